"""The arguments of ``te.make_graphed_callables``: TE's old and new spellings, the
callables with their sample inputs, and what a CUDA graph can take (CUDA tensors, an
NCCL amax-reduction group)."""

from __future__ import annotations

import warnings

import torch

from .utils import check_process_group

__all__ = ["UNSET", "API", "resolve", "check_group", "normalize", "check_devices",
           "check_capture_time_hooks", "run_hooks", "HOOK_NAMES"]

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


def normalize(modules, sample_args, sample_kwargs, schedule=None):
    """``(single, callables, args, kwargs)``: the callables as a tuple, each graph's
    sample arguments as a tuple of tensors (TE takes them as a tuple or a list) and
    its keyword arguments as a dict. One graph per callable, or with ``_order`` one per
    layer and micro-batch (``schedule``, NOTE [Pipeline schedule] in graph_schedule.py)."""
    single = not isinstance(modules, tuple)
    callables = (modules,) if single else modules
    args = (sample_args,) if single else sample_args
    if schedule is not None and schedule.ordered:
        count = schedule.num_graphs
        micro = max(schedule.microbatch_of) + 1
        per = (f"graph ({count}: {len(callables)} callables x {micro} micro-batches of "
               "_order)")
    else:
        count, per = len(callables), f"callable ({len(callables)})"
    if not isinstance(args, (tuple, list)) or len(args) != count:
        raise ValueError(f"{API}: sample_args must hold one tuple (or list) of tensors per "
                         f"{per}, got {type(sample_args).__name__}"
                         + ("" if not isinstance(args, (tuple, list)) else f" of {len(args)}"))
    if sample_kwargs is None:
        kwargs = tuple({} for _ in range(count))
    else:
        kwargs = (sample_kwargs,) if single else sample_kwargs
        if not (isinstance(kwargs, (tuple, list)) and len(kwargs) == count
                and all(isinstance(k, dict) for k in kwargs)):
            raise ValueError(f"{API}: sample_kwargs must hold one dict per {per}, "
                             f"got {type(sample_kwargs).__name__}")
    layer_of = schedule.layer_of if schedule is not None else range(count)
    for i, (layer, a, k) in enumerate(zip(layer_of, args, kwargs)):
        fn = callables[layer]
        if not callable(fn):
            raise TypeError(f"{API}: callable {layer} is not callable: {type(fn).__name__}")
        if not isinstance(a, (tuple, list)) or not all(torch.is_tensor(t) for t in a):
            raise TypeError(f"{API}: sample_args[{i}] must be a tuple or list of tensors, got "
                            f"{[type(t).__name__ for t in a] if isinstance(a, (tuple, list)) else a!r}")
        bad = [name for name, v in k.items() if not torch.is_tensor(v)]
        if bad:
            raise TypeError(f"{API}: sample_kwargs[{i}] values must be tensors; {bad} are not")
    return single, callables, tuple(tuple(a) for a in args), tuple(kwargs)


HOOK_NAMES = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")


def check_capture_time_hooks(hooks, count: int):
    """TE's ``capture_time_hooks``: None, or one entry per callable (None or a dict from
    some of `HOOK_NAMES` to ``{hook_id: hook(module)}``); each callable's four dicts."""
    if hooks is None:
        hooks = [None] * count
    if not isinstance(hooks, (list, tuple)) or len(hooks) != count:
        raise ValueError(f"{API}: capture_time_hooks must hold one entry per callable ({count}), "
                         f"got {hooks!r}")
    found = []
    for i, entry in enumerate(hooks):
        entry = {} if entry is None else entry
        if not isinstance(entry, dict):
            raise TypeError(f"{API}: capture_time_hooks[{i}] must be None or a dict, "
                            f"got {type(entry).__name__}")
        unexpected = set(entry) - set(HOOK_NAMES)
        if unexpected:
            raise ValueError(f"{API}: capture_time_hooks[{i}] has unexpected keys "
                             f"{sorted(unexpected)}; the keys are {list(HOOK_NAMES)}")
        per_name = {}
        for name in HOOK_NAMES:
            group = entry.get(name, {})
            if not isinstance(group, dict) or not all(callable(h) for h in group.values()):
                raise TypeError(f"{API}: capture_time_hooks[{i}][{name!r}] must be a dict of "
                                "hook_id -> hook(module)")
            per_name[name] = group
        found.append(per_name)
    return found


def run_hooks(hooks, index: int, name: str, fn) -> None:
    """Run callable ``index``'s ``name`` capture-time hooks on it (outside any capture)."""
    for hook in hooks[index][name].values():
        if hook(fn) is not None:
            raise RuntimeError(f"{API}: capture_time_hooks {name} must not return a value "
                               f"(callable {index})")


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
