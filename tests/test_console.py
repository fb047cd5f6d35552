"""The web console in a real browser: Debian's headless Chromium driven by Selenium through Debian's
chromium-driver (nothing downloaded). An operator logs in with a token, finds the failing
subscription, reads a message's attempt log, pauses the subscription (the worker stops sending),
redrives a dead letter (it arrives); a viewer cannot act; another project sees nothing. A newcomer
finds a failing message in at most three clicks from the project list; the delivery log's search,
a replay, creating and editing a subscription (the diff before saving) and the endpoint view, each
as an operator uses them.

With PUSH_WORKER_SCREENSHOTS=docs/images the pages' screenshots land there (`make screenshots`)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
from aiohttp import web

from tests.support.admin import ApiClient, admin_settings
from tests.support.builders import TEST_DEFAULTS, push_sub
from tests.support.endpoints import Endpoint, Received
from tests.support.helpers import eventually, stays_sync, wait_sync
from tests.support.pulsar_client import Client
from worker.model.config import FleetSettings
from worker.model.subscriptions import parse_subscription

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = [pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver "
                                 "(apt-get install chromium chromium-driver; .ci/run installs them)"),
              pytest.mark.broker_independent, pytest.mark.timeout(300)]


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,900", "--disable-extensions", "--no-first-run"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(DRIVER)), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


class Pages:
    """The browser, as the operator uses it."""

    def __init__(self, driver: Any, base: str, shots: Path) -> None:
        from selenium.webdriver.common.by import By

        self.driver, self.base, self.shots, self.by = driver, base, shots, By

    def open(self, path: str) -> None:
        self.driver.get(self.base + path)

    def find(self, css: str) -> Any:
        return self.driver.find_element(self.by.CSS_SELECTOR, css)

    def all(self, css: str) -> list[Any]:
        return list(self.driver.find_elements(self.by.CSS_SELECTOR, css))

    def go(self, element: Any) -> None:
        """Click a link or button and wait until the next page has replaced this one."""
        from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
        from selenium.webdriver.support.wait import WebDriverWait

        page = self.find("html")
        element.click()

        def replaced(_: Any) -> bool:
            try:
                page.is_enabled()
            except StaleElementReferenceException:
                return True
            except WebDriverException as e:  # asked while the old document goes: chromedriver's own words
                if "does not belong to the document" in str(e):
                    return True
                raise
            return False

        WebDriverWait(self.driver, 30).until(replaced)

    def text(self) -> str:
        return str(self.find("body").text)

    def log_in(self, token: str, shot: bool = False) -> None:
        self.driver.delete_all_cookies()
        self.open("/console/login")
        if shot:
            self.shot("login")
        self.find("#token").send_keys(token)
        self.go(self.find("#login"))

    def shot(self, name: str) -> None:
        self.shots.mkdir(parents=True, exist_ok=True)
        self.driver.save_screenshot(str(self.shots / f"console-{name}.png"))


def definition(name: str, topic: str, url: str) -> dict[str, Any]:
    # The breaker off, as in every test not about it (tests/support/builders.push_sub says why).
    return {"name": name, "topic": topic, **TEST_DEFAULTS, "dead_letter": {"topic": topic + "-dlq"},
            "deliver": {"mode": "push", "push": {"url": url, "breaker": "off"}}}


async def test_an_operator_finds_a_failing_subscription_reads_why_pauses_it_and_redrives_a_dead_letter(
        start_worker, start_admin, endpoint: Endpoint, client: Client, browser, tmp_path: Path):
    settings, tokens = admin_settings(tmp_path / "admin")
    w = await start_worker(fleet=FleetSettings(name="console-" + uuid.uuid4().hex[:8], lease_seconds=3,
                                               heartbeat_seconds=0.5))
    base = f"http://127.0.0.1:{(await start_admin(w, settings)).port}"
    alice = ApiClient(base, tokens["alice"])
    suffix = uuid.uuid4().hex[:8]
    failing_topic, fine_topic = f"persistent://p-a/main/orders-{suffix}", f"persistent://p-a/main/audit-{suffix}"
    healthy = {"orders": False, "audit": True}

    def answer(rec: Received) -> web.Response:
        name = rec.headers["Pubsub-Subscription"]
        if healthy[name]:
            return web.Response(status=204)
        return web.Response(status=500, text="<script>alert(1)</script> database unavailable")

    endpoint.behaviour = answer
    for name, topic in (("orders", failing_topic), ("audit", fine_topic)):
        created, _ = await alice.call("POST", "/v1/projects/p-a/subscriptions", definition(name, topic, endpoint.url))
        assert created == 201
    await eventually(lambda: {"p-a/orders", "p-a/audit"} <= set(w.dispatchers), what="both served")
    dead_ids = client.publish(failing_topic, [b"order-%d" % i for i in range(3)])
    client.publish(fine_topic, [b"audit-%d" % i for i in range(5)])
    await eventually(lambda: w.dispatchers["p-a/orders"].stats.dead_lettered == 3, what="dead-lettered")

    async def reported() -> bool:
        _, listed = await alice.call("GET", "/v1/projects/p-a/subscriptions")
        return any(r["name"] == "orders" and r["attempts_recent"] == 9 for r in listed["subscriptions"])

    await eventually(reported, timeout=15, what="the failures reported")
    shots = Path(os.environ.get("PUSH_WORKER_SCREENSHOTS") or tmp_path / "shots")
    pages = Pages(browser, base, shots)
    deliveries_before: list[int] = []

    def operator() -> None:
        pages.log_in(tokens["alice"], shot=True)
        # One project: the console opens it. The failing subscription stands out: its failure share and error.
        wait_sync(lambda: pages.all("#subscriptions"), what="the project's table")
        rows = {r.get_attribute("data-name"): r for r in pages.all("#subscriptions tbody tr")}
        assert set(rows) == {"orders", "audit"}
        assert "100%" in rows["orders"].text and "500" in rows["orders"].text
        assert "0%" in rows["audit"].text
        assert [rows[n].find_element(pages.by.CSS_SELECTOR, "td.dead").text for n in ("orders", "audit")] == ["3", "0"]
        pages.shot("project")
        pages.go(pages.find("th a[href*='sort=errors']"))  # sort by failure share
        pages.go(pages.find("th.sorted a"))  # and again: highest first
        assert [r.get_attribute("data-name") for r in pages.all("#subscriptions tbody tr")] == ["orders", "audit"]
        pages.go(pages.find("tr[data-name='orders'] a"))

        assert "500" in pages.find("#last-error").text
        pages.shot("subscription")
        pages.go(pages.find("#dead-letters").find_element(pages.by.LINK_TEXT, dead_ids[0]))
        attempts = pages.all("#attempts tbody tr")
        assert [row.find_elements(pages.by.TAG_NAME, "td")[3].text for row in attempts[:3]] == ["500"] * 3
        answer_cell = pages.find("#attempts code.answer")
        assert answer_cell.text.startswith("<script>alert(1)</script> database")  # shown as text, never run
        assert not pages.all("script")
        pages.shot("message")
        page = pages.find("html")
        browser.back()
        wait_sync(lambda: not _alive(page), what="back on the subscription's page")

        pages.go(pages.find("#pause"))
        pages.shot("confirm")
        pages.go(pages.find("#confirm"))
        assert pages.find("#notice").text == "paused"
        assert pages.find("#state").text == "Paused" and not pages.all("#pause")  # one of the two, by state
        assert "p-a/orders" not in w.dispatchers  # the worker stopped serving it
        deliveries_before.append(len(endpoint.requests))
        client.publish(failing_topic, [b"while-paused"])
        stays_sync(lambda: len(endpoint.requests) == deliveries_before[0], 1.0, what="nothing sent while paused")
        pages.go(pages.find("#resume"))
        pages.go(pages.find("#confirm"))
        assert pages.find("#notice").text == "resumed" and not pages.all("#resume")

        healthy["orders"] = True
        pages.go(pages.find(f"#redrive-{dead_ids[1].replace(':', '-')}"))
        pages.go(pages.find("#confirm"))
        assert pages.find("#notice").text == "redrive done: 1 delivered, 0 dead-lettered again"
        wait_sync(lambda: any(r.headers["Pubsub-Message-Id"] == dead_ids[1] and r.acked for r in endpoint.requests),
                  what="the redriven dead letter arrived")

    await asyncio.to_thread(operator)

    def viewer_and_stranger() -> None:
        pages.log_in(tokens["victor"])
        pages.open("/console/projects/p-a/subscriptions/orders")
        assert not pages.all("#pause") and not pages.all("#resume") and not pages.all("[id^='redrive']")
        pages.open("/console/projects/p-a/subscriptions/orders/confirm/pause")
        assert "403" in pages.find("h1").text
        pages.log_in(tokens["bob"])
        assert pages.all("#subscriptions") and not pages.all("#subscriptions tbody tr[data-name]")
        nowhere = _page_text(pages, "/console/projects/p-nothing")
        for path in ("/console/projects/p-a", "/console/projects/p-a/subscriptions/orders",
                     f"/console/projects/p-a/subscriptions/orders/messages/{dead_ids[0]}",
                     "/console/projects/p-a/subscriptions/orders/confirm/pause"):
            assert _page_text(pages, path) == nowhere, path
        assert "404" in nowhere and "orders" not in nowhere
        pages.shot("not-found")

    await asyncio.to_thread(viewer_and_stranger)
    assert "p-a/orders" in w.dispatchers  # nothing the viewer or the stranger did changed it


def _alive(element: Any) -> bool:
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        element.is_enabled()
    except StaleElementReferenceException:
        return False
    return True


def _page_text(pages: Pages, path: str) -> str:
    pages.open(path)
    return pages.text()


async def test_a_form_posted_from_another_site_or_without_the_session_value_changes_nothing(
        start_worker, start_admin, endpoint: Endpoint, tmp_path: Path):
    settings, tokens = admin_settings(tmp_path / "admin")
    w = await start_worker(fleet=FleetSettings(name="csrf-" + uuid.uuid4().hex[:8]))
    base = f"http://127.0.0.1:{(await start_admin(w, settings)).port}"
    topic = f"persistent://p-a/main/csrf-{uuid.uuid4().hex[:8]}"
    assert (await ApiClient(base, tokens["alice"]).call(
        "POST", "/v1/projects/p-a/subscriptions", definition("target", topic, endpoint.url)))[0] == 201
    await eventually(lambda: "p-a/target" in w.dispatchers, what="served")
    from worker.api.console import csrf_value

    pause = base + "/console/projects/p-a/subscriptions/target/pause"
    cookie = {"pw_console": tokens["alice"]}
    attempts: list[tuple[dict[str, str], dict[str, str]]] = [
        ({"confirmed": "yes"}, {}),  # no CSRF value: what a cross-site form can send
        ({"confirmed": "yes", "csrf": csrf_value("someone-else")}, {}),
        ({"confirmed": "yes", "csrf": csrf_value(tokens["alice"])}, {"Origin": "https://evil.example"}),
    ]
    async with aiohttp.ClientSession(cookies=cookie) as session:
        for form, headers in attempts:
            async with session.post(pause, data=form, headers=headers, allow_redirects=False) as response:
                assert response.status == 403, form
                assert "Content-Security-Policy" in response.headers
        assert "p-a/target" in w.dispatchers
        async with session.post(pause, data={"confirmed": "yes", "csrf": csrf_value(tokens["alice"])},
                                headers={"Origin": base}, allow_redirects=False) as response:
            assert response.status == 303  # the console's own form does it
    await eventually(lambda: "p-a/target" not in w.dispatchers, what="paused")
    async with aiohttp.ClientSession() as session, session.get(base + "/console/", allow_redirects=False) as r:
        assert r.status == 302 and r.headers["Location"] == "/console/login"  # no session: the login page
    _ = Callable  # typing only


class Clicks(Pages):
    """Pages that count the clicks a person makes."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.clicks = 0

    def go(self, element: Any) -> None:
        self.clicks += 1
        super().go(element)


