"""A request on its way: the subscription's rate limit, the endpoint's window, the credentials it
carries (signatures, OIDC, OAuth 2.0, a client certificate), and what its answer tells the endpoint's
health, the breaker and the metrics."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from worker.core.attempts import AttemptRecord
from worker.core.breaker import Breaker
from worker.core.context import STOPPED, Shared
from worker.core.delivery import Outcome, Result
from worker.core.endpoint_health import EndpointHealth
from worker.core.fencing import Fencing
from worker.core.flow import AdaptiveLimit, RateLimit
from worker.core.messages import Envelope, PushRequest, batch_id, build_batch_request, build_request
from worker.core.scheduler import cost_of
from worker.core.signing import auth_headers
from worker.endpoint.secrets import SecretUnavailable
from worker.model.subscriptions import Subscription


def rate_of(sub: Subscription) -> tuple[float, float]:
    """The subscription's rate limit as (per second, burst); 0 per second: none."""
    limit = sub.rate_limit
    return (0.0, 1.0) if limit is None else (limit.messages_per_second, limit.burst)


class Sender:
    """Sends one subscription's requests. `on_answer` runs after each answer (the state it shows may
    have changed)."""

    def __init__(self, shared: Shared, fencing: Fencing, breaker: Breaker, health: EndpointHealth,
                 on_answer: Callable[[], None]) -> None:
        self._shared = shared
        self._fencing = fencing
        self._breaker = breaker
        self._health = health
        self._on_answer = on_answer
        self.endpoint_limit = AdaptiveLimit(shared.sub.concurrency)
        self.rate = RateLimit(*rate_of(shared.sub))

    def update(self, sub: Subscription) -> None:
        self.endpoint_limit.set_ceiling(sub.concurrency)
        self.rate.set(*rate_of(sub))

    async def message(self, sub: Subscription, env: Envelope, attempt: int, probe: bool = False) -> Outcome | None:
        """One request for one message, or None when it was held back while it waited (`request`)."""
        return await self.request(sub, build_request(sub, env, attempt), env.message_id, probe=probe,
                                  traced=((env, attempt),))

    async def batch(self, sub: Subscription, sending: list[tuple[Any, Envelope, AttemptRecord]],
                    probe: bool = False) -> Outcome | None:
        """One request carrying `sending` (one message and no batch in effect: the single-message form)."""
        if sub.batch is None and len(sending) == 1:
            _, env, record = sending[0]
            return await self.message(sub, env, record.number, probe)
        request = build_batch_request(sub, [(env, record.number) for _, env, record in sending])
        webhook_id = batch_id([env.message_id for _, env, _ in sending])
        return await self.request(sub, request, webhook_id, len(sending), probe,
                                  [(env, record.number) for _, env, record in sending])

    async def request(self, sub: Subscription, request: PushRequest, webhook_id: str,
                      messages: int = 1, probe: bool = False,
                      traced: Sequence[tuple[Envelope, int]] = ()) -> Outcome | None:
        """Send `request` (carrying `messages`; `webhook_id`: its id when signed) once the rate limit
        and the endpoint's window allow; None when it may not go any more: the lease was lost, or the
        breaker opened meanwhile and this is no probe (requests queued for the rate limit went out
        after it had opened). A worker that traces starts the attempt's span (of the `traced`
        messages and their attempt numbers) right before the request, which carries its context; the
        outcome holds it until the attempt settles."""
        m = self._shared.m
        if request.omitted_attributes:
            m.attributes_omitted.inc(request.omitted_attributes)
        # The project's turn of the loop first (`scheduler.FairShare`): a retry storm or a burst of
        # another project's requests does not keep this one waiting behind all of it.
        await self._shared.ctx.share.turn(sub.tenant, cost_of(len(request.body)))
        # The rate limit before a concurrency slot: a request waiting for its turn holds no slot.
        waited = await self.rate.take()
        if waited:
            m.rate_limited_seconds.inc(waited)
        ticket = await self.endpoint_limit.acquire()
        # Checked again right before the request: Redis may have been slow, the breaker may have opened.
        if not self._fencing.may_deliver() or (self._breaker.is_open and not probe):
            self.endpoint_limit.release(None, ticket)
            return None
        tracer = self._shared.ctx.tracer
        span = None
        if tracer is not None and traced:
            span, headers = tracer.attempt(sub, traced, probe)
            if headers:
                request.headers.update(headers)
        try:
            outcome = await self._send(sub, webhook_id, request)
        except BaseException:
            self.endpoint_limit.release(None, ticket)
            if tracer is not None and span is not None:
                tracer.settled(span, STOPPED)
            raise
        self.endpoint_limit.release(outcome, ticket)
        # And again for what the answer sets going (ack, records): answers come back all together.
        await self._shared.ctx.share.turn(sub.tenant)
        self._health.record(outcome.acked, outcome.last_status)
        if outcome.acked:
            self._breaker.acked()
        self._shared.stats.recent.record(outcome, messages)
        self._on_answer()  # Error comes with time, so compare with what was reported
        m.delivery(outcome.label).inc(messages)
        if tracer is None or span is None:
            m.delivery_seconds.observe(outcome.latency)
        else:  # the latency's point links to its trace (an exemplar, where OpenMetrics is scraped)
            tracer.answered(span, outcome)
            outcome.span = span
            m.delivery_seconds.observe(outcome.latency, tracer.exemplar(span))
        return outcome

    async def _send(self, sub: Subscription, webhook_id: str, request: PushRequest) -> Outcome:
        outcome = await self._send_once(sub, webhook_id, request)
        oauth2 = self._shared.ctx.oauth2
        if outcome.status == 401 and sub.oauth2 is not None and oauth2 is not None:
            # The token was refused (revoked, or expired early): once more with a new one, at once.
            oauth2.refused(sub.oauth2)
            outcome = await self._send_once(sub, webhook_id, request)
        return outcome

    async def _send_once(self, sub: Subscription, webhook_id: str, request: PushRequest) -> Outcome:
        ctx = self._shared.ctx
        tls = None
        try:  # signed at send time, so webhook-timestamp is the moment of this attempt
            extra = auth_headers(ctx.secrets, sub.signing_secrets, sub.bearer_token, webhook_id, request.body)
            if sub.oidc is not None:
                assert ctx.tokens is not None
                extra["Authorization"] = "Bearer " + ctx.tokens.token(sub.oidc, sub.tenant, sub.name, sub.url)
            if sub.oauth2 is not None:
                if ctx.oauth2 is None:
                    raise SecretUnavailable("deliver.push.oauth2: this worker fetches no OAuth 2.0 tokens")
                extra["Authorization"] = "Bearer " + await ctx.oauth2.token(sub.oauth2, sub.tenant)
            if sub.tls is not None:
                assert ctx.certificates is not None
                tls = ctx.certificates.context(sub.tls.client_certificate, sub.tls.client_key)
        except SecretUnavailable as e:
            return Outcome(Result.NOT_SENT, detail=str(e))
        if extra:
            request = PushRequest({**request.headers, **extra}, request.body, request.omitted_attributes)
        return await ctx.deliverer.attempt(sub.url, request, float(sub.ack_deadline_seconds), bool(extra),
                                           sub.tenant, tls)
