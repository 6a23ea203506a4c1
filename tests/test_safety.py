"""The command line against the fault matrix: concurrent runs, planted links, inputs as outputs, signals
during publishing and start-up, resource limits, hostile names, closed pipes, and its exit-code contract.

Every case runs the real command line under mpiexec in a subprocess with a timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    DISTCP_FIXTURES,
    FIXTURES,
    MPIEXEC,
    assert_consolidated,
    cli,
    fixture_expected,
    index_weight_map,
    mpirun,
    reference_bytes,
    slow_beyond,
    start,
    subprocess_env,
    writing_started,
)

ROOT = Path(__file__).parent.parent
INJECT = str(Path(__file__).parent / "scripts" / "inject.py")
INPUT = FIXTURES / "edge-3ranks" / "sharded"  # 2 output files
OLDER = FIXTURES / "fsdp2-3ranks" / "sharded"  # 3 output files
ENV = subprocess_env(MPICONS_PROGRESS="lines")


def one_error(proc: subprocess.CompletedProcess) -> str:
    """The single error line of a failed run (and no traceback)."""
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mpicons: error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()} if directory.exists() else {}


def digest(directory: Path) -> str:
    return hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sorted(directory.iterdir()))).hexdigest()


def expect_edge(out: Path) -> None:
    expected, mapping = fixture_expected("edge-3ranks")
    assert_consolidated(out, expected, index_weight_map(mapping))


def old_checkpoint(out: Path) -> dict[str, bytes]:
    """An older 3-file consolidated checkpoint in ``out``, plus a file that is not part of any checkpoint."""
    proc, _ = cli(1, "consolidate", OLDER, out, "-q", "--no-sync")
    assert proc.returncode == 0, proc.stderr
    (out / "notes.txt").write_text("mine, not mpicons'\n")
    return snapshot(out)


# ---------------------------------------------------------------- one run at a time


def test_a_second_run_into_the_same_directory_stops_at_once(tmp_path):
    out = tmp_path / "out"
    release = tmp_path / "release"
    env = {**ENV, "MPICONS_TEST_RELEASE": str(release)}
    first = start(2, INJECT, "hold-write", "0", "--", "consolidate", INPUT, out, "--split", "files", env=env)
    try:
        deadline = time.monotonic() + 60
        while not writing_started(out) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert writing_started(out)
        second, _ = cli(2, "consolidate", INPUT, out, "--force")
        release.touch()
        assert second.returncode == 2
        error = one_error(second)
        assert "another mpicons run is using this output directory" in error and f"pid {first.pid}" not in error
        assert "--break-lock" in error and " on " in error
        _, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 0, stderr
    expect_edge(out)


def test_the_lock_of_a_killed_run_is_recognised_as_stale(tmp_path):
    out = tmp_path / "out"
    proc, _ = mpirun(2, [INJECT, "kill-write", "1", "--", "consolidate", INPUT, out])
    assert proc.returncode != 0
    assert (out / ".mpicons.lock").exists()
    rerun, _ = cli(2, "consolidate", INPUT, out)
    assert rerun.returncode == 0, rerun.stderr
    assert "mpicons: note:" in rerun.stderr and "its process is gone" in rerun.stderr
    assert "removed the unfinished files of an interrupted run" in rerun.stderr
    expect_edge(out)


# ---------------------------------------------------------------- nothing written outside, no input written


def test_planted_links_and_entries_are_never_followed_or_reused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "out"
    out.mkdir()
    for name in (
        ".model-00001-of-00002.safetensors.mpicons-partial",
        ".model.safetensors.index.json.mpicons-partial",
        ".mpicons.lock.0000000000000000",
        ".mpicons-staging-guess",
    ):
        (out / name).symlink_to(victim)
    (out / ".model-00002-of-00002.safetensors.mpicons-partial").mkdir()  # a directory at an old temporary name
    (out / "model-00002-of-00002.safetensors").symlink_to(victim)  # at a final name: replaced, never written through
    proc, _ = cli(2, "consolidate", INPUT, out, "--force", "-q")
    assert proc.returncode == 0, proc.stderr
    assert victim.read_bytes() == b"precious"
    assert not (out / "model-00002-of-00002.safetensors").is_symlink()
    planted = {p.name for p in out.iterdir() if p.name.startswith(".")}
    assert planted == {
        ".model-00001-of-00002.safetensors.mpicons-partial",
        ".model.safetensors.index.json.mpicons-partial",
        ".mpicons.lock.0000000000000000",
        ".mpicons-staging-guess",
        ".model-00002-of-00002.safetensors.mpicons-partial",
    }
    expected, mapping = fixture_expected("edge-3ranks")
    for path in out.glob("model-*.safetensors"):
        names = [n for n, f in index_weight_map(mapping).items() if f == path.name]
        assert path.read_bytes() == reference_bytes({n: expected[n] for n in names})


@pytest.mark.parametrize("owner_of_output", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_no_rank_may_write_into_its_own_input(tmp_path, owner_of_output):
    """``{rank}`` inputs: the output may not be any rank's input directory, even with --force and a mapping naming a shard."""
    shards = sorted(INPUT.iterdir())
    for rank in range(3):
        (tmp_path / f"d{rank}").mkdir()
    for i, path in enumerate(shards):
        shutil.copy(path, tmp_path / f"d{i % 3}" / path.name)
    before = [digest(tmp_path / f"d{rank}") for rank in range(3)]
    out = tmp_path / f"d{owner_of_output}"
    expected, _ = fixture_expected("edge-3ranks")
    victim = sorted(p.name for p in out.iterdir())[0]
    mapping = tmp_path / "mapping.json"
    mapping.write_text(json.dumps({"weight_map": {name: victim for name in expected}}))
    for extra in ([], ["--force", "--mapping", str(mapping)]):
        proc, _ = cli(3, "consolidate", str(tmp_path / "d{rank}"), out, *extra)
        assert proc.returncode == 2, proc.stderr
        assert f"output directory is the input directory (rank {owner_of_output}'s" in one_error(proc)
    assert [digest(tmp_path / f"d{rank}") for rank in range(3)] == before


