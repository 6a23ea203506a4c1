"""Pickles that name torch's classes, written opcode by opcode without torch (for the ``.distcp`` sample).

The sample generator writes checkpoints in DCP's default format: a ``.metadata`` pickle of DCP's
``Metadata`` and, per piece, a ``torch.save`` archive whose ``data.pkl`` rebuilds the tensor. Python's
pickler can only name classes it can import, so this module writes the few opcodes those pickles
need (protocol 2) from plain values and three markers: :class:`Global` (a class or function by
name), :class:`Call` (``REDUCE``) and :class:`Obj` (``NEWOBJ`` + ``BUILD``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Global:
    """A class, function or constant by module and name (``GLOBAL``)."""

    module: str
    name: str


@dataclass(frozen=True)
class Call:
    """``function(*args)`` at load time (``REDUCE``)."""

    function: Global
    args: tuple[object, ...] = ()


@dataclass(frozen=True, eq=False)
class Obj:
    """An instance of ``cls`` with ``state`` (``NEWOBJ`` with no arguments, then ``BUILD``); hashed by
    identity, so that it can be a dict key (DCP's ``MetadataIndex``)."""

    cls: Global
    state: object = field(default_factory=dict)


@dataclass(frozen=True)
class PersistentId:
    """A persistent id (``BINPERSID``): ``torch.save`` names storages this way."""

    value: object


def _int(value: int) -> bytes:
    if 0 <= value < 1 << 8:
        return b"K" + bytes([value])
    if 0 <= value < 1 << 16:
        return b"M" + struct.pack("<H", value)
    if -(1 << 31) <= value < 1 << 31:
        return b"J" + struct.pack("<i", value)
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def _dump(value: object, out: list[bytes], memo: dict[Global, int]) -> None:
    if value is None:
        out.append(b"N")
    elif value is True or value is False:
        out.append(b"\x88" if value else b"\x89")
    elif isinstance(value, int):
        out.append(_int(value))
    elif isinstance(value, float):
        out.append(b"G" + struct.pack(">d", value))
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out.append(b"X" + struct.pack("<I", len(data)) + data)
    elif isinstance(value, tuple):
        if not value:
            out.append(b")")
            return
        out.append(b"(")
        for item in value:
            _dump(item, out, memo)
        out.append(b"t")
    elif isinstance(value, list):
        out.append(b"]")
        if value:
            out.append(b"(")
            for item in value:
                _dump(item, out, memo)
            out.append(b"e")
    elif isinstance(value, dict):
        out.append(b"}")
        if value:
            out.append(b"(")
            for key, item in value.items():
                _dump(key, out, memo)
                _dump(item, out, memo)
            out.append(b"u")
    elif isinstance(value, Global):  # named once, then fetched from the memo (as Python's pickler does)
        if value in memo:
            out.append(b"j" + struct.pack("<I", memo[value]))
        else:
            memo[value] = len(memo)
            out.append(f"c{value.module}\n{value.name}\n".encode() + b"r" + struct.pack("<I", memo[value]))
    elif isinstance(value, Call):
        _dump(value.function, out, memo)
        _dump(tuple(value.args), out, memo)
        out.append(b"R")
    elif isinstance(value, Obj):
        _dump(value.cls, out, memo)
        out.append(b")\x81")
        _dump(value.state, out, memo)
        out.append(b"b")
    elif isinstance(value, PersistentId):
        _dump(value.value, out, memo)
        out.append(b"Q")
    else:
        raise TypeError(f"cannot write {type(value).__name__} {value!r}")


def dumps(value: object) -> bytes:
    """``value`` as a protocol-2 pickle."""
    out = [b"\x80\x02"]
    _dump(value, out, {})
    out.append(b".")
    return b"".join(out)


__all__ = ["Global", "Call", "Obj", "PersistentId", "dumps"]
