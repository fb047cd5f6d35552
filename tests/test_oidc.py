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

from tests.conftest import Client, Endpoint, make_sub
from tests.helpers import eventually
from worker.config import HttpSettings
from worker.embedded import free_port
from worker.errors import ConfigError
from worker.oidc import Oidc, OidcKey, Tokens
from worker.signing import SecretRef, SecretStore
from worker.subscriptions import parse_subscription


def pem(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


async def test_tokens_verify_with_the_published_jwks_and_wrong_ones_are_rejected(
        start_worker, endpoint: Endpoint, client: Client, topic, tmp_path):
    new = pem(rsa.generate_private_key(public_exponent=65537, key_size=2048), tmp_path / "new.pem")
    old = pem(ec.generate_private_key(ec.SECP256R1()), tmp_path / "old.pem")
    retired = pem(rsa.generate_private_key(public_exponent=65537, key_size=2048), tmp_path / "retired.pem")
    port = free_port()
    issuer = f"http://127.0.0.1:{port}"
    oidc = Oidc(issuer, (OidcKey(SecretRef(file=str(new)), "k2"), OidcKey(SecretRef(file=str(old)), "k1")))
    sub = make_sub(topic, endpoint.url, oidc=oidc)
    w = await start_worker(sub, http=HttpSettings(port=port))
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
        minter = Tokens(SecretStore())
        expired = minter.token(oidc, sub.tenant, sub.name, endpoint.url, now=time.time() - 7200)
        with pytest.raises(jwt.ExpiredSignatureError):
            jwt.decode(expired, jwks.get_signing_key_from_jwt(expired).key, algorithms=["RS256"], audience=endpoint.url)
        old_signed = minter.token(Oidc(issuer, (OidcKey(SecretRef(file=str(old)), "k1"),)), sub.tenant, sub.name,
                                  endpoint.url)
        assert jwt.decode(old_signed, jwks.get_signing_key_from_jwt(old_signed).key, algorithms=["ES256"],
                          audience=endpoint.url)["iss"] == issuer  # the previous key still verifies during the rotation
        by_retired = minter.token(Oidc(issuer, (OidcKey(SecretRef(file=str(retired)), "k0"),)), sub.tenant, sub.name,
                                  endpoint.url)
        with pytest.raises(jwt.PyJWKClientError):
            jwks.get_signing_key_from_jwt(by_retired)  # a retired key is not published: nothing verifies it

    await asyncio.to_thread(verify)


def test_oidc_configuration_rules(tmp_path):
    base = {"name": "o", "topic": "persistent://p-a/main/t",
            "deliver": {"mode": "push", "push": {"url": "https://example.com/h", "oidc": {
                "issuer": "https://push.example.com", "signing_key": {"file": "/k.pem"}, "key_id": "k1"}}}}
    sub = parse_subscription(base)
    assert sub.oidc is not None and sub.oidc.keys[0].key_id == "k1" and sub.oidc.audience is None
    rotation = json.loads(json.dumps(base))
    rotation["deliver"]["push"]["oidc"] = {"issuer": "https://push.example.com", "signing_key": [
        {"file": "/new.pem", "key_id": "k2"}, {"env": "OLD_KEY", "key_id": "k1"}]}
    assert [k.key_id for k in parse_subscription(rotation).oidc.keys] == ["k2", "k1"]
    both = json.loads(json.dumps(base))
    both["deliver"]["push"]["bearer_token"] = {"env": "TOKEN"}
    with pytest.raises(ConfigError, match="oidc: cannot be combined with bearer_token"):
        parse_subscription(both)
    no_issuer = json.loads(json.dumps(base))
    no_issuer["deliver"]["push"]["oidc"]["issuer"] = "push.example.com"
    with pytest.raises(ConfigError, match=r"oidc\.issuer: must be an http or https URL"):
        parse_subscription(no_issuer)


def test_expired_tokens_are_not_kept(tmp_path):
    """A token per subscription was cached for good: subscriptions that came and went piled up."""
    key = pem(ec.generate_private_key(ec.SECP256R1()), tmp_path / "k.pem")
    oidc = Oidc("https://issuer.example", (OidcKey(SecretRef(file=str(key)), "k1"),))
    minter = Tokens(SecretStore())
    start = time.time()
    for n in range(3):
        minter.token(oidc, "p", f"gone-{n}", "https://e.example/push", now=start)
    fresh = minter.token(oidc, "p", "stays", "https://e.example/push", now=start + 3600)
    assert list(minter._tokens.values()) == [(int(start + 3600) + 3600, fresh)]
