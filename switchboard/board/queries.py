"""The Board's sessions and what its pages read: transaction bodies, each confined by the human's principal."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from switchboard.configuration import BULK_MAX, HOLD_QUEUE, RESERVED_QUEUES, TERMINAL_STATES, VERB_PRESETS
from switchboard.crypto import new_token, token_hash
from switchboard.database import Txn
from switchboard.envelope import stored_envelope, untrusted_names
from switchboard.payload import stored_payload, value_at
from switchboard.providers import PROVIDER_TABLE
from switchboard.store.connections import list_connections
from switchboard.store.deliveries import EVENT_WITH_BODY, get_event
from switchboard.store.human_actions import ACTION_STATES
from switchboard.store.principals import (
    Principal,
    authenticate,
    find_human_by_login,
    human_view,
    list_endpoints,
    reissue_own_token,
)
from switchboard.store.queues import queue_views
from switchboard.store.rules import get_rules
from switchboard.store.todos import (
    Selection,
    count_selection,
    get_todo,
    grouped_page,
    scope_clause,
    select_page,
    stored_json,
    todo_groups,
)
from switchboard.store.webhooks import get_webhook, list_routes, list_webhooks, webhook_targets

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
BOARD_MCP_IDLE_SECONDS = 15 * 60
BOARD_RECENT_MS = BOARD_MCP_IDLE_SECONDS * 1000  # a worker that finished work this recently is named on its queue
BOARD_RECENT_TODOS = 200  # ... read from at most this many of the latest finished todos
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
# The one state each inbox group is, where it is one (held is two: held deliveries and work on the hold queue), so
# that a bulk action may take "all of them" as a filter; and the states each group's bulk form acts on.
INBOX_STATES = {"review": "review", "questions": "needs_input", "dead": "failed", "blocked": "blocked",
                "deferred": "deferred"}
INBOX_GROUP_STATES = {"held": ("quarantined", "pending"), **{name: (state,) for name, state in INBOX_STATES.items()}}
# The bulk actions in the order a form offers them: the one a list of these states most likely wants first (a dead
# letter's retry, a review's approval, a held delivery's discard), the ones that apply to any open work after.
BULK_PREFERENCE = ("retry", "approve", "discard", "cancel", "reroute", "defer")
_INBOX_CASE = "CASE " + " ".join(f"WHEN {where} THEN '{name}'" for name, (_, where) in INBOX_GROUPS.items()) + " END"
_OPEN = "state NOT IN ('done', 'cancelled')"  # open work: what the inbox and the queues page show
# Producer text keeps no bidirectional controls or lone surrogates on a page: they would make it read otherwise.
BOARD_UNSAFE = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
# A Board path a form may send the browser back to; a subject's page has its key quoted in it (`%23`, `:`).
BOARD_BACK = re.compile(r"^/board(?:/[A-Za-z0-9_.~/%:-]*)?(?:\?[A-Za-z0-9_.~=&%:-]*)?$")
EVENT_DISPOSITIONS = ("routed", "dropped", "repeat", "quarantined", "ping")
# A delivery's line on a page (`issues.opened · org/repo#41 · Spelling error…`) reads its body for what the
# stored envelope does not keep (a pull request's action and title) only up to this size.
SUMMARY_BODY_BYTES = 256 << 10
SUMMARY_TITLE_CHARS = 60
SUMMARY_CHARS = 140  # a completion's summary in a list's column (the todo's page has all of it)


@dataclass(frozen=True)
class BoardSession:
    """A signed-in browser: the stored hash of its session token, the human (and the login an identity proxy
    names them by), and the form token."""
    key: str
    principal: Principal
    csrf: str
    last_seen_at: int
    login: str | None = None


class BoardRefusal(Exception):
    """A state-changing form refused before it ran (no CSRF token, another origin): 403, nothing changed."""


# -- sessions (transaction bodies) ----------------------------------------------------------------------

def _open_session(txn: Txn, human_id: str, how: str) -> str:
    """A new session for the human: its token for the cookie (only the hash is kept). Expired sessions are swept
    here."""
    txn.execute("DELETE FROM board_sessions WHERE expires_at <= ?", (txn.now,))
    session = new_token("sbs")
    txn.execute("INSERT INTO board_sessions (id, human_id, csrf, created_at, last_seen_at, expires_at)"
                " VALUES (?, ?, ?, ?, ?, ?)", (token_hash(session), human_id, secrets.token_urlsafe(32), txn.now,
                                               txn.now, txn.now + BOARD_IDLE_MS))
    txn.logs.append(f"board session opened for {human_id} ({how})")
    return session


def board_sign_in(txn: Txn, token: str) -> str | None:
    """A new session for a human token, or None."""
    principal = authenticate(txn, token) if token.startswith("sbh_") else None
    if principal is None:
        return None
    return _open_session(txn, principal.id, "token")


def board_login_holder(txn: Txn, login: str) -> str | None:
    """The id of the human an identity proxy names by `login`, or None (read first, so that a login nobody has
    never costs a write)."""
    human = find_human_by_login(txn, login)
    return human["id"] if human is not None else None


def board_proxy_sign_in(txn: Txn, human_id: str, replaced: str | None) -> str:
    """A new session for the human an identity proxy named. `replaced`, the session the browser held for someone
    else, ends: the proxy says who is at the keyboard now."""
    if replaced is not None:
        board_sign_out(txn, replaced)
    return _open_session(txn, human_id, "identity proxy")


def board_reissue_token(txn: Txn, principal: Principal) -> tuple[dict, str]:
    """The signed-in human's new token (reissue_own_token: the old one and all its sessions end), and a fresh
    session for the browser that asked, so that it stays signed in to show the token once."""
    made = reissue_own_token(txn, principal)
    return made, _open_session(txn, principal.id, "new token")


def board_session(txn: Txn, key: str) -> BoardSession | None:
    row = txn.one("SELECT s.*, h.name, h.login FROM board_sessions s JOIN humans h ON h.id = s.human_id"
                  " WHERE s.id = ? AND s.expires_at > ?", (key, txn.now))
    if row is None:
        return None
    principal = Principal(kind="human", id=row["human_id"], human_id=row["human_id"], name=row["name"])
    return BoardSession(row["id"], principal, row["csrf"], row["last_seen_at"], row["login"])


def board_touch(txn: Txn, key: str) -> None:
    txn.execute("UPDATE board_sessions SET last_seen_at = ?, expires_at = ? WHERE id = ? AND expires_at > ?",
                (txn.now, txn.now + BOARD_IDLE_MS, key, txn.now))


def board_sign_out(txn: Txn, key: str) -> None:
    if txn.execute("DELETE FROM board_sessions WHERE id = ?", (key,)).rowcount:
        txn.logs.append("board session closed")


# -- what the pages read (transaction bodies, each confined by the human's principal) ---------------------

def board_account(txn: Txn, principal: Principal) -> dict:
    """The signed-in human as the account page shows them (no token: only its first characters)."""
    return {"human": human_view(txn.one("SELECT * FROM humans WHERE id = ?", (principal.id,)))}


def board_counts(txn: Txn, principal: Principal) -> dict:
    """How many todos wait in each inbox group, and a digest of every open count, which changes whenever
    anything on the inbox or the queues page would. The counts are todo_counts' (kept by triggers with every
    change, each group's `changes` moving whenever a todo enters or leaves it): a few rows, whatever the todos
    number. The running work (few) is read for its heartbeats."""
    clause, params = scope_clause(principal)
    counts = {name: 0 for name in INBOX_GROUPS}
    open_rows = [tuple(r) for r in txn.all(f"SELECT endpoint_id, queue, state, n, changes, {_INBOX_CASE} AS grp"
                                           f" FROM todo_counts WHERE {clause} AND {_OPEN}"
                                           f" ORDER BY endpoint_id, queue, state", params)]
    for *_, n, _changes, group in open_rows:
        if group:
            counts[group] += n
    # INDEXED BY: the claimed todos are few, and this read must fail rather than ever count every todo.
    claims = txn.one(f"SELECT count(*), max(updated_at) FROM todos INDEXED BY todos_lapsed_by_endpoint"
                     f" WHERE {clause} AND state = 'claimed'", params)
    digest = hashlib.sha256(json.dumps([counts, open_rows, tuple(claims)]).encode()).hexdigest()[:16]
    return {"counts": counts, "total": sum(counts.values()), "digest": digest}


def board_live(txn: Txn, principals: list[Principal]) -> dict[str, tuple[dict, dict[str, int]]]:
    """What the live view reads after a change, for each human with a stream open: their counts
    (board_counts) and their sessions still open, each with when it ends (a stream whose session is not among
    them ends)."""
    return {p.id: (board_counts(txn, p), {r["id"]: r["expires_at"] for r in txn.all(
        "SELECT id, expires_at FROM board_sessions WHERE human_id = ? AND expires_at > ?", (p.human_id, txn.now))})
        for p in principals}


def board_names(txn: Txn, principal: Principal) -> dict[str, str]:
    """The names a page shows instead of ids: the human's own and their endpoints' (revoked ones too)."""
    names = {principal.id: principal.name} if principal.kind == "human" and principal.name else {}
    names.update((r["id"], r["name"]) for r in txn.all("SELECT id, name FROM endpoints WHERE human_id = ?",
                                                        (principal.human_id,)))
    return names


def _todo_rows(txn: Txn, principal: Principal, where: str, params: tuple, after: tuple[int, str] | None,
               limit: int, newest_first: bool = False) -> list[sqlite3.Row]:
    """The first `limit` open todos meeting `where` (a condition on the state and the queue), a group at a time
    (todos.grouped_page): a page costs the same however many todos the groups hold."""
    return grouped_page(txn, todo_groups(txn, principal, f"{_OPEN} AND ({where})", params),
                        "id, endpoint_id, queue, state, title, source, kind, state_reason, trace, created_at,"
                        " updated_at, attempt, max_attempts, last_error, lease_expires_at, event_id, subject_key,"
                        " (SELECT webhook_id FROM events WHERE events.id = todos.event_id) AS webhook_id",
                        limit, newest_first=newest_first, after=after)


def _inbox_item(row: sqlite3.Row) -> dict:
    trace = stored_json(row["trace"]) or {}
    return {"id": row["id"], "endpoint_id": row["endpoint_id"], "queue": row["queue"], "state": row["state"],
            "title": row["title"], "source": row["source"], "kind": row["kind"], "state_reason": row["state_reason"],
            "created_at": row["created_at"], "updated_at": row["updated_at"], "attempt": row["attempt"],
            "max_attempts": row["max_attempts"], "last_error": row["last_error"], "event_id": row["event_id"],
            "webhook_id": row["webhook_id"], "trace": trace, "subject_key": row["subject_key"],
            "stage": trace.get("stage"), "rule": trace.get("rule_name") or trace.get("rule_id"),
            "cause": trace.get("cause"), "hold": trace.get("hold"), "detail": trace.get("payload_detail")}


def _queue_choices(txn: Txn, principal: Principal, todo: dict, cache: dict) -> list[str]:
    """The queues a todo's Release, Send or Reroute list offers: only those that can take it. Releasing a held
    delivery goes to one of its webhook's live targets; a reroute goes to a target of the same human (to the
    human's own live endpoints for work that has no webhook). Never `quarantine`; a reroute never to `hold`."""
    release = todo["state"] == "quarantined"
    key = (todo.get("webhook_id"), release)
    if key not in cache:
        webhook = txn.one("SELECT * FROM webhooks WHERE id = ?", (key[0],)) if key[0] else None
        if webhook is not None:
            targets = [t for t in webhook_targets(txn, webhook) if release or t["human_id"] == principal.human_id]
        elif release:
            targets = []  # its webhook is gone: the delivery can only be discarded
        else:
            targets = txn.all("SELECT * FROM endpoints WHERE human_id = ? AND revoked_at IS NULL",
                              (principal.human_id,))
        queues = {q for t in targets for q in json.loads(t["queues"])} - RESERVED_QUEUES
        cache[key] = sorted(queues if release else queues - {HOLD_QUEUE})
    return cache[key]


