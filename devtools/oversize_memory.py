"""What an oversize compressed message costs a worker in memory: a message of a few hundred KiB that
inflates to SIZE MiB (zlib, zeros), past `destinations.max_request_bytes`, is dead-lettered unsent;
the worker's peak RSS (VmHWM) above its RSS before the message is printed, with the dead letter's
stored size beside the original's.

    python -m devtools.oversize_memory [--mib 300] [--codec ZLib]

Runs on the embedded broker and Redis (pulsar-lite and redis-server), a worker process of its own.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pulsar
import yaml

from worker.broker import embedded

TOPIC = "persistent://p-bench/main/oversize"


def _status(pid: int, field: str) -> int:
    """A /proc/<pid>/status field in KiB."""
    text = Path(f"/proc/{pid}/status").read_text()
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(found.group(1)) if found else 0


def _bytes_in(metrics_url: str, topic: str) -> int:
    namespace, _, short = topic.split("://", 1)[1].rpartition("/")
    with urllib.request.urlopen(metrics_url) as answer:  # noqa: S310 - the embedded broker's http:// URL
        text = answer.read().decode()
    found = re.search(rf'^pulsar_in_bytes_total{{[^}}]*namespace="{re.escape(namespace)}"[^}}]*topic="{short}"'
                      rf'[^}}]*}} (\d+)', text, re.M)
    return int(found.group(1)) if found else 0


def measure(mib: int, codec: str) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        state = Path(scratch)
        broker = embedded.start_pulsar(state / "pulsar", die_with_parent=True)
        redis = embedded.start_redis(state / "redis", die_with_parent=True)
        config = state / "worker.yaml"
        config.write_text(yaml.safe_dump({
            "pulsar": {"service_url": broker.url}, "redis": {"url": redis.url}, "http": {"port": 0},
            "log": {"format": "json", "level": "warning"}, "destinations": {"allow_private": True},
            "subscriptions": [{"name": "oversize", "topic": TOPIC, "max_ack_pending": 4,
                               "deliver": {"mode": "push", "push": {"url": "http://127.0.0.1:9/never"}},
                               "dead_letter": {"topic": TOPIC + "-dlq"}}]}))
        client = pulsar.Client(broker.url, logger=pulsar.FileLogger(pulsar.LoggerLevel.Error, "/dev/null"))
        watcher = client.subscribe(TOPIC + "-dlq", "watch", initial_position=pulsar.InitialPosition.Earliest)
        with open(state / "worker.log", "wb") as log:
            worker = subprocess.Popen([sys.executable, "-m", "worker.cli", "run", "--config", str(config)],
                                      stdout=log, stderr=log)
        try:
            time.sleep(5)  # started and subscribed (an idle worker: nothing to synchronise with but time)
            before = _status(worker.pid, "VmRSS")
            producer = client.create_producer(TOPIC, batching_enabled=False,
                                              compression_type=getattr(pulsar.CompressionType, codec))
            producer.send(bytes(mib << 20))
            producer.close()
            try:
                letter = watcher.receive(120_000)
            except pulsar.Timeout:
                text = (state / "worker.log").read_text()
                sys.exit(f"no dead letter within 120 s; the worker's log:\n{text[-3000:]}")
            assert len(letter.data()) == mib << 20, len(letter.data())
            peak = _status(worker.pid, "VmHWM")
            metrics = broker.metrics_url or ""
            original, dead = _bytes_in(metrics, TOPIC), _bytes_in(metrics, TOPIC + "-dlq")
            print(f"oversize: {mib} MiB inflated ({codec}, {original:,} bytes in the broker): worker RSS "
                  f"{before / 1024:.0f} MiB before, peak {peak / 1024:.0f} MiB (+{(peak - before) / 1024:.0f} MiB, "
                  f"{(peak - before) / 1024 / mib:.2f} x the inflated size); dead letter {dead:,} bytes in the broker")
        finally:
            worker.terminate()
            worker.wait(30)
            client.close()
            broker.stop()
            redis.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.oversize_memory", description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=300, help="the inflated size (MiB)")
    parser.add_argument("--codec", default="ZLib", choices=["ZLib", "LZ4", "ZSTD", "SNAPPY"])
    args = parser.parse_args(argv)
    measure(args.mib, args.codec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
