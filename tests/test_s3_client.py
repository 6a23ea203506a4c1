"""mpicons.io.s3 against the local S3 server: URLs, listing, ranged reads, conditional puts, multipart
uploads, the access check's errors, and retries seen through the fault-injecting proxy."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from mpicons.core.errors import InputError, WriteError
from mpicons.io.s3 import ObjectExists, S3Client, S3Location, is_s3

pytest.importorskip("boto3")
pytest.importorskip("moto")

import s3server  # noqa: E402 - only once boto3 and moto are known to be there

MIB = 1 << 20
PART = 5 * MIB  # the smallest part S3 takes (all but the last)


def _client(bucket: str, endpoint: str, prefix: str = "ckpt/run1", **options: float) -> S3Client:
    return S3Client(S3Location.parse(f"s3://{bucket}/{prefix}"), endpoint, **options)


def _data(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


# --- locations ----------------------------------------------------------------------------------


def test_locations_parse_into_bucket_and_prefix() -> None:
    assert is_s3("s3://b/x") and not is_s3("/s3://x") and not is_s3(Path("s3:/x"))
    location = S3Location.parse("s3://my-bucket/a/b/")
    assert (location.bucket, location.prefix) == ("my-bucket", "a/b")
    assert location.key("model.safetensors") == "a/b/model.safetensors"
    assert location.url("model.safetensors") == "s3://my-bucket/a/b/model.safetensors"
    assert location.url() == "s3://my-bucket/a/b"
    root = S3Location.parse("s3://my.bucket")
    assert (root.prefix, root.key("x"), root.url(), root.url("x")) == ("", "x", "s3://my.bucket", "s3://my.bucket/x")


@pytest.mark.parametrize(
    "url, words",
    [
        ("s3://", "no bucket"),
        ("s3:///prefix", "no bucket"),
        ("s3://Upper/x", "not a valid bucket name"),
        ("s3://ab/x", "not a valid bucket name"),
        ("s3://bad_name/x", "not a valid bucket name"),
        ("s3://192.168.0.1/x", "not a valid bucket name"),
        ("s3://bucket/a/../b", "'..'"),
        ("s3://bucket/a//b", "empty"),
        ("s3://bucket/out-{rank}", "{rank}"),
        ("/local/path", "not an s3:// URL"),
    ],
)
def test_bad_urls_are_bad_input(url: str, words: str) -> None:
    with pytest.raises(InputError, match=re.escape(words)):
        S3Location.parse(url)


# --- the client's set-up ------------------------------------------------------------------------


def test_client_config_retries_adaptively_with_finite_timeouts(s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    config = _client("some-bucket", "http://127.0.0.1:1")._client.meta.config
    assert config.retries["mode"] == "adaptive" and config.retries["total_max_attempts"] == 11
    assert config.region_name == "us-east-1" and config.max_pool_connections >= 8
    assert 0 < config.connect_timeout <= 60 and 0 < config.read_timeout <= 600
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    config = _client("some-bucket", "http://127.0.0.1:1")._client.meta.config
    assert config.retries == {"mode": "adaptive", "total_max_attempts": 3} and config.region_name == "eu-west-1"


def test_without_boto3_an_s3_location_is_bad_input(s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3.session", None)
    with pytest.raises(InputError, match=r"s3://some-bucket/ckpt/run1: s3:// locations need boto3: pip install 'mpicons\[s3\]'"):
        _client("some-bucket", "http://127.0.0.1:1")


# --- objects ------------------------------------------------------------------------------------


def test_list_gives_the_objects_directly_under_the_prefix_over_several_pages(s3_bucket: str, s3_endpoint: str) -> None:
    raw = s3server.client(s3_endpoint)
    names = [f"shard-{i:03d}.safetensors" for i in range(25)]
    for i, name in enumerate(reversed(names)):
        raw.put_object(Bucket=s3_bucket, Key=f"ckpt/run1/{name}", Body=b"x" * i)
    for other in ("ckpt/run1/nested/deeper.bin", "ckpt/run1/", "ckpt/run10/not-mine", "ckpt/run1.txt"):
        raw.put_object(Bucket=s3_bucket, Key=other, Body=b"y")
    listed = _client(s3_bucket, s3_endpoint).list(page_size=10)
    assert [name for name, _ in listed] == names
    assert dict(listed) == {name: 24 - i for i, name in enumerate(names)}
    assert ("run1.txt", 1) in _client(s3_bucket, s3_endpoint, prefix="ckpt").list()
    assert _client(s3_bucket, s3_endpoint, prefix="empty").list() == []


def test_ranged_reads_give_the_bytes_asked_for(s3_bucket: str, s3_endpoint: str) -> None:
    data = _data(3 * MIB + 17)
    s3 = _client(s3_bucket, s3_endpoint)
    s3.put("blob.bin", data)
    assert s3.read("blob.bin", 0, 10) == data[:10]
    assert s3.read("blob.bin", MIB + 5, 100) == data[MIB + 5 : MIB + 105]
    assert s3.read("blob.bin", 0, 0) == b""
    whole = np.zeros(len(data) - 1, dtype=np.uint8)
    s3.read_into("blob.bin", 1, memoryview(whole))
    assert whole.tobytes() == data[1:]
    floats = np.zeros(16, dtype=np.float32)  # a typed view (not bytes) is filled byte for byte
    s3.read_into("blob.bin", 64, memoryview(floats))
    assert floats.tobytes() == data[64:128]
    with ThreadPoolExecutor(8) as pool:  # one client, many threads
        pieces = list(pool.map(lambda i: s3.read("blob.bin", i * 1000, 777), range(32)))
    assert pieces == [data[i * 1000 : i * 1000 + 777] for i in range(32)]


def test_short_missing_and_out_of_range_reads_are_write_errors(s3_bucket: str, s3_endpoint: str) -> None:
    s3 = _client(s3_bucket, s3_endpoint)
    s3.put("small.bin", b"0123456789")
    with pytest.raises(WriteError, match=r"s3://.*/ckpt/run1/small.bin: read of bytes 5-24 got 5 bytes, not 20"):
        s3.read("small.bin", 5, 20)
    with pytest.raises(WriteError, match=r"s3://.*/ckpt/run1/small.bin: read of bytes 50-59 failed \(InvalidRange"):
        s3.read("small.bin", 50, 10)
    with pytest.raises(WriteError, match=r"s3://.*/ckpt/run1/gone.bin: read of bytes 0-9 failed \(NoSuchKey"):
        s3.read("gone.bin", 0, 10)


def test_put_if_absent_refuses_an_existing_object_and_delete_tolerates_a_missing_one(s3_bucket: str, s3_endpoint: str) -> None:
    s3 = _client(s3_bucket, s3_endpoint)
    s3.put(".mpicons.lock", b"first", if_absent=True)
    with pytest.raises(ObjectExists, match=r"s3://.*/ckpt/run1/.mpicons.lock: upload refused: the object already exists"):
        s3.put(".mpicons.lock", b"second", if_absent=True)
    assert issubclass(ObjectExists, WriteError)
    assert s3.read(".mpicons.lock", 0, 5) == b"first"
    s3.put(".mpicons.lock", b"third")  # unconditional: replaced
    assert s3.read(".mpicons.lock", 0, 5) == b"third"
    s3.delete(".mpicons.lock")
    s3.delete(".mpicons.lock")
    assert s3.list() == []


# --- multipart uploads --------------------------------------------------------------------------


def test_a_multipart_upload_from_views_publishes_the_parts_in_order(s3_bucket: str, s3_endpoint: str) -> None:
    data = _data(2 * PART + 1234, seed=1)
    buffer = np.frombuffer(bytearray(data), dtype=np.uint8)
    s3 = _client(s3_bucket, s3_endpoint)
    upload = s3.create_upload("model.safetensors")
    assert s3.open_uploads() == [("model.safetensors", upload)]
    assert s3.list() == []  # nothing under the final key until completed
    etags = [
        s3.upload_part("model.safetensors", upload, 2, memoryview(buffer[PART : 2 * PART])),
        s3.upload_part("model.safetensors", upload, 3, data[2 * PART :]),
        s3.upload_part("model.safetensors", upload, 1, memoryview(buffer[:PART])),
    ]
    s3.complete_upload("model.safetensors", upload, [etags[2], etags[0], etags[1]], if_absent=True)
    assert s3.open_uploads() == []
    assert s3.list() == [("model.safetensors", len(data))]
    assert s3.read("model.safetensors", 0, len(data)) == data


def test_aborted_and_refused_uploads_leave_nothing_open(s3_bucket: str, s3_endpoint: str) -> None:
    s3 = _client(s3_bucket, s3_endpoint)
    deeper = _client(s3_bucket, s3_endpoint, prefix="ckpt/run1/sub")
    other = deeper.create_upload("x.bin")  # under a deeper prefix: not this location's
    upload = s3.create_upload("a.bin")
    s3.upload_part("a.bin", upload, 1, b"abc")
    s3.abort_upload("a.bin", upload)
    s3.abort_upload("a.bin", upload)  # already gone: fine
    assert s3.open_uploads() == [] and s3.list() == []
    assert deeper.open_uploads() == [("x.bin", other)]
    deeper.abort_upload("x.bin", other)
    s3.put("b.bin", b"already here")
    upload = s3.create_upload("b.bin")
    etag = s3.upload_part("b.bin", upload, 1, b"new bytes")
    with pytest.raises(ObjectExists, match=r"s3://.*/ckpt/run1/b.bin: completion of the multipart upload \(1 parts\) refused"):
        s3.complete_upload("b.bin", upload, [etag], if_absent=True)
    s3.abort_upload("b.bin", upload)
    assert s3.open_uploads() == [] and s3.read("b.bin", 0, 12) == b"already here"


def test_parts_smaller_than_the_minimum_fail_at_completion_naming_the_object(s3_bucket: str, s3_endpoint: str) -> None:
    s3 = _client(s3_bucket, s3_endpoint)
    upload = s3.create_upload("c.bin")
    etags = [s3.upload_part("c.bin", upload, number, b"tiny") for number in (1, 2)]
    with pytest.raises(
        WriteError, match=r"s3://.*/c.bin: completion of the multipart upload \(2 parts\) failed \(EntityTooSmall"
    ):
        s3.complete_upload("c.bin", upload, etags)
    s3.abort_upload("c.bin", upload)


# --- the access check ---------------------------------------------------------------------------


def test_check_access_passes_on_a_bucket_that_is_there(s3_bucket: str, s3_endpoint: str) -> None:
    _client(s3_bucket, s3_endpoint).check_access(write=True)
    _client(s3_bucket, s3_endpoint, prefix="").check_access(write=False)


def test_a_missing_bucket_is_bad_input(s3_endpoint: str, s3_env: dict[str, str]) -> None:
    with pytest.raises(
        InputError, match=r"s3://mpicons-no-such-bucket/ckpt/run1: bucket mpicons-no-such-bucket does not exist .*: create it"
    ):
        _client("mpicons-no-such-bucket", s3_endpoint).check_access(write=False)


@pytest.fixture(scope="module")
def s3_auth_endpoint() -> Iterator[str]:
    """A second server that checks credentials: every access key is unknown there."""
    with s3server.moto_server(auth=True) as url:
        yield url


def test_wrong_credentials_are_bad_input_and_the_secret_is_never_shown(
    s3_auth_endpoint: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "wJalrXUtnFEMI-not-a-real-secret-K7MDENG"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDMPICONSTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    with pytest.raises(InputError) as caught:
        _client("some-bucket", s3_auth_endpoint).check_access(write=True)
    message = str(caught.value)
    assert "s3://some-bucket/ckpt/run1: the S3 endpoint" in message and "refused the credentials" in message
    assert "AKIDMPICONSTEST" in message and "AWS_ACCESS_KEY_ID" in message and "writing to" in message
    assert secret not in message and secret not in repr(caught.value.__cause__ or "")


def test_no_credentials_at_all_is_bad_input(s3_endpoint: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(InputError, match=r"s3://some-bucket/ckpt/run1: no AWS credentials found: set AWS_ACCESS_KEY_ID"):
        _client("some-bucket", s3_endpoint).check_access(write=False)


def test_an_unreachable_endpoint_is_bad_input_promptly(s3_env: dict[str, str]) -> None:
    started = time.monotonic()
    with pytest.raises(
        InputError,
        match=r"s3://some-bucket/ckpt/run1: cannot reach the S3 endpoint http://127.0.0.1:1 \(Connection refused; "
        r"2 attempts in [0-9.]+ s\): check --s3-endpoint",
    ):
        _client("some-bucket", "http://127.0.0.1:1", connect_timeout=1, attempts=2).check_access(write=False)
    assert time.monotonic() - started < 10


def _closed_port() -> int:
    """A loopback port nothing listens on."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_with_the_default_retries_an_unreachable_endpoint_is_bad_input_within_seconds(s3_env: dict[str, str]) -> None:
    """The access check gives up after a short probe, not after botocore's ten retries (about 20 s)."""
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    client = _client("some-bucket", endpoint)
    assert client.attempts == 11  # the work keeps botocore's retries
    started = time.monotonic()
    with pytest.raises(InputError, match=re.escape(f"cannot reach the S3 endpoint {endpoint} (Connection refused; 2 attempts")):
        client.check_access(write=True)
    assert time.monotonic() - started < 5


