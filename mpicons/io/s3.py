"""``s3://bucket/prefix`` locations: one boto3 client per location, every failure an mpicons error.

The shard scan reads through :meth:`S3Client.read_into` (ranged GETs) and the output writer uploads
through the multipart calls; both meet S3 only here. boto3 is an optional extra (``mpicons[s3]``)
and is imported only when an ``s3://`` location is used (inside :class:`S3Client`), so a filesystem
run never pays for it. Retries and backoff are botocore's (adaptive mode: throttling answers slow the
client down; the first retry says how long they may last, :mod:`.s3_retries`); a failure that
outlasts them becomes a :class:`WriteError` naming the ``s3://`` URL,
the operation and the S3 error code, and a setup failure found by :meth:`S3Client.check_access`
(credentials, bucket, endpoint) an :class:`InputError` saying what to fix. No message ever holds a
secret: S3 error texts never echo the secret key, and the access key id is the most that is named.
"""

from __future__ import annotations

import builtins
import copy
import hashlib
import importlib
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from ..core.errors import InputError, MpiconsError, WriteError
from ..core.reports import count_of
from ..formats.byte_sources import MemoryBytes
from .s3_retries import (
    DEFAULT_ATTEMPTS,
    PROBE_ATTEMPTS,
    PROBE_CONNECT_TIMEOUT,
    PROBE_READ_TIMEOUT,
    THROTTLING_CODES,
    RetryNote,
    connect_reason,
    total_attempts,
)  # fmt: skip

S3_SCHEME = "s3://"
#: Bucket names as S3 allows them for new buckets: 3-63 of a-z 0-9 . -, a letter or digit at each end.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IP_LIKE = re.compile(r"^\d+\.\d+\.\d+\.\d+$")
#: Bytes per ``readinto`` call of a ranged GET's body: large enough that Python's per-call cost vanishes.
_READ_CHUNK = 8 << 20
#: Attempts at a ranged GET whose body is cut off mid-way (each resumes where the last stopped), and the first wait.
_BODY_ATTEMPTS = 4
_BODY_BACKOFF = 0.5
#: Longest S3 error text quoted in a message (an error body can be long; a message is one line).
_MESSAGE_LIMIT = 300
#: The S3 error codes of a request refused for its credentials.
_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken", "403"}
_MISSING_BUCKET_CODES = {"NoSuchBucket", "404"}
#: Codes of a conditional create that found the object (409: a concurrent conditional write won).
_EXISTS_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict"}
_ENDPOINT_HINT = "check --s3-endpoint / AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) and that the store is up and reachable"
_CREDENTIALS_HINT = (
    "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or AWS_PROFILE and its entry in ~/.aws/credentials"
)


def is_s3(location: str | os.PathLike[str]) -> bool:
    """Whether a command-line or API location names object storage instead of a path."""
    return str(location).startswith(S3_SCHEME)


@dataclass(frozen=True)
class S3Location:
    """A bucket and a key prefix (the "directory" of a checkpoint in object storage)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> S3Location:
        """``s3://bucket[/prefix]``, checked: a bad URL is bad input, found before any request."""
        if not is_s3(url):
            raise InputError(f"{url}: not an s3:// URL (expected s3://bucket/prefix)")
        rest = url[len(S3_SCHEME) :]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise InputError(f"{url}: no bucket name (expected s3://bucket/prefix)")
        if "{rank}" in url:
            raise InputError(f"{url}: '{{rank}}' is for node-local paths; an s3:// location is shared by every rank")
        if not _BUCKET.match(bucket) or ".." in bucket or _IP_LIKE.match(bucket):
            raise InputError(
                f"{url}: {bucket!r} is not a valid bucket name (3-63 lowercase letters, digits, '.' and '-', "
                "a letter or digit at each end)"
            )
        prefix = prefix.strip("/")
        parts = prefix.split("/") if prefix else []
        if any(part in ("", ".", "..") for part in parts):
            raise InputError(f"{url}: the key prefix has an empty, '.' or '..' part; give a plain prefix such as s3://bucket/a/b")
        if any(ord(char) < 32 or ord(char) == 127 for char in prefix):
            raise InputError(f"{url}: the key prefix holds a control character")
        return cls(bucket, prefix)

    def key(self, name: str) -> str:
        """The object key of ``name`` under the prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def url(self, name: str = "") -> str:
        """``s3://bucket/prefix[/name]``: how messages name an object (or the location itself)."""
        key = self.key(name) if name else self.prefix
        return f"{S3_SCHEME}{self.bucket}/{key}" if key else f"{S3_SCHEME}{self.bucket}"

    def list_prefix(self) -> str:
        """The prefix a listing asks for: the objects directly under the location."""
        return f"{self.prefix}/" if self.prefix else ""


