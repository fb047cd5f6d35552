"""The pure parts behind the operator API: roles, the PATCH merge, the recent-attempts window and its
merge across workers, and the redaction of credentials from an endpoint's answer."""

from __future__ import annotations

from unittest import mock

import pytest

from worker.api.operations import merged
from worker.core import recent
from worker.core.delivery import Outcome, Result
from worker.core.redact import answer_text
from worker.model.admin_settings import parse_roles


def test_roles_are_admin_or_a_role_on_a_project_and_the_stronger_of_two_wins():
    grants = parse_roles(["viewer:p-a", "operator:p-a", "viewer:p-b"])
    assert grants is not None and grants.projects == {"p-a": "operator", "p-b": "viewer"}
    assert grants.acts_on("p-a") and not grants.acts_on("p-b") and grants.sees("p-b") and not grants.sees("p-c")
    assert parse_roles(["admin"]).acts_on("p-anything")  # type: ignore[union-attr]
    for bad in ([], "admin", ["owner:p-a"], ["viewer:acme"], ["viewer:p-a", 3], ["viewer"], None):
        assert parse_roles(bad) is None, bad


def test_patch_keeps_what_it_leaves_out_merges_objects_and_clears_the_dead_letter_topic():
    current = {"name": "s", "max_deliver": 5, "deliver": {"mode": "push", "push": {"url": "https://a", "x": 1}},
               "dead_letter": {"topic": "persistent://p-a/main/d"}, "display_name": "S"}
    out = merged(current, {"max_deliver": 9, "deliver": {"push": {"url": "https://b"}}, "dead_letter": {"topic": ""},
                           "display_name": None})
    assert out == {"name": "s", "max_deliver": 9, "deliver": {"mode": "push", "push": {"url": "https://b", "x": 1}}}
    assert current["deliver"]["push"]["url"] == "https://a"  # the stored definition is not touched


def _outcome(status: int | None, latency: float, result: Result = Result.NACK) -> Outcome:
    return Outcome(Result.ACK if status and 200 <= status < 300 else result, status=status, latency=latency)


def test_the_window_counts_outcomes_per_class_forgets_old_steps_and_merges_workers():
    window = recent.RecentDeliveries()
    with mock.patch("time.time", return_value=1_000_000.0):
        for _ in range(90):
            window.record(_outcome(204, 0.004), 1)
        for _ in range(6):
            window.record(_outcome(503, 0.2), 1)
        window.record(_outcome(None, 5.0, Result.TIMEOUT), 1)
        window.record(_outcome(404, 0.01), 3)  # a batch of three
        window.record(_outcome(None, 0.001, Result.CONNECTION_ERROR), 1)
    summary = window.summary(now=1_000_000.0)
    assert summary["outcomes"] == {"2xx": 90, "4xx": 3, "5xx": 6, "timeout": 1, "other": 1}
    assert summary["delivered"][-1] == 90 and sum(summary["delivered"]) == 90
    assert summary["last_error"]["status"] == "connection_error"
    # Five minutes later the step is out of the window: the summary stays the same from then on.
    assert window.summary(now=1_000_000.0 + 300) == window.summary(now=1_000_000.0 + 900) == {
        "last_error": summary["last_error"]}
    assert recent.merge([window.summary(now=1_000_000.0 + 300)])["outcomes"]["2xx"] == 0
    # Another worker's summary, one step later: aligned on the newest step, added up.
    other = recent.RecentDeliveries()
    with mock.patch("time.time", return_value=1_000_010.0):
        for _ in range(10):
            other.record(_outcome(200, 0.004), 1)
    both = recent.merge([summary, other.summary(now=1_000_010.0)])
    assert both["delivered"][-2:] == [90, 10] and both["outcomes"]["2xx"] == 100
    assert both["p95_latency_ms"] == 250.0  # 95% of the latency samples fall within the 250 ms bucket
    assert recent.merge([])["p95_latency_ms"] is None


def test_an_answer_keeps_no_credential_of_the_request_whole_in_parts_or_cut_off():
    headers = {"Authorization": "Bearer s3cr3t-token-value", "webhook-signature": "v1,c2lnbmF0dXJlMQ== v1,c2lnMg==",
               "Content-Type": "application/json"}
    text = answer_text(b"got Bearer s3cr3t-token-value and v1,c2lnbmF0dXJlMQ== json", headers)
    assert "s3cr3t" not in text and "c2lnbmF0dXJlMQ" not in text and text.startswith("got Bearer [redacted]")
    assert "application/json" not in headers["Authorization"] and "json" in text  # other words stay
    cut = answer_text(b"echo: s3cr3t-tok", headers)  # the preview ended inside the token
    assert cut == "echo: [redacted]"
    assert answer_text("caf\u00e9 \xff".encode("latin-1"), {}) == "caf\ufffd \ufffd"


