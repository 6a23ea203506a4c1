"""The Slurm scripts' command lines, run with mpiexec in place of srun, and launcher-mismatch detection."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import FIXTURES, MPIEXEC, assert_consolidated, fixture_expected, index_weight_map, writing_started

from mpicons.core.errors import InputError
from mpicons.frontends.cli import check_launcher

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
        env=_env(MPICONS_LAUNCH=f"{MPIEXEC} -n 3", MPICONS_PROGRESS_EVERY="5", MPICONS_PROGRESS="lines"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "finished with exit code 0" in proc.stdout  # MPICONS_PROGRESS=lines is mpicons' own setting, not seconds
    expected, mapping = fixture_expected("edge-3ranks")
    assert_consolidated(out, expected, index_weight_map(mapping))


@pytest.mark.slow
def test_sbatch_script_writes_to_s3(tmp_path, s3_endpoint, s3_bucket):
    """An s3:// output passes the script's path checks (mpicons checks access itself) and is uploaded."""
    import s3server

    proc = subprocess.run(
        ["bash", str(ROOT / "slurm" / "consolidate.sbatch"), str(INPUT), f"s3://{s3_bucket}/hf", "--s3-endpoint", s3_endpoint],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(MPICONS_LAUNCH=f"{MPIEXEC} -n 2"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s3 = s3server.client(s3_endpoint)
    got = tmp_path / "got"
    got.mkdir()
    for item in s3.list_objects_v2(Bucket=s3_bucket, Prefix="hf/")["Contents"]:
        (got / item["Key"][3:]).write_bytes(s3.get_object(Bucket=s3_bucket, Key=item["Key"])["Body"].read())
    expected, mapping = fixture_expected("edge-3ranks")
    assert_consolidated(got, expected, index_weight_map(mapping))


def test_sbatch_script_passes_failure_through(tmp_path):
    (tmp_path / "empty").mkdir()  # passes the script's checks; mpicons finds no checkpoint in it
    proc = subprocess.run(
        ["bash", str(ROOT / "slurm" / "consolidate.sbatch"), str(tmp_path / "empty"), str(tmp_path / "hf")],
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
    (venv / "bin" / "python").symlink_to(sys.executable)  # the script checks the options with it
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


SBATCH_SCRIPT = ROOT / "slurm" / "consolidate.sbatch"
SUBMIT_SCRIPT = ROOT / "slurm" / "train-then-consolidate.sh"


def _recording_command(folder: Path, name: str, output: str = "") -> Path:
    """A stand-in for ``sbatch`` or a launcher: appends its arguments to ``folder/name.log``."""
    folder.mkdir(exist_ok=True)
    command = folder / name
    command.write_text(f'#!/bin/sh\necho "$@" >> "{folder / name}.log"\necho {output}\n')
    command.chmod(0o755)
    return command


def _sbatch_script(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """consolidate.sbatch with a recording launcher: returns the run and the launcher's log."""
    launcher = _recording_command(tmp_path / "bin", "launcher")
    proc = subprocess.run(
        ["bash", str(SBATCH_SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**_env(MPICONS_LAUNCH=str(launcher)), **env},
    )
    return proc, tmp_path / "bin" / "launcher.log"


@pytest.mark.parametrize(
    "env, args, message",
    [
        ({"MPICONS_PROGRESS": "30"}, [], "set MPICONS_PROGRESS_EVERY=30"),
        ({"MPICONS_PROGRESS": "fancy"}, [], "expected bar or lines"),
        ({"MPICONS_PROGRESS_EVERY": "soon"}, [], "MPICONS_PROGRESS_EVERY='soon'"),
        ({"MPICONS_VENV": "/nonexistent/venv"}, [], "set MPICONS_VENV"),
        ({"MPICONS_LAUNCH": "no-such-launcher -n 2"}, [], "launcher 'no-such-launcher' not found"),
        ({}, ["--forc"], "did you mean --force?"),
        ({}, ["--mapping", "m.json", "--max-shard-size", "5GB"], "give one"),
    ],
)
def test_sbatch_script_checks_settings_before_anything_else(tmp_path, env, args, message):
    proc, launched = _sbatch_script(tmp_path, str(INPUT), str(tmp_path / "hf"), *args, **env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert not launched.exists() and not (tmp_path / "hf").exists()


def test_sbatch_script_checks_paths_before_anything_else(tmp_path):
    (tmp_path / "file").write_text("")
    cases = [
        ((tmp_path / "missing", tmp_path / "hf"), "INPUT_DIR .*missing does not exist"),
        ((tmp_path / "file", tmp_path / "hf"), "INPUT_DIR .*file is not a directory"),
        ((INPUT, tmp_path / "file"), "OUTPUT_DIR .*file exists and is not a directory"),
        ((INPUT, tmp_path / "file" / "hf"), "OUTPUT_DIR .* cannot be written"),
    ]
    for (input_dir, output_dir), message in cases:
        proc, launched = _sbatch_script(tmp_path, str(input_dir), str(output_dir))
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert re.search(message, proc.stderr), proc.stderr
        assert not launched.exists()


def test_progress_setting_has_the_meaning_mpicons_gives_it(tmp_path):
    proc, launched = _sbatch_script(
        tmp_path, str(INPUT), str(tmp_path / "hf"), "-v", MPICONS_PROGRESS="lines", MPICONS_PROGRESS_EVERY="7"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert launched.read_text().split() == [
        str(Path(sys.executable).parent / "mpicons"),
        "consolidate",
        str(INPUT),
        str(tmp_path / "hf"),
        "--progress",
        "7",
        "-v",
    ]


def _submit(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """train-then-consolidate.sh with a recording ``sbatch`` on PATH: the run and sbatch's log."""
    bin_dir = tmp_path / "bin"
    _recording_command(bin_dir, "sbatch", output="4242")
    launcher = _recording_command(bin_dir, "launcher")
    train = tmp_path / "train.sbatch"
    train.write_text("#!/bin/sh\n")
    proc = subprocess.run(
        ["bash", str(SUBMIT_SCRIPT), str(train), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**_env(MPICONS_LAUNCH=str(launcher)), "PATH": f"{bin_dir}:{os.environ['PATH']}", **env},
    )
    return proc, bin_dir / "sbatch.log"


def test_submit_script_submits_training_then_the_dependent_consolidation(tmp_path):
    checkpoint = tmp_path / "run" / "step-10"  # written by the training: need not exist yet
    proc, submitted = _submit(tmp_path, str(checkpoint), str(tmp_path / "hf"), "--split", "files")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    training, consolidation = submitted.read_text().splitlines()
    assert training == f"--parsable {tmp_path / 'train.sbatch'}"
    assert consolidation.split() == [
        "--parsable",
        "--dependency=afterok:4242",
        "--kill-on-invalid-dep=yes",
        str(SBATCH_SCRIPT),
        str(checkpoint),
        str(tmp_path / "hf"),
        "--split",
        "files",
    ]


@pytest.mark.parametrize(
    "env, args, message",
    [
        ({"MPICONS_PROGRESS": "30"}, [], "MPICONS_PROGRESS_EVERY"),
        ({"MPICONS_VENV": "/nonexistent/venv"}, [], "set MPICONS_VENV"),
        ({"MPICONS_LAUNCH": "no-such-launcher"}, [], "launcher 'no-such-launcher' not found"),
        ({}, ["--break"], "did you mean --break-lock?"),
        ({}, ["--dtype", "fp4"], "invalid choice: 'fp4'"),
    ],
)
def test_submit_script_checks_everything_before_submitting_training(tmp_path, env, args, message):
    proc, submitted = _submit(tmp_path, str(tmp_path / "ckpt"), str(tmp_path / "hf"), *args, **env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert not submitted.exists()  # nothing was submitted


def test_submit_script_refuses_a_missing_training_script(tmp_path):
    proc = subprocess.run(
        ["bash", str(SUBMIT_SCRIPT), str(tmp_path / "nope.sbatch"), str(tmp_path / "ckpt"), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert proc.returncode == 2
    assert "nope.sbatch is not a readable file" in proc.stderr


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