def _trust_names(txn: Txn, todo: dict) -> list[str]:
    """Whom "trust and release" adds for a delivery the trust gate held: named in its trace (the gate records
    them); for one held before it did, worked out from the stored delivery."""
    if todo["state"] != "quarantined" or todo["state_reason"] != "untrusted_actor":
        return []
    trace = todo.get("trace") or {}
    if "untrusted" in trace:
        return list(trace["untrusted"])
    event = txn.one(f"{EVENT_WITH_BODY} WHERE e.id = ?", (todo["event_id"],)) if todo.get("event_id") else None
    webhook = txn.one("SELECT trusted_actors FROM webhooks WHERE id = ?", (event["webhook_id"],)) if event else None
    if webhook is None or event["envelope"] is None:
        return []
    return untrusted_names(stored_envelope(event["envelope"], event["headers"], event["body"]),
                           stored_json(webhook["trusted_actors"]))


def with_choices(txn: Txn, principal: Principal, todo: dict, cache: dict) -> dict:
    """A todo with what its actions offer: the queues it may go to, and whom trusting would add."""
    return {**todo, "choices": _queue_choices(txn, principal, todo, cache), "trust_names": _trust_names(txn, todo)}


def board_inbox(txn: Txn, principal: Principal, group: str | None, after: tuple[int, str] | None) -> dict:
    """Every group's oldest items (or one group, a page at a time), oldest first, each with the queues its
    actions may name."""
    names = [group] if group else list(INBOX_GROUPS)
    limit = BOARD_PAGE_SIZE if group else 10
    groups, cache = [], {}
    for name in names:
        rows = _todo_rows(txn, principal, INBOX_GROUPS[name][1], (), after if group else None, limit + 1)
        items = [with_choices(txn, principal, _inbox_item(r), cache) for r in rows[:limit]]
        groups.append({"name": name, "title": INBOX_GROUPS[name][0], "items": items,
                       "more": f"{items[-1]['created_at']}.{items[-1]['id']}" if len(rows) > limit else None})
    return {"groups": groups, **bulk_choices(txn, principal)}


