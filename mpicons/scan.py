"""Finding shard files and reading their headers, split over the ranks and shared.

Each rank reads the headers of every ``size``-th file and turns them into a compact
columnar :class:`PieceTable`; the tables are allgathered and merged, so every header
is read once however many ranks there are and every rank ends up with the same table.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from mpi4py import MPI

from .errors import InputError
from .format import DTYPE_ORDER, DTYPES, MAX_DIM, read_header
from .parallel import Comm, agree

#: ``shard-RRRRR-model-IIIII-of-NNNNN.safetensors`` as written by torch's HuggingFaceStorageWriter.
DCP_SHARD_NAME = re.compile(r"^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")
SHARDING_KEY = "DCP_SHARDING_INFO"
#: Largest training rank, file index or file count a shard name may carry (numbers are stored as int32).
MAX_SHARD_NUMBER = 2**31 - 1


@dataclass
class PieceTable:
    """Every piece of every tensor in the checkpoint, one row per piece (numpy columns).

    Shapes and offsets are padded with trailing 1s / 0s to ``ndim_max`` columns, which leaves
    the C-order layout unchanged; ``piece_ndim`` keeps the true rank.
    """

    files: list[str]
    file_size: np.ndarray  # int64[F]
    file_data_start: np.ndarray  # int64[F]
    file_out_index: np.ndarray  # int32[F], -1 when the name is not a DCP shard name
    file_out_count: np.ndarray  # int32[F]
    file_is_dcp: np.ndarray  # bool[F], header carries DCP_SHARDING_INFO
    names: list[str]
    piece_file: np.ndarray  # int32[P]
    piece_tensor: np.ndarray  # int32[P]
    piece_dtype: np.ndarray  # int8[P], index into format.DTYPES
    piece_ndim: np.ndarray  # int8[P]
    piece_shape: np.ndarray  # int64[P, D]
    piece_offset: np.ndarray  # int64[P, D]
    piece_begin: np.ndarray  # int64[P], absolute byte offset in its file
    #: This rank's input directory (``{rank}`` resolved).
    directory: str = ""
    #: Ranks that can read each file; None when every rank can (a shared filesystem).
    holders: list[np.ndarray] | None = None

    @property
    def num_pieces(self) -> int:
        return len(self.piece_file)


def list_shards(input_dir: str, allow_empty: bool = False) -> list[str]:
    """The ``*.safetensors`` files directly in ``input_dir``, sorted by name."""
    if not os.path.isdir(input_dir):
        raise InputError(f"{input_dir}: input directory does not exist or is not a directory")
    try:
        names = sorted(
            entry.name
            for entry in os.scandir(input_dir)
            if entry.name.endswith(".safetensors") and not entry.name.startswith(".") and entry.is_file()
        )
    except OSError as exc:
        raise InputError(f"{input_dir}: cannot list input directory ({exc.strerror})") from None
    if not names and not allow_empty:
        raise InputError(f"{input_dir}: no *.safetensors files found")
    return names


def _sharding_info(path: str, metadata: dict[str, str]) -> dict[str, list[int]] | None:
    text = metadata.get(SHARDING_KEY)
    if text is None:
        return None
    try:
        info = json.loads(text)
    except (ValueError, RecursionError):  # ValueError also covers ints past Python's digit limit
        raise InputError(f"{path}: {SHARDING_KEY} is not valid JSON") from None
    if not isinstance(info, dict):
        raise InputError(f"{path}: {SHARDING_KEY} is not a JSON object")
    offsets: dict[str, list[int]] = {}
    for name, entry in info.items():
        saved = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if not isinstance(saved, list) or not all(type(o) is int and 0 <= o < MAX_DIM for o in saved):
            raise InputError(
                f"{path}: {SHARDING_KEY} entry for tensor {name!r} has invalid saved_offsets {saved!r} "
                "(expected a list of non-negative integers)"
            )
        offsets[name] = saved
    return offsets


def read_table(input_dir: str, files: Sequence[str]) -> PieceTable:
    """Read the headers of ``files`` (names inside ``input_dir``) into a PieceTable."""
    names: list[str] = []
    name_ids: dict[str, int] = {}
    sizes, starts, out_index, out_count, is_dcp = [], [], [], [], []
    p_file, p_tensor, p_dtype, p_shape, p_offset, p_begin = [], [], [], [], [], []
    for file_id, file_name in enumerate(files):
        path = os.path.join(input_dir, file_name)
        try:
            header = read_header(path)
        except OSError as exc:
            raise InputError(f"{path}: cannot read ({exc.strerror})") from None
        match = DCP_SHARD_NAME.match(file_name)
        if match and max(int(part) for part in match.groups()) > MAX_SHARD_NUMBER:
            raise InputError(f"{path}: the numbers in this shard name are out of range (at most {MAX_SHARD_NUMBER})")
        info = _sharding_info(path, header.metadata)
        if match and info is None:
            raise InputError(f"{path}: named like a DCP shard but its header has no {SHARDING_KEY}")
        sizes.append(header.file_size)
        starts.append(header.data_start)
        out_index.append(int(match.group(2)) if match else -1)
        out_count.append(int(match.group(3)) if match else -1)
        is_dcp.append(info is not None)
        for entry in header.tensors:
            if info is None:
                offsets = [0] * len(entry.shape)
            else:
                offsets = info.get(entry.name)
                if offsets is None:
                    raise InputError(f"{path}: tensor {entry.name!r} is missing from {SHARDING_KEY}")
                if len(offsets) != len(entry.shape):
                    raise InputError(
                        f"{path}: tensor {entry.name!r} has {len(entry.shape)} dimensions but "
                        f"saved_offsets {offsets} has {len(offsets)}"
                    )
                if any(o + d >= MAX_DIM for o, d in zip(offsets, entry.shape)):
                    raise InputError(
                        f"{path}: tensor {entry.name!r}: saved_offsets {offsets} with shape {list(entry.shape)} "
                        "reach past 2**63 elements"
                    )
            tensor_id = name_ids.get(entry.name)
            if tensor_id is None:
                tensor_id = name_ids[entry.name] = len(names)
                names.append(entry.name)
            p_file.append(file_id)
            p_tensor.append(tensor_id)
            p_dtype.append(DTYPE_ORDER[entry.dtype])
            p_shape.append(entry.shape)
            p_offset.append(offsets)
            p_begin.append(header.data_start + entry.begin)
        if info is not None:
            extra = set(info) - {entry.name for entry in header.tensors}
            if extra:
                raise InputError(f"{path}: {SHARDING_KEY} names tensor {sorted(extra)[0]!r} that the file does not hold")
    ndims = np.array([len(s) for s in p_shape], dtype=np.int8)
    width = max(1, int(ndims.max(initial=0)))
    # Pad to a common width (trailing 1s / 0s keep the C-order layout); numpy converts the lists in C.
    shape = np.array([(*s, *(1,) * (width - len(s))) for s in p_shape], dtype=np.int64).reshape(-1, width)
    offset = np.array([(*o, *(0,) * (width - len(o))) for o in p_offset], dtype=np.int64).reshape(-1, width)
    return PieceTable(
        files=list(files),
        file_size=np.array(sizes, dtype=np.int64),
        file_data_start=np.array(starts, dtype=np.int64),
        file_out_index=np.array(out_index, dtype=np.int32),
        file_out_count=np.array(out_count, dtype=np.int32),
        file_is_dcp=np.array(is_dcp, dtype=bool),
        names=names,
        piece_file=np.array(p_file, dtype=np.int32),
        piece_tensor=np.array(p_tensor, dtype=np.int32),
        piece_dtype=np.array(p_dtype, dtype=np.int8),
        piece_ndim=ndims,
        piece_shape=shape,
        piece_offset=offset,
        piece_begin=np.array(p_begin, dtype=np.int64),
    )


def _pad(columns: np.ndarray, width: int, fill: int) -> np.ndarray:
    if columns.shape[1] == width:
        return columns
    padded = np.full((columns.shape[0], width), fill, dtype=np.int64)
    padded[:, : columns.shape[1]] = columns
    return padded


def merge_tables(parts: Sequence[PieceTable]) -> PieceTable:
    """Concatenate per-rank tables into one, renumbering files and tensor names (pure)."""
    names: list[str] = []
    name_ids: dict[str, int] = {}
    width = max(part.piece_shape.shape[1] for part in parts)
    remapped, file_base = [], 0
    for part in parts:
        lookup = np.array([name_ids.setdefault(n, len(name_ids)) for n in part.names], dtype=np.int32)
        remapped.append((lookup[part.piece_tensor] if len(part.names) else part.piece_tensor, file_base))
        file_base += len(part.files)
    names = list(name_ids)
    cat = np.concatenate
    return PieceTable(
        files=[f for part in parts for f in part.files],
        file_size=cat([p.file_size for p in parts]),
        file_data_start=cat([p.file_data_start for p in parts]),
        file_out_index=cat([p.file_out_index for p in parts]),
        file_out_count=cat([p.file_out_count for p in parts]),
        file_is_dcp=cat([p.file_is_dcp for p in parts]),
        names=names,
        piece_file=cat([p.piece_file + base for p, (_, base) in zip(parts, remapped)]).astype(np.int32),
        piece_tensor=cat([ids for ids, _ in remapped]).astype(np.int32),
        piece_dtype=cat([p.piece_dtype for p in parts]),
        piece_ndim=cat([p.piece_ndim for p in parts]),
        piece_shape=cat([_pad(p.piece_shape, width, 1) for p in parts]),
        piece_offset=cat([_pad(p.piece_offset, width, 0) for p in parts]),
        piece_begin=cat([p.piece_begin for p in parts]),
    )


def rank_directory(input_dir: str, rank: int) -> str:
    """``input_dir`` with ``{rank}`` replaced: each rank's own directory of node-local shards."""
    return input_dir.replace("{rank}", str(rank))


