"""Megatron Core imports te.optimizers (FusedAdam, FusedSGD, multi_tensor_applier and
the multi-tensor operations) without its fallback warnings, builds its Adam from
FusedAdam, and clips gradients on the CPU with multi_tensor_l2norm and
multi_tensor_scale_tensor."""

import contextlib
import subprocess
import sys
import types

import torch

from megatron_helpers import megatron_on_cpu, needs_megatron  # noqa: F401
from transformer_engine.pytorch import optimizers as te_opt

pytestmark = needs_megatron

_IMPORT = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import megatron.core.optimizer as mopt
    from megatron.core.optimizer import clip_grads, optimizer
import transformer_engine.pytorch.optimizers as te_opt
print("WARN", [str(w.message) for w in caught if "Falling back" in str(w.message)
               or "local implementations" in str(w.message)])
print("ADAM", mopt.Adam is te_opt.FusedAdam, mopt.SGD is te_opt.FusedSGD,
      mopt.USING_PYTORCH_OPTIMIZER)
print("CLIP", clip_grads.l2_norm_impl is te_opt.multi_tensor_l2norm,
      clip_grads.multi_tensor_scale_tensor_impl is te_opt.multi_tensor_scale_tensor,
      clip_grads.multi_tensor_applier is te_opt.multi_tensor_applier,
      optimizer.multi_tensor_scale_impl is te_opt.multi_tensor_scale)
"""


def test_megatron_imports_te_optimizers_without_fallback_warnings():
    done = subprocess.run([sys.executable, "-c", _IMPORT], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines()
                 if line.split(" ", 1)[0] in ("WARN", "ADAM", "CLIP"))
    assert lines["WARN"] == "[]", done.stdout + done.stderr[-2000:]
    assert lines["ADAM"] == "True True False"
    assert lines["CLIP"] == "True True True True"


class _CudaStringsOnCpu:
    """``torch`` as clip_grads.py sees it in this test: its tensors asked for on "cuda"
    are made on the CPU (Megatron allocates its norm and overflow buffers there)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _cpu(kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return kwargs

    def zeros(self, *args, **kwargs):
        return torch.zeros(*args, **self._cpu(kwargs))

    def tensor(self, *args, **kwargs):
        return torch.tensor(*args, **self._cpu(kwargs))


def test_megatron_clips_gradients_with_te_multi_tensor_ops(megatron_on_cpu, monkeypatch):  # noqa: F811
    from megatron.core import parallel_state
    from megatron.core.optimizer import clip_grads

    calls = []

    def counted(op):
        def run(*args):
            calls.append(op.__name__)
            return op(*args)
        return run

    monkeypatch.setattr(clip_grads, "torch", _CudaStringsOnCpu())
    monkeypatch.setattr(clip_grads, "l2_norm_impl", counted(te_opt.multi_tensor_l2norm))
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_tensor_impl",
                        counted(te_opt.multi_tensor_scale_tensor))
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(8, 4), (5,), (3, 3)]]
    for p in params:
        p.decoupled_grad = torch.randn(p.shape, generator=gen) * 3
    grads = [p.decoupled_grad.clone() for p in params]
    group = parallel_state.get_model_parallel_group()
    norm = clip_grads.get_grad_norm_fp32([p.decoupled_grad for p in params],
                                         grad_stats_parallel_group=group)
    want = torch.stack([g.double().norm() for g in grads]).norm()
    torch.testing.assert_close(torch.as_tensor(norm).double().reshape(()), want, rtol=1e-6,
                               atol=0)
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm,
                                            use_decoupled_grad=True)
    coeff = min(1.0, 1.0 / (float(norm) + 1e-6))
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.decoupled_grad, g * coeff, rtol=1e-6, atol=0)
    assert calls == ["multi_tensor_l2norm", "multi_tensor_scale_tensor"]
    clipped = torch.stack([p.decoupled_grad.double().norm() for p in params]).norm()
    assert abs(clipped.item() - 1.0) < 1e-5


