"""Shared vs node-local shards: the same checkpoint consolidated from one shared directory and from
per-rank directories (``{rank}``), reporting time and the bytes that crossed MPI.

Per-rank directories are made of hard links to the shared sample (no extra disk), each shard file
given to one rank (round-robin over the sorted names), so every column- or 2-D-sharded block needs
pieces from other ranks. Outputs are compared byte for byte with the shared-filesystem run.

    .venv/bin/python benchmarks/local_shards.py                  # reuses benchmarks/work/sharded
    .venv/bin/python benchmarks/local_shards.py --size 500MB --ranks 2,3 --repeat 2
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


def sample(workdir: Path, size: str) -> Path:
    """The shared sample: the main benchmark's if it exists, else a new one of ``size``."""
    shared = workdir / "sharded"
    if shared.is_dir() and any(shared.glob("shard-*.safetensors")):
        return shared
    from mpicons.frontends.arguments import parse_size
    from mpicons.sample import SampleConfig, write_sample

    write_sample(shared, SampleConfig.sized(parse_size(size)))
    return shared


def spread(shared: Path, root: Path, ranks: int) -> str:
    """Hard-link each shard into exactly one rank's directory; returns the ``{rank}`` template."""
    shutil.rmtree(root, ignore_errors=True)
    for rank in range(ranks):
        (root / f"in-{rank}").mkdir(parents=True)
    for i, path in enumerate(sorted(shared.glob("shard-*.safetensors"))):
        os.link(path, root / f"in-{i % ranks}" / path.name)
    return str(root / "in-{rank}")


def run(ranks: int, source: str, out: Path, extra: list[str]) -> dict[str, float]:
    """One consolidation; wall time, the job's own time, bytes moved over MPI, max bytes per rank."""
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=False)
    stats = out.parent / f"{out.name}.json"
    command = [
        str(VENV_BIN / "mpiexec"),
        "-n",
        str(ranks),
        str(VENV_BIN / "mpicons"),
        "consolidate",
        source,
        str(out),
        "-q",
        "--stats-json",
        str(stats),
        *extra,
    ]
    start = time.monotonic()
    subprocess.run(command, check=True)
    wall = time.monotonic() - start
    report = json.loads(stats.read_text())
    return {
        "wall": wall,
        "call": report["elapsed"]["max"],
        "moved": report["moved_bytes"],
        "max_rank": report["bytes_per_rank"]["max"],
        "total": report["total_bytes"],
    }


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=ROOT / "benchmarks" / "work")
    parser.add_argument("--size", default="2GB", help="sample size when benchmarks/work/sharded does not exist")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    shared = sample(args.workdir, args.size)
    for name in os.listdir(shared):  # warm the page cache
        with open(shared / name, "rb") as handle:
            while handle.read(1 << 24):
                pass
    rows = []
    for ranks in [int(r) for r in args.ranks.split(",")]:
        template = spread(shared, args.workdir / f"local-{ranks}", ranks)
        reference = args.workdir / f"local-out-{ranks}-shared"
        cases = [
            ("shared directory", str(shared), []),
            ("per-rank directories", template, []),
            ("per-rank, --gather-to 0", template, ["--gather-to", "0"]),
        ]
        for label, source, extra in cases:
            out = reference if label == "shared directory" else args.workdir / f"local-out-{ranks}-{len(rows)}"
            best = min((run(ranks, source, out, extra) for _ in range(args.repeat)), key=lambda r: r["wall"])
            identical = label == "shared directory" or same_files(out, reference)
            rows.append({"ranks": ranks, "case": label, **best, "identical": identical})
            print(
                f"-n {ranks}  {label:<26} wall {best['wall']:6.2f} s  call {best['call']:6.2f} s  "
                f"moved over MPI {best['moved'] / 1e9:6.3f} GB  max bytes/rank {best['max_rank'] / 1e9:6.3f} GB  "
                f"{'identical' if identical else 'DIFFERENT'}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if not all(r["identical"] for r in rows):
        sys.exit("outputs differ from the shared-filesystem run")


if __name__ == "__main__":
    main()
