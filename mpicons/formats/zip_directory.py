"""The central directory of a ``torch.save`` archive (a zip file), read from its end records (no MPI here).

:func:`simple_members` reads the directory ``torch.save`` writes (no comment, within the archive's last
bytes) from those bytes alone. Anything else goes to :mod:`zipfile`, which builds an object per entry
of the whole directory at once: :func:`check_directory` first streams through it in bounded memory and
refuses a directory with more entries than the archive's ``data.pkl`` could name storages for, so a
file of millions of made-up entries costs a few seconds and a window of memory, not gigabytes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator

from ..core.errors import InputError

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record
_LOCATOR = struct.Struct("<4sLQL")  # ZIP64 end of central directory locator
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # ZIP64 end of central directory record
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory file header
_MAX_COMMENT = 0xFFFF
_WINDOW = 1 << 20

#: Entries a central directory may have: a few for the archive's own records, and one per
#: :data:`PICKLE_BYTES_PER_MEMBER` bytes of its ``data.pkl`` (each storage is named there with its
#: key, type, device and size: 20 bytes or more), never more than :data:`MAX_MEMBERS`.
FREE_MEMBERS, PICKLE_BYTES_PER_MEMBER, MAX_MEMBERS = 64, 16, 1 << 20

#: Reads ``length`` bytes at an offset of the archive.
Read = Callable[[int, int], bytes]


def simple_members(tail: bytes, length: int) -> tuple[dict[str, tuple[int, int, int]], int] | None:
    """Members (method, stored size, local header offset) of the archive ending with ``tail`` and where
    its central directory starts, or None when it is not laid out as simply as ``torch.save`` writes it
    (no comment, the central directory within ``tail``, no ZIP64 member fields): :mod:`zipfile` reads those."""
    if len(tail) < _EOCD.size:
        return None
    signature, _, _, _, count, size, offset, comment = _EOCD.unpack_from(tail, len(tail) - _EOCD.size)
    if signature != b"PK\x05\x06" or comment:
        return None
    base = length - len(tail)  # archive offset of tail[0]
    locator = len(tail) - _EOCD.size - _LOCATOR.size
    if locator >= 0 and tail[locator : locator + 4] == b"PK\x06\x07":
        at = _LOCATOR.unpack_from(tail, locator)[2] - base
        if at < 0 or at + _EOCD64.size > len(tail) or tail[at : at + 4] != b"PK\x06\x06":
            return None
        count, size, offset = _EOCD64.unpack_from(tail, at)[7:10]
    at, central = offset - base, offset
    if at < 0 or at + size > len(tail):
        return None
    members = {}
    for _ in range(count):
        if at + _CENTRAL.size > len(tail):
            return None
        fields = _CENTRAL.unpack_from(tail, at)
        method, stored, names, extra, note, local = fields[4], fields[8], fields[10], fields[11], fields[12], fields[16]
        if fields[0] != b"PK\x01\x02" or 0xFFFFFFFF in (stored, fields[9], local) or stored != fields[9]:
            return None
        members[tail[at + _CENTRAL.size : at + _CENTRAL.size + names].decode("utf-8", "replace")] = (method, stored, local)
        at += _CENTRAL.size + names + extra + note
    return members, central


def check_directory(read: Read, length: int, where: str) -> None:
    """Refuse (exit 2, naming ``where``) an archive whose central directory has more entries than its
    ``data.pkl`` could use (see :data:`FREE_MEMBERS`), before anything builds an object per entry.
    An archive whose end records cannot be found is left to :mod:`zipfile` to refuse."""
    found = _directory(read, length)
    if found is None:
        return
    entries, pickled = 0, None
    for name, stored in _entries(read, *found):
        entries += 1
        if pickled is None and name.endswith(b"/data.pkl") and name.count(b"/") == 1:
            pickled = stored
        if entries > MAX_MEMBERS:
            break
    allowed = min(MAX_MEMBERS, FREE_MEMBERS + (pickled or 0) // PICKLE_BYTES_PER_MEMBER)
    if entries > allowed:
        said = f"more than {MAX_MEMBERS}" if entries > MAX_MEMBERS else str(entries)
        raise InputError(
            f"{where}: the archive's central directory lists {said} entries, where its "
            f"{pickled or 0}-byte data.pkl can name at most {allowed}: damaged, or made to exhaust memory"
        )


def _directory(read: Read, length: int) -> tuple[int, int] | None:
    """Where the central directory starts and how long it is, from the end records (ZIP64 or not)."""
    span = min(length, _EOCD.size + _MAX_COMMENT)
    end = read(length - span, span)
    at = end.rfind(b"PK\x05\x06")
    while at >= 0 and not _ends_the_file(end, at):
        at = end.rfind(b"PK\x05\x06", 0, at)  # a signature inside the comment, or a truncated record
    if at < 0:
        return None
    size, offset = _EOCD.unpack_from(end, at)[5:7]
    eocd = length - span + at
    if eocd >= _LOCATOR.size and 0xFFFFFFFF in (size, offset):
        locator = read(eocd - _LOCATOR.size, _LOCATOR.size)
        if locator[:4] == b"PK\x06\x07":
            record = read(_LOCATOR.unpack(locator)[2], _EOCD64.size)
            if len(record) == _EOCD64.size and record[:4] == b"PK\x06\x06":
                size, offset = _EOCD64.unpack(record)[8:10]
    if offset + size > eocd:
        return None
    return offset, size


def _ends_the_file(end: bytes, at: int) -> bool:
    """Whether an end record starting at ``at`` is whole and its comment reaches exactly to the end."""
    return at + _EOCD.size <= len(end) and at + _EOCD.size + _EOCD.unpack_from(end, at)[7] == len(end)


def _entries(read: Read, offset: int, size: int) -> Iterator[tuple[bytes, int]]:
    """Each entry's name and stored size, read in windows of :data:`_WINDOW` bytes; stops at the
    first entry that is not one (:mod:`zipfile` then says what is wrong)."""
    window, start, at, end, header = b"", offset, offset, offset + size, _CENTRAL.size
    while at < end:
        if at + header > start + len(window):
            start, window = at, read(at, min(_WINDOW, end - at))
            if len(window) < header:
                return
        fields = _CENTRAL.unpack_from(window, at - start)
        if fields[0] != b"PK\x01\x02":
            return
        names = fields[10]
        if at + header + names > start + len(window):
            if at == start:  # the name runs past the directory's end
                return
            start, window = at, read(at, min(_WINDOW, end - at))
            if header + names > len(window):
                return
        yield window[at - start + header : at - start + header + names], fields[8]
        at += header + names + fields[11] + fields[12]


__all__ = ["FREE_MEMBERS", "MAX_MEMBERS", "PICKLE_BYTES_PER_MEMBER", "check_directory", "simple_members"]
