"""Subjects: everything about one work item (an issue, a pull request, a cairn artifact) that a caller may see, on
one timeline, and the human's list of them."""

from __future__ import annotations

import base64
import binascii
import json
import re
import sqlite3
from collections.abc import Callable, Iterable

from switchboard.configuration import TERMINAL_STATES, ApiError, iso
from switchboard.database import Txn
from switchboard.envelope import parse_subject_key
from switchboard.models import SubjectListQuery
from switchboard.payload import producer_text, value_at
from switchboard.store.principals import Principal
from switchboard.store.todos import output_view, scope_clause, stored_json, todo_view

SUBJECT_STATES = ("waiting", "open", "done")
# A subject page shows at most this many of its deliveries (the latest); its todos, their transitions, outputs
# and receipts are all shown.
SUBJECT_DELIVERIES = 500


def waits_on_human(todo: sqlite3.Row | dict) -> bool:
    """The subjects triggers' `waiting` case (schema.sql): held, quarantined, a question, blocked, in review, or a
    dead letter."""
    return (todo["state"] in ("quarantined", "needs_input", "blocked", "review")
            or (todo["state"] == "failed" and bool(todo["dead_letter"]))
            or (todo["state"] == "pending" and todo["queue"] == "hold"))


def _state_of(todos: Iterable[sqlite3.Row | dict]) -> str:
    todos = list(todos)
    if any(waits_on_human(t) for t in todos):
        return "waiting"
    return "open" if any(t["state"] not in TERMINAL_STATES for t in todos) else "done"


# -- the delivery transaction's part -------------------------------------------------------------------------

def _labels(value: object) -> list[str] | None:
    if not isinstance(value, list):
        return None
    return [name for label in value if isinstance(label, dict) and (name := producer_text(label.get("name")))]


def subject_facts(envelope: dict) -> dict:
    """The title, link and labels a verified delivery gives its subject (labels None: it says nothing of them)."""
    payload = envelope["payload"]
    artifact = envelope.get("artifact") or {}
    thread = next((value_at(payload, part) for part in ("issue", "pull_request")
                   if isinstance(value_at(payload, part), dict)), {})
    title = producer_text(thread.get("title")) or producer_text(artifact.get("title"))
    url = producer_text(thread.get("html_url")) or producer_text(artifact.get("url"))
    return {"title": title[:512] if title else None, "url": url if url and len(url) <= 2048 else None,
            "labels": _labels(thread.get("labels"))}


def note_delivery(txn: Txn, human_ids: Iterable[str], envelope: dict) -> None:
    """A delivery about a subject, in its own transaction: each human who now sees it has the subject's row, with
    its last activity now and (a verified delivery only) the title, link and labels as delivered. The todos'
    counts are the triggers'."""
    key = envelope["subject_key"]
    if not key:
        return
    facts = subject_facts(envelope) if envelope["verified"] else {"title": None, "url": None, "labels": None}
    labels = json.dumps(facts["labels"]) if facts["labels"] is not None else None
    for human_id in dict.fromkeys(human_ids):
        txn.execute("INSERT INTO subjects (human_id, key, title, url, labels, first_seen_at, last_activity_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (human_id, key) DO UPDATE SET"
                    " title = coalesce(excluded.title, subjects.title), url = coalesce(excluded.url, subjects.url),"
                    " labels = CASE WHEN ? = 1 THEN excluded.labels ELSE subjects.labels END,"
                    " last_activity_at = CASE WHEN excluded.last_activity_at > subjects.last_activity_at"
                    " THEN excluded.last_activity_at ELSE subjects.last_activity_at END",
                    (human_id, key, facts["title"], facts["url"], labels or "[]", txn.now, txn.now,
                     int(labels is not None)))


# -- the list ------------------------------------------------------------------------------------------------

def _cursor(text: str | None) -> tuple[int, str] | None:
    if text is None:
        return None
    try:
        stamp, key = json.loads(base64.urlsafe_b64decode(text.encode() + b"=" * (-len(text) % 4)))
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        raise ApiError("invalid_argument", "cursor: not a cursor this list gave") from None
    if not isinstance(stamp, int) or not isinstance(key, str):
        raise ApiError("invalid_argument", "cursor: not a cursor this list gave")
    return stamp, key


