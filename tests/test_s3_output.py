"""Consolidating into ``s3://bucket/prefix`` against a local S3 server: the objects are the bytes the
filesystem path writes (and safetensors' serializer), uploaded in parts by every rank; the lock,
replacing, failures and signals leave no final object and no open upload behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from helpers import assert_consolidated, cli, sample_expected, start, subprocess_env

import mpicons
from mpicons.core.errors import InputError, WriteError
from mpicons.sample import SampleConfig, expected_mapping, write_sample

pytest.importorskip("boto3")
pytest.importorskip("moto")
import s3server  # noqa: E402

MiB = 1 << 20
#: Two files of about 12 MiB: with 10 MiB parts every file is several parts, from several ranks.
CONFIG = SampleConfig.sized(24 * MiB, files=2)
PART = 10 * MiB


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("s3-sample") / "sharded"
    write_sample(path, CONFIG)
    return path


def _objects(s3: object, bucket: str, prefix: str) -> dict[str, int]:
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")  # type: ignore[attr-defined]
    return {item["Key"][len(prefix) + 1 :]: item["Size"] for item in listed.get("Contents") or ()}


def _open_uploads(s3: object, bucket: str) -> list[str]:
    return [u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads") or ()]  # type: ignore[attr-defined]


def _download(s3: object, bucket: str, prefix: str, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in _objects(s3, bucket, prefix):
        body = s3.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"].read()  # type: ignore[attr-defined]
        (directory / name).write_bytes(body)
    return directory


def test_objects_are_the_filesystem_outputs_bytes(sharded, s3_endpoint, s3_bucket, tmp_path):
    local = mpicons.consolidate(sharded, tmp_path / "fs")
    result = mpicons.consolidate(sharded, f"s3://{s3_bucket}/hf/step-1", s3_endpoint=s3_endpoint, s3_part_size=PART)
    s3 = s3server.client(s3_endpoint)
    got = _download(s3, s3_bucket, "hf/step-1", tmp_path / "got")
    published = local.files + [local.index_file, local.manifest]
    assert sorted(p.name for p in got.iterdir()) == sorted(published)
    for name in published:
        assert (got / name).read_bytes() == (tmp_path / "fs" / name).read_bytes(), name
    assert_consolidated(got, sample_expected(CONFIG), expected_mapping(CONFIG))
    assert result.files == local.files and result.output_dir == f"s3://{s3_bucket}/hf/step-1"
    assert result.manifest == local.manifest == "SHA256SUMS"
    assert _open_uploads(s3, s3_bucket) == []


def test_from_s3_to_s3(sharded, s3_endpoint, s3_bucket, tmp_path):
    s3 = s3server.client(s3_endpoint)
    for path in sharded.iterdir():
        s3.upload_file(str(path), s3_bucket, f"shards/{path.name}")
    mpicons.consolidate(f"s3://{s3_bucket}/shards", f"s3://{s3_bucket}/hf", s3_endpoint=s3_endpoint, s3_part_size=PART)
    got = _download(s3, s3_bucket, "hf", tmp_path / "got")
    assert_consolidated(got, sample_expected(CONFIG), expected_mapping(CONFIG))


def test_a_checkpoint_there_is_replaced_only_with_force(sharded, s3_endpoint, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/hf"
    mpicons.consolidate(sharded, url, s3_endpoint=s3_endpoint, max_shard_size=8 * MiB)
    s3 = s3server.client(s3_endpoint)
    before = _objects(s3, s3_bucket, "hf")
    with pytest.raises(InputError, match="already holds a checkpoint.*--force"):
        mpicons.consolidate(sharded, url, s3_endpoint=s3_endpoint)
    assert _objects(s3, s3_bucket, "hf") == before
    mpicons.consolidate(sharded, url, s3_endpoint=s3_endpoint, force=True)  # two files now, not four
    got = _download(s3, s3_bucket, "hf", tmp_path / "got")
    assert sorted(p.name for p in got.iterdir()) == sorted(
        set(expected_mapping(CONFIG).values()) | {"model.safetensors.index.json", "SHA256SUMS"}
    )
    assert_consolidated(got, sample_expected(CONFIG), expected_mapping(CONFIG))


def test_shards_under_the_output_prefix_are_refused(sharded, s3_endpoint, s3_bucket):
    s3 = s3server.client(s3_endpoint)
    s3.put_object(Bucket=s3_bucket, Key="run/shard-00001-model-00001-of-00002.safetensors", Body=b"x")
    with pytest.raises(InputError, match="sharded checkpoint.*look swapped"):
        mpicons.consolidate(sharded, f"s3://{s3_bucket}/run", s3_endpoint=s3_endpoint, force=True)
    assert _objects(s3, s3_bucket, "run") == {"shard-00001-model-00001-of-00002.safetensors": 1}


def test_the_input_is_never_the_output(s3_endpoint, s3_bucket):
    with pytest.raises(InputError, match="the output is the input"):
        mpicons.consolidate(f"s3://{s3_bucket}/p", f"s3://{s3_bucket}/p/", s3_endpoint=s3_endpoint)
    with pytest.raises(InputError, match="the output is the input"):
        mpicons.consolidate(f"s3://{s3_bucket}//p", f"s3://{s3_bucket}/p", s3_endpoint=s3_endpoint)


def test_the_output_is_never_inside_the_input(s3_endpoint: str, s3_bucket: str) -> None:
    """As for directories: ``s3://b/shards`` → ``s3://b/shards/hf`` is refused; a sibling or the parent is not inside."""
    for source, target in (("shards", "shards/hf"), ("shards", "shards/a/b"), ("", "hf")):
        with pytest.raises(InputError, match="the output is inside the input"):
            mpicons.consolidate(f"s3://{s3_bucket}/{source}", f"s3://{s3_bucket}/{target}", s3_endpoint=s3_endpoint)
    for source, target in (("shards", "shards-hf"), ("run/shards", "run")):
        with pytest.raises(InputError) as caught:
            mpicons.consolidate(f"s3://{s3_bucket}/{source}", f"s3://{s3_bucket}/{target}", s3_endpoint=s3_endpoint)
        assert "inside the input" not in str(caught.value)  # refused later: there are no shards there


