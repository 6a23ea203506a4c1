"""``torch.save`` archives written around data that is not in memory (pure: bytes in, bytes out).

A DCP ``.distcp`` item is a ``torch.save`` zip archive: small members (``data.pkl``, ``byteorder``,
``version``) and the tensor's raw bytes as ``data/0``, stored, not compressed. :func:`archive_around`
gives the bytes before and after ``data/0``'s data, so the data itself can be written in place by any
number of ranks at their offsets. ``data/0`` starts on a 64-byte boundary of the archive (a padding
extra field, as torch writes it); zip64 records are written where a size or an offset needs them.

The data's CRC-32 is written as 0: it is not known where the archive is made. torch writes the same
with ``torch.serialization.set_crc32_options(False)``, and its reader does not check it. The small
members carry their true CRC-32, so a zip tool reads them.
"""

from __future__ import annotations

import struct
import zlib

ALIGNMENT = 64
_LIMIT = 0xFFFFFFFF
_PADDING_ID = 0x4246  # "FB", the extra field torch pads with
_UTF8 = 0x0800


def _extra(size: int, offset: int | None, start: int) -> bytes:
    """The local header's extra field: zip64 sizes where needed, then padding so the data starts aligned."""
    zip64 = struct.pack("<HHQQ", 1, 16, size, size) if size >= _LIMIT else b""
    if offset is None:
        return zip64
    pad = (-(start + len(zip64) + 4)) % ALIGNMENT
    return zip64 + struct.pack("<HH", _PADDING_ID, pad) + b"Z" * pad


def _local_header(name: bytes, size: int, crc: int, offset: int, align: bool) -> bytes:
    extra = _extra(size, offset if align else None, offset + 30 + len(name))
    needed = 45 if size >= _LIMIT else 20
    stored = _LIMIT if size >= _LIMIT else size
    fixed = struct.pack("<IHHHHHIIIHH", 0x04034B50, needed, _UTF8, 0, 0, 0x21, crc, stored, stored, len(name), len(extra))
    return fixed + name + extra


def _central_entry(name: bytes, size: int, crc: int, offset: int) -> bytes:
    values, extra = [], b""
    if size >= _LIMIT:
        values += [size, size]
    if offset >= _LIMIT:
        values.append(offset)
    if values:
        extra = struct.pack(f"<HH{len(values)}Q", 1, 8 * len(values), *values)
    needed = 45 if extra else 20
    stored, at = (_LIMIT if size >= _LIMIT else size), (_LIMIT if offset >= _LIMIT else offset)
    fixed = struct.pack(
        "<IHHHHHHIIIHHHHHII", 0x02014B50, needed, needed, _UTF8, 0, 0, 0x21, crc, stored, stored, len(name), len(extra),
        0, 0, 0, 0, at,
    )  # fmt: skip
    return fixed + name + extra


def _end(entries: int, directory_size: int, directory_at: int) -> bytes:
    """The end of central directory; with its zip64 record and locator first where a field overflows."""
    head = b""
    if directory_at >= _LIMIT or directory_size >= _LIMIT:
        record_at = directory_at + directory_size
        head = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, entries, entries, directory_size, directory_at)
        head += struct.pack("<IIQI", 0x07064B50, 0, record_at, 1)
        directory_size, directory_at = min(directory_size, _LIMIT), min(directory_at, _LIMIT)
    return head + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, entries, entries, directory_size, directory_at, 0)


def archive_around(data_pkl: bytes, data_length: int | None, folder: str = "archive") -> tuple[bytes, bytes]:
    """The bytes of a ``torch.save`` archive before and after the ``data_length`` bytes of ``data/0``
    (``None``: no data member; the whole archive is the first part)."""
    small = [("data.pkl", data_pkl), ("byteorder", b"little")]
    after = [("version", b"3\n")]
    before = bytearray()
    directory = []
    for name, content in small:
        encoded = f"{folder}/{name}".encode()
        crc = zlib.crc32(content)
        directory.append(_central_entry(encoded, len(content), crc, len(before)))
        before += _local_header(encoded, len(content), crc, len(before), align=False) + content
    tail = bytearray()
    position = len(before)
    if data_length is not None:
        encoded = f"{folder}/data/0".encode()
        directory.append(_central_entry(encoded, data_length, 0, len(before)))
        before += _local_header(encoded, data_length, 0, len(before), align=True)
        position = len(before) + data_length
    for name, content in after:
        encoded = f"{folder}/{name}".encode()
        crc = zlib.crc32(content)
        directory.append(_central_entry(encoded, len(content), crc, position + len(tail)))
        tail += _local_header(encoded, len(content), crc, position + len(tail), align=False) + content
    listing = b"".join(directory)
    tail += listing + _end(len(directory), len(listing), position + len(tail))
    if data_length is None:
        return bytes(before + tail), b""
    return bytes(before), bytes(tail)
