"""Replay: stored deliveries through the current rules, never minting work twice."""

from __future__ import annotations

import collections
import json
import sqlite3
from dataclasses import dataclass

from switchboard.configuration import ApiError, to_ms
from switchboard.crypto import new_id
from switchboard.database import Txn
from switchboard.envelope import envelope_document, envelope_record, envelope_title, stored_envelope
from switchboard.evaluator import Evaluator
from switchboard.models import ReplayMany
from switchboard.payload import payload_text
from switchboard.store.connections import connection_login
from switchboard.store.deliveries import EVENT_WITH_BODY, create_planned_todo, plan_delivery
from switchboard.store.principals import Principal
from switchboard.store.routing import decide_for_webhook, gate, trust_gate, with_current_actor
from switchboard.store.rules import rules_view
from switchboard.store.todos import stored_json
from switchboard.store.transitions import claim_once, transition
from switchboard.store.webhooks import visible_webhook

# Bytes of stored bodies a replay holds at once: a bulk replay reads, evaluates and applies its deliveries in
# batches whose bodies add up to at most this (a larger body is a batch of its own), never all of them together.
REPLAY_BATCH_BYTES = 16 << 20

# -- replay: stored deliveries through the current rules ------------------------------------------------

def replay_subject(txn: Txn, principal: Principal, event_id: str) -> tuple[sqlite3.Row, sqlite3.Row, dict]:
    """A delivery the human's webhook received, its webhook, and its envelope with `.actor` as trusted now."""
    principal.require_human("replaying deliveries")
    event = txn.one(f"{EVENT_WITH_BODY} WHERE id = ? AND (human_id = ? OR ? = 1) AND webhook_id IS NOT NULL",
                    (event_id, principal.human_id, principal.kind == "operator"))
    if event is None:
        raise ApiError("not_found", f"no event {event_id}")
    webhook = txn.one("SELECT w.*, e.human_id FROM webhooks w JOIN endpoints e ON e.id = w.endpoint_id"
                      " WHERE w.id = ?", (event["webhook_id"],))
    if webhook is None or event["envelope"] is None:
        raise ApiError("conflict", f"event {event_id} can no longer be replayed (its webhook or envelope is gone)")
    if event["disposition"] == "command":
        raise ApiError("conflict", f"event {event_id} is a forge command: it was acted on once and is not replayed")
    return event, webhook, with_current_actor(stored_envelope(event["envelope"], event["headers"], event["body"]),
                                              webhook, connection_login=connection_login(txn, webhook["id"]))


def replay_events(txn: Txn, principal: Principal, webhook_id: str, body: ReplayMany) -> list[tuple[str, int]]:
    """The matching events of a webhook, newest first, each with its body's size (SQLite reads a blob's length
    without reading the blob)."""
    principal.require_human("replaying deliveries")
    visible_webhook(txn, principal, webhook_id, "replay")
    sql = ("SELECT e.id, coalesce(length(b.body), 0) AS size FROM events e"
           " LEFT JOIN event_bodies b ON b.event_id = e.id WHERE e.webhook_id = ? AND e.disposition <> 'command'")
    args: list = [webhook_id]
    for clause, value in (("e.disposition = ?", body.disposition), ("e.kind = ?", body.kind),
                          ("e.received_at >= ?", to_ms(body.since) if body.since else None),
                          ("e.received_at < ?", to_ms(body.until) if body.until else None)):
        if value is not None:
            sql += f" AND {clause}"
            args.append(value)
    rows = txn.all(sql + " ORDER BY e.received_at DESC, e.id DESC LIMIT ?", (*args, body.limit))
    return [(r["id"], r["size"]) for r in rows]


def replay_batches(events: list[tuple[str, int]]) -> list[list[str]]:
    """Event ids (with their bodies' sizes), in order, cut into batches of at most REPLAY_BATCH_BYTES of bodies."""
    batches: list[list[str]] = []
    held = 0
    for event_id, size in events:
        if not batches or (held + size > REPLAY_BATCH_BYTES and batches[-1]):
            batches.append([])
            held = 0
        batches[-1].append(event_id)
        held += size
    return batches


@dataclass
class ReplaySubject:
    """A stored delivery ready to be decided again: the gate's decision when the gate stops it, else the envelope
    as rules read it (its text only: the parsed envelope is dropped at once, so a batch holds about its bodies'
    bytes). No document when the webhook has no rules (the default action needs none)."""
    event_id: str
    webhook: sqlite3.Row
    gated: tuple[dict, dict] | None
    document: bytes | None
    actor: dict  # the envelope's `.actor`, for the trust gate after the rules


@dataclass
class Replay:
    """One stored delivery's new decision, made outside the writer and applied (or only reported) inside it."""
    event_id: str
    action: dict
    trace: dict


def decide_again(evaluator: Evaluator, subjects: list[ReplaySubject], tenant: str | None) -> list[Replay]:
    """The current gate's and rules' decisions for stored deliveries."""
    return [Replay(s.event_id, *(s.gated or trust_gate(s.actor, *decide_for_webhook(evaluator, s.webhook,
                                                                                      s.document or b"", tenant))))
            for s in subjects]


