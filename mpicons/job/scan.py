"""Finding the shard files and reading their headers split over the ranks.

Each header is read once, by one rank that can see the file. What the layout needs is per tensor
and is combined with a few Allreduce calls (:class:`~mpicons.core.facts.TensorFacts`); the pieces stay
where they were read until the layout says which rank owns which rows, then one Alltoallv
(:func:`exchange`, called by :func:`~mpicons.job.shares.distribute`) moves each piece to the ranks
whose rows it crosses. No rank ever holds the whole piece table.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..adaptation.apply import Conversion
from ..comm.agreement import Comm, agree, agree_on
from ..core.errors import InputError
from ..core.facts import FACT_KEY, TensorFacts, local_facts, local_odd, piece_destinations, set_odd
from ..core.machine import host_name
from ..core.names import DATA_SUFFIX, METADATA_NAME, nested_hint
from ..core.reports import count_of
from ..core.safetensors_codec import DTYPES
from ..core.table import Pieces, ShardFiles, dense_strides, shard_files, to_storage_units
from ..formats.distcp_items import Item, locate_all
from ..formats.distcp_metadata import DistcpTable, read_metadata
from ..formats.shard_headers import list_shards, read_headers, relabel
from ..formats.unpickling import NOTHING, AllowList
from ..io.inputs import InputStore, PosixInputs, open_inputs, rank_directory
from ..io.journal import describe_names
from ..io.s3 import is_s3
from ..io.sources import SourceFiles
from .rank_directories import check_rank_directories

#: Largest message per destination in one round of the piece exchange (MPI counts are C ints).
EXCHANGE_LIMIT = 1 << 29


@dataclass
class Scanned:
    """What the scan found: the files and tensors (the same on every rank), this rank's pieces, the facts."""

    directory: str  # this rank's input directory ({rank} resolved), or the s3:// URL
    files: ShardFiles
    names: list[str]
    pieces: Pieces  # the pieces of the headers this rank read, storage units
    facts: TensorFacts
    #: Entries that are not tensors (DCP's non-tensor items: step counters, loader state), skipped.
    skipped: list[str] = field(default_factory=list)
    #: Per tensor, its position in the state dict as saved, when the checkpoint records it (``.distcp``).
    order: np.ndarray | None = None
    #: Tensors whose ``.distcp`` pieces cannot be read (left out of ``pieces``): name → the first problem.
    unreadable: dict[str, str] = field(default_factory=dict)
    #: Whether ``unreadable`` is listed (``inspect``) rather than refused by :func:`select`.
    listing: bool = False
    #: A model adapter's conversion, when one was applied (names and pieces are then the outputs').
    conversion: Conversion | None = None
    #: Where the files are read from (:func:`open_sources`); None: the directory ``directory``.
    inputs: InputStore | None = None
    #: What the report says of the input beyond its tensors (a trainer's state skipped, tied names).
    notes: list[str] = field(default_factory=list)

    @property
    def shared(self) -> bool:
        return self.files.holders is None


def open_store(comm: Comm, input_dir: str, endpoint: str | None = None) -> InputStore:
    """This rank's store of ``input_dir``: its directory ({rank} resolved), or the ``s3://`` location.

    For S3, every rank makes its client and rank 0 checks that the bucket can be read, in agreed
    steps: wrong credentials, a missing bucket or an unreachable endpoint are bad input on every
    rank before any work. ``endpoint``: the S3 API's (``--s3-endpoint``), else boto3's own variables.
    """
    if not is_s3(input_dir):
        return PosixInputs(rank_directory(input_dir, comm.rank))

    def make() -> InputStore:
        if "{rank}" in input_dir:
            raise InputError(
                f"{input_dir}: {{rank}} names each rank's own directory of node-local shards; every rank reads "
                "an s3:// location alike: give it without {rank}"
            )
        return open_inputs(input_dir, endpoint)

    store = agree(comm, make)
    agree_on(comm, 0, store.check_access)
    return store


