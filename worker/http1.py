"""A lean HTTP/1.1 client for push requests: one POST at a time per keep-alive connection, the
answer read to its end or to a cap, nothing else.

Why not aiohttp's client here: its general request path (URL and header merging, request and
response objects, payload registry, tracing, cookie handling) costs about 190-250 us of CPU per
request on the project's machine, more than everything else a delivery does together; this path
costs about 75 us (both measured with the same sink). It does only what delivery needs, and the
safety rules stay where they were: addresses are checked by the same `GuardedResolver` at connect
time, TLS verifies certificates and host names (the system's trust store, as aiohttp does),
redirects are never followed (a 3xx is an answer like any other), and an answer is read to at most
`cap` bytes of head and body each (an endless or oversized answer closes the connection).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any, cast

from yarl import URL

from worker.destinations import GuardedResolver

HEAD_LIMIT = 64 * 1024  # the status line and headers of one answer
LINE_LIMIT = 8 * 1024  # one chunk-size line of a chunked body
KEEPALIVE_SECONDS = 15.0  # an idle connection older than this is closed rather than reused
IDLE_PER_ENDPOINT = 256  # idle connections kept per endpoint (more are closed)
DNS_TTL_SECONDS = 30.0
WRITE_CHUNK = 256 * 1024  # large bodies go out in pieces, with flow control


class ProtocolError(Exception):
    """The endpoint broke HTTP/1.1 (or closed the connection mid-answer)."""


class HeaderRefused(ValueError):
    """A request header that cannot be sent safely (CR, LF or NUL in it)."""


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]  # lower-cased names, the last value of each


class _Connection(asyncio.Protocol):
    """One connection: bytes in a buffer, a waiter woken by data, close, or writability."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False
        self.expired = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._writable = True
        self._reading_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > 2 * HEAD_LIMIT and self.transport is not None and not self._reading_paused:
            self._reading_paused = True  # bounded memory: the reader resumes it when it wants more
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def pause_writing(self) -> None:
        self._writable = False

    def resume_writing(self) -> None:
        self._writable = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def expire(self) -> None:
        """The exchange's deadline passed: drop the connection and wake the reader."""
        self.expired = True
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    # -- writing ---------------------------------------------------------------------------

    async def send(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        if len(body) <= WRITE_CHUNK:
            self.transport.write(head + body)
            return
        self.transport.write(head)
        view = memoryview(body)
        for start in range(0, len(body), WRITE_CHUNK):
            while not self._writable and not self.closed:
                await self._wait()
            if self.closed:
                raise ProtocolError("connection closed while sending the request")
            self.transport.write(view[start:start + WRITE_CHUNK])

    # -- reading ---------------------------------------------------------------------------

    async def _more(self) -> None:
        """Wait for more bytes; ProtocolError if the connection closed instead."""
        if self.closed:
            raise ProtocolError("connection closed before the answer was complete")
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        await self._wait()

    async def _take_line(self, limit: int) -> bytes:
        while True:
            end = self.buffer.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[:end + 2]
                return line
            if len(self.buffer) > limit:
                raise ProtocolError("line too long in the answer")
            await self._more()

    async def _take(self, n: int) -> None:
        while len(self.buffer) < n:
            await self._more()
        del self.buffer[:n]

    async def read_head(self) -> tuple[bytes, int, dict[str, str]]:
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(self.buffer) > HEAD_LIMIT:
                raise ProtocolError(f"answer head over {HEAD_LIMIT} bytes")
            await self._more()
        lines = bytes(self.buffer[:end]).split(b"\r\n")
        del self.buffer[:end + 4]
        version, _, rest = lines[0].partition(b" ")
        code = rest[:3]
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit() or rest[3:4] not in (
                b"", b" "):
            raise ProtocolError("not an HTTP/1.x status line")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip() or b" " in name or b"\t" in name:
                raise ProtocolError("malformed header line in the answer")
            key = name.decode("latin-1").lower()
            text = value.strip().decode("latin-1")
            if key == "content-length" and headers.get(key, text) != text:
                raise ProtocolError("conflicting Content-Length headers")
            headers[key] = text
        return version, int(code), headers

    async def read_body(self, status: int, headers: dict[str, str], cap: int) -> bool:
        """Consume the body to its end or to `cap` bytes; True when it ended (the connection can be
        reused), False when the rest is abandoned with the connection."""
        if status in (204, 304):
            return True
        coding = headers.get("transfer-encoding")
        if coding is not None:
            if coding.lower().rsplit(",", 1)[-1].strip() != "chunked":
                return await self._read_until_close(cap)
            return await self._read_chunked(cap)
        length_text = headers.get("content-length")
        if length_text is None:
            return await self._read_until_close(cap)
        if not length_text.isdigit():
            raise ProtocolError("invalid Content-Length")
        length = int(length_text)
        await self._take(min(length, cap))
        return length <= cap

    async def _read_chunked(self, cap: int) -> bool:
        total = 0
        while True:
            size_text = (await self._take_line(LINE_LIMIT)).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise ProtocolError("invalid chunk size") from None
            if size < 0:
                raise ProtocolError("invalid chunk size")
            if size == 0:
                trailers = 0
                while line := await self._take_line(LINE_LIMIT):  # trailers, up to the empty line
                    trailers += len(line)
                    if trailers > HEAD_LIMIT:
                        raise ProtocolError(f"trailers over {HEAD_LIMIT} bytes")
                return True
            if total + size > cap:
                return False
            await self._take(size)
            if await self._take_line(LINE_LIMIT):
                raise ProtocolError("chunk not followed by CRLF")
            total += size

    async def _read_until_close(self, cap: int) -> bool:
        while len(self.buffer) < cap and not self.closed:
            await self._more()
        del self.buffer[:cap]
        return False


def _head(url: URL, headers: dict[str, str], length: int, user_agent: str) -> bytes:
    lines = [f"POST {url.raw_path_qs} HTTP/1.1", f"Host: {url.raw_authority}", f"User-Agent: {user_agent}",
             f"Content-Length: {length}"]
    for name, value in headers.items():
        if "\r" in name or "\n" in name or ":" in name or "\r" in value or "\n" in value or "\0" in value:
            raise HeaderRefused(f"header {name!r} cannot be sent safely")
        lines.append(f"{name}: {value}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode()


class Client:
    """Keep-alive connections per endpoint (scheme, host, port), opened through the guarded resolver."""

    def __init__(self, resolver: GuardedResolver, user_agent: str = "push-worker/0.1",
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.resolver = resolver
        self.user_agent = user_agent
        self.ssl_context = ssl_context or ssl.create_default_context()
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._dns: dict[tuple[str, int], tuple[float, list[str]]] = {}

    async def post(self, url: URL, headers: dict[str, str], body: bytes, cap: int,
                   deadline: float | None = None) -> Answer:
        """One POST; the answer's head and (to `cap` bytes) body are read before it returns. A 102
        answer returns at once (the final answer is not awaited). With `deadline`, the whole exchange
        (connecting included) must end within that many seconds, else TimeoutError and the connection
        is dropped. Raises ProtocolError, OSError (connect, TLS and resolver refusals) or HeaderRefused."""
        head = _head(url, headers, len(body), self.user_agent)
        endpoint = (url.scheme, url.raw_host or "", url.port or 0)
        loop = asyncio.get_running_loop()
        expires = None if deadline is None else loop.time() + deadline
        conn = self._idle_connection(endpoint)
        if conn is None:
            async with asyncio.timeout_at(expires):
                conn = await self._connect(url)
        # The deadline is a timer that drops the connection, not a timeout scope around the exchange:
        # a scope cost about 8% of a delivery's CPU (measured), and the connection is lost at the deadline anyway.
        timer = None if expires is None else loop.call_at(expires, conn.expire)
        try:
            await conn.send(head, body)
            while True:
                version, status, answer_headers = await conn.read_head()
                if status == 102 or not 100 <= status < 200:
                    break
                if status == 101:
                    raise ProtocolError("101 Switching Protocols was not asked for")
            complete = status != 102 and await conn.read_body(status, answer_headers, cap)
        except ProtocolError:
            conn.close()
            if conn.expired:
                raise TimeoutError from None
            raise
        except BaseException:
            conn.close()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if conn.expired:  # the answer did not end in time (a body read until close stops at the drop)
            raise TimeoutError
        # After a 102 the final answer would still come on this connection: it is not reused.
        if complete and version == b"HTTP/1.1" and answer_headers.get("connection", "").lower() != "close" \
                and not conn.buffer and not conn.closed:
            self._release(endpoint, conn)
        else:
            conn.close()
        return Answer(status, answer_headers)

    def _idle_connection(self, endpoint: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(endpoint)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < KEEPALIVE_SECONDS:
                return conn
            conn.close()
        return None

    def _release(self, endpoint: tuple[str, str, int], conn: _Connection) -> None:
        idle = self._idle.setdefault(endpoint, [])
        if len(idle) >= IDLE_PER_ENDPOINT:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def _addresses(self, host: str, port: int) -> list[str]:
        try:
            ipaddress.ip_address(host.strip("[]"))
            return [host.strip("[]")]  # literals are checked by the caller, as aiohttp skipped them too
        except ValueError:
            pass
        known = self._dns.get((host, port))
        now = time.monotonic()
        if known is not None and known[0] > now:
            return known[1]
        results = await self.resolver.resolve(host, port, family=socket.AF_UNSPEC)  # refusals raise DestinationRefused
        addresses = list(dict.fromkeys(str(r["host"]) for r in results))
        self._dns[(host, port)] = (now + DNS_TTL_SECONDS, addresses)
        return addresses

    async def _connect(self, url: URL) -> _Connection:
        host, port = url.raw_host or "", url.port or (443 if url.scheme == "https" else 80)
        tls: dict[str, Any] = {}
        if url.scheme == "https":
            tls = {"ssl": self.ssl_context, "server_hostname": host.strip("[]")}
        loop = asyncio.get_running_loop()
        error: OSError | None = None
        for address in await self._addresses(host, port):
            try:
                _, conn = await loop.create_connection(_Connection, address, port, **tls)
                return conn
            except OSError as e:  # ssl.SSLError is one too
                error = e
        raise error or OSError(f"no address for {host!r}")

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
