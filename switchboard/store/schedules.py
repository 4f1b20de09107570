"""Schedules: a human's recurring work for one of their endpoints (cron in a time zone, or every N seconds), and
the leader's tick that makes each due time's todo once.

A schedule's `next_run_at` is the earliest due time not yet made into a todo. The tick reads the due schedules
locked (others' locks skipped), makes the todos and moves `next_run_at` on in the same transaction,
compare-and-set on the value it read: a due time is made once, across restarts and across processes, and a new
leader starts from exactly where the last commit left off (it neither skips nor repeats a time).

Cron is evaluated by cronsim in the schedule's zone (zoneinfo), as Debian's cron does across daylight-saving
changes: a job at a fixed hour and minute whose time does not exist (the spring-forward hour) runs once, at the
first minute after the change; one whose time happens twice (the fall-back hour) runs once, the first time; a job
with a wildcard hour or minute (`0 * * * *`) runs at every matching wall-clock time that exists, in real time
order, so each real hour (both 02:00s of a fall-back night, no 02:00 on a spring-forward one)."""

from __future__ import annotations

import collections
import json
import sqlite3
from datetime import datetime
from zoneinfo import ZoneInfo

from cronsim import CronSim

from switchboard.configuration import TERMINAL_STATES, ApiError, iso
from switchboard.crypto import new_id
from switchboard.database import Txn
from switchboard.models import ScheduleCreate, ScheduleUpdate
from switchboard.store.principals import Principal, own_endpoint
from switchboard.store.todos import dump_json
from switchboard.store.transitions import create_todo, record_event

MAX_SCHEDULES_PER_ENDPOINT = 100
# The most todos one schedule makes in one tick: `catch_up: all` after a long downtime makes the latest this many.
CATCH_UP_MAX = 100
# A due time the tick reaches later than this was missed (the server was down, or no process led): the schedule's
# catch_up decides. Within it, a late tick (a busy loop, a leader taking over) makes every due time it finds.
MISSED_AFTER_MS = 30_000
# Windows back from now in which the latest cron times are looked for, narrowest first: a cron's times are walked
# forward through the narrowest window that holds enough of them, never through the whole of a long downtime.
_LOOK_BACK_MS = (3_600_000, 86_400_000, 32 * 86_400_000, 367 * 86_400_000)


def schedule_view(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "endpoint_id": row["endpoint_id"], "name": row["name"], "queue": row["queue"],
            "title": row["title"], "cron": row["cron"], "every_seconds": row["every_seconds"],
            "timezone": row["timezone"], "catch_up": row["catch_up"], "enabled": bool(row["enabled"]),
            "next_run_at": iso(row["next_run_at"]), "last_run_at": iso(row["last_run_at"]),
            "last_todo_id": row["last_todo_id"], "created_at": iso(row["created_at"])}


# -- due times --------------------------------------------------------------------------------------

