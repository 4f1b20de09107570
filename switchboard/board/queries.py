"""The Board's sessions and what its pages read: transaction bodies, each confined by the human's principal."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from switchboard.configuration import VERB_PRESETS
from switchboard.crypto import new_token, token_hash
from switchboard.database import Txn
from switchboard.store.deliveries import get_event
from switchboard.store.principals import Principal, authenticate, list_endpoints
from switchboard.store.rules import get_rules
from switchboard.store.todos import _json, _scope_clause, get_todo
from switchboard.store.webhooks import get_webhook, list_routes, list_webhooks

# Server-rendered HTML for the human's half of the loop: what waits on them (held deliveries, reviews,
# questions, dead letters), the queues, one todo, a webhook's deliveries, rules with a dry run, endpoints.
# Sign-in trades a human token for a session (only its hash is stored); every state-changing form is a POST
# carrying the session's CSRF token from the Board's own origin, and answers 303 (post-redirect-get), so every
# page works without scripts. Every action calls the same store or flow function as REST, with the human's
# Principal. Templates autoescape, and producer text is never marked safe.

BOARD_DIR = Path(__file__).parent
BOARD_COOKIE = "switchboard_board"
BOARD_IDLE_MS = 12 * 3_600_000
BOARD_TOUCH_MS = 60_000  # a session's last use is written at most this often
BOARD_PAGE_SIZE = 25
BOARD_POLL_SECONDS = 2.0
BOARD_MCP_IDLE_SECONDS = 15 * 60
BOARD_FORM_BYTES = 1 << 20
BOARD_JSON_CHARS = 200_000
FORM_TYPE = "application/x-www-form-urlencoded"
BOARD_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; frame-ancestors 'none';"
                               " base-uri 'none'; form-action 'self'",
    "Referrer-Policy": "same-origin",
    "X-Content-Type-Options": "nosniff",
}
# What waits on the human, in the inbox's order: name, heading, and which todos belong.
INBOX_GROUPS: dict[str, tuple[str, str]] = {
    "held": ("Held", "state = 'quarantined' OR (state = 'pending' AND queue = 'hold')"),
    "review": ("Review", "state = 'review'"),
    "questions": ("Questions", "state = 'needs_input'"),
    "dead": ("Dead letters", "state = 'failed'"),
    "blocked": ("Blocked", "state = 'blocked'"),
    "deferred": ("Deferred", "state = 'deferred'"),
}
_INBOX_CASE = "CASE " + " ".join(f"WHEN {where} THEN '{name}'" for name, (_, where) in INBOX_GROUPS.items()) + " END"
_OPEN = "state NOT IN ('done', 'cancelled')"  # the todos_open index's own condition, so SQLite uses it
# Producer text keeps no bidirectional controls or lone surrogates on a page: they would make it read otherwise.
_BOARD_UNSAFE = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_BOARD_BACK = re.compile(r"^/board(?:/[A-Za-z0-9_.~/-]*)?(?:\?[A-Za-z0-9_.~=&%:-]*)?$")
EVENT_DISPOSITIONS = ("routed", "dropped", "repeat", "quarantined", "ping")


@dataclass(frozen=True)
class BoardSession:
    """A signed-in browser: the stored hash of its session token, the human, and the form token."""
    key: str
    principal: Principal
    csrf: str
    last_seen_at: int


class BoardRefusal(Exception):
    """A state-changing form refused before it ran (no CSRF token, another origin): 403, nothing changed."""


# -- sessions (transaction bodies) ----------------------------------------------------------------------

def board_sign_in(txn: Txn, token: str) -> str | None:
    """A new session for a human token, or None. Expired sessions are swept here."""
    principal = authenticate(txn, token) if token.startswith("sbh_") else None
    if principal is None:
        return None
    txn.execute("DELETE FROM board_sessions WHERE expires_at <= ?", (txn.now,))
    session = new_token("sbs")
    txn.execute("INSERT INTO board_sessions (id, human_id, csrf, created_at, last_seen_at, expires_at)"
                " VALUES (?, ?, ?, ?, ?, ?)", (token_hash(session), principal.id, secrets.token_urlsafe(32), txn.now,
                                               txn.now, txn.now + BOARD_IDLE_MS))
    txn.logs.append(f"board session opened for {principal.id}")
    return session


def board_session(txn: Txn, key: str) -> BoardSession | None:
    row = txn.one("SELECT s.*, h.name FROM board_sessions s JOIN humans h ON h.id = s.human_id"
                  " WHERE s.id = ? AND s.expires_at > ?", (key, txn.now))
    if row is None:
        return None
    principal = Principal(kind="human", id=row["human_id"], human_id=row["human_id"], name=row["name"])
    return BoardSession(row["id"], principal, row["csrf"], row["last_seen_at"])


def board_touch(txn: Txn, key: str) -> None:
    txn.execute("UPDATE board_sessions SET last_seen_at = ?, expires_at = ? WHERE id = ? AND expires_at > ?",
                (txn.now, txn.now + BOARD_IDLE_MS, key, txn.now))


def board_sign_out(txn: Txn, key: str) -> None:
    if txn.execute("DELETE FROM board_sessions WHERE id = ?", (key,)).rowcount:
        txn.logs.append("board session closed")


# -- what the pages read (transaction bodies, each confined by the human's principal) ---------------------

def board_counts(txn: Txn, principal: Principal) -> dict:
    """How many todos wait in each inbox group, and a digest of every open count, which changes whenever
    anything on the inbox or the queues page would."""
    clause, params = _scope_clause(principal)
    counts = {name: 0 for name in INBOX_GROUPS}
    for row in txn.all(f"SELECT {_INBOX_CASE} AS grp, count(*) AS n FROM todos WHERE {clause} AND {_OPEN}"
                       f" AND state IN ('quarantined', 'pending', 'review', 'needs_input', 'failed', 'blocked',"
                       f" 'deferred') GROUP BY grp", params):
        if row["grp"]:
            counts[row["grp"]] = row["n"]
    open_rows = [tuple(r) for r in txn.all(f"SELECT endpoint_id, queue, state, count(*), max(created_at) FROM todos"
                                           f" WHERE {clause} AND {_OPEN} GROUP BY endpoint_id, queue, state", params)]
    claims = txn.one(f"SELECT count(*), max(updated_at) FROM todos WHERE {clause} AND state = 'claimed'", params)
    digest = hashlib.sha256(json.dumps([counts, open_rows, tuple(claims)]).encode()).hexdigest()[:16]
    return {"counts": counts, "total": sum(counts.values()), "digest": digest}


def _todo_rows(txn: Txn, principal: Principal, where: str, params: tuple, after: tuple[int, str] | None,
               limit: int, newest_first: bool = False) -> list[sqlite3.Row]:
    clause, scope = _scope_clause(principal)
    order = "DESC" if newest_first else "ASC"
    sql = (f"SELECT id, endpoint_id, queue, state, title, source, kind, state_reason, trace, created_at, updated_at,"
           f" attempt, max_attempts, last_error, lease_expires_at FROM todos WHERE {clause} AND {_OPEN} AND ({where})")
    args = [*scope, *params]
    if after is not None:
        sql += f" AND (created_at, id) {'<' if newest_first else '>'} (?, ?)"
        args += list(after)
    return txn.all(sql + f" ORDER BY created_at {order}, id {order} LIMIT ?", (*args, limit))


def _inbox_item(row: sqlite3.Row) -> dict:
    trace = _json(row["trace"]) or {}
    return {"id": row["id"], "endpoint_id": row["endpoint_id"], "queue": row["queue"], "state": row["state"],
            "title": row["title"], "source": row["source"], "kind": row["kind"], "state_reason": row["state_reason"],
            "created_at": row["created_at"], "updated_at": row["updated_at"], "attempt": row["attempt"],
            "max_attempts": row["max_attempts"], "last_error": row["last_error"],
            "stage": trace.get("stage"), "rule": trace.get("rule_name") or trace.get("rule_id"),
            "cause": trace.get("cause"), "hold": trace.get("hold")}


def board_inbox(txn: Txn, principal: Principal, group: str | None, after: tuple[int, str] | None) -> dict:
    """Every group's oldest items (or one group, a page at a time), oldest first."""
    names = [group] if group else list(INBOX_GROUPS)
    limit = BOARD_PAGE_SIZE if group else 10
    groups = []
    for name in names:
        rows = _todo_rows(txn, principal, INBOX_GROUPS[name][1], (), after if group else None, limit + 1)
        items = [_inbox_item(r) for r in rows[:limit]]
        groups.append({"name": name, "title": INBOX_GROUPS[name][0], "items": items,
                       "more": f"{items[-1]['created_at']}.{items[-1]['id']}" if len(rows) > limit else None})
    return {"groups": groups, "queues": _human_queues(txn, principal)}


