"""The delivery HTTP/1.1 client against real sockets: request wire format, keep-alive reuse, every
answer framing, protocol violations, large bodies, and TLS verification."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import shutil
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from yarl import URL

from tests.support.helpers import eventually, self_signed
from worker.core import http1
from worker.core.delivery import Deliverer, Result
from worker.core.messages import PushRequest
from worker.endpoint.destinations import DestinationPolicy, GuardedResolver

pytestmark = pytest.mark.broker_independent

ALLOW = DestinationPolicy(allow_private=True)


class Hangup(bytes):
    """A scripted answer after which the server closes the connection (`Hangup()`: no answer at all)."""


class Server:
    """A TCP server that reads each request (head and Content-Length body) and answers with the
    next scripted bytes; counts connections and keeps what it received."""

    def __init__(self, answers: list[bytes], hold_open: bool = False) -> None:
        self.answers = answers
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.hold_open = hold_open  # once out of answers, keep the connection until the client closes it
        self.closed_by_client = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(Exception):
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                answer = self.answers.pop(0)
                writer.write(answer)
                await writer.drain()
                if isinstance(answer, Hangup):
                    break
            if self.hold_open and await reader.read() == b"":
                self.closed_by_client += 1
        writer.close()


@contextlib.asynccontextmanager
async def serving(answers: list[bytes], tls: ssl.SSLContext | None = None,
                  hold_open: bool = False) -> AsyncIterator[tuple[Server, URL]]:
    server = Server(answers, hold_open)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=tls)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield server, URL(f"{'https' if tls else 'http'}://127.0.0.1:{port}/push?x=1")
    finally:
        listener.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(listener.wait_closed(), 2)


def client(context: ssl.SSLContext | None = None) -> http1.Client:
    return http1.Client(GuardedResolver(ALLOW), ssl_context=context)


async def test_requests_are_well_formed_and_reuse_one_connection():
    async with serving([b"HTTP/1.1 204 No Content\r\n\r\n"] * 3) as (server, url):
        c = client()
        try:
            for i in range(3):
                answer = await c.post(url, {"Content-Type": "application/json", "Pubsub-Delivery-Attempt": str(i)},
                                      b'{"n": %d}' % i, 65536)
                assert answer.status == 204
        finally:
            await c.close()
    assert server.connections == 1
    head, body = server.requests[2]
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /push?x=1 HTTP/1.1"
    assert f"Host: 127.0.0.1:{url.port}".encode() in lines
    assert b"Content-Length: 8" in lines and b"Pubsub-Delivery-Attempt: 2" in lines
    assert b"User-Agent: push-worker/0.1" in lines
    assert body == b'{"n": 2}'


async def test_idle_connections_are_closed_past_the_keepalive_even_if_never_used_again(monkeypatch):
    """Reuse used to be the only check: the connections of an endpoint no longer posted to (its
    subscription moved or was deleted) stayed open for good."""
    monkeypatch.setattr(http1, "KEEPALIVE_SECONDS", 0.3)
    async with contextlib.AsyncExitStack() as stack:
        endpoints = [await stack.enter_async_context(serving([b"HTTP/1.1 204 No Content\r\n\r\n"], hold_open=True))
                     for _ in range(3)]
        c = client()
        try:
            for _, url in endpoints:
                assert (await c.post(url, {}, b"x", 65536)).status == 204
            assert [server.closed_by_client for server, _ in endpoints] == [0, 0, 0]  # kept for reuse
            await eventually(lambda: all(server.closed_by_client == 1 for server, _ in endpoints), timeout=5,
                             what="every idle connection closed by the client")
        finally:
            await c.close()


@pytest.mark.parametrize(("answer", "status", "reused"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", 200, True),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\nWiki\r\n5\r\npedia\r\n0\r\n"
     b"X-Trailer: y\r\n\r\n", 200, True),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n", 201, True),
    (b"HTTP/1.1 102 Processing\r\n\r\n", 102, False),  # the final answer would follow on this connection
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", 200, False),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", 200, False),
    (b"HTTP/1.1 500 Oops\r\nContent-Length: 200000\r\n\r\n" + b"z" * 200000, 500, False),  # over the cap
    (b"HTTP/1.1 503 Busy\r\nRetry-After: 7\r\nContent-Length: 0\r\n\r\n", 503, True),
])
async def test_each_answer_framing_is_read_and_reuse_follows_it(answer, status, reused):
    async with serving([answer, b"HTTP/1.1 204 No Content\r\n\r\n"]) as (server, url):
        c = client()
        try:
            first = await c.post(url, {}, b"x", 65536)
            second = await c.post(url, {}, b"y", 65536)
        finally:
            await c.close()
    assert (first.status, second.status) == (status, 204)
    assert server.connections == (1 if reused else 2)
    if status == 503:
        assert first.headers["retry-after"] == "7"


async def test_an_answer_without_framing_ends_with_the_connection():
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nthe body runs until close")
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(handle, "127.0.0.1", 0)
    c = client()
    try:
        port = listener.sockets[0].getsockname()[1]
        answer = await c.post(URL(f"http://127.0.0.1:{port}/"), {}, b"", 65536)
        assert answer.status == 200
    finally:
        await c.close()
        listener.close()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    b"HTTP/1.1 20 OK\r\n\r\n",
    b"HTTP/2 200\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n",
    b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX: " + b"h" * (http1.HEAD_LIMIT + 10),
    # Smuggling-style framing and the leniencies a hand parser had (int(size, 16), isdigit()):
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nab",
    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x10\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: \xc2\xb2\r\n\r\nab",
    b"HTTP/1.1 200 OK\r\nContent-Length: 1_0\r\n\r\n" + b"a" * 10,
    b"HTTP/1.1 200 OK\r\nX-Folded: a\r\n b\r\nContent-Length: 0\r\n\r\n",  # obs-fold
    b"HTTP/1.1 200 OK\r\nContent-Length : 0\r\n\r\n",
])
async def test_protocol_violations_fail_the_exchange(answer):
    async with serving([answer]) as (_, url):
        c = client()
        try:
            with pytest.raises(http1.ProtocolError):
                await asyncio.wait_for(c.post(url, {}, b"x", 65536), 5)
        finally:
            await c.close()


@pytest.mark.parametrize("answer", [
    b"",  # nothing at all
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",  # body stalls
    b"HTTP/1.1 200 OK\r\n\r\nabc",  # read until close, never closed
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",  # no last chunk
])
async def test_an_exchange_not_over_by_the_deadline_times_out_and_drops_the_connection(answer):
    async with serving([answer, b"HTTP/1.1 204 No Content\r\n\r\n"]) as (server, url):
        c = client()
        try:
            started = asyncio.get_running_loop().time()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(c.post(url, {}, b"x", 65536, deadline=0.3), 5)
            assert 0.3 <= asyncio.get_running_loop().time() - started < 1.3
            assert (await c.post(url, {}, b"y", 65536, deadline=2)).status == 204  # on a new connection
        finally:
            await c.close()
    assert server.connections == 2


NO_CONTENT = b"HTTP/1.1 204 No Content\r\n\r\n"


async def test_a_kept_alive_connection_the_endpoint_closed_is_replaced_once():
    """An endpoint closes an idle connection at its keep-alive timeout; a request sent at that moment
    met the close and failed as an attempt (20% of requests sent then, measured against aiohttp's
    server), though the endpoint never saw it. Closed with no byte of an answer, a kept-alive
    connection is now replaced once by a new one, within the same deadline."""
    async with serving([NO_CONTENT, Hangup(), NO_CONTENT]) as (server, url):
        c = client()
        try:
            assert (await c.post(url, {}, b"1", 65536, deadline=5)).status == 204
            assert (await c.post(url, {}, b"2", 65536, deadline=5)).status == 204
        finally:
            await c.close()
    assert server.connections == 2 and [body for _, body in server.requests] == [b"1", b"2", b"2"]


@pytest.mark.parametrize(("answers", "connections"), [
    ([Hangup()], 1),  # a new connection: the endpoint's own answer, not a stale connection
    ([NO_CONTENT, Hangup(), Hangup()], 2),  # replaced once, not again
    ([NO_CONTENT, Hangup(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")], 1),  # an answer had begun
])
async def test_a_connection_closed_without_an_answer_is_not_replaced_otherwise(answers, connections):
    async with serving(answers) as (server, url):
        c = client()
        try:
            if answers[0] == NO_CONTENT:
                assert (await c.post(url, {}, b"1", 65536, deadline=5)).status == 204
            with pytest.raises(http1.ProtocolError):
                await c.post(url, {}, b"2", 65536, deadline=5)
        finally:
            await c.close()
    assert server.connections == connections


class TwoAddresses:
    """DNS for one name with two addresses, the first a dead backend's (the sockets are real)."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = addresses

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[dict]:
        return [{"hostname": host, "host": a, "port": port, "family": socket.AF_INET, "proto": 0, "flags": 0}
                for a in self.addresses]

    async def close(self) -> None:
        pass


