"""One options object for ``consolidate``, ``inspect`` and the command line (no MPI here)."""

from __future__ import annotations

import inspect
import os
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .errors import InputError
from .reports import human_size

#: Every choice and default of the job's options, here once: ``Options``, its checks and the command line use them.
#: The first of each tuple is the default.
SPLITS = ("bytes", "files")
BACKENDS = ("posix", "mpiio")
FORMATS = ("safetensors", "hdf5")
#: ``--dtype`` choices and the safetensors dtype each converts floating-point tensors to.
DTYPE_TARGETS = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
#: ``fp8``: the decoder layers' linear weights block-quantized to E4M3 with their scales (the rest as saved).
DTYPES = (*DTYPE_TARGETS, "fp8")
DEFAULT_BUFFER_SIZE = 32 << 20
#: The command line's seconds between progress reports (the library is silent unless asked).
DEFAULT_PROGRESS_SECONDS = 10.0
#: How progress is shown: ``MPICONS_PROGRESS`` chooses one, unset decides from the terminal.
PROGRESS_STYLES = ("bar", "lines")
PROGRESS_VARIABLE = "MPICONS_PROGRESS"
#: Background I/O threads per rank come from the environment, as a job's scripts set them.
IO_THREADS_VARIABLE = "MPICONS_IO_THREADS"
DEFAULT_IO_THREADS = 1

#: The smallest part an S3 multipart upload accepts (all parts but the last).
MIN_PART = 5 << 20
#: The largest part, and the most parts, of one S3 multipart upload.
MAX_PART = 5 << 30
MAX_PARTS = 10_000
#: Default part size: large enough for throughput, small enough that a few in flight fit any rank's memory.
DEFAULT_PART_SIZE = 64 << 20


def check_choice(value: object, choices: tuple[str, ...], what: str) -> None:
    """Refuse a value that is none of ``choices``, naming them (one wording for every option)."""
    if value not in choices:
        raise InputError(f"unknown {what} {value!r} (choose from {', '.join(choices)})")


def _listed(choices: tuple[str, ...]) -> str:
    """``a``, ``b`` or ``c``: the choices as the documentation names them."""
    quoted = [f"``{choice}``" for choice in choices]
    return f"{', '.join(quoted[:-1])} or {quoted[-1]}" if len(quoted) > 1 else quoted[0]


def io_threads_from_environment(environ: Mapping[str, str] | None = None) -> int:
    """``MPICONS_IO_THREADS`` as a count of threads (unset: one); read when an ``Options`` is made, not at import."""
    value = (os.environ if environ is None else environ).get(IO_THREADS_VARIABLE, "").strip()
    if not value:
        return DEFAULT_IO_THREADS
    if not value.isdigit():
        raise InputError(f"{IO_THREADS_VARIABLE}={value!r}: expected a whole number of threads (0: none)")
    return int(value)


