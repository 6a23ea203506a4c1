"""Progress: rank 0 reports the whole job's bytes, rate and ETA while ranks write."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest
from helpers import MPIEXEC, start, subprocess_env
from mpi4py import MPI
from test_failures import INJECT, INPUT, mpirun

from mpicons.comm import as_communicator
from mpicons.core.errors import InputError
from mpicons.job.progress import Progress, human_bytes, progress_choice, watched_terminal_columns


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


def _frames(monkeypatch, columns: int, comm, counts: list[int], verbose: bool = True) -> list[str]:
    """The bar's frames while bytes arrive in steps of ``counts`` (rank 1's count changing too), then the end."""
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.delenv("MPICONS_PROGRESS", raising=False)
    stream = FakeTerminal()
    reporter = Progress(comm, total=4_000_000_000, interval=10, stream=stream, verbose=verbose)
    reporter.tick = 0
    for step, count in enumerate(counts):
        reporter.last_print -= 1
        if comm.size > 1:  # another rank reports, then finishes half-way: "ranks writing" changes
            reporter.counts[1] = 10**step
            reporter.finished[1] = step >= len(counts) // 2
        reporter.add(count)
    reporter.finished[1:] = True
    reporter.finish()
    return stream.getvalue().split("\r")[1:]


class FakeWorld:
    """Rank 0 of a 12-rank job, for rendering only (no messages are exchanged)."""

    rank, size = 0, 12

    def irecv(self, *args):
        return None


@pytest.mark.parametrize("columns", [40, 60, 80, 120])
@pytest.mark.parametrize("world", ["self", "twelve"])
def test_bar_frames_all_have_one_width_within_the_terminal(monkeypatch, columns, world):
    """From 0 B to terabytes, fast and slow, while ranks finish: every frame is exactly as wide."""
    comm = as_communicator(MPI.COMM_SELF) if world == "self" else FakeWorld()
    monkeypatch.setattr(Progress, "_poll", lambda self: None)
    counts = [0, 999, 1_000, 123_456, 99_999_999, 1_000_000_000, 2_000_000_000, 999_000_000]
    frames = _frames(monkeypatch, columns, comm, counts)
    assert len(frames) == len(counts) + 1
    widths = {len(frame.rstrip("\n")) for frame in frames}
    assert len(widths) == 1 and widths.pop() <= columns - 1, frames  # the last column is never written
    assert frames[-1].endswith("\n") and " 100% " in frames[-1] and " of 4.00 GB" in frames[-1]
    assert all(frame.startswith("[") and "] " in frame for frame in frames)
    bars = [frame[1 : frame.index("]")] for frame in frames]
    assert len({len(bar) for bar in bars}) == 1 and len(bars[0]) >= 10
    if columns >= 80:  # room for the fields that say when it ends and who is still writing
        assert "ETA" in frames[0] and "took" in frames[-1]
        assert "ranks writing" in frames[0] or columns < 120


def test_bar_fields_are_whole_or_left_out(monkeypatch):
    """What does not fit is left out, never cut: each frame ends with a complete field."""
    for columns in range(30, 200, 7):
        frames = _frames(monkeypatch, columns, as_communicator(MPI.COMM_SELF), [1_000_000, 3_000_000])
        for frame in frames:
            assert re.search(r"(%|of 4\.00 GB|/s|\d:\d\d:\d\d|\?|ranks writing|[kMG]?B)\n?$", frame), (columns, frame)


def test_wrong_progress_setting_is_refused_by_name():
    assert progress_choice({"MPICONS_PROGRESS": "Lines"}) == "lines"
    assert progress_choice({}) is None
    with pytest.raises(InputError, match="MPICONS_PROGRESS='30'.*--progress N"):
        progress_choice({"MPICONS_PROGRESS": "30"})


def test_terminal_behind_the_launcher_is_found():
    """Under mpiexec the ranks write to pipes; the bar is still drawn when mpiexec itself writes to a terminal."""
    env = {k: v for k, v in os.environ.items() if k not in ("MPICONS_PROGRESS", "COLUMNS")}
    code = "import sys; from mpicons.job.progress import watched_terminal_columns as w; print(w(sys.stderr))"
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


def test_the_last_frame_after_a_stop_does_not_look_like_completion(monkeypatch):
    """After Ctrl-C the final frame said 'took 0:00:03', as a finished run's does."""
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.delenv("MPICONS_PROGRESS", raising=False)
    stream = FakeTerminal()
    reporter = Progress(as_communicator(MPI.COMM_SELF), total=4_000_000, interval=10, stream=stream)
    reporter.tick = 0
    reporter.last_print -= 1
    reporter.add(1_000_000)
    reporter.finish(stopped=True)
    frames = stream.getvalue().split("\r")[1:]
    assert len(frames) == 2 and len({len(frame.rstrip("\n")) for frame in frames}) == 1, frames
    assert "stopped" in frames[-1] and "took" not in frames[-1] and " 25% " in frames[-1], frames


def test_a_bar_ended_by_a_signal_on_another_rank_says_stopped(tmp_path):
    """Rank 1 is signalled mid-write; rank 0, whose share completes, draws the last frame."""
    env = subprocess_env(MPICONS_PROGRESS="bar", COLUMNS="100")
    args = ["signal-write", "1", "--", "consolidate", INPUT, tmp_path / "out", "--progress", "0.01", "--split", "files"]
    proc = start(2, INJECT, *args, env=env)
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode != 0 and "interrupted by SIGTERM" in stderr, stderr
    frames = [frame for frame in re.split(r"[\r\n]", stderr) if frame.startswith("[")]
    assert frames and "stopped" in frames[-1] and "took" not in frames[-1], stderr
