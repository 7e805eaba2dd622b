"""How `FusedAdam` keeps its states (``exp_avg``, ``exp_avg_sq``, ``master_param``) in a
dtype narrower than float32, as TE does.

NOTE [Scaled optimizer states]
    float32 (float64 for a float64 parameter) and bfloat16 states are stored as they are.
    A float16 or FP8 state is stored scaled, with a float32 scale per tensor
    (``FusedAdam._scales[param][name]``), so that the whole range of its values fits:
    ``scale = amax / R``, stored ``value / scale``, read ``stored * scale``, where ``R``
    is 65504 / 2 for float16 (half its range) and 448 for FP8 (E4M3's). An FP8 state
    (``torch.uint8`` as the dtype argument, TE's spelling) is a `Float8Tensor` of E4M3
    bits whose ``scale_inv`` is that scale, quantized by `quantize.cast_to_fp8`
    (saturating, round to nearest even). After every step the state is re-scaled from
    its new amax. A state of zeros keeps scale 0 (float16) or 1 (FP8).

    Error bound of an FP8 state: E4M3 keeps 3 mantissa bits, so a stored value differs
    from the value by at most 2**-4 of it, plus, for values below E4M3's normal range
    (``amax * 2**-6 / 448``), at most half its subnormal spacing, ``amax * 2**-10 / 448``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..quantize import cast_to_fp8
from ..tensor.float8_tensor import Float8Tensor

__all__ = ["STATE_NAMES", "STATE_DTYPES", "SCALED_RANGE", "full_precision", "new_state",
           "read_state", "write_state"]

STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")
STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
SCALED_RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0, torch.uint8: 448.0}
_FP8 = torch.float8_e4m3fn


def full_precision(param: torch.Tensor) -> torch.dtype:
    """The dtype a "float32" state of ``param`` takes: float64 for a float64 parameter
    (kept exact for float64 work), else float32."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def new_state(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A state of zeros shaped as ``param`` in the storage for ``dtype``."""
    shape, device = param.shape, param.device
    if dtype == torch.uint8:
        return Float8Tensor(torch.zeros(shape, dtype=_FP8, device=device),
                            torch.ones(1, dtype=torch.float32, device=device), torch.float32)
    if dtype == torch.float32:
        dtype = full_precision(param)
    return torch.zeros(shape, dtype=dtype, device=device)


def read_state(stored: torch.Tensor, dtype: torch.dtype,
               scale: Optional[torch.Tensor]) -> torch.Tensor:
    """The value of a state (NOTE [Scaled optimizer states]): the stored tensor itself
    where it is not scaled (float32, float64, bfloat16), else a new float32 tensor."""
    if dtype == torch.uint8:
        return stored.dequantize(dtype=torch.float32)
    if dtype == torch.float16:
        return stored.float() * scale
    return stored


def write_state(value: torch.Tensor, stored: torch.Tensor, dtype: torch.dtype,
                scale: Optional[torch.Tensor]) -> None:
    """Store ``value`` into the state ``stored``, re-computing its ``scale`` in place."""
    if dtype not in SCALED_RANGE:
        stored.copy_(value)
        return
    value = value.to(device=stored.device, dtype=torch.float32)
    peak = value.abs().amax() if value.numel() else value.new_zeros(())
    scale.copy_((peak / SCALED_RANGE[dtype]).reshape(1))
    if dtype == torch.float16:
        rscale = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
        stored.copy_(value * rscale)
        return
    quant_scale = torch.where(scale > 0, scale.reciprocal(), torch.ones_like(scale))
    q = cast_to_fp8(value, quant_scale, _FP8)
    stored._data.copy_(q.data)
    stored._scale_inv.copy_(q.scale_inv.reshape(1))
