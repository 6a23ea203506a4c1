"""A failure on one rank ends every rank promptly, with a non-zero exit and nothing published."""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    FIXTURES,
    MPIEXEC,
    assert_consolidated,
    fixture_expected,
    index_weight_map,
    mpirun,
    run_python,
    start,
    subprocess_env,
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
    assert not (tmp_path / "out").exists()  # made by the run, removed with everything in it


def test_unexpected_exception_outside_a_phase_aborts_the_job(tmp_path):
    proc, seconds = mpirun(
        3, [str(HERE / "scripts" / "inject.py"), "bug-after-write", "1", "--", "consolidate", str(INPUT), str(tmp_path / "out")]
    )
    assert proc.returncode != 0
    assert "internal error on rank 1" in proc.stderr


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


@pytest.mark.parametrize("split", ["files", "bytes"])
def test_signal_as_a_collective_phase_starts_ends_all_ranks(tmp_path, split):
    """One rank's signal lands as the write phase starts, where the other ranks are already in the phase's
    first collective call (the progress channel, the exchange): it stops there, agreed, not before it."""
    out = tmp_path / "out"
    proc, _ = mpirun(3, [INJECT, "signal-phase-start", "1", "--", "consolidate", str(INPUT), str(out), "--split", split])
    assert proc.returncode == 1, proc.stderr
    assert "[rank 1] interrupted by SIGTERM" in proc.stderr
    assert not out.exists()


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


def test_rank_killed_mid_write_ends_the_job_and_a_rerun_succeeds(tmp_path):
    out = tmp_path / "out"
    proc, seconds = mpirun(3, [INJECT, "kill-write", "2", "--", "consolidate", str(INPUT), str(out)])
    assert proc.returncode != 0
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
    assert not out.exists()
    good, _ = mpirun(3, ["-m", "mpicons", "consolidate", str(tmp_path / "in-{rank}"), str(out), "-q", "--gather-to", "2"])
    assert good.returncode == 0, good.stderr
    expected, mapping = fixture_expected("edge-3ranks")
    assert_consolidated(out, expected, index_weight_map(mapping))


# ---------------------------------------------------------------- start-up


def _processes_with(argument: str) -> list[int]:
    """The pids of the python processes whose command line holds ``argument``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if os.fsencode(argument) in argv and any(b"python" in arg for arg in argv[:1]):
            found.append(int(entry.name))
    return found


def _process_with(argument: str) -> int | None:
    """The pid of a python process whose command line holds ``argument`` (a path unique to the test)."""
    return next(iter(_processes_with(argument)), None)


def _starting_mpi(pid: int) -> bool:
    """The process has loaded the MPI library: it is inside MPI's start-up."""
    try:
        return "libmpi" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGUSR1, marks=pytest.mark.slow)])
