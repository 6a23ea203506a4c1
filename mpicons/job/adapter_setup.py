"""A model adapter in the job: the trainers asked whether the input is theirs, the rules and the
model's config read once and shared, then the scan's pieces re-expressed as the Hugging Face tensors
(per tensor, the same on every rank; per piece, numpy).

The conversion itself is pure (:mod:`mpicons.adaptation.apply`) and knows no trainer: what a trainer's
leaf (:mod:`mpicons.trainers`) says of the input (the directory to read, the classes its metadata
may name, a prefix to remove, a derived config) is handed down as parameters. Here are the parts
that read files (on one rank, the result or the error reaching every rank) and the facts reduced
again over the communicator for the converted pieces.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ..adaptation.apply import Conversion, convert_pieces, converted_declared, converted_order, converted_width, plan_conversion
from ..adaptation.rules import RuleSet, choose_rules
from ..comm.agreement import Comm, agree_on
from ..core.errors import InputError
from ..core.facts import FACT_KEY, piece_destinations
from ..core.options import Options, Selection
from ..core.safetensors_codec import DTYPES
from ..formats.unpickling import NOTHING, AllowList
from ..io.places import LocalPlace, read_small
from ..io.s3 import is_s3
from ..trainers import TRAINERS, ArchiveFormat, Found, Settled, Trainer, adapter_names, recognise, trainer
from .model_check import ModelConfig, load_model_config
from .scan import Scanned, reduce_facts
from .shares import chosen, select, without

if TYPE_CHECKING:
    from ..io.assets import HFAssets

#: ``--adapter none``: the saved names and layouts, even for an input whose trainer would choose its adapter.
NO_ADAPTER = "none"


@dataclass(frozen=True)
class Adapter:
    """What the options and the input ask of the model's files: the rules (None: no adapter), the assets
    (None: none; a config a trainer derived is one), the trainer's checkpoint recognised at the input,
    the classes its metadata may name, what the report says about them, and the model's config to check the
    output's shapes against (None: none given, derived or beside the input)."""

    rules: RuleSet | None
    assets: HFAssets | None
    found: Found | None = None
    allow: AllowList = NOTHING
    notes: tuple[str, ...] = ()
    model: ModelConfig | None = None

    @property
    def config(self) -> dict[str, object] | None:
        return None if self.assets is None else self.assets.config

    def directory(self, input_dir: str) -> str:
        """The directory to scan: the one the trainer found at ``input_dir`` (an iteration's), else ``input_dir``."""
        return input_dir if self.found is None else self.found.directory

    @property
    def archives(self) -> ArchiveFormat | None:
        """How the input's per-rank ``torch.save`` archives are read (None: it is DCP or safetensors)."""
        return None if self.found is None else TRAINERS[self.found.trainer].archives

    def strip_prefix(self, selection: Selection) -> str | None:
        """``--strip-prefix``, else the prefix the trainer's layout gives every name (NeMo's ``module.``)."""
        given = selection.strip_prefix
        return given if given is not None or self.found is None else self.found.strip_prefix

    def select(self, scanned: Scanned, selection: Selection) -> Scanned:
        """The tensors ``selection`` keeps, renamed (``--include``, ``--exclude``, ``--strip-prefix`` or the
        trainer's prefix); with ``--main-params``, the optimizer's fp32 main parameters under the weights' names."""
        if not selection.main_params:
            return select(scanned, selection.include, selection.exclude, self.strip_prefix(selection))
        trainer = None if self.found is None else TRAINERS[self.found.trainer]
        if trainer is None or not trainer.main_params_prefixes:
            raise InputError(
                "--main-params: only a Megatron run keeps the optimizer's fp32 main parameters per parameter "
                "(optimizer.state.fp32_param.*); leave out --main-params"
            )
        within = self.found.strip_prefix or ""  # type: ignore[union-attr]
        prefixes = [prefix + within for prefix in trainer.main_params_prefixes]
        prefix = next((p for p in prefixes if any(name.startswith(p) for name in scanned.names)), None)
        if prefix is None:
            flat = any(name.startswith("optimizer.distributed.") for name in scanned.names)
            why = (
                ": its distributed optimizer saved flat per-bucket buffers (dp_reshardable), which do not say which "
                "parameter each element belongs to" if flat else ""
            )  # fmt: skip
            raise InputError(
                f"--main-params: {scanned.directory} keeps no {'* or '.join(prefixes)}* tensors{why}; leave out "
                "--main-params for the model's own weights (or save with --dist-ckpt-optim-fully-reshardable, "
                "which keeps one fp32 tensor per parameter)"
            )
        return _main_params(select(scanned, (), selection.exclude), prefix, within)


