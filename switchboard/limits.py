"""Ingest rate limits, the proxies a server believes, and the gate that keeps one owner's deliveries from
starving another's."""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from switchboard.configuration import ApiError


class RateLimiter:
    """A token bucket per source (an address, or a webhook): `rate` per second, up to `burst` at once. A rate of 0
    turns it off."""

    MAX_SOURCES = 10_000

    def __init__(self, rate: float, burst: int):
        self.rate = rate
        self.burst = max(burst, 1)
        self._buckets: dict[str, tuple[float, float]] = {}

    def retry_after(self, source: str) -> float:
        """0 when the request may go ahead (and is counted), else the seconds until it may. `source` is an address,
        or a webhook id for the limit on verified deliveries."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        tokens, last = self._buckets.get(source, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens < 1:
            self._buckets[source] = (tokens, now)
            return (1 - tokens) / self.rate
        if len(self._buckets) >= self.MAX_SOURCES and source not in self._buckets:
            self._buckets = {k: v for k, v in self._buckets.items() if now - v[1] < self.burst / self.rate}
        self._buckets[source] = (tokens - 1, now)
        return 0.0


class RateLimited(ApiError):
    """429 with the seconds to wait, which the HTTP layer sends as Retry-After."""

    def __init__(self, seconds: float, message: str = "too many deliveries from this address"):
        super().__init__("rate_limited", message)
        self.retry_after = max(1, math.ceil(seconds))


IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_SWITCH_ON, _SWITCH_OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def ip_of(text: str | None) -> IpAddress | None:
    """An address as a peer or a forwarding hop names it (`[::1]:80` and `10.0.0.5:443` too), IPv4-mapped IPv6 as
    IPv4; None for anything else (a Unix socket, a name, garbage)."""
    text = (text or "").strip()
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


@dataclass(frozen=True)
class TrustedProxies:
    """What `serve --trust-proxy` declares. Without addresses (the flag's first meaning, `any_proto`): a reverse
    proxy in front sets X-Forwarded-Proto, believed from any address, and no other header is. With ADDRESSES
    (addresses or networks): only requests whose peer is one of them have their X-Forwarded-Proto, their
    X-Forwarded-For (the per-address ingest limit then counts the client it names) and the sign-in header of
    `--auth-header` believed."""
    networks: tuple[IpNetwork, ...] = ()
    any_proto: bool = False

    @classmethod
    def parse(cls, value: bool | str | None, origin: str = "--trust-proxy") -> TrustedProxies:
        """The flag as given (True when bare), or SWITCHBOARD_TRUST_PROXY: 1/true/yes/on and 0/false/no/off keep
        the switch's meaning; anything else is a list of addresses or networks, separated by commas or spaces."""
        if value is None or value is False:
            return cls()
        if value is True or value.strip().lower() in _SWITCH_ON:
            return cls(any_proto=True)
        if value.strip().lower() in _SWITCH_OFF:
            return cls()
        networks = []
        for item in re.split(r"[\s,]+", value.strip()):
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise ApiError("invalid_argument", f"{origin}: {item[:64]!r} is not an address or a network (e.g."
                                                   " 127.0.0.1, 10.0.0.0/8, ::1)") from None
        return cls(networks=tuple(networks))

    @property
    def named(self) -> bool:
        """True when the operator named the proxies (only then is a client address or an identity believed)."""
        return bool(self.networks)

    def declared(self, peer: str | None) -> bool:
        """The connection comes from one of the named proxies."""
        address = ip_of(peer)
        return address is not None and any(address in network for network in self.networks)

    def forwarded_proto_counts(self, peer: str | None) -> bool:
        return self.any_proto or self.declared(peer)

    def client_address(self, peer: str | None, forwarded_for: Iterable[str]) -> str:
        """Whom a request comes from, for the per-address limit and the log: the peer, unless it is a named proxy;
        then the rightmost hop of X-Forwarded-For that is not a named proxy (each proxy appends the address it was
        reached from, so hops to the left of that one are the client's own say). A hop that is not an address
        ends the walk at the proxy that wrote it."""
        if not self.declared(peer):
            return peer or "unknown"
        client = peer or "unknown"
        hops = [hop for header in forwarded_for for hop in header.split(",")]
        for hop in reversed(hops):
            address = ip_of(hop)
            if address is None:
                break
            client = str(address)
            if not any(address in network for network in self.networks):
                break
        return client


@dataclass(eq=False)
class PendingRules:
    """A delivery waiting for its owner's rules: its rule set (`rule_set`, the rules and the params as JSON, which
    a frame shares), its envelope, when it stops waiting (time.monotonic()), and its answer. `taken` while it is in
    a frame on its way to a child."""
    rule_set: tuple[tuple[str, ...], str]
    params: dict
    doc: bytes
    until: float
    answer: asyncio.Future
    taken: bool = False


@dataclass
class TenantGate:
    """One owner's share of the evaluator: its slots for rules saves, dry runs and replays, how many calls wait
    for one, and its deliveries waiting to be evaluated (a frame at a time, while `dispatching`)."""
    slots: asyncio.Semaphore
    waiting: int = 0
    deliveries: collections.deque = field(default_factory=collections.deque)
    dispatching: bool = False
