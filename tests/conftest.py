"""Shared fixtures: real brokers (pulsar-lite, or Apache Pulsar: tests/support/brokers.py) and redis-server
processes on free ports, real HTTP endpoints.

Nothing here is a mock: the broker, Redis and endpoints are the programs a user would run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from aiohttp import web

from devtools import redis_topologies
from tests.support import brokers
from tests.support.builders import make_settings
from tests.support.endpoints import Endpoint, Received, serve
from tests.support.helpers import eventually, self_signed
from tests.support.pulsar_client import Client
from tests.support.redis_targets import RedisTarget
from worker.api.server import AdminServer
from worker.broker import embedded
from worker.fleet.registry import Registry
from worker.model.admin_settings import AdminSettings
from worker.model.config import RedisSettings
from worker.model.subscriptions import Subscription
from worker.process.service import Worker

# -- the form under test -------------------------------------------------------------------

def pytest_configure(config: pytest.Config) -> None:
    """`make test` runs the compiled package of .build/compiled (PUSH_WORKER_TEST_COMPILED=1): it must
    be the one imported, and made from the sources as they are now."""
    if os.environ.get("PUSH_WORKER_TEST_COMPILED") != "1":
        return
    import worker
    from devtools.compile import COMPILED_DIR, stale

    if not Path(worker.__file__).resolve().is_relative_to(COMPILED_DIR):
        pytest.exit(f"PUSH_WORKER_TEST_COMPILED=1 but worker is imported from {worker.__file__}, not "
                    f"{COMPILED_DIR}: run the suite with `make test`", returncode=2)
    changed = stale()
    if changed:
        pytest.exit(f"the compiled build is older than {', '.join(changed[:3])}: run `make compile` "
                    "(make test does)", returncode=2)


# -- CI: nothing may skip -------------------------------------------------------------------

@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    gc.collect()  # finalizers now, not inside a plugin's late import (see _collect_garbage_between_tests)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if os.environ.get("CI") and skipped:
        if reporter:
            reporter.write_line(f"CI: {skipped} test(s) skipped; in CI nothing may skip", red=True)
        session.exitstatus = 1


def _other_redis_topology(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return item.get_closest_marker("redis_topology") is not None or (
        callspec is not None and callspec.params.get("redis_target", "standalone") != "standalone")


# Fixtures that start or use a broker (and so a worker); `slow` marks multi-process scenarios.
_BROKER_FIXTURES = frozenset({"broker", "own_broker", "partitioned_broker", "partitioned_topic", "client",
                              "start_worker", "redis_cluster", "redis_sentinel"})


def _needs_a_broker(item: pytest.Item) -> bool:
    names = set(getattr(item, "fixturenames", ()))
    return bool(names & _BROKER_FIXTURES) or item.get_closest_marker("slow") is not None or \
        item.module.__name__.endswith(("test_demo", "test_embedded"))  # start the embedded broker themselves


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests of what only Apache Pulsar does are deselected on pulsar-lite; the Redis Cluster and
    Sentinel variants, and tests that use no broker under test, run in the pulsar-lite lane only
    (the broker does not change what they test, and CI time is bounded). Deselected, not skipped:
    a skip would fail CI."""
    if brokers.ON_APACHE_PULSAR:
        deselected = [item for item in items
                      if _other_redis_topology(item) or item.get_closest_marker("broker_independent")]
    else:
        deselected = [item for item in items if item.get_closest_marker("apache_pulsar")]
    if os.environ.get("PUSH_WORKER_TEST_FAST"):  # `make test-fast`: what needs no broker and no worker process
        deselected += [item for item in items if _needs_a_broker(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        dropped = set(map(id, deselected))
        items[:] = [item for item in items if id(item) not in dropped]


@pytest.fixture(autouse=True)
def _collect_garbage_between_tests() -> Iterator[None]:
    """Run finalizers of a test's leftovers (Pulsar C++ callbacks, cancelled tasks) between tests,
    not in the middle of a later import: CPython 3.11.7 can fail such a compile() with
    `SystemError: AST constructor recursion depth mismatch`."""
    yield
    gc.collect()


# -- services ---------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """pulsar-lite, or the Apache Pulsar that PUSH_WORKER_TEST_PULSAR_URL names (tests/support/brokers.py)."""
    service = brokers.session_broker(tmp_path_factory.mktemp("pulsar"))
    yield service
    service.stop()


@pytest.fixture(scope="session")
def partitioned_broker(tmp_path_factory: pytest.TempPathFactory, broker: Any) -> Iterator[Any]:
    """A broker for partitioned topics: on pulsar-lite one whose topics have 3 partitions (created
    on first use); on Apache Pulsar the session broker, where `brokers.partitioned` creates them."""
    if brokers.ON_APACHE_PULSAR:
        yield broker
        return
    service = embedded.start_pulsar(tmp_path_factory.mktemp("pulsar-partitioned"), default_partitions=3)
    yield service
    service.stop()


@pytest.fixture
def partitioned_topic(partitioned_broker: Any, topic: str) -> str:
    """A topic of 3 partitions on `partitioned_broker`."""
    return brokers.partitioned(partitioned_broker, topic)


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[embedded.Service]:
    """A broker of this test's own, for tests that kill or restart it."""
    service = brokers.own_broker(tmp_path / "pulsar")
    yield service
    service.kill()


@pytest.fixture(scope="session")
def redis_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[embedded.Service]:
    service = embedded.start_redis(tmp_path_factory.mktemp("redis"))
    yield service
    service.stop()


@pytest.fixture
def redis_url(redis_service: embedded.Service) -> str:
    client = redis.Redis.from_url(redis_service.url)
    client.flushall()
    client.close()
    return redis_service.url


@pytest.fixture
async def registry(redis_url: str) -> AsyncIterator[Registry]:
    """The default fleet's registry on the test's Redis, written as `subs apply` writes it."""
    client = aioredis.Redis.from_url(redis_url)
    yield Registry(client, "default")
    await client.aclose()


def _topology(start: Callable[[Path], Any], directory: Path) -> Iterator[Any]:
    topology = start(directory)
    yield topology
    topology.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis_topologies.ClusterTopology]:
    yield from _topology(redis_topologies.start_cluster, tmp_path_factory.mktemp("redis-cluster"))


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis_topologies.SentinelTopology]:
    yield from _topology(redis_topologies.start_sentinel, tmp_path_factory.mktemp("redis-sentinel"))


