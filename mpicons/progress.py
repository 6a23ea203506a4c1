"""Whole-job progress on rank 0, gathered without stalling the writers.

Ranks other than 0 send their byte count to rank 0 with non-blocking point-to-point messages at
most every ``tick`` seconds (never more than one in flight); rank 0 keeps one receive posted per
rank and tests them whenever it finishes a block of its own writing, and prints to standard error: a bar redrawn in place when
a person is watching a terminal, else one line every ``interval`` seconds (a Slurm job log).

Under ``mpiexec`` no rank has a terminal (the launcher reads their output through pipes and
forwards it), so "a terminal" means: rank 0's standard error is one, or the launcher that started
it on this node writes to one (found through ``/proc``). ``MPICONS_PROGRESS=bar`` or ``lines``
overrides the guess.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

import numpy as np

from .comm import Communicator, Request
from .reports import human_bytes

TAG = 17


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def watched_terminal_columns(stream: TextIO) -> int | None:
    """Columns of the terminal a person watches this run on, or None when output goes to a file or pipe.

    Checked in order: ``MPICONS_PROGRESS`` (``bar``/``lines``), ``stream`` itself, then the standard
    error and output of up to four ancestor processes on this node (``mpiexec`` and its proxy).
    """
    choice = os.environ.get("MPICONS_PROGRESS", "").lower()
    if choice == "lines":
        return None
    fallback = int(os.environ.get("COLUMNS", "80") or 80)
    try:
        interactive = stream.isatty()
    except (ValueError, AttributeError):
        interactive = False
    if interactive:
        try:
            return os.get_terminal_size(stream.fileno()).columns
        except (OSError, ValueError):
            return fallback
    pid = os.getppid()
    for _ in range(4):
        if pid <= 1:
            break
        for fd in (2, 1):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(("/dev/pts/", "/dev/tty")):
                try:
                    handle = os.open(target, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
                except OSError:
                    return fallback
                try:
                    return os.get_terminal_size(handle).columns
                except OSError:
                    return fallback
                finally:
                    os.close(handle)
        pid = _parent(pid)
    return fallback if choice == "bar" else None


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Bytes done by every rank, reported by rank 0. ``comm`` should be a private duplicate."""

    def __init__(
        self,
        comm: Communicator,
        total: int,
        interval: float,
        stream: TextIO | None = None,
        verbose: bool = False,
    ) -> None:
        self.comm = comm
        self.total = total
        self.interval = interval
        self.stream = stream or sys.stderr
        self.verbose = verbose
        self.columns = watched_terminal_columns(self.stream) if comm.rank == 0 else None
        self.bar = self.columns is not None
        self._drawn = 0  # characters of the last bar frame, to blank what a shorter one leaves
        self.tick = 0.25 if self.bar else min(1.0, interval / 4)
        self.done = 0
        self.start = time.monotonic()
        self.last_tick = self.start
        self.last_print = self.start
        self.counts = np.zeros(comm.size, dtype=np.int64)
        self.finished = np.zeros(comm.size, dtype=bool)
        self._request: Request | None = None
        self._outgoing = np.zeros(2, dtype=np.int64)
        self._incoming = np.zeros((comm.size, 2), dtype=np.int64)
        self._receiving: dict[int, Request] = {}
        if comm.rank == 0:
            self._receiving = {r: comm.irecv(self._incoming[r], r, TAG) for r in range(1, comm.size)}

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

    def finish(self) -> None:
        """End of this rank's share: others report a last time (also after a failure, so rank 0 never
        waits in vain); rank 0 keeps reporting until every rank did, then prints the final frame."""
        if self.comm.rank != 0:
            self._send(final=True)
            if self._request is not None:
                self._request.wait()
            return
        self.finished[0] = True
        while not self.finished.all():
            self._poll()
            self._maybe_print(time.monotonic())
            time.sleep(0.01)
        self._print(time.monotonic(), final=True)

    def _send(self, final: bool) -> None:
        if self._request is not None:
            if not final and not self._request.test():
                return  # the previous report is still in flight: skip this one
            self._request.wait()
        self._outgoing[:] = (self.done, int(final))
        self._request = self.comm.isend(self._outgoing, 0, TAG)

    def _poll(self) -> None:
        for source, request in list(self._receiving.items()):
            while request.test():
                done, final = (int(x) for x in self._incoming[source])
                self.counts[source] = done
                if final:
                    self.finished[source] = True
                    del self._receiving[source]
                    break
                request = self._receiving[source] = self.comm.irecv(self._incoming[source], source, TAG)

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
        fraction = min(1.0, done / self.total) if self.total else 1.0
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        amount = f"{human_bytes(done)} of {human_bytes(self.total)} ({100 * fraction:.0f}%)"
        speed = f"{human_bytes(rate)}/s"
        if final:
            parts = [amount, speed, f"{_duration(elapsed)} elapsed"]
        else:
            parts = [
                amount,
                speed,
                f"ETA {_duration(eta) if eta != float('inf') else '?'}",
                f"{int((~self.finished).sum())}/{self.comm.size} ranks writing",
            ]
            if self.verbose:
                slowest = int(np.argmin(self.counts))
                parts.append(f"slowest rank {slowest} at {human_bytes(self.counts[slowest])}")
        try:
            if self.bar:
                self._draw(fraction, parts, final)
            elif not final:
                self.stream.write(f"mpicons: progress {', '.join(parts)}\n")
            self.stream.flush()
        except BrokenPipeError:
            self.bar, self.interval = False, float("inf")  # nobody reads: stop reporting

    def _draw(self, fraction: float, parts: list[str], final: bool) -> None:
        """One frame within the terminal's width (never wrapped), overwriting the previous one."""
        width = max(20, (self.columns or 80) - 1)
        while len(parts) > 1 and len(", ".join(parts)) + 12 > width:
            parts = parts[:-1]
        text = ", ".join(parts)[: width - 12]
        cells = max(10, min(30, width - len(text) - 3))
        filled = int(cells * fraction)
        frame = f"[{'#' * filled}{'.' * (cells - filled)}] {text}"[:width]
        padding = " " * max(0, self._drawn - len(frame))
        self._drawn = len(frame)
        self.stream.write("\r" + frame + padding + ("\n" if final else ""))
