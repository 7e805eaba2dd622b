"""Compile the package's Triton kernels for a Hopper GPU on a machine without one.

Triton's compiler needs no GPU: given a target it lowers a kernel to PTX and assembles
it with the ptxas its wheel ships. `compile_only` makes Triton believe the current
device is an sm_90 GPU and turns every launch of the package's kernels into a compile
of that launch's specialization (`Launcher.check`, the check that runs before a
real first launch: NOTE [Suspect compiles] in kernels/launch.py) with nothing run. So
the kernel wrappers can be called on CPU tensors of the shapes, dtypes and strides the
GPU would see, and every specialization they reach is compiled and its PTX checked.
"""

from __future__ import annotations

import contextlib
from typing import List, Tuple

import torch

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver as _driver
except ImportError:  # pragma: no cover - Triton missing: the audit tests skip
    triton = None

__all__ = ["available", "compile_only"]


def available() -> Tuple[bool, str]:
    """Whether this Triton can compile for sm_90 here, and why not."""
    if triton is None:
        return False, "Triton is not installed"
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        return False, "this Triton has no CUDA backend"
    return True, ""


class _HopperDriver:
    """What Triton's JIT asks the active driver for when it compiles (no launch)."""

    def __init__(self, capability: int):
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def compile_only(capability: int = 90):
    """Within the block, a launch of one of the package's kernels compiles its
    specialization for ``sm_<capability>`` and checks its PTX, refusing a suspect one
    as a real first launch would (`SuspectCompile`), and runs nothing. Yields the list
    of ``(kernel name, key, suspect)`` of each specialization compiled."""
    from transformer_engine.pytorch.kernels import launch

    seen: List[tuple] = []
    touched = {}            # launcher -> its (compiled, refused) before the block
    real_call = launch.Launcher.__call__

    def compile_call(self, grid, num_warps, key, *args):
        if self not in touched:
            touched[self] = (dict(self.compiled), set(self.checked), set(self.refused))
        entry_key = (0, key)
        if entry_key in self.checked:
            return
        if entry_key in self.refused:
            raise launch.SuspectCompile(self.kernel.__name__)
        try:
            self.check(grid, num_warps, entry_key, args)
        except launch.SuspectCompile:
            seen.append((self.kernel.__name__, key, True))
            raise
        seen.append((self.kernel.__name__, key, False))

    previous = _driver._active
    _driver.set_active(_HopperDriver(capability))
    launch.Launcher.__call__ = compile_call
    try:
        yield seen
    finally:
        launch.Launcher.__call__ = real_call
        _driver._active = previous
        for launcher, saved in touched.items():     # nothing of the audit stays behind
            launcher.compiled, launcher.checked, launcher.refused = saved
            launcher.kernel.device_caches.clear()
