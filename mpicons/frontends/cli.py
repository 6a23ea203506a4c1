"""Command line: ``mpicons consolidate|inspect|verify|demo``; under mpiexec/srun or as a single process.

The runner installs the signal handlers before MPI starts (MPI is imported only after argument
parsing), aborts the whole job on any exception it did not expect (as ``python -m mpi4py`` does),
prints usage errors once, and treats a closed standard output as the reader's choice, not a
failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..comm.interrupts import install_handlers
from ..core import messages
from ..core.errors import InputError, MpiconsError, WriteError
from .arguments import SERIALIZATIONS, build_parser, job_options, launcher_rank, say, selection

if TYPE_CHECKING:
    from ..comm import Communicator as Comm
    from ..job.consolidation import ConsolidateResult

# ---------------------------------------------------------------- report files


def check_report_path(path: str | None, inputs: Sequence[str | None] = ()) -> None:
    """Refuse, before any work, a report path that cannot be written ('-' is standard output), or that lies
    inside one of the ``inputs`` (shard directories: rank 0's, which writes the report)."""
    if path is None or path == "-":
        return
    from ..core.machine import check_path_fits

    check_path_fits(path, "report path name")
    parent = os.path.dirname(os.path.abspath(path))
    _refuse_inside_inputs(path, parent, inputs)
    if os.path.isdir(path):
        raise InputError(f"{path}: is a directory, not a file for the report")
    if not os.path.isdir(parent):
        raise InputError(f"{path}: cannot write the report there ({parent} is not a directory)")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise InputError(f"{path}: cannot write the report there (no write permission, or a read-only file system)")


def _refuse_inside_inputs(path: str, parent: str, inputs: Sequence[str | None]) -> None:
    """A report is an output: never written among or below the shards (as the output directory is not)."""
    from ..io.inputs import rank_directory
    from ..io.outdir import directory_identity, identities_up
    from ..io.s3 import is_s3

    above = {identity for _, identity in identities_up(parent)}
    for input_dir in inputs:
        if input_dir is None or is_s3(input_dir):
            continue
        if directory_identity(rank_directory(input_dir, 0)) in above:
            raise InputError(
                f"{path}: the report would be written inside the input directory {input_dir}: mpicons never writes "
                "among or below the shards it reads; give a path outside it"
            )


def write_report(comm: Comm, path: str | None, make: Callable[[], object], root: int = 0) -> None:
    """Write a JSON report from ``root`` ('-': standard output); every rank learns whether it worked."""
    from ..comm.agreement import agree_on

    def write() -> None:
        text = json.dumps(make(), indent=2) + "\n"
        if path == "-":
            say(text, end="")
            return
        try:
            with open(path, "w", encoding="utf-8") as handle:  # type: ignore[arg-type]
                handle.write(text)
        except OSError as exc:
            raise WriteError(f"{path}: cannot write the report ({exc.strerror})") from None

    if path is not None:
        agree_on(comm, root, write)


def _check_report_paths(comm: Comm, *paths: str | None, inputs: Sequence[str | None] = ()) -> None:
    from ..comm.agreement import agree_on

    def check() -> None:
        for path in paths:
            check_report_path(path, inputs)

    agree_on(comm, 0, check)


# ---------------------------------------------------------------- commands


def _print_result(args: argparse.Namespace, comm: Comm, result: ConsolidateResult) -> None:
    from ..job.progress import report_columns

    if comm.rank != 0 or args.quiet or args.stats_json == "-":
        return
    say("\n".join(closing_report(result, args.verbose, report_columns(sys.stdout))))


def closing_report(result: ConsolidateResult, verbose: bool, width: int) -> list[str]:
    """The lines printed after a consolidation, fitted to ``width`` columns (one item per line where a
    line would not fit; only a single name longer than the width can pass it)."""
    from ..core.reports import count_of, fit_items, human_size, skipped_parts, wrapped

    lines = result.stats.table(width).split("\n")
    if verbose:
        lines += [f"  rank {rank}: writes {count_of(count, 'byte')}" for rank, count in enumerate(result.bytes_per_rank)]
        if not result.shared_input:
            lines.append(f"  node-local shards: {count_of(result.moved_bytes, 'byte')} moved over MPI")
        if result.hints:
            hints = [f"{k}={v}" for k, v in sorted(result.hints.items())]
            lines += fit_items("  MPI-IO hints in effect: ", hints, width, indent="    ")
    lines += [f"{messages.PREFIX}{note}" for note in result.input_notes]
    if result.skipped:
        counted, names = skipped_parts(result.skipped)
        lines += fit_items(f"{messages.PREFIX}skipped {counted}: ", names, width)
    lines += _adapter_lines(result, verbose, width)
    if result.resumed_bytes:
        lines.append(f"{messages.PREFIX}continued a stopped run: {human_size(result.resumed_bytes)} kept, not written again")
    names = list(result.files) if len(result.files) < 4 else [count_of(len(result.files), "file")]
    index = [result.index_file] if result.index_file else []
    index += [result.manifest] if result.manifest else []
    line = f"{messages.PREFIX}wrote {', '.join(names)}{''.join(' and ' + i for i in index)} to {result.output_dir}"
    if len(line) <= width:
        return wrapped([*lines, line], width)
    return wrapped([*lines, f"{messages.PREFIX}wrote to {result.output_dir}:", *("  " + name for name in names + index)], width)


def _adapter_lines(result: ConsolidateResult, verbose: bool, width: int) -> list[str]:
    """The adapter's report: skipped groups one line each; dropped entries listed (all with -v); a warning
    per dropped entry that held what the model loses (all with -v); without an adapter, the one the
    names seem to need."""
    from ..core.reports import count_of, fit_items

    skipped = [line for line in result.adapted if line.startswith("skipped ")]
    dropped = [line.removeprefix("dropped ") for line in result.adapted if line.startswith("dropped ")]
    lines = [f"{messages.PREFIX}adapter: {line}" for line in skipped]
    if dropped:
        shown = (
            dropped
            if verbose or len(dropped) <= 4
            else [*dropped[:3], f"... ({count_of(len(dropped) - 3, 'more')}; -v lists all)"]
        )
        lines += fit_items(
            f"{messages.PREFIX}adapter: dropped {count_of(len(dropped), 'entry', 'entries')} on purpose: ", shown, width
        )
    if result.assets:
        lines += fit_items(f"{messages.PREFIX}published with the weights: ", list(result.assets), width)
    warnings = result.warnings if verbose or len(result.warnings) <= 4 else result.warnings[:3]
    lines += [messages.WARNING + line for line in warnings]
    if len(warnings) < len(result.warnings):
        more = count_of(len(result.warnings) - len(warnings), "more dropped entry", "more dropped entries")
        lines.append(f"{messages.WARNING}... and {more} that are not what they should be (-v lists all)")
    return lines + [messages.NOTE + line for line in result.advice]


def _stats_report(result: ConsolidateResult) -> dict[str, object]:
    report = result.stats.to_dict()
    report.update(files=result.files, moved_bytes=result.moved_bytes, shared_input=result.shared_input, notes=result.notes)
    report.update(resumed_bytes=result.resumed_bytes, manifest=result.manifest)
    report.update(adapter=result.adapted, assets=result.assets, skipped=result.skipped, input_notes=result.input_notes)
    report.update(warnings=result.warnings, advice=result.advice)
    return report


def _cmd_consolidate(args: argparse.Namespace, comm: Comm) -> int:
    from ..job.consolidation import consolidate

    _check_report_paths(comm, args.stats_json, inputs=[args.input_dir])
    result = consolidate(args.input_dir, args.output_dir, job_options(args), comm=comm)
    _print_result(args, comm, result)
    write_report(comm, args.stats_json, lambda: _stats_report(result))
    return 0


def _cmd_demo(args: argparse.Namespace, comm: Comm) -> int:
    """Write the sample into a directory the demo owns (:mod:`.demo`), consolidate it and check every tensor."""
    from ..core.reports import count_of, wrapped
    from ..job.consolidation import consolidate
    from ..job.pipeline import check_buffer_fits, check_options
    from ..job.progress import report_columns
    from ..trainers.sample_model import SampleConfig
    from .demo import DemoDirectory
    from .sample import check_sample, sample_file_names, write_sample

    _check_report_paths(comm, args.stats_json)
    options = job_options(args)  # checked, as consolidate checks them, before anything is written
    check_options(comm, options)
    check_buffer_fits(comm, options.buffer_size)
    config = SampleConfig.sized(args.size) if args.size else SampleConfig()
    distcp = args.serialization or (SERIALIZATIONS[0] if args.distcp else None)
    place = DemoDirectory(args.directory, "sharded" if distcp is None else f"distcp-{distcp}")
    names = sample_file_names(config, distcp)
    replace = place.claim(comm, names, args.force)

    def tell(line: str) -> None:
        if comm.rank == 0 and not args.quiet:
            say("\n".join(wrapped([messages.DEMO + line], report_columns(sys.stdout))))

    kind = "" if distcp is None else f" in DCP's .distcp format ({distcp})"
    tell(
        f"writing a sample checkpoint{kind} ({config.layers} layers, hidden {config.hidden}, "
        f"{config.dp}x{config.tp} training mesh) to {place.sample}"
    )
    write_sample(place.sample, config, comm, distcp=distcp, exclusive=True)
    place.record_sample(comm, names)
    result = consolidate(place.sample, place.output, options, comm=comm, force=replace)
    place.record_output(comm, [*result.files, *(name for name in (result.index_file, result.manifest) if name)])
    _print_result(args, comm, result)
    write_report(comm, args.stats_json, lambda: _stats_report(result))
    checked = check_sample(place.output, config, comm)
    tell(f"{count_of(checked, 'tensor')} in {place.output} match the sample's full tensors bit for bit")
    return 0


def _cmd_verify(args: argparse.Namespace, comm: Comm) -> int:
    """Exit 0 when the checkpoint is sound, 1 when it is not, 2 for bad arguments (InputError) or a directory
    holding entries verify does not read (links unless followed, FIFOs, devices)."""
    from .verification import verify

    _check_report_paths(comm, args.json, inputs=[args.against])
    report = verify(
        args.output_dir,
        against=args.against,
        comm=comm,
        buffer_size=args.buffer_size,
        dtype=args.dtype,
        follow_links=args.follow_links,
        **selection(args),
    )
    if comm.rank == 0 and args.json != "-":
        lines = report.lines() + ([] if args.quiet else [report.summary()])
        if lines:
            say("\n".join(lines))
    write_report(comm, args.json, report.to_dict)
    return 2 if report.refused else 0 if report.ok else 1


def _cmd_inspect(args: argparse.Namespace, comm: Comm) -> int:
    """Exit 0 when the checkpoint can be consolidated, 2 when it has problems (the report is printed either way)."""
    from .inspection import inspect

    _check_report_paths(comm, args.json, inputs=[args.input_dir])
    report = inspect(
        args.input_dir,
        comm=comm,
        ranks=args.ranks,
        mapping=args.mapping,
        split=args.split,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        **selection(args),
    )
    if comm.rank == 0 and args.json != "-":
        say(report.table(limit=args.limit))
    write_report(comm, args.json, report.to_dict)
    return 0 if report.ok else 2


def _cmd_shard(args: argparse.Namespace, comm: Comm) -> int:
    """A Hugging Face model written as a Megatron-Core ``torch_dist`` checkpoint (:mod:`mpicons.job.sharding`)."""
    from ..comm.agreement import agree
    from ..core.reports import count_of, human_bytes
    from ..job.sharding import ShardOptions, shard
    from ..trainers.megatron.export import Parallelism

    parallel = agree(
        comm,
        lambda: Parallelism(args.tp, args.pp, args.ep, args.make_vocab_size_divisible_by, args.spec),
    )
    options = ShardOptions(parallel, args.hf_assets, args.force, not args.no_sync, args.s3_endpoint)
    result = shard(args.model_dir, args.output_dir, options, comm=comm)
    if comm.rank == 0 and not args.quiet:
        say(
            f"wrote {result.checkpoint}: {count_of(result.tensors, 'tensor')} ({human_bytes(result.bytes)}) for "
            f"TP{parallel.tp} PP{parallel.pp} EP{parallel.ep} in {result.seconds:.1f} s over {count_of(comm.size, 'rank')} "
            f"({human_bytes(min(result.bytes_per_rank))} to {human_bytes(max(result.bytes_per_rank))} each); "
            f"load it with Megatron-LM's --load {args.output_dir} --finetune --no-load-optim --no-load-rng"
        )
    return 0


#: Each command's function, by the name it is given on the command line.
COMMANDS: dict[str, Callable[[argparse.Namespace, Comm], int]] = {
    "consolidate": _cmd_consolidate,
    "verify": _cmd_verify,
    "demo": _cmd_demo,
    "inspect": _cmd_inspect,
    "shard": _cmd_shard,
}


def check_launcher(world_size: int, environ: dict[str, str] | None = None) -> None:
    """Stop when ``srun`` started N separate one-rank jobs (its MPI plugin does not match the MPI library).

    Inside an srun step, ``SLURM_STEP_NUM_TASKS`` is the number of tasks srun started; a matching MPI
    sees them all in COMM_WORLD (mpiexec under Slurm starts one proxy task per node, never more tasks
    than ranks), so a world smaller than the step means every task runs alone.
    """
    from ..core.reports import count_of

    env = os.environ if environ is None else environ
    tasks = env.get("SLURM_STEP_NUM_TASKS") or (env.get("SLURM_NTASKS") if "SLURM_STEP_ID" in env else None)
    if tasks and tasks.isdigit() and int(tasks) > world_size:
        raise InputError(
            f"srun started {tasks} tasks but MPI sees {count_of(world_size, 'rank')} per job: the tasks are not one MPI job. "
            "Launch with the PMI plugin your MPI was built for, e.g. 'srun --mpi=pmix' or 'srun --mpi=pmi2' "
            "('srun --mpi=list' shows the choices), or use mpiexec inside the allocation"
        )


def _show_notes(quiet: bool, rank: int) -> None:
    """Library notes (e.g. an interrupted run recovered in the output directory) on rank 0's standard error."""
    logger = logging.getLogger("mpicons")
    if quiet or rank != 0 or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(messages.NOTE + "%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None, comm: object | None = None) -> int:
    """Run the command line on ``comm`` (default COMM_WORLD); returns the exit code.

    Errors every rank agreed on are printed once, by rank 0, and give exit 2 (bad input) or 1.
    Anything else is a bug: it is printed with its rank and the job is aborted so no rank hangs.
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # usage error, --help or --version: already printed once, before MPI starts
        return exc.code if isinstance(exc.code, int) else 2
    from ..comm import as_communicator

    world = comm is None
    comm = as_communicator(comm)  # MPI starts here (None: COMM_WORLD), after the signal handlers are in place
    _show_notes(bool(getattr(args, "quiet", False)), comm.rank)
    try:
        if world:
            check_launcher(comm.size)
        return int(COMMANDS[args.command](args, comm))
    except MpiconsError as exc:
        if comm.rank == 0:
            say(f"{messages.ERROR}{exc}", sys.stderr)
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 - last resort: never leave other ranks waiting
        if not _reported_out_of_memory(exc, comm.rank):
            say(f"{messages.internal_error(comm.rank)}:\n{traceback.format_exc()}", sys.stderr)
        if comm.size > 1:
            comm.abort(1)
        return 1


def _reported_out_of_memory(exc: BaseException, rank: int) -> bool:
    """Memory ran out outside a phase (start-up, MPI's start, between phases): the same one line as inside."""
    from ..core.machine import memory_exhausted, out_of_memory_line

    if not memory_exhausted(exc):
        return False
    say(f"{messages.ERROR}[rank {rank}] {out_of_memory_line()}", sys.stderr)
    return True


def _abort_job(exc: BaseException) -> int:
    """An exception escaped everything: end the whole job now rather than leave ranks waiting."""
    mpi = sys.modules.get("mpi4py.MPI")
    rank = launcher_rank()
    if not _reported_out_of_memory(exc, rank):
        say(f"{messages.internal_error(rank)}: {type(exc).__name__}: {exc}", sys.stderr)
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.size > 1:
        mpi.COMM_WORLD.Abort(1)
    return 1


def run() -> None:
    """Console-script entry point: handlers first, MPI later; nothing escapes without ending the job."""
    install_handlers()
    try:
        code = main()
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt, SystemExit and bugs alike
        code = _abort_job(exc)
    sys.exit(code)


__all__ = ["COMMANDS", "check_report_path", "main", "run", "write_report"]