def _cron_after(cron: str, zone: str, after_ms: int) -> int | None:
    """The first time the cron names strictly after `after_ms`, in ms; None when it names none in 50 years."""
    times = CronSim(cron, datetime.fromtimestamp(after_ms // 1000, ZoneInfo(zone)))
    # cronsim walks a fixed-time job in wall-clock time: from the second pass of a fall-back hour it would answer
    # that hour's first pass, which is past; the next time after that is the one meant.
    for moment in times:
        moment_ms = int(moment.timestamp()) * 1000
        if moment_ms > after_ms:
            return moment_ms
    return None


def next_after(row: sqlite3.Row | dict, after_ms: int) -> int | None:
    """A schedule's first due time strictly after `after_ms`. An every-N-seconds schedule keeps the phase of its
    `anchor` (its current next_run_at): its times are anchor + k·N."""
    if row["cron"] is not None:
        return _cron_after(row["cron"], row["timezone"], after_ms)
    period = row["every_seconds"] * 1000
    anchor = row["next_run_at"]
    return anchor + ((after_ms - anchor) // period + 1) * period


def latest_due(row: sqlite3.Row, first_ms: int, now_ms: int, most: int) -> list[int]:
    """The latest `most` due times in [first_ms, now_ms], oldest first (first_ms is itself a due time)."""
    if row["every_seconds"] is not None:
        period = row["every_seconds"] * 1000
        count = (now_ms - first_ms) // period + 1
        return [first_ms + k * period for k in range(max(0, count - most), count)]
    for back in _LOOK_BACK_MS:
        start = max(first_ms, now_ms - back)
        found = _cron_times(row, start, first_ms, now_ms, most)
        if len(found) == most or start == first_ms:
            return found
    return _cron_times(row, first_ms, first_ms, now_ms, most)


def _cron_times(row: sqlite3.Row, start_ms: int, first_ms: int, now_ms: int, most: int) -> list[int]:
    """The latest `most` of a cron's times in [start_ms, now_ms], walked forward from start_ms."""
    found: collections.deque[int] = collections.deque(maxlen=most)
    moment = start_ms if start_ms == first_ms else _cron_after(row["cron"], row["timezone"], start_ms - 1000)
    while moment is not None and moment <= now_ms:
        found.append(moment)
        moment = _cron_after(row["cron"], row["timezone"], moment)
    return list(found)


# -- the human's verbs ------------------------------------------------------------------------------

def _own_schedule(txn: Txn, principal: Principal, schedule_id: str) -> sqlite3.Row:
    principal.require_human("managing schedules")
    row = txn.one(f"SELECT s.* FROM schedules s WHERE s.id = ? AND EXISTS (SELECT 1 FROM endpoints e"
                  f" WHERE e.id = s.endpoint_id AND (e.human_id = ? OR ? = 1)){txn.for_update}",
                  (schedule_id, principal.human_id, principal.kind == "operator"))
    if row is None:
        raise ApiError("not_found", f"no schedule {schedule_id}")
    return row


def _in_scope(endpoint: sqlite3.Row, queue: str) -> None:
    if queue not in json.loads(endpoint["queues"]):
        raise ApiError("invalid_argument", f"queue: {queue} is outside the endpoint's scope")


def _work_item(body: ScheduleCreate | ScheduleUpdate) -> str | None:
    return body.work_item.model_dump_json(by_alias=True, exclude_none=True) if body.work_item else None


def _first_due(row: dict, now_ms: int) -> int | None:
    """When a schedule made or resumed now is first due: its next cron time, or one period from now."""
    if row["cron"] is not None:
        return _cron_after(row["cron"], row["timezone"], now_ms)
    return now_ms + row["every_seconds"] * 1000


def create_schedule(txn: Txn, principal: Principal, endpoint_id: str, body: ScheduleCreate) -> dict:
    principal.require_human("managing schedules")
    endpoint = own_endpoint(txn, principal, endpoint_id)
    if endpoint["revoked_at"] is not None:
        raise ApiError("conflict", f"endpoint {endpoint_id} is revoked")
    _in_scope(endpoint, body.queue)
    txn.lock_key("schedules", endpoint_id)  # the count and the name below, against a create beside this one
    if txn.one("SELECT 1 FROM schedules WHERE endpoint_id = ? AND name = ?", (endpoint_id, body.name)):
        raise ApiError("conflict", f"name: endpoint {endpoint_id} has a schedule named {body.name!r} already")
    if txn.one("SELECT count(*) FROM schedules WHERE endpoint_id = ?", (endpoint_id,))[0] >= MAX_SCHEDULES_PER_ENDPOINT:
        raise ApiError("conflict", f"endpoint {endpoint_id} has {MAX_SCHEDULES_PER_ENDPOINT} schedules, the most"
                                   " it may have")
    row = {"id": new_id("sc"), "endpoint_id": endpoint_id, "name": body.name, "queue": body.queue,
           "title": body.title, "cron": body.cron, "every_seconds": body.every_seconds, "timezone": body.timezone,
           "payload": dump_json(body.payload, "payload"), "work_item": _work_item(body), "priority": body.priority,
           "catch_up": body.catch_up, "enabled": int(body.enabled), "next_run_at": None, "last_run_at": None,
           "last_todo_id": None, "created_at": txn.now, "updated_at": txn.now}
    row["next_run_at"] = _first_due(row, txn.now) if body.enabled else None
    txn.execute(f"INSERT INTO schedules ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", tuple(row.values()))
    txn.logs.append(f"schedule {row['id']} made on {endpoint_id} by {principal.actor}")
    return schedule_view(row)


def list_schedules(txn: Txn, principal: Principal, endpoint_id: str) -> dict:
    principal.require_human("managing schedules")
    own_endpoint(txn, principal, endpoint_id)
    rows = txn.all("SELECT * FROM schedules WHERE endpoint_id = ? ORDER BY created_at, id", (endpoint_id,))
    return {"schedules": [schedule_view(row) for row in rows]}


def board_schedules(txn: Txn, principal: Principal) -> dict:
    """Every schedule of the human's endpoints (the Board's page), with its endpoint's name and whether the last
    todo it made is still there to link to."""
    rows = txn.all("SELECT s.*, e.name AS endpoint_name, (SELECT 1 FROM todos t WHERE t.id = s.last_todo_id)"
                   " AS last_todo_kept FROM schedules s JOIN endpoints e ON e.id = s.endpoint_id"
                   " WHERE e.human_id = ? ORDER BY e.name, s.name", (principal.human_id,))
    return {"schedules": [{**schedule_view(row), "endpoint_name": row["endpoint_name"],
                           "last_todo_kept": row["last_todo_kept"] is not None} for row in rows]}


def update_schedule(txn: Txn, principal: Principal, schedule_id: str, body: ScheduleUpdate) -> dict:
    """Change any of a schedule's fields. A new timing (cron, every_seconds, timezone) or a resume starts from now:
    the next due time is the first after this moment. Pausing clears next_run_at: a disabled schedule makes
    nothing, and on resume nothing it would have made meanwhile."""
    current = _own_schedule(txn, principal, schedule_id)
    given = body.model_fields_set
    row = dict(current)
    for name in ("name", "queue", "title", "timezone", "priority", "catch_up"):
        if name in given:
            row[name] = getattr(body, name)
    if body.cron is not None:
        row.update(cron=body.cron, every_seconds=None)
    elif body.every_seconds is not None:
        row.update(cron=None, every_seconds=body.every_seconds)
    if "payload" in given:
        row["payload"] = dump_json(body.payload, "payload")
    if "work_item" in given:
        row["work_item"] = _work_item(body)
    if "enabled" in given:
        row["enabled"] = int(body.enabled)
    if "queue" in given:
        _in_scope(own_endpoint(txn, principal, row["endpoint_id"]), row["queue"])
    if row["name"] != current["name"] and txn.one("SELECT 1 FROM schedules WHERE endpoint_id = ? AND name = ?",
                                                  (row["endpoint_id"], row["name"])):
        raise ApiError("conflict", f"name: endpoint {row['endpoint_id']} has a schedule named {row['name']!r}"
                                   " already")
    retimed = any(row[name] != current[name] for name in ("cron", "every_seconds", "timezone", "enabled"))
    if not row["enabled"]:
        row["next_run_at"] = None
    elif retimed:
        row["next_run_at"] = _first_due(row, txn.now)
    row["updated_at"] = txn.now
    changed = ("name", "queue", "title", "cron", "every_seconds", "timezone", "payload", "work_item", "priority",
               "catch_up", "enabled", "next_run_at", "updated_at")
    txn.execute(f"UPDATE schedules SET {', '.join(f'{name} = ?' for name in changed)} WHERE id = ?",
                (*(row[name] for name in changed), schedule_id))
    txn.logs.append(f"schedule {schedule_id} changed by {principal.actor}")
    return schedule_view(row)


def delete_schedule(txn: Txn, principal: Principal, schedule_id: str) -> dict:
    row = _own_schedule(txn, principal, schedule_id)
    txn.execute("DELETE FROM schedules WHERE id = ?", (schedule_id,))
    txn.logs.append(f"schedule {schedule_id} removed by {principal.actor}")
    return {**schedule_view(row), "removed": True}


# -- the leader's tick ------------------------------------------------------------------------------

def run_due_schedules(txn: Txn, limit: int = 100) -> int:
    """Make the todos of every schedule that is due, each due time once; how many todos it made. A schedule
    another transaction holds (a human changing it, another process's tick) is passed by: its holder moves it."""
    made = 0
    for schedule in txn.all(f"SELECT * FROM schedules WHERE enabled = 1 AND next_run_at <= ?"
                            f" ORDER BY next_run_at LIMIT ?{txn.skip_locked}", (txn.now, limit)):
        made += _run_schedule(txn, schedule)
    return made


def _run_schedule(txn: Txn, schedule: sqlite3.Row) -> int:
    endpoint = txn.one("SELECT * FROM endpoints WHERE id = ?", (schedule["endpoint_id"],))
    if endpoint["revoked_at"] is not None:  # a revoked endpoint takes no more work: its schedules stop
        txn.execute("UPDATE schedules SET enabled = 0, next_run_at = NULL, updated_at = ? WHERE id = ?",
                    (txn.now, schedule["id"]))
        txn.logs.append(f"schedule {schedule['id']} disabled: endpoint {endpoint['id']} is revoked")
        return 0
    first = schedule["next_run_at"]
    if txn.now - first <= MISSED_AFTER_MS:
        due = latest_due(schedule, first, txn.now, CATCH_UP_MAX)
    elif schedule["catch_up"] == "all":
        due = latest_due(schedule, first, txn.now, CATCH_UP_MAX)
    elif schedule["catch_up"] == "latest":
        due = latest_due(schedule, first, txn.now, 1)
    else:
        due = []
    following = next_after(schedule, txn.now)
    last_todo_id = schedule["last_todo_id"]
    made = []
    for due_at in due:
        todo_id = _make_todo(txn, schedule, endpoint, due_at)
        if todo_id is not None:
            made.append(todo_id)
            last_todo_id = todo_id
    # Compare-and-set on the due time read: the row is locked, so it holds; were it not, nothing above commits.
    if not txn.execute("UPDATE schedules SET next_run_at = ?, last_run_at = ?, last_todo_id = ?, updated_at = ?"
                       " WHERE id = ? AND next_run_at = ? AND enabled = 1",
                       (following, due[-1] if due else schedule["last_run_at"], last_todo_id, txn.now,
                        schedule["id"], first)).rowcount:
        raise ApiError("conflict", f"schedule {schedule['id']} moved under its tick")
    if txn.now - first > MISSED_AFTER_MS:
        txn.logs.append(f"schedule {schedule['id']} missed its due times since {iso(first)}: catch_up"
                        f" {schedule['catch_up']} made {len(made)} todo(s)")
    return len(made)


def _make_todo(txn: Txn, schedule: sqlite3.Row, endpoint: sqlite3.Row, due_at: int) -> str | None:
    """One due time's todo (source and trust mode `schedule`, idempotency key schedule:{id}:{due time}); None when
    a live todo holds that key already."""
    key = f"schedule:{schedule['id']}:{iso(due_at)}"
    if txn.one(f"SELECT 1 FROM todos WHERE endpoint_id = ? AND idempotency_key = ? AND state NOT IN"
               f" {TERMINAL_STATES}", (endpoint["id"], key)):
        return None
    payload = {"schedule_id": schedule["id"], "due_at": iso(due_at),
               **(json.loads(schedule["payload"]) if schedule["payload"] else {})}
    work_item = json.loads(schedule["work_item"]) if schedule["work_item"] else None
    subject = f"schedule:{schedule['id']}"
    trace = json.dumps({"stage": "schedule", "schedule_id": schedule["id"], "due_at": iso(due_at)})
    event_id, todo_id = new_id("ev"), new_id("td")
    record_event(txn, event_id, human_id=endpoint["human_id"], source="schedule", kind="schedule",
                 trust_mode="schedule", verified=True, body=json.dumps(payload), disposition="routed", trace=trace,
                 subject_key=subject)
    create_todo(txn, todo_id, "system", endpoint_id=endpoint["id"], queue=schedule["queue"], title=schedule["title"],
                source="schedule", kind="schedule", trace=trace, event_id=event_id, subject_key=subject,
                work_item=schedule["work_item"], idempotency_key=key, priority=schedule["priority"],
                gated=int(bool(work_item and "review" in (work_item.get("approval_gates") or []))))
    return todo_id


# When the next schedule is due, from schedules_due alone (a scalar subquery of next_due's one statement)
NEXT_SCHEDULE_MOMENT = "(SELECT min(next_run_at) FROM schedules WHERE enabled = 1)"
