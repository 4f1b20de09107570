"""What a human does to a todo (approve, answer, retry, defer, cancel, reroute) and the todos an operator
or a human pushes."""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Callable
from typing import Any

from switchboard.configuration import RESERVED_QUEUES, TERMINAL_STATES, ApiError, iso, to_ms
from switchboard.crypto import new_id
from switchboard.database import Txn
from switchboard.models import Answer, Cancel, Defer, HumanNote, RequestChanges, Reroute, TodoPush
from switchboard.store.principals import Principal, own_endpoint
from switchboard.store.todos import dump_json, load_todo, reload_todo, todo_view
from switchboard.store.transitions import (
    create_todo,
    end_attempt,
    let_go_of_absorbed,
    record_event,
    transition,
    write_receipt,
)
from switchboard.store.webhooks import webhook_targets

# -- human actions ----------------------------------------------------------------------------------

def shown(act: Callable[..., None]) -> Callable[..., dict]:
    """A human action that answers with the todo as it is after the action. `act` alone (the wrapper's `act`) is
    what a bulk call runs: it answers with counts, and skips a read of every todo it acts on."""

    @functools.wraps(act)
    def action(txn: Txn, principal: Principal, todo_id: str, *args: Any, **kwargs: Any) -> dict:
        act(txn, principal, todo_id, *args, **kwargs)
        return todo_view(reload_todo(txn, todo_id))

    action.act = act  # type: ignore[attr-defined]
    return action


# The states each action a bulk call may take starts from (the single actions check the same).
ACTION_STATES: dict[str, tuple[str, ...]] = {
    "approve": ("review",), "retry": ("failed",), "defer": ("pending",), "discard": ("quarantined",),
    "cancel": ("pending", "claimed", "needs_input", "blocked", "review", "deferred", "failed"),
    "reroute": ("pending", "needs_input", "blocked", "deferred", "failed"),
}


def human_todo(txn: Txn, principal: Principal, action: str, todo_id: str, allowed: tuple[str, ...]) -> sqlite3.Row:
    principal.require_human(action)
    todo = load_todo(txn, principal, todo_id, for_update=True)
    if todo["state"] not in allowed:
        raise ApiError("conflict", f"cannot {action} a todo that is {todo['state']}")
    return todo


@shown
def approve(txn: Txn, principal: Principal, todo_id: str, body: HumanNote, via: dict | None = None) -> None:
    todo = human_todo(txn, principal, "approve", todo_id, ACTION_STATES["approve"])
    transition(txn, todo, "done", principal.actor, {"note": body.note, **(via or {})}, outcome="approved", state_reason=None)
    write_receipt(txn, todo, principal.actor)


@shown
def request_changes(txn: Txn, principal: Principal, todo_id: str, body: RequestChanges, via: dict | None = None) -> None:
    todo = human_todo(txn, principal, "request changes on", todo_id, ("review",))
    transition(txn, todo, "pending", principal.actor, {"note": body.note, **(via or {})}, state_reason=body.note)
    let_go_of_absorbed(txn, todo_id)


@shown
def answer(txn: Txn, principal: Principal, todo_id: str, body: Answer, via: dict | None = None) -> None:
    todo = human_todo(txn, principal, "answer", todo_id, ("needs_input",))
    transition(txn, todo, "pending", principal.actor, {"question": todo["state_reason"], "answer": body.answer,
                                                       **(via or {})},
                answer=body.answer)


@shown
def resume(txn: Txn, principal: Principal, todo_id: str, body: HumanNote, via: dict | None = None) -> None:
    todo = human_todo(txn, principal, "resume", todo_id, ("blocked",))
    transition(txn, todo, "pending", principal.actor, {"note": body.note, **(via or {})}, state_reason=None)


