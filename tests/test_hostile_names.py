"""Trainer files made to break the readers: numbers too long to read, JSON nested too deep. Each is
exit 2 with one line naming the file, never a traceback, on copies of the real fixtures."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import cli

FIXTURES = Path(__file__).parent / "fixtures"
RUNS = {
    "megatron": FIXTURES / "megatron" / "llama-tp2" / "checkpoint",
    "verl": FIXTURES / "verl" / "llama-fsdp2" / "checkpoint",
}
TIMEOUT = 120


def refused(proc, *said: str) -> None:  # type: ignore[no-untyped-def]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("mpicons: error:") == 1, proc.stderr
    words = " ".join(proc.stderr.split())
    for text in said:
        assert text in words, proc.stderr


@pytest.mark.parametrize("trainer", list(RUNS))
@pytest.mark.parametrize("text", ["9" * 5000, "\u0661\u0660", "10 11"])
def test_a_tracker_file_that_is_no_plain_number_is_refused(trainer: str, text: str, tmp_path: Path) -> None:
    """5000 digits (past int()'s limit), digits of another script (which int() reads), two numbers."""
    run = tmp_path / "run"
    shutil.copytree(RUNS[trainer], run)
    (run / "latest_checkpointed_iteration.txt").write_text(text)
    proc = cli(1, "consolidate", run, tmp_path / "out", timeout=TIMEOUT)[0]
    # verl's run folder names no step of verl's then, and the tracker file is read as Megatron's: either way, named.
    refused(proc, "latest_checkpointed_iteration.txt: holds", "neither an iteration number nor 'release'")
    assert not (tmp_path / "out").exists()


def test_a_config_nested_too_deep_is_refused(tmp_path: Path) -> None:
    actor = tmp_path / "step" / "actor"
    shutil.copytree(RUNS["verl"] / "global_step_1" / "actor", actor)
    (actor / "fsdp_config.json").write_text("[" * 100_000 + "]" * 100_000)
    refused(cli(1, "consolidate", actor, tmp_path / "out", timeout=TIMEOUT)[0], "fsdp_config.json: not valid JSON")