def _queue_of(endpoint: dict, name: str) -> dict:
    """A queue's line on the queues page (made the first time it is named)."""
    return endpoint["queues"].setdefault(name, {"counts": {}, "oldest_pending": None, "working": [], "recent": []})


def board_queues(txn: Txn, principal: Principal, after: tuple[int, str] | None) -> dict:
    """Per endpoint and queue: open counts by state, the age of the oldest pending todo, how many were done in the
    last hour and day, and the workers the store knows of (those holding a live lease on it, and those that
    finished its work in the last BOARD_RECENT_MS); the running work with its claimant, lease and latest heartbeat
    note. (The sessions listening now are the doorbell's, in memory: the page adds them.)"""
    clause, params = scope_clause(principal)
    endpoints = {}
    for e in list_endpoints(txn, principal)["endpoints"]:
        endpoints[e["id"]] = {**e, "queues": {}, "control": queue_views(txn, e["id"], e["queues"])}
        for name in e["queues"]:
            _queue_of(endpoints[e["id"]], name)
    # The counts are todo_counts' (a few rows); the oldest pending todo of a queue is the first of its range.
    for row in txn.all(f"SELECT endpoint_id, queue, state, n FROM todo_counts WHERE {clause} AND {_OPEN} AND n > 0",
                       params):
        queue = _queue_of(endpoints[row["endpoint_id"]], row["queue"])
        queue["counts"][row["state"]] = row["n"]
        if row["state"] == "pending":
            queue["oldest_pending"] = txn.one("SELECT min(created_at) FROM todos WHERE endpoint_id = ?"
                                              " AND state = 'pending' AND queue = ?", (row["endpoint_id"], row["queue"]))[0]
    # The page's todos are picked from the todos alone, then joined to their open attempts: the sort of every
    # claimed todo (as many as the workers hold) carries two columns, and only the page's attempts are read.
    page = f"SELECT id FROM todos WHERE state = 'claimed' AND {clause}"
    args = list(params)
    if after is not None:
        page += " AND (created_at, id) > (?, ?)"
        args += list(after)
    sql = (f"SELECT t.id, t.title, t.queue, t.endpoint_id, t.lease_expires_at, t.created_at, t.subject_key, a.claimant,"
           f" a.claimed_at,"
           f" a.summary, a.heartbeats, a.seq FROM ({page} ORDER BY created_at, id LIMIT ?) p JOIN todos t ON t.id = p.id"
           f" JOIN attempts a ON a.todo_id = t.id AND a.ended_at IS NULL ORDER BY t.created_at, t.id")
    running = [dict(r) for r in txn.all(sql, (*args, BOARD_PAGE_SIZE + 1))]
    more = running[BOARD_PAGE_SIZE - 1] if len(running) > BOARD_PAGE_SIZE else None
    for endpoint_id, working in _working(txn, clause, params).items():
        endpoints[endpoint_id]["working"] = working
        for claimant in working:
            for queue, jobs in claimant["jobs_by_queue"].items():
                _queue_of(endpoints[endpoint_id], queue)["working"].append({"claimant": claimant["claimant"],
                                                                            "jobs": jobs})
    for row in _recent_finishers(txn, clause, params):
        if row["endpoint_id"] not in endpoints:
            continue
        queue = _queue_of(endpoints[row["endpoint_id"]], row["queue"])
        if all(w["claimant"] != row["claimant"] for w in queue["working"] + queue["recent"]):
            queue["recent"].append({"claimant": row["claimant"], "at": row["ended_at"]})
    # Done in the last hour and day: todo_done_minutes' few rows a queue, not the day's finished todos.
    minute = txn.now // 60_000
    for row in txn.all(f"SELECT endpoint_id, queue, sum(CASE WHEN minute > ? THEN n ELSE 0 END) AS hour, sum(n) AS day"
                       f" FROM todo_done_minutes WHERE {clause} AND minute > ? GROUP BY endpoint_id, queue",
                       (minute - 60, *params, minute - 1440)):
        if row["endpoint_id"] in endpoints:
            _queue_of(endpoints[row["endpoint_id"]], row["queue"])["done"] = {"hour": row["hour"], "day": row["day"]}
    running_total = sum(q["counts"].get("claimed", 0) for e in endpoints.values() for q in e["queues"].values())
    return {"endpoints": list(endpoints.values()), "running": running[:BOARD_PAGE_SIZE], "running_total": running_total,
            "more": f"{more['created_at']}.{more['id']}" if more else None, **bulk_choices(txn, principal)}


