"""The scheduler's part of the wait limits (store.wait_limits): each todo whose wait came due gets its queue's
`then`, once. The sweep runs in the leader's scheduler tick; it reads the due todos through their partial index,
each locked as it is read (one another transaction holds is left to it, and a todo changed since the read no
longer matches it), and every action writes the todo's next due moment (or none) in the statement that acts."""

from __future__ import annotations

import json
import sqlite3

from switchboard.configuration import ApiError
from switchboard.database import Txn
from switchboard.store.human_actions import move_to_queue
from switchboard.store.outbox import notify
from switchboard.store.outputs import mark_status
from switchboard.store.transitions import let_go_of_absorbed, transition
from switchboard.store.wait_limits import WAIT_REMINDERS, queue_wait_limits

# A reminder goes to the channels that listen for the event of the todo's state; pending and blocked work has no
# event of its own and is told to those listening for `held` (work that waits on the human).
REMINDER_EVENTS = {"pending": "held", "needs_input": "needs_input", "review": "review", "blocked": "held"}


# The todos whose wait came due, through their partial index (todos_wait_due): the first `?` is now.
DUE_WAITS = "SELECT * FROM todos WHERE wait_due_at IS NOT NULL AND wait_due_at <= ? ORDER BY wait_due_at LIMIT ?"


def sweep_waits(txn: Txn, limit: int = 500) -> int:
    """Act on every todo whose wait came due (at most `limit`); how many."""
    due = txn.all(DUE_WAITS + txn.skip_locked, (txn.now, limit))
    for todo in due:
        _fire(txn, todo)
    return len(due)


# When the sweep next has a wait to act on (a scalar subquery of next_due's one statement)
NEXT_WAIT_MOMENT = "(SELECT min(wait_due_at) FROM todos WHERE wait_due_at IS NOT NULL)"


def _fire(txn: Txn, todo: sqlite3.Row) -> None:
    state = todo["state"]
    limit = queue_wait_limits(txn, todo["endpoint_id"], todo["queue"]).get(state)
    if limit is None:  # the limits are recomputed with every change, so this is a limit that went with its state
        _set_due(txn, todo, None, todo["wait_reminders"])
        return
    evidence = {"wait_limit": state, "after_seconds": limit["after_seconds"]}
    why = f"waited {limit['after_seconds']} s in {state}"
    if limit["then"] == "remind":
        _remind(txn, todo, limit, evidence)
    elif limit["then"] == "cancel":
        transition(txn, todo, "cancelled", "system", evidence, state_reason=why, dead_letter=0)
        let_go_of_absorbed(txn, todo["id"])
    elif limit["then"] == "defer":
        # Deferred with no end: parked, out of every claim and wait, until the human undefers (or cancels) it.
        transition(txn, todo, "deferred", "system", evidence, state_reason=why, deferred_until=None)
        let_go_of_absorbed(txn, todo["id"])
    else:
        try:
            move_to_queue(txn, todo, limit["queue"], "system", evidence)
        except ApiError as refused:  # refused before it wrote anything: the todo stays, and no longer comes due
            txn.logs.append(f"todo {todo['id']}: wait limit {state} could not reroute to {limit['queue']}:"
                            f" {refused.message}")
            _set_due(txn, todo, None, todo["wait_reminders"])
            return
        let_go_of_absorbed(txn, todo["id"])


def _remind(txn: Txn, todo: sqlite3.Row, limit: dict, evidence: dict) -> None:
    """Tell the human again (their channels, the issue's status comment), and again after each further period,
    WAIT_REMINDERS times in all. The todo stays as it is; the reminder is a line of its history."""
    count = (todo["wait_reminders"] or 0) + 1
    _set_due(txn, todo, txn.now + limit["after_seconds"] * 1000 if count < WAIT_REMINDERS else None, count)
    txn.execute("INSERT INTO todo_history (todo_id, at, actor, from_state, to_state, evidence)"
                " VALUES (?, ?, 'system', ?, ?, ?)",
                (todo["id"], txn.now, todo["state"], todo["state"], json.dumps({**evidence, "reminder": count})))
    txn.logs.append(f"todo {todo['id']}: reminder {count} of {WAIT_REMINDERS} after {evidence['after_seconds']} s"
                    f" in {todo['state']}")
    human_id = txn.one("SELECT human_id FROM endpoints WHERE id = ?", (todo["endpoint_id"],))["human_id"]
    notify(txn, human_id, REMINDER_EVENTS[todo["state"]],
           {"todo_id": todo["id"], "queue": todo["queue"], "state": todo["state"], "title": todo["title"],
            "reminder": count})
    mark_status(txn, todo["id"], todo["subject_key"], todo["event_id"])


def _set_due(txn: Txn, todo: sqlite3.Row, due: int | None, reminders: int) -> None:
    txn.execute("UPDATE todos SET wait_due_at = ?, wait_reminders = ? WHERE id = ? AND state = ?",
                (due, reminders, todo["id"], todo["state"]))