def _option(default: Any, doc: str, factory: Callable[[], Any] | None = None, rank_local: bool = False) -> Any:
    """A field with its documentation kept where ``help(Options)`` and tools can read it; a
    ``rank_local`` one (machine tuning) may differ between the ranks of one job."""
    metadata = {"doc": doc, "rank_local": rank_local}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Options:
    """How a consolidation runs. Every field but ``io_threads`` is also a command-line option
    (``--buffer-size`` for ``buffer_size``, and so on); the defaults are the command line's."""

    mapping: str | os.PathLike[str] | Mapping[str, object] | None = _option(
        None,
        "Which tensor goes to which output file: a path to JSON or the parsed object, either torch's "
        '``fqn_to_index_mapping`` (``{name: index}``) or a Hugging Face index (``{"weight_map": {name: file}}``). '
        "None: from the shard names (DCP), or each tensor stays in its file (plain safetensors).",
    )
    split: str = _option(
        SPLITS[0],
        "How work is divided: ``bytes`` gives every rank an equal stretch of output bytes, cut at row "
        "boundaries; ``files`` deals whole output files round-robin (torch's policy).",
    )
    io: str = _option(
        BACKENDS[0], "Output backend: ``posix`` (pwrite, ``copy_file_range``) or ``mpiio`` (``MPI.File``, ``Write_at``)."
    )
    buffer_size: int = _option(
        DEFAULT_BUFFER_SIZE,
        "Bytes of buffers per rank for assembling blocks; memory per rank stays near this plus the "
        "rank's part of the plan, whatever the tensor sizes. Checked against the node's memory up front.",
    )
    hints: Mapping[str, str] = _option(
        None,
        'MPI-IO hints for ``io="mpiio"`` (e.g. ``{"striping_factor": "16"}``); applied when the files are created.',
        factory=dict,
    )
    force: bool = _option(
        False, "Replace a checkpoint already in the output directory (its files the new index does not name go too)."
    )
    break_lock: bool = _option(False, "Take over an output directory whose lock is held by a run that cannot be proven dead.")
    progress: float | None = _option(
        None, "Seconds between progress reports on rank 0's standard error (a bar on a watched terminal); None: silent."
    )
    verbose: bool = _option(False, "Progress lines name the slowest rank.")
    dtype: str | None = _option(
        None,
        f"{_listed(DTYPES)}: convert floating-point tensors (round to nearest even); block-FP8 weights (beside "
        "their ``_scale_inv``) are dequantized. ``fp8``: the decoder layers' 2-D linear weights are quantized to "
        "E4M3 with a float32 scale per 128×128 block, the rest kept as saved. None: as saved.",
    )
    max_shard_size: int | None = _option(
        None, "Re-shard like Hugging Face: files filled in order up to this many bytes (``5GB`` = 5·10⁹)."
    )
    output_format: str = _option(
        FORMATS[0], "``safetensors`` (Hugging Face files and index) or ``hdf5`` (one ``model.h5``; needs h5py)."
    )
    gather_to: int | None = _option(
        None, "Write every output on this rank only (its local output directory); data moves over MPI."
    )
    sync: bool = _option(True, "Flush outputs to stable storage before publishing them (``False``: faster, not power-loss safe).")
    manifest: bool = _option(
        True, "Publish ``SHA256SUMS`` (every published file's SHA-256, ``sha256sum -c`` format) with the weights."
    )
    restart: bool = _option(
        False,
        "Discard what an earlier, stopped run of the same command left to continue from (by default a rerun "
        "keeps its durable blocks when the inputs, options and mpicons version are the same).",
    )
    include: tuple[str, ...] = _option(
        (), "Glob patterns (``fnmatch``, on the full state-dict name): keep only the tensors matching one. Empty: all."
    )
    exclude: tuple[str, ...] = _option((), "Glob patterns: leave out the tensors matching one (after ``include``).")
    strip_prefix: str | None = _option(
        None, "Remove this prefix from the names that start with it (``model.`` for accelerate's FSDP checkpoints)."
    )
    main_params: bool = _option(
        False,
        "Take each weight from the optimizer's fp32 main parameters where the checkpoint keeps them per parameter "
        "(a Megatron run saved with a mixed-precision optimizer: ``optimizer.state.fp32_param.*``) instead of the "
        "model's weights (bf16 in a ``--bf16`` run): the output is fp32 unless ``dtype`` says otherwise.",
    )
    adapter: str | None = _option(
        None,
        "Map a training framework's names and layouts to Hugging Face's: the name of a trainer with built-in "
        "rules (the trainers' registry lists them; its families, chosen by ``config.json``'s ``model_type``, are "
        "its rule files; docs/model-families.md) or a path to a rule file (docs/adapter-rules.md). "
        "None: tensors keep their saved names and layouts, unless the input is recognisably a trainer's whose "
        "adapter is then chosen. ``none``: the saved names and layouts, whatever the input.",
    )
    hf_assets: str | os.PathLike[str] | None = _option(
        None,
        "A directory (or an ``s3://`` prefix) of the model's Hugging Face files (``config.json``, tokenizer files, "
        "``generation_config.json``; "
        "optionally ``model.safetensors.index.json``, whose ``weight_map`` then decides the output files). They are "
        "published with the weights, in the same transaction. Required by an adapter whose rules read the config. "
        "Every output tensor the model has must have the model's shape (also with a ``config.json`` beside the "
        "input when this is None): a checkpoint missing a training rank's files is refused.",
    )
    expect_ranks: int | None = _option(
        None,
        "How many training ranks saved the checkpoint: its shard files must come from exactly these ranks "
        "(``shard-RRRRR-*`` numbered 1..N as torch names them, ``__R_*.distcp`` 0..N-1), else bad input naming "
        "the missing ranks. DCP's Hugging Face layout records no full shapes, so this catches a checkpoint "
        "missing its last rank's files when no ``config.json`` is at hand. None: not checked.",
    )
    model_type: str | None = _option(
        None,
        "The Hugging Face ``model_type`` of a checkpoint whose config mpicons derives (a Megatron run without "
        "``hf_assets``), where the run's arguments cannot tell it: one of the trainer's ``derived_model_types`` "
        "(``mpicons consolidate --help`` lists them).",
    )
    keep_dtype: tuple[str, ...] = _option(
        (), "Glob patterns (on the output name): with ``dtype``, tensors matching one keep their saved dtype."
    )
    lora: str | os.PathLike[str] | None = _option(
        None,
        "A peft LoRA adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) merged into the base "
        "model the input holds, as peft's ``merge_and_unload`` does (in float32, rounded once); a folder with "
        "``adapter_config.json`` alone gives the alpha of LoRA weights the checkpoint itself holds. None: LoRA "
        "weights the checkpoint holds are merged with the alpha its trainer recorded (verl's ``lora_train_meta.json``).",
    )
    no_merge: bool = _option(
        False,
        "A checkpoint holding LoRA weights itself (a verl LoRA actor): write its base unmerged and the LoRA "
        "weights beside it as a peft adapter folder, ``lora_adapter/`` (a directory output). False: merged.",
    )
    s3_endpoint: str | None = _option(
        None,
        "The S3 API endpoint for ``s3://`` locations (e.g. ``http://127.0.0.1:9000``). None: boto3's own "
        "``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, else AWS.",
    )
    s3_part_size: int = _option(
        DEFAULT_PART_SIZE,
        "Bytes per part of an ``s3://`` output's multipart uploads (at least 10 MiB; grown for files that would "
        "need more than 10,000 parts). A rank holds up to three parts in memory besides its buffer.",
    )
    io_threads: int = _option(
        None,
        f"Background threads per rank for posix writes and kernel copies, overlapping the next block's assembly "
        f"(0: none). Not a command-line option: ``{IO_THREADS_VARIABLE}`` gives it, read when the options are made.",
        factory=io_threads_from_environment,
        rank_local=True,
    )

    def check(self, ranks: int) -> None:
        """Refuse options that are wrong whatever the checkpoint (the same on every rank)."""
        check_choice(self.output_format, FORMATS, "output format")
        check_choice(self.split, SPLITS, "split")
        check_choice(self.io, BACKENDS, "I/O backend")
        if self.dtype is not None:
            check_choice(self.dtype, DTYPES, "--dtype")
        if self.buffer_size <= 0:
            raise InputError(f"--buffer-size must be positive (got {self.buffer_size})")
        if isinstance(self.io_threads, bool) or not isinstance(self.io_threads, int) or self.io_threads < 0:
            raise InputError(f"{IO_THREADS_VARIABLE} must be a whole number of threads, 0 or more (got {self.io_threads!r})")
        if not 2 * MIN_PART <= self.s3_part_size <= MAX_PART:
            raise InputError(
                f"--s3-part-size {human_size(self.s3_part_size)} is not between {2 * MIN_PART >> 20} MiB and "
                f"{MAX_PART >> 30} GiB, S3's limits on a part (e.g. --s3-part-size 64M)"
            )
        if self.progress is not None and not self.progress >= 0:
            raise InputError(f"progress must be a number of seconds, 0 or more, or None for none (got {self.progress!r})")
        if self.max_shard_size is not None and self.max_shard_size <= 0:
            raise InputError(f"--max-shard-size must be positive (got {self.max_shard_size})")
        if self.mapping is not None and self.max_shard_size is not None:
            raise InputError("--mapping and --max-shard-size both decide the output files: give one")
        for pattern in (*self.include, *self.exclude, *self.keep_dtype):
            if not isinstance(pattern, str) or not pattern:
                raise InputError(f"--include/--exclude/--keep-dtype patterns are non-empty strings (got {pattern!r})")
        if self.keep_dtype and self.dtype is None:
            raise InputError("--keep-dtype keeps tensors out of a --dtype conversion: give --dtype too")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise InputError(f"--adapter is a built-in adapter's name or a rule file's path (got {self.adapter!r})")
        if self.main_params and (self.include or self.strip_prefix is not None):
            raise InputError("--main-params chooses the tensors and their names itself: leave out --include and --strip-prefix")
        if self.model_type is not None and (not isinstance(self.model_type, str) or not self.model_type):
            raise InputError(f"--model-type is a Hugging Face model_type (got {self.model_type!r})")
        if self.strip_prefix is not None and (not isinstance(self.strip_prefix, str) or not self.strip_prefix):
            raise InputError(f"--strip-prefix must be a non-empty string (got {self.strip_prefix!r})")
        if self.expect_ranks is not None and (
            isinstance(self.expect_ranks, bool) or not isinstance(self.expect_ranks, int) or self.expect_ranks < 1
        ):
            raise InputError(f"--expect-ranks must be a positive number of training ranks (got {self.expect_ranks!r})")
        if self.gather_to is not None:
            if not 0 <= self.gather_to < ranks:
                raise InputError(f"--gather-to {self.gather_to}: no such rank (the job has {ranks})")
            if self.io != "posix":
                raise InputError("--gather-to writes on one rank's local disk: use --io posix")

    # Each group of the options, as the layer that needs only it is handed it (every field is in one).
    @property
    def selection(self) -> Selection:
        return Selection(**self._fields_of(Selection))

    @property
    def publishing(self) -> Publishing:
        return Publishing(**self._fields_of(Publishing))

    @property
    def storage(self) -> Storage:
        return Storage(**self._fields_of(Storage))

    @property
    def tuning(self) -> Tuning:
        return Tuning(**self._fields_of(Tuning))

    def _fields_of(self, group: type) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(group)}

    def with_changes(self, **changes: Any) -> Options:
        """A copy with some fields changed; unknown names are an error (a misspelt keyword argument)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"unknown option {unknown[0]!r} (options: {', '.join(sorted(known))})")
        for name in ("include", "exclude", "keep_dtype"):  # one pattern or several
            if isinstance(changes.get(name), str):
                changes[name] = (changes[name],)
            elif name in changes:
                changes[name] = tuple(changes[name])
        return replace(self, **changes)


@dataclass(frozen=True)
class Selection:
    """The input's side of the options: which tensors, under which names, through which adapter."""

    include: tuple[str, ...]
    exclude: tuple[str, ...]
    strip_prefix: str | None
    main_params: bool
    adapter: str | None
    hf_assets: str | os.PathLike[str] | None
    model_type: str | None
    expect_ranks: int | None
    lora: str | os.PathLike[str] | None


