"""OIDC tokens on push requests, verified the way an endpoint would: PyJWT's JWKS client against the
keys the running worker publishes."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from tests.support.builders import make_sub
from tests.support.endpoints import Endpoint
from tests.support.helpers import eventually
from tests.support.pulsar_client import Client
from worker.broker.embedded import free_port
from worker.endpoint.oidc import Oidc, OidcIssuer, OidcKey, Tokens
from worker.endpoint.secrets import SecretRef, SecretStore
from worker.fleet.admission import preflight
from worker.model.config import HttpSettings, parse_settings
from worker.model.subscriptions import parse_subscription
from worker.runtime.errors import ConfigError


def pem(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def issuer_with(issuer: str, *keys: tuple[Path, str]) -> OidcIssuer:
    return OidcIssuer(issuer, tuple(OidcKey(SecretRef(file=str(path)), kid) for path, kid in keys))


async def test_tokens_verify_with_the_published_jwks_and_wrong_ones_are_rejected(
        start_worker, endpoint: Endpoint, client: Client, topic, tmp_path):
    new = pem(rsa.generate_private_key(public_exponent=65537, key_size=2048), tmp_path / "new.pem")
    old = pem(ec.generate_private_key(ec.SECP256R1()), tmp_path / "old.pem")
    retired = pem(rsa.generate_private_key(public_exponent=65537, key_size=2048), tmp_path / "retired.pem")
    port = free_port()
    issuer = f"http://127.0.0.1:{port}"
    fleet_keys = issuer_with(issuer, (new, "k2"), (old, "k1"))
    sub = make_sub(topic, endpoint.url, oidc=Oidc())
    w = await start_worker(sub, http=HttpSettings(port=port), oidc=fleet_keys)
    client.publish(topic, [b"one", b"two"])
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 2, what="delivered")
    tokens = [r.headers["Authorization"].removeprefix("Bearer ") for r in endpoint.requests]
    assert tokens[0] == tokens[1]  # cached, not minted per request

    def verify() -> None:  # blocking HTTP, off the event loop the worker runs on
        with urllib.request.urlopen(f"{issuer}/.well-known/openid-configuration", timeout=5) as r:
            discovery = json.loads(r.read())
        assert discovery["issuer"] == issuer and discovery["jwks_uri"] == f"{issuer}/.well-known/jwks.json"
        jwks = jwt.PyJWKClient(discovery["jwks_uri"], cache_keys=False)
        assert {k.key_id for k in jwks.get_signing_keys()} == {"k1", "k2"}  # both keys of the rotation published

        token = tokens[0]
        assert jwt.get_unverified_header(token)["kid"] == "k2"  # the new key signs
        claims = jwt.decode(token, jwks.get_signing_key_from_jwt(token).key, algorithms=["RS256", "ES256"],
                            audience=endpoint.url, issuer=issuer)
        assert claims["sub"] == f"projects/{sub.tenant}/subscriptions/{sub.name}"
        assert claims["exp"] - claims["iat"] == 3600

        with pytest.raises(jwt.InvalidAudienceError):
            jwt.decode(token, jwks.get_signing_key_from_jwt(token).key, algorithms=["RS256"], audience="https://other")
        minter = Tokens(SecretStore(), fleet_keys)
        expired = minter.token(Oidc(), sub.tenant, sub.name, endpoint.url, now=time.time() - 7200)
        with pytest.raises(jwt.ExpiredSignatureError):
            jwt.decode(expired, jwks.get_signing_key_from_jwt(expired).key, algorithms=["RS256"], audience=endpoint.url)
        old_signed = Tokens(SecretStore(), issuer_with(issuer, (old, "k1"))).token(Oidc(), sub.tenant, sub.name,
                                                                                  endpoint.url)
        assert jwt.decode(old_signed, jwks.get_signing_key_from_jwt(old_signed).key, algorithms=["ES256"],
                          audience=endpoint.url)["iss"] == issuer  # the previous key still verifies during the rotation
        by_retired = Tokens(SecretStore(), issuer_with(issuer, (retired, "k0"))).token(Oidc(), sub.tenant, sub.name,
                                                                                       endpoint.url)
        with pytest.raises(jwt.PyJWKClientError):
            jwks.get_signing_key_from_jwt(by_retired)  # a retired key is not published: nothing verifies it

    await asyncio.to_thread(verify)


def test_oidc_configuration_rules(tmp_path):
    base = {"name": "o", "topic": "persistent://p-a/main/t",
            "deliver": {"mode": "push", "push": {"url": "https://example.com/h", "oidc": {}}}}
    sub = parse_subscription(base)
    assert sub.oidc == Oidc(audience=None)
    with_audience = json.loads(json.dumps(base))
    with_audience["deliver"]["push"]["oidc"] = {"audience": "https://aud.example"}
    assert parse_subscription(with_audience).oidc == Oidc("https://aud.example")
    both = json.loads(json.dumps(base))
    both["deliver"]["push"]["bearer_token"] = {"secret": "token"}
    with pytest.raises(ConfigError, match="oidc: cannot be combined with bearer_token"):
        parse_subscription(both)
    # Keys and issuer are the fleet's: a subscription that brings its own is refused, pointing at the setting.
    for moved in ({"issuer": "https://push.example.com"}, {"signing_key": {"file": "/k.pem"}, "key_id": "k1"}):
        old_form = json.loads(json.dumps(base))
        old_form["deliver"]["push"]["oidc"] = moved
        for trusted in (True, False):
            with pytest.raises(ConfigError, match=r"is the worker's setting now.*oidc: \{issuer, signing_keys\}"):
                parse_subscription(old_form, trusted=trusted)


def test_the_worker_oidc_setting_rules(tmp_path):
    key = pem(ec.generate_private_key(ec.SECP256R1()), tmp_path / "k.pem")
    good = {"issuer": "https://push.example.com", "signing_keys": [{"file": str(key), "key_id": "k2"},
                                                                   {"env": "OLD_KEY", "key_id": "k1"}]}
    settings = parse_settings({"oidc": good}, env={})
    assert settings.oidc is not None and [k.key_id for k in settings.oidc.keys] == ["k2", "k1"]
    for broken, rule in ((dict(good, issuer="push.example.com"), r"oidc\.issuer: must be a URL"),
                         (dict(good, signing_keys=[]), r"oidc\.signing_keys: must be a list of one to four"),
                         (dict(good, signing_keys=[{"file": str(key), "key_id": "k1"}, {"env": "X", "key_id": "k1"}]),
                          r"key_id 'k1' is given twice"),
                         (dict(good, signing_keys=[{"key_id": "k1"}]), r"exactly one of file or env")):
        with pytest.raises(ConfigError, match=rule):
            parse_settings({"oidc": broken}, env={})
    # A subscription asking for tokens needs the setting: refused at load, not at its first request.
    sub_doc = {"name": "o", "topic": "persistent://p-a/main/t",
               "deliver": {"mode": "push", "push": {"url": "https://example.com/h", "oidc": {}}}}
    with pytest.raises(ConfigError, match=r"deliver\.push\.oidc: needs the worker setting oidc"):
        preflight(parse_settings({"subscriptions": [sub_doc]}, env={}))


def test_expired_tokens_are_not_kept(tmp_path):
    """A token per subscription was cached for good: subscriptions that came and went piled up."""
    key = pem(ec.generate_private_key(ec.SECP256R1()), tmp_path / "k.pem")
    minter = Tokens(SecretStore(), issuer_with("https://issuer.example", (key, "k1")))
    start = time.time()
    for n in range(3):
        minter.token(Oidc(), "p", f"gone-{n}", "https://e.example/push", now=start)
    fresh = minter.token(Oidc(), "p", "stays", "https://e.example/push", now=start + 3600)
    assert list(minter._tokens.values()) == [(int(start + 3600) + 3600, fresh)]
