"""A todo's transitions: create, claim, heartbeat, complete, fail, release, lease expiry, receipts."""

from __future__ import annotations

import json
import secrets
import sqlite3
from collections.abc import Iterable
from typing import Any

from switchboard.configuration import (
    BACKOFF_BASE_SECONDS,
    BACKOFF_CAP_SECONDS,
    DEFAULT_LEASE_SECONDS,
    HOLD_QUEUE,
    MAX_RESULT_BYTES,
    MAX_SUMMARY_BYTES,
    TERMINAL_STATES,
    ApiError,
    iso,
    log,
)
from switchboard.crypto import hashes_match, new_id, token_hash
from switchboard.database import Txn
from switchboard.engines import database_errors
from switchboard.models import (
    Block,
    ClaimById,
    ClaimNext,
    ClaimNow,
    Complete,
    Fail,
    Heartbeat,
    Leased,
    NeedsInput,
    PostOutputs,
    Release,
)
from switchboard.store.admission import admit, control_row, full_groups, in_groups, key_group, ring_room, withholds
from switchboard.store.outbox import notify_todo
from switchboard.store.outputs import accept_outputs, mark_status
from switchboard.store.principals import Principal, endpoint_view, own_endpoint
from switchboard.store.todos import attempt_view, dump_json, load_todo, messaging_attributes, reload_todo, todo_view
from switchboard.store.wait_limits import wait_due_at
from switchboard.tracing import new_span_id, new_trace_id, parse_traceparent, traceparent


def revoke_endpoint(txn: Txn, principal: Principal, endpoint_id: str) -> dict:
    """Revocation is immediate: the token stops working and every open todo fails `endpoint_revoked`."""
    row = own_endpoint(txn, principal, endpoint_id)
    if row["revoked_at"] is not None:
        return endpoint_view(row)
    txn.execute("UPDATE endpoints SET revoked_at = ? WHERE id = ?", (txn.now, endpoint_id))
    # Held deliveries stay held on the owner's quarantine queue: a human releases or discards them. Each open todo
    # is locked as it is read, and read as it is once a claim or a verb under way on it commits: a claim racing
    # the revocation must have its attempt ended here, not left open on a failed todo.
    open_todos = txn.all(f"SELECT * FROM todos WHERE endpoint_id = ? AND state NOT IN {TERMINAL_STATES}"
                         f" AND state <> 'quarantined' ORDER BY id{txn.for_update}", (endpoint_id,))
    for todo in open_todos:
        if todo["state"] == "claimed":
            end_attempt(txn, todo, "failed", "endpoint revoked")
        transition(txn, todo, "failed", principal.actor, {"reason": "endpoint_revoked"},
                    dead_letter=1, last_error="endpoint_revoked")
    txn.logs.append(f"endpoint {endpoint_id} revoked; {len(open_todos)} open todos failed")
    return endpoint_view(txn.one("SELECT * FROM endpoints WHERE id = ?", (endpoint_id,)))


# -- todos: transitions -----------------------------------------------------------------------------

_UNBLOCKED = ("NOT EXISTS (SELECT 1 FROM todo_deps d JOIN todos p ON p.id = d.depends_on_id"
              " WHERE d.todo_id = todos.id AND p.state <> 'done')")


# Claimable: a pending todo's dependencies are done and no live attempt (leased, or awaiting review) holds it
# absorbed. The one `?` is the transaction's now; the text never changes, so SQLite reuses the prepared statement.
CLAIMABLE = (f"{_UNBLOCKED} AND NOT EXISTS (SELECT 1 FROM absorptions a JOIN todos h ON h.id = a.holder_id"
              f" WHERE a.absorbed_id = todos.id AND (h.state = 'review'"
              f" OR (h.state = 'claimed' AND h.lease_expires_at > ?)))")


TODO_DEFAULTS = {"state": "pending", "subject_key": None, "work_order": None, "work_item": None,
                 "idempotency_key": None, "priority": 0, "gated": 0, "state_reason": None, "silent": 0}
_INSERT_TODO = (f"INSERT INTO todos (id, endpoint_id, queue, title, source, kind, trace, event_id,"
                f" {', '.join(TODO_DEFAULTS)}, ring_count, last_ring_at, available_at, created_at, updated_at, wait_due_at,"
                f" traceparent) VALUES ({', '.join('?' * (8 + len(TODO_DEFAULTS) + 7))})")


