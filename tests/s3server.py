"""A local S3-compatible server for the tests (moto's server mode on the loopback interface), and a
fault-injecting proxy to put in front of it.

As a program (what tests/run.sh and the fixtures start)::

    python tests/s3server.py serve [--auth]                     # prints the endpoint URL, serves until SIGTERM
    python tests/s3server.py proxy --target URL [--control F]   # prints the proxy's URL, forwards until SIGTERM

``--auth``: credentials are checked (every access key is then unknown: any request → 403). A server
stops by itself when the process that started it is gone, so no test run leaves one behind.

The proxy forwards every request and answers the ones its rules choose with an S3 error instead. The
rules are a JSON control file, read again whenever it changes (its counters then start afresh), so a
test can change the faults of a running proxy, and a CLI subprocess test uses it by endpoint URL only::

    {"rules": [{"op": "UploadPart", "times": 2, "status": 503, "code": "SlowDown"},
               {"op": "UploadPart", "part": 3, "status": 500, "code": "InternalError"},
               {"op": "PutObject", "key": "index.json", "delay": 2.0}],
     "log": "/tmp/requests.log"}

A rule matches on ``op`` (the S3 operation, or "*"), optionally ``part`` (UploadPart's number) and
``key`` (a substring of the object key); ``times`` limits it to the first N matching requests (no
``times``: every one). ``delay`` sleeps before answering; ``lost`` forwards the request and drops
the connection instead of answering (the write happened, its answer was lost); ``cut`` (bytes)
forwards the answer's headers and only that much of its body, then drops the connection (a transfer
reset mid-way); ``status`` (with ``code``, ``message``) answers with that error instead of
forwarding. ``log`` appends one line per request:
``OP KEY PART STATUS`` (what a test counts retries by). The first matching rule that still applies wins.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: Headers that belong to one connection, not to the request or response forwarded.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
_START_TIMEOUT = 60.0
_DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


# --- the moto server ----------------------------------------------------------------------------


def _watch_parent(stop: threading.Event) -> None:
    """Set ``stop`` when the process that started this one is gone (this one was reparented)."""
    parent = os.getppid()
    while not stop.wait(1.0):
        if os.getppid() != parent:
            stop.set()


def _serve_until_stopped(url: str) -> None:
    """Print the URL (the starter reads that line), then wait for SIGTERM/SIGINT or an orphaned start."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    print(url, flush=True)
    threading.Thread(target=_watch_parent, args=(stop,), daemon=True).start()
    stop.wait()


def serve(auth: bool = False) -> None:
    """moto's S3 in this process on a free loopback port (the OS picks it: no race with another run)."""
    if auth:
        os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"  # read when moto loads
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        _serve_until_stopped(f"http://{host}:{port}")
    finally:
        server.stop()


