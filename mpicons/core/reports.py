"""What reports are made of: problems and human-readable sizes (no MPI here)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field

#: Every ``Problem.kind``, with what it means: a caller acts on the kind, never on the message's words.
KINDS: dict[str, str] = {
    # the plan (consolidate, inspect, verify --against): what the shards say
    "hole": "no piece covers some elements of a tensor (or the pieces fall short of its shape)",
    "overlap": "two or more pieces cover the same elements",
    "no data": "no piece holds any data for a tensor that has elements",
    "copy": "a shard file only repeats the pieces of another one",
    "dtype": "a tensor's pieces disagree on its dtype",
    "ndim": "a tensor's pieces disagree on its number of dimensions",
    "extent": "a piece reaches past the tensor's shape",
    "misaligned": "pieces of a sub-byte dtype not cut on byte boundaries of the last dimension",
    "too large": "a tensor larger than mpicons can address (2**62 bytes)",
    "destination": "a tensor is given two different output files",
    "mapping": "--mapping does not name every tensor, or names what is not there",
    "options": "options that contradict each other",
    "quantized": "a block-quantized (FP8) weight or its scales that --dtype would cast without the other",
    "empty": "the checkpoint holds no tensors",
    "not dcp": "a shard file without DCP sharding information among DCP shards",
    "shard name": "shard file names that do not say consistently which output file each feeds",
    "ranks": "the shard files do not come from exactly the training ranks --expect-ranks gives",
    "model shape": "a tensor's shape differs from the one the model's config.json gives it (a missing training rank?)",
    "model config": "the model's config.json contradicts the weights: their layers, an output layer, tensors its model has",
    "unreadable": "a file that cannot be read (the system's reason given), or that changed while read",
    # verify: a consolidated checkpoint as it is on disk
    "refused": "an entry verify does not open: a link (unless followed), a FIFO, a device, a directory",
    "lock": "a lock file mpicons cannot read as its own",
    "locked": "a consolidation holds the directory: its content may be changing",
    "sharded": "the directory holds DCP shards, not a consolidated checkpoint",
    "leftover": "what an interrupted consolidation left in the directory",
    "header": "a safetensors header (or its length prefix) that breaks the format's rules",
    "metadata": "a file's __metadata__ 'format' missing or not the one Hugging Face checkpoints need",
    "hdf5": "an HDF5 output h5py cannot read, or a dataset not stored as mpicons stores it",
    "index": "the index missing, not JSON, too large, or without a usable weight_map or metadata.total_size",
    "index mismatch": "the index and the files disagree: where a tensor is, or the total size",
    "duplicate": "a tensor in more than one file",
    "extra file": "a file in the directory that is not part of the checkpoint",
    "missing file": "a file the index or SHA256SUMS lists that is not there",
    # verify with a SHA256SUMS in the directory: every file it lists hashed
    "checksum": "a file whose SHA-256 differs from the one SHA256SUMS lists for it",
    "unlisted": "a file in the directory (or a sub-folder) that SHA256SUMS does not list",
    "manifest": "a SHA256SUMS that is not in sha256sum's format, or too large to be a manifest",
    # verify --against: the output compared with the shards
    "missing tensor": "a tensor of the shards in no output file",
    "extra tensor": "a tensor of the output not in the shards",
    "mismatch": "a tensor whose dtype or shape differs from the shards'",
    "values": "a tensor whose bytes differ from the shards'",
    "dtype option": "the output's floats were converted: verify with the --dtype it was written with",
    "adapter option": "the output has an adapter's names, the shards a trainer's: verify with the --adapter it was written with",
}


@dataclass(frozen=True)
class Problem:
    """One thing wrong, as a value carried from where it is found to where it is reported.

    ``message`` is the text shown; ``kind`` (one of :data:`KINDS`) lets a caller act on the problem
    without reading that text; ``tensor`` and ``path`` are what it concerns (if any);
    ``region`` and ``files`` are the element region and the shard files it names. Shown as
    ``path: tensor 'name': message`` when it has a path, else as ``message`` alone (a plan's message
    names its tensor and files itself).
    """

    message: str
    tensor: str | None = None
    path: str | None = None
    kind: str = field(kw_only=True)
    region: str | None = field(default=None, kw_only=True)
    files: tuple[str, ...] = field(default=(), kw_only=True)

    @property
    def what(self) -> str:
        """The message, under the name reports have always used for it."""
        return self.message

    def __str__(self) -> str:
        if self.path is None:
            return self.message
        if self.tensor is None:
            return f"{self.path}: {self.message}"
        return f"{self.path}: tensor {self.tensor!r}: {self.message}"

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "tensor": self.tensor, "what": self.message}


def human_bytes(count: float) -> str:
    """Decimal units, as storage vendors and Hugging Face count them."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{int(count)} B"