def create_todo(txn: Txn, todo_id: str, actor: str, *, endpoint_id: str, queue: str, title: str, source: str,
                kind: str | None, trace: str, event_id: str, depends_on: Iterable[str] = (),
                **optional: Any) -> None:
    """The one place a todo is born (the counterpart of transition): its row, its dependencies, its first
    history entry, the count, and a ring when it is claimable now. `optional` overrides TODO_DEFAULTS. Its payload
    is its event's body."""
    values = {**TODO_DEFAULTS, **optional}
    # Born pending with nothing to wait for, and allowed to ring, a todo is claimable this moment (nothing can
    # have absorbed an id just made): it is written rung already, instead of read back and updated. A paused or
    # full queue (or a full key of a per-key limit) withholds the ring (see mark_rung).
    rung = txn.inline_rings and values["state"] == "pending" and not depends_on and not values["silent"]
    withheld = rung and withholds(txn, endpoint_id, queue, values["subject_key"])
    # Its `send` span: under the transaction's context (a delivery's route span), else the root of a new trace.
    trace_id, parent_id = txn.trace_context or (new_trace_id(), None)
    send_span = new_span_id()
    txn.execute(_INSERT_TODO, (todo_id, endpoint_id, queue, title, source, kind, trace, event_id,
                               *values.values(), int(rung), txn.now if rung else None, txn.now, txn.now, txn.now,
                               wait_due_at(txn, endpoint_id, queue, values["state"], txn.now),
                               traceparent(trace_id, send_span)))
    if txn.spans is not None:
        txn.spans.append(span_record(
            f"send {queue}", "producer", trace_id, send_span, parent_id, txn.now, txn.now,
            messaging_attributes(todo_id, queue, endpoint_id, values["subject_key"], title=title)))
    for dependency in depends_on:
        txn.execute("INSERT INTO todo_deps (todo_id, depends_on_id) VALUES (?, ?)", (todo_id, dependency))
    txn.execute("INSERT INTO todo_history (todo_id, at, actor, from_state, to_state, evidence)"
                " VALUES (?, ?, ?, NULL, ?, ?)", (todo_id, txn.now, actor, values["state"],
                                                   json.dumps({"event_id": event_id})))
    txn.logs.append(f"todo {todo_id} created on {endpoint_id} by {actor}")
    txn.counts["created"] += 1
    mark_status(txn, todo_id, values["subject_key"], event_id)
    if values["state"] == "quarantined" or queue == HOLD_QUEUE:
        notify_todo(txn, todo_id, "held")
    if rung:
        if not withheld:
            _queue_ring(txn, {"id": todo_id, "endpoint_id": endpoint_id, "queue": queue, "kind": kind,
                              "source": source, "title": title})
    elif values["state"] == "pending":
        _became_pending(txn, todo_id)


def span_record(name: str, kind: str, trace_id: str, span_id: str, parent_id: str | None, start_ms: int,
                end_ms: int, attributes: dict, links: Iterable[tuple[str, str, dict]] = ()) -> dict:
    """A span as plain data (what switchboard.tracing exports once the transaction commits)."""
    return {"name": name, "kind": kind, "trace_id": trace_id, "span_id": span_id, "parent_id": parent_id,
            "start_ms": start_ms, "end_ms": end_ms, "attributes": attributes, "links": list(links)}


def record_event(txn: Txn, event_id: str, *, human_id: str, source: str, kind: str | None, trust_mode: str,
                 verified: bool, body: bytes | str | None, disposition: str, trace: str, webhook_id: str | None = None,
                 delivery_key: str | None = None, body_hash: str | None = None, headers: str = "{}",
                 envelope: str | None = None, outcome: str | None = None, subject_key: str | None = None) -> None:
    """The one place an event (a delivery, or an operator-authored todo's provenance) is written."""
    txn.execute("INSERT INTO events (id, webhook_id, human_id, source, kind, trust_mode, verified, delivery_key,"
                " body_hash, headers, envelope, disposition, trace, outcome, received_at, subject_key)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (event_id, webhook_id, human_id, source, kind, trust_mode, int(verified), delivery_key, body_hash,
                 headers, envelope, disposition, trace, outcome, txn.now, subject_key))
    if body is not None:
        # Bytes always: the column is a BLOB (bytea on Postgres), and an operator's JSON body is its UTF-8.
        txn.execute("INSERT INTO event_bodies (event_id, body) VALUES (?, ?)",
                    (event_id, body.encode() if isinstance(body, str) else body))


def claim_once(txn: Txn, webhook_id: str, key: str, event_id: str, queue: str) -> None:
    """The one place a `once` claim is made: the subject is now taken for this queue, for good."""
    txn.execute("INSERT INTO routing_once (webhook_id, once_key, event_id, queue, claimed_at) VALUES (?, ?, ?, ?, ?)",
                (webhook_id, key, event_id, queue, txn.now))


def transition(txn: Txn, todo: sqlite3.Row, to_state: str, actor: str, evidence: dict | None,
                **changes: Any) -> dict | None:
    """The one place a todo changes state: the row, its history line, the log line, and what follows. Returns
    the columns it wrote (see _as_written), or None when the todo had left `todo["state"]` by then: another
    transaction moved it first (where writers run side by side, a todo read without a lock may be changed before
    this writes), and nothing is written over that move. A caller holding the row's lock always writes."""
    columns = {"state": to_state, "updated_at": txn.now, **changes}
    if to_state != "claimed":
        columns.update(lease_expires_at=None, lease_token_hash=None)
    if to_state == "pending":
        columns.setdefault("available_at", txn.now)
        columns.update(ring_count=0, last_ring_at=None, ring_acked_at=None)
    # A wait limit's clock starts with the state (for pending work held back by a backoff, when it is available):
    # its due moment is written by this same statement, so the sweep never reads a stale one.
    columns.update(wait_due_at=wait_due_at(txn, columns.get("endpoint_id", todo["endpoint_id"]),
                                           columns.get("queue", todo["queue"]), to_state,
                                           max(txn.now, columns.get("available_at") or txn.now)),
                   wait_reminders=None)
    assignments = ", ".join(f"{name} = ?" for name in columns)
    moved = txn.execute(f"UPDATE todos SET {assignments} WHERE id = ? AND state = ?",
                        (*columns.values(), todo["id"], todo["state"]))
    if todo["id"] not in txn.held and not moved.rowcount:
        txn.logs.append(f"todo {todo['id']} left {todo['state']} before {actor} moved it to {to_state}: not moved")
        return None
    txn.execute("INSERT INTO todo_history (todo_id, at, actor, from_state, to_state, evidence) VALUES (?, ?, ?, ?, ?, ?)",
                (todo["id"], txn.now, actor, todo["state"], to_state,
                 json.dumps(evidence) if evidence is not None else None))
    txn.logs.append(f"todo {todo['id']} {todo['state']} -> {to_state} by {actor}")
    mark_status(txn, todo["id"], todo["subject_key"], todo["event_id"])
    if to_state == "claimed":
        txn.counts["claimed"] += 1
    elif to_state == "done":
        txn.counts[f"completed:{changes['outcome']}"] += 1
    if to_state in ("needs_input", "review") or (to_state == "failed" and changes.get("dead_letter")):
        notify_todo(txn, todo["id"], "dead_letter" if to_state == "failed" else to_state)
    elif columns.get("queue") == HOLD_QUEUE and todo["queue"] != HOLD_QUEUE:
        notify_todo(txn, todo["id"], "held")
    if to_state == "pending":
        _became_pending(txn, todo["id"])
    elif to_state == "done" and not _known_none(todo, "awaited"):
        for dependent in txn.all("SELECT todo_id FROM todo_deps WHERE depends_on_id = ?", (todo["id"],)):
            _became_pending(txn, dependent["todo_id"])
    elif to_state in ("failed", "cancelled") and not _known_none(todo, "awaited"):
        for dependent in txn.all(
                "SELECT t.* FROM todo_deps d JOIN todos t ON t.id = d.todo_id"
                " WHERE d.depends_on_id = ? AND t.state IN ('pending', 'deferred')", (todo["id"],)):
            transition(txn, dependent, "blocked", "system", {"dependency": todo["id"], "state": to_state},
                        state_reason=f"dependency {todo['id']} {to_state}")
    if todo["state"] == "claimed":
        _slot_freed(txn, todo)
    return columns