@pytest.fixture
async def console(start_worker, start_admin, endpoint: Endpoint, tmp_path: Path):
    settings, tokens = admin_settings(tmp_path / "admin")
    w = await start_worker(fleet=FleetSettings(name="log-" + uuid.uuid4().hex[:8], lease_seconds=3,
                                               heartbeat_seconds=0.5))
    base = f"http://127.0.0.1:{(await start_admin(w, settings)).port}"
    return w, base, tokens, Path(os.environ.get("PUSH_WORKER_SCREENSHOTS") or tmp_path / "shots")


async def test_a_newcomer_finds_a_failing_message_in_three_clicks_searches_the_log_and_replays_it(
        console, endpoint: Endpoint, client: Client, browser):
    w, base, tokens, shots = console
    alice = ApiClient(base, tokens["alice"])
    topic = f"persistent://p-a/main/pay-{uuid.uuid4().hex[:8]}"
    failing = {b"order-2"}

    def answer(rec: Received) -> web.Response:
        return web.Response(status=503 if rec.body_payload in failing else 204, headers={"X-Trace": "t-1"})

    endpoint.behaviour = answer
    created = await alice.call("POST", "/v1/projects/p-a/subscriptions", definition("payments", topic, endpoint.url))
    assert created[0] == 201
    await eventually(lambda: "p-a/payments" in w.dispatchers, what="served")
    ids = client.publish(topic, [b'{"order": %d}' % i for i in range(2)] + [b"order-2"])
    await eventually(lambda: w.dispatchers["p-a/payments"].stats.dead_lettered == 1, what="the failing one dead")

    async def logged() -> bool:
        _, page = await alice.call("GET", "/v1/projects/p-a/subscriptions/payments/log?limit=200")
        return len(page["entries"]) == 6  # two delivered, three attempts of the failing one, its dead letter
    await eventually(logged, what="every attempt in the log")
    pages = Clicks(browser, base, shots)

    def newcomer() -> None:
        pages.log_in(tokens["alice"])
        pages.clicks = 0  # from the project list on
        pages.go(pages.find("tr[data-name='payments'] a"))
        pages.find("#search select[name=status]").send_keys("5xx")
        pages.go(pages.find("#search-log"))
        rows = pages.all("#log tbody tr")
        assert len(rows) == 3 and all("503" in row.text for row in rows)
        pages.shot("log")
        pages.go(pages.find(f"#log a[href$='{quote(ids[2], safe='')}']"))
        assert pages.clicks <= 3 and "Message " + ids[2] in pages.find("h1").text
        assert [row.find_elements(pages.by.TAG_NAME, "td")[3].text for row in pages.all("#attempts tbody tr")][:3] == \
            ["503"] * 3
        assert pages.find("#outcome").text.startswith("Dead-lettered after 3 attempt(s) · last status 503")
        pages.find("#exchange-1 summary").click()  # the last attempt's exchange is open, the others closed
        exchange = pages.find("#exchange-1").text
        assert "Pubsub-Message-Id" in exchange and "t-1" in exchange  # the headers both ways
        assert pages.find("#payload pre").text == "order-2"
        pages.find("#sent summary").click()
        sent = json.loads(pages.find("#sent-body").text)  # the wrapper, as the endpoint got it
        assert sent["message"]["data"] == base64.b64encode(b"order-2").decode()
        assert sent["message"]["delivery_attempt"] == 3 and sent["subscription"] == "payments"

    await asyncio.to_thread(newcomer)

    def search_and_replay() -> None:
        pages.open("/console/projects/p-a/subscriptions/payments")
        part = ":".join(ids[0].split(":")[:2]) + ":"  # part of the id: its ledger and entry
        pages.find("#search input[name=message_id]").send_keys(part)
        pages.go(pages.find("#search-log"))
        assert [row.find_elements(pages.by.TAG_NAME, "td")[1].text for row in pages.all("#log tbody tr")] == [ids[0]]
        pages.go(pages.find(f"#log a[href$='{quote(ids[0], safe='')}']"))
        assert pages.find("#outcome").text.startswith("Delivered at attempt 1 · status 204")
        assert pages.find("#payload pre").text == '{\n  "order": 0\n}'  # JSON pretty-printed
        pages.shot("message-payload")
        before = len(endpoint.requests)
        pages.go(pages.find("#replay"))
        pages.go(pages.find("#confirm"))
        assert pages.find("#notice").text == f"replayed {ids[0]} as attempt 2: delivered"
        assert [(r.headers["Pubsub-Message-Id"], r.headers["Pubsub-Delivery-Attempt"])
                for r in endpoint.requests[before:]] == [(ids[0], "2")]

    await asyncio.to_thread(search_and_replay)


