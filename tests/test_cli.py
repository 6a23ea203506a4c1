"""Every command-line option reaches the library call, and the flags change what is written."""

from __future__ import annotations

import argparse
import json
import pydoc
import subprocess
import sys
from dataclasses import fields, replace

import pytest
from helpers import FIXTURES, assert_manifest, cli, mpirun, subprocess_env

from mpicons.core.options import Options
from mpicons.core.reports import count_of, human_size, wrapped
from mpicons.frontends.arguments import build_parser, job_options, parse_size
from mpicons.frontends.cli import closing_report, main
from mpicons.job.consolidation import ConsolidateResult
from mpicons.job.stats import PHASES, Spread, Stats

INPUT = FIXTURES / "edge-3ranks" / "sharded"


def test_every_consolidate_option_is_passed_on():
    args = build_parser().parse_args(
        [
            "consolidate",
            "in",
            "out",
            "--mapping",
            "m.json",
            "--dtype",
            "bf16",
            "--max-shard-size",
            "5GB",
            "--format",
            "hdf5",
            "--gather-to",
            "1",
            "--split",
            "files",
            "--io",
            "mpiio",
            "--hint",
            "a=b",
            "--buffer-size",
            "8M",
            "--force",
            "--break-lock",
            "--no-sync",
            "--no-manifest",
            "--restart",
            "--progress",
            "3",
            "-v",
            "--include",
            "model.*",
            "--include",
            "lm_head.*",
            "--exclude",
            "*.bias",
            "--strip-prefix",
            "model.",
            "--adapter",
            "torchtitan",
            "--model-type",
            "qwen3",
            "--hf-assets",
            "assets",
            "--keep-dtype",
            "*norm*",
            "--s3-endpoint",
            "http://127.0.0.1:9000",
            "--s3-part-size",
            "16M",
            "--expect-ranks",
            "8",
            "--main-params",
            "--lora",
            "adapter",
            "--no-merge",
        ]
    )
    options = job_options(args)
    assert options == Options(
        mapping="m.json",
        dtype="bf16",
        max_shard_size=5 * 10**9,
        output_format="hdf5",
        gather_to=1,
        split="files",
        io="mpiio",
        hints={"a": "b"},
        buffer_size=8 << 20,
        force=True,
        break_lock=True,
        include=("model.*", "lm_head.*"),
        exclude=("*.bias",),
        strip_prefix="model.",
        adapter="torchtitan",
        model_type="qwen3",
        hf_assets="assets",
        keep_dtype=("*norm*",),
        s3_endpoint="http://127.0.0.1:9000",
        s3_part_size=16 << 20,
        expect_ranks=8,
        main_params=True,
        lora="adapter",
        no_merge=True,
        sync=False,
        manifest=False,
        restart=True,
        progress=3.0,
        verbose=True,
    )
    defaults = Options()
    # No option of the library is unreachable from the command line: every field was changed above
    # (but the background I/O threads, which MPICONS_IO_THREADS gives).
    unchanged = [f.name for f in fields(Options) if getattr(options, f.name) == getattr(defaults, f.name)]
    assert unchanged == ["io_threads"]


