"""The fused producers (NOTE [Fused producers] in module/fused_producers.py): the
normalization, activation and activation-gradient kernels that write the FP8 copies of
their outputs, against the unfused path (torch's op, then the reference cast), and the
modules that use them against the same modules unfused.

Where they run: on a GPU with FP8 and Triton; or, without a GPU, on CPU tensors under
the Triton interpreter (``TRITON_INTERPRET=1`` set before Triton is imported, e.g.
``TRITON_INTERPRET=1 python -m pytest tests/pytorch/test_fused_producers.py`` in an
environment with Triton; ``KernelConfig.interpret`` routes CPU tensors to the
kernels). Without either, only the CPU-path checks run. ``-k smoke``: one case of each
kind.

What is compared bit for bit: every FP8 copy, transposed copy, ``scale_inv`` and amax
against the reference cast of the producer's output; an activation and its gradient
against torch's (on a GPU: NOTE [Same arithmetic] in kernels/activations.py; under the
interpreter, whose ``exp`` / ``tanh`` are numpy's, only the ReLU family, the others
within a bound); whole modules against the same modules unfused with the
normalization computed by the fused kernel. Within stated bounds: the normalization
output against torch's (another reduction order), FC1's bias gradient.

Compiling a kernel variant (a combination of dtypes, flags and shape
specializations) costs most of a GPU run, so each kernel case below is one compiled
variant (two with current scaling) that runs several inputs: one row, rows cut at a
tile edge, no rows, NaN and infinities. The cases cover every activation in float32
(where the arithmetic must match torch's op for op), each dtype and recipe, row
lengths that are and are not multiples of 16 (vectorized and scalar accesses).
"""

import os
from contextlib import contextmanager

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format
from transformer_engine.pytorch import quantize
from transformer_engine.pytorch.kernel_config import kernel_config
from transformer_engine.pytorch.module import fused_producers, layernorm_linear, layernorm_mlp
from transformer_engine.pytorch.module.devices import activation_dtype
from transformer_engine.pytorch.module.forward_plan import ForwardPlan
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
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
HP = [pytest.param(F32, id="fp32"), pytest.param(BF16, id="bf16"),
      pytest.param(F16, id="fp16")]
RECIPES = [pytest.param("delayed", id="delayed"), pytest.param("current", id="current")]
ACTS = sorted(ACTIVATIONS)
# exact float32 arithmetic only (no exp / tanh): torch's CPU ops give the same bits
EXACT_ANYWHERE = {"relu", "reglu", "srelu", "sreglu"}
_DTYPE_ID = {F32: "fp32", BF16: "bf16", F16: "fp16"}


def _case(kind, *fields, smoke=False):
    """A kernel case: its fields and a readable id (``smoke-`` for the quick subset)."""
    parts = [_DTYPE_ID.get(f, str(f)) for f in fields]
    return pytest.param(fields, id=("smoke-" if smoke else "") + "-".join(parts))


# (activation, dtype, recipe, F): every activation in float32, each recipe, F a multiple
# of 16 in one tile (48), in several (208), or not (200, 37: an odd row length)
ACT_CASES = [
    _case("act", "relu", F32, "current", 48, smoke=True),
    _case("act", "gelu", F32, "delayed", 48),
    _case("act", "geglu", F32, "current", 200),
    _case("act", "reglu", F32, "delayed", 37),
    _case("act", "srelu", F32, "delayed", 208),
    _case("act", "sreglu", F32, "current", 48),
    _case("act", "silu", F32, "current", 200),
    _case("act", "swiglu", F32, "delayed", 48),
    _case("act", "qgelu", F32, "delayed", 37),
    _case("act", "qgeglu", F32, "current", 208),
    _case("act", "glu", F32, "delayed", 200),
    _case("act", "swiglu", BF16, "current", 208),
    _case("act", "gelu", BF16, "delayed", 37),
    _case("act", "geglu", F16, "delayed", 48),
    _case("act", "srelu", F16, "current", 200),
]
# (normalization, zero-centred gain, dtype, recipe, N)
NORM_CASES = [
    _case("norm", "LayerNorm", False, F32, "delayed", 64, smoke=True),
    _case("norm", "RMSNorm", False, F32, "current", 300),
    _case("norm", "LayerNorm", True, F32, "current", 96),
    _case("norm", "LayerNorm", True, BF16, "current", 48),
    _case("norm", "LayerNorm", False, BF16, "delayed", 1040),
    _case("norm", "RMSNorm", True, F16, "delayed", 33),
    _case("norm", "RMSNorm", False, BF16, "current", 256),
]
ROWS = (1, 77, 0)       # one row; rows cut at a tile edge (64); no rows


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


def _describe(t, index):
    """``t[index]`` as a value and its bit pattern."""
    bits = int(_bits(t)[index]) & ((1 << (8 * t.element_size())) - 1)
    return f"{float(t[index].float()):.9g} (0x{bits:0{2 * t.element_size()}x})"


