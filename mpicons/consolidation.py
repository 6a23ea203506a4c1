"""The consolidate job: scan → plan → write → publish, every phase agreed over the communicator."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
from mpi4py import MPI

from .copy import MIN_BUFFER, Executor
from .convert import TARGETS
from .exchange import ExchangeExecutor
from .errors import InputError, MpiconsError
from .hdf5 import HDF5_NAME, check_names, create_layout, retarget
from .interrupts import deferred, forget_pending, raise_pending
from .io import BACKENDS, PosixOutput, MpiioOutput, SourceFiles, open_output
from .machine import check_buffer_size, host_name
from .outdir import OutputDir
from .parallel import Comm, agree, agree_on, wait_for_all
from .progress import Progress
from .plan import INDEX_NAME, SPLITS, Plan, build_plan, parse_mapping
from .replicas import assign_readers, check_digests, hash_rows
from .routing import Routes, route
from .scan import PieceTable, rank_directory, scan
from .stats import PhaseClock, Stats, reduce_stats

DEFAULT_BUFFER_SIZE = 32 << 20
#: Background threads per rank for posix writes and kernel copies (overlapping the next block's assembly).
IO_THREADS = int(os.environ.get("MPICONS_IO_THREADS", "1"))
FORMATS = ("safetensors", "hdf5")

log = logging.getLogger("mpicons")


@dataclass(frozen=True)
class ConsolidateResult:
    """What a consolidation produced; the same on every rank."""

    output_dir: str
    files: list[str]
    index_file: str
    tensors: int
    total_bytes: int
    stats: Stats
    plan: Plan
    hints: dict[str, str]
    bytes_per_rank: list[int]
    moved_bytes: int  # bytes sent between ranks over MPI (node-local shards / gather_to)
    shared_input: bool  # every rank could read every shard file
    notes: list[str] = field(default_factory=list)  # what was found and mended in the output directory


def load_mapping(mapping: str | os.PathLike[str] | Mapping[str, object]) -> dict[str, str]:
    """A ``--mapping`` argument (path to JSON, or the parsed object) as tensor name → file name."""
    if isinstance(mapping, Mapping):
        return parse_mapping(dict(mapping))
    path = os.fspath(mapping)
    try:
        with open(path, encoding="utf-8") as handle:
            obj = json.load(handle)
    except OSError as exc:
        raise InputError(f"{path}: cannot read mapping ({exc.strerror})") from None
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{path}: mapping is not valid JSON ({exc})") from None
    return parse_mapping(obj, path)


def _final_names(plan: Plan, output_format: str) -> list[str]:
    """Every name the job publishes, in publishing order: the index (safetensors) last."""
    return [f.name for f in plan.files] + ([INDEX_NAME] if output_format == "safetensors" else [])


def check_options(
    ranks: int, *, split: str, io: str, buffer_size: int, output_format: str, gather_to: int | None, dtype: str | None
) -> None:
    """Options that are wrong whatever the checkpoint: refused before any work (the same on every rank)."""
    if output_format not in FORMATS:
        raise InputError(f"unknown output format {output_format!r} (choose from {', '.join(FORMATS)})")
    if split not in SPLITS:
        raise InputError(f"unknown split {split!r} (choose from {', '.join(SPLITS)})")
    if io not in BACKENDS:
        raise InputError(f"unknown I/O backend {io!r} (choose from {', '.join(BACKENDS)})")
    if dtype is not None and dtype not in TARGETS:
        raise InputError(f"unknown --dtype {dtype!r} (choose from {', '.join(TARGETS)})")
    if buffer_size <= 0:
        raise InputError(f"--buffer-size must be positive (got {buffer_size})")
    if gather_to is not None:
        if not 0 <= gather_to < ranks:
            raise InputError(f"--gather-to {gather_to}: no such rank (the job has {ranks})")
        if io != "posix":
            raise InputError("--gather-to writes on one rank's local disk: use --io posix")


def _directory_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_machine(comm: Comm, input_dir: str, output_dir: str, buffer_size: int) -> None:
    """Before anything is created: the output is no rank's input directory, and the buffers fit in memory.

    Each rank compares the output directory as it sees it with the input directory of every rank
    on the same host (``{rank}`` resolved), so no input file can be replaced on any rank.
    """
    seen = agree(comm, lambda: (host_name(), _directory_identity(rank_directory(input_dir, comm.rank))), gather=True)

    def check() -> None:
        host = seen[comm.rank][0]
        output = _directory_identity(output_dir)
        for rank, (other_host, identity) in enumerate(seen):
            if output is not None and other_host == host and identity == output:
                whose = f" (rank {rank}'s {rank_directory(input_dir, rank)})" if "{rank}" in input_dir else ""
                raise InputError(f"{output_dir}: output directory is the input directory{whose}")
        check_buffer_size(buffer_size, sum(1 for other_host, _ in seen if other_host == host))

    agree(comm, check)


def check_buffer_fits(comm: Comm, buffer_size: int) -> None:
    """Refuse, before any work, a buffer size the ranks sharing a node cannot all have."""
    hosts = agree(comm, host_name, gather=True)
    agree(comm, lambda: check_buffer_size(buffer_size, hosts.count(hosts[comm.rank])))


def consolidate(
    input_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    comm: Comm | None = None,
    mapping: str | os.PathLike[str] | Mapping[str, object] | None = None,
    split: str = "bytes",
    io: str = "posix",
    buffer_size: int = DEFAULT_BUFFER_SIZE,
    hints: Mapping[str, str] | None = None,
    force: bool = False,
    break_lock: bool = False,
    progress: float | None = None,
    verbose: bool = False,
    dtype: str | None = None,
    max_shard_size: int | None = None,
    output_format: str = "safetensors",
    gather_to: int | None = None,
    sync: bool = True,
) -> ConsolidateResult:
    """Consolidate the sharded checkpoint in ``input_dir`` into a Hugging Face checkpoint in ``output_dir``.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``): every rank of it must call this with the
    same arguments. ``progress`` (seconds) makes rank 0 report bytes done, rate and ETA: a bar on
    a terminal, else a line every ``progress`` seconds. ``dtype`` (``bf16``/``fp16``/``fp32``) converts
    floating-point tensors; ``max_shard_size`` (bytes) re-shards like Hugging Face;
    ``output_format="hdf5"`` writes one ``model.h5`` instead (needs h5py).

    The output directory is locked for the run (``break_lock`` clears a lock left by a run that
    cannot be proven dead); new files are written in a private staging directory and published as
    one transaction, so the directory holds either what it held before or the complete new
    checkpoint. ``force`` replaces an existing checkpoint there (its files that the new one does
    not name are removed in the same transaction).

    Shards need not be on a shared filesystem: ``{rank}`` in ``input_dir`` gives each rank its own
    directory (or the same path names a node-local disk); each file is read only by ranks that see
    it and data moves over MPI where needed. ``gather_to=r`` writes every output on rank ``r`` only
    (its local ``output_dir``). ``sync=False`` skips flushing outputs to stable storage (renames stay
    atomic for processes, but a power loss may then leave empty or partial files). Raises
    :class:`~mpicons.errors.InputError` for a bad checkpoint or options and
    :class:`~mpicons.errors.WriteError` for I/O failures, on every rank alike.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    input_dir, output_dir = os.fspath(input_dir), os.fspath(output_dir)
    check_options(comm.size, split=split, io=io, buffer_size=buffer_size, output_format=output_format, gather_to=gather_to, dtype=dtype)
    owner = gather_to if gather_to is not None else 0
    clock = PhaseClock()
    held: list[OutputDir] = []  # the owner's hold on the output directory

    def open_output_dir() -> list[str]:
        held.append(OutputDir.open(output_dir, break_lock))
        return held[0].notes

    try:
        with clock("scan"):
            check_machine(comm, input_dir, output_dir, buffer_size)
            notes = agree_on(comm, owner, open_output_dir)
            if comm.rank == 0:
                for note in notes:
                    log.info("%s: %s", output_dir, note)
            names = agree_on(comm, 0, lambda: load_mapping(mapping) if mapping is not None else None)
            table = scan(input_dir, comm)
        with clock("plan"):
            plan = agree(comm, lambda: build_plan(table, comm.size, mapping=names, split=split, dtype=dtype, max_shard_size=max_shard_size))
            if output_format == "hdf5":
                agree(comm, lambda: check_names(plan))
            routes = None
            if table.holders is not None or gather_to is not None:
                routes = agree(comm, lambda: route(plan, table.holders, comm.size, _block_bytes(buffer_size), gather_to))
        with clock("write"):
            check_replicas(comm, plan, table, buffer_size)
            plan, written, in_effect = _write(comm, held, plan, routes, table, owner, force, output_format,
                                              io, hints, buffer_size, progress, verbose, sync)
        with clock("finalize"):
            agree_on(comm, owner, lambda: _publish(held[0], plan, output_format, sync))
            forget_pending()  # the checkpoint is complete: a signal now has nothing left to stop
    except BaseException as exc:
        for session in held:
            session.close()
        if isinstance(exc, MpiconsError):  # agreed: every rank is here, so all return after the cleanup
            wait_for_all(comm)
        raise
    for session in held:
        session.close()
    stats = reduce_stats(comm, clock, written, len(plan.files), len(plan.tensors), plan.total_bytes)
    return ConsolidateResult(
        output_dir=output_dir,
        files=[f.name for f in plan.files],
        index_file=INDEX_NAME if output_format == "safetensors" else "",
        tensors=len(plan.tensors),
        total_bytes=plan.total_bytes,
        stats=stats,
        plan=plan,
        hints=in_effect,
        bytes_per_rank=routes.written.tolist() if routes is not None else plan.bytes_per_rank(),
        moved_bytes=routes.moved_bytes if routes is not None else 0,
        shared_input=table.holders is None,
        notes=notes,
    )


