#!/usr/bin/env python3
"""Consolidating to and from ``s3://`` on a local S3 server, against the filesystem path and against
the server's own speed.

One dense sample (``SampleConfig.sized``, output files of at most ~128 MB: the local server's ranged
GET costs time in proportion to the whole object) is written once; the script starts the local moto
server of ``tests/s3server.py`` (stopped in ``finally``), uploads the shards once to
``s3://bench/shards``, takes one untimed FS→FS run as the reference, then runs interleaved rounds
(the order rotating by one case per round) of

    mpiexec -n N mpicons consolidate SHARDS OUT --no-sync                                  (fs-fs)
    mpiexec -n N mpicons consolidate SHARDS s3://bench/out-K --s3-endpoint URL             (fs-s3)
    mpiexec -n N mpicons consolidate s3://bench/shards OUT --s3-endpoint URL --no-sync     (s3-fs)
    mpiexec -n N mpicons consolidate s3://bench/shards s3://bench/out-K --s3-endpoint URL  (s3-s3)
    python s3.py plain upload ...    boto3's transfer manager: the reference output's files, multipart
    python s3.py plain download ...  the same for the shard objects, into a local directory

and reports medians, each case's ratio to fs-fs, and mpicons' ratio to the plain transfers of the same
bytes (fs-s3 / plain upload, s3-fs / plain download): how close mpicons comes to what the server can
do. Every output is checked byte-identical to the reference (S3 objects downloaded and compared, no
multipart upload left open), then removed before the next run.

    python benchmarks/s3.py                                  # ~512 MB, 2 ranks, 3 rounds, in /tmp
    python benchmarks/s3.py --size 100MB --repeat 1          # a quick run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import (
    PYTHON,
    REPO,
    Quiet,
    Timed,
    cached_sample,
    checked,
    machine,
    mpirun,
    parse_size,
    quiesce,
    run_timed,
    same_tree,
    warm,
)

BUCKET = "bench"
#: The local server ignores credentials, but boto3 needs some: dummy ones, never real ones.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
ENV = {**os.environ, "PYTHONPATH": str(REPO), "MPICONS_PROGRESS": "lines", **CREDENTIALS}
FILE_BYTES = 128 * 10**6
CASES = ("fs-fs", "fs-s3", "s3-fs", "s3-s3", "plain-up", "plain-down")


def ensure_sample(workdir: Path, size: int) -> tuple[Path, dict[str, Any]]:
    """Write the dense sample once (output files of at most ~128 MB); reuse it while its config holds."""
    sys.path.insert(0, str(REPO))
    from mpicons.sample import SampleConfig

    directory = workdir / f"shards-{size}"
    config = SampleConfig.sized(size, files=max(2, math.ceil(size / FILE_BYTES)))
    return directory, cached_sample(directory, config, "s3")


def s3_client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=32),
    )


def plain(direction: str, endpoint: str, prefix: str, directory: Path, part_size: int) -> None:
    """boto3's own transfer manager (what ``upload_file``/``download_file`` use), every file at once,
    multipart with ``part_size``; prints the transfer's seconds without the interpreter's start."""
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    began = time.perf_counter()
    client = s3_client(endpoint)
    config = TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size)
    with create_transfer_manager(client, config) as manager:
        if direction == "upload":
            futures = [manager.upload(str(p), BUCKET, f"{prefix}/{p.name}") for p in sorted(directory.iterdir())]
        else:
            directory.mkdir(parents=True, exist_ok=True)
            keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/").get("Contents", [])]
            futures = [manager.download(BUCKET, key, str(directory / key.rsplit("/", 1)[1])) for key in keys]
        for future in futures:
            future.result()
    print(f"transfer {time.perf_counter() - began:.3f}")


def keys_under(client: Any, prefix: str) -> list[str]:
    found: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/"):
        found += [item["Key"] for item in page.get("Contents") or ()]
    return found


def delete_prefix(client: Any, prefix: str) -> None:
    keys = keys_under(client, prefix)
    for start in range(0, len(keys), 1000):
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in keys[start : start + 1000]], "Quiet": True})


def check_objects(client: Any, prefix: str, reference: Path, scratch: Path) -> str | None:
    """None when the objects under ``prefix`` are the reference's files, byte for byte, and no
    multipart upload is left open."""
    open_uploads = client.list_multipart_uploads(Bucket=BUCKET, Prefix=f"{prefix}/").get("Uploads") or []
    if open_uploads:
        return f"{len(open_uploads)} multipart upload(s) left open under {prefix}/"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    for key in keys_under(client, prefix):
        client.download_file(BUCKET, key, str(scratch / key.rsplit("/", 1)[1]))
    try:
        return same_tree(reference, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=int(512e6), help="tensor bytes of the sample (default 512MB)")
    parser.add_argument("--ranks", type=int, default=2, help="mpicons ranks (default 2)")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--part-size", default="64M", help="--s3-part-size, and the plain transfers' part size (default 64M)")
    parser.add_argument("--no-s3-s3", action="store_true", help="skip the s3-s3 case")
    parser.add_argument("--patience", type=float, default=60.0, help="seconds to wait for an idle machine per run")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mpicons-bench-s3")
    parser.add_argument("--json", type=Path, help="write every number here")
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    args.workdir.mkdir(parents=True, exist_ok=True)
    shards, described = ensure_sample(args.workdir, args.size)
    from mpicons.frontends.arguments import parse_size as cli_size  # the units --s3-part-size takes (64M = 64 MiB)

    part_bytes = cli_size(args.part_size)
    cases = [c for c in CASES if not (args.no_s3_s3 and c == "s3-s3")]
    sys.path.insert(0, str(REPO / "tests"))
    import moto
    from s3server import Server

    server = Server(["serve"], env=CREDENTIALS)
    try:
        measured = _measure(args, cases, shards, server.url, part_bytes)
    finally:
        server.stop()
    measured["server"] = f"moto {moto.__version__} (tests/s3server.py serve, loopback)"
    _report(args, described, shards, measured)


def _measure(args: argparse.Namespace, cases: list[str], shards: Path, endpoint: str, part_bytes: int) -> dict[str, Any]:
    """The reference run, the shards' upload, then the interleaved rounds, each output checked and removed."""
    client = s3_client(endpoint)
    client.create_bucket(Bucket=BUCKET)
    began = time.perf_counter()
    for path in sorted(shards.iterdir()):
        client.upload_file(str(path), BUCKET, f"shards/{path.name}")
    print(f"s3: uploaded the shards in {time.perf_counter() - began:.1f} s")
    quiet = Quiet(args.patience)
    work = args.workdir
    reference, local_out, downloaded = work / "reference", work / "out", work / "plain-down"
    consolidate = [PYTHON, "-m", "mpicons", "consolidate", "-q"]
    s3_options = ["--s3-endpoint", endpoint, "--s3-part-size", args.part_size]
    quiesce(reference)
    checked(run_timed(mpirun(args.ranks, [*consolidate, str(shards), str(reference), "--no-sync"]), env=ENV), "reference fs-fs")
    runs: dict[str, list[Timed]] = {name: [] for name in cases}
    transfer: dict[str, list[float]] = {"plain-up": [], "plain-down": []}
    checks: dict[str, int] = {name: 0 for name in cases}
    serial = 0

    def command(name: str, prefix: str) -> list[str]:
        source = f"s3://{BUCKET}/shards" if name.startswith("s3-") else str(shards)
        if name in ("plain-up", "plain-down"):
            direction, directory = ("upload", reference) if name == "plain-up" else ("download", downloaded)
            source_prefix = prefix if name == "plain-up" else "shards"
            return [PYTHON, __file__, "plain", direction, endpoint, source_prefix, str(directory), str(part_bytes)]
        if name.endswith("-s3"):
            return mpirun(args.ranks, [*consolidate, source, f"s3://{BUCKET}/{prefix}", *s3_options])
        extra = s3_options if name.startswith("s3-") else []
        return mpirun(args.ranks, [*consolidate, source, str(local_out), "--no-sync", *extra])

    def run(name: str) -> None:
        nonlocal serial
        serial += 1
        prefix = f"out-{serial}"
        quiesce(local_out, downloaded)
        warm(shards)
        quiet.wait(name)
        timed = checked(run_timed(command(name, prefix), env=ENV), name)
        runs[name].append(timed)
        if name.startswith("plain"):
            transfer[name].append(float(timed.log.split()[-1]))
        if name.endswith("-s3") or name == "plain-up":
            problem = check_objects(client, prefix, reference, work / "check")
            delete_prefix(client, prefix)
        elif name == "plain-down":
            problem = same_tree(shards, downloaded)
        else:
            problem = same_tree(reference, local_out)
        if problem:
            raise SystemExit(f"s3: the {name} output differs from the fs-fs reference: {problem}")
        checks[name] += 1

    for round_ in range(args.repeat):
        shift = round_ % len(cases)
        for name in cases[shift:] + cases[:shift]:
            run(name)
    quiesce(local_out, downloaded)
    return {"runs": runs, "transfer": transfer, "checks": checks, "busy_runs": quiet.busy_runs, "part_bytes": part_bytes}