def test_fused_adam_takes_megatrons_precision_aware_arguments():
    """The keyword arguments Megatron's get_megatron_optimizer passes its Adam with
    use_precision_aware_optimizer (bfloat16 moments, float32 master weights managed by
    the optimizer, decoupled grads, remainders), and its init_state_fn's one-argument
    ``initialize_state(p)``; the step then updates the bfloat16 params from the masters.
    (Megatron's optimizer wrappers allocate on CUDA, so the factory itself needs a GPU.)"""
    import megatron.core.optimizer as mopt
    params = [torch.nn.Parameter(torch.randn(6, 4).bfloat16()) for _ in range(2)]
    opt = mopt.Adam(params=[{"params": params}], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95),
                    eps=1e-8, capturable=False, adam_w_mode=True, exp_avg_dtype=torch.bfloat16,
                    exp_avg_sq_dtype=torch.bfloat16, master_weights=True,
                    use_decoupled_grad=True, master_weight_dtype=torch.float32,
                    store_param_remainders=True)
    assert isinstance(opt, te_opt.FusedAdam)
    for p in params:
        opt.initialize_state(p)
        p.decoupled_grad = torch.randn(p.shape)
    before = [p.detach().clone() for p in params]
    opt.step()
    for p, b in zip(params, before):
        assert opt.state[p]["master_param"].dtype == torch.int16
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
        assert not torch.equal(p.detach(), b)


# ---- Megatron's distributed optimizer with FP8 parameters (--fp8-param-gather) ---------------
#
# Two gloo ranks, data parallel, each on its own data. The run under test: Megatron's DDP with
# its distributed optimizer and ``fp8_param_gather`` (FP32 master shards, FP8 weights in one
# uint8 buffer, all-gathered in FP8 through TE's tensor.utils hooks). The reference: the same
# model, data and Megatron DDP (gradients all-reduced instead of reduce-scattered: the same
# two-term sums) with FP8 primary weights and no sharding, every rank updating whole FP32
# master weights with the same FusedAdam and writing them into the FP8 weights as a
# non-distributed optimizer does (rounded to the weights' bfloat16 first, as TE's hooks do).
# The masters start from the weights' high-precision initial values in both. Gradient
# clipping is off: a sharded norm sums in another order, which no FP8 path changes.

FP8_GATHER_STEPS, FP8_GATHER_LR = 3, 1e-2


class _CudaOnCpu:
    """``torch.cuda`` as Megatron's DDP, optimizer and layer modules see it in a forked
    rank: the current device is the CPU and its stream orders nothing."""

    class _Stream:
        def wait_event(self, event):
            """Nothing to wait for: the CPU runs ops in order."""

        def wait_stream(self, stream):
            """Nothing to wait for: the CPU runs ops in order."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available():
        return False

    @staticmethod
    def current_device():
        return "cpu"

    def current_stream(self, *args, **kwargs):
        return self._Stream()


class _TorchOnCpuRank:
    """``torch`` for those modules: `_CudaOnCpu`, and tensors asked for on "cuda" made on
    the CPU."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _cpu(kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return kwargs

    def zeros(self, *args, **kwargs):
        return torch.zeros(*args, **self._cpu(kwargs))

    def empty(self, *args, **kwargs):
        return torch.empty(*args, **self._cpu(kwargs))

    def tensor(self, *args, **kwargs):
        return torch.tensor(*args, **self._cpu(kwargs))


@contextlib.contextmanager
def _one_by_one(group=None, device=None, async_ops=False):
    """Megatron's ``_coalescing_manager`` for gloo: the all-gathers and reduce-scatters
    issued in it run one by one, and its ``wait()`` waits for all of them. Gloo's
    coalesced all-gather assumes one dtype for all tensors (pytorch/pytorch#35671) and
    garbles the FP8 (uint8) and bfloat16 buckets Megatron gathers together."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    works = []

    def collecting(func):
        def call(*args, **kwargs):
            work = func(*args, **kwargs)
            if work is not None:
                works.append(work)
            return work
        return call

    found = pgb.dist_all_gather_func, pgb.dist_reduce_scatter_func
    pgb.dist_all_gather_func, pgb.dist_reduce_scatter_func = map(collecting, found)
    try:
        yield types.SimpleNamespace(wait=lambda: [w.wait() for w in works])
    finally:
        pgb.dist_all_gather_func, pgb.dist_reduce_scatter_func = found


def _megatron_on_cpu_rank():
    """Run Megatron's DDP, distributed optimizer and layers on this forked rank's CPU: the
    device look-ups above, its parameter type checks answered as for CUDA tensors
    ("torch.cuda.BFloat16Tensor"), gloo's collectives one by one."""
    from megatron.core.distributed import param_and_grad_buffer

    shim = _TorchOnCpuRank()
    for name, module in list(sys.modules.items()):
        if name.startswith(("megatron.core.optimizer", "megatron.core.distributed",
                            "megatron.core.extensions", "megatron.core.tensor_parallel")) \
                and getattr(module, "torch", None) is torch:
            module.torch = shim
    plain_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        name = plain_type(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)
    torch.Tensor.type = cuda_type
    param_and_grad_buffer._coalescing_manager = _one_by_one


