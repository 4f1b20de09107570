"""The schema and its numbered migrations: schema.sql applied to a new file, MIGRATIONS[v] taking a file
from user_version v to v + 1."""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass, field

from switchboard.configuration import SCHEMA_PATH, SCHEMA_VERSION, ApiError


@dataclass(frozen=True)
class Migration:
    """Upgrades a database from user_version v to v + 1. SQLite cannot change a CHECK in place, so a table whose
    constraints changed is rebuilt from its definition in schema.sql, copying the columns both versions have;
    `fill` gives SQL expressions (over the old row) for new columns that need a value. A nullable column without
    a constraint is added in place instead (`add`: table -> columns) where an earlier step's rebuild did not make
    it already, so a large table is not copied for it. Then schema.sql runs again (every statement is
    idempotent), which adds new tables and indexes. `before` runs first, on the old tables, and `after` last, for
    changes to the data itself."""
    summary: str
    rebuild: tuple[str, ...] = ()
    add: dict[str, tuple[str, ...]] = field(default_factory=dict)
    fill: dict[str, dict[str, str]] = field(default_factory=dict)
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()


# What migration 6 fills the subjects' counts with: schema.sql's triggers' cases, over a todo `t`.
_OPEN = "CASE WHEN t.state IN ('done', 'failed', 'cancelled') THEN 0 ELSE 1 END"
_WAITING = ("CASE WHEN t.state IN ('quarantined', 'needs_input', 'blocked', 'review')"
            " OR (t.state = 'failed' AND t.dead_letter = 1) OR (t.state = 'pending' AND t.queue = 'hold')"
            " THEN 1 ELSE 0 END")


def _latest(*paths: str) -> str:
    """The first of the envelope's `paths` that the latest stored delivery about a subject has."""
    found = ", ".join(f"json_extract(v.envelope, '$.{path}')" for path in paths)
    return (f"SELECT coalesce({found}, NULL) FROM events v WHERE v.subject_key = subjects.key"
            f" AND v.envelope IS NOT NULL ORDER BY v.received_at DESC, v.id DESC LIMIT 1")


# Explicit, ordered migrations: MIGRATIONS[v] upgrades a database from user_version v to v + 1.
MIGRATIONS: dict[int, Migration] = {
    1: Migration(
        "release 2: webhooks gain trusted_actors (existing forge and cairn webhooks keep receiving everything:"
        " allow_all) and pinged_at; events may be pings; new tables for Board sessions, notification channels,"
        " the notification outbox and replays; indexes of events by webhook and of open todos",
        rebuild=("webhooks", "events"),
        fill={"webhooks": {"trusted_actors": "CASE WHEN provider IN ('github', 'gitea', 'cairn')"
                                             " THEN '{\"allow_all\": true}' END"}}),
    2: Migration(
        "release 3: each delivery's body is stored once, in event_bodies: envelopes lose their copies of the"
        " payload and headers and todos theirs of the payload (read from the body and the event's headers; a todo"
        " whose event was already pruned keeps its payload)",
        rebuild=("events",),
        before=("UPDATE events SET envelope = json_remove(envelope, '$.payload', '$.headers') WHERE envelope IS NOT NULL",),
        after=("UPDATE todos SET payload = NULL WHERE payload IS NOT NULL"
               " AND event_id IN (SELECT event_id FROM event_bodies)",)),
    3: Migration(
        "release 3: the global index of leases goes (the per-endpoint one serves the reaper too, over the few"
        " claimed todos), so a claim and a completion each write one page fewer",
        before=("DROP INDEX IF EXISTS todos_lapsed",)),
    4: Migration(
        "webhooks gain a name their human may set (existing webhooks have none until then)",
        rebuild=("webhooks",)),
    5: Migration(
        "flat cost as the work grows: todos are counted by group (endpoint, queue, state) in todo_counts, kept by"
        " triggers, and indexed by group for every state (todos_by_state replaces the open-only todos_open), so"
        " the Board's counts and pages and the todo list read a page's worth, not every todo",
        before=("DROP INDEX IF EXISTS todos_open",),
        # The counts of the todos already there (the triggers count every change from here on).
        after=("DELETE FROM todo_counts",
               "INSERT INTO todo_counts (endpoint_id, queue, state, n, changes)"
               " SELECT endpoint_id, queue, state, count(*), count(*) FROM todos GROUP BY endpoint_id, queue, state")),
    6: Migration(
        "humans gain a login an identity proxy may sign them in by (serve --auth-header; none until the operator"
        " sets one with `human set-login`)",
        rebuild=("humans",)),
    7: Migration(
        "queue control: queue_controls holds each endpoint's queue pauses and admission caps (every queue starts"
        " open and uncapped), and todos_by_subject indexes the todos by subject for the filtered todo list"),
    8: Migration(
        "work items you can follow: subjects (one row per human and subject, with the counts its list filters on,"
        " kept by triggers), events gain their subject_key and todos an index by subject, done todos are counted"
        " by the minute for the queues page; forge connections, webhooks' connections and output policies, the"
        " outputs outbox and the status comments",
        add={"events": ("subject_key",)},
        after=(
            "UPDATE events SET subject_key = json_extract(envelope, '$.subject_key')"
            " WHERE envelope IS NOT NULL AND json_extract(envelope, '$.subject_key') IS NOT NULL",
            # The counts as the triggers keep them from here on (the same cases as theirs, summed).
            f"INSERT INTO subjects (human_id, key, open_todos, waiting_todos, state, first_seen_at, last_activity_at)"
            f" SELECT e.human_id, t.subject_key, sum({_OPEN}), sum({_WAITING}),"
            f" CASE WHEN sum({_WAITING}) > 0 THEN 'waiting' WHEN sum({_OPEN}) > 0 THEN 'open' ELSE 'done' END,"
            f" min(t.created_at), max(max(t.updated_at), min(t.created_at))"
            f" FROM todos t JOIN endpoints e ON e.id = t.endpoint_id WHERE t.subject_key IS NOT NULL"
            f" GROUP BY e.human_id, t.subject_key",
            "INSERT INTO subjects (human_id, key, first_seen_at, last_activity_at)"
            " SELECT human_id, subject_key, min(received_at), max(received_at) FROM events"
            " WHERE subject_key IS NOT NULL GROUP BY human_id, subject_key"
            " ON CONFLICT (human_id, key) DO UPDATE SET"
            " first_seen_at = min(first_seen_at, excluded.first_seen_at),"
            " last_activity_at = max(last_activity_at, excluded.last_activity_at)",
            # Title, link and labels as the latest stored delivery about the subject gave them.
            f"UPDATE subjects SET title = ({_latest('issue.title', 'artifact.title')}),"
            f" url = ({_latest('issue.url', 'artifact.url')}), labels = coalesce(({_latest('issue.labels')}), '[]')",
            "INSERT INTO todo_done_minutes (endpoint_id, queue, minute, n)"
            " SELECT endpoint_id, queue, updated_at / 60000, count(*) FROM todos WHERE state = 'done'"
            " AND updated_at >= CAST(strftime('%s', 'now') AS INTEGER) * 1000 - 86400000"
            " GROUP BY endpoint_id, queue, updated_at / 60000")),
}

