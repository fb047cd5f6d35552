"""One host, checked where it is used: every spelling of a refused address is refused, by the
registry's admission and by the delivery client at connect time. Property-based (Hypothesis): the
spellings are generated (Unicode digits and dots, fullwidth forms, decimal, octal and hex parts,
short forms, trailing dots, IPv6 forms embedding the address); a real listener on 127.0.0.2 (not
admitted) catches any request that gets through."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.endpoints import catcher
from worker.core.delivery import Deliverer, Result
from worker.core.messages import PushRequest
from worker.endpoint.destinations import DestinationPolicy, endpoint_host, literal_address
from worker.fleet.admission import admit
from worker.model.subscriptions import parse_subscription
from worker.runtime.errors import ConfigError

pytestmark = pytest.mark.broker_independent

BLOCKED = ipaddress.IPv4Address("127.0.0.2")
POLICY = DestinationPolicy(allow_cidrs=(ipaddress.ip_network("127.0.0.1/32"),))  # 127.0.0.2 is not admitted

# Characters NFKC (IDNA, yarl) folds into ASCII digits and dots.
UNICODE_DIGITS = [
    "0123456789",
    "".join(chr(0xFF10 + i) for i in range(10)),  # fullwidth
    "".join(chr(0x1D7CE + i) for i in range(10)),  # mathematical bold
    "".join(chr(0x1D7D8 + i) for i in range(10)),  # mathematical double-struck
    "⓪①②③④⑤⑥⑦⑧⑨",  # circled
]
DOTS = [".", "\u3002", "\uff0e", "\uff61"]  # ideographic, fullwidth, halfwidth ideographic full stops


@st.composite
def number(draw: st.DrawFn, value: int) -> str:
    """`value` in decimal, octal (0-prefixed) or hex (0x), as inet_aton reads a part."""
    form = draw(st.sampled_from(["dec", "oct", "hex", "HEX"]))
    if form == "dec":
        text = str(value)
    elif form == "oct":
        text = "0" + format(value, "o")
    else:
        text = ("0x" if form == "hex" else "0X") + format(value, "x" if form == "hex" else "X")
    digits = draw(st.sampled_from(UNICODE_DIGITS))
    return "".join(digits[int(c)] if c.isdigit() else c for c in text)


@st.composite
def ipv4_spelling(draw: st.DrawFn) -> str:
    """127.0.0.2 as a.b.c.d, a.b.c (c: 16 bits), a.b (b: 24 bits) or one 32-bit number."""
    value = int(BLOCKED)
    shape = draw(st.sampled_from([4, 3, 2, 1]))
    octets = [value >> 24, (value >> 16) & 0xFF, (value >> 8) & 0xFF, value & 0xFF]
    parts = {4: octets, 3: [octets[0], octets[1], value & 0xFFFF], 2: [octets[0], value & 0xFFFFFF],
             1: [value]}[shape]
    dot = draw(st.sampled_from(DOTS))
    host = dot.join(draw(number(p)) for p in parts)
    return host + (dot if draw(st.booleans()) else "")


IPV6_FORMS = [
    "[::ffff:127.0.0.2]", "[::FFFF:7F00:2]", "[0:0:0:0:0:ffff:7f00:2]", "[2002:7f00:2::]", "[2002:7f00:0002:0:0:0:0:1]",
    "[64:ff9b::7f00:2]", "[64:ff9b::127.0.0.2]", "[::127.0.0.2]", "[2001:0:4136:e378:8000:63bf:80ff:fffd]",
]


def refused_on_admission(host: str, port: int) -> bool:
    """Refused as a registry entry is: by its own rules or by the worker's admission."""
    doc = {"name": "s", "topic": "persistent://p-a/main/t",
           "deliver": {"mode": "push", "push": {"url": f"http://{host}:{port}/"}}}
    try:
        admit(parse_subscription(doc), POLICY, None)
    except (ConfigError, ValueError):
        return True
    return False


@pytest.fixture
async def listener():
    """A real listener on the refused address, recording anything that reaches it."""
    runner, url, got = await catcher(str(BLOCKED))
    yield int(url.rsplit(":", 1)[1].split("/")[0]), got
    await runner.cleanup()


@settings(max_examples=300, deadline=None)
@given(host=st.one_of(ipv4_spelling(), st.sampled_from(IPV6_FORMS)))
def test_every_spelling_reads_as_the_address_and_is_refused(host):
    normalised = endpoint_host(f"http://{host}:80/")
    address = literal_address(normalised)
    assert address is not None, (host, normalised)
    assert POLICY.refusal(str(address)) is not None
    assert refused_on_admission(host, 80)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(host=st.one_of(ipv4_spelling(), st.sampled_from(IPV6_FORMS[:3])))
async def test_no_spelling_reaches_the_refused_listener(listener, host):
    """The delivery client is the last line: asked to send to any spelling, it connects nowhere. (The
    IPv6 forms sent here are those a loopback listener can receive: IPv4-mapped.)"""
    port, got = listener
    deliverer = Deliverer(POLICY)
    try:
        outcome = await deliverer.attempt(f"http://{host}:{port}/push", PushRequest({}, b"{}", 0), 2.0)
    finally:
        await deliverer.close()
    assert outcome.result is Result.CONNECTION_ERROR and got == [], (host, outcome)
    assert "refused" in outcome.detail or "ValueError" in outcome.detail, (host, outcome)


async def test_the_listener_does_catch_an_admitted_spelling(listener):
    """The catcher is real: with 127.0.0.2 admitted, the same client reaches it (so the test above can fail)."""
    port, got = listener
    deliverer = Deliverer(DestinationPolicy(allow_cidrs=(ipaddress.ip_network("127.0.0.2/32"),)))
    try:
        outcome = await deliverer.attempt(f"http://0x7f.2:{port}/push", PushRequest({}, b"{}", 0), 2.0)
    finally:
        await deliverer.close()
    assert outcome.result is Result.ACK and len(got) == 1


def test_special_purpose_ranges_are_refused_and_public_ones_pass():
    for address in ("100.64.0.1", "192.0.0.9", "198.18.0.1", "240.0.0.1", "255.255.255.255", "0.1.2.3",
                    "2002:a9fe:a9fe::", "64:ff9b::a00:1", "64:ff9b:1::1", "2001:db8::1", "fc00::1", "fe80::1",
                    "::ffff:10.0.0.1", "::10.0.0.1", "3fff::1", "5f00::1", "100::1"):
        assert DestinationPolicy().refusal(address) is not None, address
    for address in ("93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946", "2002:5db8:d822::1", "64:ff9b::5db8:d822"):
        assert DestinationPolicy().refusal(address) is None, address


@pytest.mark.parametrize("host", ["localhost", "localhost.", "LOCALHOST.", "api.localhost", "api.localhost."])
def test_localhost_in_every_spelling_is_refused_at_load_whatever_dns_says(host):
    """RFC 6761: `localhost` and its subdomains are loopback; with a trailing dot the name did not
    resolve here (no DNS), and `check` let it through. The default policy (this module's admits
    127.0.0.1 for its listener)."""
    doc = {"name": "s", "topic": "persistent://p-a/main/t",
           "deliver": {"mode": "push", "push": {"url": f"http://{host}/push"}}}
    with pytest.raises(ConfigError, match=r"refused: 127\.0\.0\.1 is a loopback"):
        admit(parse_subscription(doc), DestinationPolicy(), None, resolve=True)
