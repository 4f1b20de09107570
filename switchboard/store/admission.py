"""Queue control as claims and rings meet it: whether a queue of an endpoint admits a claim now (its pause, its
caps), how many rings it may still send, and a claim counted against its window. The human's side (pause, resume,
limits, the queues' views) is store.queues."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from switchboard.configuration import iso
from switchboard.database import Row, Txn
from switchboard.envelope import parse_subject_key

# A queue without a row in queue_controls is open and uncapped: one indexed read (of no row) is all it costs a
# claim, a ring or a finished claim, and on Postgres not even a round trip (Txn.all_usually_none).


def window_start(row: Row, now: int) -> int:
    """Where the window holding `now` began: windows are fixed and aligned to the epoch."""
    return now - now % (row["window_seconds"] * 1000)


def claims_in_window(row: Row, now: int) -> int | None:
    """The claims counted in the window holding `now`, or None without a window cap."""
    if row["window_count"] is None:
        return None
    return row["window_claims"] if row["window_started_at"] == window_start(row, now) else 0


def window_end(row: Row, now: int) -> int | None:
    return window_start(row, now) + row["window_seconds"] * 1000 if row["window_count"] is not None else None


def is_paused(row: Row, now: int) -> bool:
    """Paused now: a pause whose `until` has passed is over, whether or not the scheduler has cleared it yet."""
    return row["paused_at"] is not None and (row["paused_until"] is None or row["paused_until"] > now)


def in_flight(txn: Txn, endpoint_id: str, queue: str) -> int:
    """The queue's claimed todos (todo_counts: one row). A lapsed lease counts until it is reaped."""
    row = txn.one("SELECT n FROM todo_counts WHERE endpoint_id = ? AND queue = ? AND state = 'claimed'",
                  (endpoint_id, queue))
    return row["n"] if row else 0


def key_group(per_key: str, subject_key: str | None) -> str | None:
    """What a per-key limit counts a todo under: its subject key (`subject`), or its repository with its provider
    (`repo`: `github:acme/site` for `github:acme/site#12` and `github:acme/site@refs/heads/main`). None: the
    limit does not bind the todo (no subject key, or under `repo` a key that names no repository)."""
    if subject_key is None or per_key == "subject":
        return subject_key
    repo = parse_subject_key(subject_key)["repo"]
    return f"{subject_key.partition(':')[0]}:{repo}" if repo is not None else None


def full_groups(txn: Txn, row: Row) -> set[str]:
    """The key groups of the queue at its per-key limit: its claimed todos' subject keys (a few: read through
    todos_by_state, by endpoint, state and queue), counted by group. A lapsed lease counts until it is reaped, as for max_in_flight."""
    if row["per_key"] is None:
        return set()
    counted = Counter(key_group(row["per_key"], r["subject_key"]) for r in txn.all(
        "SELECT subject_key FROM todos WHERE endpoint_id = ? AND queue = ? AND state = 'claimed'"
        " AND subject_key IS NOT NULL", (row["endpoint_id"], row["queue"])))
    return {group for group, n in counted.items() if group is not None and n >= row["per_key_max"]}


def in_groups(per_key: str, groups: Iterable[str]) -> tuple[str, tuple]:
    """SQL (and its parameters) true for a todo (of `todos`) whose key group is one of `groups`: a subject key
    among them, or a subject key about one of the repositories (`{group}#…` or `{group}@…`)."""
    groups = sorted(groups)
    # False, never null, for a todo without a subject key: `NOT` of it must keep that todo.
    if per_key == "subject":
        return f"(subject_key IS NOT NULL AND subject_key IN ({', '.join('?' * len(groups))}))", tuple(groups)
    terms = " OR ".join("substr(subject_key, 1, ?) IN (?, ?)" for _ in groups)
    return (f"(subject_key IS NOT NULL AND ({terms}))",
            tuple(p for g in groups for p in (len(g) + 1, f"{g}#", f"{g}@")))


def refusal(txn: Txn, row: Row) -> dict | None:
    """Why the queue admits no claim now, as a claim's `admission` names it ({queue, reason, until}), or None."""
    if is_paused(row, txn.now):
        return {"queue": row["queue"], "reason": "paused", "until": iso(row["paused_until"])}
    if row["max_in_flight"] is not None and in_flight(txn, row["endpoint_id"], row["queue"]) >= row["max_in_flight"]:
        return {"queue": row["queue"], "reason": "max_in_flight", "until": None}
    if row["window_count"] is not None and claims_in_window(row, txn.now) >= row["window_count"]:
        return {"queue": row["queue"], "reason": "max_claims_per_window", "until": iso(window_end(row, txn.now))}
    return None


def room(txn: Txn, row: Row) -> int | None:
    """How many more claims the queue admits now: 0 while paused or full, None when no cap bounds it."""
    if is_paused(row, txn.now):
        return 0
    bounds = []
    if row["max_in_flight"] is not None:
        bounds.append(row["max_in_flight"] - in_flight(txn, row["endpoint_id"], row["queue"]))
    if row["window_count"] is not None:
        bounds.append(row["window_count"] - claims_in_window(row, txn.now))
    return max(0, min(bounds)) if bounds else None


