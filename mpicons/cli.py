"""Command line: ``mpicons consolidate|demo``; run under mpiexec/srun or as a single process."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback
from typing import Callable, Sequence

from mpi4py import MPI

from . import __version__
from .convert import TARGETS
from .consolidation import DEFAULT_BUFFER_SIZE, FORMATS, ConsolidateResult, consolidate
from .errors import InputError, MpiconsError
from .io import BACKENDS
from .parallel import Comm, install_signal_handlers
from .plan import SPLITS

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1}


def parse_size(text: str) -> int:
    """``64M``/``64MiB`` = 64·2^20, ``5GB`` = 5·10^9 (Hugging Face's units), plain numbers are bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64M, 512MiB, 5GB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _hint(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpicons",
        description="Consolidate sharded (DCP) safetensors checkpoints into Hugging Face checkpoints, MPI-parallel.",
    )
    parser.add_argument("--version", action="version", version=f"mpicons {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("consolidate", help="consolidate INPUT_DIR into OUTPUT_DIR")
    run.add_argument("input_dir", help="directory of shard-RRRRR-model-IIIII-of-NNNNN.safetensors files")
    run.add_argument("output_dir", help="where model-IIIII-of-NNNNN.safetensors and the index go")
    _add_job_options(run)
    run.set_defaults(func=_cmd_consolidate)

    demo = commands.add_parser("demo", help="write the built-in sample sharded checkpoint and consolidate it")
    demo.add_argument("directory", nargs="?", default="mpicons-demo", help="work directory (default: %(default)s)")
    demo.add_argument("--size", type=parse_size, default=0, help="approximate checkpoint size, e.g. 1GB (default: small)")
    _add_job_options(demo)
    demo.set_defaults(func=_cmd_demo)

    check = commands.add_parser("verify", help="check a consolidated checkpoint (files, index; values with --against)")
    check.add_argument("output_dir", help="directory of model-IIIII-of-NNNNN.safetensors files and the index")
    check.add_argument("--against", metavar="DIR", help="also compare every tensor with the sharded checkpoint in DIR")
    check.add_argument("--buffer-size", type=parse_size, default=DEFAULT_BUFFER_SIZE, metavar="SIZE",
                       help="memory per rank for comparing blocks (default: 32M)")
    check.add_argument("--dtype", choices=sorted(TARGETS), help="the output was written with --dtype: convert the shards alike")
    check.add_argument("--json", metavar="FILE", help="write the report as JSON")
    check.add_argument("-q", "--quiet", action="store_true", help="print only the problems")
    check.set_defaults(func=_cmd_verify)

    look = commands.add_parser("inspect", help="show tensors, shards, problems and each rank's work, writing nothing")
    look.add_argument("input_dir", help="directory of shard-RRRRR-model-IIIII-of-NNNNN.safetensors files")
    look.add_argument("--ranks", type=_int_at_least(1), metavar="N", help="plan for N ranks (default: this job's size)")
    look.add_argument("--mapping", metavar="FILE", help="tensor → output file: {name: index} JSON or a model.safetensors.index.json")
    look.add_argument("--split", choices=sorted(SPLITS), default="bytes", help="work split over ranks (default: %(default)s)")
    look.add_argument("--dtype", choices=sorted(TARGETS), help="plan with floating-point tensors converted")
    look.add_argument("--max-shard-size", type=parse_size, metavar="SIZE", help="plan a Hugging Face re-sharding, e.g. 5GB")
    look.add_argument("--json", metavar="FILE", help="write the full report as JSON ('-': to stdout, instead of the table)")
    look.add_argument("--limit", type=_int_at_least(0), default=50, metavar="N",
                      help="rows per list in the table, 0 for all (default: %(default)s)")
    look.set_defaults(func=_cmd_inspect)
    return parser


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type for integers >= ``minimum``, so bad values are usage errors, not tracebacks."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum} (got {value})")
        return value

    return parse


