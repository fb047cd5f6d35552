"""The push subscription model and its rules, as the platform docs define them.

A `Subscription` is immutable; edits produce a new value. `parse_subscription` turns untrusted
mappings (config file, registry) into one, or raises `ConfigError` naming subscription, field and rule.
A definition can only name its own project's things: its topics are in its project's tenant
(`persistent://p-<short>/...`), and a registry entry's secrets are names resolved in that project's
directory (`{secret: NAME}`); only the operator's config file (`trusted`) may name the worker's
environment or files.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from worker.endpoint.oauth2 import OAuth2
from worker.endpoint.oidc import Oidc
from worker.endpoint.secrets import SECRET_NAME_RULE, SecretRef, secret_name_ok
from worker.model.filters import Filter, FilterError, parse_filter
from worker.runtime.errors import ConfigError
from worker.runtime.fields import FieldReader, bounds, declared, read, setting, yaml_fields

NAME_RULE = "lowercase letters, digits and dashes; starts with a letter, does not end with a dash; 63 max"
_NAME = r"[a-z]([a-z0-9-]{0,61}[a-z0-9])?"
# The platform maps each project to the Pulsar tenant p-<short> (so no project key can be `fleet/...`).
_PROJECT = r"p-[a-z0-9]([a-z0-9-]{0,59}[a-z0-9])?"
NAME_PATTERN = re.compile(f"^{_NAME}$")
PROJECT_PATTERN = re.compile(f"^{_PROJECT}$")
SUBSCRIPTION_KEY = re.compile(f"^{_PROJECT}/{_NAME}$")  # `<project>/<name>`: nothing else names one in Redis
PROJECT_RULE = "a project's tenant: p-<short> (lowercase letters, digits and dashes)"
# persistent://<tenant>/<namespace>/<topic>; the platform puts every project in tenant p-<short>, ns main.
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_TOPIC_RE = re.compile(r"^(persistent|non-persistent)://([A-Za-z0-9_.=-]+)/([A-Za-z0-9_.=-]+)/([A-Za-z0-9_.=-]+)$")

TYPES = ("shared", "key-shared", "exclusive", "failover")
START_FROM = ("all", "new")
CONTENT_MODES = ("wrapped", "raw", "cloudevents", "gcp")
CLOUDEVENTS_MODES = ("binary", "structured")
_HEADER_TEXT_RE = re.compile(r"^[\x21-\x7e]{1,256}$")  # visible ASCII, no spaces: safe in a header
MODES = ("push", "pull")


class State(enum.StrEnum):
    """Subscription states as the platform docs name them (Paused and Expired are the fleet's)."""

    ACTIVE = "Active"
    ERROR = "Error"
    SEEKING = "Seeking"
    PAUSED = "Paused"
    EXPIRED = "Expired"
    SUSPENDED = "Suspended"  # its breaker is open (deliver.push.breaker): only probes go
    STARTING = "Starting"  # its owner's subscribe keeps failing (the broker refuses it)
    QUARANTINED = "Quarantined"  # paused by the fleet: its workers died serving it (fleet/quarantine.py)


ERROR_AFTER_SECONDS = 300.0  # an endpoint failing every attempt for this long puts the subscription in Error


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff bounds between failed attempts."""

    min_backoff_seconds: float = setting(1.0, 0.0, 3600.0, help="the delay before the first retry")
    max_backoff_seconds: float = setting(60.0, 0.0, 3600.0, help="the longest delay between two attempts "
                                         "(at least min_backoff_seconds; the worker waits at least 0.1 s)")


MAX_WORKERS = 64  # workers one subscription may spread over
MAX_RATE = 100_000.0  # requests a second: a bound on what one subscription may ask for, not a target


@dataclass(frozen=True)
class RateLimit:
    """`deliver.push.rate_limit`: requests to the endpoint over any `t` seconds stay within
    `messages_per_second * t + burst`."""

    messages_per_second: float = setting(low=0.001, high=MAX_RATE, read_by_hand=True,
                                         help="requests a second to the endpoint, retries included")
    burst: float = setting(low=1.0, high=MAX_RATE, read_by_hand=True, shown_default="messages_per_second",
                           help="requests at once after a quiet spell (at least 1)")


@dataclass(frozen=True)
class ClientTls:
    """`deliver.push.tls`: the client certificate (and its key) presented to an endpoint that
    requires mutual TLS (`client_tls.py`)."""

    client_certificate: SecretRef
    client_key: SecretRef


@dataclass(frozen=True)
class BreakerPolicy:
    """`deliver.push.breaker` (`breaker.py`): open after every attempt failed for
    `open_after_seconds`; then one probe every `probe_interval_seconds`."""

    open_after_seconds: float = setting(300.0, 1.0, 86_400.0, help="every attempt failed this long: Suspended")
    probe_interval_seconds: float = setting(30.0, 1.0, 3_600.0, help="one probe this often while Suspended")


@dataclass(frozen=True)
class BatchPolicy:
    """`deliver.push.batch`: up to `max_messages` messages (and about `max_bytes` of request body) in
    one request, waiting at most `max_wait_ms` for it to fill."""

    max_messages: int = setting(100, 1, 1000, help="messages a request at most")
    max_bytes: int = setting(1024 * 1024, 1024, 64 * 1024 * 1024,
                             help="request body at most (estimated; a larger message goes alone)")
    max_wait_ms: int = setting(50, 0, 10_000, help="how long a batch may wait to fill after its first message")


@dataclass(frozen=True)
class CloudEvents:
    """`deliver.push.cloudevents`: how `content: cloudevents` requests are made (CloudEvents 1.0, HTTP
    binding). `source` None: `//pulsar/<topic>`."""

    mode: str = setting("binary", choices=CLOUDEVENTS_MODES,
                        help="binary: context in ce- headers, the payload as the body; structured: one JSON event")
    type: str = setting("pubsub.message.published", read_by_hand=True, help="the events' type (visible ASCII)")
    source: str | None = setting(None, read_by_hand=True, help="the events' source (none: //pulsar/<topic>)")


@dataclass(frozen=True)
class Subscription:
    """One push subscription: where messages come from, where they go, and how hard to try."""

    name: str = setting(read_by_hand=True, help="the subscription's name in its project (" + NAME_RULE + ")")
    topic: str = setting(read_by_hand=True, help="persistent://p-<project>/main/<topic> (immutable)")
    url: str = setting(read_by_hand=True, yaml="deliver.push.url", help="the endpoint: http or https, an ASCII host, "
                       "no credentials, at most 2,048 characters")
    type: str = setting("shared", choices=TYPES, help="the Pulsar subscription type (immutable)")
    content: str = setting("wrapped", choices=CONTENT_MODES, yaml="deliver.push.content",
                           help="the request body (the delivery contract shows each)")
    ack_deadline_seconds: int = setting(30, 1, 600, help="the per-request timeout")
    max_deliver: int = setting(5, -1, 1000, help="attempts before dead-lettering; -1: retry forever; 0: "
                               "dead-letter the first failure")
    max_ack_pending: int = setting(1000, 1, 100_000, help="messages taken from the broker and not yet settled")
    max_concurrency: int | None = setting(None, 1, 10_000, read_by_hand=True,
                                          help="requests in flight at most (below max_ack_pending)")
    start_from: str = setting("all", choices=START_FROM, help="where a new subscription starts (immutable)")
    max_workers: int = setting(1, 1, MAX_WORKERS, help="workers that may serve it at once, each with a consumer "
                               "(exclusive: 1; failover: up to the topic's partitions)")
    retry: RetryPolicy = setting(RetryPolicy, section=True, help="the backoff between attempts")
    dead_letter_topic: str | None = setting(None, read_by_hand=True, yaml="dead_letter.topic",
                                            help="where exhausted messages go, in the project's tenant ("
                                                 "dead_letter.after_attempts overrides max_deliver)")
    signing_secrets: tuple[SecretRef, ...] = setting((), read_by_hand=True, yaml="deliver.push.signing_secrets",
                                                     kind="list of 1-2 secrets",
                                                     help="Standard Webhooks signatures (two during a rotation)")
    bearer_token: SecretRef | None = setting(None, read_by_hand=True, yaml="deliver.push.bearer_token",
                                             kind="secret", help="Authorization: Bearer <token>")
    cloudevents: CloudEvents = setting(CloudEvents, section=True, yaml="deliver.push.cloudevents",
                                       help="content: cloudevents only")
    filter: Filter | None = setting(None, read_by_hand=True, kind="filter",
                                    help="Google Pub/Sub's filter syntax on attributes (immutable)")
    oidc: Oidc | None = setting(None, read_by_hand=True, yaml="deliver.push.oidc", kind="{audience}",
                                help="Authorization: Bearer <a JWT signed by the fleet's keys>")
    rate_limit: RateLimit | None = setting(None, section=True, yaml="deliver.push.rate_limit",
                                           help="requests over any t seconds within R t + B")
    breaker: BreakerPolicy | None = setting(BreakerPolicy, section=True, yaml="deliver.push.breaker",
                                            help="on by default; `off` disables it")  # None: `breaker: off`
    tls: ClientTls | None = setting(None, read_by_hand=True, yaml="deliver.push.tls",
                                    kind="{client_certificate, client_key}", help="mutual TLS (secrets)")
    oauth2: OAuth2 | None = setting(None, read_by_hand=True, yaml="deliver.push.oauth2",
                                    kind="{token_url, client_id, client_secret, scope, audience}",
                                    help="Authorization: Bearer <a token from the client credentials grant>")
    batch: BatchPolicy | None = setting(None, section=True, yaml="deliver.push.batch",
                                        help="several messages a request (content wrapped or cloudevents)")
    display_name: str | None = setting(None, read_by_hand=True, help="shown by subs get (at most 256 characters)")
    # The definition as written (secrets are references in it, never values): what a worker publishes
    # of its config file's subscriptions for the operator commands (fleet/published.py).
    definition: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Set here, in one order for every instance, the cached properties keep the instances' dicts
        # sharing their keys: first set when read (any order), each one unshared its dict, 1.5 KB a
        # subscription more (150 MB at 100,000, in every worker).
        if _TOPIC_RE.fullmatch(self.topic):  # else the topic is refused where it is checked, as before
            for name in ("tenant", "key"):
                getattr(self, name)

    @property
    def attempt_limit(self) -> int | None:
        """Attempts before giving up; None: never give up (`max_deliver: -1`)."""
        return None if self.max_deliver < 0 else max(1, self.max_deliver)

    @property
    def concurrency(self) -> int:
        """The most requests in flight at once."""
        return min(self.max_ack_pending, self.max_concurrency or self.max_ack_pending)

    @functools.cached_property  # read per message on the hot path
    def tenant(self) -> str:
        """The Pulsar tenant of the topic: the platform's project boundary."""
        return topic_parts(self.topic)[1]

    @property
    def credentials(self) -> bool:
        """Whether requests carry credentials (a signature, a bearer token, an OIDC token, a client
        certificate)."""
        return bool(self.signing_secrets) or self.bearer_token is not None or self.oidc is not None or \
            self.tls is not None or self.oauth2 is not None

    @functools.cached_property
    def key(self) -> str:
        """Unique within a fleet: two projects may both have a subscription called `orders`."""
        return f"{self.tenant}/{self.name}"

    @property
    def pulsar_subscription(self) -> str:
        """The Pulsar subscription name on the topic."""
        return self.name


TOPIC_RULE = "must be a full topic name like persistent://p-<project>/main/<topic>"


def valid_key(key: str) -> bool:
    """A subscription key `p-<short>/<name>` as the fleet spells it (nothing else can reach Redis)."""
    return bool(SUBSCRIPTION_KEY.fullmatch(key))


def topic_parts(topic: str) -> tuple[str, str, str, str]:
    """Split `persistent://tenant/ns/name` into its four parts (domain, tenant, namespace, name)."""
    m = _TOPIC_RE.fullmatch(topic)
    if not m:
        raise ValueError(topic)
    return m.group(1), m.group(2), m.group(3), m.group(4)


def _check_topic(r: FieldReader, name: str, value: str) -> tuple[str, str, str, str]:
    try:
        parts = topic_parts(value)
    except ValueError:
        raise r.fail(name, TOPIC_RULE) from None
    if parts[0] != "persistent":  # a non-persistent topic drops what no consumer holds: push must not lose messages
        raise r.fail(name, "must be persistent:// (a non-persistent topic loses messages no consumer holds)")
    if not PROJECT_PATTERN.fullmatch(parts[1]):
        raise r.fail(name, f"must be in {PROJECT_RULE} (got tenant {parts[1]!r})")
    return parts


MAX_URL_LENGTH = 2048


def _check_url(r: FieldReader, value: str, name: str = "url") -> str:
    if len(value) > MAX_URL_LENGTH:
        raise r.fail(name, f"must be at most {MAX_URL_LENGTH} characters (got {len(value)})")
    if any(c <= " " or c == "\x7f" for c in value):  # the HTTP client would drop them: another URL
        raise r.fail(name, "must not contain spaces or control characters (percent-encode them)")
    try:
        parts = urlsplit(value)
        _ = parts.port  # a port out of 0..65535 raises here
    except ValueError as e:
        raise r.fail(name, f"must be a valid URL ({e})") from None
    if parts.port == 0:
        raise r.fail(name, "must be a valid URL (port 0)")
    if parts.scheme not in ("http", "https"):
        raise r.fail(name, "must be an http or https URL")
    if not parts.hostname:
        raise r.fail(name, "must name a host")
    if not parts.hostname.isascii():  # one spelling only: the client would normalise it into another host
        raise r.fail(name, "must have an ASCII host (write an internationalised name in its xn-- form)")
    if parts.username or parts.password:
        raise r.fail(name, "must not carry credentials (use a bearer token secret instead)")
    return value


def _secret_ref(r: FieldReader, name: str, value: Any, project: str, trusted: bool) -> SecretRef:
    where_to = "{secret: NAME} (the file <secrets.dir>/" + project + "/NAME)"
    if not isinstance(value, dict):
        forms = f"{where_to}, {{env: VARIABLE}} or {{file: /path}}" if trusted else where_to
        raise r.fail(name, f"must say where the secret lives, {forms} (secrets never go in the definition itself)")
    ref = FieldReader(r.where, value, f"{r.prefix}{name}.")
    ref.reject_unknown({"secret", "env", "file"})
    kinds = [kind for kind in ("secret", "env", "file") if ref.has(kind)]
    if len(kinds) != 1:
        raise r.fail(name, f"must have exactly one of secret, env or file: {where_to}")
    if kinds[0] != "secret" and not trusted:
        raise ref.fail(kinds[0], f"is for the operator's config file only: a registry subscription names its "
                                 f"project's secret, {where_to}")
    if kinds[0] == "secret":
        secret = ref.text("secret")
        if not secret_name_ok(secret):
            raise ref.fail("secret", SECRET_NAME_RULE)
        return SecretRef(secret=secret, project=project)
    if kinds[0] == "env":
        env = ref.text("env")
        if not _ENV_NAME_RE.fullmatch(env):
            raise ref.fail("env", "must be an environment variable name (letters, digits, underscore)")
        return SecretRef(env=env)
    return SecretRef(file=ref.text("file"))


def _auth(push: FieldReader, project: str, trusted: bool) -> tuple[tuple[SecretRef, ...], SecretRef | None]:
    secrets = push.data.get("signing_secrets")
    refs: tuple[SecretRef, ...] = ()
    if secrets is not None:
        if not isinstance(secrets, list) or not 1 <= len(secrets) <= 2:
            raise push.fail("signing_secrets", "must be a list of one secret, or two during a rotation")
        refs = tuple(_secret_ref(push, f"signing_secrets[{i}]", v, project, trusted) for i, v in enumerate(secrets))
    bearer = push.data.get("bearer_token")
    return refs, (None if bearer is None else _secret_ref(push, "bearer_token", bearer, project, trusted))


def is_push(data: Any) -> bool:
    """True unless the definition says `deliver.mode: pull` (pull is not this fleet's job)."""
    if not isinstance(data, dict):
        return True
    deliver = data.get("deliver")
    return not (isinstance(deliver, dict) and deliver.get("mode") == "pull")


def parse_subscription(data: Any, where: str = "", *, trusted: bool = False, stored: bool = False) -> Subscription:
    """Validate one subscription definition and build its value. `trusted`: it comes from the
    operator's config file (it may name the worker's environment and files); else from the
    registry, written on behalf of a project. `stored`: read back from the registry, where it may
    have been written under older rules (a filter mixing AND and OR keeps its reading)."""
    if not isinstance(data, dict):
        raise ConfigError(where, "subscription", "must be a mapping")
    name_value = data.get("name")
    where = f"subscription {name_value!r}" if isinstance(name_value, str) else (where or "subscription")
    r = FieldReader(where, data)
    r.reject_unknown(yaml_fields(Subscription))
    name = r.text("name")
    if not NAME_PATTERN.fullmatch(name):
        raise r.fail("name", NAME_RULE)
    display_name = data.get("display_name")
    if display_name is not None and (not isinstance(display_name, str) or len(display_name) > 256):
        raise r.fail("display_name", "must be a string of at most 256 characters")
    topic = r.text("topic")
    _, tenant, _, _ = _check_topic(r, "topic", topic)

    deliver = r.sub("deliver")
    deliver.reject_unknown({"mode", "push"})
    if deliver.choice("mode", MODES, "pull") != "push":
        raise deliver.fail("mode", "must be push for this fleet (pull subscriptions are ignored)")
    push = deliver.sub("push")
    push.reject_unknown(yaml_fields(Subscription, under="deliver.push"))
    url = _check_url(push, push.text("url"))
    content = read(Subscription, push, "content")
    cloudevents = _cloudevents(push, content)
    signing_secrets, bearer_token = _auth(push, tenant, trusted)
    oidc = _oidc(push)
    if oidc is not None and bearer_token is not None:
        raise push.fail("oidc", "cannot be combined with bearer_token (both set Authorization)")
    oauth2 = _oauth2(push, tenant, trusted)
    if oauth2 is not None and (oidc is not None or bearer_token is not None):
        raise push.fail("oauth2", "cannot be combined with bearer_token or oidc (each sets Authorization)")

    retry_reader = r.sub("retry")
    retry = declared(RetryPolicy, retry_reader)
    if retry.max_backoff_seconds < retry.min_backoff_seconds:
        raise retry_reader.fail("max_backoff_seconds",
                                f"must be >= min_backoff_seconds ({retry.min_backoff_seconds:g})")

    max_deliver = read(Subscription, r, "max_deliver")
    kind = read(Subscription, r, "type")
    max_workers = read(Subscription, r, "max_workers")
    if kind == "exclusive" and max_workers > 1:
        raise r.fail("max_workers", f"must be 1 for type exclusive (one consumer at a time; got {max_workers}): "
                                    "use shared or key-shared to spread a subscription over several workers")
    dead_letter_topic = None
    if r.has("dead_letter"):
        dl = r.sub("dead_letter")
        dl.reject_unknown({"topic", "after_attempts"})
        dl_topic = dl.data.get("topic")
        if dl_topic != "":  # {"topic": ""} clears it, as in the platform's PATCH rules
            dead_letter_topic = dl.text("topic")
            _, dl_tenant, _, _ = _check_topic(dl, "topic", dead_letter_topic)
            # A partition (`<topic>-partition-N`) and its partitioned topic overlap: dead letters would come back.
            if topic in (dead_letter_topic, _partitioned_topic(dead_letter_topic)) or \
                    dead_letter_topic == _partitioned_topic(topic):
                raise dl.fail("topic", "must differ from the subscription's own topic (and its partitions)")
            if dl_tenant != tenant:
                raise dl.fail("topic", f"must be in the subscription's project tenant {tenant!r}")
        if dl.has("after_attempts"):
            max_deliver = dl.integer("after_attempts", max_deliver, *bounds(Subscription, "max_deliver"))

    return Subscription(
        name=name,
        topic=topic,
        url=url,
        type=kind,
        content=content,
        ack_deadline_seconds=read(Subscription, r, "ack_deadline_seconds"),
        max_deliver=max_deliver,
        max_ack_pending=read(Subscription, r, "max_ack_pending"),
        max_concurrency=(r.integer("max_concurrency", 0, *bounds(Subscription, "max_concurrency"))
                         if r.has("max_concurrency") else None),
        start_from=read(Subscription, r, "start_from"),
        max_workers=max_workers,
        retry=retry,
        display_name=display_name,
        dead_letter_topic=dead_letter_topic,
        signing_secrets=signing_secrets,
        bearer_token=bearer_token,
        cloudevents=cloudevents,
        filter=_filter(r, stored),
        oidc=oidc,
        rate_limit=_rate_limit(push),
        breaker=_breaker(push),
        tls=_client_tls(push, url, tenant, trusted),
        oauth2=oauth2,
        batch=_batch(push, content),
        definition=data,
    )


def _rate_limit(push: FieldReader) -> RateLimit | None:
    """`rate_limit: {messages_per_second: R, burst: B}` (B defaults to R, at least 1)."""
    if not push.has("rate_limit"):
        return None
    rl = push.sub("rate_limit")
    rl.reject_unknown({"messages_per_second", "burst"})
    if not rl.has("messages_per_second"):
        raise rl.fail("messages_per_second", "is required (requests a second to the endpoint)")
    low, high = bounds(RateLimit, "messages_per_second")
    rate = rl.number("messages_per_second", 0.0, low, high)
    if rate <= 0:
        raise rl.fail("messages_per_second", f"must be in {low:g}..{high:g} (got {rate:g})")
    return RateLimit(rate, rl.number("burst", max(1.0, rate), *bounds(RateLimit, "burst")))


BATCHED_CONTENT = ("wrapped", "cloudevents")  # the formats with a batch form


def _batch(push: FieldReader, content: str) -> BatchPolicy | None:
    """`batch: {max_messages: M, max_bytes: X, max_wait_ms: W}` (each optional), for a format that has
    a batch form."""
    if not push.has("batch"):
        return None
    if content not in BATCHED_CONTENT:
        raise push.fail("batch", f"needs content {' or '.join(BATCHED_CONTENT)} (content {content} has no batch form)")
    return declared(BatchPolicy, push.sub("batch"))


def _oauth2(push: FieldReader, project: str, trusted: bool) -> OAuth2 | None:
    """`oauth2: {token_url, client_id, client_secret: <secret>, scope?, audience?}`."""
    if not push.has("oauth2"):
        return None
    o = push.sub("oauth2")
    o.reject_unknown({"token_url", "client_id", "client_secret", "scope", "audience"})
    if not o.has("client_secret"):
        raise o.fail("client_secret", "is required")
    return OAuth2(token_url=_check_url(o, o.text("token_url"), "token_url"), client_id=o.text("client_id"),
                  client_secret=_secret_ref(o, "client_secret", o.data["client_secret"], project, trusted),
                  scope=o.text("scope") if o.has("scope") else None,
                  audience=o.text("audience") if o.has("audience") else None)


def _client_tls(push: FieldReader, url: str, project: str, trusted: bool) -> ClientTls | None:
    """`tls: {client_certificate: <secret>, client_key: <secret>}`, for an https:// endpoint."""
    if not push.has("tls"):
        return None
    t = push.sub("tls")
    t.reject_unknown({"client_certificate", "client_key"})
    if urlsplit(url).scheme.lower() != "https":
        raise push.fail("tls", "needs an https:// url (a client certificate is presented in the TLS handshake)")
    for name in ("client_certificate", "client_key"):
        if not t.has(name):
            raise t.fail(name, "is required")
    return ClientTls(_secret_ref(t, "client_certificate", t.data["client_certificate"], project, trusted),
                     _secret_ref(t, "client_key", t.data["client_key"], project, trusted))


def _breaker(push: FieldReader) -> BreakerPolicy | None:
    """`breaker: off`, or `breaker: {open_after_seconds: S, probe_interval_seconds: P}` (on by default)."""
    if not push.has("breaker"):
        return BreakerPolicy()
    value = push.data["breaker"]
    if value is False or value == "off":  # YAML reads a bare `off` as false
        return None
    if not isinstance(value, dict):
        raise push.fail("breaker", "must be off or {open_after_seconds: S, probe_interval_seconds: P}")
    return declared(BreakerPolicy, push.sub("breaker"))


def _oidc(push: FieldReader) -> Oidc | None:
    """`oidc: {audience?}`: the fleet signs (the worker setting `oidc`); a subscription chooses only
    its tokens' audience (default: the push URL)."""
    if not push.has("oidc"):
        return None
    o = push.sub("oidc")
    for moved in ("issuer", "signing_key", "key_id"):
        if o.has(moved):
            raise o.fail(moved, "is the worker's setting now, not a subscription's: the fleet signs every token "
                                "with its own keys (oidc: {issuer, signing_keys} in the worker config); a subscription "
                                "sets only deliver.push.oidc.audience")
    o.reject_unknown({"audience"})
    return Oidc(audience=o.text("audience") if o.has("audience") else None)


def _filter(r: FieldReader, stored: bool) -> Filter | None:
    if not r.has("filter"):
        return None
    try:
        return parse_filter(r.text("filter"), mixed=stored)
    except FilterError as e:
        raise r.fail("filter", str(e)) from None


def _partitioned_topic(topic: str) -> str | None:
    """The partitioned topic `topic` is a partition of (`...-partition-N`), else None."""
    found = re.fullmatch(r"(.+)-partition-\d+", topic)
    return found.group(1) if found else None


def _cloudevents(push: FieldReader, content: str) -> CloudEvents:
    if not push.has("cloudevents"):
        return CloudEvents()
    if content != "cloudevents":
        raise push.fail("cloudevents", "is only for content: cloudevents")
    ce = push.sub("cloudevents")
    values: dict[str, str] = {}
    for name in ("type", "source"):
        if ce.has(name):
            values[name] = ce.text(name)
            if not _HEADER_TEXT_RE.fullmatch(values[name]):
                raise ce.fail(name, "must be 1-256 visible ASCII characters without spaces")
    return declared(CloudEvents, ce, **values)