def _report(args: argparse.Namespace, described: dict[str, Any], shards: Path, measured: dict[str, Any]) -> None:
    runs: dict[str, list[Timed]] = measured["runs"]
    config = described["config"]
    shard_bytes = sum(p.stat().st_size for p in shards.iterdir())
    out_bytes = sum(p.stat().st_size for p in (args.workdir / "reference").iterdir())
    print(
        f"dense sample: hidden {config['hidden']}, {config['layers']} layers, {described['tensors']} tensors, "
        f"{len(list(shards.iterdir()))} shard files ({shard_bytes / 1e6:.0f} MB) → {config['files']} output files "
        f"({out_bytes / 1e6:.0f} MB); {args.ranks} ranks, part size {args.part_size}, {args.repeat} interleaved rounds; "
        f"{measured['server']}"
    )
    medians = {name: statistics.median(t.wall for t in timed) for name, timed in runs.items()}
    print(f"{'case':<12}{'median s':>10}{'best s':>9}{'worst s':>9}{'MB/s':>8}{'RSS MB':>8}{'/ fs-fs':>9}")
    for name, timed in runs.items():
        walls = [t.wall for t in timed]
        moved = shard_bytes if name == "plain-down" else out_bytes
        print(
            f"{name:<12}{medians[name]:>10.3f}{min(walls):>9.3f}{max(walls):>9.3f}{moved / 1e6 / medians[name]:>8.0f}"
            f"{max(t.rss_mb for t in timed):>8.0f}{medians[name] / medians['fs-fs']:>8.2f}x"
        )
    transfer = {name: statistics.median(values) for name, values in measured["transfer"].items() if values}
    print("plain transfers without the interpreter's start (median s): " + ", ".join(f"{n} {s:.3f}" for n, s in transfer.items()))
    ratios = {f"{name} / fs-fs": medians[name] / medians["fs-fs"] for name in runs if name != "fs-fs"}
    ratios["fs-s3 / plain-up"] = medians["fs-s3"] / medians["plain-up"]
    ratios["s3-fs / plain-down"] = medians["s3-fs"] / medians["plain-down"]
    print("mpicons against the server's own speed (medians): " + ", ".join(f"{k} {v:.2f}x" for k, v in list(ratios.items())[-2:]))
    counts = ", ".join(f"{n} {c}" for n, c in measured["checks"].items())
    print(f"outputs checked byte-identical to the fs-fs reference (runs): {counts}")
    if measured["busy_runs"]:
        print("runs that started on a busy machine:", "; ".join(measured["busy_runs"]))
    if args.json:
        numbers = {
            "machine": machine(args.workdir),
            "sample": described,
            "ranks": args.ranks,
            "part_size": measured["part_bytes"],
            "server": measured["server"],
            "cases": {n: [t.__dict__ | {"log": ""} for t in ts] for n, ts in runs.items()},
            "plain_transfer_s": measured["transfer"],
            "medians": medians,
            "ratios": ratios,
            "checks": measured["checks"],
            "busy_runs": measured["busy_runs"],
        }
        args.json.write_text(json.dumps(numbers, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "plain":
        plain(sys.argv[2], sys.argv[3], sys.argv[4], Path(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