async def test_an_operator_creates_a_subscription_and_edits_it_seeing_the_diff_before_saving(
        console, endpoint: Endpoint, browser):
    w, base, tokens, shots = console
    suffix = uuid.uuid4().hex[:8]
    pages = Pages(browser, base, shots)

    def create_and_edit() -> None:
        pages.log_in(tokens["alice"])
        pages.open("/console/projects/p-a")
        pages.go(pages.find("#new-subscription"))
        for field in ("name", "topic", "url", "ack_deadline_seconds", "max_deliver", "dead_letter_topic"):
            box = pages.find(f"#{field}")  # placeholders, not values a careless Create would save
            assert box.get_attribute("value") == "" and box.get_attribute("placeholder"), field
        assert pages.find("#topic").get_attribute("placeholder").startswith("persistent://p-a/")
        pages.shot("new")

        def fill(**values: str) -> None:
            for field, value in values.items():
                box = pages.find(f"#{field}")
                box.clear()
                box.send_keys(value)

        fill(name=f"made-{suffix}", topic=f"persistent://p-b/main/t-{suffix}", url=endpoint.url, max_deliver="3",
             dead_letter_topic="", more='deliver:\n  push:\n    breaker: "off"\n')
        pages.go(pages.find("#preview"))
        assert "p-a's tenant" in pages.find("#form-error").text  # the API's rule: nothing saved
        fill(topic=f"persistent://p-a/main/t-{suffix}", max_deliver="many")
        pages.go(pages.find("#preview"))
        assert "max_deliver" in pages.find("#form-error").text
        fill(max_deliver="3")
        pages.go(pages.find("#preview"))
        assert f"+name: made-{suffix}" in pages.find("#diff").text
        pages.go(pages.find("#save"))
        assert pages.find("#notice").text == "created"
        wait_sync(lambda: f"p-a/made-{suffix}" in w.dispatchers, what="the worker serving the new subscription")

        pages.go(pages.find("#edit"))
        assert pages.find("#name").get_attribute("readonly")
        assert pages.find("#max_deliver").get_attribute("value") == "3"
        fill(max_deliver="7")
        pages.go(pages.find("#preview"))
        diff = pages.find("#diff").text.splitlines()
        assert "-max_deliver: 3" in diff and "+max_deliver: 7" in diff and len([d for d in diff if d[:1] in "+-"]) == 2
        pages.shot("edit-diff")
        pages.go(pages.find("#save"))
        assert pages.find("#notice").text == "saved"

    await asyncio.to_thread(create_and_edit)
    await eventually(lambda: w.dispatchers[f"p-a/made-{suffix}"].sub.max_deliver == 7, what="the edit applied")