def _add_job_options(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--mapping", metavar="FILE", help="tensor → output file: {name: index} JSON or a model.safetensors.index.json")
    cmd.add_argument("--dtype", choices=sorted(TARGETS), help="convert floating-point tensors (round to nearest even)")
    cmd.add_argument("--max-shard-size", type=parse_size, metavar="SIZE",
                     help="re-shard like Hugging Face, e.g. 5GB (10^9 bytes), instead of following the shard names")
    cmd.add_argument("--format", dest="output_format", choices=FORMATS, default="safetensors",
                     help="output: Hugging Face safetensors files (default) or one HDF5 file (needs h5py)")
    cmd.add_argument("--gather-to", type=int, metavar="RANK",
                     help="write every output on this rank only (its local OUTPUT_DIR); data moves over MPI")
    cmd.add_argument("--split", choices=sorted(SPLITS), default="bytes", help="work split over ranks (default: %(default)s)")
    cmd.add_argument("--io", choices=BACKENDS, default="posix", help="output backend (default: %(default)s)")
    cmd.add_argument("--hint", type=_hint, action="append", default=[], metavar="KEY=VALUE", help="MPI-IO hint (repeatable)")
    cmd.add_argument("--buffer-size", type=parse_size, default=DEFAULT_BUFFER_SIZE, metavar="SIZE",
                     help="memory per rank for assembling blocks (default: 32M)")
    cmd.add_argument("--force", action="store_true", help="overwrite existing output files")
    cmd.add_argument("--no-sync", dest="sync", action="store_false",
                     help="do not flush outputs to stable storage (scratch data, benchmarks): faster, not power-loss safe")
    cmd.add_argument("--progress", type=float, default=10.0, metavar="N",
                     help="progress line every N seconds (a bar on a terminal); 0 turns it off (default: %(default)s)")
    cmd.add_argument("--stats-json", metavar="FILE", help="write the timing report as JSON")
    cmd.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    cmd.add_argument("-v", "--verbose", action="store_true", help="print per-rank detail")


def _job_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return dict(
        mapping=args.mapping,
        split=args.split,
        io=args.io,
        buffer_size=args.buffer_size,
        hints=dict(args.hint),
        force=args.force,
        progress=None if args.quiet or args.progress <= 0 else args.progress,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        output_format=args.output_format,
        gather_to=args.gather_to,
        sync=args.sync,
        verbose=args.verbose,
    )


def _report(args: argparse.Namespace, comm: Comm, result: ConsolidateResult) -> None:
    if comm.rank != 0:
        return
    if not args.quiet:
        print(result.stats.table())
        if args.verbose:
            for rank, count in enumerate(result.bytes_per_rank):
                print(f"  rank {rank}: writes {count} bytes")
            if not result.shared_input:
                print(f"  node-local shards: {result.moved_bytes} bytes moved over MPI")
            if result.hints:
                print("  MPI-IO hints in effect: " + ", ".join(f"{k}={v}" for k, v in sorted(result.hints.items())))
        index = f" and {result.index_file}" if result.index_file else ""
        print(f"mpicons: wrote {', '.join(result.files) if len(result.files) < 4 else f'{len(result.files)} files'}{index} to {result.output_dir}")
    if args.stats_json:
        report = result.stats.to_dict()
        report["files"] = result.files
        report["moved_bytes"] = result.moved_bytes
        report["shared_input"] = result.shared_input
        with open(args.stats_json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
            handle.write("\n")


def _cmd_consolidate(args: argparse.Namespace, comm: Comm) -> int:
    result = consolidate(args.input_dir, args.output_dir, comm=comm, **_job_kwargs(args))
    _report(args, comm, result)
    return 0


def _cmd_demo(args: argparse.Namespace, comm: Comm) -> int:
    from .sample import SampleConfig, write_sample
    from .verify import check_sample

    config = SampleConfig.sized(args.size) if args.size else SampleConfig()
    sharded = os.path.join(args.directory, "sharded")
    output = os.path.join(args.directory, "consolidated")
    if comm.rank == 0 and not args.quiet:
        print(f"mpicons demo: writing a sample checkpoint ({config.layers} layers, hidden {config.hidden}, "
              f"{config.dp}x{config.tp} training mesh) to {sharded}")
    write_sample(sharded, config, comm)
    kwargs = _job_kwargs(args)
    kwargs["force"] = True
    result = consolidate(sharded, output, comm=comm, **kwargs)
    _report(args, comm, result)
    checked = check_sample(output, config, comm)
    if comm.rank == 0 and not args.quiet:
        print(f"mpicons demo: {checked} tensors in {output} match the sample's full tensors bit for bit")
    return 0


def _cmd_verify(args: argparse.Namespace, comm: Comm) -> int:
    """Exit 0 when the checkpoint is sound, 1 when it is not (bad arguments raise InputError: exit 2)."""
    from .verify import verify

    report = verify(args.output_dir, against=args.against, comm=comm, buffer_size=args.buffer_size, dtype=args.dtype)
    if comm.rank == 0:
        for line in report.lines():
            print(line)
        if not args.quiet:
            print(report.summary())
        sys.stdout.flush()
        if args.json:
            try:
                with open(args.json, "w", encoding="utf-8") as handle:
                    json.dump(report.to_dict(), handle, indent=2)
                    handle.write("\n")
            except OSError as exc:
                print(f"mpicons: error: {args.json}: cannot write the report ({exc.strerror})", file=sys.stderr, flush=True)
                return 1
    return 0 if report.ok else 1


def _cmd_inspect(args: argparse.Namespace, comm: Comm) -> int:
    """Exit 0 when the checkpoint can be consolidated, 2 when it has problems (the report is printed either way)."""
    from .errors import WriteError
    from .inspect import inspect
    from .parallel import agree

    report = inspect(
        args.input_dir, comm=comm, ranks=args.ranks, mapping=args.mapping, split=args.split,
        dtype=args.dtype, max_shard_size=args.max_shard_size,
    )
    if comm.rank == 0:
        if args.json == "-":
            json.dump(report.to_dict(), sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            print(report.table(limit=args.limit))
        sys.stdout.flush()

    def write_json() -> None:
        try:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(report.to_dict(), handle, indent=2)
                handle.write("\n")
        except OSError as exc:
            raise WriteError(f"{args.json}: cannot write the report ({exc.strerror})") from None

    # Every rank learns whether rank 0 could write the file, so all exit with the same code.
    agree(comm, lambda: write_json() if comm.rank == 0 and args.json not in (None, "-") else None, root=0)
    return 0 if report.ok else 2


def check_launcher(world_size: int, environ: dict[str, str] | None = None) -> None:
    """Stop when ``srun`` started N separate one-rank jobs (its MPI plugin does not match the MPI library).

    Inside an srun step, ``SLURM_STEP_NUM_TASKS`` is the number of tasks srun started; a matching MPI
    sees them all in COMM_WORLD (mpiexec under Slurm starts one proxy task per node, never more tasks
    than ranks), so a world smaller than the step means every task runs alone.
    """
    env = os.environ if environ is None else environ
    tasks = env.get("SLURM_STEP_NUM_TASKS") or (env.get("SLURM_NTASKS") if "SLURM_STEP_ID" in env else None)
    if tasks and tasks.isdigit() and int(tasks) > world_size:
        raise InputError(
            f"srun started {tasks} tasks but MPI sees {world_size} rank(s) per job: the tasks are not one MPI job. "
            "Launch with the PMI plugin your MPI was built for, e.g. 'srun --mpi=pmix' or 'srun --mpi=pmi2' "
            "('srun --mpi=list' shows the choices), or use mpiexec inside the allocation"
        )


def main(argv: Sequence[str] | None = None, comm: Comm | None = None) -> int:
    """Run the command line on ``comm`` (default COMM_WORLD); returns the exit code.

    Errors every rank agreed on are printed once, by rank 0, and give exit 2 (bad input) or 1.
    Anything else is a bug: it is printed with its rank and the job is aborted so no rank hangs.
    """
    args = build_parser().parse_args(argv)
    comm = MPI.COMM_WORLD if comm is None else comm
    install_signal_handlers()
    try:
        check_launcher(MPI.COMM_WORLD.size)
        return args.func(args, comm)
    except MpiconsError as exc:
        if comm.rank == 0:
            print(f"mpicons: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except Exception:  # noqa: BLE001 - last resort: never leave other ranks waiting
        print(f"mpicons: internal error on rank {comm.rank}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        if comm.size > 1:
            comm.Abort(1)
        return 1


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())


__all__ = ["main", "run", "parse_size", "InputError"]
