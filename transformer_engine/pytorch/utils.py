"""Small helpers shared across the package: nested-structure flattening for
checkpointed and graphed callables' outputs."""

from __future__ import annotations

from typing import Any, Tuple

__all__ = ["flatten_nested", "rebuild_nested"]


def flatten_nested(obj) -> Tuple[list, Any]:
    """The leaves of nested tuples, lists and dicts (named tuples are leaves), and a
    spec that `rebuild_nested` turns back into the same structure."""
    if isinstance(obj, (tuple, list)) and not hasattr(obj, "_fields"):
        leaves, specs = [], []
        for item in obj:
            sub, spec = flatten_nested(item)
            leaves += sub
            specs.append((len(sub), spec))
        return leaves, (type(obj), specs)
    if isinstance(obj, dict):
        keys = list(obj)
        leaves, spec = flatten_nested([obj[k] for k in keys])
        return leaves, (dict, keys, spec)
    return [obj], None


def rebuild_nested(leaves: list, spec):
    """The structure `flatten_nested` described, with ``leaves`` in place."""
    if spec is None:
        return leaves[0]
    if spec[0] is dict:
        _, keys, inner = spec
        return dict(zip(keys, rebuild_nested(leaves, inner)))
    kind, specs = spec
    items, start = [], 0
    for count, sub in specs:
        items.append(rebuild_nested(leaves[start:start + count], sub))
        start += count
    return kind(items)
