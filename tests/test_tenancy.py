"""Tenants that cannot reach each other: the registry is hostile input.

Two projects on one worker. p-victim has a config-file subscription and secrets of its own; p-evil
writes registry entries (directly into Redis, as a compromised control plane would, and through
`subs apply`) that try to read p-victim's topics, take over its subscription, send the worker's and
p-victim's secrets to p-evil's endpoint, reach a refused address through another spelling of it,
mint tokens in p-victim's name, and make the fleet's own keys its own. Each is refused with a reason;
p-evil's endpoints receive nothing that carries a secret; p-victim's deliveries go on untouched.
Real broker, Redis, worker and endpoints (the refused address has a real listener too: 127.0.0.2).
"""

from __future__ import annotations

import ipaddress
import json
import os

import jwt
import pytest
import redis
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from tests.support.builders import make_sub, push_sub
from tests.support.endpoints import Endpoint, Received, catcher
from tests.support.helpers import cli, eventually
from tests.support.pulsar_client import Client
from worker.core import keys
from worker.endpoint.destinations import DestinationPolicy
from worker.endpoint.oidc import OidcIssuer, OidcKey
from worker.endpoint.secrets import SecretRef
from worker.model.config import FleetSettings

WORKER_SECRET = "redis://:worker-only-password@127.0.0.1:1/0"
VICTIM_TOKEN = "victim-bearer-token"
EVIL_TOKEN = "evil-own-token"
ADMITTED = DestinationPolicy(allow_cidrs=(ipaddress.ip_network("127.0.0.1/32"),))


def leaked(requests: list[Received]) -> list[str]:
    """Any secret of the worker or of p-victim in what p-evil's endpoints received."""
    text = json.dumps([{**r.headers, "body": r.body.decode(errors="replace")} for r in requests])
    return [s for s in (WORKER_SECRET, "worker-only-password", VICTIM_TOKEN) if s in text]


def write_registry(client: redis.Redis, fleet: str, entries: dict[str, object]) -> None:
    """What a control plane (or anything that can write the registry) does, bypassing `subs apply`."""
    with client.pipeline(transaction=True) as pipe:
        pipe.hset(keys.fleet_key(fleet, "registry"), mapping={k: json.dumps(v) for k, v in entries.items()})
        pipe.incr(keys.fleet_key(fleet, "version"))
        pipe.execute()
    client.publish(keys.fleet_key(fleet, "events"), b"registry")