def board_todos(txn: Txn, principal: Principal, selection: Selection, after: tuple[int, str] | None) -> dict:
    """The todo list in every state, newest first, a page at a time (select_page), each with its completion's
    summary (the latest completed attempt's, on one line and cut to SUMMARY_CHARS); how many match the filter
    (None when only a title scan could say), and the queues a bulk reroute may name."""
    page, more = select_page(txn, principal, selection, BOARD_PAGE_SIZE, after)
    rows = txn.all(f"SELECT id, endpoint_id, queue, state, outcome, title, source, kind, subject_key, attempt,"
                   f" max_attempts, dead_letter, created_at, updated_at, (SELECT a.summary FROM attempts a WHERE"
                   f" a.todo_id = todos.id AND a.outcome = 'completed' ORDER BY a.seq DESC LIMIT 1) AS summary"
                   f" FROM todos WHERE id IN ({', '.join('?' * len(page))}) ORDER BY created_at DESC, id DESC",
                   page) if page else []
    todos = [{**r, "summary": _one_line(r["summary"]), "summary_cut": _one_line(r["summary"], SUMMARY_CHARS)}
             for r in map(dict, rows)]
    return {"todos": todos, "more": f"{more[0]}.{more[1]}" if more else None,
            "total": count_selection(txn, principal, selection, BULK_MAX),
            "endpoint_choices": list_endpoints(txn, principal)["endpoints"], **bulk_choices(txn, principal)}