def _listing(directory: str) -> tuple[list[str], list[int]]:
    names = list_shards(directory, allow_empty=True)
    return names, [os.path.getsize(os.path.join(directory, n)) for n in names]


def discover(input_dir: str, comm: Comm) -> tuple[list[str], list[np.ndarray] | None]:
    """Every shard file name, and which ranks can read each (None: all of them).

    Each rank looks at its own directory (one lister per node unless ``{rank}`` is in the path), so
    node-local disks are seen as they are; the same name and size on several ranks is one file.
    """
    directory = rank_directory(input_dir, comm.rank)
    per_rank = "{rank}" in input_dir
    node = comm.Split_type(MPI.COMM_TYPE_SHARED) if not per_rank else None
    try:
        if node is None:
            listing = agree(comm, lambda: _listing(directory))
        else:
            listing = agree(comm, lambda: _listing(directory) if node.rank == 0 else None)
            listing = node.bcast(listing, root=0)
    finally:
        if node is not None:
            node.Free()
    digest = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
    if len(set(comm.allgather(digest))) == 1:
        agree(comm, lambda: _nonempty(listing[0], directory))
        return listing[0], None
    listings = comm.allgather(listing)
    return agree(comm, lambda: _holders(input_dir, listings))


def _nonempty(names: list[str], directory: str) -> None:
    if not names:
        raise InputError(f"{directory}: no *.safetensors files found")


