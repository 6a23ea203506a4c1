"""The consolidate job: scan → plan → write → finalize, every phase agreed over the communicator."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Mapping

from mpi4py import MPI

from .copy import MIN_BUFFER, Executor
from .exchange import ExchangeExecutor
from .errors import InputError, MpiconsError, WriteError
from .hdf5 import HDF5_NAME, create_layout, retarget
from .io import MpiioOutput, SourceFiles, open_output
from .parallel import Comm, agree, signals_deferred, wait_for_all
from .progress import Progress
from .plan import INDEX_NAME, Plan, build_plan, parse_mapping
from .routing import Routes, route
from .scan import scan
from .stats import PhaseClock, Stats, reduce_stats

DEFAULT_BUFFER_SIZE = 32 << 20
#: Background threads per rank for posix writes and kernel copies (overlapping the next block's assembly).
IO_THREADS = int(os.environ.get("MPICONS_IO_THREADS", "1"))
PARTIAL_SUFFIX = ".mpicons-partial"
FORMATS = ("safetensors", "hdf5")


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


def partial_name(name: str) -> str:
    """Temporary name of an output while it is written (hidden, never a final name)."""
    return f".{name}{PARTIAL_SUFFIX}"


def _final_names(plan: Plan, output_format: str) -> list[str]:
    """Every name the job publishes; the index (safetensors) comes last."""
    return [f.name for f in plan.files] + ([INDEX_NAME] if output_format == "safetensors" else [])


def _prepare_output_dir(input_dir: str, output_dir: str, names: list[str], force: bool) -> None:
    if os.path.realpath(input_dir) == os.path.realpath(output_dir):
        raise InputError(f"{output_dir}: output directory is the input directory")
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as exc:
        raise WriteError(f"{output_dir}: cannot create output directory ({exc.strerror})") from None
    if not force:
        for name in names:
            if os.path.lexists(os.path.join(output_dir, name)):
                raise InputError(f"{os.path.join(output_dir, name)}: already exists (use --force to overwrite)")


def _publish(output_dir: str, plan: Plan, with_index: bool, durable: bool = True) -> None:
    """Rename every finished output to its final name, then write the index last."""
    for out in plan.files:
        os.replace(os.path.join(output_dir, partial_name(out.name)), os.path.join(output_dir, out.name))
    if with_index:
        index_tmp = os.path.join(output_dir, partial_name(INDEX_NAME))
        with open(index_tmp, "w", encoding="utf-8") as handle:
            json.dump(plan.index(), handle, indent=2)
            handle.write("\n")
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(index_tmp, os.path.join(output_dir, INDEX_NAME))
    if durable:
        dir_fd = os.open(output_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _remove_partials(output_dir: str, names: list[str]) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(output_dir, partial_name(name)))
        except OSError:
            pass


def _layout_hdf5(output_dir: str, plan: Plan) -> tuple[list[int], int]:
    path = os.path.join(output_dir, partial_name(HDF5_NAME))
    offsets = create_layout(path, plan)
    return offsets, os.path.getsize(path)


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
    if output_format not in FORMATS:
        raise InputError(f"unknown output format {output_format!r} (choose from {', '.join(FORMATS)})")
    clock = PhaseClock()
    with clock("scan"):
        names = agree(comm, lambda: load_mapping(mapping) if mapping is not None and comm.rank == 0 else None, root=0)
        table = scan(input_dir, comm)
    with clock("plan"):
        plan = agree(comm, lambda: build_plan(table, comm.size, mapping=names, split=split, dtype=dtype, max_shard_size=max_shard_size))
        routes = None
        if table.holders is not None or gather_to is not None:
            if gather_to is not None and io != "posix":
                raise InputError("--gather-to writes on one rank's local disk: use --io posix")
            routes = agree(comm, lambda: route(plan, table.holders, comm.size, _block_bytes(buffer_size), gather_to))
    owner = gather_to if gather_to is not None else 0
    with clock("write"):
        if output_format == "hdf5":
            plan = retarget(plan, [0] * len(plan.tensors), 0)
        final_names = _final_names(plan, output_format)
        agree(comm, lambda: _prepare_output_dir(input_dir, output_dir, final_names, force) if comm.rank == owner else None, root=owner)
        try:
            if output_format == "hdf5":
                offsets, size = agree(comm, lambda: _layout_hdf5(output_dir, plan) if comm.rank == owner else None, root=owner)
                plan = retarget(plan, offsets, size)
            paths = [os.path.join(output_dir, partial_name(f.name)) for f in plan.files]
            output = agree(
                comm,
                lambda: open_output(
                    io, comm, paths, [f.header for f in plan.files], [f.size for f in plan.files], hints,
                    preallocated=output_format == "hdf5", owner=owner, durable=sync,
                ),
            )
        except MpiconsError:
            if comm.rank == owner:
                _remove_partials(output_dir, final_names)
            raise
        sources = SourceFiles(table.directory, plan.source_files)
        try:
            agree(comm, output.create)
            in_effect = output.hints_in_effect() if isinstance(output, MpiioOutput) else {}
            written = agree(comm, lambda: _write_share(plan, routes, sources, output, buffer_size, comm, progress, verbose))
            agree(comm, output.sync)
        except MpiconsError:
            _close_quietly(output, sources)
            if comm.rank == owner:
                _remove_partials(output_dir, final_names)
            raise
        _close_quietly(output, sources)
    with clock("finalize"):
        try:
            agree(comm, lambda: _publish(output_dir, plan, output_format == "safetensors", sync) if comm.rank == owner else None, root=owner)
        except MpiconsError:
            if comm.rank == owner:
                _remove_partials(output_dir, final_names)
            raise
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
    )


def _block_bytes(buffer_size: int) -> int:
    """Block size for routed work: six blocks (assembly, reads, receives, two sends, conversion) fit the buffer."""
    return max(MIN_BUFFER, buffer_size // 6)


def _write_share(
    plan: Plan,
    routes: Routes | None,
    sources: SourceFiles,
    output: object,
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
            written = Executor(plan, sources, output, buffer_size, on_bytes, io_threads=IO_THREADS).run(plan.work[comm.rank])  # type: ignore[arg-type]
        else:
            with signals_deferred():
                executor = ExchangeExecutor(plan, routes, sources, output, _block_bytes(buffer_size), channel, on_bytes)  # type: ignore[arg-type]
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


def _close_quietly(output: object, sources: SourceFiles) -> None:
    sources.close()
    try:
        output.close()  # type: ignore[attr-defined]
    except (OSError, MPI.Exception):
        pass
