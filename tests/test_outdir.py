"""The output directory's lock, staging and journaled publishing, with a failure injected at every step.

Whatever step fails (an error, which is rolled back at once, or a crash, which the next run
recovers), the directory must end up holding exactly what it held before, or the complete new
checkpoint with its index.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

import mpicons.outdir as outdir
from mpicons.errors import InputError, WriteError
from mpicons.outdir import LOCK_NAME, Holder, OutputDir, OutputLock, recover

OLD = {
    "model-00001-of-00003.safetensors": b"old one",
    "model-00002-of-00003.safetensors": b"old two",
    "model-00003-of-00003.safetensors": b"old three",
    "model.safetensors.index.json": b'{"weight_map": {"a": "model-00001-of-00003.safetensors", "b": "custom.bin"}}',
    "custom.bin": b"named by the old index",
    "notes.txt": b"not part of any checkpoint",
}
NEW = {
    "model-00001-of-00002.safetensors": b"new one",
    "model-00002-of-00002.safetensors": b"new two",
    "model.safetensors.index.json": b'{"weight_map": {}}',
}


def snapshot(directory: Path) -> dict[str, bytes]:
    """Visible entries (hidden ones are mpicons' own: lock, staging) and their bytes."""
    return {p.name: p.read_bytes() for p in directory.iterdir() if not p.name.startswith(".")}


def expected_after_success(before: dict[str, bytes]) -> dict[str, bytes]:
    kept = {n: b for n, b in before.items() if n == "notes.txt"}
    return {**kept, **NEW}


def publish_new(directory: Path, force: bool = True) -> OutputDir:
    session = OutputDir.open(str(directory))
    try:
        aside = session.replaced_entries(list(NEW), force=force, checkpoint=True)
        session.stage()
        for name, data in NEW.items():
            session.write_staged(name, data)
        session.publish(list(NEW), aside, durable=True, before_commit=lambda: None)
    finally:
        session.close()
    return session


@pytest.fixture(params=["empty", "old-checkpoint"])
def before(request, tmp_path) -> tuple[Path, dict[str, bytes]]:
    out = tmp_path / "out"
    out.mkdir()
    if request.param == "old-checkpoint":
        for name, data in OLD.items():
            (out / name).write_bytes(data)
    return out, snapshot(out)


def steps(directory: Path, before_state: dict[str, bytes]) -> list[str]:
    """Every step label publishing goes through, recorded from a clean run on a copy."""
    seen: list[str] = []
    outdir.step_hook = seen.append
    try:
        publish_new(directory)
    finally:
        outdir.step_hook = lambda label: None
    return seen


def reset(directory: Path, state: dict[str, bytes]) -> None:
    for path in directory.iterdir():
        if path.is_dir():
            import shutil

            shutil.rmtree(path)
        else:
            path.unlink()
    for name, data in state.items():
        (directory / name).write_bytes(data)


def test_publish_replaces_the_old_checkpoint_and_keeps_unrelated_files(before):
    out, state = before
    publish_new(out)
    assert snapshot(out) == expected_after_success(state)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # lock and staging gone


def test_without_force_an_old_checkpoint_is_refused(before):
    out, state = before
    if not state:
        publish_new(out, force=False)
        assert snapshot(out) == NEW
        return
    with pytest.raises(InputError, match=r"already holds model.safetensors.index.json, .* \(use --force to replace them\)"):
        publish_new(out, force=False)
    assert snapshot(out) == state
    assert not any(p.name.startswith(".") for p in out.iterdir())


def test_an_error_at_any_step_leaves_the_directory_as_it_was(before):
    out, state = before
    labels = steps(out, state)
    assert labels[0].startswith("write") and any(label.startswith("commit") for label in labels)
    for label in labels:
        reset(out, state)

        def fail(now: str, label: str = label) -> None:
            if now == label:
                raise OSError(28, "No space left on device (injected)", now)

        outdir.step_hook = fail
        try:
            if label == "discard":  # after the commit point: the new checkpoint stands, the rest is tidied later
                publish_new(out)
                outdir.step_hook = lambda now: None
                assert snapshot(out) == expected_after_success(state)
                continue
            with pytest.raises(OSError, match="injected"):
                publish_new(out)
        finally:
            outdir.step_hook = lambda now: None
        assert snapshot(out) == state, label
        assert not any(p.name.startswith(".") for p in out.iterdir()), label  # lock released, staging removed


def _crash_at(out: Path, label: str) -> None:
    """Publish in a child process that dies (no cleanup at all) when it reaches ``label``."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child

        def die(now: str) -> None:
            if now == label:
                os._exit(9)

        outdir.step_hook = die
        try:
            publish_new(out)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) in (0, 9)


def test_a_crash_at_any_step_is_recovered_by_the_next_run(before):
    out, state = before
    for label in steps(out, state):
        reset(out, state)
        _crash_at(out, label)
        # The crashed run's lock is provably stale (same host, its pid is gone): the next run takes over.
        session = OutputDir.open(str(out))
        session.close()
        assert snapshot(out) in (state, expected_after_success(state)), label
        assert not any(p.name.startswith(".") for p in out.iterdir()), label
        publish_new(out)  # a plain rerun succeeds
        assert snapshot(out) == expected_after_success(state), label


def test_recovery_direction_follows_the_commit_point(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name, data in OLD.items():
        (out / name).write_bytes(data)
    old_state = snapshot(out)
    _crash_at(out, "commit model.safetensors.index.json")
    notes = recover(str(out))
    assert "undid" in notes[0] and snapshot(out) == old_state
    reset(out, old_state)
    _crash_at(out, "discard")
    notes = recover(str(out))
    assert "finished publishing" in notes[0] and snapshot(out) == expected_after_success(old_state)


# ---------------------------------------------------------------- the lock


def test_a_live_lock_stops_a_second_run_naming_the_holder(tmp_path):
    first = OutputDir.open(str(tmp_path))
    try:
        with pytest.raises(InputError, match=rf"pid {os.getpid()} on {socket.gethostname()}.*--break-lock"):
            OutputDir.open(str(tmp_path))
    finally:
        first.close()
    OutputDir.open(str(tmp_path)).close()


def test_a_lock_from_another_host_needs_break_lock(tmp_path):
    foreign = Holder("elsewhere", 4242, "777", "2026-01-01 00:00:00 UTC", "boot", 1, 1, "feedface")
    (tmp_path / LOCK_NAME).write_bytes(foreign.to_bytes())
    with pytest.raises(InputError, match="pid 4242 on elsewhere, Slurm job 777.*rerun with --break-lock"):
        OutputDir.open(str(tmp_path))
    session = OutputDir.open(str(tmp_path), break_lock=True)
    assert "broke the lock" in session.notes[0]
    session.close()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_dead_local_holder_is_recognised(tmp_path):
    pid = os.fork()
    if pid == 0:  # pragma: no cover
        OutputLock.acquire(str(tmp_path))
        os._exit(0)
    os.waitpid(pid, 0)
    assert json.loads((tmp_path / LOCK_NAME).read_bytes())["pid"] == pid
    session = OutputDir.open(str(tmp_path))
    assert "its process is gone" in session.notes[0]
    session.close()


def test_a_lock_broken_by_another_run_stops_publishing(tmp_path):
    session = OutputDir.open(str(tmp_path))
    session.stage()
    for name, data in NEW.items():
        session.write_staged(name, data)
    other = OutputDir.open(str(tmp_path), break_lock=True)
    try:
        with pytest.raises(WriteError, match="lock was broken by another run; nothing published"):
            session.publish(list(NEW), [], durable=True, before_commit=lambda: None)
    finally:
        session.close()
        other.close()
    assert snapshot(tmp_path) == {}


def test_a_symlink_at_the_lock_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).symlink_to(victim)
    with pytest.raises(InputError, match="mpicons did not make this"):
        OutputDir.open(str(out))
    assert victim.read_bytes() == b"precious"


def test_a_directory_in_the_way_is_never_replaced(tmp_path):
    (tmp_path / "model-00001-of-00002.safetensors").mkdir()
    with pytest.raises(InputError, match="is a directory; mpicons never replaces a directory"):
        publish_new(tmp_path, force=True)


def test_output_paths_that_are_files_are_bad_input(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="output path exists and is not a directory"):
        OutputDir.open(str(tmp_path / "file"))
    with pytest.raises(InputError, match="is not a directory, so the output directory"):
        OutputDir.open(str(tmp_path / "file" / "sub" / "out"))


def test_directories_made_by_a_failed_run_are_removed(tmp_path):
    target = tmp_path / "a" / "b" / "out"
    session = OutputDir.open(str(target))
    session.stage()
    session.close()
    assert not (tmp_path / "a").exists()