def _known_none(todo: sqlite3.Row | dict, flag: str) -> bool:
    """Whether the todo's row was read with `flag` (FINISHING) and it says nothing is there."""
    return flag in todo.keys() and not todo[flag]


def _as_written(todo: sqlite3.Row, written: dict) -> dict:
    """A todo read from todo_rows with the columns just written over it: what reload_todo would read, without the
    read (a call into SQLite fewer on the hottest answers: claim, heartbeat, complete)."""
    return {**dict(todo), **written}


# A ring counted on a todo, only while it is pending: one read without a lock may have been claimed (or moved) since
COUNT_RING = "UPDATE todos SET ring_count = ring_count + 1, last_ring_at = ? WHERE id = ? AND state = 'pending'"


def _became_pending(txn: Txn, todo_id: str) -> None:
    """Ring now for a todo that is claimable now; the scheduler rings the rest when they come due."""
    if not txn.inline_rings:
        return
    # mark_rung's count and the read of the row in one statement: claimable, so counted, and read as counted
    rung = txn.all(f"{COUNT_RING} AND available_at <= ? AND silent = 0 AND {CLAIMABLE} RETURNING *",
                   (txn.now, todo_id, txn.now, txn.now))
    if rung:
        _ring_unless_withheld(txn, rung[0])


def mark_rung(txn: Txn, row: sqlite3.Row) -> dict | None:
    """Count a ring on the todo and queue it for the doorbell. A queue that is paused, or whose caps admit no more
    claims (or no more of the todo's subject key or repository), withholds it: counted on the todo (its re-ring
    sweep goes on) and sent to no one; the queue rings for what waits when it opens again (ring_claimable).
    None: withheld, or the todo is no longer pending."""
    if not txn.execute(COUNT_RING, (txn.now, row["id"])).rowcount:
        return None
    return _ring_unless_withheld(txn, row)


def _ring_unless_withheld(txn: Txn, row: sqlite3.Row) -> dict | None:
    """The ring of a todo counted as rung, unless its queue withholds it (mark_rung)."""
    if withholds(txn, row["endpoint_id"], row["queue"], row["subject_key"]):
        return None
    return _queue_ring(txn, row)


def ring_claimable(txn: Txn, endpoint_id: str, queue: str, most: int, group: str | None = None) -> int:
    """Ring for up to `most` of the queue's claimable todos, best first (as a claim takes them), leaving out those
    this transaction rang already and those a per-key limit holds back: a queue that opens again (resumed, its
    window turned, a slot freed) wakes one worker per todo it now admits. `group`: only the todos of that key
    group (a key that freed up). How many rang."""
    if not txn.inline_rings or most <= 0:
        return 0
    rung = {ring["todo_id"] for ring in txn.rings}
    row = control_row(txn, endpoint_id, queue)
    keyed, keyed_params = "", ()
    if row is not None and row["per_key"] is not None:
        if group is not None:
            keyed, keyed_params = in_groups(row["per_key"], [group])
            keyed = f" AND {keyed}"
        full = full_groups(txn, row)
        if full:
            held_back, held_params = in_groups(row["per_key"], full)
            keyed, keyed_params = f"{keyed} AND NOT {held_back}", (*keyed_params, *held_params)
    # A todo another transaction holds is being claimed (or changed) right now and needs no ring; waiting for it
    # here would wait on a claim that in turn waits for this transaction's count rows (a deadlock on Postgres).
    rows = txn.all(f"SELECT * FROM todos WHERE endpoint_id = ? AND state = 'pending' AND queue = ? AND available_at <= ?"
                   f" AND silent = 0 AND {CLAIMABLE}{keyed} ORDER BY priority DESC, created_at, id"
                   f" LIMIT ?{txn.skip_locked}", (endpoint_id, queue, txn.now, txn.now, *keyed_params, most + len(rung)))
    fresh = [row for row in rows if row["id"] not in rung][:most]
    return sum(mark_rung(txn, row) is not None for row in fresh)


