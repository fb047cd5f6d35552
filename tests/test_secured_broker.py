"""A broker as production clusters run it: messages over its size limit (chunked), token
authentication on the binary protocol, the admin API and /metrics, TLS with a private CA."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pulsar
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from devtools import apache_pulsar
from tests.support import brokers
from tests.support.builders import make_settings, make_sub
from tests.support.endpoints import Endpoint, serve
from tests.support.helpers import cli, eventually
from tests.support.pulsar_client import Client
from worker.broker import broker_admin
from worker.broker.backlog import BacklogReader
from worker.broker.consumer import quiet_logger
from worker.model.config import PulsarSettings
from worker.model.subscriptions import RetryPolicy, Subscription
from worker.process.service import Worker


@pytest.mark.apache_pulsar
async def test_a_message_over_the_brokers_size_limit_is_delivered_whole_and_dead_lettered_whole(
        broker, start_worker, endpoint: Endpoint, client: Client, topic):
    """A producer with chunking on splits a message over the broker's limit (5 MB) into chunks; the
    consumer joins them. The worker delivered such a message whole, but its dead-letter producer had
    no chunking: the republish was refused (MessageTooBig) and retried for ever, the original never
    settled. (pulsar-lite's dispatch of chunked messages sometimes stalls the message after one, so
    this runs on Apache Pulsar only.)"""
    big = bytes(range(256)) * (1024 * 26)  # 6.5 MiB: two chunks
    ok_sub = make_sub(topic, endpoint.url, name="whole", content="raw")
    dlq = topic + "-dlq"
    failing = make_sub(topic, endpoint.url + "/fail", name="fails", content="raw", max_deliver=1,
                       dead_letter_topic=dlq)
    endpoint.behaviour = lambda rec: web.Response(status=500 if rec.headers["Pubsub-Subscription"] == "fails" else 204)
    watcher = client.watch(dlq)
    await start_worker(ok_sub, failing)
    producer = client.client.create_producer(topic, batching_enabled=False, chunking_enabled=True)
    producer.send(big, properties={"kind": "large"})
    producer.close()
    dead = await asyncio.to_thread(Client.drain, watcher, 1, 60)
    assert len(dead) == 1 and dead[0].data() == big
    assert dead[0].properties()["pubsub.last_status"] == "500"
    whole = [r for r in endpoint.requests if r.headers["Pubsub-Subscription"] == "whole"]
    assert [r.body == big for r in whole] == [True]
    async with aiohttp.ClientSession() as session:
        for sub in (ok_sub, failing):  # every chunk acked, not only the last
            async def backlog(s: Subscription = sub) -> Any:
                entry = await broker_admin.subscription_stats(session, brokers.admin_url(broker), s)
                return (entry or {}).get("msgBacklog")
            async def drained() -> bool:
                return await backlog() == 0

            await eventually(drained, timeout=30, what=f"{sub.name}: backlog 0", interval=0.5)


SECRET = b"push-worker-test-secret-of-32-bytes!"
FORGED = b"another-secret-of-32-bytes-long!!!"  # signs tokens the secured broker cannot verify


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, certificate) -> Iterator[apache_pulsar.ApachePulsar]:
    """An Apache Pulsar as production clusters run it: token authentication and authorization, TLS
    with a private CA beside the plain ports. Role `worker` may consume and produce in p-test/main."""
    broker = apache_pulsar.start(tmp_path_factory.mktemp("secured"), token_secret=SECRET, tls=certificate)
    try:
        apache_pulsar.ensure_namespace(broker.admin_url, "p-test", token=broker.admin_token)
        status, _ = apache_pulsar.admin_request(broker.admin_url, "POST",
                                                "/admin/v2/namespaces/p-test/main/permissions/worker",
                                                ["consume", "produce"], token=broker.admin_token)
        assert status == 204
        yield broker
    finally:
        broker.stop()


def publish_as_admin(broker: apache_pulsar.ApachePulsar, topic: str, count: int) -> None:
    client = pulsar.Client(broker.url, authentication=pulsar.AuthenticationToken(broker.admin_token),
                           logger=quiet_logger())
    try:
        producer = client.create_producer(topic, batching_enabled=False)
        for i in range(count):
            producer.send(b"m%d" % i)
    finally:
        client.close()


def backlog_of(w: Any, sub: Subscription) -> Any:
    return w.metrics.registry.get_sample_value("pushworker_subscription_backlog",
                                               {"project": sub.tenant, "subscription": sub.name})


@pytest.mark.apache_pulsar
async def test_a_broker_that_wants_tokens_gets_the_workers_token_on_its_admin_api_too(
        secured, start_worker, endpoint: Endpoint, topic):
    """Production clusters authenticate: the worker sent its token on the binary protocol but not to
    the admin API, whose 401 read as "no such topic": no backlog metric (nothing for the HPA), no
    expiry, no word in the log. Now the token goes with the admin calls too, and a refusal (here: the
    role may consume but not unload a topic, to evict a stale consumer) is logged with the broker's
    reason and counted. The worker's admin URL here is a broker that does not own the topic: it
    redirects (307) to the one that does, as Apache Pulsar's brokers do in a cluster; the redirect
    was not followed, the reading lost the same silent way."""
    redirected: list[str] = []

    async def not_the_owner(request: web.Request) -> web.StreamResponse:
        redirected.append(request.headers.get("Authorization", ""))
        raise web.HTTPTemporaryRedirect(secured.admin_url + request.path_qs)

    runner, url = await serve("/{tail:.*}", not_the_owner, method="*")
    other_broker = url.removesuffix("/push")
    endpoint.behaviour = lambda rec: web.Response(status=503)
    sub = make_sub(topic, endpoint.url, max_deliver=100, retry=RetryPolicy(30, 30))
    admin_client = pulsar.Client(secured.url, authentication=pulsar.AuthenticationToken(secured.admin_token),
                                 logger=quiet_logger())
    stale = admin_client.subscribe(topic, sub.pulsar_subscription, consumer_type=pulsar.ConsumerType.Shared,
                                   consumer_name="someone-else", receiver_queue_size=1)
    try:
        worker_token = apache_pulsar.token(SECRET, "worker")
        settings = PulsarSettings(service_url=secured.url, admin_url=other_broker, backlog_interval_seconds=0.5,
                                  auth_token=worker_token)
        with capture_logs() as logged:
            w = await start_worker(sub, pulsar=settings)
            publish_as_admin(secured, topic, 5)
            await eventually(lambda: backlog_of(w, sub) == 5, timeout=30, what="the backlog read with the token")
        refused = [e for e in logged if e["event"] == "stale consumer check failed"]
        assert refused and "refused the token" in refused[0]["error"], logged
        assert "UNLOAD" in refused[0]["error"] and "admin of their tenants" in refused[0]["error"]
        assert w.metrics.registry.get_sample_value("pushworker_broker_errors_total", {"operation": "admin"}) == 1
        assert not [e for e in logged if e["event"] == "backlog read failed"]
        assert redirected and set(redirected) == {f"Bearer {worker_token}"}
    finally:
        stale.close()
        admin_client.close()
        await runner.cleanup()


@pytest.mark.apache_pulsar
async def test_a_broker_behind_a_private_ca_is_trusted_on_both_its_protocols(
        secured, certificate, start_worker, endpoint: Endpoint, topic):
    """`pulsar.tls_trust_certs_file` was the binary protocol's trust only: the admin API over https,
    signed by the same private CA, failed verification at every backlog read (logged with the
    error's type only). Now it is trusted there too, as Pulsar's own admin client does; and the
    binary protocol over TLS, with the host name checked, is proven on Apache Pulsar."""
    endpoint.behaviour = lambda rec: web.Response(status=503)
    sub = make_sub(topic, endpoint.url, max_deliver=100, retry=RetryPolicy(30, 30))
    settings = PulsarSettings(service_url=secured.tls_url, tls_trust_certs_file=str(certificate[0]),
                              admin_url=secured.tls_admin_url, backlog_interval_seconds=0.5,
                              auth_token=apache_pulsar.token(SECRET, "worker"))
    with capture_logs() as logged:
        w = await start_worker(sub, pulsar=settings)
        publish_as_admin(secured, topic, 4)
        await eventually(lambda: backlog_of(w, sub) == 4 and len(endpoint.requests) >= 4, timeout=30,
                         what="deliveries over TLS and the backlog read over https")
    assert not [e for e in logged if e["event"] == "backlog read failed"], logged


@pytest.mark.apache_pulsar
async def test_a_metrics_endpoint_that_wants_tokens_gets_the_workers(secured, start_worker, endpoint: Endpoint, topic):
    """With `authenticateMetricsEndpoint`, the broker's /metrics/ answers 401 without a token: the
    backlog read from `pulsar.metrics_url` failed at every interval, logged as a bare
    ClientResponseError. The worker's token goes there too now."""
    endpoint.behaviour = lambda rec: web.Response(status=503)
    sub = make_sub(topic, endpoint.url, max_deliver=100, retry=RetryPolicy(30, 30))
    settings = PulsarSettings(service_url=secured.url, metrics_url=secured.admin_url + "/metrics/",
                              backlog_interval_seconds=0.5, auth_token=apache_pulsar.token(SECRET, "worker"))
    with capture_logs() as logged:
        w = await start_worker(sub, pulsar=settings)
        publish_as_admin(secured, topic, 3)
        await eventually(lambda: backlog_of(w, sub) == 3, timeout=30, what="the backlog read from /metrics/")
    assert not [e for e in logged if e["event"] == "backlog read failed"], logged
    session = broker_admin.make_session()  # without the token: said as what to set
    forged = broker_admin.make_session(token=apache_pulsar.token(FORGED, "worker"))
    try:
        with pytest.raises(broker_admin.AdminError, match=r"wants a token \(set PUSH_WORKER_PULSAR_TOKEN"):
            await BacklogReader(session, None, secured.admin_url + "/metrics/").read([sub])
        # A token the broker cannot verify: any verified token may read /metrics/, so no role advice.
        # The reason is the title of the broker's HTML error page, on the log line's one line.
        with pytest.raises(broker_admin.AdminError, match=r"^pulsar.metrics_url refused the token \(HTTP 401: "
                           r"Error 401 Authentication required\); the broker does not accept it"):
            await BacklogReader(forged, None, secured.admin_url + "/metrics/").read([sub])
    finally:
        await session.close()
        await forged.close()


@pytest.mark.apache_pulsar
async def test_readiness_names_the_token_when_an_authenticating_broker_does_not_answer(
        secured, redis_target, endpoint: Endpoint, topic):
    """Apache Pulsar drops a connection whose token it refuses, unanswered: the client sees the same
    timeout as from a dead broker. /readyz said "broker unreachable" only; with a token configured
    it names the token too, the one thing that may be wrong on a broker that is up."""
    forged = apache_pulsar.token(FORGED, "worker")
    settings = make_settings(secured.url, redis_target.settings, (make_sub(topic, endpoint.url),),
                             pulsar=PulsarSettings(service_url=secured.url, auth_token=forged,
                                                   operation_timeout_seconds=5))
    w = Worker(settings, worker_id="w-forged")
    try:
        await w.start()
        async def refused() -> bool:
            return (await w.readiness())[1] == "broker unreachable or refusing PUSH_WORKER_PULSAR_TOKEN"

        await eventually(refused, timeout=30, what="readiness to name the refused token", interval=0.2)
    finally:
        await w.close()


@pytest.mark.apache_pulsar
async def test_publish_uses_the_workers_token_and_tls_trust(secured, certificate, tmp_path, topic):
    """`push-worker publish` built a client of its own with neither `PUSH_WORKER_PULSAR_TOKEN` nor
    `pulsar.tls_trust_certs_file`: on a cluster that authenticates it timed out ("no answer from the
    broker"), and over TLS with a private CA it could not connect."""
    token = {"PUSH_WORKER_PULSAR_TOKEN": apache_pulsar.token(SECRET, "worker")}
    code, out, err = await cli("publish", topic, "plain", "--service-url", secured.url, extra_env=token)
    assert code == 0 and out.strip(), err
    config = tmp_path / "w.yaml"
    config.write_text(json.dumps({"pulsar": {"service_url": secured.tls_url,
                                             "tls_trust_certs_file": str(certificate[0])}}))
    code, out, err = await cli("publish", topic, "over tls", "-c", str(config), extra_env=token)
    assert code == 0 and out.strip(), err
    # Without a token the broker drops the connection unanswered: the one line says what to check.
    code, _, err = await cli("publish", topic, "no token", "--service-url", secured.url)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "$PUSH_WORKER_PULSAR_TOKEN" in err, err