def shapes_and_dtypes(scanned: Scanned) -> tuple[list[tuple[int, ...]], list[str]]:
    """Each tensor's full shape and dtype as the facts say (``""``: a tensor with no stored piece)."""
    facts = scanned.facts
    ndim = (facts.ndim_first % FACT_KEY).astype(np.int64)
    codes = (facts.dtype_first % FACT_KEY).astype(np.int64)
    full = facts.extent if facts.declared is None else facts.declared
    shapes = [tuple(int(x) for x in full[t][: ndim[t]]) for t in range(len(scanned.names))]
    # A tensor with no stored piece has no dtype (its key is the MIN's start): "" never equals a partner's.
    return shapes, [DTYPES[int(c)].name if n else "" for c, n in zip(codes, facts.count)]


def open_sources(scanned: Scanned) -> SourceFiles:
    """The engine's source files of a scan (its files by their ids), from wherever the scan read them."""
    inputs = scanned.inputs if scanned.inputs is not None else PosixInputs(scanned.directory)
    return inputs.sources(scanned.files.names)


def _inputs_of(
    input_dir: str, names: list[str], sizes: list[int], holders: list[np.ndarray] | None, nested: Sequence[str] = ()
) -> tuple[list[str], list[int], list[np.ndarray] | None]:
    """The files of the checkpoint: with ``.metadata``, it and the ``.distcp`` files; else the ``.safetensors`` files.

    ``nested``: the subdirectories that hold input files, named in the message when the directory itself holds none.
    """
    distcp = METADATA_NAME in names
    keep = [i for i, n in enumerate(names) if (n == METADATA_NAME or n.endswith(DATA_SUFFIX)) == distcp]
    safetensors = [n for n in names if n.endswith(".safetensors")]
    if distcp and safetensors and not any(n.endswith(DATA_SUFFIX) for n in names):
        raise InputError(
            f"{input_dir}: holds a {METADATA_NAME} (DCP's default format, whose data is in .distcp files) beside "
            f"{count_of(len(safetensors), 'safetensors file')} ({describe_names(safetensors)}) and no .distcp file. "
            f"A {METADATA_NAME} makes the directory DCP's default format, so the safetensors files are not read: if they "
            f"are the checkpoint (DCP's Hugging Face layout writes no {METADATA_NAME}), move the {METADATA_NAME} out of "
            "the directory; if not, the .distcp files are missing (was the checkpoint copied in part?)"
        )
    if not keep:
        if any(n.endswith(DATA_SUFFIX) for n in names):
            raise InputError(
                f"{input_dir}: holds .distcp data files but no {METADATA_NAME} (DCP writes it last: was the save interrupted?)"
            )
        where = "" if holders is None else " on any rank"
        raise InputError(f"{input_dir}: no *.safetensors files found{where}{nested_hint(input_dir, nested)}")
    return [names[i] for i in keep], [sizes[i] for i in keep], None if holders is None else [holders[i] for i in keep]


def _listing(store: InputStore) -> tuple[list[str], list[int], list[str]]:
    """The store's input files and sizes, and when there are none, the subdirectories that hold some."""
    names, sizes = store.list()
    return names, sizes, [] if names else store.nested()


def discover(input_dir: str, comm: Comm, store: InputStore | None = None) -> tuple[list[str], list[int], list[np.ndarray] | None]:
    """Every shard file name and size, and which ranks can read each (None: all of them).

    One rank per host lists the directory (every rank when ``{rank}`` is in the path), so node-local
    disks are seen as they are; the same name and size on several ranks is one file. When every
    listing is the same (a shared filesystem), only digests cross the network and rank 0's listing.
    A shared store (``s3://``) is listed by rank 0 alone.
    """
    store = store if store is not None else PosixInputs(rank_directory(input_dir, comm.rank))
    directory = store.location
    if store.shared:
        names, sizes, nested = agree_on(comm, 0, lambda: _listing(store))
        return agree(comm, lambda: _inputs_of(directory, names, sizes, None, nested))
    hosts = comm.allgather(host_name())
    per_rank = "{rank}" in input_dir
    if per_rank:
        check_rank_directories(comm, input_dir, hosts)
    leader = [r if per_rank else hosts.index(hosts[r]) for r in range(comm.size)]
    listing = agree(comm, lambda: _listing(store) if leader[comm.rank] == comm.rank else None)
    digest = None if listing is None else hashlib.sha256(json.dumps(listing).encode()).hexdigest()
    digests = comm.allgather(digest)
    if len({d for d in digests if d is not None}) == 1:
        names, sizes, nested = comm.bcast(listing, root=0)
        return agree(comm, lambda: _inputs_of(directory, names, sizes, None, nested))
    listings = comm.allgather(listing)
    nested = sorted({name for found in listings if found is not None for name in found[2]})
    files, sizes, holders = agree(comm, lambda: _holders(input_dir, [listings[leader[r]][:2] for r in range(comm.size)]))
    return agree(comm, lambda: _inputs_of(input_dir, files, sizes, holders, nested))


