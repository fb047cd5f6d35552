"""The operator API (`admin:` listener, /v1) against a real worker, broker, Redis and endpoint: what
it shows, what it changes (through the CLI's operations), who may do what, and that every answer is
the OpenAPI document's."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import urllib.parse
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import pytest
import structlog
import yaml
from aiohttp import web
from openapi_spec_validator import validate

from tests.support.admin import ApiClient, admin_settings, new_issuer, write_jwks
from tests.support.builders import TEST_DEFAULTS
from tests.support.endpoints import Endpoint, Received
from tests.support.helpers import cli, eventually
from tests.support.pulsar_client import Client
from worker.api.routes import openapi_document
from worker.model.config import FleetSettings

ECHOED = "upstream says no"


def definition(name: str, topic: str, url: str, **extra: Any) -> dict[str, Any]:
    # The breaker off, as in every test not about it (tests/support/builders.push_sub says why).
    return {"name": name, "topic": topic, **TEST_DEFAULTS, "deliver": {"mode": "push", "push": {"url": url,
            "bearer_token": {"secret": "push-token"}, "breaker": "off"}}, **extra}


async def created(w: Any, caller: ApiClient, name: str, topic: str, url: str, **extra: Any) -> None:
    """A subscription created through the API (201), once the worker serves it."""
    status, body = await caller.call("POST", "/v1/projects/p-a/subscriptions", definition(name, topic, url, **extra))
    assert status == 201, body
    await eventually(lambda: f"p-a/{name}" in w.dispatchers, what="the worker serves it")


@pytest.fixture
async def fleet(start_worker, start_admin, tmp_path: Path):
    """A worker with the admin listener; clients per principal; the secret its subscriptions use."""
    secrets = tmp_path / "secrets"
    for project in ("p-a", "p-b"):
        (secrets / project).mkdir(parents=True)
        (secrets / project / "push-token").write_text(f"{project}-bearer-{uuid.uuid4().hex}")
    issuer = new_issuer()
    settings, tokens = admin_settings(tmp_path / "admin", issuer)
    w = await start_worker(secrets_dir=secrets, fleet=FleetSettings(name="api-" + uuid.uuid4().hex[:8],
                                                                    lease_seconds=3, heartbeat_seconds=0.5))
    base = f"http://127.0.0.1:{(await start_admin(w, settings)).port}"
    clients = {name: ApiClient(base, token) for name, token in tokens.items()}
    return w, base, clients, issuer, secrets, tmp_path / "admin"


def test_the_openapi_document_is_valid_openapi_3_1():
    validate(openapi_document())


async def test_an_operator_sees_why_messages_fail_and_gets_them_delivered_again(
        fleet, endpoint: Endpoint, client: Client):
    w, _, clients, _, secrets, _ = fleet
    alice = clients["alice"]
    topic = f"persistent://p-a/main/orders-{uuid.uuid4().hex[:8]}"
    healthy = False

    def answer(rec: Received) -> web.Response:
        if healthy:
            return web.Response(status=204)
        # An endpoint that echoes what it got, credentials included: the log must not keep them.
        return web.Response(status=503, text=f"{ECHOED}; you sent {rec.headers.get('Authorization')}")

    endpoint.behaviour = answer
    status, created = await alice.call("POST", "/v1/projects/p-a/subscriptions",
                                       definition("orders", topic, endpoint.url, dead_letter={"topic": topic + "-dlq"}))
    assert status == 201, created
    assert created["name"] == "orders" and created["definition"]["topic"] == topic
    key = "p-a/orders"
    await eventually(lambda: key in w.dispatchers, what="the worker serves the new subscription")

    ids = client.publish(topic, [b"m%d" % i for i in range(4)])
    await eventually(lambda: w.dispatchers[key].stats.dead_lettered == 4, what="all dead-lettered")

    async def failing_row() -> dict[str, Any]:
        _, listed = await alice.call("GET", "/v1/projects/p-a/subscriptions")
        return next(r for r in listed["subscriptions"] if r["name"] == "orders")

    async def reported() -> bool:  # status reports go every 5 s
        row = await failing_row()
        return row["attempts_recent"] == 12 and row["last_error"] is not None

    await eventually(reported, timeout=15, what="the failures reported")
    row = await failing_row()
    assert row["workers"] == ["w0"] and row["outcome_shares"]["5xx"] == 1.0 and row["last_error"]["status"] == "503"
    assert row["p95_latency_ms"] is not None and row["counters"]["dead_lettered"] == 4

    status, log = await alice.call("GET", f"/v1/projects/p-a/subscriptions/orders/messages/{ids[0]}")
    assert status == 200
    attempts = [e for e in log["history"] if "result" in e]
    assert [(e["attempt"], e["status"]) for e in attempts] == [(1, "503"), (2, "503"), (3, "503")]
    assert all(e["answer"].startswith(ECHOED) for e in attempts)
    bearer = (secrets / "p-a" / "push-token").read_text()
    assert all(bearer not in e["answer"] and "[redacted]" in e["answer"] for e in attempts), attempts
    assert log["history"][-1]["event"] == "dead-lettered"
    # A viewer reads the attempts, never an answer: one may echo the credential in a form no redaction foresaw.
    _, viewed = await clients["victor"].call("GET", f"/v1/projects/p-a/subscriptions/orders/messages/{ids[0]}")
    assert [(e["attempt"], e["status"]) for e in viewed["history"] if "result" in e] == [(1, "503"), (2, "503"),
                                                                                         (3, "503")]
    assert {e["answer"] for e in viewed["history"] if "result" in e} == {"(shown to operators only)"}
    _, dead_viewed = await clients["victor"].call("GET", f"/v1/projects/p-a/subscriptions/orders/dead-letters/{ids[1]}")
    assert {e["answer"] for e in dead_viewed["history"] if "result" in e} == {"(shown to operators only)"}

    status, dead = await alice.call("GET", "/v1/projects/p-a/subscriptions/orders/messages?state=dead")
    assert status == 200 and sorted(m["message_id"] for m in dead["messages"]) == sorted(ids)
    status, one = await alice.call("GET", f"/v1/projects/p-a/subscriptions/orders/dead-letters/{ids[1]}")
    assert status == 200 and one["data"] == "m1" and one["data_truncated"] is False

    healthy = True
    before = len(endpoint.requests)
    status, result = await alice.call("POST", "/v1/projects/p-a/subscriptions/orders/redrive",
                                      {"message_id": ids[2], "rate": 100})
    assert status == 200 and result["redriven"] == 1, result
    assert [r.headers["Pubsub-Message-Id"] for r in endpoint.requests[before:]] == [ids[2]]
    status, result = await alice.call("POST", "/v1/projects/p-a/subscriptions/orders/redrive",
                                      {"since": "2020-01-01T00:00:00Z", "status": ["5xx"], "rate": 100})
    assert status == 200 and result["redriven"] == 3, result
    assert sorted(r.headers["Pubsub-Message-Id"] for r in endpoint.requests[before:]) == sorted(ids)


async def test_subscriptions_are_created_patched_paused_sought_and_deleted_as_subs_apply_does(
        fleet, endpoint: Endpoint, client: Client):
    w, _, clients, _, _, _ = fleet
    alice = clients["alice"]
    topic = f"persistent://p-a/main/crud-{uuid.uuid4().hex[:8]}"
    path = "/v1/projects/p-a/subscriptions/crud"
    created, _ = await alice.call("POST", "/v1/projects/p-a/subscriptions", definition("crud", topic, endpoint.url))
    assert created == 201
    status, again = await alice.call("POST", "/v1/projects/p-a/subscriptions", definition("crud", topic, endpoint.url))
    assert status == 409 and again["error"]["code"] == "conflict"
    await eventually(lambda: "p-a/crud" in w.dispatchers, what="served")

    status, patched = await alice.call("PATCH", path, {"max_deliver": 9, "ack_deadline_seconds": 7})
    assert status == 200 and patched["definition"]["max_deliver"] == 9
    assert patched["definition"]["deliver"]["push"]["url"] == endpoint.url  # fields left out keep their value
    await eventually(lambda: w.dispatchers["p-a/crud"].sub.max_deliver == 9, what="the worker applies the change")
    status, refused = await alice.call("PATCH", path, {"type": "exclusive"})
    assert status == 400 and "immutable" in refused["error"]["message"]
    status, refused = await alice.call("PATCH", path, {"max_deliver": "many"})
    assert status == 400 and "max_deliver" in refused["error"]["message"]
    assert (await alice.call("GET", path))[1]["definition"]["max_deliver"] == 9  # a refused change wrote nothing

    status, paused = await alice.call("POST", path + "/pause", {"wait_seconds": 20})
    assert status == 200 and paused["result"] == "paused"
    assert "p-a/crud" not in w.dispatchers  # the answer came once the worker had stopped
    held = client.publish(topic, [b"while-paused"])
    assert (await alice.call("GET", path))[1]["status"]["state"] == "Paused"
    assert (await alice.call("POST", path + "/resume"))[1]["result"] == "resumed"
    await eventually(lambda: any(r.headers["Pubsub-Message-Id"] == held[0] for r in endpoint.requests),
                     what="delivered after the resume")

    status, sought = await alice.call("POST", path + "/seek", {"to": "latest"})
    assert status == 200 and sought["result"] == "sought", sought
    status, purged = await alice.call("POST", path + "/purge")
    assert status == 200 and purged["result"] == "purged", purged
    status, missing = await alice.call("POST", path + "/discard", {"message_id": "9:9:-1:-1"})
    assert status == 404 and "nothing to discard" in missing["error"]["message"]
    status, bad = await alice.call("POST", path + "/seek", {"to": "yesterday"})
    assert status == 400 and bad["error"]["code"] == "bad_request"

    status, deleted = await alice.call("DELETE", path)
    assert status == 200 and deleted["result"] == "deleted"
    await eventually(lambda: "p-a/crud" not in w.dispatchers, what="the worker stops serving it")
    assert (await alice.call("GET", path))[0] == 404


async def test_a_project_never_learns_of_another_projects_subscriptions_and_a_viewer_cannot_act(
        fleet, endpoint: Endpoint):
    w, base, clients, issuer, _, directory = fleet
    alice, victor, bob, root = clients["alice"], clients["victor"], clients["bob"], clients["root"]
    topic = f"persistent://p-a/main/private-{uuid.uuid4().hex[:8]}"
    with structlog.testing.capture_logs() as logged:
        assert (await alice.call("POST", "/v1/projects/p-a/subscriptions",
                                 definition("private", topic, endpoint.url)))[0] == 201
    assert {"subject": "alice", "project": "p-a", "action": "create", "target": "private", "result": "ok"}.items() \
        <= next(e for e in logged if e["event"] == "audit").items()
    await eventually(lambda: "p-a/private" in w.dispatchers, what="served")

    # Another project's token: the same 404 as for a project or subscription that does not exist.
    nothing = await bob.call("GET", "/v1/projects/p-nothing/subscriptions")
    for method, path, body in [("GET", "/v1/projects/p-a/subscriptions", None),
                               ("GET", "/v1/projects/p-a/subscriptions/private", None),
                               ("GET", "/v1/projects/p-a/subscriptions/private/messages?state=retrying", None),
                               ("POST", "/v1/projects/p-a/subscriptions/private/pause", {}),
                               ("PATCH", "/v1/projects/p-a/subscriptions/private", {"max_deliver": 1}),
                               ("DELETE", "/v1/projects/p-a/subscriptions/private", None),
                               ("POST", "/v1/projects/p-a/subscriptions", definition("x", topic, endpoint.url))]:
        assert await bob.call(method, path, body) == nothing, (method, path)
    assert nothing[0] == 404
    assert (await bob.call("GET", "/v1/projects"))[1] == {"projects": ["p-b"]}
    assert "p-a/private" in w.dispatchers  # nothing of it changed

    # A definition in the caller's project path but another project's topic: refused, nothing written.
    status, refused = await bob.call("POST", "/v1/projects/p-b/subscriptions", definition("steal", topic, endpoint.url))
    assert status == 400 and "p-b" in refused["error"]["message"]
    assert [r["name"] for r in (await root.call("GET", "/v1/projects/p-a/subscriptions"))[1]["subscriptions"]] == [
        "private"]

    # A viewer reads, and is refused every action.
    assert (await victor.call("GET", "/v1/projects/p-a/subscriptions/private"))[0] == 200
    for method, path in [("POST", "/pause"), ("POST", "/resume"), ("POST", "/redrive"), ("PATCH", ""),
                         ("DELETE", "")]:
        status, body = await victor.call(method, "/v1/projects/p-a/subscriptions/private" + path, {})
        assert status == 403 and body["error"]["code"] == "forbidden", (method, path)
    assert "p-a/private" in w.dispatchers

    # No token, a wrong one, a cookie in place of the header: nothing.
    for anonymous in (ApiClient(base, None), ApiClient(base, "not-a-token")):
        status, body = await anonymous.call("GET", "/v1/projects/p-a/subscriptions")
        assert status == 401 and body["error"]["code"] == "unauthorized"
    async with aiohttp.ClientSession(cookies={"pw_console": alice.token or ""}) as session, \
            session.get(base + "/v1/projects/p-a/subscriptions") as response:
        assert response.status == 401  # the API takes the header only: a cookie cannot be sent for it by another site

    # JWTs: the issuer's with roles work, anything else does not.
    jwt_client = ApiClient(base, issuer.token("carol@example.com", ["viewer:p-a"]))
    assert (await jwt_client.call("GET", "/v1/me"))[1] == {"subject": "carol@example.com", "roles": ["viewer:p-a"]}
    assert (await jwt_client.call("GET", "/v1/projects/p-a/subscriptions/private"))[0] == 200
    assert (await jwt_client.call("POST", "/v1/projects/p-a/subscriptions/private/pause", {}))[0] == 403
    other_issuer = new_issuer()
    other_issuer.kid = issuer.kid  # a forger who knows the key id
    refused_tokens = [
        other_issuer.token("mallory", ["admin"]),
        issuer.token("mallory", ["admin"], expires_in=-120),
        issuer.token("mallory", ["admin"], audience="someone-else"),
        issuer.token("mallory", ["admin"], issuer="https://evil.example/"),
        issuer.token("mallory", ["admin:p-a"]),  # not a role
        _unsigned({"iss": "https://login.test.example/", "aud": "push-worker", "sub": "mallory", "exp": 2**31,
                   "push_worker_roles": ["admin"]}),
    ]
    for token in refused_tokens:
        assert (await ApiClient(base, token).call("GET", "/v1/me"))[0] == 401
    bob_jwt = ApiClient(base, issuer.token("dave", ["operator:p-b"]))
    assert await bob_jwt.call("GET", "/v1/projects/p-a/subscriptions/private") == nothing

    # The issuer rotates its key: the new key's tokens are accepted without a restart.
    rotated = new_issuer()
    write_jwks(directory / "jwks.json", rotated)
    assert (await ApiClient(base, rotated.token("erin", ["viewer:p-a"])).call("GET", "/v1/me"))[0] == 200


def _unsigned(claims: dict[str, Any]) -> str:
    import base64

    def part(data: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims)}."


async def test_the_listener_is_off_unless_configured_and_refuses_to_start_without_credentials(start_worker):
    w = await start_worker()
    assert w.admin is None
    from worker.model.config import parse_settings
    from worker.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="nothing is served anonymously"):
        parse_settings({"admin": {"port": 9465}})
    with pytest.raises(ConfigError, match="jwks_url: must be an https"):
        parse_settings({"admin": {"auth": {"issuer": "x", "audience": "y", "jwks_url": "http://idp.example/k"}}})
    with pytest.raises(ConfigError, match="roles"):
        parse_settings({"admin": {"tokens": [{"subject": "a", "file": "/f", "roles": ["owner:p-a"]}]}})
    await asyncio.sleep(0)


async def test_every_refusal_to_a_known_caller_is_audited_and_failed_logins_are_too_at_a_bounded_rate(
        fleet, endpoint: Endpoint):
    """Refusals by role, scope, body, form and confirmation wrote nothing; failed console logins no
    line at all (#61). Anonymous requests are counted, not logged (tests/test_admin_process.py)."""
    _, base, clients, _, _, _ = fleet
    topic = f"persistent://p-a/main/aud-{uuid.uuid4().hex[:8]}"
    assert (await clients["alice"].call("POST", "/v1/projects/p-a/subscriptions",
                                        definition("aud", topic, endpoint.url)))[0] == 201
    with structlog.testing.capture_logs() as logged:
        assert (await clients["victor"].call("POST", "/v1/projects/p-a/subscriptions/aud/pause", {}))[0] == 403
        assert (await clients["bob"].call("GET", "/v1/projects/p-a/subscriptions/aud"))[0] == 404
        async with aiohttp.ClientSession() as session:
            async with session.post(base + "/v1/projects/p-a/subscriptions/aud/seek", data="{not json",
                                    headers={"Authorization": f"Bearer {clients['alice'].token}",
                                             "Content-Type": "application/json"}) as answer:
                assert answer.status == 400
            for _ in range(5):
                async with session.post(base + "/console/login", data={"token": "guess"}) as answer:
                    assert answer.status == 401
        assert (await ApiClient(base, "forged").call("GET", "/v1/me"))[0] == 401
    audits = [e for e in logged if e["event"] == "audit"]
    by_subject = {e["subject"]: e for e in audits}
    assert by_subject["victor"]["result"].startswith("refused: 403") and by_subject["victor"]["project"] == "p-a"
    assert by_subject["bob"]["result"] == "refused: 404 no such project" and by_subject["bob"]["target"] == "aud"
    assert by_subject["alice"]["result"].startswith("refused: 400") and "JSON" in by_subject["alice"]["result"]
    logins = [e for e in audits if e["action"] == "console login"]
    assert len(logins) == 1 and logins[0]["failures"] == 1 and logins[0]["result"] == "refused: not a valid token"
    assert len(audits) == 4  # nothing for the anonymous request, one line a second for failed logins


async def test_inputs_the_api_refuses_are_refused_as_documented_and_never_answer_500(
        fleet, endpoint: Endpoint, client: Client):
    w, base, clients, issuer, _, _ = fleet
    alice = clients["alice"]
    topic = f"persistent://p-a/main/edge-{uuid.uuid4().hex[:8]}"
    created = await alice.call("POST", "/v1/projects/p-a/subscriptions", definition("edge", topic, endpoint.url))
    assert created[0] == 201
    path = "/v1/projects/p-a/subscriptions/edge"
    # A superscript digit is a digit to str.isdigit; JSON nested 5,000 deep overflowed the parser.
    assert (await alice.call("GET", path + "/messages?state=retrying&limit=\u00b2"))[0] == 400
    deep = "[" * 5000 + "]" * 5000
    async with aiohttp.ClientSession() as session, session.post(
            base + path + "/seek", data=deep, headers={"Authorization": f"Bearer {alice.token}",
                                                       "Content-Type": "application/json"}) as answer:
        assert answer.status == 400 and "nested too deep" in (await answer.json())["error"]["message"]
    # A trailing newline passed every `^...$` pattern: refused now, and nothing is written.
    for bad in (definition("nl\n", topic, endpoint.url), definition("nl", topic + "\n", endpoint.url)):
        status, body = await alice.call("POST", "/v1/projects/p-a/subscriptions", bad)
        assert status == 400, body
    assert (await alice.call("GET", "/v1/projects/p-a/subscriptions/nl%0A"))[0] == 404
    assert [r["name"] for r in (await alice.call("GET", "/v1/projects/p-a/subscriptions"))[1]["subscriptions"]] == [
        "edge"]
    assert (await ApiClient(base, issuer.token("", ["admin"])).call("GET", "/v1/me"))[0] == 401  # an empty sub
    # A missing secret is named, but not where the process reads secrets from.
    secret_def = {**definition("secretive", topic, endpoint.url)}
    secret_def["deliver"]["push"]["bearer_token"] = {"secret": "missing-token"}
    secret_def["topic"] = topic + "-s"
    assert (await alice.call("POST", "/v1/projects/p-a/subscriptions", secret_def))[0] == 201
    await eventually(lambda: "p-a/secretive" in w.dispatchers, what="served")
    [mid] = client.publish(topic + "-s", [b"x"])

    async def attempted() -> Any:
        status, log = await alice.call("GET", f"/v1/projects/p-a/subscriptions/secretive/messages/{mid}")
        history = log["history"] if status == 200 else []  # 404 until its first attempt is written
        return history if any("missing-token" in json.dumps(e) for e in history) else None

    await eventually(attempted, timeout=15, what="an attempt not sent for want of the secret")
    shown = json.dumps(await attempted())
    assert "[secrets.dir]" in shown and "/secrets/" not in shown, shown
    # The console's session ends with a JWT that ends sooner than 8 h; a notice comes from the console only.
    short = issuer.token("carol", ["operator:p-a"], expires_in=120)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        async with session.post(base + "/console/login", data={"token": short}, allow_redirects=False) as answer:
            assert answer.status == 303
            assert 0 < int(answer.cookies["pw_console"]["max-age"]) <= 120
        async with session.get(base + "/console/projects/p-a/subscriptions/edge?notice=Your+account+is+locked",
                               cookies={"pw_console": short}) as answer:
            assert answer.status == 200 and "locked" not in await answer.text()


async def test_a_caller_past_its_rate_or_concurrency_gets_429_and_others_are_served(fleet):
    _, base, clients, _, _, _ = fleet
    async with aiohttp.ClientSession() as session:
        async def me(token: str) -> tuple[int, str | None]:
            async with session.get(base + "/v1/me", headers={"Authorization": f"Bearer {token}"}) as answer:
                await answer.read()
                return answer.status, answer.headers.get("Retry-After")

        answers = await asyncio.gather(*(me(clients["victor"].token or "") for _ in range(120)))
        limited = [a for a in answers if a[0] == 429]
        assert limited and all(retry is not None and int(retry) >= 1 for _, retry in limited), answers
        assert {status for status, _ in answers} == {200, 429}
        assert (await me(clients["alice"].token or ""))[0] == 200  # another caller is served meanwhile


async def test_a_jwt_and_a_static_token_of_one_subject_are_two_callers_and_limited_requests_are_audited(fleet):
    """A JWT whose subject equals a static token's shared its rate limit and its audit identity: now
    they are two callers (the JWT's flood leaves the token's alice served), every audit line says
    which kind of credential spoke, and the flood's 429s are audited, one line a second with a count."""
    _, base, clients, issuer, _, _ = fleet
    impostor = issuer.token("alice", ["viewer:p-b"])  # the issuer's "alice" is not the token's alice
    async with aiohttp.ClientSession() as session:
        async def me(token: str) -> int:
            async with session.get(base + "/v1/me", headers={"Authorization": f"Bearer {token}"}) as answer:
                await answer.read()
                return answer.status

        with structlog.testing.capture_logs() as logged:
            answers = await asyncio.gather(*(me(impostor) for _ in range(150)))
            assert 429 in answers
            assert await me(clients["alice"].token or "") == 200  # the static token's alice is not limited
            await me(impostor)
    refused = [line for line in logged if line.get("event") == "audit" and "429" in str(line.get("result"))]
    assert refused and all(line["via"] == "jwt" and line["subject"] == "alice" for line in refused), refused
    assert len(refused) == 1 and refused[0]["refusals"] == 1, refused  # the rest of the second's are counted


def test_limited_requests_are_audited_a_line_a_second_per_caller_with_how_many_it_stands_for():
    """routes.LimitedAudit with a hand-driven clock."""
    from worker.api.auth import Principal
    from worker.api.routes import LimitedAudit
    from worker.model.admin_settings import Grants

    now = [100.0]
    audit = LimitedAudit(clock=lambda: now[0])
    token, jwt = Principal("alice", Grants(), "t"), Principal("alice", Grants(), "j", via="jwt")
    with structlog.testing.capture_logs() as logged:
        for _ in range(5):
            audit.limited(jwt, "rate", "GET /v1/me")
        audit.limited(token, "rate", "GET /v1/me")  # another caller: a line of its own
        now[0] += 1.0
        audit.limited(jwt, "concurrency", "GET /v1/me")
    assert [(line["via"], line["refusals"], line["result"]) for line in logged] == [
        ("jwt", 1, "refused: 429 (rate)"), ("token", 1, "refused: 429 (rate)"),
        ("jwt", 5, "refused: 429 (concurrency)")]


async def test_slow_and_surplus_connections_are_closed_not_kept(fleet):
    """250 slowloris connections were held over 40 s (#61): a request head must come within 10 s, and
    past 256 connections the listener answers 503 at once."""
    _, base, _, _, _, _ = fleet
    port = int(base.rsplit(":", 1)[1])
    slow_reader, slow_writer = await asyncio.open_connection("127.0.0.1", port)
    slow_writer.write(b"GET /v1/me HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    await slow_writer.drain()
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(255)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in answer
        writer.close()
        started = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(slow_reader.read(), 15) == b""  # closed by the listener
        assert asyncio.get_running_loop().time() - started <= 12
    finally:
        slow_writer.close()
        for _, w in held:
            w.close()


async def test_a_body_that_trickles_in_is_cut_off_within_the_bound_of_a_head(fleet):
    """A request body sent a byte at a time held its connection for as long as the sender liked (150 s
    and counting), even without a token: the body must come within the head's bound (10 s), or the
    listener answers 408 and closes the connection."""
    _, base, _, _, _, _ = fleet
    port = int(base.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/projects/p-a/subscriptions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{")
    await writer.drain()
    started = asyncio.get_running_loop().time()

    async def trickle() -> None:
        while True:
            await asyncio.sleep(1)  # a byte a second: the sender's pace, not a synchronisation
            writer.write(b" ")
            await writer.drain()
    sender = asyncio.create_task(trickle())
    try:
        answer = await asyncio.wait_for(reader.read(), 20)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert asyncio.get_running_loop().time() - started <= 12
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        writer.close()


async def test_config_file_subscriptions_answer_409_and_are_no_oracle_for_another_project(
        start_worker, start_admin, endpoint: Endpoint, tmp_path: Path):
    from tests.support.builders import make_sub

    mine = make_sub(f"persistent://p-a/main/sa-{uuid.uuid4().hex[:6]}", endpoint.url, name="static-a")
    theirs = make_sub(f"persistent://p-b/main/sb-{uuid.uuid4().hex[:6]}", endpoint.url, name="static-b")
    w = await start_worker(mine, theirs, fleet=FleetSettings(name="static-" + uuid.uuid4().hex[:8]))
    settings, tokens = admin_settings(tmp_path / "admin")
    base = f"http://127.0.0.1:{(await start_admin(w, settings)).port}"
    alice = ApiClient(base, tokens["alice"])
    status, body = await alice.call("DELETE", "/v1/projects/p-a/subscriptions/static-a")
    assert status == 409 and "config file" in body["error"]["message"], body
    assert "p-a/static-a" in w.dispatchers
    # Named like another project's config-file subscription, on that project's topic: the answer is
    # about this project's tenant, exactly as for any other name (it said "config file").
    answers = [await alice.call("POST", "/v1/projects/p-a/subscriptions", definition(name, theirs.topic, endpoint.url))
               for name in ("static-b", "no-such-name")]
    assert [a[0] for a in answers] == [400, 400]
    assert answers[0][1]["error"]["message"].replace("static-b", "X") == \
        answers[1][1]["error"]["message"].replace("no-such-name", "X"), answers


async def test_the_delivery_log_keeps_every_attempt_with_headers_both_ways_and_search_finds_them(
        fleet, endpoint: Endpoint, client: Client):
    """Every attempt, newest first, with the request's headers (the credential as [redacted]) and the
    answer's (an echoed credential cut out); searched by message id, status class or status, attempt
    number, ordering key and time, in pages that add up to the whole; the hourly counts; a viewer
    reads no header; a bad parameter is one line and a 400."""
    w, _, clients, _, secrets, _ = fleet
    alice, victor = clients["alice"], clients["victor"]
    topic = f"persistent://p-a/main/log-{uuid.uuid4().hex[:8]}"

    def answer(rec: Received) -> web.Response:
        first, odd = rec.headers["Pubsub-Delivery-Attempt"] == "1", rec.body_payload.endswith((b"1", b"3", b"5"))
        echo = {"X-Echo": f"you sent {rec.headers.get('Authorization')}", "X-Upstream": "shard-7"}
        return web.Response(status=503 if first and odd else 204, headers=echo)

    endpoint.behaviour = answer
    status, _ = await alice.call("POST", "/v1/projects/p-a/subscriptions", definition("logged", topic, endpoint.url))
    assert status == 201
    await eventually(lambda: "p-a/logged" in w.dispatchers, what="the worker serves it")
    began = rfc3339_now()
    keyed = client.publish(topic, [b"m0", b"m1", b"m2"], key="customer-7")
    plain = client.publish(topic, [b"m3", b"m4", b"m5"])
    ids = keyed + plain
    await eventually(lambda: w.dispatchers["p-a/logged"].stats.acked == 6, what="all delivered")
    path = "/v1/projects/p-a/subscriptions/logged/log"

    async def search(**query: Any) -> dict[str, Any]:
        status, page = await alice.call("GET", path + "?" + urlencode(query))
        assert status == 200, page
        return page

    async def every_attempt_logged() -> bool:  # the record after an ack rides with the next round trip
        return len((await search(limit=200))["entries"]) == 9

    await eventually(every_attempt_logged, what="nine attempts in the log")
    everything = (await search(limit=200))["entries"]
    assert [e["id"] for e in everything] == sorted((e["id"] for e in everything), key=_entry_order, reverse=True)
    assert sorted((e["message_id"], e["attempt"], e["status"]) for e in everything) == sorted(
        [(m, 1, "204") for m in (ids[0], ids[2], ids[4])] + [(m, 1, "503") for m in (ids[1], ids[3], ids[5])]
        + [(m, 2, "204") for m in (ids[1], ids[3], ids[5])])
    bearer = (secrets / "p-a" / "push-token").read_text()
    for e in everything:
        assert e["request_headers"]["Authorization"] == "[redacted]"
        assert e["request_headers"]["Pubsub-Message-Id"] == e["message_id"]
        echoed = {k.lower(): v for k, v in e["response_headers"].items()}
        assert echoed["x-upstream"] == "shard-7" and "[redacted]" in echoed["x-echo"]
        assert bearer not in json.dumps(e)
    assert [(e["attempt"], e["status"]) for e in (await search(message_id=ids[1]))["entries"]] == [(2, "204"),
                                                                                                   (1, "503")]
    assert len((await search(status="5xx"))["entries"]) == 3
    assert len((await search(status="503"))["entries"]) == 3
    assert len((await search(status="2xx"))["entries"]) == 6
    assert {e["message_id"] for e in (await search(min_attempt=2))["entries"]} == {ids[1], ids[3], ids[5]}
    assert {e["message_id"] for e in (await search(ordering_key="customer-7"))["entries"]} == set(keyed)
    assert len((await search(since=began))["entries"]) == 9
    assert (await search(until="2020-01-01T00:00:00Z"))["entries"] == []
    pages, cursor = [], None
    while True:  # pages of four add up to the whole, in order, with no entry twice
        page = await search(limit=4, **({"cursor": cursor} if cursor else {}))
        pages += page["entries"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert [e["id"] for e in pages] == [e["id"] for e in everything]

    hours: list[dict] = []

    async def counted() -> bool:  # the counts are added once a second (log_upkeep.py)
        nonlocal hours
        hours = (await alice.call("GET", path + "/hours"))[1]["hours"]
        return sum(h["attempts"] for h in hours) == 9

    await eventually(counted, what="the hour's counts")
    assert len(hours) == 72  # the last hour or two hold them (across an hour's end)
    assert sum(h["by_class"].get("5xx", 0) for h in hours) == 3
    assert any(h["p95_latency_ms"] is not None for h in hours[-2:])
    status, viewed = await victor.call("GET", path)
    assert status == 200 and all(e["request_headers"] == {} == e["response_headers"] for e in viewed["entries"])
    _, message = await alice.call("GET", f"/v1/projects/p-a/subscriptions/logged/messages/{ids[1]}")
    assert [e["attempt"] for e in message["log"]] == [1, 2] and message["log"][0]["response_headers"]
    for bad in ({"status": "bogus"}, {"cursor": "xyz"}, {"limit": "0"}, {"since": "yesterday-ish"}):
        status, error = await alice.call("GET", path + "?" + urlencode(bad))
        assert status == 400 and error["error"]["message"] and "\n" not in error["error"]["message"], (bad, error)


def _entry_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


def rfc3339_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def test_an_operator_reads_a_payload_back_from_the_broker_and_replays_a_delivered_message(
        fleet, endpoint: Endpoint, client: Client):
    """The message page's payload (JSON pretty-printed, binary as hex, the whole of it as a download)
    is read back from the broker, for operators only; a replay sends a settled message once more,
    numbered after its last attempt, never retried nor dead-lettered when it fails; a message still
    being delivered is refused (409), an id the topic does not hold is 404."""
    w, _, clients, _, _, _ = fleet
    alice, victor = clients["alice"], clients["victor"]
    topic = f"persistent://p-a/main/replay-{uuid.uuid4().hex[:8]}"
    failing: set[bytes] = {b"\x00\xffbinary"}  # fails its first attempt
    hold: set[bytes] = set()  # fails every attempt

    def answer(rec: Received) -> web.Response:
        body = rec.body_payload
        if body in hold or (body in failing and rec.headers["Pubsub-Delivery-Attempt"] == "1"):
            return web.Response(status=503)
        if body == b"marker" and rec.headers["Pubsub-Delivery-Attempt"] in ("1", "2"):
            return web.Response(status=503)  # its retries measure the subscription's backoff, twice
        return web.Response(status=204)

    endpoint.behaviour = answer
    status, _ = await alice.call("POST", "/v1/projects/p-a/subscriptions", definition(
        "replayed", topic, endpoint.url, dead_letter={"topic": topic + "-dlq"}))
    assert status == 201
    await eventually(lambda: "p-a/replayed" in w.dispatchers, what="the worker serves it")
    [as_json] = client.publish(topic, [b'{"order": 7, "items": ["a"]}'], properties={"kind": "order"}, key="c-7")
    [binary] = client.publish(topic, [b"\x00\xffbinary"])
    await eventually(lambda: w.dispatchers["p-a/replayed"].stats.acked == 2, what="both delivered")
    base = "/v1/projects/p-a/subscriptions/replayed/messages"

    _, shown = await alice.call("GET", f"{base}/{as_json}")
    assert shown["payload"]["encoding"] == "json"
    assert shown["payload"]["text"] == '{\n  "order": 7,\n  "items": [\n    "a"\n  ]\n}'
    assert shown["attributes"] == {"kind": "order"} and shown["ordering_key"] == "c-7"
    _, shown = await alice.call("GET", f"{base}/{binary}")
    assert shown["payload"] == {"size": 8, "truncated": False, "encoding": "hex", "text": "00 ff 62 69 6e 61 72 79"}
    status, data, headers = await alice.raw(f"{base}/{binary}/payload")
    assert status == 200 and data == b"\x00\xffbinary" and "attachment" in headers["Content-Disposition"]
    _, viewed = await victor.call("GET", f"{base}/{binary}")  # the project's data: its viewers read it too
    assert viewed["payload"]["text"] == "00 ff 62 69 6e 61 72 79"
    assert all(e["request_headers"] == {} for e in viewed["log"])
    assert (await victor.raw(f"{base}/{binary}/payload"))[:2] == (200, b"\x00\xffbinary")
    assert (await victor.call("POST", f"{base}/{binary}/replay"))[0] == 403  # acting is the operators'

    before = len(endpoint.requests)
    status, replayed = await alice.call("POST", f"{base}/{binary}/replay")
    assert status == 200 and replayed == {"subscription": "p-a/replayed", "message_id": binary, "attempt": 3,
                                          "result": "delivered"}, replayed
    again = endpoint.requests[before:]
    assert [(r.headers["Pubsub-Message-Id"], r.headers["Pubsub-Delivery-Attempt"]) for r in again] == [(binary, "3")]
    _, shown = await alice.call("GET", f"{base}/{binary}")
    assert [e["attempt"] for e in shown["history"] if "result" in e] == [1, 2, 3]
    assert [(e["attempt"], e["worker"]) for e in shown["log"]][-1] == (3, "replay")

    hold.add(b'{"order": 7, "items": ["a"]}')  # the endpoint fails it now: one attempt, no retry, no dead letter
    before = len(endpoint.requests)
    status, replayed = await alice.call("POST", f"{base}/{as_json}/replay")
    assert status == 200 and replayed["result"] == "failed" and replayed["attempt"] == 2
    assert len(endpoint.requests) - before == 1 and w.dispatchers["p-a/replayed"].stats.dead_lettered == 0
    # Over time too: a message published after it is retried twice with the subscription's backoff, and
    # by its third attempt the failed replay has still had no retry of its own (it would, by then).
    [marker] = client.publish(topic, [b"marker"])
    await eventually(lambda: any(r.headers["Pubsub-Message-Id"] == marker and
                                 r.headers["Pubsub-Delivery-Attempt"] == "3" for r in endpoint.requests),
                     what="the later message's third attempt")
    assert sum(r.headers["Pubsub-Message-Id"] == as_json for r in endpoint.requests[before:]) == 1
    assert w.dispatchers["p-a/replayed"].stats.dead_lettered == 0

    hold.add(b"pending")
    [pending] = client.publish(topic, [b"pending"])  # retried every 0.05-0.2 s: never settled while held
    await eventually(lambda: any(r.headers["Pubsub-Message-Id"] == pending for r in endpoint.requests),
                     what="its first attempt")
    status, refused = await alice.call("POST", f"{base}/{pending}/replay")
    assert status == 409 and "still being delivered" in refused["error"]["message"], refused
    status, _ = await alice.call("POST", f"{base}/999999:0:-1:-1/replay")
    assert status == 404


async def test_a_replay_refuses_what_is_not_settled_goes_one_at_a_time_and_never_numbers_back(
        fleet, endpoint: Endpoint, client: Client, redis_url: str):
    """What broke from outside (#72), each refused: a replay of a message never attempted (paused,
    then published) was sent once and settled as dropped, lost; a replay beside its first attempt
    sent two requests numbered 1; six concurrent replays sent numbers that went back. Now anything not
    settled is 409, one replay of a message at a time (the others 409), and the numbers only go up;
    a failed replay says so in the history, and the message keeps every attempt it had."""
    w, _, clients, _, _, _ = fleet
    alice = clients["alice"]
    topic = f"persistent://p-a/main/replays-{uuid.uuid4().hex[:8]}"
    release = asyncio.Event()
    failing = {b"fails"}

    async def answer(rec: Received) -> web.Response:
        if rec.body_payload == b"slow":
            await release.wait()  # its first attempt stays under way until the test lets it end
        if rec.body_payload in failing:
            return web.Response(status=503)
        return web.Response(status=204)

    endpoint.behaviour = answer
    await created(w, alice, "replays", topic, endpoint.url)
    base = "/v1/projects/p-a/subscriptions/replays"

    # Never attempted: paused, published, replayed while the endpoint fails, resumed.
    assert (await alice.call("POST", f"{base}/pause", {"wait_seconds": 10}))[0] == 200
    [fresh] = client.publish(topic, [b"fails"])
    status, refused = await alice.call("POST", f"{base}/messages/{fresh}/replay")
    assert status == 409 and "no settled delivery" in refused["error"]["message"], refused
    assert not endpoint.requests  # nothing was sent
    assert (await alice.call("POST", f"{base}/resume", {"wait_seconds": 10}))[0] == 200
    await eventually(lambda: len([r for r in endpoint.requests if r.body_payload == b"fails"]) == TEST_DEFAULTS[
        "max_deliver"], timeout=30, what="every attempt of the message, none spent by the refused replay")

    # Its first attempt under way.
    [slow] = client.publish(topic, [b"slow"])
    await eventually(lambda: any(r.body_payload == b"slow" for r in endpoint.requests), what="its first attempt")
    status, refused = await alice.call("POST", f"{base}/messages/{slow}/replay")
    assert status == 409 and "still being delivered" in refused["error"]["message"], refused
    release.set()
    await eventually(lambda: w.dispatchers["p-a/replays"].stats.acked >= 1, what="the slow one acked")
    assert [r.headers["Pubsub-Delivery-Attempt"] for r in endpoint.requests if r.body_payload == b"slow"] == ["1"]

    # Six at once on a delivered message: one goes, five are refused, numbers only go up.
    answers = await asyncio.gather(*(alice.call("POST", f"{base}/messages/{slow}/replay") for _ in range(6)))
    assert sorted(status for status, _ in answers) == [200, 409, 409, 409, 409, 409], answers
    assert [r.headers["Pubsub-Delivery-Attempt"] for r in endpoint.requests if r.body_payload == b"slow"] == ["1", "2"]
    status, again = await alice.call("POST", f"{base}/messages/{slow}/replay")
    assert status == 200 and again["attempt"] == 3
    assert [r.headers["Pubsub-Delivery-Attempt"] for r in endpoint.requests if r.body_payload == b"slow"] == \
        ["1", "2", "3"]

    # A failed replay: settled as it was, said as a failed replay in the history (not a drop).
    failing.add(b"slow")
    status, failed = await alice.call("POST", f"{base}/messages/{slow}/replay")
    assert status == 200 and failed == {"subscription": "p-a/replays", "message_id": slow, "attempt": 4,
                                        "result": "failed"}
    _, shown = await alice.call("GET", f"{base}/messages/{slow}")
    assert shown["history"][-1]["event"] == "replay-failed" and shown["attempts_in_progress"] is None
    assert not [e for e in shown["history"] if e.get("event") == "dropped"]
    _, kept = await alice.call("GET", f"{base}/messages/{fresh}")  # the one replayed before any attempt
    assert [e.get("attempt") for e in kept["history"]] == [1, 2, 3, 3] and kept["history"][-1]["event"] == "dropped"

    status, _ = await alice.call("POST", f"{base}/messages/not-an-id/replay")
    assert status == 404


async def test_a_dead_letter_is_redriven_not_replayed_and_the_dry_run_agrees_with_the_redrive(
        fleet, endpoint: Endpoint, client: Client, tmp_path: Path):
    """A replayed dead letter stayed a dead letter (a later redrive delivered it again). A replay of a
    dead letter is 409, saying to redrive it; the redrive of it delivers it once, and a dry run then
    finds nothing more. `dlq redrive --dry-run --message-id` counts that one letter, and an id no dead
    letter has exits 3 in one line (it counted every letter, exit 0)."""
    w, _, clients, _, secrets, _ = fleet
    alice = clients["alice"]
    topic = f"persistent://p-a/main/dead-{uuid.uuid4().hex[:8]}"
    healthy = False
    endpoint.behaviour = lambda rec: web.Response(status=204 if healthy else 503)
    await created(w, alice, "deadly", topic, endpoint.url, dead_letter={"topic": topic + "-dlq"})
    ids = client.publish(topic, [b"one", b"two"])
    await eventually(lambda: w.dispatchers["p-a/deadly"].stats.dead_lettered == 2, timeout=30,
                     what="both dead-lettered")
    base = "/v1/projects/p-a/subscriptions/deadly"
    status, refused = await alice.call("POST", f"{base}/messages/{ids[0]}/replay")
    assert status == 409 and "a dead letter: redrive it" in refused["error"]["message"], refused

    config = tmp_path / "cli.yaml"
    config.write_text(yaml.safe_dump({"redis": {"url": w.redis_url}, "pulsar": {"service_url": w.pulsar_url},
                                      "fleet": {"name": w.settings.fleet.name}, "secrets": {"dir": str(secrets)},
                                      "destinations": {"allow_private": True}}))  # as the worker's
    code, out, err = await cli("dlq", "redrive", "p-a/deadly", "--dry-run", "--message-id", ids[0],
                               "--config", str(config))
    assert code == 0 and "would take 1 dead letter(s)" in out, (out, err)
    code, out, err = await cli("dlq", "redrive", "p-a/deadly", "--dry-run", "--message-id", "999999:0:-1:-1",
                               "--config", str(config))
    assert code == 3 and out == "" and len(err.splitlines()) == 1 and "no dead letter 999999:0:-1:-1" in err, err

    healthy = True
    before = len(endpoint.requests)
    status, done = await alice.call("POST", f"{base}/redrive", {"message_id": ids[0]})
    assert status == 200 and done["redriven"] == 1, done
    code, out, err = await cli("dlq", "redrive", "p-a/deadly", "--dry-run", "--config", str(config))
    assert code == 0 and "would take 1 dead letter(s)" in out, (out, err)  # the other one only
    status, done = await alice.call("POST", f"{base}/redrive", {})
    assert status == 200 and done["redriven"] == 1, done
    delivered = [r.body_payload for r in endpoint.requests[before:] if r.acked]
    assert sorted(delivered) == [b"one", b"two"]  # each once


async def test_a_running_admin_refuses_every_write_once_redis_holds_a_newer_layout(
        fleet, endpoint: Endpoint, client: Client, redis_url: str):
    """The admin process read the layout once and kept it: after Redis came to hold a newer
    release's layout, pause and delete still wrote, and so did create, PATCH and redrive. Each is now
    refused (409, the one line), and nothing changes."""
    import redis as redis_sync

    from worker.core.keys import layout_key
    from worker.fleet.layout import LAYOUT

    w, _, clients, _, _, _ = fleet
    alice = clients["alice"]
    topic = f"persistent://p-a/main/layout-{uuid.uuid4().hex[:8]}"
    endpoint.behaviour = lambda rec: web.Response(status=204)
    await created(w, alice, "kept", topic, endpoint.url, dead_letter={"topic": topic + "-dlq"})  # a write before
    [delivered] = client.publish(topic, [b"once"])
    store = redis_sync.Redis.from_url(redis_url)
    try:
        # Settled in Redis (its record is written after the ack): the snapshot below is then still.
        await eventually(lambda: any(store.hexists(k, delivered) for k in store.keys("pw:{p-a/kept}:acked:*")),
                         what="settled")
        await eventually(lambda: store.exists("pw:{p-a/kept}:log-stats"), what="its hour counted")
        store.set(layout_key(), LAYOUT + 1)
        before = {key: store.dump(key) for key in store.keys("*") if not key.startswith(b"pw:{fleet/")}
        base = "/v1/projects/p-a/subscriptions"
        for method, path, body in (
                ("POST", f"{base}/kept/pause", {"wait_seconds": 0}),
                ("DELETE", f"{base}/kept", None),
                ("POST", base, definition("new", topic, endpoint.url)),
                ("PATCH", f"{base}/kept", {"max_deliver": 9}),
                ("POST", f"{base}/kept/redrive", {}),
                ("POST", f"{base}/kept/messages/{delivered}/replay", None)):
            status, refused = await alice.call(method, path, body)
            assert status == 409 and f"redis holds layout {LAYOUT + 1}" in refused["error"]["message"], \
                (method, path, status, refused)
        after = {key: store.dump(key) for key in store.keys("*") if not key.startswith(b"pw:{fleet/")}
        assert after == before  # the subscription's keys as they were (the fleet's own heartbeat aside)
        assert store.hexists(f"pw:{{fleet/{w.settings.fleet.name}}}:registry", "p-a/kept")
    finally:
        store.set(layout_key(), LAYOUT)
        store.close()



async def test_malformed_ids_cursors_and_bodies_answer_400_or_404_never_500_or_503(
        fleet, endpoint: Endpoint, client: Client):
    """Malformed message ids and log cursors answered 500 or a false 503 ("Redis is not answering"),
    and YAML nested 900 deep a 500: each is a 400 or a 404 now, in one line."""
    w, base, clients, _, _, _ = fleet
    alice = clients["alice"]
    topic = f"persistent://p-a/main/bad-{uuid.uuid4().hex[:8]}"
    endpoint.behaviour = lambda rec: web.Response(status=204)
    await created(w, alice, "bad", topic, endpoint.url, dead_letter={"topic": topic + "-dlq"})
    sub = "/v1/projects/p-a/subscriptions/bad"
    ids = ["\u00b2:0:-1:-1", "\u0663:1:-1:-1", "99999999999999999999999:0:-1:-1", "1:2:3", "1:2:-1:-1:5", "-5:0:-1:-1",
           "1:99999999999999999999:-1:-1", "x" * 300]
    for message_id in ids:
        quoted = urllib.parse.quote(message_id, safe="")
        for method, path, body in (("GET", f"{sub}/messages/{quoted}", None),
                                   ("POST", f"{sub}/messages/{quoted}/replay", None),
                                   ("GET", f"{sub}/dead-letters/{quoted}", None),
                                   ("POST", f"{sub}/discard", {"message_id": message_id, "wait_seconds": 0}),
                                   ("POST", f"{sub}/redrive", {"message_id": message_id})):
            status, answer = await alice.call(method, path, body)
            assert status in (400, 404), (method, path, status, answer)
        status, _, _ = await alice.raw(f"{sub}/messages/{quoted}/payload")
        assert status in (400, 404), (message_id, status)
        status, answer = await alice.call("GET", f"{sub}/log?message_id={quoted}")  # a filter: matches nothing
        assert status in (200, 400), (message_id, status, answer)
    for cursor in ("\u0663-0", "99999999999999999999-0", "1-99999999999999999999", "18446744073709551616-0", "a-b"):
        status, answer = await alice.call("GET", f"{sub}/log?cursor={urllib.parse.quote(cursor)}")
        assert status == 400 and "cursor" in answer["error"]["message"], (cursor, status, answer)
    deep = "a: " + "[" * 900 + "]" * 900
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session, session.post(
            base + "/v1/projects/p-a/subscriptions", data=deep.encode(),
            headers={"Authorization": f"Bearer {alice.token}", "Content-Type": "application/yaml"}) as answer:
        assert answer.status == 400, await answer.text()
    nested: Any = []
    for _ in range(900):
        nested = [nested]
    status, answer = await alice.call("POST", "/v1/projects/p-a/subscriptions", {"name": "deep", "more": nested})
    assert status == 400, answer


async def test_the_edit_review_refuses_what_the_save_would_refuse(start_worker, redis_url: str, endpoint: Endpoint):
    """The console's review (Operations.check, editing) accepted a changed topic or type, which the
    save then refused: the review runs the save's checks against what is stored, writing nothing."""
    from worker.api.operations import Operations
    from worker.runtime.errors import ConfigError

    w = await start_worker(fleet=FleetSettings(name="review-" + uuid.uuid4().hex[:8]))
    ops = Operations(w.settings, w.redis_url, w.pulsar_url)
    try:
        topic = f"persistent://p-a/main/review-{uuid.uuid4().hex[:8]}"
        await ops.create("p-a", definition("edited", topic, endpoint.url))
        await ops.check("p-a", definition("edited", topic, endpoint.url, max_deliver=7), editing="edited")  # fine
        for changed in (definition("edited", topic + "-other", endpoint.url),
                        definition("edited", topic, endpoint.url, type="failover")):
            with pytest.raises(ConfigError, match="immutable"):
                await ops.check("p-a", changed, editing="edited")
            with pytest.raises(ConfigError, match="immutable"):
                await ops.replace("p-a", "edited", changed)
    finally:
        await ops.close()


async def test_sixteen_concurrent_downloads_of_a_large_payload_all_get_it(fleet, endpoint: Endpoint, client: Client):
    """16 concurrent downloads of one 4 MiB payload gave one false 404 (16 readers at once, one timed
    out): a message is read back once for everyone asking at that moment, and a slow read is never
    said as a message that does not exist."""
    _, _, clients, _, _, _ = fleet
    alice, victor = clients["alice"], clients["victor"]  # 8 each: a caller's concurrency cap
    topic = f"persistent://p-a/main/big-{uuid.uuid4().hex[:8]}"
    status, _ = await alice.call("POST", "/v1/projects/p-a/subscriptions", definition("big", topic, endpoint.url))
    assert status == 201
    assert (await alice.call("POST", "/v1/projects/p-a/subscriptions/big/pause", {"wait_seconds": 10}))[0] == 200
    payload = os.urandom(4 << 20)
    [message_id] = client.publish(topic, [payload])  # kept by the broker, read back from it
    path = f"/v1/projects/p-a/subscriptions/big/messages/{message_id}/payload"
    answers = await asyncio.gather(*(caller.raw(path) for caller in [alice, victor] * 8))
    assert [status for status, _, _ in answers] == [200] * 16
    assert all(data == payload for _, data, _ in answers)


async def test_a_callers_log_searches_read_no_more_than_its_share(fleet, endpoint: Endpoint, redis_url: str):
    """A search that matched nothing read 5,000 entries, and one viewer's searches took the admin
    process's core: a caller's searches now read at most its share (10,000 entries, then 10,000 a
    second), one at a time; past it, 429 with Retry-After, or a page that says where to go on."""
    import redis as redis_sync

    from worker.api.limits import SEARCH_BURST, SEARCH_RATE
    from worker.core.keys import log_key

    _, _, clients, _, _, _ = fleet
    alice, victor = clients["alice"], clients["victor"]
    topic = f"persistent://p-a/main/searched-{uuid.uuid4().hex[:8]}"
    status, _ = await alice.call("POST", "/v1/projects/p-a/subscriptions", definition("searched", topic, endpoint.url))
    assert status == 201
    store = redis_sync.Redis.from_url(redis_url)
    try:
        pipe = store.pipeline(transaction=False)
        for i in range(12_000):  # the log of 12,000 acked attempts
            pipe.xadd(log_key("p-a/searched"), {"message_id": f"1:{i}:-1:-1", "attempt": "1", "result": "ack",
                                                "status": "204", "worker": "w"})
        pipe.execute()
    finally:
        store.close()
    path = "/v1/projects/p-a/subscriptions/searched/log?status=5xx"  # matches nothing
    started = asyncio.get_running_loop().time()
    answers = [await victor.call("GET", path) for _ in range(4)]
    elapsed = asyncio.get_running_loop().time() - started
    scanned = sum(body["scanned"] for status, body in answers if status == 200)
    assert scanned <= SEARCH_BURST + SEARCH_RATE * elapsed, (scanned, elapsed)
    assert all(body["next_cursor"] for status, body in answers if status == 200)  # where to go on
    assert any(status == 429 or body["scanned"] < 5000 for status, body in answers), answers
    status, body = await alice.call("GET", path)  # another caller has a share of its own
    assert status == 200 and body["scanned"] == 5000