def bulk_offer(states: Iterable[str] | None) -> list[str]:
    """The bulk actions a list of todos in `states` offers, the one it most likely wants first: only those the
    states allow (a filter of done or cancelled work allows none). A list of every state offers them all."""
    states = set(states or ())
    return [action for action in BULK_PREFERENCE if not states or states & set(ACTION_STATES[action])]


def bulk_choices(txn: Txn, principal: Principal) -> dict:
    """What the bulk forms offer: the queues of the human's live endpoints (a reroute's target)."""
    queues = {q for e in list_endpoints(txn, principal)["endpoints"] if not e["revoked_at"] for q in e["queues"]}
    return {"bulk_queues": sorted(queues - RESERVED_QUEUES)}


def _working(txn: Txn, clause: str, params: tuple) -> dict[str, list[dict]]:
    """Per endpoint, the claimants holding a live lease now, each with its queues, jobs and first claim: a worker
    whose every slot is busy holds no waiting claim (so the doorbell has no session of it), yet it is connected
    and working. Read from the claimed todos (as many as the workers hold) and their open attempts."""
    rows = txn.all(f"SELECT t.endpoint_id, a.claimant, t.queue, count(*) AS jobs, min(a.claimed_at) AS since FROM"
                   f" (SELECT id, endpoint_id, queue FROM todos WHERE state = 'claimed' AND lease_expires_at > ?"
                   f" AND {clause}) t JOIN attempts a ON a.todo_id = t.id AND a.ended_at IS NULL"
                   f" GROUP BY t.endpoint_id, a.claimant, t.queue ORDER BY t.endpoint_id, a.claimant, t.queue",
                   (txn.now, *params))
    working: dict[str, dict[str, dict]] = {}
    for row in rows:
        claimant = working.setdefault(row["endpoint_id"], {}).setdefault(
            row["claimant"], {"claimant": row["claimant"], "queues": [], "jobs": 0, "since": row["since"],
                              "jobs_by_queue": {}})
        claimant["queues"].append(row["queue"])
        claimant["jobs"] += row["jobs"]
        claimant["jobs_by_queue"][row["queue"]] = row["jobs"]
        claimant["since"] = min(claimant["since"], row["since"])
    return {endpoint_id: list(by_claimant.values()) for endpoint_id, by_claimant in working.items()}


def _recent_finishers(txn: Txn, clause: str, params: tuple) -> list[sqlite3.Row]:
    """Who finished work in the last BOARD_RECENT_MS, per endpoint and queue, latest first: a worker between two
    claims holds no lease, and its waiting claim carries no name, but the store knows who it was. Read from the
    latest BOARD_RECENT_TODOS finished todos (todos_finished's newest stretch) and their attempts, by key."""
    since = txn.now - BOARD_RECENT_MS
    rows = txn.all(f"SELECT t.endpoint_id, t.queue, a.claimant, a.ended_at FROM (SELECT id, endpoint_id, queue"
                   f" FROM todos INDEXED BY todos_finished WHERE state IN ('done', 'failed', 'cancelled')"
                   f" AND updated_at > ? AND {clause} ORDER BY updated_at DESC LIMIT ?) t"
                   f" JOIN attempts a ON a.todo_id = t.id AND a.ended_at > ?", (since, *params, BOARD_RECENT_TODOS, since))
    return sorted(rows, key=lambda row: row["ended_at"], reverse=True)


