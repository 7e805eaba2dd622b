"""Hostile FP8 extra-state payloads (NOTE [Payload unpickler] in payload_pickle.py):
thousands of payloads mutated at the opcode and byte level from valid ones, hand-made
attacks (BUILD on classes, functions, enum members and values the reader made, every
allowed global with hostile arguments, size, depth and shared-reference bombs). Each
loads or is refused with a ValueError, in bounded time and memory; a refused one
leaves the module bit for bit and object for object as it was; and a process-wide
canary (the recipe classes and formats, the functions a payload can name, a
``torch.load`` round trip, a short FP8 training run) never changes. Seeded: the same
payloads every run."""

import collections
import io
import pickle
import random
import resource
import time

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe as recipe_module
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                              Float8CurrentScaling, Format, MMParams, QParams)
from helpers import fp8_training_steps
from pickle_ops import assemble, global_ops, ops

CPU = "cpu"
SEED = 20261205
MUTATIONS = 12000
PER_PAYLOAD_S = 2.0          # generous: a loaded 2-core machine; a bomb takes minutes
RSS_GROWTH_MB = 300          # a size bomb takes gigabytes
FULL_CANARY_EVERY = 400

RECIPE = "transformer_engine.common.recipe"
ALLOWED_GLOBALS = [
    ("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes"),
    ("megatron.core.safe_globals", "safe_load_from_bytes"), ("collections", "OrderedDict"),
    (RECIPE, "DelayedScaling"), (RECIPE, "Float8CurrentScaling"), (RECIPE, "Float8BlockScaling"),
    (RECIPE, "QParams"), (RECIPE, "MMParams"), (RECIPE, "Format"), (RECIPE, "_FormatHelper"),
    (RECIPE, "_FormatSpec"), (RECIPE, "_OverrideLinearPrecision"),
    ("transformer_engine.common.recipe_fields", "QParams"),
    ("megatron.core.extensions.transformer_engine", "TEDelayedScaling"),
    ("torch", "float8_e4m3fn"), ("torch", "FloatStorage"),
]
FORBIDDEN_GLOBALS = [("builtins", "getattr"), ("builtins", "setattr"), ("os", "system"),
                     ("builtins", "eval"), ("torch", "load"), ("copyreg", "_reconstructor"),
                     ("torch._tensor", "_rebuild_from_type_v2"), ("builtins", "object"),
                     (RECIPE, "MXFP8BlockScaling"), ("transformer_engine.common", "recipe")]
HOSTILE_NAMES = ["__class__", "__dict__", "__defaults__", "__kwdefaults__", "__code__",
                 "__init__", "__reduce__", "__setstate__", "__getattr__", "_value_",
                 "_member_map_", "dtype_fwd", "max_fwd", "value", "E4M3", "HYBRID", "validate",
                 "__post_init__", "margin", "amax_history_len", "num_gemms", "recipe"]
HOSTILE_INTS = [0, 1, -1, 255, 256, 2 ** 31 - 1, -2 ** 31, 2 ** 32, 2 ** 62, 2 ** 63,
                10 ** 30, 65536, 65537, 448]


# ---- the canary ---------------------------------------------------------------------

def _class_state(cls) -> dict:
    return {name: id(value) for name, value in vars(cls).items()}


def _watched_classes():
    return [DelayedScaling, Float8CurrentScaling, Float8BlockScaling, QParams, MMParams, Format,
            recipe_module._FormatHelper, recipe_module._FormatSpec, collections.OrderedDict,
            recipe_module.Recipe, torch.Tensor, torch.storage.TypedStorage]


def _watched_functions():
    return [torch._utils._rebuild_tensor_v2, torch.storage._load_from_bytes, torch.load]


