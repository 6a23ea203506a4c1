"""Reading the checkpoint from ``s3://bucket/prefix``: the scan, the engine's reads, consolidate and inspect.

Checkpoints (the sample generator's, both layouts, and the real ``.distcp`` fixtures) are uploaded
to the local moto server and consolidated from there; the output must be byte-identical to
consolidating the same files from the filesystem. The read counts are checked through a counting
source: a header is one read (two when long), ``.metadata`` one, a ``torch.save`` item two or three.
The MPI tests (1-4 ranks) share rank 0's server; their verdicts are agreed by conftest.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import s3server
from helpers import DISTCP_FIXTURES, cli
from mpi4py import MPI

import mpicons
from mpicons.comm.single import SingleProcess
from mpicons.core.errors import InputError
from mpicons.formats.byte_sources import PosixSource
from mpicons.formats.distcp_items import locate_all
from mpicons.formats.distcp_metadata import read_metadata
from mpicons.formats.shard_headers import HEAD_READ, read_file
from mpicons.frontends.inspection import inspect
from mpicons.job.scan import open_sources, scan
from mpicons.sample import SampleConfig, write_sample

BUCKET = "ckpt"
CONFIG = SampleConfig(layers=2, hidden=64, intermediate=136, vocab=301, files=2)
LAYOUTS = ["hf", "torch_save", "safetensors"]


# ---------------------------------------------------------------- helpers


class CountingSource(PosixSource):
    """A file whose reads are counted (what a ranged GET each would cost on S3)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.reads: list[tuple[int, int]] = []

    def read_at(self, offset: int, length: int) -> bytes:
        self.reads.append((offset, length))
        return super().read_at(offset, length)


def upload(endpoint: str, bucket: str, directory: Path, prefix: str) -> str:
    """Every file directly in ``directory`` as an object under ``s3://bucket/prefix``; the URL."""
    client = s3server.client(endpoint)
    for path in sorted(directory.iterdir()):
        if path.is_file():
            client.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=path.read_bytes())
    return f"s3://{bucket}/{prefix}"


def sample(directory: Path, layout: str, comm: object | None = None) -> Path:
    write_sample(directory, CONFIG, comm, distcp=None if layout == "hf" else layout)
    return directory


