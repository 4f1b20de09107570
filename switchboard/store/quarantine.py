"""The trust gate's held deliveries: releasing (optionally trusting the actor) and discarding."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass

from switchboard.configuration import ApiError, iso
from switchboard.crypto import new_id
from switchboard.database import Database, Txn
from switchboard.envelope import actors_to_trust, stored_envelope, untrusted_names
from switchboard.evaluator import Evaluator
from switchboard.models import ReleaseQuarantine
from switchboard.store.connections import connection_login
from switchboard.store.deliveries import EVENT_WITH_BODY, create_planned_todo, plan_delivery, work_item_columns
from switchboard.store.human_actions import human_todo
from switchboard.store.principals import Principal
from switchboard.store.routing import decide_for_webhook, with_current_actor
from switchboard.store.todos import get_todo, stored_json
from switchboard.store.transitions import claim_once, transition

# -- quarantine -------------------------------------------------------------------------------------

@dataclass
class QuarantineRelease:
    """A held delivery's re-evaluated decision, made outside the writer and applied inside it."""
    todo_id: str
    envelope: dict
    action: dict
    trace: dict
    trusted_actors: dict | None = None  # the webhook's new list, when the human trusted the actor


def _trusting(todo: sqlite3.Row, webhook: sqlite3.Row, envelope: dict) -> tuple[dict, list[str]]:
    """The webhook's trusted actors with this held delivery's actor added, and whom that trusts (those it adds,
    or, when the list names them all already, all of them)."""
    if todo["state_reason"] != "untrusted_actor":
        raise ApiError("conflict", f"trust_actor is for deliveries the trust gate held; this one is held as"
                                   f" {todo['state_reason']}")
    trusted = stored_json(webhook["trusted_actors"]) or {}
    names = actors_to_trust(envelope, trusted)
    if trusted.get("allow_all") or not names:
        raise ApiError("conflict", "there is no actor to trust on this delivery")
    field_name = "actor_ids" if "actor_ids" in trusted else "logins"
    added = untrusted_names(envelope, trusted)
    return {**trusted, field_name: [*trusted[field_name], *added]}, added or names


def _held_subject(txn: Txn, principal: Principal, todo_id: str) -> tuple[sqlite3.Row, sqlite3.Row | None, dict]:
    todo = human_todo(txn, principal, "release", todo_id, ("quarantined",))
    event = txn.one(f"{EVENT_WITH_BODY} WHERE id = ?", (todo["event_id"],))
    if event is None or event["envelope"] is None:
        raise ApiError("conflict", "the held delivery was pruned; discard it")
    webhook = txn.one("SELECT * FROM webhooks WHERE id = ?", (event["webhook_id"],))
    return todo, webhook, stored_envelope(event["envelope"], event["headers"], event["body"])


def prepare_quarantine_release(db: Database, evaluator: Evaluator, principal: Principal, todo_id: str,
                    body: ReleaseQuarantine) -> QuarantineRelease:
    """Re-evaluate a held delivery with `.release` set (the trust gate does not run again: a human released
    it), or send it to a named queue; with `trust_actor`, first as if its actor were trusted."""
    todo, webhook, envelope = db.read_sync(_held_subject, principal, todo_id)
    if webhook is None:
        raise ApiError("conflict", "the webhook of this delivery is gone; discard it")
    trusted = _trusting(todo, webhook, envelope)[0] if body.trust_actor else None
    envelope = with_current_actor(envelope, webhook, trusted, db.read_sync(connection_login, webhook["id"]))
    envelope["release"] = {"by": principal.actor, "at": iso(db.clock.now_ms())}
    if body.queue is not None:
        action = {"queue": body.queue, "exclusive": True}
        trace = {"stage": "release", "cause": "named_queue", "action": action}
    else:
        action, trace = decide_for_webhook(evaluator, webhook, json.dumps(envelope).encode(), principal.human_id)
    return QuarantineRelease(todo_id, envelope, action, trace, trusted)


def apply_quarantine_release(txn: Txn, principal: Principal, release: QuarantineRelease, note: str | None = None) -> dict:
    """Act on a release's decision. Trusting the actor is the human's own decision: it is saved whatever the
    rules then do with the delivery (route it, drop it, or hold it again, when it stays held for that reason).
    The answer is the todo with its history, whose last line says what happened."""
    todo, webhook, envelope = _held_subject(txn, principal, release.todo_id)
    if webhook is None:
        raise ApiError("conflict", "the webhook of this delivery is gone; discard it")
    plan = plan_delivery(txn, webhook, release.envelope, release.action, release.trace)
    evidence = {"release": release.envelope["release"], "disposition": plan.disposition, "note": note}
    if plan.disposition == "quarantined":
        if release.trace["stage"] == "release":
            raise ApiError("invalid_argument", f"queue: no target of this webhook is scoped to {release.action['queue']}")
        if release.trusted_actors is None:
            raise ApiError("conflict", f"the rules hold it again ({plan.trace['hold']}); nothing changed")
    if release.trusted_actors is not None:
        # The list as it is now, so that a change made since the decision is kept.
        trusted, evidence["trusted"] = _trusting(todo, webhook, envelope)
        txn.execute("UPDATE webhooks SET trusted_actors = ? WHERE id = ?", (json.dumps(trusted), webhook["id"]))
        txn.logs.append(f"webhook {webhook['id']} trusted actors set by a release")
    trace = json.dumps(plan.trace_for(todo["endpoint_id"]))
    if plan.disposition == "quarantined":
        transition(txn, todo, "quarantined", principal.actor, evidence, state_reason=plan.trace["hold"], trace=trace)
    elif plan.disposition != "routed":
        transition(txn, todo, "done", principal.actor, evidence, outcome="discarded", state_reason=plan.disposition,
                    trace=trace)
    else:
        if plan.once_key:
            claim_once(txn, webhook["id"], plan.once_key, todo["event_id"], release.action["queue"])
        (endpoint_id, queue, _), *others = plan.targets
        transition(txn, todo, "pending", principal.actor, evidence, queue=queue, endpoint_id=endpoint_id,
                    trace=json.dumps(plan.trace_for(endpoint_id)),
                    work_order=json.dumps(plan.work_order) if plan.work_order else None, state_reason=None,
                    **work_item_columns(plan.work_order, todo["gated"]))
        for target in others:
            create_planned_todo(txn, new_id("td"), target, release.envelope, plan, todo["event_id"], todo["title"])
    return get_todo(txn, principal, todo["id"])