def test_the_parent_of_the_input_may_be_the_output(tmp_path):
    """torchtitan's layout: shards in CHECKPOINT/sharded, the consolidated files in CHECKPOINT."""
    shutil.copytree(INPUT, tmp_path / "ckpt" / "sharded")
    before = digest(tmp_path / "ckpt" / "sharded")
    proc, _ = cli(2, "consolidate", tmp_path / "ckpt" / "sharded", tmp_path / "ckpt", "-q")
    assert proc.returncode == 0, proc.stderr
    assert digest(tmp_path / "ckpt" / "sharded") == before
    shutil.rmtree(tmp_path / "ckpt" / "sharded")
    expect_edge(tmp_path / "ckpt")


def test_an_output_inside_the_input_is_refused(tmp_path):
    """``consolidate ckpt/sharded ckpt/sharded/hf``: nothing is written below the shards, by any entry point,
    whatever the path looks like (deeper, through a link, a rank's own {rank} directory, a report file)."""
    import mpicons
    from mpicons.comm import SingleProcess
    from mpicons.core.errors import InputError

    shards = tmp_path / "ckpt" / "sharded"
    shutil.copytree(INPUT, shards)
    before = digest(shards)
    proc, _ = cli(2, "consolidate", shards, shards / "hf", "--force")
    assert proc.returncode == 2, proc.stderr
    assert f"{shards / 'hf'}: output directory is inside the input directory {shards}" in one_error(proc)
    assert f"(its parent, {shards.parent}, may be the output)" in one_error(proc)
    (tmp_path / "link").symlink_to(shards)
    for output in (shards / "a" / "b", tmp_path / "link" / "hf"):
        with pytest.raises(InputError, match="output directory is inside the input directory"):
            mpicons.consolidate(shards, output, comm=SingleProcess())
    for command in (["inspect", shards, "--json"], ["consolidate", shards, tmp_path / "out", "--stats-json"]):
        proc, _ = cli(1, *command, shards / "report.json")
        assert proc.returncode == 2 and "the report would be written inside the input directory" in one_error(proc)
    assert digest(shards) == before
    for rank in range(3):  # {rank}: inside any rank's own directory
        (tmp_path / f"d{rank}").mkdir()
    for i, path in enumerate(sorted(INPUT.iterdir())):
        shutil.copy(path, tmp_path / f"d{i % 3}" / path.name)
    proc, _ = cli(3, "consolidate", tmp_path / "d{rank}", tmp_path / "d1" / "hf")
    assert proc.returncode == 2 and "output directory is inside the input directory" in one_error(proc)
    assert "(rank 1's" in one_error(proc) and not (tmp_path / "d1" / "hf").exists()