def test_format_and_gather_flags_take_effect(tmp_path):
    proc, _ = mpirun(2, ["-m", "mpicons", "consolidate", str(INPUT), str(tmp_path / "h5"), "--format", "hdf5", "-q"])
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "h5").iterdir()) == ["SHA256SUMS", "model.h5"]
    assert_manifest(tmp_path / "h5")
    stats = tmp_path / "s.json"
    proc, _ = mpirun(
        3,
        [
            "-m",
            "mpicons",
            "consolidate",
            str(INPUT),
            str(tmp_path / "g"),
            "--gather-to",
            "2",
            "-q",
            "--stats-json",
            str(stats),
            "--no-sync",
        ],
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(stats.read_text())
    assert report["bytes_per_rank"]["max"] == report["total_bytes"]  # rank 2 wrote everything
    assert report["moved_bytes"] == 0 and report["shared_input"]  # ...reading it all from the shared directory


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(commands.choices)


def test_no_parser_takes_abbreviations():
    parser = build_parser()
    assert not parser.allow_abbrev
    assert {name: sub.allow_abbrev for name, sub in _subparsers(parser).items()} == {
        "consolidate": False,
        "demo": False,
        "verify": False,
        "inspect": False,
        "shard": False,
    }


@pytest.mark.parametrize(
    "argv, suggestion",
    [
        (["consolidate", "in", "out", "--forc"], "--force"),
        (["consolidate", "in", "out", "--break"], "--break-lock"),
        (["demo", "--progres", "3"], "--progress"),
        (["verify", "out", "--agaist", "in"], "--against"),
        (["inspect", "in", "--limt", "3"], "--limit"),
    ],
)
def test_a_typo_is_refused_with_the_commands_usage_and_a_suggestion(capsys, argv, suggestion):
    """A prefix of a dangerous flag is not that flag; the error comes from the command's own parser."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: mpicons {argv[0]} ")
    assert f"mpicons {argv[0]}: error: unrecognized arguments: --" in err
    assert f"(did you mean {suggestion}?)" in err


def test_nothing_close_suggests_nothing(capsys):
    assert main(["consolidate", "in", "out", "--zzzz"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzz\n" in err and "did you mean" not in err


@pytest.mark.parametrize(
    "argv, said",
    [
        (["consolidte", "in", "out"], "invalid choice: 'consolidte'"),
        (["--dtype", "bf16", "consolidate", "in", "out"], "--dtype is an option of the command: put it after it"),
        (["--forc", "consolidate", "in", "out"], "unrecognized arguments: --forc (did you mean --force?); options go after"),
        (["--agaist", "x", "verify", "out"], "unrecognized arguments: --agaist (did you mean --against?)"),
    ],
)
def test_a_typo_before_the_command_says_what_to_type(capsys, argv, said):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: mpicons ") and said in err, err
    if argv[0] == "consolidte":
        assert "(did you mean consolidate?)" in err


def test_a_word_like_no_command_suggests_none(capsys):
    assert main(["frobnicate"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def test_demo_distcp_is_a_flag_before_the_directory():
    args = build_parser().parse_args(["demo", "--distcp", "work"])
    assert (args.directory, args.distcp, args.serialization) == ("work", True, None)
    args = build_parser().parse_args(["demo", "work", "--serialization", "safetensors"])
    assert (args.directory, args.serialization) == ("work", "safetensors")


def test_demo_distcp_dir_writes_there(tmp_path):
    proc, _ = cli(1, "demo", "--distcp", tmp_path / "d", "-q")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "d" / "distcp-torch_save" / ".metadata").is_file()
    assert (tmp_path / "d" / "consolidated" / "model.safetensors").is_file()


def test_a_wrong_progress_setting_stops_the_run_up_front(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mpicons", "consolidate", str(INPUT), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(MPICONS_PROGRESS="30"),
    )
    assert proc.returncode == 2
    assert "MPICONS_PROGRESS='30': expected 'bar' or 'lines'" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_help_of_options_shows_every_field_and_its_meaning():
    text = pydoc.render_doc(Options, renderer=pydoc.plaintext)
    flat = " ".join(text.replace("|", " ").split())
    for option in fields(Options):
        doc = " ".join(option.metadata["doc"].split())
        assert f" {option.name} {doc}" in flat, option.name


def test_size_echo_keeps_the_unit_the_user_wrote():
    assert human_size(parse_size("500G")) == "500 GiB (536.87 GB)"
    assert human_size(parse_size("64MiB")) == "64 MiB (67.11 MB)"
    assert human_size(parse_size("5GB")) == "5.00 GB"
    assert human_size(parse_size("1000")) == "1.00 kB"


def test_plurals():
    assert [count_of(n, "file") for n in (0, 1, 2)] == ["0 files", "1 file", "2 files"]
    assert count_of(1, "entry", "entries") == "1 entry"


def _result(files: list[str], output_dir: str, **stats: object) -> ConsolidateResult:
    spread = Spread(0.5, 12.25, 1234.5)
    figures = dict(ranks=1, files=len(files), tensors=1, total_bytes=1_234_567_890_123) | stats
    table = Stats(phases=dict.fromkeys(PHASES, spread), elapsed=spread, bytes_per_rank=spread, peak_rss_mb=spread, **figures)
    return ConsolidateResult(
        output_dir=output_dir,
        files=files,
        index_file="model.safetensors.index.json" if len(files) > 1 else "",
        tensors=1,
        total_bytes=1,
        stats=table,
        layout=None,  # type: ignore[arg-type]
        hints={"romio_cb_write": "enable", "striping_factor": "16", "cb_buffer_size": "16777216"},
        bytes_per_rank=[1, 2],
        moved_bytes=1,
        shared_input=False,
        skipped=[f"optimizer.state.{i}" for i in range(7)],
    )


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_closing_report_fits_the_terminal(width):
    files = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    lines = closing_report(_result(files, "out"), verbose=True, width=width)
    assert all(len(line) <= width for line in lines), [line for line in lines if len(line) > width]
    text = " ".join(" ".join(lines).split())  # the words, wherever the lines were broken
    for expected in [
        *files,
        "model.safetensors.index.json",
        "3 files",
        "1 tensor",
        "1 rank",
        "1 byte moved",
        "2 bytes",
        "optimizer.state.4",
    ]:
        assert expected in text  # fitted by breaking between items, nothing cut
    assert "1 bytes" not in text and "1 tensors" not in text and "1 ranks" not in text


def test_closing_report_keeps_one_line_per_item_when_it_fits():
    lines = closing_report(_result(["model.safetensors"], "out"), verbose=False, width=200)
    assert lines[0] == "mpicons: 1 file, 1 tensor, 1.23 TB on 1 rank"
    assert lines[-1] == "mpicons: wrote model.safetensors to out"
    assert (
        lines[-2]
        == "mpicons: skipped 7 entries that are not tensors: "
        + ", ".join(f"optimizer.state.{i}" for i in range(5))
        + ", and 2 more"
    )


def test_io_threads_come_from_the_environment_when_the_options_are_made(monkeypatch):
    from mpicons.core.errors import InputError
    from mpicons.core.options import io_threads_from_environment

    assert io_threads_from_environment({}) == 1
    assert io_threads_from_environment({"MPICONS_IO_THREADS": " 3 "}) == 3
    with pytest.raises(InputError, match="MPICONS_IO_THREADS='two'"):
        io_threads_from_environment({"MPICONS_IO_THREADS": "two"})
    monkeypatch.setenv("MPICONS_IO_THREADS", "0")
    assert Options().io_threads == 0
    with pytest.raises(InputError, match="MPICONS_IO_THREADS must be"):
        Options(io_threads=-1).check(1)


def test_closing_report_breaks_between_phrases_in_an_80_column_log():
    """A Slurm log is 80 columns: '(not model' / 'state)' read as two statements."""
    result = _result(["model.safetensors"], "/scratch/run/hf-step-10000-with-a-long-name/for-the-log")
    result = replace(result, adapted=["skipped 23 saved tensors matching optimizer.** (not model state)"], skipped=[])
    lines = closing_report(result, verbose=False, width=80)
    assert all(len(line) <= 80 for line in lines), lines
    assert "mpicons: adapter: skipped 23 saved tensors matching optimizer.**" in lines
    assert "  (not model state)" in lines
    assert wrapped(["mpicons: first part here, (kept, whole) second"], 32) == [
        "mpicons: first part here,",
        "  (kept, whole) second",  # no break at the comma inside the parenthesis
    ]


@pytest.mark.parametrize("seconds", ["-1", "-0.5", "nan", "soon"])
def test_a_negative_progress_interval_is_a_usage_error(capsys, seconds):
    """--progress -1 used to turn progress off silently, as 0 does."""
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["consolidate", "in", "out", "--progress", seconds])
    assert stopped.value.code == 2
    assert "argument --progress: " in capsys.readouterr().err
    assert build_parser().parse_args(["consolidate", "in", "out", "--progress", "0"]).progress == 0


def test_the_s3_part_size_is_echoed_in_the_unit_given():
    from mpicons.core.errors import InputError

    with pytest.raises(InputError, match=r"--s3-part-size 1 MiB \(1\.05 MB\) is not between 10 MiB and 5 GiB"):
        Options(s3_part_size=parse_size("1M")).check(1)
    with pytest.raises(InputError, match=r"--s3-part-size 6 GiB \(6\.44 GB\)"):
        Options(s3_part_size=parse_size("6G")).check(1)