async def test_one_project_cannot_reach_another_or_the_worker(start_worker, endpoint: Endpoint, client: Client,
                                                              redis_url, tmp_path, monkeypatch):
    fleet = "tenancy"
    monkeypatch.setenv("PUSH_WORKER_REDIS_URL", WORKER_SECRET)  # what {env: ...} would read
    secrets = tmp_path / "secrets"
    (secrets / "p-victim").mkdir(parents=True)
    (secrets / "p-evil").mkdir()
    (secrets / "p-victim" / "token").write_text(VICTIM_TOKEN)
    (secrets / "p-evil" / "token").write_text(EVIL_TOKEN)
    os.symlink("../p-victim/token", secrets / "p-evil" / "borrowed")  # a link out of the project's directory
    fleet_key = ec.generate_private_key(ec.SECP256R1())
    key_file = tmp_path / "fleet-oidc.pem"
    key_file.write_bytes(fleet_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
    evil_runner, evil_url, evil_got = await catcher("127.0.0.1")
    far_runner, far_url, far_got = await catcher("127.0.0.2")  # not admitted by the policy
    far_port = far_url.rsplit(":", 1)[1].strip("/")
    try:
        victim_topic = "persistent://p-victim/main/orders"
        evil_topic = "persistent://p-evil/main/bait"
        victim = make_sub(victim_topic, endpoint.url, name="victim-push", bearer_token=SecretRef(file=str(
            secrets / "p-victim" / "token")))
        w = await start_worker(victim, destinations=ADMITTED, secrets_dir=secrets, fleet=FleetSettings(name=fleet),
                               oidc=OidcIssuer("https://push.example", (OidcKey(SecretRef(file=str(key_file)), "f1"),)))

        def evil(name: str, topic: str = evil_topic, url: str = evil_url, **push: object) -> dict[str, object]:
            doc = push_sub(name, topic, url)
            doc["deliver"]["push"].update(push)  # type: ignore[index]
            return doc

        attacks = {
            # 1. secrets of the worker and of other projects
            "p-evil/env": evil("env", bearer_token={"env": "PUSH_WORKER_REDIS_URL"}),
            "p-evil/file": evil("file", bearer_token={"file": str(secrets / "p-victim" / "token")}),
            "p-evil/climb": evil("climb", bearer_token={"secret": "../p-victim/token"}),
            "p-evil/sign": evil("sign", signing_secrets=[{"file": str(secrets / "p-victim" / "token")}]),
            # 2. a refused address in other spellings
            "p-evil/circled": evil("circled", url=f"http://①②⑦.0.0.2:{far_port}/"),
            "p-evil/fullwidth": evil("fullwidth", url=f"http://１２７．０．０．２:{far_port}/"),  # noqa: RUF001
            "p-evil/decimal": evil("decimal", url=f"http://2130706434:{far_port}/"),
            "p-evil/mapped": evil("mapped", url=f"http://[::ffff:127.0.0.2]:{far_port}/"),
            "p-evil/plain": evil("plain", url=far_url),
            # 3. OIDC keys of its own
            "p-evil/forge": evil("forge", oidc={"issuer": "https://push.example", "key_id": "f1",
                                                 "signing_key": {"secret": "token"}}),
            # 4. the fleet's hash tag, glob characters
            "fleet/default": evil("default"),
            f"fleet/{fleet}": evil(fleet),
            "*/*": evil("glob"),
            # 5. another project's topic, subscription, or field
            "p-evil/spy": evil("spy", topic=victim_topic),
            "p-victim/victim-push": evil("victim-push", topic=victim_topic),
            "p-evil/innocent": evil("victim-push", topic=victim_topic),
            "public/x": evil("x", topic="persistent://public/default/x"),
        }
        legit = evil("legit", bearer_token={"secret": "token"})
        borrowing = evil("borrowing", bearer_token={"secret": "borrowed"})
        rclient = redis.Redis.from_url(redis_url)
        write_registry(rclient, fleet, {**attacks, "p-evil/legit": legit, "p-evil/borrowing": borrowing})
        await eventually(lambda: "p-evil/legit" in w.dispatchers and "p-evil/borrowing" in w.dispatchers,
                         what="the project's valid entries served")
        assert set(w.fleet.subscriptions) == {"p-victim/victim-push", "p-evil/legit", "p-evil/borrowing"}
        assert w.fleet.subscriptions["p-victim/victim-push"] == victim  # the config's definition, not the registry's

        client.publish(victim_topic, [f"v{i}".encode() for i in range(20)])
        client.publish(evil_topic, [b"bait"])
        await eventually(lambda: len({r.body_payload for r in endpoint.requests}) == 20, what="victim's deliveries")
        await eventually(lambda: sum(r.headers.get("Authorization") == f"Bearer {EVIL_TOKEN}" for r in evil_got) >= 1,
                         what="p-evil's own subscription delivered with its own secret")
        # The link out of p-evil's directory is never followed: not sent, retried, never with a secret.
        await eventually(lambda: w.dispatchers["p-evil/borrowing"].stats.retried >= 1, what="the borrowing refused")
        assert all(r.headers["Authorization"] == f"Bearer {VICTIM_TOKEN}" for r in endpoint.requests)
        assert not leaked(evil_got), leaked(evil_got)
        assert all(r.headers.get("Authorization") == f"Bearer {EVIL_TOKEN}" for r in evil_got)
        assert far_got == []

        # Every attack is Invalid in `subs list`, with the reason (read as an operator would, with the
        # workers' config: its policy and its own subscriptions are what the entries are checked against).
        config = tmp_path / "worker.yaml"
        config.write_text(json.dumps({
            "redis": {"url": redis_url}, "fleet": {"name": fleet}, "secrets": {"dir": str(secrets)},
            "destinations": {"allow_cidrs": ["127.0.0.1/32"]},
            "oidc": {"issuer": "https://push.example", "signing_keys": [{"file": str(key_file), "key_id": "f1"}]},
            "subscriptions": [push_sub("victim-push", victim_topic, endpoint.url)]}))
        code, out, err = await cli("subs", "list", "--json", "--config", str(config))
        assert code == 0, err
        listed = json.loads(out)
        rows = {f"{r['project']}/{r['name']}": r for r in listed if r["source"] == "registry"}
        reasons = {key: rows[key]["reason"] for key in attacks}
        assert [r["state"] for r in listed if r["source"] == "config"] == ["Active"]  # the config's keeps serving
        assert "is a subscription of the workers' config file" in reasons["p-victim/victim-push"]
        assert all(rows[key]["state"] == "Invalid" for key in reasons), rows
        assert "for the operator's config file only" in reasons["p-evil/env"]
        assert "for the operator's config file only" in reasons["p-evil/file"]
        assert "must be a secret name" in reasons["p-evil/climb"]
        assert "ASCII host" in reasons["p-evil/circled"] and "ASCII host" in reasons["p-evil/fullwidth"]
        assert "is the worker's setting now" in reasons["p-evil/forge"]
        assert "p-<short>" in reasons["fleet/default"] and "p-<short>" in reasons["public/x"]
        assert "defines p-victim/victim-push" in reasons["p-evil/innocent"]
        assert "defines p-victim/spy" in reasons["p-evil/spy"]
        for key in ("p-evil/decimal", "p-evil/mapped", "p-evil/plain"):
            assert "127.0.0.2 is a loopback" in reasons[key]

        # 3. Tokens: signed by the fleet's key only, naming p-evil's own subscription whatever it asks.
        evil_oidc = evil("oidc-aud", oidc={"audience": endpoint.url})
        code, _, err = await cli("subs", "apply", "-f", "-", "--redis-url", redis_url, stdin=json.dumps(evil_oidc),
                                 extra_env={"PUSH_WORKER_FLEET": fleet})
        assert code == 0, err
        await eventually(lambda: "p-evil/oidc-aud" in w.dispatchers, what="the OIDC subscription served")
        client.publish(evil_topic, [b"token please"])
        await eventually(lambda: any(r.headers.get("Authorization", "").count(".") == 2 for r in evil_got),
                         what="a token")
        token = next(r.headers["Authorization"].removeprefix("Bearer ") for r in evil_got
                     if r.headers.get("Authorization", "").count(".") == 2)
        claims = jwt.decode(token, fleet_key.public_key(), algorithms=["ES256"], audience=endpoint.url)
        assert claims["sub"] == "projects/p-evil/subscriptions/oidc-aud"  # p-victim's endpoint checks sub: refused
        assert w.tokens.jwks()["keys"][0]["kid"] == "f1" and len(w.tokens.jwks()["keys"]) == 1

        # 4. Deleting garbage fields deletes those fields and nothing else.
        before = {k for k in rclient.scan_iter(match="pw:*") if b"{fleet/" not in k}
        for field in ("fleet/default", f"fleet/{fleet}", "*/*"):
            code, _, err = await cli("subs", "delete", field, "--redis-url", redis_url,
                                     extra_env={"PUSH_WORKER_FLEET": fleet})
            assert code == 0, err
        registry = {k.decode() for k in rclient.hkeys(keys.fleet_key(fleet, "registry"))}
        assert "p-evil/legit" in registry and "p-victim/victim-push" in registry and "*/*" not in registry
        assert rclient.zcard(keys.fleet_key(fleet, "members")) == 1  # the fleet's own keys are intact
        after = {k for k in rclient.scan_iter(match="pw:*") if b"{fleet/" not in k}
        assert before <= after | {k for k in before if b"{*/*}" in k}
        client.publish(victim_topic, [b"after"])
        await eventually(lambda: any(r.body_payload == b"after" for r in endpoint.requests), what="still delivering")
        rclient.close()
    finally:
        await evil_runner.cleanup()
        await far_runner.cleanup()


async def test_subs_apply_refuses_what_a_registry_entry_may_not_name(redis_url, tmp_path):
    """Exit 2 naming the field, and nothing written."""
    url = "https://push.example.com/h"
    cases = [
        (push_sub("a", "persistent://p-a/main/t", url, ) | {"deliver": {"mode": "push", "push": {
            "url": url, "bearer_token": {"env": "PUSH_WORKER_REDIS_URL"}}}}, "deliver.push.bearer_token.env"),
        (push_sub("a", "persistent://p-a/main/t", url) | {"deliver": {"mode": "push", "push": {
            "url": url, "signing_secrets": [{"file": "/etc/passwd"}]}}}, "deliver.push.signing_secrets[0].file"),
        (push_sub("a", "persistent://p-a/main/t", url) | {"deliver": {"mode": "push", "push": {
            "url": url, "bearer_token": {"secret": "a/../b"}}}}, "deliver.push.bearer_token.secret"),
        (push_sub("a", "persistent://p-a/main/t", "http://①②⑦.0.0.1/"), "deliver.push.url"),
        (push_sub("a", "persistent://fleet/main/t", url), "topic"),
        (push_sub("a", "persistent://p-a/main/t", url, dead_letter={"topic": "persistent://p-b/main/dlq"}),
         "dead_letter.topic"),
    ]
    for doc, field in cases:
        code, _, err = await cli("subs", "apply", "-f", "-", "--redis-url", redis_url, stdin=json.dumps(doc))
        assert code == 2 and f"{field}:" in err, (field, err)
    assert redis.Redis.from_url(redis_url).hlen(keys.fleet_key("default", "registry")) == 0


async def test_credentials_go_over_plain_http_to_an_admitted_private_address(start_worker, client: Client, topic,
                                                                            tmp_path):
    """A project secret read from its own directory, sent over http:// to an address allow_cidrs admits."""
    runner, url, got = await catcher("127.0.0.1")
    try:
        (tmp_path / "p-test").mkdir()
        (tmp_path / "p-test" / "token").write_text("tok\n")
        sub = make_sub(topic, url, bearer_token=SecretRef(secret="token", project="p-test"))
        await start_worker(sub, destinations=ADMITTED, secrets_dir=tmp_path)
        client.publish(topic, [b"one"])
        await eventually(lambda: any(r.headers.get("Authorization") == "Bearer tok" for r in got), what="sent")
    finally:
        await runner.cleanup()


class PublicResolver:
    """Resolves every name to a public address (nothing is ever connected to: see below)."""

    async def resolve(self, host: str, port: int = 0, family: object = 0) -> list[dict[str, object]]:
        return [{"hostname": host, "host": "93.184.216.34", "port": port, "family": 2, "proto": 6, "flags": 0}]

    async def close(self) -> None:
        pass


async def test_credentials_never_go_over_plain_http_to_a_public_address(monkeypatch):
    """Checked where the client connects: a public address may receive pushes, never credentials in
    clear. The connection attempt is recorded instead of made, so this test sends nothing anywhere."""
    from worker.core import http1
    from worker.core.delivery import Deliverer, Result
    from worker.core.messages import PushRequest
    from worker.endpoint.destinations import GuardedResolver

    tried: list[object] = []

    async def no_connection(infos: object, **_: object) -> object:
        tried.append(infos)
        raise OSError("not connecting in a test")

    monkeypatch.setattr(http1.aiohappyeyeballs, "start_connection", no_connection)
    policy = DestinationPolicy(allow_private=True)
    deliverer = Deliverer(policy, http1.Client(GuardedResolver(policy, PublicResolver())))  # type: ignore[arg-type]
    request = PushRequest({"Authorization": "Bearer tok"}, b"{}", 0)
    refused = await deliverer.attempt("http://public.example/push", request, 5.0, credentials=True)
    assert refused.result is Result.CONNECTION_ERROR and "public address" in refused.detail and tried == []
    await deliverer.attempt("http://public.example/push", PushRequest({}, b"{}", 0), 5.0)
    assert len(tried) == 1  # without credentials the same address is tried
    await deliverer.close()
    assert "public address" in (policy.clear_text_refusal("93.184.216.34") or "")
    assert policy.clear_text_refusal("127.0.0.1") is None
    strict = DestinationPolicy(allow_cidrs=(ipaddress.ip_network("10.1.0.0/16"),))
    assert strict.clear_text_refusal("10.1.2.3") is None and strict.clear_text_refusal("10.2.0.1") is not None
    # At validation too, however the scheme is spelled: no policy admits a public address for them.
    from worker.fleet.admission import admit
    from worker.model.subscriptions import parse_subscription
    from worker.runtime.errors import ConfigError

    for url in ("http://93.184.216.34/push", "HTTP://93.184.216.34/push"):
        doc = {"name": "s", "topic": "persistent://p-a/main/t",
               "deliver": {"mode": "push", "push": {"url": url, "bearer_token": {"secret": "t"}}}}
        with pytest.raises(ConfigError, match="public address"):
            admit(parse_subscription(doc), policy, None)


def test_the_endpoints_file_holds_no_credentials_and_is_private(tmp_path):
    """An external Redis (with a password in its URL) beside the embedded broker: endpoints.json names
    only what the worker started, and only its owner can read it."""
    from worker.broker import embedded

    service = embedded.start_pulsar(tmp_path, die_with_parent=True)
    try:
        embedded.record_endpoints(tmp_path, embedded.service_urls([service]), [service])
        path = tmp_path / embedded.ENDPOINTS_FILE
        assert (path.stat().st_mode & 0o777) == 0o600
        recorded = json.loads(path.read_text())
        assert recorded["pulsar_url"] == service.url and "redis_url" not in recorded
    finally:
        service.stop()


def test_errors_that_quote_a_url_strip_its_credentials():
    from tests.support.helpers import run_cli
    from worker.runtime.errors import strip_userinfo

    result = run_cli("publish", "persistent://p-a/main/t", "x", "--service-url", "pulsar://user:hunter2@127.0.0.1:1")
    assert result.returncode == 2 and "without credentials" in result.stderr, result.stderr
    result = run_cli("subs", "list", "--redis-url", "redis://:hunter2@127.0.0.1:1/0")
    assert result.returncode == 1 and "redis unreachable" in result.stderr, result.stderr
    for stderr in (result.stderr, run_cli("publish", "persistent://p-a/main/t", "x", "--service-url",
                                          "pulsar://user:hunter2@127.0.0.1:1").stderr):
        assert "hunter2" not in stderr
    assert strip_userinfo("cannot reach redis://u:hunter2@h:1/0 nor pulsar://:x@h:2") == \
        "cannot reach redis://h:1/0 nor pulsar://h:2"
    assert strip_userinfo("invalid hostname: user:hunter2@127.0.0.1:1") == "invalid hostname: 127.0.0.1:1"


def test_a_project_directory_that_links_out_of_the_secrets_dir_is_refused(tmp_path):
    """The project's directory itself a link elsewhere (`secrets.dir/p-evil -> /elsewhere`) reached
    any file there; Kubernetes' own layout (`p-a -> ..data/p-a`, inside secrets.dir) still reads.
    A hard link cannot be told from the file it names: docs/security.md says so."""
    from worker.endpoint.secrets import SecretRef, SecretStore, SecretUnavailable

    secrets, elsewhere = tmp_path / "secrets", tmp_path / "elsewhere"
    (secrets / "..data" / "p-a").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "token").write_text("not p-evil's")
    (secrets / "..data" / "p-a" / "token").write_text("p-a's own")
    os.symlink(elsewhere, secrets / "p-evil")
    os.symlink("..data/p-a", secrets / "p-a")
    store = SecretStore(secrets_dir=secrets)
    with pytest.raises(SecretUnavailable, match=r"the project's directory links outside secrets\.dir"):
        store.read(SecretRef(secret="token", project="p-evil"))
    assert store.read(SecretRef(secret="token", project="p-a")) == b"p-a's own"
