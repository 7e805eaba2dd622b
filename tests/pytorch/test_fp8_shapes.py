"""TE's FP8 shape rule (tokens and out_features multiples of 8, in_features of 16) and
the zero padding that lets ``torch._scaled_mm`` (all dims multiples of 16) run those
shapes exactly (NOTE [FP8 shapes] in fp8_shapes.py).

The padded path is the CUDA one; on the CPU it runs with ``cpu_gemm="scaled_mm"``.
The data are chosen so that every FP8 GEMM is exact in float32 whatever the order of
its sums (weights on a grid of 1/4 in [-1, 1], first-step scales of 1, E4M3 both
ways), so each GEMM can be compared with float64 and the padded run with the
unpadded ("upcast") run bit for bit.
"""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch import fp8_shapes, quantize
from transformer_engine.pytorch.kernel_config import kernel_config
from helpers import (REENTRANT, assert_runs_equal, assert_tensors_equal, capture, cuda_fp8,
                     te_modules)

E4M3_RECIPE = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4)
RULE = r"FP8 execution requires 2D input matrices with height divisible by 8 and width divisible by 16"


# ---- the rule ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(8, 16), (24, 48), (3, 8, 32), (2, 4, 1, 16)],
                         ids=["8x16", "24x48", "3d", "4d"])
def test_rule_accepts_height_8_width_16(shape):
    fp8_shapes.check_fp8_matrix("api", "input", shape)


@pytest.mark.parametrize("shape, message", [
    ((12, 16), r"the input of shape \(12, 16\), height 12 and width 16"),
    ((16, 24), r"the input of shape \(16, 24\), height 16 and width 24"),
    ((3, 4, 32), r"the input of shape \(3, 4, 32\) \(a \[12, 32\] matrix\), height 12"),
], ids=["height-12", "width-24", "3d-height-12"])
def test_rule_refuses_with_the_shape(shape, message):
    with pytest.raises(ValueError, match=rf"api: {RULE}; got {message}"):
        fp8_shapes.check_fp8_matrix("api", "input", shape)


def _fp8_forward(module, x, *args):
    with te.autocast(recipe=E4M3_RECIPE):
        return module(x, *args)


@pytest.mark.parametrize("make, x_shape, args, message", [
    (lambda: te.Linear(64, 40, device="cpu", name="proj"), (3, 4, 64), (),
     r"te.Linear\(name='proj'\): .*the input of shape \(3, 4, 64\) \(a \[12, 64\] matrix\)"),
    (lambda: te.Linear(64, 12, device="cpu"), (16, 64), (),
     r"te.Linear: .*the weight of shape \(12, 64\), height 12 and width 64"),
    (lambda: te.Linear(40, 16, device="cpu"), (16, 40), (),
     r"te.Linear: .*the input of shape \(16, 40\), height 16 and width 40"),
    (lambda: te.LayerNormLinear(64, 16, device="cpu"), (20, 64), (),
     r"te.LayerNormLinear: .*the normalized input of shape \(20, 64\)"),
    (lambda: te.LayerNormMLP(64, 36, device="cpu"), (16, 64), (),
     r"te.LayerNormMLP: .*the fc1_weight of shape \(36, 64\), height 36"),
    (lambda: te.GroupedLinear(2, 64, 16, device="cpu"), (16, 64), ([4, 12],),
     r"te.GroupedLinear: .*the input rows of GEMM 0 \(m_splits\[0\]=4\) of shape \(4, 64\)"),
], ids=["linear-tokens", "linear-out-features", "linear-in-features", "lnlinear-tokens",
        "lnmlp-ffn", "grouped-split"])
def test_modules_name_the_tensor_that_breaks_the_rule(make, x_shape, args, message):
    with pytest.raises(ValueError, match=message):
        _fp8_forward(make(), torch.randn(x_shape), *args)


@pytest.mark.parametrize("make, x_shape, args", [
    (lambda: te.Linear(48, 40, device="cpu"), (3, 8, 48), ()),
    (lambda: te.LayerNormLinear(48, 24, device="cpu"), (24, 48), ()),
    (lambda: te.LayerNormMLP(48, 48, activation="gelu", device="cpu"), (8, 48), ()),
    (lambda: te.GroupedLinear(3, 48, 40, device="cpu"), (48, 48), ([8, 24, 16],)),
], ids=["linear", "lnlinear", "lnmlp", "grouped"])
def test_modules_run_shapes_that_are_not_multiples_of_16(make, x_shape, args):
    """Tokens 8/24 and out_features 24/40 were refused when every dimension had to be a
    multiple of 16; TE runs them, and so do we (the default CPU GEMM needs no padding)."""
    out = _fp8_forward(make(), torch.randn(x_shape, requires_grad=True), *args)
    out.sum().backward()
    assert torch.isfinite(out).all()


# ---- the padded _scaled_mm, GEMM by GEMM ---------------------------------------------------

