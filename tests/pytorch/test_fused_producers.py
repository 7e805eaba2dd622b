"""The fused producers (NOTE [Fused producers] in module/fused_producers.py): the
normalization, activation and activation-gradient kernels that write the FP8 copies of
their outputs, against the unfused path (torch's op, then the reference cast), and the
modules that use them against the same modules unfused.

Where they run: on a GPU with FP8 and Triton; or, without a GPU, on CPU tensors under
the Triton interpreter (``TRITON_INTERPRET=1`` set before Triton is imported, e.g.
``TRITON_INTERPRET=1 python -m pytest tests/pytorch/test_fused_producers.py`` in an
environment with Triton; ``KernelConfig.interpret`` routes CPU tensors to the
kernels). Without either, only the CPU-path checks run.

What is compared bit for bit: every FP8 copy, transposed copy, ``scale_inv`` and amax
against the reference cast of the producer's output; an activation and its gradient
against torch's (on a GPU: NOTE [Same arithmetic] in kernels/activations.py; under the
interpreter, whose ``exp`` / ``tanh`` are numpy's, only the ReLU family, the others
within a bound); whole modules against the same modules unfused with the
normalization computed by the fused kernel. Within stated bounds: the normalization
output against torch's (another reduction order), FC1's bias gradient.
"""

import os

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format
from transformer_engine.pytorch import quantize
from transformer_engine.pytorch.kernel_config import kernel_config
from transformer_engine.pytorch.module import fused_producers, layernorm_linear, layernorm_mlp
from transformer_engine.pytorch.module.base import ForwardPlan, activation_dtype
from transformer_engine.pytorch.module.layernorm import normalize
from transformer_engine.pytorch.module.layernorm_mlp import ACTIVATIONS, activate
from helpers import HAS_CUDA_FP8, assert_runs_equal, capture, params, te_modules

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = ("cuda" if HAS_CUDA_FP8 and HAS_TRITON and not INTERPRET
          else "cpu" if HAS_TRITON and INTERPRET else None)
needs_kernels = pytest.mark.skipif(
    DEVICE is None, reason="needs a CUDA GPU with FP8 and Triton, or Triton's interpreter "
                           "(TRITON_INTERPRET=1) on the CPU")
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU with FP8 and Triton")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HP = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
      pytest.param(torch.float16, id="fp16")]
RECIPES = [pytest.param("delayed", id="delayed"), pytest.param("current", id="current")]
ACTS = sorted(ACTIVATIONS)
# exact float32 arithmetic only (no exp / tanh): torch's CPU ops give the same bits
EXACT_ANYWHERE = {"relu", "reglu", "srelu", "sreglu"}
# (rows, features): one row, tiles cut at both edges, no rows
SHAPES = [pytest.param((1, 48), id="1x48"), pytest.param((77, 200), id="77x200"),
          pytest.param((0, 64), id="0x64")]


@pytest.fixture(autouse=True)
def kernels_on():
    """The fused kernels on (on CPU tensors under the interpreter) whatever the
    environment says."""
    with kernel_config(fused=True, fused_producers=True, interpret=DEVICE == "cpu"):
        yield


