"""Whether FP8 runs here: `is_fp8_available` (CUDA compute capability, or a probe of
the CPU FP8 GEMM) and the ``check_*_support`` queries TE's clients call. The fp8
module re-exports them, where TE has them."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import quantize

__all__ = ["is_fp8_available", "check_fp8_support", "check_mxfp8_support",
           "check_fp8_block_scaling_support", "check_nvfp4_support", "recipe_execution"]


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


def _emulation_support() -> Tuple[bool, str]:
    """Where an exactly emulated recipe runs: on any CUDA device (torch ops on CUDA
    tensors), and on the CPU where torch's FP8 dtypes and the FP8 GEMM probe work."""
    if torch.cuda.is_available():
        return True, ""
    return is_fp8_available(return_reason=True, device="cpu")


def check_mxfp8_support() -> Tuple[bool, str]:
    """``(available, reason)`` for ``MXFP8BlockScaling``: emulated exactly on any CUDA
    device and on the CPU (NOTE [MXFP8 layout and rounding] in mx_scaling.py), so it
    runs wherever this package's FP8 runs; `recipe_execution` says it is emulated."""
    return _emulation_support()


def check_nvfp4_support() -> Tuple[bool, str]:
    """``(available, reason)`` for ``NVFP4BlockScaling``: emulated exactly, as MXFP8
    (NOTE [NVFP4 layout and rounding] in nvfp4_scaling.py)."""
    return _emulation_support()


def check_fp8_block_scaling_support() -> Tuple[bool, str]:
    """``(available, reason)`` for ``Float8BlockScaling``: its GEMMs run on Hopper's
    block-scaled FP8 GEMM where they fit and are an exact float32 emulation elsewhere
    (NOTE [Block scaling layout] in block_scaling.py), which needs only torch's FP8
    dtypes, so it runs wherever `check_fp8_support` says FP8 runs, and on any CUDA
    device too."""
    if torch.cuda.is_available():
        return True, ""
    return is_fp8_available(return_reason=True, device="cpu")


def recipe_execution(recipe, device=None) -> Tuple[str, str]:
    """``("native" | "emulated", how)``: whether ``recipe``'s GEMMs run on ``device``'s
    own low-precision tensor cores or are computed from the quantized operands by a
    float32 emulation (exact products, float32 sums).

    MXFP8BlockScaling and NVFP4BlockScaling are always emulated here (Blackwell's MX
    and NVFP4 tensor cores are not used, on Hopper and the CPU there are none).
    Float8BlockScaling is native on Hopper where its GEMM fits (NOTE [Block-scaled
    GEMM routing] in block_scaling.py), per-tensor scaling on CUDA devices with FP8
    (compute capability 8.9+) through ``torch._scaled_mm``; on the CPU both are exact
    upcast GEMMs. ``device`` defaults to CUDA if present, else the CPU.
    """
    from ..common.recipe import Recipe        # (recipe.py imports nothing from here)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe_execution: recipe must be a transformer_engine.common.recipe."
                        f"Recipe, got {type(recipe).__name__}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if recipe.mxfp8() or recipe.nvfp4():
        name = "MXFP8" if recipe.mxfp8() else "NVFP4"
        return "emulated", (f"{name} operands are dequantized to float32 and multiplied by a "
                            f"float32 GEMM on {device.type} (no {name} tensor-core kernel is "
                            "used)")
    if device.type != "cuda":
        return "emulated", "the CPU computes FP8 GEMMs by an exact float32 upcast GEMM"
    if not is_fp8_available(device=device):
        return "emulated", is_fp8_available(return_reason=True, device=device)[1]
    if recipe.float8_block_scaling():
        hopper = torch.cuda.get_device_capability(device) == (9, 0)
        if hopper:
            return "native", ("Hopper's block-scaled FP8 GEMM (torch._scaled_mm) where the "
                              "shape fits, else the exact emulation")
        return "emulated", "the block-scaled FP8 GEMM needs a Hopper GPU (SM 9.0)"
    return "native", "FP8 tensor cores through torch._scaled_mm"