@pytest.mark.parametrize(
    "layout, force",
    slow_beyond([("safetensors", False), ("distcp", True), ("safetensors", True), ("distcp", False)], 2),
)
def test_swapped_arguments_never_write_into_the_shard_directory(tmp_path, layout, force):
    """``consolidate OUT_HF SHARDS``: a consolidated checkpoint as input, the shard directory as output."""
    shards = tmp_path / "shards"
    shutil.copytree(INPUT if layout == "safetensors" else DISTCP_FIXTURES / "fsdp-3ranks" / "dcp", shards)
    before = digest(shards)
    _plain_checkpoint(tmp_path / "hf", ["a", "b"])
    proc, _ = cli(1, "consolidate", tmp_path / "hf", shards, *(["--force"] if force else []))
    assert proc.returncode == 2, proc.stderr
    error = one_error(proc)
    assert f"{shards}: the output directory holds a sharded checkpoint" in error
    assert "The arguments look swapped" in error and "mpicons consolidate INPUT_DIR OUTPUT_DIR" in error
    assert digest(shards) == before  # not even a lock was made there


def _hostile_lock(lock: Path, kind: str) -> None:
    same_host = {"host": socket.gethostname(), "job": None, "started": "now", "boot_id": "", "pid_namespace": 0}
    same_host |= {"process_start": None, "token": "0123456789abcdef"}
    if kind == "fifo":
        os.mkfifo(lock)
        return
    contents = {
        "deep array": b"[" * 200_000 + b"]" * 200_000,
        "pid 2**80": json.dumps({**same_host, "pid": 2**80}).encode(),
        "pid as a string": json.dumps({**same_host, "pid": "1"}).encode(),
    }
    lock.write_bytes(contents[kind])


@pytest.mark.parametrize("kind", slow_beyond(["deep array", "pid 2**80", "pid as a string", "fifo"], 1))
def test_a_hostile_lock_is_an_unknown_holder(tmp_path, kind):
    out = tmp_path / "out"
    _plain_checkpoint(out, ["a", "b"])
    _hostile_lock(out / ".mpicons.lock", kind)
    proc, _ = cli(1, "consolidate", INPUT, out, "--force", timeout=30)
    assert proc.returncode == 2, proc.stderr
    error = one_error(proc)
    assert "held by an unknown holder" in error and "rerun with --break-lock" in error
    proc, _ = cli(1, "verify", out, timeout=30)  # verify reads the lock as consolidate does
    assert "Traceback" not in proc.stderr and proc.returncode == 2, proc.stderr
    assert "held by an unknown holder" in proc.stdout and "--break-lock" in proc.stdout
    if kind == "fifo":  # what the message says to do
        proc, _ = cli(1, "consolidate", INPUT, out, "--force", "--break-lock", "-q", timeout=30)
        assert proc.returncode == 0, proc.stderr
        expect_edge(out)


# ---------------------------------------------------------------- publishing is one transaction


def test_force_leaves_exactly_the_new_checkpoint(tmp_path):
    out = tmp_path / "out"
    old_checkpoint(out)
    proc, _ = cli(2, "consolidate", INPUT, out)
    assert proc.returncode == 2 and "already holds model.safetensors.index.json" in one_error(proc)
    proc, _ = cli(2, "consolidate", INPUT, out, "--force", "-q")
    assert proc.returncode == 0, proc.stderr
    (out / "notes.txt").rename(tmp_path / "notes.txt")  # unrelated files stay
    expect_edge(out)
    proc, _ = cli(2, "verify", out, "--against", INPUT)
    assert proc.returncode == 0, proc.stdout


PUBLISH_FAULTS = [
    "publish-write-error",
    "publish-publish-term",
    "publish-aside-term",
    "publish-journal-error",
    "publish-publish-error",
]


@pytest.mark.parametrize("fault", slow_beyond(PUBLISH_FAULTS, 1))
def test_a_failure_while_publishing_leaves_the_directory_as_it_was(tmp_path, fault):
    """SIGTERM during the renames (a Slurm time limit), disk full at the index: old checkpoint intact, rerun works."""
    out = tmp_path / "out"
    before = old_checkpoint(out)
    proc, seconds = mpirun(2, [INJECT, fault, "0", "--", "consolidate", INPUT, out, "--force"])
    assert proc.returncode == 1, proc.stderr
    error = one_error(proc)
    if fault.endswith("term"):
        assert "interrupted by SIGTERM" in error
    if fault == "publish-write-error":
        assert "model.safetensors.index.json" in error and "No space left on device" in error
    assert snapshot(out) == before
    hidden = [p.name for p in out.iterdir() if p.name.startswith(".")]
    if fault in ("publish-write-error", "publish-journal-error"):  # before the journal, every block durable: kept
        assert len(hidden) == 1 and hidden[0].startswith(".mpicons-staging-"), hidden
        assert "run the same command again to continue" in proc.stderr
    else:
        assert hidden == []
    rerun, _ = cli(2, "consolidate", INPUT, out, "--force", "-q")
    assert rerun.returncode == 0, rerun.stderr
    (out / "notes.txt").unlink()
    expect_edge(out)