def _holders(input_dir: str, listings: list[tuple[list[str], list[int]]]) -> tuple[list[str], list[int], list[np.ndarray]]:
    """Merge every rank's listing: one file per name, seen by the ranks that list it (sizes must agree)."""
    sizes: dict[str, dict[int, list[int]]] = {}
    for rank, (names, file_sizes) in enumerate(listings):
        for name, size in zip(names, file_sizes):
            sizes.setdefault(name, {}).setdefault(size, []).append(rank)
    files = sorted(sizes)
    for name in files:
        if len(sizes[name]) > 1:
            variants = "; ".join(f"{size} bytes on ranks {ranks}" for size, ranks in sorted(sizes[name].items()))
            raise InputError(f"{name}: ranks see different files under this name ({variants})")
    return files, [next(iter(sizes[n])) for n in files], [np.array(next(iter(sizes[n].values())), dtype=np.int32) for n in files]


def assign_readers(holders: list[np.ndarray] | None, files: int, ranks: int) -> np.ndarray:
    """One reading rank per file among those that see it, balancing the number of files."""
    if holders is None:
        return np.arange(files, dtype=np.int32) % ranks
    count = np.zeros(ranks, dtype=np.int64)
    readers = np.empty(files, dtype=np.int32)
    for f, candidates in enumerate(holders):
        reader = int(candidates[np.argmin(count[candidates])])
        count[reader] += 1
        readers[f] = reader
    return readers


def _union(a: list[str], b: list[str]) -> list[str]:
    return sorted(set(a) | set(b))


def scan(
    input_dir: str,
    comm: Comm,
    listing: bool = False,
    endpoint: str | None = None,
    store: InputStore | None = None,
    allow: AllowList = NOTHING,
) -> Scanned:
    """Find the shards and read every header once, split over ``comm``; the facts are the same on every rank.

    ``input_dir``: a directory (``{rank}`` in it: each rank's own) or an ``s3://bucket/prefix``
    (``endpoint``: the S3 API's; ``store``: the location already opened by :func:`open_store`).
    ``.distcp`` pieces that cannot be read are left out and their tensors kept in ``unreadable``:
    :func:`select` refuses those it keeps, all named at once, unless ``listing`` (``inspect``).
    ``allow``: the classes a trainer adds to ``.metadata`` (its leaf's allow-list), read as inert records.
    """
    store = store if store is not None else open_store(comm, input_dir, endpoint)
    names, sizes, holders = discover(input_dir, comm, store)
    if METADATA_NAME in names:
        return _scan_distcp(store, comm, names, sizes, holders, listing, allow)
    files = shard_files(names, sizes, holders)
    readers = assign_readers(holders, len(names), comm.size)
    mine = np.flatnonzero(readers == comm.rank)
    directory = store.location
    size_of = dict(zip(names, sizes))
    local = agree(
        comm,
        lambda: read_headers(lambda name: store.open(name, size_of[name]), [names[f] for f in mine], mine.tolist(), comm.rank),
    )
    # Per-file facts (data start, DCP flag) from their readers: one small Allreduce each.
    starts = np.zeros(len(names), dtype=np.int64)
    dcp = np.zeros(len(names), dtype=np.int64)
    starts[local.file_ids] = local.data_start
    dcp[local.file_ids] = local.is_dcp
    comm.allreduce_array(starts, "max")
    comm.allreduce_array(dcp, "max")
    files.data_start, files.is_dcp = starts, dcp.astype(bool)
    tensor_names = comm.allreduce_object(sorted(set(local.names)), _union)
    width = comm.allreduce(local.pieces.width, "max")
    pieces = relabel(local, tensor_names).widened(width)
    misaligned = to_storage_units(pieces)
    facts = reduce_facts(comm, pieces, len(tensor_names), width, piece_destinations(files), misaligned)
    del local
    release_memory()
    return Scanned(directory, files, tensor_names, pieces, facts, inputs=store)


