"""Wait limits: how long a todo may sit `pending`, `needs_input`, `review` or `blocked` in a queue before the
system acts on it. The moment a todo's wait comes due is its `wait_due_at`, written by the very statement that
changes its state (transitions) and, when the human changes the limits, recomputed for the queue's todos in the
same transaction; so the scheduler's sweep (store.wait_sweep) finds due waits through the partial index on it
alone, never by reading every todo."""

from __future__ import annotations

import json

from switchboard.configuration import RESERVED_QUEUES, ApiError
from switchboard.database import Row, Txn
from switchboard.models import WAIT_STATES, WaitLimits

WAIT_REMINDERS = 3  # a `remind` limit reminds the human at most this many times per stay in a state

# When a todo entered its state: its last transition (a todo not claimed changes `updated_at` only by a transition),
# or for a pending one held back by a retry's backoff, the moment it became available.
_ENTERED = "CASE WHEN state = 'pending' AND available_at > updated_at THEN available_at ELSE updated_at END"


def stored_wait_limits(row: Row | None) -> dict[str, dict]:
    """A queue_controls row's wait limits by state (none for no row)."""
    return json.loads(row["wait_limits"]) if row is not None and row["wait_limits"] else {}


def queue_wait_limits(txn: Txn, endpoint_id: str, queue: str) -> dict[str, dict]:
    # The very read admission.control_row makes: a queue without controls costs Postgres no round trip.
    rows = txn.all_usually_none("SELECT * FROM queue_controls WHERE endpoint_id = ? AND queue = ?",
                                (endpoint_id, queue))
    return stored_wait_limits(rows[0] if rows else None)


def wait_limits_view(row: Row | None) -> dict:
    """The limits as the queue's answer shows them: each state, null where it has none."""
    limits = stored_wait_limits(row)
    return {state: limits.get(state) for state in WAIT_STATES}


def wait_due_at(txn: Txn, endpoint_id: str, queue: str, state: str, entered_at: int) -> int | None:
    """When a todo that enters `state` of the queue at `entered_at` has waited too long (None: no limit)."""
    if state not in WAIT_STATES:
        return None
    limit = queue_wait_limits(txn, endpoint_id, queue).get(state)
    return entered_at + limit["after_seconds"] * 1000 if limit else None


def _checked(txn: Txn, human_id: str, queue: str, state: str, limit: dict) -> dict:
    """One state's limit, refused (naming its field) when its reroute could never land."""
    field = f"wait_limits.{state}.queue"
    target = limit["queue"]
    if limit["then"] != "reroute":
        if target is not None:
            raise ApiError("invalid_argument", f"{field}: only `then: reroute` takes a queue")
        return {"after_seconds": limit["after_seconds"], "then": limit["then"], "queue": None}
    if target is None:
        raise ApiError("invalid_argument", f"{field}: `then: reroute` needs the queue to reroute to")
    if target in RESERVED_QUEUES:
        raise ApiError("invalid_argument", f"{field}: {target} is reserved")
    if target == queue:
        raise ApiError("invalid_argument", f"{field}: a todo rerouted to its own queue would only wait there again")
    scopes = txn.all("SELECT queues FROM endpoints WHERE human_id = ? AND revoked_at IS NULL", (human_id,))
    if not any(target in json.loads(row["queues"]) for row in scopes):
        raise ApiError("invalid_argument", f"{field}: no live endpoint of yours takes the queue {target}")
    return limit


def set_wait_limits(txn: Txn, human_id: str, endpoint_id: str, queue: str, body: WaitLimits | None) -> None:
    """Change the queue's wait limits (its queue_controls row exists): a state given replaces its limit (null
    clears it), one left out keeps it; `body` None clears them all. Every todo of the queue waiting in a changed
    state has its due moment recomputed here, so a limit shortened below a wait already under way fires at the
    scheduler's next tick."""
    limits = queue_wait_limits(txn, endpoint_id, queue)
    changed = WAIT_STATES if body is None else tuple(state for state in WAIT_STATES if state in body.model_fields_set)
    for state in changed:
        given = getattr(body, state) if body is not None else None
        if given is None:
            limits.pop(state, None)
        else:
            limits[state] = _checked(txn, human_id, queue, state, given.model_dump())
    txn.execute("UPDATE queue_controls SET wait_limits = ? WHERE endpoint_id = ? AND queue = ?",
                (json.dumps(limits, sort_keys=True) if limits else None, endpoint_id, queue))
    for state in changed:
        where = ("WHERE endpoint_id = ? AND state = ? AND queue = ?", (endpoint_id, state, queue))
        limit = limits.get(state)
        if limit is None:
            txn.execute(f"UPDATE todos SET wait_due_at = NULL {where[0]} AND wait_due_at IS NOT NULL", where[1])
        elif limit["then"] == "remind":
            # The k-th reminder is due k periods after the todo entered the state; after the last, none.
            txn.execute(f"UPDATE todos SET wait_due_at = CASE WHEN coalesce(wait_reminders, 0) >= {WAIT_REMINDERS}"
                        f" THEN NULL ELSE {_ENTERED} + ? * (coalesce(wait_reminders, 0) + 1) END {where[0]}",
                        (limit["after_seconds"] * 1000, *where[1]))
        else:
            txn.execute(f"UPDATE todos SET wait_due_at = {_ENTERED} + ? {where[0]}",
                        (limit["after_seconds"] * 1000, *where[1]))
