"""Destination policy: which addresses a push may reach.

Checked twice: when a subscription is loaded (clear error early) and when a connection is made
(the resolver below), so a DNS answer that changes after validation cannot reach a private address.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Any

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from worker.errors import DestinationRefused

# Cloud instance metadata services: never a push destination, whatever the policy says.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200")
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
DEFAULT_MAX_REQUEST_BYTES = 10 * 1024 * 1024


@dataclass(frozen=True)
class DestinationPolicy:
    """Which addresses a push may reach (`destinations:` in the config), and how big a request may be.

    Private, loopback and link-local addresses are refused unless `allow_private`, or unless they lie
    in one of `allow_cidrs` (private networks meant to receive pushes). Cloud metadata addresses are
    refused whatever the policy says.
    """

    allow_private: bool = False
    allow_cidrs: tuple[IPNetwork, ...] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def refusal(self, address: str) -> str | None:
        """Why `address` may not be pushed to, or None when it may."""
        try:
            ip: IPAddress = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return f"{address!r} is not an IP address"
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip in METADATA_ADDRESSES:
            return f"{ip} is a cloud metadata address"
        if ip.is_multicast or ip.is_unspecified:
            return f"{ip} is not a unicast address"
        if self.allow_private or any(ip.version == net.version and ip in net for net in self.allow_cidrs):
            return None
        if ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved:
            return (f"{ip} is a loopback, private or link-local address "
                    "(allow it with destinations.allow_cidrs or destinations.allow_private)")
        return None


def check_host(host: str, policy: DestinationPolicy, resolve: bool = True) -> None:
    """Raise `DestinationRefused` if `host` is, or resolves to, a refused address.

    A name that does not resolve now passes: it is checked again at connect time.
    """
    try:
        ipaddress.ip_address(host.strip("[]"))
        addresses = [host.strip("[]")]
    except ValueError:
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

    async def close(self) -> None:
        await self._inner.close()