@shown
def retry(txn: Txn, principal: Principal, todo_id: str, body: HumanNote, via: dict | None = None) -> None:
    todo = human_todo(txn, principal, "retry", todo_id, ACTION_STATES["retry"])
    if txn.all_usually_none("SELECT 1 FROM endpoints WHERE id = ? AND revoked_at IS NOT NULL", (todo["endpoint_id"],)):
        raise ApiError("conflict", "the todo's endpoint is revoked; reroute it instead")
    transition(txn, todo, "pending", principal.actor, {"note": body.note, **(via or {})}, attempt=0,
               dead_letter=0)


@shown
def defer(txn: Txn, principal: Principal, todo_id: str, body: Defer, via: dict | None = None) -> None:
    todo = human_todo(txn, principal, "defer", todo_id, ACTION_STATES["defer"])
    until = to_ms(body.until) if body.until else None
    transition(txn, todo, "deferred", principal.actor, {"reason": body.reason, "until": iso(until), **(via or {})},
                state_reason=body.reason, deferred_until=until)


@shown
def undefer(txn: Txn, principal: Principal, todo_id: str, body: HumanNote, via: dict | None = None) -> None:
    todo = human_todo(txn, principal, "undefer", todo_id, ("deferred",))
    transition(txn, todo, "pending", principal.actor, {"note": body.note, **(via or {})}, state_reason=None,
               deferred_until=None)


@shown
def cancel(txn: Txn, principal: Principal, todo_id: str, body: Cancel, via: dict | None = None) -> None:
    """Cancel live work, or close a dead letter the human will not retry (it stops being a dead letter)."""
    todo = human_todo(txn, principal, "cancel", todo_id, ACTION_STATES["cancel"])
    if todo["state"] == "claimed":
        end_attempt(txn, todo, "cancelled", body.reason)
    transition(txn, todo, "cancelled", principal.actor, {"reason": body.reason, **(via or {})},
               state_reason=body.reason,
                dead_letter=0)
    let_go_of_absorbed(txn, todo_id)


@shown
def discard(txn: Txn, principal: Principal, todo_id: str, body: HumanNote) -> None:
    todo = human_todo(txn, principal, "discard", todo_id, ACTION_STATES["discard"])
    transition(txn, todo, "done", principal.actor, {"note": body.note}, outcome="discarded")


def reroute_target(txn: Txn, todo: sqlite3.Row, queue: str) -> str:
    """Choose the endpoint as exclusive delivery would: the first, in order, whose scope grants the queue,
    among the originating webhook's targets; for operator-authored todos (or a deleted webhook), among the same
    human's live endpoints in creation order."""
    human_id = txn.one("SELECT human_id FROM endpoints WHERE id = ?", (todo["endpoint_id"],))["human_id"]
    webhook = txn.one("SELECT w.* FROM events e JOIN webhooks w ON w.id = e.webhook_id WHERE e.id = ?",
                      (todo["event_id"],))
    if webhook is not None:
        candidates = webhook_targets(txn, webhook)
    else:
        candidates = txn.all("SELECT * FROM endpoints WHERE human_id = ? AND revoked_at IS NULL"
                             " ORDER BY created_at, rowid", (human_id,))
    for row in candidates:
        # A friend's route lets a webhook reach another human; a reroute never crosses humans.
        if row["human_id"] == human_id and queue in json.loads(row["queues"]):
            return row["id"]
    raise ApiError("invalid_argument", f"queue: no live target endpoint is scoped to {queue}")


@shown
def reroute(txn: Txn, principal: Principal, todo_id: str, body: Reroute) -> None:
    if body.queue in RESERVED_QUEUES:
        raise ApiError("invalid_argument", f"queue: {body.queue} is reserved")
    todo = human_todo(txn, principal, "reroute", todo_id, ACTION_STATES["reroute"])
    move_to_queue(txn, todo, body.queue, principal.actor, {})