def _cheap_canary():
    """What a BUILD or SETITEM on a real object would change, cheap to read."""
    return (
        [_class_state(c) for c in _watched_classes()],
        [(f.__defaults__, f.__kwdefaults__, id(f.__code__), dict(f.__dict__))
         for f in _watched_functions()],
        [(m.name, tuple(m.value), m.value.dtype_fwd, m.value.dtype_bwd) for m in Format],
        dict(Format._value2member_map_), dict(vars(recipe_module)),
        dict(vars(torch._utils)).keys(), torch.storage._load_from_bytes,
    )


def _full_canary():
    """The cheap canary, a torch.load round trip, and a short FP8 training run (its
    loss, output and scales, bit for bit)."""
    buf = io.BytesIO()
    torch.save({"w": torch.arange(6.0).reshape(2, 3)}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["w"]
    rng_state = torch.get_rng_state()
    try:
        torch.manual_seed(5)
        lin = te.Linear(16, 16, device=CPU)
        fp8_training_steps(lin, DelayedScaling(amax_history_len=2), [1.0, 3.0])
        with te.autocast(recipe=DelayedScaling(amax_history_len=2, fp8_format=Format.HYBRID)):
            out = lin(torch.ones(16, 16))
    finally:
        torch.set_rng_state(rng_state)
    fwd = lin.fp8_meta["scaling_fwd"]
    return (_cheap_canary(), loaded.tolist(), out.detach().clone(), fwd.scale.clone(),
            fwd.amax_history.clone(), DelayedScaling(), Float8CurrentScaling())


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


# ---- valid payloads -------------------------------------------------------------------

def _grouped_step(m, recipe):
    x = torch.randn(32, 16, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = m(x, [16, 16])
    y.float().pow(2).mean().backward()


def _base_payloads() -> dict:
    torch.manual_seed(3)
    out = {}
    lin = te.Linear(16, 16, device=CPU)
    fp8_training_steps(lin, DelayedScaling(amax_history_len=3), [1.0, 4.0])
    out["linear-delayed"] = lin.get_extra_state().plain()
    cur = te.Linear(16, 16, device=CPU)
    fp8_training_steps(cur, Float8CurrentScaling(), [1.0])
    out["linear-current"] = cur.get_extra_state().plain()
    blk = te.Linear(128, 128, device=CPU)
    fp8_training_steps(blk, Float8BlockScaling(), [1.0], features=128)
    out["linear-block"] = blk.get_extra_state().plain()
    grouped = te.GroupedLinear(2, 16, 16, device=CPU)
    _grouped_step(grouped, DelayedScaling(amax_history_len=2))
    out["grouped-delayed"] = grouped.get_extra_state().plain()
    return out


# ---- mutations ------------------------------------------------------------------------

def _hostile_snippets(rng):
    """Opcode runs that leave the stack as they found it if the reader let them run:
    each tries to change a real object (BUILD, SETITEM, APPEND on a global or on what
    a global returned)."""
    module, name = rng.choice(ALLOWED_GLOBALS + FORBIDDEN_GLOBALS)
    attr = rng.choice(HOSTILE_NAMES)
    state = [("EMPTY_DICT", None), ("SHORT_BINUNICODE", attr), ("BININT1", 1), ("SETITEM", None)]
    slot_state = [("NONE", None)] + state + [("TUPLE2", None)]
    fmt = global_ops(RECIPE, "Format") + global_ops(RECIPE, "_FormatHelper") + [
        ("BININT2", 448), ("BININT2", 448), ("TUPLE2", None), ("NEWOBJ", None),
        ("TUPLE1", None), ("REDUCE", None)]
    target = rng.choice([global_ops(module, name), fmt,
                         global_ops("collections", "OrderedDict") + [("EMPTY_TUPLE", None),
                                                                      ("REDUCE", None)],
                         [("BINGET", rng.randrange(0, 12))]])
    action = rng.choice([state + [("BUILD", None)], slot_state + [("BUILD", None)],
                         [("SHORT_BINUNICODE", attr), ("NONE", None), ("SETITEM", None)],
                         [("NONE", None), ("APPEND", None)],
                         [("MARK", None), ("NONE", None), ("APPENDS", None)]])
    return target + action + [("POP", None)]


def _mutate(rng, base_ops):
    op_list = list(base_ops)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        kind = rng.randrange(8)
        i = rng.randrange(len(op_list))
        name, arg = op_list[i]
        if kind == 0:
            del op_list[i]
        elif kind == 1:
            op_list.insert(i, op_list[i])
        elif kind == 2 and i + 1 < len(op_list):
            op_list[i], op_list[i + 1] = op_list[i + 1], op_list[i]
        elif kind == 3 and isinstance(arg, int) and not isinstance(arg, bool):
            value = rng.choice(HOSTILE_INTS + [arg + 1, arg - 1, -arg])
            fits = {"BININT1": 0 <= value < 256, "BININT2": 0 <= value < 65536,
                    "BINPUT": 0 <= value < 256, "BINGET": 0 <= value < 256,
                    "BININT": -2 ** 31 <= value < 2 ** 31}
            op_list[i] = (name, value) if fits.get(name, name in ("LONG1", "LONG4")) \
                else ("LONG1", value)
        elif kind == 4 and isinstance(arg, str):
            pick = rng.choice(HOSTILE_NAMES + [m for m, _ in ALLOWED_GLOBALS + FORBIDDEN_GLOBALS]
                              + [n for _, n in ALLOWED_GLOBALS + FORBIDDEN_GLOBALS])
            op_list[i] = (name, pick)
        elif kind == 5:
            op_list[i:i] = _hostile_snippets(rng)
        elif kind == 6:
            op_list.insert(i, rng.choice(_RANDOM_OPS)(rng))
        else:
            op_list.insert(i, (rng.choice(["BUILD", "SETITEM", "SETITEMS", "APPEND", "APPENDS",
                                           "REDUCE", "NEWOBJ", "POP", "MARK", "TUPLE",
                                           "STACK_GLOBAL", "POP_MARK", "DUP", "BINPERSID"]),
                               None))
    return assemble(op_list)


_RANDOM_OPS = [
    lambda r: ("BININT", r.randrange(-2 ** 31, 2 ** 31)),
    lambda r: ("LONG1", r.choice(HOSTILE_INTS)),
    lambda r: ("BINFLOAT", r.choice([float("nan"), float("inf"), -0.0, 1e308])),
    lambda r: ("SHORT_BINUNICODE", r.choice(HOSTILE_NAMES)),
    lambda r: ("SHORT_BINBYTES", bytes(r.randrange(256) for _ in range(r.randrange(9)))),
    lambda r: ("BINGET", r.randrange(0, 40)),
    lambda r: ("BINPUT", r.randrange(0, 40)),
    lambda r: ("EMPTY_DICT", None), lambda r: ("EMPTY_LIST", None), lambda r: ("NONE", None),
    lambda r: ("GLOBAL", " ".join(r.choice(ALLOWED_GLOBALS + FORBIDDEN_GLOBALS))),
]


def _byte_mutation(rng, raw: bytes) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.choice([1, 2, 4])):
        i = rng.randrange(len(data))
        kind = rng.randrange(3)
        if kind == 0:
            data[i] = rng.randrange(256)
        elif kind == 1:
            del data[i:i + rng.randrange(1, 16)]
        else:
            data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
    return bytes(data)


# ---- hand-made attacks ----------------------------------------------------------------

def _pickle(op_list) -> bytes:
    return assemble([("PROTO", 4)] + op_list + [("STOP", None)])


def _build_on_each_global():
    """BUILD (dict state and slot state) on every allowed global and on what each
    makes, the attack that rewrote `Format`, `_rebuild_tensor_v2.__defaults__` and the
    recipe classes."""
    cases = {}
    for module, name in ALLOWED_GLOBALS:
        for attr in ("__defaults__", "__doc__", "dtype_fwd", "__init__", "validate", "_value_"):
            state = [("EMPTY_DICT", None), ("SHORT_BINUNICODE", attr), ("NONE", None),
                     ("SETITEM", None)]
            cases[f"build-dict-{name}-{attr}"] = _pickle(
                global_ops(module, name) + state + [("BUILD", None)])
            cases[f"build-slots-{name}-{attr}"] = _pickle(
                global_ops(module, name) + [("NONE", None)] + state
                + [("TUPLE2", None), ("BUILD", None)])
    fmt = global_ops(RECIPE, "Format") + global_ops(RECIPE, "_FormatHelper") + [
        ("BININT2", 448), ("LONG1", 57344), ("TUPLE2", None), ("NEWOBJ", None),
        ("TUPLE1", None), ("REDUCE", None)]
    for attr in ("_value_", "_name_", "value", "__class__"):
        cases[f"build-format-member-{attr}"] = _pickle(
            fmt + [("EMPTY_DICT", None), ("SHORT_BINUNICODE", attr), ("BININT1", 7),
                   ("SETITEM", None), ("BUILD", None)])
    record = global_ops(RECIPE, "DelayedScaling") + [("EMPTY_TUPLE", None), ("NEWOBJ", None)]
    cases["build-twice"] = _pickle(record + [("EMPTY_DICT", None), ("BUILD", None),
                                             ("EMPTY_DICT", None), ("BUILD", None)])
    cases["build-unknown-field"] = _pickle(record + [
        ("EMPTY_DICT", None), ("SHORT_BINUNICODE", "__class__"), ("NONE", None),
        ("SETITEM", None), ("BUILD", None)])
    cases["build-after-placed"] = _pickle(record + [
        ("MEMOIZE", None), ("TUPLE1", None), ("POP", None), ("BINGET", 0),
        ("EMPTY_DICT", None), ("BUILD", None)])
    cases["setitem-on-placed-dict"] = _pickle([
        ("EMPTY_DICT", None), ("MEMOIZE", None), ("TUPLE1", None), ("POP", None),
        ("BINGET", 0), ("SHORT_BINUNICODE", "k"), ("NONE", None), ("SETITEM", None)])
    cases["cycle"] = _pickle([
        ("EMPTY_LIST", None), ("MEMOIZE", None), ("BINGET", 0), ("APPEND", None)])
    cases["append-on-tuple"] = _pickle([("EMPTY_TUPLE", None), ("NONE", None), ("APPEND", None)])
    cases["setitem-on-ordereddict-class"] = _pickle(global_ops("collections", "OrderedDict") + [
        ("SHORT_BINUNICODE", "fromkeys"), ("NONE", None), ("SETITEM", None)])
    return cases


def _hostile_arguments(valid_storage_bytes: bytes):
    """Every allowed callable or class with arguments it must refuse."""
    cases = {}
    rebuild = global_ops("torch._utils", "_rebuild_tensor_v2")
    storage = global_ops("torch.storage", "_load_from_bytes") + [
        ("BINBYTES", valid_storage_bytes), ("TUPLE1", None), ("REDUCE", None)]
    hooks = global_ops("collections", "OrderedDict") + [("EMPTY_TUPLE", None), ("REDUCE", None)]

    def tensor(offset, size, stride, extra=()):
        ints = [("MARK", None)] + [("LONG1", v) for v in size] + [("TUPLE", None)]
        strides = [("MARK", None)] + [("LONG1", v) for v in stride] + [("TUPLE", None)]
        return _pickle(rebuild + [("MARK", None)] + storage + [("LONG1", offset)] + ints
                       + strides + [("NEWFALSE", None)] + hooks + list(extra)
                       + [("TUPLE", None), ("REDUCE", None)])

    # the storage holds 3 float32 elements (a scale of one GEMM's 3 TE slots)
    cases["tensor-expanded"] = tensor(0, (65536, 3), (0, 1))
    cases["tensor-expanded-huge"] = tensor(0, (2 ** 40, 2 ** 20), (0, 0))
    cases["tensor-overlap"] = tensor(0, (3, 3), (1, 1))
    cases["tensor-out-of-bounds"] = tensor(1, (3,), (1,))
    cases["tensor-offset-huge"] = tensor(2 ** 62, (1,), (1,))
    cases["tensor-negative-stride"] = tensor(2, (3,), (-1,))
    cases["tensor-negative-size"] = tensor(0, (-3,), (1,))
    cases["tensor-many-dims"] = tensor(0, (1,) * 40, (1,) * 40)
    cases["tensor-metadata"] = tensor(0, (3,), (1,), extra=[("EMPTY_DICT", None), (
        "SHORT_BINUNICODE", "x"), ("NONE", None), ("SETITEM", None)])
    cases["tensor-few-args"] = _pickle(rebuild + [("EMPTY_TUPLE", None), ("REDUCE", None)])
    cases["tensor-bad-storage"] = _pickle(rebuild + [("MARK", None), ("NONE", None)] + [
        ("BININT1", 0), ("EMPTY_TUPLE", None), ("EMPTY_TUPLE", None), ("NEWFALSE", None),
        ("EMPTY_DICT", None), ("TUPLE", None), ("REDUCE", None)])
    big = global_ops("torch.storage", "_load_from_bytes") + [
        ("BINBYTES", _legacy_storage(numel=65536, data=bytes(4 * 65536))), ("TUPLE1", None),
        ("REDUCE", None), ("MEMOIZE", None), ("POP", None)]
    one = rebuild + [("MARK", None), ("BINGET", 0), ("BININT1", 0), ("LONG1", 65536),
                     ("TUPLE1", None), ("BININT1", 1), ("TUPLE1", None), ("NEWFALSE", None)
                     ] + hooks + [("TUPLE", None), ("REDUCE", None)]
    cases["tensor-one-storage-many-times"] = _pickle(
        big + [("EMPTY_LIST", None), ("MARK", None)] + one * 300 + [("APPENDS", None)])
    for what, arg in {"int": [("BININT1", 1)], "str": [("SHORT_BINUNICODE", "x")],
                      "garbage": [("BINBYTES", b"\x80\x02garbage")],
                      "huge-numel": [("BINBYTES", _legacy_storage(numel=2 ** 40, data=b"\0" * 12))],
                      "numel-mismatch": [("BINBYTES", _legacy_storage(numel=4, data=b"\0" * 12))],
                      "inner-global": [("BINBYTES", _legacy_storage(inner_global="os system"))],
                      "inner-build": [("BINBYTES", _legacy_storage(inner_build=True))],
                      "big-endian": [("BINBYTES", _legacy_storage(little_endian=False))],
                      "two-args": [("BINBYTES", valid_storage_bytes), ("NONE", None)]}.items():
        for module, name in (("torch.storage", "_load_from_bytes"),
                             ("megatron.core.safe_globals", "safe_load_from_bytes")):
            cases[f"storage-{name}-{what}"] = _pickle(global_ops(module, name) + [
                ("MARK", None)] + arg + [("TUPLE", None), ("REDUCE", None)])
    cases["ordereddict-items"] = _pickle(global_ops("collections", "OrderedDict") + [
        ("EMPTY_LIST", None), ("TUPLE1", None), ("REDUCE", None)])
    for what, value in {"e2m1": [("BININT1", 6), ("BININT1", 6), ("TUPLE2", None)],
                        "name": [("SHORT_BINUNICODE", "E4M3")],
                        "list": [("EMPTY_LIST", None)],
                        "huge": [("LONG1", 10 ** 40), ("LONG1", 10 ** 40), ("TUPLE2", None)]}.items():
        cases[f"format-{what}"] = _pickle(global_ops(RECIPE, "Format") + value + [
            ("TUPLE1", None), ("REDUCE", None)])
    cases["format-helper-many-args"] = _pickle(global_ops(RECIPE, "_FormatHelper") + [
        ("MARK", None)] + [("BININT1", 1)] * 1000 + [("TUPLE", None), ("NEWOBJ", None)])
    for cls in ("DelayedScaling", "QParams", "_OverrideLinearPrecision", "Format"):
        cases[f"reduce-{cls}"] = _pickle(global_ops(RECIPE, cls) + [
            ("BININT1", 1), ("TUPLE1", None), ("REDUCE", None)])
        cases[f"newobj-args-{cls}"] = _pickle(global_ops(RECIPE, cls) + [
            ("BININT1", 1), ("TUPLE1", None), ("NEWOBJ", None)])
    cases["call-a-dtype"] = _pickle(global_ops("torch", "float8_e4m3fn") + [
        ("EMPTY_TUPLE", None), ("REDUCE", None)])
    cases["call-a-storage-type"] = _pickle(global_ops("torch", "FloatStorage") + [
        ("EMPTY_TUPLE", None), ("REDUCE", None)])
    cases["persistent-id"] = _pickle([("NONE", None), ("BINPERSID", None)])
    return cases


def _legacy_storage(numel=3, data=b"\0" * 12, inner_global="torch FloatStorage",
                    inner_build=False, little_endian=True):
    """A storage in the legacy torch.save format, with what a test wants wrong."""
    head = (pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)
            + pickle.dumps(1001, protocol=2)
            + pickle.dumps({"protocol_version": 1001, "little_endian": little_endian,
                            "type_sizes": {"short": 2, "int": 4, "long": 4}}, protocol=2))
    pid = [("MARK", None), ("BINUNICODE", "storage"), ("GLOBAL", inner_global),
           ("BINUNICODE", "k0"), ("BINUNICODE", "cpu"), ("LONG1", numel), ("NONE", None),
           ("TUPLE", None)]
    if inner_build:
        pid += [("EMPTY_DICT", None), ("BUILD", None)]
    obj = assemble([("PROTO", 2)] + pid + [("BINPERSID", None), ("STOP", None)])
    keys = pickle.dumps(["k0"], protocol=2)
    return head + obj + keys + numel.to_bytes(8, "little", signed=False)[:8] + data


