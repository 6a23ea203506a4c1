"""Where every row of a verl actor checkpoint's parameters lies (pure: a function of what the files say).

FSDP shards each parameter on dim 0 like ``torch.chunk``: ``c = ceil(rows / W)`` rows per rank,
rank R holding rows ``[R·c, min((R+1)·c, rows))`` (the last ranks short, possibly empty; FSDP2 pads
the storage of a short shard, and only the tensor's own rows are read). The full tensor is the
ranks' rows in rank order, in the saved dtype (verl keeps fp32 parameters). Tensors that are not
DTensors are whole on every rank and read from rank 0's file; two names on one storage (tied
embeddings) are written once, under the first name saved, as ``save_pretrained`` writes them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ...core.errors import InputError
from ...core.flat_pieces import FlatPiece, Param, TrainerLayout
from ...core.reports import count_of, human_bytes
from .files import VerlFiles, check_ranks
from .records import VerlEntry, VerlRank


def verl_layout(
    files: VerlFiles, ranks: Sequence[VerlRank], directory: str, sizes: Mapping[str, int] | None = None
) -> TrainerLayout:
    """The tensors of the actor checkpoint and their pieces, from every rank's records. ``sizes``: the
    directory's file sizes, for the line on what is skipped. Raises InputError naming the file and
    tensor for anything that does not add up."""
    check_ranks(files, directory)
    ranked = sorted(ranks, key=lambda r: r.rank)
    first = ranked[0]
    sharded = {e.name: e.sharded for e in first.entries}
    tied = _tied(first.entries)
    params = [Param(e.name, e.dtype, e.shape) for e in first.entries if e.name not in tied]
    pieces: list[FlatPiece] = []
    for rank in ranked:
        entries = {e.name: e for e in rank.entries}
        if list(entries) != [e.name for e in first.entries]:
            extra = sorted(set(entries) ^ {e.name for e in first.entries})
            raise InputError(
                f"{directory}/{rank.file}: holds other tensors than {first.file} "
                f"({extra[0]!r}{' and more' if len(extra) > 1 else ''}; two checkpoints mixed?)"
            )
        for param in params:
            piece = _piece(entries[param.name], param, sharded[param.name], rank, files.world_size, directory)
            if piece is not None:
                pieces.append(piece)
    skipped = [f"not a tensor: {name!r}" for name in first.skipped]
    if files.others:
        size = sum((sizes or {}).get(n, 0) for n in files.others)
        skipped.append(
            f"optimizer and extra state: {count_of(len(files.others), 'file')}"
            f"{f', {human_bytes(size)}' if size else ''} (optim_*, extra_state_*), not read"
        )
    return TrainerLayout(params, pieces, tied, skipped)


def _piece(entry: VerlEntry, param: Param, sharded: bool, rank: VerlRank, world: int, directory: str) -> FlatPiece | None:
    """Rank ``rank``'s rows of ``param`` as a flat piece (None: it holds none, or the tensor is whole and read from rank 0)."""
    where = f"{directory}/{rank.file}: tensor {param.name!r}"
    if entry.dtype != param.dtype or entry.shape != param.shape or entry.sharded != sharded:
        raise InputError(
            f"{where}: {'a sharded' if entry.sharded else 'a whole'} {entry.dtype} {list(entry.shape)} here, "
            f"{'a sharded' if sharded else 'a whole'} {param.dtype} {list(param.shape)} on rank 0"
        )
    row = math.prod(param.shape[1:])
    if not entry.sharded:
        if entry.rows != (param.shape[0] if param.shape else 1):
            raise InputError(f"{where}: a whole tensor of {entry.rows} rows, shape {list(param.shape)}")
        return FlatPiece(param.name, 0, param.numel, rank.file, entry.begin) if rank.rank == 0 and param.numel else None
    chunk = -(-param.shape[0] // world)
    rows = max(0, min(chunk, param.shape[0] - rank.rank * chunk))
    if entry.rows != rows:
        raise InputError(
            f"{where}: rank {rank.rank} holds {entry.rows} rows of {param.shape[0]}; FSDP's Shard(0) over {world} ranks "
            f"gives it {rows} (a checkpoint of another world size?)"
        )
    return FlatPiece(param.name, rank.rank * chunk * row, rows * row, rank.file, entry.begin) if rows * row else None


def _tied(entries: Sequence[VerlEntry]) -> dict[str, str]:
    """Names whose tensor is an earlier name's (one storage, same place and shape) → that name."""
    first: dict[tuple[str, int, tuple[int, ...]], str] = {}
    tied = {}
    for entry in entries:
        if entry.storage in first and min(entry.storage[2], default=1) > 0:
            tied[entry.name] = first[entry.storage]
        else:
            first.setdefault(entry.storage, entry.name)
    return tied


__all__ = ["verl_layout"]
