"""Background work: lease expiry, deferrals, re-rings, retention and the scheduler's next moment."""

from __future__ import annotations

import sqlite3
import threading
import time
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
    PostOutputs,
    Release,
    RequestChanges,
    Reroute,
)
from switchboard.store.admission import ring_room
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
from switchboard.store.queues import NEXT_QUEUE_MOMENT, ring_due_queues
from switchboard.store.schedules import NEXT_SCHEDULE_MOMENT, run_due_schedules
from switchboard.store.transitions import (
    CLAIMABLE,
    absorb,
    block,
    claim_todo,
    complete,
    expire_lease,
    fail,
    heartbeat,
    mark_rung,
    needs_input,
    post_outputs,
    release,
    transition,
)
from switchboard.store.wait_sweep import NEXT_WAIT_MOMENT, sweep_waits

# -- background work --------------------------------------------------------------------------------

def scheduler_tick(txn: Txn, limit: int = 500) -> dict:
    """Make the due schedules' todos, return lapsed leases, wake due deferrals, act on waits past their queue's
    wait limit, end pauses and ring queues that opened, and ring todos that came due since they went pending."""
    scheduled = run_due_schedules(txn)
    # Each row locked as it is read (one another transaction holds is left to it): a claim reaps its endpoint's
    # lapsed leases too, and a human's verb may be changing a deferred or held todo.
    lapsed = txn.all(f"SELECT * FROM todos WHERE state = 'claimed' AND lease_expires_at <= ? LIMIT ?{txn.skip_locked}",
                     (txn.now, limit))
    for todo in lapsed:
        expire_lease(txn, todo)
    due = txn.all(f"SELECT * FROM todos WHERE state = 'deferred' AND deferred_until <= ? LIMIT ?{txn.skip_locked}",
                  (txn.now, limit))
    for todo in due:
        transition(txn, todo, "pending", "system", {"until": iso(todo["deferred_until"])},
                    state_reason=None, deferred_until=None)
    expired = txn.all(f"SELECT * FROM todos WHERE state = 'quarantined' AND created_at <= ? LIMIT ?{txn.skip_locked}",
                      (txn.now - QUARANTINE_DAYS * 86_400_000, limit))
    for todo in expired:
        transition(txn, todo, "done", "system", {"expired_after_days": QUARANTINE_DAYS}, outcome="discarded",
                    state_reason="expired")
    waits = sweep_waits(txn, limit)
    # The rings too: a todo another transaction holds is being claimed or changed and needs no ring now (waiting
    # for it, while holding the todos rung before it, could deadlock with a claim).
    unrung = txn.all(f"SELECT * FROM todos WHERE state = 'pending' AND ring_count = 0 AND available_at <= ?"
                     f" AND silent = 0 AND {CLAIMABLE} ORDER BY available_at LIMIT ?{txn.skip_locked}",
                     (txn.now, txn.now, limit))
    rerung: list[sqlite3.Row] = []
    for count, wait_ms in enumerate(RERING_AFTER_MS, start=1):
        rerung += txn.all(f"SELECT * FROM todos WHERE state = 'pending' AND ring_count > 0 AND ring_count = ?"
                          f" AND last_ring_at <= ?"
                          f" AND available_at <= ? AND silent = 0 AND {CLAIMABLE} LIMIT ?{txn.skip_locked}",
                          (count, txn.now - wait_ms, txn.now, txn.now, limit))
    if txn.inline_rings:
        for todo in unrung + rerung:
            mark_rung(txn, todo)
    opened = ring_due_queues(txn)
    return {"lapsed": len(lapsed), "undeferred": len(due), "expired": len(expired), "rung": len(unrung),
            "rerung": len(rerung), "queues": opened, "scheduled": scheduled, "waits": waits,
            "next_due": next_due(txn)}


