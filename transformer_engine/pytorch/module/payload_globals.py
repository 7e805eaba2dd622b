"""What an FP8 extra-state payload may name, and how each is built from checked
arguments (NOTE [Payload unpickler] in payload_pickle.py): tensors and their storages
(torch's pickle and ``torch.save`` formats, parsed here, never by ``torch.load``),
recipe objects as `Record` s, `Format` members. `read_pickle` reads TE's layout,
`read_archive` the ``torch.save`` archive this package once wrote."""

from __future__ import annotations

import io
import math
import struct
import zipfile
from typing import NamedTuple

import torch

from ...common.recipe import Format
from .payload_pickle import Reader
from .payload_values import Budget, GlobalRef, InvalidPayload, Record, describe
from .payload_recipe import RECORD_SPECS

__all__ = ["read_pickle", "read_archive", "MAX_TENSOR_DIMS"]

MAX_TENSOR_DIMS = 8
_MAX_DIM_SIZE = 1 << 40
_RECIPE = "transformer_engine.common.recipe"
# The storage classes torch's pickles name, by the dtype of their elements.
_STORAGE_DTYPES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64,
                   "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
                   "LongStorage": torch.int64, "IntStorage": torch.int32,
                   "ShortStorage": torch.int16, "CharStorage": torch.int8,
                   "ByteStorage": torch.uint8}
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C      # the first pickle of a legacy torch.save
_LEGACY_PROTOCOL = 1001


class Storage(NamedTuple):
    """The elements of one storage: ``numel`` values of ``dtype``, little-endian."""

    data: bytearray
    dtype: torch.dtype
    numel: int


class _StorageId(NamedTuple):
    dtype: torch.dtype
    key: str
    numel: int


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _storage_id(pid, legacy: bool) -> _StorageId:
    """A persistent id ``('storage', <StorageType>, key, location, numel[, view])``."""
    n = 6 if legacy else 5
    if not (type(pid) is tuple and len(pid) == n and pid[0] == "storage"
            and isinstance(pid[1], GlobalRef) and isinstance(pid[1].value, torch.dtype)
            and isinstance(pid[2], str) and isinstance(pid[3], str) and _is_int(pid[4])
            and pid[4] >= 0 and (not legacy or pid[5] is None)):
        raise InvalidPayload(f"it holds a storage reference {describe(pid, 60)}, not one "
                             "torch writes for a tensor's storage")
    return _StorageId(pid[1].value, pid[2], pid[4])


def _storage_from_bytes(reader: Reader, args) -> Storage:
    """torch's ``storage._load_from_bytes`` (and Megatron's ``safe_load_from_bytes``):
    a storage saved by the legacy ``torch.save``, parsed: five pickles (magic number,
    protocol, system info, the storage's persistent id, its key list), then the
    element count and the raw elements."""
    if len(args) != 1 or type(args[0]) is not bytes:
        raise InvalidPayload(f"it loads a storage from {describe(args, 60)}, not from bytes")
    data, budget = args[0], reader.budget

    def next_pickle(pos, globals_=None, persistent=None):
        return Reader(data, pos, globals_ or {}, budget, persistent).load()

    magic, pos = next_pickle(0)
    version, pos = next_pickle(pos)
    info, pos = next_pickle(pos)
    if magic != _LEGACY_MAGIC or version != _LEGACY_PROTOCOL or type(info) is not dict:
        raise InvalidPayload("it holds storage bytes that are not a storage torch saved")
    if info.get("little_endian") is not True:
        raise InvalidPayload("it holds a storage saved on a big-endian machine (not read here)")
    found = []

    def persistent(_reader, pid):
        found.append(_storage_id(pid, legacy=True))
        return found[-1]

    sid, pos = next_pickle(pos, _STORAGE_GLOBALS, persistent)
    keys, pos = next_pickle(pos)
    if len(found) != 1 or sid is not found[0] or keys != [sid.key]:
        raise InvalidPayload("it holds storage bytes that are not exactly one storage")
    budget.take_bytes(len(data))
    return _read_elements(data, pos, sid)


def _read_elements(data: bytes, pos: int, sid: _StorageId) -> Storage:
    if pos + 8 > len(data) or struct.unpack_from("<q", data, pos)[0] != sid.numel:
        raise InvalidPayload(f"it holds a storage of {sid.numel} elements whose element "
                             "count is missing or differs")
    nbytes = sid.numel * sid.dtype.itemsize
    if len(data) - pos - 8 != nbytes:
        raise InvalidPayload(f"it holds a storage of {sid.numel} {sid.dtype} elements with "
                             f"{len(data) - pos - 8} bytes of data (needs {nbytes})")
    return Storage(bytearray(memoryview(data)[pos + 8:]), sid.dtype, sid.numel)