def board_todo(txn: Txn, principal: Principal, todo_id: str) -> dict:
    """get_todo as REST answers it, plus one timeline of history and attempts, and the queues to offer."""
    todo = get_todo(txn, principal, todo_id)
    timeline = [{"at": h["at"], "kind": "history", **h} for h in todo["history"]]
    for attempt in todo["attempts"]:
        timeline.append({"at": attempt["claimed_at"], "kind": "claimed", **attempt})
        if attempt["ended_at"]:
            timeline.append({"at": attempt["ended_at"], "kind": "ended", **attempt})
    timeline.sort(key=lambda entry: (entry["at"] or "", entry["kind"] != "history"))
    event = txn.one("SELECT webhook_id FROM events WHERE id = ?", (todo["event_id"],)) if todo["event_id"] else None
    todo = with_choices(txn, principal, {**todo, "webhook_id": event["webhook_id"] if event else None}, {})
    trace = txn.one("SELECT traceparent FROM todos WHERE id = ?", (todo_id,))["traceparent"]
    return {"todo": todo, "timeline": timeline, "facts": attempt_facts(todo),
            "axis": time_axis(todo, txn.now), "trace_id": trace.split("-")[1] if trace else None}


# What each state is on the time axis: waiting for a worker, worked, or waiting for a human.
AXIS_PART = {"pending": "wait", "deferred": "wait", "blocked": "wait", "quarantined": "human", "needs_input": "human",
             "review": "human", "claimed": "work"}


def time_axis(todo: dict, now_ms: int) -> dict:
    """The todo's life on one time axis, from what the store holds (its history and attempts, export or not): one
    row of state spans (waits, the human's part) and one bar per attempt (claim to end, or to its lease's end while
    open, with its heartbeats); each as percentages of the whole, for the page's SVG."""
    def ms(text: str | None) -> int | None:
        return None if text is None else int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)

    history = todo["history"]
    start = ms(history[0]["at"]) if history else ms(todo["created_at"])
    ends = [ms(h["at"]) for h in history[1:]]
    final = now_ms if todo["state"] not in TERMINAL_STATES else (ends[-1] if ends else start)
    attempts = [(a, ms(a["claimed_at"]), ms(a["ended_at"]) or min(ms(a["lease_expires_at"]), now_ms))
                for a in todo["attempts"]]
    stop = max([final, *(end for _, _, end in attempts)])
    span = max(stop - start, 1)

    def place(begin: int, end: int) -> dict:
        left = (begin - start) * 100 / span
        return {"x": round(left, 2), "w": round(max((end - begin) * 100 / span, 0.4), 2),
                "seconds": round((end - begin) / 1000, 1)}

    states = []
    for entry, end in zip(history, [*ends, final], strict=True):
        if end > ms(entry["at"]) or entry is history[-1]:
            states.append({"state": entry["to"], "part": AXIS_PART.get(entry["to"], "end"),
                           **place(ms(entry["at"]), max(end, ms(entry["at"])))})
    bars = [{"seq": a["seq"], "outcome": a["outcome"] or "open", "heartbeats": a["heartbeats"], **place(begin, end)}
            for a, begin, end in attempts]
    return {"states": states, "attempts": bars, "seconds": round(span / 1000, 1)}


_ERROR_OUTCOMES = ("failed", "lease_expired")


def attempt_facts(todo: dict) -> dict:
    """What the todo page says of attempts and errors, true to its timeline. `attempt` counts against the budget:
    a release refunds its attempt, and a human's retry or reroute starts the count again, while the timeline
    shows every claim. `last_error` is kept after the work moved on: it is the todo's current error only while
    the todo is a dead letter or waits for (or runs) the retry of an attempt that failed; otherwise it is an
    earlier attempt's (`error_seq`)."""
    attempts = todo["attempts"]
    resets = [h for h in todo["history"] if str(h["actor"]).startswith("human:") and h["to"] == "pending"
              and (h["from"] == "failed" or "to_queue" in (h["evidence"] or {}))]
    reset = resets[-1] if resets else None
    ended = [a for a in attempts if a["ended_at"]]
    failed = [a for a in attempts if a["outcome"] in _ERROR_OUTCOMES]
    current = todo["state"] == "failed" or (
        todo["state"] in ("pending", "claimed") and bool(ended) and ended[-1]["outcome"] in _ERROR_OUTCOMES)
    return {"claims": len(attempts), "released": sum(a["outcome"] == "released" for a in attempts),
            "reset_at": reset["at"] if reset else None,
            "reset_by": (reset and ("retry" if reset["from"] == "failed" else "reroute")),
            "error_current": bool(todo["last_error"]) and current,
            "error_seq": failed[-1]["seq"] if failed else None}


