"""Progress: rank 0 reports the whole job's bytes, rate and ETA while ranks write."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest
from helpers import MPIEXEC
from mpi4py import MPI
from test_failures import INJECT, INPUT, mpirun

from mpicons.comm import as_communicator
from mpicons.progress import Progress, human_bytes, watched_terminal_columns


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def lines_mode(monkeypatch):
    """Lines, even when the test run itself watches a terminal (the launcher's terminal would mean a bar)."""
    monkeypatch.setenv("MPICONS_PROGRESS", "lines")


@pytest.mark.slow
def test_log_lines_from_every_rank_reach_rank_0(tmp_path, lines_mode):
    proc, _ = mpirun(
        3,
        [
            INJECT,
            "slow-write",
            "0",
            "--",
            "consolidate",
            str(INPUT),
            str(tmp_path / "out"),
            "--buffer-size",
            "64K",
            "--split",
            "files",
            "--progress",
            "0.1",
            "-v",
        ],
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpicons: progress")]
    assert len(lines) >= 2
    assert not any(line.startswith("mpicons: progress") for line in proc.stdout.splitlines())  # stdout stays clean
    percents = [int(re.search(r"\((\d+)%\)", line).group(1)) for line in lines]
    assert percents == sorted(percents) and percents[-1] > 0
    assert all("ranks writing" in line and "ETA" in line for line in lines)


def test_quiet_prints_nothing(tmp_path, lines_mode):
    proc, _ = mpirun(
        2, [INJECT, "slow-write", "0", "--", "consolidate", str(INPUT), str(tmp_path / "out"), "--progress", "0.1", "-q"]
    )
    assert proc.returncode == 0
    assert proc.stdout == "" and proc.stderr == ""


@pytest.mark.parametrize("columns", [80, 40])
def test_bar_fits_the_terminal_and_ends_on_a_full_frame(monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.delenv("MPICONS_PROGRESS", raising=False)
    stream = FakeTerminal()
    reporter = Progress(as_communicator(MPI.COMM_SELF), total=4_000_000, interval=10, stream=stream, verbose=True)
    reporter.tick = 0
    reporter.last_print -= 1
    reporter.add(1_000_000)
    reporter.add(3_000_000)
    reporter.finish()
    text = stream.getvalue()
    frames = text.split("\r")[1:]
    assert len(frames) >= 2  # while writing, and at the end
    assert frames[0].startswith("[") and "1.00 MB of 4.00 MB (25%)" in frames[0]
    assert all(len(frame.rstrip("\n")) < columns for frame in frames)  # never wraps
    assert frames[-1].endswith("\n") and "4.00 MB of 4.00 MB (100%)" in frames[-1]
    assert ("elapsed" in frames[-1]) == (columns == 80)  # what does not fit is left out, not wrapped
    assert text.count("\n") == 1  # one line in the end, drawn over


def test_terminal_behind_the_launcher_is_found():
    """Under mpiexec the ranks write to pipes; the bar is still drawn when mpiexec itself writes to a terminal."""
    env = {k: v for k, v in os.environ.items() if k not in ("MPICONS_PROGRESS", "COLUMNS")}
    code = "import sys; from mpicons.progress import watched_terminal_columns as w; print(w(sys.stderr))"
    master, slave = os.openpty()
    try:
        proc = subprocess.run(
            [MPIEXEC, "-n", "1", sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=slave,
            text=True,
            timeout=60,
            env={**env, "PYTHONPATH": str(INPUT.parents[3].parent)},
        )
    finally:
        os.close(master)
        os.close(slave)
    assert proc.returncode == 0
    assert proc.stdout.strip().isdigit()  # mpiexec's stderr is a terminal: columns found
    proc = subprocess.run(
        [MPIEXEC, "-n", "1", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "PYTHONPATH": str(INPUT.parents[3].parent)},
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout.strip() == "None"  # pipes all the way: lines


def test_choice_can_be_forced(monkeypatch):
    monkeypatch.setenv("MPICONS_PROGRESS", "lines")
    assert watched_terminal_columns(FakeTerminal()) is None
    monkeypatch.setenv("MPICONS_PROGRESS", "bar")
    monkeypatch.setenv("COLUMNS", "100")
    assert watched_terminal_columns(io.StringIO()) == 100


def test_human_bytes():
    assert human_bytes(999) == "999 B"
    assert human_bytes(1_500_000) == "1.50 MB"
    assert human_bytes(2.5e12) == "2.50 TB"