def _exact(activation: str) -> bool:
    return DEVICE == "cuda" or activation in EXACT_ANYWHERE


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(
        {2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_bits_equal(a, b, what):
    """Equal bit for bit, but a NaN only as a NaN (its sign and payload are not kept)."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} vs {b.shape}"
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    assert torch.equal(nan_a, nan_b), f"{what}: NaNs differ"
    same = _bits(a) == _bits(b)
    assert bool((same | nan_a).all()), f"{what}: {int((~same & ~nan_a).sum())} values differ"


_assert_fp8_equal = _assert_bits_equal


def _assert_close_hp(a, b, dtype, what, ulps=1, floor=None):
    """Within ``ulps`` units in the last place of ``dtype`` at the reference's magnitude,
    or ``floor`` (a float32-sized one by default), infinities and NaNs where the
    reference has them."""
    assert a.shape == b.shape and a.dtype == b.dtype, what
    a32, b32 = a.float(), b.float()
    finite = b32.isfinite()
    assert torch.equal(a32[~finite].nan_to_num(), b32[~finite].nan_to_num()), \
        f"{what}: infinities or NaNs differ"
    a32, b32 = a32[finite], b32[finite]
    if floor is None:
        floor = 4 * torch.finfo(torch.float32).eps
    tol = ulps * torch.finfo(dtype).eps * b32.abs() + floor
    bad = (a32 - b32).abs() > tol
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {a.numel()} values beyond "
                                 f"{ulps} ulp; max diff {(a32 - b32).abs().max()}")


def _sample(shape, dtype, scale=3.0):
    return (torch.randn(shape, device=DEVICE) * scale).to(dtype)


def _scaling(recipe):
    """The scaling arguments of a kernel call and of its reference cast."""
    if recipe == "delayed":
        scale = torch.tensor([0.5, 3.0, 0.25], device=DEVICE)
        history = torch.full((2, 3), 1e-20, device=DEVICE)       # below every amax
        return {"scale": scale, "index": 1, "amax_history": history}
    return {"power_2_scale": False, "amax_epsilon": 0.0,
            "non_finite": torch.zeros((), dtype=torch.int32, device=DEVICE)}


def _copy(scaling):
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in scaling.items()}


def _reference_cast(v, recipe, dtype, scaling, transpose=True):
    """The unfused cast of ``v`` with a copy of ``scaling`` (taken before the fused
    call); returns the FP8 copies and the copy's history or counter after it."""
    with kernel_config(fused=False):
        if recipe == "delayed":
            history = scaling["amax_history"].clone()
            q, q_t = quantize.cast_transpose_to_fp8(v, scaling["scale"], dtype,
                                                    index=scaling["index"],
                                                    amax_history=history, transpose=transpose)
            return q, q_t, history
        counter = scaling["non_finite"].clone()
        q, q_t = quantize.current_scaling_cast(v, dtype, False, 0.0, counter, True, transpose)
        return q, q_t, counter


def _assert_cast_state(recipe, scaling, ref_state, what):
    got = scaling["amax_history"] if recipe == "delayed" else scaling["non_finite"]
    assert torch.equal(got.nan_to_num(-7.0), ref_state.nan_to_num(-7.0)), \
        f"{what}: amax history / non-finite count differs: {got} vs {ref_state}"


def _kernels():
    from transformer_engine.pytorch.kernels import act_cast, dact_cast, norm_cast
    return norm_cast, act_cast, dact_cast


# ---- activation + cast ------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hp", HP)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ACTS)
def test_act_cast_is_the_unfused_activation_and_cast(activation, recipe, hp, shape):
    """act_cast's output and FP8 copies against ``activate`` then the reference cast."""
    m, f = shape
    gated = ACTIVATIONS[activation][1]
    x = _sample((m, 2 * f if gated else f), hp)
    if m and _exact(activation):    # (the interpreter's tanh rounds 1 + tanh to 0 early)
        x.view(-1)[::97] = float("nan")
        x.view(-1)[5::89] = float("inf")
    scaling = _scaling(recipe)
    before = _copy(scaling)
    y, q, q_t, scale_inv = _kernels()[1].act_cast(x, activation, E4M3, write_y=True,
                                                  transpose=True, **scaling)
    ref = activate(x, activation)
    if _exact(activation):
        _assert_bits_equal(y, ref, "the activation against torch's")
    else:       # the interpreter's exp and tanh: 2 ulps, or 1e-5 of the largest output
        scale = float(ref.float()[ref.isfinite()].abs().max()) if ref.numel() else 0.0
        _assert_close_hp(y, ref, hp, "activation", ulps=2, floor=1e-5 * scale)
    # the FP8 copies are the reference cast of the output the kernel computed
    ref_q, ref_qt, ref_state = _reference_cast(y, recipe, E4M3, before)
    _assert_fp8_equal(q, ref_q.data, "FP8 copy")
    _assert_fp8_equal(q_t, ref_qt.data, "transposed FP8 copy")
    assert torch.equal(scale_inv, ref_q.scale_inv)
    _assert_cast_state(recipe, scaling, ref_state, "act_cast")
    if hp == torch.bfloat16:    # without the high-precision output: the same FP8 bits
        _, q2, q2_t, _ = _kernels()[1].act_cast(x, activation, E4M3, transpose=True,
                                                **_scaling(recipe))
        _assert_fp8_equal(q2, q, "FP8 copy without the output")
        _assert_fp8_equal(q2_t, q_t, "transposed copy without the output")


# ---- activation gradient + cast ----------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hp", HP)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ACTS)
def test_dact_cast_is_the_unfused_gradient_and_cast(activation, recipe, hp, shape):
    """dact_cast's FP8 gradient against torch's autograd of ``activate`` then the
    reference cast; the bias gradient against the column sum."""
    m, f = shape
    gated = ACTIVATIONS[activation][1]
    x = _sample((m, 2 * f if gated else f), hp)
    dy = _sample((m, f), hp, scale=1.0)
    x_ref = x.clone().requires_grad_()
    activate(x_ref, activation).backward(dy)
    dx_ref = x_ref.grad
    scaling = _scaling(recipe)
    before = _copy(scaling)
    q, q_t, scale_inv, dbias = _kernels()[2].dact_cast(x, dy, activation, E5M2, transpose=True,
                                                       dbias_dtype=hp, **scaling)
    ref_q, ref_qt, ref_state = _reference_cast(dx_ref, recipe, E5M2, before)
    if _exact(activation):
        _assert_fp8_equal(q, ref_q.data, "FP8 gradient")
        _assert_fp8_equal(q_t, ref_qt.data, "transposed FP8 gradient")
        assert torch.equal(scale_inv, ref_q.scale_inv)
        _assert_cast_state(recipe, scaling, ref_state, "dact_cast")
    else:   # the interpreter: 1 - tanh^2 from numpy's tanh; a check of the formulas
        top = float(dx_ref.float().abs().max()) if m else 0.0
        for got, ref in ((q, dx_ref), (q_t, dx_ref.t())):
            torch.testing.assert_close(got.float() * scale_inv, ref.float(), rtol=0.3,
                                       atol=1e-2 * top)
    # the bias gradient: float32 sums in another order than torch's, rounded once
    ref_dbias = dx_ref.sum(0, dtype=torch.float32)
    bound = m * torch.finfo(torch.float32).eps * dx_ref.float().abs().sum(0)
    if not _exact(activation):
        bound = bound + 0.05 * dx_ref.float().abs().sum(0) + 1e-6   # (the interpreter)
    assert bool(((dbias.float() - ref_dbias).abs()
                 <= bound + torch.finfo(hp).eps * ref_dbias.abs() + 1e-30).all())
    assert dbias.dtype == hp and dbias.shape == (x.shape[1],)


# ---- normalization + cast -------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("shape", [pytest.param((1, 33), id="1x33"),
                                   pytest.param((37, 300), id="37x300"),
                                   pytest.param((0, 64), id="0x64")])
