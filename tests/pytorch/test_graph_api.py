"""te.make_graphed_callables' arguments that TE's own tests use: ``sample_args`` given
as lists (te.DotProductAttention), ``sample_kwargs`` (an attention mask, built on the
device with no host read, so the capture can hold it), the returned parameter
gradients' ownership (``clone_param_grads_on_return``, ``skip_backward_post_hook``),
``capture_time_hooks`` and the warm-up hooks, the default ``_order``, and TE's
``reset()``. The host-read check runs on the CPU; the rest needs a CUDA GPU."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_engine.pytorch as te
from transformer_engine.pytorch.attention.masks import build_core_mask
from transformer_engine.pytorch.graph_args import normalize
from transformer_engine.pytorch.graph_callable import FP8Setting, GraphedCallable
from helpers import RerunCapture, cuda_fp8

_aten = torch.ops.aten
# the ops that read a tensor's values back to the host (.item(), bool(t), nonzero)
_HOST_READS = {_aten._local_scalar_dense.default, _aten.nonzero.default,
               _aten.is_nonzero.default, _aten.equal.default}


class _HostReads(TorchDispatchMode):
    """Records every op that reads tensor values back to the host: what a CUDA graph
    capture refuses ("operation not permitted when stream is capturing")."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            self.found.append(func)
        return func(*args, **(kwargs or {}))


def _layer(device="cpu", dtype=torch.float32):
    return te.TransformerLayer(64, 64, 2, hidden_dropout=0.0, attention_dropout=0.0,
                               self_attn_mask_type="arbitrary", fuse_qkv_params=True,
                               params_dtype=dtype, device=device)


# ---- no host reads (CPU) ---------------------------------------------------------------------

def test_an_arbitrary_mask_is_applied_without_host_reads():
    """A TransformerLayer's forward and backward with an ``attention_mask`` (some rows
    fully masked) read nothing back to the host; the fully masked rows still output 0
    (as if their queries attended to nothing), the others are unchanged."""
    torch.manual_seed(0)
    layer = _layer()
    x = torch.randn(32, 2, 64, requires_grad=True)
    mask = torch.randint(2, (2, 1, 32, 32), dtype=torch.bool)
    mask[0, 0, 5] = True                            # row 5 of sequence 0 sees no key
    with _HostReads() as reads:
        y = layer(x, attention_mask=mask)
        y.sum().backward()
    assert reads.found == []
    core = build_core_mask("test", "arbitrary", None, mask, 2, 2, 32, 32, "cpu")
    assert core.out_keep is not None and not bool(core.out_keep[0, 0, 5, 0])
    assert bool(core.out_keep[0, 0, 4, 0]) and bool(core.allowed[0, 0, 5].all())


@pytest.mark.parametrize("mask_type, window", [("arbitrary", None), ("causal", (4, 0)),
                                               ("causal_bottom_right", None),
                                               ("no_mask", (2, 2)), ("padding", None)])
def test_every_built_mask_reads_nothing_back(mask_type, window):
    batch, sq, skv = 2, 8, 12
    if mask_type == "arbitrary":
        attention_mask = torch.rand(batch, 1, sq, skv) > 0.5
    elif mask_type == "padding":
        attention_mask = (torch.rand(batch, 1, 1, sq) > 0.7,
                          torch.rand(batch, 1, 1, skv) > 0.7)
    else:
        attention_mask = None
    with _HostReads() as reads:
        build_core_mask("test", mask_type, window, attention_mask, batch, 2, sq, skv, "cpu",
                        explicit=True)
    assert reads.found == []


# ---- the replay's input binding (CPU) -----------------------------------------------------

def _graphed_on_cpu(modules, sample_args, sample_kwargs=None):
    """The first callable of ``make_graphed_callables(modules, sample_args, ...)`` as
    its `GraphedCallable` (argument handling, captures, replay Function), with the
    CUDA graphs stood in for by `RerunGraphs`."""
    _, callables, args, kwargs = normalize(modules, sample_args, sample_kwargs)
    g = GraphedCallable(callables[0], args[0], kwargs[0], FP8Setting(False, False, None, None),
                        RerunCapture().graphs())
    g.capture_forward()
    g.capture_backward(False, False)
    return g


