"""Whether FP8 runs here: `is_fp8_available` (CUDA compute capability, or a probe of
the CPU FP8 GEMM) and the ``check_*_support`` queries TE's clients call. The fp8
module re-exports them, where TE has them."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import quantize

__all__ = ["is_fp8_available", "check_fp8_support", "check_mxfp8_support",
           "check_fp8_block_scaling_support"]


_CPU_FP8_PROBE: Optional[Tuple[bool, str]] = None


def _probe_cpu_fp8() -> Tuple[bool, str]:
    """Run the CPU FP8 GEMM once on a known product (NOTE [CPU FP8 GEMM])."""
    global _CPU_FP8_PROBE
    if _CPU_FP8_PROBE is None:
        try:
            one = torch.ones(1, dtype=torch.float32)
            a = quantize.Float8Data(torch.ones(16, 16, dtype=torch.float8_e4m3fn), one)
            out = quantize.fp8_gemm(a, a, torch.float32)
            ok = bool(out[0, 0].item() == 16.0)
            _CPU_FP8_PROBE = (ok, "" if ok else "the CPU FP8 GEMM gave a wrong result")
        except (RuntimeError, NotImplementedError) as err:
            _CPU_FP8_PROBE = (False, f"the CPU FP8 GEMM is not available: {err}")
    return _CPU_FP8_PROBE


def is_fp8_available(return_reason: bool = False, device=None):
    """Whether FP8 GEMMs can run on ``device`` (default: CUDA if present, else CPU).

    CUDA needs compute capability 8.9 (Ada) or newer; the CPU needs torch's FP8
    dtypes and the CPU FP8 GEMM to run (probed once).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            ok, reason = False, "CUDA is not available"
        else:
            major, minor = torch.cuda.get_device_capability(device)
            ok = (major, minor) >= (8, 9)
            reason = "" if ok else f"FP8 needs compute capability 8.9+, device has {major}.{minor}"
    elif device.type == "cpu":
        ok, reason = _probe_cpu_fp8()
    else:
        ok, reason = False, f"FP8 GEMMs are not supported on device type {device.type!r}"
    return (ok, reason) if return_reason else ok


# ---- support checks, as TE's clients call them ----------------------------------------

def check_fp8_support() -> Tuple[bool, str]:
    """``(available, reason)``: whether FP8 GEMMs run on the default device (CUDA if
    present, else the CPU), as `is_fp8_available` decides; ``reason`` is empty when
    they do."""
    return is_fp8_available(return_reason=True)


_NOT_IMPLEMENTED_RECIPES = ("this pure-PyTorch Transformer Engine implements the DelayedScaling, "
                            "Float8CurrentScaling and Float8BlockScaling recipes only")


def check_mxfp8_support() -> Tuple[bool, str]:
    """``(False, reason)``: MXFP8 block scaling (``MXFP8BlockScaling``) is not implemented."""
    return False, f"MXFP8 block scaling is not implemented: {_NOT_IMPLEMENTED_RECIPES}"


def check_fp8_block_scaling_support() -> Tuple[bool, str]:
    """``(available, reason)`` for ``Float8BlockScaling``: its GEMMs run on Hopper's
    block-scaled FP8 GEMM where they fit and are an exact float32 emulation elsewhere
    (NOTE [Block scaling layout] in block_scaling.py), which needs only torch's FP8
    dtypes, so it runs wherever `check_fp8_support` says FP8 runs, and on any CUDA
    device too."""
    if torch.cuda.is_available():
        return True, ""
    return is_fp8_available(return_reason=True, device="cpu")
