"""This package's ``torch.library`` custom ops, in the ``transformer_engine`` namespace
(``torch.ops.transformer_engine.<name>``), each with a fake implementation so that
``torch.compile`` can trace it.

NOTE [Custom ops]
    Compiled code (NOTE [torch.compile] in torch_compile.py) calls these where a plain
    torch op would not do:

    - ``scale_snapshot(scale)``: a copy of a delayed-scaling scale vector, taken in the
      forward graph before the casts read it. The casts' FP8 outputs are cheap to
      recompute, so AOTAutograd's partitioner may recompute them in the backward graph
      from the graph's inputs rather than save them; but the scale input is updated in
      place between the forward and the backward (the autocast's exit), so a recompute
      from it would cast with the new scale. An opaque op is not recomputed (not in
      the partitioner's recomputable list): the backward reads the saved copy.
    - ``cast_transpose`` / ``fp8_gemm``: the eager path's delayed-scaling cast (one
      Triton pass on CUDA: amax into the history slot, cast, transposed copy) and FP8
      GEMM, for compiled code that wants this package's kernels rather than the ops
      Inductor generates (the modules' compiled path uses the latter).

    Other files (the fused producer kernels) register their ops in the same namespace.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["scale_snapshot", "cast_transpose", "fp8_gemm"]


@torch.library.custom_op("transformer_engine::scale_snapshot", mutates_args=())
def scale_snapshot(scale: torch.Tensor) -> torch.Tensor:
    """A copy of ``scale`` (NOTE [Custom ops])."""
    return scale.clone()


@scale_snapshot.register_fake
def _scale_snapshot_fake(scale: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(scale)


@torch.library.custom_op("transformer_engine::cast_transpose", mutates_args=("amax_history",))
def cast_transpose(x: torch.Tensor, scale: torch.Tensor, index: int, fp8_dtype: torch.dtype,
                   amax_history: Optional[torch.Tensor], data: bool,
                   transpose: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize.cast_transpose_unchecked` of a 2-D ``x``: ``(x_fp8, x_fp8^T, scale_inv)``
    (an empty tensor for the one not asked for), the amax folded into
    ``amax_history[0, index]`` when given."""
    from .quantize import cast_transpose_unchecked
    q, q_t = cast_transpose_unchecked(x, scale, fp8_dtype, index, amax_history, data, transpose)
    found = q if q is not None else q_t
    empty = x.new_empty(0, dtype=fp8_dtype)
    return (q.data if q is not None else empty, q_t.data if q_t is not None else empty,
            found.scale_inv)


@cast_transpose.register_fake
def _cast_transpose_fake(x, scale, index, fp8_dtype, amax_history, data, transpose):
    rows, cols = x.shape
    return (x.new_empty((rows, cols) if data else (0,), dtype=fp8_dtype),
            x.new_empty((cols, rows) if transpose else (0,), dtype=fp8_dtype),
            scale.new_empty(1))


@torch.library.custom_op("transformer_engine::fp8_gemm", mutates_args=())
def fp8_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
             b_scale_inv: torch.Tensor, out_dtype: torch.dtype, bias: Optional[torch.Tensor],
             use_fast_accum: bool) -> torch.Tensor:
    """`quantize.fp8_gemm_unchecked`: ``a @ b^T`` of row-major FP8 operands."""
    from .quantize import Float8Data, fp8_gemm_unchecked
    return fp8_gemm_unchecked(Float8Data(a, a_scale_inv), Float8Data(b, b_scale_inv), out_dtype,
                              bias, use_fast_accum)


@fp8_gemm.register_fake
def _fp8_gemm_fake(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_fast_accum):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
