"""``te.ops.Sequential``: a ``torch.nn.Sequential`` whose consecutive fusible
operations run through one `OperationFuser` each (NOTE [Fusion passes] in fuser.py)."""

from __future__ import annotations

from typing import Iterable, Iterator, List, Optional, Union

import torch

from .fuser import OperationFuser
from .op import FusibleOperation

__all__ = ["Sequential"]


class Sequential(torch.nn.Module):
    """A sequence of modules, the fusible operations among them fused. Modules are
    registered under ``"0"``, ``"1"``, ... (or the keys of a dict passed alone), so the
    state_dict keys are those of ``torch.nn.Sequential``.

    Parameters
    ----------
    *args : FusibleOperation or torch.nn.Module, or one dict of them

    Returns (forward)
    -----------------
    The output, followed by the extra outputs (`MakeExtraOutput`) when there are any.
    Extra inputs (`AddExtraInput`) follow the input, in the order of the operations.
    """

    def __init__(self, *args: Union[FusibleOperation, torch.nn.Module]):
        super().__init__()
        self._module_groups: Optional[list] = None
        if len(args) == 1 and isinstance(args[0], dict):
            for key, module in args[0].items():
                self.add_module(key, module)
        else:
            for module in args:
                self.append(module)

    def add_module(self, name: str, module: Optional[torch.nn.Module]) -> None:
        self._module_groups = None
        super().add_module(name, module)

    def _keys(self, idx) -> List[str]:
        keys = list(self._modules.keys())
        if isinstance(idx, slice):
            return keys[idx]
        if not isinstance(idx, int):
            raise TypeError(f"te.ops.Sequential: index must be an int or a slice, "
                            f"got {type(idx).__name__}")
        if not -len(keys) <= idx < len(keys):
            raise IndexError(f"te.ops.Sequential: index {idx} out of range for "
                             f"{len(keys)} modules")
        return [keys[idx]]

    def __getitem__(self, idx):
        keys = self._keys(idx)
        if isinstance(idx, slice):
            return Sequential({k: self._modules[k] for k in keys})
        return self._modules[keys[0]]

    def __setitem__(self, idx: int, module: torch.nn.Module) -> None:
        self.add_module(self._keys(idx)[0], module)

    def __delitem__(self, idx) -> None:
        for key in self._keys(idx):
            del self._modules[key]
        self._module_groups = None

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self._modules.values())

    def _next_key(self) -> str:
        n = len(self._modules)
        while str(n) in self._modules:
            n += 1
        return str(n)

    def append(self, module: torch.nn.Module) -> "Sequential":
        """Add ``module`` at the end."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"te.ops.Sequential.append: expected a torch.nn.Module, "
                            f"got {type(module).__name__}")
        self.add_module(self._next_key(), module)
        return self

    def extend(self, modules: Iterable[torch.nn.Module]) -> "Sequential":
        """Add ``modules`` at the end, in order."""
        for module in modules:
            self.append(module)
        return self

    def insert(self, idx: int, module: torch.nn.Module) -> "Sequential":
        """Insert ``module`` before position ``idx`` (the keys are renumbered)."""
        modules = list(self._modules.values())
        modules.insert(idx, module)
        self._modules.clear()
        self._module_groups = None
        return self.extend(modules)

    def pop(self, idx: int) -> torch.nn.Module:
        """Remove and return the module at ``idx``."""
        module = self[idx]
        del self[idx]
        return module

    def __iadd__(self, modules: Iterable[torch.nn.Module]) -> "Sequential":
        return self.extend(modules)

    def __add__(self, modules: Iterable[torch.nn.Module]) -> "Sequential":
        return Sequential(*self, *modules)

    def _make_groups(self) -> list:
        """The modules in order, each run of fusible operations as one fuser."""
        groups: list = []
        for module in self._modules.values():
            if isinstance(module, FusibleOperation):
                if not groups or not isinstance(groups[-1], list):
                    groups.append([])
                groups[-1].append(module)
            else:
                groups.append(module)
        return [OperationFuser(g) if isinstance(g, list) else g for g in groups]

    def _groups(self) -> list:
        """The groups, kept between calls (each fuser keeps its fused lists). While
        dynamo traces, fresh ones: what a traced call writes to the module, dynamo
        guards on, so filling the cache in the first compiled call would compile the
        function again at the second (the fusion runs at trace time only)."""
        if torch.compiler.is_compiling():
            return self._make_groups()
        if self._module_groups is None:
            self._module_groups = self._make_groups()
        return self._module_groups

    def forward(self, input: torch.Tensor, *extra_inputs: torch.Tensor):  # noqa: A002
        """Run the modules in order (see the class docstring for the return value)."""
        x, extra_inputs, extra_outputs = input, list(extra_inputs), []
        for group in self._groups():
            if isinstance(group, OperationFuser):
                k = group.num_extra_inputs
                if len(extra_inputs) < k:
                    raise ValueError(f"te.ops.Sequential: its operations take "
                                     f"{self._count_extra_inputs()} extra inputs, got fewer")
                ins, extra_inputs = extra_inputs[:k], extra_inputs[k:]
                out = group(x, *ins)
                if isinstance(out, tuple):
                    x = out[0]
                    extra_outputs.extend(out[1:])
                else:
                    x = out
            else:
                x = group(x)
        if extra_inputs:
            raise ValueError(f"te.ops.Sequential: its operations take "
                             f"{self._count_extra_inputs()} extra inputs, got "
                             f"{self._count_extra_inputs() + len(extra_inputs)}")
        return (x, *extra_outputs) if extra_outputs else x

    def _count_extra_inputs(self) -> int:
        return sum(g.num_extra_inputs for g in self._groups() if isinstance(g, OperationFuser))