class Server:
    """A server subprocess (``serve`` or ``proxy`` mode of this file): started, its URL read, stopped."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self._errors = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty server never blocks
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *args],
            stdout=subprocess.PIPE,
            stderr=self._errors,
            env={**os.environ, **(env or {})},
            text=True,
        )
        self.url = self._read_url()

    def _read_url(self) -> str:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], _START_TIMEOUT)
        line = self.process.stdout.readline().strip() if ready else ""
        if not line.startswith("http://"):
            self.stop(keep_errors=True)
            self._errors.seek(0)
            errors = self._errors.read()
            self._errors.close()
            raise RuntimeError(f"the S3 test server did not start: {errors[-2000:]}")
        return line

    def stop(self, keep_errors: bool = False) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        if not keep_errors:
            self._errors.close()


@contextmanager
def moto_server(auth: bool = False) -> Iterator[str]:
    """A moto S3 server subprocess for the ``with`` block; its endpoint URL."""
    server = Server(["serve", "--auth"] if auth else ["serve"])
    try:
        yield server.url
    finally:
        server.stop()


def client(endpoint: str, **credentials: str) -> Any:
    """A plain boto3 S3 client for test set-up (dummy credentials unless given)."""
    import boto3
    from botocore.config import Config

    keys = {**_DUMMY_CREDENTIALS, **credentials}
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=keys["AWS_DEFAULT_REGION"],
        aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
        config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 2}),
    )


def empty_bucket(s3: Any, bucket: str) -> None:
    """Delete every object and abort every multipart upload of ``bucket``, then the bucket (best effort)."""
    try:
        for page in s3.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
            for upload in page.get("Uploads") or ():
                s3.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": item["Key"]} for item in page.get("Contents") or ()]
            if keys:
                s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        s3.delete_bucket(Bucket=bucket)
    except Exception:  # the server may be gone, or a test left it unreachable: nothing to clean
        pass


# --- the fault-injecting proxy ------------------------------------------------------------------


def operation(method: str, path: str, query: dict[str, list[str]], headers: Any) -> tuple[str, str, int | None]:
    """(S3 operation, object key, part number) of a path-style request."""
    bucket, _, key = urllib.parse.unquote(path.lstrip("/")).partition("/")
    part = int(query["partNumber"][0]) if "partNumber" in query else None
    if not key:
        names = {"GET": "ListObjectsV2" if "list-type" in query else "ListObjects", "HEAD": "HeadBucket", "PUT": "CreateBucket"}
        if "uploads" in query:
            return "ListMultipartUploads", "", None
        return names.get(method, f"{method}Bucket"), "", None
    if method == "PUT":
        if "uploadId" in query:
            return ("UploadPartCopy" if "x-amz-copy-source" in headers else "UploadPart"), key, part
        return ("CopyObject" if "x-amz-copy-source" in headers else "PutObject"), key, None
    if method == "POST":
        if "uploads" in query:
            return "CreateMultipartUpload", key, None
        if "uploadId" in query:
            return "CompleteMultipartUpload", key, None
        return "PostObject", key, None
    if method == "DELETE":
        return ("AbortMultipartUpload" if "uploadId" in query else "DeleteObject"), key, None
    if method == "GET":
        return ("ListParts" if "uploadId" in query else "GetObject"), key, part
    if method == "HEAD":
        return "HeadObject", key, part
    return method, key, part


class Faults:
    """The control file's rules and their counters (shared by the proxy's threads)."""

    def __init__(self, control: str | None) -> None:
        self.control = control
        self._lock = threading.Lock()
        self._text: str | None = None
        self._rules: list[dict[str, Any]] = []
        self._counts: list[int] = []
        self._log: str | None = None

    def _reload(self) -> None:
        text = ""
        if self.control:
            try:
                text = Path(self.control).read_text()
            except FileNotFoundError:
                text = ""
        if text != self._text:
            config = json.loads(text) if text.strip() else {}
            self._text, self._rules = text, list(config.get("rules", []))
            self._counts = [0] * len(self._rules)
            self._log = config.get("log")

    def choose(self, op: str, key: str, part: int | None) -> dict[str, Any] | None:
        """The rule that applies to this request (counted), or None: forward it untouched."""
        with self._lock:
            self._reload()
            for index, rule in enumerate(self._rules):
                if rule.get("op", "*") not in ("*", op):
                    continue
                if "part" in rule and rule["part"] != part:
                    continue
                if "key" in rule and rule["key"] not in key:
                    continue
                if "times" in rule and self._counts[index] >= int(rule["times"]):
                    continue
                self._counts[index] += 1
                return rule
            return None

    def record(self, op: str, key: str, part: int | None, status: int) -> None:
        with self._lock:
            if self._log:
                with open(self._log, "a", encoding="utf-8") as log:
                    log.write(f"{op} {key or '-'} {part if part is not None else '-'} {status}\n")


def _error_body(code: str, message: str, key: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message><Key>{key}</Key>"
        "<RequestId>injected</RequestId></Error>"
    ).encode()


def _handler(target: str, faults: Faults) -> type[http.server.BaseHTTPRequestHandler]:
    parsed = urllib.parse.urlsplit(target)
    upstream_host, upstream_port = parsed.hostname or "127.0.0.1", parsed.port or 80

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, and 100-continue answered before the body is read

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _body(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline().strip():
                            pass
                        break
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                return b"".join(chunks)
            return self.rfile.read(length) if length else b""

        def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD" and body:
                self.wfile.write(body)

        def _forward(self) -> None:
            split = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(split.query, keep_blank_values=True)
            op, key, part = operation(self.command, split.path, query, self.headers)
            body = self._body()
            rule = faults.choose(op, key, part)
            if rule and rule.get("delay"):
                time.sleep(float(rule["delay"]))
            if rule and rule.get("status"):
                status = int(rule["status"])
                code = str(rule.get("code", "InternalError"))
                payload = _error_body(code, str(rule.get("message", f"injected {code}")), key)
                headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(payload)))]
                faults.record(op, key, part, status)
                self._answer(status, headers, payload)
                return
            upstream = http.client.HTTPConnection(upstream_host, upstream_port, timeout=300)
            try:
                sent = {name: value for name, value in self.headers.items() if name.lower() not in _HOP_BY_HOP}
                sent["Content-Length"] = str(len(body))
                upstream.request(self.command, self.path, body=body, headers=sent)
                response = upstream.getresponse()
                payload = response.read()
                headers = [(n, v) for n, v in response.getheaders() if n.lower() not in _HOP_BY_HOP | {"content-length"}]
                length = response.getheader("Content-Length") if self.command == "HEAD" else str(len(payload))
                headers.append(("Content-Length", length or "0"))
                faults.record(op, key, part, response.status)
                if rule and rule.get("lost"):  # done upstream, but the answer never reaches the client
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if rule and "cut" in rule and self.command != "HEAD":  # the body stops after N bytes, the connection drops
                    self.close_connection = True
                    self._answer(response.status, headers, payload[: int(rule["cut"])])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self._answer(response.status, headers, payload)
            finally:
                upstream.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    return Handler


class FaultProxy:
    """The proxy in a thread of this process: ``url`` to give the client, ``close()`` when done."""

    def __init__(self, target: str, control: str | os.PathLike[str] | None = None) -> None:
        self.faults = Faults(str(control) if control is not None else os.environ.get("MPICONS_TEST_S3_FAULTS"))
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(target, self.faults))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def fault_proxy_process(target: str, control: str | os.PathLike[str]) -> Iterator[str]:
    """The proxy as a subprocess (for tests whose ranks run elsewhere); its URL."""
    server = Server(["proxy", "--target", target, "--control", str(control)])
    try:
        yield server.url
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    serve_mode = modes.add_parser("serve", help="a moto S3 server on a free loopback port")
    serve_mode.add_argument("--auth", action="store_true", help="check credentials (every key is unknown → 403)")
    proxy_mode = modes.add_parser("proxy", help="a fault-injecting proxy in front of TARGET")
    proxy_mode.add_argument("--target", required=True)
    proxy_mode.add_argument("--control", default=None, help="the JSON rules file (default: $MPICONS_TEST_S3_FAULTS)")
    args = parser.parse_args(argv)
    if args.mode == "serve":
        serve(auth=args.auth)
        return
    proxy = FaultProxy(args.target, args.control)
    try:
        _serve_until_stopped(proxy.url)
    finally:
        proxy.close()


if __name__ == "__main__":
    main()
