"""What reports are made of: problems and human-readable sizes (no MPI here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong: what, the tensor it concerns (if any), and the file it was found in (if any).

    Shown as ``path: tensor 'name': what`` when it has a file, else as ``what`` alone (a plan's
    message names its tensor and files itself).
    """

    what: str
    tensor: str | None = None
    path: str | None = None

    def __str__(self) -> str:
        if self.path is None:
            return self.what
        if self.tensor is None:
            return f"{self.path}: {self.what}"
        return f"{self.path}: tensor {self.tensor!r}: {self.what}"

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "tensor": self.tensor, "what": self.what}


def human_bytes(count: float) -> str:
    """Decimal units, as storage vendors and Hugging Face count them."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{int(count)} B"


def count_of(n: int, noun: str, plural: str | None = None) -> str:
    """``1 file``, ``3 files`` (``plural`` where adding an s will not do)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def skipped_entries(names: Sequence[str], show: int = 5) -> str:
    """``2 entries that are not tensors: a, b`` (the first ``show`` named)."""
    more = f" and {len(names) - show} more" if len(names) > show else ""
    counted = count_of(len(names), "entry that is not a tensor", "entries that are not tensors")
    return f"{counted}: {', '.join(names[:show])}{more}"
