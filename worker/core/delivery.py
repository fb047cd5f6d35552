"""One HTTP delivery attempt, turned into an `Outcome` value (never an exception across layers)."""

from __future__ import annotations

import enum
import ssl
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

from yarl import URL

from worker.core import http1
from worker.core.messages import PushRequest
from worker.core.redact import answer_text, received_headers, sent_headers
from worker.endpoint.destinations import DestinationPolicy, GuardedResolver
from worker.runtime.errors import DestinationRefused

USER_AGENT = "push-worker/0.1"
RESPONSE_BODY_CAP = 64 * 1024  # read at most this much of an endpoint's answer, then drop the connection
TARGET_CACHE_SIZE = 10_000  # parsed endpoint URLs kept (one per subscription in practice)


class Result(enum.StrEnum):
    """How an attempt ended; `last_status` in dead-letter properties uses these or the HTTP status."""

    ACK = "ack"
    NACK = "nack"
    TIMEOUT = "timeout"
    CONNECTION_ERROR = "connection_error"
    TOO_LARGE = "payload_too_large"  # never sent: retrying cannot help, so it is dead-lettered at once
    NOT_SENT = "not_sent"  # never sent for a reason an operator can fix (a signing secret is missing)


@dataclass(slots=True)  # one per attempt: see messages.Envelope
class Outcome:
    """The result of one attempt."""

    result: Result
    status: int | None = None
    latency: float = 0.0
    retry_after: float | None = None
    detail: str = ""
    answer: str = ""  # a failure's first bytes of body, credentials cut out (the attempt log keeps it)
    # For the delivery log, credentials cut out (redact.py): the headers sent, and those answered.
    request_headers: dict[str, str] | None = None
    response_headers: dict[str, str] | None = None
    span: Any = None  # the attempt's trace span, when the worker traces (ended when it settles)

    @property
    def acked(self) -> bool:
        return self.result is Result.ACK

    @property
    def permanent(self) -> bool:
        """A failure no retry can fix."""
        return self.result is Result.TOO_LARGE

    @property
    def last_status(self) -> str:
        """HTTP status, or the result's name (`timeout`, `connection_error`, `payload_too_large`, ...)."""
        return str(self.status) if self.status is not None else self.result.value

    @property
    def label(self) -> str:
        """Low-cardinality metric label: ack, 4xx/5xx/..., timeout, connection_error."""
        if self.result is Result.NACK and self.status is not None:
            return f"{self.status // 100}xx"
        return self.result.value


def is_ack_status(status: int) -> bool:
    """102 (Processing) and any 2xx acknowledge the message."""
    return status == 102 or 200 <= status < 300


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or HTTP date); None when absent or invalid."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class Deliverer:
    """Sends push requests over keep-alive connections and classifies what comes back."""

    def __init__(self, policy: DestinationPolicy, client: http1.Client | None = None,
                 max_connections: int | None = None) -> None:
        self.policy = policy
        self.client = client or http1.Client(GuardedResolver(policy), USER_AGENT, max_connections=max_connections)
        self._targets: dict[str, URL] = {}

    def _target(self, url: str) -> URL:
        """The parsed URL, worked out once per URL. Its host is checked where it is connected to
        (`http1.Client`: literals and resolved names alike), so no other spelling of it is checked."""
        known = self._targets.get(url)
        if known is None:
            if len(self._targets) >= TARGET_CACHE_SIZE:
                self._targets.clear()
            known = self._targets[url] = URL(url)
        return known

    async def attempt(self, url: str, request: PushRequest, deadline: float, credentials: bool = False,
                      owner: str = "", tls: ssl.SSLContext | None = None) -> Outcome:
        """POST once; the whole exchange (connect, send, status, capped body) is bounded by `deadline` s.
        `credentials`: the request carries some (plain http:// then reaches only admitted private
        addresses); `owner`: the project whose share of the worker's connections a new one takes; `tls`:
        the context an https:// connection is opened with (a client certificate), else the client's."""
        started = time.monotonic()
        if len(request.body) > self.policy.max_request_bytes:
            return Outcome(Result.TOO_LARGE, detail=f"request body of {len(request.body)} bytes is over "
                           f"destinations.max_request_bytes ({self.policy.max_request_bytes})")
        sent = sent_headers(request.headers)
        try:
            target = self._target(url)  # a URL yarl cannot parse is a ValueError: a connection error below
            # An answer counts once complete within the deadline; a huge or endless body costs at
            # most the cap (then the connection is dropped). The body itself is not used.
            answer = await self.client.post(target, request.headers, request.body, RESPONSE_BODY_CAP, deadline,
                                             credentials, owner, tls)
        except TimeoutError:
            return Outcome(Result.TIMEOUT, latency=time.monotonic() - started, detail=f"no answer in {deadline:g}s",
                           request_headers=sent)
        except (DestinationRefused, http1.ProtocolError) as e:
            return Outcome(Result.CONNECTION_ERROR, latency=time.monotonic() - started, detail=str(e),
                           request_headers=sent)
        except (OSError, ValueError) as e:
            return Outcome(Result.CONNECTION_ERROR, latency=time.monotonic() - started, detail=type(e).__name__,
                           request_headers=sent)
        except Exception as e:  # an outcome, never an exception: one odd endpoint must not wedge a message
            return Outcome(Result.CONNECTION_ERROR, latency=time.monotonic() - started,
                           detail=f"unexpected {type(e).__name__}", request_headers=sent)
        latency = time.monotonic() - started
        answered = received_headers(answer.headers, request.headers)
        if is_ack_status(answer.status):
            return Outcome(Result.ACK, status=answer.status, latency=latency, request_headers=sent,
                           response_headers=answered)
        retry_after = parse_retry_after(answer.headers.get("retry-after")) if answer.status in (429, 503) else None
        return Outcome(Result.NACK, status=answer.status, latency=latency, retry_after=retry_after,
                       answer=answer_text(answer.preview, request.headers) if answer.preview else "",
                       request_headers=sent, response_headers=answered)

    async def close(self) -> None:
        await self.client.close()