def control_row(txn: Txn, endpoint_id: str, queue: str) -> Row | None:
    rows = txn.all_usually_none("SELECT * FROM queue_controls WHERE endpoint_id = ? AND queue = ?",
                                (endpoint_id, queue))
    return rows[0] if rows else None


def ring_room(txn: Txn, endpoint_id: str, queue: str) -> int | None:
    """How many rings the queue may still send in this transaction: its room less the rings already queued for it
    here (a ring wakes one worker, and a worker woken for a slot that is not there only asks in vain). None: no
    bound; 0: the ring is withheld."""
    row = control_row(txn, endpoint_id, queue)
    return _rings_left(txn, row) if row is not None else None


def _rings_left(txn: Txn, row: Row) -> int | None:
    left = room(txn, row)
    if left is None:
        return None
    queued = sum(1 for ring in txn.rings if ring["endpoint_id"] == row["endpoint_id"] and ring["queue"] == row["queue"])
    return max(0, left - queued)


def withholds(txn: Txn, endpoint_id: str, queue: str, subject_key: str | None) -> bool:
    """Whether the queue withholds a ring for a todo now: it has no room for its ring (ring_room), or the todo's
    subject key (or repository) is at the queue's per-key limit."""
    row = control_row(txn, endpoint_id, queue)
    if row is None:
        return False
    if _rings_left(txn, row) == 0:
        return True
    group = key_group(row["per_key"], subject_key) if row["per_key"] is not None else None
    return group is not None and group in full_groups(txn, row)


def next_ring_at(row: Row, now: int) -> int | None:
    """When the scheduler must next ring for the queue: its pause ends, or its full window turns."""
    moments = []
    if is_paused(row, now) and row["paused_until"] is not None:
        moments.append(row["paused_until"])
    if row["window_count"] is not None and claims_in_window(row, now) >= row["window_count"]:
        moments.append(window_end(row, now))
    return min(moments, default=None)


@dataclass
class Admission:
    """The queues a claim named that admit it now (`open`, in the claim's order), why each other one does not
    (`refused`: the claim's `admission`), and the control rows read (to count the claim against its window)."""
    open: list[str]
    refused: list[dict] = field(default_factory=list)
    rows: dict[str, Row] = field(default_factory=dict)

    def passed_over(self, txn: Txn) -> tuple[str, tuple, list[str]]:
        """What a claim must pass over now under the open queues' per-key limits: SQL (with its parameters) true
        for a todo whose key group is full in its queue ("" when none is), and those queues. Read after admit()
        locked each queue, so claims racing for a key's last slot see each other's claims."""
        terms, params, queues = [], [], []
        for queue in self.open:
            row = self.rows.get(queue)
            full = full_groups(txn, row) if row is not None else set()
            if full:
                sql, values = in_groups(row["per_key"], full)
                terms.append(f"(queue = ? AND {sql})")
                params += [queue, *values]
                queues.append(queue)
        return (f"({' OR '.join(terms)})" if terms else "", tuple(params), queues)

    def count(self, txn: Txn, queue: str) -> None:
        """A claim was made from `queue`: it counts against the queue's window; the claim that fills the window
        asks the scheduler to ring when it turns."""
        row = self.rows.get(queue)
        if row is None or row["window_count"] is None:
            return
        start = window_start(row, txn.now)
        claims = (claims_in_window(row, txn.now) or 0) + 1
        due = row["ring_due_at"]
        if claims >= row["window_count"]:
            turn = start + row["window_seconds"] * 1000
            due = turn if due is None else min(due, turn)
        txn.execute("UPDATE queue_controls SET window_started_at = ?, window_claims = ?, ring_due_at = ?"
                    " WHERE endpoint_id = ? AND queue = ?", (start, claims, due, row["endpoint_id"], queue))


def _rows(read: Callable[[str, tuple], list[Row]], endpoint_id: str, queues: Iterable[str]) -> dict[str, Row]:
    """The control rows of the endpoint's `queues`, read by `read` (Txn.all, or Txn.all_usually_none)."""
    queues = list(queues)
    return {row["queue"]: row for row in read(
        f"SELECT * FROM queue_controls WHERE endpoint_id = ? AND queue IN ({', '.join('?' * len(queues))})",
        (endpoint_id, *queues))}


def admit(txn: Txn, endpoint_id: str, queues: list[str]) -> Admission:
    """Which of `queues` admit a claim now. Each queue under control is locked (lock_key) before its row is read
    again, always in the same order, so two claims racing for a cap's last slot pass one after the other and the
    second sees the first counted (SQLite's one writer runs them one after the other anyway)."""
    rows = _rows(txn.all_usually_none, endpoint_id, queues)
    if not rows:
        return Admission(list(queues))
    for queue in sorted(rows):
        txn.lock_key("queue", endpoint_id, queue)
    rows = _rows(txn.all, endpoint_id, sorted(rows))  # read for real: under the lock, what a claim goes by
    refused = [answer for queue in queues if queue in rows and (answer := refusal(txn, rows[queue]))]
    shut = {answer["queue"] for answer in refused}
    return Admission([queue for queue in queues if queue not in shut], refused, rows)
