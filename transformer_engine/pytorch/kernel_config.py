"""Which kernels the FP8 casts, GEMMs and updates run: one frozen `KernelConfig`,
read from the environment at first use, replaced only through `kernel_config`.

NOTE [Kernel selection]
    CUDA: with ``fused`` (the default) and Triton importable, every cast of a CUDA
    tensor is one Triton pass that also records the amax and writes the transposed
    FP8 copy, and one launch updates all states of a delayed-scaling update (NOTE
    [Fused casts] in quantize.py); otherwise the torch reference ops run. Both compute
    the same bits. ``direct_launch`` calls the compiled Triton kernels' launchers
    directly (NOTE [Launch overhead] in kernels/launch.py), only on the Triton
    versions that interface was checked on; elsewhere every launch goes through the
    JIT. ``fused_producers``: a normalization or activation that feeds an FP8 GEMM
    writes the FP8 copy of its output and its amax in its own kernel (NOTE [Fused
    producers] in module/fused_producers.py; needs ``fused`` too). ``interpret``: CPU
    tensors take the Triton kernels too, run by the Triton interpreter (set
    ``TRITON_INTERPRET=1`` before Triton is imported): for testing the kernels and
    their wiring without a GPU, not for use. CPU: ``cpu_gemm`` picks the FP8 GEMM
    (NOTE [CPU FP8 GEMM]). Block scaling:
    ``block_gemm`` "hardware" runs its GEMMs on Hopper through ``torch._scaled_mm``'s
    blockwise scales where the shapes allow, "emulation" always emulates them (NOTE
    [Block scaling layout] in block_scaling.py).

    Environment, read once: ``NVTE_FUSED_FP8_KERNELS=0`` turns the fused kernels off;
    ``NVTE_FUSED_PRODUCERS=0`` the fused producers only;
    ``NVTE_CPU_FP8_GEMM=scaled_mm`` selects ``torch._scaled_mm`` on the CPU;
    ``NVTE_BLOCK_FP8_GEMM=emulation`` turns the Hopper block-scaled GEMM off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["KernelConfig", "get_kernel_config", "kernel_config", "CPU_GEMMS", "BLOCK_GEMMS",
           "SuspectCompile", "load_kernels"]

CPU_GEMMS = ("upcast", "scaled_mm")


class SuspectCompile(RuntimeError):
    """A Triton kernel's specialization was refused before its launch: its compiled
    code is of the kind ptxas miscompiles (NOTE [Suspect compiles] in kernels/launch.py).
    Raised before anything is written, so the caller takes the torch path instead."""

BLOCK_GEMMS = ("hardware", "emulation")
_SWITCHES = {"1": True, "0": False}


@dataclass(frozen=True)
class KernelConfig:
    """The kernel choices (NOTE [Kernel selection]).

    Parameters
    ----------
    fused : bool, default True
        CUDA: Triton kernels for the casts, amaxes and the delayed-scaling update.
    direct_launch : bool, default True
        CUDA: launch compiled Triton kernels directly where the Triton version allows.
    fused_producers : bool, default True
        CUDA: normalizations and activations write their FP8 outputs themselves.
    interpret : bool, default False
        Run the Triton kernels on CPU tensors through the Triton interpreter (tests).
    cpu_gemm : "upcast" | "scaled_mm", default "upcast"
        The CPU FP8 GEMM.
    block_gemm : "hardware" | "emulation", default "hardware"
        The Float8BlockScaling GEMM on Hopper (elsewhere it is always emulated).
    """

    fused: bool = True
    direct_launch: bool = True
    fused_producers: bool = True
    interpret: bool = False
    cpu_gemm: str = "upcast"
    block_gemm: str = "hardware"

    def __post_init__(self):
        for name in ("fused", "direct_launch", "fused_producers", "interpret"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"KernelConfig: {name} must be a bool, "
                                f"got {getattr(self, name)!r}")
        if self.cpu_gemm not in CPU_GEMMS:
            raise ValueError(f"KernelConfig: cpu_gemm must be one of {CPU_GEMMS}, "
                             f"got {self.cpu_gemm!r}")
        if self.block_gemm not in BLOCK_GEMMS:
            raise ValueError(f"KernelConfig: block_gemm must be one of {BLOCK_GEMMS}, "
                             f"got {self.block_gemm!r}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> "KernelConfig":
        switches = {}
        for field, name in (("fused", "NVTE_FUSED_FP8_KERNELS"),
                            ("fused_producers", "NVTE_FUSED_PRODUCERS")):
            value = environ.get(name, "1")
            if value not in _SWITCHES:
                raise ValueError(f"{name} must be 0 or 1, got {value!r}")
            switches[field] = _SWITCHES[value]
        return cls(**switches,
                   cpu_gemm=environ.get("NVTE_CPU_FP8_GEMM", "upcast"),
                   block_gemm=environ.get("NVTE_BLOCK_FP8_GEMM", "hardware"))


_LOCK = threading.Lock()
_config: Optional[KernelConfig] = None


def get_kernel_config() -> KernelConfig:
    """The configuration in force (read from the environment at the first call)."""
    global _config
    config = _config
    if config is None:
        with _LOCK:
            if _config is None:
                _config = KernelConfig.from_environment()
            config = _config
    return config


@contextlib.contextmanager
def kernel_config(**changes):
    """Run a block with some fields replaced (``kernel_config(fused=False)``); the
    configuration found on entry is put back on exit. Process-wide, not per thread:
    for tests and benchmarks."""
    global _config
    saved = get_kernel_config()
    _config = dataclasses.replace(saved, **changes)
    try:
        yield _config
    finally:
        _config = saved


def load_kernels(*names: str):
    """The Triton kernel modules ``names`` of `kernels` (e.g. ``load_kernels("casts")``),
    imported now, as a tuple; False where Triton (or a working Triton) is missing.
    Callers keep the answer, so each imports once, on first use: the CPU path never
    imports the kernels package."""
    import importlib

    package = __name__.rsplit(".", 1)[0] + ".kernels"
    try:
        if not importlib.import_module(package + ".common").AVAILABLE:
            return False
        return tuple(importlib.import_module(f"{package}.{name}") for name in names)
    except ImportError:
        return False