def _qkv(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 2, 2, 8, generator=gen, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize("form", ["list", "tuple", "tuple-of-lists", "kwargs"])
def test_replay_binds_each_new_input_to_its_static_buffer(form):
    """A graphed DotProductAttention, its CUDA graphs replaced by reruns of the capture
    from the static buffers: with ``sample_args`` a list of q, k, v (TE's test), a
    tuple, one list per callable in a tuple, and an attention mask in
    ``sample_kwargs``, each call's tensors are bound to their own static inputs, so
    three calls' outputs and input gradients equal eager ones bit for bit. Every call
    returns the same static output tensor, which the next call overwrites: a step's
    output outlives the next call only as a copy."""
    mask_type = "arbitrary" if form == "kwargs" else "causal"
    model = te.DotProductAttention(2, 8, attention_dropout=0.0, attn_mask_type=mask_type)
    samples = [torch.ones(16, 2, 2, 8, requires_grad=True) for _ in range(3)]
    modules, sample_args, sample_kwargs = {
        "list": (model, samples, None), "tuple": (model, tuple(samples), None),
        "tuple-of-lists": ((model,), (samples,), None),
        "kwargs": (model, samples, {"attention_mask": torch.zeros(2, 1, 16, 16, dtype=torch.bool)}),
    }[form]
    graphed = _graphed_on_cpu(modules, sample_args, sample_kwargs)
    assert all(a is b for a, b in zip(graphed.static_inputs, samples))
    results, returned = [], []
    for run in (model, graphed):
        got = []
        for step in range(3):
            inputs = _qkv(step)
            kwargs = ({"attention_mask": torch.rand(2, 1, 16, 16,
                                                    generator=torch.Generator().manual_seed(step))
                       > 0.5} if form == "kwargs" else {})
            out = run(*inputs, **kwargs)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(9)))
            got += [out.detach().clone()] + [t.grad for t in inputs]
            if run is graphed:
                returned.append(out)
        results.append(got)
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"result {i} (step {i // 4}, {'out q k v'.split()[i % 4]})"
    assert len({t.data_ptr() for t in returned}) == 1
    assert all(torch.equal(t, results[1][8]) for t in returned)    # all hold the last output
    assert not torch.equal(results[1][0], results[1][8])


# ---- on the GPU ----------------------------------------------------------------------------

def _dpa_inputs(dtype, warmup=False, seed=0):
    make = torch.ones if warmup else torch.randn
    if not warmup:
        torch.manual_seed(seed)
    return [make(32, 2, 2, 32, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]


@cuda_fp8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_dot_product_attention_graphed_from_list_sample_args(dtype):
    """``sample_args`` as a list of the three tensors q, k, v (as TE's test passes
    them): the graphed attention's outputs and input gradients equal eager ones at
    every step. A graphed output is the graph's static buffer (the same tensor at every
    call, as TE's), so each step's is kept as a copy."""
    results = []
    for graph in (False, True):
        model = te.DotProductAttention(2, 32, attention_dropout=0.0)
        if graph:
            model = te.make_graphed_callables(model, _dpa_inputs(dtype, warmup=True),
                                              num_warmup_iters=3)
        got, addresses = [], set()
        for step in range(3):
            inputs = _dpa_inputs(dtype, seed=step)
            out = model(*inputs)
            out.backward(torch.ones_like(out))
            addresses.add(out.data_ptr())
            got += [out.detach().clone()] + [t.grad for t in inputs]
        assert len(addresses) == 1 or not graph      # one static output buffer
        if graph:
            model.reset()
        results.append(got)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@cuda_fp8
def test_sample_kwargs_attention_mask_is_captured():
    """TE's test: a TransformerLayer with an arbitrary mask passed as a keyword, graphed
    with ``sample_kwargs``; training with fresh random masks equals eager bit for bit."""
    torch.manual_seed(0)
    eager = _layer("cuda")
    graphed = copy.deepcopy(eager)
    for model in (eager, graphed):
        for p in model.parameters():
            p.grad = torch.empty_like(p)
    te.make_graphed_callables(
        graphed, (torch.ones(32, 2, 64, device="cuda", requires_grad=True),),
        sample_kwargs={"attention_mask": torch.zeros(2, 1, 32, 32, dtype=torch.bool,
                                                     device="cuda")},
        allow_unused_input=True)
    outputs = []
    for model in (eager, graphed):
        torch.manual_seed(1)
        opt = torch.optim.SGD(model.parameters(), lr=0.001)
        for _ in range(3):
            opt.zero_grad(set_to_none=False)
            for _ in range(2):
                x = torch.randn(32, 2, 64, device="cuda", requires_grad=True)
                dy = torch.randn(32, 2, 64, device="cuda")
                mask = torch.randint(2, (2, 1, 32, 32), dtype=torch.bool, device="cuda")
                out = model(x, attention_mask=mask)
                out.backward(dy)
            opt.step()
        outputs.append([out.detach()] + [t for p in model.parameters() for t in (p, p.grad)])
    for a, b in zip(*outputs):
        assert torch.equal(a, b)


def _graphed_linear(**kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64, bias=False, device="cuda")
    return te.make_graphed_callables(model, (torch.ones(32, 64, device="cuda"),), **kwargs)


def _two_backwards(model, between=None):
    seen = []
    hook = model.weight.register_hook(lambda g: seen.append(g) or g)
    for i in range(2):
        x = torch.randn(32, 64, device="cuda")
        model(x).backward(torch.randn(32, 64, device="cuda"))
        if i == 0:
            snapshot = seen[0].clone()
            if between is not None:
                between()
    hook.remove()
    return seen, snapshot


@cuda_fp8
def test_returned_parameter_gradients_are_owned_by_default():
    """The gradient a hook receives is a fresh tensor each replay: the next replay does
    not overwrite it."""
    model = _graphed_linear()
    seen, snapshot = _two_backwards(model, lambda: model.zero_grad(set_to_none=True))
    assert seen[0].data_ptr() != seen[1].data_ptr()
    assert torch.equal(seen[0], snapshot)
    model.reset()


@cuda_fp8
def test_graphed_gradients_accumulate_like_eager_ones():
    model = _graphed_linear()
    xs = [torch.randn(32, 64, device="cuda") for _ in range(2)]
    dys = [torch.randn(32, 64, device="cuda") for _ in range(2)]
    model.zero_grad(set_to_none=True)
    for x, dy in zip(xs, dys):
        model(x).backward(dy)
    expected = dys[0].t() @ xs[0] + dys[1].t() @ xs[1]
    torch.testing.assert_close(model.weight.grad, expected, rtol=1e-6, atol=1e-6)


@cuda_fp8
@pytest.mark.parametrize("how", ["clone-off", "skip-mark"])
def test_uncloned_gradients_are_the_graphs_buffer(how):
    """``clone_param_grads_on_return=False``, or a parameter marked
    ``skip_backward_post_hook`` when captured: the hook sees the graph's buffer, the
    same tensor each replay."""
    if how == "clone-off":
        model = _graphed_linear(clone_param_grads_on_return=False)
    else:
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64, bias=False, device="cuda")
        model.weight.skip_backward_post_hook = True
        model = te.make_graphed_callables(model, (torch.ones(32, 64, device="cuda"),))
    seen, _ = _two_backwards(model, lambda: model.zero_grad(set_to_none=True))
    assert seen[0].data_ptr() == seen[1].data_ptr()
    model.reset()