def _holders(input_dir: str, listings: list[tuple[list[str], list[int]]]) -> tuple[list[str], list[np.ndarray]]:
    """Merge every rank's listing: one file per name, seen by the ranks that list it (sizes must agree)."""
    sizes: dict[str, dict[int, list[int]]] = {}
    for rank, (names, file_sizes) in enumerate(listings):
        for name, size in zip(names, file_sizes):
            sizes.setdefault(name, {}).setdefault(size, []).append(rank)
    files = sorted(sizes)
    if not files:
        raise InputError(f"{input_dir}: no *.safetensors files found on any rank")
    for name in files:
        if len(sizes[name]) > 1:
            variants = "; ".join(f"{size} bytes on ranks {ranks}" for size, ranks in sorted(sizes[name].items()))
            raise InputError(f"{name}: ranks see different files under this name ({variants})")
    return files, [np.array(next(iter(sizes[name].values())), dtype=np.int32) for name in files]


def _assign_readers(holders: list[np.ndarray], ranks: int) -> list[int]:
    """One reading rank per file among those that see it, balancing the number of files."""
    count = np.zeros(ranks, dtype=np.int64)
    readers = []
    for candidates in holders:
        reader = int(candidates[np.argmin(count[candidates])])
        count[reader] += 1
        readers.append(reader)
    return readers


def scan(input_dir: str, comm: Comm) -> PieceTable:
    """Find the shards and read every header once, split over ``comm``; same table on every rank."""
    files, holders = discover(input_dir, comm)
    if holders is None:
        readers = [i % comm.size for i in range(len(files))]
    else:
        readers = _assign_readers(holders, comm.size)
    mine = [name for name, reader in zip(files, readers) if reader == comm.rank]
    directory = rank_directory(input_dir, comm.rank)
    local = agree(comm, lambda: read_table(directory, mine), gather=True)
    table = merge_tables(local)
    # The merged table lists files rank by rank: renumber so file id i is files[i] on every rank.
    position = {name: i for i, name in enumerate(files)}
    table = _reorder_files(table, [position[name] for name in table.files])
    table.directory = directory
    table.holders = holders
    return table


def _reorder_files(table: PieceTable, order: list[int]) -> PieceTable:
    """Renumber files so that file id i is ``sorted(files)[i]`` (order[j] = sorted index of file j)."""
    position = np.array(order, dtype=np.int64)
    inverse = np.empty_like(position)
    inverse[position] = np.arange(len(position))
    table.files = [table.files[j] for j in inverse]
    for name in ("file_size", "file_data_start", "file_out_index", "file_out_count", "file_is_dcp"):
        setattr(table, name, getattr(table, name)[inverse])
    table.piece_file = position[table.piece_file].astype(np.int32)
    return table


__all__ = ["PieceTable", "list_shards", "read_table", "merge_tables", "scan", "DTYPES"]