# The moments next_due weighs, each from a partial index (or the few queue controls), as one statement: the
# scheduler's idle look is this one read. `ring_count > 0` repeats the partial index's own condition, so SQLite
# uses it (todos_rerung).
_MOMENTS = ("SELECT (SELECT min(lease_expires_at) FROM todos WHERE state = 'claimed'),"
            " (SELECT min(deferred_until) FROM todos WHERE state = 'deferred'),"
            " (SELECT min(available_at) FROM todos WHERE state = 'pending' AND ring_count = 0 AND available_at > ?),"
            f" {NEXT_QUEUE_MOMENT}, {NEXT_SCHEDULE_MOMENT}, {NEXT_WAIT_MOMENT},"
            " (SELECT min(created_at) FROM todos WHERE state = 'quarantined'), "
            + ", ".join(f"(SELECT min(last_ring_at) FROM todos WHERE state = 'pending' AND ring_count > 0"
                        f" AND ring_count = {count})" for count in range(1, len(RERING_AFTER_MS) + 1)))


def next_due(txn: Txn) -> int | None:
    """When the scheduler next has something to do (a lease lapses, a deferral ends, a held item expires, a
    retry comes due, a re-ring is owed, a queue's pause ends or its full window turns, a schedule or a wait comes
    due); None when nothing waits."""
    lease, deferral, retry, queue, schedule, wait, held, *rung = txn.one(_MOMENTS, (txn.now,))
    moments = [lease, deferral, retry, queue, schedule, wait,
               held + QUARANTINE_DAYS * 86_400_000 if held is not None else None]
    moments += [last + wait_ms if last is not None else None
                for last, wait_ms in zip(rung, RERING_AFTER_MS, strict=True)]
    return min((m for m in moments if m is not None), default=None)


def rings_for_new_session(txn: Txn, endpoint_id: str, queues: Iterable[str], limit: int = 3) -> list[dict]:
    """A session that connects is rung at once for up to `limit` of its oldest claimable todos (of the queues
    that admit a claim now). These rings go to that session alone, so they are returned rather than queued for the
    doorbell."""
    queues = [queue for queue in queues if ring_room(txn, endpoint_id, queue) != 0]
    if not queues:
        return []
    marks = ",".join("?" * len(queues))
    rows = txn.all(f"SELECT * FROM todos WHERE endpoint_id = ? AND state = 'pending' AND queue IN ({marks})"
                   f" AND available_at <= ? AND silent = 0 AND {CLAIMABLE}"
                   f" ORDER BY priority DESC, created_at, rowid LIMIT ?", (endpoint_id, *queues, txn.now, txn.now, limit))
    rings = [ring for ring in (mark_rung(txn, row) for row in rows) if ring is not None]
    txn.rings.clear()
    return rings


RETENTION_MS = 30 * 86_400_000
RETENTION_ROWS = 500_000
PRUNE_BATCH = 5_000  # rows one step deletes at most
PRUNE_STEP_MS = 10  # ...and how long one step holds the writer (deliveries wait behind it) before it commits
PRUNE_WALK = 50  # rows one statement looks at
# Between steps a prune waits, so other writers (a server's deliveries, when `switchboard prune` runs beside it)
# get the lock: SQLite's busy handler retries after sleeps of growing length (1, 2, 5, 10, 15 ms…), and a prune
# that took the lock straight back could keep a waiting writer out for many steps.
PRUNE_PAUSE_MS = 20
# What retention deletes, in this order: terminal todos, then events no todo points at (a todo's payload is its
# event's body), then sent notifications; each the oldest first, by `stamp`. A walk reads the rows meeting `walk`
# (its index's own condition, so that SQLite walks the index in order) and deletes those that are `eligible`.
_RETAINED = (("todos", "todos", f"state IN {TERMINAL_STATES}", "1 = 1", "updated_at"),
             ("events", "events", "1 = 1", "NOT EXISTS (SELECT 1 FROM todos t WHERE t.event_id = events.id)",
              "received_at"),
             ("notifications", "notify_outbox", "(sent_at IS NOT NULL OR gave_up_at IS NOT NULL)", "1 = 1",
              "created_at"))


