"""Destination policy: which addresses a push may reach, and which may receive credentials in clear.

One host, checked where it is used: `endpoint_host` is the host exactly as the HTTP client connects to
it (yarl's normalisation: IDNA, NFKC, lowercase), and `literal_address` reads it as the C library
would (`127.1`, `0x7f.1`, `2130706433` are 127.0.0.1). `check`, `subs apply`, the registry's loading
and the connect-time resolver all go through these two, so a spelling the check does not take for
an address is never an address the client connects to.

Checked when a subscription is loaded (a clear error early) and when a connection is made (names
are resolved then, so a DNS answer that changes after validation cannot reach a refused address).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver
from yarl import URL

from worker.runtime.errors import DestinationRefused
from worker.runtime.fields import setting

# Cloud instance metadata services: never a push destination, whatever the policy says.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200")
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
DEFAULT_MAX_REQUEST_BYTES = 10 * 1024 * 1024

# IANA's IPv4 and IPv6 Special-Purpose Address Registries (every entry, whatever its "globally
# reachable" column says: none is a push endpoint's address), plus multicast and site-local. Written
# out here rather than taken from `ipaddress.is_global`, whose table differs between Python releases.
SPECIAL_PURPOSE: tuple[IPNetwork, ...] = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.0.2.0/24", "192.31.196.0/24", "192.52.193.0/24", "192.88.99.0/24", "192.168.0.0/16",
    "192.175.48.0/24", "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4",
    "::/8",  # ::, ::1, IPv4-compatible ::a.b.c.d (IPv4-mapped is read as its IPv4 address first)
    "64:ff9b:1::/48", "100::/64", "100:0:0:1::/64", "2001::/23", "2001:db8::/32", "2620:4f:8000::/48",
    "3fff::/20", "5f00::/16", "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8",
))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NUMERIC_HOST = re.compile(r"^[0-9a-fx.]+$")  # what inet_aton may read as an address (decimal, octal, hex)


def without_credentials(url: str) -> str:
    """`url` as a log line or a span may say it: no user, password or query (they may carry credentials)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def endpoint_host(url: str) -> str:
    """The host of `url` exactly as the delivery client connects to it (brackets stripped)."""
    return (URL(url).raw_host or "").strip("[]")


def literal_address(host: str) -> IPAddress | None:
    """`host` as an IP address, in every spelling the C library accepts, or None for a name."""
    bare = host.strip("[]").split("%", 1)[0]
    try:
        return ipaddress.ip_address(bare)
    except ValueError:
        pass
    candidate = bare.lower().removesuffix(".")
    if _NUMERIC_HOST.fullmatch(candidate):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(candidate))
        except OSError:
            return None
    return None


def _embedded_ipv4(ip: IPAddress) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address carries (mapped, 6to4, Teredo, NAT64): each is checked too."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return []
    found = []
    if ip.ipv4_mapped is not None:
        found.append(ip.ipv4_mapped)
    if ip.sixtofour is not None:
        found.append(ip.sixtofour)
    if ip.teredo is not None:
        found.extend(ip.teredo)
    if ip in _NAT64:
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return found


def special_purpose(ip: IPAddress) -> bool:
    """In a special-purpose range, itself or through an IPv4 address it embeds (a NAT64 address of
    the well-known prefix, inside ::/8, is judged by the IPv4 address it carries alone)."""
    if any(special_purpose(v4) for v4 in _embedded_ipv4(ip)):
        return True
    return ip not in _NAT64 and any(ip.version == net.version and ip in net for net in SPECIAL_PURPOSE)