@dataclass(frozen=True)
class Publishing:
    """The output's side: its files and their names, dtypes and format, and how they are published."""

    mapping: str | os.PathLike[str] | Mapping[str, object] | None
    max_shard_size: int | None
    output_format: str
    dtype: str | None
    keep_dtype: tuple[str, ...]
    no_merge: bool
    force: bool
    break_lock: bool
    sync: bool
    manifest: bool
    restart: bool


@dataclass(frozen=True)
class Storage:
    """Object storage: the S3 API's endpoint and the parts of an output's multipart uploads."""

    s3_endpoint: str | None
    s3_part_size: int


@dataclass(frozen=True)
class Tuning:
    """How the work is done, not what it makes: the split, the I/O, the buffers, progress."""

    split: str
    io: str
    buffer_size: int
    hints: Mapping[str, str]
    io_threads: int
    gather_to: int | None
    progress: float | None
    verbose: bool


def _documented(cls: type) -> str:
    """The class docstring followed by every field and its documentation, as ``help()`` shows them."""
    entries = []
    for option in fields(cls):
        doc = textwrap.fill(
            option.metadata["doc"], width=92, initial_indent="        ", subsequent_indent="        ", break_on_hyphens=False
        )
        entries.append(f"    {option.name}\n{doc}")
    return f"{inspect.cleandoc(cls.__doc__ or '')}\n\nFields:\n" + "\n".join(entries)


Options.__doc__ = _documented(Options)

__all__ = [
    "Options",
    "Publishing",
    "Selection",
    "Storage",
    "Tuning",
    "DEFAULT_BUFFER_SIZE",
    "DEFAULT_PROGRESS_SECONDS",
    "DEFAULT_IO_THREADS",
    "SPLITS",
    "BACKENDS",
    "FORMATS",
    "DTYPES",
    "DTYPE_TARGETS",
    "check_choice",
    "PROGRESS_STYLES",
    "PROGRESS_VARIABLE",
    "IO_THREADS_VARIABLE",
    "io_threads_from_environment",
]
