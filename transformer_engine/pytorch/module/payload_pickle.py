"""A bounded pickle reader for FP8 extra-state payloads (NOTE [Payload unpickler]).

NOTE [Payload unpickler]
    ``pickle.Unpickler`` with a ``find_class`` allow-list still runs the pickle
    machine on the real objects it names: ``BUILD`` on a class, a function or an enum
    member is ``setattr`` on it, so a few appended bytes can rewrite a process-wide
    object, and a refusal comes after the damage. This reader runs its own machine
    over the opcodes a payload needs (protocol 2 and up) and never touches a real
    object it did not make:

    - a global is looked up in the caller's table and stands on the stack as a
      `GlobalRef` (the table's entry, not the object); only entries that say so may be
      called (``REDUCE``) or instantiated (``NEWOBJ``), and they build fresh values
      from checked arguments;
    - ``NEWOBJ`` of an allowed recipe class makes a `Record` (the class's name and its
      fields, nothing else); ``BUILD`` sets the fields of a record this reader made and
      nothing else, once, with field names the record's class declares;
    - ``SETITEM(S)`` / ``APPEND(S)`` act only on dicts and lists this reader made and
      that nothing holds yet: a container is sealed when it is placed in another one
      (or in a tuple, an argument list, a record), so no cycle can be built and
      nothing is changed after it was checked or used;
    - limits bound the work before it is done: opcodes, objects, nesting depth, marks,
      memo entries, string and integer sizes; ``describe`` renders any value within a
      fixed budget (shared references cannot make it exponential).

    Anything else is refused with `InvalidPayload`, a ``ValueError`` that says what.
"""

from __future__ import annotations

import struct
from typing import Callable, Optional

from .payload_values import (LEAVES, MARK, MAX_DEPTH, MAX_GLOBAL_NAME, MAX_INT_BYTES,
                             MAX_ITEMS, MAX_MARKS, MAX_MEMO, MAX_STR_BYTES, Budget, GlobalRef,
                             InvalidPayload, Record, corrupt, describe)

__all__ = ["Reader"]


