"""The hot queries keep their plans: a page of work costs the same at any size (issue 30, point 4).

Each hot store function (the human's todo list, the Board's counts, inbox, queues and endpoints, a claim, a
scheduler tick, the metrics' queue stats, a step of retention) runs against a database built through the store as
tests/bench/bench_scale.py builds its own (signed deliveries with their bodies, a third done, every kind of waiting
work, held deliveries), with every statement it runs recorded; each statement that reads todos is then run again
under EXPLAIN QUERY PLAN. A plan fails when it scans the todos (or another large table) or sorts every todo it
reads in a temporary B-tree, unless what it reads is bounded by construction (a key, or the few claimed todos).
Plans are checked as SQLite makes them without statistics (a served database has none) and after ANALYZE. A
second test counts the SQLite virtual machine's steps for the same calls at two sizes: they must not grow with
the todos. A third checks that todo_counts, which those calls read instead of counting todos, is the todos
counted, after a migration from each earlier release and after every kind of change.
"""

from __future__ import annotations

import re
import shutil
import sqlite3
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
import bench_scale  # noqa: E402

from switchboard.board.forge_pages import board_subject  # noqa: E402
from switchboard.board.queries import board_counts, board_endpoints, board_inbox, board_queues, board_todos  # noqa: E402
from switchboard.configuration import SCHEMA_VERSION, Clock  # noqa: E402
from switchboard.database import Txn, connect  # noqa: E402
from switchboard.migrations import apply_schema  # noqa: E402
from switchboard.models import (  # noqa: E402
    BulkAction,
    ClaimNext,
    QueueLimits,
    QueuePause,
    QueueResume,
    SubjectListQuery,
    TodoListQuery,
)
from switchboard.store.bulk import bulk_dry_run  # noqa: E402
from switchboard.store.principals import Principal, authenticate  # noqa: E402
from switchboard.store.queues import pause_queue, resume_queue, set_queue_limits  # noqa: E402
from switchboard.store.subjects import get_subject, list_subjects  # noqa: E402
from switchboard.store.todos import Selection, list_todos  # noqa: E402
from switchboard.store.transitions import claim_next  # noqa: E402
from switchboard.store.upkeep import prune_batch, queue_stats, scheduler_tick  # noqa: E402

SMALL, LARGE = 600, 2_400
# Tables a plan may scan: a few rows each, whatever the work.
SMALL_TABLES = {"endpoints", "humans", "webhooks", "webhook_routes", "todo_counts", "board_sessions",
                "notify_channels", "friend_edges"}
# Partial indexes that hold only work few todos are in at once (the claimed ones, the open attempts).
BOUNDED_INDEXES = {"todos_lapsed_by_endpoint", "attempts_open"}
TODO_TABLES = ("todos", "todo_rows")