def test_a_held_lock_is_refused_and_broken_only_when_asked(sharded, s3_endpoint, s3_bucket, tmp_path):
    s3 = s3server.client(s3_endpoint)
    s3.put_object(Bucket=s3_bucket, Key="hf/.mpicons.lock", Body=b"not ours")
    left = s3.create_multipart_upload(Bucket=s3_bucket, Key="hf/model-00001-of-00002.safetensors")["UploadId"]
    url = f"s3://{s3_bucket}/hf"
    with pytest.raises(InputError, match="locked by an unknown holder.*--break-lock"):
        mpicons.consolidate(sharded, url, s3_endpoint=s3_endpoint)
    assert _open_uploads(s3, s3_bucket) == ["hf/model-00001-of-00002.safetensors"]
    result = mpicons.consolidate(sharded, url, s3_endpoint=s3_endpoint, break_lock=True)
    assert any("broke the lock" in note and "aborted 1 upload" in note for note in result.notes), result.notes
    assert left and _open_uploads(s3, s3_bucket) == []
    assert ".mpicons.lock" not in _objects(s3, s3_bucket, "hf")


def _proxy_rules(path: Path, *rules: dict[str, object]) -> Path:
    path.write_text(json.dumps({"rules": list(rules), "log": str(path.with_suffix(".log"))}))
    return path


