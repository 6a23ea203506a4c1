"""``mpicons demo DIR`` never overwrites or mixes with what is in DIR: it writes only into a new or empty
directory or over its own earlier sample, and refuses anything else before writing a byte, on every rank."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
from helpers import FIXTURES, cli

from mpicons.frontends.arguments import build_parser

#: A user's shards named exactly as the demo's sample names its own (4 training ranks, 2 files).
SAME_NAMES = FIXTURES / "tp2d-4ranks" / "sharded"
#: A user's shards of other names (3 files).
OTHER_NAMES = FIXTURES / "fsdp2-3ranks" / "sharded"
USER_CHECKPOINT = FIXTURES / "edge-3ranks" / "expected" / "full.safetensors"


def snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every entry under ``directory``: files with their bytes, directories as None."""
    return {
        str(path.relative_to(directory)): path.read_bytes() if path.is_file() else None for path in sorted(directory.rglob("*"))
    }


def refused(proc, *said: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("mpicons: error:") == 1, proc.stderr  # said once, by rank 0, for every rank
    words = " ".join(proc.stderr.split())  # lines are wrapped at 80 columns, wherever the temporary path falls
    assert "nothing was written" in words or "has written nothing" in words, proc.stderr
    for text in said:
        assert " ".join(text.split()) in words, proc.stderr
    assert "writing a sample" not in proc.stdout


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_user_shards_in_sharded_stay_byte_identical(tmp_path, ranks):
    """Shards named as the demo names its own were replaced by sample data, exit 0."""
    work = tmp_path / "work"
    shutil.copytree(SAME_NAMES, work / "sharded")
    before = snapshot(work)
    proc, _ = cli(ranks, "demo", work, timeout=120)
    refused(proc, "sharded/shard-00001-model-00001-of-00002.safetensors", "did not write", "mpicons demo NEW_DIR")
    assert snapshot(work) == before  # not a byte changed, nothing added (no marker, no output)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_shards_of_other_names_are_not_mixed_with_the_sample(tmp_path, ranks):
    """The demo added its own shards beside these, then failed: a directory of two checkpoints' shards."""
    work = tmp_path / "work"
    shutil.copytree(OTHER_NAMES, work / "sharded")
    before = snapshot(work)
    proc, _ = cli(ranks, "demo", work, timeout=120)
    refused(proc, "sharded/shard-00001-model-00001-of-00003.safetensors")
    assert snapshot(work) == before


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_a_checkpoint_in_consolidated_is_replaced_only_with_force(tmp_path, ranks):
    work = tmp_path / "work"
    (work / "consolidated").mkdir(parents=True)
    shutil.copy(USER_CHECKPOINT, work / "consolidated" / "model.safetensors")
    (work / "consolidated" / "notes.txt").write_text("mine\n")
    before = snapshot(work)
    proc, _ = cli(ranks, "demo", work, timeout=120)
    refused(proc, "consolidated: already holds a checkpoint the demo did not make (model.safetensors)", "--force")
    assert snapshot(work) == before  # refused before the sample was written, not by the consolidation after it
    if ranks != 3:
        return
    proc, _ = cli(ranks, "demo", work, "--force", "-q", timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in (work / "consolidated").iterdir())
    assert names == [  # the old checkpoint replaced as consolidate --force replaces one; other files stay
        "SHA256SUMS",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "notes.txt",
    ]
    assert (work / "consolidated" / "notes.txt").read_text() == "mine\n"


def test_other_files_in_the_directory_stop_it(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine\n")
    (work / "sharded").mkdir()  # empty: the demo may write there
    proc, _ = cli(2, "demo", work, timeout=120)
    refused(proc, "holds notes.txt, which mpicons demo did not write")
    assert snapshot(work) == {"notes.txt": b"mine\n", "sharded": None}


def test_a_rerun_over_its_own_sample_works_and_a_changed_file_is_no_longer_its_own(tmp_path):
    work = tmp_path / "work"
    for args in ([], [], ["--distcp"], []):  # again, then the other format beside it, then the first again
        proc, _ = cli(2, "demo", work, *args, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "match the sample's full tensors bit for bit" in " ".join(proc.stdout.split()), proc.stdout
        assert all(len(line) <= 80 or " " not in line.strip() for line in proc.stdout.splitlines()), proc.stdout
    assert sorted(p.name for p in work.iterdir()) == [".mpicons-demo", "consolidated", "distcp-torch_save", "sharded"]
    made = json.loads((work / ".mpicons-demo").read_text())["files"]
    assert sorted(made) == sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file() and p.parent != work)

    changed = work / "sharded" / "shard-00002-model-00001-of-00002.safetensors"
    with changed.open("ab") as handle:
        handle.write(b"the user's own bytes")
    before = snapshot(work)
    proc, _ = cli(2, "demo", work, timeout=120)
    refused(proc, "sharded/shard-00002-model-00001-of-00002.safetensors")
    assert snapshot(work) == before


def test_a_marker_it_cannot_read_as_its_own_stops_it(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / ".mpicons-demo").write_text('{"files": {"sharded/x": null}}')
    proc, _ = cli(1, "demo", work, timeout=120)
    refused(proc, ".mpicons-demo: not a marker mpicons demo wrote")
    assert sorted(p.name for p in work.iterdir()) == [".mpicons-demo"]


@pytest.mark.parametrize(
    "option",
    [
        ["--adapter", "torchtitan"],
        ["--hf-assets", "assets"],
        ["--s3-endpoint", "http://127.0.0.1:9"],
        ["--s3-part-size", "10M"],
        ["--dtype", "bf16"],
        ["--keep-dtype", "*.bias"],
        ["--include", "model.*"],
        ["--exclude", "lm_head.*"],
        ["--strip-prefix", "model."],
        ["--mapping", "m.json"],
        ["--format", "hdf5"],
    ],
)
def test_options_that_do_not_apply_to_the_demo_are_usage_errors(capsys, option):
    """The demo checks its result against the sample's own tensors: nothing that renames, converts,
    selects or goes to object storage (some of these were accepted and ignored, others broke the check)."""
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["demo", "work", *option])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: mpicons demo ") and f"unrecognized arguments: {option[0]}" in err
    assert f"{option[0]} is an option of mpicons consolidate, not of the demo" in err


def test_the_demo_keeps_the_options_of_how_a_run_goes():
    args = build_parser().parse_args(
        ["demo", "work", "--split", "files", "--io", "mpiio", "--buffer-size", "8M", "--max-shard-size", "300KB"]
        + ["--gather-to", "1", "--force", "--break-lock", "--no-sync", "--progress", "2", "--stats-json", "s.json", "-v"]
    )
    assert isinstance(args, argparse.Namespace) and args.split == "files" and args.gather_to == 1


@pytest.mark.parametrize("option", [["--gather-to", "5"], ["--buffer-size", "4000T"]])
def test_options_are_checked_before_the_sample_is_written(tmp_path, option):
    proc, _ = cli(2, "demo", tmp_path / "work", *option, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert not (tmp_path / "work").exists()