def test_a_signal_after_the_commit_point_leaves_the_complete_checkpoint(tmp_path):
    out = tmp_path / "out"
    old_checkpoint(out)
    proc, _ = mpirun(2, [INJECT, "publish-commit-term", "0", "--", "consolidate", INPUT, out, "--force", "-q"])
    assert proc.returncode == 0, proc.stderr  # the index was already on its way in: the run is complete
    (out / "notes.txt").unlink()
    expect_edge(out)


@pytest.mark.slow
@pytest.mark.parametrize("step", ["journal", "aside", "publish", "commit", "discard"])
def test_a_rank_killed_while_publishing_is_recovered_by_a_plain_rerun(tmp_path, step):
    out = tmp_path / "out"
    old_checkpoint(out)
    proc, _ = mpirun(2, [INJECT, f"publish-{step}-kill", "0", "--", "consolidate", INPUT, out, "--force"])
    assert proc.returncode != 0
    rerun, _ = cli(2, "consolidate", INPUT, out, "--force")
    assert rerun.returncode == 0, rerun.stderr
    assert "mpicons: note:" in rerun.stderr
    (out / "notes.txt").unlink()
    expect_edge(out)


# ---------------------------------------------------------------- no hang, ever


@pytest.mark.slow
def test_ctrl_c_at_any_moment_of_start_up_ends_the_job(tmp_path):
    """SIGINT to the whole process group (what a terminal sends) at random moments of the first second."""
    rng = random.Random(9)
    interrupted = 0
    for attempt in range(20):
        out = tmp_path / f"out-{attempt}"
        proc = start(2, "-m", "mpicons", "consolidate", INPUT, out, "-q", env=ENV)
        time.sleep(rng.uniform(0.0, 0.7))
        os.killpg(proc.pid, signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"attempt {attempt}: the job did not end within 30 s of SIGINT")
        # Python itself may be interrupted before mpicons' first line runs; after that, no traceback.
        python_start = stderr.startswith("Fatal Python error: init_")  # the interpreter's own start-up, before mpicons
        # A bare KeyboardInterrupt (Python prints "KeyboardInterrupt:" when it lands in importlib's own
        # lock callback, before any mpicons line runs) is the only traceback allowed.
        bare = re.search(r"KeyboardInterrupt:?\s*$", stderr) is not None
        assert python_start or "Traceback" not in stderr or bare, stderr
        if (out / "model.safetensors.index.json").exists():
            expect_edge(out)  # finished before the signal mattered: complete
            continue
        interrupted += 1
        assert proc.returncode != 0
        if out.exists():  # stopped once every byte was durable: kept for the same command to continue
            assert [p.name.startswith(".mpicons-staging-") for p in out.iterdir()] == [True], stderr
            assert "run the same command again to continue" in stderr
            rerun, _ = cli(2, "consolidate", INPUT, out, "-q")
            assert rerun.returncode == 0, rerun.stderr
            expect_edge(out)
    assert interrupted >= 3, interrupted  # several attempts really were interrupted


def test_a_huge_rank_number_beside_a_hole_costs_nothing(tmp_path):
    inp = tmp_path / "in"
    shutil.copytree(INPUT, inp)
    (inp / "shard-00002-model-00001-of-00002.safetensors").unlink()  # a hole
    (inp / "shard-00003-model-00002-of-00002.safetensors").rename(inp / "shard-2000000000-model-00002-of-00002.safetensors")
    proc, seconds = cli(2, "consolidate", inp, tmp_path / "out", timeout=30)
    assert proc.returncode == 2
    assert "shard files missing from the set" in one_error(proc)
    proc, seconds = cli(2, "inspect", inp, timeout=30)
    assert proc.returncode == 2
    assert "expected shard files absent" in proc.stdout


# ---------------------------------------------------------------- bad input: exit 2 before any work