class Reader:
    """Reads one pickle from ``data[pos:]``: `load` returns ``(value, end)``.

    ``globals_`` maps ``(module, name)`` to a `GlobalRef`; ``persistent_load`` (or
    None: refused) turns a persistent id into a value. Values are plain Python data
    (None, bool, int, float, str, bytes, tuples, and dicts and lists this reader
    made), `Record`, `GlobalRef`, or what the table's entries return.
    """

    def __init__(self, data, pos: int, globals_: dict, budget: Budget,
                 persistent_load: Optional[Callable] = None):
        self.data = memoryview(data).cast("B")
        self.pos, self.globals, self.budget = pos, globals_, budget
        self.persistent_load = persistent_load
        self.stack: list = []
        self.marks: list = []
        self.memo: dict = {}
        self.open: set = set()      # ids of containers / records still mutable
        self.depth: dict = {}       # id -> nesting depth of a container, tuple, record
        self.keep: list = []        # keeps every made object alive (stable ids)

    # ---- bookkeeping ------------------------------------------------------------
    def made(self, obj, depth: int = 1, mutable: bool = False):
        """Register a value this reader made (or an entry returned)."""
        self.budget.take_objects()
        if not isinstance(obj, LEAVES):
            self.keep.append(obj)
            self.depth[id(obj)] = depth
            if depth > MAX_DEPTH:
                raise InvalidPayload(f"it nests values more than {MAX_DEPTH} deep")
            if mutable:
                self.open.add(id(obj))
        return obj

    def depth_of(self, obj) -> int:
        return 0 if isinstance(obj, LEAVES) else self.depth.get(id(obj), 1)

    def seal(self, items) -> int:
        """Seal values placed into another one; the depth of the deepest."""
        self.budget.take_objects(len(items))
        deepest = 0
        for x in items:
            if x is MARK:
                raise corrupt("it uses a MARK as a value")
            self.open.discard(id(x))
            deepest = max(deepest, self.depth_of(x))
        return deepest

    def grow(self, container, items) -> None:
        depth = max(self.depth.get(id(container), 1), self.seal(items) + 1)
        if id(container) not in self.open:       # it was among the items
            raise InvalidPayload("it places a value inside itself (a cycle)")
        if depth > MAX_DEPTH:
            raise InvalidPayload(f"it nests values more than {MAX_DEPTH} deep")
        self.depth[id(container)] = depth

    def mutable(self, obj, kind, op: str):
        if type(obj) is not kind or id(obj) not in self.open:
            raise InvalidPayload(f"its {op} acts on {describe(obj, 40)}, not on a "
                                 f"{kind.__name__} it made and has not placed yet")
        return obj

    # ---- reading ----------------------------------------------------------------
    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise corrupt("they end inside it")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def text(self, n: int) -> str:
        if n > MAX_STR_BYTES:
            raise InvalidPayload(f"it holds a string of {n} bytes (at most {MAX_STR_BYTES})")
        try:
            return str(self.take(n), "utf-8")
        except UnicodeDecodeError:
            raise InvalidPayload("it holds a string that is not UTF-8") from None

    def pop(self):
        if not self.stack:
            raise corrupt("it pops an empty stack")
        x = self.stack.pop()
        if x is MARK:
            raise corrupt("it pops a MARK as a value")
        return x

    def pop_mark(self) -> list:
        if not self.marks:
            raise corrupt("it closes a MARK it never opened")
        items, self.stack = self.stack, self.marks.pop()
        if any(x is MARK for x in items):
            raise corrupt("it nests a MARK")
        if len(items) > MAX_ITEMS:
            raise InvalidPayload(f"it groups {len(items)} items (at most {MAX_ITEMS})")
        return items

    def push(self, x) -> None:
        self.stack.append(x)

    def load(self):
        """``(value, end)``: the pickle's value and the offset after its STOP."""
        ops = _OPS
        if self.data[self.pos:self.pos + 1] != b"\x80":
            raise corrupt("no header of pickle protocol 2 or later")
        while True:
            self.budget.take_op()
            code = self.take(1)[0]
            op = ops.get(code)
            if op is None:
                raise InvalidPayload(f"it uses pickle opcode {bytes([code])!r}, which an FP8 "
                                     "extra state never holds")
            if op(self):
                if len(self.stack) != 1 or self.marks:
                    raise corrupt("it stops with a malformed stack")
                return self.stack[0], self.pos

    # ---- opcodes ----------------------------------------------------------------
    def op_proto(self):
        if not 2 <= self.take(1)[0] <= 5:
            raise corrupt("a protocol older than 2 or unknown")

    def op_frame(self):
        if self.unpack("<Q") > len(self.data) - self.pos:
            raise corrupt("a frame runs past its end")

    def op_stop(self):
        return True

    def op_mark(self):
        if len(self.marks) >= MAX_MARKS:
            raise InvalidPayload(f"it opens more than {MAX_MARKS} MARKs at once")
        self.marks.append(self.stack)
        self.stack = []

    def op_pop(self):
        self.pop()

    def op_pop_mark(self):
        self.pop_mark()

    def push_leaf(self, x):
        self.budget.take_objects()
        self.push(x)

    def op_none(self):
        self.push_leaf(None)

    def op_true(self):
        self.push_leaf(True)

    def op_false(self):
        self.push_leaf(False)

    def op_binint(self):
        self.push_leaf(self.unpack("<i"))

    def op_binint1(self):
        self.push_leaf(self.take(1)[0])

    def op_binint2(self):
        self.push_leaf(self.unpack("<H"))

    def long(self, n: int):
        if n > MAX_INT_BYTES:
            raise InvalidPayload(f"it holds an integer of {n} bytes (at most {MAX_INT_BYTES})")
        self.push_leaf(int.from_bytes(self.take(n), "little", signed=True))

    def op_long1(self):
        self.long(self.take(1)[0])

    def op_long4(self):
        self.long(self.unpack("<i"))

    def op_binfloat(self):
        self.push_leaf(self.unpack(">d"))

    def op_short_binunicode(self):
        self.push_leaf(self.text(self.take(1)[0]))

    def op_binunicode(self):
        self.push_leaf(self.text(self.unpack("<I")))

    def op_binunicode8(self):
        self.push_leaf(self.text(self.unpack("<Q")))

    def op_short_binbytes(self):
        self.push_leaf(bytes(self.take(self.take(1)[0])))

    def op_binbytes(self):
        self.push_leaf(bytes(self.take(self.unpack("<I"))))

    def op_binbytes8(self):
        self.push_leaf(bytes(self.take(self.unpack("<Q"))))

    def op_empty_list(self):
        self.push(self.made([], mutable=True))

    def op_empty_dict(self):
        self.push(self.made({}, mutable=True))

    def op_list(self):
        items = self.pop_mark()
        out = self.made([], mutable=True)
        self.grow(out, items)
        out.extend(items)
        self.push(out)

    def op_dict(self):
        items = self.pop_mark()
        out = self.made({}, mutable=True)
        self.set_items(out, items)
        self.push(out)

    def tuple_of(self, items):
        items = tuple(items)
        out = self.made(items, depth=self.seal(items) + 1)
        self.push(out)

    def op_empty_tuple(self):
        self.tuple_of(())

    def op_tuple(self):
        self.tuple_of(self.pop_mark())

    def op_tuple1(self):
        self.tuple_of([self.pop()])

    def op_tuple2(self):
        b, a = self.pop(), self.pop()
        self.tuple_of([a, b])

    def op_tuple3(self):
        c, b, a = self.pop(), self.pop(), self.pop()
        self.tuple_of([a, b, c])

    def op_append(self):
        value = self.pop()
        target = self.mutable(self.stack[-1] if self.stack else None, list, "APPEND")
        self.grow(target, [value])
        target.append(value)
        self.check_items(target)

    def op_appends(self):
        items = self.pop_mark()
        target = self.mutable(self.stack[-1] if self.stack else None, list, "APPENDS")
        self.grow(target, items)
        target.extend(items)
        self.check_items(target)

    def set_items(self, target: dict, items) -> None:
        if len(items) % 2:
            raise corrupt("a SETITEMS has a key without a value")
        self.grow(target, items)
        for key, value in zip(items[::2], items[1::2]):
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise InvalidPayload(f"it holds a dict key {describe(key, 40)} (only str and "
                                     "int keys load)")
            target[key] = value
        self.check_items(target)

    def check_items(self, target) -> None:
        if len(target) > MAX_ITEMS:
            raise InvalidPayload(f"it holds a container of more than {MAX_ITEMS} items")

    def op_setitem(self):
        value, key = self.pop(), self.pop()
        target = self.mutable(self.stack[-1] if self.stack else None, dict, "SETITEM")
        self.set_items(target, [key, value])

    def op_setitems(self):
        items = self.pop_mark()
        target = self.mutable(self.stack[-1] if self.stack else None, dict, "SETITEMS")
        self.set_items(target, items)

    def memo_put(self, index: int):
        if not self.stack or self.stack[-1] is MARK:
            raise corrupt("it memoizes nothing")
        if index not in self.memo and len(self.memo) >= MAX_MEMO:
            raise InvalidPayload(f"it memoizes more than {MAX_MEMO} values")
        self.memo[index] = self.stack[-1]

    def op_binput(self):
        self.memo_put(self.take(1)[0])

    def op_long_binput(self):
        self.memo_put(self.unpack("<I"))

    def op_memoize(self):
        self.memo_put(len(self.memo))

    def memo_get(self, index: int):
        if index not in self.memo:
            raise corrupt("it refers to a value it never memoized")
        self.budget.take_objects()
        self.push(self.memo[index])

    def op_binget(self):
        self.memo_get(self.take(1)[0])

    def op_long_binget(self):
        self.memo_get(self.unpack("<I"))

    def find(self, module: str, name: str) -> GlobalRef:
        ref = self.globals.get((module, name))
        if ref is None:
            raise InvalidPayload(f"it refers to {describe(module, 60)[1:-1]}."
                                 f"{describe(name, 60)[1:-1]}, which an FP8 extra state never "
                                 "holds (only tensors and recipes load)")
        return ref

    def op_global(self):
        line = bytes(self.data[self.pos:self.pos + 2 * MAX_GLOBAL_NAME + 2])
        parts = line.split(b"\n", 2)
        if len(parts) < 3:
            raise corrupt("a GLOBAL is not two lines")
        self.pos += len(parts[0]) + len(parts[1]) + 2
        try:
            module, name = parts[0].decode("ascii"), parts[1].decode("ascii")
        except UnicodeDecodeError:
            raise corrupt("a GLOBAL is not ASCII") from None
        self.push(self.find(module, name))

    def op_stack_global(self):
        name, module = self.pop(), self.pop()
        if not (isinstance(module, str) and isinstance(name, str)):
            raise corrupt("a STACK_GLOBAL names a global by non-strings")
        self.push(self.find(module, name))

    def call_args(self, what: str):
        args = self.pop()
        fn = self.pop()
        if type(args) is not tuple:
            raise InvalidPayload(f"its {what} passes {describe(args, 40)} as arguments")
        if not isinstance(fn, GlobalRef):
            raise InvalidPayload(f"its {what} calls {describe(fn, 40)}, not an allowed global")
        depth = self.seal([args])
        return fn, args, depth

    def op_reduce(self):
        fn, args, depth = self.call_args("REDUCE")
        if fn.call is None:
            raise InvalidPayload(f"it calls {fn.qualname}, which an FP8 extra state never calls")
        self.push(self.made(fn.call(self, args), depth=depth + 1))

    def op_newobj(self):
        cls, args, depth = self.call_args("NEWOBJ")
        if cls.new is None:
            raise InvalidPayload(f"it instantiates {cls.qualname}, which an FP8 extra state "
                                 "never instantiates")
        out = cls.new(self, args)
        self.push(self.made(out, depth=depth + 1, mutable=isinstance(out, Record)))

    def op_build(self):
        state = self.pop()
        target = self.stack[-1] if self.stack else None
        if not isinstance(target, Record) or id(target) not in self.open or target.built:
            raise InvalidPayload(f"its BUILD sets the state of {describe(target, 40)}; only a "
                                 "recipe object the payload itself made, once, can get fields")
        if type(state) is not dict or id(state) not in self.open:
            raise InvalidPayload(f"its BUILD gives {target.spec.name} the state "
                                 f"{describe(state, 40)}, not a dict of fields")
        spec = target.spec
        for key in state:
            if not isinstance(key, str) or not (key in spec.fields or key in spec.ignored
                                                or key.startswith("__pydantic")):
                raise InvalidPayload(f"its BUILD gives {spec.name} the field "
                                     f"{describe(key, 40)}, which {spec.name} does not have")
        self.grow(target, [state])
        target.fields = {k: v for k, v in state.items() if k in spec.fields}
        target.built = True

    def op_binpersid(self):
        pid = self.pop()
        if self.persistent_load is None:
            raise InvalidPayload("it holds a persistent id, which an FP8 extra state never holds")
        depth = self.seal([pid])
        self.push(self.made(self.persistent_load(self, pid), depth=depth + 1))