def pending_among(txn: Txn, todo_ids: list[str]) -> set[str]:
    """Which of these todos are pending now."""
    marks = ",".join("?" * len(todo_ids))
    return {row["id"] for row in txn.all(f"SELECT id FROM todos WHERE id IN ({marks}) AND state = 'pending'",
                                         tuple(todo_ids))}


def _slot_freed(txn: Txn, todo: sqlite3.Row) -> None:
    """A claim ended (the todo left `claimed`): in a queue with a cap, the slot it held may admit the next
    claimable todo, which rings (unless this transition already rang for it). Under a per-key limit alone, the
    todo's subject key (or repository) has room again: its best waiting todo rings. Uncapped queues ring on their
    own."""
    left = ring_room(txn, todo["endpoint_id"], todo["queue"])
    if left:
        ring_claimable(txn, todo["endpoint_id"], todo["queue"], 1)
    elif left is None and todo["subject_key"] is not None:
        row = control_row(txn, todo["endpoint_id"], todo["queue"])
        group = key_group(row["per_key"], todo["subject_key"]) if row is not None and row["per_key"] else None
        if group is not None:
            ring_claimable(txn, todo["endpoint_id"], todo["queue"], 1, group)


def _queue_ring(txn: Txn, todo: sqlite3.Row | dict) -> dict:
    """The ring the doorbell sends after COMMIT."""
    ring = {"todo_id": todo["id"], "endpoint_id": todo["endpoint_id"], "queue": todo["queue"], "kind": todo["kind"],
            "source": todo["source"], "title": todo["title"]}
    txn.rings.append(ring)
    return ring


def end_attempt(txn: Txn, todo: sqlite3.Row, outcome: str, summary: str | None, artifact: str | None = None) -> None:
    """Close the open attempt. Anything but completion lets go of what the attempt absorbed (fail open)."""
    if txn.spans is not None:
        _process_span(txn, todo, outcome)
    txn.execute("UPDATE attempts SET ended_at = ?, outcome = ?, summary = ?, artifact = ?"
                " WHERE todo_id = ? AND ended_at IS NULL", (txn.now, outcome, summary, artifact, todo["id"]))
    if outcome != "completed" and not _known_none(todo, "absorbing"):
        let_go_of_absorbed(txn, todo["id"])


def _process_span(txn: Txn, todo: sqlite3.Row, outcome: str) -> None:
    """The attempt's `process` span, from its claim to now, under its todo's `send` span, with the ids the claim
    minted (read only when something exports)."""
    attempt = txn.one("SELECT seq, claimed_at, span_id FROM attempts WHERE todo_id = ? AND ended_at IS NULL",
                      (todo["id"],))
    context = parse_traceparent(todo["traceparent"])
    if attempt is None or attempt["span_id"] is None or context is None:
        return
    txn.spans.append(span_record(
        f"process {todo['queue']}", "consumer", context[0], attempt["span_id"], context[1], attempt["claimed_at"],
        txn.now, messaging_attributes(todo["id"], todo["queue"], todo["endpoint_id"], todo["subject_key"],
                                      attempt=attempt["seq"], outcome=outcome)))


def let_go_of_absorbed(txn: Txn, holder_id: str) -> None:
    held = txn.all("SELECT absorbed_id FROM absorptions WHERE holder_id = ?", (holder_id,))
    if not held:
        return
    txn.execute("DELETE FROM absorptions WHERE holder_id = ?", (holder_id,))
    txn.logs.append(f"todo {holder_id} let go of {len(held)} absorbed todos")
    for row in held:
        _became_pending(txn, row["absorbed_id"])


def write_receipt(txn: Txn, holder: sqlite3.Row, actor: str) -> None:
    """On the holder's outright success: one receipt naming the still-pending todos the server handed to this
    attempt, each closed as done/absorbed. If writing fails, they are simply let go (fail open)."""
    if _known_none(holder, "absorbing") or not txn.one("SELECT 1 FROM absorptions WHERE holder_id = ? LIMIT 1",
                                                        (holder["id"],)):
        return
    seq = txn.one("SELECT MAX(seq) FROM attempts WHERE todo_id = ?", (holder["id"],))[0]
    # Locked as they are read: a human's cancel, reroute or defer of one of them commits first, or waits.
    absorbed = [r["id"] for r in txn.all(
        "SELECT t.id FROM absorptions a JOIN todos t ON t.id = a.absorbed_id"
        " WHERE a.holder_id = ? AND a.holder_seq = ? AND t.state = 'pending' AND t.endpoint_id = ? AND t.queue = ?"
        f" AND t.subject_key = ? ORDER BY t.created_at, t.rowid{txn.for_update}",
        (holder["id"], seq, holder["endpoint_id"], holder["queue"], holder["subject_key"]))]
    if not absorbed:
        txn.execute("DELETE FROM absorptions WHERE holder_id = ?", (holder["id"],))
        return
    txn.execute("SAVEPOINT receipt")
    try:
        receipt_id = new_id("rc")
        txn.execute("INSERT INTO receipts (id, todo_id, attempt_seq, written_at) VALUES (?, ?, ?, ?)",
                    (receipt_id, holder["id"], seq, txn.now))
        for todo_id in absorbed:
            txn.execute("INSERT INTO receipt_items (todo_id, receipt_id) VALUES (?, ?)", (todo_id, receipt_id))
            transition(txn, reload_todo(txn, todo_id), "done", actor, {"absorbed_by": holder["id"], "receipt": receipt_id},
                        outcome="absorbed",
                        result=json.dumps({"absorbed_by": holder["id"], "receipt": receipt_id}))
        txn.execute("DELETE FROM absorptions WHERE holder_id = ?", (holder["id"],))
        txn.settle()  # what the receipt's writes met is raised here, inside its savepoint
        txn.execute("RELEASE receipt")
    except database_errors() as exc:
        txn.execute("ROLLBACK TO receipt")
        txn.execute("RELEASE receipt")
        log.error("receipt for %s not written (%s); its absorbed todos run as usual", holder["id"], exc)
        let_go_of_absorbed(txn, holder["id"])
        return
    txn.logs.append(f"receipt {receipt_id}: {holder['id']} absorbed {len(absorbed)} todos")


