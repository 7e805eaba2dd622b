"""The fused kernels as ``torch.library`` custom ops in the namespace
``transformer_engine``, with fake (meta) implementations, so that a ``torch.compile``d
path can call the very kernels eager runs (eager calls the Python functions of
`casts`, `norm_cast`, `act_cast` and `dact_cast` directly: an op call costs dispatcher
time on every cast).

Call `register()` once before tracing (idempotent; nothing is registered at import).
The ops, as ``torch.ops.transformer_engine.<name>``:

- ``cast_transpose(x, scale, amax_history?, index, dtype, data, transpose) -> (q, q_t,
  scale_inv)``: delayed-scaling cast of a 2-D ``x`` (`casts.cast_transpose`);
  mutates ``amax_history``.
- ``current_cast(x, dtype, power_2_scale, amax_epsilon, non_finite?, data, transpose)
  -> (q, q_t, scale_inv)`` (`casts.current_cast`); mutates ``non_finite``.
- ``norm_cast(x, weight, bias?, normalization, eps, zero_centered_gamma, out_dtype,
  dtype, scale?, index, amax_history?, power_2_scale, amax_epsilon, non_finite?,
  write_y, data, transpose) -> (y, q, q_t, scale_inv, stats)`` (`norm_cast.norm_cast`).
- ``act_cast(x, activation, dtype, scale?, index, amax_history?, power_2_scale,
  amax_epsilon, non_finite?, write_y, data, transpose) -> (y, q, q_t, scale_inv)``.
- ``dact_cast(x, dy, activation, dtype, scale?, index, amax_history?, power_2_scale,
  amax_epsilon, non_finite?, data, transpose, dbias, dbias_dtype) -> (q, q_t,
  scale_inv, dbias)``.

A ``scale`` selects delayed scaling (with ``index`` and the optional ``amax_history``),
its absence current scaling. An output that was not asked for is an empty tensor of
the right dtype (ops cannot return None). Each output has its own allocation (in
eager ``scale_inv`` and an FP8 copy share one; an op's outputs may not share storage).
"""

from __future__ import annotations

import threading
from typing import Optional, Tuple

import torch

__all__ = ["register", "NAMESPACE"]

NAMESPACE = "transformer_engine"
_LOCK = threading.Lock()
_registered = False
_T = torch.Tensor


def _empty(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=like.device)