@pytest.mark.parametrize("hp", HP)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("normalization, zero_centered", [
    ("LayerNorm", False), ("LayerNorm", True), ("RMSNorm", False), ("RMSNorm", True)],
    ids=["ln", "ln-zero-centered", "rms", "rms-zero-centered"])
def test_norm_cast_output_bound_and_cast_bits(normalization, zero_centered, recipe, hp, shape):
    """norm_cast's output within one ulp of ``normalize`` (float32: a few float32
    ulps); its FP8 copies, amax and ``scale_inv`` the reference cast of that output; the
    statistics those of a float64 computation to float32 rounding."""
    m, n = shape
    x = (torch.randn(m, n, device=DEVICE) * 2 + 0.5).to(hp)
    w = (torch.randn(n, device=DEVICE) * 0.2 + (0.0 if zero_centered else 1.0)).to(hp)
    b = (torch.randn(n, device=DEVICE) * 0.1).to(hp) if normalization == "LayerNorm" else None
    scaling = _scaling(recipe)
    before = _copy(scaling)
    y, q, q_t, scale_inv, stats = _kernels()[0].norm_cast(
        x, w, b, normalization, 1e-5, zero_centered, hp, E4M3, write_y=True, transpose=True,
        **scaling)
    ref = normalize(x, w, b, normalization, 1e-5, zero_centered)
    _assert_close_hp(y, ref, hp, "normalization", ulps=1 if hp != torch.float32 else 64)
    ref_q, ref_qt, ref_state = _reference_cast(y, recipe, E4M3, before)
    _assert_fp8_equal(q, ref_q.data, "FP8 copy")
    _assert_fp8_equal(q_t, ref_qt.data, "transposed FP8 copy")
    assert torch.equal(scale_inv, ref_q.scale_inv)
    _assert_cast_state(recipe, scaling, ref_state, "norm_cast")
    x64 = x.double()
    rstd = stats[-1].double().view(-1)
    if normalization == "LayerNorm":
        mean64 = x64.mean(-1)
        var64 = x64.var(-1, unbiased=False)
        assert torch.allclose(stats[0].double().view(-1), mean64, rtol=0,
                              atol=float(4e-7 * (x64.abs().max() if m else 1)))
    else:
        var64 = x64.pow(2).mean(-1)
    assert torch.allclose(rstd, (var64 + 1e-5).rsqrt(), rtol=1e-6, atol=0)
    if hp == torch.bfloat16:    # without the high-precision output: the same FP8 bits
        _, q2, q2_t, _, _ = _kernels()[0].norm_cast(
            x, w, b, normalization, 1e-5, zero_centered, hp, E4M3, transpose=True,
            **_scaling(recipe))
        _assert_fp8_equal(q2, q, "FP8 copy without the output")
        _assert_fp8_equal(q2_t, q_t, "transposed copy without the output")