def absorb(txn: Txn, principal: Principal, todo_id: str, body: Leased) -> dict:
    """Fold the pending follow-ups about the same subject into the run this lease holds."""
    holder = _fenced(txn, principal, "absorb", todo_id, body.lease_token)
    seq = txn.one("SELECT seq FROM attempts WHERE todo_id = ? AND ended_at IS NULL", (todo_id,))["seq"]
    if holder["subject_key"] is not None:
        # Two runs about one subject absorb one after the other, and each follow-up it takes is held against a
        # claim (which skips it) until commit: where writers run side by side, a follow-up is absorbed once.
        txn.lock_key("absorb", holder["endpoint_id"], holder["queue"], holder["subject_key"])
        fresh = txn.all(
            f"SELECT id FROM todos WHERE endpoint_id = ? AND queue = ? AND subject_key = ? AND state = 'pending'"
            f" AND id <> ? AND created_at <= ? AND {CLAIMABLE}{txn.for_update}",
            (holder["endpoint_id"], holder["queue"], holder["subject_key"], todo_id, txn.now, txn.now))
        for row in fresh:
            txn.execute("INSERT INTO absorptions (absorbed_id, holder_id, holder_seq, absorbed_at) VALUES (?, ?, ?, ?)"
                        " ON CONFLICT (absorbed_id) DO UPDATE SET holder_id = excluded.holder_id,"
                        " holder_seq = excluded.holder_seq, absorbed_at = excluded.absorbed_at",
                        (row["id"], todo_id, seq, txn.now))
        if fresh:
            txn.logs.append(f"todo {todo_id} absorbed {len(fresh)} todos")
    rows = txn.all("SELECT t.* FROM absorptions a JOIN todo_rows t ON t.id = a.absorbed_id WHERE a.holder_id = ?"
                   " ORDER BY t.created_at, t.todo_rowid", (todo_id,))
    return {"absorbed": [todo_view(r) for r in rows]}


def expire_lease(txn: Txn, todo: sqlite3.Row) -> None:
    """A lapsed lease is a failed attempt (lease_expired), retried at once or dead-lettered at the cap."""
    end_attempt(txn, todo, "lease_expired", None)
    txn.counts["lease_expired"] += 1
    evidence = {"attempt": todo["attempt"], "outcome": "lease_expired"}
    if todo["attempt"] >= todo["max_attempts"]:
        transition(txn, todo, "failed", "system", evidence, dead_letter=1, last_error="lease_expired")
    else:
        transition(txn, todo, "pending", "system", evidence, last_error="lease_expired")


def _reap_endpoint(txn: Txn, endpoint_id: str) -> int:
    """Expire the endpoint's lapsed leases; how many there were. Each is locked as it is read, and one another
    transaction holds is left to it: claims racing after a restart all reap, and a lease expired twice would end
    its attempt twice and count the todo out of `claimed` twice."""
    lapsed = txn.all(f"SELECT * FROM todos WHERE endpoint_id = ? AND state = 'claimed' AND lease_expires_at <= ?"
                     f"{txn.skip_locked}", (endpoint_id, txn.now))
    for todo in lapsed:
        expire_lease(txn, todo)
    return len(lapsed)


# A todo's last five attempts, oldest first, as one JSON array (what attempt_view reads), for the claim's answer and
# its next `seq`; `t` is the todo.
_PRIOR_ATTEMPTS = ("SELECT json_group_array(json_object('seq', seq, 'claimant', claimant, 'claimed_at', claimed_at,"
                   " 'lease_expires_at', lease_expires_at, 'heartbeats', heartbeats, 'ended_at', ended_at,"
                   " 'outcome', outcome, 'summary', summary, 'artifact', artifact)) FROM (SELECT * FROM attempts"
                   " WHERE todo_id = t.id ORDER BY seq DESC LIMIT 5) AS recent")


def _prior_attempts(text: str | None) -> list[dict]:
    """_PRIOR_ATTEMPTS's array, oldest first (Postgres's aggregate of no rows is NULL)."""
    return sorted(json.loads(text or "[]"), key=lambda attempt: attempt["seq"])


