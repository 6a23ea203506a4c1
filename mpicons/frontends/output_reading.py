"""What ``verify`` reads from a checkpoint directory: the listing, the index, headers, HDF5 datasets.

Only regular files inside the directory are read, with bounded reads: a link (unless links to
regular files are asked for), a FIFO or a device is reported and never opened. An HDF5 output
(``model.h5``) is read through h5py, handed the file verify opened. What is read becomes the
values of :mod:`mpicons.frontends.verify_checks`, whose checks are pure.
"""

from __future__ import annotations

import io
import json
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import InputError, WriteError
from ..core.layout import OUTPUT_METADATA
from ..core.names import DATA_SUFFIX, DCP_SHARD_NAME, INDEX_NAME, METADATA_NAME, SINGLE_FILE_NAME
from ..core.reports import Problem
from ..core.reports import count_of as _count
from ..core.safetensors_codec import (
    DTYPE_BY_NAME,
    PREFIX_SIZE,
    BadPrefix,
    Header,
    HeaderError,
    header_length,
    nbytes_of,
    parse_header,
)
from ..io import regular_files
from ..io.hdf5 import HDF5_NAME, dataset_path, storage_dtype
from ..io.journal import STAGING_PREFIX
from ..io.lock import LOCK_NAME, read_lock
from ..io.regular_files import read_at, read_bounded
from ..io.s3 import is_s3
from ..io.sources import SourceFiles
from ..job.adapter_setup import checkpoint_at
from ..trainers import TRAINERS
from .verify_checks import FileResult, Listing, file_problem, header_problem, parse_index

#: An index larger than this is refused unread (one for a million tensors is far smaller).
MAX_INDEX_SIZE = 100_000_000
_FOLLOW_HINT = "pass --follow-links (follow_links=True) to accept links to regular files"
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


class Unreadable(Exception):
    """A file verify cannot read as what it should be; ``what`` says why (the path is kept apart), ``kind``
    is the problem's kind (``reports.KINDS``): unreadable, or not what it should be (``header``, ``index``)."""

    def __init__(self, what: str, kind: str = "unreadable") -> None:
        super().__init__(what)
        self.what, self.kind = what, kind


class Refused(Unreadable):
    """An entry verify will not open: a link (unless followed), a FIFO, a device, a directory."""

    def __init__(self, what: str) -> None:
        super().__init__(what, "refused")


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


#: What a refused data file's problem adds: where verify reads, and how to accept links.
_DATA_FILES = "; verify reads only regular files inside the directory"


def refusal(path: str, follow_links: bool, suffix: str | None = None) -> str | None:
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
    """A read-only descriptor on the regular file at ``path``; :class:`Unreadable` for anything else.

    The open never follows a link unless ``follow_links`` and never blocks, and the descriptor is
    checked again with ``fstat``: an entry swapped for a link or a FIFO after the look is refused too.
    """
    why = refusal(path, follow_links, suffix)
    if why is not None:
        raise Refused(why)
    try:
        return regular_files.open_regular(path, follow_links)
    except regular_files.NotRegular as exc:
        raise Refused(f"is {_kind(exc.mode)}, not a regular file (it changed while verify looked at it)") from None


def _read_index(path: str, follow_links: bool) -> object:
    """The parsed index at ``path``: read only if it is a regular file of at most MAX_INDEX_SIZE bytes."""
    try:
        fd = open_regular(path, follow_links)
    except OSError as exc:
        raise Unreadable(f"cannot read index ({exc.strerror})") from None
    try:
        raw = read_bounded(fd, MAX_INDEX_SIZE)
    except OSError as exc:
        raise Unreadable(f"cannot read index ({exc.strerror})") from None
    finally:
        os.close(fd)
    if raw is None:
        raise Unreadable(f"index is larger than the {MAX_INDEX_SIZE}-byte limit (not an index?)", "index")
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise Unreadable(f"index is not valid JSON ({exc})", "index") from None


def _read_header(path: str, follow_links: bool) -> Header:
    """The header of the safetensors file at ``path`` by the reference reader's rules, read only if regular."""
    fd = open_regular(path, follow_links)
    try:
        size = os.fstat(fd).st_size
        try:
            length = header_length(read_at(fd, PREFIX_SIZE, 0), size)
        except BadPrefix as exc:
            raise Unreadable(exc.what, "header") from None
        raw = read_at(fd, length, PREFIX_SIZE)
    finally:
        os.close(fd)
    if len(raw) != length:
        raise Unreadable("file shrank while its header was read")
    return parse_header(raw, size, path)


