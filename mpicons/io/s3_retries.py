"""How long botocore's retries may last, and the one note that says so when they begin.

botocore retries a failed S3 request silently (adaptive mode: up to ten retries, with backoff), so a
store that is down or throttling looked like a hung job for up to minutes. The access check before
any work therefore probes with a short timeout and one retry (:data:`PROBE_ATTEMPTS`), and every
client says once, on its first retried request, how long it will keep trying (:class:`RetryNote`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any

#: The access check's first request: a short connect timeout and one retry, so an endpoint that is
#: down or mistyped is one line within seconds, not botocore's retries.
PROBE_CONNECT_TIMEOUT = 2.0
PROBE_READ_TIMEOUT = 10.0
PROBE_ATTEMPTS = 2
#: botocore's backoff (standard and adaptive modes): before attempt i + 2 it waits up to
#: min(scale * 2**i, 20) s, scale 1 s after a throttling answer and 0.05 s after anything else.
_MAX_BACKOFF = 20.0
_THROTTLING_SCALE = 1.0
_OTHER_SCALE = 0.05
#: botocore's ``max_attempts=10`` counts retries: 11 attempts in all.
DEFAULT_ATTEMPTS = 11
THROTTLING_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests", "503", "429"}

log = logging.getLogger("mpicons")


def retry_seconds(attempts: int, throttling: bool, per_attempt: float = 0.0) -> float:
    """The longest botocore can spend on ``attempts`` attempts of one request: its backoff waits between
    them, plus ``per_attempt`` seconds each attempt may take to fail (a connect timeout)."""
    scale = _THROTTLING_SCALE if throttling else _OTHER_SCALE
    waits = sum(min(scale * 2**i, _MAX_BACKOFF) for i in range(max(0, attempts - 1)))
    return waits + per_attempt * attempts


def duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def total_attempts(attempts: int | None) -> int:
    """How many attempts botocore makes per request: ``attempts``, else AWS_MAX_ATTEMPTS, else its default."""
    if attempts is not None:
        return max(1, attempts)
    given = os.environ.get("AWS_MAX_ATTEMPTS", "").strip()
    return max(1, int(given)) if given.isdigit() else DEFAULT_ATTEMPTS


def connect_reason(exc: BaseException) -> str:
    """Why a connection failed, in the system's words where botocore kept them ("Connection refused")."""
    if type(exc).__name__ == "ConnectTimeoutError":
        return "no answer to the connection"
    found = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", str(getattr(exc, "kwargs", {}).get("error", "")))
    return found.group(1).strip() if found else "no connection"


class RetryNote:
    """A handler of botocore's ``needs-retry`` event: the first time a request of the client failed, it
    logs how long the retries may take. It returns None always, so botocore's own handler decides."""

    def __init__(self, url: str, endpoint: str, attempts: int, connect_timeout: float, errors: Any) -> None:
        self.url, self.endpoint, self.attempts = url, endpoint, attempts
        self.connect_timeout = connect_timeout
        self.errors = errors  # botocore.exceptions
        self.told = False
        self._telling = threading.Lock()  # the upload threads share the client: one note

    def __call__(self, attempts: int = 0, response: Any = None, caught_exception: Any = None, **_: Any) -> None:
        if attempts != 1 or attempts >= self.attempts or self.told:
            return
        answer = response[1] if response else {}
        status = (answer.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if caught_exception is None and not (isinstance(status, int) and (status >= 500 or status == 429)):
            return
        with self._telling:
            if self.told:
                return
            self.told = True
        if caught_exception is None:
            code = str((answer.get("Error") or {}).get("Code") or status)
            what = f"the S3 endpoint {self.endpoint} answered {code} (HTTP {status})"
            bound = retry_seconds(self.attempts, code in THROTTLING_CODES)
        else:
            connect = (self.errors.EndpointConnectionError, self.errors.ConnectTimeoutError)
            if isinstance(caught_exception, connect):
                what = f"cannot connect to the S3 endpoint {self.endpoint} ({connect_reason(caught_exception)})"
            else:
                what = f"a request to the S3 endpoint {self.endpoint} failed ({type(caught_exception).__name__})"
            timed_out = isinstance(caught_exception, self.errors.ConnectTimeoutError)
            bound = retry_seconds(self.attempts, False, self.connect_timeout if timed_out else 0.0)
        log.info(
            "%s: %s; retrying up to %d more times, for at most about %s, before giving up",
            self.url, what, self.attempts - 1, duration(bound),
        )  # fmt: skip


__all__ = [
    "PROBE_CONNECT_TIMEOUT", "PROBE_READ_TIMEOUT", "PROBE_ATTEMPTS", "DEFAULT_ATTEMPTS", "THROTTLING_CODES",
    "retry_seconds", "duration", "total_attempts", "connect_reason", "RetryNote",
]  # fmt: skip
