"""Background work: lease expiry, deferrals, re-rings, retention and the scheduler's next moment."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable

from switchboard.configuration import (
    QUARANTINE_DAYS,
    RERING_AFTER_MS,
    SCHEMA_VERSION,
    TERMINAL_STATES,
    TODO_STATES,
    iso,
)
from switchboard.database import Database, Txn
from switchboard.models import (
    Answer,
    Block,
    Body,
    Cancel,
    ClaimById,
    Complete,
    Defer,
    Fail,
    Heartbeat,
    HumanNote,
    Leased,
    NeedsInput,
    Release,
    RequestChanges,
    Reroute,
)
from switchboard.store.human_actions import (
    answer,
    approve,
    cancel,
    defer,
    discard,
    request_changes,
    reroute,
    resume,
    retry,
    undefer,
)
from switchboard.store.transitions import (
    _CLAIMABLE,
    _expire_lease,
    _mark_rung,
    _transition,
    absorb,
    block,
    claim_todo,
    complete,
    fail,
    heartbeat,
    needs_input,
    release,
)

# -- background work --------------------------------------------------------------------------------

def scheduler_tick(txn: Txn, limit: int = 500) -> dict:
    """Return lapsed leases, wake due deferrals, and ring todos that came due since they went pending."""
    lapsed = txn.all("SELECT * FROM todos WHERE state = 'claimed' AND lease_expires_at <= ? LIMIT ?",
                     (txn.now, limit))
    for todo in lapsed:
        _expire_lease(txn, todo)
    due = txn.all("SELECT * FROM todos WHERE state = 'deferred' AND deferred_until <= ? LIMIT ?", (txn.now, limit))
    for todo in due:
        _transition(txn, todo, "pending", "system", {"until": iso(todo["deferred_until"])},
                    state_reason=None, deferred_until=None)
    expired = txn.all("SELECT * FROM todos WHERE state = 'quarantined' AND created_at <= ? LIMIT ?",
                      (txn.now - QUARANTINE_DAYS * 86_400_000, limit))
    for todo in expired:
        _transition(txn, todo, "done", "system", {"expired_after_days": QUARANTINE_DAYS}, outcome="discarded",
                    state_reason="expired")
    unrung = txn.all(f"SELECT * FROM todos WHERE state = 'pending' AND ring_count = 0 AND available_at <= ?"
                     f" AND silent = 0 AND {_CLAIMABLE} ORDER BY available_at LIMIT ?", (txn.now, txn.now, limit))
    rerung: list[sqlite3.Row] = []
    for count, wait_ms in enumerate(RERING_AFTER_MS, start=1):
        rerung += txn.all(f"SELECT * FROM todos WHERE state = 'pending' AND ring_count > 0 AND ring_count = ?"
                          f" AND last_ring_at <= ?"
                          f" AND available_at <= ? AND silent = 0 AND {_CLAIMABLE} LIMIT ?",
                          (count, txn.now - wait_ms, txn.now, txn.now, limit))
    if txn.inline_rings:
        for todo in unrung + rerung:
            _mark_rung(txn, todo)
    return {"lapsed": len(lapsed), "undeferred": len(due), "expired": len(expired), "rung": len(unrung),
            "rerung": len(rerung), "next_due": next_due(txn)}


def next_due(txn: Txn) -> int | None:
    """When the scheduler next has something to do (a lease lapses, a deferral ends, a held item expires, a
    retry comes due, a re-ring is owed), from the partial indexes alone; None when nothing waits."""
    moments = [txn.one("SELECT min(lease_expires_at) FROM todos WHERE state = 'claimed'")[0],
               txn.one("SELECT min(deferred_until) FROM todos WHERE state = 'deferred'")[0],
               txn.one("SELECT min(available_at) FROM todos WHERE state = 'pending' AND ring_count = 0"
                       " AND available_at > ?", (txn.now,))[0]]
    held = txn.one("SELECT min(created_at) FROM todos WHERE state = 'quarantined'")[0]
    moments.append(held + QUARANTINE_DAYS * 86_400_000 if held is not None else None)
    for count, wait_ms in enumerate(RERING_AFTER_MS, start=1):
        # `ring_count > 0` repeats the partial index's own condition, so SQLite uses it (todos_rerung).
        rung = txn.one(f"SELECT min(last_ring_at) FROM todos WHERE state = 'pending' AND ring_count > 0"
                       f" AND ring_count = {count}")[0]
        moments.append(rung + wait_ms if rung is not None else None)
    return min((m for m in moments if m is not None), default=None)


def rings_for_new_session(txn: Txn, endpoint_id: str, queues: Iterable[str], limit: int = 3) -> list[dict]:
    """A session that connects is rung at once for up to `limit` of its oldest claimable todos. These rings go
    to that session alone, so they are returned rather than queued for the doorbell."""
    queues = list(queues)
    marks = ",".join("?" * len(queues))
    rows = txn.all(f"SELECT * FROM todos WHERE endpoint_id = ? AND state = 'pending' AND queue IN ({marks})"
                   f" AND available_at <= ? AND silent = 0 AND {_CLAIMABLE}"
                   f" ORDER BY priority DESC, created_at, rowid LIMIT ?", (endpoint_id, *queues, txn.now, txn.now, limit))
    rings = [_mark_rung(txn, row) for row in rows]
    txn.rings.clear()
    return rings


RETENTION_MS = 30 * 86_400_000
RETENTION_ROWS = 500_000
PRUNE_BATCH = 5_000


def prune_batch(txn: Txn) -> dict:
    """One bounded step of retention: terminal todos and events older than 30 days or beyond 500,000 rows.
    Pending and claimed work is never touched, nor an event any todo still points at (the todo's payload is the
    event's body), nor routing_once."""
    todos = _prune_table(txn, "todos", f"state IN {TERMINAL_STATES}", "updated_at")
    events = _prune_table(txn, "events", "NOT EXISTS (SELECT 1 FROM todos t WHERE t.event_id = events.id)",
                          "received_at")
    messages = _prune_table(txn, "notify_outbox", "(sent_at IS NOT NULL OR gave_up_at IS NOT NULL)", "created_at")
    if todos or events or messages:
        txn.logs.append(f"pruned {todos} todos, {events} events and {messages} sent notifications")
    return {"todos": todos, "events": events, "notifications": messages}


def _prune_table(txn: Txn, table: str, eligible: str, stamp: str) -> int:
    """Delete up to a batch of eligible rows: those past the age limit, or the oldest beyond the row cap."""
    excess = min(PRUNE_BATCH, max(0, txn.one(f"SELECT count(*) FROM {table}")[0] - RETENTION_ROWS))
    rows = txn.all(f"SELECT id FROM {table} WHERE {eligible} AND {stamp} < ? ORDER BY {stamp} LIMIT ?",
                   (txn.now - RETENTION_MS, PRUNE_BATCH))
    if len(rows) < excess:
        rows = txn.all(f"SELECT id FROM {table} WHERE {eligible} ORDER BY {stamp} LIMIT ?", (excess,))
    txn.conn.executemany(f"DELETE FROM {table} WHERE id = ?", [(r["id"],) for r in rows])
    return len(rows)


def prune(db: Database) -> dict:
    """Retention to the end, in bounded transactions so that deliveries keep flowing between them."""
    total = {"todos": 0, "events": 0, "notifications": 0}
    while True:
        step = db.write_sync(prune_batch)
        total = {k: total[k] + step[k] for k in total}
        if not any(step.values()):
            return total


def queue_stats(txn: Txn) -> dict:
    depth = {state: 0 for state in TODO_STATES}
    depth.update({r["state"]: r["n"] for r in txn.all("SELECT state, count(*) AS n FROM todos GROUP BY state")})
    oldest = txn.one("SELECT MIN(available_at) FROM todos WHERE state = 'pending' AND available_at <= ?",
                     (txn.now,))[0]
    return {"depth": depth, "oldest_pending_seconds": (txn.now - oldest) / 1000 if oldest is not None else 0.0}


def check_database(txn: Txn) -> dict:
    integrity = [r[0] for r in txn.all("PRAGMA integrity_check")]
    foreign = txn.all("PRAGMA foreign_key_check")
    return {"integrity": "ok" if integrity == ["ok"] else integrity, "foreign_keys": "ok" if not foreign else len(foreign),
            "schema_version": txn.one("PRAGMA user_version")[0], "program_schema_version": SCHEMA_VERSION,
            "journal_mode": txn.one("PRAGMA journal_mode")[0]}


# The todo verbs by their REST and CLI names: the body's model and the store function that runs it.
AGENT_ACTIONS: dict[str, tuple[type[Body], Callable]] = {
    "claim": (ClaimById, claim_todo), "heartbeat": (Heartbeat, heartbeat), "complete": (Complete, complete),
    "fail": (Fail, fail), "release": (Release, release), "needs-input": (NeedsInput, needs_input),
    "block": (Block, block), "absorb": (Leased, absorb),
}
HUMAN_ACTIONS: dict[str, tuple[type[Body], Callable]] = {
    "approve": (HumanNote, approve), "request-changes": (RequestChanges, request_changes),
    "answer": (Answer, answer), "resume": (HumanNote, resume), "retry": (HumanNote, retry),
    "defer": (Defer, defer), "undefer": (HumanNote, undefer), "cancel": (Cancel, cancel),
    "reroute": (Reroute, reroute), "discard": (HumanNote, discard),
}