class OutputFiles(SourceFiles):
    """The checked checkpoint's files for the value comparison, opened as verify opens everything."""

    def __init__(self, directory: str, names: Sequence[str], follow_links: bool) -> None:
        super().__init__(directory, names)
        self.follow_links = follow_links

    def _open(self, file: int) -> int:
        try:
            return open_regular(self.path(file), self.follow_links)
        except Unreadable as exc:
            raise WriteError(f"{self.path(file)}: {exc.what}") from None
        except OSError as exc:
            raise WriteError(f"{self.path(file)}: cannot open ({exc.strerror})") from None


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
            why = refusal(path, follow_links)
        except FileNotFoundError:
            entries.missing.append(name)
            continue
        except OSError as exc:
            entries.refused.append(name)
            entries.problems.append(file_problem(path, None, f"cannot be looked at ({exc.strerror})", kind="unreadable"))
            continue
        if why is None:
            entries.regular.append(name)
        else:
            entries.refused.append(name)
            entries.problems.append(file_problem(path, None, why, kind="refused"))
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
        return file_problem(lock, None, f"cannot be read ({exc.strerror or exc})", kind="lock"), True
    if seen is None:
        return None, False
    if seen.holder is None:
        what = (
            f"{seen.describe(lock)}; if no consolidation is running, remove it "
            "(or let the next consolidate take it over with --break-lock)"
        )
        return file_problem(lock, None, what, kind="lock"), True
    if seen.holder.provably_gone():
        what = (
            f"left by a consolidation that is no longer running ({seen.holder.describe()}; that process is gone): "
            "nothing is changing the directory, but that run did not finish; the next 'mpicons consolidate' into it "
            "clears the lock and finishes or undoes what the run left"
        )
        return file_problem(lock, None, what, kind="leftover"), False
    what = f"a consolidation holds this directory ({seen.holder.describe()}): its content may be changing"
    return file_problem(lock, None, what, kind="locked"), False


def list_output(output_dir: str, follow_links: bool) -> Listing:
    """Rank 0: the directory's safetensors and partial files, and the index, parsed leniently."""
    if is_s3(output_dir):
        raise InputError(
            f"{output_dir}: verify checks a local directory; a checkpoint in object storage cannot be verified yet. "
            f"Verify a local copy of it, or a local output against shards there: mpicons verify OUTPUT_DIR --against {output_dir}"
        )
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
    sharded = _sharded_what(names, found) if not os.path.lexists(index_path) else None
    trainers = checkpoint_at(output_dir) if sharded is None and not found and not os.path.lexists(index_path) else None
    if trainers is not None:
        sharded = f"a {TRAINERS[trainers.trainer].title} checkpoint ({trainers.layout})"
    if sharded is not None:
        what = (
            f"{sharded}, not a consolidated checkpoint; to check a consolidation of it: "
            f"mpicons verify OUTPUT_DIR --against {output_dir}"
        )
        return Listing([], [], None, None, [], [], [file_problem(output_dir, None, what, kind="sharded")], sharded=True)
    problems, refused = list(candidates.problems), list(candidates.refused)
    lock, lock_refused = _lock_problem(output_dir)
    problems += [lock] if lock else []
    refused += [LOCK_NAME] if lock_refused else []
    if HDF5_NAME in names and not os.path.lexists(index_path):
        problems += [file_problem(os.path.join(output_dir, n), None, _NOT_HDF5, kind="extra file") for n in found]
        hdf5 = _hdf5_result(output_dir, follow_links)
        return Listing([], leftovers, None, None, [], [], problems, refused=refused, hdf5=hdf5)
    obj: object = None
    if not os.path.lexists(index_path):
        if found != [SINGLE_FILE_NAME]:  # a lone model.safetensors needs no index (Hugging Face writes none)
            problems.append(file_problem(index_path, None, "index is missing (the checkpoint is incomplete)", kind="index"))
    else:
        try:
            obj = _read_index(index_path, follow_links)
        except Unreadable as exc:
            problems.append(file_problem(index_path, None, exc.what, kind=exc.kind))
            refused += [INDEX_NAME] if isinstance(exc, Refused) else []
    weight_map, total_size, more = parse_index(index_path, obj) if obj is not None else (None, None, [])
    problems += more
    listed = _classify(output_dir, sorted(set(weight_map.values())) if weight_map else [], follow_links)
    problems += [p for p in listed.problems if p.path not in {q.path for q in candidates.problems}]
    refused = sorted(set(refused) | set(listed.refused))
    return Listing(found, leftovers, weight_map, total_size, listed.regular, listed.missing, problems, refused=refused)