# Columns that moved to a table of their own: (table, column) -> (new table, the copy). Whichever migration first
# rebuilds the table without the column (release 1's files meet it in their first step) makes the new table from
# schema.sql and copies the column into it before the old table goes.
MOVED_COLUMNS: dict[tuple[str, str], tuple[str, str]] = {
    ("events", "body"): ("event_bodies",
                         "INSERT INTO event_bodies (event_id, body) SELECT id, body FROM events WHERE body IS NOT NULL"),
}


def apply_schema(conn: sqlite3.Connection) -> int:
    """Create a fresh database or migrate an older one; refuse a newer one. Returns the version."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise ApiError("unavailable", f"database schema {version} is newer than this program ({SCHEMA_VERSION})")
    if version == SCHEMA_VERSION:
        return version
    statements = _split_sql(SCHEMA_PATH.read_text())
    # Rebuilding a table must not fire its foreign keys (a DROP would cascade); they are checked at the end.
    conn.execute("PRAGMA foreign_keys=OFF")
    try:
        conn.execute("BEGIN IMMEDIATE")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            for statement in statements:
                conn.execute(statement)
            version = SCHEMA_VERSION
        while version < SCHEMA_VERSION:
            _migrate(conn, MIGRATIONS[version], statements)
            version += 1
        if conn.execute("PRAGMA foreign_key_check").fetchone() is not None:
            raise sqlite3.IntegrityError("a migration left a dangling foreign key")
        conn.execute(f"PRAGMA user_version={version}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    finally:
        conn.execute("PRAGMA foreign_keys=ON")
    return version


def pending_migrations(conn: sqlite3.Connection) -> list[dict]:
    """What opening this database with this program would change, without changing it."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version == 0:
        return [{"from": 0, "to": SCHEMA_VERSION, "summary": "create the schema"}]
    return [{"from": v, "to": v + 1, "summary": MIGRATIONS[v].summary, "rebuilds": list(MIGRATIONS[v].rebuild)}
            for v in range(version, SCHEMA_VERSION)]


def _migrate(conn: sqlite3.Connection, migration: Migration, statements: list[str]) -> None:
    tables = {m.group(1): s for s in statements
              if (m := re.search(r"^CREATE TABLE IF NOT EXISTS (\w+)", s, re.MULTILINE))}
    # Views come back with schema.sql at the end of the step; a table rebuilt under one could not be renamed.
    for (view,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'view'").fetchall():
        conn.execute(f"DROP VIEW {view}")
    for statement in migration.before:
        conn.execute(statement)
    for table in migration.rebuild:
        old_columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
        conn.execute(tables[table].replace(f"CREATE TABLE IF NOT EXISTS {table} ", f"CREATE TABLE {table}__new ", 1))
        new_columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table}__new)")]
        for column in (c for c in old_columns if c not in new_columns and (table, c) in MOVED_COLUMNS):
            target, copy = MOVED_COLUMNS[(table, column)]
            conn.execute(tables[target])
            conn.execute(copy)
        fill = migration.fill.get(table, {})
        columns = [c for c in new_columns if c in old_columns or c in fill]
        values = [fill.get(c, c) for c in columns]
        conn.execute(f"INSERT INTO {table}__new ({', '.join(columns)}) SELECT {', '.join(values)} FROM {table}")
        conn.execute(f"DROP TABLE {table}")
        conn.execute(f"ALTER TABLE {table}__new RENAME TO {table}")
    # Every step runs today's schema.sql, whose indexes may name a column a later step adds in place: such columns
    # are added first, whichever step this is (the later step's `after` still fills them).
    for table, columns in (item for later in MIGRATIONS.values() for item in later.add.items()):
        present = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        for column in (c for c in columns if present and c not in present):
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column}")
    for statement in statements:
        conn.execute(statement)
    for statement in migration.after:
        conn.execute(statement)


def _split_sql(script: str) -> list[str]:
    """Split a schema script into statements (sqlite3.complete_statement knows where each ends)."""
    statements, current = [], []
    for line in script.splitlines():
        current.append(line)
        text = "\n".join(current)
        if sqlite3.complete_statement(text):
            if text.strip() and not all(line.strip().startswith("--") or not line.strip() for line in current):
                statements.append(text)
            current = []
    return statements