def _bombs(base: bytes):
    """Size, depth and shared-reference bombs: tiny payloads that would cost minutes
    or gigabytes (or a RecursionError) if read naively."""
    cases = {}
    shared = _shared(60, 2)
    cases["shared-reference-bomb"] = _pickle(shared)
    wide = _shared(4, 1000)
    cases["wide-shared-bomb"] = _pickle(wide)
    for name, bomb in (("narrow", _shared(12, 2)), ("wide", wide)):
        cases[f"{name}-bomb-as-recipe"] = _pickle(
            [("EMPTY_DICT", None), ("MARK", None), ("SHORT_BINUNICODE", "recipe")] + bomb
            + [("SHORT_BINUNICODE", "extra_fp8_variables"), ("EMPTY_DICT", None),
               ("SETITEMS", None)])
        cases[f"{name}-bomb-as-extra"] = _pickle(
            [("EMPTY_DICT", None), ("SHORT_BINUNICODE", "recipe"), ("NONE", None),
             ("SETITEM", None), ("SHORT_BINUNICODE", "extra_fp8_variables")] + bomb
            + [("SETITEM", None)])
        record = global_ops(RECIPE, "DelayedScaling") + [("EMPTY_TUPLE", None), ("NEWOBJ", None)]
        cases[f"{name}-bomb-as-margin"] = _pickle(
            [("EMPTY_DICT", None), ("SHORT_BINUNICODE", "recipe")] + record
            + [("EMPTY_DICT", None), ("SHORT_BINUNICODE", "margin")] + bomb
            + [("SETITEM", None), ("BUILD", None), ("SETITEM", None),
               ("SHORT_BINUNICODE", "extra_fp8_variables"), ("EMPTY_DICT", None),
               ("SETITEM", None)])
    cases["deep-lists"] = _pickle([("EMPTY_LIST", None)] * 20000
                                  + [("APPEND", None)] * 19999)
    cases["deep-tuples"] = _pickle([("NONE", None)] + [("TUPLE1", None)] * 20000)
    cases["mark-flood"] = _pickle([("MARK", None)] * 50000)
    cases["memo-flood"] = _pickle([("NONE", None)] + [("LONG_BINPUT", i) for i in range(20000)])
    cases["op-flood"] = _pickle([("NONE", None), ("POP", None)] * 30000 + [("NONE", None)])
    cases["wide-list"] = _pickle([("EMPTY_LIST", None), ("MARK", None)]
                                 + [("NONE", None)] * 20000 + [("APPENDS", None)])
    cases["long-string"] = assemble([("PROTO", 4)]) + b"\x8d" + (2 ** 62).to_bytes(8, "little")
    cases["long-bytes"] = assemble([("PROTO", 4)]) + b"\x8e" + (2 ** 40).to_bytes(8, "little")
    cases["huge-long4"] = assemble([("PROTO", 4)]) + b"\x8b" + (2 ** 31 - 1).to_bytes(4, "little")
    cases["big-long4"] = _pickle([("LONG4", 2 ** 8000)])
    cases["frame-huge"] = assemble([("PROTO", 4)]) + b"\x95" + (2 ** 63).to_bytes(8, "little")
    cases["string-4k"] = _pickle([("BINUNICODE", "x" * 5000)])
    cases["appended-after-stop"] = base + b"\x80\x04N."
    return cases