def outputs(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def unused_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def get_counts(log: Path) -> dict[str, int]:
    """GetObject requests per object key, from the fault proxy's request log."""
    counts: dict[str, int] = {}
    for line in log.read_text().splitlines():
        op, key, _, _ = line.split(" ")
        if op == "GetObject":
            name = key.rsplit("/", 1)[-1]
            counts[name] = counts.get(name, 0) + 1
    return counts


# ---------------------------------------------------------------- reads stay few and large


def test_a_header_is_one_read_and_a_long_one_two(tmp_path: Path) -> None:
    shard = sample(tmp_path / "in", "hf") / sorted(os.listdir(tmp_path / "in"))[0]
    with CountingSource(str(shard)) as source:
        read_file(source, shard.name)
        assert len(source.reads) == 1
    long = tmp_path / "long.safetensors"  # a header longer than the first read
    header = json.dumps({"__metadata__": {"pad": "x" * HEAD_READ}, "t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})
    long.write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"abcd")
    with CountingSource(str(long)) as source:
        assert read_file(source, long.name).names == ["t"]
        assert len(source.reads) == 2


@pytest.mark.parametrize("fixture", sorted(p.name for p in DISTCP_FIXTURES.iterdir() if (p / "dcp").is_dir()))
def test_metadata_is_one_read_and_an_item_two_or_three(fixture: str) -> None:
    """``.metadata`` whole in one read; each torch.save item's records from its first and last 4 KiB."""
    checkpoint = DISTCP_FIXTURES / fixture / "dcp"
    with CountingSource(str(checkpoint / ".metadata")) as source:
        table = read_metadata(source)
        assert source.reads == [(0, source.size)]
    from test_distcp import _items_by_file

    for name, items in _items_by_file(checkpoint).items():
        with CountingSource(str(checkpoint / name)) as source:
            begins, problems, _ = locate_all(source, items)
            assert not problems
            assert list(begins) == list(locate_all(str(checkpoint / name), items, fast=False)[0])
            assert len(source.reads) <= 3 * len(items), (name, len(items), len(source.reads))
    assert len(table.names)


# ---------------------------------------------------------------- the scan and the engine's reads from S3


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_scan_of_s3_is_the_scan_of_the_files(layout: str, tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    local = sample(tmp_path / "in", layout)
    url = upload(s3_endpoint, s3_bucket, local, f"scan/{layout}")
    comm = SingleProcess()
    on_disk, in_bucket = scan(str(local), comm), scan(url, comm, endpoint=s3_endpoint)
    assert in_bucket.directory == url and in_bucket.shared
    assert in_bucket.files.names == on_disk.files.names
    assert list(in_bucket.files.size) == list(on_disk.files.size)
    assert list(in_bucket.files.data_start) == list(on_disk.files.data_start)
    assert in_bucket.names == on_disk.names and in_bucket.skipped == on_disk.skipped
    for column in ("tensor", "file", "shape", "offset", "begin"):
        assert np.array_equal(getattr(in_bucket.pieces, column), getattr(on_disk.pieces, column)), column
    sources = open_sources(in_bucket)
    try:
        assert not sources.local and sources.path(0) == f"{url}/{in_bucket.files.names[0]}"
        for f, name in enumerate(in_bucket.files.names):
            data = (local / name).read_bytes()
            target = bytearray(len(data) - 5)
            sources.read_into(f, 5, memoryview(target))
            assert bytes(target) == data[5:]
    finally:
        sources.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_scan_of_s3_makes_few_gets(layout: str, tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    """One ranged GET per safetensors header, one for ``.metadata``, at most three per ``.distcp`` item."""
    local = sample(tmp_path / "in", layout)
    url = upload(s3_endpoint, s3_bucket, local, f"gets/{layout}")
    log, control = tmp_path / "requests.log", tmp_path / "faults.json"
    control.write_text(json.dumps({"rules": [], "log": str(log)}))
    with s3server.FaultProxy(s3_endpoint, control) as proxy:
        scanned = scan(url, SingleProcess(), endpoint=proxy.url)
    counts = get_counts(log)
    assert set(counts) == set(scanned.files.names) | ({".metadata"} if layout != "hf" else set())
    if layout == "hf":
        assert set(counts.values()) == {1}
    else:
        assert counts.pop(".metadata") == 1
        items = np.bincount(scanned.pieces.file, minlength=len(scanned.files))
        for f, name in enumerate(scanned.files.names):
            assert counts[name] <= 3 * max(1, int(items[f])), (name, counts[name], int(items[f]))


def test_an_s3_input_with_rank_in_it_is_refused(s3_endpoint: str, s3_bucket: str) -> None:
    with pytest.raises(InputError, match=r"\{rank\}"):
        scan(f"s3://{s3_bucket}/ckpt-{{rank}}", SingleProcess(), endpoint=s3_endpoint)


def test_an_empty_prefix_is_bad_input(s3_endpoint: str, s3_bucket: str) -> None:
    with pytest.raises(InputError, match=r"no \*\.safetensors files found"):
        scan(f"s3://{s3_bucket}/nothing", SingleProcess(), endpoint=s3_endpoint)


def test_a_prefix_above_the_shards_names_them(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    """``s3://b/run`` given for ``s3://b/run/sharded``: the message names the prefix to pass."""
    upload(s3_endpoint, s3_bucket, sample(tmp_path / "local", "hf"), "run/sharded")
    wanted = f"its subdirectory 'sharded' holds a checkpoint's files: pass s3://{s3_bucket}/run/sharded"
    with pytest.raises(InputError, match=re.escape(wanted)):
        scan(f"s3://{s3_bucket}/run", SingleProcess(), endpoint=s3_endpoint)


# ---------------------------------------------------------------- consolidate and inspect from S3


@pytest.mark.parametrize("layout", LAYOUTS)
def test_consolidating_from_s3_writes_the_same_bytes(layout: str, tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    local = sample(tmp_path / "in", layout)
    url = upload(s3_endpoint, s3_bucket, local, f"consolidate/{layout}")
    mpicons.consolidate(local, tmp_path / "from-files", buffer_size=1 << 16)
    result = mpicons.consolidate(url, tmp_path / "from-s3", buffer_size=1 << 16, s3_endpoint=s3_endpoint)
    assert outputs(tmp_path / "from-s3") == outputs(tmp_path / "from-files")
    assert result.total_bytes > 0


@pytest.mark.parametrize("fixture", ["fsdp-3ranks", "transposed", "dtypes-2ranks-safetensors"])
def test_a_real_distcp_checkpoint_from_s3(fixture: str, tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    local = DISTCP_FIXTURES / fixture / "dcp"
    url = upload(s3_endpoint, s3_bucket, local, f"fixtures/{fixture}")
    mpicons.consolidate(local, tmp_path / "from-files")
    mpicons.consolidate(url, tmp_path / "from-s3", s3_endpoint=s3_endpoint)
    assert outputs(tmp_path / "from-s3") == outputs(tmp_path / "from-files")


@pytest.mark.parametrize("layout", ["hf", "torch_save"])
def test_inspect_of_s3_describes_the_same_checkpoint(layout: str, tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    local = sample(tmp_path / "in", layout)
    url = upload(s3_endpoint, s3_bucket, local, f"inspect/{layout}")
    on_disk, in_bucket = inspect(local).to_dict(), inspect(url, s3_endpoint=s3_endpoint).to_dict()
    assert in_bucket.pop("input_dir") == url
    on_disk.pop("input_dir")
    assert in_bucket == on_disk and in_bucket["ok"]


def test_verify_compares_with_the_shards_in_s3(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    local = sample(tmp_path / "in", "torch_save")
    url = upload(s3_endpoint, s3_bucket, local, "verify")
    mpicons.consolidate(local, tmp_path / "out")
    report = mpicons.verify(tmp_path / "out", against=url, s3_endpoint=s3_endpoint)
    assert report.ok and not report.problems


def test_the_cli_reads_s3_by_the_endpoint_variable(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = sample(tmp_path / "in", "hf")
    url = upload(s3_endpoint, s3_bucket, local, "cli")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    proc, _ = cli(2, "inspect", url)
    assert proc.returncode == 0, proc.stderr
    assert url in proc.stdout
    proc, _ = cli(2, "consolidate", url, tmp_path / "out", "-q")
    assert proc.returncode == 0, proc.stderr
    mpicons.consolidate(local, tmp_path / "from-files")
    assert outputs(tmp_path / "out") == outputs(tmp_path / "from-files")


# ---------------------------------------------------------------- bad locations: exit 2 before any work


def test_a_missing_bucket_is_bad_input(tmp_path: Path, s3_endpoint: str, s3_env: dict[str, str]) -> None:
    with pytest.raises(InputError, match="bucket no-such-bucket does not exist"):
        mpicons.consolidate("s3://no-such-bucket/p", tmp_path / "out", s3_endpoint=s3_endpoint)
    assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match="does not exist"):
        inspect("s3://no-such-bucket/p", s3_endpoint=s3_endpoint)


def test_an_unreachable_endpoint_is_bad_input(tmp_path: Path, s3_env: dict[str, str]) -> None:
    with pytest.raises(InputError, match="cannot reach the S3 endpoint"):
        inspect("s3://ckpt/p", s3_endpoint=f"http://127.0.0.1:{unused_port()}")


def test_an_unreachable_endpoint_ends_the_job_within_seconds_in_one_line(tmp_path: Path, s3_env: dict[str, str]) -> None:
    """At 2 ranks, an s3:// input and an s3:// output alike: exit 2 with one line, no retries for a minute."""
    endpoint = f"http://127.0.0.1:{unused_port()}"
    write_sample(tmp_path / "sharded", SampleConfig(layers=1, hidden=16, intermediate=24, vocab=40, kv_dim=8), MPI.COMM_SELF)
    for source, target, url in (
        ("s3://ckpt/p", tmp_path / "out", "s3://ckpt/p"),
        (tmp_path / "sharded", "s3://ckpt/out", "s3://ckpt/out"),
    ):
        started = time.monotonic()
        proc, _ = cli(2, "consolidate", source, target, "--s3-endpoint", endpoint, timeout=60)
        took = time.monotonic() - started
        assert proc.returncode == 2, proc.stderr
        [line] = proc.stderr.splitlines()
        assert line.startswith(
            f"mpicons: error: [rank 0] {url}: cannot reach the S3 endpoint {endpoint} (Connection refused; 2 attempts in "
        ), line
        hint = "check --s3-endpoint / AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) and that the store is up and reachable"
        assert line.endswith(f"s): {hint}"), line
        assert took < 15, took  # MPI's start and the imports included; botocore's retries took 10-25 s
    assert not (tmp_path / "out").exists()


def test_wrong_credentials_are_bad_input_and_exit_2(
    tmp_path: Path, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "do-not-show-this-secret"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    with s3server.moto_server(auth=True) as guarded:
        with pytest.raises(InputError, match="refused the credentials") as caught:
            inspect("s3://ckpt/p", s3_endpoint=guarded)
        assert secret not in str(caught.value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", guarded)
        proc, _ = cli(2, "consolidate", "s3://ckpt/p", tmp_path / "out")
    assert proc.returncode == 2, proc.stderr
    assert "refused the credentials" in proc.stderr and secret not in proc.stderr + proc.stdout
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- at 1-4 ranks


def _shared_upload(comm: MPI.Intracomm, endpoint: str, bucket: str, directory: Path, prefix: str) -> str:
    """Rank 0 uploads; every rank learns whether that worked, and the URL."""
    error, url = None, None
    if comm.rank == 0:
        try:
            url = upload(endpoint, bucket, directory, prefix)
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            error = repr(exc)
    error, url = comm.bcast((error, url), root=0)
    assert error is None
    return url


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ["hf", "torch_save"])
def test_every_rank_reads_from_s3_alike(layout: str, mpi_tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    """Consolidated from the bucket and from the files by the whole job: the same bytes; inspect agrees."""
    comm = MPI.COMM_WORLD
    local = sample(mpi_tmp_path / "in", layout, comm)
    url = _shared_upload(comm, s3_endpoint, s3_bucket, local, layout)
    mpicons.consolidate(local, mpi_tmp_path / "from-files", comm=comm, buffer_size=1 << 14)
    result = mpicons.consolidate(url, mpi_tmp_path / "from-s3", comm=comm, buffer_size=1 << 14, s3_endpoint=s3_endpoint)
    assert sum(result.bytes_per_rank) == result.total_bytes
    if comm.rank == 0:
        assert outputs(mpi_tmp_path / "from-s3") == outputs(mpi_tmp_path / "from-files")
    report = inspect(url, comm=comm, s3_endpoint=s3_endpoint).to_dict()
    texts = comm.allgather(json.dumps(report, sort_keys=True))
    assert all(text == texts[0] for text in texts) and report["ok"]


@pytest.mark.mpi
def test_a_bad_s3_input_is_bad_input_on_every_rank(mpi_tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    comm = MPI.COMM_WORLD
    with pytest.raises(InputError, match="does not exist"):
        mpicons.consolidate("s3://no-such-bucket/p", mpi_tmp_path / "out", comm=comm, s3_endpoint=s3_endpoint)
    port = comm.bcast(unused_port(), root=0)
    with pytest.raises(InputError, match="cannot reach the S3 endpoint"):
        inspect(f"s3://{s3_bucket}/p", comm=comm, s3_endpoint=f"http://127.0.0.1:{port}")
    with pytest.raises(InputError, match=r"\{rank\}"):
        inspect(f"s3://{s3_bucket}/p-{{rank}}", comm=comm, s3_endpoint=s3_endpoint)


def test_a_read_cut_off_mid_way_is_resumed(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    """botocore retries a request until its headers arrive; a body that stops later is resumed from the byte it reached."""
    from mpicons.io.s3 import S3Client, S3Location

    data = bytes(range(256)) * 4096  # 1 MiB
    s3server.client(s3_endpoint).put_object(Bucket=s3_bucket, Key="p/blob", Body=data)
    control = tmp_path / "faults.json"
    log = tmp_path / "requests.log"
    control.write_text(json.dumps({"rules": [{"op": "GetObject", "times": 2, "cut": 100_000}], "log": str(log)}))
    with s3server.FaultProxy(s3_endpoint, control) as proxy:
        client = S3Client(S3Location.parse(f"s3://{s3_bucket}/p"), proxy.url)
        target = bytearray(len(data) - 10)
        client.read_into("blob", 10, memoryview(target))
    assert bytes(target) == data[10:]
    assert log.read_text().count("GetObject") == 3, "two cut-off bodies, each resumed by a GET of the rest"
