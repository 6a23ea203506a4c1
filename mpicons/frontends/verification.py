"""Checking a consolidated checkpoint: file structure, index, and tensor values.

:func:`verify` is collective. Rank 0 lists the directory and reads the index; the output headers
are read round-robin over the ranks; with ``against`` every rank compares its byte-balanced share
of tensor rows with the shards, block by block. Every problem is collected rather than the first
one raised, so one run tells the whole story, and every rank returns the same report.

Only regular files inside the directory are read, with bounded reads: a link (unless links to
regular files are asked for), a FIFO or a device is reported and never opened. An HDF5 output
(``model.h5``) is checked through h5py and its datasets are compared in place like safetensors data.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..comm import as_communicator
from ..comm.agreement import Comm, agree, agree_arguments, agree_on
from ..comm.interrupts import deferred
from ..core.convert import TARGETS
from ..core.engine import Assembler, Block, Segment, block_budget, blocks, segment_bytes, segment_offset
from ..core.errors import InputError, MpiconsError, WriteError
from ..core.format import DTYPE_BY_NAME, MAX_HEADER_SIZE, Header, nbytes_of, parse_header
from ..core.names import INDEX_NAME, SINGLE_FILE_NAME, plain_file_name
from ..core.plan import OUTPUT_METADATA, Layout, Part, build_layout
from ..core.reports import Problem, human_bytes
from ..core.reports import count_of as _count
from ..core.table import DCP_SHARD_NAME
from ..io.hdf5 import HDF5_NAME, dataset_path, storage_dtype
from ..io.journal import STAGING_PREFIX
from ..io.lock import LOCK_NAME, read_lock
from ..io.sources import MAX_TRANSFER, SourceFiles
from ..job.consolidation import DEFAULT_BUFFER_SIZE, check_buffer_fits
from ..job.exchange import ExchangeWriter
from ..job.scan import Scanned, distribute, scan, select

#: Smallest comparison buffer half: must hold one storage unit (≤ 8 bytes); tiny values are for tests.
MIN_HALF_BUFFER = 64
#: An index larger than this is refused unread (one for a million tensors is far smaller).
MAX_INDEX_SIZE = 100_000_000
#: Largest lock file read: mpicons' own are a few hundred bytes.
_MAX_LOCK_SIZE = 1 << 16
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_FOLLOW_HINT = "pass --follow-links (follow_links=True) to accept links to regular files"
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class _Unreadable(Exception):
    """A file verify cannot read as what it should be; ``what`` says why (the path is kept apart)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class _Refused(_Unreadable):
    """An entry verify will not open: a link (unless followed), a FIFO, a device, a directory."""


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


#: What a refused data file's problem adds: where verify reads, and how to accept links.
_DATA_FILES = "; verify reads only regular files inside the directory"


def _refusal(path: str, follow_links: bool, suffix: str | None = None) -> str | None:
    """Why the entry at ``path`` is not opened (a link, a FIFO, a device, ...), or None for a regular file.

    Looked at with ``lstat`` before any open, so nothing but a regular file is ever opened (opening a
    FIFO blocks, a device may have side effects). FileNotFoundError when nothing is there. ``suffix``
    ends the reason (default: where verify reads, and for a link how to accept links).
    """
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        target = os.readlink(path)
        if not follow_links:
            return f"is a symbolic link to {target}" + (f"{_DATA_FILES}: {_FOLLOW_HINT}" if suffix is None else suffix)
        try:
            info = os.stat(path)
        except OSError as exc:
            return f"is a symbolic link to {target}, which cannot be followed ({exc.strerror})"
        if not stat.S_ISREG(info.st_mode):
            return f"is a symbolic link to {target}, which is {_kind(info.st_mode)}" + (suffix or _DATA_FILES)
        return None
    if not stat.S_ISREG(info.st_mode):
        return f"is {_kind(info.st_mode)}, not a regular file" + (suffix or _DATA_FILES)
    return None


def open_regular(path: str, follow_links: bool = False, suffix: str | None = None) -> int:
    """A read-only descriptor on the regular file at ``path``; :class:`_Unreadable` for anything else.

    The open never follows a link unless ``follow_links`` and never blocks, and the descriptor is
    checked again with ``fstat``: an entry swapped for a link or a FIFO after the look is refused too.
    """
    why = _refusal(path, follow_links, suffix)
    if why is not None:
        raise _Refused(why)
    fd = os.open(path, _OPEN_FLAGS | (0 if follow_links else _NOFOLLOW))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _Refused(f"is {_kind(mode)}, not a regular file (it changed while verify looked at it)")
    return fd