def retention_progress(txn: Txn) -> dict:
    """Where one prune starts: each table's walk from its oldest row, and how many rows it holds beyond
    RETENTION_ROWS (counted once per prune, on a reader; todos from todo_counts)."""
    held = {"todos": txn.one("SELECT coalesce(sum(n), 0) FROM todo_counts")[0],
            "events": txn.one("SELECT count(*) FROM events")[0],
            "notifications": txn.one("SELECT count(*) FROM notify_outbox")[0]}
    return {name: {"after": (-1, -1), "excess": max(0, held[name] - RETENTION_ROWS), "done": False} for name in held}


def prune_batch(txn: Txn, progress: dict | None = None) -> dict:
    """One bounded step of retention: terminal todos and events older than 30 days or beyond 500,000 rows.
    Pending and claimed work is never touched, nor an event any todo still points at (the todo's payload is the
    event's body), nor routing_once. A step ends once it deleted PRUNE_BATCH rows or held the writer for
    PRUNE_STEP_MS, so deliveries keep flowing between steps. `progress` (retention_progress) carries one prune's
    place in each table from step to step, so no step walks again what an earlier one passed over."""
    progress = retention_progress(txn) if progress is None else progress
    deadline = time.monotonic() + PRUNE_STEP_MS / 1000
    pruned = {name: 0 for name, *_ in _RETAINED}
    for name, table, walk, eligible, stamp in _RETAINED:
        place = progress[name]
        while not place["done"] and sum(pruned.values()) < PRUNE_BATCH and time.monotonic() < deadline:
            pruned[name] += _prune_walk(txn, place, f"{table} WHERE {walk}", eligible, stamp,
                                        PRUNE_BATCH - sum(pruned.values()))
        if not place["done"]:
            break  # events wait for the todos that point at them
    return pruned


def _prune_walk(txn: Txn, place: dict, rows_of: str, eligible: str, stamp: str, most: int) -> int:
    """Look at the next PRUNE_WALK rows (`rows_of`: a table and a condition) in `stamp` order and delete (up to
    `most` of) the eligible ones that are past the age limit, or the oldest beyond the row cap. Marks the walk done
    at the first row that is neither, or at the end."""
    cutoff = txn.now - RETENTION_MS
    # A row another transaction holds is being changed (a dead letter retried, an event replayed): the walk passes
    # it by, and the next prune looks again.
    rows = txn.all(f"SELECT rowid, {stamp} AS stamp, {eligible} AS eligible FROM {rows_of} AND {stamp} >= ?"
                   f" AND ({stamp}, rowid) > (?, ?) ORDER BY {stamp}, rowid LIMIT ?{txn.skip_locked}",
                   (place["after"][0], *place["after"], PRUNE_WALK))
    doomed = []
    for row in rows:
        if row["stamp"] >= cutoff and place["excess"] <= 0:
            place["done"] = True
            break
        place["after"] = (row["stamp"], row["rowid"])
        if row["eligible"]:
            doomed.append(row["rowid"])
            place["excess"] -= 1
            if len(doomed) == most:
                break
    else:
        place["done"] = len(rows) < PRUNE_WALK
    if not doomed:
        return 0
    # Eligibility is asked again as the rows go, where it is current: a todo pointing at an event may have been
    # made since the walk read it (the eligible column was the walk's snapshot), and a row whose stamp moved since
    # (a todo retried and finished again) is no longer the row the walk chose.
    return txn.execute(f"DELETE FROM {rows_of} AND {eligible} AND {stamp} <= ? AND rowid IN"
                       f" ({', '.join('?' * len(doomed))})", (place["after"][0], *doomed)).rowcount


def prune(db: Database, stop: threading.Event | None = None) -> dict:
    """Retention to the end, in short transactions with a pause after each, so that deliveries keep flowing; or
    until `stop` is set (a server shutting down), after the step under way. What it deleted, by table."""
    progress = db.read_sync(retention_progress)
    total = {name: 0 for name, *_ in _RETAINED}
    stop = stop or threading.Event()
    while True:
        step = db.write_sync(prune_batch, progress)
        total = {k: total[k] + step[k] for k in total}
        if all(place["done"] for place in progress.values()) or stop.wait(PRUNE_PAUSE_MS / 1000):
            return total