async def test_the_endpoint_view_lists_every_subscription_pushing_to_a_host(
        console, endpoint: Endpoint, client: Client, browser):
    w, base, tokens, shots = console
    alice = ApiClient(base, tokens["alice"])
    suffix = uuid.uuid4().hex[:8]
    endpoint.behaviour = lambda rec: web.Response(status=500 if rec.headers["Pubsub-Subscription"] == "ledger" else 204)
    for name in ("ledger", "mailer"):
        topic = f"persistent://p-a/main/{name}-{suffix}"
        created = await alice.call("POST", "/v1/projects/p-a/subscriptions", definition(name, topic, endpoint.url))
        assert created[0] == 201
        await eventually(lambda name=name: f"p-a/{name}" in w.dispatchers, what=f"{name} served")
        client.publish(topic, [b"x"])
    await eventually(lambda: w.dispatchers["p-a/ledger"].stats.dead_lettered == 1, what="ledger's message failed")
    pages = Pages(browser, base, shots)

    def endpoint_view() -> None:
        pages.log_in(tokens["alice"])
        pages.open("/console/projects/p-a/subscriptions/ledger")
        assert [f.get_attribute("id") for f in pages.all("figure.chart")] == ["chart-rate", "chart-outcomes",
                                                                               "chart-p95"]
        pages.go(pages.find("#endpoint"))
        rows = pages.all("#endpoint-subscriptions tbody tr")
        names = {row.find_elements(pages.by.TAG_NAME, "td")[1].text: row.text for row in rows}
        assert sorted(names) == ["ledger", "mailer"] and "500" in names["ledger"] and "500" not in names["mailer"]
        assert pages.find("#endpoint-failed").text != "0%"
        pages.shot("endpoint")
        pages.go(pages.find("#endpoint-subscriptions a[href$='/mailer']"))
        assert pages.find("h1").text.startswith("mailer")

    await asyncio.to_thread(endpoint_view)


