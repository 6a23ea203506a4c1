"""Which files make a DeepSpeed ZeRO checkpoint, from the names in a directory (pure, no I/O).

``engine.save_checkpoint(DIR, tag)`` writes ``DIR/latest`` (the tag) and ``DIR/<tag>/`` holding, per
data-parallel rank R, ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` (the fp32 master weights
and the optimizer state), and the model states: one ``mp_rank_00_model_states.pt`` (stages 1 and 2)
or ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank (stage 3).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ...core.errors import InputError
from ..base import RANK_NUMBER, refuse_other_spellings

#: DeepSpeed's own spellings: the data-parallel rank as it is, the model-parallel one zero-padded to two
#: digits (``zero_pp_rank_{}_mp_rank_{:02d}``).
_MP = r"(0[0-9]|[1-9][0-9]+)"
_OPTIM = re.compile(rf"^(bf16_)?zero_pp_rank_{RANK_NUMBER}_mp_rank_{_MP}_optim_states\.pt$")
_MODEL3 = re.compile(rf"^zero_pp_rank_{RANK_NUMBER}_mp_rank_{_MP}_model_states\.pt$")
_MODEL = re.compile(rf"^mp_rank_{_MP}_model_states\.pt$")
#: Any spelling of the same names (digits of any script, any padding): a file matching one of these but
#: not DeepSpeed's own claims a rank another file has, or should have.
_LOOSE = (
    (
        re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$"),
        "{0}zero_pp_rank_{1}_mp_rank_{2:02d}_optim_states.pt",
    ),
    (re.compile(r"^()zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$"), "zero_pp_rank_{1}_mp_rank_{2:02d}_model_states.pt"),
    (re.compile(r"^()()mp_rank_(\d+)_model_states\.pt$"), "mp_rank_{2:02d}_model_states.pt"),
)
_PIPELINE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$|^layer_\d+-model_states\.pt$")
#: The file a run directory names its newest checkpoint in.
LATEST = "latest"


@dataclass(frozen=True)
class ZeroFiles:
    """The files of one ZeRO checkpoint (names inside its directory), by data-parallel rank."""

    optim_states: dict[int, str]
    #: Stage 3: one per rank; stages 1-2: the one file, under rank 0.
    model_states: dict[int, str]
    stage3: bool

    def optim_name(self, rank: int) -> str:
        """The name rank ``rank``'s optimizer-state file has (present or not)."""
        prefix = "bf16_" if any(name.startswith("bf16_") for name in self.optim_states.values()) else ""
        return f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"

    def model_name(self, rank: int) -> str:
        """The name rank ``rank``'s model-state file has (stage 3), or the one model-state file."""
        return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if self.stage3 else "mp_rank_00_model_states.pt"


def detect(names: Sequence[str], directory: str) -> ZeroFiles | None:
    """The ZeRO checkpoint whose files are among ``names`` (the entries of ``directory``), or None when
    there is none. A directory that is one but cannot be read as one (tensor or pipeline parallel,
    model states without optimizer states) is bad input, said here."""
    for loose, spelling in _LOOSE:
        refuse_other_spellings(names, loose, functools.partial(_canonical, spelling), directory)
    optim = {n: m for n in names if (m := _OPTIM.match(n))}
    model3 = {n: m for n in names if (m := _MODEL3.match(n))}
    model = {n: m for n in names if (m := _MODEL.match(n))}
    if not optim and not model3 and not model:
        if any(_PIPELINE.match(n) for n in names):
            raise InputError(f"{directory}: a DeepSpeed pipeline-parallel checkpoint (layer_*-model_states.pt): not supported")
        return None
    tensor_parallel = sorted(n for n, m in [*optim.items(), *model3.items(), *model.items()] if int(m.groups()[-1]) != 0)
    if tensor_parallel:
        raise InputError(
            f"{directory}: a DeepSpeed checkpoint saved with tensor (model) parallelism ({tensor_parallel[0]}): "
            "not supported; only mp_rank_00 files are read"
        )
    if not optim:
        raise InputError(
            f"{directory}: DeepSpeed model states without optimizer states (*_optim_states.pt): the fp32 master "
            "weights are in those; copy them too (or save the model with save_16bit_model)"
        )
    if len({m.group(1) for m in optim.values()}) > 1:
        raise InputError(f"{directory}: optimizer states both with and without the bf16_ prefix: two checkpoints mixed?")
    optim_states = {int(m.group(2)): n for n, m in optim.items()}
    if model3:
        return ZeroFiles(optim_states, {int(m.group(1)): n for n, m in model3.items()}, True)
    if not model:
        raise InputError(f"{directory}: DeepSpeed optimizer states without model states (mp_rank_00_model_states.pt)")
    return ZeroFiles(optim_states, {0: next(iter(model))}, False)


def _canonical(spelling: str, found: re.Match[str]) -> str:
    """The name DeepSpeed writes for what a loosely matched name claims (its numbers read as numbers)."""
    prefix, rank, mp = found.group(1) or "", found.group(2), found.group(3)
    return spelling.format(prefix, int(rank) if rank else 0, int(mp))


def latest_tag(text: str, path: str) -> str:
    """The checkpoint directory a run directory's ``latest`` file names (the tag, e.g. ``global_step2``)."""
    tag = text.strip()
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or "\0" in tag or len(tag.encode()) > 255:
        raise InputError(f"{path}: does not name a checkpoint directory ({tag[:80]!r})")
    return tag


__all__ = ["LATEST", "ZeroFiles", "detect", "latest_tag"]
