"""Agreeing on failure across ranks, so one rank's error ends every rank with the same message.

An exception on one rank before a collective would leave the others blocked in it. Every
phase therefore runs through :func:`agree`: the outcome (value or error) of each rank is
exchanged in the phase's own collective and, if any rank failed, every rank raises the
first failure, naming the rank it happened on.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from .comm import Communicator, sleeping_wait
from .errors import InputError, MpiconsError, WriteError
from .interrupts import deferred, raise_pending, raising_inside

Comm = Communicator
T = TypeVar("T")

_KINDS: dict[str, type[MpiconsError]] = {"input": InputError, "write": WriteError, "error": MpiconsError}


def _outcome(fn: Callable[[], T]) -> tuple[tuple[str, str] | None, T | None]:
    try:
        with raising_inside():
            raise_pending()
            value = fn()
        raise_pending()
        return None, value
    except InputError as exc:
        return ("input", str(exc)), None
    except MpiconsError as exc:
        return ("write", str(exc)), None
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        return ("write", f"{where}{exc.strerror or exc}"), None
    except MemoryError:
        return ("write", "out of memory (try a smaller --buffer-size, or fewer ranks per node)"), None
    except Exception as exc:  # noqa: BLE001 - reported on every rank, with its traceback
        return ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"), None


def _raise_first(errors: list[tuple[str, str] | None]) -> None:
    for rank, error in enumerate(errors):
        if error is not None:
            kind, message = error
            raise _KINDS[kind](f"[rank {rank}] {message}")


def agree(comm: Comm, fn: Callable[[], T], *, gather: bool = False, root: int | None = None) -> Any:
    """Run ``fn`` and agree on its outcome over ``comm``.

    - default: every rank runs ``fn``; returns this rank's value.
    - ``gather=True``: returns the list of every rank's value (one allgather).
    - ``root=r``: only rank ``r``'s value counts and is broadcast (one bcast); other
      ranks still call ``fn`` so it should return None cheaply there.
    """
    outcome = _outcome(fn)
    if root is not None:
        error, value = comm.bcast(outcome if comm.rank == root else (None, None), root=root)
        errors: list[tuple[str, str] | None] = [None] * root
        errors.append(error)
        _raise_first(errors)
        return value
    error, value = outcome
    if gather:
        outcomes = comm.allgather((error, value))
        _raise_first([e for e, _ in outcomes])
        return [v for _, v in outcomes]
    _raise_first(comm.allgather(error))
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


def any_rank(comm: Comm, flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any."""
    return bool(comm.allreduce(int(flag), "max"))