@pytest.fixture
def redis_target(request: pytest.FixtureRequest) -> RedisTarget:
    """Standalone unless the test is parametrised over MODES (tests/support/redis_targets.py). The cluster
    and Sentinel setups are shared by the session: a test that kills a node starts its own."""
    mode = getattr(request, "param", "standalone")
    if mode == "standalone":
        url = request.getfixturevalue("redis_url")
        return RedisTarget(mode, RedisSettings(url=url), {"url": url})
    topology = request.getfixturevalue("redis_cluster" if mode == "cluster" else "redis_sentinel")
    assert not topology.stopped, "a test killed a node of the shared topology"
    target = RedisTarget(mode, topology.settings(), topology.config(), topology)
    target.flush()
    return target


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[embedded.Service]:
    service = embedded.start_redis(tmp_path / "redis")
    yield service
    service.kill()


@pytest.fixture(scope="session")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the previous release's `worker` package (tests/support/previous_release.py)."""
    from tests.support import previous_release as release

    return release.extract(tmp_path_factory.mktemp("previous-release"))[1]


@pytest.fixture
def topic() -> str:
    return f"persistent://p-test/main/t-{uuid.uuid4().hex[:12]}"


# -- endpoints --------------------------------------------------------------------------------

@pytest.fixture
async def endpoint() -> AsyncIterator[Endpoint]:
    ep = Endpoint()

    async def handle(request: web.Request) -> web.StreamResponse:
        rec = Received(dict(request.headers), await request.read(), time.monotonic(), path=request.path)
        ep.requests.append(rec)
        if ep.behaviour is None:
            result: Any = web.Response(status=204)
        else:
            result = ep.behaviour(rec)
            if asyncio.iscoroutine(result):
                result = await result
        rec.status = result.status
        return result  # type: ignore[no-any-return]

    runner, ep.url = await serve("/{tail:.*}", handle)
    yield ep
    await runner.cleanup()


# -- worker and clients -----------------------------------------------------------------------

@pytest.fixture
async def start_worker(broker: Any, redis_target: RedisTarget) -> AsyncIterator[Callable[..., Awaitable[Worker]]]:
    workers: list[Worker] = []

    async def start(*subs: Subscription, broker_url: str | None = None, redis: str | RedisSettings | None = None,
                    **kw: Any) -> Worker:
        w = Worker(make_settings(broker_url or broker.url, redis or redis_target.settings, subs, **kw),
                   worker_id=f"w{len(workers)}")
        workers.append(w)
        await w.start()
        await eventually(lambda: all(s.key in w.dispatchers for s in subs), what="subscriptions started")
        return w

    yield start
    for w in workers:
        await w.close()


@pytest.fixture
async def start_admin() -> AsyncIterator[Callable[..., Awaitable[AdminServer]]]:
    """The operator API and console for a started worker's fleet, in the test's process (`push-worker
    admin` runs the same server in a process of its own: tests/test_admin_process.py)."""
    servers: list[AdminServer] = []

    async def start(w: Worker, settings: AdminSettings) -> AdminServer:
        server = AdminServer(settings, dataclasses.replace(w.settings, admin=settings), w.redis_url, w.pulsar_url)
        servers.append(server)
        await server.start()
        return server

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
def client(broker: Any) -> Iterator[Client]:
    c = Client(broker.url)
    yield c
    c.close()


@pytest.fixture(scope="session")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (made with the openssl command): a
    private CA of its own, which no system trust store knows."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    return self_signed(tmp_path_factory.mktemp("tls"), "IP:127.0.0.1")

