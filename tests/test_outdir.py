"""The output directory's lock, staging and journaled publishing, with a failure injected at every step.

Whatever step fails (an error, which is rolled back at once, or a crash, which the next run
recovers), the directory must end up holding exactly what it held before, or the complete new
checkpoint with its index.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

import pytest

import mpicons.io.journal as journal
import mpicons.io.regular_files as regular_files
from mpicons.comm import SingleProcess
from mpicons.comm.agreement import agree
from mpicons.core.errors import InputError, WriteError
from mpicons.io.journal import UntrustedJournal, recover
from mpicons.io.lock import LOCK_NAME, Holder, OutputLock
from mpicons.io.outdir import OutputDir

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
    journal.step_hook = seen.append
    try:
        publish_new(directory)
    finally:
        journal.step_hook = lambda label: None
    return seen


def reset(directory: Path, state: dict[str, bytes]) -> None:
    for path in directory.iterdir():
        if path.is_dir():
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
    with pytest.raises(
        InputError,
        match=r"already holds model.safetensors.index.json, .* \(use --force to replace them; force=True from Python\)",
    ):
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

        journal.step_hook = fail
        try:
            if label == "discard":  # after the commit point: the new checkpoint stands, the rest is tidied later
                publish_new(out)
                journal.step_hook = lambda now: None
                assert snapshot(out) == expected_after_success(state)
                continue
            with pytest.raises(OSError, match="injected"):
                publish_new(out)
        finally:
            journal.step_hook = lambda now: None
        assert snapshot(out) == state, label
        assert not any(p.name.startswith(".") for p in out.iterdir()), label  # lock released, staging removed


def _crash_at(out: Path, label: str) -> None:
    """Publish in a child process that dies (no cleanup at all) when it reaches ``label``."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child

        def die(now: str) -> None:
            if now == label:
                os._exit(9)

        journal.step_hook = die
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
    with pytest.raises(InputError, match="unknown holder: .* is a symbolic link, not a lock mpicons made.*--break-lock"):
        OutputDir.open(str(out))
    assert victim.read_bytes() == b"precious"
    OutputDir.open(str(out), break_lock=True).close()  # the link goes, never its target
    assert victim.read_bytes() == b"precious" and not os.path.lexists(out / LOCK_NAME)


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


# ---------------------------------------------------------------- hostile locks

HERE = Holder.me()
SAME_HOST = {**json.loads(HERE.to_bytes()), "pid": 1 << 30}


def _hostile(lock: Path, kind: str) -> None:
    contents = {
        "deep array": b"[" * 200_000 + b"]" * 200_000,
        "pid 2**80": json.dumps({**SAME_HOST, "pid": 2**80}).encode(),
        "pid as a string": json.dumps({**SAME_HOST, "pid": str(os.getpid())}).encode(),
        "pid as a boolean": json.dumps({**SAME_HOST, "pid": True}).encode(),
        "negative pid": json.dumps({**SAME_HOST, "pid": -1}).encode(),
        "huge number": b'{"pid": ' + b"9" * 100_000 + b"}",
        "no token": json.dumps({k: v for k, v in SAME_HOST.items() if k != "token"}).encode(),
        "a line break in the host": json.dumps({**SAME_HOST, "host": "a\nmpicons: error: forged"}).encode(),
        "not utf-8": b"\xff\xfe{",
        "empty": b"",
    }
    if kind == "fifo":
        os.mkfifo(lock)
    elif kind == "directory":
        lock.mkdir()
    else:
        lock.write_bytes(contents[kind])


HOSTILE_LOCKS = [
    "deep array", "pid 2**80", "pid as a string", "pid as a boolean", "negative pid", "huge number", "no token",
    "a line break in the host", "not utf-8", "empty", "fifo", "directory",
]  # fmt: skip