def _shared(levels: int, fan_out: int) -> list:
    """Opcodes that push one value: ``levels`` nested tuples, each ``fan_out``
    references to the one below (``fan_out ** levels`` leaves, in a few bytes)."""
    out = [("EMPTY_LIST", None), ("MEMOIZE", None), ("POP", None)]
    for k in range(levels):
        out += [("MARK", None)] + [("LONG_BINGET", k)] * fan_out + [
            ("TUPLE", None), ("MEMOIZE", None), ("POP", None)]
    return out + [("LONG_BINGET", levels)]


def _structural(base_ops):
    """Valid pickles of invalid payloads: neither recipe nor scales, and others."""
    cases = {}
    cases["no-recipe-no-scales"] = pickle.dumps({"recipe": None,
                                                 "extra_fp8_variables": {"num_gemms": 1}})
    cases["only-extra"] = pickle.dumps({"extra_fp8_variables": {}})
    cases["empty-dict"] = pickle.dumps({})
    cases["protocol-0"] = pickle.dumps({"recipe": None}, protocol=0)
    cases["protocol-1"] = pickle.dumps({"recipe": None}, protocol=1)
    cases["a-set"] = pickle.dumps({"recipe": {1, 2}})
    cases["bytearray"] = pickle.dumps({"recipe": bytearray(b"x")}, protocol=5)
    cases["stop-early"] = assemble([("PROTO", 4), ("STOP", None)])
    return cases


