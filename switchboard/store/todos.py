"""Todos as the API shows them, and who may see which."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from switchboard.configuration import ApiError, iso, to_ms
from switchboard.database import Txn
from switchboard.models import TodoFilter, TodoListQuery
from switchboard.payload import stored_payload
from switchboard.store.principals import Principal

# -- todos: views and visibility --------------------------------------------------------------------

def dump_json(value: Any, field_name: str) -> str | None:
    """Producer JSON as stored text; NaN and Infinity are not JSON and are refused."""
    if value is None:
        return None
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:
        raise ApiError("invalid_argument", f"{field_name}: NaN and Infinity are not JSON") from None


def stored_json(text: str | None) -> Any:
    """Stored JSON, read back. Nothing stored may make a read fail: JSON nested too deep to read is null."""
    try:
        return None if text is None else json.loads(text)
    except RecursionError:
        return None


def todo_view(row: sqlite3.Row) -> dict:
    """A todo as the API shows it, from a row of the todo_rows view (which carries its event's body)."""
    return {
        "id": row["id"], "endpoint_id": row["endpoint_id"], "queue": row["queue"], "state": row["state"],
        "outcome": row["outcome"], "title": row["title"], "source": row["source"], "kind": row["kind"],
        "subject_key": row["subject_key"], "priority": row["priority"], "attempt": row["attempt"],
        "max_attempts": row["max_attempts"], "dead_letter": bool(row["dead_letter"]),
        "lease_expires_at": iso(row["lease_expires_at"]), "available_at": iso(row["available_at"]),
        "created_at": iso(row["created_at"]), "updated_at": iso(row["updated_at"]),
        "payload": (stored_json(row["payload"]) if row["payload"] is not None
                    else stored_payload(row["event_body"], row["event_content_type"])),
        "work_order": stored_json(row["work_order"]),
        "work_item": stored_json(row["work_item"]), "trace": stored_json(row["trace"]), "result": stored_json(row["result"]),
        "last_error": row["last_error"], "key": row["idempotency_key"], "state_reason": row["state_reason"],
        "answer": row["answer"], "deferred_until": iso(row["deferred_until"]), "event_id": row["event_id"],
        "rings": {"count": row["ring_count"], "last_at": iso(row["last_ring_at"]),
                  "acked_at": iso(row["ring_acked_at"])},
    }


TITLE_IN_SPAN = 200  # the only producer text a span carries (SPEC 17), cut to this many characters


def messaging_attributes(todo_id: str, queue: str, endpoint_id: str, subject_key: str | None, *,
                         title: str | None = None, attempt: int | None = None, outcome: str | None = None) -> dict:
    """A todo's span attributes after OpenTelemetry's messaging conventions: ids, names and counts, never a payload,
    a token or producer text beyond the cut title."""
    attributes = {"messaging.system": "switchboard", "messaging.destination.name": queue,
                  "messaging.message.id": todo_id, "switchboard.endpoint_id": endpoint_id}
    for name, value in (("switchboard.subject_key", subject_key), ("switchboard.title", title and title[:TITLE_IN_SPAN]),
                        ("switchboard.attempt", attempt), ("switchboard.outcome", outcome)):
        if value is not None:
            attributes[name] = value
    return attributes


def attempt_view(row: sqlite3.Row) -> dict:
    return {"seq": row["seq"], "claimant": row["claimant"], "claimed_at": iso(row["claimed_at"]),
            "lease_expires_at": iso(row["lease_expires_at"]), "heartbeats": row["heartbeats"],
            "ended_at": iso(row["ended_at"]), "outcome": row["outcome"], "summary": row["summary"],
            "artifact": row["artifact"]}


def output_view(row: sqlite3.Row) -> dict:
    """A forge output as its todo, its subject and the answers show it."""
    view = {"id": row["id"], "todo_id": row["todo_id"], "type": row["type"],
            "target": f"{row['repo']}#{row['number']}", "state": row["state"], "error": row["error"],
            "attempts": row["attempts"], "created_at": iso(row["created_at"]), "sent_at": iso(row["sent_at"])}
    if row["type"] == "comment":
        view["body"] = row["body"]
    else:
        view["labels"] = json.loads(row["labels"])
    return view


def outputs_of(txn: Txn, todo_id: str) -> list[dict]:
    return [output_view(r) for r in txn.all("SELECT * FROM forge_outputs WHERE todo_id = ? ORDER BY created_at, id",
                                            (todo_id,))]


def scope_clause(principal: Principal) -> tuple[str, tuple]:
    """The WHERE fragment that confines a query on `todos` to what the principal may see."""
    if principal.kind == "endpoint":
        return "endpoint_id = ? AND state <> 'quarantined'", (principal.id,)
    if principal.kind == "human":
        return "endpoint_id IN (SELECT id FROM endpoints WHERE human_id = ?)", (principal.human_id,)
    return "1 = 1", ()


def load_todo(txn: Txn, principal: Principal, todo_id: str, source: str = "todos",
              for_update: bool = False) -> sqlite3.Row:
    """A todo the principal may see; from `todo_rows` when it is to be shown (todo_view), else the bare row.
    `for_update`: a verb about to change it holds it until commit (where writers run side by side)."""
    clause, params = scope_clause(principal)
    row = txn.one(f"SELECT * FROM {source} WHERE id = ? AND {clause}{txn.for_update if for_update else ''}",
                  (todo_id, *params))
    if row is None:
        raise ApiError("not_found", f"no todo {todo_id}")
    if for_update:
        txn.held.add(todo_id)
    return row


def reload_todo(txn: Txn, todo_id: str) -> sqlite3.Row:
    """A todo as todo_view reads it."""
    return txn.one("SELECT * FROM todo_rows WHERE id = ?", (todo_id,))


def todo_groups(txn: Txn, principal: Principal, where: str = "1 = 1", params: tuple = ()) -> list[tuple]:
    """The groups (endpoint, state, queue) that hold todos the principal may see and that meet `where`, a condition
    on the state and the queue (and the endpoint) only: from todo_counts, a few rows whatever the todos number."""
    clause, scope = scope_clause(principal)
    return [tuple(r) for r in txn.all(f"SELECT endpoint_id, state, queue FROM todo_counts WHERE {clause} AND n > 0"
                                      f" AND ({where})", (*scope, *params))]


def grouped_page(txn: Txn, groups: list[tuple], columns: str, limit: int, *, newest_first: bool = False,
                 after: tuple | None = None, tie: str = "id") -> list[sqlite3.Row]:
    """The first `limit` todos of `groups` in (created_at, `tie`) order, oldest or newest first, past the cursor
    `after` (a created_at and a `tie` value). Each group is one range of todos_by_state already in created_at
    order, read up to `limit` entries; the ranges are merged here. So a page costs the same at any size, where one
    query over several groups would sort every todo in them first. `columns` must name created_at and `tie`."""
    order, beyond = ("DESC", "<") if newest_first else ("ASC", ">")
    cursor = f" AND created_at {beyond}= ? AND (created_at, {tie}) {beyond} (?, ?)" if after is not None else ""
    bounds = (after[0], *after) if after is not None else ()
    rows: list[sqlite3.Row] = []
    for group in groups:
        rows += txn.all(f"SELECT {columns} FROM todos WHERE endpoint_id = ? AND state = ? AND queue = ?{cursor}"
                        f" ORDER BY created_at {order}, {tie} {order} LIMIT ?", (*group, *bounds, limit))
    rows.sort(key=lambda row: (row["created_at"], row[tie]), reverse=newest_first)
    return rows[:limit]


@dataclass(frozen=True)
class Selection:
    """Which todos a list (or a bulk action) takes: by endpoint, queue, states, subject, title text (`q`, any
    case) and creation time (`since`, ms)."""
    endpoint: str | None = None
    queue: str | None = None
    states: tuple[str, ...] | None = None
    subject: str | None = None
    q: str | None = None
    since: int | None = None

    @classmethod
    def of(cls, query: TodoListQuery | TodoFilter) -> Selection:
        since = getattr(query, "since", None)
        return cls(query.endpoint, query.queue, query.states, query.subject, query.q,
                   to_ms(since) if since is not None else None)


# A page filtered beyond its groups (by title, or within a subject) reads at most this many todos, across its
# groups: a title matched by few todos is paged through in stretches, each page as fast as the next.
SCAN_ROWS = 4_000


def select_page(txn: Txn, principal: Principal, selection: Selection, limit: int,
                after: tuple[int, str] | None = None) -> tuple[list[str], tuple[int, str] | None]:
    """The ids of the first `limit` todos the selection matches that the principal may see, newest first (by
    created_at, then id), past `after`; and where the next page starts (None: there is none).

    Each source is one range of an index already in that order: a group (endpoint, state, queue) of
    todos_by_state, named by todo_counts, or the subject's range of todos_by_subject. Each is read up to a window:
    `limit + 1` todos when every todo of the group matches, else a share of SCAN_ROWS, each then tested (the
    subject's by state, scope and the rest in SQL, the title in Python, casefolded). Where a window filled before
    its source ended, the todos past it were not read, so the page stops at the highest such place and the next
    page starts from there: a page may be short, and still name a next one."""
    needle = selection.q.casefold() if selection.q is not None else None
    if selection.subject is not None:
        clause, scope = scope_clause(principal)
        hit, hit_params = _conditions(selection, clause, scope)
        sources = [("subject_key = ?", (selection.subject,))]
    else:
        where, args = _conditions(selection, "1 = 1", ())
        sources = [("endpoint_id = ? AND state = ? AND queue = ?", group)
                   for group in todo_groups(txn, principal, where, args)]
        hit, hit_params = "1", ()
    plain = needle is None and selection.subject is None
    window = limit + 1 if plain else max(limit + 1, SCAN_ROWS // max(1, len(sources)))
    bounds, bound_params = "", []
    if selection.since is not None:
        bounds += " AND created_at >= ?"
        bound_params.append(selection.since)
    if after is not None:
        bounds += " AND created_at <= ? AND (created_at, id) < (?, ?)"
        bound_params += [after[0], *after]
    hits: list[tuple[int, str]] = []
    stop: tuple[int, str] | None = None
    for source, params in sources:
        rows = txn.all(f"SELECT created_at, id, title, ({hit}) AS hit FROM todos WHERE {source}{bounds}"
                       f" ORDER BY created_at DESC, id DESC LIMIT ?", (*hit_params, *params, *bound_params, window))
        if len(rows) == window:
            last = (rows[-1]["created_at"], rows[-1]["id"])
            stop = last if stop is None else max(stop, last)
        hits += [(r["created_at"], r["id"]) for r in rows
                 if r["hit"] and (needle is None or needle in r["title"].casefold())]
    if stop is not None:
        hits = [key for key in hits if key >= stop]
    hits.sort(reverse=True)
    if len(hits) > limit:
        return [todo_id for _, todo_id in hits[:limit]], hits[limit - 1]
    return [todo_id for _, todo_id in hits], stop


def _conditions(selection: Selection, clause: str, params: tuple) -> tuple[str, tuple]:
    """`clause` and the selection's endpoint, queue and states, as one condition on a todo."""
    where, args = clause, list(params)
    for column, value in (("queue", selection.queue), ("endpoint_id", selection.endpoint)):
        if value is not None:
            where += f" AND {column} = ?"
            args.append(value)
    if selection.states is not None:
        where += f" AND state IN ({', '.join('?' * len(selection.states))})"
        args += selection.states
    return where, tuple(args)


def count_selection(txn: Txn, principal: Principal, selection: Selection, most: int) -> int | None:
    """How many todos the selection matches, counted up to `most` + 1; None when only a scan could say (a title
    search). Groups are counted by todo_counts, a subject's todos along todos_by_subject."""
    if selection.q is not None:
        return None
    clause, scope = scope_clause(principal)
    if selection.subject is not None:
        where, args = _conditions(selection, clause, scope)
        since = " AND created_at >= ?" if selection.since is not None else ""
        return txn.one(f"SELECT count(*) FROM (SELECT 1 FROM todos WHERE subject_key = ?{since} AND {where} LIMIT ?)"
                       f" AS matched", (selection.subject, *([selection.since] if since else []), *args, most + 1))[0]
    if selection.since is not None:
        return None
    where, args = _conditions(selection, clause, scope)
    return txn.one(f"SELECT coalesce(sum(n), 0) FROM todo_counts WHERE n > 0 AND {where}", args)[0]


def matching_ids(txn: Txn, principal: Principal, selection: Selection, most: int) -> tuple[list[str], bool]:
    """Up to `most` ids the selection matches, newest first, and whether there were more."""
    found: list[str] = []
    after: tuple[int, str] | None = None
    while True:
        page, after = select_page(txn, principal, selection, most + 1 - len(found), after)
        found += page
        if after is None or len(found) > most:
            return found[:most], len(found) > most


def list_todos(txn: Txn, principal: Principal, query: TodoListQuery) -> dict:
    """Newest first, a page at a time (`next_cursor`). The page is picked from the index (select_page) and only
    its todos are read whole, with their events' bodies: a list reads a page of todos, never every todo."""
    if principal.kind == "endpoint":
        principal.require_verb("list_todos")
    page, after = select_page(txn, principal, Selection.of(query), query.limit, query.after)
    rows = txn.all(f"SELECT * FROM todo_rows WHERE id IN ({', '.join('?' * len(page))})"
                   f" ORDER BY created_at DESC, id DESC", page) if page else []
    return {"todos": [todo_view(r) for r in rows], "next_cursor": f"{after[0]}.{after[1]}" if after else None}


def get_todo(txn: Txn, principal: Principal, todo_id: str) -> dict:
    if principal.kind == "endpoint":
        principal.require_verb("get_todo")
    view = todo_view(load_todo(txn, principal, todo_id, "todo_rows"))
    view["attempts"] = [attempt_view(a) for a in txn.all(
        "SELECT * FROM attempts WHERE todo_id = ? ORDER BY seq", (todo_id,))]
    view["history"] = [
        {"at": iso(h["at"]), "actor": h["actor"], "from": h["from_state"], "to": h["to_state"],
         "evidence": stored_json(h["evidence"])}
        for h in txn.all("SELECT * FROM todo_history WHERE todo_id = ? ORDER BY id", (todo_id,))]
    view["depends_on"] = [d["depends_on_id"] for d in txn.all(
        "SELECT depends_on_id FROM todo_deps WHERE todo_id = ? ORDER BY depends_on_id", (todo_id,))]
    receipt = txn.one("SELECT id FROM receipts WHERE todo_id = ? ORDER BY written_at DESC, id DESC LIMIT 1",
                      (todo_id,)) or txn.one("SELECT receipt_id AS id FROM receipt_items WHERE todo_id = ?", (todo_id,))
    view["receipt"] = receipt_view(txn, receipt["id"]) if receipt else None
    view["outputs"] = outputs_of(txn, todo_id)
    return view


def receipt_view(txn: Txn, receipt_id: str) -> dict:
    row = txn.one("SELECT * FROM receipts WHERE id = ?", (receipt_id,))
    return {"id": row["id"], "todo_id": row["todo_id"], "attempt_seq": row["attempt_seq"],
            "absorbed": [r["todo_id"] for r in txn.all(
                "SELECT i.todo_id FROM receipt_items i JOIN todos t ON t.id = i.todo_id WHERE i.receipt_id = ?"
                " ORDER BY t.created_at, t.rowid", (receipt_id,))],
            "written_at": iso(row["written_at"])}