def test_a_failed_part_upload_leaves_no_object_and_no_open_upload(sharded, s3_endpoint, s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    control = _proxy_rules(tmp_path / "faults.json", {"op": "UploadPart", "part": 2, "status": 500, "code": "InternalError"})
    with s3server.FaultProxy(s3_endpoint, control) as proxy:
        with pytest.raises(WriteError, match=r"part 2 .*InternalError"):
            mpicons.consolidate(sharded, f"s3://{s3_bucket}/hf", s3_endpoint=proxy.url, s3_part_size=PART)
    s3 = s3server.client(s3_endpoint)
    assert _objects(s3, s3_bucket, "hf") == {}, "no final object, no index, no lock"
    assert _open_uploads(s3, s3_bucket) == []


def test_throttled_uploads_are_retried(sharded, s3_endpoint, s3_bucket, tmp_path):
    control = _proxy_rules(tmp_path / "faults.json", {"op": "UploadPart", "times": 3, "status": 503, "code": "SlowDown"})
    with s3server.FaultProxy(s3_endpoint, control) as proxy:
        mpicons.consolidate(sharded, f"s3://{s3_bucket}/hf", s3_endpoint=proxy.url, s3_part_size=PART)
    log = control.with_suffix(".log").read_text().split("\n")
    assert sum(1 for line in log if line.startswith("UploadPart") and line.endswith(" 503")) == 3
    got = _download(s3server.client(s3_endpoint), s3_bucket, "hf", tmp_path / "got")
    assert_consolidated(got, sample_expected(CONFIG), expected_mapping(CONFIG))


def test_sigterm_while_uploading_aborts_every_upload(sharded, s3_endpoint, s3_bucket, tmp_path, s3_env):
    control = _proxy_rules(tmp_path / "faults.json", {"op": "UploadPart", "delay": 1.0})
    with s3server.fault_proxy_process(s3_endpoint, control) as proxy:
        args = ["-m", "mpicons", "consolidate", sharded, f"s3://{s3_bucket}/hf", "--s3-endpoint", proxy, "--s3-part-size", "10M"]
        proc = start(2, *args, env=subprocess_env())
        log = control.with_suffix(".log")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (log.exists() and "CreateMultipartUpload" in log.read_text()):
            time.sleep(0.05)
        time.sleep(0.5)  # part uploads are in flight (each held a second by the proxy)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0, stderr
    assert "interrupted by SIGTERM" in stderr
    s3 = s3server.client(s3_endpoint)
    assert _objects(s3, s3_bucket, "hf") == {}
    assert _open_uploads(s3, s3_bucket) == []


@pytest.mark.parametrize(
    "problem", ["credentials", pytest.param("bucket", marks=pytest.mark.slow), pytest.param("endpoint", marks=pytest.mark.slow)]
)
def test_access_problems_are_bad_input_before_any_work(problem, sharded, s3_endpoint, s3_bucket, s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "never-printed-secret")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    bucket = "no-such-bucket-here" if problem == "bucket" else s3_bucket
    with s3server.moto_server(auth=True) as guarded:
        endpoint = {"credentials": guarded, "bucket": s3_endpoint, "endpoint": "http://127.0.0.1:9"}[problem]
        proc, _ = cli(1, "consolidate", sharded, f"s3://{bucket}/hf", "--s3-endpoint", endpoint, timeout=120)
    assert proc.returncode == 2, proc.stderr
    said = {"credentials": "credentials", "bucket": "bucket", "endpoint": "endpoint"}[problem]
    assert said in proc.stderr.lower() and "Traceback" not in proc.stderr, proc.stderr
    assert "never-printed-secret" not in proc.stderr
    assert _objects(s3server.client(s3_endpoint), s3_bucket, "hf") == {}


def test_hdf5_and_gather_to_are_refused_for_s3(sharded, s3_endpoint, s3_bucket):
    for changes in ({"output_format": "hdf5"}, {"gather_to": 0}, {"io": "mpiio"}):
        with pytest.raises(InputError):
            mpicons.consolidate(sharded, f"s3://{s3_bucket}/hf", s3_endpoint=s3_endpoint, **changes)


def test_the_command_line_writes_to_s3(sharded, s3_endpoint, s3_bucket, tmp_path, s3_env):
    proc, _ = cli(2, "consolidate", sharded, f"s3://{s3_bucket}/hf", "--s3-endpoint", s3_endpoint, "--s3-part-size", "10M")
    assert proc.returncode == 0, proc.stderr
    got = _download(s3server.client(s3_endpoint), s3_bucket, "hf", tmp_path / "got")
    assert_consolidated(got, sample_expected(CONFIG), expected_mapping(CONFIG))
    assert os.environ["AWS_ACCESS_KEY_ID"] == s3_env["AWS_ACCESS_KEY_ID"]


@pytest.mark.slow
def test_a_bug_on_one_rank_aborts_every_upload_before_the_job_is_aborted(sharded, s3_endpoint, s3_bucket, s3_env):
    """Outside any phase nothing is agreed: the failing rank aborts the run's uploads itself (every rank
    knows their ids), then the runner aborts the job; the lock stays, as for any run killed outright."""
    inject = Path(__file__).parent / "scripts" / "inject.py"
    args = ["bug-before-s3-commit", "1", "--", "consolidate", sharded, f"s3://{s3_bucket}/hf", "--s3-endpoint", s3_endpoint]
    proc = start(2, inject, *args, env=subprocess_env())
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "injected bug before the S3 commit" in stderr, stderr
    s3 = s3server.client(s3_endpoint)
    assert set(_objects(s3, s3_bucket, "hf")) <= {".mpicons.lock"}
    assert _open_uploads(s3, s3_bucket) == []


def test_a_file_of_empty_tensors_is_its_header_alone(s3_endpoint, s3_bucket, tmp_path):
    """A file with no data bytes is one part, its header, uploaded by the owner (a plain checkpoint keeps its files)."""
    import numpy as np
    from safetensors.numpy import save_file

    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({"empty": np.zeros((0, 4), dtype=np.float32)}, str(plain / "model-00001-of-00002.safetensors"))
    save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(plain / "model-00002-of-00002.safetensors"))
    local = mpicons.consolidate(plain, tmp_path / "fs")
    mpicons.consolidate(plain, f"s3://{s3_bucket}/hf", s3_endpoint=s3_endpoint)
    got = _download(s3server.client(s3_endpoint), s3_bucket, "hf", tmp_path / "got")
    for name in local.files + [local.index_file]:
        assert (got / name).read_bytes() == (tmp_path / "fs" / name).read_bytes(), name