def _rebuild_tensor(reader: Reader, args) -> torch.Tensor:
    """torch's ``_utils._rebuild_tensor_v2(storage, offset, size, stride,
    requires_grad, backward_hooks[, metadata])``: the view is checked against its
    storage (in bounds, no element twice, no stride 0) before a byte is copied."""
    if len(args) not in (6, 7):
        raise InvalidPayload(f"it rebuilds a tensor from {len(args)} arguments (6 or 7)")
    storage, offset, size, stride, requires_grad, hooks = args[:6]
    metadata = args[6] if len(args) == 7 else None
    if not isinstance(storage, Storage):
        raise InvalidPayload(f"it rebuilds a tensor from {describe(storage, 40)}, not a storage")
    if not (_is_int(offset) and type(size) is tuple and type(stride) is tuple
            and len(size) == len(stride) <= MAX_TENSOR_DIMS
            and all(_is_int(v) for v in size + stride) and offset >= 0
            and all(0 <= v <= _MAX_DIM_SIZE for v in size + stride)):
        raise InvalidPayload(f"it rebuilds a tensor with offset {describe(offset, 20)}, size "
                             f"{describe(size, 60)}, stride {describe(stride, 60)}: expected "
                             f"non-negative ints, at most {MAX_TENSOR_DIMS} dimensions")
    if not (isinstance(requires_grad, bool) and type(hooks) is dict and not hooks
            and (metadata is None or (type(metadata) is dict and not metadata))):
        raise InvalidPayload("it rebuilds a tensor with backward hooks or metadata")
    numel = math.prod(size)
    if numel == 0:
        return torch.empty(size, dtype=storage.dtype)
    dims = sorted((st, n) for n, st in zip(size, stride) if n > 1)
    reach = 0                           # the furthest element the smaller strides reach
    for st, n in dims:
        if st <= reach:
            raise InvalidPayload(f"it rebuilds a tensor of size {size} with stride {stride}, "
                                 "which reads elements more than once (expanded or overlapping)")
        reach += (n - 1) * st
    if offset + reach >= storage.numel:
        raise InvalidPayload(f"it rebuilds a tensor of size {size}, stride {stride}, offset "
                             f"{offset} from a storage of {storage.numel} elements (out of bounds)")
    reader.budget.take_bytes(numel * storage.dtype.itemsize)
    base = torch.frombuffer(storage.data, dtype=storage.dtype, count=storage.numel)
    return base.as_strided(size, stride, offset).clone(memory_format=torch.contiguous_format)


def _ordered_dict(_reader: Reader, args) -> dict:
    if args != ():
        raise InvalidPayload(f"it builds an OrderedDict from {describe(args, 40)}")
    return {}


def _format(_reader: Reader, args) -> Format:
    """``Format(value)``: the member whose (max_fwd, max_bwd) is ``value``'s."""
    value = args[0] if len(args) == 1 else None
    if type(value) is tuple and len(value) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        for member in Format:
            if (member.value.max_fwd, member.value.max_bwd) == value:
                return member
    raise InvalidPayload(f"it holds a Format of value {describe(args, 60)}, not one of "
                         f"{[f.name for f in Format]}")


def _format_helper(_reader: Reader, args) -> tuple:
    """TE's ``_FormatHelper(max_fwd, max_bwd)``, or this package's earlier
    ``_FormatSpec(max_fwd, max_bwd, dtype_fwd, dtype_bwd)``: the maxima."""
    dtypes = args[2:]
    if len(args) not in (2, 4) or not all(isinstance(d, GlobalRef)
                                          and isinstance(d.value, torch.dtype) for d in dtypes):
        raise InvalidPayload(f"it holds a Format value {describe(args, 60)}, not (max_fwd, "
                             "max_bwd)")
    return tuple(args[:2])


def _override_precision(_reader: Reader, args) -> tuple:
    """TE's ``_OverrideLinearPrecision(fprop, dgrad, wgrad)``, as a plain tuple."""
    if len(args) != 3:
        raise InvalidPayload(f"it holds override_linear_precision {describe(args, 60)}")
    return tuple(args)


def _record_maker(spec):
    def new(_reader: Reader, args) -> Record:
        if args != ():
            raise InvalidPayload(f"it instantiates {spec.name} with arguments "
                                 f"{describe(args, 40)} (a pickled recipe has none)")
        return Record(spec)
    return new


