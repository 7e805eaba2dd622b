"""How the Triton kernels of this package are launched: straight through the
compiled kernel's launcher once a specialization has been compiled.

NOTE [Launch overhead]
    A small ``te.Linear`` step is bound by the host, not the GPU, and Triton's JIT
    launch path binds and specializes every argument, builds launch metadata and calls
    its (empty) launch hooks on every call. So each launch goes through `Launcher`:
    the first launch of a specialization goes through the JIT, which compiles and
    returns the compiled kernel; later ones call that kernel's launcher directly. Each
    wrapper passes a key of what the JIT specializes on among the arguments that can
    vary: dtypes, constexpr values, and Triton's rule for the rest (an int on being 1,
    on divisibility by 16 and on fitting int32: `int_spec`; a pointer on 16-byte
    alignment: `aligned`), so a compiled kernel is reused only where the JIT would
    reuse it (tests/pytorch/test_triton_kernels.py alternates such arguments). The
    compiled kernel's launcher and that key rule are Triton internals, checked on the
    versions in `DIRECT_LAUNCH_TRITON_VERSIONS` only: on any other Triton, with a
    launch hook registered (a profiler's), or with ``KernelConfig.direct_launch`` off,
    every launch goes through the JIT. On an H200 machine this took a ``te.Linear``
    step at 256^3 from 1285 to 795 us of host time (benchmarks/bench_linear.py).
    Under the Triton interpreter (``TRITON_INTERPRET=1``, tests without a GPU) every
    launch goes through the JIT too.

Imported only by the kernel files of this package, so only where Triton imports.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Dict, List, Optional, Tuple

import torch

from ..kernel_config import SuspectCompile, get_kernel_config

try:
    import triton
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: every launch through the JIT
    _knobs = None

__all__ = ["Launcher", "int_spec", "aligned", "direct_launch_supported",
           "DIRECT_LAUNCH_TRITON_VERSIONS", "INTERPRET", "undefined_registers",
           "suspect_compiles", "ptx_suspect", "SuspectCompile"]

_INT32_MIN, _INT32_MAX = -2 ** 31, 2 ** 31 - 1

# (major, minor) of the Triton releases whose launcher interface and specialization
# rule NOTE [Launch overhead] was checked against.
DIRECT_LAUNCH_TRITON_VERSIONS = ((3, 6),)


def direct_launch_supported(version: Optional[str]) -> bool:
    """Whether the direct launch may be used with this Triton version string."""
    if not version:
        return False
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) in DIRECT_LAUNCH_TRITON_VERSIONS


# The Triton interpreter runs kernels on CPU tensors with numpy (read when Triton is
# imported, as Triton reads it).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

_DIRECT_LAUNCH_OK = (triton is not None and not INTERPRET
                     and direct_launch_supported(getattr(triton, "__version__", None)))


def int_spec(v: int) -> int:
    """What Triton's JIT specializes an int argument on: 1, divisible by 16, or
    neither; and whether it fits int32 (NOTE [Launch overhead])."""
    spec = 1 if v == 1 else (16 if v % 16 == 0 else 0)
    return spec if _INT32_MIN <= v <= _INT32_MAX else spec + 64


def aligned(t: torch.Tensor) -> bool:
    """Whether Triton's JIT would specialize this pointer argument as 16-byte aligned."""
    return t.data_ptr() % 16 == 0


