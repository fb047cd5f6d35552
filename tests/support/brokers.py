"""Which broker the suite runs on: pulsar-lite (the default, started per session) or Apache Pulsar.

`PUSH_WORKER_TEST_PULSAR_URL` and `PUSH_WORKER_TEST_PULSAR_ADMIN_URL` point the suite at a running
Apache Pulsar (`make apache-pulsar`); tests that restart or kill their broker then start an Apache
Pulsar standalone of their own. Apache Pulsar creates no tenant or namespace by itself, so the ones
the tests use are created through its admin API.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path

from devtools import apache_pulsar
from worker.broker import embedded

EXTERNAL_URL = os.environ.get("PUSH_WORKER_TEST_PULSAR_URL", "")
EXTERNAL_ADMIN_URL = os.environ.get("PUSH_WORKER_TEST_PULSAR_ADMIN_URL", "")
ON_APACHE_PULSAR = bool(EXTERNAL_URL)

# Every tenant a test, the demo or a benchmark publishes under (always with the namespace `main`).
TENANTS = ("p-test", "p-a", "p-b", "p-c", "p-x", "p-cli", "p-other", "p-local", "p-fleet", "p-demo", "p-bench",
           "p-soak", "p-victim", "p-evil", "p-good", "p-hang", "p-noisy", "p-up", "p-roll", "p-switch")


def is_pulsar_lite(broker: object) -> bool:
    return getattr(broker, "name", "") == "pulsar-lite"


def admin_url(broker: object) -> str:
    return str(getattr(broker, "admin_url", ""))


def prepare(broker: object) -> None:
    """Create the tests' tenants and namespaces where the broker does not create them on use."""
    if admin_url(broker):
        for tenant in TENANTS:
            apache_pulsar.ensure_namespace(admin_url(broker), tenant)


def session_broker(state_dir: Path) -> embedded.Service | apache_pulsar.RunningBroker:
    if ON_APACHE_PULSAR:
        if not EXTERNAL_ADMIN_URL:
            raise RuntimeError("PUSH_WORKER_TEST_PULSAR_URL is set: set PUSH_WORKER_TEST_PULSAR_ADMIN_URL too")
        broker = apache_pulsar.RunningBroker(EXTERNAL_URL, EXTERNAL_ADMIN_URL)
        prepare(broker)
        return broker
    return embedded.start_pulsar(state_dir)


def own_broker(state_dir: Path, port: int | None = None) -> embedded.Service:
    """A broker of one test's own, which it may kill and restart."""
    if ON_APACHE_PULSAR:
        broker = apache_pulsar.start(state_dir, port=port)
        prepare(broker)
        return broker
    return embedded.start_pulsar(state_dir, port=port)


def partitioned(broker: object, topic: str, partitions: int = 3) -> str:
    """`topic` as a partitioned topic: created through the admin API on Apache Pulsar; the
    partitioned pulsar-lite broker makes every topic it creates on first use partitioned."""
    if admin_url(broker):
        apache_pulsar.create_partitioned_topic(admin_url(broker), topic, partitions)
    return topic


def bytes_published(broker: object, topic: str) -> int:
    """The bytes `topic` took in, as the broker stores them (a compressed payload as it came): the
    topic's stats on Apache Pulsar (`bytesInCounter`), its `pulsar_in_bytes_total` on pulsar-lite."""
    if admin_url(broker):
        with urllib.request.urlopen(f"{admin_url(broker)}/admin/v2/{topic.replace('://', '/')}/stats") as answer:
            return int(json.load(answer)["bytesInCounter"])
    namespace, _, short = topic.split("://", 1)[1].rpartition("/")
    with urllib.request.urlopen(str(getattr(broker, "metrics_url"))) as answer:  # noqa: B009 - pulsar-lite's
        text = answer.read().decode()
    pattern = re.compile(rf'^pulsar_in_bytes_total{{[^}}]*namespace="{re.escape(namespace)}"[^}}]*'
                         rf'topic="{re.escape(short)}"[^}}]*}} (\d+)', re.M)
    return sum(int(found) for found in pattern.findall(text))
