"""What a checkpoint cannot say about itself: whether every training rank's files are there (pure).

DCP's Hugging Face layout records no full shapes: a tensor's shape is where its pieces end, so a
checkpoint missing its last training rank's files looks like one of smaller tensors (no hole, no
overlap). The shard names carry the training rank, so ``--expect-ranks N`` can check the set of
ranks; without it (and without a model config, :mod:`.model_shapes`) a report says what it could
not check instead of a bare OK.
"""

from __future__ import annotations

from .reports import Problem, count_of
from .table import ShardFiles


def seen_ranks(files: ShardFiles) -> list[int]:
    """The training ranks the file names carry (``shard-RRRRR-*``: as torch numbers them, from 1;
    ``__R_N.distcp``: from 0), sorted."""
    return sorted({int(r) for r in files.train_rank.tolist() if r >= 0})


def first_rank(files: ShardFiles, ranks: list[int]) -> int:
    """The number of the first training rank in the names: torch names ``shard-RRRRR`` from 1 (rank + 1),
    ``.distcp`` files from 0; a shard name numbered 0 says this one counts from 0."""
    return 0 if files.source_format == "distcp" or (ranks and ranks[0] == 0) else 1


def _name_of(files: ShardFiles, rank: int) -> str:
    return f"__{rank}_*.distcp" if files.source_format == "distcp" else f"shard-{rank:05d}-*"


def _listed(files: ShardFiles, ranks: list[int], count: int, show: int = 4) -> str:
    shown = ", ".join(f"{r} ({_name_of(files, r)})" for r in ranks[:show])
    return shown + (f" and {count - min(show, len(ranks))} more" if count > min(show, len(ranks)) else "")


def _first_missing(seen: set[int], low: int, high: int, show: int) -> list[int]:
    """The first ``show`` numbers of ``low..high-1`` not in ``seen``: costs what is seen, never what is expected."""
    found: list[int] = []
    candidate = low
    for rank in sorted(r for r in seen if low <= r < high) + [high]:
        while candidate < rank and len(found) < show:
            found.append(candidate)
            candidate += 1
        candidate = rank + 1
        if len(found) >= show:
            break
    return found


def rank_problem(files: ShardFiles, expect: int, where: str, show: int = 4) -> Problem | None:
    """The shard files of ``where`` against ``--expect-ranks expect``: None when they come from exactly
    training ranks 0..expect-1 (numbered as the names number them), else the problem naming the
    missing (or unexpected) ranks."""
    ranks = seen_ranks(files)
    if not ranks:
        return Problem(
            f"{where}: --expect-ranks {expect}: the files carry no training rank (they are not named "
            "shard-RRRRR-model-IIIII-of-NNNNN.safetensors or __R_N.distcp): leave --expect-ranks out for this checkpoint",
            kind="ranks",
        )
    low = first_rank(files, ranks)
    high = low + expect
    inside = sum(1 for r in ranks if low <= r < high)
    extra = [r for r in ranks if not low <= r < high]
    missing = _first_missing(set(ranks), low, high, show)
    if inside == expect and not extra:
        return None
    parts = []
    if inside < expect:
        plural = "s" if expect - inside > 1 else ""
        parts.append(f"no files of training rank{plural} {_listed(files, missing, expect - inside, show)}")
    if extra:
        plural = "s" if len(extra) > 1 else ""
        parts.append(f"files of training rank{plural} {_listed(files, extra, len(extra), show)}, beyond them")
    cause = (
        " (a copy that stopped early, a node-local disk not mounted, or fewer {rank} directories read than were written?)"
        if inside < expect
        else " (is N the number of ranks that saved it?)"
    )
    return Problem(
        f"{where}: --expect-ranks {expect} (training ranks {low}..{high - 1} as the file names number them): "
        f"{'; '.join(parts)}{cause}",
        kind="ranks",
    )


def records_no_shapes(files: ShardFiles) -> bool:
    """DCP's Hugging Face layout: pieces with offsets and no recorded full shape (a missing last rank is invisible)."""
    return files.source_format != "distcp" and bool(files.is_dcp.any())


#: What to do about what a report could not check (DCP's Hugging Face layout, neither check asked for).
UNCHECKED_HINT = (
    "a checkpoint missing its last training rank's files looks like one with smaller tensors: --expect-ranks N, "
    "or --hf-assets DIR with the model's config.json, checks it"
)


def caveat(files: ShardFiles, expect: int | None, checked: str | None) -> str | None:
    """What an OK for this checkpoint rests on, when its format records no full shapes (None otherwise):
    the model's config (``checked`` says which tensors were compared with what), ``--expect-ranks``, or
    nothing (then it says what it cannot know)."""
    if not records_no_shapes(files):
        return None
    ranks = seen_ranks(files)
    seen = f"{count_of(len(ranks), 'training rank')} seen ({_span(ranks)})" if ranks else "no training ranks in the file names"
    if checked is not None:
        return f"{checked}; {seen}"
    if expect is not None:
        return f"global shapes are not recorded in this format; {seen}, as --expect-ranks {expect} says"
    return f"global shapes are not recorded in this format; {seen}"


def _span(ranks: list[int]) -> str:
    """``1-3`` for consecutive ranks, else the first few (sorted ``ranks``; costs what is seen)."""
    if ranks[-1] - ranks[0] + 1 == len(ranks):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


__all__ = ["seen_ranks", "first_rank", "rank_problem", "records_no_shapes", "caveat", "UNCHECKED_HINT"]
