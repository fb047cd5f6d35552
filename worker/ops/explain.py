"""The one line (and exit code) a user gets for an error: what failed and what to check. Shared by
the command line, the operator API and the admin process, so a failure reads alike everywhere."""

from __future__ import annotations

from worker.runtime.errors import ConfigError, NotFound, PushWorkerError, UsageError

# A Redis that works but will not do what was asked, and what to do about it: its error code (as
# it comes back from inside a script) or redis-py's class for it (which drops the code).
_REDIS_REFUSALS = (
    ("OOM ", "OutOfMemoryError", "it is full (maxmemory reached, policy noeviction): give it memory or lower the TTLs"),
    ("READONLY ", "ReadOnlyError",
     "it is a read-only replica: point the Redis URL at the master (or use redis.mode sentinel)"),
    ("NOPERM ", "NoPermissionError", "its ACL user may not run it"),
    ("LOADING ", "BusyLoadingError", "it is still loading its data: try again shortly"),
    ("MISCONF ", "", "it cannot save to disk and refuses writes: check its disk and logs"),
)


# What a broker's refusal usually means for an operator command.
_BROKER_REFUSALS = {
    "TopicNotFound": " (the topic, or its tenant or namespace, does not exist: Apache Pulsar creates none of "
                     "them on first use)",
    "AuthenticationError": " (check the token: $PUSH_WORKER_PULSAR_TOKEN)",
    "AuthorizationError": " (the token's role lacks a permission on the namespace)",
}


def explain(error: BaseException) -> tuple[int, str]:
    """The exit code and the one line an operator sees for `error`: what failed and what to check."""
    import pulsar
    import pulsar.asyncio as pulsar_async
    from redis import exceptions as redis_errors

    text = " ".join(str(error).split())[:300] or type(error).__name__
    if isinstance(error, UsageError):
        return 2, f"invalid argument: {text}"
    if isinstance(error, ConfigError):
        return 2, f"invalid configuration: {text}"
    if isinstance(error, NotFound):
        return 3, text
    if isinstance(error, PushWorkerError):
        return 1, text
    if isinstance(error, redis_errors.AuthenticationError) or "WRONGPASS" in text or "NOAUTH" in text:
        return 1, f"redis refused the credentials ({text}); check the password in the Redis URL"
    if isinstance(error, (redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.RedisClusterException)):
        from worker.state.redis_client import describe

        return 1, (f"redis unreachable ({describe(error)[:300]}); check --redis-url, redis.url or "
                   "$PUSH_WORKER_REDIS_URL (or redis.nodes / redis.sentinels), and that Redis is running")
    if isinstance(error, redis_errors.RedisError):
        refused = next((why for code, kind, why in _REDIS_REFUSALS
                        if code in text or type(error).__name__ == kind), None)
        if refused:
            return 1, f"redis refused the command: {refused} ({text})"
        return 1, f"redis answered with an error ({text}); its data may be damaged"
    if isinstance(error, (pulsar.PulsarException, pulsar_async.PulsarException)):
        from worker.broker.consumer import answered_by_broker, broker_error_text, broker_result, result_name

        if answered_by_broker(error):  # it is there and said no: its URL is not what to check
            name = result_name(broker_result(error))
            return 1, f"the broker refused: {name}" + _BROKER_REFUSALS.get(name, "")
        # A broker that authenticates drops a connection without a valid token unanswered: the
        # client sees the same timeout as from a dead broker (measured on Apache Pulsar).
        return 1, (f"the broker failed: {broker_error_text(error)}; check --service-url, pulsar.service_url or "
                   "$PUSH_WORKER_PULSAR_URL, that the broker is running, and $PUSH_WORKER_PULSAR_TOKEN if it "
                   "authenticates clients")
    if isinstance(error, OSError):
        return 1, f"{text}"
    return 1, f"unexpected error: {type(error).__name__}: {text} (a bug: PUSH_WORKER_DEBUG=1 shows where)"