def _echoes(secret: str) -> dict[str, str]:
    """The forms an endpoint may echo a credential in (#61's list)."""
    import base64
    import json
    from urllib.parse import quote

    half = len(secret) // 2
    return {"urlencoded": quote(secret, safe=""), "json": json.dumps(secret).replace("/", "\\/"),
            "json-unicode": "".join(c if c.isalnum() else f"\\u{ord(c):04X}" for c in secret),
            "base64": base64.b64encode(secret.encode()).decode(),
            "base64url": base64.urlsafe_b64encode(secret.encode()).decode().rstrip("="),
            "hex": secret.encode().hex(), "HEX": secret.encode().hex().upper(),
            "upper": secret.upper(), "lower": secret.lower(), "halves": f"{secret[:half]} ... {secret[half:]}",
            "invalid byte": f"{secret[:half]}\udcff{secret[half:]}", "segments": " | ".join(secret.split("."))}


def test_an_echoed_credential_is_cut_in_every_encoding_an_endpoint_may_use():
    """Literal whole-value matches kept URL-encoded, JSON-escaped, base64, hex, other-case, split,
    byte-inserted and JWT-segment echoes of the token in the attempt log (#61)."""
    import jwt as pyjwt

    opaque = "tok+en/With+Slash/and=Sign+0123456789abcdefXYZ"
    signed = pyjwt.encode({"sub": "svc", "aud": "https://endpoint.example", "iat": 1_800_000_000,
                           "exp": 1_800_003_600}, "k" * 32, algorithm="HS256")
    for token in (opaque, signed):
        headers = {"Authorization": f"Bearer {token}"}
        for form, echoed in _echoes(token).items():
            raw = f"you sent {echoed} to us".encode("utf-8", "surrogateescape")
            text = answer_text(raw, headers)
            assert text.startswith("you sent ") and text.endswith(" to us"), (form, text)
            # No run of 8 characters of the credential, in any of its encodings, is left
            left = text.replace("[redacted]", "\0")
            for encoded in _echoes(token).values():
                for i in range(len(encoded) - 7):
                    assert encoded[i:i + 8].lower() not in left.lower(), (form, encoded[i:i + 8], text)
    assert answer_text(b"nothing secret here at all", {"Authorization": f"Bearer {opaque}"}) == \
        "nothing secret here at all"


def test_subs_get_prints_a_series_on_one_line():
    """The last five minutes in steps of 10 s were thirty lines of zeros in `subs get`."""
    from worker.ops.render import people_yaml

    text = people_yaml({"status": {"recent": {"delivered": [0] * 29 + [3], "p95_latency_ms": None},
                                   "warnings": ["filter: mixes AND and OR"]}})
    assert "    delivered: [0, 0, 0," in text and text.count("\n") == 5, text
    assert "  - 'filter: mixes AND and OR'" in text  # lists of text stay a line an item


def test_the_grafana_link_opens_the_subscription_dashboard_with_it_chosen():
    from worker.api.console import Console
    from worker.model.admin_settings import parse_admin
    from worker.runtime.errors import ConfigError
    from worker.runtime.fields import FieldReader

    console = Console(mock.Mock(), mock.Mock(), secure_cookie=True, grafana_url="https://grafana.example.com/")
    assert console.grafana_link("p-a", "orders & co") == ("https://grafana.example.com/d/push-worker-subscription/"
                                                          "push-worker-subscription?var-project=p-a&"
                                                          "var-subscription=orders%20%26%20co")
    assert Console(mock.Mock(), mock.Mock(), secure_cookie=True).grafana_link("p-a", "orders") == ""

    def admin(**extra: object) -> object:
        return parse_admin(FieldReader("config", {"tokens": [{"subject": "s", "file": "/f", "roles": ["admin"]}],
                                                  **extra}, "admin."))

    assert admin().refresh_seconds == 15 and admin().grafana_url == ""  # type: ignore[attr-defined]
    for bad in ({"grafana_url": "http://grafana.example.com"}, {"refresh_seconds": -1}):
        with pytest.raises(ConfigError):
            admin(**bad)


