"""A model adapter in the job: its rules and the model's config read once and shared, then the scan's
pieces re-expressed as the Hugging Face tensors (per tensor, the same on every rank; per piece, numpy).

The conversion itself is pure (:mod:`mpicons.core.adapting`); here are the parts that read files
(on one rank, the result or the error reaching every rank) and the facts reduced again over the
communicator for the converted pieces.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ..comm.agreement import Comm, agree_on
from ..core.adapter_rules import BUILTIN, RuleSet, choose_rules
from ..core.adapting import Conversion, convert_pieces, converted_declared, converted_order, converted_width, plan_conversion
from ..core.errors import InputError
from ..core.facts import FACT_KEY, piece_destinations
from ..core.format import DTYPES
from ..core.options import Options
from ..io.regular_files import NotRegular, kind_of, open_regular, read_bounded
from .model_check import ModelConfig, load_model_config
from .scan import Scanned, reduce_facts

if TYPE_CHECKING:
    from ..io.assets import HFAssets

#: A rule file larger than this is not a rule file.
MAX_RULE_FILE = 1 << 20


@dataclass(frozen=True)
class Adapter:
    """What the options ask of the model's files: the rules (None: no adapter), the assets (None: none),
    and the model's config to check the shapes against (None: none given or beside the input)."""

    rules: RuleSet | None
    assets: HFAssets | None
    model: ModelConfig | None = None

    @property
    def config(self) -> dict[str, object] | None:
        return None if self.assets is None else self.assets.config


def _read_rule_file(path: str) -> str:
    """A user's rule file: a regular file (links followed: it is the user's own), bounded, UTF-8."""
    try:
        fd = open_regular(path, follow_links=True)
    except FileNotFoundError:
        raise InputError(f"--adapter {path!r}: no such file (built-in adapters: {', '.join(BUILTIN)})") from None
    except NotRegular as exc:
        raise InputError(f"--adapter {path!r}: {kind_of(exc.mode)}, not a rule file") from None
    except OSError as exc:
        raise InputError(f"--adapter {path!r}: cannot read it: {exc.strerror}") from None
    try:
        raw = read_bounded(fd, MAX_RULE_FILE)
    finally:
        os.close(fd)
    if raw is None:
        raise InputError(f"--adapter {path!r}: larger than {MAX_RULE_FILE >> 20} MiB, not a rule file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"--adapter {path!r}: not a text file (UTF-8)") from None


def load_adapter(comm: Comm, options: Options, owner: int = 0, input_dir: str | None = None) -> Adapter:
    """The assets and rules ``options`` name, read on ``owner`` and shared (an error is every rank's); with
    ``input_dir``, also the model's config (``--hf-assets``', else one beside the input) for the shape check."""
    adapter = _load_rules_and_assets(comm, options, owner)
    if input_dir is None:
        return adapter
    return replace(adapter, model=load_model_config(comm, input_dir, adapter.assets))


def _load_rules_and_assets(comm: Comm, options: Options, owner: int) -> Adapter:
    if options.adapter is None and options.hf_assets is None:
        return Adapter(None, None)

    def read() -> Adapter:
        from ..io.assets import read_assets

        assets = None if options.hf_assets is None else read_assets(os.fspath(options.hf_assets))
        config = None if assets is None else assets.config
        if options.hf_assets is not None and options.adapter is not None and config is None:
            raise InputError(
                f"--hf-assets {os.fspath(options.hf_assets)!r}: no config.json (an adapter reads the model's shape from it)"
            )
        rules = None
        if options.adapter is not None:
            text = None if options.adapter in BUILTIN else _read_rule_file(options.adapter)
            rules = choose_rules(options.adapter, config, text)
        return Adapter(rules, assets)

    return agree_on(comm, owner, read)


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