def _exact_fp8(rows, cols, dtype=torch.float8_e4m3fn, gen=None):
    """FP8 data on a grid of 1/4 in [-2, 2] (exact in E4M3 and E5M2)."""
    values = torch.randint(-8, 9, (rows, cols), generator=gen).float() / 4
    return values.to(dtype)


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """Record the operand shapes of every ``torch._scaled_mm`` call."""
    shapes = []
    real = torch._scaled_mm

    def recording(a, b, *args, **kwargs):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    return shapes


@pytest.mark.parametrize("m, k, n", [(24, 48, 40), (8, 16, 8), (40, 24, 16), (16, 32, 48)],
                         ids=["forward-like", "smallest", "wgrad-like", "aligned"])
@pytest.mark.parametrize("out_dtype, bias", [(torch.float32, False), (torch.float32, True),
                                             (torch.bfloat16, True)],
                         ids=["fp32", "fp32-bias", "bf16-fused-bias"])
def test_padded_scaled_mm_equals_float64(m, k, n, out_dtype, bias, scaled_mm_calls):
    gen = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    a = quantize.Float8Data(_exact_fp8(m, k, gen=gen), torch.tensor([0.5]))
    b = quantize.Float8Data(_exact_fp8(n, k, torch.float8_e5m2, gen=gen), torch.tensor([2.0]))
    bias_t = (torch.randint(-4, 5, (n,), generator=gen).float() / 2) if bias else None
    out = fp8_shapes.scaled_mm_padded(a, b, out_dtype, bias_t)
    ref = (a.data.double() * 0.5) @ (b.data.double() * 2.0).T
    if bias:
        ref = ref + bias_t.double()
    assert out.shape == (m, n) and out.dtype == out_dtype and out.is_contiguous()
    assert torch.equal(out, ref.to(out_dtype))
    (a_shape, b_shape), = scaled_mm_calls
    padded = (-(-m // 16) * 16, -(-k // 16) * 16, -(-n // 16) * 16)
    assert a_shape == padded[:2] and b_shape == (padded[1], padded[2])


def test_aligned_operands_are_not_copied():
    t = torch.zeros(16, 32, dtype=torch.float8_e4m3fn)
    assert fp8_shapes._zero_padded(t, (16, 32)) is t
    padded = fp8_shapes._zero_padded(t[:8], (16, 32))
    assert padded.shape == (16, 32) and not bool(padded.view(torch.uint8).any())


# ---- modules on the padded path --------------------------------------------------------------

@pytest.fixture
def checked_gemms(monkeypatch):
    """Run every module GEMM through ``scaled_mm_padded`` and check each result against
    float64 on the same FP8 operands; returns the list of ``(M, K, N)`` computed."""
    done = []
    real = quantize.scaled_mm_padded

    def checking(a, b, out_dtype, bias=None, use_fast_accum=False):
        out = real(a, b, out_dtype, bias, use_fast_accum)
        ref = a.dequantize(torch.float64) @ b.dequantize(torch.float64).T
        if bias is not None:
            ref = ref + bias.double()
        assert torch.equal(out, ref.to(out_dtype)), f"GEMM {tuple(a.data.shape)} x " \
            f"{tuple(b.data.shape)}^T differs from float64 by {(out.double() - ref).abs().max()}"
        done.append((a.data.shape[0], a.data.shape[1], b.data.shape[0]))
        return out

    monkeypatch.setattr(quantize, "scaled_mm_padded", checking)
    return done


def _dyadic_weights(module):
    """Every weight on a grid of 1/4 in [-1, 1], biases on a grid of 1/8."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "layer_norm" in name:
                continue
            step = 8 if "bias" in name else 4
            p.copy_(torch.randint(-step, step + 1, p.shape, generator=gen).float() / step)
    return module


MODULES = [
    pytest.param(lambda: te.Linear(48, 40, device="cpu"), (3, 8, 48), (), id="linear"),
    pytest.param(lambda: te.LayerNormLinear(48, 24, device="cpu"), (24, 48), (),
                 id="lnlinear"),
    pytest.param(lambda: te.LayerNormMLP(48, 48, activation="gelu", device="cpu"), (24, 48),
                 (), id="lnmlp"),
    pytest.param(lambda: te.GroupedLinear(3, 48, 40, device="cpu"), (48, 48), ([8, 24, 16],),
                 id="grouped-splits-of-8"),
]


def _one_step(make, x_shape, args, device="cpu"):
    """One FP8 forward and backward (first step: every scale is 1) of a module with
    dyadic weights; returns its output, input gradient and parameter gradients."""
    torch.manual_seed(0)
    module = _dyadic_weights(make())
    gen = torch.Generator().manual_seed(3)
    x = (torch.randint(-8, 9, x_shape, generator=gen).float() / 4).to(device).requires_grad_()
    g = (torch.randint(-4, 5, (*x_shape[:-1], 1), generator=gen).float() / 4).to(device)
    out = _fp8_forward(module, x, *args)
    (out * g).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("make, x_shape, args", MODULES)
def test_padded_module_gemms_equal_float64_and_the_unpadded_run(make, x_shape, args,
                                                                checked_gemms):
    """Forward, dgrad and wgrad GEMMs of each module through the padded ``_scaled_mm``
    equal float64 GEMM by GEMM, and the module's output and gradients equal the
    unpadded upcast run bit for bit."""
    with kernel_config(cpu_gemm="scaled_mm"):
        padded = _one_step(make, x_shape, args)
    assert checked_gemms, "the padded path did not run"
    assert any(d % 16 for gemm in checked_gemms for d in gemm), "no GEMM needed padding"
    count = len(checked_gemms)
    with kernel_config(cpu_gemm="upcast"):
        unpadded = _one_step(make, x_shape, args)
    assert len(checked_gemms) == count          # the upcast path does not pad
    assert_tensors_equal(padded, unpadded, "padded vs unpadded")


def test_padded_linear_equals_float64_end_to_end():
    """te.Linear with 24 tokens and 40 outputs: output and gradients against float64 on
    the E4M3 values of the operands (all exact: scale 1, small dyadic data)."""
    make, x_shape, _ = MODULES[0].values
    with kernel_config(cpu_gemm="scaled_mm"):
        out, dx, dw, db = _one_step(make, x_shape, ())
    torch.manual_seed(0)
    module = _dyadic_weights(make())
    gen = torch.Generator().manual_seed(3)
    x = (torch.randint(-8, 9, x_shape, generator=gen).float() / 4).double().reshape(24, 48)
    g = (torch.randint(-4, 5, (*x_shape[:-1], 1), generator=gen).float() / 4).double()
    w, b = module.weight.detach().double(), module.bias.detach().double()
    dy = g.reshape(24, 1).expand(24, 40)
    assert torch.equal(out.double().reshape(24, 40), x @ w.T + b)
    assert torch.equal(dx.double().reshape(24, 48), dy @ w)
    assert torch.equal(dw.double(), dy.T @ x)
    assert torch.equal(db.double(), dy.sum(0))


# ---- recompute on a padded shape -------------------------------------------------------------

def _checkpointed_run(checkpointed: bool, use_reentrant: bool, steps: int = 3):
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(48, 48, device="cpu")
    proj = te.Linear(48, 40, device="cpu")
    params = list(mlp.parameters()) + list(proj.parameters())
    opt = torch.optim.SGD(params, lr=0.05)
    calls = [0]

    def block(x):
        calls[0] += 1
        return proj(mlp(x))

    gen = torch.Generator().manual_seed(5)
    record = []
    for _ in range(steps):
        x = torch.randn(3, 8, 48, generator=gen).requires_grad_()
        with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
            if checkpointed:
                out = te.checkpoint(block, x, use_reentrant=use_reentrant)
            else:
                out = block(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        record.append(capture(loss, [x], params, te_modules(torch.nn.ModuleList([mlp, proj]))))
        opt.step()
        opt.zero_grad()
    return record, calls[0]


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_checkpoint_is_bit_identical_on_a_padded_shape(use_reentrant, scaled_mm_calls):
    """24 tokens and 40 outputs through the padded ``_scaled_mm``: te.checkpoint gives
    the losses, gradients and FP8 states of the run without it, step by step."""
    with kernel_config(cpu_gemm="scaled_mm"):
        ref, ref_calls = _checkpointed_run(False, use_reentrant)
        got, calls = _checkpointed_run(True, use_reentrant)
    assert ref_calls == 3 and calls == 6                  # every step recomputed
    assert any(a[0] == (32, 48) for a in scaled_mm_calls)   # 24 tokens padded to 32
    assert_runs_equal(ref, got)


@cuda_fp8
@pytest.mark.parametrize("make, x_shape, args",
                         [m for m in MODULES if m.id != "lnmlp"])
def test_cuda_runs_padded_shapes_like_the_cpu(make, x_shape, args, scaled_mm_calls):
    """On the GPU, ``torch._scaled_mm`` gets operands padded to multiples of 16 and the
    module matches the CPU's exact run (the forward GEMM uses fast accumulation).
    LayerNormMLP is left to the CPU tests of the padded path: the GELU between its
    GEMMs rounds differently on the two devices, so its second GEMM gets different FP8
    operands (seen on an H200), not a padding error."""
    cpu = _one_step(make, x_shape, args)

    def make_cuda():
        return make().cuda()

    gpu = _one_step(make_cuda, x_shape, args, device="cuda")
    assert scaled_mm_calls and all(d % 16 == 0 for a, b in scaled_mm_calls for d in a + b)
    for i, (c, g) in enumerate(zip(cpu, gpu)):
        torch.testing.assert_close(g.cpu(), c, rtol=1e-3, atol=1e-3, msg=f"tensor {i}")
