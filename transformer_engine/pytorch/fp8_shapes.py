"""FP8 GEMM shapes: TE's shape rule for the tensors that enter an FP8 GEMM, and the
``torch._scaled_mm`` call that pads operands to the multiples of 16 it needs.

NOTE [FP8 shapes]
    The rule is TE's: every 2-D matrix that enters an FP8 GEMM from a module, its input
    (all leading dimensions flattened: the tokens) and its weight ``[out_features,
    in_features]``, has a height divisible by 8 and a width divisible by 16. So tokens
    and ``out_features`` must be multiples of 8, ``in_features`` a multiple of 16.
    `check_fp8_matrix` is the one place that states it; the modules call it at their
    entry, `fp8_gemm` on its operands. ``torch._scaled_mm`` on CUDA asks more: all of
    M, K and N multiples of 16, in the forward (N = out_features) and in the backward
    GEMMs too (the wgrad GEMM's K is the token count). `scaled_mm_padded` meets that by
    copying an operand into a zero matrix rounded up to 16 rows and columns and
    slicing the result: zero rows give output rows that are dropped, zero columns in
    K add products that are exactly 0, so the kept block is the unpadded product.
    Shapes already aligned take no copy. The CPU ``"upcast"`` GEMM takes any shape.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from .function_results import add_into

__all__ = ["Float8Data", "FP8_HEIGHT_MULTIPLE", "FP8_WIDTH_MULTIPLE", "check_fp8_matrix",
           "check_gemm_shape", "scaled_mm_padded"]

FP8_HEIGHT_MULTIPLE = 8
FP8_WIDTH_MULTIPLE = 16
_SCALED_MM_MULTIPLE = 16


class Float8Data(NamedTuple):
    """An FP8 tensor: ``data`` (an FP8 dtype) and the ``scale_inv`` that turns it
    back into real values (``real = data * scale_inv``)."""

    data: torch.Tensor
    scale_inv: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # (no same-dtype .to: NOTE [Fresh function results] in function_results.py)
        out = self.data.to(torch.float32) * self.scale_inv
        return out if dtype == torch.float32 else out.to(dtype)

    def t_contiguous(self) -> "Float8Data":
        """The transposed copy, row-major, with the same scale."""
        return Float8Data(self.data.t().contiguous(), self.scale_inv)


def check_fp8_matrix(api: str, name: str, shape: Sequence[int]) -> None:
    """TE's shape rule for a tensor that enters an FP8 GEMM (NOTE [FP8 shapes]): seen
    as a 2-D matrix (leading dimensions flattened), its height must be divisible by 8
    and its width by 16. Raises a ``ValueError`` naming ``api``, the tensor (``name``)
    and its shape."""
    shape = tuple(shape)
    rows = 1
    for d in shape[:-1]:
        rows *= d
    cols = shape[-1] if shape else 1
    if rows % FP8_HEIGHT_MULTIPLE == 0 and cols % FP8_WIDTH_MULTIPLE == 0:
        return
    as_matrix = "" if len(shape) == 2 else f" (a [{rows}, {cols}] matrix)"
    raise ValueError(
        f"{api}: FP8 execution requires 2D input matrices with height divisible by "
        f"{FP8_HEIGHT_MULTIPLE} and width divisible by {FP8_WIDTH_MULTIPLE}; got the {name} "
        f"of shape {shape}{as_matrix}, height {rows} and width {cols}. Pad the tokens to a "
        f"multiple of {FP8_HEIGHT_MULTIPLE} (te.Fp8Padding for grouped GEMMs), use "
        f"in_features a multiple of {FP8_WIDTH_MULTIPLE} and out_features a multiple of "
        f"{FP8_HEIGHT_MULTIPLE}, or run this layer outside te.autocast.")


def check_gemm_shape(api: str, m: int, k: int, n: int, what: str) -> None:
    """The rule of `check_fp8_matrix` for a GEMM ``a [m, k] @ b^T`` with ``b [n, k]``;
    ``what`` says where the operands come from."""
    check_fp8_matrix(api, f"operand a of {what}", (m, k))
    check_fp8_matrix(api, f"operand b of {what}", (n, k))


def _round_up(v: int) -> int:
    return -(-v // _SCALED_MM_MULTIPLE) * _SCALED_MM_MULTIPLE


def _zero_padded(t: torch.Tensor, shape: Tuple[int, ...]) -> torch.Tensor:
    """``t`` in the leading corner of a zero tensor of ``shape`` (``t`` itself when it
    has that shape already)."""
    if tuple(t.shape) == shape:
        return t
    out = torch.zeros(shape, dtype=t.dtype, device=t.device)
    out[tuple(slice(0, d) for d in t.shape)].copy_(t)
    return out


def scaled_mm_padded(a: Float8Data, b: Float8Data, out_dtype: torch.dtype,
                     bias: Optional[torch.Tensor] = None,
                     use_fast_accum: bool = False) -> torch.Tensor:
    """``a @ b^T`` through ``torch._scaled_mm``, with M, K and N zero-padded to
    multiples of 16 where they are not and the ``[M, N]`` block of the result returned
    (NOTE [FP8 shapes]). The CUDA FP8 GEMM; on the CPU with ``cpu_gemm="scaled_mm"``."""
    m, k = a.data.shape
    n = b.data.shape[0]
    if m % _SCALED_MM_MULTIPLE or k % _SCALED_MM_MULTIPLE or n % _SCALED_MM_MULTIPLE:
        mp, kp, np_ = _round_up(m), _round_up(k), _round_up(n)
        ad = _zero_padded(a.data, (mp, kp))
        bd = _zero_padded(b.data, (np_, kp))
    else:       # the common case: no padding (host time on every GEMM)
        mp, kp, np_, ad, bd = m, k, n, a.data, b.data
    # cuBLASLt takes a bias only for 16-bit outputs; a float32 output adds it after.
    fused_bias = None
    if bias is not None and out_dtype != torch.float32:
        fused_bias = bias if bias.dtype == out_dtype else bias.to(out_dtype)
        if np_ != n:
            fused_bias = _zero_padded(fused_bias, (np_,))
    scale_a, scale_b = a.scale_inv, b.scale_inv
    if torch.compiler.is_compiling():
        # Inductor's Triton templates for _scaled_mm (max-autotune) take a per-tensor
        # scale as a 0-d tensor (or 2-D): they load a 1-D one with a 2-D index and fail
        scale_a, scale_b = scale_a.reshape(()), scale_b.reshape(())
    out = torch._scaled_mm(ad, bd.t(), scale_a=scale_a, scale_b=scale_b,
                           bias=fused_bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    if np_ != n:
        out = out[:m, :n].contiguous()
    elif mp != m:
        out = out[:m]
    if bias is not None and fused_bias is None:
        # the modules' autograd functions return this (NOTE [Fresh function results] in
        # function_results.py)
        out = add_into(out, bias.to(out_dtype))
    return out
