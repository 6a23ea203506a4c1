"""The command line's arguments: the parser of every command, sizes and other option types, and the
:class:`~mpicons.core.options.Options` they make (no MPI here: parsing happens before MPI starts).

Usage errors and help are printed once per job (by the rank the launcher calls 0), options are never
abbreviated, and an unknown option is answered with the closest ones the command has.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import IO, Any, NoReturn

from ..core.options import BACKENDS, DEFAULT_BUFFER_SIZE, DEFAULT_PROGRESS_SECONDS, DTYPES, FORMATS, SPLITS, Options
from ..core.version import __version__
from ..io.s3_upload_plan import DEFAULT_PART_SIZE
from ..trainers import adapter_names, derived_model_types

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
#: How a ``.distcp`` sample holds its tensors (``demo --serialization``).
SERIALIZATIONS = ("torch_save", "safetensors")


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
_INPUT_HELP = (
    "the sharded checkpoint: torch DCP (shard-RRRRR-model-IIIII-of-NNNNN.safetensors files, or .metadata and "
    ".distcp files), or a trainer's run, step or iteration folder (torchtitan, Megatron-Core torch_dist, DeepSpeed "
    "ZeRO, verl, accelerate), recognised by its files"
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mpicons",
        description="Consolidate sharded training checkpoints (torch DCP, torchtitan, Megatron-Core, DeepSpeed ZeRO, "
        "verl, accelerate) into Hugging Face model directories, and shard a Hugging Face model into a Megatron-Core "
        "checkpoint, MPI-parallel.",
    )
    parser.add_argument("--version", action="version", version=f"mpicons {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("consolidate", help="consolidate INPUT_DIR into OUTPUT_DIR")
    run.add_argument("input_dir", help=_INPUT_HELP + " (a directory or s3://BUCKET/PREFIX)")
    run.add_argument(
        "output_dir", help="where model-IIIII-of-NNNNN.safetensors and the index go (a directory or s3://BUCKET/PREFIX)"
    )
    _add_job_options(run)

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

    _add_inspect_command(commands)
    _add_shard_command(commands)
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
        choices=SERIALIZATIONS,
        help="how the .distcp files hold tensors (implies --distcp; default: torch_save, as torch.save does)",
    )
    _add_run_options(demo)  # the sample is checked against its own tensors: nothing that renames, converts or selects
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


def _add_shard_command(commands: Any) -> None:
    """``mpicons shard``: a Hugging Face model written as a trainer's checkpoint (the other direction)."""
    shard = commands.add_parser("shard", help="write a Hugging Face model as a Megatron-Core torch_dist checkpoint")
    shard.add_argument(
        "model_dir", help="a Hugging Face model: a directory or s3://BUCKET/PREFIX (model*.safetensors, config.json)"
    )
    shard.add_argument("output_dir", help="the Megatron run directory to write (latest_checkpointed_iteration.txt, release/)")
    shard.add_argument("--to", choices=["megatron"], default="megatron", help="the checkpoint format (default: %(default)s)")
    for flag, what in (("--tp", "tensor"), ("--pp", "pipeline"), ("--ep", "expert")):
        shard.add_argument(
            flag, type=_int_at_least(1), default=1, metavar="N", help=f"{what}-parallel size the run uses (default: 1)"
        )
    shard.add_argument(
        "--spec",
        choices=["te", "local"],
        default="te",
        help="the layer spec the run builds (Megatron-LM's --transformer-impl): the norms' names (default: %(default)s)",
    )
    shard.add_argument(
        "--make-vocab-size-divisible-by",
        type=_int_at_least(1),
        default=128,
        metavar="N",
        help="as Megatron-LM's flag: the vocabulary is padded to a multiple of N x TP (default: %(default)s)",
    )
    shard.add_argument("--hf-assets", metavar="DIR", help="the directory holding config.json (default: the model's)")
    shard.add_argument("--s3-endpoint", metavar="URL", help="for an s3:// model: the S3 API's endpoint (default: boto3's)")
    shard.add_argument("--force", action="store_true", help="replace a tracker file left without a checkpoint")
    shard.add_argument("--no-sync", action="store_true", help="do not flush to stable storage before publishing")
    shard.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")


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
        "--main-params",
        action="store_true",
        help="take the weights from the optimizer's fp32 main parameters where the checkpoint keeps them per "
        "parameter (a Megatron run: optimizer.state.fp32_param.*), not from the model's (bf16) weights",
    )
    cmd.add_argument(
        "--adapter",
        metavar="NAME|FILE",
        help=f"map a trainer's names and layouts to Hugging Face's: {' or '.join(map(repr, adapter_names()))} (built-in "
        "rules, by config.json's model_type; docs/model-families.md) or a rule file (docs/adapter-rules.md); a Megatron "
        "checkpoint chooses 'megatron', 'none' keeps the saved names",
    )
    cmd.add_argument(
        "--model-type",
        metavar="TYPE",
        help="the model_type of a Megatron run whose config.json mpicons derives, where its args cannot tell "
        f"({', '.join(t.partition(':')[2] for t in derived_model_types())})",
    )
    cmd.add_argument(
        "--hf-assets",
        metavar="DIR",
        help="the model's Hugging Face files (config.json, tokenizer, ...), a directory or an s3:// prefix: its config "
        "is checked against the weights (consolidate also publishes a model's files from it with the weights: "
        "docs/assets.md); its model.safetensors.index.json, if any, decides the output files",
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
    _add_value_options(cmd)


def _add_value_options(cmd: argparse.ArgumentParser) -> None:
    """What the values become on the way: kept out of ``--dtype``, a LoRA adapter merged."""
    cmd.add_argument(
        "--keep-dtype",
        action="append",
        default=[],
        metavar="GLOB",
        help="with --dtype: tensors whose output name matches GLOB keep their saved dtype (repeatable)",
    )
    cmd.add_argument(
        "--lora",
        metavar="DIR",
        help="merge this peft LoRA adapter (adapter_config.json, adapter_model.safetensors) into the base model read "
        "from the input, exactly as peft's merge_and_unload; a folder with adapter_config.json alone gives the "
        "alpha of LoRA weights the checkpoint holds (docs/lora-fp8.md)",
    )
    cmd.add_argument(
        "--no-merge",
        action="store_true",
        help="a checkpoint holding LoRA weights itself (a verl LoRA actor): write its base unmerged and the "
        "LoRA weights as a peft adapter folder, OUT/lora_adapter/",
    )


def selection(args: argparse.Namespace) -> dict[str, Any]:
    """The tensor selection and the adapter, the same options for consolidate, inspect and verify."""
    return {
        "include": tuple(args.include),
        "exclude": tuple(args.exclude),
        "strip_prefix": args.strip_prefix,
        "main_params": args.main_params,
        "adapter": args.adapter,
        "model_type": args.model_type,
        "hf_assets": args.hf_assets,
        "keep_dtype": tuple(args.keep_dtype),
        "lora": args.lora,
        "no_merge": args.no_merge,
        "s3_endpoint": args.s3_endpoint,
        "expect_ranks": args.expect_ranks,
    }


def _add_job_options(cmd: argparse.ArgumentParser) -> None:
    """``consolidate``'s options: what to make of the checkpoint, then how to run (:func:`_add_run_options`)."""
    cmd.add_argument("--mapping", metavar="FILE", help=_MAPPING_HELP)
    cmd.add_argument(
        "--dtype",
        choices=DTYPES,
        help="convert floating-point tensors (round to nearest even); block-FP8 weights are dequantized; fp8: "
        "the decoder layers' linear weights quantized to E4M3 with a scale per 128x128 block (docs/lora-fp8.md)",
    )
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
        "--no-manifest",
        dest="manifest",
        action="store_false",
        help="publish no SHA256SUMS beside the weights (saves hashing every file once)",
    )
    cmd.add_argument(
        "--restart",
        action="store_true",
        help="discard what a stopped earlier run of this command left, instead of continuing from it",
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
            **selection(args),
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
        manifest=args.manifest,
        restart=args.restart,
        verbose=args.verbose,
        **planned,
    )


__all__ = ["SERIALIZATIONS", "build_parser", "job_options", "launcher_rank", "parse_size", "say", "selection"]
