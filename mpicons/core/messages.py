"""The tags every line mpicons prints begins with, so the command line, the job and the start-up agree."""

from __future__ import annotations

#: Every line mpicons itself prints starts with this (reports, progress, errors).
PREFIX = "mpicons: "
#: An error every rank agreed on, or one found before the job could start.
ERROR = PREFIX + "error: "
#: Something the library found and dealt with (an interrupted run recovered), on rank 0's standard error.
NOTE = PREFIX + "note: "
#: A run that succeeded but lost something the user may want (a dropped entry that was not empty).
WARNING = PREFIX + "warning: "
#: A progress line (a Slurm job log, or any standard error that is no watched terminal).
PROGRESS = PREFIX + "progress "
#: The demo's own lines around the consolidation it runs.
DEMO = "mpicons demo: "


def internal_error(rank: int) -> str:
    """The start of the line for an exception mpicons did not expect: a bug, named with its rank."""
    return f"{PREFIX}internal error on rank {rank}"


__all__ = ["PREFIX", "ERROR", "NOTE", "WARNING", "PROGRESS", "DEMO", "internal_error"]