# ---- the test ---------------------------------------------------------------------------

def _payloads():
    rng = random.Random(SEED)
    bases = _base_payloads()
    raws = {k: v.numpy().tobytes() for k, v in bases.items()}
    base_ops = {k: ops(v) for k, v in raws.items()}
    storage = next(arg for name, arg in base_ops["linear-delayed"]
                   if name in ("BINBYTES", "SHORT_BINBYTES"))
    one_gemm_scale = _legacy_storage(numel=3, data=torch.ones(3).numpy().tobytes())
    cases = dict(_build_on_each_global())
    cases.update(_hostile_arguments(one_gemm_scale))
    cases.update(_bombs(raws["linear-delayed"]))
    cases.update(_structural(base_ops))
    cases["valid-storage-in-place"] = _pickle(global_ops("torch.storage", "_load_from_bytes") + [
        ("BINBYTES", storage), ("TUPLE1", None), ("REDUCE", None)])
    names = sorted(k for k in raws if k != "grouped-delayed")
    for i in range(MUTATIONS):
        base = names[i % len(names)]
        if i % 5 == 4:
            cases[f"bytes-{base}-{i}"] = _byte_mutation(rng, raws[base])
        else:
            cases[f"ops-{base}-{i}"] = _mutate(rng, base_ops[base])
    return cases


