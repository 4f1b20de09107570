"""The human's queue control, per endpoint and queue: pause (until a moment, or until resumed), resume, admission
caps, and the queues as they stand; and the scheduler's part, which ends pauses and rings when a window turns.
Claims and rings read the same rows through store.admission."""

from __future__ import annotations

import json
import re

from switchboard.configuration import QUEUE_PATTERN, ApiError, iso
from switchboard.database import Row, Txn
from switchboard.models import QueueLimits, QueuePause, QueueResume
from switchboard.store.admission import claims_in_window, control_row, is_paused, next_ring_at, ring_room, window_end
from switchboard.store.forge_outbox import lane_changed
from switchboard.store.principals import Principal, own_endpoint
from switchboard.store.transitions import ring_claimable
from switchboard.store.wait_limits import set_wait_limits, wait_limits_view

RING_MOST = 500  # todos one opening rings for at most (the scheduler's tick rings as many)


def queue_view(txn: Txn, queue: str, row: Row | None, counts: dict[tuple[str, str], int]) -> dict:
    """One queue as GET /api/v1/endpoints/{id}/queues shows it; `counts` by (queue, state)."""
    paused = row is not None and is_paused(row, txn.now)
    windowed = row is not None and row["window_count"] is not None
    return {
        "queue": queue,
        "paused": {"until": iso(row["paused_until"]), "reason": row["paused_reason"], "by": row["paused_by"],
                   "at": iso(row["paused_at"])} if paused else None,
        "limits": {"max_in_flight": row["max_in_flight"] if row is not None else None,
                   "max_claims_per_window": {"count": row["window_count"], "window_seconds": row["window_seconds"]}
                   if windowed else None,
                   "max_in_flight_per_key": {"key": row["per_key"], "max": row["per_key_max"]}
                   if row is not None and row["per_key"] is not None else None,
                   "wait_limits": wait_limits_view(row)},
        "in_flight": counts.get((queue, "claimed"), 0),
        "claims_in_window": claims_in_window(row, txn.now) if windowed else None,
        "window_ends_at": iso(window_end(row, txn.now)) if windowed else None,
        "pending": counts.get((queue, "pending"), 0),
    }


def queue_views(txn: Txn, endpoint_id: str, scope: list[str]) -> dict[str, dict]:
    """Every queue of an endpoint by name: those of its scope, and any other that holds open work or a control."""
    rows = {r["queue"]: r for r in txn.all("SELECT * FROM queue_controls WHERE endpoint_id = ?", (endpoint_id,))}
    counts = {(r["queue"], r["state"]): r["n"] for r in txn.all(
        "SELECT queue, state, n FROM todo_counts WHERE endpoint_id = ? AND state IN ('pending', 'claimed') AND n > 0",
        (endpoint_id,))}
    names = sorted({*scope, *rows, *(queue for queue, _ in counts)})
    return {name: queue_view(txn, name, rows.get(name), counts) for name in names}


def list_queues(txn: Txn, principal: Principal, endpoint_id: str) -> dict:
    principal.require_human("queue control")
    endpoint = own_endpoint(txn, principal, endpoint_id)
    return {"queues": list(queue_views(txn, endpoint_id, json.loads(endpoint["queues"])).values())}


def _controlled(txn: Txn, principal: Principal, endpoint_id: str, queue: str) -> Row:
    """The endpoint (the principal's own) whose queue `queue` (in its scope) is to change; the queue's lock held."""
    principal.require_human("queue control")
    endpoint = own_endpoint(txn, principal, endpoint_id)
    if not re.match(QUEUE_PATTERN, queue):
        raise ApiError("invalid_argument", f"queue: {queue!r} is not a queue name")
    if queue not in json.loads(endpoint["queues"]):
        raise ApiError("invalid_argument", f"queue: {queue} is outside the endpoint's scope")
    txn.lock_key("queue", endpoint_id, queue)
    return endpoint


def _after_change(txn: Txn, endpoint_id: str, queue: str) -> dict:
    """What follows any change to a queue's control: it rings for what it now admits, the scheduler's next moment
    for it is set again, and a row with nothing left in it goes. A transaction that cannot ring (the CLI's, in a
    process of its own) leaves the ringing to the server's scheduler: the queue is due at once. Answers the
    queue's view."""
    opened = _ring_for_room(txn, endpoint_id, queue)
    if opened:
        txn.logs.append(f"queue {queue} of {endpoint_id} rang for {opened} waiting todos")
    row = control_row(txn, endpoint_id, queue)
    if row is not None:
        empty = row["paused_at"] is None and row["max_in_flight"] is None and row["window_count"] is None
        empty = empty and row["wait_limits"] is None
        empty = empty and row["per_key"] is None
        if empty and txn.inline_rings:
            txn.execute("DELETE FROM queue_controls WHERE endpoint_id = ? AND queue = ?", (endpoint_id, queue))
            row = None
        else:
            due = next_ring_at(row, txn.now) if txn.inline_rings else txn.now
            txn.execute("UPDATE queue_controls SET ring_due_at = ? WHERE endpoint_id = ? AND queue = ?",
                        (due, endpoint_id, queue))
            row = control_row(txn, endpoint_id, queue)
    counts = {(queue, r["state"]): r["n"] for r in txn.all(
        "SELECT state, n FROM todo_counts WHERE endpoint_id = ? AND queue = ? AND state IN ('pending', 'claimed')",
        (endpoint_id, queue))}
    return queue_view(txn, queue, row, counts)