def _next_cursor(row: sqlite3.Row) -> str:
    return base64.urlsafe_b64encode(json.dumps([row["last_activity_at"], row["key"]]).encode()).decode().rstrip("=")


def _like(text: str) -> str:
    return "%" + re.sub(r"([\\%_])", r"\\\1", text.lower()) + "%"


def subject_humans(txn: Txn, principal: Principal) -> list[str]:
    """Whose subject rows the principal reads: a human's own, the operator's everyone's."""
    if principal.kind == "endpoint":
        raise ApiError("forbidden", "listing subjects needs a human token")
    if principal.kind == "human":
        return [principal.human_id]
    return [r["id"] for r in txn.all("SELECT id FROM humans ORDER BY id")]


def _todo_queues(txn: Txn, human_id: str, key: str) -> list[str]:
    """The queues of the human's todos about the subject (todos_by_subject: a subject's few todos)."""
    return sorted({r["queue"] for r in txn.all("SELECT queue FROM todos WHERE subject_key = ? AND endpoint_id IN"
                                               " (SELECT id FROM endpoints WHERE human_id = ?)", (key, human_id))})


def subject_line(txn: Txn, row: sqlite3.Row) -> dict:
    """One subject as the list shows it."""
    return {"key": row["key"], "title": row["title"], "url": row["url"], **parse_subject_key(row["key"]),
            "state": row["state"], "last_activity_at": iso(row["last_activity_at"]), "open_todos": row["open_todos"],
            "queues": _todo_queues(txn, row["human_id"], row["key"])}


def list_subjects(txn: Txn, principal: Principal, query: SubjectListQuery) -> dict:
    """The human's subjects, most recently active first, a page at a time: one range of subjects_by_state per
    state asked for, each read up to the page's size past the cursor, merged here (so a page costs the same at
    any size). `q` and `provider` filter within those ranges."""
    after = _cursor(query.cursor)
    where, args = "", []
    if query.q:
        where += " AND (lower(coalesce(title, '')) LIKE ? ESCAPE '\\' OR lower(key) LIKE ? ESCAPE '\\')"
        args += [_like(query.q)] * 2
    if query.provider:
        where += " AND key LIKE ? ESCAPE '\\'"
        args.append(query.provider + ":%")
    if after is not None:
        where += " AND last_activity_at <= ? AND (last_activity_at, key) < (?, ?)"
        args += [after[0], *after]
    rows: list[sqlite3.Row] = []
    for human_id in subject_humans(txn, principal):
        for state in [query.state] if query.state else SUBJECT_STATES:
            rows += txn.all(f"SELECT * FROM subjects WHERE human_id = ? AND state = ?{where}"
                            f" ORDER BY last_activity_at DESC, key DESC LIMIT ?", (human_id, state, *args,
                                                                                   query.limit + 1))
    rows.sort(key=lambda row: (row["last_activity_at"], row["key"]), reverse=True)
    seen: set[str] = set()
    page = [row for row in rows if not (row["key"] in seen or seen.add(row["key"]))]
    more = len(page) > query.limit
    page = page[:query.limit]
    return {"subjects": [subject_line(txn, row) for row in page],
            "next_cursor": _next_cursor(page[-1]) if more and page else None}


# -- one subject -----------------------------------------------------------------------------------------------

def _marks(values: list) -> str:
    return ", ".join("?" * len(values))


def _delivery_entry(row: sqlite3.Row, visible_todos: set[str]) -> dict:
    record = stored_json(row["envelope"]) or {}
    trace = stored_json(row["trace"]) or {}
    outcome = stored_json(row["outcome"]) or {}
    issue = record.get("issue") or {}
    return {"at": row["received_at"], "type": "delivery", "event_id": row["id"], "webhook_id": row["webhook_id"],
            "kind": row["kind"], "action": issue.get("action") or None,
            "sender": (record.get("actor") or {}).get("sender"), "disposition": row["disposition"],
            "rule_id": trace.get("rule_id"), "stage": trace.get("stage"), "cause": trace.get("cause"),
            "queue": action.get("queue") if isinstance(action := trace.get("action"), dict) else None,
            "labels": issue.get("labels") if issue else None, "label": issue.get("label") if issue else None,
            "todos": [t["id"] for t in outcome.get("todos", []) if t.get("id") in visible_todos],
            "command": trace.get("command"), "forge": trace.get("forge")}


