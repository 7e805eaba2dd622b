"""Stateless FP8 math: saturating casts, amax, and the FP8 GEMM (the delayed-scaling
formulas are in `delayed_scaling.py`).

Nothing here reads or writes FP8 global state; `fp8.py` decides *which* scale to
use and *where* an amax is recorded, the module files decide *what* is cast.

NOTE [Fused casts]
    On CUDA, when Triton imports and the fused kernels are on (NOTE [Kernel
    selection] in kernel_config.py), `amax`, `cast_to_fp8`, `cast_transpose_to_fp8`,
    `current_scaling_cast` and `delayed_scaling_update_` run the kernels of
    `kernels/casts.py`: one pass over a tensor folds its amax into the amax-history
    slot, casts it with the delayed scale, writes ``scale_inv`` and, for the backward
    GEMMs, the transposed FP8 copy too; current scaling takes two launches (the amax,
    then the scale and the cast), with no host synchronisation; one launch updates the
    delayed-scaling state of all modules of an update. A cast's outputs come from one
    allocation (two when both FP8 copies are made: `kernels.common.cast_outputs`).
    Otherwise (CPU, no Triton, or switched off) the torch reference ops below run.
    Both compute the same bits; tests/pytorch/test_triton_kernels.py checks it on a
    GPU. The CPU path never imports Triton.

NOTE [CPU FP8 GEMM]
    An FP8 x FP8 product is exact in float32 (a 4-bit by 4-bit significand product
    needs 8 bits), and every E4M3/E5M2 value is exact in float32, so a float32 GEMM
    on the operands upcast from FP8, scaled by ``scale_inv_a * scale_inv_b``, is a
    faithful FP8 GEMM with float32 accumulation, as ``torch._scaled_mm`` computes it.
    On the CPU that is the default (``"upcast"``): ``torch._scaled_mm`` there goes to
    oneDNN, which on some CPUs (Intel Xeons with AMX) runs E4M3 x E4M3 on a reference
    kernel about 1,000x slower than float32 (measured: 1.6 s against 1.3 ms for the
    upcast at 2048x128x384); the upcast was also faster for E4M3 x E5M2 and E5M2 x
    E4M3 on every shape measured (``benchmarks/bench_cpu_gemm.py``). The choice is a
    fixed setting, not a timing probe, so that two processes on one machine compute
    the same bits. ``KernelConfig.cpu_gemm="scaled_mm"`` (``NVTE_CPU_FP8_GEMM``) selects
    ``torch._scaled_mm`` instead, through the same padding as on CUDA
    (`scaled_mm_padded`); both are tested against a float64 reference.

NOTE [GEMM vocabulary]
    For a linear layer ``y = x W^T`` (x: [M, K], W: [N, K], y: [M, N]):
    forward  ``y     = x  @ W^T``  (x, W in the forward FP8 type)
    dgrad    ``dx    = dy @ W``    (dy in the backward FP8 type)
    wgrad    ``dW    = dy^T @ x``
    Every FP8 GEMM here is written ``a @ b^T`` with both operands row-major
    ``[rows, K]``; `fp8_gemm` hands ``b`` to ``torch._scaled_mm`` column-major.

    Shapes: NOTE [FP8 shapes] in fp8_shapes.py.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from .fp8_shapes import (FP8_HEIGHT_MULTIPLE, FP8_WIDTH_MULTIPLE, Float8Data,
                         check_fp8_matrix, check_gemm_shape, scaled_mm_padded)
from .function_results import add_into, cast_to, mul_into
from .kernel_config import SuspectCompile, get_kernel_config, load_kernels

__all__ = [
    "Float8Data", "FP8_DTYPES", "fp8_max", "amax", "cast_to_fp8", "cast_transpose_to_fp8",
    "cast_transpose_unchecked", "current_scale", "current_scaling_cast", "fp8_gemm",
    "fp8_gemm_unchecked", "upcast_gemm", "scaled_mm_padded", "check_fp8_matrix", "check_gemm_shape",
    "FP8_HEIGHT_MULTIPLE", "FP8_WIDTH_MULTIPLE", "fused_kernels", "transpose_fp8",
    "cast_pair_unchecked", "fused_or_none",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_GEMM_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP32_MAX = torch.finfo(torch.float32).max
_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# ---- dispatch to the fused kernels (NOTE [Fused casts]) ---------------------------
_kernels_module = None      # kernels.casts once loaded; False when Triton is missing
# whether Triton's interpreter may run kernels on CPU tensors (read once: the CPU path
# pays nothing for KernelConfig.interpret when it cannot apply)
_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fused_kernels(x: torch.Tensor, dtypes: Tuple[torch.dtype, ...] = _HP_DTYPES):
    """The Triton cast kernels module (`kernels.casts`) if ``x`` (of one of ``dtypes``)
    should take the fused path, else None. CPU tensors take it only under
    ``KernelConfig.interpret`` (tests without a GPU)."""
    global _kernels_module
    if not ((x.is_cuda or (_INTERPRETER and get_kernel_config().interpret))
            and x.dtype in dtypes and x.numel() > 0 and get_kernel_config().fused) \
            or torch.compiler.is_compiling():
        return None         # compiled: the reference ops, for Inductor (NOTE [torch.compile])
    if _kernels_module is None:
        _kernels_module = (load_kernels("casts") or (False,))[0]
    return _kernels_module or None


def fused_or_none(call, *args, **kwargs):
    """``call(*args, **kwargs)`` (a fused kernel's wrapper), or None where its
    kernel's specialization was refused before it wrote anything (NOTE [Suspect
    compiles] in kernels/launch.py): the caller then takes the torch path."""
    try:
        return call(*args, **kwargs)
    except SuspectCompile:
        return None


def transpose_fp8(q: Float8Data) -> Float8Data:
    """``q.t_contiguous()`` of 2-D FP8 data, bit for bit (the dgrad and wgrad operands,
    NOTE [GEMM vocabulary]), in one Triton pass on CUDA."""
    kernels = fused_kernels(q.data, FP8_DTYPES)
    if kernels is not None and q.data.dim() == 2 and q.data.is_contiguous():
        data_t = fused_or_none(kernels.transpose, q.data)
        if data_t is not None:
            return Float8Data(data_t, q.scale_inv)
    return q.t_contiguous()


def _fused_scale_ok(scale: torch.Tensor, x: torch.Tensor) -> bool:
    return scale.dtype == torch.float32 and scale.numel() == 1 and scale.device == x.device


def _fused_state_ok(x: torch.Tensor, scale: torch.Tensor,
                    amax_history: Optional[torch.Tensor]) -> bool:
    """Whether a scale vector and amax history can go to the fused cast of ``x``:
    float32 (as the states make them), contiguous, on ``x``'s device."""
    return (scale.dtype == torch.float32 and scale.is_contiguous() and scale.device == x.device
            and (amax_history is None or amax_history.is_contiguous()))