def replay_subjects(txn: Txn, principal: Principal, event_ids: list[str]) -> list[ReplaySubject]:
    subjects = []
    for event_id in event_ids:
        event, webhook, envelope = replay_subject(txn, principal, event_id)
        gated = gate(envelope)
        document = None
        if gated is None and rules_view(webhook)["rules"]:
            document = envelope_document(envelope_record(envelope), event["headers"],
                                         payload_text(envelope["payload"], event["body"] or b"")).encode()
        subjects.append(ReplaySubject(event_id, webhook, gated, document, envelope["actor"]))
    return subjects


def apply_replays(txn: Txn, principal: Principal, replays: list[Replay], dry_run: bool) -> list[dict]:
    return [apply_replay(txn, principal, replay, dry_run) for replay in replays]


def apply_replay(txn: Txn, principal: Principal, replay: Replay, dry_run: bool) -> dict:
    """Act on a replayed decision as a fresh delivery would, except that `once` claims hold (a subject already
    routed to the queue is a repeat) and a target the event already minted a todo on (wherever the todo went
    since) is never minted again; a held todo of the event is closed once its delivery routes. The event's first
    answer stays as it was. Replays of one event take turns (the event's row is locked first): each must see the
    todos and the once claim of the one before it together, not one of them."""
    txn.lock("events", "id = ?", (replay.event_id,))
    event, webhook, envelope = replay_subject(txn, principal, replay.event_id)
    plan = plan_delivery(txn, webhook, envelope, replay.action, replay.trace)
    minted = txn.all("SELECT * FROM todos WHERE event_id = ?", (event["id"],))
    covered = _covered_targets(txn, event, minted)
    fresh = [] if covered is None else [t for t in plan.targets
                                        if (t[0], t[1]) not in covered and (None, t[1]) not in covered]
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
        create_planned_todo(txn, todo_id, target, envelope, plan, event["id"], envelope_title(envelope))
        todos.append({"id": todo_id, "endpoint_id": target[0], "queue": target[1], "created": True})
    if plan.disposition == "routed" and fresh:
        for held in (m for m in minted if m["state"] == "quarantined"):
            transition(txn, held, "done", principal.actor, {"replayed": True}, outcome="discarded",
                        state_reason="replayed")
    txn.execute("INSERT INTO event_replays (id, event_id, actor, at, before, after, created) VALUES (?, ?, ?, ?, ?,"
                " ?, ?)", (new_id("rp"), event["id"], principal.actor, txn.now, json.dumps(before), json.dumps(after),
                           len(todos)))
    txn.logs.append(f"delivery {event['id']} replayed by {principal.actor}: {plan.disposition}, {len(todos)} todos")
    return {**answer, "todos": todos, "created": len(todos)}


# A move a human made: a reroute (its evidence names the queue it left) or a release from hold.
_MOVES = ("SELECT todo_id, from_state, json_extract(evidence, '$.from_queue') AS from_queue FROM todo_history"
          " WHERE todo_id IN (SELECT id FROM todos WHERE event_id = ?) AND (json_extract(evidence, '$.from_queue')"
          " IS NOT NULL OR (from_state = 'quarantined' AND to_state = 'pending')) ORDER BY id")


def _covered_targets(txn: Txn, event: sqlite3.Row, minted: list[sqlite3.Row]) -> set[tuple[str | None, str]] | None:
    """The (endpoint, queue) targets the event's todos cover: where each was minted, wherever a human moved it
    since, and where it is now. A todo minted by the delivery itself names its target in the event's first
    answer; one minted later and since rerouted left the queue its reroute names, from the endpoint its trace
    names when it names one (else it covers that queue on every endpoint: `None`). None when a human released
    one of them from hold: the release routed the delivery, so its work is placed and no target gets another."""
    first = {t["id"]: (t["endpoint_id"], t["queue"]) for t in (stored_json(event["outcome"]) or {}).get("todos", [])}
    left: dict[str, str] = {}
    for move in txn.all(_MOVES, (event["id"],)):
        if move["from_state"] == "quarantined" and move["from_queue"] is None:
            return None
        left.setdefault(move["todo_id"], move["from_queue"])
    covered: set[tuple[str | None, str]] = set()
    for todo in minted:
        covered.add((todo["endpoint_id"], todo["queue"]))
        if todo["id"] in first:
            covered.add(first[todo["id"]])
        elif todo["id"] in left:
            named = (stored_json(todo["trace"]) or {}).get("endpoints") or []
            covered.add((named[0] if len(named) == 1 else None, left[todo["id"]]))
    return covered


def replay_summary(results: list[dict]) -> dict:
    transitions = collections.Counter((r["before"]["disposition"], r["after"]["disposition"], r["after"]["rule_id"])
                                      for r in results)
    return {"matched": len(results),
            "changed": sum(1 for r in results if r["before"]["disposition"] != r["after"]["disposition"] or r["todos"]),
            "created": sum(r["created"] for r in results),
            "transitions": [{"from": a, "to": b, "rule_id": rule, "count": n}
                            for (a, b, rule), n in sorted(transitions.items(), key=lambda kv: -kv[1])]}