def queue_stats(txn: Txn) -> dict:
    """The todos by state (todo_counts) and the age of the oldest claimable pending todo, for /metrics."""
    depth = {state: 0 for state in TODO_STATES}
    depth.update({r["state"]: r["n"] for r in txn.all("SELECT state, sum(n) AS n FROM todo_counts GROUP BY state")})
    oldest = _oldest_available(txn)
    return {"depth": depth, "oldest_pending_seconds": (txn.now - oldest) / 1000 if oldest is not None else 0.0}


def _oldest_available(txn: Txn) -> int | None:
    """The earliest available_at of the pending todos available now. Each pending group is walked in created_at
    order (todos_by_state) only until created_at passes the best found (a todo is never available before it was
    created): a few rows each, where min(available_at) over the pending todos would read every one."""
    best = None
    for group in txn.all("SELECT endpoint_id, queue FROM todo_counts WHERE state = 'pending' AND n > 0"):
        for created, available in txn.execute("SELECT created_at, available_at FROM todos WHERE endpoint_id = ?"
                                              " AND state = 'pending' AND queue = ? ORDER BY created_at", group):
            if best is not None and created >= best:
                break
            if available <= txn.now and (best is None or available < best):
                best = available
    return best


def _schema_history(txn: Txn) -> list[dict]:
    """The migration steps the database took, as schema_history recorded them (none before it had the table)."""
    if not txn.has_table("schema_history"):
        return []
    return [{"version": version, "summary": summary, "applied_at": iso(at)}
            for version, summary, at in txn.all("SELECT version, summary, applied_at FROM schema_history"
                                                " ORDER BY version")]


def check_database(txn: Txn) -> dict:
    """The engine's own health checks. SQLite checks every page and key; Postgres keeps its pages and keys whole
    itself, so its report says what a Postgres operator must know instead: whether a commit waits for the disk,
    and which processes serve the database and how far their clocks are from the database's."""
    if txn.engine == "postgres":
        processes = [dict(r) for r in txn.all(
            "SELECT id, host, pid, seen_at, clock_ms - db_ms AS clock_skew_ms FROM processes ORDER BY started_at")]
        return {"engine": "postgres", "integrity": "ok", "foreign_keys": "ok",
                "schema_version": txn.schema_version(), "program_schema_version": SCHEMA_VERSION,
                "schema_history": _schema_history(txn), "synchronous_commit": txn.one("SHOW synchronous_commit")[0], "processes": processes,
                "clock_skew_ms": max((abs(p["clock_skew_ms"]) for p in processes), default=0)}
    integrity = [r[0] for r in txn.all("PRAGMA integrity_check")]
    foreign = txn.all("PRAGMA foreign_key_check")
    return {"engine": "sqlite", "integrity": "ok" if integrity == ["ok"] else integrity,
            "foreign_keys": "ok" if not foreign else len(foreign),
            "schema_version": txn.schema_version(), "program_schema_version": SCHEMA_VERSION,
            "schema_history": _schema_history(txn), "journal_mode": txn.one("PRAGMA journal_mode")[0]}


# The todo verbs by their REST and CLI names: the body's model and the store function that runs it.
AGENT_ACTIONS: dict[str, tuple[type[Body], Callable]] = {
    "claim": (ClaimById, claim_todo), "heartbeat": (Heartbeat, heartbeat), "complete": (Complete, complete),
    "fail": (Fail, fail), "release": (Release, release), "needs-input": (NeedsInput, needs_input),
    "block": (Block, block), "absorb": (Leased, absorb), "outputs": (PostOutputs, post_outputs),
}
HUMAN_ACTIONS: dict[str, tuple[type[Body], Callable]] = {
    "approve": (HumanNote, approve), "request-changes": (RequestChanges, request_changes),
    "answer": (Answer, answer), "resume": (HumanNote, resume), "retry": (HumanNote, retry),
    "defer": (Defer, defer), "undefer": (HumanNote, undefer), "cancel": (Cancel, cancel),
    "reroute": (Reroute, reroute), "discard": (HumanNote, discard),
}