def _human_queues(txn: Txn, principal: Principal) -> list[str]:
    queues: set[str] = set()
    for endpoint in list_endpoints(txn, principal)["endpoints"]:
        if endpoint["revoked_at"] is None:
            queues.update(endpoint["queues"])
    return sorted(queues)


def board_queues(txn: Txn, principal: Principal, after: tuple[int, str] | None) -> dict:
    """Per endpoint and queue: open counts by state and the age of the oldest pending todo; the running work
    with its claimant, lease and latest heartbeat note."""
    clause, params = _scope_clause(principal)
    endpoints = {e["id"]: {**e, "queues": {q: {"counts": {}, "oldest_pending": None} for q in e["queues"]}}
                 for e in list_endpoints(txn, principal)["endpoints"]}
    for row in txn.all(f"SELECT endpoint_id, queue, state, count(*) AS n, min(created_at) AS oldest FROM todos"
                       f" WHERE {clause} AND {_OPEN} GROUP BY endpoint_id, queue, state", params):
        queue = endpoints[row["endpoint_id"]]["queues"].setdefault(row["queue"], {"counts": {}, "oldest_pending": None})
        queue["counts"][row["state"]] = row["n"]
        if row["state"] == "pending":
            queue["oldest_pending"] = row["oldest"]
    sql = (f"SELECT t.id, t.title, t.queue, t.endpoint_id, t.lease_expires_at, t.created_at, a.claimant, a.claimed_at,"
           f" a.summary, a.heartbeats, a.seq FROM todos t JOIN attempts a ON a.todo_id = t.id AND a.ended_at IS NULL"
           f" WHERE t.state = 'claimed' AND t.{clause}")
    args = list(params)
    if after is not None:
        sql += " AND (t.created_at, t.id) > (?, ?)"
        args += list(after)
    running = [dict(r) for r in txn.all(sql + " ORDER BY t.created_at, t.id LIMIT ?", (*args, BOARD_PAGE_SIZE + 1))]
    more = running[BOARD_PAGE_SIZE - 1] if len(running) > BOARD_PAGE_SIZE else None
    return {"endpoints": list(endpoints.values()), "running": running[:BOARD_PAGE_SIZE],
            "more": f"{more['created_at']}.{more['id']}" if more else None}