def _assert_bits_equal(a, b, what):
    """Equal bit for bit, but a NaN only as a NaN (its sign and payload are not kept).
    A failure names how many elements differ and the first of them: index, both
    values and their bits (``a`` is what was computed, ``b`` the reference)."""
    assert a.shape == b.shape and a.dtype == b.dtype, \
        f"{what}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    differ = (_bits(a) != _bits(b)) & ~(nan_a & nan_b)
    if bool(differ.any()):
        index = tuple(int(i) for i in differ.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(differ.sum())} of {a.numel()} elements differ (NaNs: "
            f"{int(nan_a.sum())} computed, {int(nan_b.sum())} in the reference); first at "
            f"index {index}: computed {_describe(a, index)}, reference {_describe(b, index)}")


_assert_fp8_equal = _assert_bits_equal


def _assert_close_hp(a, b, dtype, what, ulps=1, floor=None):
    """Within ``ulps`` units in the last place of ``dtype`` at the reference's magnitude,
    or ``floor`` (a float32-sized one by default), infinities and NaNs where the
    reference has them. A failure names the first element out of bounds."""
    assert a.shape == b.shape and a.dtype == b.dtype, what
    a32, b32 = a.float(), b.float()
    finite = b32.isfinite()
    special = ~finite & ~((a32 == b32) | (a32.isnan() & b32.isnan()))
    if bool(special.any()):
        index = tuple(int(i) for i in special.nonzero()[0])
        raise AssertionError(f"{what}: infinities or NaNs differ at {int(special.sum())} "
                             f"elements; first at {index}: computed {_describe(a, index)}, "
                             f"reference {_describe(b, index)}")
    if floor is None:
        floor = 4 * torch.finfo(torch.float32).eps
    tol = ulps * torch.finfo(dtype).eps * b32.abs() + floor
    bad = finite & ((a32 - b32).abs() > tol)
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {a.numel()} values beyond {ulps} "
                             f"ulp; first at {index}: computed {_describe(a, index)}, "
                             f"reference {_describe(b, index)}")


def _sample(shape, dtype, scale=3.0, specials=False):
    """Normal samples; with ``specials`` a NaN every 97 elements and an infinity of
    each sign further on."""
    x = (torch.randn(shape, device=DEVICE) * scale).to(dtype)
    if specials and x.numel():
        flat = x.view(-1)
        flat[::97] = float("nan")
        flat[5::89] = float("inf")
        flat[40::101] = float("-inf")
    return x


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


def _assert_copies(q, q_t, scale_inv, scaling, ref, recipe, what):
    """The FP8 copies, ``scale_inv`` and the amax history / counter of a kernel call
    against those of the reference cast ``ref = (ref_q, ref_qt, ref_state)``."""
    ref_q, ref_qt, ref_state = ref
    _assert_fp8_equal(q, ref_q.data, f"{what}: FP8 copy")
    _assert_fp8_equal(q_t, ref_qt.data, f"{what}: transposed FP8 copy")
    assert torch.equal(scale_inv, ref_q.scale_inv), \
        f"{what}: scale_inv {scale_inv.tolist()} vs {ref_q.scale_inv.tolist()}"
    _assert_cast_state(recipe, scaling, ref_state, what)


def _kernels():
    from transformer_engine.pytorch.kernels import act_cast, dact_cast, norm_cast
    return norm_cast, act_cast, dact_cast


@contextmanager
def _launches(expected, what):
    """Count the kernel launches inside: ``expected`` (no rows: none)."""
    from transformer_engine.pytorch.kernels import launch
    calls = []
    real = launch.Launcher.__call__

    def counting(self, *args, **kwargs):
        calls.append(getattr(self.kernel, "__name__", "?"))
        return real(self, *args, **kwargs)
    launch.Launcher.__call__ = counting
    try:
        yield
    finally:
        launch.Launcher.__call__ = real
    assert len(calls) == expected, f"{what}: {len(calls)} launches {calls}, not {expected}"


def _inputs(rows):
    """The inputs of a case: (label, rows, with NaN and infinities?) for one row, rows
    cut at a tile edge (finite, then with NaN/inf) and no rows, from ``rows``."""
    return [(f"{m} rows{' with NaN/inf' if specials else ''}", m, specials)
            for m, specials in ((rows[0], False), (rows[1], False), (rows[1], True),
                                (rows[2], False))]


# ---- activation + cast ------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("case", ACT_CASES)
def test_act_cast_is_the_unfused_activation_and_cast(case):
    """act_cast's output and FP8 copies against ``activate`` then the reference cast,
    for one row, rows cut at a tile edge (finite, and with NaN and infinities) and no
    rows; one launch with delayed scaling, two with current scaling."""
    activation, hp, recipe, f = case
    gated = ACTIVATIONS[activation][1]
    for label, m, specials in _inputs(ROWS):
        what = f"{activation} {_DTYPE_ID[hp]} {recipe} [{m}, {f}], {label}"
        x = _sample((m, 2 * f if gated else f), hp, specials=specials and _exact(activation))
        scaling = _scaling(recipe)
        before = _copy(scaling)
        with _launches((1 if recipe == "delayed" else 2) if m else 0, what):
            y, q, q_t, scale_inv = _kernels()[1].act_cast(x, activation, E4M3, write_y=True,
                                                          transpose=True, **scaling)
        ref = activate(x, activation)
        if _exact(activation):
            _assert_bits_equal(y, ref, f"{what}: the activation against torch's")
        else:   # the interpreter's exp and tanh: 2 ulps, or 1e-5 of the largest output
            top = float(ref.float()[ref.isfinite()].abs().max()) if ref.numel() else 0.0
            _assert_close_hp(y, ref, hp, f"{what}: activation", ulps=2, floor=1e-5 * top)
        # the FP8 copies are the reference cast of the output the kernel computed
        _assert_copies(q, q_t, scale_inv, scaling, _reference_cast(y, recipe, E4M3, before),
                       recipe, what)
        if hp == BF16 and m:    # without the high-precision output: the same FP8 bits
            _, q2, q2_t, _ = _kernels()[1].act_cast(x, activation, E4M3, transpose=True,
                                                    **_scaling(recipe))
            _assert_fp8_equal(q2, q, f"{what}: FP8 copy without the output")
            _assert_fp8_equal(q2_t, q_t, f"{what}: transposed copy without the output")