def test_a_signal_ends_a_rank_waiting_for_mpi_to_start(tmp_path, signum):
    """Rank 1 never starts MPI (a node that never came up), so rank 0 waits inside MPI_Init, where no
    Python handler runs: the job's end must still end it at once (nothing has been written)."""
    out = tmp_path / "out"
    command = f"{shlex.quote(sys.executable)} -m mpicons consolidate {shlex.quote(str(INPUT))} {shlex.quote(str(out))}"
    # The launcher ends the job when a rank dies by a signal: the wrapper reports rank 0's status, then does.
    rank_0 = f'{command}; echo "rank 0 exit status $?" >&2; kill -KILL $$'
    script = f'if [ "$PMI_RANK" = 0 ]; then {rank_0}; else exec sleep 120; fi'
    proc = subprocess.Popen(
        [MPIEXEC, "-n", "2", "bash", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
        start_new_session=True,
    )
    try:
        pid = None
        while proc.poll() is None and (pid is None or not _starting_mpi(pid)):
            pid = _process_with(str(out))
            time.sleep(0.02)
        assert pid is not None and proc.poll() is None, proc.communicate()
        os.kill(pid, signum)
        _, stderr = proc.communicate(timeout=30)  # rank 1 sleeps 120 s: only rank 0's end ends the job
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert f"rank 0 exit status {128 + signum}" in stderr, stderr  # ended by the signal itself
    assert "Traceback" not in stderr, stderr
    assert not out.exists()


@pytest.mark.parametrize("ranks", [2, 4])
def test_ctrl_c_while_mpi_starts_ends_every_rank_cleanly(tmp_path, ranks):
    """Ctrl-C (SIGINT to the launcher's whole process group) once the ranks are starting MPI: each finishes
    starting, then stops as at any later moment: "interrupted", exit 1, nothing written, no crash."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "mpicons", "consolidate", str(INPUT), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            pids = _processes_with(str(out))
            if len(pids) == ranks and all(_starting_mpi(pid) for pid in pids):
                break
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode == 0:
        pytest.skip("the job was done before the signal came (a fast machine): nothing to interrupt")
    assert proc.returncode == 1, stdout + stderr
    assert "interrupted by SIGINT" in stderr and "Segmentation" not in stdout + stderr, stdout + stderr
    assert "Traceback" not in stderr and not out.exists()


def test_a_signal_caught_before_mpi_starts_ends_the_process_there():
    """A signal recorded before MPI's start-up would otherwise wait for the first phase, which a rank
    blocked in MPI_Init never reaches."""
    code = (
        "import os, signal\n"
        "from mpicons.comm.interrupts import ending_at_once, install_handlers\n"
        "install_handlers()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "with ending_at_once():\n"
        "    print('still running')\n"
    )
    proc = run_python("-c", code, timeout=30)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


def test_a_signal_is_acted_on_while_a_pickle_is_being_built():
    """Python's unpickler is C code: a signal waits until it returns to Python. mpicons' unpickler
    reads its bytes through Python methods every 128 KiB, so the handler runs in one of them, mid-build,
    not after a large pickle (here 2 s of building) is done."""
    code = (
        "import pickle, signal\n"
        "from mpicons.formats.unpickling import NOTHING, RestrictedUnpickler\n"
        "data = pickle.dumps({f'layers.{i}.weight': [i, {'dtype': 'bf16'}] for i in range(1_000_000)}, protocol=2)\n"
        "where = []\n"
        "def stop(signum, frame):\n"
        "    where.append(frame.f_code.co_filename)\n"
        "    raise KeyboardInterrupt\n"
        "signal.signal(signal.SIGALRM, stop)\n"
        "unpickler = RestrictedUnpickler(data, NOTHING)\n"
        "signal.setitimer(signal.ITIMER_REAL, 0.1)\n"
        "try:\n"
        "    unpickler.load()\n"
        "except KeyboardInterrupt:\n"
        "    pass\n"
        "print(where[0] if where else 'no signal')\n"
    )
    proc = run_python("-c", code, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("unpickling.py"), proc.stdout + proc.stderr


def test_handlers_come_back_after_mpi_starts():
    code = (
        "import signal\n"
        "from mpicons.comm.interrupts import ending_at_once, install_handlers, pending_signal\n"
        "install_handlers()\n"
        "ours = signal.getsignal(signal.SIGTERM)\n"
        "with ending_at_once():\n"
        "    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\n"
        "assert signal.getsignal(signal.SIGTERM) is ours\n"
        "signal.raise_signal(signal.SIGTERM)\n"
        "print(pending_signal().name)\n"
    )
    proc = run_python("-c", code, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == "SIGTERM", proc.stderr


# ---------------------------------------------------------------- memory


def _address_space(limit: int):
    """A ``preexec_fn`` giving the child an address-space limit (``ulimit -v``)."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))

    return apply


def _python_could_not_start(proc: subprocess.CompletedProcess) -> bool:
    """The interpreter itself failed before running a line of mpicons (the loader, or Python's own start)."""
    return proc.returncode == 127 or "Fatal Python error" in proc.stderr


def _mpi_could_not_start(proc: subprocess.CompletedProcess) -> bool:
    """MPICH's own start (its shared-memory transport) ran out and aborted the job itself, which no
    error handler can catch: the limit was just above what mpicons checks before loading MPI."""
    return "Fatal error in internal_Init_thread" in proc.stderr


def _assert_one_clear_memory_line(stderr: str) -> bool:
    """Whatever is said about memory is mpicons' one line; returns whether it was said."""
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    lines = stderr.strip().splitlines()
    if not any(word in stderr.lower() for word in ("memory", "alloc", "map segment")):
        return False
    assert len(lines) == 1 and re.match(r"mpicons: error: (\[rank 0\] )?out of memory", lines[0]), stderr
    return True


@pytest.mark.slow
def test_memory_running_out_anywhere_is_one_clear_line(tmp_path):
    """From limits where Python barely starts upward: imports, MPI's start, scan, plan, write, report."""
    said, succeeded = 0, 0
    for mib in range(12, 300, 12):
        out = tmp_path / f"out-{mib}"
        args = [sys.executable, "-m", "mpicons", "consolidate", INPUT, out, "--stats-json", tmp_path / f"s-{mib}.json"]
        proc = subprocess.run(
            args, capture_output=True, text=True, timeout=60, env=subprocess_env(), preexec_fn=_address_space(mib << 20)
        )
        if _python_could_not_start(proc):
            continue
        if proc.returncode == 0:
            succeeded += 1
            expected, mapping = fixture_expected("edge-3ranks")
            assert_consolidated(out, expected, index_weight_map(mapping))
            continue
        assert proc.returncode in (1, 2), (mib, proc.returncode, proc.stderr)
        said += _assert_one_clear_memory_line(proc.stderr)
        assert not out.exists(), mib
    assert said >= 5 and succeeded >= 1, (said, succeeded)


@pytest.mark.slow
def test_threads_that_cannot_start_are_memory_running_out(tmp_path):
    """Under ``ulimit -v`` a writer thread's stack is what fails first (``can't start new thread``): at
    3 ranks on a Megatron checkpoint, each limit either consolidates or says out of memory in one line."""
    run = Path(__file__).parent / "fixtures" / "megatron" / "llama-tp2" / "checkpoint"
    said = 0
    for mib in range(180, 236, 6):
        out = tmp_path / f"out-{mib}"
        proc = subprocess.run(
            [MPIEXEC, "-n", "3", sys.executable, "-m", "mpicons", "consolidate", str(run), str(out)],
            capture_output=True, text=True, timeout=60, env=subprocess_env(), preexec_fn=_address_space(mib << 20),
        )  # fmt: skip
        if proc.returncode == 0 or _mpi_could_not_start(proc):
            continue
        assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, (mib, proc.stderr)
        lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("mpicons: error:")]
        assert 1 <= len(lines) <= 3 and all(re.match(r"mpicons: error: (\[rank \d\] )?out of memory", line) for line in lines)
        said += 1
        assert not out.exists(), mib
    assert said >= 1


@pytest.mark.slow
def test_memory_running_out_before_mpi_starts_is_one_line_per_rank(tmp_path):
    """Every rank under the same limit, too small for MPI to start: each says so in one line and exits."""
    proc = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-m", "mpicons", "consolidate", str(INPUT), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(),
        preexec_fn=_address_space(150 << 20),
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    clear = r"mpicons: error: (\[rank [01]\] )?out of memory \(try a smaller --buffer-size"
    assert len(lines) == 2 and all(re.match(clear, line) for line in lines), proc.stderr
    assert not (tmp_path / "out").exists()
