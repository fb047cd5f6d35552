"""A fault point between a process and a service: a TCP proxy the test controls, in a thread of its
own (the test's event loop serves endpoints meanwhile). It forwards, or it is cut (partitioned:
bytes stop flowing both ways and nothing is closed, as when a network drops every packet; new
connections are accepted and hang), or it adds latency to every chunk it forwards. Packets to and
from it can be dropped at random by the kernel (`packet_loss`: iptables, as root), so that TCP's
own retransmissions are what the process meets."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

from worker.broker.embedded import free_port


class GroupFirewall:
    """Drops every packet a process group `gid` (`spawn_worker(gid=...)`) sends to a port: a
    partition between that one process and a service, at the kernel (iptables, as root). What the
    service sends back still arrives, but nothing it needs from the process does (acks, flow
    permits, answers), so the connection stalls as a partitioned one does."""

    def __init__(self, gid: int) -> None:
        self.gid = gid
        self.blocked: set[int] = set()

    def _rule(self, port: int) -> list[str]:
        return ["OUTPUT", "-m", "owner", "--gid-owner", str(self.gid), "-p", "tcp", "--dport", str(port), "-j", "DROP"]

    def block(self, port: int) -> None:
        subprocess.run(["iptables", "-A", *self._rule(port)], check=True, capture_output=True, timeout=10)
        self.blocked.add(port)

    def unblock(self, port: int) -> None:
        subprocess.run(["iptables", "-D", *self._rule(port)], check=True, capture_output=True, timeout=10)
        self.blocked.discard(port)

    def close(self) -> None:
        for port in list(self.blocked):
            self.unblock(port)


class FaultyLink:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = free_port()
        self.latency = 0.0  # seconds added to each chunk, each way
        self.dropped = 0  # packets the last `packet_loss` dropped
        self._flowing: asyncio.Event | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="faulty link", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the faulty link did not start")

    @classmethod
    def to_url(cls, url: str) -> tuple[FaultyLink, str]:
        """A link to the service at `url`, and the same URL through the link."""
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        link = cls(parts.hostname, parts.port)
        netloc = parts.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{link.port}"
        return link, urlunsplit(parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._flowing = asyncio.Event()
        self._flowing.set()
        server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", self.port))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            self._loop.close()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(self._pipe(client_reader, upstream_writer), self._pipe(upstream_reader, client_writer),
                             return_exceptions=True)
        for writer in (client_writer, upstream_writer):
            writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Chunks go on in order, each `latency` after it arrived (a delay, not a slower link), and
        not while the link is cut."""
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            assert self._flowing is not None
            while True:
                arrived, data = await chunks.get()
                if not data:
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    return
                await asyncio.sleep(max(0.0, arrived + self.latency - self._loop.time()))
                await self._flowing.wait()  # cut: held here, neither delivered nor refused
                writer.write(data)
                await writer.drain()

        delivering = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(65536)
                chunks.put_nowait((self._loop.time(), data))
                if not data:
                    break
            await delivering
        finally:
            delivering.cancel()

    def cut(self) -> None:
        assert self._flowing is not None
        self._loop.call_soon_threadsafe(self._flowing.clear)

    def heal(self) -> None:
        assert self._flowing is not None
        self._loop.call_soon_threadsafe(self._flowing.set)

    @contextlib.contextmanager
    def packet_loss(self, probability: float) -> Iterator[None]:
        """Drop each packet to or from the link's port with `probability` (both directions)."""
        rules = [["OUTPUT", "-p", "tcp", side, str(self.port), "-m", "statistic", "--mode", "random",
                  "--probability", str(probability), "-j", "DROP"] for side in ("--dport", "--sport")]
        for rule in rules:
            subprocess.run(["iptables", "-A", *rule], check=True, capture_output=True, timeout=10)
        try:
            yield
        finally:
            listed = subprocess.run(["iptables", "-L", "OUTPUT", "-v", "-x", "-n"], capture_output=True, text=True,
                                    timeout=10).stdout
            self.dropped = sum(int(line.split()[0]) for line in listed.splitlines()
                               if "DROP" in line and (f"dpt:{self.port}" in line or f"spt:{self.port}" in line))
            for rule in rules:
                subprocess.run(["iptables", "-D", *rule], capture_output=True, timeout=10)

    def close(self) -> None:
        self.heal()
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
