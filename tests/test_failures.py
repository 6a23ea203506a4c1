"""A failure on one rank ends every rank promptly, with a non-zero exit and nothing published."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    FIXTURES,
    assert_consolidated,
    fixture_expected,
    index_weight_map,
    mpirun,
    run_python,
    start,
    writing_started,
)

HERE = Path(__file__).parent
INPUT = FIXTURES / "edge-3ranks" / "sharded"


def final_names(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) if out.exists() else []


@pytest.mark.parametrize("ranks", [1, 3])
def test_io_error_on_one_rank_fails_all_and_publishes_nothing(tmp_path, ranks):
    victim = ranks - 1
    proc, seconds = mpirun(
        ranks,
        [
            str(HERE / "scripts" / "inject.py"),
            "write-oserror",
            str(victim),
            "--",
            "consolidate",
            str(INPUT),
            str(tmp_path / "out"),
        ],
    )
    assert proc.returncode == 1, proc.stderr
    assert f"[rank {victim}]" in proc.stderr and "/injected/path" in proc.stderr
    assert proc.stderr.count("mpicons: error:") == 1
    assert seconds < 30
    assert not (tmp_path / "out").exists()  # made by the run, removed with everything in it


def test_unexpected_exception_outside_a_phase_aborts_the_job(tmp_path):
    proc, seconds = mpirun(
        3, [str(HERE / "scripts" / "inject.py"), "bug-after-write", "1", "--", "consolidate", str(INPUT), str(tmp_path / "out")]
    )
    assert proc.returncode != 0
    assert "internal error on rank 1" in proc.stderr
    assert seconds < 30


def test_bad_input_exits_2_on_every_rank_with_one_message(tmp_path):
    proc, _ = mpirun(3, ["-m", "mpicons", "consolidate", str(tmp_path / "missing"), str(tmp_path / "out")])
    assert proc.returncode == 2
    assert proc.stderr.count("mpicons: error:") == 1
    assert "missing: input directory does not exist" in proc.stderr


def test_cli_runs_without_a_launcher(tmp_path):
    proc = run_python("-m", "mpicons", "consolidate", INPUT, tmp_path / "out", "--stats-json", tmp_path / "s.json")
    assert proc.returncode == 0, proc.stderr
    assert "/s overall" in proc.stdout
    expected, mapping = fixture_expected("edge-3ranks")
    assert_consolidated(tmp_path / "out", expected, index_weight_map(mapping))
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["ranks"] == 1 and set(report["phases"]) == {"scan", "plan", "write", "finalize"}


INJECT = str(HERE / "scripts" / "inject.py")


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGUSR1, marks=pytest.mark.slow)])
def test_signal_to_the_job_aborts_cleanly(tmp_path, signum):
    """What Slurm does before a time limit: every rank stops, partial files are removed."""
    out = tmp_path / "out"
    proc = start(3, INJECT, "slow-write", "0", "--", "consolidate", INPUT, out, "--buffer-size", "64K", "--split", "files")
    deadline = time.monotonic() + 20
    while not writing_started(out) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode != 0, stderr  # the ranks exit 1; mpiexec may report the signal instead
    assert f"interrupted by {signal.Signals(signum).name}" in stderr
    assert not out.exists()


def test_signal_to_one_rank_ends_all_ranks(tmp_path):
    proc, seconds = mpirun(3, [INJECT, "signal-write", "1", "--", "consolidate", str(INPUT), str(tmp_path / "out")])
    assert proc.returncode == 1
    assert "[rank 1] interrupted by SIGTERM" in proc.stderr
    assert not (tmp_path / "out").exists()
    assert seconds < 30


@pytest.mark.parametrize("fault", ["signal-progress-start", "signal-progress-finish"])
@pytest.mark.parametrize("victim", [0, 2])
def test_a_signal_inside_the_progress_protocol_ends_every_rank(tmp_path, fault, victim):
    """The reporter's set-up and its last reports are a message pattern: a signal there is held
    until it completes (raising mid-way left rank 0 waiting for a report that never came)."""
    args = [INJECT, fault, str(victim), "--", "consolidate", str(INPUT), str(tmp_path / "out"), "--progress", "0.01"]
    proc, seconds = mpirun(3, args, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "interrupted by SIGTERM" in proc.stderr
    assert not (tmp_path / "out").exists()
    assert seconds < 30


def test_rank_killed_mid_write_ends_the_job_and_a_rerun_succeeds(tmp_path):
    out = tmp_path / "out"
    proc, seconds = mpirun(3, [INJECT, "kill-write", "2", "--", "consolidate", str(INPUT), str(out)])
    assert proc.returncode != 0
    assert seconds < 30
    assert final_names(out) == []
    rerun, _ = mpirun(3, ["-m", "mpicons", "consolidate", str(INPUT), str(out), "-q"])
    assert rerun.returncode == 0, rerun.stderr
    expected, mapping = fixture_expected("edge-3ranks")
    assert_consolidated(out, expected, index_weight_map(mapping))


def test_file_size_limit_is_a_clean_error(tmp_path):
    out = tmp_path / "out"
    proc, _ = mpirun(2, [INJECT, "fsize-limit", "0", "--", "consolidate", str(INPUT), str(out)])
    assert proc.returncode == 1, proc.stderr
    assert "File too large" in proc.stderr and "model-00001-of-00002.safetensors" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_existing_outputs_are_kept_unless_forced(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"precious")
    proc, _ = mpirun(2, ["-m", "mpicons", "consolidate", str(INPUT), str(out)])
    assert proc.returncode == 2 and "already holds model-00001-of-00002.safetensors (use --force" in proc.stderr
    assert (out / "model-00001-of-00002.safetensors").read_bytes() == b"precious"
    proc, _ = mpirun(2, ["-m", "mpicons", "consolidate", str(INPUT), str(INPUT)])
    assert proc.returncode == 2 and "output directory is the input directory" in proc.stderr
    proc, _ = mpirun(2, ["-m", "mpicons", "consolidate", str(INPUT), str(out), "--force", "-q"])
    assert proc.returncode == 0
    assert (out / "model-00001-of-00002.safetensors").read_bytes() != b"precious"


def test_read_only_output_directory_is_a_clean_error(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    mounted = False
    if os.geteuid() == 0:  # root ignores permission bits: use a read-only mount if we may
        mounted = (
            subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)], capture_output=True).returncode
            == 0
        )
        if not mounted:
            pytest.skip("running as root without permission to mount a read-only file system")
    else:
        target.chmod(0o555)
    try:
        proc, _ = mpirun(2, ["-m", "mpicons", "consolidate", str(INPUT), str(target / "out")])
        assert proc.returncode == 1, proc.stderr
        assert "Read-only file system" in proc.stderr or "Permission denied" in proc.stderr
        assert "Traceback" not in proc.stderr
    finally:
        if mounted:
            subprocess.run(["umount", str(target)], check=False)
        else:
            target.chmod(0o755)


@pytest.mark.slow
def test_read_error_during_node_local_exchange_ends_every_rank(tmp_path):
    """A rank that fails while others wait for its data must not leave them hanging."""
    files = sorted(INPUT.iterdir())
    for rank in range(3):
        (tmp_path / f"in-{rank}").mkdir()
    for i, path in enumerate(files):
        shutil.copy(path, tmp_path / f"in-{i % 3}" / path.name)
    out = tmp_path / "out"
    proc, seconds = mpirun(3, [INJECT, "read-error", "1", "--", "consolidate", str(tmp_path / "in-{rank}"), str(out)])
    assert proc.returncode == 1, proc.stderr
    assert "[rank 1]" in proc.stderr and "Input/output error (injected)" in proc.stderr
    assert seconds < 30
    assert not out.exists()
    good, _ = mpirun(3, ["-m", "mpicons", "consolidate", str(tmp_path / "in-{rank}"), str(out), "-q", "--gather-to", "2"])
    assert good.returncode == 0, good.stderr
    expected, mapping = fixture_expected("edge-3ranks")
    assert_consolidated(out, expected, index_weight_map(mapping))