@needs_kernels
@pytest.mark.parametrize("hp", HP)
@pytest.mark.parametrize("normalization, zero_centered", [
    ("LayerNorm", False), ("LayerNorm", True), ("RMSNorm", False)],
    ids=["ln", "ln-zero-centered", "rms"])
def test_norm_cast_backward_is_the_normalization_gradient(normalization, zero_centered, hp):
    """NormCast's backward (torch's at the kernel's statistics) against the autograd of
    ``normalize``: the same gradient to the output dtype's rounding."""
    n = 96
    x = (torch.randn(3, 16, n, device=DEVICE) * 2 + 0.5).to(hp).requires_grad_()
    w = (torch.randn(n, device=DEVICE) * 0.2 + (0.0 if zero_centered else 1.0)).to(hp)
    w.requires_grad_()
    b = ((torch.randn(n, device=DEVICE) * 0.1).to(hp).requires_grad_()
         if normalization == "LayerNorm" else None)
    dy = torch.randn(3, 16, n, device=DEVICE).to(hp)
    y = kernel_normalize(x, w, b, normalization, 1e-5, zero_centered)
    grads = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], dy)
    y_ref = normalize(x, w, b, normalization, 1e-5, zero_centered)
    refs = torch.autograd.grad(y_ref, [t for t in (x, w, b) if t is not None], dy)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}[hp]
    for g, r, name in zip(grads, refs, ("dx", "dgamma", "dbeta")):
        torch.testing.assert_close(g.float(), r.float(), rtol=tol, atol=tol, msg=name)


def kernel_normalize(x, weight, bias, normalization, eps, zero_centered_gamma):
    """`normalize` computed by the fused kernel (its output written, an FP8 copy made
    with a fixed scale and dropped), with NormCast's backward: the reference path of
    the module tests, so that they compare the fusion, not the normalization."""
    assert fused_producers._load() is not None
    call = fused_producers._NormCall(
        normalization, eps, zero_centered_gamma, activation_dtype(x), E4M3,
        {"scale": torch.ones(1, device=x.device), "index": 0, "amax_history": None},
        write_y=True, transpose=False)
    return fused_producers.NormCast.apply(x, weight, bias, call)


# ---- current-scaling casts: two launches, no host synchronisation -----------------------
@needs_kernels
@pytest.mark.parametrize("shape", [pytest.param((1, 1), id="1x1"),
                                   pytest.param((100, 37), id="100x37"),
                                   pytest.param((333, 1040), id="333x1040")])
@pytest.mark.parametrize("hp", HP)
@pytest.mark.parametrize("qparams", [(False, 0.0), (True, 0.0), (False, 1.0)],
                         ids=["plain", "pow2", "epsilon"])
