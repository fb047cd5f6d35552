"""What a subscription must pass on a worker, beyond its own rules: the destination policy and the
fleet settings it relies on. Config-file subscriptions pass it at load (`preflight`, with DNS and
secrets); registry entries pass it when applied and each time a worker loads the registry (`admit`),
and an entry that fails is `Invalid` with the reason: nothing is ever sent for it.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Callable
from urllib.parse import urlsplit

from worker.core.signing import bearer, signing_key
from worker.endpoint.client_tls import ClientCertificates
from worker.endpoint.destinations import DestinationPolicy, check_host, endpoint_host, literal_address
from worker.endpoint.oidc import OidcIssuer, Tokens
from worker.endpoint.secrets import SecretStore, SecretUnavailable
from worker.model.config import Settings
from worker.model.subscriptions import Subscription
from worker.runtime.errors import ConfigError, DestinationRefused

Admit = Callable[[Subscription], None]  # raises ConfigError naming the field and the rule


def admit(sub: Subscription, policy: DestinationPolicy, oidc: OidcIssuer | None, resolve: bool = False) -> None:
    """Refuse `sub` where this worker could not serve it as written: its host (as the client connects
    to it) is refused, credentials would go over plain http:// to a place the policy did not admit,
    or it asks for OIDC tokens the worker cannot sign. The same for its OAuth 2.0 token URL, which
    the client secret goes to. `resolve`: look names up too (at load)."""
    where = f"subscription {sub.name!r}"
    _admit_url(where, "deliver.push.url", sub.url, sub.credentials, policy, resolve)
    if sub.oauth2 is not None:
        _admit_url(where, "deliver.push.oauth2.token_url", sub.oauth2.token_url, True, policy, resolve)
    if sub.oidc is not None and oidc is None:
        raise ConfigError(where, "deliver.push.oidc", "needs the worker setting oidc (issuer and signing_keys): "
                                                      "the fleet signs every token with its own keys")


def _admit_url(where: str, field: str, url: str, credentials: bool, policy: DestinationPolicy, resolve: bool) -> None:
    host = endpoint_host(url)
    try:
        check_host(host, policy, resolve=resolve)
    except DestinationRefused as e:
        raise ConfigError(where, field, str(e)) from None
    if credentials and urlsplit(url).scheme == "http":  # the scheme as the client reads it (any case)
        literal = literal_address(host)
        why = (policy.clear_text_refusal(str(literal)) if literal is not None
               else None if policy.may_send_credentials_in_clear()
               else "credentials are sent only over https:// (or to a private network admitted by "
                    "destinations.allow_cidrs or allow_private)")
        if why:
            raise ConfigError(where, field, why)


def admit_for(settings: Settings) -> Admit:
    """`admit` with a worker's own policy and OIDC settings, as a registry check."""
    return functools.partial(admit, policy=settings.destinations, oidc=settings.oidc)


def secret_store(settings: Settings) -> SecretStore:
    return SecretStore(secrets_dir=settings.secrets_dir)


def preflight(settings: Settings, secrets: SecretStore | None = None) -> None:
    """Refuse, at load, what would fail every attempt: push URLs whose host is or resolves to a refused
    address, credentials over plain http://, secrets and OIDC keys that cannot be read or used."""
    secrets = secrets or secret_store(settings)
    for field, path in (("pulsar.tls_trust_certs_file", settings.pulsar.tls_trust_certs_file),
                        ("redis.tls_ca_file", settings.redis.tls_ca_file)):
        if path:
            _check_ca_file(field, path)
    if settings.oidc is not None:
        tokens = Tokens(secrets, settings.oidc)
        for i, key in enumerate(settings.oidc.keys):
            try:
                tokens.private_key(key)
            except SecretUnavailable as e:
                raise ConfigError("config", f"oidc.signing_keys[{i}]", str(e)) from None
    for sub in settings.subscriptions:
        admit(sub, settings.destinations, settings.oidc, resolve=True)
        check_secrets(sub, secrets)


def _check_ca_file(field: str, path: str) -> None:
    """A CA file that cannot be read or holds no certificate: every TLS connection would fail, one
    retry after another, where `check` can say so at once."""
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError:
        raise ConfigError("config", field, f"must hold PEM certificates ({path} holds none)") from None
    except OSError as e:
        raise ConfigError("config", field, f"cannot be read ({e.strerror}: {path})") from None


def check_secrets(sub: Subscription, secrets: SecretStore) -> None:
    """Every signing secret, bearer token and client certificate of `sub` can be read and used as
    delivery uses it (a `whsec_` secret decodes, a token fits in a header, a certificate loads with
    its key), else a ConfigError naming it."""
    def usable(field: str, use: Callable[[], object]) -> None:
        try:
            use()
        except SecretUnavailable as e:
            raise ConfigError(f"subscription {sub.name!r}", field, str(e)) from None

    for i, ref in enumerate(sub.signing_secrets):
        usable(f"deliver.push.signing_secrets[{i}]", lambda: signing_key(secrets.read(ref)))  # noqa: B023 - called at once
    if sub.bearer_token is not None:
        usable("deliver.push.bearer_token", functools.partial(bearer, secrets, sub.bearer_token))
    if sub.oauth2 is not None:
        usable("deliver.push.oauth2.client_secret", functools.partial(secrets.read, sub.oauth2.client_secret))
    if sub.tls is not None:
        usable("deliver.push.tls", functools.partial(ClientCertificates(secrets).context, sub.tls.client_certificate,
                                                      sub.tls.client_key))
