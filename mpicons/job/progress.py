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
from collections.abc import Mapping
from typing import TextIO

import numpy as np

from ..comm import Communicator, Request
from ..comm.base import PROGRESS_TAG
from ..core.errors import InputError
from ..core.messages import PROGRESS
from ..core.options import PROGRESS_STYLES, PROGRESS_VARIABLE
from ..core.reports import human_bytes


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def progress_choice(environ: Mapping[str, str] | None = None) -> str | None:
    """``MPICONS_PROGRESS`` as mpicons reads it: ``bar``, ``lines``, or None (decided from the terminal).

    Any other value is refused, so a setting meant for something else (seconds, say) is caught up front.
    """
    value = (os.environ if environ is None else environ).get(PROGRESS_VARIABLE, "").strip().lower()
    if not value or value in PROGRESS_STYLES:
        return value or None
    expected = " or ".join(repr(style) for style in PROGRESS_STYLES)
    raise InputError(
        f"{PROGRESS_VARIABLE}={value!r}: expected {expected}, or unset to decide from the terminal "
        "(the seconds between progress lines are --progress N)"
    )


def _fallback_columns() -> int:
    value = os.environ.get("COLUMNS", "")
    return int(value) if value.isdigit() and int(value) > 0 else 80


def terminal_columns(stream: TextIO) -> int | None:
    """Columns of the terminal ``stream`` ends up on, or None when it goes to a file or pipe.

    Checked in order: ``stream`` itself, then the standard error and output of up to four ancestor
    processes on this node (``mpiexec`` and its proxy).
    """
    try:
        interactive = stream.isatty()
    except (ValueError, AttributeError):
        interactive = False
    if interactive:
        try:
            return os.get_terminal_size(stream.fileno()).columns
        except (OSError, ValueError):
            return _fallback_columns()
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
                return _device_columns(target)
        pid = _parent(pid)
    return None


