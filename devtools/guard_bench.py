"""What the broker guard (deploy/pulsar-guard) costs: the same load through an Apache Pulsar standalone
without it and with it, in turns (fresh data each start), each publishing MESSAGES messages of 1 KiB
(zstd, batched as producers do) while a push-worker consumer (consumer property `push-worker`, so
every entry goes through the filter) reads them. Prints publish and end-to-end rates per run and the
ratios with the guard against without it, medians over ROUNDS.

    python -m devtools.guard_bench [--messages 50000] [--rounds 3]

Needs Java 17 and Maven (the broker and the guard are built on first use).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import pulsar

from devtools import apache_pulsar
from worker.broker.consumer import PUSH_CONSUMER_PROPERTY

TOPIC = "persistent://public/default/guard-bench"


def _run(broker_url: str, messages: int) -> tuple[float, float]:
    """(published msg/s, received msg/s), both from the first send."""
    client = pulsar.Client(broker_url, logger=pulsar.FileLogger(pulsar.LoggerLevel.Error, "/dev/null"))
    consumer = client.subscribe(TOPIC, "push", consumer_type=pulsar.ConsumerType.Shared,
                                receiver_queue_size=1000, properties={PUSH_CONSUMER_PROPERTY: "1"})
    received = threading.Event()
    got = 0

    def read() -> None:
        nonlocal got
        while got < messages:
            consumer.acknowledge(consumer.receive(60_000))
            got += 1
        received.set()

    reader = threading.Thread(target=read, daemon=True)
    producer = client.create_producer(TOPIC, compression_type=pulsar.CompressionType.ZSTD, batching_enabled=True,
                                      block_if_queue_full=True)
    payload = bytes(range(256)) * 4
    began = time.perf_counter()
    reader.start()
    for _ in range(messages):
        producer.send_async(payload, None)
    producer.flush()
    published = time.perf_counter() - began
    if not received.wait(300):
        raise SystemExit(f"only {got} of {messages} received")
    done = time.perf_counter() - began
    client.close()
    return messages / published, messages / done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.guard_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    figures: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for guard in (False, True):
                broker = apache_pulsar.start(Path(scratch) / f"b{round_}{guard}", guard=guard)
                try:
                    figures[guard].append(_run(broker.url, args.messages))
                finally:
                    broker.stop()
                pub, e2e = figures[guard][-1]
                print(f"round {round_ + 1}, guard {'on ' if guard else 'off'}: publish {pub:,.0f} msg/s, "
                      f"end to end {e2e:,.0f} msg/s", flush=True)
    off_pub = statistics.median(p for p, _ in figures[False])
    on_pub = statistics.median(p for p, _ in figures[True])
    off_e2e = statistics.median(e for _, e in figures[False])
    on_e2e = statistics.median(e for _, e in figures[True])
    print(f"guard: {args.messages:,} x 1 KiB zstd, batched, {args.rounds} rounds (medians): publish "
          f"{on_pub / off_pub:.2f} x without it ({on_pub:,.0f} / {off_pub:,.0f} msg/s), end to end "
          f"{on_e2e / off_e2e:.2f} x ({on_e2e:,.0f} / {off_e2e:,.0f} msg/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
