"""Replay: stored deliveries through the current rules, never minting work twice."""

from __future__ import annotations

import collections
import json
import sqlite3
from dataclasses import dataclass

from switchboard.configuration import ApiError, to_ms
from switchboard.crypto import new_id
from switchboard.database import Txn
from switchboard.envelope import envelope_title, stored_envelope
from switchboard.evaluator import Evaluator
from switchboard.models import ReplayMany
from switchboard.store.deliveries import EVENT_WITH_BODY, _create_planned_todo, plan_delivery
from switchboard.store.principals import Principal
from switchboard.store.routing import decide_for_webhook, gate, with_current_actor
from switchboard.store.transitions import _transition, claim_once
from switchboard.store.webhooks import _visible_webhook

# -- replay: stored deliveries through the current rules ------------------------------------------------

def replay_subject(txn: Txn, principal: Principal, event_id: str) -> tuple[sqlite3.Row, sqlite3.Row, dict]:
    """A delivery the human's webhook received, its webhook, and its envelope with `.actor` as trusted now."""
    principal.require_human("replaying deliveries")
    event = txn.one(f"{EVENT_WITH_BODY} WHERE id = ? AND (human_id = ? OR ?) AND webhook_id IS NOT NULL",
                    (event_id, principal.human_id, principal.kind == "operator"))
    if event is None:
        raise ApiError("not_found", f"no event {event_id}")
    webhook = txn.one("SELECT w.*, e.human_id FROM webhooks w JOIN endpoints e ON e.id = w.endpoint_id"
                      " WHERE w.id = ?", (event["webhook_id"],))
    if webhook is None or event["envelope"] is None:
        raise ApiError("conflict", f"event {event_id} can no longer be replayed (its webhook or envelope is gone)")
    return event, webhook, with_current_actor(stored_envelope(event["envelope"], event["headers"], event["body"]), webhook)


def replay_events(txn: Txn, principal: Principal, webhook_id: str, body: ReplayMany) -> list[str]:
    principal.require_human("replaying deliveries")
    _visible_webhook(txn, principal, webhook_id, "replay")
    sql, args = "SELECT id FROM events WHERE webhook_id = ?", [webhook_id]
    for clause, value in (("disposition = ?", body.disposition), ("kind = ?", body.kind),
                          ("received_at >= ?", to_ms(body.since) if body.since else None),
                          ("received_at < ?", to_ms(body.until) if body.until else None)):
        if value is not None:
            sql += f" AND {clause}"
            args.append(value)
    return [r["id"] for r in txn.all(sql + " ORDER BY received_at DESC, id DESC LIMIT ?", (*args, body.limit))]


@dataclass
class Replay:
    """One stored delivery's new decision, made outside the writer and applied (or only reported) inside it."""
    event_id: str
    action: dict
    trace: dict


def decide_again(evaluator: Evaluator, subjects: list[tuple[str, sqlite3.Row, dict]], tenant: str | None
                 ) -> list[Replay]:
    """The current gate's and rules' decisions for stored deliveries (event id, webhook, envelope)."""
    return [Replay(event_id, *(gate(envelope) or decide_for_webhook(evaluator, webhook, json.dumps(envelope).encode(),
                                                                     tenant)))
            for event_id, webhook, envelope in subjects]


def replay_subjects(txn: Txn, principal: Principal, event_ids: list[str]) -> list[tuple[str, sqlite3.Row, dict]]:
    return [(event_id, *replay_subject(txn, principal, event_id)[1:]) for event_id in event_ids]


def apply_replays(txn: Txn, principal: Principal, replays: list[Replay], dry_run: bool) -> list[dict]:
    return [apply_replay(txn, principal, replay, dry_run) for replay in replays]


def apply_replay(txn: Txn, principal: Principal, replay: Replay, dry_run: bool) -> dict:
    """Act on a replayed decision as a fresh delivery would, except that `once` claims hold (a subject already
    routed to the queue is a repeat) and a todo the event already minted on a target is never minted again;
    a held todo of the event is closed once its delivery routes. The event's first answer stays as it was."""
    event, webhook, envelope = replay_subject(txn, principal, replay.event_id)
    plan = plan_delivery(txn, webhook, envelope, replay.action, replay.trace)
    minted = txn.all("SELECT * FROM todos WHERE event_id = ?", (event["id"],))
    known = {(m["endpoint_id"], m["queue"]) for m in minted}
    fresh = [t for t in plan.targets if (t[0], t[1]) not in known]
    before = {"disposition": event["disposition"]}
    after = {"disposition": plan.disposition, "queue": plan.targets[0][1] if plan.targets else None,
             "rule_id": replay.trace.get("rule_id"), "stage": replay.trace["stage"]}
    answer = {"event_id": event["id"], "dry_run": dry_run, "before": before, "after": after, "created": 0,
              "todos": [{"id": None, "endpoint_id": e, "queue": q, "created": False} for e, q, _ in fresh]}
    if dry_run:
        return answer
    if plan.disposition == "routed" and plan.once_key and fresh:
        claim_once(txn, webhook["id"], plan.once_key, event["id"], replay.action["queue"])
    todos = []
    for target in fresh:
        todo_id = new_id("td")
        _create_planned_todo(txn, todo_id, target, envelope, plan, event["id"], envelope_title(envelope))
        todos.append({"id": todo_id, "endpoint_id": target[0], "queue": target[1], "created": True})
    if plan.disposition == "routed" and fresh:
        for held in (m for m in minted if m["state"] == "quarantined"):
            _transition(txn, held, "done", principal.actor, {"replayed": True}, outcome="discarded",
                        state_reason="replayed")
    txn.execute("INSERT INTO event_replays (id, event_id, actor, at, before, after, created) VALUES (?, ?, ?, ?, ?,"
                " ?, ?)", (new_id("rp"), event["id"], principal.actor, txn.now, json.dumps(before), json.dumps(after),
                           len(todos)))
    txn.logs.append(f"delivery {event['id']} replayed by {principal.actor}: {plan.disposition}, {len(todos)} todos")
    return {**answer, "todos": todos, "created": len(todos)}


def replay_summary(results: list[dict]) -> dict:
    transitions = collections.Counter((r["before"]["disposition"], r["after"]["disposition"], r["after"]["rule_id"])
                                      for r in results)
    return {"matched": len(results),
            "changed": sum(1 for r in results if r["before"]["disposition"] != r["after"]["disposition"] or r["todos"]),
            "created": sum(r["created"] for r in results),
            "transitions": [{"from": a, "to": b, "rule_id": rule, "count": n}
                            for (a, b, rule), n in sorted(transitions.items(), key=lambda kv: -kv[1])]}
