"""Every command-line option reaches the library call, and the flags change what is written."""

from __future__ import annotations

import json
from dataclasses import fields

from helpers import FIXTURES, mpirun

from mpicons.cli import build_parser, job_options
from mpicons.options import Options

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
        sync=False,
        progress=3.0,
        verbose=True,
    )
    defaults = Options()
    # No option of the library is unreachable from the command line: every field was changed above.
    assert [f.name for f in fields(Options) if getattr(options, f.name) == getattr(defaults, f.name)] == []


def test_format_and_gather_flags_take_effect(tmp_path):
    proc, _ = mpirun(2, ["-m", "mpicons", "consolidate", str(INPUT), str(tmp_path / "h5"), "--format", "hdf5", "-q"])
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "h5").iterdir()) == ["model.h5"]
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