def move_to_queue(txn: Txn, todo: sqlite3.Row, queue: str, actor: str, evidence: dict) -> None:
    """A reroute (the human's, or a wait limit's): the todo starts again, pending on `queue` of the endpoint
    reroute_target chooses. Refused (ApiError, before anything is written) when no endpoint takes the queue or
    an open todo there holds the same idempotency key."""
    todo_id = todo["id"]
    endpoint_id = reroute_target(txn, todo, queue)
    if todo["idempotency_key"] is not None:
        twin = txn.one("SELECT id FROM todos WHERE endpoint_id = ? AND idempotency_key = ? AND id <> ?"
                       " AND state NOT IN ('done', 'failed', 'cancelled')",
                       (endpoint_id, todo["idempotency_key"], todo_id))
        if twin is not None:
            raise ApiError("conflict", f"todo {twin['id']} on {endpoint_id} already holds idempotency key"
                                       f" {todo['idempotency_key']!r}; finish or cancel one of them first")
    txn.execute("DELETE FROM absorptions WHERE absorbed_id = ?", (todo_id,))
    transition(txn, todo, "pending", actor,
                {"from_queue": todo["queue"], "to_queue": queue, "endpoint_id": endpoint_id, **evidence},
                queue=queue, endpoint_id=endpoint_id, attempt=0, dead_letter=0, state_reason=None,
                deferred_until=None, answer=None)


# -- operator-authored todos ------------------------------------------------------------------------

def push_todo(txn: Txn, principal: Principal, endpoint_id: str, body: TodoPush) -> dict:
    """A todo written by a human or the operator, recorded as an event of trust mode `operator`."""
    if principal.kind == "endpoint":
        raise ApiError("forbidden", "pushing todos needs a human token")
    endpoint = own_endpoint(txn, principal, endpoint_id)
    if endpoint["revoked_at"] is not None:
        raise ApiError("conflict", f"endpoint {endpoint_id} is revoked")
    if body.queue not in json.loads(endpoint["queues"]):
        raise ApiError("invalid_argument", f"queue: {body.queue} is outside the endpoint's scope")
    if body.key is not None:
        existing = txn.one(f"SELECT * FROM todo_rows WHERE endpoint_id = ? AND idempotency_key = ?"
                           f" AND state NOT IN {TERMINAL_STATES}", (endpoint_id, body.key))
        if existing is not None:
            return {**todo_view(existing), "created": False}
    work_item = body.work_item
    deps = list(dict.fromkeys(work_item.depends_on or [])) if work_item else []
    human_id = endpoint["human_id"]
    dep_states = []
    for dep in deps:
        row = txn.one("SELECT t.state FROM todos t JOIN endpoints e ON e.id = t.endpoint_id"
                      " WHERE t.id = ? AND e.human_id = ?", (dep, human_id))
        if row is None:
            raise ApiError("not_found", f"work_item.depends_on: no todo {dep}")
        dep_states.append((dep, row["state"]))
    payload = dump_json(body.payload, "payload")
    event_id, todo_id = new_id("ev"), new_id("td")
    trace = json.dumps({"stage": "operator", "actor": principal.actor})
    record_event(txn, event_id, human_id=human_id, source="operator", kind="todo", trust_mode="operator",
                 verified=True, body=payload, disposition="routed", trace=trace)
    dead = [(dep, state) for dep, state in dep_states if state in ("failed", "cancelled")]
    create_todo(txn, todo_id, principal.actor, endpoint_id=endpoint_id, queue=body.queue, title=body.title,
                source="operator", kind="todo", trace=trace, event_id=event_id,
                work_item=work_item.model_dump_json(by_alias=True, exclude_none=True) if work_item else None,
                idempotency_key=body.key, priority=body.priority,
                gated=int(bool(work_item and "review" in (work_item.approval_gates or []))),
                depends_on=[dep for dep, _ in dep_states],
                **({"state": "blocked", "state_reason": f"dependency {dead[0][0]} {dead[0][1]}"} if dead else {}))
    return {**todo_view(reload_todo(txn, todo_id)), "created": True}