def board_todo(txn: Txn, principal: Principal, todo_id: str) -> dict:
    """get_todo as REST answers it, plus one timeline of history and attempts, and the queues to offer."""
    todo = get_todo(txn, principal, todo_id)
    timeline = [{"at": h["at"], "kind": "history", **h} for h in todo["history"]]
    for attempt in todo["attempts"]:
        timeline.append({"at": attempt["claimed_at"], "kind": "claimed", **attempt})
        if attempt["ended_at"]:
            timeline.append({"at": attempt["ended_at"], "kind": "ended", **attempt})
    timeline.sort(key=lambda entry: (entry["at"] or "", entry["kind"] != "history"))
    return {"todo": todo, "timeline": timeline, "queues": _human_queues(txn, principal)}


def _webhook_summary(txn: Txn, webhook: dict) -> dict:
    last = txn.one("SELECT id, kind, verified, disposition, received_at FROM events WHERE webhook_id = ?"
                   " ORDER BY received_at DESC, id DESC LIMIT 1", (webhook["id"],))
    return {**webhook, "last_event": dict(last) if last else None}


def board_webhooks(txn: Txn, principal: Principal) -> dict:
    return {"webhooks": [_webhook_summary(txn, w) for w in list_webhooks(txn, principal)["webhooks"]],
            "endpoints": list_endpoints(txn, principal)["endpoints"]}