def _tables():
    storage = {("torch", name): GlobalRef(f"torch.{name}", value=dtype)
               for name, dtype in _STORAGE_DTYPES.items()}
    tensors = {("torch._utils", "_rebuild_tensor_v2"):
               GlobalRef("torch._utils._rebuild_tensor_v2", call=_rebuild_tensor),
               ("collections", "OrderedDict"):
               GlobalRef("collections.OrderedDict", call=_ordered_dict)}
    te = dict(tensors)
    for module, name in (("torch.storage", "_load_from_bytes"),
                         ("megatron.core.safe_globals", "safe_load_from_bytes")):
        te[(module, name)] = GlobalRef(f"{module}.{name}", call=_storage_from_bytes)
    for name, spec in RECORD_SPECS.items():
        te[(_RECIPE, name)] = GlobalRef(f"{_RECIPE}.{name}", new=_record_maker(spec))
    # Megatron's subclass of DelayedScaling, pickled by NVIDIA's TE under Megatron
    te[("megatron.core.extensions.transformer_engine", "TEDelayedScaling")] = GlobalRef(
        "megatron.core.extensions.transformer_engine.TEDelayedScaling",
        new=_record_maker(RECORD_SPECS["DelayedScaling"]))
    # this package's earlier payloads: QParams / MMParams under their defining module,
    # a Format pickled by its (max_fwd, max_bwd, dtype_fwd, dtype_bwd) value
    for name in ("QParams", "MMParams"):
        te[("transformer_engine.common.recipe_fields", name)] = te[(_RECIPE, name)]
    te[(_RECIPE, "Format")] = GlobalRef(f"{_RECIPE}.Format", call=_format)
    for name in ("_FormatHelper", "_FormatSpec"):
        te[(_RECIPE, name)] = GlobalRef(f"{_RECIPE}.{name}", new=_format_helper)
    te[(_RECIPE, "_OverrideLinearPrecision")] = GlobalRef(
        f"{_RECIPE}._OverrideLinearPrecision", new=_override_precision)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        name = str(dtype).split(".")[1]
        te[("torch", name)] = GlobalRef(f"torch.{name}", value=dtype)
    return storage, te, {**tensors, **storage}


_STORAGE_GLOBALS, _TE_GLOBALS, _ARCHIVE_GLOBALS = _tables()


def read_pickle(raw: bytes):
    """The value of a payload in TE's layout (a pickle), read by the rules of NOTE
    [Payload unpickler]; its bytes must end where the pickle does."""
    value, end = Reader(raw, 0, _TE_GLOBALS, Budget(2 * len(raw))).load()
    if end != len(raw):
        raise InvalidPayload(f"its bytes go on for {len(raw) - end} bytes after the pickle ends")
    return value


def read_archive(raw: bytes):
    """The value of a ``torch.save`` zip archive (this package's earlier layout): its
    ``data.pkl`` read like a payload, each storage from its uncompressed record."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(raw))
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, NotImplementedError):
        raise InvalidPayload("its bytes are not a complete torch.save archive (truncated or "
                             "corrupted)") from None
    with archive:
        records = archive.infolist()
        if len(records) > 64 or any(r.compress_type != zipfile.ZIP_STORED
                                    or r.file_size > len(raw) for r in records):
            raise InvalidPayload("it is a zip archive torch.save does not write (too many or "
                                 "compressed records)")
        names = {r.filename for r in records}
        pickles = [n for n in names if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise InvalidPayload("its bytes are not a complete torch.save archive (no data.pkl)")
        prefix = pickles[0][:-len("data.pkl")]
        if prefix + "byteorder" in names and _read(archive, prefix + "byteorder") != b"little":
            raise InvalidPayload("it is an archive saved on a big-endian machine (not read here)")

        storages = {}

        def persistent(_reader, pid):
            sid = _storage_id(pid, legacy=False)
            if sid.key not in storages:
                name = prefix + "data/" + sid.key
                data = _read(archive, name) if name in names else None
                if data is None or len(data) != sid.numel * sid.dtype.itemsize:
                    raise InvalidPayload(f"it refers to a storage record {describe(sid.key, 40)} "
                                         "that is missing or of another size")
                storages[sid.key] = Storage(bytearray(data), sid.dtype, sid.numel)
            if storages[sid.key].dtype != sid.dtype or storages[sid.key].numel != sid.numel:
                raise InvalidPayload("it refers to one storage record as two storages")
            return storages[sid.key]

        data = _read(archive, pickles[0])
        value, end = Reader(data, 0, _ARCHIVE_GLOBALS, Budget(2 * len(raw)), persistent).load()
    if end != len(data):
        raise InvalidPayload("its data.pkl goes on after the pickle ends")
    return value


def _read(archive: zipfile.ZipFile, name: str) -> bytes:
    try:
        return archive.read(name)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError):
        raise InvalidPayload("its bytes are not a complete torch.save archive (truncated or "
                             "corrupted)") from None