@cuda_fp8
def test_the_clone_policy_is_fixed_at_capture():
    model = _graphed_linear()
    model.weight.skip_backward_post_hook = True         # after the capture: no effect
    seen, snapshot = _two_backwards(model, lambda: model.zero_grad(set_to_none=True))
    assert seen[0].data_ptr() != seen[1].data_ptr() and torch.equal(seen[0], snapshot)
    model.reset()


@cuda_fp8
@pytest.mark.parametrize("order", [None, [1, 2, -2, -1]], ids=["no-order", "default-order"])
def test_capture_time_hooks_run_around_warm_up_and_capture(order):
    """Each hook runs with its module, outside any capture, around every warm-up
    forward / backward and around the captures, in TE's order (all forwards, then the
    backwards in reverse); never at replay. The warm-up hooks run once each."""
    modules = (torch.nn.Linear(8, 8, device="cuda"), torch.nn.Linear(8, 8, device="cuda"))
    records, warm = [], []

    def make(index, name):
        def hook(module):
            assert module is modules[index] and not torch.cuda.is_current_stream_capturing()
            records.append((index, name))
        return hook

    hooks = [{name: {0: make(i, name)} for name in
              ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")}
             for i in range(2)]
    graphed = te.make_graphed_callables(
        modules, tuple((torch.ones(4, 8, device="cuda", requires_grad=True),) for _ in modules),
        num_warmup_iters=2, _order=order, capture_time_hooks=hooks,
        pre_warmup_hook=lambda: warm.append("pre"), post_warmup_hook=lambda: warm.append("post"))
    one_pass = [(0, "forward_pre_hooks"), (0, "forward_hooks"), (1, "forward_pre_hooks"),
                (1, "forward_hooks"), (1, "backward_pre_hooks"), (1, "backward_hooks"),
                (0, "backward_pre_hooks"), (0, "backward_hooks")]
    assert records == one_pass * 3 and warm == ["pre", "post"]
    for g in graphed:
        y = g(torch.randn(4, 8, device="cuda", requires_grad=True))
        y.backward(torch.ones_like(y))
    assert records == one_pass * 3
    for g in graphed:
        g.reset()


@cuda_fp8
def test_a_hook_that_returns_a_value_is_refused():
    with pytest.raises(RuntimeError, match="capture_time_hooks forward_hooks must not return "
                                           "a value"):
        te.make_graphed_callables(torch.nn.Linear(8, 8, device="cuda"),
                                  (torch.ones(4, 8, device="cuda"),),
                                  capture_time_hooks=[{"forward_hooks": {0: lambda m: 1}}])


@cuda_fp8
def test_reset_frees_the_graphs():
    model = _graphed_linear()
    model.reset()
    with pytest.raises(RuntimeError, match=r"was reset\(\)"):
        model(torch.randn(32, 64, device="cuda"))
    model.eval()                            # outside training the module runs eagerly
    x = torch.randn(32, 64, device="cuda")
    assert torch.equal(model(x), torch.nn.functional.linear(x, model.weight))
