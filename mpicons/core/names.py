"""The file names a checkpoint is made of, in one place: the plan names its output files with these
rules and the output directory recognises them with the same ones (pure: functions of their arguments).

The inputs' names are here too: DCP's shard names (``shard-RRRRR-model-IIIII-of-NNNNN.safetensors``),
the missing-shard hint built on them, and the files of DCP's default format (``.metadata``, ``*.distcp``).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence

#: Hugging Face's index of a sharded checkpoint, published last: the commit point of a run.
INDEX_NAME = "model.safetensors.index.json"
#: What Hugging Face names a checkpoint of one file (and writes no index for).
SINGLE_FILE_NAME = "model.safetensors"
#: File names a Hugging Face safetensors checkpoint is made of (beside the files its index names).
CHECKPOINT_FILE = re.compile(r"^(model-\d{5,}-of-\d{5,}\.safetensors|model\.safetensors|model\.safetensors\.index\.json)$")
#: Files of a sharded checkpoint (DCP's safetensors layout, DCP's default format): never an output directory's.
SHARD_FILE = re.compile(r"^(shard-\d+-model-\d+-of-\d+\.safetensors|\.metadata|.+\.distcp)$")
#: ``shard-RRRRR-model-IIIII-of-NNNNN.safetensors`` as torch's HuggingFaceStorageWriter names them.
DCP_SHARD_NAME = re.compile(r"^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")
#: Largest training rank, file index or file count a shard name may carry (stored as int32).
MAX_SHARD_NUMBER = 2**31 - 1
#: DCP's default format: the checkpoint's metadata (written last) and the suffix of its data files.
METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"


def output_name(index: int, count: int) -> str:
    """Output file ``index`` (from 1) of ``count``, as Hugging Face's ``save_pretrained`` names it."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def plain_file_name(name: object) -> bool:
    """A file name that stays inside its directory: not empty, not ``.``/``..``, no separators or NUL."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def shard_file_name(rank: int, index: int, count: int) -> str:
    """The name torch's HuggingFaceStorageWriter gives training rank ``rank``'s part of output file ``index``."""
    return f"shard-{rank:05d}-model-{index:05d}-of-{count:05d}.safetensors"


def parse_shard_name(name: str) -> tuple[int, int, int] | None:
    """(training rank, output index, output count) of a DCP shard name, None for other names."""
    match = DCP_SHARD_NAME.match(name)
    return None if match is None else (int(match.group(1)), int(match.group(2)), int(match.group(3)))


def missing_shards(files: Sequence[str], show: int = 3) -> tuple[int, int, list[str]]:
    """Absent DCP shard files: (how many, how many the present names imply, the first ``show`` names).

    The present names span a grid of training ranks × output files; a training rank with no piece
    of some output file writes no file for it, so this is only a hint, and a missing *last* rank
    cannot be seen at all. Costs what exists (the names present), never what the names imply: a
    rank number of 10⁹ in one name does not make 10⁹ names.
    """
    parsed = {p for p in map(parse_shard_name, files) if p}
    counts = {count for _, _, count in parsed}
    if not parsed or len(counts) != 1:
        return 0, 0, []
    count = counts.pop()
    by_rank: dict[int, set[int]] = {}
    for rank, index, _ in parsed:
        by_rank.setdefault(rank, set()).add(index)
    low, top = (1 if min(by_rank) >= 1 else 0), max(by_rank)
    expected = (top - low + 1) * count
    missing = expected - len(parsed)
    found: list[str] = []
    previous = low - 1
    for rank in sorted(by_rank):
        for absent in range(previous + 1, min(rank, previous + 1 + show)):  # ranks with no file at all
            found += [shard_file_name(absent, i, count) for i in range(1, min(count, show) + 1)]
        index = 1
        while len(found) < show and index <= min(count, len(by_rank[rank]) + show):
            if index not in by_rank[rank]:
                found.append(shard_file_name(rank, index, count))
            index += 1
        previous = rank
        if len(found) >= show:
            break
    return missing, expected, found[:show]


def nested_hint(location: str, nested: Sequence[str]) -> str:
    """``; its subdirectory 'sharded' holds ...: pass DIR/sharded``, for a location (a directory or an
    ``s3://`` prefix) one level above the checkpoints in ``nested``; empty when there are none."""
    if not nested:
        return ""
    if len(nested) == 1:
        return f"; its subdirectory {nested[0]!r} holds a checkpoint's files: pass {posixpath.join(location, nested[0])}"
    shown = ", ".join(repr(name) for name in nested[:4]) + (", ..." if len(nested) > 4 else "")
    example = posixpath.join(location, nested[-1])
    return f"; its subdirectories {shown} hold checkpoints' files: pass one of them, e.g. {example}"


__all__ = [
    "INDEX_NAME",
    "SINGLE_FILE_NAME",
    "CHECKPOINT_FILE",
    "SHARD_FILE",
    "DCP_SHARD_NAME",
    "MAX_SHARD_NUMBER",
    "METADATA_NAME",
    "DATA_SUFFIX",
    "output_name",
    "plain_file_name",
    "shard_file_name",
    "parse_shard_name",
    "missing_shards",
    "nested_hint",
]
