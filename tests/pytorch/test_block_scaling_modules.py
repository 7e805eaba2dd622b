"""Float8BlockScaling in the modules: te.Linear's three GEMMs against a float64
block-by-block reference (each operand quantized along the K of its GEMM), the modules
against float64, te.checkpoint (reentrant and non-reentrant, autocast inside or outside)
bit-identical to no checkpointing, GroupedLinear / LayerNormLinear against te.Linear bit
for bit, the FP8 weight cache, and extra state."""

import contextlib

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Float8BlockScaling, Float8CurrentScaling, Format
from transformer_engine.pytorch import distributed
from block_references import (accumulation_bound, fp8_gemm_bound, hopper_gemm_bound,
                              quantize_ref, varied)
from helpers import REENTRANT, assert_runs_equal, assert_tensors_equal, capture, te_modules
from references import leaf64, mlp_ref, norm_rel_err, randomize_

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the emulation runs on any)"))]
# (x, w, grad) block dims: TE's default, and the other shapes that keep every GEMM at
# most one 2D-scaled operand
DIMS = [pytest.param((1, 2, 1), id="x1-w2-g1"), pytest.param((2, 1, 1), id="x2-w1-g1"),
        pytest.param((1, 1, 1), id="x1-w1-g1"), pytest.param((1, 1, 2), id="x1-w1-g2")]
FORMATS = [pytest.param(Format.E4M3, id="e4m3"), pytest.param(Format.HYBRID, id="hybrid")]


def _recipe(dims=(1, 2, 1), fmt=Format.E4M3):
    return Float8BlockScaling(fp8_format=fmt, x_block_scaling_dim=dims[0],
                              w_block_scaling_dim=dims[1], grad_block_scaling_dim=dims[2])


def _rows(dim):
    return 128 if dim == 2 else 1


def _gemm_bound(a, b, device):
    """Float32 accumulation, or on Hopper (whose block-scaled GEMM runs the GEMMs that
    fit it) the hardware's accumulation."""
    hopper = device == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    return hopper_gemm_bound(a, b) if hopper else accumulation_bound(a, b)


def _within(got, ref, bound, what):
    err = (got.double().cpu() - ref).abs()
    assert torch.all(err <= bound), f"{what}: max error {err.max():.3g} over its bound"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("size", [(200, 300, 136), (256, 384, 256)],
                         ids=["partial-blocks", "hopper-shapes"])
def test_linear_matches_blockwise_reference(size, dims, fmt, device):
    """Forward ``x W^T + b`` (K = in features), dgrad ``dy W`` (K = out features),
    wgrad ``dy^T x`` (K = tokens): each equals the float64 GEMM of the
    reference-quantized operands up to float32 accumulation (the hardware's on
    Hopper), with every operand quantized in blocks along its GEMM's K. Sizes
    (tokens, in, out) with no multiple of 128, and sizes whose GEMMs Hopper's
    block-scaled GEMM takes."""
    tokens, features_in, features_out = size
    torch.manual_seed(0)
    m = te.Linear(features_in, features_out, device=device)
    randomize_(m)
    # magnitudes varying along both dimensions, so that blocks along the wrong
    # dimension would flush values the right blocks keep
    x = varied(tokens, features_in, seed=1, spread=8).to(device).requires_grad_()
    dy = varied(tokens, features_out, seed=2, spread=8).to(device)
    with te.autocast(recipe=_recipe(dims, fmt)):
        y = m(x)
    y.backward(dy)
    fwd, bwd = fmt.value.dtype_fwd, fmt.value.dtype_bwd
    xd, wd, gd = (_rows(d) for d in dims)
    xc, wc, dyc = x.detach().cpu(), m.weight.detach().cpu(), dy.cpu()
    xq, wq = quantize_ref(xc, fwd, xd)[0], quantize_ref(wc, fwd, wd)[0]
    y_ref = xq @ wq.t() + m.bias.detach().cpu().double()
    _within(y, y_ref, _gemm_bound(xq, wq, device) + 2 ** -24 * y_ref.abs(), "forward")
    dyq, wtq = quantize_ref(dyc, bwd, gd)[0], quantize_ref(wc.t(), fwd, wd)[0]
    _within(x.grad, dyq @ wtq.t(), _gemm_bound(dyq, wtq, device), "dgrad")
    dytq, xtq = quantize_ref(dyc.t(), bwd, gd)[0], quantize_ref(xc.t(), fwd, xd)[0]
    _within(m.weight.grad, dytq @ xtq.t(), _gemm_bound(dytq, xtq, device), "wgrad")
    # dbias: a float32 sum over the tokens, in whatever order the device sums
    dyd = dyc.double()
    _within(m.bias.grad, dyd.sum(0), dyd.shape[0] * 2 ** -24 * dyd.abs().sum(0), "dbias")
    # and against float64 on the unquantized operands, within FP8 rounding
    xs, ws = quantize_ref(xc, fwd, xd)[1], quantize_ref(wc, fwd, wd)[1]
    exact = xc.double() @ wc.double().t() + m.bias.detach().cpu().double()
    hardware = _gemm_bound(xq, wq, device) - accumulation_bound(xq, wq)
    _within(y, exact, fp8_gemm_bound(xc, xq, xs, fwd, wc, wq, ws, fwd) + hardware
            + 2 ** -24 * exact.abs(), "forward against float64")