def _train_fp8_params(rank: int, recipe: str, sharded: bool) -> dict:
    """Train a one-layer GPT with FP8 primary weights (Megatron's ``fp8_param``, bfloat16
    parameters, ``recipe``: "delayed" or "tensorwise") for `FP8_GATHER_STEPS` Adam steps
    on this rank's data, through Megatron's distributed optimizer with
    ``fp8_param_gather`` (``sharded``) or the unsharded reference; what the comparison
    needs."""
    from megatron.core import fp8_utils
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_helpers import BATCH, SEQ, VOCAB, gpt_model, te_modules_of
    from transformer_engine.pytorch.tensor import utils as te_tensor_utils

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, params_dtype=torch.bfloat16,
        bf16=True, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=False,
        use_te_rng_tracker=True, fp8="hybrid", fp8_recipe=recipe, fp8_amax_history_len=4,
        fp8_param=True)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(1234, te_rng_tracker=True, force_reset_rng=True)
    model = Float16Module(config, gpt_model(config))      # FP8 weights: Megatron's fp8_model_init
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=sharded, fp8_param_gather=sharded,
        overlap_grad_reduce=sharded, overlap_param_gather=sharded),
        model)
    params = [p for p in ddp.parameters() if p.requires_grad]
    fp8 = [fp8_utils.is_float8tensor(p) for p in params]
    opt_config = OptimizerConfig(optimizer="adam", lr=FP8_GATHER_LR, weight_decay=0.0,
                                 bf16=True, params_dtype=torch.bfloat16, clip_grad=0.0,
                                 use_distributed_optimizer=sharded, fp8_recipe=recipe)
    seen = {"shards": [], "post_all_gather": 0}
    if sharded:
        opt = get_megatron_optimizer(opt_config, [ddp])
        inner = opt.optimizer
        quantize, post = te_tensor_utils.quantize_master_weights, \
            fp8_utils.te_post_all_gather_processing

        def quantize_spy(weights, masters, offsets, *args, **kwargs):
            seen["shards"].append([(w.numel(), None if m is None else (o, m.numel()))
                                   for w, m, o in zip(weights, masters, offsets)])
            return quantize(weights, masters, offsets, *args, **kwargs)

        def post_spy(weights):
            seen["post_all_gather"] += 1
            return post(weights)
        te_tensor_utils.quantize_master_weights = quantize_spy
        fp8_utils.te_post_all_gather_processing = post_spy     # bound at Megatron's import
        buffers = [b.param_data for b in ddp.buffers if b.param_dtype == torch.uint8]
        seen["in_uint8_buffer"] = [any(b.data_ptr() <= p._data.data_ptr() < b.data_ptr()
                                       + b.numel() for b in buffers)
                                   for p, f in zip(params, fp8) if f]
    else:
        # the masters as the distributed optimizer makes them, whole
        masters = [(p.get_high_precision_init_val() if f else p.detach()).float().clone()
                   for p, f in zip(params, fp8)]
        inner = te_opt.FusedAdam(masters, lr=opt_config.lr, weight_decay=opt_config.weight_decay,
                                 betas=(opt_config.adam_beta1, opt_config.adam_beta2),
                                 eps=opt_config.adam_eps, adam_w_mode=opt_config.decoupled_weight_decay)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(FP8_GATHER_STEPS):
        ddp.zero_grad_buffer()
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
        with fp8_utils.get_fp8_context(config):
            loss = ddp(tokens, positions, attention_mask=None, labels=labels).float().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        ddp.finish_grad_sync()
        if sharded:
            opt.step()
            opt.zero_grad()
            continue
        for p, m in zip(params, masters):
            m.grad = p.main_grad.float()
        inner.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m.to(p.dtype))
    if sharded:
        ddp.start_param_sync(force_sync=True)   # the last step's all-gather (else: next forward)
        te_tensor_utils.quantize_master_weights = quantize
        fp8_utils.te_post_all_gather_processing = post
    return {
        "losses": losses,
        "weights": [(p._data.view(torch.uint8).clone(), p._scale_inv.clone()) if f
                    else p.detach().clone() for p, f in zip(params, fp8)],
        "states": [(s.scale.clone(), s.amax_history.clone())
                   for m in te_modules_of(ddp) for s in (m.fp8_meta["scaling_fwd"],
                                                         m.fp8_meta["scaling_bwd"])
                   if s is not None],
        "adam": (type(inner).__name__, getattr(inner, "adam_w_mode", None),
                 sorted({tuple(g[k] for k in ("lr", "betas", "eps", "weight_decay",
                                              "bias_correction"))
                         for g in inner.param_groups})),
        "seen": seen,
    }