@pytest.mark.parametrize("kind", HOSTILE_LOCKS)
def test_a_lock_mpicons_cannot_read_is_an_unknown_holder(tmp_path, kind):
    _hostile(tmp_path / LOCK_NAME, kind)
    with pytest.raises(InputError) as caught:
        OutputDir.open(str(tmp_path))
    message = str(caught.value)
    assert "held by an unknown holder" in message and "rerun with --break-lock" in message and "\n" not in message
    assert os.path.lexists(tmp_path / LOCK_NAME)  # left as found
    session = OutputDir.open(str(tmp_path), break_lock=True)
    assert "broke the lock" in session.notes[0] and "\n" not in session.notes[0]
    session.close()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_directory_with_entries_at_the_lock_is_never_removed(tmp_path):
    (tmp_path / LOCK_NAME).mkdir()
    (tmp_path / LOCK_NAME / "keep").write_text("mine")
    with pytest.raises(InputError, match="is a directory that is not empty.*move it out"):
        OutputDir.open(str(tmp_path), break_lock=True)
    assert (tmp_path / LOCK_NAME / "keep").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]


# ---------------------------------------------------------------- a journal recovery cannot trust


def _checksum(journal: dict) -> str:
    """The journal's checksum as docs/failure-model.md defines it: SHA-256 of the other fields as compact sorted JSON."""
    body = {k: v for k, v in journal.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _resealed(journal: dict) -> bytes:
    return json.dumps({**journal, "sha256": _checksum(journal)}).encode()


def _damage(raw: bytes, kind: str, out: Path) -> bytes | None:
    journal = json.loads(raw)
    notes = os.lstat(out / "notes.txt")
    first_new = journal["new"][0]
    damaged = {
        "empty": b"",
        "truncated": raw[: len(raw) // 2],
        "not JSON": b"\x00\x01 this is not a journal",
        "lists nothing new": _resealed({**journal, "new": []}),
        "names an unrelated file": json.dumps(
            {**journal, "new": [{"name": "notes.txt", "device": notes.st_dev, "inode": notes.st_ino}, *journal["new"]]}
        ).encode(),
        "names an unrelated file, resealed": _resealed({**journal, "new": [{**first_new, "name": "notes.txt"}]}),
        "names a path outside staging": _resealed({**journal, "new": [{**first_new, "name": "../notes.txt"}]}),
        "sets aside a path outside staging": _resealed({**journal, "aside": [{**first_new, "name": "../../victim"}]}),
        "forgets what it set aside": _resealed({**journal, "aside": []}),
        "another run's": _resealed({**journal, "token": "0123456789abcdef"}),
        "deep": b"[" * 200_000 + b"]" * 200_000,
        "removed": None,
        "a FIFO": None,
    }
    return damaged[kind]


JOURNAL_DAMAGE = [
    "empty", "truncated", "not JSON", "lists nothing new", "names an unrelated file", "names an unrelated file, resealed",
    "names a path outside staging", "sets aside a path outside staging", "forgets what it set aside", "another run's",
    "deep", "removed", "a FIFO",
]  # fmt: skip


@pytest.mark.parametrize(
    "crash_at",
    ["publish model-00001-of-00002.safetensors", pytest.param("commit model.safetensors.index.json", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("kind", JOURNAL_DAMAGE)
def test_a_journal_recovery_cannot_trust_deletes_nothing(tmp_path, kind, crash_at):
    """A crash while publishing, then a damaged journal: exit 2, every set-aside and unrelated file in place,
    and the message's restore instructions give back the old checkpoint."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "victim").write_bytes(b"precious")
    for name, data in OLD.items():
        (out / name).write_bytes(data)
    old_state = snapshot(out)
    _crash_at(out, crash_at)
    [staging] = out.glob(".mpicons-staging-*")
    kept = staging / ".replaced"
    set_aside = {p.name: p.read_bytes() for p in kept.iterdir()}
    assert set_aside == {n: b for n, b in OLD.items() if n != "notes.txt"}  # the whole old checkpoint
    journal = staging / ".journal.json"
    damaged = _damage(journal.read_bytes(), kind, out)
    journal.unlink()
    if damaged is not None:
        journal.write_bytes(damaged)
    if kind == "a FIFO":
        os.mkfifo(journal)
    (out / LOCK_NAME).unlink()  # the crashed run's (provably stale)
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(UntrustedJournal) as caught:
        OutputDir.open(str(out))
    message = str(caught.value)
    assert isinstance(caught.value, InputError) and "\n" not in message
    assert message.startswith(f"{staging}: ") and "moved and deleted nothing" in message
    assert f"to restore the old checkpoint, move them back into {out} (mv -f {kept}/* {out}/)" in message
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert not (out / LOCK_NAME).exists()  # released
    for path in kept.iterdir():  # what the message says to do
        path.replace(out / path.name)
    shutil.rmtree(staging)
    restored = snapshot(out)
    assert {n: b for n, b in restored.items() if n in old_state} == old_state
    assert {n: b for n, b in restored.items() if n not in old_state}.items() <= NEW.items()  # moved in, unindexed
    publish_new(out)
    assert snapshot(out) == expected_after_success(old_state)


def test_a_crash_while_removing_the_staging_directory_is_finished(tmp_path):
    """The set-aside files go first and the journal last: what is left is still a journal recovery trusts."""
    for name, data in OLD.items():
        (tmp_path / name).write_bytes(data)
    old_state = snapshot(tmp_path)
    _crash_at(tmp_path, "discard")
    [staging] = tmp_path.glob(".mpicons-staging-*")
    shutil.rmtree(staging / ".replaced")  # as far as removing it had come
    notes = recover(str(tmp_path))
    assert "finished publishing" in notes[0] and snapshot(tmp_path) == expected_after_success(old_state)
    assert not staging.exists()


def test_an_untrusted_journal_with_nothing_set_aside_says_so(tmp_path):
    _crash_at(tmp_path, "publish model-00001-of-00002.safetensors")
    [staging] = tmp_path.glob(".mpicons-staging-*")
    (staging / ".journal.json").write_bytes(b"")
    with pytest.raises(UntrustedJournal, match=rf"its journal is empty.*It set no files aside: remove {staging} and rerun"):
        OutputDir.open(str(tmp_path))
    assert staging.is_dir()


def test_the_journal_is_durable_without_sync(tmp_path, monkeypatch):
    """--no-sync skips the data's fsync, never the journal's: a power cut must not leave a journal to distrust."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    session = OutputDir.open(str(tmp_path))
    session.stage()
    for name, data in NEW.items():
        session.write_staged(name, data, durable=False)
    staging = session.staging
    session.publish(list(NEW), [], durable=False, before_commit=lambda: None)
    session.close()
    journal = synced.index(f"{staging}/.journal.json.partial")
    assert synced[journal : journal + 3] == [f"{staging}/.journal.json.partial", staging, str(tmp_path)]
    assert not any(path.endswith(".safetensors") for path in synced)  # the data's fsync is skipped
    assert snapshot(tmp_path) == NEW


# ---------------------------------------------------------------- a directory of shards is an input


@pytest.mark.parametrize("shard", ["shard-00001-model-00001-of-00001.safetensors", ".metadata", "__0_0.distcp"])
def test_a_directory_of_shards_is_never_an_output(tmp_path, shard):
    (tmp_path / shard).write_bytes(b"a shard")
    with pytest.raises(InputError, match=r"holds a sharded checkpoint \(.*\).*arguments look swapped.*INPUT_DIR OUTPUT_DIR"):
        OutputDir.open(str(tmp_path))
    assert os.listdir(tmp_path) == [shard]  # not even a lock was made there
    (tmp_path / "sharded").mkdir()  # torchtitan's layout: the shards one level down
    (tmp_path / shard).rename(tmp_path / "sharded" / shard)
    OutputDir.open(str(tmp_path)).close()


# ---------------------------------------------------------------- a full disk names the file


def _disk_full_at(monkeypatch, name: str) -> None:
    """Writes to the file called ``name`` fail with ENOSPC, as the system call reports it (naming no file)."""
    real_write = regular_files.write_bytes

    def write(fd: int, data: memoryview) -> int:
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(regular_files, "write_bytes", write)


@pytest.mark.parametrize("name", ["model.safetensors.index.json", ".journal.json.partial", ".mpicons.lock.", "data"])
def test_a_full_disk_names_the_file(tmp_path, monkeypatch, before, name):
    out, state = before
    if name == ".mpicons.lock.":  # the lock's private name ends with this run's token
        monkeypatch.setattr(Holder, "me", classmethod(lambda cls: HERE))
        name += HERE.token
    if name == "data":
        name = next(iter(NEW))
    _disk_full_at(monkeypatch, name)
    with pytest.raises(WriteError) as caught:
        agree(SingleProcess(), lambda: publish_new(out))
    assert str(caught.value).startswith("[rank 0] ") and str(caught.value).endswith(f"/{name}: No space left on device")
    assert snapshot(out) == state
    assert not any(p.name.startswith(".") for p in out.iterdir())