# ---- activation gradient + cast ----------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("case", ACT_CASES)
def test_dact_cast_is_the_unfused_gradient_and_cast(case):
    """dact_cast's FP8 gradient against torch's autograd of ``activate`` then the
    reference cast, for the inputs of the activation test; the bias gradient against
    the column sum."""
    activation, hp, recipe, f = case
    gated = ACTIVATIONS[activation][1]
    for label, m, specials in _inputs(ROWS):
        what = f"{activation} gradient {_DTYPE_ID[hp]} {recipe} [{m}, {f}], {label}"
        x = _sample((m, 2 * f if gated else f), hp, specials=specials and _exact(activation))
        dy = _sample((m, f), hp, scale=1.0)
        x_ref = x.clone().requires_grad_()
        activate(x_ref, activation).backward(dy)
        dx_ref = x_ref.grad
        scaling = _scaling(recipe)
        before = _copy(scaling)
        with _launches((1 if recipe == "delayed" else 2) if m else 0, what):
            q, q_t, scale_inv, dbias = _kernels()[2].dact_cast(
                x, dy, activation, E5M2, transpose=True, dbias_dtype=hp, **scaling)
        ref = _reference_cast(dx_ref, recipe, E5M2, before)
        finite_dx = dx_ref.float()[dx_ref.float().isfinite()]
        top = float(finite_dx.abs().max()) if finite_dx.numel() else 0.0
        if _exact(activation):
            _assert_copies(q, q_t, scale_inv, scaling, ref, recipe, what)
        else:   # the interpreter: 1 - tanh^2 from numpy's tanh; a check of the formulas
            for got, r in ((q, dx_ref), (q_t, dx_ref.t())):
                torch.testing.assert_close(got.float() * scale_inv, r.float(), rtol=0.3,
                                           atol=1e-2 * top, msg=what)
        assert dbias.dtype == hp and dbias.shape == (x.shape[1],), what
        ref_dbias = dx_ref.sum(0, dtype=torch.float32)
        finite = ref_dbias.isfinite()
        assert torch.equal(dbias.float()[~finite].nan_to_num(), ref_dbias[~finite].nan_to_num()), \
            f"{what}: bias gradient infinities/NaNs differ"
        _assert_column_sum(dbias, dx_ref, finite, what, hp,
                           slack=None if _exact(activation) else (0.3, 1e-4 * top))


@gpu_only
@pytest.mark.parametrize("case", [c for c in ACT_CASES
                                  if c.values[0][1] == F32 and c.values[0][0] not in EXACT_ANYWHERE])