def check_replicas(comm: Comm, plan: Plan, table: PieceTable, buffer_size: int) -> None:
    """Every copy of a replicated piece hashed by a rank that can read it; differing copies are bad input."""
    replicas = plan.replicas
    if replicas is None:
        return
    readers = assign_readers(replicas, table.holders, comm.size)
    mine = np.flatnonzero(readers == comm.rank)

    def digest_mine() -> dict[int, bytes]:
        sources = SourceFiles(table.directory, plan.source_files)
        try:
            return hash_rows(replicas, mine, sources, np.empty(max(MIN_BUFFER, buffer_size), dtype=np.uint8))
        finally:
            sources.close()

    digests: dict[int, bytes] = {}
    for part in agree(comm, digest_mine, gather=True):
        digests.update(part)
    agree(comm, lambda: check_digests(plan, digests))


def _write(
    comm: Comm,
    held: list[OutputDir],
    plan: Plan,
    routes: Routes | None,
    table: PieceTable,
    owner: int,
    force: bool,
    output_format: str,
    io: str,
    hints: Mapping[str, str] | None,
    buffer_size: int,
    progress: float | None,
    verbose: bool,
    sync: bool,
) -> tuple[Plan, int, dict[str, str]]:
    """Stage every output in the owner's private directory and fill it; returns the (re-targeted) plan."""
    if output_format == "hdf5":
        plan = retarget(plan, [0] * len(plan.tensors), 0)
    names = _final_names(plan, output_format)

    def stage() -> tuple[str, list[str]]:
        session = held[0]
        aside = session.replaced_entries(names, force, checkpoint=output_format == "safetensors")
        session.aside = aside
        return session.stage(), aside

    staging, _ = agree_on(comm, owner, stage)
    if output_format == "hdf5":
        offsets, size = agree_on(comm, owner, lambda: _layout_hdf5(staging, plan))
        plan = retarget(plan, offsets, size)
    paths = [os.path.join(staging, f.name) for f in plan.files]
    output = agree(
        comm,
        lambda: open_output(
            io, comm, paths, [f.header for f in plan.files], [f.size for f in plan.files], hints,
            preallocated=output_format == "hdf5", owner=owner, durable=sync,
        ),
    )
    sources = SourceFiles(table.directory, plan.source_files)
    try:
        agree(comm, output.create)
        written = agree(comm, lambda: _write_share(plan, routes, sources, output, buffer_size, comm, progress, verbose))
        agree(comm, output.sync)
        return plan, written, output.hints_in_effect()
    finally:
        _close_quietly(output, sources)


