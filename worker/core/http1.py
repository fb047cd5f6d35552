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
import functools
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import aiohappyeyeballs
import httptools
from yarl import URL

from worker.core.budgets import ByteBudget, SharedBudget
from worker.endpoint.destinations import GuardedResolver
from worker.runtime.errors import DestinationRefused

HEAD_LIMIT = 64 * 1024  # the status line and headers of one answer
KEEPALIVE_SECONDS = 15.0  # an idle connection older than this is closed rather than reused
IDLE_PER_ENDPOINT = 256  # idle connections kept per endpoint (more are closed)
DNS_TTL_SECONDS = 30.0
WRITE_CHUNK = 256 * 1024  # large bodies go out in pieces, with flow control
PREVIEW_BYTES = 256  # of a failed answer's body, kept for the attempt log (the console shows it)
# scheme, host, port, for credentials over plain http, the TLS context (one with a client certificate)
Endpoint = tuple[str, str, int, bool, ssl.SSLContext | None]
HAPPY_EYEBALLS_DELAY = 0.25  # seconds before the next of a host's addresses is tried too (RFC 8305's default)


def _address_info(address: str, port: int) -> aiohappyeyeballs.AddrInfoType:
    if ":" in address:
        return socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port, 0, 0)
    return socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port)


class ProtocolError(Exception):
    """The endpoint broke HTTP/1.1 (or closed the connection mid-answer)."""


class HeaderRefused(ValueError):
    """A request header that cannot be sent safely (CR, LF or NUL in it)."""


@dataclass(slots=True)  # one per attempt: see messages.Envelope
class Answer:
    status: int
    headers: dict[str, str]  # lower-cased names, the last value of each
    body: bytes = b""  # only when asked for (`keep_body`), and only up to the cap
    preview: bytes = b""  # a failure's (status 300 and above) first PREVIEW_BYTES, for the attempt log


class _Connection(asyncio.Protocol):
    """One connection. Answer bytes go straight to an llhttp parser (`httptools`, the parser behind
    uvicorn), whose callbacks fill in the current exchange; the reader waits on a waiter woken by
    parser progress, close, or writability. The protocol owns flow control and the deadline, the
    parser owns HTTP (framing, chunk sizes, conflicting lengths, obs-fold: all refused by llhttp)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()  # kept: a lookup is a getpid() system call on Python 3.11
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.expired = False
        self.stray = False  # bytes arrived that belong to no answer: the connection is not reused
        self.cut_short = False  # the request's body was not sent whole: the connection is not reused
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._writable = True
        # One parser and one exchange record per connection, reset per request: making a parser per
        # request cost about 5% of a delivery's CPU (measured). `_parsing` is False between exchanges
        # and after a broken answer; bytes arriving then are stray.
        self._exchange = _Exchange()
        self._parser = self._exchange.parser = httptools.HttpResponseParser(self._exchange)
        self._parsing = False
        self.on_lost: Callable[[], None] | None = None  # gives the connection's budget slot back, once
        self.account: ByteBudget | None = None  # the project's share of connections it counts against

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        x = self._exchange
        if not self._parsing:
            self.stray = True
            return
        if not x.head_done:
            x.head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            x.error = ProtocolError("101 Switching Protocols was not asked for")
        except httptools.HttpParserError as e:
            x.error = ProtocolError(f"malformed answer: {e}")
        if not x.head_done and x.head_bytes > HEAD_LIMIT and x.error is None:
            x.error = ProtocolError(f"answer head over {HEAD_LIMIT} bytes")
        if x.error is not None or x.over_cap:
            self._parsing = False  # nothing more is parsed: the connection goes with this exchange
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.on_lost is not None:
            on_lost, self.on_lost = self.on_lost, None
            on_lost()
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
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    @property
    def heard(self) -> bool:
        """Whether any byte of an answer to the current request arrived."""
        return self._exchange.head_bytes > 0

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

    async def send(self, head: bytes, body: bytes, cap: int, keep_body: bool = False) -> None:
        """Start an exchange (its answer is parsed from now on, its body counted up to `cap`, and
        kept with `keep_body`) and send the request."""
        assert self.transport is not None
        self._exchange.reset(cap, keep_body)
        self._parsing = True
        if len(body) <= WRITE_CHUNK:
            self.transport.write(head + body)
            return
        self.transport.write(head)
        view = memoryview(body)
        x = self._exchange
        for start in range(0, len(body), WRITE_CHUNK):
            while not self._writable and not self.closed and not x.final_head:
                await self._wait()
            if x.final_head:
                # The endpoint answered before taking the whole body (a 413 over its size limit, a 401):
                # that answer is the attempt's, as RFC 9112 (9.5) asks. Sending on, the client met the
                # close that follows such answers and reported a connection error instead of the status.
                self.cut_short = True
                return
            if self.closed:
                raise ProtocolError("connection closed while sending the request")
            self.transport.write(view[start:start + WRITE_CHUNK])

    # -- reading ---------------------------------------------------------------------------

    def answer_preview(self) -> bytes:
        """The first PREVIEW_BYTES of the last answer's body, when it was not a success."""
        return self._exchange.preview

    def answer_body(self) -> bytes:
        """The body of the last answer, as far as it was kept (`send(keep_body=True)`)."""
        return bytes(self._exchange.body)

    async def read_answer(self) -> tuple[int, dict[str, str], bool, bool]:
        """Wait for the answer: its status, headers, whether its body ended (else it was abandoned
        at the cap or with the connection) and whether the endpoint allows keeping the connection.
        A 102 returns at its head (the final answer is not awaited)."""
        x = self._exchange
        while True:
            if x.error is not None:
                raise x.error
            if x.done or x.over_cap or (x.head_done and x.status == 102):
                break
            if self.closed:
                if x.head_done and not x.framed:  # a body read until close: it ends with the connection
                    break
                raise ProtocolError("connection closed before the answer was complete")
            await self._wait()
        self._parsing = False  # anything after this answer is stray
        return x.status, x.headers, x.done, x.done and x.keep_alive and not x.extra