def test_blocks_keep_rows_that_one_scale_per_tensor_loses():
    """Rows whose magnitudes span 2**-24 to 1: one current scale per tensor flushes the
    small rows' inputs to zero, one scale per 1x128 block keeps every row to FP8
    precision."""
    torch.manual_seed(1)
    m = te.Linear(256, 128, bias=False, device="cpu")
    x = torch.randn(32, 256) * torch.exp2(-torch.linspace(0, 24, 32))[:, None]
    ref = x.double() @ m.weight.detach().double().t()

    def row_errors(recipe):
        with te.autocast(recipe=recipe), torch.no_grad():
            y = m(x).double()
        return (y - ref).norm(dim=1) / ref.norm(dim=1)

    assert row_errors(Float8BlockScaling()).max() < 0.1
    per_tensor = row_errors(Float8CurrentScaling())
    assert torch.all(per_tensor[-4:] == 1.0)               # the smallest rows came out zero


def test_layernorm_mlp_close_to_float64():
    """Two block-scaled GEMMs each way, against the float64 MLP. An E4M3 operand is off
    by at most 2**-4 relative (3 mantissa bits), about 0.03 in norm for values spread
    over binades; a GEMM output, from two such operands, about 0.04-0.05 in norm; the
    gradients, through a chain of two quantized GEMMs, somewhat more. 0.1 bounds it with
    margin (measured: 0.03 for the output, up to 0.065 for gradients, as current scaling
    measures on the same data)."""
    torch.manual_seed(2)
    m = te.LayerNormMLP(160, 320, activation="gelu", device="cpu")
    randomize_(m)
    x = torch.randn(40, 160, requires_grad=True)
    dy = torch.randn(40, 160)
    with te.autocast(recipe=Float8BlockScaling()):
        y = m(x)
    y.backward(dy)
    p = {n: leaf64(t) for n, t in m.named_parameters()}
    x64 = leaf64(x)
    ref = mlp_ref(p, x64, "LayerNorm", "gelu")
    ref.backward(dy.double())
    errors = {"y": norm_rel_err(y, ref.detach()), "dx": norm_rel_err(x.grad, x64.grad)}
    errors.update({f"d{n}": norm_rel_err(t.grad, p[n].grad) for n, t in m.named_parameters()})
    assert max(errors.values()) < 0.1 and errors["y"] > 0, errors


class _Net(torch.nn.Module):
    """Linear -> checkpointed region (LayerNormMLP, LayerNormLinear) -> Linear, 160
    features (one whole and one partial block of 128)."""

    def __init__(self):
        super().__init__()
        self.pre, self.post = te.Linear(160, 160, device="cpu"), te.Linear(160, 160, device="cpu")
        self.mlp = te.LayerNormMLP(160, 192, device="cpu")
        self.proj = te.LayerNormLinear(160, 160, device="cpu")

    def forward(self, x, recipe, inner, checkpoint, use_reentrant, calls):
        def region(h):
            calls.append(1)
            ctx = te.autocast(recipe=recipe) if inner else contextlib.nullcontext()
            with ctx:
                return self.proj(self.mlp(h))

        outer = contextlib.nullcontext() if inner else te.autocast(recipe=recipe)
        with outer:
            h = self.pre(x)
            h = te.checkpoint(region, h, use_reentrant=use_reentrant) if checkpoint else region(h)
            return self.post(torch.tanh(h))


def _train(checkpoint, use_reentrant, inner, steps=2):
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    record, calls = [], []
    for step in range(steps):
        x = (torch.randn(40, 160) * 2.0 ** step).requires_grad_()
        loss = net(x, Float8BlockScaling(), inner, checkpoint, use_reentrant, calls).pow(2).mean()
        loss.backward()
        record.append(capture(loss, [x], net.parameters(), te_modules(net)))
        opt.step()
        opt.zero_grad()
    return record, len(calls)


