"""Problems found while planning, kept as values: raised at the first or collected for a report."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError
from .reports import Problem


@dataclass(frozen=True)
class Hole:
    """A region of a tensor no piece covers, as one rank found it in its rows (storage units)."""

    low: tuple[int, ...]
    high: tuple[int, ...]
    missing: int  # elements missing in the rows that rank checked


class Problems:
    """Problems found while planning: raised at the first (``strict``) or collected (``inspect``)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.general: list[Problem] = []  # checkpoint-wide
        self.by_tensor: dict[int, Problem] = {}
        self.holes: dict[int, Hole] = {}  # the tensors whose problem is a hole, to merge over ranks

    def add(self, problem: Problem, tensor: int | None = None, hole: Hole | None = None) -> None:
        """Record ``problem`` (of tensor number ``tensor``, if any): the first per tensor is kept."""
        if self.strict:
            raise InputError(problem.message)
        if tensor is None:
            self.general.append(problem)
        elif tensor not in self.by_tensor:
            self.by_tensor[tensor] = problem
            if hole is not None:
                self.holes[tensor] = hole

    def __bool__(self) -> bool:
        return bool(self.general or self.by_tensor)