def test_retries_say_once_how_long_they_may_take(s3_env: dict[str, str], caplog: pytest.LogCaptureFixture) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    client = _client("some-bucket", endpoint, attempts=3)
    caplog.set_level("INFO", logger="mpicons")
    for _ in range(2):
        with pytest.raises(WriteError, match=re.escape(f"failed after 3 attempts: cannot reach the S3 endpoint {endpoint}")):
            client.list()
    notes = [r.getMessage() for r in caplog.records if r.name == "mpicons"]
    assert notes == [
        f"s3://some-bucket/ckpt/run1: cannot connect to the S3 endpoint {endpoint} (Connection refused); "
        "retrying up to 2 more times, for at most about 0.2 s, before giving up"
    ]


def test_the_longest_retries_follow_botocore_s_backoff() -> None:
    from mpicons.io.s3_retries import retry_seconds

    assert retry_seconds(11, throttling=False) == pytest.approx(0.05 * (2**9 - 1) + 20)  # 45.55 s
    assert retry_seconds(3, throttling=True) == pytest.approx(1 + 2)
    assert retry_seconds(2, throttling=False, per_attempt=10) == pytest.approx(0.05 + 20)
    assert retry_seconds(1, throttling=True) == 0


def test_a_malformed_endpoint_is_bad_input(s3_env: dict[str, str]) -> None:
    with pytest.raises(InputError, match=r"s3://some-bucket/ckpt/run1: bad S3 endpoint 'not a url'"):
        _client("some-bucket", "not a url")