_FP8_MAX = {dtype: torch.finfo(dtype).max for dtype in FP8_DTYPES}


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    found = _FP8_MAX.get(dtype)
    return found if found is not None else torch.finfo(dtype).max


def _no_grad(x: torch.Tensor) -> torch.Tensor:
    """``x``, detached only where autograd could record the ops about to run on it
    (``detach`` is an op and a new tensor, on every cast of the modules, which run
    their casts with grad mode off)."""
    return x.detach() if x.requires_grad and torch.is_grad_enabled() else x


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` as a float32 scalar tensor (0 for an empty tensor)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    kernels = fused_kernels(x)
    if kernels is not None and x.is_contiguous():
        found = fused_or_none(kernels.amax, x)      # reads the data only: no autograd
        if found is not None:
            return found
    return _no_grad(x).abs().amax().to(torch.float32)


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Float8Data:
    """Quantize ``x`` with ``scale``: ``fp8(clamp(x * scale, -max, max))``.

    Saturating: a value beyond the range becomes +-max, never inf (NaN stays NaN).
    ``scale`` is a one-element float32 tensor; ``scale_inv`` is a fresh tensor, so
    later scale updates do not change the meaning of the returned data.
    """
    if dtype not in FP8_DTYPES:
        raise TypeError(f"cast_to_fp8: dtype must be one of {FP8_DTYPES}, got {dtype}")
    kernels = fused_kernels(x)
    if kernels is not None and x.dim() >= 1 and _fused_scale_ok(scale, x):
        x2d = x.detach().reshape(-1, x.shape[-1])
        out = fused_or_none(kernels.cast_transpose, x2d, scale, dtype)
        if out is not None:
            return Float8Data(out[0].view(x.shape), out[2])
    return _cast_reference(x, scale, dtype)


def _cast_reference(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Float8Data:
    """The torch ops that define the cast (NOTE [Fused casts])."""
    limit = fp8_max(dtype)
    scaled = _no_grad(x).to(torch.float32) * scale
    data = torch.clamp(scaled, -limit, limit).to(dtype)
    scale_inv = torch.reciprocal(scale.to(torch.float32))
    return Float8Data(data, scale_inv if scale_inv.dim() == 1 else scale_inv.reshape(1))


def cast_transpose_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *,
                          index: int = 0, amax_history: Optional[torch.Tensor] = None,
                          data: bool = True, transpose: bool = False
                          ) -> Tuple[Optional[Float8Data], Optional[Float8Data]]:
    """Cast a 2-D ``x [M, N]`` to FP8 with ``scale[index]`` and return ``(x_fp8 [M, N],
    x_fp8^T [N, M])``, each None unless asked for by ``data`` / ``transpose``; both
    share one fresh ``scale_inv``. The transposed copy is what the dgrad/wgrad GEMMs
    take (NOTE [GEMM vocabulary]).

    Parameters
    ----------
    scale : 1-D float32 tensor; element ``index`` is the scale.
    amax_history : float32 tensor, optional
        ``[L, n]`` (or ``[n]``): ``max|x|`` is folded into row 0, column ``index``
        (max with what it holds), as `ScalingState.record_amax` does.

    On CUDA all of this is one pass over ``x`` (NOTE [Fused casts]); the values are
    those of `amax`, `cast_to_fp8` and a transposed copy.
    """
    api = "cast_transpose_to_fp8"
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{api}: dtype must be one of {FP8_DTYPES}, got {dtype}")
    if x.dim() != 2:
        raise ValueError(f"{api}: x must be 2-D [M, N], got shape {tuple(x.shape)}; "
                         "reshape it to [-1, last_dim] first")
    if not 0 <= index < scale.numel():
        raise ValueError(f"{api}: index {index} is out of range for a scale of "
                         f"{scale.numel()} element(s)")
    if amax_history is not None and (
            amax_history.dtype != torch.float32 or amax_history.dim() not in (1, 2)
            or index >= amax_history.shape[-1] or amax_history.device != x.device):
        raise ValueError(f"{api}: amax_history must be a float32 [L, n] or [n] tensor on "
                         f"{x.device} with n > index={index}, got {amax_history.dtype} of shape "
                         f"{tuple(amax_history.shape)} on {amax_history.device}")
    return cast_transpose_unchecked(x, scale, dtype, index, amax_history, data, transpose)


def cast_transpose_unchecked(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                             index: int, amax_history: Optional[torch.Tensor], data: bool,
                             transpose: bool, views=None
                             ) -> Tuple[Optional[Float8Data], Optional[Float8Data]]:
    """`cast_transpose_to_fp8` without its argument checks, for the modules, which
    build the arguments themselves (the host cost of a small step matters).
    ``views``: an object whose ``cast_views(index)`` gives ``(scale[index:index + 1],
    amax_history[0, index])`` made once (`scaling.ScalingState`), for the reference
    path."""
    kernels = fused_kernels(x)
    out = None
    if kernels is not None and _fused_state_ok(x, scale, amax_history):
        out = fused_or_none(kernels.cast_transpose, x, scale, dtype, index=index,
                            amax_history=amax_history, data=data, transpose=transpose)
    if out is not None:
        q, q_t, scale_inv = out
        return (Float8Data(q, scale_inv) if data else None,
                Float8Data(q_t, scale_inv) if transpose else None)
    if views is not None:
        scale, slot = views.cast_views(index)
        if amax_history is not None:
            torch.maximum(slot, amax(x), out=slot)
        q = _cast_reference(x, scale, dtype)
        return (q if data else None), (transpose_fp8(q) if transpose else None)
    if amax_history is not None:
        slot = amax_history[0, index] if amax_history.dim() == 2 else amax_history[index]
        torch.maximum(slot, amax(x), out=slot)
    if scale.dim() != 1:
        scale = scale.reshape(-1)
    if index != 0 or scale.shape[0] != 1:       # a one-element scale is its own slice
        scale = scale[index:index + 1]
    q = _cast_reference(x, scale, dtype)
    return (q if data else None), (transpose_fp8(q) if transpose else None)


def cast_pair_unchecked(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                        dtype: torch.dtype, index: int, amax_history: Optional[torch.Tensor],
                        transpose_x: bool, transpose_w: bool, views=None):
    """`cast_transpose_unchecked` of a GEMM's two forward operands, ``x`` with
    ``scale[index]`` and ``w`` with ``scale[index + 1]`` (their amaxes into those
    slots): ``((x_fp8, x_fp8^T or None), (w_fp8, w_fp8^T or None))``. On CUDA one
    launch for both (a te.Linear forward pays one launch less); the same bits as two
    casts."""
    kernels = fused_kernels(x)
    out = None
    if (kernels is not None and fused_kernels(w) is not None and w.device == x.device
            and _fused_state_ok(x, scale, amax_history)):
        out = fused_or_none(kernels.cast_pair, x, w, scale, dtype, index, index + 1,
                            amax_history, transpose_x, transpose_w)
    if out is not None:
        (qx, qx_t, inv_x), (qw, qw_t, inv_w) = out
        return ((Float8Data(qx, inv_x), Float8Data(qx_t, inv_x) if transpose_x else None),
                (Float8Data(qw, inv_w), Float8Data(qw_t, inv_w) if transpose_w else None))
    return (cast_transpose_unchecked(x, scale, dtype, index, amax_history, True, transpose_x,
                                     views),
            cast_transpose_unchecked(w, scale, dtype, index + 1, amax_history, True,
                                     transpose_w, views))


def current_scaling_cast(x: torch.Tensor, dtype: torch.dtype, power_2_scale: bool,
                         amax_epsilon: float, non_finite: Optional[torch.Tensor],
                         data: bool = True, transpose: bool = False):
    """`cast_transpose_unchecked` of a 2-D ``x`` with current scaling (`current_scale`
    of its own amax); non-finite amaxes add to ``non_finite``. On CUDA two launches
    (NOTE [Fused casts])."""
    kernels = fused_kernels(x)
    out = None if kernels is None else fused_or_none(
        kernels.current_cast, x, dtype, power_2_scale, amax_epsilon, non_finite, data,
        transpose)
    if out is not None:
        q, q_t, scale_inv = out
        return (Float8Data(q, scale_inv) if data else None,
                Float8Data(q_t, scale_inv) if transpose else None)
    scale = current_scale(amax(x), dtype, power_2_scale, amax_epsilon, non_finite=non_finite)
    return cast_transpose_unchecked(x, scale, dtype, 0, None, data, transpose)


def current_scale(amax_value: torch.Tensor, dtype: torch.dtype, power_2_scale: bool = False,
                  amax_epsilon: float = 0.0,
                  non_finite: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scale of current scaling: ``fp8_max / max(amax, amax_epsilon)`` (1 where that is
    0 or not finite), clamped to the float32 range and, with ``power_2_scale``, rounded
    down to a power of two (mantissa bits zeroed: the scale is a positive normal float32,
    at least ``fp8_max / FP32_MAX``). One scale per amax (a scalar amax gives a
    one-element tensor; block scaling passes one amax per block). These are the
    `QParams` of Float8CurrentScaling and Float8BlockScaling.

    ``non_finite``: an int32 scalar counter to which the number of NaN or infinite
    amaxes is added (amaxes are >= 0 or NaN; NOTE [Non-finite amaxes] in
    amax_update.py)."""
    amax_value = amax_value.to(torch.float32)
    finite = amax_value <= _FP32_MAX        # False for +inf and NaN
    if non_finite is not None:
        non_finite.add_(~finite if finite.dim() == 0 else (~finite).sum())
    if amax_value.dim() == 0:
        amax_value = amax_value.reshape(1)
    if amax_epsilon > 0:
        amax_value = torch.clamp(amax_value, min=amax_epsilon)      # NaN stays NaN
    # a tensor numerator: ``float / tensor`` is computed as ``float * (1 / tensor)``,
    # rounded twice, which can land an ulp off the quotient
    scale = torch.full_like(amax_value, fp8_max(dtype)).div_(amax_value)
    scale = torch.where((amax_value > 0) & finite, scale, 1.0).clamp(max=_FP32_MAX)
    if power_2_scale:
        scale = torch.bitwise_and(scale.view(torch.int32), 0x7F800000).view(torch.float32)
    return scale


def fp8_gemm(a: Float8Data, b: Float8Data, out_dtype: torch.dtype,
             bias: Optional[torch.Tensor] = None, use_fast_accum: bool = False) -> torch.Tensor:
    """``a @ b^T`` for FP8 operands ``a: [M, K]`` and ``b: [N, K]`` (both row-major),
    dequantized by their ``scale_inv``, accumulated in float32, written in ``out_dtype``.

    Runs ``torch._scaled_mm`` on CUDA; on the CPU, a float32 GEMM on the upcast
    operands, which computes the same exact products (NOTE [CPU FP8 GEMM]).
    """
    ad, bd = a.data, b.data
    if ad.dim() != 2 or bd.dim() != 2:
        raise ValueError(f"fp8_gemm: operands must be 2-D, got {tuple(ad.shape)} and {tuple(bd.shape)}")
    if ad.dtype not in FP8_DTYPES or bd.dtype not in FP8_DTYPES:
        raise TypeError(f"fp8_gemm: operands must be FP8, got {ad.dtype} and {bd.dtype}")
    if ad.dtype == torch.float8_e5m2 and bd.dtype == torch.float8_e5m2:
        raise TypeError("fp8_gemm: an E5M2 x E5M2 GEMM is not supported; one operand must be E4M3")
    if ad.shape[1] != bd.shape[1]:
        raise ValueError(f"fp8_gemm: inner dimensions differ: a is {tuple(ad.shape)}, "
                         f"b is {tuple(bd.shape)} (computing a @ b^T)")
    if out_dtype not in _GEMM_OUT_DTYPES:
        raise TypeError(f"fp8_gemm: out_dtype must be one of {_GEMM_OUT_DTYPES}, got {out_dtype}")
    check_gemm_shape("fp8_gemm", ad.shape[0], ad.shape[1], bd.shape[0],
                     f"a {tuple(ad.shape)} @ b^T {tuple(bd.shape)}")
    if not ad.is_contiguous():
        a = Float8Data(ad.contiguous(), a.scale_inv)
    if not bd.is_contiguous():
        b = Float8Data(bd.contiguous(), b.scale_inv)
    return fp8_gemm_unchecked(a, b, out_dtype, bias, use_fast_accum)


def fp8_gemm_unchecked(a: Float8Data, b: Float8Data, out_dtype: torch.dtype,
                       bias: Optional[torch.Tensor] = None,
                       use_fast_accum: bool = False) -> torch.Tensor:
    """`fp8_gemm` without its checks, for operands the modules' own casts made
    (contiguous, FP8, shapes checked by `check_fp8_matrix` at the module's entry)."""
    if not a.data.is_cuda and get_kernel_config().cpu_gemm == "upcast":
        return upcast_gemm(a, b, out_dtype, bias)
    return scaled_mm_padded(a, b, out_dtype, bias, use_fast_accum)


def upcast_gemm(a: Float8Data, b: Float8Data, out_dtype: torch.dtype,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``a @ b^T`` as a float32 GEMM on the upcast FP8 operands (exact products, float32
    accumulation), scaled, the bias added in float32, rounded once to ``out_dtype``."""
    out = torch.mm(a.data.to(torch.float32), b.data.to(torch.float32).t())
    out = mul_into(out, a.scale_inv * b.scale_inv)
    if bias is not None:
        out = add_into(out, bias)
    return cast_to(out, out_dtype)