def _fp8_gather_worker(rank, world_size):
    from megatron.core import parallel_state

    _megatron_on_cpu_rank()
    parallel_state.initialize_model_parallel(1, 1)      # data parallel over both ranks
    return {recipe: {"gather": _train_fp8_params(rank, recipe, sharded=True),
                     "reference": _train_fp8_params(rank, recipe, sharded=False)}
            for recipe in ("delayed", "tensorwise")}


def test_fp8_param_gather_matches_unsharded_fp8_primary_weights(client_deadline):  # noqa: F811
    """``--fp8-param-gather`` on two data-parallel ranks, delayed and current
    ("tensorwise") scaling: every rank's losses, final weights (FP8 bits and scales,
    bfloat16 parameters) and FP8 scaling state equal, bit for bit, those of the
    unsharded run with FP8 primary weights (the comment above says why that run is the
    reference)."""
    from distributed.dist_utils import launch

    ranks = launch(_fp8_gather_worker, 2, timeout_s=120, preload=[
        "megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer",
        __name__])
    for rank, runs in enumerate(ranks):
        for recipe, run in runs.items():
            got, ref = run["gather"], run["reference"]
            where = f"rank {rank}, {recipe}"
            assert got["adam"] == ref["adam"], where
            assert got["adam"][0] == "FusedAdam", where
            # the run under test sharded the masters and gathered the weights in FP8
            seen = got["seen"]
            assert seen["in_uint8_buffer"] and all(seen["in_uint8_buffer"]), where
            assert len(seen["shards"]) == FP8_GATHER_STEPS, where
            # after the all-gather before each forward (the first gathers the initial
            # weights) and the one that ends the run
            assert seen["post_all_gather"] == FP8_GATHER_STEPS + 1, where
            shards = seen["shards"][0]
            held = sum(0 if s is None else s[1] for _, s in shards)
            assert 0 < held < sum(n for n, _ in shards), where
            # the losses, the final FP8 bits, scales and all other weights, bit for bit
            assert not torch.equal(ref["losses"][0], ref["losses"][-1]), where
            assert all(torch.equal(a, b) for a, b in zip(got["losses"], ref["losses"])), \
                (where, got["losses"], ref["losses"])
            assert len(got["weights"]) == len(ref["weights"]), where
            for i, (a, b) in enumerate(zip(got["weights"], ref["weights"])):
                same = (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                        if isinstance(a, tuple) else torch.equal(a, b))
                assert same, f"{where}: parameter {i} differs"
            # (delayed scaling's state; current scaling keeps none)
            assert len(got["states"]) == len(ref["states"]), where
            assert (len(ref["states"]) > 0) == (recipe == "delayed"), where
            for i, (a, b) in enumerate(zip(got["states"], ref["states"])):
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), \
                    f"{where}: FP8 scaling state {i} differs"
    # a weight split across the ranks: each holds part of its master
    split = [i for i, (a, b) in enumerate(zip(ranks[0]["delayed"]["gather"]["seen"]["shards"][0],
                                              ranks[1]["delayed"]["gather"]["seen"]["shards"][0]))
             if a[1] is not None and b[1] is not None]
    assert split, "no FP8 weight was split across the two ranks"
    # the ranks trained on different data, and ended with the same weights
    assert not torch.equal(ranks[0]["delayed"]["gather"]["losses"][0],
                           ranks[1]["delayed"]["gather"]["losses"][0])
    for recipe in ("delayed", "tensorwise"):
        for a, b in zip(ranks[0][recipe]["gather"]["weights"], ranks[1][recipe]["gather"]["weights"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b)) if isinstance(a, tuple) \
                else torch.equal(a, b)
