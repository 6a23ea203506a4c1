"""Work assignment when shard files are not visible to every rank (pure: no MPI, no I/O).

With node-local shards only some ranks can read a given file (``holders``). Work then has two
kinds, both identical on every rank:

- *direct* pieces: a piece that lands contiguously in a shared output is copied in place by one of
  its holders, balanced by bytes; no data crosses MPI.
- *blocks*: blocks of rows of the other tensors (column-/2-D-sharded, converted, or everything when
  the output is gathered on one rank) are assembled by a writer rank from *portions* (rows of one
  piece) read by holders and sent to the writer over MPI when the writer cannot read them itself.

Blocks are numbered globally; every rank handles the blocks it takes part in, in that order, so the
messages between any two ranks arrive in the order both expect.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InputError
from .plan import Plan


@dataclass
class Routes:
    """Who reads and who writes what; identical on every rank."""

    ranks: int
    direct_piece: np.ndarray  # int64[D], index into the plan's piece arrays
    direct_rank: np.ndarray  # int32[D]
    block_tensor: np.ndarray  # int32[B]
    block_rows: np.ndarray  # int64[B, 2]: [row_begin, row_end)
    block_writer: np.ndarray  # int32[B]
    portion_start: np.ndarray  # int64[B + 1]: block b owns portions portion_start[b]:portion_start[b+1]
    portion_piece: np.ndarray  # int64[Q]
    portion_rows: np.ndarray  # int64[Q, 2]: rows of the tensor, within the piece and the block
    portion_reader: np.ndarray  # int32[Q]
    portion_bytes: np.ndarray  # int64[Q], bytes of each portion in the shard
    written: np.ndarray  # int64[ranks], output bytes each rank writes

    @property
    def moved_bytes(self) -> int:
        """Bytes that cross MPI (portions read by a rank other than their block's writer)."""
        writer = np.repeat(self.block_writer, np.diff(self.portion_start))
        return int(self.portion_bytes[self.portion_reader != writer].sum())


def _least_loaded(load: np.ndarray, candidates: np.ndarray) -> int:
    return int(candidates[np.argmin(load[candidates])])


def route(
    plan: Plan,
    holders: list[np.ndarray] | None,
    ranks: int,
    block_bytes: int,
    gather_to: int | None = None,
) -> Routes:
    """Assign reads to ranks that can see the files and writes to ranks, balanced by bytes.

    ``holders[f]`` lists the ranks that can read source file ``f`` (None: every rank can);
    ``gather_to`` makes that rank write everything (output on its local disk).
    """
    everyone = np.arange(ranks, dtype=np.int32)
    if gather_to is not None and not 0 <= gather_to < ranks:
        raise InputError(f"--gather-to {gather_to}: no such rank (the job has {ranks})")
    if holders is not None:
        blind = [plan.source_files[f] for f in np.unique(plan.piece_file) if len(holders[f]) == 0]
        if blind:
            raise InputError(f"{blind[0]}: no rank can read this shard file")
    holder_of = (lambda f: everyone) if holders is None else (lambda f: holders[f])
    write_load = np.zeros(ranks, dtype=np.int64)
    read_load = np.zeros(ranks, dtype=np.int64)
    direct_piece, direct_rank = [], []
    block_tensor, block_rows, block_writer = [], [], []
    portion_start = [0]
    portion_piece, portion_rows, portion_reader, portion_bytes = [], [], [], []
    order = sorted(range(len(plan.tensors)), key=lambda t: (plan.tensors[t].file, plan.tensors[t].offset))
    for t in order:
        tensor = plan.tensors[t]
        if tensor.nbytes == 0:
            continue
        lo, hi = int(plan.piece_start[t]), int(plan.piece_start[t + 1])
        shape, offset = plan.piece_shape[lo:hi], plan.piece_offset[lo:hi]
        row_elements = int(np.prod(tensor.storage[1:], dtype=np.int64))
        piece_row_bytes = np.prod(shape[:, 1:], axis=1) * tensor.source_unit
        full_width = bool(np.all(shape[:, 1:] == np.asarray(tensor.storage[1:])))
        if full_width and tensor.source_dtype == tensor.dtype and gather_to is None:
            for i in range(hi - lo):
                rank = _least_loaded(write_load, holder_of(int(plan.piece_file[lo + i])))
                write_load[rank] += int(shape[i, 0]) * row_elements * tensor.unit
                direct_piece.append(lo + i)
                direct_rank.append(rank)
            continue
        rows_per_block = max(1, block_bytes // (row_elements * max(tensor.unit, tensor.source_unit)))
        for row_begin in range(0, tensor.rows, rows_per_block):
            row_end = min(tensor.rows, row_begin + rows_per_block)
            writer = gather_to if gather_to is not None else int(np.argmin(write_load))
            write_load[writer] += (row_end - row_begin) * row_elements * tensor.unit
            first = np.maximum(offset[:, 0], row_begin)
            last = np.minimum(offset[:, 0] + shape[:, 0], row_end)
            for i in np.nonzero(last > first)[0]:
                piece = lo + int(i)
                readers = holder_of(int(plan.piece_file[piece]))
                reader = writer if writer in readers else _least_loaded(read_load, readers)
                size = int(last[i] - first[i]) * int(piece_row_bytes[i])
                read_load[reader] += size
                portion_piece.append(piece)
                portion_rows.append((int(first[i]), int(last[i])))
                portion_reader.append(reader)
                portion_bytes.append(size)
            block_tensor.append(t)
            block_rows.append((row_begin, row_end))
            block_writer.append(writer)
            portion_start.append(len(portion_piece))
    return Routes(
        ranks=ranks,
        direct_piece=np.array(direct_piece, dtype=np.int64),
        direct_rank=np.array(direct_rank, dtype=np.int32),
        block_tensor=np.array(block_tensor, dtype=np.int32),
        block_rows=np.array(block_rows, dtype=np.int64).reshape(-1, 2),
        block_writer=np.array(block_writer, dtype=np.int32),
        portion_start=np.array(portion_start, dtype=np.int64),
        portion_piece=np.array(portion_piece, dtype=np.int64),
        portion_rows=np.array(portion_rows, dtype=np.int64).reshape(-1, 2),
        portion_reader=np.array(portion_reader, dtype=np.int32),
        portion_bytes=np.array(portion_bytes, dtype=np.int64),
        written=write_load,
    )