def board_webhook(txn: Txn, principal: Principal, webhook_id: str) -> dict:
    webhook = _webhook_summary(txn, get_webhook(txn, principal, webhook_id))
    recent = [dict(r) for r in txn.all(
        "SELECT id, kind, disposition, verified, received_at FROM events WHERE webhook_id = ? AND envelope IS NOT NULL"
        " ORDER BY received_at DESC, id DESC LIMIT 20", (webhook_id,))]
    return {"webhook": webhook, "rules": get_rules(txn, principal, webhook_id),
            "routes": list_routes(txn, principal, webhook_id)["routes"], "recent": recent,
            "endpoints": list_endpoints(txn, principal)["endpoints"]}


def board_deliveries(txn: Txn, principal: Principal, webhook_id: str, disposition: str | None, kind: str | None,
                     before: tuple[int, str] | None) -> dict:
    """A webhook's deliveries, newest first, a page at a time (what list_events shows, filterable by kind)."""
    webhook = get_webhook(txn, principal, webhook_id)
    sql, args = ("SELECT id, kind, disposition, verified, trust_mode, delivery_key, received_at, outcome FROM events"
                 " WHERE webhook_id = ?", [webhook_id])
    for column, value in (("disposition", disposition), ("kind", kind)):
        if value:
            sql += f" AND {column} = ?"
            args.append(value)
    if before is not None:
        sql += " AND (received_at, id) < (?, ?)"
        args += list(before)
    rows = txn.all(sql + " ORDER BY received_at DESC, id DESC LIMIT ?", (*args, BOARD_PAGE_SIZE + 1))
    events = [{**dict(r), "outcome": _json(r["outcome"]) or {}} for r in rows[:BOARD_PAGE_SIZE]]
    more = events[-1] if len(rows) > BOARD_PAGE_SIZE else None
    return {"webhook": webhook, "events": events, "more": f"{more['received_at']}.{more['id']}" if more else None}


def board_delivery(txn: Txn, principal: Principal, event_id: str) -> dict:
    event = get_event(txn, principal, event_id)
    clause, params = _scope_clause(principal)
    todos = [dict(r) for r in txn.all(f"SELECT id, title, state, queue, endpoint_id FROM todos WHERE event_id = ?"
                                      f" AND {clause} ORDER BY created_at, id", (event_id, *params))]
    return {"event": event, "todos": todos}


def board_endpoints(txn: Txn, principal: Principal) -> dict:
    clause, params = _scope_clause(principal)
    open_counts = {r["endpoint_id"]: r["n"] for r in txn.all(
        f"SELECT endpoint_id, count(*) AS n FROM todos WHERE {clause} AND {_OPEN} AND state NOT IN ('failed',"
        f" 'quarantined') GROUP BY endpoint_id", params)}
    endpoints = [{**e, "open": open_counts.get(e["id"], 0)} for e in list_endpoints(txn, principal)["endpoints"]]
    return {"endpoints": endpoints, "presets": list(VERB_PRESETS)}