def _opcode_table() -> dict:
    import pickle
    names = {
        "PROTO": "op_proto", "FRAME": "op_frame", "STOP": "op_stop", "MARK": "op_mark",
        "POP": "op_pop", "POP_MARK": "op_pop_mark", "NONE": "op_none",
        "NEWTRUE": "op_true", "NEWFALSE": "op_false", "BININT": "op_binint",
        "BININT1": "op_binint1", "BININT2": "op_binint2", "LONG1": "op_long1",
        "LONG4": "op_long4", "BINFLOAT": "op_binfloat",
        "SHORT_BINUNICODE": "op_short_binunicode", "BINUNICODE": "op_binunicode",
        "BINUNICODE8": "op_binunicode8", "SHORT_BINBYTES": "op_short_binbytes",
        "BINBYTES": "op_binbytes", "BINBYTES8": "op_binbytes8",
        "EMPTY_LIST": "op_empty_list", "EMPTY_DICT": "op_empty_dict", "LIST": "op_list",
        "DICT": "op_dict", "EMPTY_TUPLE": "op_empty_tuple", "TUPLE": "op_tuple",
        "TUPLE1": "op_tuple1", "TUPLE2": "op_tuple2", "TUPLE3": "op_tuple3",
        "APPEND": "op_append", "APPENDS": "op_appends", "SETITEM": "op_setitem",
        "SETITEMS": "op_setitems", "BINPUT": "op_binput", "LONG_BINPUT": "op_long_binput",
        "MEMOIZE": "op_memoize", "BINGET": "op_binget", "LONG_BINGET": "op_long_binget",
        "GLOBAL": "op_global", "STACK_GLOBAL": "op_stack_global", "REDUCE": "op_reduce",
        "NEWOBJ": "op_newobj", "BUILD": "op_build", "BINPERSID": "op_binpersid",
    }
    return {getattr(pickle, name)[0]: getattr(Reader, method) for name, method in names.items()}


_OPS = _opcode_table()
