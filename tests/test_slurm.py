"""The Slurm scripts' command lines, run with mpiexec in place of srun, and launcher-mismatch detection.

consolidate-preemptible.sbatch passes every check consolidate.sbatch does, and more: it requeues itself
(a recording ``scontrol`` stands in) when its time runs out, and a requeued attempt runs the same command.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import FIXTURES, MPIEXEC, assert_consolidated, fixture_expected, index_weight_map, writing_started

from mpicons.core.errors import InputError
from mpicons.frontends.cli import check_launcher
from mpicons.io.lock import LOCK_NAME, Holder

ROOT = Path(__file__).parent.parent
INPUT = FIXTURES / "edge-3ranks" / "sharded"
SBATCH_SCRIPT = ROOT / "slurm" / "consolidate.sbatch"
PREEMPTIBLE_SCRIPT = ROOT / "slurm" / "consolidate-preemptible.sbatch"
SUBMIT_SCRIPT = ROOT / "slurm" / "train-then-consolidate.sh"
#: The two batch scripts: every check of the plain one holds for the preemptible one too.
BATCH_SCRIPTS = pytest.mark.parametrize("batch", [SBATCH_SCRIPT, PREEMPTIBLE_SCRIPT], ids=lambda path: path.name)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["MPICONS_VENV"] = str(Path(sys.executable).parent.parent)
    env.update(extra)
    return env


@BATCH_SCRIPTS
def test_sbatch_script_runs_with_mpiexec_in_place_of_srun(tmp_path, batch):
    out = tmp_path / "hf"
    proc = subprocess.run(
        ["bash", str(batch), str(INPUT), str(out), "--split", "files"],
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


@BATCH_SCRIPTS
def test_sbatch_script_passes_failure_through(tmp_path, batch):
    (tmp_path / "empty").mkdir()  # passes the script's checks; mpicons finds no checkpoint in it
    scontrol = _recording_command(tmp_path / "bin", "scontrol")
    proc = subprocess.run(
        ["bash", str(batch), str(tmp_path / "empty"), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(MPICONS_LAUNCH=f"{MPIEXEC} -n 2", SLURM_JOB_ID="1234", PATH=f"{scontrol.parent}:{os.environ['PATH']}"),
    )
    assert proc.returncode == 2
    assert "finished with exit code 2" in proc.stdout
    assert not Path(f"{scontrol}.log").exists()  # a failure is no reason to requeue


def _held_venv(tmp_path: Path) -> Path:
    """A virtualenv whose mpicons holds every rank at its first block (until MPICONS_TEST_RELEASE
    exists), so that a signal certainly lands mid-write."""
    script = ROOT / "tests" / "scripts" / "inject.py"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    shim = venv / "bin" / "mpicons"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} {script} hold-write 0 -- "$@"\n')
    shim.chmod(0o755)
    (venv / "bin" / "python").symlink_to(sys.executable)  # the script checks the options with it
    return venv


def _signalled_mid_write(batch: Path, out: Path, signum: int, **env: str) -> tuple[int, str, str]:
    """Run ``batch`` into ``out``, send its shell ``signum`` once mpicons writes: exit code, stdout, stderr."""
    tmp = out.parent
    release = tmp / "release"  # never made: the ranks hold until the signal stops them
    proc = subprocess.Popen(
        ["bash", str(batch), str(INPUT), str(out), "--split", "files"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **_env(MPICONS_LAUNCH=f"{MPIEXEC} -n 2", PYTHONPATH=str(ROOT), MPICONS_TEST_RELEASE=str(release), **env),
            "MPICONS_VENV": str(_held_venv(tmp)),
        },
        start_new_session=True,  # its own process group: ended whole should the test fail
    )
    try:
        deadline = time.monotonic() + 120
        while not writing_started(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert writing_started(out), "mpicons did not start writing"
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        _end_group(proc)
    return proc.returncode, stdout, stderr


def _end_group(proc: subprocess.Popen[str]) -> None:
    """Kill what is left of a script started in its own session (a test that failed half-way)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_sbatch_script_usr1_before_time_limit_stops_cleanly(tmp_path):
    """Slurm's --signal=B:USR1@120 reaches the batch shell, whose trap stops mpicons."""
    out = tmp_path / "hf"
    returncode, stdout, stderr = _signalled_mid_write(SBATCH_SCRIPT, out, signal.SIGUSR1)
    assert returncode != 0, stdout + stderr
    assert "time limit near" in stderr
    assert not out.exists() or [p.name for p in out.iterdir() if not p.name.startswith(".")] == []  # nothing published


def _recording_command(folder: Path, name: str, output: str = "") -> Path:
    """A stand-in for ``sbatch`` or a launcher: appends its arguments to ``folder/name.log``."""
    folder.mkdir(exist_ok=True)
    command = folder / name
    command.write_text(f'#!/bin/sh\necho "$@" >> "{folder / name}.log"\necho {output}\n')
    command.chmod(0o755)
    return command