# -- deliveries, each on one line -------------------------------------------------------------------------

# An event's columns for its line, with its body only where the line needs it and it is small: a forge delivery
# that is not an issue (the stored envelope keeps an issue's action and title, not a pull request's).
_EVENT_LINE = (f"SELECT e.id, e.source, e.kind, e.disposition, e.verified, e.trust_mode, e.delivery_key,"
               f" e.received_at, e.outcome, e.envelope, json_extract(e.trace, '$.payload_error') AS payload_error,"
               f" CASE WHEN e.source IN"
               f" ({', '.join(repr(p) for p, spec in PROVIDER_TABLE.items() if spec.forge)})"
               f" AND json_extract(e.envelope, '$.issue') IS NULL AND length(b.body) <= {SUMMARY_BODY_BYTES}"
               f" THEN b.body END AS line_body FROM events e LEFT JOIN event_bodies b ON b.event_id = e.id")
# The action a `kind.action` filter compares: an issue's from the stored envelope, else the body's `action`.
_EVENT_ACTION = ("coalesce(json_extract(e.envelope, '$.issue.action'), CASE WHEN length(b.body) <="
                 f" {SUMMARY_BODY_BYTES} AND json_valid(CAST(b.body AS TEXT))"
                 " THEN json_extract(CAST(b.body AS TEXT), '$.action') END)")


