"""One HTTP delivery attempt, turned into an `Outcome` value (never an exception across layers)."""

from __future__ import annotations

import asyncio
import enum
import io
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit

import aiohttp
from yarl import URL

from worker.destinations import DestinationPolicy, GuardedResolver, check_host
from worker.errors import DestinationRefused
from worker.messages import PushRequest

STREAM_ABOVE = 256 * 1024  # request bodies larger than this are streamed
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


@dataclass(frozen=True)
class Outcome:
    """The result of one attempt."""

    result: Result
    status: int | None = None
    latency: float = 0.0
    retry_after: float | None = None
    detail: str = ""

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


class _Processing(Exception):
    """An endpoint answered `102 Processing`: accepted, the final answer is not awaited."""


class _InterimAwareResponse(aiohttp.ClientResponse):
    """aiohttp skips 1xx answers while waiting for the final one; the contract acks on 102."""

    async def start(self, connection: aiohttp.connector.Connection) -> aiohttp.ClientResponse:
        protocol = connection.protocol
        if protocol is None:
            return await super().start(connection)
        read = protocol.read

        async def read_final_or_processing() -> tuple[object, object]:
            message, payload = await read()
            if message.code == 102:
                raise _Processing
            return message, payload

        protocol.read = read_final_or_processing  # type: ignore[method-assign,assignment]
        try:
            return await super().start(connection)
        finally:
            del protocol.read  # back to the class's method; the connection is closed on _Processing


def make_session(policy: DestinationPolicy, limit: int = 0) -> aiohttp.ClientSession:
    """The shared HTTP client: guarded DNS, TLS verification on, no cookies kept between endpoints."""
    connector = aiohttp.TCPConnector(
        resolver=GuardedResolver(policy), limit=limit, ttl_dns_cache=30, ssl=True
    )
    return aiohttp.ClientSession(
        connector=connector, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
        headers={"User-Agent": "push-worker/0.1"}, skip_auto_headers=("Accept-Encoding",),
        response_class=_InterimAwareResponse,
    )


async def read_capped(response: aiohttp.ClientResponse, cap: int) -> bytes:
    """The body to its end or to `cap` bytes, whichever comes first (`content.read(n)` alone returns
    whatever has arrived so far, which can be much less than n)."""
    chunks: list[bytes] = []
    remaining = cap
    while remaining > 0:
        chunk = await response.content.read(remaining)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _payload(body: bytes) -> bytes | io.BytesIO:
    # aiohttp writes a large bytes body in one go (and warns that this can stall the loop); a file
    # object is streamed in chunks, with the same Content-Length.
    return io.BytesIO(body) if len(body) > STREAM_ABOVE else body


class Deliverer:
    """Sends push requests over one shared session and classifies what comes back."""

    def __init__(self, session: aiohttp.ClientSession, policy: DestinationPolicy) -> None:
        self.session = session
        self.policy = policy
        self._targets: dict[str, tuple[URL, str | None]] = {}

    def _target(self, url: str) -> tuple[URL, str | None]:
        """The parsed URL and why it is refused (None: allowed), worked out once per URL. aiohttp skips
        the resolver for IP literals, so those are checked here."""
        known = self._targets.get(url)
        if known is None:
            refused = None
            try:
                check_host(urlsplit(url).hostname or "", self.policy, resolve=False)
            except DestinationRefused as e:
                refused = str(e)
            if len(self._targets) >= TARGET_CACHE_SIZE:
                self._targets.clear()
            known = self._targets[url] = (URL(url), refused)
        return known

    async def attempt(self, url: str, request: PushRequest, deadline: float) -> Outcome:
        """POST once; the whole exchange (connect, send, status, capped body) is bounded by `deadline` s."""
        started = time.monotonic()
        if len(request.body) > self.policy.max_request_bytes:
            return Outcome(Result.TOO_LARGE, detail=f"request body of {len(request.body)} bytes is over "
                           f"destinations.max_request_bytes ({self.policy.max_request_bytes})")
        target, refused = self._target(url)
        if refused:
            return Outcome(Result.CONNECTION_ERROR, detail=refused)
        try:
            async with asyncio.timeout(deadline):
                async with self.session.post(
                    target, data=_payload(request.body), headers=request.headers, allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(total=None),
                ) as response:
                    status = response.status
                    retry_after = parse_retry_after(response.headers.get("Retry-After"))
                    # An answer counts once complete within the deadline; a huge or endless body costs
                    # at most the cap (then the connection is dropped). The body itself is not used.
                    await read_capped(response, RESPONSE_BODY_CAP)
        except _Processing:
            return Outcome(Result.ACK, status=102, latency=time.monotonic() - started)
        except TimeoutError:
            return Outcome(Result.TIMEOUT, latency=time.monotonic() - started, detail=f"no answer in {deadline:g}s")
        except aiohttp.ClientConnectorError as e:
            detail = str(e.os_error) if isinstance(e.os_error, DestinationRefused) else type(e).__name__
            return Outcome(Result.CONNECTION_ERROR, latency=time.monotonic() - started, detail=detail)
        except (aiohttp.ClientError, OSError, ValueError) as e:
            return Outcome(Result.CONNECTION_ERROR, latency=time.monotonic() - started, detail=type(e).__name__)
        except Exception as e:  # an outcome, never an exception: one odd endpoint must not wedge a message
            return Outcome(Result.CONNECTION_ERROR, latency=time.monotonic() - started,
                           detail=f"unexpected {type(e).__name__}")
        latency = time.monotonic() - started
        if is_ack_status(status):
            return Outcome(Result.ACK, status=status, latency=latency)
        return Outcome(Result.NACK, status=status, latency=latency,
                       retry_after=retry_after if status in (429, 503) else None)
