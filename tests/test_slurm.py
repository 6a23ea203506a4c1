"""The Slurm scripts' command lines, run with mpiexec in place of srun, and launcher-mismatch detection."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import FIXTURES, MPIEXEC, assert_consolidated, fixture_expected, index_weight_map, writing_started

from mpicons.cli import check_launcher
from mpicons.errors import InputError

ROOT = Path(__file__).parent.parent
INPUT = FIXTURES / "edge-3ranks" / "sharded"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["MPICONS_VENV"] = str(Path(sys.executable).parent.parent)
    env.update(extra)
    return env


def test_sbatch_script_runs_with_mpiexec_in_place_of_srun(tmp_path):
    out = tmp_path / "hf"
    proc = subprocess.run(
        ["bash", str(ROOT / "slurm" / "consolidate.sbatch"), str(INPUT), str(out), "--split", "files"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(MPICONS_LAUNCH=f"{MPIEXEC} -n 3", MPICONS_PROGRESS="5"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "finished with exit code 0" in proc.stdout
    expected, mapping = fixture_expected("edge-3ranks")
    assert_consolidated(out, expected, index_weight_map(mapping))


def test_sbatch_script_passes_failure_through(tmp_path):
    proc = subprocess.run(
        ["bash", str(ROOT / "slurm" / "consolidate.sbatch"), str(tmp_path / "missing"), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(MPICONS_LAUNCH=f"{MPIEXEC} -n 2"),
    )
    assert proc.returncode == 2
    assert "finished with exit code 2" in proc.stdout


def test_sbatch_script_usr1_before_time_limit_stops_cleanly(tmp_path):
    """Slurm's --signal=B:USR1@120 reaches the batch shell, whose trap stops mpicons."""
    out = tmp_path / "hf"
    script = ROOT / "tests" / "scripts" / "inject.py"
    launch = f"{MPIEXEC} -n 2"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    shim = venv / "bin" / "mpicons"  # mpicons with slow writes, so the signal lands mid-write
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} {script} slow-write 0 -- "$@"\n')
    shim.chmod(0o755)
    proc = subprocess.Popen(
        ["bash", str(ROOT / "slurm" / "consolidate.sbatch"), str(INPUT), str(out), "--buffer-size", "64K", "--split", "files"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**_env(MPICONS_LAUNCH=launch, PYTHONPATH=str(ROOT)), "MPICONS_VENV": str(venv)},
    )
    deadline = time.monotonic() + 20
    while not writing_started(out) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(10)  # SIGUSR1
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0, stdout + stderr
    assert "time limit near" in stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "env, world, bad",
    [
        ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0"}, 1, True),
        ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0"}, 4, False),
        ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0"}, 8, False),  # mpiexec: one proxy per node
        ({"SLURM_NTASKS": "16"}, 4, False),  # batch shell: mpiexec -n 4 inside a 16-task allocation
        ({}, 1, False),
    ],
)
def test_launcher_mismatch_detection(env, world, bad):
    if bad:
        with pytest.raises(InputError, match="srun --mpi=pmix"):
            check_launcher(world, env)
    else:
        check_launcher(world, env)


def test_launcher_mismatch_stops_the_command(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mpicons", "consolidate", str(INPUT), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**_env(), "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0"},
    )
    assert proc.returncode == 2
    assert "srun started 4 tasks but MPI sees 1 rank" in proc.stderr