async def test_an_address_that_drops_connection_attempts_does_not_hold_the_host():
    """A host's addresses were tried one after another, each until it failed: one that drops
    connection attempts (a dead backend among them) held every request to the host until its
    deadline, though the next address answered. Now the next is tried 250 ms later (Happy Eyeballs,
    as aiohttp connects)."""
    async with serving([NO_CONTENT]) as (server, url):
        # A listener that never accepts, its queue full: the kernel drops further SYNs, as a dead host does.
        dead = socket.socket()
        dead.bind(("127.0.0.2", url.port))
        dead.listen(0)
        fillers = []
        for _ in range(8):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.2", url.port))
            fillers.append(filler)
        c = http1.Client(GuardedResolver(ALLOW, inner=TwoAddresses("127.0.0.2", "127.0.0.1")))  # type: ignore[arg-type]
        try:
            started = asyncio.get_running_loop().time()
            answer = await c.post(url.with_host("backends.example"), {}, b"x", 65536, deadline=3)
            assert answer.status == 204 and asyncio.get_running_loop().time() - started < 1.5
        finally:
            await c.close()
            for sock in (dead, *fillers):
                sock.close()
    assert server.connections == 1


@pytest.fixture(scope="module")
def backends_certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    return self_signed(tmp_path_factory.mktemp("backends"), "DNS:backends.example")