@pytest.mark.slow
def test_unwritable_report_paths_are_refused_before_any_work(tmp_path):
    out = tmp_path / "out"
    for option in (["--stats-json", str(tmp_path / "no" / "such" / "s.json")], ["--stats-json", str(tmp_path)]):
        proc, _ = cli(2, "consolidate", INPUT, out, *option)
        assert proc.returncode == 2
        assert "cannot write the report there" in one_error(proc) or "is a directory" in proc.stderr
        assert not out.exists()
    proc, _ = cli(2, "consolidate", INPUT, out, "-q")
    assert proc.returncode == 0
    proc, _ = cli(2, "verify", out, "--json", str(tmp_path / "missing" / "v.json"))
    assert proc.returncode == 2 and "cannot write the report there" in one_error(proc)


def test_a_buffer_the_machine_cannot_give_is_refused_up_front(tmp_path):
    proc, seconds = cli(2, "consolidate", INPUT, tmp_path / "out", "--buffer-size", "1T")
    assert proc.returncode == 2
    assert "--buffer-size 1 TiB (1.10 TB) per rank" in one_error(proc) and "memory available" in proc.stderr
    assert not (tmp_path / "out").exists()


def _plain_checkpoint(directory: Path, names: list[str]) -> None:
    directory.mkdir()
    tensors = {name: ("F32", [2], bytes(8)) for name in names}
    (directory / "model.safetensors").write_bytes(reference_bytes(tensors))


@pytest.mark.parametrize(
    "names, phrase",
    slow_beyond(
        [
            (["a", "a.b"], "would be both a dataset and a group"),
            (["a\0b"], "cannot be an HDF5 dataset"),
            (["layers..x"], "cannot be an HDF5 dataset"),
            (["a.b", "a/b"], "would both be the HDF5 dataset /a/b"),
        ],
        1,
    ),
)
def test_names_hdf5_cannot_hold_are_bad_input(tmp_path, names, phrase):
    _plain_checkpoint(tmp_path / "in", names)
    proc, _ = cli(2, "consolidate", tmp_path / "in", tmp_path / "out", "--format", "hdf5")
    assert proc.returncode == 2 and phrase in one_error(proc)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("how", ["file", "parent"])
def test_an_output_path_that_is_a_file_is_bad_input(tmp_path, how):
    (tmp_path / "f").write_text("x")
    target = tmp_path / "f" if how == "file" else tmp_path / "f" / "out"
    proc, _ = cli(2, "consolidate", INPUT, target)
    assert proc.returncode == 2 and "not a directory" in one_error(proc)
    assert (tmp_path / "f").read_text() == "x"