def test_current_cast_bits_and_launches(qparams, hp, shape, monkeypatch):
    """`quantize.current_scaling_cast` fused: the bits of amax -> current_scale -> cast,
    in two launches; a non-finite amax is counted on the device."""
    from transformer_engine.pytorch.kernels import launch
    launches = _count_launches(monkeypatch, launch)
    x = _sample(shape, hp)
    power_2, epsilon = qparams
    if shape[0] > 1:
        x[3, 4] = float("inf")
    counts = [torch.zeros((), dtype=torch.int32, device=DEVICE) for _ in range(2)]
    q, q_t = quantize.current_scaling_cast(x, E4M3, power_2, epsilon, counts[0], True, True)
    assert len(launches) == 2
    with kernel_config(fused=False):
        r, r_t = quantize.current_scaling_cast(x, E4M3, power_2, epsilon, counts[1], True, True)
    _assert_fp8_equal(q.data, r.data, "FP8 copy")
    _assert_fp8_equal(q_t.data, r_t.data, "transposed FP8 copy")
    assert torch.equal(q.scale_inv, r.scale_inv) and q_t.scale_inv is q.scale_inv
    assert torch.equal(counts[0], counts[1])


def _count_launches(monkeypatch, launch):
    launches = []
    real = launch.Launcher.__call__

    def counting(self, *args, **kwargs):
        launches.append(self.kernel.__name__ if hasattr(self.kernel, "__name__") else "?")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(launch.Launcher, "__call__", counting)
    return launches


@needs_kernels
@pytest.mark.parametrize("recipe, launches", [("delayed", 1), ("current", 2)])
def test_producer_launches_per_tensor(recipe, launches, monkeypatch):
    """Each producer takes one launch with delayed scaling and two with current
    scaling (the amax before the cast)."""
    from transformer_engine.pytorch.kernels import launch
    norm_cast, act_cast, dact_cast = _kernels()
    calls = _count_launches(monkeypatch, launch)
    x = _sample((32, 64), torch.bfloat16)
    w = torch.ones(64, device=DEVICE, dtype=torch.bfloat16)
    norm_cast.norm_cast(x, w, None, "RMSNorm", 1e-5, False, torch.bfloat16, E4M3,
                        transpose=True, **_scaling(recipe))
    assert len(calls) == launches
    act_cast.act_cast(x, "swiglu", E4M3, transpose=True, **_scaling(recipe))
    assert len(calls) == 2 * launches
    dact_cast.dact_cast(x, x[:, :32], "swiglu", E5M2, transpose=True, **_scaling(recipe))
    assert len(calls) == 3 * launches


@gpu_only
def test_current_scaling_casts_do_not_synchronize():
    """No host synchronisation in the current-scaling casts and producers."""
    norm_cast, act_cast, dact_cast = _kernels()
    x = _sample((64, 128), torch.bfloat16)
    w = torch.ones(128, device=DEVICE, dtype=torch.bfloat16)
    counter = torch.zeros((), dtype=torch.int32, device=DEVICE)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):          # the second round takes the direct launches
            quantize.current_scaling_cast(x, E4M3, False, 0.0, counter, True, True)
            norm_cast.norm_cast(x, w, w, "LayerNorm", 1e-5, False, torch.bfloat16, E4M3,
                                non_finite=counter, transpose=True)
            act_cast.act_cast(x, "geglu", E4M3, non_finite=counter, transpose=True)
            dact_cast.dact_cast(x, x[:, :64], "geglu", E5M2, non_finite=counter,
                                transpose=True, dbias_dtype=torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode(previous)


# ---- modules -----------------------------------------------------------------------
def _recipe(name):
    return (DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4) if name == "delayed"
            else Float8CurrentScaling())


def _spy_producers(monkeypatch):
    """Count the fused producer kernels the modules call."""
    norm_cast, act_cast, dact_cast = _kernels()
    calls = {"norm": 0, "act": 0, "dact": 0}
    for module, name, key in ((norm_cast, "norm_cast", "norm"), (act_cast, "act_cast", "act"),
                              (dact_cast, "dact_cast", "dact")):
        real = getattr(module, name)

        def counting(*args, _real=real, _key=key, **kwargs):
            calls[_key] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(module, name, counting)
    return calls