def multipart_etag(etags: Sequence[str]) -> str:
    """The ETag S3 gives an object completed from parts with these ETags (MD5 of their MD5s, ``-N``)."""
    digests = b"".join(bytes.fromhex(etag.strip('"')) for etag in etags)
    return f"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{len(etags)}"


class ObjectExists(WriteError):
    """A conditional create (``If-None-Match: *``) found the object already there."""


def _error_parts(exc: BaseException) -> tuple[str, str, int | None]:
    """(S3 error code, its message, HTTP status) of a botocore ClientError; ("", str, None) for anything else."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error") or {}
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        code = str(error.get("Code") or status or "")
        text = str(error.get("Message") or "")
        return code, text, status if isinstance(status, int) else None
    return "", str(exc), None


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MESSAGE_LIMIT else text[: _MESSAGE_LIMIT - 3] + "..."


class S3Client:
    """One boto3 client for one location; every call maps failures to mpicons errors naming the s3:// URL.

    Made once per location and shared by the threads of a rank: a boto3 client is thread-safe (a
    session is not, so the session is used only here). ``connect_timeout``, ``read_timeout`` and
    ``attempts`` (total attempts per request) exist for tests and tuning; by default botocore's
    adaptive retries make up to 10 retries, or as many attempts as AWS_MAX_ATTEMPTS says when set.
    """

    def __init__(
        self,
        location: S3Location,
        endpoint: str | None = None,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
        attempts: int | None = None,
        max_pool_connections: int = 16,
    ) -> None:
        self.location = location
        try:
            # By name: boto3 ships no type information, and mpicons needs only a few of its calls.
            boto3_session = importlib.import_module("boto3.session")
            botocore_config = importlib.import_module("botocore.config")
            self._errors = importlib.import_module("botocore.exceptions")
        except ImportError as exc:
            raise InputError(f"{location.url()}: s3:// locations need boto3: pip install 'mpicons[s3]'") from exc
        session = boto3_session.Session()
        self._session = session
        retries: dict[str, Any] = {"mode": "adaptive"}
        if attempts is not None:
            retries["total_max_attempts"] = max(1, attempts)
        elif not os.environ.get("AWS_MAX_ATTEMPTS"):
            retries["max_attempts"] = DEFAULT_ATTEMPTS - 1
        self.attempts = total_attempts(attempts)
        self.connect_timeout = connect_timeout
        # A store other than AWS (MinIO, Ceph RGW, a gateway) is addressed by path: virtual-hosted
        # names need wildcard DNS such stores rarely have. Checksums only where the API requires
        # them (the AWS_* variables still choose): many such stores reject the newer checksum headers.
        custom = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        settings: dict[str, Any] = {
            "region_name": session.region_name or "us-east-1",
            "retries": retries,
            "connect_timeout": connect_timeout,
            "read_timeout": read_timeout,
            "max_pool_connections": max_pool_connections,
            "s3": {"addressing_style": "path"} if custom else None,
        }
        for option in ("request_checksum_calculation", "response_checksum_validation"):
            if option in botocore_config.Config.OPTION_DEFAULTS:  # botocore >= 1.36
                settings[option] = os.environ.get(f"AWS_{option.upper()}", "when_required")
        self._make = lambda **changes: self._new_client(botocore_config.Config(**{**settings, **changes}), endpoint)
        self._client = self._make()
        self.retry_note = RetryNote(location.url(), self.endpoint, self.attempts, connect_timeout, self._errors)
        self._client.meta.events.register_first("needs-retry.s3", self.retry_note)

    def moved(self, location: S3Location) -> S3Client:
        """This client's connections for another location (names and messages relative to it)."""
        other = copy.copy(self)
        other.location = location
        return other

    def _new_client(self, config: Any, endpoint: str | None) -> Any:
        try:
            return self._session.client("s3", endpoint_url=endpoint or None, config=config)
        except ValueError as exc:  # a malformed endpoint URL
            raise InputError(
                f"{self.location.url()}: bad S3 endpoint {endpoint!r} ({_short(str(exc))}); {_ENDPOINT_HINT}"
            ) from exc
        except self._errors.BotoCoreError as exc:
            raise InputError(f"{self.location.url()}: cannot set up the S3 client ({_short(str(exc))})") from exc

    @property
    def endpoint(self) -> str:
        """The endpoint URL requests go to (for messages)."""
        return str(self._client.meta.endpoint_url)

    # --- errors -------------------------------------------------------------------------------

    def _access_key_id(self) -> str:
        """The access key id in use, for messages (never the secret); "" when there is none."""
        try:
            credentials = self._session.get_credentials()
        except self._errors.BotoCoreError:
            return ""
        return str(getattr(credentials, "access_key", "") or "") if credentials is not None else ""

    def _is_connect_error(self, exc: BaseException) -> bool:
        return isinstance(exc, (self._errors.EndpointConnectionError, self._errors.ConnectTimeoutError))

    def failure(self, exc: BaseException, what: str, name: str = "", input_error: bool = False) -> NoReturn:
        """Raise the mpicons error for a botocore failure of ``what`` (e.g. "upload of part 3") on ``name``.

        A ClientError names the S3 error code and text; missing credentials are always bad input;
        anything else after botocore's retries is a WriteError (an InputError when ``input_error``)."""
        url = self.location.url(name)
        kind: type[WriteError] | type[InputError] = InputError if input_error else WriteError
        if isinstance(exc, self._errors.NoCredentialsError):
            raise InputError(f"{url}: {what} failed: no AWS credentials found; {_CREDENTIALS_HINT}, or run with a role") from exc
        if isinstance(exc, self._errors.ClientError):
            code, text, status = _error_parts(exc)
            detail = f"{code}: {_short(text)}" if text and text != code else code
            if status is not None and str(status) != code:
                detail += f", HTTP {status}"
            raise kind(f"{url}: {what} failed ({detail})") from exc
        if self._is_connect_error(exc):
            raise kind(
                f"{url}: {what} failed after {count_of(self.attempts, 'attempt')}: cannot reach the S3 endpoint "
                f"{self.endpoint} ({connect_reason(exc)}); {_ENDPOINT_HINT}"
            ) from exc
        if isinstance(exc, self._errors.BotoCoreError):
            raise kind(f"{url}: {what} failed ({type(exc).__name__}: {_short(str(exc))})") from exc
        raise exc

    def _call(self, what: str, name: str, method: Callable[..., Any], **kwargs: Any) -> Any:
        """One client call; botocore failures become mpicons errors naming ``name``'s URL."""
        try:
            return method(**kwargs)
        except (self._errors.BotoCoreError, self._errors.ClientError) as exc:
            self.failure(exc, what, name)

    # --- the API --------------------------------------------------------------------------------

    def check_access(self, write: bool) -> None:
        """Before any work: can this client reach the bucket with these credentials? (Nothing is
        written, even when ``write``: the output lock's conditional create is the write check.)
        Every way of failing here is bad input, with what to do about it."""
        url = self.location.url()
        bucket = self.location.bucket
        try:
            self._head_bucket()
            return
        except self._errors.NoCredentialsError as exc:
            raise InputError(
                f"{url}: no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE "
                "(a profile in ~/.aws/credentials or ~/.aws/config), or run where an instance or web-identity role is available"
            ) from exc
        except self._errors.ClientError as exc:
            code, text, status = _error_parts(exc)
            if code in _CREDENTIAL_CODES or status == 403:
                key_id = self._access_key_id()
                named = f" (access key id {key_id})" if key_id else ""
                access = "writing to" if write else "reading from"
                raise InputError(
                    f"{url}: the S3 endpoint {self.endpoint} refused the credentials{named} for bucket {bucket} "
                    f"({code}, HTTP {status}): they are wrong or lack permission for {access} it; {_CREDENTIALS_HINT}"
                ) from exc
            if code in _MISSING_BUCKET_CODES or status == 404:
                raise InputError(
                    f"{url}: bucket {bucket} does not exist at {self.endpoint}: create it (e.g. aws s3 mb s3://{bucket}) "
                    "or fix the bucket name in the URL"
                ) from exc
            if status in (301, 307) or code in {"PermanentRedirect", "301", "AuthorizationHeaderMalformed"}:
                headers = (exc.response.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}
                region = headers.get("x-amz-bucket-region", "")
                where = f" (it is in {region})" if region else ""
                raise InputError(
                    f"{url}: bucket {bucket} is in another region{where}: set AWS_REGION / AWS_DEFAULT_REGION to it"
                ) from exc
            self.failure(exc, "checking access to the bucket", input_error=True)
        except (self._errors.EndpointConnectionError, self._errors.ConnectTimeoutError) as exc:
            raise InputError(f"{url}: cannot reach the S3 endpoint {self.endpoint}: {_ENDPOINT_HINT}") from exc
        except self._errors.BotoCoreError as exc:
            self.failure(exc, "checking access to the bucket", input_error=True)

    def _head_bucket(self) -> None:
        """The access check's request, first on a client that gives up within seconds when nothing answers
        (one line, exit 2, instead of botocore's retries); an answer worth waiting out (throttling, a server
        error) is asked again with the full retries. Other answers are raised for :meth:`check_access`."""
        probe = self._make(
            connect_timeout=PROBE_CONNECT_TIMEOUT,
            read_timeout=PROBE_READ_TIMEOUT,
            retries={"mode": "standard", "total_max_attempts": min(PROBE_ATTEMPTS, self.attempts)},
        )
        tries = min(PROBE_ATTEMPTS, self.attempts)
        started = time.monotonic()
        try:
            probe.head_bucket(Bucket=self.location.bucket)
            return
        except (self._errors.EndpointConnectionError, self._errors.ConnectTimeoutError) as exc:
            took = f"{count_of(tries, 'attempt')} in {time.monotonic() - started:.1f} s"
            raise InputError(
                f"{self.location.url()}: cannot reach the S3 endpoint {self.endpoint} ({connect_reason(exc)}; {took}): "
                f"{_ENDPOINT_HINT}"
            ) from exc
        except self._errors.ReadTimeoutError as exc:
            raise InputError(
                f"{self.location.url()}: the S3 endpoint {self.endpoint} took the connection but did not answer within "
                f"{PROBE_READ_TIMEOUT:.0f} s ({count_of(tries, 'attempt')}): {_ENDPOINT_HINT}"
            ) from exc
        except self._errors.ClientError as exc:
            code, _, status = _error_parts(exc)
            if not (code in THROTTLING_CODES or (status is not None and status >= 500)):
                raise
        self._client.head_bucket(Bucket=self.location.bucket)

    def list(self, page_size: int | None = None) -> builtins.list[tuple[str, int]]:
        """Objects directly under the prefix (names relative to it, no "/" in them), sorted, with sizes."""
        prefix = self.location.list_prefix()
        found: builtins.list[tuple[str, int]] = []
        paging = {"PageSize": page_size} if page_size else {}
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.location.bucket, Prefix=prefix, Delimiter="/", PaginationConfig=paging
            )
            for page in pages:
                for item in page.get("Contents") or ():
                    name = str(item["Key"])[len(prefix) :]
                    if name and "/" not in name:
                        found.append((name, int(item["Size"])))
        except (self._errors.BotoCoreError, self._errors.ClientError) as exc:
            self.failure(exc, "listing the objects")
        return sorted(found)

    def list_folder(self, folder: str) -> tuple[builtins.list[tuple[str, int]], builtins.list[str]]:
        """What is directly in ``folder`` (a path below the prefix, "" for the prefix itself): its
        objects' names and sizes, and the names of the sub-prefixes that hold objects, both sorted."""
        prefix = self.location.list_prefix() + (f"{folder}/" if folder else "")
        files: builtins.list[tuple[str, int]] = []
        folders: builtins.list[str] = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.location.bucket, Prefix=prefix, Delimiter="/"
            )
            for page in pages:
                files.extend((str(item["Key"])[len(prefix) :], int(item["Size"])) for item in page.get("Contents") or ())
                folders.extend(str(item["Prefix"])[len(prefix) :].rstrip("/") for item in page.get("CommonPrefixes") or ())
        except (self._errors.BotoCoreError, self._errors.ClientError) as exc:
            self.failure(exc, "listing the objects", folder, input_error=True)
        return sorted(f for f in files if f[0]), sorted(f for f in folders if f)

    def list_below(self, limit: int = 1000) -> builtins.list[str]:
        """Keys one level below the prefix (``sub/name``, relative to it), from one listing of at most
        ``limit`` keys: a hint of where a checkpoint is, not an inventory."""
        prefix = self.location.list_prefix()
        bucket = self.location.bucket
        page = self._call("listing the objects", "", self._client.list_objects_v2, Bucket=bucket, Prefix=prefix, MaxKeys=limit)
        keys = (str(item["Key"])[len(prefix) :] for item in page.get("Contents") or ())
        return [key for key in keys if key.count("/") == 1 and not key.endswith("/")]

    def read(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of object ``name`` from ``offset`` (one ranged GET)."""
        buffer = bytearray(length)
        self.read_into(name, offset, memoryview(buffer))
        return bytes(buffer)

    def read_into(self, name: str, offset: int, target: memoryview) -> None:
        """Fill ``target`` with object ``name``'s bytes from ``offset``: one ranged GET, its body read
        straight into ``target`` in large chunks. Fewer bytes than asked (or a server that ignored the
        range) is a WriteError: the object is shorter than its header said, or changed."""
        view = target.cast("B") if target.format != "B" or target.ndim != 1 else target
        length = len(view)
        if length == 0:
            return
        what = f"read of bytes {offset}-{offset + length - 1}"
        done = 0
        for attempt in range(_BODY_ATTEMPTS):
            try:
                done += self._read_body(name, offset + done, view[done:], what)
                break
            except MpiconsError:
                raise  # the request itself failed after botocore's retries, or the store ignored the range
            except Exception as exc:  # noqa: BLE001 - botocore and urllib3 raise several kinds mid-body
                # botocore retries a request until its response headers arrive; a body cut off later
                # (a reset, a read timeout) is resumed here from the byte it reached.
                done += getattr(exc, "mpicons_done", 0)
                if attempt == _BODY_ATTEMPTS - 1:
                    if isinstance(exc, self._errors.BotoCoreError):
                        self.failure(exc, what, name)
                    raise WriteError(
                        f"{self.location.url(name)}: {what} failed ({type(exc).__name__}: {_short(str(exc))})"
                    ) from exc
                time.sleep(_BODY_BACKOFF * 2**attempt)
        if done != length:
            raise WriteError(
                f"{self.location.url(name)}: {what} got {done} bytes, not {length}: "
                "the object is shorter than its header says, or changed while mpicons read it"
            )

    def _read_body(self, name: str, offset: int, view: memoryview, what: str) -> int:
        """One ranged GET of ``len(view)`` bytes from ``offset`` into ``view``; the bytes it got. A failure
        while the body streams carries the bytes got so far as ``mpicons_done``."""
        length = len(view)
        response = self._call(
            what,
            name,
            self._client.get_object,
            Bucket=self.location.bucket,
            Key=self.location.key(name),
            Range=f"bytes={offset}-{offset + length - 1}",
        )
        body = response["Body"]
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        done = 0
        try:
            if status != 206 and offset != 0:
                raise WriteError(f"{self.location.url(name)}: {what} failed: the store ignored the range (HTTP {status})")
            while done < length:
                count = body.readinto(view[done : min(length, done + _READ_CHUNK)])
                if not count:
                    break
                done += count
        except BaseException as exc:
            exc.mpicons_done = done  # type: ignore[attr-defined]
            raise
        finally:
            body.close()
        return done

    def _is_mine(self, name: str, etag: str) -> bool:
        """Whether object ``name`` is the one this client wrote (its ETag is ``etag``): a write that
        botocore retried after its response was lost finds its own object, not another's."""
        try:
            head = self._client.head_object(Bucket=self.location.bucket, Key=self.location.key(name))
        except (self._errors.BotoCoreError, self._errors.ClientError):
            return False
        return str(head.get("ETag", "")).strip('"') == etag

    def put(self, name: str, data: bytes, if_absent: bool = False) -> None:
        """Write a small object whole; ``if_absent``: only if nothing is there (412 → ObjectExists, unless
        what is there is this very write, retried after a lost response)."""
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        try:
            self._client.put_object(Bucket=self.location.bucket, Key=self.location.key(name), Body=data, **extra)
        except self._errors.ClientError as exc:
            if if_absent and self._is_mine(name, hashlib.md5(data, usedforsecurity=False).hexdigest()):
                return
            self._raise_exists(exc, name, "upload")
            self.failure(exc, "upload", name)
        except self._errors.BotoCoreError as exc:
            self.failure(exc, "upload", name)

    def _raise_exists(self, exc: BaseException, name: str, what: str) -> None:
        code, _, status = _error_parts(exc)
        if code in _EXISTS_CODES or status == 412:
            raise ObjectExists(f"{self.location.url(name)}: {what} refused: the object already exists ({code})") from exc

    def delete(self, name: str) -> None:
        """Remove object ``name``; one that is not there is fine."""
        try:
            self._client.delete_object(Bucket=self.location.bucket, Key=self.location.key(name))
        except self._errors.ClientError as exc:
            if _error_parts(exc)[0] in {"NoSuchKey", "404"}:
                return
            self.failure(exc, "delete", name)
        except self._errors.BotoCoreError as exc:
            self.failure(exc, "delete", name)

    def create_upload(self, name: str) -> str:
        """Start a multipart upload of ``name``; its UploadId (any rank may upload parts to it)."""
        response = self._call(
            "start of the multipart upload",
            name,
            self._client.create_multipart_upload,
            Bucket=self.location.bucket,
            Key=self.location.key(name),
        )
        return str(response["UploadId"])

    def upload_part(self, name: str, upload_id: str, number: int, data: memoryview | bytes) -> str:
        """Upload part ``number`` (1-based) of an open multipart upload, without copying ``data``; its ETag."""
        body: Any = data if isinstance(data, (bytes, bytearray)) else MemoryBytes(data)
        response = self._call(
            f"upload of part {number}",
            name,
            self._client.upload_part,
            Bucket=self.location.bucket,
            Key=self.location.key(name),
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
        )
        return str(response["ETag"])

    def complete_upload(self, name: str, upload_id: str, etags: builtins.list[str], if_absent: bool = False) -> None:
        """Publish the object from parts 1..len(etags); ``if_absent``: only if nothing is there (→ ObjectExists)."""
        parts = [{"ETag": etag, "PartNumber": number} for number, etag in enumerate(etags, start=1)]
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        what = f"completion of the multipart upload ({len(etags)} parts)"
        try:
            self._client.complete_multipart_upload(
                Bucket=self.location.bucket,
                Key=self.location.key(name),
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                **extra,
            )
        except self._errors.ClientError as exc:
            code = _error_parts(exc)[0]
            if (if_absent or code == "NoSuchUpload") and self._is_mine(name, multipart_etag(etags)):
                return  # completed by an earlier attempt whose response was lost
            self._raise_exists(exc, name, what)
            self.failure(exc, what, name)
        except self._errors.BotoCoreError as exc:
            self.failure(exc, what, name)

    def abort_upload(self, name: str, upload_id: str) -> None:
        """Abort a multipart upload (its parts are dropped); one already gone is fine."""
        try:
            self._client.abort_multipart_upload(Bucket=self.location.bucket, Key=self.location.key(name), UploadId=upload_id)
        except self._errors.ClientError as exc:
            if _error_parts(exc)[0] in {"NoSuchUpload", "404"}:
                return
            self.failure(exc, "abort of the multipart upload", name)
        except self._errors.BotoCoreError as exc:
            self.failure(exc, "abort of the multipart upload", name)

    def open_uploads(self) -> builtins.list[tuple[str, str]]:
        """(name, UploadId) of the unfinished multipart uploads directly under the prefix, sorted
        (a deeper key belongs to another location, maybe another run's)."""
        prefix = self.location.list_prefix()
        found: builtins.list[tuple[str, str]] = []
        try:
            pages = self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.location.bucket, Prefix=prefix, Delimiter="/"
            )
            for page in pages:
                for upload in page.get("Uploads") or ():
                    name = str(upload["Key"])[len(prefix) :]
                    if name and "/" not in name and str(upload["Key"]).startswith(prefix):
                        found.append((name, str(upload["UploadId"])))
        except (self._errors.BotoCoreError, self._errors.ClientError) as exc:
            self.failure(exc, "listing the open multipart uploads")
        return sorted(found)