@dataclass(frozen=True)
class DestinationPolicy:
    """Which addresses a push may reach (`destinations:` in the config), and how big a request may be.

    Special-purpose addresses (private, loopback, link-local, shared, documentation, reserved, and
    IPv6 forms embedding any of them) are refused unless `allow_private`, or unless they lie in one
    of `allow_cidrs` (private networks meant to receive pushes). Cloud metadata, multicast and
    unspecified addresses are refused whatever the policy says. Credentials (a bearer token, an OIDC
    token, a signature) go over plain http:// only to addresses this policy had to admit explicitly.
    """

    allow_private: bool = setting(False, read_by_hand=True, help="push URLs resolving to special-purpose "
                                  "addresses (loopback, private, link-local, shared: IANA's registries) are refused "
                                  "unless true")
    allow_cidrs: tuple[IPNetwork, ...] = setting((), read_by_hand=True, kind="list of CIDRs",
                                                 help="...or unless inside one of these")
    max_request_bytes: int = setting(DEFAULT_MAX_REQUEST_BYTES, 1024, 256 * 1024 * 1024,
                                     help="a larger payload or request body is never sent: dead-lettered as "
                                          "payload_too_large")
    max_connections: int | None = setting(None, 16, 1_000_000, read_by_hand=True,
                                          help="open push connections, shared fairly by project (none: the "
                                               "open-files limit, raised to its hard limit at start, less 512)")

    def _admitted(self, ip: IPAddress) -> bool:
        return any(ip.version == net.version and ip in net for net in self.allow_cidrs)

    def refusal(self, address: str) -> str | None:
        """Why `address` may not be pushed to, or None when it may."""
        ip = literal_address(address)
        if ip is None:
            return f"{address!r} is not an IP address"
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip in METADATA_ADDRESSES or any(v4 in METADATA_ADDRESSES for v4 in _embedded_ipv4(ip)):
            return f"{ip} is a cloud metadata address"
        if ip.is_multicast or ip.is_unspecified:
            return f"{ip} is not a unicast address"
        if self.allow_private or self._admitted(ip) or not special_purpose(ip):
            return None
        return (f"{ip} is a loopback, private, link-local or other special-purpose address "
                "(allow it with destinations.allow_cidrs or destinations.allow_private)")

    def clear_text_refusal(self, address: str) -> str | None:
        """Why credentials may not go to `address` over plain http://, or None when they may: only to
        an address the policy admits by `allow_private` or `allow_cidrs` (a private network)."""
        refused = self.refusal(address)
        if refused:
            return refused
        ip = literal_address(address)
        assert ip is not None
        if self._admitted(ip) or (self.allow_private and special_purpose(ip)):
            return None
        return (f"{ip} is a public address: credentials (a bearer token, an OIDC token, a signature) are sent "
                "only over https:// (or to a private network admitted by destinations.allow_cidrs/allow_private)")

    def may_send_credentials_in_clear(self) -> bool:
        """Whether any address could take credentials over http:// under this policy."""
        return self.allow_private or bool(self.allow_cidrs)


def check_host(host: str, policy: DestinationPolicy, resolve: bool = True) -> None:
    """Raise `DestinationRefused` if `host` (as `endpoint_host` gives it) is, or resolves to, a
    refused address. A name that does not resolve now passes: it is checked again at connect time."""
    literal = literal_address(host)
    if literal is None and _loopback_name(host):
        literal = ipaddress.ip_address("127.0.0.1")
    if literal is not None:
        addresses = [str(literal)]
    else:
        if not resolve:
            return
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError):
            return
        addresses = [str(info[4][0]) for info in infos]
    for address in addresses:
        why = policy.refusal(address)
        if why:
            raise DestinationRefused(f"host {host!r} refused: {why}")


def _loopback_name(host: str) -> bool:
    """`localhost` and its subdomains, in any case and with a trailing dot: loopback whatever DNS says
    (RFC 6761), so refused as loopback at load even where the name does not resolve here."""
    name = host.lower().removesuffix(".")
    return name == "localhost" or name.endswith(".localhost")


class GuardedResolver(AbstractResolver):
    """An aiohttp resolver that drops refused addresses; refuses the host if none are left."""

    def __init__(self, policy: DestinationPolicy, inner: AbstractResolver | None = None) -> None:
        self.policy = policy
        self._inner = inner or DefaultResolver()

    async def resolve(self, host: str, port: int = 0, family: Any = socket.AF_INET) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        allowed = [r for r in results if self.policy.refusal(r["host"]) is None]
        if not allowed:
            why = self.policy.refusal(results[0]["host"]) if results else "no address"
            raise DestinationRefused(f"host {host!r} refused: {why}")
        return allowed

    def literal(self, host: str) -> str | None:
        """`host` as the canonical IP address to connect to, if it is one (refused: DestinationRefused)."""
        ip = literal_address(host)
        if ip is None:
            return None
        why = self.policy.refusal(str(ip))
        if why:
            raise DestinationRefused(f"host {host!r} refused: {why}")
        return str(ip)

    async def close(self) -> None:
        await self._inner.close()
