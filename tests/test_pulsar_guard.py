"""The broker-side guard (deploy/pulsar-guard, loaded by every Apache Pulsar the project starts): a
message that declares more than its limit (64 MiB by default) inflated, whatever its compression, or
chunked, never reaches a push worker; the broker counts and logs each one with its id. Messages under
the limit, compressed or chunked, pass. Apache Pulsar only: pulsar-lite loads no broker plugins."""

from __future__ import annotations

import asyncio
import random
import re
import urllib.request
from pathlib import Path

import pulsar
import pytest

from tests.support.builders import make_sub
from tests.support.endpoints import Endpoint
from tests.support.helpers import eventually
from tests.support.pulsar_client import Client

LIMIT = 64 << 20  # the guard's default (OversizeGuard.DEFAULT_MAX_BYTES)
ROOT = Path(__file__).resolve().parents[1]
CODECS = [pulsar.CompressionType.ZLib, pulsar.CompressionType.LZ4, pulsar.CompressionType.ZSTD,
          pulsar.CompressionType.SNAPPY]


def kept_away(broker: object) -> dict[str, float]:
    """pushworker_guard_kept_away_total by kind, from the broker's /metrics."""
    with urllib.request.urlopen(str(getattr(broker, "metrics_url"))) as answer:  # noqa: B009
        text = answer.read().decode()
    return {kind: float(value) for kind, value in
            re.findall(r'^pushworker_guard_kept_away_total\{[^}]*kind="(\w+)"[^}]*\} (\S+)', text, re.M)}


def send(client: Client, topic: str, payload: bytes, **producer: object) -> str:
    made = client.client.create_producer(topic, batching_enabled=False, **producer)
    mid = made.send(payload)
    made.close()
    return f"{mid.ledger_id()}:{mid.entry_id()}"


@pytest.mark.apache_pulsar
@pytest.mark.timeout(300)
async def test_the_guard_keeps_messages_declaring_too_much_from_push_workers(
        broker, start_worker, endpoint: Endpoint, client: Client, topic):
    sub = make_sub(topic, endpoint.url, content="raw")  # raw: an 8 MiB payload is an 8 MiB body
    w = await start_worker(sub)
    before = kept_away(broker)
    rng = random.Random(58)
    bombs = {f"bomb-{codec.name}": send(client, topic, codec.name.encode() + bytes(LIMIT + (16 << 20)),
                                        compression_type=codec) for codec in CODECS}
    bombs["chunked"] = send(client, topic, rng.randbytes(LIMIT + (4 << 20)), chunking_enabled=True)
    passing = {"small-zstd": b"small-zstd" + bytes(3 << 20), "chunked-8MiB": rng.randbytes(8 << 20)}
    send(client, topic, passing["small-zstd"], compression_type=pulsar.CompressionType.ZSTD)
    send(client, topic, passing["chunked-8MiB"], chunking_enabled=True)
    client.publish(topic, [b"last"])
    expected = sorted([*passing.values(), b"last"])
    stats = w.dispatchers[sub.key].stats
    # A shared subscription delivers in parallel: the 8 MiB chunked one may come after the last.
    await eventually(lambda: stats.acked >= 3, timeout=120, what="the messages under the limit delivered")
    assert sorted(r.body for r in endpoint.requests) == expected
    assert (stats.acked, stats.dead_lettered, stats.dropped) == (3, 0, 0)  # nothing else reached the worker

    after = kept_away(broker)
    assert after.get("compressed", 0) - before.get("compressed", 0) == len(CODECS), after
    assert after.get("chunked", 0) - before.get("chunked", 0) >= 1, after  # each chunk of it is an entry
    log = Path(getattr(broker, "log_path", ROOT / ".apache-pulsar" / "apache-pulsar.log"))
    text = await asyncio.to_thread(log.read_text)
    for what, mid in bombs.items():
        assert re.search(rf"push-worker guard: message {mid} of {re.escape(topic)} kept away from subscription "
                         rf"{sub.pulsar_subscription}", text) or what == "chunked", (what, mid)
    assert re.search(rf"push-worker guard: message \d+:\d+ of {re.escape(topic)} kept away .* is chunked to "
                     rf"{LIMIT + (4 << 20)} bytes", text)


@pytest.mark.apache_pulsar
async def test_a_consumer_that_is_not_a_push_workers_gets_every_message(broker, client: Client, topic):
    """The guard's default scope is push-worker's consumers (consumer property `push-worker`): a
    project's own client still reads what it published."""
    reader = client.client.subscribe(topic, "own-client", initial_position=pulsar.InitialPosition.Earliest)
    bomb = bytes(LIMIT + (1 << 20))
    send(client, topic, bomb, compression_type=pulsar.CompressionType.ZSTD)
    message = await asyncio.to_thread(reader.receive, 30_000)
    assert message.data() == bomb
    reader.close()
