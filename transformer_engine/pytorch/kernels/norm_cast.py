"""LayerNorm / RMSNorm forward writing the FP8 copy of its output: one kernel reads the
input rows, computes their statistics (two passes over the row, in float32: the mean,
then the variance of the centred values; RMSNorm the mean square), normalizes,
applies the gain (``1 + weight`` when zero-centred) and shift, rounds to the output
dtype and, in the same pass, writes the FP8 copy, its transposed copy (the wgrad
operand of the GEMM it feeds), the amax, ``mean`` / ``rstd`` for the backward (torch's
layout: `torch.ops.aten.native_layer_norm_backward` and ``_fused_rms_norm_backward``
take them), and the high-precision output only when asked for.

Program ``p`` normalizes rows ``[p * BLOCK_M, (p + 1) * BLOCK_M)``, looping over the
columns in chunks (the later passes re-read the rows from L2).

Delayed scaling: one launch. Current scaling: two launches, no host synchronisation:
the first computes the statistics and the output's amax (and writes the
high-precision output if asked for), the second recomputes the output from the
saved statistics, bit for bit the same, and casts it.

NOTE [Infinite rows in RMSNorm]
    torch's CUDA RMSNorm (``F.rms_norm``, what `layernorm.normalize` calls) takes one of
    two kernels, and they disagree on a row holding an infinity. Its single-pass kernel
    (row length a multiple of 4, at most 2^24, input, output and gain 16-byte aligned)
    sums squares: the sum is inf, ``rstd = rsqrt(inf) = 0`` and the row's finite
    elements normalize to 0 (the infinity to NaN), as here. Its two-kernel path
    (every other row) reduces the row with Welford's update, where ``inf - inf`` makes
    the statistics, and so ``rstd`` and the whole output row, NaN. `norm_cast` follows
    the path torch would take for the same call (`rms_norm_infinity_is_nan`), so that
    the fused normalization is a drop-in for the unfused one on such rows too; with
    ``INF_NAN`` the kernel adds ``x - x`` (0 for a finite ``x``, NaN otherwise) to each
    row's mean square. On the CPU torch sums squares (rstd 0). A NaN makes the row NaN
    on every path, and LayerNorm's mean makes an infinite row NaN on every path.

The output is not torch's bit for bit: torch's CUDA normalization reduces the row in
another order (Welford), so ``mean`` and ``rstd`` differ in their last float32 bits,
and an output rounded to 16 bits differs by one unit in the last place where the
float32 value lies that close to a rounding boundary (bounds in
tests/pytorch/test_fused_producers.py). The FP8 copy is the cast of this kernel's own
output (NOTE [FP8 cast formula] in common.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from .common import AVAILABLE, F32, FP32_MAX, FP8_MAX, cast_outputs
from .launch import Launcher, aligned, int_spec

if AVAILABLE:
    import triton
    import triton.language as tl

    from .casts import finish_current_scale, partials_block
    from .common import (TL_FP8, fold_amax, round_to, saturate, store_fp8, tile_amax_bits,
                         to_fp8)

__all__ = ["norm_cast", "rms_norm_infinity_is_nan"]

_BLOCK_M, _MAX_BLOCK_N, _WARPS = 16, 256, 4
# torch's single-pass CUDA normalization kernel: rows of a multiple of this many
# elements, at most this long, with 16-byte aligned operands
_TORCH_VECTOR, _TORCH_MAX_VECTOR_ROW, _TORCH_ALIGN = 4, 1 << 24, 16

if AVAILABLE:
    @triton.jit
    def _normalized(x, mean, rstd, w, b, RMS: tl.constexpr, HAS_BIAS: tl.constexpr):
        # the same expression in every launch, so both launches of a current-scaling
        # cast compute the same values
        if RMS:
            y = (x * rstd[:, None]) * w[None, :]
        else:
            y = ((x - mean[:, None]) * rstd[:, None]) * w[None, :]
            if HAS_BIAS:
                y = y + b[None, :]
        return y

    # rows and counts derived from them are not specialized on: one binary for every
    # number of rows (fewer compilations; the row loop does not need them)
    @triton.jit(do_not_specialize=["index", "partials", "M"])
    def _norm_cast_kernel(x_ptr, w_ptr, b_ptr, y_ptr, q_ptr, qt_ptr, mean_ptr, rstd_ptr,
                          scale_ptr, amax_ptr, index, scale_inv_ptr, partial_ptr, partials,
                          non_finite_ptr, amax_epsilon, M, N, stride_xm, eps,
                          RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                          HAS_BIAS: tl.constexpr, MODE: tl.constexpr, WRITE_Y: tl.constexpr,
                          WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr,
                          WRITE_AMAX: tl.constexpr, Y_DTYPE: tl.constexpr,
                          FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr,
                          EPSILON: tl.constexpr, POW2: tl.constexpr, COUNT: tl.constexpr,
                          FP32_MAX: tl.constexpr, INF_NAN: tl.constexpr,
                          BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):
        # MODE 0: delayed (scale[index]; amax into amax[index]); 1: current, first
        # launch (statistics, partial amax, y if asked); 2: current, the cast. INF_NAN
        # (RMSNorm): a non-finite element makes the row's rstd NaN (NOTE [Infinite rows
        # in RMSNorm]).
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        r64 = rows.to(tl.int64)
        n_f = tl.zeros([BLOCK_M], dtype=tl.float32) + N     # N may be a constexpr 1
        if MODE == 0:
            scale = tl.load(scale_ptr + index)
            if pid == 0:
                tl.store(scale_inv_ptr, tl.div_rn(1.0, scale))
        elif MODE == 2:
            scale = finish_current_scale(partial_ptr, partials, scale_inv_ptr, non_finite_ptr,
                                         amax_epsilon, pid == 0, FP8_MAX, EPSILON, POW2,
                                         COUNT, FP32_MAX, BLOCK_P)
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        if MODE == 2:
            rstd = tl.load(rstd_ptr + r64, mask=rmask, other=0.0)
            if not RMS:
                mean = tl.load(mean_ptr + r64, mask=rmask, other=0.0)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            poison = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for n0 in range(0, N, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                mask = rmask[:, None] & (cols[None, :] < N)
                x = tl.load(x_ptr + r64[:, None] * stride_xm + cols[None, :], mask=mask,
                            other=0.0).to(tl.float32)
                if RMS:
                    acc += x * x
                    if INF_NAN:
                        poison += x - x
                else:
                    acc += x
            if RMS:
                var = tl.div_rn(tl.sum(acc, axis=1), n_f)
                if INF_NAN:     # + 0 for a finite row: the same bits
                    var = var + tl.sum(poison, axis=1)
            else:
                mean = tl.div_rn(tl.sum(acc, axis=1), n_f)
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for n0 in range(0, N, BLOCK_N):
                    cols = n0 + tl.arange(0, BLOCK_N)
                    mask = rmask[:, None] & (cols[None, :] < N)
                    x = tl.load(x_ptr + r64[:, None] * stride_xm + cols[None, :], mask=mask,
                                other=0.0).to(tl.float32)
                    d = tl.where(mask, x - mean[:, None], 0.0)
                    acc += d * d
                var = tl.div_rn(tl.sum(acc, axis=1), n_f)
                tl.store(mean_ptr + r64, mean, mask=rmask)
            rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
            tl.store(rstd_ptr + r64, rstd, mask=rmask)
        best = tl.full([], 0, tl.int32)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            cmask = cols < N
            c64 = cols.to(tl.int64)
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(x_ptr + r64[:, None] * stride_xm + c64[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                w = w + 1.0
            b = w
            if HAS_BIAS:
                b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            y_out = round_to(_normalized(x, mean, rstd, w, b, RMS, HAS_BIAS), Y_DTYPE)
            v = y_out.to(tl.float32)            # the value the unfused path casts
            if MODE != 2:
                if WRITE_Y:
                    tl.store(y_ptr + r64[:, None] * N + c64[None, :], y_out, mask=mask)
                best = tl.maximum(best, tile_amax_bits(v, mask))
            if MODE != 1:
                q = to_fp8(saturate(v, scale, FP8_MAX), OUT_DTYPE)
                if WRITE_Q:     # NOTE [FP8 stores] in common.py
                    store_fp8(q_ptr + r64[:, None] * N + c64[None, :], q, mask)
                if WRITE_QT:
                    store_fp8(qt_ptr + c64[None, :] * M + r64[:, None], q, mask)
        if MODE == 0:
            if WRITE_AMAX:
                fold_amax(amax_ptr, index, best)
        elif MODE == 1:
            tl.store(partial_ptr.to(tl.pointer_type(tl.int32)) + pid, best)

    _launch = Launcher(_norm_cast_kernel, enable_fp_fusion=False)

    _TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def rms_norm_infinity_is_nan(x: torch.Tensor, weight: torch.Tensor,
                             zero_centered_gamma: bool) -> bool:
    """Whether torch's ``F.rms_norm`` of `layernorm.normalize`'s float32 operands for a
    2-D ``x`` and ``weight`` takes its two-kernel CUDA path, on which a row holding an
    infinity comes out NaN (NOTE [Infinite rows in RMSNorm]). ``normalize`` hands torch
    ``x`` itself when it is a contiguous float32 tensor (else a fresh, aligned copy), and
    ``weight`` itself when it is float32 and not zero-centred; the output is fresh."""
    if not x.is_cuda:
        return False

    def aligned_for_torch(t: torch.Tensor, copied: bool) -> bool:
        return copied or not t.is_contiguous() or t.data_ptr() % _TORCH_ALIGN == 0
    n = x.shape[-1]
    single_pass = (n % _TORCH_VECTOR == 0 and n <= _TORCH_MAX_VECTOR_ROW
                   and aligned_for_torch(x, x.dtype != F32)
                   and aligned_for_torch(weight, weight.dtype != F32 or zero_centered_gamma))
    return not single_pass


def norm_cast(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              normalization: str, eps: float, zero_centered_gamma: bool,
              out_dtype: torch.dtype, dtype: torch.dtype, *,
              scale: Optional[torch.Tensor] = None, index: int = 0,
              amax_history: Optional[torch.Tensor] = None, power_2_scale: bool = False,
              amax_epsilon: float = 0.0, non_finite: Optional[torch.Tensor] = None,
              write_y: bool = False, data: bool = True, transpose: bool = False,
              separate: bool = False, infinity_is_nan: Optional[bool] = None):
    """Normalize the rows of a 2-D ``x [M, N]`` (unit column stride) with ``weight [N]``
    (and ``bias [N]`` for LayerNorm), output in ``out_dtype``, cast to FP8 ``dtype`` in
    the same pass. ``normalization``: "LayerNorm" or "RMSNorm". Returns ``(y [M, N] or
    None, q [M, N] or None, q_t [N, M] or None, scale_inv [1], stats)``: ``stats`` is
    ``[2, M, 1]`` float32 (``mean``, ``rstd``) for LayerNorm, ``[1, M, 1]`` (``rstd``) for
    RMSNorm. Scaling arguments as `act_cast.act_cast`. ``infinity_is_nan`` (RMSNorm):
    whether a row holding an infinity comes out NaN; by default as torch's ``F.rms_norm``
    of the same operands on this device (`rms_norm_infinity_is_nan`)."""
    m, n = x.shape
    device = x.device
    rms = normalization == "RMSNorm"
    if infinity_is_nan is None:
        infinity_is_nan = rms and rms_norm_infinity_is_nan(x, weight, zero_centered_gamma)
    inf_nan = bool(rms and infinity_is_nan)
    delayed = scale is not None
    programs = -(-m // _BLOCK_M)
    y = torch.empty((m, n), dtype=out_dtype, device=device) if write_y else None
    q, q_t, scale_inv, partial = cast_outputs(m, n, dtype, device, data, transpose,
                                              scratch=0 if delayed else programs,
                                              separate=separate)
    stats = torch.empty((1 if rms else 2, m, 1), dtype=F32, device=device)
    mean, rstd = (None, stats[0]) if rms else (stats[0], stats[1])
    if m == 0:
        if delayed:
            torch.reciprocal(scale[index:index + 1], out=scale_inv)
        else:
            scale_inv.fill_(1.0)
        return y, q, q_t, scale_inv, stats
    block_n = min(_MAX_BLOCK_N, 1 << (n - 1).bit_length())     # (next power of 2, n >= 1)
    has_amax = delayed and amax_history is not None
    has_bias = bias is not None and not rms
    count = non_finite is not None and not delayed
    epsilon = amax_epsilon > 0
    block_p = partials_block(programs)
    dummy = scale_inv
    spec = (x.dtype, weight.dtype, has_bias and bias.dtype, out_dtype, dtype, rms,
            zero_centered_gamma, aligned(x), aligned(weight), has_bias and aligned(bias),
            int_spec(n), int_spec(x.stride(0)), data, transpose, epsilon, power_2_scale, count,
            count and aligned(non_finite), has_amax, delayed and aligned(scale),
            has_amax and aligned(amax_history), aligned(stats[-1]), block_n, inf_nan)
    common = (x, weight, bias if has_bias else weight, y if write_y else dummy,
              q if data else dummy, q_t if transpose else dummy,
              mean if not rms else rstd, rstd, scale if delayed else dummy,
              amax_history if has_amax else dummy, index, scale_inv,
              partial if not delayed else dummy, programs, non_finite if count else dummy,
              float(amax_epsilon), m, n, x.stride(0), float(eps), rms, zero_centered_gamma,
              has_bias)
    # BLOCK_P (`casts.partials_block` of the row-dependent program count) is read by the
    # cast launch only: the others get 1, the cast's key holds it
    tail = (_TL[out_dtype], FP8_MAX[dtype], TL_FP8[dtype], epsilon, power_2_scale, count,
            FP32_MAX, inf_nan)
    grid = (programs, 1, 1)
    if delayed:
        _launch(grid, _WARPS, (spec, 0, write_y), *common, 0, write_y, data, transpose,
                has_amax, *tail, 1, _BLOCK_M, block_n)
    else:
        _launch(grid, _WARPS, (spec, 1, write_y), *common, 1, write_y, False, False, False,
                *tail, 1, _BLOCK_M, block_n)
        cast_args = common[:3] + (dummy,) + common[4:]     # (the cast writes no y)
        _launch(grid, _WARPS, (spec, 2, block_p), *cast_args, 2, False, data, transpose, False,
                *tail, block_p, _BLOCK_M, block_n)
    return y, q, q_t, scale_inv, stats