# --- faults through the proxy -------------------------------------------------------------------


@pytest.fixture
def faults(tmp_path: Path, s3_endpoint: str) -> Iterator[tuple[s3server.FaultProxy, Path, Path]]:
    """The fault-injecting proxy in front of the test server: (proxy, its control file, its request log)."""
    control, log = tmp_path / "faults.json", tmp_path / "requests.log"
    with s3server.FaultProxy(s3_endpoint, control) as proxy:
        yield proxy, control, log


def _rules(control: Path, log: Path, *rules: dict[str, object]) -> None:
    control.write_text(json.dumps({"rules": list(rules), "log": str(log)}))


def _logged(log: Path, op: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith(op + " ")]


def test_throttling_answers_are_retried_to_success(
    s3_bucket: str, faults: tuple[s3server.FaultProxy, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    proxy, control, log = faults
    caplog.set_level("INFO", logger="mpicons")
    data = _data(PART + 10, seed=2)
    s3 = _client(s3_bucket, proxy.url)
    upload = s3.create_upload("t.bin")
    _rules(control, log, {"op": "UploadPart", "times": 2, "status": 503, "code": "SlowDown"})
    etags = [s3.upload_part("t.bin", upload, 1, data[:PART]), s3.upload_part("t.bin", upload, 2, data[PART:])]
    s3.complete_upload("t.bin", upload, etags)
    assert [line.split()[-1] for line in _logged(log, "UploadPart")] == ["503", "503", "200", "200"]
    assert [r.getMessage() for r in caplog.records if r.name == "mpicons"] == [
        f"s3://{s3_bucket}/ckpt/run1: the S3 endpoint {proxy.url} answered SlowDown (HTTP 503); "
        "retrying up to 10 more times, for at most about 2 min, before giving up"
    ]
    assert s3.read("t.bin", 0, len(data)) == data


def test_a_failure_that_outlasts_the_retries_is_a_write_error_naming_the_part(
    s3_bucket: str, faults: tuple[s3server.FaultProxy, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy, control, log = faults
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    s3 = _client(s3_bucket, proxy.url)
    upload = s3.create_upload("model-00001-of-00002.safetensors")
    _rules(control, log, {"op": "UploadPart", "part": 2, "status": 500, "code": "InternalError", "message": "disk on fire"})
    s3.upload_part("model-00001-of-00002.safetensors", upload, 1, b"p" * 100)
    with pytest.raises(
        WriteError,
        match=r"s3://.*/model-00001-of-00002.safetensors: upload of part 2 failed \(InternalError: disk on fire, HTTP 500\)",
    ):
        s3.upload_part("model-00001-of-00002.safetensors", upload, 2, b"q" * 100)
    assert len(_logged(log, "UploadPart")) == 1 + 3  # part 1 once, part 2 three times (AWS_MAX_ATTEMPTS)
    s3.abort_upload("model-00001-of-00002.safetensors", upload)
    assert s3.open_uploads() == []


def test_the_proxy_works_as_a_subprocess_too(s3_bucket: str, s3_endpoint: str, tmp_path: Path) -> None:
    control, log = tmp_path / "faults.json", tmp_path / "requests.log"
    _rules(control, log, {"op": "PutObject", "times": 1, "status": 500, "code": "InternalError"})
    with s3server.fault_proxy_process(s3_endpoint, control) as url:
        s3 = _client(s3_bucket, url)
        s3.put("p.bin", b"payload")
        assert s3.read("p.bin", 0, 7) == b"payload"
    assert [line.split()[-1] for line in _logged(log, "PutObject")] == ["500", "200"]
    assert os.path.exists(control)


def test_a_conditional_write_retried_after_its_answer_was_lost_finds_its_own_object(tmp_path, s3_endpoint, s3_bucket):
    """botocore resends a write whose answer never came; with If-None-Match the resend gets 412 from the
    write's own object, which is success, while an object someone else made stays ObjectExists."""
    from mpicons.io.s3 import ObjectExists, S3Client, S3Location

    control = tmp_path / "faults.json"
    rules = [{"op": "PutObject", "times": 1, "lost": True}, {"op": "CompleteMultipartUpload", "times": 1, "lost": True}]
    control.write_text(json.dumps({"rules": rules}))
    with s3server.FaultProxy(s3_endpoint, control) as proxy:
        client = S3Client(S3Location.parse(f"s3://{s3_bucket}/p"), proxy.url)
        client.put("lock", b"mine", if_absent=True)
        upload = client.create_upload("big")
        etags = [client.upload_part("big", upload, 1, b"x" * (5 << 20)), client.upload_part("big", upload, 2, b"tail")]
        client.complete_upload("big", upload, etags, if_absent=True)
        with pytest.raises(ObjectExists):
            client.put("lock", b"another run's", if_absent=True)
    s3 = s3server.client(s3_endpoint)
    assert s3.get_object(Bucket=s3_bucket, Key="p/lock")["Body"].read() == b"mine"
    assert s3.head_object(Bucket=s3_bucket, Key="p/big")["ContentLength"] == (5 << 20) + 4