# ---------------------------------------------------------------- DCP's default format


def _item_records(width: int) -> np.dtype:
    return np.dtype(
        [
            ("tensor", "<i4"),
            ("file", "<i4"),
            ("dtype", "i1"),
            ("ndim", "i1"),
            ("item_offset", "<i8"),
            ("item_length", "<i8"),
            ("shape", "<i8", (width,)),
            ("offset", "<i8", (width,)),
        ]
    )


def _missing_file_message(store: InputStore, name: str) -> str:
    return f"{store.path(METADATA_NAME)}: names data file {name!r}, which no rank sees"


def _read_distcp_metadata(
    store: InputStore, listed: list[str], sizes: list[int], listing: bool = False, allow: AllowList = NOTHING
) -> DistcpTable:
    """``.metadata`` read (whole, in one read; ``allow``: a trainer's extra classes); a data file it names that
    no rank sees is bad input, unless ``listing`` (``inspect``: the tensors with pieces there are listed as
    unreadable, the rest described)."""
    source = store.open(METADATA_NAME, sizes[listed.index(METADATA_NAME)])
    try:
        table = read_metadata(source, allow)
    finally:
        source.close()
    present = set(listed)
    for name in table.files:
        if name not in present and not listing:
            raise InputError(_missing_file_message(store, name))
    return table


def _missing_files(table: DistcpTable, store: InputStore, listed: list[str]) -> dict[str, str]:
    """Per tensor with a piece in a data file no rank sees, that problem (the first such file)."""
    present = set(listed)
    missing = [f for f, name in enumerate(table.files) if name not in present]
    problems: dict[str, str] = {}
    if not missing:
        return problems
    for t, f in zip(table.tensor[np.isin(table.file, missing)].tolist(), table.file[np.isin(table.file, missing)].tolist()):
        problems.setdefault(
            table.names[t], f"{_missing_file_message(store, table.files[f])} (tensor {table.names[t]!r} has pieces there)"
        )
    return problems


def _scan_distcp(
    store: InputStore,
    comm: Comm,
    names: list[str],
    sizes: list[int],
    holders: list[np.ndarray] | None,
    listing: bool = False,
    allow: AllowList = NOTHING,
) -> Scanned:
    """``.metadata`` read by one rank that sees it; each piece sent to the reader of its data file, which
    finds the piece's bytes inside its item (``torch.save`` archive or safetensors blob)."""
    directory = store.location
    meta = names.index(METADATA_NAME)
    owner = 0 if holders is None else int(holders[meta][0])
    table = agree(comm, lambda: _read_distcp_metadata(store, names, sizes, listing, allow) if comm.rank == owner else None)
    missing = {} if table is None else _missing_files(table, store, names)
    tensors: Any = comm.bcast(
        None
        if table is None
        else (table.names, table.order, table.dtype, table.size, table.ndim, table.skipped, table.files, missing),
        root=owner,
    )
    tensor_names, order, dtype, size, ndim, skipped, data_files, missing = tensors
    # A data file no rank sees (inspect only) is read by nobody: its records are dropped below.
    listed = [names.index(f) if f in names else -1 for f in data_files]
    data_holders = None if holders is None else [holders[i] if i >= 0 else np.array([owner]) for i in listed]
    data_sizes = [sizes[i] if i >= 0 else 0 for i in listed]
    readers = assign_readers(data_holders, len(data_files), comm.size)
    width = size.shape[1]
    records = _item_table(table, [f for f, i in enumerate(listed) if i < 0], width)
    destination = readers[records["file"]] if len(records) else np.zeros(0, dtype=np.int32)
    del table
    mine = exchange(comm, records, destination)
    del records
    pieces, problems = _located(comm, store, data_files, data_sizes, tensor_names, mine, missing, width)
    files = _distcp_files(data_files, data_sizes, data_holders)
    misaligned = to_storage_units(pieces)
    facts = reduce_facts(comm, pieces, len(tensor_names), width, piece_destinations(files), misaligned)
    never = np.flatnonzero(facts.count == 0)  # tensors with no stored piece: the metadata's dtype and rank
    facts.dtype_first[never], facts.ndim_first[never], facts.dest_first[never] = dtype[never], ndim[never], 0
    facts.declared = size
    release_memory()
    return Scanned(
        directory, files, tensor_names, pieces, facts, skipped=list(skipped), order=order, unreadable=problems,
        listing=listing, inputs=store,
    )  # fmt: skip


