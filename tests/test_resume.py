"""A stopped run continues when the same command runs again: what is durable is kept, the rest written,
the result byte-identical to a clean run (with its SHA256SUMS), and nothing stale is ever trusted."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import MPIEXEC, subprocess_env

from mpicons.io.resume import DoneRanges, RunIdentity, pack_records, unpack_records
from mpicons.sample import SampleConfig, write_sample

HERE = Path(__file__).parent
INJECT = str(HERE / "scripts" / "inject.py")
#: Small blocks, so a run has many and can be stopped between any two.
BUFFER = "256K"


def mpicons_run(ranks: int, *args: object, fault: str | None = None) -> subprocess.CompletedProcess:
    """``mpicons ARGS`` at ``ranks`` ranks, with a fault injected on every rank when given."""
    head = [INJECT, fault, "0", "--"] if fault else ["-m", "mpicons"]
    command = [MPIEXEC, "-n", str(ranks), os.sys.executable, *head, *map(str, args)]  # type: ignore[attr-defined]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=subprocess_env())


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("resume") / "sharded"
    write_sample(directory, SampleConfig(layers=4, hidden=256, intermediate=704, vocab=4000, kv_dim=64))
    return directory


def consolidate_args(source: Path, out: Path, stats: Path, *more: str) -> list[object]:
    return ["consolidate", source, out, "--buffer-size", BUFFER, "-q", "--stats-json", stats, *more]


def listing(out: Path) -> dict[str, str]:
    """Every entry of the output directory (hidden ones too) and its content's digest."""
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(out.rglob("*"))
    }


def clean_run(source: Path, tmp_path: Path, *more: str) -> dict[str, str]:
    out = tmp_path / "clean"
    proc = mpicons_run(2, *consolidate_args(source, out, tmp_path / "clean.json", *more))
    assert proc.returncode == 0, proc.stderr
    return listing(out)


def stopped_then_rerun(ranks: int, source: Path, out: Path, fault: str, *more: str) -> tuple[dict, str]:
    """A run stopped by ``fault``, then the same command again: the rerun's stats and its output."""
    stats = out.parent / "stats.json"
    stopped = mpicons_run(ranks, *consolidate_args(source, out, stats, *more), fault=fault)
    assert stopped.returncode != 0, stopped.stdout
    assert not (out / "model.safetensors.index.json").exists()
    proc = mpicons_run(ranks, *consolidate_args(source, out, stats, *more))
    assert proc.returncode == 0, proc.stderr
    return json.loads(stats.read_text()), proc.stderr


def share_bytes(source: Path, ranks: int, fraction: float) -> int:
    """``fraction`` of one rank's share of the output's bytes (the sample's files, about as large)."""
    total = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    return int(total / ranks * fraction)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_killed_mid_write_continues_byte_identical(sample, tmp_path, ranks):
    expected = clean_run(sample, tmp_path)
    out = tmp_path / "out"
    stats, _ = stopped_then_rerun(ranks, sample, out, f"stop-{share_bytes(sample, ranks, 0.45)}-kill")
    assert stats["resumed_bytes"] > 0
    assert listing(out) == expected  # the same files, byte for byte, and nothing else left behind


def test_terminated_run_keeps_its_blocks_and_says_so(sample, tmp_path):
    expected = clean_run(sample, tmp_path)
    out = tmp_path / "out"
    stats_path = tmp_path / "stats.json"
    args = consolidate_args(sample, out, stats_path)
    stopped = mpicons_run(2, *args, fault=f"stop-{share_bytes(sample, 2, 0.6)}-term")
    assert stopped.returncode != 0
    assert "run the same command again to continue" in stopped.stderr
    rerun = mpicons_run(2, *args[:-3])  # without -q and --stats-json: the report says what was kept
    assert rerun.returncode == 0, rerun.stderr
    assert "continued a stopped run" in rerun.stdout
    assert listing(out) == expected


@pytest.mark.parametrize(
    "fault",
    ["stop-0-kill", "publish-journal-kill", "publish-publish-kill", "publish-journal-term"],
    ids=["before-any-block", "after-last-block", "during-publish", "term-in-publish"],
)
def test_stopped_anywhere_gives_the_clean_result(sample, tmp_path, fault):
    expected = clean_run(sample, tmp_path)
    out = tmp_path / "out"
    stats, _ = stopped_then_rerun(2, sample, out, fault)
    assert listing(out) == expected
    if fault == "publish-journal-kill":  # every block was durable: nothing written again
        assert stats["resumed_bytes"] == stats["total_bytes"]


def test_between_files_with_whole_files_per_rank(sample, tmp_path):
    more = ("--split", "files", "--max-shard-size", "2M")
    expected = clean_run(sample, tmp_path, *more)
    out = tmp_path / "out"
    stats, _ = stopped_then_rerun(3, sample, out, f"stop-{share_bytes(sample, 3, 0.5)}-kill", *more)
    assert stats["resumed_bytes"] > 0
    assert listing(out) == expected


