"""Command line: ``mpicons consolidate|inspect|verify|demo``; under mpiexec/srun or as a single process.

The runner installs the signal handlers before MPI starts (MPI is imported only after argument
parsing), aborts the whole job on any exception it did not expect (as ``python -m mpi4py`` does),
prints usage errors once, and treats a closed standard output as the reader's choice, not a
failure.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import IO, TYPE_CHECKING, Any, NoReturn

from ..comm.interrupts import install_handlers
from ..core import messages
from ..core.errors import InputError, MpiconsError, WriteError
from ..core.options import BACKENDS, DEFAULT_BUFFER_SIZE, DEFAULT_PROGRESS_SECONDS, DTYPES, FORMATS, SPLITS, Options
from ..core.upload_parts import DEFAULT_PART_SIZE
from ..core.version import __version__

if TYPE_CHECKING:
    from ..comm import Communicator as Comm
    from ..job.consolidation import ConsolidateResult

_UNITS = {
    "": 1,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "b": 1,
}
#: Where launchers put a process's rank before MPI starts (MPICH/hydra, Open MPI, PMIx, Slurm, MVAPICH).
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "MV2_COMM_WORLD_RANK")
_SERIALIZATIONS = ("torch_save", "safetensors")  # how a .distcp sample holds its tensors


def launcher_rank() -> int:
    """This process's rank as the launcher announced it (0 without a launcher); needs no MPI."""
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors and help printed once per job (by rank 0), not once per rank.

    Options are never abbreviated (``--forc`` is not ``--force``: a prefix must not take a dangerous
    flag), and an unknown option is reported by the parser of the command it was given to, with that
    command's usage and the closest options it has.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        #: Options another command has that this one refuses on purpose: option → why, said with the error.
        self.refused_options: dict[str, str] = {}

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._subparsers is not None:  # the top level: a command's option given before the command
            given = list(sys.argv[1:] if args is None else args)
            commands = self._command_names()
            if given and given[0].startswith("-") and given[0] not in ("-h", "--help", "--version"):
                command = next((a for a in given if a in commands), None)
                if command is not None:
                    known = self._command_parser(command)._option_string_actions
                    option = given[0].partition("=")[0]
                    if option in known:
                        self.error(
                            f"{option} is an option of the command: put it after it "
                            f"(mpicons {command} {option} ...; 'mpicons {command} --help' lists them)"
                        )
                    self.error(
                        f"unrecognized arguments: {given[0]}{_suggestion([given[0]], known)}; "
                        f"options go after the command (mpicons {command} --help lists them)"
                    )
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            first = next((extra.partition("=")[0] for extra in extras if extra.startswith("-")), "")
            why = f"; {first} {self.refused_options[first]}" if first in self.refused_options else ""
            self.error(f"unrecognized arguments: {' '.join(extras)}{_suggestion(extras, self._option_string_actions)}{why}")
        return parsed, extras

    def _print_message(self, message: str, file: Any = None) -> None:
        if launcher_rank() == 0 and message:
            say(message, file or sys.stderr, end="")

    def _command_names(self) -> list[str]:
        actions = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
        return [name for action in actions for name in action.choices]

    def _command_parser(self, command: str) -> argparse.ArgumentParser:
        actions = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
        return next(action.choices[command] for action in actions if command in action.choices)

    def error(self, message: str) -> NoReturn:
        typo = re.match(r"argument command: invalid choice: '([^']*)'", message)
        if typo is not None:  # a misspelt command: the closest one
            close = difflib.get_close_matches(typo.group(1), self._command_names(), n=1, cutoff=0.6)
            message += f" (did you mean {close[0]}?)" if close else ""
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _suggestion(extras: Sequence[str], known: Iterable[str]) -> str:
    """`` (did you mean --force?)`` for the first unknown option: the options it begins, else the closest."""
    typed = next((extra.partition("=")[0] for extra in extras if extra.startswith("-")), None)
    if typed is None:
        return ""
    long_options = sorted(option for option in known if option.startswith("--"))
    close = [o for o in long_options if o.startswith(typed)] or difflib.get_close_matches(typed, long_options, n=1, cutoff=0.75)
    return f" (did you mean {' or '.join(close[:3])}?)" if close else ""


def say(text: str, stream: IO[str] | None = None, end: str = "\n") -> None:
    """Print and flush; a reader that went away (``| head``) silences further output instead of failing."""
    stream = sys.stdout if stream is None else stream
    try:
        stream.write(text + end)
        stream.flush()
    except BrokenPipeError:
        _silence(stream)


