"""A failure on one rank ends every rank promptly, with a non-zero exit and nothing published."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import FIXTURES, fixture_expected, assert_consolidated, index_weight_map

HERE = Path(__file__).parent
MPIEXEC = str(Path(sys.executable).parent / "mpiexec") if (Path(sys.executable).parent / "mpiexec").exists() else shutil.which("mpiexec")
INPUT = FIXTURES / "edge-3ranks" / "sharded"


def mpirun(ranks: int, args: list[str], timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run(
        [MPIEXEC, "-n", str(ranks), sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(HERE.parent)},
    )
    return proc, time.monotonic() - start


def final_names(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) if out.exists() else []


@pytest.mark.parametrize("ranks", [1, 3])
def test_io_error_on_one_rank_fails_all_and_publishes_nothing(tmp_path, ranks):
    victim = ranks - 1
    proc, seconds = mpirun(ranks, [str(HERE / "scripts" / "inject.py"), "write-oserror", str(victim), "--", "consolidate", str(INPUT), str(tmp_path / "out")])
    assert proc.returncode == 1, proc.stderr
    assert f"[rank {victim}]" in proc.stderr and "/injected/path" in proc.stderr
    assert proc.stderr.count("mpicons: error:") == 1
    assert seconds < 30
    assert final_names(tmp_path / "out") == []
    assert list((tmp_path / "out").iterdir()) == []  # partial files removed too


def test_unexpected_exception_outside_a_phase_aborts_the_job(tmp_path):
    proc, seconds = mpirun(3, [str(HERE / "scripts" / "inject.py"), "bug-after-write", "1", "--", "consolidate", str(INPUT), str(tmp_path / "out")])
    assert proc.returncode != 0
    assert "internal error on rank 1" in proc.stderr
    assert seconds < 30


def test_bad_input_exits_2_on_every_rank_with_one_message(tmp_path):
    proc, _ = mpirun(3, ["-m", "mpicons", "consolidate", str(tmp_path / "missing"), str(tmp_path / "out")])
    assert proc.returncode == 2
    assert proc.stderr.count("mpicons: error:") == 1
    assert "missing: input directory does not exist" in proc.stderr


def test_cli_runs_without_a_launcher(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mpicons", "consolidate", str(INPUT), str(tmp_path / "out"), "--stats-json", str(tmp_path / "s.json")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "GB/s" in proc.stdout
    expected, mapping = fixture_expected("edge-3ranks")
    assert_consolidated(tmp_path / "out", expected, index_weight_map(mapping))
    import json

    report = json.loads((tmp_path / "s.json").read_text())
    assert report["ranks"] == 1 and set(report["phases"]) == {"scan", "plan", "write", "finalize"}
