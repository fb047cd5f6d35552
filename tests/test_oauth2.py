"""OAuth 2.0 client credentials (`deliver.push.oauth2`): tokens fetched from a local token endpoint
that issues expiring ones, renewed before they expire, fetched again after a 401, never sent
without one (a failing token endpoint makes the attempt `not_sent`)."""

from __future__ import annotations

import base64
import itertools
import time
import urllib.parse

import pytest
from aiohttp import web

from tests.support.builders import make_sub
from tests.support.endpoints import serve
from tests.support.helpers import eventually
from tests.support.pulsar_client import Client
from worker.endpoint.destinations import DestinationPolicy
from worker.endpoint.oauth2 import OAuth2
from worker.endpoint.secrets import SecretRef
from worker.fleet.admission import admit
from worker.model.subscriptions import parse_subscription
from worker.runtime.errors import ConfigError

LIFETIME = 6  # seconds: a token is renewed when 5 s are left, so about every second here


class TokenServer:
    """Issues `tok-N` for the right client and secret; remembers when each expires, and which were revoked."""

    def __init__(self) -> None:
        self.issued: dict[str, float] = {}
        self.revoked: set[str] = set()
        self.forms: list[dict[str, str]] = []
        self.numbers = itertools.count(1)

    async def token(self, request: web.Request) -> web.Response:
        form = dict(urllib.parse.parse_qsl((await request.read()).decode()))
        self.forms.append(form)
        basic = base64.b64decode(request.headers.get("Authorization", "Basic ").split(" ", 1)[1]).decode()
        if basic != "orders-client:s3cret%2Fvalue" or form.get("grant_type") != "client_credentials":
            return web.json_response({"error": "invalid_client"}, status=401)
        token = f"tok-{next(self.numbers)}"
        self.issued[token] = time.monotonic() + LIFETIME
        return web.json_response({"access_token": token, "token_type": "Bearer", "expires_in": LIFETIME})

    def valid(self, authorization: str) -> bool:
        token = authorization.removeprefix("Bearer ")
        return token in self.issued and time.monotonic() < self.issued[token] and token not in self.revoked


async def test_tokens_are_fetched_renewed_before_they_expire_and_fetched_again_after_a_401(
        start_worker, client: Client, topic, tmp_path):
    tokens = TokenServer()
    answers: list[tuple[str, int]] = []

    async def endpoint(request: web.Request) -> web.Response:
        await request.read()
        status = 204 if tokens.valid(request.headers.get("Authorization", "")) else 401
        answers.append((request.headers.get("Authorization", ""), status))
        return web.Response(status=status)

    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500)

    token_runner, token_url = await serve("/token", tokens.token)
    broken_runner, broken_url = await serve("/token", broken)
    push_runner, push_url = await serve("/push", endpoint)
    secrets = tmp_path / "secrets"
    (secrets / "p-test").mkdir(parents=True)
    (secrets / "p-test" / "orders-client-secret").write_text("s3cret/value\n")
    secret = SecretRef(secret="orders-client-secret", project="p-test")
    sub = make_sub(topic, push_url, oauth2=OAuth2(token_url, "orders-client", secret, scope="push:write"))
    unauthenticated = make_sub(topic + "-b", push_url, max_deliver=2,
                               oauth2=OAuth2(broken_url, "orders-client", secret))
    try:
        w = await start_worker(sub, unauthenticated, secrets_dir=secrets,
                               destinations=DestinationPolicy(allow_private=True))
        started, published = time.monotonic(), 0

        def three_seconds_of_traffic() -> bool:
            nonlocal published
            client.publish(sub.topic, [b"m%d" % published])
            published += 1
            return time.monotonic() - started > 3

        await eventually(three_seconds_of_traffic, timeout=10, interval=0.1, what="3 s of traffic")
        await eventually(lambda: sum(1 for _, status in answers if status == 204) >= published,
                         what="the traffic delivered")
        assert all(status == 204 for _, status in answers), answers  # every token sent was valid
        assert 2 <= len(tokens.issued) <= 8, len(tokens.issued)  # renewed about every second, not per request
        assert all(f["scope"] == "push:write" for f in tokens.forms)

        tokens.revoked.update(tokens.issued)  # every token so far refused from now on
        before = len(answers)
        client.publish(sub.topic, [b"after revocation"])
        await eventually(lambda: any(status == 204 for _, status in answers[before:]), what="delivered again")
        assert [status for _, status in answers[before:]] == [401, 204]  # fetched again at once, same attempt
        assert w.metrics.registry.get_sample_value("pushworker_retries_total", {
            "project": "p-test", "subscription": sub.name}) in (None, 0.0)

        client.publish(unauthenticated.topic, [b"never without a token"])

        def not_sent() -> float:
            return w.metrics.registry.get_sample_value("pushworker_deliveries_total", {
                "project": "p-test", "subscription": unauthenticated.name, "result": "not_sent"}) or 0.0

        await eventually(lambda: not_sent() >= 2, what="attempts not sent")
        assert all(auth.startswith("Bearer tok-") for auth, _ in answers)  # nothing went without a token
    finally:
        for runner in (token_runner, broken_runner, push_runner):
            await runner.cleanup()


@pytest.mark.broker_independent
def test_oauth2_is_checked_at_load():
    def parsed(oauth2: object, **push: object):
        return parse_subscription({"name": "s", "topic": "persistent://p-a/main/t", "deliver": {
            "mode": "push", "push": {"url": "https://example.com/h", "oauth2": oauth2, **push}}})

    ok = {"token_url": "https://auth.example.com/token", "client_id": "c", "client_secret": {"secret": "cs"}}
    assert parsed(ok).oauth2 == OAuth2("https://auth.example.com/token", "c", SecretRef(secret="cs", project="p-a"))
    for bad, says in (({**ok, "client_secret": "plain"}, "client_secret: must say where the secret lives"),
                      ({**ok, "token_url": "ftp://x"}, "token_url: "),
                      ({k: v for k, v in ok.items() if k != "client_id"}, "client_id: is required"),
                      ({**ok, "grant": "password"}, "grant: is not a known field")):
        with pytest.raises(ConfigError, match=says):
            parsed(bad)
    with pytest.raises(ConfigError, match="oauth2: cannot be combined"):
        parsed(ok, bearer_token={"secret": "t"})
    # The token URL is a destination like the push URL: the policy refuses it before any request.
    for token_url, says in (("https://127.0.0.1/token", "loopback"),
                            ("http://auth.example.com/token", "credentials are sent only over https://")):
        with pytest.raises(ConfigError, match=f"deliver.push.oauth2.token_url: .*{says}"):
            admit(parsed({**ok, "token_url": token_url}), DestinationPolicy(), None)
    admit(parsed(ok), DestinationPolicy(), None)
