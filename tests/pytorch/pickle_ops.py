"""Pickles as lists of ``(opcode name, argument)``, for tests that edit payloads at the
opcode level: `ops` reads a pickle's opcodes (pickletools), `assemble` writes a list
back to bytes. Any opcode may be written, with any argument its encoding can hold, so
a test can build what no pickler writes."""

import pickle
import pickletools
import struct

_STRUCT_ARGS = {"BININT": "<i", "BININT1": "<B", "BININT2": "<H", "BINFLOAT": ">d",
                "BINPUT": "<B", "LONG_BINPUT": "<I", "BINGET": "<B", "LONG_BINGET": "<I",
                "PROTO": "<B", "FRAME": "<Q", "EXT1": "<B", "EXT2": "<H", "EXT4": "<i"}
_LENGTH_PREFIXED = {"SHORT_BINUNICODE": "<B", "BINUNICODE": "<I", "BINUNICODE8": "<Q",
                    "SHORT_BINBYTES": "<B", "BINBYTES": "<I", "BINBYTES8": "<Q",
                    "SHORT_BINSTRING": "<B", "BINSTRING": "<i", "BYTEARRAY8": "<Q"}


def ops(data: bytes) -> list:
    """The opcodes of one pickle, FRAMEs dropped (they only group bytes)."""
    return [(op.name, arg) for op, arg, _ in pickletools.genops(data) if op.name != "FRAME"]


def _long_bytes(n: int) -> bytes:
    if n == 0:
        return b""
    size = (n.bit_length() + 8) // 8
    return n.to_bytes(size, "little", signed=True)


def encode(name: str, arg=None) -> bytes:
    """One opcode with its argument (None for opcodes without one)."""
    code = getattr(pickle, name)
    if name in _STRUCT_ARGS:
        return code + struct.pack(_STRUCT_ARGS[name], arg)
    if name in _LENGTH_PREFIXED:
        raw = arg.encode("utf-8", "surrogatepass") if isinstance(arg, str) else bytes(arg)
        return code + struct.pack(_LENGTH_PREFIXED[name], len(raw)) + raw
    if name == "LONG1":
        raw = _long_bytes(arg)
        return code + struct.pack("<B", len(raw)) + raw
    if name == "LONG4":
        raw = _long_bytes(arg)
        return code + struct.pack("<i", len(raw)) + raw
    if name in ("GLOBAL", "INST"):
        module, qualname = arg.split(" ")
        return code + f"{module}\n{qualname}\n".encode()
    if name in ("INT", "LONG", "FLOAT", "STRING", "UNICODE", "PUT", "GET", "PERSID"):
        return code + f"{arg}\n".encode()
    return code


def assemble(op_list) -> bytes:
    return b"".join(encode(name, arg) for name, arg in op_list)


def global_ops(module: str, name: str) -> list:
    """The opcodes that push the global ``module.name`` (STACK_GLOBAL, as pickle 4 does)."""
    return [("SHORT_BINUNICODE", module), ("SHORT_BINUNICODE", name), ("STACK_GLOBAL", None)]
