"""Exceptions that cross the rank boundary: bad input (exit 2) vs. runtime failure (exit 1)."""

from __future__ import annotations

#: The one line for memory running out, wherever it happens.
OUT_OF_MEMORY = "out of memory (try a smaller --buffer-size, or fewer ranks per node)"


class MpiconsError(Exception):
    """Base class: a failure mpicons can explain in one line."""

    exit_code = 1


class InputError(MpiconsError):
    """The checkpoint, the mapping or the options are wrong; rerunning will not help."""

    exit_code = 2


class WriteError(MpiconsError):
    """Reading or writing failed at run time (disk full, permissions, I/O error, signal)."""

    exit_code = 1


class Interrupted(WriteError):
    """A signal (SIGTERM, SIGUSR1 before a Slurm time limit, SIGINT) stopped the job."""