async def test_a_config_file_subscription_shows_its_endpoint_and_definition_read_only_and_offers_what_works(
        start_worker, start_admin, endpoint: Endpoint, client: Client, browser, tmp_path: Path):
    """A subscription of the config file (not the registry): its endpoint, its definition as the
    file says it, marked read-only, in the endpoint view; no Edit (it would refuse); Pause, then
    only Resume."""
    settings, tokens = admin_settings(tmp_path / "admin")
    topic = f"persistent://p-a/main/filed-{uuid.uuid4().hex[:8]}"
    filed = parse_subscription(push_sub("filed", topic, endpoint.url), trusted=True)
    w = await start_worker(filed, fleet=FleetSettings(name="filed-" + uuid.uuid4().hex[:8]))
    base = f"http://127.0.0.1:{(await start_admin(w, settings)).port}"
    client.publish(topic, [b"x"])
    await eventually(lambda: w.dispatchers["p-a/filed"].stats.acked == 1, what="delivered")
    _, got = await ApiClient(base, tokens["alice"]).call("GET", "/v1/projects/p-a/subscriptions/filed")
    assert "source" not in got and got["status"]["source"] == "config"  # one `source`
    assert got["definition"]["topic"] == topic and got["status"]["endpoint"] == "127.0.0.1"
    pages = Pages(browser, base, Path(os.environ.get("PUSH_WORKER_SCREENSHOTS") or tmp_path / "shots"))

    def operator() -> None:
        pages.log_in(tokens["alice"])
        pages.open("/console/projects/p-a")
        assert "127.0.0.1" in pages.find("tr[data-name='filed']").text
        pages.go(pages.find("tr[data-name='filed'] a"))
        assert "Read-only" in pages.find("#definition-source").text and topic in pages.find("#definition").text
        pages.shot("config-subscription")
        assert not pages.all("#edit") and not pages.all("#resume")
        pages.go(pages.find("#endpoint"))
        assert [row.find_elements(pages.by.TAG_NAME, "td")[1].text
                for row in pages.all("#endpoint-subscriptions tbody tr")] == ["filed"]
        browser.back()
        pages.go(pages.find("#pause"))
        pages.go(pages.find("#confirm"))
        assert pages.find("#notice").text == "paused" and pages.find("#state").text == "Paused"
        assert not pages.all("#pause") and pages.find("#resume")

    other = f"persistent://p-b/main/other-{uuid.uuid4().hex[:8]}"
    created, _ = await ApiClient(base, tokens["bob"]).call("POST", "/v1/projects/p-b/subscriptions",
                                                           definition("other", other, endpoint.url))
    assert created == 201

    def admin() -> None:  # several projects: a table of them, with where to look first
        pages.log_in(tokens["root"])
        cells = {row.get_attribute("data-name"): [td.text for td in row.find_elements(pages.by.TAG_NAME, "td")[1:]]
                 for row in pages.all("#projects tbody tr")}
        assert cells == {"p-a": ["1", "0", "0"], "p-b": ["1", "0", "0"]}  # subscriptions, failing, dead-lettered
        pages.shot("projects")

    await asyncio.to_thread(operator)
    await asyncio.to_thread(admin)
    assert "p-a/filed" not in w.dispatchers


