"""Agreeing on failure across ranks, so one rank's error ends every rank with the same message.

An exception on one rank before a collective would leave the others blocked in it. Every
phase therefore runs through :func:`agree`: the outcome (value or error) of each rank is
exchanged in the phase's own collective and, if any rank failed, every rank raises the
first failure, naming the rank it happened on. A ``KeyboardInterrupt`` inside a phase is an
outcome too: every rank raises :class:`~mpicons.core.errors.Interrupted`, and the interrupted rank's
is also a ``KeyboardInterrupt`` (:class:`KeyboardInterrupted`), so a Python caller's Ctrl-C
handling still sees it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ..core.errors import InputError, Interrupted, MpiconsError, WriteError
from ..core.machine import memory_exhausted, out_of_memory_line
from .base import Communicator, sleeping_wait
from .interrupts import deferred, raise_pending, raising_inside

Comm = Communicator
T = TypeVar("T")
Error = tuple[str, str]

_KINDS: dict[str, type[MpiconsError]] = {
    "input": InputError,
    "write": WriteError,
    "error": MpiconsError,
    "interrupt": Interrupted,
}


class KeyboardInterrupted(Interrupted, KeyboardInterrupt):
    """What the rank that caught a ``KeyboardInterrupt`` raises once every rank agreed on it: an
    :class:`~mpicons.core.errors.Interrupted` like the other ranks', and still a ``KeyboardInterrupt`` for
    code that handles Ctrl-C (uncaught, Python exits as it does after Ctrl-C)."""


class _Held:
    """A ``KeyboardInterrupt`` caught where only another rank's outcome was exchanged (the non-root ranks
    of :func:`agree_on`), raised again at the start of this rank's next phase, where it is agreed."""

    interrupt = False


def _raise_held() -> None:
    if _Held.interrupt:
        _Held.interrupt = False
        raise KeyboardInterrupt


def _outcome(fn: Callable[[], T], collective: bool = False) -> tuple[Error | None, T | None]:
    try:
        if collective:  # fn raises a signal itself where it may; every rank runs its message pattern
            with deferred():
                value = fn()
        else:
            with raising_inside():
                raise_pending()
                _raise_held()
                value = fn()
        raise_pending()
        _raise_held()
        return None, value
    except InputError as exc:
        return ("input", str(exc)), None
    except MpiconsError as exc:
        return ("write", str(exc)), None
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        return ("write", f"{where}{exc.strerror or exc}"), None
    except KeyboardInterrupt:
        return ("interrupt", "interrupted (KeyboardInterrupt)"), None
    except BaseException as exc:  # noqa: BLE001 - a bug or a SystemExit inside a phase: reported on every rank
        if memory_exhausted(exc):  # MemoryError, or a thread whose stack could not be mapped
            return ("write", out_of_memory_line()), None
        return ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"), None


def _raise_agreed(errors: Sequence[Error | None], mine: Error | None) -> None:
    """Raise the agreed failure: an interruption before any other error (the user asked to stop),
    else the first failure in rank order; the interrupted rank's is also a ``KeyboardInterrupt``."""
    failed = [(rank, error) for rank, error in enumerate(errors) if error is not None]
    if not failed:
        return
    interrupted = [(rank, error) for rank, error in failed if error[0] == "interrupt"]
    rank, (kind, message) = (interrupted or failed)[0]
    if kind == "interrupt" and mine is not None and mine[0] == "interrupt":
        raise KeyboardInterrupted(f"[rank {rank}] {message}")
    raise _KINDS[kind](f"[rank {rank}] {message}")


