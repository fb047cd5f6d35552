"""OIDC tokens for push requests (`deliver.push.oidc`), as Google's push subscriptions send them:
`Authorization: Bearer <JWT>` signed RS256 (RSA key) or ES256 (P-256 key) with `iss`, `aud`, `sub`
(the subscription's full name, `projects/<project>/subscriptions/<name>`), `iat` and `exp` (one hour
later). A token is reused until five minutes before it expires.

The signing keys are the fleet's (the worker setting `oidc: {issuer, signing_keys}`), never a
subscription's: a project can choose only its tokens' audience, so it cannot mint a token that
names another project's subscription, nor replace a key in the published set. The worker publishes
those keys as a JWKS at `/.well-known/jwks.json` and the issuer's `/.well-known/openid-configuration`
on its HTTP port, so an endpoint verifies with any OIDC library and checks `aud` and `sub`. Rotation:
two keys, the first signs, both are published until the old one is removed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from worker.endpoint.secrets import SecretRef, SecretStore, SecretUnavailable

TOKEN_SECONDS = 3600
RENEW_BEFORE_SECONDS = 300
PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class OidcKey:
    """A private key (PEM, from a file or an environment variable) and the `kid` it is published as."""

    ref: SecretRef
    key_id: str


@dataclass(frozen=True)
class OidcIssuer:
    """The worker setting `oidc`: the issuer every token names, and the fleet's keys (`keys[0]` signs;
    every key is published)."""

    issuer: str
    keys: tuple[OidcKey, ...]


@dataclass(frozen=True)
class Oidc:
    """`deliver.push.oidc`: what a subscription chooses. `audience` None: the push URL."""

    audience: str | None = None


def subject(project: str, name: str) -> str:
    return f"projects/{project}/subscriptions/{name}"


def algorithm(key: PrivateKey) -> str:
    if isinstance(key, rsa.RSAPrivateKey):
        return "RS256"
    if isinstance(key.curve, ec.SECP256R1):
        return "ES256"
    raise SecretUnavailable(f"an OIDC key must be RSA or EC P-256, not EC {key.curve.name}")


class Tokens:
    """Signs and caches tokens with the fleet's keys; reads keys through the worker's SecretStore
    (rotated files are seen). `issuer` None: the worker has no `oidc` setting, and signs nothing."""

    def __init__(self, store: SecretStore, issuer: OidcIssuer | None = None) -> None:
        self.store = store
        self.issuer = issuer
        self._keys: dict[bytes, PrivateKey] = {}
        self._tokens: dict[tuple[str, str, str], tuple[float, str]] = {}

    def private_key(self, key: OidcKey) -> PrivateKey:
        pem = self.store.read(key.ref)
        loaded = self._keys.get(pem)
        if loaded is None:
            try:
                candidate = serialization.load_pem_private_key(pem, password=None)
            except (ValueError, TypeError):
                raise SecretUnavailable(f"OIDC signing key ({key.ref.describe()}) is not an unencrypted PEM "
                                        "private key") from None
            if not isinstance(candidate, rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey):
                raise SecretUnavailable(f"OIDC signing key ({key.ref.describe()}) must be RSA or EC P-256")
            algorithm(candidate)
            loaded = self._keys[pem] = candidate
        return loaded

    def token(self, oidc: Oidc, project: str, name: str, url: str, now: float | None = None) -> str:
        """A valid token for one request to `url`, minted or reused."""
        if self.issuer is None:
            raise SecretUnavailable("deliver.push.oidc needs the worker setting oidc (issuer and signing_keys)")
        now = time.time() if now is None else now
        signer = self.issuer.keys[0]
        audience = oidc.audience or url
        cache_key = (audience, subject(project, name), signer.key_id)
        cached = self._tokens.get(cache_key)
        if cached is not None and cached[0] - RENEW_BEFORE_SECONDS > now:
            return cached[1]
        key = self.private_key(signer)
        issued = int(now)
        claims = {"iss": self.issuer.issuer, "aud": audience, "sub": subject(project, name), "iat": issued,
                  "exp": issued + TOKEN_SECONDS}
        token = jwt.encode(claims, key, algorithm=algorithm(key), headers={"kid": signer.key_id})
        # Expired tokens go when one is minted (once an hour a subscription, beside a signature that
        # costs far more): subscriptions that came and went leave none behind.
        for stale in [k for k, (expires, _) in self._tokens.items() if expires <= now]:
            del self._tokens[stale]
        self._tokens[cache_key] = (issued + TOKEN_SECONDS, token)
        return token

    def discovery(self) -> dict[str, Any] | None:
        """The issuer's discovery document (None: the worker has no `oidc` setting)."""
        return openid_configuration(self.issuer.issuer) if self.issuer is not None else None

    def jwks(self) -> dict[str, Any]:
        """The fleet's public keys; a key that cannot be read now is left out."""
        keys: list[dict[str, Any]] = []
        for key in self.issuer.keys if self.issuer is not None else ():
            try:
                private = self.private_key(key)
            except SecretUnavailable:
                continue
            public = private.public_key()
            jwk = (RSAAlgorithm.to_jwk(public, as_dict=True) if isinstance(public, rsa.RSAPublicKey)
                   else ECAlgorithm.to_jwk(public, as_dict=True))
            keys.append({**jwk, "kid": key.key_id, "use": "sig", "alg": algorithm(private)})
        return {"keys": keys}


def openid_configuration(issuer: str) -> dict[str, Any]:
    """The discovery document of `issuer`, whose keys this worker serves."""
    base = issuer.rstrip("/")
    return {"issuer": issuer, "jwks_uri": f"{base}/.well-known/jwks.json", "response_types_supported": ["id_token"],
            "subject_types_supported": ["public"], "id_token_signing_alg_values_supported": ["RS256", "ES256"]}