def test_usage_errors_are_printed_once(tmp_path):
    proc, _ = cli(3, "consolidate", "--no-such-option", INPUT, tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.count("usage:") == 1 and proc.stderr.count("error:") == 1


# ---------------------------------------------------------------- resource limits


def _limit_files(count: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (count, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    return apply


@pytest.mark.slow
@pytest.mark.parametrize("io", ["posix", "mpiio"])
def test_more_outputs_than_open_files_allowed(tmp_path, io):
    """600 output files under ``ulimit -n 200``: open handles are bounded whatever the number of outputs."""
    from mpicons.sample import SampleConfig, tensor_specs, write_sample

    config = SampleConfig(layers=66, hidden=16, intermediate=24, kv_dim=8, vocab=40, files=1)
    write_sample(tmp_path / "in", config)
    names = [spec[0] for spec in tensor_specs(config)]
    assert len(names) > 600
    (tmp_path / "mapping.json").write_text(json.dumps({name: i + 1 for i, name in enumerate(names)}))
    proc = subprocess.run(
        [
            MPIEXEC,
            "-n",
            "2",
            sys.executable,
            "-m",
            "mpicons",
            "consolidate",
            str(tmp_path / "in"),
            str(tmp_path / "out"),
            "--mapping",
            str(tmp_path / "mapping.json"),
            "--io",
            io,
            "-q",
            "--no-sync",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        preexec_fn=_limit_files(200),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) == len(names)


def test_a_final_name_of_250_bytes_fits(tmp_path):
    expected, _ = fixture_expected("edge-3ranks")
    long_name = "w" * 238 + ".safetensors"
    assert len(long_name) == 250
    weight_map = {name: long_name if i % 2 else "short.safetensors" for i, name in enumerate(sorted(expected))}
    (tmp_path / "mapping.json").write_text(json.dumps({"weight_map": weight_map}))
    proc, _ = cli(2, "consolidate", INPUT, tmp_path / "out", "--mapping", tmp_path / "mapping.json", "-q")
    assert proc.returncode == 0, proc.stderr
    assert_consolidated(tmp_path / "out", expected, weight_map)


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    target = tmp_path / "disk"
    target.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(target)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield target
    subprocess.run(["umount", str(target)], check=False)


@pytest.mark.parametrize("io", ["posix", "mpiio"])
def test_disk_full_is_one_line_naming_the_file(small_disk, io):
    out = small_disk / "out"
    proc, _ = cli(2, "consolidate", INPUT, out, "--io", io)
    assert proc.returncode == 1
    error = one_error(proc)
    assert "No space left on device" in error and ".safetensors" in error and "error stack" not in proc.stderr
    assert not out.exists()
    assert os.listdir(small_disk) == []


# ---------------------------------------------------------------- the output streams


def _pipeline(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", f'set -o pipefail; {command}; echo "status ${{PIPESTATUS[0]}}" >&2'],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )


def test_a_closed_standard_output_ends_quietly(tmp_path):
    python = sys.executable
    proc = _pipeline(f"{MPIEXEC} -n 2 {python} -m mpicons inspect {INPUT} --json - --limit 0 | head -c 10")
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert "status 0" in proc.stderr and len(proc.stdout) == 10
    out = tmp_path / "out"
    assert cli(2, "consolidate", INPUT, out, "-q")[0].returncode == 0
    (out / "extra.safetensors").write_bytes(reference_bytes({f"t{i}": ("F32", [1], bytes(4)) for i in range(200)}))
    proc = _pipeline(f"{MPIEXEC} -n 2 {python} -m mpicons verify {out} --against {INPUT} | head -3")
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert "status 1" in proc.stderr and len(proc.stdout.splitlines()) == 3  # not sound: 1, printed or not


@pytest.mark.slow
def test_dash_means_standard_output_for_every_report(tmp_path):
    out = tmp_path / "out"
    proc, _ = cli(2, "consolidate", INPUT, out, "--stats-json", "-")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ranks"] == 2 and not Path("-").exists()
    proc, _ = cli(2, "verify", out, "--json", "-")
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"] is True
    proc, _ = cli(2, "inspect", INPUT, "--json", "-")
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"] is True


# ---------------------------------------------------------------- verify's hints


def test_verify_on_a_sharded_directory_says_what_to_do(tmp_path):
    proc, _ = cli(2, "verify", INPUT)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout  # one problem and the summary
    assert (
        f"not a consolidated checkpoint; to check a consolidation of it: mpicons verify OUTPUT_DIR --against {INPUT}" in lines[0]
    )


def test_verify_on_a_distcp_directory_says_what_to_do():
    """DCP's default format (``.metadata`` and ``.distcp`` files) is a sharded checkpoint too."""
    shards = DISTCP_FIXTURES / "fsdp-3ranks" / "dcp"
    proc, _ = cli(2, "verify", shards)
    assert proc.returncode == 1
    problem, summary = proc.stdout.splitlines()
    assert problem == (
        f"{shards}: holds DCP's .metadata and 3 .distcp files (DCP's default format), not a consolidated checkpoint; "
        f"to check a consolidation of it: mpicons verify OUTPUT_DIR --against {shards}"
    )
    assert summary.startswith("mpicons verify: 1 problem:")


def test_verify_of_an_s3_location_says_it_cannot_be_verified_yet():
    proc, _ = cli(2, "verify", "s3://models/llama/hf")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "mpicons: error: [rank 0] s3://models/llama/hf: verify checks a local directory; a checkpoint in object storage "
        "cannot be verified yet. Verify a local copy of it, or a local output against shards there: mpicons verify "
        "OUTPUT_DIR --against s3://models/llama/hf"
    ]
    assert "does not exist" not in proc.stderr


def test_verify_hints_at_dtype_for_a_converted_output(tmp_path):
    """One line saying which --dtype to give, not one per converted tensor."""
    out = tmp_path / "out"
    assert cli(2, "consolidate", INPUT, out, "--dtype", "fp32", "-q")[0].returncode == 0
    proc, _ = cli(2, "verify", out, "--against", INPUT)
    assert proc.returncode == 1
    problem, summary = proc.stdout.splitlines()
    assert problem.startswith(f"{out}: the output's floating-point tensors (")
    assert problem.endswith("if it was written with --dtype fp32, verify with --dtype fp32"), problem
    assert summary.startswith("mpicons verify: 1 problem:"), summary
    proc, _ = cli(2, "verify", out, "--against", INPUT, "--dtype", "fp32")
    assert proc.returncode == 0, proc.stdout