_BINARY_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def human_size(count: int) -> str:
    """A size the way a user likely wrote it: ``500 GiB (536.87 GB)`` for a whole number of binary
    units (``500G``, ``500GiB``), else decimal (``5.00 GB`` for ``5GB``)."""
    for unit, scale in _BINARY_UNITS:
        if count >= scale and count % scale == 0:
            return f"{count // scale} {unit} ({human_bytes(count)})"
    return human_bytes(count)


def count_of(n: int, noun: str, plural: str | None = None) -> str:
    """``1 file``, ``3 files`` (``plural`` where adding an s will not do): every message's plural."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def fit_items(head: str, items: Sequence[str], width: int, separator: str = ", ", indent: str = "  ") -> list[str]:
    """``head`` and ``items`` on one line when that fits in ``width`` columns, else ``head`` alone and
    one item per indented line: a report line wrapped by the terminal breaks mid-word."""
    line = head + separator.join(items)
    if len(line) <= width or not items:
        return [line]
    if not head.strip():  # nothing to head the list: the items alone, one per line
        return [head + item for item in items]
    return [head.rstrip(), *(indent + item for item in items)]


def wrapped(lines: Sequence[str], width: int) -> list[str]:
    """Lines still longer than ``width`` broken between phrases where they can be (after a ``,``, ``;`` or
    ``:``, before a ``(``, never inside parentheses), else between words; never inside a word.
    Continuations are indented two more columns. A terminal's own wrapping cuts names and numbers in
    two, and a line broken mid-phrase (``(not model`` / ``state)``) reads as two statements."""
    result: list[str] = []
    for line in lines:
        if len(line) <= width:
            result.append(line)
            continue
        lead = line[: len(line) - len(line.lstrip())]
        result += _fill_phrases(_phrases(line), width, lead, lead + "  ")
    return result


def _phrases(line: str) -> list[str]:
    """The words of ``line`` grouped into phrases: a phrase ends after a word ending in ``,;:`` and before
    a word opening a parenthesis, wherever no parenthesis is open."""
    phrases: list[list[str]] = []
    depth = 0
    for word in line.split():
        if not phrases or (depth == 0 and (word.startswith("(") or phrases[-1][-1].endswith((",", ";", ":")))):
            phrases.append([])
        phrases[-1].append(word)
        depth = max(0, depth + word.count("(") - word.count(")"))
    return [" ".join(words) for words in phrases]


def _fill_phrases(phrases: list[str], width: int, lead: str, indent: str) -> list[str]:
    """Phrases packed into lines of ``width``: a phrase that does not fit goes whole to the next line when
    the current one is at least half full and the phrase fits a line of its own; otherwise it is
    broken between words."""
    lines: list[str] = []
    prefix, text = lead, ""
    for phrase in phrases:
        joined = f"{text} {phrase}" if text else phrase
        if len(prefix) + len(joined) <= width:
            text = joined
        elif text and len(indent) + len(phrase) <= width and len(prefix) + len(text) >= width // 2:
            lines.append(prefix + text)
            prefix, text = indent, phrase
        else:
            parts = textwrap.wrap(
                prefix + joined, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
            )
            lines += parts[:-1]
            prefix, text = (indent, parts[-1][len(indent) :]) if len(parts) > 1 else (prefix, joined)
    lines.append(prefix + text)
    return lines


def skipped_parts(names: Sequence[str], show: int = 5) -> tuple[str, list[str]]:
    """(``2 entries that are not tensors``, the first ``show`` names and ``and N more``)."""
    counted = count_of(len(names), "entry that is not a tensor", "entries that are not tensors")
    groups: dict[str, int] = {}
    for name in names:
        group = name.split(".", 1)[0]
        groups[group] = groups.get(group, 0) + 1
    if len(names) > show and 1 < len(groups) <= 4 * show:  # a trainer's state groups, each counted
        members = set(names)
        return counted, [g if n == 1 and g in members else f"{g}.* ({n})" for g, n in sorted(groups.items())]
    more = [f"and {len(names) - show} more"] if len(names) > show else []
    return counted, [*names[:show], *more]


def skipped_entries(names: Sequence[str], show: int = 5) -> str:
    """``2 entries that are not tensors: a, b`` (the first ``show`` named)."""
    counted, shown = skipped_parts(names, show)
    more = f" {shown.pop()}" if shown and shown[-1].startswith("and ") else ""
    return f"{counted}: {', '.join(shown)}{more}"