def _sharded_what(names: Sequence[str], found: Sequence[str]) -> str | None:
    """What makes a directory without an index a sharded checkpoint (DCP's shard files, or DCP's
    ``.metadata``), or None."""
    shards = [n for n in found if DCP_SHARD_NAME.match(n)]
    if shards:
        return f"holds {_count(len(shards), 'DCP shard file')} (shard-*-model-*.safetensors)"
    if METADATA_NAME in names:
        data = sum(1 for n in names if n.endswith(DATA_SUFFIX))
        return f"holds DCP's {METADATA_NAME} and {_count(data, DATA_SUFFIX + ' file')} (DCP's default format)"
    return None


_NOT_HDF5 = "beside model.h5 (an HDF5 output) and not part of it (stray file)"


def check_file(output_dir: str, name: str, follow_links: bool) -> FileResult:
    """Header by the safetensors rules (offsets, sizes, length, dtypes, names) and ``format`` = ``pt``."""
    path = os.path.join(output_dir, name)
    try:
        header = _read_header(path, follow_links)
    except Unreadable as exc:
        problem = file_problem(path, None, exc.what, kind=exc.kind)
        return FileResult(name, None, 0, [problem], refused=isinstance(exc, Refused))
    except HeaderError as exc:
        return FileResult(name, None, 0, [header_problem(exc)])
    except OSError as exc:
        return FileResult(name, None, 0, [file_problem(path, None, f"cannot read ({exc.strerror})", kind="unreadable")])
    problems = []
    expected = OUTPUT_METADATA["format"]
    got = header.metadata.get("format")
    if got != expected:
        what = "has no __metadata__ 'format'" if got is None else f"__metadata__ 'format' is {got!r}"
        problems.append(file_problem(path, None, f"{what}; Hugging Face checkpoints need {expected!r}", kind="metadata"))
    tensors = [(e.name, e.dtype, e.shape, e.begin, e.end) for e in header.tensors]
    return FileResult(name, tensors, header.data_start, problems)


# ---------------------------------------------------------------- HDF5 output


def _hdf5_result(output_dir: str, follow_links: bool) -> FileResult:
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
    except Refused as exc:
        return FileResult(HDF5_NAME, None, 0, [file_problem(path, None, exc.what, kind=exc.kind)], refused=True)
    except OSError as exc:
        return FileResult(HDF5_NAME, None, 0, [file_problem(path, None, f"cannot read ({exc.strerror})", kind="unreadable")])
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
        what = f"is not an HDF5 file h5py can read ({exc})"
        return FileResult(HDF5_NAME, None, 0, [file_problem(path, None, what, kind="hdf5")])
    return FileResult(HDF5_NAME, tensors, 0, problems)


def _attr_text(value: object) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def _hdf5_tensor(path: str, dataset: Any, file_size: int) -> tuple[str, str, tuple[int, ...], int, int] | Problem:
    """A dataset as mpicons writes it (its ``name`` and ``dtype`` attributes, contiguous, at its path), or the problem."""
    import h5py

    name, dtype = _attr_text(dataset.attrs.get("name")), _attr_text(dataset.attrs.get("dtype"))
    if name is None or dtype not in DTYPE_BY_NAME:
        return file_problem(path, None, f"dataset {dataset.name} has no 'name' and safetensors 'dtype' attributes", kind="hdf5")
    if dataset.name != dataset_path(name):
        return file_problem(path, name, f"is the dataset {dataset.name}; mpicons stores it at {dataset_path(name)}", kind="hdf5")
    if dataset.dtype != storage_dtype(dtype):
        what = f"is stored as {dataset.dtype}, not as {storage_dtype(dtype)} (its dtype attribute is {dtype})"
        return file_problem(path, name, what, kind="hdf5")
    shape = tuple(int(d) for d in dataset.shape)
    bits = DTYPE_BY_NAME[dtype].bits
    if bits % 8 and shape:  # sub-byte dtypes are stored with their last dimension in bytes
        shape = (*shape[:-1], shape[-1] * 8 // bits)
    nbytes = nbytes_of(dtype, shape) or 0
    if dataset.id.get_create_plist().get_layout() != h5py.h5d.CONTIGUOUS:
        return file_problem(path, name, "is not a contiguous dataset, so its bytes cannot be compared in place", kind="hdf5")
    offset = dataset.id.get_offset()
    if nbytes and (offset is None or offset + nbytes > file_size or dataset.id.get_storage_size() != nbytes):
        what = f"its {nbytes} bytes of data are not all allocated in the {file_size}-byte file"
        return file_problem(path, name, what, kind="hdf5")
    return name, dtype, shape, int(offset or 0), int(offset or 0) + nbytes
