"""What reports are made of: problems and human-readable sizes (no MPI here)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Problem:
    """One thing wrong, as a value carried from where it is found to where it is reported.

    ``message`` is the text shown; ``kind`` (``hole``, ``overlap``, ``dtype``, ...) lets a caller act on
    the problem without reading that text; ``tensor`` and ``path`` are what it concerns (if any);
    ``region`` and ``files`` are the element region and the shard files it names. Shown as
    ``path: tensor 'name': message`` when it has a path, else as ``message`` alone (a plan's message
    names its tensor and files itself).
    """

    message: str
    tensor: str | None = None
    path: str | None = None
    kind: str = field(default="other", kw_only=True)
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
    """Lines still longer than ``width`` broken between words (continuations indented two more columns),
    never inside a word: a terminal's own wrapping cuts names and numbers in two."""
    result: list[str] = []
    for line in lines:
        if len(line) <= width:
            result.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()) + 2)
        result += textwrap.wrap(
            line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False, drop_whitespace=True
        )
    return result


def skipped_parts(names: Sequence[str], show: int = 5) -> tuple[str, list[str]]:
    """(``2 entries that are not tensors``, the first ``show`` names and ``and N more``)."""
    counted = count_of(len(names), "entry that is not a tensor", "entries that are not tensors")
    more = [f"and {len(names) - show} more"] if len(names) > show else []
    return counted, [*names[:show], *more]


def skipped_entries(names: Sequence[str], show: int = 5) -> str:
    """``2 entries that are not tensors: a, b`` (the first ``show`` named)."""
    counted, shown = skipped_parts(names, show)
    more = f" {shown.pop()}" if len(names) > show else ""
    return f"{counted}: {', '.join(shown)}{more}"
