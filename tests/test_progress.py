"""Progress: rank 0 reports the whole job's bytes, rate and ETA while ranks write."""

from __future__ import annotations

import io
import re

from mpi4py import MPI

from mpicons.progress import Progress, human_bytes
from test_failures import INJECT, INPUT, mpirun


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_lines_from_every_rank_reach_rank_0(tmp_path):
    proc, _ = mpirun(3, [INJECT, "slow-write", "0", "--", "consolidate", str(INPUT), str(tmp_path / "out"),
                         "--buffer-size", "64K", "--split", "files", "--progress", "0.1", "-v"])
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("mpicons: progress")]
    assert len(lines) >= 2
    percents = [int(re.search(r"\((\d+)%\)", line).group(1)) for line in lines]
    assert percents == sorted(percents) and percents[-1] > 0
    assert all("ranks writing" in line and "ETA" in line for line in lines)


def test_quiet_prints_nothing(tmp_path):
    proc, _ = mpirun(2, [INJECT, "slow-write", "0", "--", "consolidate", str(INPUT), str(tmp_path / "out"), "--progress", "0.1", "-q"])
    assert proc.returncode == 0
    assert proc.stdout == ""


def test_bar_on_a_terminal():
    stream = FakeTerminal()
    reporter = Progress(MPI.COMM_SELF, total=4_000_000, interval=10, stream=stream)
    reporter.tick = 0
    reporter.last_print -= 1
    reporter.add(1_000_000)
    reporter.finish()
    text = stream.getvalue()
    updates = text.split("\r")[1:]
    assert len(updates) == 2  # one while writing, one at the end
    assert updates[0].startswith("[#######") and "1.00 MB of 4.00 MB (25%)" in updates[0]
    assert updates[1].endswith("0/1 ranks writing\n")


def test_human_bytes():
    assert human_bytes(999) == "999 B"
    assert human_bytes(1_500_000) == "1.50 MB"
    assert human_bytes(2.5e12) == "2.50 TB"