def test_a_changed_input_starts_afresh(sample, tmp_path):
    source = tmp_path / "in"
    source.mkdir()
    for shard in sample.iterdir():
        (source / shard.name).write_bytes(shard.read_bytes())
    out = tmp_path / "out"
    stats_path = tmp_path / "stats.json"
    args = consolidate_args(source, out, stats_path)
    assert mpicons_run(2, *args, fault=f"stop-{share_bytes(source, 2, 0.5)}-kill").returncode != 0
    changed = sorted(source.glob("*.safetensors"))[0]
    data = bytearray(changed.read_bytes())
    data[-1] ^= 0xFF  # the last byte of some tensor's data: the same size, other values
    changed.write_bytes(bytes(data))
    proc = mpicons_run(2, *args)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(stats_path.read_text())
    assert any("started afresh" in note and "input files changed" in note for note in stats["notes"]), stats["notes"]
    assert stats["resumed_bytes"] == 0
    assert listing(out) == clean_run(source, tmp_path)


@pytest.mark.parametrize("more", [("--no-sync",), ("--restart",)], ids=["no-sync", "restart"])
def test_unflushed_or_restarted_runs_trust_nothing(sample, tmp_path, more):
    expected = clean_run(sample, tmp_path)
    out = tmp_path / "out"
    first = more if more == ("--no-sync",) else ()
    stats_path = tmp_path / "stats.json"
    stopped = mpicons_run(2, *consolidate_args(sample, out, stats_path, *first), fault=f"stop-{share_bytes(sample, 2, 0.5)}-kill")
    assert stopped.returncode != 0
    proc = mpicons_run(2, *consolidate_args(sample, out, stats_path, *more))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(stats_path.read_text())["resumed_bytes"] == 0
    assert listing(out) == expected


def test_other_options_start_afresh(sample, tmp_path):
    out = tmp_path / "out"
    stats_path = tmp_path / "stats.json"
    stopped = mpicons_run(2, *consolidate_args(sample, out, stats_path), fault=f"stop-{share_bytes(sample, 2, 0.5)}-kill")
    assert stopped.returncode != 0
    proc = mpicons_run(2, *consolidate_args(sample, out, stats_path, "--dtype", "fp32"))
    assert proc.returncode == 0, proc.stderr
    notes = json.loads(stats_path.read_text())["notes"]
    assert any("started afresh" in note and "other options" in note for note in notes), notes
    assert listing(out) == clean_run(sample, tmp_path, "--dtype", "fp32")


# ---------------------------------------------------------------- the records, serially


def test_records_round_trip_and_a_torn_end_is_ignored():
    ranges = [(0, 0, 100), (3, 1 << 40, 7)]
    raw = pack_records(ranges)
    assert unpack_records(raw) == ranges
    assert unpack_records(raw[:-1]) == ranges[:1]  # the last record torn: not trusted
    damaged = bytearray(raw)
    damaged[5] ^= 1
    assert unpack_records(bytes(damaged)) == []  # a damaged record stops the reading


def test_done_ranges_merge_and_cover_only_whole_blocks():
    done = DoneRanges([(0, 0, 10), (0, 10, 10), (0, 40, 10), (1, 0, 5), (2, 0, 99)], sizes=[100, 4, 100])
    assert done.covers(0, 0, 20) and done.covers(0, 5, 15) and done.covers(0, 40, 10)
    assert not done.covers(0, 15, 10) and not done.covers(0, 35, 10) and not done.covers(3, 0, 1)
    assert not done.covers(1, 0, 1)  # a record past its file's end is ignored
    assert done.total == 20 + 10 + 99


def test_identity_says_what_differs():
    one = RunIdentity("1", "a", "b", "c")
    assert one.difference(one) is None
    assert "input files changed" in (one.difference(RunIdentity("1", "a", "x", "c")) or "")
    assert "mpicons 0" in (one.difference(RunIdentity("0", "a", "b", "c")) or "")
    assert RunIdentity.parse(one.to_bytes()) == one
    assert RunIdentity.parse(b'{"version": 1}') is None


# ---------------------------------------------------------------- the manifest, in one process


def test_the_manifest_lists_what_is_published_and_only_that(sample, tmp_path):
    from helpers import assert_manifest

    from mpicons import consolidate
    from mpicons.comm import SingleProcess

    out = tmp_path / "out"
    result = consolidate(sample, out, comm=SingleProcess(), buffer_size=1 << 20)
    assert result.manifest == "SHA256SUMS" and result.resumed_bytes == 0
    assert_manifest(out)
    proc = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=out, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # --no-manifest with --force: the old manifest would disagree with the new files, so it goes too
    again = consolidate(sample, out, comm=SingleProcess(), force=True, manifest=False, dtype="fp32")
    assert again.manifest == "" and not (out / "SHA256SUMS").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted([*again.files, again.index_file])


def test_set_aside_files_without_a_journal_are_never_taken_over(tmp_path):
    """A resumable staging directory holding an old checkpoint's set-aside files but no journal is left to
    recovery, which touches nothing: continuing it would delete those files."""
    from mpicons.io.journal import UntrustedJournal
    from mpicons.io.outdir import OutputDir

    out = tmp_path / "out"
    staging = out / ".mpicons-staging-0123456789abcdef"
    (staging / ".replaced").mkdir(parents=True)
    (staging / ".resume.json").write_bytes(RunIdentity("v", "o", "i", "l").to_bytes())
    (staging / ".blocks-0123456789abcdef-0").write_bytes(pack_records([(0, 0, 10)]))
    (staging / ".replaced" / "model.safetensors").write_bytes(b"the old checkpoint")
    with pytest.raises(UntrustedJournal):
        OutputDir.open(str(out))
    assert (staging / ".replaced" / "model.safetensors").read_bytes() == b"the old checkpoint"
