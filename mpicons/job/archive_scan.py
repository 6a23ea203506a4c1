"""The scan of a checkpoint saved as per-rank ``torch.save`` archives (DeepSpeed ZeRO, verl): the
archives' records read split over the ranks, the trainer's layout made from them, and each rank's
share of the pieces, as :mod:`.scan` makes them of shard headers.

Each file is read by one rank (its central directory and ``data.pkl``, a few small reads; never a
storage); the records are small and every rank receives all of them, so the layout (pure: the
trainer's leaf) is the same everywhere. Each rank then keeps the pieces of the files it read: a
piece is a byte range of a ``.pt`` file, read by the engine like a piece of a shard file.
"""

from __future__ import annotations

import numpy as np

from ..comm.agreement import Comm, agree, agree_on
from ..core.facts import piece_destinations
from ..core.flat_pieces import TrainerLayout, as_pieces
from ..core.safetensors_codec import DTYPE_ORDER
from ..core.table import shard_files, to_storage_units
from ..formats.unpickling import NOTHING, AllowList
from ..io.inputs import InputStore
from ..trainers.base import ArchiveFormat
from .scan import Scanned, open_store, reduce_facts, release_memory, scan

#: The ``source_format`` of such a scan's files (they name no output file: sharded as ``save_pretrained`` does).
TORCH_SAVE = "torch.save"
#: The files of such a checkpoint's directory the scan lists: the archives and the JSON beside them (verl's config).
ARCHIVE_SUFFIXES = (".pt", ".json")


def _read_records(store: InputStore, archives: ArchiveFormat, names: list[str], sizes: dict[str, int]) -> list[object]:
    records = []
    for name in names:
        source = store.open(name, sizes[name])
        try:
            records.append(archives.read(source, name))
        finally:
            source.close()
    return records


def _notes(layout: TrainerLayout, title: str) -> list[str]:
    """What the report says of the layout: what was skipped, the tied names written once."""
    notes = [f"{title}: skipped {line}" for line in layout.skipped]
    for alias, source in sorted(layout.tied.items()):
        notes.append(f"{title}: {alias!r} is tied to {source!r}: written once, as {source!r} (as save_pretrained does)")
    return notes


def scan_archives(store: InputStore, comm: Comm, archives: ArchiveFormat, listing: bool = False) -> Scanned:
    """The scan of the archives in ``store``'s directory (of a shared filesystem, or an ``s3://`` prefix):
    records read split over ``comm``, the layout made on every rank, each rank holding the pieces of the
    files it read."""
    directory = store.location
    names, sizes = agree_on(comm, 0, lambda: store.list_suffixed(ARCHIVE_SUFFIXES))
    size_of = dict(zip(names, sizes))
    wanted = agree(comm, lambda: archives.wanted(names, directory))
    mine = wanted[comm.rank :: comm.size]
    local = agree(comm, lambda: _read_records(store, archives, mine, size_of))
    records = [record for part in comm.allgather(local) for record in part]
    layout = agree(comm, lambda: archives.layout(names, records, size_of, directory))
    del local
    files_read = sorted({piece.file for piece in layout.pieces})
    files = shard_files(files_read, [size_of[n] for n in files_read], None)
    files.source_format = TORCH_SAVE
    tensor_names = sorted(param.name for param in layout.params)
    reader = {name: i % comm.size for i, name in enumerate(files_read)}
    my_layout = TrainerLayout(layout.params, [p for p in layout.pieces if reader[p.file] == comm.rank])
    pieces = as_pieces(my_layout, tensor_names, files_read, comm.rank)
    width = pieces.width
    misaligned = to_storage_units(pieces)
    facts = reduce_facts(comm, pieces, len(tensor_names), width, piece_destinations(files), misaligned)
    params = {param.name: param for param in layout.params}
    declared = np.ones((len(tensor_names), width), dtype=np.int64)
    for t, name in enumerate(tensor_names):
        declared[t, : len(params[name].shape)] = params[name].shape
    never = np.flatnonzero(facts.count == 0)  # tensors with no element: their dtype and rank from the layout
    facts.dtype_first[never] = [DTYPE_ORDER[params[tensor_names[t]].dtype] for t in never]
    facts.ndim_first[never] = [len(params[tensor_names[t]].shape) for t in never]
    facts.dest_first[never] = 0
    facts.declared = declared
    saved = {param.name: i for i, param in enumerate(layout.params)}
    order = np.array([saved[name] for name in tensor_names], dtype=np.int64)
    release_memory()
    notes = _notes(layout, archives.title)
    return Scanned(directory, files, tensor_names, pieces, facts, order=order, listing=listing, inputs=store, notes=notes)


def scan_input(
    input_dir: str,
    comm: Comm,
    archives: ArchiveFormat | None,
    listing: bool = False,
    endpoint: str | None = None,
    store: InputStore | None = None,
    allow: AllowList = NOTHING,
) -> Scanned:
    """The scan of ``input_dir``: its archives when a trainer reads it as such (``archives``), else its
    shard headers or DCP metadata (:func:`~mpicons.job.scan.scan`, with the other arguments)."""
    if archives is None:
        return scan(input_dir, comm, listing=listing, endpoint=endpoint, store=store, allow=allow)
    return scan_archives(store if store is not None else open_store(comm, input_dir, endpoint), comm, archives, listing)


__all__ = ["TORCH_SAVE", "scan_archives", "scan_input"]