def test_activation_and_gradient_bits_on_a_wide_row(case):
    """The activations whose arithmetic NOTE [Same arithmetic] repeats (exp, tanh,
    contracted multiply-adds), on one row of 4096 more values than the case (the same
    compiled variant): the output and the float32 gradient (one row: the bias gradient
    is the gradient plus +0) bit for bit torch's, and the gradient's FP8 copies, signed
    zeros included, over [-10, 10] and normal samples."""
    activation, hp, recipe, f = case
    gated = ACTIVATIONS[activation][1]
    width = f + 4096        # the row lengths and strides of the case, modulo 16
    n = 2 * width if gated else width
    x = torch.cat([torch.linspace(-10.0, 10.0, n // 2, device=DEVICE),
                   torch.randn(n - n // 2, device=DEVICE) * 3]).view(1, n)
    dy = torch.randn(1, width, device=DEVICE)
    what = f"{activation} fp32 {recipe}, one row of {n}"
    y, _, _, _ = _kernels()[1].act_cast(x, activation, E4M3, write_y=True, transpose=True,
                                        **_scaling(recipe))
    _assert_bits_equal(y, activate(x, activation), f"{what}: the activation")
    x_ref = x.clone().requires_grad_()
    activate(x_ref, activation).backward(dy)
    scaling = _scaling(recipe)
    before = _copy(scaling)
    q, q_t, scale_inv, dbias = _kernels()[2].dact_cast(x, dy, activation, E5M2, transpose=True,
                                                       dbias_dtype=F32, **scaling)
    # one row's bias gradient is the gradient added onto +0 (as torch's sum does: -0
    # becomes +0); the FP8 copies keep the gradient's signed zeros
    _assert_bits_equal(dbias, x_ref.grad.view(-1) + 0.0, f"{what}: the gradient")
    _assert_copies(q, q_t, scale_inv, scaling,
                   _reference_cast(x_ref.grad, recipe, E5M2, before), recipe, what)


# Inputs where torch's gradients are signed zeros: x far below 0 (tanh is -1, exp(-x)
# overflows: the derivative is exactly 0, the gradient a zero of dy's sign or the
# opposite), x = +-0, and output gradients +-0. The input of a gated form's activation
# is -0 only on a GPU: there relu(-0) is the max instruction in torch's kernel and in
# Triton's; under the interpreter it is numpy's maximum (+0), while torch's CPU max
# keeps -0.
_ZERO_X = (-200.0, -20.0, -1.0, 0.0, 1.0, 20.0) + ((-0.0,) if DEVICE == "cuda" else ())
_ZERO_DY = (1.0, -1.0, 0.0, -0.0)
_ZERO_GATE = (1.0, -1.0, 0.0, -0.0)


def _signed_zero_rows(f, gated):
    """Rows of ``f`` (gated: ``2f``) inputs and their ``dy``: every pair of `_ZERO_X`
    (non-gated: and -0) and `_ZERO_DY`, times every `_ZERO_GATE` value when gated, in
    row-major order, the last row filled up by repeating them."""
    xs = _ZERO_X + ((-0.0,) if not gated and -0.0 not in _ZERO_X else ())
    gates = _ZERO_GATE if gated else (1.0,)
    combos = [(a, d, b) for b in gates for a in xs for d in _ZERO_DY]
    rows = -(-len(combos) // f)
    a, dy, b = (torch.tensor([combos[i % len(combos)][k] for i in range(rows * f)]).view(rows, f)
                for k in range(3))
    x = torch.cat([a, b], dim=1) if gated else a
    return x.to(DEVICE), dy.to(DEVICE)


@needs_kernels
@pytest.mark.parametrize("case", [c for c in ACT_CASES if c.values[0][1] == F32])
def test_gradient_signed_zeros_are_torchs(case):
    """Where torch's float32 gradient is a signed zero (``dy * 0`` with ``dy``'s sign,
    ``-dy * 0``, ``+-0 * f'(x)``, ``0 + -0``), the kernel's is the same zero: its FP8
    copies (E5M2 keeps -0) are the reference cast's bit for bit there, and on a GPU
    (under the interpreter, for the ReLU family) everywhere. For the ReLU family, whose
    terms here are small integers (exact sums in any order), the bias gradient is
    torch's column sum bit for bit, both adding onto +0. Each case's compiled variant."""
    activation, hp, recipe, f = case
    gated = ACTIVATIONS[activation][1]
    x, dy = _signed_zero_rows(f, gated)
    x_ref = x.clone().requires_grad_()
    activate(x_ref, activation).backward(dy)
    grad = x_ref.grad
    zeros = grad == 0
    assert bool((zeros & grad.signbit()).any()) and bool((zeros & ~grad.signbit()).any()), \
        f"{activation}: the inputs must give torch gradients of both signed zeros"
    scaling = _scaling(recipe)
    before = _copy(scaling)
    q, q_t, scale_inv, dbias = _kernels()[2].dact_cast(x, dy, activation, E5M2, transpose=True,
                                                       dbias_dtype=hp, **scaling)
    ref = _reference_cast(grad, recipe, E5M2, before)
    what = f"{activation} gradient {recipe} {tuple(x.shape)}, signed zeros"
    at = _bits(ref[0].data) & 0x7F == 0                 # the reference copy's zeros
    assert bool(at[zeros].all()), f"{what}: the reference cast keeps torch's zeros"
    _assert_bits_equal(q[at], ref[0].data[at], f"{what}: FP8 copy at torch's zeros")
    _assert_bits_equal(q_t.t()[at], ref[0].data[at], f"{what}: transposed copy at the zeros")
    if _exact(activation):
        _assert_copies(q, q_t, scale_inv, scaling, ref, recipe, what)
    if activation in EXACT_ANYWHERE:
        _assert_bits_equal(dbias, grad.sum(0), f"{what}: bias gradient")


def _assert_column_sum(dbias, terms, columns, what, hp, slack=None):
    """``dbias``: the column sums of ``terms`` [m, W] added in float32 in some order and
    rounded once to ``hp``, against their float64 sums at ``columns``. Where each term is
    the kernel's own (torch's gradient bit for bit, NOTE [Same arithmetic]), a float32
    sum of m terms in any order lies within gamma(m - 1) * sum|terms| of the exact sum
    (gamma(k) = k u / (1 - k u), u the float32 unit roundoff: Higham, Accuracy and
    Stability of Numerical Algorithms, 4.2), and the rounding to ``hp`` adds at most
    ``u_hp`` of the result (or half an ``hp`` subnormal step). One row: the bias gradient
    is the gradient plus +0 (a sum starts at +0, as torch's does), bit for bit.
    ``slack = (relative, absolute)`` widens it where the terms differ (the interpreter's
    exp and tanh)."""
    m = terms.shape[0]
    exact = terms.double().sum(0)
    magnitude = terms.double().abs().sum(0)
    u = torch.finfo(torch.float32).eps / 2
    bound = (m - 1) * u / (1 - (m - 1) * u) * magnitude
    if slack is not None:
        bound = bound + slack[0] * magnitude + slack[1]
    if hp != torch.float32:
        info = torch.finfo(hp)
        bound = bound + info.eps / 2 * (exact.abs() + bound) + info.smallest_normal * info.eps / 2
    error = (dbias.double() - exact).abs()
    bad = columns & (error > bound)
    if bool(bad.any()):
        first = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: bias gradient beyond its bound at {int(bad.sum())} columns; first "
            f"{first}: {float(dbias[first])} vs {float(exact[first])} (float64), error "
            f"{float(error[first]):.3g} > bound {float(bound[first]):.3g}, {m} rows")


# ---- normalization + cast -------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("case", NORM_CASES)
def test_norm_cast_output_bound_and_cast_bits(case):
    """norm_cast's output within one ulp of ``normalize`` (float32: a few float32
    ulps); its FP8 copies, amax and ``scale_inv`` the reference cast of that output; the
    statistics those of a float64 computation to float32 rounding. One row, rows cut at
    a tile edge (finite, and with NaN and infinities), no rows."""
    normalization, zero_centered, hp, recipe, n = case
    w = (torch.randn(n, device=DEVICE) * 0.2 + (0.0 if zero_centered else 1.0)).to(hp)
    b = (torch.randn(n, device=DEVICE) * 0.1).to(hp) if normalization == "LayerNorm" else None
    for label, m, specials in _inputs((1, 37, 0)):
        what = f"{normalization} {_DTYPE_ID[hp]} {recipe} [{m}, {n}], {label}"
        x = (torch.randn(m, n, device=DEVICE) * 2 + 0.5).to(hp)
        if specials:            # a row with a NaN, a row with an infinity
            x[1, 3], x[4, n - 1] = float("nan"), float("inf")
        scaling = _scaling(recipe)
        before = _copy(scaling)
        with _launches((1 if recipe == "delayed" else 2) if m else 0, what):
            y, q, q_t, scale_inv, stats = _kernels()[0].norm_cast(
                x, w, b, normalization, 1e-5, zero_centered, hp, E4M3, write_y=True,
                transpose=True, **scaling)
        ref = normalize(x, w, b, normalization, 1e-5, zero_centered)
        _assert_close_hp(y, ref, hp, f"{what}: normalization",
                         ulps=1 if hp != F32 else 64)
        _assert_copies(q, q_t, scale_inv, scaling, _reference_cast(y, recipe, E4M3, before),
                       recipe, what)
        if not m:
            continue
        x64 = x.double()
        rstd = stats[-1].double().view(-1)
        if normalization == "LayerNorm":
            mean64 = x64.mean(-1)
            var64 = x64.var(-1, unbiased=False)
            assert torch.allclose(stats[0].double().view(-1), mean64, rtol=0, equal_nan=True,
                                  atol=float(4e-7 * x64[x64.isfinite()].abs().max())), \
                f"{what}: mean"
        else:
            var64 = x64.pow(2).mean(-1)
        rstd64 = (var64 + 1e-5).rsqrt()
        # a row torch normalizes to NaN throughout has NaN statistics (NOTE [Infinite
        # rows in RMSNorm] in kernels/norm_cast.py)
        rstd64[ref.float().isnan().all(-1)] = float("nan")
        assert torch.allclose(rstd, rstd64, rtol=1e-6, atol=0, equal_nan=True), \
            f"{what}: rstd {rstd.tolist()} vs {rstd64.tolist()}"
        if hp == BF16:          # without the high-precision output: the same FP8 bits
            _, q2, q2_t, _, _ = _kernels()[0].norm_cast(
                x, w, b, normalization, 1e-5, zero_centered, hp, E4M3, transpose=True,
                **_scaling(recipe))
            _assert_fp8_equal(q2, q, f"{what}: FP8 copy without the output")
            _assert_fp8_equal(q2_t, q_t, f"{what}: transposed copy without the output")


@needs_kernels
def test_rms_norm_infinite_rows_either_way():
    """RMSNorm rows holding an infinity, with ``infinity_is_nan`` off (torch's
    single-pass kernels: the finite elements normalize to 0, the infinity to NaN) and on
    (its two-kernel path: the row NaN throughout, rstd NaN); every other row bit for bit
    the same either way, each call's FP8 copies the cast of its output."""
    n = 33          # the variant of the fp16 RMSNorm case above
    w = (torch.randn(n, device=DEVICE) * 0.2).to(F16)
    x = (torch.randn(20, n, device=DEVICE) * 2 + 0.5).to(F16)
    x[2, 0], x[7, n - 1], x[11, 5], x[11, 6] = float("inf"), float("-inf"), float("inf"), 1e4
    x[15, 3] = float("nan")
    inf_rows = torch.zeros(20, dtype=torch.bool, device=DEVICE)
    inf_rows[[2, 7, 11]] = True
    ref = normalize(x, w, None, "RMSNorm", 1e-5, True)
    runs = {}
    for infinity_is_nan in (False, True):
        what = f"RMSNorm fp16 rows with infinities, infinity_is_nan={infinity_is_nan}"
        scaling = _scaling("delayed")
        before = _copy(scaling)
        y, q, q_t, scale_inv, stats = _kernels()[0].norm_cast(
            x, w, None, "RMSNorm", 1e-5, True, F16, E4M3, write_y=True, transpose=True,
            infinity_is_nan=infinity_is_nan, **scaling)
        _assert_copies(q, q_t, scale_inv, scaling, _reference_cast(y, "delayed", E4M3, before),
                       "delayed", what)
        rstd = stats[-1].view(-1)
        if infinity_is_nan:
            assert bool(y[inf_rows].isnan().all()) and bool(rstd[inf_rows].isnan().all()), what
        else:
            assert bool((rstd[inf_rows] == 0).all()), what
            assert torch.equal(y[inf_rows].isnan(), ~x[inf_rows].isfinite()), what
            assert bool((y[inf_rows][x[inf_rows].isfinite()] == 0).all()), what
        assert bool(y[15].isnan().all()) and bool(rstd[15].isnan()), f"{what}: NaN row"
        finite_rows = ~inf_rows
        _assert_close_hp(y[finite_rows], ref[finite_rows], F16, what)
        runs[infinity_is_nan] = (y[finite_rows], rstd[finite_rows])
    _assert_bits_equal(runs[True][0], runs[False][0], "finite rows, either way")
    _assert_bits_equal(runs[True][1], runs[False][1], "finite rows' rstd, either way")


@gpu_only
@pytest.mark.parametrize("n, offset, weight_offset", [
    pytest.param(36, 0, 0, id="single-pass"), pytest.param(36, 1, 0, id="unaligned-x"),
    pytest.param(36, 0, 1, id="unaligned-weight"), pytest.param(34, 0, 0, id="odd-row")])
def test_rms_norm_infinite_rows_follow_torch(n, offset, weight_offset):
    """norm_cast's default for rows with an infinity is torch's ``F.rms_norm`` of the
    same float32 operands: NaN where torch's two-kernel path runs (a row length not a
    multiple of 4, an operand not 16-byte aligned), 0 where its single-pass one does."""
    buf = torch.randn(8 * n + offset, device=DEVICE) * 2 + 0.5
    x = buf[offset:].view(8, n)
    x[3, n - 1] = float("inf")
    w = (torch.randn(n + weight_offset, device=DEVICE) * 0.2 + 1.0)[weight_offset:]
    ref = normalize(x, w, None, "RMSNorm", 1e-5, False)
    y, _, _, _, stats = _kernels()[0].norm_cast(x, w, None, "RMSNorm", 1e-5, False, F32, E4M3,
                                                write_y=True, **_scaling("delayed"))
    what = f"RMSNorm fp32 [8, {n}], x offset {offset}, weight offset {weight_offset}"
    _assert_close_hp(y, ref, F32, what, ulps=64)
    expect_nan = _kernels()[0].rms_norm_infinity_is_nan(x, w, False)
    assert bool(ref[3].isnan().all()) == expect_nan, f"{what}: torch's path is not the rule's"


@needs_kernels
@pytest.mark.parametrize("normalization, zero_centered, hp", [
    pytest.param("LayerNorm", False, F32, id="ln-fp32"),
    pytest.param("RMSNorm", False, BF16, id="rms-bf16"),
    pytest.param("LayerNorm", True, F16, id="ln-zero-centered-fp16")])
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
    tol = {F32: 1e-4, BF16: 2e-2, F16: 4e-3}[hp]
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


# ---- the casts of quantize.py on the kernels (kernels/casts.py) ------------------------
@needs_kernels
@pytest.mark.parametrize("hp, qparams, shape", [
    pytest.param(F32, (False, 0.0), (1, 48), id="smoke-fp32-plain-1x48"),
    pytest.param(BF16, (True, 0.0), (100, 37), id="bf16-pow2-100x37"),
    pytest.param(F16, (False, 1.0), (333, 1040), id="fp16-epsilon-333x1040"),
    pytest.param(F32, (True, 0.0), (77, 200), id="fp32-pow2-77x200")])
def test_current_cast_bits_and_launches(hp, qparams, shape):
    """`quantize.current_scaling_cast` fused: the bits of amax -> current_scale -> cast,
    in two launches; a non-finite amax is counted on the device (finite input, then
    one with an infinity)."""
    power_2, epsilon = qparams
    for specials in (False, True):
        what = f"current cast {_DTYPE_ID[hp]} {shape}{' with inf' if specials else ''}"
        x = _sample(shape, hp)
        if specials:
            x[-1, -1] = float("inf")
        counts = [torch.zeros((), dtype=torch.int32, device=DEVICE) for _ in range(2)]
        with _launches(2, what):
            q, q_t = quantize.current_scaling_cast(x, E4M3, power_2, epsilon, counts[0], True,
                                                   True)
        with kernel_config(fused=False):
            r, r_t = quantize.current_scaling_cast(x, E4M3, power_2, epsilon, counts[1], True,
                                                   True)
        _assert_fp8_equal(q.data, r.data, f"{what}: FP8 copy")
        _assert_fp8_equal(q_t.data, r_t.data, f"{what}: transposed FP8 copy")
        assert torch.equal(q.scale_inv, r.scale_inv) and q_t.scale_inv is q.scale_inv, what
        assert torch.equal(counts[0], counts[1]) and int(counts[0]) == int(specials), what


@needs_kernels
@pytest.mark.parametrize("hp", [pytest.param(F32, id="smoke-fp32"), pytest.param(BF16, id="bf16")])
def test_one_row_delayed_casts(hp):
    """A one-row input whose row length is a multiple of 16 (a single token), cast with
    its transposed copy, alone and paired with a weight, as the torch ops cast it."""
    x, w = _sample((1, 48), hp), _sample((64, 48), hp)
    scale = torch.tensor([0.5, 3.0, 0.25], device=DEVICE)
    states = [torch.full((2, 3), 1e-20, device=DEVICE) for _ in range(3)]
    q, q_t = quantize.cast_transpose_unchecked(x, scale, E4M3, 1, states[0], True, True)
    (qx, qx_t), _ = quantize.cast_pair_unchecked(x, w, scale, E4M3, 1, states[1], True, True)
    with kernel_config(fused=False):
        r, r_t = quantize.cast_transpose_unchecked(x, scale, E4M3, 1, states[2], True, True)
    for got, ref, what in ((q, r, "one-row cast"), (q_t, r_t, "one-row transposed cast"),
                           (qx, r, "paired one-row cast"),
                           (qx_t, r_t, "paired one-row transposed cast")):
        _assert_fp8_equal(got.data, ref.data, what)
    assert torch.equal(states[0], states[2]) and torch.equal(states[1][:, 1], states[2][:, 1])


@gpu_only
def test_current_scaling_casts_do_not_synchronize():
    """No host synchronisation in the current-scaling casts and producers (the
    variants of the cases above: no compilation here)."""
    norm_cast, act_cast, dact_cast = _kernels()
    x = _sample((40, 37), BF16)
    xn = _sample((40, 48), BF16)
    w = torch.ones(48, device=DEVICE, dtype=BF16)
    xa, dy = _sample((40, 400), F32), _sample((40, 200), F32)
    counter = torch.zeros((), dtype=torch.int32, device=DEVICE)
    for _ in range(2):          # compiled, then the direct launches
        torch.cuda.synchronize()
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            quantize.current_scaling_cast(x, E4M3, True, 0.0, counter, True, True)
            norm_cast.norm_cast(xn, w, w, "LayerNorm", 1e-5, True, BF16, E4M3,
                                non_finite=counter, write_y=True, transpose=True)
            act_cast.act_cast(xa, "geglu", E4M3, non_finite=counter, write_y=True,
                              transpose=True)
            dact_cast.dact_cast(xa, dy, "geglu", E5M2, non_finite=counter, transpose=True,
                                dbias_dtype=F32)
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def test_unwritten_register_scan():
    """`launch.undefined_registers` finds the registers a PTX body reads and never
    writes (as in the PTX ptxas miscompiled), and nothing in a clean body."""
    pytest.importorskip("transformer_engine.pytorch.kernels.launch")
    from transformer_engine.pytorch.kernels.launch import undefined_registers
    bad = """
        cvt.rn.satfinite.e4m3x2.f32  %rs4, %r159, %r158;
        mov.b32 	%r383, {%rs4, %rs52};
        prmt.b32 	%r391, %r390, %r392, 0x3340U;
        @%p18 st.global.b8 [ %rd98 + 0 ], { %rs17 };
        setp.lt.s32 	%p1|%p2, %r1, %r2;
    """
    assert undefined_registers(bad) == ["%p18", "%r1", "%r158", "%r159", "%r2", "%r390",
                                        "%r392", "%rd98", "%rs17", "%rs52"]
    clean = """
        mov.u32 	%r1, %tid.x;   // a comment %r9
        mov.u64 	%rd2, %clock64;
        ld.global.b32 { %r2 }, [ %rd1 + 0 ];
        @%p1 st.global.b8 [%rd1], %r2;
        mov.b32 	{%rs1, %rs2}, %r2;
        shfl.sync.bfly.b32	%r3|%p2, %r1, 1, 31, -1;
        atom.global.gpu.acq_rel.max.s32 %r4, [ %rd1 + 0 ], %r3;
    $L__BB0_2:
        bra.uni 	$L__BB0_2;
    """
    assert undefined_registers(clean) == ["%p1", "%rd1"]


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
    """(activation, recipe) of the LayerNormMLP runs: the kernel cases above cover every
    activation; these check the wiring (under the interpreter: exact ones)."""
    if DEVICE == "cuda":
        return [pytest.param("gelu", "delayed", id="gelu-delayed"),
                pytest.param("swiglu", "current", id="swiglu-current"),
                pytest.param("srelu", "delayed", id="srelu-delayed")]
    return [pytest.param("relu", "delayed", id="relu-delayed"),
            pytest.param("sreglu", "current", id="sreglu-current")]


@needs_kernels
@pytest.mark.parametrize("normalization, recipe", [
    pytest.param("LayerNorm", "delayed", id="smoke-LayerNorm-delayed"),
    pytest.param("RMSNorm", "current", id="RMSNorm-current")])
def test_layernorm_linear_fused_equals_unfused(normalization, recipe, monkeypatch):
    make = lambda: te.LayerNormLinear(64, 48, normalization=normalization,  # noqa: E731
                                      params_dtype=torch.bfloat16, device=DEVICE)
    calls = _compare_fused(make, recipe, (2, 16, 64), torch.bfloat16, monkeypatch)
    assert calls == {"norm": 2, "act": 0, "dact": 0}


@needs_kernels
@pytest.mark.parametrize("activation, recipe", _module_activations())
def test_layernorm_mlp_fused_equals_unfused(activation, recipe, monkeypatch):
    make = lambda: te.LayerNormMLP(64, 96, activation=activation,  # noqa: E731
                                   params_dtype=torch.bfloat16, device=DEVICE)
    calls = _compare_fused(make, recipe, (32, 64), torch.bfloat16, monkeypatch,
                           skip_grads=("fc1_bias",))
    assert calls == {"norm": 2, "act": 2, "dact": 2}


@needs_kernels
@pytest.mark.parametrize("recipe", RECIPES)
def test_refused_producer_kernels_take_the_unfused_path(recipe, monkeypatch):
    """A producer kernel whose specialization is refused (NOTE [Suspect compiles] in
    kernels/launch.py) is never launched: the normalization runs unfused, and the
    activation's forward and backward take the unfused path's ops and casts inside the
    fused Function. The run equals the unfused one bit for bit, FP8 state included."""
    from transformer_engine.pytorch.kernel_config import SuspectCompile
    from transformer_engine.pytorch.kernels import launch
    refused = {"_norm_cast_kernel", "_act_cast_kernel", "_dact_cast_kernel"}
    real_call = launch.Launcher.__call__
    attempts = []

    def refusing(self, grid, num_warps, key, *args):
        if self.kernel.__name__ in refused:
            attempts.append(self.kernel.__name__)
            raise SuspectCompile(self.kernel.__name__)
        return real_call(self, grid, num_warps, key, *args)

    activation = "gelu" if DEVICE == "cuda" else "relu"
    make = lambda: te.LayerNormMLP(64, 96, activation=activation,  # noqa: E731
                                   params_dtype=torch.bfloat16, device=DEVICE)
    torch.manual_seed(3)
    model, ref_model = make(), make()
    ref_model.load_state_dict(model.state_dict())
    monkeypatch.setattr(launch.Launcher, "__call__", refusing)
    outputs, run = _train(model, _recipe(recipe), 2, (32, 64), torch.bfloat16, True)
    assert sorted(set(attempts)) == sorted(refused), "the fused path was not attempted"
    monkeypatch.setattr(launch.Launcher, "__call__", real_call)
    ref_outputs, ref_run = _train(ref_model, _recipe(recipe), 2, (32, 64), torch.bfloat16,
                                  False)
    for a, b in zip(outputs, ref_outputs):
        assert torch.equal(_bits(a), _bits(b)), "outputs differ"
    assert_runs_equal(ref_run, run, "refused producers against unfused,")


@needs_kernels
@pytest.mark.parametrize("recipe", RECIPES)
def test_clamped_swiglu_activation_runs_unfused(recipe, monkeypatch):
    """The kernels implement the activations without parameters: with "clamped_swiglu"
    the normalization is fused and the activation and its gradient run unfused (torch's
    ops, then the cast), giving the fully unfused run bit for bit."""
    make = lambda: te.LayerNormMLP(64, 96, activation="clamped_swiglu",  # noqa: E731
                                   activation_params={"limit": 0.5, "alpha": 1.702},
                                   params_dtype=torch.bfloat16, device=DEVICE)
    calls = _compare_fused(make, recipe, (32, 64), torch.bfloat16, monkeypatch)
    assert calls == {"norm": 2, "act": 0, "dact": 0}


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
@pytest.mark.parametrize("recipe, dtype", [
    pytest.param("delayed", F32, id="smoke-delayed-fp32"),
    pytest.param("current", BF16, id="current-bf16")])
def test_transformer_layer_fused_equals_unfused(recipe, dtype, monkeypatch):
    """A whole layer (float32 parameters, as te.TransformerLayer's default, and
    bfloat16) fused against unfused."""
    activation = "gelu" if DEVICE == "cuda" else "relu"
    make = lambda: te.TransformerLayer(64, 128, 4, hidden_dropout=0.0,  # noqa: E731
                                       attention_dropout=0.0, activation=activation,
                                       params_dtype=dtype, device=DEVICE)
    calls = _compare_fused(make, recipe, (16, 2, 64), dtype, monkeypatch,
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
    declarations agree with the kernels (``torch.library.opcheck``), each op once, an
    amax history or a non-finite counter mutated."""
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
        (ns.act_cast, (x, "gelu", E4M3, None, 0, None, False, 1e-3, counter(), False, True,
                       False)),
        (ns.dact_cast, (x, x[:, :32].contiguous(), "geglu", E5M2, scale, 0, history(), False,
                        0.0, None, True, True, True, torch.bfloat16)),
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


# ---- last: what every kernel compiled above was compiled to ------------------------
@gpu_only
def test_compiled_kernels_read_no_unwritten_registers():
    """The PTX of every kernel this process compiled (the module runs last, after the
    cases above) reads only registers it writes: the code ptxas miscompiled (NOTE [FP8
    stores] in kernels/common.py) was not produced."""
    from transformer_engine.pytorch.kernels import launch
    assert launch.suspect_compiles() == []
