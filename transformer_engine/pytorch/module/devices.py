"""Where a TE module lives and in which dtype its GEMMs run: the default device, the
activation dtype under ``torch.autocast``, and a context with ``torch.autocast`` off."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["default_device", "activation_dtype", "no_autocast"]


def default_device(device) -> torch.device:
    """``device`` or, when None, CUDA if available else CPU (TE's modules default to CUDA)."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def activation_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a GEMM should produce: the torch.autocast dtype if autocast is on."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


# (a nullcontext holds nothing and may be entered again and again, from any thread)
_NO_CONTEXT = contextlib.nullcontext()


def no_autocast(device_type: str):
    """A context with ``torch.autocast`` off for ``device_type`` (a no-op context when
    it is off already: entering ``torch.autocast`` costs host time on every GEMM)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return _NO_CONTEXT