def test_the_console_form_shows_a_definition_in_fields_and_gives_it_back_whole():
    from worker.api.console import definition_of, form_of
    from worker.runtime.errors import ConfigError

    definition = {"name": "orders", "topic": "persistent://p-a/main/orders", "type": "key-shared",
                  "ack_deadline_seconds": 30, "max_deliver": 5, "retry": {"min_backoff_seconds": 1},
                  "deliver": {"mode": "push", "push": {"url": "https://shop.example/push", "content": "raw"}},
                  "dead_letter": {"topic": "persistent://p-a/main/orders-dlq"}}
    fields = form_of(definition)
    assert (fields["name"], fields["url"], fields["max_deliver"]) == ("orders", "https://shop.example/push", "5")
    assert "type: key-shared" in fields["more"] and "url" not in fields["more"]
    assert definition_of(fields) == definition
    plain = form_of({"name": "n", "topic": "t", "deliver": {"mode": "push", "push": {"url": "https://x.example"}}})
    assert plain["more"] == "" and definition_of(plain) == {"name": "n", "topic": "t", "deliver": {
        "mode": "push", "push": {"url": "https://x.example"}}}
    with pytest.raises(ConfigError, match="max_deliver"):
        definition_of({**fields, "max_deliver": "five"})
    with pytest.raises(ConfigError, match="anchors and aliases"):
        definition_of({**fields, "more": "a: &x [1]\nb: *x\n"})
    with pytest.raises(ConfigError, match="YAML mapping"):
        definition_of({**fields, "more": "- a list"})


def test_the_logged_headers_keep_no_credential_and_stay_bounded():
    import base64

    from worker.core.redact import LOGGED_HEADERS, LOGGED_VALUE, received_headers, sent_headers

    token = "s3cr3t-bearer-token-0123456789"
    request = {"Authorization": f"Bearer {token}", "webhook-signature": "v1,abcdefghijklmnop", "Pubsub-Message-Id": "1"}
    assert sent_headers(request) == {"Authorization": "[redacted]", "webhook-signature": "[redacted]",
                                     "Pubsub-Message-Id": "1"}
    answer = {"x-echo": f"got {token}", "x-b64": base64.b64encode(token.encode()).decode(), "server": "nginx",
              **{f"x-{i}": "v" * 1000 for i in range(60)}}
    kept = received_headers(answer, request)
    assert token not in str(kept) and "[redacted]" in kept["x-echo"] and "[redacted]" in kept["x-b64"]
    assert kept["server"] == "nginx" and len(kept) == LOGGED_HEADERS
    assert max(len(v) for v in kept.values()) <= LOGGED_VALUE
    # A header whose name carries the credential (an endpoint echoing it as a name) is cut like a value.
    named = received_headers({f"x-{token}": "1", "x-fine": "2"}, request)
    assert token not in str(named) and set(named) == {"x-[redacted]", "x-fine"}, named


def test_a_viewer_reads_a_push_url_without_its_query_values():
    """A credential in a push URL's query string (`?token=`, as Google Pub/Sub's docs suggest) was
    shown to the project's viewers: they read the URL with every query value hidden."""
    from worker.api.operations import for_viewer, without_query_values

    assert without_query_values("https://h.example/p?token=s3cret&mode=a&flag") == \
        "https://h.example/p?token=[redacted]&mode=[redacted]&flag"
    assert without_query_values("https://h.example/p") == "https://h.example/p"
    sub = {"name": "s", "definition": {"deliver": {"mode": "push", "push": {"url": "https://h.example/?token=s3cret"}}}}
    shown = for_viewer(sub)
    assert "s3cret" not in str(shown) and "s3cret" in str(sub)  # the operator's copy is untouched


def test_a_definition_nested_900_deep_is_a_clear_error_not_a_crash():
    """The console's YAML field nested 900 deep answered 500: it is a ConfigError (400) now."""
    import pytest

    from worker.api.console import definition_of
    from worker.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="nested too deep"):
        definition_of({"name": "n", "topic": "persistent://p-a/main/t", "url": "https://e.example/",
                       "more": "a: " + "[" * 900 + "]" * 900})


def test_a_callers_log_searches_read_within_its_share_one_at_a_time():
    """limits.SearchBudget with a hand-driven clock: a search gets at most what is left of the
    caller's bucket; a second search of the caller's while one runs is refused, and so is one with
    too little left; another caller has a bucket of its own; the bucket refills with time."""
    import pytest

    from worker.api.limits import SearchBudget, TooMany

    now = [0.0]
    budget = SearchBudget(rate=1000, burst=6000, clock=lambda: now[0])
    with budget.take("token:v", 5000, 500) as share:
        assert share.entries == 5000
        share.read = 5000
        with pytest.raises(TooMany, match="under way"), budget.take("token:v", 5000, 500):
            pass
        with budget.take("jwt:v", 5000, 500) as theirs:  # the JWT's v is another caller
            assert theirs.entries == 5000
    with budget.take("token:v", 5000, 500) as share:
        assert share.entries == 1000  # what was left
        share.read = 200  # a search that found enough sooner: the rest goes back
    with budget.take("token:v", 5000, 500) as share:
        assert share.entries == 800
        share.read = 800
    with pytest.raises(TooMany, match="budget"), budget.take("token:v", 5000, 500):
        pass
    now[0] += 2.0
    with budget.take("token:v", 5000, 500) as share:
        assert share.entries == 2000