_NOTHING_KEPT = bytearray()  # never appended to: `on_body` adds only when the body is kept


class _Exchange:
    """What the parser found of one answer (httptools calls these methods as bytes arrive)."""

    def __init__(self) -> None:
        self.parser: httptools.HttpResponseParser | None = None
        self.reset(0)

    def reset(self, cap: int, keep_body: bool = False) -> None:
        """Ready for the next answer on the connection, its body counted up to `cap` (and kept)."""
        self.cap = cap
        self.keep_body = keep_body
        # Kept bodies only (a token endpoint's answer): a push request's answer allocates nothing here.
        self.body = bytearray() if keep_body else _NOTHING_KEPT
        self.preview = b""
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.head_bytes = 0
        self.framed = False  # Content-Length or chunked: the body ends by itself, not with the connection
        self.body_bytes = 0
        self.trailer_bytes = 0
        self.over_cap = False
        self.done = False
        self.keep_alive = False
        self.extra = False  # another answer followed this one (nothing asked for it)
        self.error: ProtocolError | None = None

    def on_message_begin(self) -> None:
        if self.done:
            self.extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:  # a trailer of a chunked body
            self.trailer_bytes += len(name) + len(value)
            if self.trailer_bytes > HEAD_LIMIT:
                self.error = ProtocolError(f"trailers over {HEAD_LIMIT} bytes")
            return
        key = name.decode("latin-1").lower()
        if key == "transfer-encoding" and key in self.headers:  # llhttp joins them; framing must be one
            self.error = ProtocolError("repeated Transfer-Encoding header")
        self.headers[key] = value.decode("latin-1").strip()

    def on_headers_complete(self) -> None:
        parser = self.parser
        assert parser is not None
        status = parser.get_status_code()
        if 100 <= status < 200 and status != 102:
            self.headers = {}  # an interim answer (100 Continue, 103): the final one follows
            return
        self.status = status
        self.head_done = True
        self.framed = "content-length" in self.headers or "transfer-encoding" in self.headers
        self.keep_alive = parser.get_http_version() == "1.1" and parser.should_keep_alive()

    @property
    def final_head(self) -> bool:
        """Whether a final answer's head arrived, or the answer failed: sending more is pointless. A
        102 is not final here: the endpoint still reads the body it is processing."""
        return (self.head_done and self.status != 102) or self.error is not None

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.body_bytes > self.cap:
            self.over_cap = True
        elif self.keep_body:
            self.body += body
        if self.status >= 300 and len(self.preview) < PREVIEW_BYTES:  # why a request failed, for the log
            self.preview += body[:PREVIEW_BYTES - len(self.preview)]

    def on_message_complete(self) -> None:
        if self.head_done:
            self.done = not self.over_cap


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
                 ssl_context: ssl.SSLContext | None = None, max_connections: int | None = None) -> None:
        self.resolver = resolver
        self.user_agent = user_agent
        self.ssl_context = ssl_context or ssl.create_default_context()
        # Open connections, shared fairly by project (None: not counted): one project's hung endpoint
        # held 2,015 sockets at the open-files limit, and another project's deliveries failed.
        self.connections = SharedBudget(max_connections) if max_connections is not None else None
        self._accounts: dict[str, ByteBudget] = {}
        self._idle: dict[Endpoint, list[_Connection]] = {}
        self._dns: dict[tuple[str, int], tuple[float, list[str]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweep_timer: asyncio.TimerHandle | None = None

    async def post(self, url: URL, headers: dict[str, str], body: bytes, cap: int,
                   deadline: float | None = None, credentials: bool = False, owner: str = "",
                   tls: ssl.SSLContext | None = None, keep_body: bool = False) -> Answer:
        """One POST; the answer's head and (to `cap` bytes) body are read before it returns. A 102
        answer returns at once (the final answer is not awaited). With `deadline`, the whole exchange
        (connecting included) must end within that many seconds, else TimeoutError and the connection
        is dropped. A kept-alive connection the endpoint closed before any byte of an answer is
        replaced once by a new one. Raises ProtocolError, OSError (connect, TLS and resolver
        refusals) or HeaderRefused. `credentials`: the headers carry some, so a plain http:// connection
        may only go to an address the policy admits for them (`clear_text_refusal`). `owner` (the
        project) is whose share of `max_connections` a new connection takes; waiting for one counts
        against the deadline. `tls`: the context an https:// connection is opened with (default: the
        client's); connections opened with one are reused only for it. `keep_body`: the answer's body
        comes back too (up to `cap`; a body over it is a ProtocolError)."""
        head = _head(url, headers, len(body), self.user_agent)
        # Connections opened for credentials are kept apart: one opened without them may lead anywhere.
        endpoint = (url.scheme, url.raw_host or "", url.port or 0, credentials and url.scheme == "http", tls)
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()  # kept: a lookup is a getpid() on Python 3.11
        expires = None if deadline is None else loop.time() + deadline
        conn = self._idle_connection(endpoint)
        reused = conn is not None
        while True:
            if conn is None:
                async with asyncio.timeout_at(expires):
                    conn = await self._connect(url, endpoint[3], owner, tls)
            used = conn
            # The deadline is a timer that drops the connection, not a timeout scope around the exchange:
            # a scope cost about 8% of a delivery's CPU (measured), and the connection is lost at the deadline anyway.
            timer = None if expires is None else loop.call_at(expires, used.expire)
            try:
                await used.send(head, body, cap, keep_body)
                status, answer_headers, ended, keep_alive = await used.read_answer()
            except ProtocolError:
                used.close()
                if used.expired:
                    raise TimeoutError from None
                if not reused or used.heard:
                    raise
                # Closed with not a byte of an answer: the endpoint closed the idle connection as the
                # request went out (its keep-alive timeout; 20% of requests sent at that moment, measured).
                # Sent again on a new connection, within the same deadline: the endpoint never saw it,
                # or (an endpoint that died on it) at-least-once delivery allows the duplicate.
                conn, reused = None, False
            except BaseException:
                used.close()
                raise
            finally:
                if timer is not None:
                    timer.cancel()
            if conn is not None:  # answered (the break is out here: mypyc compiles none inside try/finally)
                break
        if used.expired:  # the answer did not end in time (a body read until close stops at the drop)
            raise TimeoutError
        preview = used.answer_preview()
        # After a 102 the final answer would still come on this connection: it is not reused.
        if ended and keep_alive and status != 102 and not used.stray and not used.closed and not used.cut_short:
            self._release(endpoint, used)
        else:
            used.close()
        if not keep_body:
            return Answer(status, answer_headers, preview=preview)
        if not ended:
            raise ProtocolError(f"answer body over {cap} bytes or cut short")
        return Answer(status, answer_headers, used.answer_body())

    def _idle_connection(self, endpoint: Endpoint) -> _Connection | None:
        idle = self._idle.get(endpoint)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < KEEPALIVE_SECONDS:
                return conn
            conn.close()
        return None

    def _release(self, endpoint: Endpoint, conn: _Connection) -> None:
        if conn.account is not None and self.connections is not None and self.connections.holds_back(conn.account):
            conn.close()  # its project waits for a connection elsewhere: the slot is worth more than reuse
            return
        idle = self._idle.setdefault(endpoint, [])
        if len(idle) >= IDLE_PER_ENDPOINT:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)
        if self._sweep_timer is None and self._loop is not None:
            self._sweep_timer = self._loop.call_later(KEEPALIVE_SECONDS, self._sweep)

    def _sweep(self) -> None:
        """Close connections idle past KEEPALIVE_SECONDS and forget endpoints and names no longer in
        use. Reuse only checks the connections of an endpoint posted to again: one that is not (its
        subscription moved or was deleted) would keep its sockets open for good."""
        self._sweep_timer = None
        now = time.monotonic()
        for endpoint, idle in list(self._idle.items()):
            fresh: list[_Connection] = []
            for conn in idle:  # oldest first, as they were released
                if not conn.closed and now - conn.idle_since < KEEPALIVE_SECONDS:
                    fresh.append(conn)
                else:
                    conn.close()
            if fresh:
                self._idle[endpoint] = fresh
            else:
                del self._idle[endpoint]
        for name in [name for name, (expires, _) in self._dns.items() if expires <= now]:
            del self._dns[name]
        if self._idle and self._loop is not None:
            self._sweep_timer = self._loop.call_later(KEEPALIVE_SECONDS, self._sweep)

    async def _addresses(self, host: str, port: int) -> list[str]:
        literal = self.resolver.literal(host)  # the address connected to is the one checked (refused: raises)
        if literal is not None:
            return [literal]
        known = self._dns.get((host, port))
        now = time.monotonic()
        if known is not None and known[0] > now:
            return known[1]
        results = await self.resolver.resolve(host, port, family=socket.AF_UNSPEC)  # refusals raise DestinationRefused
        addresses = list(dict.fromkeys(str(r["host"]) for r in results))
        self._dns[(host, port)] = (now + DNS_TTL_SECONDS, addresses)
        return addresses

    async def _connect(self, url: URL, credentials_in_clear: bool, owner: str,
                       tls: ssl.SSLContext | None = None) -> _Connection:
        account = self._account(owner)
        if account is None:
            return await self._open(url, credentials_in_clear, tls)
        if not account.try_take(1):
            self._close_idle_of(account)  # the project's own idle connections make room first
            await account.take(1)
        try:
            conn = await self._open(url, credentials_in_clear, tls)
        except BaseException:
            account.give_back(1)
            raise
        conn.account = account
        conn.on_lost = functools.partial(account.give_back, 1)
        return conn

    def _close_idle_of(self, account: ByteBudget) -> None:
        for idle in self._idle.values():
            for conn in [c for c in idle if c.account is account]:
                idle.remove(conn)
                conn.close()  # its slot comes back when the transport reports the close

    def _account(self, owner: str) -> ByteBudget | None:
        if self.connections is None:
            return None
        account = self._accounts.get(owner)
        if account is None:
            account = self._accounts[owner] = ByteBudget(self.connections.total, self.connections)
        return account

    async def _open(self, url: URL, credentials_in_clear: bool, context: ssl.SSLContext | None = None) -> _Connection:
        host, port = url.raw_host or "", url.port or (443 if url.scheme == "https" else 80)
        tls: dict[str, Any] = {}
        if url.scheme == "https":
            tls = {"ssl": context or self.ssl_context, "server_hostname": host.strip("[]")}
        addresses = await self._addresses(host, port)
        if credentials_in_clear:
            policy = self.resolver.policy
            refusals = [policy.clear_text_refusal(a) for a in addresses]
            if addresses and all(refusals):
                raise DestinationRefused(f"host {host!r} refused: {refusals[0]}")
            addresses = [a for a, why in zip(addresses, refusals, strict=True) if not why]
        if not addresses:
            raise OSError(f"no address for {host!r}")
        # Happy Eyeballs (RFC 8305), as aiohttp connects: each next address is tried 250 ms after
        # the one before, without waiting for it to fail. One after another, an address that drops
        # connection attempts (a dead backend among a host's addresses) held every request to the
        # host until its deadline, however many addresses answered.
        infos = [_address_info(a, port) for a in addresses]
        while True:
            sock = await aiohappyeyeballs.start_connection(infos, happy_eyeballs_delay=HAPPY_EYEBALLS_DELAY,
                                                          interleave=1)
            peer = None
            try:  # TLS (ssl.SSLError is an OSError too) on the connected socket
                peer = sock.getpeername()
                _, conn = await asyncio.get_running_loop().create_connection(_Connection, sock=sock, **tls)
                return conn
            except OSError:
                sock.close()
                if peer is None or len(infos) == 1:
                    raise
                # An address whose handshake fails (a broken TLS terminator among a host's backends) is
                # left for the next one, as aiohttp does; the caller's deadline bounds the whole search.
                aiohappyeyeballs.remove_addr_infos(infos, peer)
            except BaseException:
                sock.close()
                raise

    async def close(self) -> None:
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
            self._sweep_timer = None
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
