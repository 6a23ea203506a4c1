"""``{rank}`` paths: a directory the pattern names for a rank the job does not have is refused.

Each rank reads its own directory (``/local/ckpt-{rank}``), so a job with fewer ranks than the
checkpoint has directories leaves the rest unread, and DCP's Hugging Face layout cannot show it (the
tensors just come out short). One rank per host looks for such directories before anything is read.
"""

from __future__ import annotations

from ..comm.agreement import Comm, agree, agree_on
from ..core.errors import InputError
from ..core.reports import count_of
from ..io.inputs import rank_directories_beyond


def check_rank_directories(comm: Comm, input_dir: str, hosts: list[str]) -> None:
    """Bad input, before anything is read, when a ``{rank}`` path names an existing directory for a rank
    this job does not have: its shards would be left out, and DCP's Hugging Face layout cannot show it
    (the tensors just come out short). One rank per host looks (node-local disks differ between hosts)."""
    leader = hosts.index(hosts[comm.rank]) == comm.rank
    found = agree(comm, lambda: rank_directories_beyond(input_dir, comm.size) if leader else [], gather=True)
    beyond = sorted({entry for entries in found for entry in entries})

    def refuse() -> None:
        if not beyond:
            return
        top = beyond[-1][0]
        more = f" (and {count_of(len(beyond) - 1, 'more')} up to rank {top}: {beyond[-1][1]})" if len(beyond) > 1 else ""
        raise InputError(
            f"{beyond[0][1]}: the input {input_dir!r} has a directory for rank {beyond[0][0]}{more}, but this job has "
            f"{count_of(comm.size, 'rank')}, so its shards would be left out (the tensors would come out short): run "
            f"with -n {top + 1} (one rank per directory), or move the directories that are not part of this checkpoint away"
        )

    agree_on(comm, 0, refuse)


__all__ = ["check_rank_directories"]