def _device_columns(device: str) -> int:
    try:
        handle = os.open(device, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError:
        return _fallback_columns()
    try:
        return os.get_terminal_size(handle).columns
    except OSError:
        return _fallback_columns()
    finally:
        os.close(handle)


def watched_terminal_columns(stream: TextIO) -> int | None:
    """Columns for a progress bar, or None for progress lines (output to a file or pipe).

    ``MPICONS_PROGRESS`` (``bar``/``lines``) decides when set; an unknown value counts as unset here
    (the command line refuses it before any work).
    """
    try:
        choice = progress_choice()
    except InputError:
        choice = None
    if choice == "lines":
        return None
    columns = terminal_columns(stream)
    if columns is None and choice == "bar":
        return _fallback_columns()
    return columns


def report_columns(stream: TextIO) -> int:
    """The width to fit a closing report to: the terminal's, else ``COLUMNS`` or 80 (a log file)."""
    return terminal_columns(stream) or _fallback_columns()


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


#: A bar never shrinks below this many cells (fields are left out first) nor grows beyond the maximum.
MIN_CELLS, MAX_CELLS = 10, 50
_DURATION_WIDTH = 8  # 99:59:59; longer estimates are shown as '>99h'
_RATE_WIDTH = len("999.99 MB/s")
_BYTES_WIDTH = len("999.99 MB")


def _short_duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    return _duration(seconds) if seconds < 100 * 3600 else ">99h"


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
        self.stopped = False  # some rank ended its share early (a signal, an error): the end is no completion
        self._request: Request | None = None
        self._outgoing = np.zeros(2, dtype=np.int64)
        self._incoming = np.zeros((comm.size, 2), dtype=np.int64)
        self._receiving: dict[int, Request] = {}
        if comm.rank == 0:
            self._receiving = {r: comm.irecv(self._incoming[r], r, PROGRESS_TAG) for r in range(1, comm.size)}

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

    def finish(self, stopped: bool = False) -> None:
        """End of this rank's share: others report a last time (also after a failure, so rank 0 never
        waits in vain); rank 0 keeps reporting until every rank did, then prints the final frame.

        ``stopped``: this rank's share ended early (a signal, an error). If any rank's did, the final
        frame says ``stopped`` where a completed run's says how long it took."""
        if self.comm.rank != 0:
            self._send(final=True, stopped=stopped)
            if self._request is not None:
                self._request.wait()
            return
        self.stopped |= stopped
        self.finished[0] = True
        while not self.finished.all():
            self._poll()
            self._maybe_print(time.monotonic())
            time.sleep(0.01)
        self._print(time.monotonic(), final=True)

    def _send(self, final: bool, stopped: bool = False) -> None:
        if self._request is not None:
            if not final and not self._request.test():
                return  # the previous report is still in flight: skip this one
            self._request.wait()
        self._outgoing[:] = (self.done, _STOPPED if stopped else int(final))
        self._request = self.comm.isend(self._outgoing, 0, PROGRESS_TAG)

    def _poll(self) -> None:
        for source, request in list(self._receiving.items()):
            while request.test():
                done, final = (int(x) for x in self._incoming[source])
                self.counts[source] = done
                self.stopped |= final == _STOPPED
                if final:
                    self.finished[source] = True
                    del self._receiving[source]
                    break
                request = self._receiving[source] = self.comm.irecv(self._incoming[source], source, PROGRESS_TAG)

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
        writing = int((~self.finished).sum())
        slowest = int(np.argmin(self.counts))
        try:
            if self.bar:
                fields = self._bar_fields(done, fraction, rate, elapsed if final else eta, final, writing, slowest)
                self._draw(fraction, fields, final)
            elif not final:
                amount = f"{human_bytes(done)} of {human_bytes(self.total)} ({100 * fraction:.0f}%)"
                parts = [amount, f"{human_bytes(rate)}/s", f"ETA {_short_duration(eta)}"]
                parts.append(f"{writing}/{self.comm.size} ranks writing")
                if self.verbose:
                    parts.append(f"slowest rank {slowest} at {human_bytes(self.counts[slowest])}")
                self.stream.write(f"{PROGRESS}{', '.join(parts)}\n")
            self.stream.flush()
        except BrokenPipeError:
            self.bar, self.interval = False, float("inf")  # nobody reads: stop reporting

    def _field_widths(self) -> list[int]:
        """The bar's fields, most important first, each always this wide (so the frame never changes size)."""
        rank_digits = len(str(self.comm.size - 1))
        widths = [
            len("100%"),
            max(_BYTES_WIDTH, len(human_bytes(self.total))) + len(" of ") + len(human_bytes(self.total)),
            _RATE_WIDTH,
            len("took ") + _DURATION_WIDTH,
            2 * len(str(self.comm.size)) + len("/ ranks writing"),
        ]
        if self.verbose:
            widths.append(len("slowest rank ") + rank_digits + len(" at ") + _BYTES_WIDTH)
        return widths

    def _bar_fields(
        self, done: int, fraction: float, rate: float, seconds: float, final: bool, writing: int, slowest: int
    ) -> list[str]:
        """The fields of one frame, each padded to its width in ``_field_widths``."""
        widths = self._field_widths()
        size = self.comm.size
        texts = [
            f"{100 * fraction:.0f}%",
            f"{human_bytes(done):>{widths[1] - 4 - len(human_bytes(self.total))}} of {human_bytes(self.total)}",
            f"{human_bytes(rate)}/s",
            "stopped"
            if final and self.stopped
            else f"{'took' if final else 'ETA':<4} {_short_duration(seconds):>{_DURATION_WIDTH}}",
            f"{writing:>{len(str(size))}}/{size} ranks writing",
            f"slowest rank {slowest:>{len(str(size - 1))}} at {human_bytes(self.counts[slowest]):>{_BYTES_WIDTH}}",
        ]
        return [text.rjust(width) for text, width in zip(texts, widths)]

    def _layout(self) -> tuple[int, int]:
        """(fields shown, bar cells) for this terminal: fields are left out, least important first,
        until the bar has at least ``MIN_CELLS``; the bar then takes what is left, up to ``MAX_CELLS``."""
        line = max(12, (self.columns or 80) - 1)  # the last column would make some terminals wrap
        widths = self._field_widths()
        shown = len(widths)
        while shown > 1 and line - 3 - _joined_width(widths[:shown]) < MIN_CELLS:
            shown -= 1
        return shown, max(1, min(MAX_CELLS, line - 3 - _joined_width(widths[:shown])))

    def _draw(self, fraction: float, fields: list[str], final: bool) -> None:
        """One frame of the same width as every other (never wrapped, nothing cut), over the previous one."""
        shown, cells = self._layout()
        text = _SEPARATOR.join(fields[:shown])
        cells = max(1, cells - (len(text) - _joined_width(self._field_widths()[:shown])))  # a field that overflowed
        filled = int(cells * fraction)
        frame = f"[{'#' * filled}{'.' * (cells - filled)}] {text}"
        padding = " " * max(0, self._drawn - len(frame))
        self._drawn = len(frame)
        self.stream.write("\r" + frame + padding + ("\n" if final else ""))


_SEPARATOR = "  "
#: A rank's last report says its share ended early (1: it completed; 0: not its last report).
_STOPPED = 2


def _joined_width(widths: list[int]) -> int:
    return sum(widths) + len(_SEPARATOR) * (len(widths) - 1)