def _layout_hdf5(staging: str, plan: Plan) -> tuple[list[int], int]:
    path = os.path.join(staging, HDF5_NAME)
    offsets = create_layout(path, plan)
    return offsets, os.path.getsize(path)


def _publish(session: OutputDir, plan: Plan, output_format: str, durable: bool) -> None:
    """The owner writes the index into the staging directory and publishes everything as one transaction.

    Signals are held back meanwhile; one that arrived is honoured at the commit point (rolled back).
    """
    with deferred():
        if output_format == "safetensors":
            session.write_staged(INDEX_NAME, (json.dumps(plan.index(), indent=2) + "\n").encode(), durable)
        session.publish(_final_names(plan, output_format), session.aside, durable, before_commit=raise_pending)
        forget_pending()


def _block_bytes(buffer_size: int) -> int:
    """Block size for routed work: six blocks (assembly, reads, receives, two sends, conversion) fit the buffer."""
    return max(MIN_BUFFER, buffer_size // 6)


def _write_share(
    plan: Plan,
    routes: Routes | None,
    sources: SourceFiles,
    output: PosixOutput | MpiioOutput,
    buffer_size: int,
    comm: Comm,
    progress: float | None,
    verbose: bool,
) -> int:
    """This rank's share of the writing; with progress, reports flow to rank 0 meanwhile."""
    channel = comm.Dup() if progress or routes is not None else comm
    reporter = Progress(channel, plan.total_bytes, progress, verbose=verbose) if progress else None
    on_bytes = reporter.add if reporter is not None else None
    ok = False
    try:
        if routes is None:
            written = Executor(plan, sources, output, buffer_size, on_bytes, io_threads=IO_THREADS).run(plan.work[comm.rank])
        else:
            with deferred():
                executor = ExchangeExecutor(plan, routes, sources, output, _block_bytes(buffer_size), channel, on_bytes)
                written = executor.run_routes()
        ok = True
        return written
    finally:
        # Always report the end (so rank 0 never waits for a rank that failed); rank 0 waits only on success.
        if reporter is not None:
            reporter.finish(wait_for_others=ok)
        wait_for_all(channel)
        if channel is not comm:
            channel.Free()


def _close_quietly(output: PosixOutput | MpiioOutput, sources: SourceFiles) -> None:
    sources.close()
    try:
        output.close()
    except (OSError, MPI.Exception):
        pass
