"""Termination signals turned into an agreed, clean failure (no MPI here).

The command line installs the handlers before MPI starts, so no signal can arrive while nothing
catches it. A caught signal is only *recorded*; it is raised as :class:`~mpicons.core.errors.Interrupted`
inside a phase (where the failure is then agreed over the communicator), never between
collectives, where raising would leave the other ranks waiting.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

from ..core.errors import Interrupted

#: What Slurm and a terminal send: a time limit (TERM, or USR1 with ``--signal``), Ctrl-C.
HANDLED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
#: The job's end (Slurm's time limit, ``scancel``): it acts at once even while MPI starts. Ctrl-C reaches
#: every rank of the launcher's process group together, so all of them finish starting MPI and then stop
#: cleanly; ending them inside MPI_Init instead crashes the ranks still starting (MPICH reports a
#: segmentation fault). A second Ctrl-C makes the launcher kill the job, as it says.
JOB_END = (signal.SIGTERM, signal.SIGUSR1)


class _State:
    pending: int | None = None
    inside_phase: bool = False


def _on_signal(signum: int, frame: object) -> None:
    _State.pending = signum
    if _State.inside_phase:
        _State.inside_phase = False
        raise Interrupted(f"interrupted by {signal.Signals(signum).name}")


def install_handlers(signals: tuple[int, ...] = HANDLED) -> None:
    """Catch termination signals; also ignore SIGXFSZ so a file-size limit is an EFBIG error, not a kill."""
    for signum in signals:
        signal.signal(signum, _on_signal)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def pending_signal() -> signal.Signals | None:
    """A signal caught but not yet raised (code that must not be interrupted polls this)."""
    return signal.Signals(_State.pending) if _State.pending is not None else None


def raise_pending() -> None:
    """Raise :class:`Interrupted` if a signal was caught."""
    if _State.pending is not None:
        raise Interrupted(f"interrupted by {signal.Signals(_State.pending).name}")


def forget_pending() -> None:
    """Drop a recorded signal: the work it would have stopped is already complete."""
    _State.pending = None


@contextmanager
def raising_inside() -> Iterator[None]:
    """Inside, a caught signal raises at once (a phase's protected call)."""
    previous = _State.inside_phase
    _State.inside_phase = True
    try:
        yield
    finally:
        _State.inside_phase = previous


@contextmanager
def deferred() -> Iterator[None]:
    """Inside, caught signals are only recorded: for code whose MPI message pattern or renames must complete."""
    previous = _State.inside_phase
    _State.inside_phase = False
    try:
        yield
    finally:
        _State.inside_phase = previous


@contextmanager
def ending_at_once(signals: tuple[int, ...] = JOB_END) -> Iterator[None]:
    """Inside, the job's end (``signals``) ends the process at once with the signal's default action.

    For MPI's start-up: a rank blocked in MPI_Init (waiting for a peer that never comes) runs no
    Python handler, so a recorded signal would never act; nothing has been written yet, so ending
    is right. A signal recorded just before ends the process the same way. Only mpicons' own
    handlers are swapped (a library caller's are left alone) and they are back afterwards.
    """
    ours = [signum for signum in signals if signal.getsignal(signum) is _on_signal]
    for signum in ours:
        signal.signal(signum, signal.SIG_DFL)  # runs the handler of a signal caught just before, first
    if _State.pending in ours:
        signal.raise_signal(_State.pending)
    try:
        yield
    finally:
        for signum in ours:
            signal.signal(signum, _on_signal)
