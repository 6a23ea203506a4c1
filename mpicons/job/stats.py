"""Per-phase timings and bytes, reduced over the ranks (min / mean / max)."""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np

from ..comm import Communicator
from ..core.messages import PREFIX
from ..core.reports import count_of, fit_items, human_bytes, wrapped

PHASES = ("scan", "plan", "write", "finalize")


class PhaseClock:
    """Wall-clock seconds spent by this rank in each phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - began

    def total(self) -> float:
        return time.perf_counter() - self.start


@dataclass(frozen=True)
class Spread:
    min: float
    mean: float
    max: float


@dataclass(frozen=True)
class Stats:
    """The job's timing report, identical on every rank."""

    ranks: int
    phases: dict[str, Spread]
    elapsed: Spread
    bytes_per_rank: Spread
    peak_rss_mb: Spread
    total_bytes: int
    files: int
    tensors: int

    @property
    def imbalance(self) -> float:
        """max / mean bytes written per rank (1.0 is perfect balance)."""
        return self.bytes_per_rank.max / self.bytes_per_rank.mean if self.bytes_per_rank.mean else 1.0

    @property
    def rate_gbs(self) -> float:
        """Output bytes per second over the whole job (slowest rank), in GB/s."""
        return self.total_bytes / self.elapsed.max / 1e9 if self.elapsed.max else 0.0

    @property
    def write_rate_gbs(self) -> float:
        write = self.phases["write"].max
        return self.total_bytes / write / 1e9 if write else 0.0

    def to_dict(self) -> dict[str, object]:
        result = asdict(self)
        result.update(imbalance=self.imbalance, rate_gbs=self.rate_gbs, write_rate_gbs=self.write_rate_gbs)
        return result

    def table(self, width: int = 80) -> str:
        """The closing report, no line longer than ``width`` where it can be helped (one item per line)."""
        lines = [
            f"{PREFIX}{count_of(self.files, 'file')}, {count_of(self.tensors, 'tensor')}, "
            f"{human_bytes(self.total_bytes)} on {count_of(self.ranks, 'rank')}",
            f"{'phase':<10}{'min s':>10}{'mean s':>10}{'max s':>10}",
        ]
        for name, spread in [*self.phases.items(), ("total", self.elapsed)]:
            lines.append(f"{name:<10}{spread.min:>10.3f}{spread.mean:>10.3f}{spread.max:>10.3f}")
        figures = [
            f"rate {human_bytes(self.rate_gbs * 1e9)}/s overall, {human_bytes(self.write_rate_gbs * 1e9)}/s writing",
            f"bytes/rank max/mean {self.imbalance:.2f}",
            f"peak RSS/rank max {self.peak_rss_mb.max:.0f} MB",
        ]
        lines += fit_items("", figures, width, separator="; ")
        return "\n".join(wrapped(lines, width))


def peak_rss_mb() -> float:
    """This process's peak resident set size in MB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reduce_stats(comm: Communicator, clock: PhaseClock, bytes_written: int, files: int, tensors: int, total_bytes: int) -> Stats:
    """Allreduce this rank's phase times, bytes and memory into min/mean/max over ``comm``."""
    local = np.array(
        [clock.seconds.get(p, 0.0) for p in PHASES] + [clock.total(), float(bytes_written), peak_rss_mb()],
        dtype=np.float64,
    )
    low, high, total = local.copy(), local.copy(), local.copy()
    comm.allreduce_array(low, "min")
    comm.allreduce_array(high, "max")
    comm.allreduce_array(total, "sum")
    spreads = [Spread(float(a), float(s / comm.size), float(b)) for a, s, b in zip(low, total, high)]
    return Stats(
        ranks=comm.size,
        phases=dict(zip(PHASES, spreads[: len(PHASES)])),
        elapsed=spreads[len(PHASES)],
        bytes_per_rank=spreads[len(PHASES) + 1],
        peak_rss_mb=spreads[len(PHASES) + 2],
        total_bytes=total_bytes,
        files=files,
        tensors=tensors,
    )