def _one_line(value: object, cut: int | None = None) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return None
    text = " ".join(value.split())
    if cut is None or len(text) <= cut:
        return text
    short = text[:cut - 1]
    if " " in short[cut // 2:]:  # cut between words where one ends in the latter half
        short = short.rsplit(" ", 1)[0]
    return short.rstrip(" ,;:") + "…"


def _line(source: str, kind: str | None, record: dict, payload: object) -> dict:
    """What a delivery was about, for one line: its kind and action (`issues.opened`), its subject (`org/repo#41`,
    the subject key without its provider) and its title, cut to SUMMARY_TITLE_CHARS. Producer text, shown escaped."""
    issue, artifact = record.get("issue") or {}, record.get("artifact") or {}
    action = _one_line(issue.get("action")) or _one_line(value_at(payload, "action"), 40)
    commit = value_at(payload, "head_commit", "message")
    title = next((text for text in (
        _one_line(issue.get("title")), _one_line(artifact.get("title")),
        *(_one_line(value_at(payload, part, field)) for part, field in (("pull_request", "title"),
                                                                    ("discussion", "title"), ("release", "name"))),
        _one_line(commit.splitlines()[0] if isinstance(commit, str) and commit.strip() else None)) if text), None)
    subject = record.get("subject_key")
    if isinstance(subject, str) and subject.startswith(f"{source}:"):
        subject = subject[len(source) + 1:]
    what = f"{kind}.{action}" if kind and action and not kind.endswith(f".{action}") else kind or "delivery"
    if title is not None and len(title) > SUMMARY_TITLE_CHARS:
        cut = title[:SUMMARY_TITLE_CHARS - 1]
        title = (cut.rsplit(" ", 1)[0] if " " in cut[SUMMARY_TITLE_CHARS // 2:] else cut).rstrip(" ,;:") + "…"
    return {"what": what, "subject": subject, "title": title}


def delivery_line(row: sqlite3.Row) -> dict:
    """A row of _EVENT_LINE with its line (`issues.opened · org/repo#41 · Spelling error…`): from the stored
    envelope, and for a forge's other deliveries from the body when it is small."""
    event = dict(row)
    record = stored_json(event.pop("envelope")) or {}
    body = event.pop("line_body")
    payload = stored_payload(body, record.get("content_type")) if body is not None else None
    line = _line(event["source"], event["kind"], record, payload)
    if event["payload_error"] and line["title"] is None:
        line["title"] = f"no payload ({event['payload_error'].replace('_', ' ')})"
    return {**event, "outcome": stored_json(event["outcome"]) or {}, **line}


def _webhook_summary(txn: Txn, webhook: dict, names: dict[str, str]) -> dict:
    last = txn.one(f"{_EVENT_LINE} WHERE e.webhook_id = ? ORDER BY e.received_at DESC, e.id DESC LIMIT 1",
                   (webhook["id"],))
    return {**webhook, "last_event": delivery_line(last) if last else None,
            "owner": names.get(webhook["endpoint_id"], webhook["endpoint_id"])}


def board_webhooks(txn: Txn, principal: Principal) -> dict:
    names = board_names(txn, principal)
    return {"webhooks": [_webhook_summary(txn, w, names) for w in list_webhooks(txn, principal)["webhooks"]],
            "endpoints": list_endpoints(txn, principal)["endpoints"]}


def board_webhook(txn: Txn, principal: Principal, webhook_id: str) -> dict:
    """One webhook with its rules, its routes (each target by name), the deliveries a dry run may use, and the
    endpoints a new route may name."""
    names = board_names(txn, principal)
    webhook = _webhook_summary(txn, get_webhook(txn, principal, webhook_id), names)
    recent = [delivery_line(r) for r in txn.all(
        f"{_EVENT_LINE} WHERE e.webhook_id = ? AND e.envelope IS NOT NULL ORDER BY e.received_at DESC, e.id DESC"
        f" LIMIT 20", (webhook_id,))]
    routes = [{**r, **dict(txn.one("SELECT e.name, e.revoked_at, h.name AS human FROM endpoints e JOIN humans h"
                                    " ON h.id = e.human_id WHERE e.id = ?", (r["endpoint_id"],)) or {})}
              for r in list_routes(txn, principal, webhook_id)["routes"]]
    routed = {webhook["endpoint_id"], *(r["endpoint_id"] for r in routes)}
    endpoints = list_endpoints(txn, principal)["endpoints"]
    connected = txn.one("SELECT policy FROM webhook_connections WHERE webhook_id = ?", (webhook_id,))
    return {"webhook": webhook, "rules": get_rules(txn, principal, webhook_id), "routes": routes, "recent": recent,
            "endpoints": endpoints, "policy": json.loads(connected["policy"]) if connected else None,
            "connections": list_connections(txn, principal)["connections"] if principal.kind != "endpoint" else [],
            "route_choices": [e for e in endpoints if not e["revoked_at"] and e["id"] not in routed]}


def board_deliveries(txn: Txn, principal: Principal, webhook_id: str, disposition: str | None, kind: str | None,
                     before: tuple[int, str] | None) -> dict:
    """A webhook's deliveries, newest first, a page at a time (what list_events shows), each on one line.
    `kind` matches the kind (`issues`, `invoice.paid`) or a kind and its action (`issues.opened`)."""
    webhook = get_webhook(txn, principal, webhook_id)
    sql, args = f"{_EVENT_LINE} WHERE e.webhook_id = ?", [webhook_id]
    if disposition:
        sql += " AND e.disposition = ?"
        args.append(disposition)
    if kind:
        stem, dot, action = kind.rpartition(".")
        sql += f" AND (e.kind = ? OR (e.kind = ? AND {_EVENT_ACTION} = ?))" if dot else " AND e.kind = ?"
        args += [kind, stem, action] if dot else [kind]
    if before is not None:
        sql += " AND (e.received_at, e.id) < (?, ?)"
        args += list(before)
    rows = txn.all(sql + " ORDER BY e.received_at DESC, e.id DESC LIMIT ?", (*args, BOARD_PAGE_SIZE + 1))
    events = [delivery_line(r) for r in rows[:BOARD_PAGE_SIZE]]
    more = events[-1] if len(rows) > BOARD_PAGE_SIZE else None
    return {"webhook": webhook, "events": events, "more": f"{more['received_at']}.{more['id']}" if more else None}


def board_delivery(txn: Txn, principal: Principal, event_id: str) -> dict:
    event = get_event(txn, principal, event_id)
    clause, params = scope_clause(principal)
    todos = [dict(r) for r in txn.all(f"SELECT id, title, state, queue, endpoint_id FROM todos WHERE event_id = ?"
                                      f" AND {clause} ORDER BY created_at, id", (event_id, *params))]
    webhook = txn.one("SELECT id, name, provider, queue FROM webhooks WHERE id = ?", (event["webhook_id"],)) \
        if event["webhook_id"] else None
    envelope = event["envelope"] or {}
    return {"event": event, "todos": todos, "webhook": dict(webhook) if webhook else None,
            "line": _line(event["source"], event["kind"], envelope, envelope.get("payload"))}


def board_endpoints(txn: Txn, principal: Principal) -> dict:
    clause, params = scope_clause(principal)
    open_counts = {r["endpoint_id"]: r["n"] for r in txn.all(
        f"SELECT endpoint_id, sum(n) AS n FROM todo_counts WHERE {clause} AND {_OPEN} AND state NOT IN ('failed',"
        f" 'quarantined') GROUP BY endpoint_id", params)}
    endpoints = [{**e, "open": open_counts.get(e["id"], 0)} for e in list_endpoints(txn, principal)["endpoints"]]
    return {"endpoints": endpoints, "presets": list(VERB_PRESETS)}