def _train(model, recipe, steps, shape, dtype, fused):
    """``steps`` training steps (forward in FP8, backward, no optimizer); returns each
    step's output and record (`helpers.capture`)."""
    outputs, run = [], []
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    with kernel_config(fused_producers=fused):
        for _ in range(steps):
            x = torch.randn(shape, device=DEVICE, generator=gen).to(dtype).requires_grad_()
            with te.autocast(recipe=recipe):
                y = model(x)
            out = y[0] if isinstance(y, tuple) else y
            loss = out.float().pow(2).mean()
            loss.backward()
            outputs.append(out.detach())
            run.append(capture(loss, [x], params([model]), te_modules(model)))
            model.zero_grad(set_to_none=True)
    return outputs, run


def _compare_fused(make, recipe_name, shape, dtype, monkeypatch, skip_grads=(), steps=2):
    """The fused run of ``make()`` against the unfused run with the normalization
    computed by the kernel (`kernel_normalize`), bit for bit, FP8 state included;
    gradients named in ``skip_grads`` within a bound instead."""
    recipe = _recipe(recipe_name)
    torch.manual_seed(3)
    fused_model = make()
    ref_model = make()
    ref_model.load_state_dict(fused_model.state_dict())
    calls = _spy_producers(monkeypatch)
    outputs, run = _train(fused_model, recipe, steps, shape, dtype, True)
    counted = dict(calls)
    monkeypatch.setattr(layernorm_linear, "normalize", kernel_normalize)
    monkeypatch.setattr(layernorm_mlp, "normalize", kernel_normalize)
    ref_outputs, ref_run = _train(ref_model, recipe, steps, shape, dtype, False)
    for a, b in zip(outputs, ref_outputs):
        assert torch.equal(_bits(a), _bits(b)), "outputs differ"
    names = [n for n, _ in fused_model.named_parameters()]
    for step, (got, ref) in enumerate(zip(run, ref_run)):
        for i, name in enumerate(names):
            if name in skip_grads:
                g, r = got.param_grads[i], ref.param_grads[i]
                torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=1e-3,
                                           msg=f"step {step}: {name}.grad")
                got.param_grads[i] = ref.param_grads[i] = None
    assert_runs_equal(ref_run, run, "fused producers against unfused,")
    return counted


def _module_activations():
    return ACTS if DEVICE == "cuda" else ["relu", "sreglu"]


@needs_kernels
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_fused_equals_unfused(normalization, recipe, monkeypatch):
    make = lambda: te.LayerNormLinear(64, 48, normalization=normalization,  # noqa: E731
                                      params_dtype=torch.bfloat16, device=DEVICE)
    calls = _compare_fused(make, recipe, (2, 16, 64), torch.bfloat16, monkeypatch)
    assert calls == {"norm": 2, "act": 0, "dact": 0}


@needs_kernels
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", _module_activations())
def test_layernorm_mlp_fused_equals_unfused(activation, recipe, monkeypatch):
    make = lambda: te.LayerNormMLP(64, 96, activation=activation,  # noqa: E731
                                   params_dtype=torch.bfloat16, device=DEVICE)
    calls = _compare_fused(make, recipe, (32, 64), torch.bfloat16, monkeypatch,
                           skip_grads=("fc1_bias",))
    assert calls == {"norm": 2, "act": 2, "dact": 2}


@needs_kernels
@pytest.mark.parametrize("dtype", HP)
def test_layernorm_mlp_fused_dtypes(dtype, monkeypatch):
    """Parameters and activations in every dtype (RMSNorm, zero-centred gain)."""
    activation = "swiglu" if DEVICE == "cuda" else "reglu"
    make = lambda: te.LayerNormMLP(64, 80, activation=activation, params_dtype=dtype,  # noqa: E731
                                   normalization="RMSNorm", zero_centered_gamma=True,
                                   device=DEVICE)
    calls = _compare_fused(make, "delayed", (16, 64), dtype, monkeypatch,
                           skip_grads=("fc1_bias",))
    assert calls == {"norm": 2, "act": 2, "dact": 2}


