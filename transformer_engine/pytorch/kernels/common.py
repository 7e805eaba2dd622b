"""What the kernels of this package share: the FP8 cast of a float32 value, the amax
as integer bits, the current-scaling scale, the float32 math functions, and the one
allocation that holds a cast's outputs.

NOTE [FP8 cast formula]
    Every kernel here casts the same way as `quantize.py`'s torch reference: ``q =
    fp8(clamp(float32(v) * scale, -max, max))``, round to nearest even, NaN kept
    (``tl.clamp`` with NaN propagation, as ``torch.clamp``), where ``v`` is the value the
    unfused path would cast: a producer's output *rounded to its output dtype*
    (bfloat16, say), then widened to float32. ``amax = max|v|`` before scaling, reduced
    on the float32 bit patterns with the sign bit cleared (integer order is float order
    for non-negative floats, and a NaN sorts above +inf, so it propagates as torch's
    ``amax``), folded into a history slot with an integer ``atomic_max``. On a GPU the
    float32 -> FP8 conversion is Triton's (the hardware's round-to-nearest-even); under
    the Triton interpreter, whose own FP8 conversion rounds ties away and mishandles
    subnormals, `to_fp8` computes the same bits with integer arithmetic instead (tested
    against torch's conversion on every bfloat16 value and every tie), and `round_to`
    rounds to bfloat16 (which the interpreter truncates).

NOTE [FP8 stores]
    The producers (norm_cast, act_cast, dact_cast) write each FP8 value from the thread
    that computed it, one byte store per element (`store_fp8`), and never hand FP8
    data to `tl.store`. A `tl.store` gets the layout that suits its addresses, so the
    row-major and the transposed copy of one tile need the tile in two layouts, and
    Triton converts the cheapest value: for a float32 input, the FP8 tile. On sm_90
    Triton 3.6 lowers some 8-bit layout conversions (through ldmatrix / stmatrix) to
    PTX that reads registers it never writes, and the ptxas it ships (12.8) then
    compiles bytes of earlier data into the copies: on an H100, float32 inputs whose
    row length is a multiple of 16 got wrong transposed copies (and a wrong row-major
    one in some gated activations); bfloat16 and float16 inputs, converted before the
    cast, did not. `store_fp8` is an inline-assembly store with no layout of its own, so
    no conversion of FP8 data is ever made; `launch.Launcher` checks each compiled
    kernel's PTX for reads of registers it never writes (`launch.undefined_registers`).
    Under the interpreter it is `tl.store`.

Imported only by the kernel files of this package, so only where Triton imports.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

from .launch import INTERPRET

__all__ = ["AVAILABLE", "INTERPRET", "F32", "FP32_MAX", "FP8_MAX", "TL_FP8", "cast_outputs",
           "row_stats_outputs"]

AVAILABLE = triton is not None
F32 = torch.float32
FP32_MAX = torch.finfo(torch.float32).max
FP8_MAX = {torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max,
           torch.float8_e5m2: torch.finfo(torch.float8_e5m2).max}
# A cast's outputs start this many bytes into their allocation (scale_inv, then any
# scratch), so that the FP8 data is 16-byte aligned, as torch._scaled_mm needs.
_HEADER_ALIGN = 16

if AVAILABLE:
    TL_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}

    @triton.jit
    def max_nan(a, b):
        """max that propagates NaN, as torch.amax does."""
        return tl.where((a > b) | (a != a), a, b)

    @triton.jit
    def abs_bits(v):
        """|v| as the int32 bit pattern of a float32 (NOTE [FP8 cast formula])."""
        return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF

    @triton.jit
    def tile_amax_bits(v, mask):
        """The largest `abs_bits` of the masked-in elements of a 2-D tile (0 if none)."""
        return tl.max(tl.max(tl.where(mask, abs_bits(v), 0), axis=1), axis=0)

    @triton.jit
    def saturate(v, scale, FP8_MAX: tl.constexpr):
        """``clamp(v * scale, -max, max)``, NaN kept."""
        return tl.clamp(v * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def current_scale(amax, amax_epsilon, FP8_MAX: tl.constexpr, EPSILON: tl.constexpr,
                      POW2: tl.constexpr, FP32_MAX: tl.constexpr):
        """`quantize.current_scale` of one float32 amax, value for value."""
        finite = amax <= FP32_MAX                       # NaN and inf fail
        a = amax
        if EPSILON:
            a = tl.maximum(a, amax_epsilon, propagate_nan=tl.PropagateNan.ALL)
        scale = tl.where((a > 0) & finite, tl.div_rn(FP8_MAX, a), 1.0)
        scale = tl.minimum(scale, FP32_MAX)
        if POW2:
            scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        return scale

    if INTERPRET:
        @triton.jit
        def round_to(y, DTYPE: tl.constexpr):
            """float32 -> ``DTYPE`` (float32, bfloat16, float16), round to nearest even
            (the interpreter truncates to bfloat16: NOTE [FP8 cast formula])."""
            if DTYPE == tl.bfloat16:
                bits = y.to(tl.int32, bitcast=True)
                r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                r = tl.where(y != y, (bits >> 16) | 0x40, r)         # NaN stays NaN
                return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
            else:
                return y.to(DTYPE)

        @triton.jit
        def to_fp8(y, OUT_DTYPE: tl.constexpr):
            """float32 -> FP8, round to nearest even, for ``|y| <= max`` or NaN (the
            clamp has run), in integer arithmetic (NOTE [FP8 cast formula])."""
            MANT: tl.constexpr = OUT_DTYPE.fp_mantissa_width
            BIAS: tl.constexpr = OUT_DTYPE.exponent_bias
            SHIFT: tl.constexpr = 23 - MANT
            bits = y.to(tl.int32, bitcast=True)
            sign = (bits >> 31) & 1
            a = bits & 0x7FFFFFFF
            # normal results: round the float32 significand to MANT bits (a carry
            # moves into the exponent), then rebias the exponent
            lsb = (a >> SHIFT) & 1
            normal = ((a + ((1 << (SHIFT - 1)) - 1) + lsb) >> SHIFT) - ((127 - BIAS) << MANT)
            # subnormal results: |y| in units of the smallest subnormal, rounded to an
            # integer by the float32 adder (exact power-of-two scaling)
            m = tl.abs(y) * (2.0 ** (BIAS + MANT - 1))
            sub = ((m + 8388608.0) - 8388608.0).to(tl.int32)
            mag = tl.where(a < ((128 - BIAS) << 23), sub, normal)
            mag = tl.where(a > 0x7F800000, 0x7F, mag)
            return ((sign << 7) | mag).to(tl.uint8).to(OUT_DTYPE, bitcast=True)
    else:
        @triton.jit
        def round_to(y, DTYPE: tl.constexpr):
            """float32 -> ``DTYPE`` (float32, bfloat16, float16), round to nearest even."""
            return y.to(DTYPE)

        @triton.jit
        def to_fp8(y, OUT_DTYPE: tl.constexpr):
            """float32 -> FP8, round to nearest even (NOTE [FP8 cast formula])."""
            return y.to(OUT_DTYPE)

    if INTERPRET:
        @triton.jit
        def store_fp8(ptrs, q, mask):
            """``q`` (FP8) to ``ptrs`` where ``mask`` (NOTE [FP8 stores])."""
            tl.store(ptrs, q, mask=mask)
    else:
        @triton.jit
        def store_fp8(ptrs, q, mask):
            """``q`` (FP8) to ``ptrs`` where ``mask``, one byte store per element from
            the thread that holds it: no layout conversion (NOTE [FP8 stores])."""
            tl.inline_asm_elementwise(
                "@$3 st.global.b8 [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r,b",
                [ptrs, q.to(tl.uint8, bitcast=True).to(tl.int32), mask], dtype=tl.int32,
                is_pure=False, pack=1)

    @triton.jit
    def fold_amax(amax_ptr, index, bits):
        """Fold `abs_bits` into the float32 slot ``amax_ptr[index]`` (max with what it
        holds: a non-negative float or NaN)."""
        tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)) + index, bits)


def _align(nbytes: int) -> int:
    return -(-nbytes // _HEADER_ALIGN) * _HEADER_ALIGN


def cast_outputs(m: int, n: int, dtype: torch.dtype, device: torch.device, data: bool,
                 transpose: bool, scratch: int = 0, separate: bool = False
                 ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor,
                            Optional[torch.Tensor]]:
    """The outputs of casting an ``[m, n]`` tensor: ``(q [m, n] or None, q_t [n, m] or
    None, scale_inv [1], scratch [scratch] float32 or None)``.

    ``scale_inv`` and ``scratch`` sit at the head of one allocation with the copy the
    backward keeps: ``q_t`` when asked for (the module saves ``q_t`` and ``scale_inv``;
    the row-major ``q`` feeds the forward GEMM only, so it gets its own allocation and
    is freed after it, not kept alive by a shared one until the backward), else ``q``.
    One allocation when one copy is asked for, two when both. ``separate``: each its
    own allocation (the custom ops of ops.py, whose outputs may not share storage)."""
    if separate:
        return (torch.empty((m, n), dtype=dtype, device=device) if data else None,
                torch.empty((n, m), dtype=dtype, device=device) if transpose else None,
                torch.empty(1, dtype=F32, device=device),
                torch.empty(scratch, dtype=F32, device=device) if scratch else None)
    # The allocation is typed FP8 and holds a whole number of float32 words; each
    # output is one view of it (``as_strided``: one op, where a slice and a dtype view
    # would be two or three; the views are made on every cast, NOTE [Launch overhead]).
    head = _align(4) + _align(4 * scratch)
    kept = m * n if (data or transpose) else 0
    buf = torch.empty(head + -(-kept // 4) * 4, dtype=dtype, device=device)
    words = buf.view(F32)
    scale_inv = words.as_strided((1,), (1,), 0)
    extra = words.as_strided((scratch,), (1,), _align(4) // 4) if scratch else None
    q = q_t = None
    if transpose:
        q_t = buf.as_strided((n, m), (m, 1), head)
        if data:
            q = torch.empty((m, n), dtype=dtype, device=device)
    elif data:
        q = buf.as_strided((m, n), (n, 1), head)
    return q, q_t, scale_inv, extra


def row_stats_outputs(m: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(mean [m, 1], rstd [m, 1])`` float32 of one allocation, the layout torch's
    normalization backward reads."""
    buf = torch.empty((2, m, 1), dtype=F32, device=device)
    return buf[0], buf[1]