def _subject_events(txn: Txn, principal: Principal, key: str, todo_events: set[str]) -> list[sqlite3.Row]:
    """The deliveries about the subject the principal may see: a human's webhooks' and those that made their
    todos; an endpoint's todos' only. The latest SUBJECT_DELIVERIES, oldest first."""
    columns = "id, webhook_id, kind, disposition, envelope, trace, outcome, received_at"
    if principal.kind == "endpoint":
        ids = sorted(todo_events)
        rows = txn.all(f"SELECT {columns} FROM events WHERE id IN ({_marks(ids)})", ids) if ids else []
    else:
        mine = "" if principal.kind == "operator" else " AND human_id = ?"
        rows = txn.all(f"SELECT {columns} FROM events WHERE subject_key = ?{mine}"
                       f" ORDER BY received_at DESC, id DESC LIMIT ?",
                       (key, *(() if principal.kind == "operator" else (principal.human_id,)), SUBJECT_DELIVERIES))
        missing = sorted(todo_events - {r["id"] for r in rows})
        if missing:
            rows += txn.all(f"SELECT {columns} FROM events WHERE id IN ({_marks(missing)})", missing)
    return sorted(rows, key=lambda r: (r["received_at"], r["id"]))[-SUBJECT_DELIVERIES:]


# What the subject answer leaves out of each todo: the producer's and the worker's documents, which made one
# issue's answer tens of KB (each todo's whole delivery again). Its `link` fetches the todo whole.
TODO_DOCUMENTS = ("payload", "work_order", "work_item", "trace", "result")


def subject_links(txn: Txn, human_ids: list[str], key: str) -> list[dict]:
    """A subject's links (store.forge_control makes them): the issues a pull request closes (`closes`), the pull
    requests that close an issue (`closed_by`), oldest first."""
    if not human_ids:
        return []
    rows = txn.all(f"SELECT pull_key, issue_key, event_id, linked_at FROM subject_links WHERE human_id IN"
                   f" ({_marks(human_ids)}) AND (pull_key = ? OR issue_key = ?) ORDER BY linked_at, pull_key, issue_key",
                   (*human_ids, key, key))
    links: dict[tuple[str, str], dict] = {}
    for r in rows:
        other, kind = (r["issue_key"], "closes") if r["pull_key"] == key else (r["pull_key"], "closed_by")
        links.setdefault((other, kind), {"key": other, "kind": kind, "at": r["linked_at"], "event_id": r["event_id"]})
    return list(links.values())


def subject_todo(row: sqlite3.Row) -> dict:
    """A todo as the subject answer names it: every field a list gives but the documents, and its link."""
    view = todo_view(row)
    for name in TODO_DOCUMENTS:
        del view[name]
    return {**view, "link": f"/api/v1/todos/{row['id']}"}


def subject_answer(txn: Txn, principal: Principal, key: str) -> dict:
    """`GET /api/v1/subjects/{key}` and `subject show`: the subject with its todos named and linked (subject_todo),
    not repeated whole."""
    return get_subject(txn, principal, key, subject_todo)