@needs_kernels
@pytest.mark.parametrize("recipe", RECIPES)
def test_transformer_layer_fused_equals_unfused(recipe, monkeypatch):
    activation = "gelu" if DEVICE == "cuda" else "relu"
    make = lambda: te.TransformerLayer(64, 128, 4, hidden_dropout=0.0,  # noqa: E731
                                       attention_dropout=0.0, activation=activation,
                                       params_dtype=torch.bfloat16, device=DEVICE)
    calls = _compare_fused(make, recipe, (16, 2, 64), torch.bfloat16, monkeypatch,
                           skip_grads=("layernorm_mlp.fc1_bias",))
    assert calls == {"norm": 4, "act": 2, "dact": 2}


@needs_kernels
@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_backward_override_keeps_the_unfused_producers(override, monkeypatch):
    """A recipe whose backward reads the high-precision operands (NOTE [Backward
    override]) gets them: no producer is fused."""
    calls = _spy_producers(monkeypatch)
    layer = te.LayerNormMLP(64, 64, params_dtype=torch.bfloat16, device=DEVICE)
    x = _sample((16, 64), torch.bfloat16).requires_grad_()
    with te.autocast(recipe=Float8CurrentScaling(backward_override=override)):
        y = layer(x)
    y.float().sum().backward()
    assert calls == {"norm": 0, "act": 0, "dact": 0} and x.grad is not None


@needs_kernels
def test_fused_paths_write_no_normalization_output(monkeypatch):
    """Only a module that returns the normalization output has it written; what it
    returns is the kernel's output."""
    seen = []
    real = fused_producers.NormCast.forward

    def spying(ctx, x, weight, bias, call):
        out = real(ctx, x, weight, bias, call)
        seen.append(out.stride())
        return out
    monkeypatch.setattr(fused_producers.NormCast, "forward", staticmethod(spying))
    x = _sample((16, 64), torch.bfloat16)
    for returns in (False, True):
        layer = te.LayerNormLinear(64, 32, return_layernorm_output=returns,
                                   params_dtype=torch.bfloat16, device=DEVICE)
        with te.autocast(recipe=DelayedScaling()):
            out = layer(x)
        assert seen.pop() == ((64, 1) if returns else (0, 0))
        if returns:
            assert torch.equal(_bits(out[1]), _bits(kernel_normalize(
                x, layer.layer_norm_weight, layer.layer_norm_bias, "LayerNorm", layer.eps,
                False)))