def test_a_lock_that_cannot_be_released_is_a_warning_not_a_hang(sharded, s3_endpoint, s3_bucket, tmp_path, s3_env, monkeypatch):
    """The checkpoint is committed; releasing the lock fails on the owner alone: every rank still ends (exit 0)."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    control = _proxy_rules(tmp_path / "faults.json", {"op": "DeleteObject", "key": ".mpicons.lock", "status": 500})
    with s3server.fault_proxy_process(s3_endpoint, control) as proxy:
        proc, _ = cli(2, "consolidate", sharded, f"s3://{s3_bucket}/hf", "--s3-endpoint", proxy, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "the lock could not be released" in proc.stderr and "--break-lock" in proc.stderr
    got = _download(s3server.client(s3_endpoint), s3_bucket, "hf", tmp_path / "got")
    (got / ".mpicons.lock").unlink()  # left behind, as the warning says
    assert_consolidated(got, sample_expected(CONFIG), expected_mapping(CONFIG))


def test_parts_the_node_cannot_hold_are_refused_before_any_work(sharded, s3_endpoint, s3_bucket, monkeypatch):
    import mpicons.core.machine

    monkeypatch.setattr(mpicons.core.machine, "available_memory", lambda: 100 << 20)
    with pytest.raises(InputError, match="upload parts .*--s3-part-size"):
        mpicons.consolidate(sharded, f"s3://{s3_bucket}/hf", s3_endpoint=s3_endpoint, s3_part_size=64 * MiB)
    assert _objects(s3server.client(s3_endpoint), s3_bucket, "hf") == {}