def _out(t: Optional[torch.Tensor], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _empty(like, dtype) if t is None else t


def _fake_cast(x: torch.Tensor, rows: int, cols: int, dtype: torch.dtype, data: bool,
               transpose: bool) -> Tuple[_T, _T, _T]:
    q = x.new_empty((rows, cols), dtype=dtype) if data else _empty(x, dtype)
    q_t = x.new_empty((cols, rows), dtype=dtype) if transpose else _empty(x, dtype)
    return q, q_t, x.new_empty(1, dtype=torch.float32)


def _scaling(scale, index, amax_history, power_2_scale, amax_epsilon, non_finite) -> dict:
    if scale is not None:
        return {"scale": scale, "index": index, "amax_history": amax_history}
    return {"power_2_scale": power_2_scale, "amax_epsilon": amax_epsilon,
            "non_finite": non_finite}


def register() -> str:
    """Register the ops (once; later calls do nothing); returns the namespace."""
    global _registered
    with _LOCK:
        if not _registered:
            _define()
            _registered = True
    return NAMESPACE


def _define() -> None:
    from . import act_cast, casts, dact_cast, norm_cast
    lib = NAMESPACE

    @torch.library.custom_op(f"{lib}::cast_transpose", mutates_args=("amax_history",))
    def cast_transpose_op(x: _T, scale: _T, amax_history: Optional[_T], index: int,
                          dtype: torch.dtype, data: bool, transpose: bool) -> Tuple[_T, _T, _T]:
        q, q_t, scale_inv = casts.cast_transpose(x, scale, dtype, index=index,
                                                 amax_history=amax_history, data=data,
                                                 transpose=transpose, separate=True)
        return _out(q, x, dtype), _out(q_t, x, dtype), scale_inv

    @cast_transpose_op.register_fake
    def _(x, scale, amax_history, index, dtype, data, transpose):
        return _fake_cast(x, x.shape[0], x.shape[1], dtype, data, transpose)

    @torch.library.custom_op(f"{lib}::current_cast", mutates_args=("non_finite",))
    def current_cast_op(x: _T, dtype: torch.dtype, power_2_scale: bool, amax_epsilon: float,
                        non_finite: Optional[_T], data: bool,
                        transpose: bool) -> Tuple[_T, _T, _T]:
        q, q_t, scale_inv = casts.current_cast(x, dtype, power_2_scale, amax_epsilon,
                                               non_finite, data, transpose, separate=True)
        return _out(q, x, dtype), _out(q_t, x, dtype), scale_inv

    @current_cast_op.register_fake
    def _(x, dtype, power_2_scale, amax_epsilon, non_finite, data, transpose):
        return _fake_cast(x, x.shape[0], x.shape[1], dtype, data, transpose)

    @torch.library.custom_op(f"{lib}::norm_cast", mutates_args=("amax_history", "non_finite"))
    def norm_cast_op(x: _T, weight: _T, bias: Optional[_T], normalization: str, eps: float,
                     zero_centered_gamma: bool, out_dtype: torch.dtype, dtype: torch.dtype,
                     scale: Optional[_T], index: int, amax_history: Optional[_T],
                     power_2_scale: bool, amax_epsilon: float, non_finite: Optional[_T],
                     write_y: bool, data: bool, transpose: bool) -> Tuple[_T, _T, _T, _T, _T]:
        y, q, q_t, scale_inv, stats = norm_cast.norm_cast(
            x, weight, bias, normalization, eps, zero_centered_gamma, out_dtype, dtype,
            write_y=write_y, data=data, transpose=transpose, separate=True,
            **_scaling(scale, index, amax_history, power_2_scale, amax_epsilon, non_finite))
        return (_out(y, x, out_dtype), _out(q, x, dtype), _out(q_t, x, dtype), scale_inv,
                stats)

    @norm_cast_op.register_fake
    def _(x, weight, bias, normalization, eps, zero_centered_gamma, out_dtype, dtype, scale,
          index, amax_history, power_2_scale, amax_epsilon, non_finite, write_y, data,
          transpose):
        m, n = x.shape
        y = x.new_empty((m, n), dtype=out_dtype) if write_y else _empty(x, out_dtype)
        q, q_t, scale_inv = _fake_cast(x, m, n, dtype, data, transpose)
        stats = x.new_empty((1 if normalization == "RMSNorm" else 2, m, 1),
                            dtype=torch.float32)
        return y, q, q_t, scale_inv, stats

    @torch.library.custom_op(f"{lib}::act_cast", mutates_args=("amax_history", "non_finite"))
    def act_cast_op(x: _T, activation: str, dtype: torch.dtype, scale: Optional[_T],
                    index: int, amax_history: Optional[_T], power_2_scale: bool,
                    amax_epsilon: float, non_finite: Optional[_T], write_y: bool, data: bool,
                    transpose: bool) -> Tuple[_T, _T, _T, _T]:
        y, q, q_t, scale_inv = act_cast.act_cast(
            x, activation, dtype, write_y=write_y, data=data, transpose=transpose, separate=True,
            **_scaling(scale, index, amax_history, power_2_scale, amax_epsilon, non_finite))
        return _out(y, x, x.dtype), _out(q, x, dtype), _out(q_t, x, dtype), scale_inv

    @act_cast_op.register_fake
    def _(x, activation, dtype, scale, index, amax_history, power_2_scale, amax_epsilon,
          non_finite, write_y, data, transpose):
        m, w = x.shape
        f = w // 2 if act_cast.activation_code(activation)[1] else w
        y = x.new_empty((m, f)) if write_y else _empty(x, x.dtype)
        return (y, *_fake_cast(x, m, f, dtype, data, transpose))

    @torch.library.custom_op(f"{lib}::dact_cast", mutates_args=("amax_history", "non_finite"))
    def dact_cast_op(x: _T, dy: _T, activation: str, dtype: torch.dtype, scale: Optional[_T],
                     index: int, amax_history: Optional[_T], power_2_scale: bool,
                     amax_epsilon: float, non_finite: Optional[_T], data: bool, transpose: bool,
                     dbias: bool, dbias_dtype: torch.dtype) -> Tuple[_T, _T, _T, _T]:
        q, q_t, scale_inv, db = dact_cast.dact_cast(
            x, dy, activation, dtype, data=data, transpose=transpose,
            dbias_dtype=dbias_dtype if dbias else None, separate=True,
            **_scaling(scale, index, amax_history, power_2_scale, amax_epsilon, non_finite))
        return _out(q, x, dtype), _out(q_t, x, dtype), scale_inv, _out(db, x, dbias_dtype)

    @dact_cast_op.register_fake
    def _(x, dy, activation, dtype, scale, index, amax_history, power_2_scale, amax_epsilon,
          non_finite, data, transpose, dbias, dbias_dtype):
        m, w = x.shape
        q, q_t, scale_inv = _fake_cast(x, m, w, dtype, data, transpose)
        db = x.new_empty(w, dtype=dbias_dtype) if dbias else _empty(x, dbias_dtype)
        return q, q_t, scale_inv, db