@pytest.mark.parametrize("broken", ["closes at once", "an untrusted certificate"])
async def test_an_address_whose_tls_handshake_fails_leaves_the_request_to_the_next(
        broken, backends_certificate, certificate):
    """One of a host's backends breaks TLS (a terminator that hangs up, or serves a certificate the client
    does not trust): the request goes to the next address instead of failing, as aiohttp's would."""
    cert, key = backends_certificate
    good = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    good.load_cert_chain(cert, key)
    async with serving([NO_CONTENT], tls=good) as (server, url):
        if broken == "closes at once":
            bad_tls = None
        else:
            bad_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            bad_tls.load_cert_chain(*certificate)  # not one the client trusts (nor for backends.example)

        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if bad_tls is not None:  # the handshake went through on this side: wait for the client to drop it
                await reader.read()
            writer.close()

        bad = await asyncio.start_server(hang_up, "127.0.0.2", url.port, ssl=bad_tls)
        c = http1.Client(GuardedResolver(ALLOW, inner=TwoAddresses("127.0.0.2", "127.0.0.1")),  # type: ignore[arg-type]
                         ssl_context=ssl.create_default_context(cafile=str(cert)))
        try:
            answer = await c.post(url.with_host("backends.example"), {}, b"x", 65536, deadline=3)
            assert answer.status == 204
        finally:
            await c.close()
            bad.close()
    assert server.connections == 1


async def test_unsafe_header_values_are_refused_before_anything_is_sent():
    async with serving([b"HTTP/1.1 204 No Content\r\n\r\n"]) as (server, url):
        c = client()
        try:
            with pytest.raises(http1.HeaderRefused):
                await c.post(url, {"X-Evil": "a\r\nInjected: yes"}, b"x", 65536)
        finally:
            await c.close()
    assert server.connections == 0


async def test_a_large_body_arrives_whole():
    body = bytes(range(256)) * (5 * 4096)  # 5 MiB, sent in pieces with flow control
    async with serving([b"HTTP/1.1 204 No Content\r\n\r\n"]) as (server, url):
        c = client()
        try:
            assert (await c.post(url, {}, body, 65536)).status == 204
        finally:
            await c.close()
    assert hashlib.sha256(server.requests[0][1]).digest() == hashlib.sha256(body).digest()

@pytest.mark.parametrize("then", ["close", "half-close"])
async def test_an_answer_before_the_whole_body_is_the_attempts_answer(then):
    """An endpoint over its size limit (or refusing the caller) answers after the head and closes,
    as Go's server does (half-close, reading on for a while) or plainly. The attempt ends with that
    status, not a connection error, and the connection is not reused."""
    heads: list[bytes] = []

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            heads.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 413 Payload Too Large\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            if then == "half-close":
                writer.write_eof()
                while await reader.read(65536):
                    pass
        writer.close()

    listener = await asyncio.start_server(refuse, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    deliverer = Deliverer(ALLOW)
    try:
        outcomes = [await deliverer.attempt(f"http://127.0.0.1:{port}/push", PushRequest({}, b"x" * (8 << 20)), 5.0)
                    for _ in range(3)]
    finally:
        await deliverer.close()
        listener.close()
    assert [(o.result, o.last_status) for o in outcomes] == [(Result.NACK, "413")] * 3, outcomes
    assert len(heads) == 3  # a connection each: a request cut short leaves nothing to reuse


async def test_tls_certificates_are_verified(certificate, monkeypatch):
    cert, key = certificate
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    async with serving([b"HTTP/1.1 204 No Content\r\n\r\n"] * 3, tls=server_side) as (server, url):
        # The system trust store does not know this certificate: refused, nothing delivered.
        deliverer = Deliverer(ALLOW)
        try:
            outcome = await deliverer.attempt(str(url), PushRequest({}, b"secret"), 5.0)
        finally:
            await deliverer.close()
        assert outcome.result is Result.CONNECTION_ERROR and "SSL" in outcome.detail, outcome
        assert server.requests == []
        # Trusted, it goes through (and the host name, an IP here, is checked against the certificate).
        trusted = ssl.create_default_context(cafile=str(cert))
        c = client(trusted)
        try:
            assert (await c.post(url, {}, b"hello", 65536)).status == 204
        finally:
            await c.close()
        assert server.requests[0][1] == b"hello"
        # A private CA, as docs/configuration.md says: OpenSSL's SSL_CERT_FILE names the bundle to trust.
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        deliverer = Deliverer(ALLOW)
        try:
            outcome = await deliverer.attempt(str(url), PushRequest({}, b"private"), 5.0)
        finally:
            await deliverer.close()
        assert outcome.result is Result.ACK and server.requests[1][1] == b"private", outcome