def _located(
    comm: Comm,
    store: InputStore,
    data_files: list[str],
    data_sizes: list[int],
    tensor_names: list[str],
    mine: np.ndarray,
    missing: dict[str, str],
    width: int,
) -> tuple[Pieces, dict[str, str]]:
    """This rank's pieces found inside their items, and every tensor some of whose pieces cannot be read
    (agreed over the ranks: the first problem of each, its pieces dropped everywhere)."""
    begins, problems, strides = agree(comm, lambda: _locate_items(store, data_files, data_sizes, tensor_names, mine))
    problems = comm.allreduce_object(problems, _first_per_tensor)
    problems = {**problems, **{name: message for name, message in missing.items() if name not in problems}}
    if problems:
        position = {name: t for t, name in enumerate(tensor_names)}
        readable = ~np.isin(mine["tensor"], [position[name] for name in problems])
        mine, begins = mine[readable], begins[readable]
        strides = None if strides is None else strides[readable]
    return _located_pieces(mine, begins, strides, width, comm.rank), problems


def _item_table(table: DistcpTable | None, absent: list[int], width: int) -> np.ndarray:
    """The metadata's pieces as records to send to their data files' readers (none on a rank that did
    not read it), without those of the data files in ``absent`` (seen by no rank)."""
    records = np.empty(0 if table is None else len(table.tensor), dtype=_item_records(width))
    if table is not None:
        for column in ("tensor", "file", "item_offset", "item_length", "shape", "offset"):
            records[column] = getattr(table, column)
        records["dtype"], records["ndim"] = table.dtype[table.tensor], table.ndim[table.tensor]
        if absent:
            records = records[~np.isin(records["file"], absent)]
    return records


def _located_pieces(mine: np.ndarray, begins: np.ndarray, strides: np.ndarray | None, width: int, rank: int) -> Pieces:
    """The pieces whose bytes this rank found in its data files (``begins``: where each starts)."""
    return Pieces(
        tensor=mine["tensor"].copy(),
        file=mine["file"].copy(),
        dtype=mine["dtype"].copy(),
        ndim=mine["ndim"].copy(),
        shape=mine["shape"].reshape(len(mine), width).copy(),
        offset=mine["offset"].reshape(len(mine), width).copy(),
        begin=begins,
        holder=np.full(len(mine), rank, dtype=np.int32),
        stride=strides,
    )


_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def _distcp_files(names: list[str], sizes: list[int], holders: list[np.ndarray] | None) -> ShardFiles:
    files = shard_files(names, sizes, holders)
    files.source_format = "distcp"
    for i, name in enumerate(names):  # __R_N.distcp: written by training rank R (shown by inspect, relied on by nothing)
        match = _DATA_FILE.match(name)
        files.train_rank[i] = int(match.group(1)) if match and int(match.group(1)) < 2**31 else -1
    return files


def _first_per_tensor(a: dict[str, str], b: dict[str, str]) -> dict[str, str]:
    return {**b, **a}


def unreadable_summary(problems: dict[str, str]) -> str:
    """One line for every tensor whose pieces cannot be read: the first in full, then the others' names."""
    names = sorted(problems)
    first = problems[names[0]]
    if len(names) == 1:
        return first
    shown = ", ".join(repr(n) for n in names[1:6]) + (", ..." if len(names) > 6 else "")
    return f"{first} (and {count_of(len(names) - 1, 'more tensor')} with unreadable pieces: {shown}; mpicons inspect lists each)"