class Recording:
    """A connection that remembers every statement run through it, with its parameters."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn
        self.statements: list[tuple[str, tuple]] = []

    def execute(self, sql: str, params=()):
        self.statements.append((sql, tuple(params)))
        return self.conn.execute(sql, params)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def _principals(conn: sqlite3.Connection, made: dict) -> tuple[Principal, Principal]:
    txn = Txn(conn, Clock().now_ms(), True)
    human = authenticate(txn, made["human"]["token"])
    return human, authenticate(txn, made["endpoint"]["token"])


def _calls(human: Principal, endpoint: Principal) -> dict:
    """The hot calls: (function of a Txn, whether it writes, so runs in a transaction rolled back after)."""
    def dead_letters_after_the_first(txn):
        first = board_inbox(txn, human, "dead", None)["groups"][0]["items"][0]
        return board_inbox(txn, human, "dead", (first["created_at"], first["id"]))

    def finished_work_past_a_cursor(txn):
        first = list_todos(txn, human, TodoListQuery(state="done,failed,cancelled", limit=10))
        return list_todos(txn, human, TodoListQuery(state="done,failed,cancelled", cursor=first["next_cursor"]))

    def claims_from_a_capped_and_a_paused_queue(txn):
        """Caps set, a claim under them (counted in its window), then the queue paused, a claim refused, and
        resumed: it rings for what waited, as many as its caps now admit (a few, at any size)."""
        set_queue_limits(txn, human, endpoint.id, "inbox",
                         QueueLimits.model_validate({"max_in_flight": 20, "max_claims_per_window": {
                             "count": 10, "window_seconds": 3600}}))
        claim_next(txn, endpoint, ClaimNext(queue="inbox"))
        pause_queue(txn, human, endpoint.id, "inbox", QueuePause())
        claim_next(txn, endpoint, ClaimNext(queue="inbox"))
        return resume_queue(txn, human, endpoint.id, "inbox", QueueResume())

    def batch_claims_under_a_per_key_limit(txn):
        """A per-key limit of one, two claims of eight: the second passes over the subjects the first holds."""
        set_queue_limits(txn, human, endpoint.id, "inbox", QueueLimits.model_validate(
            {"max_in_flight_per_key": {"key": "subject", "max": 1}}))
        claim_next(txn, endpoint, ClaimNext(queue="inbox", max_todos=8))
        return claim_next(txn, endpoint, ClaimNext(queue="inbox", max_todos=8))

    return {
        "the human's list of a queue": (lambda txn: list_todos(txn, human, TodoListQuery(queue="inbox")), False),
        "the human's list of a state": (lambda txn: list_todos(txn, human, TodoListQuery(state="failed")), False),
        "the human's whole list": (lambda txn: list_todos(txn, human, TodoListQuery(limit=200)), False),
        "the human's finished work past a cursor": (finished_work_past_a_cursor, False),
        "the human's list of a subject": (lambda txn: list_todos(txn, human, TodoListQuery(
            subject="github:Codertocat/Hello-World#7", state="done,pending")), False),
        "a title search": (lambda txn: list_todos(txn, human, TodoListQuery(q="Hello-World#7:")), False),
        "the Board's todo list of done work": (lambda txn: board_todos(txn, human, Selection(states=("done",)), None),
                                               False),
        "a bulk dry run by filter": (lambda txn: bulk_dry_run(txn, human, BulkAction(
            action="retry", filter={"state": "failed,done"})), False),
        "claims from a capped and a paused queue": (claims_from_a_capped_and_a_paused_queue, True),
        "the endpoint's own list": (lambda txn: list_todos(txn, endpoint, TodoListQuery()), False),
        "the Board's counts": (lambda txn: board_counts(txn, human), False),
        "the inbox, every group": (lambda txn: board_inbox(txn, human, None, None), False),
        "the inbox, held": (lambda txn: board_inbox(txn, human, "held", None), False),
        "the inbox, dead letters past a cursor": (dead_letters_after_the_first, False),
        "the queues page": (lambda txn: board_queues(txn, human, None), False),
        "the endpoints page": (lambda txn: board_endpoints(txn, human), False),
        "the metrics' queue stats": (queue_stats, False),
        "a claim": (lambda txn: claim_next(txn, endpoint, ClaimNext(queue="inbox")), True),
        "batch claims under a per-key limit": (batch_claims_under_a_per_key_limit, True),
        "a scheduler tick": (scheduler_tick, True),
        "a step of retention": (prune_batch, True),
    }


def _run(conn: sqlite3.Connection, call, writes: bool) -> list[tuple[str, tuple]]:
    recording = Recording(conn)
    if writes:
        conn.execute("BEGIN IMMEDIATE")
    try:
        call(Txn(recording, Clock().now_ms(), True))
    finally:
        if writes:
            conn.execute("ROLLBACK")
    return recording.statements


def _problems(conn: sqlite3.Connection, sql: str, params: tuple) -> list[str]:
    """What is wrong with the plan of one statement that reads todos."""
    plan = [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params)]
    # A derived table (a CO-ROUTINE or a MATERIALIZE, whose own reads are checked line by line) is scanned whole.
    materialized = {line.split()[1] for line in plan if line.startswith(("MATERIALIZE ", "CO-ROUTINE "))}
    bad = []
    for line in plan:
        scanned = re.match(r"SCAN (\S+)(.*)", line)
        if scanned and not (scanned[1] in SMALL_TABLES or scanned[1] in materialized or scanned[1] == "CONSTANT"
                            or scanned[1].startswith("(") or any(i in scanned[2] for i in BOUNDED_INDEXES)):
            bad.append(line)
    sorts = [line for line in plan if re.match(r"USE TEMP B-TREE FOR (ORDER BY|GROUP BY|DISTINCT)", line)]
    # A sort is over a bounded set when every todo the statement reads is read by its key, or is a claimed one.
    reads = [line for line in plan if re.match(r"(SEARCH|SCAN) (todos|t)\b", line)]
    keyed = all(re.search(r"\((rowid|id)=\?\)|INTEGER PRIMARY KEY|sqlite_autoindex_todos_1", line) for line in reads)
    if sorts and not keyed and "state = 'claimed'" not in sql:
        bad += sorts
    return [f"{line}    in: {' '.join(sql.split())[:220]}" for line in bad]


def _plans(path: str, made: dict) -> dict[str, list[str]]:
    conn = connect(path)
    try:
        human, endpoint = _principals(conn, made)
        found = {}
        for name, (call, writes) in _calls(human, endpoint).items():
            statements = _run(conn, call, writes)
            assert statements, name
            found[name] = [problem for sql, params in statements if any(t in sql for t in TODO_TABLES)
                           and sql.lstrip().upper().startswith(("SELECT", "UPDATE", "DELETE"))
                           for problem in _problems(conn, sql, params)]
        return found
    finally:
        conn.close()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("plans")
    out = {}
    for n in (SMALL, LARGE):
        path = str(folder / f"scale-{n}.db")
        out[n] = (path, bench_scale.build(path, n))
    return out


@pytest.mark.parametrize("statistics", [False, True], ids=["as served", "after ANALYZE"])
def test_no_hot_query_scans_or_sorts_every_todo(built, tmp_path, statistics):
    path, made = built[LARGE]
    if statistics:
        copy = str(tmp_path / "analyzed.db")
        shutil.copy(path, copy)
        conn = sqlite3.connect(copy)
        conn.execute("ANALYZE")
        conn.close()
        path = copy
    problems = {name: lines for name, lines in _plans(path, made).items() if lines}
    assert not problems, "plans that read every todo:\n" + "\n".join(
        f"{name}:\n  " + "\n  ".join(lines) for name, lines in problems.items())


def test_the_plans_use_the_indexes_meant_for_them(built):
    path, made = built[LARGE]
    conn = connect(path)
    try:
        human, endpoint = _principals(conn, made)
        calls = _calls(human, endpoint)

        def plan(name: str, containing: str) -> str:
            sql, params = next((s, p) for s, p in _run(conn, *calls[name]) if containing in s)
            return "\n".join(row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params))

        assert "INDEX todos_claimable" in plan("a claim", "state = 'pending' AND queue IN")
        assert "INDEX todos_by_state (endpoint_id=? AND state=? AND queue=?)" in plan(
            "the human's list of a queue", "ORDER BY created_at DESC, id DESC LIMIT")
        assert "INDEX sqlite_autoindex_todos_1 (id=?)" in plan("the human's list of a queue", "FROM todo_rows WHERE id IN")
        assert "INDEX todos_by_state (endpoint_id=? AND state=? AND queue=?)" in plan(
            "the inbox, held", "ORDER BY created_at ASC, id ASC")
        assert "todo_counts" in plan("the Board's counts", "todo_counts")
        assert [s for s, _ in _run(conn, *calls["the Board's counts"]) if "FROM todos" in s] == [
            "SELECT count(*), max(updated_at) FROM todos INDEXED BY todos_lapsed_by_endpoint WHERE endpoint_id IN"
            " (SELECT id FROM endpoints WHERE human_id = ?) AND state = 'claimed'"], "they read only the claimed todos"
        assert "INDEX todos_finished" in plan("a step of retention", "FROM todos")
        assert "INDEX todos_by_subject (subject_key=?)" in plan("the human's list of a subject", "subject_key = ?")
        assert "INDEX todos_by_state (endpoint_id=? AND state=? AND queue=?)" in plan(
            "the human's finished work past a cursor", "ORDER BY created_at DESC, id DESC")
        assert "INDEX todos_claimable" in plan("claims from a capped and a paused queue", "ORDER BY priority DESC,"
                                                                                        " created_at, id LIMIT")
        # A per-key limit reads the queue's claimed todos alone (a few, at any size) by todos_by_state.
        assert "INDEX todos_by_state (endpoint_id=? AND state=? AND queue=?)" in plan(
            "batch claims under a per-key limit", "subject_key IS NOT NULL")
        assert "INDEX todos_claimable" in plan("batch claims under a per-key limit", "AND NOT ((queue = ?")
    finally:
        conn.close()


def test_a_hot_call_costs_the_same_with_four_times_the_todos(built):
    """SQLite's virtual machine steps per call, at SMALL and at LARGE todos: flat, where a scan or a sort of every
    todo would grow fourfold."""
    steps = {}
    for n, (path, made) in built.items():
        conn = connect(path)
        counted = [0]

        def count() -> int:
            counted[0] += 1
            return 0

        conn.set_progress_handler(count, 100)
        try:
            human, endpoint = _principals(conn, made)
            for name, (call, writes) in _calls(human, endpoint).items():
                if name in ("a scheduler tick", "a bulk dry run by filter"):
                    # The one rings what came due, a number that grows with the todos (500 a tick at most); the
                    # other reads every todo its filter matches (10,000 a call at most).
                    continue
                counted[0] = 0
                _run(conn, call, writes)
                steps.setdefault(name, {})[n] = counted[0] * 100
        finally:
            conn.close()
    grown = {name: by for name, by in steps.items() if by[LARGE] > 1.5 * by[SMALL] + 2_000}
    assert not grown, f"steps grew with the todos ({SMALL} -> {LARGE}): {grown}"


_COUNTED = ("SELECT endpoint_id, queue, state, count(*) FROM todos GROUP BY endpoint_id, queue, state"
            " ORDER BY endpoint_id, queue, state")
_KEPT = "SELECT endpoint_id, queue, state, n FROM todo_counts WHERE n > 0 ORDER BY endpoint_id, queue, state"


@pytest.mark.parametrize("release", ["release1", "release2"])
def test_todo_counts_are_the_todos_counted_after_a_migration_and_every_change(built, tmp_path, release):
    """The counts the Board, the lists and the metrics read are the todos counted: filled by the migration from an
    older release, and kept by the triggers through every transition the build made (claims, completions,
    failures, questions, reviews, deferrals, reroutes, held deliveries) and through retention's deletes."""
    fixture = Path(__file__).resolve().parent / "fixtures" / release / f"{release}.db"
    shutil.copy(fixture, tmp_path / "old.db")
    conn = connect(str(tmp_path / "old.db"))
    assert apply_schema(conn) == SCHEMA_VERSION
    assert [tuple(r) for r in conn.execute(_KEPT)] == [tuple(r) for r in conn.execute(_COUNTED)] != []
    conn.close()
    path, _ = built[LARGE]
    copy = str(tmp_path / "built.db")
    shutil.copy(path, copy)
    conn = connect(copy)
    assert [tuple(r) for r in conn.execute(_KEPT)] == [tuple(r) for r in conn.execute(_COUNTED)]
    conn.execute("UPDATE todos SET updated_at = updated_at - 40 * 86400000 WHERE state = 'done'")
    txn = Txn(conn, Clock().now_ms(), True)
    conn.execute("BEGIN IMMEDIATE")
    assert prune_batch(txn)["todos"] > 0
    conn.execute("COMMIT")
    assert [tuple(r) for r in conn.execute(_KEPT)] == [tuple(r) for r in conn.execute(_COUNTED)]
    conn.close()


