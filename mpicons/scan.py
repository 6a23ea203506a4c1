"""Finding shard files and reading their headers, split over the ranks and shared.

Each rank reads the headers of every ``size``-th file and turns them into a compact
columnar :class:`PieceTable`; the tables are allgathered and merged, so every header
is read once however many ranks there are and every rank ends up with the same table.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import InputError
from .format import DTYPE_ORDER, DTYPES, read_header
from .parallel import Comm, agree

#: ``shard-RRRRR-model-IIIII-of-NNNNN.safetensors`` as written by torch's HuggingFaceStorageWriter.
DCP_SHARD_NAME = re.compile(r"^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")
SHARDING_KEY = "DCP_SHARDING_INFO"


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

    @property
    def num_pieces(self) -> int:
        return len(self.piece_file)


def list_shards(input_dir: str) -> list[str]:
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
    if not names:
        raise InputError(f"{input_dir}: no *.safetensors files found")
    return names


def _sharding_info(path: str, metadata: dict[str, str]) -> dict[str, list[int]] | None:
    text = metadata.get(SHARDING_KEY)
    if text is None:
        return None
    try:
        info = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise InputError(f"{path}: {SHARDING_KEY} is not valid JSON") from None
    if not isinstance(info, dict):
        raise InputError(f"{path}: {SHARDING_KEY} is not a JSON object")
    offsets: dict[str, list[int]] = {}
    for name, entry in info.items():
        saved = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if not isinstance(saved, list) or not all(type(o) is int and o >= 0 for o in saved):
            raise InputError(f"{path}: {SHARDING_KEY} entry for tensor {name!r} has no valid saved_offsets")
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
    shape = np.ones((len(p_shape), width), dtype=np.int64)
    offset = np.zeros((len(p_shape), width), dtype=np.int64)
    for row, (s, o) in enumerate(zip(p_shape, p_offset)):
        shape[row, : len(s)] = s
        offset[row, : len(o)] = o
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


def scan(input_dir: str, comm: Comm) -> PieceTable:
    """List the shards and read every header once, split over ``comm``; same table on every rank."""
    files = agree(comm, lambda: list_shards(input_dir) if comm.rank == 0 else None, root=0)
    mine = files[comm.rank :: comm.size]
    local = agree(comm, lambda: read_table(input_dir, mine), gather=True)
    # Rank r read files r, r+size, ...: restore the sorted file order so file ids match on every rank.
    table = merge_tables(local)
    order = [i for r in range(comm.size) for i in range(r, len(files), comm.size)]
    return _reorder_files(table, order)


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