def _locate_items(
    store: InputStore, data_files: list[str], sizes: list[int], names: list[str], records: np.ndarray
) -> tuple[np.ndarray, dict[str, str], np.ndarray | None]:
    """Where each received piece's bytes begin in its data file (one pass over each file's items), the
    first problem of each tensor whose pieces cannot be read, and every piece's strides when some
    were saved as views (None when all are row-major)."""
    begins = np.zeros(len(records), dtype=np.int64)
    problems: dict[str, str] = {}
    strides: np.ndarray | None = None
    for f in np.unique(records["file"]):
        at = np.flatnonzero(records["file"] == f)
        items = [
            Item(
                names[int(r["tensor"])],
                DTYPES[int(r["dtype"])].name,
                tuple(int(x) for x in r["shape"][: r["ndim"]]),
                tuple(int(x) for x in r["offset"][: r["ndim"]]),
                int(r["item_offset"]),
                int(r["item_length"]),
            )
            for r in records[at]
        ]
        source = store.open(data_files[int(f)], sizes[int(f)])
        try:
            begins[at], found, views = locate_all(source, items)
        finally:
            source.close()
        for problem in found:
            problems.setdefault(problem.tensor, problem.message)
        if views and strides is None:
            width = records["shape"].shape[1] if len(records) else 1
            strides = dense_strides(records["shape"].reshape(len(records), width))
        for i, stride in views.items():
            assert strides is not None
            strides[at[i], : len(stride)] = stride
    return begins, problems, strides


def release_memory() -> None:
    """Give freed heap memory back to the system (the parsed headers' objects leave a lot behind).

    The headers' objects are freed by reference counting; only the young generations are collected
    (a full collection costs 0.1 s in a process that has imported torch, and frees nothing more here).
    """
    gc.collect(1)
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def reduce_facts(
    comm: Comm, pieces: Pieces, num_tensors: int, width: int, destinations: np.ndarray, misaligned: np.ndarray | None = None
) -> TensorFacts:
    """The facts of every rank's pieces, combined (two rounds: the second finds disagreeing pieces)."""
    facts = local_facts(pieces, num_tensors, width, destinations, misaligned)
    for names, op in ((TensorFacts.SUM, "sum"), (TensorFacts.MAX, "max"), (TensorFacts.MIN, "min")):
        for name in names:
            comm.allreduce_array(getattr(facts, name), op)
    odd = local_odd(pieces, facts, destinations)
    for values in odd:
        comm.allreduce_array(values, "min")
    set_odd(facts, odd)
    return facts


def exchange(comm: Comm, records: np.ndarray, destination: np.ndarray, ordered: bool = False) -> np.ndarray:
    """Send each record to its destination rank (Alltoallv of bytes, in rounds below the C int limit).

    ``ordered``: the records are already sorted by destination (saves a copy).
    """
    size = comm.size
    if size == 1:
        return records
    if not ordered:
        order = np.argsort(destination, kind="stable")
        records, destination = records[order], destination[order]
    itemsize = max(1, records.dtype.itemsize)
    per_round = max(1, EXCHANGE_LIMIT // itemsize)
    counts = np.bincount(destination, minlength=size).astype(np.int64)
    first = np.cumsum(counts) - counts
    rounds = comm.allreduce(int(-(-counts.max(initial=0) // per_round)), "max")
    received = []
    for r in range(max(1, rounds)):
        take = np.clip(counts - r * per_round, 0, per_round)
        if rounds <= 1:
            send = records
        else:
            send = np.concatenate([records[first[d] + r * per_round : first[d] + r * per_round + take[d]] for d in range(size)])
        received.append(comm.alltoallv(send.view(np.uint8), take * itemsize).view(records.dtype))
    return received[0] if len(received) == 1 else np.concatenate(received)


__all__ = [
    "Scanned",
    "scan",
    "open_store",
    "open_sources",
    "shapes_and_dtypes",
    "discover",
    "rank_directory",
    "reduce_facts",
    "exchange",
    "list_shards",
    "unreadable_summary",
]
