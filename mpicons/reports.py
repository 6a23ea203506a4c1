"""What reports are made of: problems and human-readable sizes (no MPI here)."""

from __future__ import annotations

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


def count_of(n: int, noun: str) -> str:
    """``1 file``, ``3 files``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