# -- subjects (issue 36): their list and page read a page's worth at any size -----------------------------------

# The large tables a subject's calls read besides the todos: none may be scanned, whatever the plan's table name.
SUBJECT_TABLES = ("todos", "todo_rows", "events", "subjects", "todo_history", "forge_outputs", "receipts",
                  "attempts")


def _subject_calls(human: Principal, endpoint: Principal, key: str) -> dict:
    return {
        "the subjects list": lambda txn: list_subjects(txn, human, SubjectListQuery()),
        "the subjects list of a state": lambda txn: list_subjects(txn, human, SubjectListQuery(state="waiting")),
        "the subjects list's second page": lambda txn: list_subjects(txn, human, SubjectListQuery(
            cursor=list_subjects(txn, human, SubjectListQuery(limit=5))["next_cursor"])),
        "a subject's page": lambda txn: get_subject(txn, human, key),
        "a subject's page for an endpoint": lambda txn: get_subject(txn, endpoint, key),
        "the Board's subject page": lambda txn: board_subject(txn, human, key),
    }


def _subject_problems(conn: sqlite3.Connection, sql: str, params: tuple) -> list[str]:
    """_problems, where a sort of the todos read through todos_by_subject (one subject's few) is bounded too."""
    plan = [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params)]
    reads = [line for line in plan if re.match(r"(SEARCH|SCAN) (todos|t)\b", line)]
    by_subject = reads and all("todos_by_subject (subject_key=?)" in line for line in reads)
    return [p for p in _problems(conn, sql, params) if not (by_subject and p.startswith("USE TEMP B-TREE"))]


