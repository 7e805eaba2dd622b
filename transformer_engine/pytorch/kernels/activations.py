"""The activations of te.LayerNormMLP and their gradients, as Triton functions of
float32 values, for the fused activation casts (`act_cast.py`, `dact_cast.py`).

NOTE [Same arithmetic]
    The unfused path (`module/layernorm_mlp.py`'s ``activate`` and autograd) computes an
    activation with torch's CUDA kernels: in float32 (16-bit inputs widened), each
    torch op rounding its float32 result once, and nvcc contracting each ``a * b + c``
    *inside* one op's kernel into a fused multiply-add (it builds with ``--fmad=true``;
    where both addends of a sum are products, the backend contracts the first addend's
    product, as LLVM's NVPTX combine tries the first operand before the second).
    The functions below repeat those operations in the same order: one float32
    rounding where torch stores a float32 tensor between two ops, ``tl.fma`` exactly
    where nvcc contracts inside one op, ``tl.div_rn`` for an IEEE division, libdevice's
    ``expf`` and ``tanhf`` (what CUDA's ``expf`` / ``tanhf`` compile to). The kernels that
    use them are compiled with ``enable_fp_fusion=False``, so Triton contracts nothing
    else. With the same float32 value before the last rounding to the output dtype, the
    fused output equals torch's bit for bit, and so does its FP8 cast
    (tests/pytorch/test_fused_producers.py checks every activation and dtype on a GPU).
    That includes signed zeros: with the same operations in the same order, IEEE
    rules give the same zero (``dy * +0`` has ``dy``'s sign; ``+0 + -0``, also inside
    an FMA, is +0; ``threshold_backward`` writes +0), checked on the CPU too through
    the gradients' FP8 copies, which keep -0.
    The gradients follow torch's autograd: a gated ``f(a) * b`` gives ``db = g * f(a)``
    and ``da = f'(a; g * b)``; the grad of ``x * sigmoid(1.702 x)`` sums its two paths
    with one float32 addition. Under the Triton interpreter ``exp`` and ``tanh`` are
    numpy's and ``tl.fma`` rounds twice, so there the values agree with torch's only
    within a few ulps (the FP8 copy still equals the cast of the value written).

The constants are torch's: ``kBeta = float(sqrt(2) * 2/sqrt(pi) * 0.5)`` (the product
in double, rounded once), ``kKappa = float(0.044715)``, ``3 * kKappa`` rounded in
float32, ``1.702`` rounded to float32.
"""

from __future__ import annotations

import math
import struct

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

from .launch import INTERPRET

__all__ = ["ACTIVATION_CODES", "activation_code"]

# name -> (function code, gated): the activations of module/layernorm_mlp.py
ACTIVATION_CODES = {
    "gelu": (0, False), "geglu": (0, True),
    "relu": (1, False), "reglu": (1, True),
    "srelu": (2, False), "sreglu": (2, True),
    "silu": (3, False), "swiglu": (3, True),
    "qgelu": (4, False), "qgeglu": (4, True),
    "glu": (5, True),
}


def _f32(v: float) -> float:
    """``v`` rounded to float32 (to nearest even), as a Python float."""
    return struct.unpack("f", struct.pack("f", v))[0]


# (a product of two float32 values is exact in double, so _f32 rounds it once)
_CONSTANTS = {"beta": _f32(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5),
              "kappa": _f32(0.044715), "3kappa": _f32(3.0 * _f32(0.044715)),
              "qgelu": _f32(1.702)}


def activation_code(activation: str):
    """``(code, gated)`` of an activation name (a key of `ACTIVATION_CODES`)."""
    return ACTIVATION_CODES[activation]


if triton is not None:
    _K_BETA = tl.constexpr(_CONSTANTS["beta"])
    _K_KAPPA = tl.constexpr(_CONSTANTS["kappa"])
    _K_3KAPPA = tl.constexpr(_CONSTANTS["3kappa"])
    _QGELU = tl.constexpr(_CONSTANTS["qgelu"])

    if INTERPRET:
        @triton.jit
        def _exp(x):
            return tl.exp(x)

        @triton.jit
        def _tanh(x):
            return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
    else:
        from triton.language.extra.cuda import libdevice

        @triton.jit
        def _exp(x):
            return libdevice.exp(x)

        @triton.jit
        def _tanh(x):
            return libdevice.tanh(x)

    @triton.jit
    def _sigmoid(x):
        # torch: 1 / (1 + exp(-x))
        return tl.div_rn(1.0, 1.0 + _exp(-x))

    @triton.jit
    def _relu(x):
        # torch's clamp_min(x, 0): NaN kept, else max(x, 0)
        return tl.where(x != x, x, tl.maximum(x, 0.0))

    @triton.jit
    def act_fwd(x, ACT: tl.constexpr):
        """The float32 value of activation ``ACT`` at float32 ``x`` (NOTE [Same
        arithmetic])."""
        if ACT == 0:        # gelu, tanh approximation: one torch kernel
            x3 = x * x * x
            inner = _K_BETA * tl.fma(_K_KAPPA, x3, x)
            y = (0.5 * x) * (1.0 + _tanh(inner))
        elif ACT == 1:      # relu
            y = _relu(x)
        elif ACT == 2:      # srelu: relu, then square (x * x)
            r = _relu(x)
            y = r * r
        elif ACT == 3:      # silu: x / (1 + exp(-x)), one kernel
            y = tl.div_rn(x, 1.0 + _exp(-x))
        elif ACT == 4:      # qgelu: x * sigmoid(1.702 * x), three kernels
            y = x * _sigmoid(x * _QGELU)
        else:               # sigmoid (the gate of glu)
            y = _sigmoid(x)
        return y

    @triton.jit
    def act_bwd(g, x, ACT: tl.constexpr):
        """d act(x) for the float32 output gradient ``g`` at float32 ``x``, as torch's
        backward of `act_fwd` computes it (NOTE [Same arithmetic])."""
        if ACT == 0:        # gelu_backward, one kernel
            x_sq = x * x
            x_cube = x_sq * x
            inner = _K_BETA * tl.fma(_K_KAPPA, x_cube, x)
            t = _tanh(inner)
            left = 0.5 * x
            tanh_derivative = tl.fma(-t, t, 1.0)
            inner_derivative = _K_BETA * tl.fma(_K_3KAPPA, x_sq, 1.0)
            right_derivative = (left * tanh_derivative) * inner_derivative
            # left_derivative + right_derivative, left_derivative = 0.5 * (1 + t): the
            # first addend's product is the one contracted
            dx = g * tl.fma(0.5, 1.0 + t, right_derivative)
        elif ACT == 1:      # threshold_backward(g, relu(x), 0)
            dx = tl.where(_relu(x) <= 0.0, 0.0, g)
        elif ACT == 2:      # pow_backward: g * (2 * r); then threshold_backward at r
            r = _relu(x)
            dx = tl.where(r <= 0.0, 0.0, g * (r * 2.0))
        elif ACT == 3:      # silu_backward, one kernel
            s = tl.div_rn(1.0, 1.0 + _exp(-x))
            dx = (g * s) * tl.fma(x, 1.0 - s, 1.0)
        elif ACT == 4:      # x * s, s = sigmoid(t), t = 1.702 x
            s = _sigmoid(x * _QGELU)
            direct = g * s
            ds = g * x
            dt = (ds * (1.0 - s)) * s                  # sigmoid_backward(ds, s)
            dx = direct + dt * _QGELU
        else:               # sigmoid_backward(g, sigmoid(x))
            s = _sigmoid(x)
            dx = (g * (1.0 - s)) * s
        return dx