def _module_view(m):
    meta = m.fp8_meta
    state = [meta["recipe"], meta["scaling_fwd"], meta["scaling_bwd"]]
    bits = [None if s is None else (s.scale.clone(), s.scale_inv.clone(), s.amax_history.clone())
            for s in state[1:]]
    return state, bits


def _unchanged(m, view) -> bool:
    state, bits = view
    now = [m.fp8_meta["recipe"], m.fp8_meta["scaling_fwd"], m.fp8_meta["scaling_bwd"]]
    if not all(a is b for a, b in zip(now, state)):
        return False
    return all(_same(list(b), [s.scale, s.scale_inv, s.amax_history]) if b is not None
               else s is None for b, s in zip(bits, now[1:]))


def test_hostile_payloads_are_refused_and_change_nothing_outside_the_module():
    cases = _payloads()          # pickling caches __slotnames__ on the classes: first
    reference = _full_canary()
    cheap = _cheap_canary()
    assert len(cases) > MUTATIONS
    target = te.Linear(16, 16, device=CPU)
    fp8_training_steps(target, DelayedScaling(amax_history_len=3), [1.0, 2.0])
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused = accepted = 0
    slow = []
    for i, (name, raw) in enumerate(cases.items()):
        payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
            torch.zeros(1, dtype=torch.uint8)
        view = _module_view(target)
        start = time.perf_counter()
        try:
            target.set_extra_state(payload)
            accepted += 1
        except ValueError as err:
            refused += 1
            message = str(err)
            assert message.startswith("Linear.set_extra_state: "), (name, message[:200])
            assert len(message) < 1200, (name, len(message))
            assert _unchanged(target, view), f"{name}: a refused payload changed the module"
        except Exception as err:   # noqa: BLE001 - any other exception fails the test
            pytest.fail(f"{name}: {type(err).__name__} (only ValueError may refuse a payload): "
                        f"{str(err)[:300]}")
        took = time.perf_counter() - start
        if took > PER_PAYLOAD_S:
            slow.append((name, round(took, 2)))
        assert _same(_cheap_canary(), cheap), f"{name}: changed something outside the module"
        if i % FULL_CANARY_EVERY == 0:
            assert _same(_full_canary(), reference), f"{name}: the canary changed"
    assert not slow, f"payloads that took more than {PER_PAYLOAD_S} s: {slow}"
    growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert growth_mb < RSS_GROWTH_MB, f"peak memory grew by {growth_mb:.0f} MB"
    assert _same(_full_canary(), reference), "the canary changed"
    # the hand-made attacks are all refused; mutations mostly are, a few stay valid
    assert refused > 0.9 * len(cases) and accepted > 0, (refused, accepted)
    # and the module still loads a valid payload and trains
    fresh = te.Linear(16, 16, device=CPU)
    fp8_training_steps(fresh, DelayedScaling(amax_history_len=3), [1.0])
    target.set_extra_state(fresh.get_extra_state())
    fp8_training_steps(target, DelayedScaling(amax_history_len=3), [1.0])


def test_hand_made_attacks_are_each_refused():
    """Every hand-made attack is refused (none happens to load), each with a reason."""
    bases = _base_payloads()
    raw = bases["linear-delayed"].numpy().tobytes()
    cases = dict(_build_on_each_global())
    cases.update(_hostile_arguments(_legacy_storage(numel=3, data=torch.ones(3).numpy().tobytes())))
    cases.update(_bombs(raw))
    cases.update(_structural(ops(raw)))
    target = te.Linear(16, 16, device=CPU)
    fp8_training_steps(target, DelayedScaling(amax_history_len=3), [1.0])
    for name, payload in cases.items():
        with pytest.raises(ValueError, match="not a valid payload written by get_extra_state: ") \
                as info:
            target.set_extra_state(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        assert "Linear.set_extra_state" in str(info.value), name