def get_subject(txn: Txn, principal: Principal, key: str, todo_form: Callable[[sqlite3.Row], dict] = todo_view
                ) -> dict:
    """One subject as the caller may see it: its facts, its todos in every queue (in `todo_form`: whole for the
    Board's page, named for the answer), and one timeline, oldest first, of its deliveries, its todos'
    transitions, their outputs and receipts. A human sees their own webhooks' deliveries and endpoints' todos; an
    endpoint its own todos; nothing visible is 404."""
    if principal.kind == "endpoint":
        principal.require_verb("get_todo")
    clause, params = scope_clause(principal)
    todos = txn.all(f"SELECT * FROM todo_rows WHERE subject_key = ? AND {clause} ORDER BY created_at, id",
                    (key, *params))
    row = None
    if principal.kind == "human":
        row = txn.one("SELECT * FROM subjects WHERE human_id = ? AND key = ?", (principal.human_id, key))
    elif principal.kind == "operator":
        row = txn.one("SELECT * FROM subjects WHERE key = ? ORDER BY last_activity_at DESC LIMIT 1", (key,))
    if row is None and not todos:
        raise ApiError("not_found", f"no subject {key}")
    ids = [t["id"] for t in todos]
    events = _subject_events(txn, principal, key, {t["event_id"] for t in todos if t["event_id"]})
    timeline: list[tuple[int, int, str, dict]] = [(e["received_at"], 0, e["id"], _delivery_entry(e, set(ids)))
                                                  for e in events]
    commands = [e["id"] for e in events if e["disposition"] == "command"]
    reactions = {r["event_id"]: {"content": r["content"], "state": r["state"]} for r in txn.all(
        f"SELECT event_id, content, state FROM forge_reactions WHERE event_id IN ({_marks(commands)})",
        commands)} if commands else {}
    for _, _, event_id, entry in timeline:
        if event_id in reactions:
            entry["reaction"] = reactions[event_id]
    if ids:
        queues = {t["id"]: t["queue"] for t in todos}
        for h in txn.all(f"SELECT * FROM todo_history WHERE todo_id IN ({_marks(ids)}) ORDER BY id", ids):
            timeline.append((h["at"], 1, f"{h['id']:020d}", {
                "at": h["at"], "type": "transition", "todo_id": h["todo_id"], "queue": queues[h["todo_id"]],
                "from": h["from_state"], "to": h["to_state"], "actor": h["actor"],
                "evidence": stored_json(h["evidence"])}))
        for o in txn.all(f"SELECT * FROM forge_outputs WHERE todo_id IN ({_marks(ids)}) ORDER BY created_at, id",
                         ids):
            view = output_view(o)
            timeline.append((o["created_at"], 2, o["id"], {
                "at": o["created_at"], "type": "output", "output_id": o["id"], "todo_id": o["todo_id"],
                "queue": queues[o["todo_id"]],
                "output_type": o["type"], "state": o["state"], "labels": view.get("labels"),
                "error": o["error"], "sent_at": view["sent_at"]}))
        for r in txn.all(f"SELECT * FROM receipts WHERE todo_id IN ({_marks(ids)}) ORDER BY written_at, id", ids):
            absorbed = [i["todo_id"] for i in txn.all("SELECT todo_id FROM receipt_items WHERE receipt_id = ?"
                                                      " ORDER BY todo_id", (r["id"],))]
            timeline.append((r["written_at"], 3, r["id"], {
                "at": r["written_at"], "type": "receipt", "receipt_id": r["id"], "todo_id": r["todo_id"],
                "queue": queues[r["todo_id"]],
                "absorbed": absorbed}))
    humans = [principal.human_id] if principal.kind == "human" else (
        [r["human_id"] for r in txn.all("SELECT human_id FROM subjects WHERE key = ?", (key,))]
        if principal.kind == "operator" else [])
    links = subject_links(txn, humans, key)
    for link in links:
        timeline.append((link["at"], 4, link["key"], {"at": link["at"], "type": "link", "key": link["key"],
                                                      "kind": link["kind"], "event_id": link["event_id"]}))
    timeline.sort(key=lambda entry: entry[:3])
    latest = next((stored_json(e["envelope"]) for e in reversed(events) if e["envelope"]), None) or {}
    issue = latest.get("issue") or {}
    facts = {"title": row["title"], "url": row["url"], "labels": json.loads(row["labels"])} if row is not None else {
        "title": issue.get("title") or (todos[-1]["title"] if todos else None), "url": issue.get("url") or None,
        "labels": issue.get("labels") or []}
    return {"key": key, **facts, **parse_subject_key(key),
            "state": row["state"] if row is not None else _state_of(todos),
            "todos": [todo_form(t) for t in todos],
            "links": [{"key": link["key"], "kind": link["kind"], "at": iso(link["at"])} for link in links],
            "timeline": [{**entry, "at": iso(entry["at"])} for *_, entry in timeline]}