def _main_params(scanned: Scanned, prefix: str, within: str) -> Scanned:
    """The optimizer's main parameters under the weights' names (``prefix`` removed), and the model's
    tensors that have none (buffers such as a router's expert bias, which no optimizer keeps; ``within``
    removed, NeMo's ``module.``); the rest of the optimizer's state left out."""
    names = scanned.names
    mains = {name[len(prefix) :] for name in names if name.startswith(prefix)}
    keep = [
        t for t, n in enumerate(names) if n.startswith(prefix) or not (n.startswith("optimizer.") or without(n, within) in mains)
    ]
    renamed = [without(names[t], prefix if names[t].startswith(prefix) else within) for t in keep]
    return chosen(scanned, keep, renamed, "--main-params")


def _read_rule_file(path: str) -> str:
    """A user's rule file: a regular file (links followed: it is the user's own), bounded, UTF-8."""
    if not os.path.lexists(path):
        raise InputError(f"--adapter {path!r}: {_not_an_adapter(path)}")
    raw = read_small(path, "a rule file", named=f"--adapter {path!r}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"--adapter {path!r}: not a text file (UTF-8)") from None


def _not_an_adapter(name: str) -> str:
    """Why ``--adapter NAME`` names nothing: a trainer recognised without it, a misspelt built-in, or no file."""
    if name in TRAINERS:
        return (
            f"{TRAINERS[name].title} checkpoints are recognised by their files and read without --adapter "
            "(their names are Hugging Face's already): leave --adapter out"
        )
    close = difflib.get_close_matches(name, [*adapter_names(), NO_ADAPTER], n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"no such file ({hint}built-in adapters: {', '.join(adapter_names())}; 'none' keeps the saved names)"


def _include(name: str, including: str) -> tuple[str, str]:
    """The file a user's rule file includes: ``TRAINER:PATH`` a built-in part (``megatron:parts/gqa.rules``),
    anything else a path beside the including file; within a built-in part, that trainer's parts."""
    owner, colon, path = name.partition(":")
    if colon and owner in TRAINERS:
        return TRAINERS[owner].rule_file(path, including)
    within, colon, _ = including.partition(":")
    if colon and within in TRAINERS:
        return TRAINERS[within].rule_file(name, including)
    path = os.path.join(os.path.dirname(including), name)
    if not os.path.lexists(path):
        raise InputError(f"{including}: include {name!r}: no such file ({path})")
    return path, _read_rule_file(path)


def _refuse_archives_per_rank(input_dir: str) -> None:
    """Per-rank directories (``{rank}``) hold shards the trainers need not recognise; but per-rank
    ``torch.save`` archives are read from one location: say so rather than that there are no shards."""
    first = input_dir.replace("{rank}", "0")
    try:
        found = recognise(LocalPlace(first))
    except InputError:
        return  # not an archive checkpoint the trainers can read: the scan says what the directory lacks
    if found is not None and TRAINERS[found.trainer].archives is not None:
        raise InputError(
            f"{input_dir}: {found.directory} holds a {TRAINERS[found.trainer].title} checkpoint, whose per-rank "
            "torch.save files are read from one directory (of a shared filesystem) or one s3:// prefix, not from "
            "per-rank directories: gather them into one and give that"
        )


def _recognised(input_dir: str | None, endpoint: str | None) -> Found | None:
    """The trainers asked about the input directory or ``s3://`` prefix (per-rank directories: only
    whether they hold archives, which are not read from there)."""
    if input_dir is None:
        return None
    if "{rank}" in input_dir:
        _refuse_archives_per_rank(input_dir)
        return None
    if is_s3(input_dir):
        from ..io.s3_sources import S3Place

        return recognise(S3Place.at(input_dir, endpoint))
    found = recognise(LocalPlace(input_dir))
    if found is None:
        _refuse_a_folder_of_checkpoints(input_dir)
    return found


#: Files that make a directory a checkpoint mpicons reads as it is (DCP, safetensors): no hint is needed.
_CHECKPOINT_FILES = (".metadata", ".safetensors", ".distcp")


def _refuse_a_folder_of_checkpoints(input_dir: str) -> None:
    """Bad input naming the subdirectories to give instead, when ``input_dir`` holds no checkpoint files
    but trainers' checkpoints one level down (a run's parent folder, a DeepSpeed run without ``latest``)."""
    try:
        names = sorted(os.listdir(input_dir))
    except OSError:
        return  # the scan says what is wrong with it
    if any(name.endswith(_CHECKPOINT_FILES) for name in names):
        return
    found = [(name, hit) for name in names if (hit := checkpoint_at(os.path.join(input_dir, name))) is not None]
    if not found:
        return
    titles = sorted({TRAINERS[hit.trainer].title for _, hit in found})
    if len(found) == 1:
        name = found[0][0]
        raise InputError(
            f"{input_dir}: holds no checkpoint itself; its subdirectory {name!r} holds a {titles[0]} checkpoint: "
            f"pass {os.path.join(input_dir, name)}"
        )
    listed = ", ".join(name for name, _ in found[:6]) + ("" if len(found) <= 6 else f" and {len(found) - 6} more")
    raise InputError(
        f"{input_dir}: holds no checkpoint itself; its subdirectories {listed} hold {' and '.join(titles)} checkpoints "
        "(no file names the newest, such as DeepSpeed's latest): pass the one to consolidate"
    )


def refuse_checkpoint_output(output_dir: str, input_dir: str, inside_input: bool = False) -> None:
    """Bad input when the output directory is the input given, or is (or lies inside) a checkpoint a trainer
    recognises: a model published among a run's files spoils the run's folder and the model (both
    arguments swapped, most often). A local output only; an ``s3://`` one is checked against the input's
    prefix. ``inside_input``: the caller asked for the output inside the input (torch's consolidators'
    contract), so only the folders between the output and the input are looked at."""
    if is_s3(output_dir) or "{rank}" in output_dir:
        return
    out = os.path.realpath(output_dir)
    if not is_s3(input_dir) and "{rank}" not in input_dir and os.path.realpath(input_dir) == out:
        raise InputError(f"{output_dir}: output directory is the input directory; give another directory for the model")
    given = None if is_s3(input_dir) or not inside_input else os.path.realpath(input_dir)
    path = out
    while path != given:
        found = checkpoint_at(path)
        if found is not None:
            title = TRAINERS[found.trainer].title
            a = "an" if title[:1].lower() in "aeiou" else "a"
            where = f"is {a} {title} checkpoint" if path == out else f"is inside {a} {title} checkpoint ({path})"
            raise InputError(
                f"{output_dir}: the output directory {where}: mpicons never writes into a training run's folder. "
                "Are the arguments swapped (mpicons consolidate CHECKPOINT OUTPUT_DIR)? Give an output directory "
                "outside the run"
            )
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def checkpoint_at(path: str) -> Found | None:
    """The checkpoint a trainer recognises at ``path``; one a trainer claims but cannot read counts too."""
    if not os.path.isdir(path):
        return None
    place = LocalPlace(path)
    for name, known in TRAINERS.items():
        try:
            found = known.recognise(place)
        except InputError:
            return Found(name, path, "checkpoint")
        if found is not None:
            return found
    return None


def _settled(options: Options, found: Found | None, chosen: Trainer | None, input_dir: str | None = None) -> Settled:
    """The assets (``--hf-assets``, else those saved with the checkpoint, else the input's own when it is a
    Hugging Face model folder), and the config as the adapter's trainer (or, under a rule file, the input's)
    settles it."""
    from ..io.assets import read_assets

    saved = None if found is None or options.hf_assets is not None else found.assets
    if found is None and options.hf_assets is None and _model_folder(input_dir):
        saved = input_dir
    where = os.fspath(options.hf_assets) if options.hf_assets is not None else saved
    assets = None if where is None else read_assets(where, options.s3_endpoint)
    asked = options.adapter is not None and options.adapter != NO_ADAPTER
    if saved is not None and chosen is None and not asked:
        return Settled(assets, (f"the model's Hugging Face files (config, tokenizer) from {saved} (--hf-assets for others)",))
    if assets is not None and assets.config is None and (asked or chosen is not None):
        raise InputError(f"--hf-assets {assets.directory!r}: no config.json (an adapter reads the model's shape from it)")
    settler = chosen or (TRAINERS[found.trainer] if found is not None and asked else None)
    if settler is None:
        if options.model_type is not None:
            raise InputError("--model-type is for a checkpoint whose config mpicons derives (a Megatron run's)")
        return Settled(assets)
    mine = found if found is not None and found.trainer == settler.name else None
    return settler.settle_config(mine, assets, options.model_type)


def _model_folder(input_dir: str | None) -> bool:
    """Whether the input is a Hugging Face model folder (weights with their ``config.json``), whose files
    are then published with what is made of it (dequantized, a LoRA merged)."""
    if input_dir is None or "{rank}" in input_dir or is_s3(input_dir):
        return False
    try:
        return os.path.isfile(os.path.join(input_dir, "config.json")) and any(
            name.endswith(".safetensors") for name in os.listdir(input_dir)
        )
    except OSError:
        return False


def load_adapter(comm: Comm, options: Options, input_dir: str | None = None, owner: int = 0) -> Adapter:
    """The trainer that recognises ``input_dir``, the assets and the rules ``options`` name (or the trainer's
    own, when the input chooses them), read on ``owner`` and shared (an error is every rank's); with
    ``input_dir``, also the model's config (the assets', else one beside the input) for the shape check."""

    def read() -> Adapter:
        found = _recognised(input_dir, options.s3_endpoint)
        off = options.adapter == NO_ADAPTER
        named = None if options.adapter is None or off else trainer(options.adapter)
        if named is not None and found is not None and found.trainer != named.name and TRAINERS[found.trainer].has_rules():
            own = TRAINERS[found.trainer]
            raise InputError(
                f"--adapter {named.name}: {found.directory} is a {own.title} checkpoint, whose names --adapter {own.name} "
                f"maps: leave --adapter out ({own.name} is chosen by itself) or give --adapter {own.name}"
            )
        auto = found is not None and options.adapter is None and TRAINERS[found.trainer].chosen_unasked
        chosen = named or (TRAINERS[found.trainer] if auto and found is not None else None)
        notes = [] if found is None else list(found.notes)
        if auto and chosen is not None:
            notes.append(
                f"adapter {chosen.name}: chosen because the input is a {chosen.title} checkpoint "
                "(--adapter FILE for other rules, --adapter none for the names as saved)"
            )
        if options.main_params:
            precision = f"converted to {options.dtype}" if options.dtype else "in fp32, as the optimizer keeps them"
            notes.append(f"--main-params: the weights are the optimizer's fp32 main parameters, written {precision}")
        settled = _settled(options, found, chosen, input_dir)
        rules = None
        if chosen is not None:
            rules = chosen.choose_rules(settled.config)
        elif options.adapter is not None and not off:
            rules = choose_rules(options.adapter, settled.config, _read_rule_file(options.adapter), _include)
        allow = (
            TRAINERS[found.trainer].metadata_allow if found is not None else (NOTHING if named is None else named.metadata_allow)
        )
        shared = None if found is None else replace(found, place=None)  # a place holds a connection: it stays here
        left_out = () if settled.assets is None else settled.assets.notes
        return Adapter(rules, settled.assets, shared, allow, (*notes, *settled.notes, *left_out))

    adapter = agree_on(comm, owner, read)
    if input_dir is None:
        return adapter
    return replace(adapter, model=load_model_config(comm, adapter.directory(input_dir), adapter.assets))


def _bits(code: int) -> int:
    return DTYPES[code].bits


def plan_scanned(scanned: Scanned, rules: RuleSet, config: dict[str, object] | None) -> Conversion:
    """What the rules make of the scan's tensors (pure, per tensor: the same on every rank)."""
    facts = scanned.facts
    ndim = (facts.ndim_first % FACT_KEY).astype(np.int64)
    dtype = (facts.dtype_first % FACT_KEY).astype(np.int64)
    shapes = facts.extent if facts.declared is None else facts.declared
    storage = [tuple(int(x) for x in shapes[t][: ndim[t]]) for t in range(len(scanned.names))]
    sub_byte = [DTYPES[int(d)].bits % 8 != 0 for d in dtype]
    return plan_conversion(scanned.names, storage, sub_byte, rules, config or {})


def convert_scanned(
    comm: Comm, scanned: Scanned, rules: RuleSet, config: dict[str, object] | None, conversion: Conversion | None = None
) -> Scanned:
    """The scan re-expressed as the rules' Hugging Face tensors (collective: the facts are reduced again);
    ``conversion``: :func:`plan_scanned`'s, when the caller has it already."""
    facts = scanned.facts
    dtype = (facts.dtype_first % FACT_KEY).astype(np.int64)
    conversion = conversion or plan_scanned(scanned, rules, config)
    width = comm.allreduce(converted_width(conversion, scanned.pieces.width), "max")
    pieces = convert_pieces(scanned.pieces, conversion, _bits).widened(width)
    count = len(conversion.outputs)
    new = reduce_facts(comm, pieces, count, width, piece_destinations(scanned.files))
    source = np.array([o.source for o in conversion.outputs], dtype=np.int64)
    never = np.flatnonzero(new.count == 0)  # no stored piece: the saved tensor's dtype, the output's rank
    ranks = np.array([len(o.storage) for o in conversion.outputs], dtype=np.int64)
    new.dtype_first[never] = dtype[source[never]]
    new.ndim_first[never] = ranks[never]
    new.dest_first[never] = 0
    if facts.declared is not None:
        new.declared = converted_declared(conversion, width)
    outputs_of: dict[str, str] = {}
    for o in conversion.outputs:
        outputs_of.setdefault(scanned.names[o.source], o.name)
    unreadable = {outputs_of[n]: m for n, m in scanned.unreadable.items() if n in outputs_of}
    return replace(
        scanned,
        names=conversion.names,
        pieces=pieces,
        facts=new,
        order=converted_order(conversion, scanned.order),
        unreadable=unreadable,
        conversion=conversion,
    )


def assets_mapping(conversion: Conversion | None, assets: HFAssets | None) -> dict[str, str] | None:
    """The assets' index as a ``--mapping`` (name → file), less the names the rules drop on purpose."""
    if assets is None or assets.weight_map is None:
        return None
    dropped = set() if conversion is None else conversion.dropped_names()
    return {name: file for name, file in assets.weight_map.items() if name not in dropped}


__all__ = ["Adapter", "load_adapter", "plan_scanned", "convert_scanned", "assets_mapping", "Conversion"]
