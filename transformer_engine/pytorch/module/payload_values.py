"""The values, limits and errors of the bounded payload reader (NOTE [Payload
unpickler] in payload_pickle.py): what a payload may cost, the stand-ins it holds for
globals and recipe objects, and ``describe``, which renders any of its values for an
error message in bounded time."""

from __future__ import annotations

import itertools
from typing import Any, Callable, NamedTuple, Optional

__all__ = ["InvalidPayload", "Budget", "corrupt", "GlobalRef", "Record", "RecordSpec",
           "describe", "MARK", "LEAVES"]

MAX_OPS = 20_000            # opcodes per payload (its nested storage pickles included)
MAX_OBJECTS = 10_000        # values made and placed in containers, per payload
MAX_DEPTH = 16              # nesting of containers, tuples and records
MAX_MARKS = 32              # open MARKs at once
MAX_MEMO = 4_096            # memo entries
MAX_STR_BYTES = 4_096       # one str (utf-8 bytes)
MAX_INT_BYTES = 64          # one LONG1 / LONG4 integer
MAX_ITEMS = 1_024           # items of one container or tuple
MAX_GLOBAL_NAME = 512       # a GLOBAL's module or name (bytes)


class InvalidPayload(ValueError):
    """Why a payload was refused (the caller adds which module refused it)."""


def corrupt(detail: str) -> InvalidPayload:
    return InvalidPayload(f"its bytes are not a complete pickle (truncated or corrupted: {detail})")


class Budget:
    """The work one payload may cost, shared by the nested pickles it holds."""

    __slots__ = ("ops", "objects", "nbytes")

    def __init__(self, nbytes: int, ops: int = MAX_OPS, objects: int = MAX_OBJECTS):
        self.ops, self.objects, self.nbytes = ops, objects, nbytes

    def take_op(self) -> None:
        self.ops -= 1
        if self.ops < 0:
            raise InvalidPayload(f"it has more than {MAX_OPS} pickle operations")

    def take_objects(self, n: int = 1) -> None:
        self.objects -= n
        if self.objects < 0:
            raise InvalidPayload(f"it holds more than {MAX_OBJECTS} values")

    def take_bytes(self, n: int) -> None:
        """Storage and tensor bytes made: at most a few times the payload's own size,
        however often it reuses one storage."""
        self.nbytes -= n
        if self.nbytes < 0:
            raise InvalidPayload("it makes more tensor data than its own size allows "
                                 "(one storage read many times?)")


class RecordSpec(NamedTuple):
    """An allowed class whose instances a payload may hold: its name, the field names
    ``BUILD`` may set (declared here or by NVIDIA's TE), and private names TE's
    instances carry that are ignored (a cached repr)."""

    name: str
    fields: frozenset
    ignored: frozenset = frozenset(("_cached_repr",))


class Record:
    """An instance of an allowed class as the payload described it: the class's
    `RecordSpec` and the fields ``BUILD`` gave it. Never the class or an object of it:
    the caller builds the real object from checked fields."""

    __slots__ = ("spec", "fields", "built")

    def __init__(self, spec: RecordSpec):
        self.spec, self.fields, self.built = spec, {}, False


class GlobalRef:
    """A global the payload named, as the caller's table allows it: ``call(reader,
    args)`` for ``REDUCE``, ``new(reader, args)`` for ``NEWOBJ`` (either may be None:
    refused), ``value`` when the global is a plain constant (a storage type)."""

    __slots__ = ("qualname", "call", "new", "value")

    def __init__(self, qualname: str, call: Optional[Callable] = None,
                 new: Optional[Callable] = None, value: Any = None):
        self.qualname, self.call, self.new, self.value = qualname, call, new, value


class _Mark:
    """The pickle machine's MARK on the reader's stack."""

    __slots__ = ()


MARK = _Mark()
LEAVES = (type(None), bool, int, float, str, bytes)     # values that hold no other value


# ---- bounded descriptions ------------------------------------------------------------

def describe(value, limit: int = 80) -> str:
    """``value`` for an error message, in at most ``limit`` characters, in time
    bounded by ``limit`` whatever the value holds (shared or deep references): repr
    is called on leaves only, cut first."""
    out, size, todo = [], 0, [value]
    while todo and size <= limit:
        item = todo.pop()
        piece = item.text if isinstance(item, _Text) else _expand(item, todo, limit)
        out.append(piece)
        size += len(piece)
    text = "".join(out)
    return text if len(text) <= limit and not todo else text[:max(limit - 3, 0)] + "..."


class _Text:
    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


def _expand(item, todo: list, limit: int) -> str:
    """A leaf's text; or a container's opening, its first ``limit`` parts pushed."""
    leaf = _leaf(item, limit)
    if leaf is not None:
        return leaf
    seq = []
    if isinstance(item, dict):
        opening, closing = "{", "}"
        for i, (k, v) in enumerate(itertools.islice(item.items(), limit)):
            seq += ([_Text(", ")] if i else []) + [k, _Text(": "), v]
    else:
        opening, closing = ("[", "]") if isinstance(item, list) else ("(", ")")
        for i, v in enumerate(itertools.islice(item, limit)):
            seq += ([_Text(", ")] if i else []) + [v]
    if len(item) > limit:
        seq.append(_Text(", ..."))
    todo.append(_Text(closing))
    todo.extend(reversed(seq))
    return opening


def _leaf(item, limit: int) -> Optional[str]:
    if item is None or isinstance(item, (bool, float)):
        return repr(item)
    if isinstance(item, int):
        return repr(item) if abs(item) < 10 ** 30 else f"<int of {item.bit_length()} bits>"
    if isinstance(item, (str, bytes)):
        return repr(item[:limit]) + ("..." if len(item) > limit else "")
    if isinstance(item, GlobalRef):
        return f"<global {item.qualname}>"
    if isinstance(item, Record):
        return f"<{item.spec.name} object>"
    if type(item) in (dict, list, tuple):
        return None
    shape, dtype = getattr(item, "shape", None), getattr(item, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{dtype} tensor of shape {tuple(shape)}"
    name = getattr(item, "name", None)
    if type(item).__module__.startswith("transformer_engine") and isinstance(name, str):
        return f"{type(item).__name__}.{name}"            # a Format member
    return f"<{type(item).__name__} object>"