def _ring_for_room(txn: Txn, endpoint_id: str, queue: str) -> int:
    """Ring for as many of the queue's claimable todos as it admits claims now (at most RING_MOST)."""
    left = ring_room(txn, endpoint_id, queue)
    return ring_claimable(txn, endpoint_id, queue, RING_MOST if left is None else min(left, RING_MOST))


def _touch(txn: Txn, endpoint_id: str, queue: str) -> None:
    """The queue's control row, made if it had none."""
    txn.execute("INSERT INTO queue_controls (endpoint_id, queue, updated_at) VALUES (?, ?, ?)"
                " ON CONFLICT (endpoint_id, queue) DO UPDATE SET updated_at = excluded.updated_at",
                (endpoint_id, queue, txn.now))


def pause_queue(txn: Txn, principal: Principal, endpoint_id: str, queue: str, body: QueuePause) -> dict:
    """Pause (or pause again, with a new `until` and reason): claims skip the queue and it rings no one;
    deliveries still land in it. It resumes by itself at `until`."""
    _controlled(txn, principal, endpoint_id, queue)
    until = body.until_ms(txn.now)
    if until is not None and until <= txn.now:
        raise ApiError("invalid_argument", f"until: {iso(until)} has passed already")
    _touch(txn, endpoint_id, queue)
    txn.execute("UPDATE queue_controls SET paused_at = ?, paused_until = ?, paused_by = ?, paused_reason = ?"
                " WHERE endpoint_id = ? AND queue = ?",
                (txn.now, until, principal.actor, body.reason, endpoint_id, queue))
    txn.logs.append(f"queue {queue} of {endpoint_id} paused by {principal.actor}"
                    f"{' until ' + iso(until) if until is not None else ''}")
    lane_changed(txn, endpoint_id, queue)
    return _after_change(txn, endpoint_id, queue)


def resume_queue(txn: Txn, principal: Principal, endpoint_id: str, queue: str, body: QueueResume) -> dict:
    """End the pause (an open queue stays open) and ring for what waited."""
    _controlled(txn, principal, endpoint_id, queue)
    row = control_row(txn, endpoint_id, queue)
    if row is not None and row["paused_at"] is not None:
        _end_pause(txn, endpoint_id, queue, principal.actor)
    return _after_change(txn, endpoint_id, queue)


def _end_pause(txn: Txn, endpoint_id: str, queue: str, actor: str) -> None:
    txn.execute("UPDATE queue_controls SET paused_at = NULL, paused_until = NULL, paused_by = NULL,"
                " paused_reason = NULL, updated_at = ? WHERE endpoint_id = ? AND queue = ?",
                (txn.now, endpoint_id, queue))
    txn.logs.append(f"queue {queue} of {endpoint_id} resumed by {actor}")
    lane_changed(txn, endpoint_id, queue)


def set_queue_limits(txn: Txn, principal: Principal, endpoint_id: str, queue: str, body: QueueLimits) -> dict:
    """Set or clear the queue's caps and wait limits: a field given replaces its cap (null clears it), one left
    out keeps it. A new window size starts its count again."""
    endpoint = _controlled(txn, principal, endpoint_id, queue)
    _touch(txn, endpoint_id, queue)
    if "max_in_flight" in body.model_fields_set:
        txn.execute("UPDATE queue_controls SET max_in_flight = ? WHERE endpoint_id = ? AND queue = ?",
                    (body.max_in_flight, endpoint_id, queue))
    if "max_claims_per_window" in body.model_fields_set:
        window = body.max_claims_per_window
        row = control_row(txn, endpoint_id, queue)
        same = window is not None and window.window_seconds == row["window_seconds"]
        txn.execute("UPDATE queue_controls SET window_count = ?, window_seconds = ?, window_started_at = ?,"
                    " window_claims = ? WHERE endpoint_id = ? AND queue = ?",
                    (window.count if window else None, window.window_seconds if window else None,
                     row["window_started_at"] if same else None, row["window_claims"] if same else 0,
                     endpoint_id, queue))
    if "max_in_flight_per_key" in body.model_fields_set:
        per_key = body.max_in_flight_per_key
        txn.execute("UPDATE queue_controls SET per_key = ?, per_key_max = ? WHERE endpoint_id = ? AND queue = ?",
                    (per_key.key if per_key else None, per_key.max if per_key else None, endpoint_id, queue))
    if "wait_limits" in body.model_fields_set:
        set_wait_limits(txn, endpoint["human_id"], endpoint_id, queue, body.wait_limits)
    txn.logs.append(f"queue {queue} of {endpoint_id} limits set by {principal.actor}")
    return _after_change(txn, endpoint_id, queue)


def ring_due_queues(txn: Txn) -> int:
    """The scheduler's part: for each queue whose moment came (a pause's `until`, a full window's turn), end the
    pause and ring for what it now admits. How many queues."""
    due = txn.all("SELECT endpoint_id, queue, paused_at, paused_until FROM queue_controls WHERE ring_due_at <= ?",
                  (txn.now,))
    for row in due:
        txn.lock_key("queue", row["endpoint_id"], row["queue"])
        if row["paused_at"] is not None and row["paused_until"] is not None and row["paused_until"] <= txn.now:
            _end_pause(txn, row["endpoint_id"], row["queue"], "system (its pause ended)")
        _after_change(txn, row["endpoint_id"], row["queue"])
    return len(due)


# When the scheduler next has a queue to open (a scalar subquery of next_due's one statement)
NEXT_QUEUE_MOMENT = "(SELECT min(ring_due_at) FROM queue_controls)"
