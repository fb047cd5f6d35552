"""Reading the delivery log (core/attempts.py writes it): search, newest first, and the hourly counts.

A search reads the stream backwards from a cursor (an entry id, exclusive) in chunks, keeps the
entries that match, and stops at `limit` matches or after SCAN_BUDGET entries, whichever comes
first: one request costs Redis a bounded read however rare the matches, and `next_cursor` goes on
where it stopped. Entry ids are times, so a time window is the range read, not a filter.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import orjson

from worker.core import keys
from worker.core.delivery import Result
from worker.core.history import LATENCY_BINS_MS, outcome_class
from worker.state.redis_client import AsyncClient

SCAN_BUDGET = 5000  # entries read per search request at most
CHUNK = 500
MAX_LIMIT = 200
ATTEMPT_RESULTS = frozenset(r.value for r in Result)
STATUS_CLASSES = ("2xx", "3xx", "4xx", "5xx", "timeout", "connection_error")


@dataclasses.dataclass(frozen=True)
class LogQuery:
    message_id: str = ""  # a whole message id or part of one ("0:10")
    since_ms: int | None = None
    until_ms: int | None = None
    status: str = ""  # one of STATUS_CLASSES, or an exact status ("503")
    min_attempt: int = 1
    ordering_key: str = ""
    limit: int = 50
    cursor: str = ""  # an entry id: the page goes on from just before it

    def takes(self, entry: dict[str, Any]) -> bool:
        if self.message_id and self.message_id not in entry["message_id"]:  # a whole id or part of one
            return False
        if self.ordering_key and entry["ordering_key"] != self.ordering_key:
            return False
        if self.min_attempt > 1 and (entry["attempt"] or 0) < self.min_attempt:
            return False
        if self.status:  # of attempts: an event (dead-lettered, ...) repeats its last attempt's status
            if entry["result"] not in ATTEMPT_RESULTS:
                return False
            status = str(entry["status"])
            if status != self.status and outcome_class(status) != self.status:
                return False
        return True


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _json(value: str) -> Any:
    try:
        return orjson.loads(value) if value else None
    except orjson.JSONDecodeError:
        return None


def _fields(raw: dict[Any, Any] | None) -> dict[str, str]:
    """A stream entry's fields: layout 1's twelve, or layout 2's one JSON document (`e`) as the same."""
    fields = {_text(k): _text(v) for k, v in (raw or {}).items()}
    if "e" not in fields:
        return fields
    document = _json(fields["e"])
    if not isinstance(document, dict):
        return {}
    told = {"message_id", "attempt", "result", "event", "status", "latency_ms", "worker", "ordering_key",
            "request_headers", "response_headers", "answer", "detail", "at_ms"}
    out = {k: _text(document.get(k) if document.get(k) is not None else "") for k in
           ("message_id", "attempt", "status", "latency_ms", "worker", "ordering_key", "answer", "detail")}
    out["result"] = _text(document.get("result", document.get("event", "")))
    for k in ("request_headers", "response_headers"):
        out[k] = orjson.dumps(document[k]).decode() if isinstance(document.get(k), dict) else ""
    extra = {k: v for k, v in document.items() if k not in told}
    out["extra"] = orjson.dumps(extra).decode() if extra else ""
    return out


def entry_of(entry_id: Any, raw: dict[Any, Any] | None) -> dict[str, Any]:
    """One stream entry as the API shows it (fields an older or corrupt entry lacks are empty)."""
    fields = _fields(raw)
    text_id = _text(entry_id)
    attempt = fields.get("attempt", "")
    latency = fields.get("latency_ms", "")
    entry: dict[str, Any] = {
        "id": text_id, "at_ms": int(text_id.split("-")[0]) if text_id.split("-")[0].isdigit() else 0,
        "message_id": fields.get("message_id", ""), "attempt": int(attempt) if attempt.isdigit() else None,
        "result": fields.get("result", ""), "status": fields.get("status", ""),
        "latency_ms": float(latency) if latency.replace(".", "", 1).isdigit() else None,
        "worker": fields.get("worker", ""), "ordering_key": fields.get("ordering_key", ""),
        "request_headers": _json(fields.get("request_headers", "")) or {},
        "response_headers": _json(fields.get("response_headers", "")) or {},
        "answer": fields.get("answer", ""), "detail": fields.get("detail", "")}
    extra = _json(fields.get("extra", ""))
    if isinstance(extra, dict):
        entry["extra"] = extra
    return entry


