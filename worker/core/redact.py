"""Credentials cut out of what the delivery log keeps: an endpoint's answer and headers both ways.

An endpoint may echo the request back, credentials and all, in any encoding: as sent, in another
case, URL-encoded, JSON-escaped, in base64 or hex, split in pieces, with a byte inserted. Rather
than chase each form whole, any run of `RUN` characters of a credential in any of those encodings
is cut, wherever it appears, and so is a credential's start at the very end of the answer (where
the preview cut it off). A piece shorter than `RUN` is not enough to matter.
"""

from __future__ import annotations

import base64
import functools
import json
from urllib.parse import quote, quote_plus

CREDENTIAL_HEADERS = frozenset({"authorization", "webhook-signature"})
REDACTED = "[redacted]"
RUN = 8
SHORTEST_TAIL = 4  # a credential's first characters at the answer's end, cut from this many on
LOGGED_HEADERS = 40  # of an answer's headers, the first this many are kept
LOGGED_VALUE = 256  # characters of a header's value kept
_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")  # length-preserving


def _encodings(secret: str) -> set[str]:
    raw = secret.encode("utf-8", "replace")
    forms = {secret, quote(secret, safe=""), quote_plus(secret), json.dumps(secret)[1:-1],
             secret.replace("/", "\\/"),
             "".join(c if c.isalnum() else f"\\u{ord(c):04x}" for c in secret),
             base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode(), raw.hex()}
    return {form.translate(_LOWER) for form in forms}


@functools.lru_cache(maxsize=256)
def _runs(secrets: frozenset[str]) -> tuple[frozenset[str], tuple[str, ...]]:
    """Every run of RUN characters of the secrets' encodings (lower case), and the encodings."""
    forms = {form for secret in secrets for form in _encodings(secret)}
    # Whitespace separates a header's words (`Bearer <token>`): a run across it is no credential's.
    runs = frozenset(run for form in forms for run in (form[i:i + RUN] for i in range(len(form) - RUN + 1))
                     if not any(c.isspace() for c in run))
    return runs, tuple(forms)


def credentials(headers: dict[str, str]) -> frozenset[str]:
    """The request's credentials: each credential header's value and its words of 8 characters or more."""
    found: set[str] = set()
    for name, value in headers.items():
        if name.lower() in CREDENTIAL_HEADERS:
            found.add(value)
            found.update(word for word in value.replace(",", " ").split() if len(word) >= RUN)
    return frozenset(found)


def answer_text(preview: bytes, headers: dict[str, str]) -> str:
    """A failed answer's first bytes as text, with every credential of the request cut out."""
    return _cut(preview.decode("utf-8", "replace"), credentials(headers))


def _cut(text: str, secrets: frozenset[str]) -> str:
    """`text` with every run of `secrets` (in any encoding `_runs` knows) cut out."""
    if not secrets or not text:
        return text
    runs, forms = _runs(secrets)
    low = text.translate(_LOWER)
    cut = [False] * len(text)
    for i in range(len(text) - RUN + 1):
        if low[i:i + RUN] in runs:
            for j in range(i, i + RUN):
                cut[j] = True
    for size in range(min(RUN - 1, len(text)), SHORTEST_TAIL - 1, -1):
        if any(form.startswith(low[-size:]) for form in forms):
            for j in range(len(text) - size, len(text)):
                cut[j] = True
            break
    out: list[str] = []
    for i, ch in enumerate(text):
        if not cut[i]:
            out.append(ch)
        elif i == 0 or not cut[i - 1]:
            out.append(REDACTED)
    return "".join(out)


def sent_headers(headers: dict[str, str]) -> dict[str, str]:
    """A request's headers as the delivery log keeps them: a credential header's value never."""
    return {name: REDACTED if name.lower() in CREDENTIAL_HEADERS else value[:LOGGED_VALUE]
            for name, value in headers.items()}


def received_headers(answer: dict[str, str], request: dict[str, str]) -> dict[str, str]:
    """An answer's headers as the delivery log keeps them: the first LOGGED_HEADERS, each value cut
    to LOGGED_VALUE characters with the request's credentials cut out (an endpoint may echo them)."""
    secrets = credentials(request)  # once for all the answer's headers: this runs for every attempt
    kept: dict[str, str] = {}
    for name, value in answer.items():
        if len(kept) >= LOGGED_HEADERS:
            break
        kept[_cut(name[:LOGGED_VALUE], secrets)] = _cut(value[:LOGGED_VALUE], secrets)  # a name may echo one too
    return kept