@needs_kernels
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_fused_layer_is_bit_identical(use_reentrant, monkeypatch):
    """te.checkpoint of a layer on the fused path: the recompute reruns the fused
    kernels with the stashed scales: outputs, gradients and FP8 state as without it."""
    activation = "geglu" if DEVICE == "cuda" else "reglu"
    torch.manual_seed(5)
    layers = [te.LayerNormMLP(64, 96, activation=activation, params_dtype=torch.bfloat16,
                              device=DEVICE) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    calls = _spy_producers(monkeypatch)
    forwards = []

    def run(layer, checkpointed):
        def fn(x):
            forwards.append(1)
            return layer(x)
        return _train(_Wrapped(fn, layer, checkpointed, use_reentrant), _recipe("delayed"),
                      2, (32, 64), torch.bfloat16, True)
    plain = run(layers[0], False)
    assert len(forwards) == 2 and calls["act"] == 2
    checkpointed = run(layers[1], True)
    assert len(forwards) == 6 and calls["act"] == 6        # phase 1 and the recompute
    for a, b in zip(plain[0], checkpointed[0]):
        assert torch.equal(_bits(a), _bits(b))
    assert_runs_equal(plain[1], checkpointed[1], "checkpointed fused layer,")


class _Wrapped(torch.nn.Module):
    def __init__(self, fn, layer, checkpointed, use_reentrant):
        super().__init__()
        self.fn, self.layer = fn, layer
        self.checkpointed, self.use_reentrant = checkpointed, use_reentrant

    def forward(self, x):
        if self.checkpointed:
            return te.checkpoint(self.fn, x, use_reentrant=self.use_reentrant)
        return self.fn(x)


@needs_kernels
def test_mlp_checkpoint_option_matches_plain_run(monkeypatch):
    """LayerNormMLP(checkpoint=True) (normalization unfused, FC1 -> FC2 recomputed)
    against checkpoint=False (normalization fused), the normalization being the
    kernel's in both: bit for bit."""
    activation = "swiglu" if DEVICE == "cuda" else "relu"
    monkeypatch.setattr(layernorm_mlp, "normalize", kernel_normalize)
    torch.manual_seed(6)
    a = te.LayerNormMLP(64, 96, activation=activation, params_dtype=torch.bfloat16,
                        device=DEVICE)
    b = te.LayerNormMLP(64, 96, activation=activation, params_dtype=torch.bfloat16,
                        device=DEVICE, checkpoint=True)
    b.load_state_dict(a.state_dict())
    out_a, run_a = _train(a, _recipe("delayed"), 2, (32, 64), torch.bfloat16, True)
    out_b, run_b = _train(b, _recipe("delayed"), 2, (32, 64), torch.bfloat16, True)
    for x, y in zip(out_a, out_b):
        assert torch.equal(_bits(x), _bits(y))
    assert_runs_equal(run_a, run_b, "checkpoint=True against False,")


# ---- the custom ops ------------------------------------------------------------------
@needs_kernels
def test_custom_ops_pass_opcheck():
    """The torch.library registrations: schemas, fake implementations and mutation
    declarations agree with the kernels (``torch.library.opcheck``)."""
    from transformer_engine.pytorch.kernels import ops
    ns = getattr(torch.ops, ops.register())
    assert ops.register() == "transformer_engine"            # idempotent
    x = _sample((32, 64), torch.bfloat16)
    w = torch.ones(64, device=DEVICE, dtype=torch.bfloat16)
    scale = torch.tensor([2.0, 0.5], device=DEVICE)

    def history():
        return torch.zeros(4, 2, device=DEVICE)

    def counter():
        return torch.zeros((), dtype=torch.int32, device=DEVICE)
    cases = [
        (ns.cast_transpose, (x, scale, history(), 1, E4M3, True, True)),
        (ns.current_cast, (x, E5M2, False, 0.0, counter(), True, False)),
        (ns.norm_cast, (x, w, w, "LayerNorm", 1e-5, False, torch.bfloat16, E4M3, scale, 0,
                        history(), False, 0.0, None, True, True, True)),
        (ns.norm_cast, (x, w, None, "RMSNorm", 1e-5, True, torch.float32, E4M3, None, 0, None,
                        True, 0.0, counter(), False, True, False)),
        (ns.act_cast, (x, "swiglu", E4M3, scale, 1, history(), False, 0.0, None, True, True,
                       True)),
        (ns.act_cast, (x, "gelu", E4M3, None, 0, None, False, 1e-3, counter(), False, True,
                       False)),
        (ns.dact_cast, (x, x[:, :32].contiguous(), "geglu", E5M2, scale, 0, history(), False,
                        0.0, None, True, True, True, torch.bfloat16)),
        (ns.dact_cast, (x, x, "relu", E5M2, None, 0, None, False, 0.0, counter(), False, True,
                        False, torch.float32)),
    ]
    for op, args in cases:
        torch.library.opcheck(op.default, args)
    q, q_t, scale_inv = ns.cast_transpose(x, scale, None, 1, E4M3, True, False)
    ref = quantize.cast_to_fp8(x, scale[1:], E4M3)
    _assert_fp8_equal(q, ref.data, "op cast")
    assert q_t.numel() == 0 and torch.equal(scale_inv, ref.scale_inv)


# ---- where the fused path is not taken ---------------------------------------------
def test_cpu_modules_never_take_the_fused_path(monkeypatch):
    """On the CPU (no interpreter switch) the modules keep the reference path."""
    with kernel_config(interpret=False):
        plan = ForwardPlan(fp8=True, recipe=DelayedScaling(), record_amax=True)
        assert not fused_producers.fused_producers_on(plan, torch.ones(16, 16))
        layer = te.LayerNormMLP(32, 32, device="cpu")
        monkeypatch.setattr(fused_producers, "NormCast", None)      # would fail if used
        monkeypatch.setattr(fused_producers, "ActCast", None)
        with te.autocast(recipe=DelayedScaling()):
            layer(torch.randn(16, 32)).sum().backward()


def test_unwritten_edge_is_one_element():
    t = fused_producers.unwritten((4096, 1024), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (4096, 1024) and t.stride() == (0, 0)
    assert t.untyped_storage().nbytes() == 2