def agree(comm: Comm, fn: Callable[[], T], *, gather: bool = False, root: int | None = None, collective: bool = False) -> Any:
    """Run ``fn`` and agree on its outcome over ``comm``.

    - default: every rank runs ``fn``; returns this rank's value.
    - ``collective=True``: ``fn`` itself communicates over ``comm`` (a collective call, a message
      pattern), which every rank must complete. A signal is then only recorded while ``fn`` runs
      (``fn`` may raise it inside :func:`~mpicons.comm.interrupts.raising_inside`, around work of its
      own) and raised, agreed, after it: a rank that raised at the phase's start would leave the
      others waiting in ``fn``'s first collective.
    - ``gather=True``: returns the list of every rank's value (one allgather).
    - ``root=r``: only rank ``r``'s outcome counts and is broadcast (one bcast); other
      ranks still call ``fn`` so it should return None cheaply there (a signal or an
      interrupt caught there is raised, and agreed, in the rank's next phase).
    """
    error, value = _outcome(fn, collective)
    if root is not None:
        if comm.rank != root and error is not None and error[0] == "interrupt":
            _Held.interrupt = True  # only root's outcome is exchanged here: agreed in the next phase
        root_error, value = comm.bcast((error, value) if comm.rank == root else (None, None), root=root)
        errors: list[Error | None] = [None] * root
        _raise_agreed([*errors, root_error], error if comm.rank == root else None)
        return value
    if gather:
        outcomes = comm.allgather((error, value))
        _raise_agreed([e for e, _ in outcomes], error)
        return [v for _, v in outcomes]
    _raise_agreed(comm.allgather(error), error)
    return value


def agree_on(comm: Comm, rank: int, fn: Callable[[], T]) -> T:
    """Run ``fn`` on ``rank`` only and broadcast its outcome: its value, or its error on every rank."""
    result: T = agree(comm, lambda: fn() if comm.rank == rank else None, root=rank)
    return result


def wait_for_all(comm: Comm, poll: float = 0.002) -> None:
    """A barrier that sleeps instead of spinning: ranks that finish early leave the CPU to the others.

    MPI implementations busy-poll inside blocking collectives; with more ranks than cores (or
    one rank per core and I/O threads), idle ranks would slow down the ones still working.
    Every rank must call this, failing or not, before the next collective.
    """
    request = comm.ibarrier()
    with deferred():
        sleeping_wait(request, poll)


def _normalized(value: object) -> object:
    """A comparable form of an argument: paths as strings, options field by field, mappings sorted."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _normalized(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return sorted((repr(_normalized(k)), _normalized(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return [_normalized(item) for item in value]
    return value


def _fingerprint(value: object) -> tuple[str, str]:
    """(digest, what a message shows) of one argument."""
    text = repr(_normalized(value))
    shown = text if len(text) <= 80 else text[:77] + "..."
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest(), shown


def _spread(arguments: Mapping[str, object]) -> dict[str, object]:
    """Arguments to compare, an options object field by field (so a message names the field) without
    the fields marked ``rank_local`` (machine tuning a rank may set for itself)."""
    spread: dict[str, object] = {}
    for name, value in arguments.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = [f for f in dataclasses.fields(value) if not f.metadata.get("rank_local")]
            spread.update((f.name, getattr(value, f.name)) for f in fields)
        else:
            spread[name] = value
    return spread


def agree_arguments(comm: Comm, call: str, **arguments: object) -> None:
    """Refuse, on every rank alike and before any work, a collective call whose ranks passed different
    arguments (a different output directory on one rank would otherwise be silently ignored).

    Each rank sends a digest of every argument (paths as the caller made them absolute); the first
    argument that differs from rank 0's is named with both values.
    """
    prints = agree(comm, lambda: {name: _fingerprint(value) for name, value in _spread(arguments).items()}, gather=True)
    for rank, theirs in enumerate(prints):
        for name, (digest, shown) in theirs.items():
            if digest != prints[0][name][0]:
                raise InputError(
                    f"[rank {rank}] {call}: argument {name} differs between ranks: {shown} on rank {rank}, "
                    f"{prints[0][name][1]} on rank 0; every rank of the communicator must call {call} with the same arguments"
                )