def _silence(stream: IO[str]) -> None:
    """Point a closed stream at /dev/null, so neither later writes nor the exit-time flush fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


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


def _seconds(text: str) -> float:
    """An argparse type for a number of seconds, 0 or more (a negative or NaN is a usage error, not "off")."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or a positive number of seconds (got {text})")
    return value


#: The default buffer size as the options are written (``32M``).
_BUFFER_SIZE_TEXT = f"{DEFAULT_BUFFER_SIZE >> 20}M"
_MAPPING_HELP = "tensor → output file: {name: index} JSON or a model.safetensors.index.json"
_SPLIT_HELP = "work split over ranks (default: %(default)s)"
_INPUT_HELP = "the sharded checkpoint: shard-RRRRR-model-IIIII-of-NNNNN.safetensors files, or .metadata and .distcp files"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mpicons",
        description="Consolidate sharded (DCP) safetensors checkpoints into Hugging Face checkpoints, MPI-parallel.",
    )
    parser.add_argument("--version", action="version", version=f"mpicons {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("consolidate", help="consolidate INPUT_DIR into OUTPUT_DIR")
    run.add_argument("input_dir", help=_INPUT_HELP + " (a directory or s3://BUCKET/PREFIX)")
    run.add_argument(
        "output_dir", help="where model-IIIII-of-NNNNN.safetensors and the index go (a directory or s3://BUCKET/PREFIX)"
    )
    _add_job_options(run)
    run.set_defaults(func=_cmd_consolidate)

    demo = _add_demo_command(commands)
    demo.refused_options = dict.fromkeys(
        set(run._option_string_actions) - set(demo._option_string_actions),
        "is an option of mpicons consolidate, not of the demo, which checks what it makes against its own sample",
    )

    check = commands.add_parser("verify", help="check a consolidated checkpoint (files, index; values with --against)")
    check.add_argument(
        "output_dir", help="directory of model-IIIII-of-NNNNN.safetensors files and the index (or an HDF5 output's model.h5)"
    )
    check.add_argument("--against", metavar="DIR", help="also compare every tensor with the sharded checkpoint in DIR")
    check.add_argument(
        "--buffer-size",
        type=parse_size,
        default=DEFAULT_BUFFER_SIZE,
        metavar="SIZE",
        help=f"memory per rank for comparing blocks (default: {_BUFFER_SIZE_TEXT})",
    )
    check.add_argument("--dtype", choices=DTYPES, help="the output was written with --dtype: convert the shards alike")
    _add_selection_options(check)
    check.add_argument("--json", metavar="FILE", help="write the report as JSON ('-': to standard output)")
    check.add_argument("-q", "--quiet", action="store_true", help="print only the problems")
    check.add_argument(
        "--follow-links",
        action="store_true",
        help="accept symbolic links to regular files (a Hugging Face cache snapshot); otherwise a link is a problem",
    )
    check.set_defaults(func=_cmd_verify)

    _add_inspect_command(commands)
    return parser


def _add_demo_command(commands: Any) -> _Parser:
    """``mpicons demo``: the sample written, then consolidated with the job's options."""
    demo = commands.add_parser("demo", help="write the built-in sample sharded checkpoint and consolidate it")
    demo.add_argument(
        "directory",
        nargs="?",
        default="mpicons-demo",
        help="a new or empty directory, or one the demo wrote before (default: %(default)s)",
    )
    demo.add_argument("--size", type=parse_size, default=0, help="approximate checkpoint size, e.g. 1GB (default: small)")
    demo.add_argument(
        "--distcp",
        action="store_true",
        help="write the sample in DCP's default format (.metadata + .distcp) instead of DCP's Hugging Face layout",
    )
    demo.add_argument(
        "--serialization",
        choices=_SERIALIZATIONS,
        help="how the .distcp files hold tensors (implies --distcp; default: torch_save, as torch.save does)",
    )
    _add_run_options(demo)  # the sample is checked against its own tensors: nothing that renames, converts or selects
    demo.set_defaults(func=_cmd_demo)
    return demo


def _add_inspect_command(commands: Any) -> None:
    """``mpicons inspect``: the plan's options only, since nothing is written."""
    look = commands.add_parser("inspect", help="show tensors, shards, problems and each rank's work, writing nothing")
    look.add_argument("input_dir", help=_INPUT_HELP)
    look.add_argument("--ranks", type=_int_at_least(1), metavar="N", help="plan for N ranks (default: this job's size)")
    look.add_argument("--mapping", metavar="FILE", help=_MAPPING_HELP)
    look.add_argument("--split", choices=SPLITS, default=SPLITS[0], help=_SPLIT_HELP)
    look.add_argument("--dtype", choices=DTYPES, help="plan with floating-point tensors converted")
    look.add_argument("--max-shard-size", type=parse_size, metavar="SIZE", help="plan a Hugging Face re-sharding, e.g. 5GB")
    _add_selection_options(look)
    look.add_argument(
        "--json", metavar="FILE", help="write the full report as JSON ('-': to standard output, instead of the table)"
    )
    look.add_argument(
        "--limit",
        type=_int_at_least(0),
        default=50,
        metavar="N",
        help="rows per list in the table, 0 for all (default: %(default)s)",
    )
    look.set_defaults(func=_cmd_inspect)


def _add_selection_options(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="GLOB",
        help="keep only tensors whose state-dict name matches GLOB (repeatable; default: all)",
    )
    cmd.add_argument(
        "--exclude", action="append", default=[], metavar="GLOB", help="leave out tensors whose name matches GLOB (repeatable)"
    )
    cmd.add_argument(
        "--strip-prefix", metavar="PREFIX", help="remove PREFIX from tensor names that start with it (e.g. 'model.')"
    )
    cmd.add_argument(
        "--adapter",
        metavar="NAME|FILE",
        help="map a trainer's names and layouts to Hugging Face's: 'torchtitan' or 'megatron' (built-in rules, by "
        "config.json's model_type) or a rule file (docs/adapter-rules.md); a Megatron checkpoint chooses 'megatron', "
        "'none' keeps the saved names",
    )
    cmd.add_argument(
        "--model-type",
        metavar="TYPE",
        help="the model_type of a Megatron run whose config.json mpicons derives, where its args cannot tell "
        "(llama, qwen3, qwen3_moe, mixtral)",
    )
    cmd.add_argument(
        "--hf-assets",
        metavar="DIR",
        help="the model's Hugging Face files (config.json, tokenizer, ...): published with the weights; "
        "its model.safetensors.index.json, if any, decides the output files",
    )
    cmd.add_argument(
        "--s3-endpoint",
        metavar="URL",
        help="the S3 API endpoint for s3:// inputs and outputs, e.g. http://127.0.0.1:9000 "
        "(default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS)",
    )
    cmd.add_argument(
        "--expect-ranks",
        type=_int_at_least(1),
        metavar="N",
        help="the checkpoint was saved by N training ranks: its shard files must come from exactly those "
        "(catches a checkpoint missing its last rank's files, which DCP's Hugging Face layout cannot show)",
    )
    cmd.add_argument(
        "--keep-dtype",
        action="append",
        default=[],
        metavar="GLOB",
        help="with --dtype: tensors whose output name matches GLOB keep their saved dtype (repeatable)",
    )


def _selection(args: argparse.Namespace) -> dict[str, Any]:
    """The tensor selection and the adapter, the same options for consolidate, inspect and verify."""
    return {
        "include": tuple(args.include),
        "exclude": tuple(args.exclude),
        "strip_prefix": args.strip_prefix,
        "adapter": args.adapter,
        "model_type": args.model_type,
        "hf_assets": args.hf_assets,
        "keep_dtype": tuple(args.keep_dtype),
        "s3_endpoint": args.s3_endpoint,
        "expect_ranks": args.expect_ranks,
    }


def _add_job_options(cmd: argparse.ArgumentParser) -> None:
    """``consolidate``'s options: what to make of the checkpoint, then how to run (:func:`_add_run_options`)."""
    cmd.add_argument("--mapping", metavar="FILE", help=_MAPPING_HELP)
    cmd.add_argument("--dtype", choices=DTYPES, help="convert floating-point tensors (round to nearest even)")
    _add_selection_options(cmd)
    cmd.add_argument(
        "--format",
        dest="output_format",
        choices=FORMATS,
        default=FORMATS[0],
        help="output: Hugging Face safetensors files (default) or one HDF5 file (needs h5py)",
    )
    cmd.add_argument(
        "--s3-part-size",
        type=parse_size,
        default=DEFAULT_PART_SIZE,
        metavar="SIZE",
        help=f"part size of an s3:// output's multipart uploads (default: {DEFAULT_PART_SIZE >> 20}M)",
    )
    _add_run_options(cmd)


def _add_run_options(cmd: argparse.ArgumentParser) -> None:
    """The options of a consolidation that apply to any checkpoint: ``consolidate``'s and ``demo``'s."""
    cmd.add_argument(
        "--max-shard-size",
        type=parse_size,
        metavar="SIZE",
        help="re-shard like Hugging Face, e.g. 5GB (10^9 bytes), instead of following the shard names "
        "(.distcp inputs, which name no files: 5GB unless given)",
    )
    cmd.add_argument(
        "--gather-to",
        type=_int_at_least(0),
        metavar="RANK",
        help="write every output on this rank only (its local OUTPUT_DIR); data moves over MPI",
    )
    cmd.add_argument("--split", choices=SPLITS, default=SPLITS[0], help=_SPLIT_HELP)
    cmd.add_argument("--io", choices=BACKENDS, default=BACKENDS[0], help="output backend (default: %(default)s)")
    cmd.add_argument("--hint", type=_hint, action="append", default=[], metavar="KEY=VALUE", help="MPI-IO hint (repeatable)")
    cmd.add_argument(
        "--buffer-size",
        type=parse_size,
        default=DEFAULT_BUFFER_SIZE,
        metavar="SIZE",
        help=f"memory per rank for assembling blocks (default: {_BUFFER_SIZE_TEXT})",
    )
    cmd.add_argument("--force", action="store_true", help="replace an existing checkpoint in OUTPUT_DIR")
    cmd.add_argument(
        "--break-lock",
        action="store_true",
        help="take over OUTPUT_DIR although another run's lock is there (only when that run is dead)",
    )
    cmd.add_argument(
        "--no-sync",
        dest="sync",
        action="store_false",
        help="do not flush outputs to stable storage (scratch data, benchmarks): faster, not power-loss safe",
    )
    cmd.add_argument(
        "--progress",
        type=_seconds,
        default=DEFAULT_PROGRESS_SECONDS,
        metavar="N",
        help="progress line every N seconds on standard error (a bar on a terminal); 0 turns it off (default: %(default)s)",
    )
    cmd.add_argument("--stats-json", metavar="FILE", help="write the timing report as JSON ('-': to standard output)")
    cmd.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    cmd.add_argument("-v", "--verbose", action="store_true", help="print per-rank detail")


def job_options(args: argparse.Namespace) -> Options:
    """The library's options object from the parsed command line (every field has an option; a command
    without some of them, ``demo``, leaves those fields at their defaults).

    ``MPICONS_PROGRESS`` is checked here too, so a wrong value stops the run before any work."""
    from ..job.progress import progress_choice

    progress_choice()
    planned: dict[str, Any] = {}
    if hasattr(args, "mapping"):
        planned = dict(
            mapping=args.mapping,
            dtype=args.dtype,
            output_format=args.output_format,
            s3_part_size=args.s3_part_size,
            **_selection(args),
        )
    return Options(
        split=args.split,
        io=args.io,
        buffer_size=args.buffer_size,
        hints=dict(args.hint),
        force=args.force,
        break_lock=args.break_lock,
        progress=None if args.quiet or args.progress == 0 else args.progress,
        max_shard_size=args.max_shard_size,
        gather_to=args.gather_to,
        sync=args.sync,
        verbose=args.verbose,
        **planned,
    )


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
    from ..core.reports import count_of, fit_items, skipped_parts, wrapped

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
    names = list(result.files) if len(result.files) < 4 else [count_of(len(result.files), "file")]
    index = [result.index_file] if result.index_file else []
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
    from ..job.consolidation import check_buffer_fits, check_options, consolidate
    from ..job.progress import report_columns
    from .demo import DemoDirectory
    from .sample import SampleConfig, check_sample, sample_file_names, write_sample

    _check_report_paths(comm, args.stats_json)
    options = job_options(args)  # checked, as consolidate checks them, before anything is written
    check_options(comm, options)
    check_buffer_fits(comm, options.buffer_size)
    config = SampleConfig.sized(args.size) if args.size else SampleConfig()
    distcp = args.serialization or (_SERIALIZATIONS[0] if args.distcp else None)
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
    place.record_output(comm, [*result.files, *([result.index_file] if result.index_file else [])])
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
        **_selection(args),
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
        **_selection(args),
    )
    if comm.rank == 0 and args.json != "-":
        say(report.table(limit=args.limit))
    write_report(comm, args.json, report.to_dict)
    return 0 if report.ok else 2


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
        return int(args.func(args, comm))
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


__all__ = ["main", "run", "parse_size", "launcher_rank", "check_report_path", "write_report", "InputError"]