def _read_at(fd: int, size: int, offset: int) -> bytes:
    """Up to ``size`` bytes at ``offset`` (fewer only at the end of the file)."""
    chunks, done = [], 0
    while done < size:
        chunk = os.pread(fd, min(size - done, MAX_TRANSFER), offset + done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def _read_index(path: str, follow_links: bool) -> object:
    """The parsed index at ``path``: read only if it is a regular file of at most MAX_INDEX_SIZE bytes."""
    try:
        fd = open_regular(path, follow_links)
    except OSError as exc:
        raise _Unreadable(f"cannot read index ({exc.strerror})") from None
    try:
        raw = _read_at(fd, MAX_INDEX_SIZE + 1, 0)
    except OSError as exc:
        raise _Unreadable(f"cannot read index ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_INDEX_SIZE:
        raise _Unreadable(f"index is larger than the {MAX_INDEX_SIZE}-byte limit (not an index?)")
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _Unreadable(f"index is not valid JSON ({exc})") from None


def _read_header(path: str, follow_links: bool) -> Header:
    """The header of the safetensors file at ``path`` by the reference reader's rules, read only if regular."""
    fd = open_regular(path, follow_links)
    try:
        size = os.fstat(fd).st_size
        prefix = _read_at(fd, 8, 0)
        if len(prefix) < 8:
            raise _Unreadable(f"file is {size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_SIZE:
            raise _Unreadable(
                f"header length {length} exceeds the safetensors limit of {MAX_HEADER_SIZE} bytes (not a safetensors file?)"
            )
        if 8 + length > size:
            raise _Unreadable(
                f"header length {length} runs past the end of the {size}-byte file (truncated, or not a safetensors file?)"
            )
        raw = _read_at(fd, length, 8)
    finally:
        os.close(fd)
    if len(raw) != length:
        raise _Unreadable("file shrank while its header was read")
    return parse_header(raw, size, path)


class _OutputFiles(SourceFiles):
    """The checked checkpoint's files for the value comparison, opened as verify opens everything."""

    def __init__(self, directory: str, names: Sequence[str], follow_links: bool) -> None:
        super().__init__(directory, names)
        self.follow_links = follow_links

    def _open(self, file: int) -> int:
        try:
            return open_regular(self.path(file), self.follow_links)
        except _Unreadable as exc:
            raise WriteError(f"{self.path(file)}: {exc.what}") from None
        except OSError as exc:
            raise WriteError(f"{self.path(file)}: cannot open ({exc.strerror})") from None


# ---------------------------------------------------------------- report


def _problem(path: str, tensor: str | None, what: str) -> Problem:
    """A problem found in a file of the checkpoint (or its index)."""
    return Problem(what, tensor, path)


@dataclass
class VerifyReport:
    """The outcome of :func:`verify`; identical on every rank. ``ok`` when ``problems`` is empty."""

    output_dir: str
    against: str | None
    ranks: int
    files: list[str]
    tensors: int
    total_bytes: int
    shard_tensors: int = 0
    compared_tensors: int = 0
    compared_bytes: int = 0
    problems: list[Problem] = field(default_factory=list)
    #: Entries not read: not regular files (links unless followed, FIFOs, devices), or a lock mpicons
    #: cannot read as its own. The directory cannot be checked as it is (the command line exits 2).
    refused: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        """One line per problem: ``path: tensor 'x': what``."""
        return [str(p) for p in self.problems]

    def summary(self) -> str:
        status = "OK" if self.ok else _count(len(self.problems), "problem")
        checked = f"{_count(len(self.files), 'file')}, {_count(self.tensors, 'tensor')}, {human_bytes(self.total_bytes)}"
        if self.against is not None:
            checked += (
                f"; {self.compared_tensors} of {_count(self.shard_tensors, 'tensor')} ({human_bytes(self.compared_bytes)}) "
                f"compared with {self.against}"
            )
        if self.refused:
            checked += f"; {_count(len(self.refused), 'entry', 'entries')} not read (see above)"
        return f"mpicons verify: {status}: {self.output_dir} ({checked}) on {_count(self.ranks, 'rank')}"

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "output_dir": self.output_dir,
            "against": self.against,
            "ranks": self.ranks,
            "files": list(self.files),
            "tensors": self.tensors,
            "total_bytes": self.total_bytes,
            "shard_tensors": self.shard_tensors,
            "compared_tensors": self.compared_tensors,
            "compared_bytes": self.compared_bytes,
            "problems": [p.to_dict() for p in self.problems],
            "refused": list(self.refused),
        }


# ---------------------------------------------------------------- structure checks


@dataclass
class _Listing:
    """What rank 0 found in the directory and the index, shared with every rank."""

    found: list[str]  # regular, non-hidden *.safetensors files
    leftovers: list[str]  # staging directories of interrupted consolidations
    weight_map: dict[str, str] | None
    total_size: int | None
    listed_existing: list[str]  # files named by the weight map that are regular files (any extension)
    listed_missing: list[str]
    problems: list[Problem]
    sharded: bool = False  # the directory is a sharded checkpoint, not a consolidated one
    refused: list[str] = field(default_factory=list)  # present but not opened: links, FIFOs, devices
    hdf5: _FileResult | None = None  # the datasets of an HDF5 output (``--format hdf5``)


@dataclass
class _FileResult:
    """One output file's header: its tensors ``(name, dtype, shape, begin, end)``, None when unreadable."""

    name: str
    tensors: list[tuple[str, str, tuple[int, ...], int, int]] | None
    data_start: int
    problems: list[Problem]
    refused: bool = False  # not opened: not a regular file (or a link not followed)


@dataclass(frozen=True)
class _Located:
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset of the tensor's data in its file
    nbytes: int


@dataclass
class _Entries:
    """Names of the directory sorted by what verify may do with them."""

    regular: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def _classify(output_dir: str, names: Sequence[str], follow_links: bool) -> _Entries:
    """Each name as a regular file verify reads, an entry it refuses (one problem each), or missing."""
    entries = _Entries()
    for name in names:
        path = os.path.join(output_dir, name)
        try:
            why = _refusal(path, follow_links)
        except FileNotFoundError:
            entries.missing.append(name)
            continue
        except OSError as exc:
            why = f"cannot be looked at ({exc.strerror})"
        if why is None:
            entries.regular.append(name)
        else:
            entries.refused.append(name)
            entries.problems.append(_problem(path, None, why))
    return entries


def _lock_problem(output_dir: str) -> tuple[Problem | None, bool]:
    """A lock file says a consolidation may be running. It is read as the output directory reads it
    (bounded, never following a link or blocking on a FIFO); one mpicons cannot read as its own is
    refused (exit 2), as ``consolidate`` refuses it.

    Returns the problem (None without a lock) and whether the lock was refused."""
    lock = os.path.join(output_dir, LOCK_NAME)
    try:
        seen = read_lock(output_dir)
    except OSError as exc:
        return _problem(lock, None, f"cannot be read ({exc.strerror or exc})"), True
    if seen is None:
        return None, False
    if seen.holder is None:
        what = (
            f"{seen.describe(lock)}; if no consolidation is running, remove it "
            "(or let the next consolidate take it over with --break-lock)"
        )
        return _problem(lock, None, what), True
    return _problem(
        lock, None, f"a consolidation holds this directory ({seen.holder.describe()}): its content may be changing"
    ), False


def _parse_index(index_path: str, obj: object) -> tuple[dict[str, str] | None, int | None, list[Problem]]:
    """The weight map (plain file names only) and total size of a parsed index, leniently."""
    problems: list[Problem] = []
    weight_map: dict[str, str] | None = None
    raw_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(raw_map, dict):
        problems.append(_problem(index_path, None, "index has no weight_map object"))
    else:
        weight_map = {}
        for tensor, file_name in raw_map.items():
            if plain_file_name(file_name):
                weight_map[tensor] = file_name
            else:
                problems.append(_problem(index_path, tensor, f"weight_map value {file_name!r} is not a plain file name"))
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    size = metadata.get("total_size") if isinstance(metadata, dict) else None
    if type(size) is not int:
        problems.append(_problem(index_path, None, f"index has no integer metadata.total_size (got {size!r})"))
        size = None
    return weight_map, size, problems


def _list_output(output_dir: str, follow_links: bool) -> _Listing:
    """Rank 0: the directory's safetensors and partial files, and the index, parsed leniently."""
    if not os.path.isdir(output_dir):
        raise InputError(f"{output_dir}: output directory does not exist or is not a directory")
    try:
        names = sorted(e.name for e in os.scandir(output_dir))
    except OSError as exc:
        raise InputError(f"{output_dir}: cannot list output directory ({exc.strerror})") from None
    candidates = _classify(output_dir, [n for n in names if n.endswith(".safetensors") and not n.startswith(".")], follow_links)
    found = candidates.regular
    leftovers = [n for n in names if n.startswith(STAGING_PREFIX)]
    index_path = os.path.join(output_dir, INDEX_NAME)
    shards = [n for n in found if DCP_SHARD_NAME.match(n)]
    if shards and not os.path.lexists(index_path):
        what = (
            f"holds {_count(len(shards), 'DCP shard file')} (shard-*-model-*.safetensors), not a consolidated "
            f"checkpoint; to check a consolidation of it: mpicons verify OUTPUT_DIR --against {output_dir}"
        )
        return _Listing([], [], None, None, [], [], [_problem(output_dir, None, what)], sharded=True)
    problems, refused = list(candidates.problems), list(candidates.refused)
    lock, lock_refused = _lock_problem(output_dir)
    problems += [lock] if lock else []
    refused += [LOCK_NAME] if lock_refused else []
    if HDF5_NAME in names and not os.path.lexists(index_path):
        problems += [_problem(os.path.join(output_dir, n), None, _NOT_HDF5) for n in found]
        hdf5 = _hdf5_result(output_dir, follow_links)
        return _Listing([], leftovers, None, None, [], [], problems, refused=refused, hdf5=hdf5)
    obj: object = None
    if not os.path.lexists(index_path):
        if found != [SINGLE_FILE_NAME]:  # a lone model.safetensors needs no index (Hugging Face writes none)
            problems.append(_problem(index_path, None, "index is missing (the checkpoint is incomplete)"))
    else:
        try:
            obj = _read_index(index_path, follow_links)
        except _Unreadable as exc:
            problems.append(_problem(index_path, None, exc.what))
            refused += [INDEX_NAME] if isinstance(exc, _Refused) else []
    weight_map, total_size, more = _parse_index(index_path, obj) if obj is not None else (None, None, [])
    problems += more
    listed = _classify(output_dir, sorted(set(weight_map.values())) if weight_map else [], follow_links)
    problems += [p for p in listed.problems if p.path not in {q.path for q in candidates.problems}]
    refused = sorted(set(refused) | set(listed.refused))
    return _Listing(found, leftovers, weight_map, total_size, listed.regular, listed.missing, problems, refused=refused)


_NOT_HDF5 = "beside model.h5 (an HDF5 output) and not part of it (stray file)"


#: ``tensor 'name': what`` as format's errors word it (the name is a Python repr).
_TENSOR_PREFIX = re.compile(r"""^tensor ('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"): (.*)$""", re.DOTALL)


def _strip_path(message: str, path: str) -> str:
    """mpicons errors start with the path; a Problem keeps the path apart."""
    prefix = f"{path}: "
    return message[len(prefix) :] if message.startswith(prefix) else message


def _header_problem(path: str, message: str) -> Problem:
    """A header error as a Problem, with the tensor it names (if any) in its own field."""
    what = _strip_path(message, path)
    match = _TENSOR_PREFIX.match(what)
    if match:
        try:
            return _problem(path, ast.literal_eval(match.group(1)), match.group(2))
        except (ValueError, SyntaxError):
            pass
    return _problem(path, None, what)


def _check_file(output_dir: str, name: str, follow_links: bool) -> _FileResult:
    """Header by the safetensors rules (offsets, sizes, length, dtypes, names) and ``format`` = ``pt``."""
    path = os.path.join(output_dir, name)
    try:
        header = _read_header(path, follow_links)
    except _Unreadable as exc:
        return _FileResult(name, None, 0, [_problem(path, None, exc.what)], refused=isinstance(exc, _Refused))
    except InputError as exc:
        return _FileResult(name, None, 0, [_header_problem(path, str(exc))])
    except OSError as exc:
        return _FileResult(name, None, 0, [_problem(path, None, f"cannot read ({exc.strerror})")])
    problems = []
    expected = OUTPUT_METADATA["format"]
    got = header.metadata.get("format")
    if got != expected:
        what = "has no __metadata__ 'format'" if got is None else f"__metadata__ 'format' is {got!r}"
        problems.append(_problem(path, None, f"{what}; Hugging Face checkpoints need {expected!r}"))
    tensors = [(e.name, e.dtype, e.shape, e.begin, e.end) for e in header.tensors]
    return _FileResult(name, tensors, header.data_start, problems)


# ---------------------------------------------------------------- HDF5 output


def _hdf5_result(output_dir: str, follow_links: bool) -> _FileResult:
    """Rank 0: ``model.h5``'s datasets as tensors at their byte offsets in the file, read through h5py.

    The file is opened as every file verify reads and handed to h5py as an open file, so h5py
    never opens a path itself; the values are then compared at those offsets like safetensors data.
    """
    path = os.path.join(output_dir, HDF5_NAME)
    try:
        import h5py
    except ImportError:
        raise InputError(f"{path}: verifying an HDF5 output needs h5py: pip install 'mpicons[hdf5]'") from None
    try:
        fd = open_regular(path, follow_links)
    except _Refused as exc:
        return _FileResult(HDF5_NAME, None, 0, [_problem(path, None, exc.what)], refused=True)
    except OSError as exc:
        return _FileResult(HDF5_NAME, None, 0, [_problem(path, None, f"cannot read ({exc.strerror})")])
    size = os.fstat(fd).st_size
    tensors: list[tuple[str, str, tuple[int, ...], int, int]] = []
    problems: list[Problem] = []
    try:
        with io.FileIO(fd, "rb") as raw, h5py.File(raw, "r") as handle:
            datasets: list[h5py.Dataset] = []
            handle.visititems(lambda _, item: datasets.append(item) if isinstance(item, h5py.Dataset) else None)
            for dataset in datasets:
                described = _hdf5_tensor(path, dataset, size)
                (problems if isinstance(described, Problem) else tensors).append(described)  # type: ignore[arg-type]
    except OSError as exc:  # h5py's error for a file that is not HDF5 (or breaks while read)
        return _FileResult(HDF5_NAME, None, 0, [_problem(path, None, f"is not an HDF5 file h5py can read ({exc})")])
    return _FileResult(HDF5_NAME, tensors, 0, problems)


def _attr_text(value: object) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def _hdf5_tensor(path: str, dataset: Any, file_size: int) -> tuple[str, str, tuple[int, ...], int, int] | Problem:
    """A dataset as mpicons writes it (its ``name`` and ``dtype`` attributes, contiguous, at its path), or the problem."""
    import h5py

    name, dtype = _attr_text(dataset.attrs.get("name")), _attr_text(dataset.attrs.get("dtype"))
    if name is None or dtype not in DTYPE_BY_NAME:
        return _problem(path, None, f"dataset {dataset.name} has no 'name' and safetensors 'dtype' attributes")
    if dataset.name != dataset_path(name):
        return _problem(path, name, f"is the dataset {dataset.name}; mpicons stores it at {dataset_path(name)}")
    if dataset.dtype != storage_dtype(dtype):
        what = f"is stored as {dataset.dtype}, not as {storage_dtype(dtype)} (its dtype attribute is {dtype})"
        return _problem(path, name, what)
    shape = tuple(int(d) for d in dataset.shape)
    bits = DTYPE_BY_NAME[dtype].bits
    if bits % 8 and shape:  # sub-byte dtypes are stored with their last dimension in bytes
        shape = (*shape[:-1], shape[-1] * 8 // bits)
    nbytes = nbytes_of(dtype, shape) or 0
    if dataset.id.get_create_plist().get_layout() != h5py.h5d.CONTIGUOUS:
        return _problem(path, name, "is not a contiguous dataset, so its bytes cannot be compared in place")
    offset = dataset.id.get_offset()
    if nbytes and (offset is None or offset + nbytes > file_size or dataset.id.get_storage_size() != nbytes):
        return _problem(path, name, f"its {nbytes} bytes of data are not all allocated in the {file_size}-byte file")
    return name, dtype, shape, int(offset or 0), int(offset or 0) + nbytes


def _cross_check(output_dir: str, listing: _Listing, results: list[_FileResult]) -> tuple[dict[str, _Located], list[Problem]]:
    """Where every tensor is, and the problems between the files and the index (pure, same on every rank)."""
    join = lambda name: os.path.join(output_dir, name)  # noqa: E731
    index_path = join(INDEX_NAME)
    problems = list(listing.problems) + [p for r in results for p in r.problems]
    located: dict[str, _Located] = {}
    listed = set(listing.weight_map.values()) if listing.weight_map is not None else set()
    # Files the index lists come first, so a tensor duplicated in a stray file is located where it belongs.
    for result in sorted(results, key=lambda r: (r.name not in listed, r.name)):
        for tensor, dtype, shape, begin, end in result.tensors or ():
            if tensor in located:
                problems.append(
                    _problem(join(result.name), tensor, f"also in {located[tensor].file}; a tensor must be in one file")
                )
                continue
            located[tensor] = _Located(result.name, dtype, shape, result.data_start + begin, end - begin)
    problems += [
        _problem(
            join(n),
            None,
            "left by an interrupted consolidation; the next 'mpicons consolidate' into this directory finishes or undoes it",
        )
        for n in listing.leftovers
    ]
    weight_map = listing.weight_map
    if weight_map is None:
        return located, problems
    counts: dict[str, int] = {}
    for file_name in weight_map.values():
        counts[file_name] = counts.get(file_name, 0) + 1
    problems += [_problem(join(n), None, "not listed in the index (stray file)") for n in listing.found if n not in listed]
    problems += [
        _problem(join(n), None, f"listed in the index for {_count(counts[n], 'tensor')} but missing")
        for n in listing.listed_missing
    ]
    readable = {r.name for r in results if r.tensors is not None}
    for tensor, file_name in weight_map.items():
        where = located.get(tensor)
        if where is None:
            if file_name in readable:
                problems.append(_problem(index_path, tensor, f"weight_map names {file_name}, which does not hold the tensor"))
        elif where.file != file_name:
            problems.append(_problem(index_path, tensor, f"weight_map names {file_name} but the tensor is in {where.file}"))
    for tensor, where in located.items():
        if tensor not in weight_map and where.file in listed:
            problems.append(_problem(join(where.file), tensor, "not in the index's weight_map"))
    if listing.total_size is not None and listed <= readable:
        actual = sum(w.nbytes for w in located.values() if w.file in listed)
        if actual != listing.total_size:
            problems.append(
                _problem(
                    index_path,
                    None,
                    f"metadata.total_size is {listing.total_size} but the files hold {actual} bytes of tensor data",
                )
            )
    return located, problems


# ---------------------------------------------------------------- value comparison


@dataclass
class _Diff:
    """Differences found in part of one tensor: how many storage units, and the first one (C order)."""

    count: int = 0
    first: tuple[int, ...] | None = None
    got: bytes = b""
    want: bytes = b""
    error: str | None = None

    def add(self, count: int, first: tuple[int, ...], got: bytes, want: bytes) -> None:
        self.count += count
        if self.first is None or first < self.first:
            self.first, self.got, self.want = first, got, want

    def merge(self, other: _Diff) -> None:
        if other.count:
            self.add(other.count, other.first, other.got, other.want)  # type: ignore[arg-type]
        self.error = self.error or other.error


class _Checker:
    """Compares assembled blocks (what the shards say) with the output files, segment by segment.

    The output bytes of a block are read with one read per contiguous stretch of an output file;
    only a block that differs is looked at segment by segment.
    """

    def __init__(self, layout: Layout, located: dict[str, _Located], outputs: SourceFiles, out_ids: dict[str, int]) -> None:
        self.layout = layout
        self.located = located
        self.outputs = outputs
        self.out_ids = out_ids
        self.got = np.empty(0, dtype=np.uint8)
        self.diffs: dict[int, _Diff] = {}

    def _where(self, segment: Segment) -> tuple[int, int, int]:
        """(output file id, byte offset, bytes) of a segment in the checked output."""
        tensor = self.layout.tensors[segment.tensor]
        inside = segment_offset(self.layout, segment) - tensor.offset
        where = self.located[tensor.name]
        return self.out_ids[where.file], where.start + inside, segment_bytes(self.layout, segment)[1]

    def __call__(self, block: Block, expected: np.ndarray) -> None:
        if len(self.got) < block.size:
            self.got = np.empty(block.size, dtype=np.uint8)
        got = self.got[: block.size]
        places = [self._where(s) for s in block.segments]
        position = 0
        while position < len(places):  # one read per contiguous stretch of one output file
            file, offset, size = places[position]
            last = position
            while last + 1 < len(places) and places[last + 1][0] == file and places[last + 1][1] == offset + size:
                last += 1
                size += places[last][2]
            start = sum(p[2] for p in places[:position])
            self.outputs.read_into(file, offset, got[start : start + size].data)
            position = last + 1
        if np.array_equal(got, expected):
            return
        start = 0
        for segment, (_, _, size) in zip(block.segments, places):
            self._segment(segment, got[start : start + size], expected[start : start + size])
            start += size

    def _segment(self, segment: Segment, got: np.ndarray, want: np.ndarray) -> None:
        tensor = self.layout.tensors[segment.tensor]
        unit = tensor.unit
        bad = (got.reshape(-1, unit) != want.reshape(-1, unit)).any(axis=1)
        if not bad.any():
            return
        first = int(np.argmax(bad))
        linear = (segment_offset(self.layout, segment) - tensor.offset) // unit + first
        index = tuple(int(i) for i in np.unravel_index(linear, tensor.storage))
        diff = self.diffs.setdefault(segment.tensor, _Diff())
        diff.add(
            int(np.count_nonzero(bad)),
            index,
            got[first * unit : (first + 1) * unit].tobytes(),
            want[first * unit : (first + 1) * unit].tobytes(),
        )

    def fail(self, block: Block, error: BaseException) -> None:
        for segment in block.segments:
            self.diffs.setdefault(segment.tensor, _Diff()).error = f"cannot compare: {error}"


def _compare_share(
    comm: Comm,
    scanned: Scanned,
    layout: Layout,
    part: Part,
    output_dir: str,
    located: dict[str, _Located],
    comparable: set[int],
    buffer_size: int,
    follow_links: bool,
) -> dict[int, _Diff]:
    """This rank's rows of the comparable tensors, assembled from the shards and compared; differences per tensor."""
    part.items = [item for item in part.items if item.tensor in comparable]
    out_names = sorted({located[layout.tensors[t].name].file for t in comparable})
    sources, outputs = SourceFiles(scanned.directory, scanned.files.names), _OutputFiles(output_dir, out_names, follow_links)
    checker = _Checker(layout, located, outputs, {name: i for i, name in enumerate(out_names)})
    try:
        if scanned.shared:
            block_bytes = block_budget(buffer_size, 2)
            assembler = Assembler(layout, part, block_bytes, sources.read_into)
            buffer = np.empty(block_bytes, dtype=np.uint8)
            segments = [Segment(i.tensor, i.row_begin, i.row_end) for i in part.items]
            for whole in blocks(layout, segments, block_bytes):
                for block, runs in assembler.split(whole):
                    if len(buffer) < block.size:
                        buffer = np.empty(block.size, dtype=np.uint8)
                    try:
                        checker(block, assembler.assemble(block, buffer, runs))
                    except (MpiconsError, OSError) as exc:
                        checker.fail(block, exc)
        else:
            with deferred():  # a message pattern every rank must complete (the exchange polls for signals itself)
                channel = comm.duplicate()
                try:
                    ExchangeWriter(
                        layout,
                        part,
                        scanned.files,
                        sources,
                        None,
                        buffer_size,
                        channel,
                        sink=checker,
                        copies=False,
                        delegate=False,
                    ).run()
                finally:
                    channel.free()
    finally:
        sources.close()
        outputs.close()
    return checker.diffs


def _element_index(storage_index: tuple[int, ...], dtype: str, ndim: int) -> list[int]:
    """A storage-unit index as an element index: padding dims dropped, sub-byte last dims in elements."""
    index = list(storage_index[:ndim])
    bits = DTYPE_BY_NAME[dtype].bits
    if bits % 8 and index:
        index[-1] = index[-1] * 8 // bits
    return index


def _against_checks(
    plan: Layout, against: str, output_dir: str, listing: _Listing, results: list[_FileResult], located: dict[str, _Located]
) -> tuple[set[int], list[Problem]]:
    """Tensors present on both sides with the same dtype and shape (comparable), and the problems of the rest."""
    join = lambda name: os.path.join(output_dir, name)  # noqa: E731
    unreadable = set(listing.listed_missing) | set(listing.refused) | {r.name for r in results if r.tensors is None}
    weight_map = listing.weight_map or {}
    sole = results[0].name if listing.weight_map is None and len(results) == 1 else None  # model.safetensors, model.h5
    problems: list[Problem] = []
    comparable: set[int] = set()
    names = set()
    for t, info in enumerate(plan.tensors):
        names.add(info.name)
        where = located.get(info.name)
        if where is None:
            if weight_map.get(info.name, sole) not in unreadable:  # else its file's problem says it all
                problems.append(
                    _problem(output_dir, info.name, f"in the shards ({info.dtype}{list(info.shape)}) but in no output file")
                )
        elif (where.dtype, where.shape) != (info.dtype, info.shape):
            problems.append(
                _problem(
                    join(where.file),
                    info.name,
                    f"is {where.dtype}{list(where.shape)} but the shards hold {info.dtype}{list(info.shape)}",
                )
            )
        else:
            comparable.add(t)
    for tensor, where in located.items():
        if tensor not in names:
            problems.append(_problem(join(where.file), tensor, f"not in the shards in {against}"))
    hint = _dtype_hint(plan, located)
    if hint:
        problems.append(_problem(output_dir, None, hint))
    return comparable, problems


def _dtype_hint(plan: Layout, located: dict[str, _Located]) -> str | None:
    """When every float tensor that differs in dtype was turned into one dtype, the output was written with --dtype."""
    targets = {v: k for k, v in TARGETS.items()}
    changed = {
        (info.dtype, located[info.name].dtype)
        for info in plan.tensors
        if info.name in located
        and located[info.name].shape == info.shape
        and located[info.name].dtype != info.dtype
        and DTYPE_BY_NAME[info.dtype].is_float
    }
    written = {after for _, after in changed}
    if len(written) != 1 or next(iter(written)) not in targets:
        return None
    dtype = next(iter(written))
    was = "/".join(sorted(before for before, _ in changed))
    if plan.tensors and any(t.source_dtype != t.dtype for t in plan.tensors):
        return None  # verify was given --dtype already
    return (
        f"the output's floating-point tensors are {dtype} where the shards hold {was}: if it was written "
        f"with --dtype {targets[dtype]}, verify with --dtype {targets[dtype]}"
    )


def _diff_problems(plan: Layout, output_dir: str, located: dict[str, _Located], diffs: dict[int, _Diff]) -> list[Problem]:
    problems = []
    for t in sorted(diffs):
        diff, info = diffs[t], plan.tensors[t]
        path = os.path.join(output_dir, located[info.name].file)
        if diff.error:
            problems.append(_problem(path, info.name, diff.error))
        if diff.count:
            units = int(np.prod(info.storage, dtype=np.int64))
            noun = "elements" if info.unit * 8 == DTYPE_BY_NAME[info.dtype].bits else "bytes"
            index = _element_index(diff.first, info.dtype, len(info.shape))  # type: ignore[arg-type]
            problems.append(
                _problem(
                    path,
                    info.name,
                    f"differs from the shards in {diff.count} of {units} {noun}; first at {index} "
                    f"(output bytes {diff.got.hex()}, shards {diff.want.hex()})",
                )
            )
    return problems


# ---------------------------------------------------------------- the job


def verify(
    output_dir: str | os.PathLike[str],
    *,
    against: str | os.PathLike[str] | None = None,
    comm: object | None = None,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
    dtype: str | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    strip_prefix: str | None = None,
    follow_links: bool = False,
) -> VerifyReport:
    """Check the consolidated checkpoint in ``output_dir``; with ``against``, every tensor against the shards.

    Parameters:
        output_dir: a consolidated checkpoint (safetensors files and ``model.safetensors.index.json``,
            or the ``model.h5`` of ``--format hdf5``). Structure is always checked: headers (HDF5:
            datasets), index, stray and missing files, leftovers of a run. Only regular files inside
            the directory are opened: links, FIFOs and devices are reported, never read.
        against: the shard directory it was made from (``{rank}`` allowed, as for consolidate): every
            tensor's dtype, shape and bytes are compared with the shards, block by block.
        comm: the communicator (default ``MPI.COMM_WORLD``); collective, files and blocks are split
            over its ranks.
        buffer_size: bytes of buffers per rank for the comparison (as for consolidate).
        dtype: the output was written with this ``--dtype``; the shards are converted the same way
            before comparing.
        include, exclude, strip_prefix: the output was written with this tensor selection
            (:class:`~mpicons.core.options.Options`): the shards are selected and renamed alike.
        follow_links: accept symbolic links to regular files (a Hugging Face cache snapshot links
            its files into ``blobs/``); links to anything else are still reported.

    Problems with the checkpoint are collected in the returned :class:`VerifyReport` (the same on
    every rank), not raised. :class:`InputError` is raised on every rank when the arguments are
    unusable (missing directory, unreadable shards).
    """
    comm = as_communicator(comm)
    output_dir = os.fspath(output_dir)
    against = None if against is None else os.fspath(against)
    agree_arguments(
        comm, "verify", output=os.path.abspath(output_dir), against=against and os.path.abspath(against),
        buffer_size=buffer_size, dtype=dtype, include=include, exclude=exclude, strip_prefix=strip_prefix,
        follow_links=follow_links,
    )  # fmt: skip
    check_buffer_fits(comm, buffer_size)
    listing: _Listing = agree_on(comm, 0, lambda: _list_output(output_dir, follow_links))
    if listing.sharded:
        return VerifyReport(output_dir, against, comm.size, [], 0, 0, problems=list(listing.problems))
    if listing.hdf5 is not None:
        files, results = [HDF5_NAME], [listing.hdf5]
    else:
        files = sorted(set(listing.found) | set(listing.listed_existing))
        mine = files[comm.rank :: comm.size]
        parts = agree(comm, lambda: [_check_file(output_dir, name, follow_links) for name in mine], gather=True)
        results = sorted((r for part in parts for r in part), key=lambda r: r.name)
    located, problems = _cross_check(output_dir, listing, results)
    report = VerifyReport(
        output_dir=output_dir,
        against=against,
        ranks=comm.size,
        files=files,
        tensors=len(located),
        total_bytes=sum(w.nbytes for w in located.values()),
    )
    if against is not None:
        scanned = select(scan(against, comm), include, exclude, strip_prefix)
        layout = agree(comm, lambda: build_layout(scanned.files, scanned.names, scanned.facts, comm.size, dtype=dtype))
        part = distribute(comm, scanned, layout)
        comparable, more = _against_checks(layout, against, output_dir, listing, results, located)
        problems += more
        shares = agree(
            comm,
            lambda: _compare_share(comm, scanned, layout, part, output_dir, located, comparable, buffer_size, follow_links),
            gather=True,
        )
        diffs: dict[int, _Diff] = {}
        for share in shares:
            for t, diff in share.items():
                diffs.setdefault(t, _Diff()).merge(diff)
        problems += _diff_problems(layout, output_dir, located, diffs)
        report.shard_tensors = len(layout.tensors)
        report.compared_tensors = len(comparable)
        report.compared_bytes = sum(layout.tensors[t].nbytes for t in comparable)
    report.problems = sorted(problems, key=lambda p: (p.path, p.tensor or "", p.what))
    names = set(listing.refused) | {r.name for r in results if r.refused}
    report.refused = sorted(os.path.join(output_dir, name) for name in names)
    return report


__all__ = ["verify", "VerifyReport", "MAX_INDEX_SIZE", "open_regular"]
