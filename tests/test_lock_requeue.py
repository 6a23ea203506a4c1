"""A requeued Slurm job takes over its own earlier attempt's lock, on any node, and nothing else does.

Slurm ends every process of an attempt before it starts the next one with the same SLURM_JOB_ID and a
higher SLURM_RESTART_COUNT, so that lock is stale wherever it was taken; the same attempt's lock is not
(a second step of the job may be running now), nor another job's, nor one without a restart count.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FIXTURES, assert_consolidated, fixture_expected, index_weight_map

from mpicons.core.errors import InputError
from mpicons.io.lock import LOCK_NAME, Holder, OutputLock
from mpicons.io.outdir import OutputDir

#: An attempt of job 1234 that ran on another node (another host name and boot): never provably gone here.
EARLIER = Holder("node-gone-7", 4242, "1234", "2026-01-01 00:00:00 UTC", "another-boot", 1, 1, "feedface", job_restart=0)


def _slurm(monkeypatch: pytest.MonkeyPatch, job: str | None, restart: str | None) -> None:
    """This process as a task of ``job`` at ``restart`` (None: the variable unset)."""
    for name, value in (("SLURM_JOB_ID", job), ("SLURM_RESTART_COUNT", restart)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


def _lock_at(out: Path, holder: Holder | dict[str, object]) -> bytes:
    raw = holder.to_bytes() if isinstance(holder, Holder) else json.dumps(holder).encode()
    (out / LOCK_NAME).write_bytes(raw)
    return raw


def test_a_requeued_attempt_takes_over_its_earlier_attempts_lock_on_another_node(tmp_path, monkeypatch):
    _slurm(monkeypatch, "1234", "1")
    _lock_at(tmp_path, EARLIER)
    lock, notes = OutputLock.acquire(str(tmp_path))
    try:
        assert notes == [
            "took over the lock of this Slurm job's earlier attempt (job 1234, restart 0 -> 1; "
            "pid 4242 on node-gone-7, Slurm job 1234, since 2026-01-01 00:00:00 UTC)"
        ]
        now = Holder.parse((tmp_path / LOCK_NAME).read_bytes())
        assert now == lock.holder and now is not None and (now.job, now.job_restart) == ("1234", 1)
    finally:
        lock.release()
    assert os.listdir(tmp_path) == []  # the earlier lock gone, nothing set aside left


def test_a_takeover_skips_attempts_and_is_noted_by_the_output_directory(tmp_path, monkeypatch):
    _slurm(monkeypatch, "1234", "3")
    _lock_at(tmp_path, dataclasses.replace(EARLIER, job_restart=1))
    session = OutputDir.open(str(tmp_path))
    try:
        assert "earlier attempt (job 1234, restart 1 -> 3" in session.notes[0]
        assert session.lock.owned()
    finally:
        session.close()


@pytest.mark.parametrize(
    "job, restart, why",
    [
        ("1234", "0", "the same attempt: maybe a second step of the job, running now"),
        (
            "1234",
            None,
            "no SLURM_RESTART_COUNT: the first attempt (0), the same as the lock's",
        ),
        ("5678", "1", "another job"),
        (None, None, "outside Slurm"),
        (None, "1", "a restart count without a job"),
    ],
)
def test_no_takeover_but_of_a_later_attempt_of_the_same_job(tmp_path, monkeypatch, job, restart, why):
    _slurm(monkeypatch, job, restart)
    raw = _lock_at(tmp_path, EARLIER)
    with pytest.raises(InputError, match="another mpicons run is using this output directory.*--break-lock"):
        OutputLock.acquire(str(tmp_path))
    assert (tmp_path / LOCK_NAME).read_bytes() == raw, why  # left as found


def test_an_earlier_attempt_never_takes_over_a_later_ones_lock(tmp_path, monkeypatch):
    _slurm(monkeypatch, "1234", "1")
    _lock_at(tmp_path, dataclasses.replace(EARLIER, job_restart=2))
    with pytest.raises(InputError, match=r"Slurm job 1234 \(restart 2\)"):
        OutputLock.acquire(str(tmp_path))


@pytest.mark.parametrize("restart", ["", "x", "-1", "+1", "1.0", " 1", "\u0661", str(1 << 40)])
def test_an_unreadable_restart_count_takes_nothing_over(tmp_path, monkeypatch, restart):
    _slurm(monkeypatch, "1234", restart)
    assert Holder.me().job_restart is None
    _lock_at(tmp_path, EARLIER)
    with pytest.raises(InputError, match="another mpicons run"):
        OutputLock.acquire(str(tmp_path))


def test_the_holder_records_the_restart_count_only_inside_slurm(monkeypatch):
    _slurm(monkeypatch, "1234", None)
    assert Holder.me().job_restart == 0  # a first attempt: Slurm sets no count
    _slurm(monkeypatch, "1234", "2")
    me = Holder.me()
    assert me.job_restart == 2 and Holder.parse(me.to_bytes()) == me
    _slurm(monkeypatch, None, "2")
    assert Holder.me().job_restart is None and Holder.me().job is None
    _slurm(monkeypatch, "", None)  # an empty SLURM_JOB_ID is no job
    assert Holder.me().job is None and Holder.me().job_restart is None


# ---------------------------------------------------------------- a lock of an older mpicons (no job_restart)


def _old_format(holder: Holder) -> dict[str, object]:
    fields = dataclasses.asdict(holder)
    del fields["job_restart"]
    return fields


def test_an_old_format_lock_is_read_but_never_taken_over_as_a_requeue(tmp_path, monkeypatch):
    _slurm(monkeypatch, "1234", "1")
    raw = _lock_at(tmp_path, _old_format(EARLIER))
    assert Holder.parse(raw) == dataclasses.replace(EARLIER, job_restart=None)
    with pytest.raises(InputError, match="pid 4242 on node-gone-7, Slurm job 1234.*--break-lock"):
        OutputLock.acquire(str(tmp_path))
    assert (tmp_path / LOCK_NAME).read_bytes() == raw
    lock, notes = OutputLock.acquire(str(tmp_path), break_lock=True)
    assert notes[0].startswith("broke the lock of an earlier run") and notes[0].endswith("as asked (--break-lock)")
    lock.release()


def test_an_old_format_lock_whose_process_is_provably_gone_is_broken(tmp_path, monkeypatch):
    _slurm(monkeypatch, None, None)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _lock_at(tmp_path, _old_format(dataclasses.replace(Holder.me(), pid=int(ended.stdout))))
    lock, notes = OutputLock.acquire(str(tmp_path))
    assert notes[0].endswith("its process is gone")
    lock.release()


@pytest.mark.parametrize(
    "damage",
    [
        {"job_restart": -1},
        {"job_restart": "1"},
        {"job_restart": True},
        {"job_restart": 1.0},
        {"job_restart": 1 << 40},
        {"job_restart": [1]},
        {"job": None, "job_restart": 0},  # mpicons counts restarts only inside a Slurm job
        {"job_restart_extra": 1},
    ],
)
def test_a_malformed_restart_count_is_an_unknown_holder(tmp_path, monkeypatch, damage):
    _slurm(monkeypatch, "1234", "1")
    raw = _lock_at(tmp_path, {**dataclasses.asdict(EARLIER), **damage})
    assert Holder.parse(raw) is None
    with pytest.raises(InputError, match="held by an unknown holder.*--break-lock"):
        OutputLock.acquire(str(tmp_path))
    assert (tmp_path / LOCK_NAME).read_bytes() == raw


# ---------------------------------------------------------------- the command line


def test_a_requeued_consolidation_runs_past_its_earlier_attempts_lock(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    _lock_at(out, EARLIER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    command = [sys.executable, "-m", "mpicons", "consolidate", str(FIXTURES / "edge-3ranks" / "sharded"), str(out)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**env, "SLURM_JOB_ID": "1234"})
    assert first.returncode == 2 and "another mpicons run is using this output directory" in first.stderr
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**env, "SLURM_JOB_ID": "1234", "SLURM_RESTART_COUNT": "1"}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "earlier attempt (job 1234, restart 0 -> 1" in proc.stdout + proc.stderr
    expected, mapping = fixture_expected("edge-3ranks")
    assert_consolidated(out, expected, index_weight_map(mapping))
