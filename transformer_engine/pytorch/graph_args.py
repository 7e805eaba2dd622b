"""The arguments of ``te.make_graphed_callables``: TE's old and new spellings, the
callables with their sample inputs, and what a CUDA graph can take (CUDA tensors, an
NCCL amax-reduction group)."""

from __future__ import annotations

import warnings

import torch

from .utils import check_process_group

__all__ = ["UNSET", "API", "resolve", "check_group", "normalize", "check_devices"]

UNSET = object()
API = "te.make_graphed_callables"


def resolve(new_name: str, new, old_name: str, old, default):
    """A TE argument that has a new and a deprecated spelling."""
    if old is not UNSET:
        warnings.warn(f"{API}: {old_name} is deprecated; use {new_name}",
                      DeprecationWarning, stacklevel=3)
        if new is not UNSET and new != old:
            raise ValueError(f"{API}: {new_name}={new!r} and its deprecated spelling "
                             f"{old_name}={old!r} disagree; pass only {new_name}")
        return old
    return default if new is UNSET else new


def check_group(group) -> None:
    """The amax reduction group must be one whose collectives a graph can capture."""
    dist = torch.distributed
    if group is None:
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        group = dist.group.WORLD
    check_process_group(API, "amax_reduction_group", group)
    backend = dist.get_backend(group)
    if backend != "nccl":
        raise RuntimeError(f"{API}: the amax reduction group uses the {backend!r} backend, whose "
                           "collectives cannot be captured in a CUDA graph; use an NCCL group "
                           "(or reduce_amax=False in the recipe)")


def normalize(modules, sample_args, sample_kwargs):
    single = not isinstance(modules, tuple)
    callables = (modules,) if single else modules
    args = (sample_args,) if single else sample_args
    if not isinstance(args, tuple) or len(args) != len(callables):
        raise ValueError(f"{API}: sample_args must hold one tuple of tensors per callable "
                         f"({len(callables)}), got {type(sample_args).__name__}")
    if sample_kwargs is None:
        kwargs = tuple({} for _ in callables)
    else:
        kwargs = (sample_kwargs,) if single else sample_kwargs
        if not (isinstance(kwargs, tuple) and len(kwargs) == len(callables)
                and all(isinstance(k, dict) for k in kwargs)):
            raise ValueError(f"{API}: sample_kwargs must hold one dict per callable, "
                             f"got {type(sample_kwargs).__name__}")
    for i, (fn, a, k) in enumerate(zip(callables, args, kwargs)):
        if not callable(fn):
            raise TypeError(f"{API}: callable {i} is not callable: {type(fn).__name__}")
        if not isinstance(a, tuple) or not all(torch.is_tensor(t) for t in a):
            raise TypeError(f"{API}: sample_args[{i}] must be a tuple of tensors, got "
                            f"{[type(t).__name__ for t in a] if isinstance(a, tuple) else a!r}")
        bad = [name for name, v in k.items() if not torch.is_tensor(v)]
        if bad:
            raise TypeError(f"{API}: sample_kwargs[{i}] values must be tensors; {bad} are not")
    return single, callables, args, kwargs


def check_devices(callables, args, kwargs) -> None:
    for i, (fn, a, k) in enumerate(zip(callables, args, kwargs)):
        for what, t in [(f"sample_args[{i}][{j}]", t) for j, t in enumerate(a)] + \
                [(f"sample_kwargs[{i}][{n!r}]", t) for n, t in k.items()]:
            if not t.is_cuda:
                raise RuntimeError(f"{API}: {what} is on {t.device}; a CUDA graph can only "
                                   "take CUDA tensors")
        if isinstance(fn, torch.nn.Module):
            for name, p in fn.named_parameters():
                if not p.is_cuda:
                    raise RuntimeError(f"{API}: parameter {name!r} of callable {i} is on "
                                       f"{p.device}; move the module to CUDA first")