def _hooks_registered() -> bool:
    """Whether a Triton launch hook (a profiler's) is registered; then every launch
    goes through Triton's own path, which calls it."""
    if _knobs is None:
        return True
    for hook in (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _known_options(options: dict) -> dict:
    """The compile options this Triton's CUDA backend knows (an older one may lack
    ``enable_reflect_ftz``; the kernels' tests then show what that changes)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a Triton without the CUDA backend
        return {}
    known = getattr(CUDAOptions, "__dataclass_fields__", {})
    return {k: v for k, v in options.items() if k in known}


# PTX instructions without a destination operand: every register they name is read.
_NO_DEST = ("st.", "stmatrix", "bar", "bra", "red.", "fence", "membar", "prefetch", "ret",
            "exit", "trap", "cp.async", "barrier", "griddepcontrol")
_REG = re.compile(r"%[a-z]+[0-9]+")
_SPECIAL = re.compile(r"%(clock64|pm[0-9]+|envreg[0-9]+)$")      # special registers: read-only
_GUARD = re.compile(r"^@!?(%[a-z]+[0-9]+)\s+")


def undefined_registers(ptx: str) -> List[str]:
    """The registers that the PTX of a kernel reads and never writes (NOTE [FP8
    stores] in common.py): each instruction's first operand is what it writes, but for
    the stores, barriers and branches, which write nothing."""
    written, read = set(), set()
    for line in ptx.splitlines():
        for stmt in line.split("//", 1)[0].split(";"):
            stmt = stmt.strip().lstrip("{}").strip()
            guard = _GUARD.match(stmt)
            if guard:
                read.add(guard.group(1))
                stmt = stmt[guard.end():]
            if not stmt or stmt[0] in ".$" or stmt.endswith(":") or " " not in stmt:
                continue
            opcode, operands = stmt.split(None, 1)
            if opcode.startswith(_NO_DEST):
                read.update(_REG.findall(operands))
                continue
            depth, cut = 0, len(operands)      # the first operand ends at a top-level comma
            for i, ch in enumerate(operands):
                depth += ch in "{[" and 1 or (ch in "}]" and -1 or 0)
                if ch == "," and depth == 0:
                    cut = i
                    break
            written.update(_REG.findall(operands[:cut]))
            read.update(_REG.findall(operands[cut:]))
    return sorted(r for r in read - written if not _SPECIAL.match(r))


# NOTE [Suspect compiles]
#     A specialization is compiled (Triton's ``warmup``: nothing runs) and its PTX
#     checked by `undefined_registers` before its first launch. A suspect one is refused:
#     that launch and every later one of the same specialization raise `SuspectCompile`
#     before anything is written, and the caller (quantize.py, block_scaling.py,
#     delayed_scaling.py, module/fused_producers.py) takes the torch path, which gives
#     the same bits the kernel would have (NOTE [FP8 cast formula]). One RuntimeWarning
#     per kernel names it. The kernels store FP8 data only through `common.store_fp8`,
#     and tests/pytorch/test_kernel_ptx.py compiles every specialization the tests and
#     benchmarks reach on the CPU (no GPU needed) and requires none to be suspect: the
#     refusal is a safety net, not a path the package expects to take.

# (kernel name, registers) of each compiled kernel whose PTX reads registers it never
# writes; `Launcher` adds to it and warns once per kernel
_SUSPECT: List[Tuple[str, Tuple[str, ...]]] = []
_WARNED: set = set()


def suspect_compiles() -> List[Tuple[str, Tuple[str, ...]]]:
    """The kernels compiled so far in this process whose PTX reads registers it never
    writes (the GPU tests require none)."""
    return list(_SUSPECT)


def ptx_suspect(kernel, compiled) -> bool:
    """Whether ``compiled`` (a compiled Triton kernel) reads registers it never
    writes; records and warns once per kernel if so (NOTE [Suspect compiles])."""
    asm = getattr(compiled, "asm", None)
    try:
        ptx = asm["ptx"]
    except (KeyError, TypeError):      # a cache that keeps binaries only
        return False
    regs = undefined_registers(ptx)
    if not regs:
        return False
    name = getattr(kernel, "__name__", str(kernel))
    _SUSPECT.append((name, tuple(regs)))
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(
            f"Triton compiled {name} to PTX that reads registers it never writes "
            f"({', '.join(regs[:4])}{', ...' if len(regs) > 4 else ''}), code the ptxas "
            f"of Triton 3.6 miscompiles (NOTE [FP8 stores] in "
            f"transformer_engine/pytorch/kernels/common.py): this specialization is not "
            f"used; its launches take the torch path, which gives the same bits.",
            RuntimeWarning, stacklevel=4)
    return True


class Launcher:
    """Launches one JIT kernel (NOTE [Launch overhead]). The caller passes ``key``:
    everything the JIT specializes the kernel on (dtypes, constexpr values, int and
    alignment specializations of the runtime arguments) that its arguments can vary
    in. The first launch of a key compiles it without running it and checks its PTX
    (NOTE [Suspect compiles]): a suspect key raises `SuspectCompile` now and on every
    later launch. Later launches of a sound key call the compiled kernel's launcher
    directly. Arguments are positional, constexprs included, in the kernel's parameter
    order. ``options`` are compile options passed on every JIT launch
    (``enable_fp_fusion=False``: no multiply-add contraction but the explicit
    ``tl.fma`` of a kernel, NOTE [Same arithmetic] in activations.py)."""

    def __init__(self, kernel, **options):
        self.kernel = kernel
        self.options = {} if INTERPRET else _known_options(options)
        self.compiled: Dict[tuple, tuple] = {}     # direct-launch entries of checked keys
        self.checked: set = set()                  # keys compiled and found sound
        self.refused: set = set()                  # keys compiled and found suspect

    def check(self, grid, num_warps: int, entry_key: tuple, args) -> None:
        """Compile ``entry_key``'s specialization without running it and check its PTX
        (NOTE [Suspect compiles]); a suspect one is refused from now on."""
        compiled = self.kernel.warmup(*args, grid=grid, num_warps=num_warps, **self.options)
        if ptx_suspect(self.kernel, compiled):
            self.refused.add(entry_key)
            raise SuspectCompile(getattr(self.kernel, "__name__", str(self.kernel)))
        self.checked.add(entry_key)

    def __call__(self, grid: Tuple[int, int, int], num_warps: int, key: tuple, *args) -> None:
        if INTERPRET:
            self.kernel[grid](*args, num_warps=num_warps, **self.options)
            return
        # Triton launches on the current device; CUDA is initialized by the time a
        # module casts on it, so torch.cuda.current_device()'s lazy-init check is skipped
        device = torch._C._cuda_getDevice()
        entry_key = (device, key)
        entry = self.compiled.get(entry_key)
        if (entry is None or not (_DIRECT_LAUNCH_OK and get_kernel_config().direct_launch)
                or _hooks_registered()):
            if entry_key not in self.checked:
                if entry_key in self.refused:
                    raise SuspectCompile(getattr(self.kernel, "__name__", str(self.kernel)))
                self.check(grid, num_warps, entry_key, args)
            compiled = self.kernel[grid](*args, num_warps=num_warps, **self.options)
            if (entry is None and _DIRECT_LAUNCH_OK and compiled is not None
                    and getattr(compiled, "function", None) is not None):
                self.compiled[entry_key] = (compiled.run, compiled.function,
                                            compiled.packed_metadata)
            return
        run, function, metadata = entry
        stream = torch._C._cuda_getCurrentRawStream(device)
        run(grid[0], grid[1], grid[2], stream, function, metadata, None, None, None, *args)