def _a_subject(path: str) -> str:
    """A subject in the middle of the built database: a todo done, the ones about it in every state."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT subject_key FROM todos WHERE state = 'done' ORDER BY created_at DESC"
                            " LIMIT 1").fetchone()[0]
    finally:
        conn.close()


@pytest.mark.parametrize("statistics", [False, True], ids=["as served", "after ANALYZE"])
def test_no_subject_call_scans_or_sorts_a_large_table(built, tmp_path, statistics):
    path, made = built[LARGE]
    if statistics:
        copy = str(tmp_path / "analyzed.db")
        shutil.copy(path, copy)
        conn = sqlite3.connect(copy)
        conn.execute("ANALYZE")
        conn.close()
        path = copy
    conn = connect(path)
    try:
        human, endpoint = _principals(conn, made)
        problems = {}
        for name, call in _subject_calls(human, endpoint, _a_subject(path)).items():
            statements = _run(conn, call, False)
            found = [problem for sql, params in statements if any(t in sql for t in SUBJECT_TABLES)
                     and sql.lstrip().upper().startswith("SELECT") for problem in _subject_problems(conn, sql, params)]
            if found:
                problems[name] = found
    finally:
        conn.close()
    assert not problems, "plans that read every row:\n" + "\n".join(
        f"{name}:\n  " + "\n  ".join(lines) for name, lines in problems.items())


def test_a_subject_call_costs_the_same_with_four_times_the_todos(built):
    steps = {}
    for n, (path, made) in built.items():
        key = _a_subject(path)
        conn = connect(path)
        counted = [0]

        def count() -> int:
            counted[0] += 1
            return 0

        conn.set_progress_handler(count, 100)
        try:
            human, endpoint = _principals(conn, made)
            for name, call in _subject_calls(human, endpoint, key).items():
                counted[0] = 0
                _run(conn, call, False)
                steps.setdefault(name, {})[n] = counted[0] * 100
        finally:
            conn.close()
    grown = {name: by for name, by in steps.items() if by[LARGE] > 1.5 * by[SMALL] + 2_000}
    assert not grown, f"steps grew with the todos ({SMALL} -> {LARGE}): {grown}"


def test_the_subjects_counts_are_the_todos_counted_after_every_change(built):
    """What the subjects list filters on is kept by triggers through every transition the build made."""
    path, _ = built[LARGE]
    conn = sqlite3.connect(path)
    try:
        kept = conn.execute("SELECT human_id, key, open_todos, waiting_todos, state FROM subjects ORDER BY 1, 2").fetchall()
        counted = conn.execute(
            "SELECT e.human_id, t.subject_key, sum(t.state NOT IN ('done', 'failed', 'cancelled')),"
            " sum(t.state IN ('quarantined', 'needs_input', 'blocked', 'review') OR (t.state = 'failed' AND"
            " t.dead_letter = 1) OR (t.state = 'pending' AND t.queue = 'hold')) AS waiting, NULL"
            " FROM todos t JOIN endpoints e ON e.id = t.endpoint_id WHERE t.subject_key IS NOT NULL"
            " GROUP BY 1, 2 ORDER BY 1, 2").fetchall()
    finally:
        conn.close()
    assert [r[:4] for r in kept] == [r[:4] for r in counted] and len(kept) > LARGE // 2
    assert {r[4] for r in kept} == {"open", "waiting", "done"}
    assert all(r[4] == ("waiting" if r[3] else "open" if r[2] else "done") for r in kept)
