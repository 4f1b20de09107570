"""Bulk actions: one human action (retry, cancel, reroute, defer, discard, approve) on many todos, by id or by
filter, a dry run unless asked to act. Acting runs in short steps, each its own transaction (the writer is never
held long), and each todo's action on its own: one its state no longer allows is skipped and counted by state."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from switchboard.configuration import BULK_MAX, RESERVED_QUEUES, ApiError
from switchboard.database import Row, Txn
from switchboard.models import BulkAction, Cancel, Defer, HumanNote, Reroute
from switchboard.store.human_actions import (
    ACTION_STATES,
    approve,
    cancel,
    defer,
    discard,
    reroute,
    reroute_target,
    retry,
)
from switchboard.store.principals import Principal
from switchboard.store.todos import Selection, matching_ids, scope_clause

BULK_STEP_MS = 5  # one step holds the writer about this long at most, then commits
BULK_STEP_TODOS = 250  # ... and acts on at most this many todos
# Between two steps the writer is left to everything else this long (a third of the time is the bulk action's), as
# retention's steps do: deliveries queued meanwhile commit without waiting behind the next step.
BULK_PAUSE_MS = 10


def step_pacing(one_writer: bool) -> tuple[float | None, float]:
    """A step's time budget and the pause after it, in ms. SQLite's one writer is shared by everything, so a step
    holds it briefly and then lets go; Postgres runs writers side by side and a step locks only its own todos, so
    there a step takes BULK_STEP_TODOS without a clock and the next follows at once."""
    return (BULK_STEP_MS, BULK_PAUSE_MS) if one_writer else (None, 0)


# Each action alone, without the todo's view its single call answers with
ACTIONS: dict[str, Callable] = {"retry": retry.act, "cancel": cancel.act, "reroute": reroute.act, "defer": defer.act,
                                "discard": discard.act, "approve": approve.act}


def item_body(body: BulkAction) -> HumanNote | Cancel | Defer | Reroute:
    """What the single action takes, from the bulk call's fields: the reason is the cancel's or the deferral's
    reason and the others' note."""
    if body.action == "cancel":
        return Cancel(reason=body.reason)
    if body.action == "defer":
        return Defer(reason=body.reason, until=body.until)
    if body.action == "reroute":
        return Reroute(queue=body.queue)
    return HumanNote(note=body.reason)


@dataclass
class Matches:
    """The todos a bulk call takes, newest first: their ids (an id the caller cannot see stays, as not found),
    the rows of those it can see, and whether a filter matched more than BULK_MAX."""
    ids: list[str]
    rows: dict[str, Row]
    truncated: bool


def bulk_matches(txn: Txn, principal: Principal, body: BulkAction) -> Matches:
    """(A read.) The ids given, or up to BULK_MAX the filter matches, confined to what the principal may see."""
    principal.require_human("bulk actions")
    if body.ids is not None:
        ids, truncated = list(dict.fromkeys(body.ids)), False
    else:
        ids, truncated = matching_ids(txn, principal, Selection.of(body.filter), BULK_MAX)
    clause, scope = scope_clause(principal)
    # One keyed read each (a list of ids would let the planner prefer a scan of a small table).
    sql = f"SELECT id, state, endpoint_id, queue, event_id FROM todos WHERE id = ? AND {clause}"
    found = (txn.one(sql, (todo_id, *scope)) for todo_id in ids)
    return Matches(ids, {row["id"]: row for row in found if row is not None}, truncated)


def _answer(body: BulkAction, matched: int, acted: int, skipped: collections.Counter, truncated: bool) -> dict:
    return {"dry_run": body.dry_run, "action": body.action, "matched": matched, "acted": acted,
            "skipped": dict(sorted(skipped.items())), "truncated": truncated}


def bulk_dry_run(txn: Txn, principal: Principal, body: BulkAction) -> dict:
    """(A read.) What acting would do: how many it would act on, and how many it would skip, by state. A todo is
    counted as acted on when its state allows the action and, for a retry, its endpoint is live, for a reroute, a
    live endpoint of its human takes the queue (what the action itself checks first)."""
    matches = bulk_matches(txn, principal, body)
    skipped: collections.Counter = collections.Counter()
    revoked = {row["id"] for row in txn.all("SELECT id FROM endpoints WHERE revoked_at IS NOT NULL")}
    acted = 0
    for todo_id in matches.ids:
        row = matches.rows.get(todo_id)
        if row is None:
            skipped["not_found"] += 1
        elif _would_act(txn, body, row, revoked):
            acted += 1
        else:
            skipped[row["state"]] += 1
    return _answer(body, len(matches.ids), acted, skipped, matches.truncated)


def _would_act(txn: Txn, body: BulkAction, row: Row, revoked: set[str]) -> bool:
    if row["state"] not in ACTION_STATES[body.action]:
        return False
    if body.action == "retry":
        return row["endpoint_id"] not in revoked
    if body.action == "reroute":
        if body.queue in RESERVED_QUEUES:
            return False
        try:
            reroute_target(txn, row, body.queue)
        except ApiError:
            return False
    return True


def bulk_step(txn: Txn, principal: Principal, body: BulkAction, ids: list[str], budget_ms: float | None) -> dict:
    """(A write.) Act on the first of `ids` until BULK_STEP_TODOS or `budget_ms`: each todo through the very
    function its single action runs, in a savepoint of its own; one the action refuses (its state moved on since
    the match) is skipped, by the state it is in. `taken` says how many of `ids` this step went through."""
    principal.require_human("bulk actions")
    run, arguments = ACTIONS[body.action], item_body(body)
    clause, scope = scope_clause(principal)
    deadline = time.monotonic() + budget_ms / 1000 if budget_ms is not None else None
    acted, taken = 0, 0
    skipped: collections.Counter = collections.Counter()
    for todo_id in ids:
        if taken >= BULK_STEP_TODOS or (taken and deadline is not None and time.monotonic() >= deadline):
            break
        taken += 1
        txn.execute("SAVEPOINT bulk_todo")
        try:
            run(txn, principal, todo_id, arguments)
        except ApiError:
            # Refused (or not there for this human): the state it is in says which, read only for these
            txn.execute("ROLLBACK TO bulk_todo")
            row = txn.one(f"SELECT state FROM todos WHERE id = ? AND {clause}", (todo_id, *scope))
            skipped[row["state"] if row is not None else "not_found"] += 1
        else:
            acted += 1
        txn.execute("RELEASE bulk_todo")
    return {"taken": taken, "acted": acted, "skipped": dict(skipped)}


@dataclass
class BulkRun:
    """Acting on a bulk call's matches, step by step: whoever drives it (the server's flow, the CLI) writes
    `bulk_step` over `remaining` until nothing remains, adding each step's result."""
    body: BulkAction
    matches: Matches
    done: int = 0
    acted: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)

    @property
    def remaining(self) -> list[str]:
        return self.matches.ids[self.done:]

    def add(self, step: dict) -> None:
        self.done += step["taken"]
        self.acted += step["acted"]
        self.skipped.update(step["skipped"])

    def answer(self) -> dict:
        return _answer(self.body, len(self.matches.ids), self.acted, self.skipped, self.matches.truncated)
