"""Waking exactly one waiting session when work becomes claimable."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

# The queue is the ledger; the doorbell is a hint. A ring goes to exactly one session of the todo's
# endpoint whose queue filter covers it: the oldest waiting claim first, else the streams in turn.

RING_FIELDS = ("todo_id", "queue", "kind", "source", "title")  # all a ring carries: no payload, lease or secret


@dataclass(eq=False)
class Session:
    endpoint_id: str
    queues: frozenset[str] | None
    kind: Literal["wait", "stream"]
    notify: Callable[[dict], None]
    close: Callable[[], None] | None = None
    via: str = "sse"  # how the worker listens: "sse" (GET /api/v1/doorbell), "mcp", or "claim" (a waiting claim)
    opened_at: float = field(default_factory=time.time)

    def covers(self, queue: str) -> bool:
        return self.queues is None or queue in self.queues


class Doorbell:
    """This process's sessions. `on_listen(endpoint_id, queues, waiting, delta)`, when given (Postgres), is told
    of each session that comes and goes, so that a committing transaction in any process can choose this one."""

    def __init__(self, on_listen: Callable[[str, frozenset[str] | None, bool, int], None] | None = None) -> None:
        self.on_listen = on_listen
        self._sessions: dict[str, list[Session]] = {}
        self._turn: dict[str, int] = {}
        self.rung = 0
        self.unheard = 0
        self.passed_on = 0  # rings a waiting claim took and did not use, rung again for the next in line
        self.closing = False

    def close_all(self) -> None:
        """At shutdown: end every stream and wake every waiting claim, so in-flight requests can finish."""
        self.closing = True
        for sessions in list(self._sessions.values()):
            for session in list(sessions):
                if session.close:
                    session.close()

    def sessions_of(self, endpoint_id: str) -> list[dict]:
        """Read-only, for the Board: the sessions listening on an endpoint now, how, for which queues, since when."""
        return [{"via": s.via, "queues": sorted(s.queues) if s.queues is not None else None, "since": s.opened_at}
                for s in self._sessions.get(endpoint_id, ())]

    def attach(self, session: Session) -> Session:
        self._sessions.setdefault(session.endpoint_id, []).append(session)
        self._told(session, 1)
        return session

    def detach(self, session: Session) -> None:
        sessions = self._sessions.get(session.endpoint_id, [])
        if session in sessions:
            sessions.remove(session)
            self._told(session, -1)

    def _told(self, session: Session, delta: int) -> None:
        if self.on_listen is not None and session.queues != frozenset():  # the Board's stream hears no rings
            self.on_listen(session.endpoint_id, session.queues, session.kind == "wait", delta)

    def ring(self, rings: list[dict]) -> None:
        for ring in rings:
            self._ring_one(ring)

    def _ring_one(self, ring: dict) -> bool:
        endpoint_id = ring["endpoint_id"]
        candidates = [s for s in self._sessions.get(endpoint_id, ()) if s.covers(ring["queue"])]
        if not candidates:
            self.unheard += 1
            return False
        waiting = [s for s in candidates if s.kind == "wait"]
        if waiting:
            chosen = waiting[0]
            self.detach(chosen)
        else:
            turn = self._turn.get(endpoint_id, 0)
            chosen = candidates[turn % len(candidates)]
            self._turn[endpoint_id] = turn + 1
        self.rung += 1
        chosen.notify({k: ring[k] for k in RING_FIELDS})
        return True

    def waiter(self, endpoint_id: str, queues: Iterable[str], first: bool = False) -> tuple[Session, asyncio.Future]:
        """A one-shot session for a waiting claim: its future resolves on the first ring it receives. A waiter
        that was rung but lost the todo to a faster claim goes back `first` in line, keeping its place."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()

        def notify(ring: dict | None) -> None:
            if not future.done():
                future.set_result(ring)

        session = Session(endpoint_id, frozenset(queues), "wait", notify, lambda: notify(None), via="claim")
        if first:
            self._sessions.setdefault(endpoint_id, []).insert(0, session)
            self._told(session, 1)
            return session, future
        return self.attach(session), future