def floor_ms(log_seconds: int, now_ms: int | None = None) -> int:
    """The oldest time the log keeps (older entries may linger until the next write trims them)."""
    return (now_ms if now_ms is not None else int(time.time() * 1000)) - log_seconds * 1000


async def search(client: AsyncClient, subscription_key: str, query: LogQuery,
                 log_seconds: int, budget: int = SCAN_BUDGET) -> dict[str, Any]:
    """Matching entries, newest first, and where the next page starts (None: nothing older), having
    read at most `budget` entries (the caller's share, at most SCAN_BUDGET)."""
    budget = min(budget, SCAN_BUDGET)
    key = keys.log_key(subscription_key)
    oldest = max(query.since_ms or 0, floor_ms(log_seconds))
    end: str = f"({query.cursor}" if query.cursor else (str(query.until_ms) if query.until_ms is not None else "+")
    found: list[dict[str, Any]] = []
    scanned, last, more = 0, "", True
    while more and scanned < budget and len(found) < query.limit:
        want = min(CHUNK, budget - scanned)
        chunk = await client.xrevrange(key, max=end, min=str(oldest), count=want) or []
        more = len(chunk) == want
        for i, (entry_id, raw) in enumerate(chunk):
            scanned += 1
            entry = entry_of(entry_id, raw)
            last = entry["id"]
            if query.takes(entry):
                found.append(entry)
                if len(found) >= query.limit:
                    more = more or i < len(chunk) - 1
                    break
        end = f"({last}"
    return {"entries": found, "next_cursor": last if more and last else None, "scanned": scanned}


async def of_message(client: AsyncClient, subscription_key: str, message_id: str, from_ms: int,
                     to_ms: int) -> list[dict[str, Any]]:
    """The log's entries of one message between two times (its history's first and last), oldest first."""
    raw = await client.xrange(keys.log_key(subscription_key), min=str(max(0, from_ms)), max=str(to_ms),
                              count=SCAN_BUDGET) or []
    return [entry for entry in (entry_of(i, fields) for i, fields in raw) if entry["message_id"] == message_id]


def _p95(bins: list[int]) -> float | None:
    total = sum(bins)
    if not total:
        return None
    wanted, seen = math.ceil(total * 0.95), 0
    for i, count in enumerate(bins):
        seen += count
        if seen >= wanted:
            return float(LATENCY_BINS_MS[i]) if i < len(LATENCY_BINS_MS) else None
    return None


async def hourly(client: AsyncClient, subscription_key: str, log_seconds: int,
                 now_ms: int | None = None) -> list[dict[str, Any]]:
    """Per hour of the log's window, oldest first: attempts, their outcome classes, and the p95
    latency (the upper bound of the bin that holds it; None beyond the last bin or with no attempt)."""
    raw = await client.hgetall(keys.log_stats_key(subscription_key))
    now_hour = (now_ms if now_ms is not None else int(time.time() * 1000)) // 3_600_000
    hours = [now_hour - i for i in range(math.ceil(log_seconds / 3600) - 1, -1, -1)]
    counts: dict[int, dict[str, int]] = {h: {} for h in hours}
    bins: dict[int, list[int]] = {h: [0] * (len(LATENCY_BINS_MS) + 1) for h in hours}
    for field, value in raw.items():
        hour_text, _, what = _text(field).partition(":")
        if not hour_text.isdigit() or int(hour_text) not in counts or not _text(value).lstrip("-").isdigit():
            continue
        hour, count = int(hour_text), int(_text(value))
        if what.startswith("l") and what[1:].isdigit() and int(what[1:]) < len(bins[hour]):
            bins[hour][int(what[1:])] += count
        elif what:
            counts[hour][what] = counts[hour].get(what, 0) + count
    return [{"hour_ms": h * 3_600_000, "attempts": sum(counts[h].values()), "by_class": counts[h],
             "p95_latency_ms": _p95(bins[h])} for h in hours]


