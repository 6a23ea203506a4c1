"""Whole-job progress on rank 0, gathered without stalling the writers.

Ranks other than 0 send their byte count to rank 0 with non-blocking point-to-point messages at
most every ``tick`` seconds (never more than one in flight); rank 0 picks them up whenever it
finishes a block of its own writing, and prints a bar on a terminal or one line every
``interval`` seconds otherwise (a Slurm job log). No collective is involved, so a slow rank never
holds up a fast one.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

import numpy as np
from mpi4py import MPI

from .parallel import Comm
from .stats import human_bytes

TAG = 17


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Bytes done by every rank, reported by rank 0. ``comm`` should be a private duplicate."""

    def __init__(
        self,
        comm: Comm,
        total: int,
        interval: float,
        stream: TextIO | None = None,
        verbose: bool = False,
    ) -> None:
        self.comm = comm
        self.total = total
        self.interval = interval
        self.stream = stream or sys.stdout
        self.verbose = verbose
        self.bar = comm.rank == 0 and self.stream.isatty()
        self.tick = 0.25 if self.bar else min(1.0, interval / 4)
        self.done = 0
        self.start = time.monotonic()
        self.last_tick = self.start
        self.last_print = self.start
        self.counts = np.zeros(comm.size, dtype=np.int64)
        self.finished = np.zeros(comm.size, dtype=bool)
        self._request: MPI.Request | None = None
        self._outgoing = np.zeros(2, dtype=np.int64)
        self._incoming = np.zeros(2, dtype=np.int64)

    def add(self, nbytes: int) -> None:
        """Called by the writer after every block; cheap unless a tick is due."""
        self.done += nbytes
        now = time.monotonic()
        if now - self.last_tick < self.tick:
            return
        self.last_tick = now
        if self.comm.rank == 0:
            self._poll()
            self._maybe_print(now)
        else:
            self._send(final=False)

    def finish(self, wait_for_others: bool = True) -> None:
        """End of this rank's share: others report a last time; rank 0 keeps reporting until all did."""
        if self.comm.rank != 0:
            self._send(final=True)
            if self._request is not None:
                self._request.Wait()
            return
        self.finished[0] = True
        while wait_for_others and not self.finished.all():
            self._poll()
            self._maybe_print(time.monotonic())
            time.sleep(0.01)
        self._poll()
        self._print(time.monotonic(), final=True)

    def _send(self, final: bool) -> None:
        if self._request is not None:
            if not final and not self._request.Test():
                return  # the previous report is still in flight: skip this one
            self._request.Wait()
        self._outgoing[:] = (self.done, int(final))
        self._request = self.comm.Isend(self._outgoing, dest=0, tag=TAG)

    def _poll(self) -> None:
        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG, status=status):
            source = status.Get_source()
            self.comm.Recv(self._incoming, source=source, tag=TAG)
            self.counts[source] = self._incoming[0]
            self.finished[source] |= bool(self._incoming[1])

    def _maybe_print(self, now: float) -> None:
        due = 0.25 if self.bar else self.interval
        if now - self.last_print >= due:
            self.last_print = now
            self._print(now)

    def _print(self, now: float, final: bool = False) -> None:
        self.counts[0] = self.done
        done = int(self.counts.sum())
        elapsed = now - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        fraction = done / self.total if self.total else 1.0
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        eta_text = _duration(eta) if eta != float("inf") else "?"
        text = (
            f"{human_bytes(done)} of {human_bytes(self.total)} ({100 * fraction:.0f}%), {human_bytes(rate)}/s, "
            f"ETA {eta_text}, {int((~self.finished).sum())}/{self.comm.size} ranks writing"
        )
        if self.verbose and not final:
            slowest = int(np.argmin(self.counts))
            text += f", slowest rank {slowest} at {human_bytes(self.counts[slowest])}"
        if self.bar:
            width = 30
            filled = int(width * fraction)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}" + ("\n" if final else ""))
        elif not final:
            self.stream.write(f"mpicons: progress {text}\n")
        self.stream.flush()
