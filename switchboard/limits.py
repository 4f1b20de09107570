"""Per-tenant rate limits and the gate that keeps one owner's deliveries from starving another's."""

from __future__ import annotations

import asyncio
import collections
import math
import time
from dataclasses import dataclass, field

from switchboard.configuration import ApiError

# The orchestration that is not HTTP: accepting a delivery, waiting claims, ring streams, rules with the
# evaluator's fair share, releasing held work, and the background loop. The HTTP section below only reads
# requests and writes answers around these.

class RateLimiter:
    """A token bucket per source address: `rate` per second, up to `burst` at once. A rate of 0 turns it off."""

    MAX_SOURCES = 10_000

    def __init__(self, rate: float, burst: int):
        self.rate = rate
        self.burst = max(burst, 1)
        self._buckets: dict[str, tuple[float, float]] = {}

    def retry_after(self, source: str) -> float:
        """0 when the request may go ahead (and is counted), else the seconds until it may."""
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

    def __init__(self, seconds: float):
        super().__init__("rate_limited", "too many deliveries from this address")
        self.retry_after = max(1, math.ceil(seconds))


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