def _sbatch_script(
    tmp_path: Path, *args: str, batch: Path = SBATCH_SCRIPT, **env: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A batch script (consolidate.sbatch unless ``batch``) with a recording launcher: the run and the launcher's log."""
    launcher = _recording_command(tmp_path / "bin", "launcher")
    proc = subprocess.run(
        ["bash", str(batch), *args],
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
@BATCH_SCRIPTS
def test_sbatch_script_checks_settings_before_anything_else(tmp_path, env, args, message, batch):
    proc, launched = _sbatch_script(tmp_path, str(INPUT), str(tmp_path / "hf"), *args, batch=batch, **env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert not launched.exists() and not (tmp_path / "hf").exists()


@BATCH_SCRIPTS
def test_sbatch_script_checks_paths_before_anything_else(tmp_path, batch):
    (tmp_path / "file").write_text("")
    cases = [
        ((tmp_path / "missing", tmp_path / "hf"), "INPUT_DIR .*missing does not exist"),
        ((tmp_path / "file", tmp_path / "hf"), "INPUT_DIR .*file is not a directory"),
        ((INPUT, tmp_path / "file"), "OUTPUT_DIR .*file exists and is not a directory"),
        ((INPUT, tmp_path / "file" / "hf"), "OUTPUT_DIR .* cannot be written"),
    ]
    for (input_dir, output_dir), message in cases:
        proc, launched = _sbatch_script(tmp_path, str(input_dir), str(output_dir), batch=batch)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert re.search(message, proc.stderr), proc.stderr
        assert not launched.exists()


@BATCH_SCRIPTS
def test_progress_setting_has_the_meaning_mpicons_gives_it(tmp_path, batch):
    proc, launched = _sbatch_script(
        tmp_path, str(INPUT), str(tmp_path / "hf"), "-v", batch=batch, MPICONS_PROGRESS="lines", MPICONS_PROGRESS_EVERY="7"
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


# ---------------------------------------------------------------- consolidate-preemptible.sbatch


def _with_scontrol(tmp_path: Path, **env: str) -> tuple[dict[str, str], Path]:
    """Slurm variables (SLURM_JOB_ID 1234 unless given) and a recording ``scontrol`` first on PATH: the
    environment to add, and the log the scontrol keeps."""
    scontrol = _recording_command(tmp_path / "bin", "scontrol")
    return {"SLURM_JOB_ID": "1234", "PATH": f"{scontrol.parent}:{os.environ['PATH']}", **env}, Path(f"{scontrol}.log")


@pytest.mark.parametrize(
    "restarts, requeued",
    [(None, "requeueing job 1234"), ("4", "requeueing job 1234"), ("5", "not requeued: job 1234 has restarted 5 times")],
)
def test_preemptible_script_requeues_itself_when_its_time_runs_out(tmp_path, restarts, requeued):
    """USR1 before the time limit: mpicons stops, the job is requeued (up to MPICONS_MAX_REQUEUES restarts),
    and the next attempt, the same command with SLURM_RESTART_COUNT one higher, writes the whole result."""
    out = tmp_path / "hf"
    slurm, scontrol_log = _with_scontrol(tmp_path, **({"SLURM_RESTART_COUNT": restarts} if restarts else {}))
    returncode, stdout, stderr = _signalled_mid_write(PREEMPTIBLE_SCRIPT, out, signal.SIGUSR1, **slurm)
    assert returncode != 0, stdout + stderr
    assert "time limit near: stopping" in stderr and requeued in stderr
    assert (scontrol_log.read_text() if scontrol_log.exists() else None) == (
        "requeue 1234\n" if requeued.startswith("requeueing") else None
    )
    slurm["SLURM_RESTART_COUNT"] = str(int(restarts or 0) + 1)
    stats = tmp_path / "stats.json"
    proc = subprocess.run(
        ["bash", str(PREEMPTIBLE_SCRIPT), str(INPUT), str(out), "--split", "files", "--stats-json", str(stats)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(MPICONS_LAUNCH=f"{MPIEXEC} -n 3", **slurm),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert type(json.loads(stats.read_text())["resumed_bytes"]) is int  # how much it reused (docs/slurm.md)
    expected, mapping = fixture_expected("edge-3ranks")
    assert_consolidated(out, expected, index_weight_map(mapping))


def test_preemptible_script_takes_over_its_earlier_attempts_lock(tmp_path):
    """An attempt SIGKILLed on another node left its lock: the requeued attempt (restart count one higher)
    takes it over; a run of the same attempt does not."""
    out = tmp_path / "hf"
    out.mkdir()
    earlier = Holder("node-gone-7", 4242, "1234", "2026-01-01 00:00:00 UTC", "another-boot", 1, 1, "feedface", job_restart=0)
    (out / LOCK_NAME).write_bytes(earlier.to_bytes())
    slurm, _ = _with_scontrol(tmp_path)
    command = ["bash", str(PREEMPTIBLE_SCRIPT), str(INPUT), str(out), "--split", "files"]
    launch = f"{MPIEXEC} -n 3"
    same = subprocess.run(command, capture_output=True, text=True, timeout=120, env=_env(MPICONS_LAUNCH=launch, **slurm))
    assert same.returncode == 2 and "another mpicons run is using this output directory" in same.stderr
    slurm["SLURM_RESTART_COUNT"] = "1"
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=_env(MPICONS_LAUNCH=launch, **slurm))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "took over the lock of this Slurm job's earlier attempt (job 1234, restart 0 -> 1" in proc.stderr
    expected, mapping = fixture_expected("edge-3ranks")
    assert_consolidated(out, expected, index_weight_map(mapping))


def _waiting_launcher(folder: Path) -> Path:
    """A stand-in for srun that records the signals it gets (each ends it) in ``folder/launcher.log``."""
    launcher = folder / "launcher"
    log, ready = folder / "launcher.log", folder / "launcher.ready"
    launcher.write_text(
        f"#!/bin/bash\ntrap 'echo USR1 >> {log}; exit 1' USR1\ntrap 'echo TERM >> {log}; exit 1' TERM\n"
        f"touch {ready}\nwhile :; do sleep 0.05; done\n"
    )
    launcher.chmod(0o755)
    return launcher


@pytest.mark.parametrize(
    "signum, said, requeue",
    [(signal.SIGUSR1, "time limit near", "requeue 1234\n"), (signal.SIGTERM, "SIGTERM (preempted or cancelled)", None)],
)
def test_preemptible_script_passes_usr1_to_the_launcher_and_leaves_preemption_to_slurm(tmp_path, signum, said, requeue):
    """srun forwards USR1 to every task but answers TERM by killing them: the launcher gets USR1 whatever
    reached the script. Only the time limit makes the script requeue the job: after a TERM (preemption,
    scancel) requeueing is Slurm's (--requeue), or nobody's."""
    slurm, scontrol_log = _with_scontrol(tmp_path)
    launcher = _waiting_launcher(tmp_path / "bin")
    proc = subprocess.Popen(
        ["bash", str(PREEMPTIBLE_SCRIPT), str(INPUT), str(tmp_path / "hf")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(MPICONS_LAUNCH=str(launcher), **slurm),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "bin" / "launcher.ready").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "bin" / "launcher.ready").exists(), "the script did not start the launcher"
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        _end_group(proc)
    assert proc.returncode == 1, stdout + stderr
    assert f"{said}: stopping" in stderr and "finished with exit code 1" in stdout
    assert (tmp_path / "bin" / "launcher.log").read_text() == "USR1\n"
    assert (scontrol_log.read_text() if scontrol_log.exists() else None) == requeue


@pytest.mark.parametrize("restarts, kept", [(None, True), ("0", True), ("2", False)])
def test_preemptible_script_restarts_only_on_the_first_attempt(tmp_path, restarts, kept):
    """--restart discards an earlier run's partial output: on a requeued attempt it would discard the
    earlier attempts' work each time, so the script drops it there."""
    env = {"SLURM_JOB_ID": "1234", **({"SLURM_RESTART_COUNT": restarts} if restarts else {})}
    args = (str(INPUT), str(tmp_path / "hf"), "--restart", "-v")
    proc, launched = _sbatch_script(tmp_path, *args, batch=PREEMPTIBLE_SCRIPT, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert launched.read_text().split()[-2:] == (["--restart", "-v"] if kept else ["30", "-v"])
    assert ("--restart dropped" in proc.stderr) is not kept


@pytest.mark.parametrize(
    "env, message",
    [
        ({"MPICONS_MAX_REQUEUES": "many"}, "MPICONS_MAX_REQUEUES='many': expected a number of restarts"),
        ({"MPICONS_MAX_REQUEUES": "-1"}, "MPICONS_MAX_REQUEUES='-1'"),
        ({"SLURM_RESTART_COUNT": "x"}, "SLURM_RESTART_COUNT='x'"),
    ],
)
def test_preemptible_script_checks_its_own_settings(tmp_path, env, message):
    proc, launched = _sbatch_script(tmp_path, str(INPUT), str(tmp_path / "hf"), batch=PREEMPTIBLE_SCRIPT, **env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert not launched.exists() and not (tmp_path / "hf").exists()


def _sbatch_options(script: Path) -> list[str]:
    return re.findall(r"^#SBATCH (\S+)$", script.read_text(), re.MULTILINE)


def test_preemptible_script_asks_consolidate_sbatch_resources_and_to_be_requeued():
    """The same job as consolidate.sbatch, requeueable, its log appended to by every attempt, and warned
    (USR1 to the batch shell, which requeues the job) 120 s before the time limit."""
    plain = [option for option in _sbatch_options(SBATCH_SCRIPT) if not option.startswith("--signal=")]
    assert sorted(_sbatch_options(PREEMPTIBLE_SCRIPT)) == sorted(
        [*plain, "--open-mode=append", "--requeue", "--signal=B:USR1@120"]
    )


@pytest.mark.parametrize("script", sorted((ROOT / "slurm").iterdir()), ids=lambda path: path.name)
def test_the_scripts_parse_and_pass_shellcheck(script):
    """bash -n always; shellcheck (warnings and errors) where it is installed."""
    parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    checked = subprocess.run(["shellcheck", "--severity=warning", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout


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