@pytest.mark.parametrize("inner", [False, True], ids=["autocast-outside", "autocast-inside"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_checkpoint_is_bit_identical(use_reentrant, inner):
    ref, ref_calls = _train(False, use_reentrant, inner)
    got, calls = _train(True, use_reentrant, inner)
    assert ref_calls == 2 and calls == 4                    # the region was recomputed
    assert_runs_equal(ref, got)
    assert distributed.recompute_stash_count() == 0         # stateless: nothing stashed


def _copy_linear(src_w, src_b):
    m = te.Linear(src_w.shape[1], src_w.shape[0], device="cpu")
    with torch.no_grad():
        m.weight.copy_(src_w)
        m.bias.copy_(src_b)
    return m


def test_grouped_linear_equals_separate_linears():
    torch.manual_seed(3)
    grouped = te.GroupedLinear(3, 160, 144, device="cpu")
    linears = [_copy_linear(getattr(grouped, f"weight{i}"), getattr(grouped, f"bias{i}"))
               for i in range(3)]
    splits = [40, 0, 90]
    x = torch.randn(130, 160, requires_grad=True)
    x_sep = x.detach().clone().requires_grad_()
    dy = torch.randn(130, 144)
    with te.autocast(recipe=Float8BlockScaling()):
        y = grouped(x, splits)
        y_sep = torch.cat([lin(part) for lin, part in zip(
            (linears[0], linears[2]), torch.split(x_sep, [40, 90]))])
    y.backward(dy)
    y_sep.backward(dy)
    assert torch.equal(y, y_sep) and torch.equal(x.grad, x_sep.grad)
    assert_tensors_equal([grouped.weight0.grad, grouped.weight2.grad, grouped.bias2.grad],
                         [linears[0].weight.grad, linears[2].weight.grad, linears[2].bias.grad])
    assert torch.equal(grouped.weight1.grad, torch.zeros_like(grouped.weight1))


def test_layernorm_linear_equals_layernorm_then_linear():
    torch.manual_seed(4)
    fused = te.LayerNormLinear(160, 144, device="cpu")
    randomize_(fused)
    norm = te.LayerNorm(160, device="cpu")
    lin = _copy_linear(fused.weight, fused.bias)
    with torch.no_grad():
        norm.weight.copy_(fused.layer_norm_weight)
        norm.bias.copy_(fused.layer_norm_bias)
    x = torch.randn(2, 20, 160)
    with te.autocast(recipe=Float8BlockScaling()), torch.no_grad():
        assert torch.equal(fused(x), lin(norm(x)))


def test_transformer_layer_runs_close_to_high_precision():
    torch.manual_seed(5)
    layer = te.TransformerLayer(128, 256, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                device="cpu")
    x = torch.randn(16, 2, 128, requires_grad=True)
    with torch.no_grad():
        ref = layer(x)
    with te.autocast(recipe=Float8BlockScaling()):
        y = layer(x)
    y.sum().backward()
    assert 0 < norm_rel_err(y, ref) < 0.1
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


@pytest.mark.parametrize("dims", [pytest.param((1, 2, 1), id="w2"),
                                  pytest.param((2, 1, 1), id="w1")])
def test_weight_cache_matches_casting_every_time(dims):
    """``is_first_microbatch=True`` under no_grad caches the FP8 weight; a later
    ``False`` with grad needs its columnwise copy: for a weight in 1x128 blocks it was
    quantized with the cache (it cannot be made from the FP8 data)."""
    torch.manual_seed(6)
    m = te.Linear(160, 144, device="cpu")
    x = torch.randn(48, 160, requires_grad=True)
    recipe = _recipe(dims)

    def run(first, then):
        with te.autocast(recipe=recipe):
            with torch.no_grad():
                m(x, is_first_microbatch=first)
            y = m(x, is_first_microbatch=then)
        y.pow(2).sum().backward()
        grads = [x.grad.clone(), m.weight.grad.clone()]
        x.grad, m.weight.grad, m.bias.grad = None, None, None
        return y.detach(), grads

    y_ref, g_ref = run(None, None)
    y, g = run(True, False)
    assert torch.equal(y, y_ref)
    assert_tensors_equal(g, g_ref)


def test_extra_state_round_trip_keeps_the_recipe_and_no_history():
    m = te.Linear(160, 144, device="cpu")
    recipe = _recipe((2, 1, 1), Format.HYBRID)
    recipe.fp8_quant_fwd_weight.amax_epsilon = 1e-3
    with te.autocast(recipe=recipe):
        m(torch.randn(16, 160))
    other = te.Linear(160, 144, device="cpu")
    other.load_state_dict(m.state_dict())
    assert other.fp8_meta["recipe"] == recipe
    assert other.fp8_meta["scaling_fwd"] is None and other.fp8_meta["scaling_bwd"] is None