async def test_a_subscription_page_reloads_itself_with_the_default_settings_and_stops_when_asked(
        start_worker, start_admin, browser, tmp_path: Path):
    """The live view as shipped (admin.refresh_seconds 15): a meta refresh, no script, and the page
    is in fact loaded again; `stop` keeps it still."""
    settings, tokens = admin_settings(tmp_path / "admin", refresh_seconds=15)
    w = await start_worker(fleet=FleetSettings(name="live-" + uuid.uuid4().hex[:8]))
    base = f"http://127.0.0.1:{(await start_admin(w, settings)).port}"
    topic = f"persistent://p-a/main/live-{uuid.uuid4().hex[:8]}"
    created = await ApiClient(base, tokens["alice"]).call("POST", "/v1/projects/p-a/subscriptions",
                                                          definition("watched", topic, "https://example.com/push"))
    assert created[0] == 201
    pages = Pages(browser, base, tmp_path)

    def live() -> None:
        pages.log_in(tokens["alice"])
        pages.open("/console/projects/p-a/subscriptions/watched")
        assert pages.find("meta[http-equiv=refresh]").get_attribute("content") == "15"
        assert not pages.all("script")
        page = pages.find("html")
        wait_sync(lambda: not _alive(page), 30, what="the page loaded again by itself")
        pages.go(pages.find("#stop-live"))  # just after a reload: the next is 15 s away
        assert not pages.all("meta[http-equiv=refresh]") and pages.find("#start-live")

    await asyncio.to_thread(live)