def _claim_row(txn: Txn, principal: Principal, todo: sqlite3.Row, prior: list[dict], lease_seconds: int | None,
               claimant: str | None) -> dict:
    """Claim `todo`, a row of todo_rows whose last attempts are `prior`."""
    lease = lease_seconds or principal.default_lease_seconds or DEFAULT_LEASE_SECONDS
    lease_token = secrets.token_urlsafe(16)
    # `attempt` counts against the retry budget (a release refunds it, a human retry resets it);
    # `seq` numbers attempt rows for the todo's whole life.
    seq = prior[-1]["seq"] + 1 if prior else 1
    expires = txn.now + lease * 1000
    who = claimant or principal.actor
    # The attempt's `process` span: in its todo's trace, under its `send` span (a todo older than traces starts one).
    context = parse_traceparent(todo["traceparent"])
    span_id = new_span_id()
    written = transition(txn, todo, "claimed", principal.actor,
                          {"attempt": todo["attempt"] + 1, "seq": seq, "claimant": who},
                          attempt=todo["attempt"] + 1, lease_expires_at=expires,
                          lease_token_hash=token_hash(lease_token),
                          ring_acked_at=txn.now if todo["ring_count"] else None)
    txn.execute("INSERT INTO attempts (todo_id, seq, endpoint_id, claimant, claimed_at, lease_expires_at, lease_seconds,"
                " span_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (todo["id"], seq, principal.id, who, txn.now, expires, lease, span_id if context else None))
    return {"todo": todo_view(_as_written(todo, written)), "lease_token": lease_token,
            "prior_attempts": [attempt_view(a) for a in prior],
            "traceparent": traceparent(context[0] if context else new_trace_id(), span_id)}


def claim_queues(principal: Principal, wanted: list[str] | None) -> list[str]:
    if wanted is None:
        return list(principal.queues)
    outside = [q for q in wanted if q not in principal.queues]
    if outside:
        raise ApiError("forbidden", f"queue {outside[0]} is outside this endpoint's scope")
    return wanted


def claim_next(txn: Txn, principal: Principal, body: ClaimNow | ClaimNext, rung_for: str | None = None) -> dict:
    """Claim the best claimable todo of the caller's endpoint (see _claim_one). With `max_todos` above 1, up to
    that many in this one transaction, each claimed as a claim of its own would be (its own attempt and lease
    token; caps, per-key limits, pauses and dependencies read again for each), answered as `{"claims": [...]}`;
    the usual empty answer when none was claimable."""
    first = _claim_one(txn, principal, body, rung_for)
    most = getattr(body, "max_todos", 1)
    if most == 1 or "todo" not in first:
        return first
    claims = [first]
    while len(claims) < most and "todo" in (more := _claim_one(txn, principal, body)):
        claims.append(more)
    return {"claims": claims}


def _claim_one(txn: Txn, principal: Principal, body: ClaimNow, rung_for: str | None = None) -> dict:
    """Claim the best claimable todo of the caller's endpoint: highest priority, then oldest. Lapsed leases of the
    endpoint are expired first, so their todos count; one statement reads the best todo, its prior attempts and
    whether any lease has lapsed (then the claim reaps and reads again). A todo whose subject key (or repository)
    is at its queue's per-key limit is passed over. `rung_for`: the todo a waiting claim was rung for, taken
    first while it is claimable: rings go out best first, one per waiter, and where claims run side by side
    (Postgres) each waiter taking its own ring's todo keeps two of them from meeting on one."""
    principal.require_verb("claim_next")
    queues = claim_queues(principal, body.queue_filter())
    # Queue control first: a paused or full queue is left out of the pick (a lapsed lease frees its slot).
    gate = admit(txn, principal.id, queues)
    if any(r["reason"] == "max_in_flight" for r in gate.refused) and _reap_endpoint(txn, principal.id):
        gate = admit(txn, principal.id, queues)
    if not gate.open:
        return {"empty": True, **({"admission": gate.refused} if gate.refused else {})}
    marks = ",".join("?" * len(gate.open))
    # The key groups at a per-key limit, read once the queues are locked (admit): a claim racing for a key's last
    # slot waits for the other's commit and then reads its claim here.
    passed, passed_params, keyed = gate.passed_over(txn)

    def best(only: str = "") -> str:
        # One statement: the best todo, locked, with its columns as the lock found them; whether a lease of the
        # endpoint has lapsed; and what the claim's answer shows (its event's body, its last attempts).
        return (f"WITH picked AS (SELECT todos.*, todos.rowid AS todo_rowid, (SELECT 1 FROM todos WHERE endpoint_id"
                f" = ? AND state = 'claimed' AND lease_expires_at <= ? LIMIT 1) AS lapsed FROM todos"
                f" WHERE endpoint_id = ? AND state = 'pending' AND queue IN ({marks}) AND available_at <= ?"
                f" AND {CLAIMABLE}{' AND NOT ' + passed if passed else ''}{only}"
                f" ORDER BY priority DESC, created_at, rowid LIMIT 1{txn.skip_locked})"
                f" SELECT t.*, r.event_body, r.event_content_type, ({_PRIOR_ATTEMPTS}) AS prior_attempts"
                f" FROM picked t JOIN todo_rows r ON r.id = t.id")

    params = (principal.id, txn.now, principal.id, *gate.open, txn.now, txn.now, *passed_params)
    picked = txn.one(best(" AND id = ?"), (*params, rung_for)) if rung_for else None
    if picked is None:
        picked = txn.one(best(), params)
    if (picked is None or picked["lapsed"]) and _reap_endpoint(txn, principal.id):
        if keyed:  # a lapsed lease no longer holds its key
            passed, passed_params, keyed = gate.passed_over(txn)
            params = (principal.id, txn.now, principal.id, *gate.open, txn.now, txn.now, *passed_params)
        picked = txn.one(best(), params)
    row = picked
    if row is not None:
        txn.held.add(row["id"])  # the pick locked it (skip_locked)
        # Where writers run side by side, the pick judged the other tables as they were when it began: a run about
        # the same subject may have absorbed this todo before the lock was granted. The claim commits only if the
        # todo is still claimable now that it is held, else it runs again (and picks anew).
        txn.confirm_exists(f"SELECT 1 FROM todos WHERE id = ? AND state = 'pending' AND {CLAIMABLE}",
                           (row["id"], txn.now))
    else:
        refused = gate.refused + [{"queue": queue, "reason": "max_in_flight_per_key", "until": None}
                                  for queue in keyed if _passed_over_in(txn, principal.id, queue, passed, passed_params)]
        return {"empty": True, **({"admission": refused} if refused else {})}
    gate.count(txn, row["queue"])
    return _claim_row(txn, principal, row, _prior_attempts(row["prior_attempts"]), body.lease_seconds,
                      body.claimant)


def _passed_over_in(txn: Txn, endpoint_id: str, queue: str, passed: str, params: tuple) -> bool:
    """Whether a claim that came back empty passed over a claimable todo of `queue` for its per-key limit (its
    admission then says so)."""
    return txn.one(f"SELECT 1 FROM todos WHERE endpoint_id = ? AND state = 'pending' AND queue = ? AND available_at"
                   f" <= ? AND {CLAIMABLE} AND {passed} LIMIT 1", (endpoint_id, queue, txn.now, txn.now, *params)
                   ) is not None


def claim_todo(txn: Txn, principal: Principal, todo_id: str, body: ClaimById) -> dict:
    principal.require_verb("claim")
    todo = load_todo(txn, principal, todo_id, "todo_rows", for_update=True)
    if todo["queue"] not in principal.queues:
        raise ApiError("forbidden", f"queue {todo['queue']} is outside this endpoint's scope")
    if todo["state"] == "claimed" and todo["lease_expires_at"] <= txn.now:
        expire_lease(txn, todo)
        todo = reload_todo(txn, todo_id)
    if todo["state"] != "pending":
        raise ApiError("conflict", f"todo is {todo['state']}, not claimable")
    if todo["available_at"] > txn.now:
        raise ApiError("conflict", f"todo is not available until {iso(todo['available_at'])}")
    if txn.one(f"SELECT 1 FROM todos WHERE id = ? AND NOT ({CLAIMABLE})", (todo_id, txn.now)):
        raise ApiError("conflict", "todo waits for its dependencies or is held by a run that absorbed it")
    gate = admit(txn, principal.id, [todo["queue"]])
    if gate.refused:
        shut = gate.refused[0]
        raise ApiError("conflict", f"queue {shut['queue']} admits no claim now ({shut['reason'].replace('_', ' ')}"
                                   f"{' until ' + shut['until'] if shut['until'] else ''})")
    row = gate.rows.get(todo["queue"])
    group = key_group(row["per_key"], todo["subject_key"]) if row is not None and row["per_key"] else None
    if group is not None and group in full_groups(txn, row):
        raise ApiError("conflict", f"queue {todo['queue']} admits no claim now (max in flight per key: {group} has"
                                   f" {row['per_key_max']} claimed)")
    prior = _prior_attempts(txn.one(f"SELECT ({_PRIOR_ATTEMPTS}) FROM todos t WHERE t.id = ?", (todo_id,))[0])
    gate.count(txn, todo["queue"])
    return _claim_row(txn, principal, todo, prior, body.lease_seconds, body.claimant)


# The todo as the verbs that end an attempt read it (locked): todo_rows, and whether another todo awaits it (a
# dependency) and whether its run absorbed any (a receipt to write, or todos to let go), so that an attempt that
# ends with neither reads neither again.
FINISHING = ("(SELECT t.*, EXISTS (SELECT 1 FROM todo_deps WHERE depends_on_id = t.id) AS awaited,"
             " EXISTS (SELECT 1 FROM absorptions WHERE holder_id = t.id) AS absorbing FROM todo_rows t) AS todo_rows")


def _fenced(txn: Txn, principal: Principal, verb: str, todo_id: str, lease_token: str,
            source: str = "todos") -> sqlite3.Row:
    """Fencing: the todo must be claimed under this exact, unexpired lease token. Read from `source`."""
    principal.require_verb(verb)
    todo = load_todo(txn, principal, todo_id, source, for_update=True)
    if todo["state"] != "claimed" or not hashes_match(todo["lease_token_hash"], lease_token):
        raise ApiError("conflict", "lease token is stale or wrong for this todo")
    if todo["lease_expires_at"] <= txn.now:
        raise ApiError("conflict", "lease has expired")
    return todo


def heartbeat(txn: Txn, principal: Principal, todo_id: str, body: Heartbeat) -> dict:
    todo = _fenced(txn, principal, "heartbeat", todo_id, body.lease_token, "todo_rows")
    attempt = txn.one("SELECT * FROM attempts WHERE todo_id = ? AND ended_at IS NULL", (todo_id,))
    lease = body.lease_seconds or attempt["lease_seconds"]
    expires = txn.now + lease * 1000
    written = {"lease_expires_at": expires, "updated_at": txn.now}
    txn.execute("UPDATE todos SET lease_expires_at = ?, updated_at = ? WHERE id = ?", (*written.values(), todo_id))
    txn.execute("UPDATE attempts SET lease_expires_at = ?, heartbeats = heartbeats + 1, lease_seconds = ?,"
                " summary = COALESCE(?, summary) WHERE todo_id = ? AND seq = ?",
                (expires, lease, body.note, todo_id, attempt["seq"]))
    return todo_view(_as_written(todo, written))


def _truncate_utf8(text: str | None, limit: int) -> str | None:
    if text is None:
        return None
    return text.encode()[:limit].decode("utf-8", "ignore")


def _with_outputs(view: dict, made: list[dict], asked: list | None) -> dict:
    """A report's answer: the todo, and the outputs it made when it asked for any."""
    return {**view, "outputs": made} if asked else view


def complete(txn: Txn, principal: Principal, todo_id: str, body: Complete) -> dict:
    """Finish the held todo; with `claim_next`, claim the endpoint's next todo in the same transaction (a refused
    claim refuses the whole call), answered as `next`."""
    if body.claim_next is not None:
        principal.require_verb("claim_next")
        claim_queues(principal, body.claim_next.queue_filter())
    todo = _fenced(txn, principal, "complete", todo_id, body.lease_token, FINISHING)
    made = accept_outputs(txn, todo, body.outputs or [])
    result = dump_json(body.result, "result")
    if result is not None and len(result.encode()) > MAX_RESULT_BYTES:
        raise ApiError("too_large", f"result is over {MAX_RESULT_BYTES} bytes")
    summary = _truncate_utf8(body.summary, MAX_SUMMARY_BYTES)
    evidence = {"attempt": todo["attempt"], "summary": summary, "artifact": body.artifact}
    if todo["gated"]:
        if not summary:
            raise ApiError("invalid_argument", "summary: a gated todo needs a summary for its reviewer")
        end_attempt(txn, todo, "completed", summary, body.artifact)
        written = transition(txn, todo, "review", principal.actor, evidence, result=result, state_reason=summary)
    else:
        end_attempt(txn, todo, "completed", summary, body.artifact)
        written = transition(txn, todo, "done", principal.actor, evidence, result=result, outcome="completed")
        write_receipt(txn, todo, principal.actor)
    answer = _with_outputs(todo_view(_as_written(todo, written)), made, body.outputs)
    if body.claim_next is not None:
        answer["next"] = claim_next(txn, principal, body.claim_next)
        if "todo" in answer["next"]:  # a ring this completion queued for the todo it now hands out wakes no one
            txn.rings[:] = [ring for ring in txn.rings if ring["todo_id"] != answer["next"]["todo"]["id"]]
    return answer


def backoff_ms(attempt: int) -> int:
    return min(BACKOFF_BASE_SECONDS * 2 ** max(attempt - 1, 0), BACKOFF_CAP_SECONDS) * 1000


def fail(txn: Txn, principal: Principal, todo_id: str, body: Fail) -> dict:
    todo = _fenced(txn, principal, "fail", todo_id, body.lease_token, FINISHING)
    made = accept_outputs(txn, todo, body.outputs or [])
    end_attempt(txn, todo, "failed", _truncate_utf8(body.error, MAX_SUMMARY_BYTES))
    evidence = {"attempt": todo["attempt"], "error": body.error, "retry": body.retry}
    if body.retry and todo["attempt"] < todo["max_attempts"]:
        delay = body.retry_in_seconds * 1000 if body.retry_in_seconds is not None else backoff_ms(todo["attempt"])
        transition(txn, todo, "pending", principal.actor, evidence, last_error=body.error,
                   available_at=txn.now + delay)
        view = todo_view(reload_todo(txn, todo_id))  # a ring it got at once is counted on the row
    else:
        written = transition(txn, todo, "failed", principal.actor, evidence, last_error=body.error, dead_letter=1)
        view = todo_view(_as_written(todo, written))
    return _with_outputs(view, made, body.outputs)


def release(txn: Txn, principal: Principal, todo_id: str, body: Release) -> dict:
    """Hand the todo back untouched: pending at once, and the attempt does not count."""
    return _hand_back(txn, principal, _fenced(txn, principal, "release", todo_id, body.lease_token, FINISHING),
                      body.note)


def hand_back_unheard(txn: Txn, principal: Principal, todo_id: str, lease_token: str) -> dict:
    """A waiting claim whose asker left before hearing the answer: the claim is undone as a release."""
    todo = _fenced(txn, principal, "claim_next", todo_id, lease_token, FINISHING)
    return _hand_back(txn, principal, todo, "the waiting client went away before the answer")


def _hand_back(txn: Txn, principal: Principal, todo: sqlite3.Row, note: str | None) -> dict:
    end_attempt(txn, todo, "released", note)
    transition(txn, todo, "pending", principal.actor, {"attempt": todo["attempt"], "note": note},
                attempt=todo["attempt"] - 1)
    return todo_view(reload_todo(txn, todo["id"]))


def needs_input(txn: Txn, principal: Principal, todo_id: str, body: NeedsInput) -> dict:
    todo = _fenced(txn, principal, "needs_input", todo_id, body.lease_token, FINISHING)
    made = accept_outputs(txn, todo, body.outputs or [])
    end_attempt(txn, todo, "needs_input", body.question)
    transition(txn, todo, "needs_input", principal.actor, {"question": body.question},
                state_reason=body.question)
    return _with_outputs(todo_view(reload_todo(txn, todo_id)), made, body.outputs)


def block(txn: Txn, principal: Principal, todo_id: str, body: Block) -> dict:
    todo = _fenced(txn, principal, "block", todo_id, body.lease_token)
    made = accept_outputs(txn, todo, body.outputs or [])
    end_attempt(txn, todo, "blocked", body.reason)
    transition(txn, todo, "blocked", principal.actor, {"reason": body.reason}, state_reason=body.reason)
    return _with_outputs(todo_view(reload_todo(txn, todo_id)), made, body.outputs)


def post_outputs(txn: Txn, principal: Principal, todo_id: str, body: PostOutputs) -> dict:
    """Outputs while the work goes on, fenced like a heartbeat (the same verb, the same lease)."""
    todo = _fenced(txn, principal, "heartbeat", todo_id, body.lease_token)
    return {"outputs": accept_outputs(txn, todo, body.outputs)}
