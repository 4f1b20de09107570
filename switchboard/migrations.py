"""The schema and its one numbered list of migrations, for both engines: a new database gets the whole schema
file of its engine (schema.sql, schema.postgres.sql) at SCHEMA_VERSION; MIGRATIONS[v] takes an existing one from
version v to v + 1, in its SQLite form or its Postgres form. Each step runs in a transaction of its own and is
recorded in schema_history (the version it reached, what it did, when), which `check` shows.

Adding a step: schema.sql and schema.postgres.sql take the new form (they stay what a new database is made of),
SCHEMA_VERSION goes up by one, and MIGRATIONS gets the entry for the version before it, with both forms. A
database migrated step by step must equal a new one on either engine (tests/test_migrations_both_engines.py)."""

from __future__ import annotations

import re
import sqlite3
import time
from dataclasses import dataclass, field

from switchboard.configuration import SCHEMA_PATH, SCHEMA_VERSION, ApiError

# Postgres came with the fourth release, at schema 9: no Postgres database is older, so the steps before it have
# no Postgres form, and every step from it on has one.
POSTGRES_FIRST_VERSION = 9
# What schema_history says of a database made whole at its version.
CREATED = "a new database: the whole schema"
# A step recorded (on both engines; Postgres's dialect takes the placeholders). A version already recorded is
# recorded again: a file set back by hand to an older version and migrated anew.
RECORD_STEP = ("INSERT INTO schema_history (version, summary, applied_at) VALUES (?, ?, ?) ON CONFLICT (version)"
               " DO UPDATE SET summary = excluded.summary, applied_at = excluded.applied_at")


@dataclass(frozen=True)
class Migration:
    """Upgrades a database from user_version v to v + 1. SQLite cannot change a CHECK in place, so a table whose
    constraints changed is rebuilt from its definition in schema.sql, copying the columns both versions have;
    `fill` gives SQL expressions (over the old row) for new columns that need a value. A nullable column without
    a constraint is added in place instead (`add`: table -> column definitions, `name TYPE`) where an earlier
    step's rebuild did not make it already, so a large table is not copied for it. Then schema.sql runs again
    (every statement is idempotent), which adds new tables and indexes. `before` runs first, on the old tables,
    and `after` last, for
    changes to the data itself.

    `postgres` is the same step on Postgres: statements run in order in the step's transaction (PostgreSQL changes
    a CHECK or a column in place, so each says exactly what changes). None before POSTGRES_FIRST_VERSION only;
    a step with nothing to change on Postgres says so with ()."""
    summary: str
    rebuild: tuple[str, ...] = ()
    add: dict[str, tuple[str, ...]] = field(default_factory=dict)
    fill: dict[str, dict[str, str]] = field(default_factory=dict)
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    postgres: tuple[str, ...] | None = None


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


# Migration 11: every copy of a signed body but the earliest gives up its hash (events_body still serves the
# lookup), so the unique index can be built on a database that stored one body twice.
_SIGNED_BODY_ONCE = (
    "UPDATE events SET body_hash = NULL WHERE webhook_id IS NOT NULL AND trust_mode = 'signed'"
    " AND body_hash IS NOT NULL AND EXISTS (SELECT 1 FROM events f WHERE f.webhook_id = events.webhook_id"
    " AND f.trust_mode = 'signed' AND f.body_hash = events.body_hash"
    " AND (f.received_at, f.rowid) < (events.received_at, events.rowid))",
    "DROP INDEX IF EXISTS events_body",
    "CREATE UNIQUE INDEX IF NOT EXISTS events_signed_body ON events(webhook_id, body_hash)"
    " WHERE webhook_id IS NOT NULL AND trust_mode = 'signed'")

# schema.postgres.sql's todo_rows, made again by a step that adds columns to todos (its `t.*` was fixed when made).
_TODO_ROWS_VIEW = (
    "CREATE VIEW todo_rows AS SELECT t.*, t.rowid AS todo_rowid,"
    " (SELECT b.body FROM event_bodies b WHERE b.event_id = t.event_id) AS event_body,"
    " (SELECT replace(e.envelope, '\\u0000', '\\ufffd')::json ->> 'content_type' FROM events e"
    " WHERE e.id = t.event_id) AS event_content_type FROM todos t")

# Postgres's switchboard_confirm, as schema.postgres.sql makes it (migration 13).
_CONFIRM_FUNCTION = """CREATE OR REPLACE FUNCTION switchboard_confirm(holds boolean, what text) RETURNS boolean
    LANGUAGE plpgsql AS $$
BEGIN
    IF holds IS NOT TRUE THEN
        RAISE EXCEPTION 'switchboard_confirm: % changed', what;
    END IF;
    RETURN true;
END $$"""

# Explicit, ordered migrations: MIGRATIONS[v] upgrades a database from version v to v + 1. Steps 1 to 8 are SQLite's
# alone (no Postgres database was ever older than 9).
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
    9: Migration(
        "each migration step is recorded in schema_history (the version it reached, what it did, when), which"
        " `check` shows",
        postgres=("CREATE TABLE schema_history (version BIGINT PRIMARY KEY, summary TEXT NOT NULL,"
                  " applied_at BIGINT NOT NULL)",)),
    10: Migration(
        "outputs can be held: outputs_hold's one row stops every forge output, status comment and notification"
        " until `outputs resume` (every backup's copy is born held)",
        postgres=("CREATE TABLE outputs_hold (scope TEXT PRIMARY KEY CHECK (scope = 'all'), since BIGINT NOT NULL,"
                  " reason TEXT NOT NULL CHECK (length(reason) BETWEEN 1 AND 512))",)),
    11: Migration(
        "one event per signed body: the unique index events_signed_body replaces events_body, so the same body"
        " delivered at once to two processes under two delivery ids is recorded once (an older copy of a body"
        " already stored twice keeps its row but gives up its hash: the dedup answers from the earliest)",
        before=_SIGNED_BODY_ONCE, postgres=_SIGNED_BODY_ONCE),
    12: Migration(
        "the fifth release. The forge steers the work: webhooks' connections name their commanders (`commands`,"
        " nobody until set), an event's disposition may be `command`, forge_reactions acknowledges each command on"
        " its comment, and subject_links keeps the pull requests that close issues. Time: schedules (an event's"
        " trust mode may be `schedule`); queue_controls keep wait_limits, and todos when their wait comes due"
        " (wait_due_at, indexed where set) and the reminders sent in their state. Keys: queue_controls keep a"
        " limit of claimed todos per subject or repository (per_key, per_key_max). Traces: todos keep their W3C"
        " traceparent, attempts their span id, forge outputs the trace they belong to",
        rebuild=("events", "webhook_connections", "queue_controls"),
        add={"todos": ("wait_due_at INTEGER", "wait_reminders INTEGER", "traceparent TEXT"),
             "attempts": ("span_id TEXT",), "forge_outputs": ("traceparent TEXT",)},
        postgres=(
            "ALTER TABLE events DROP CONSTRAINT events_disposition_check",
            "ALTER TABLE events ADD CONSTRAINT events_disposition_check CHECK (disposition IN ('routed', 'dropped',"
            " 'repeat', 'quarantined', 'ping', 'command'))",
            "ALTER TABLE events DROP CONSTRAINT events_trust_mode_check",
            "ALTER TABLE events ADD CONSTRAINT events_trust_mode_check CHECK (trust_mode IN ('signed', 'token',"
            " 'operator', 'schedule'))",
            "ALTER TABLE todos ADD COLUMN wait_due_at BIGINT",
            "ALTER TABLE todos ADD COLUMN wait_reminders BIGINT",
            "ALTER TABLE todos ADD COLUMN traceparent TEXT",
            "ALTER TABLE attempts ADD COLUMN span_id TEXT",
            "ALTER TABLE forge_outputs ADD COLUMN traceparent TEXT",
            "ALTER TABLE queue_controls ADD COLUMN wait_limits TEXT",
            "ALTER TABLE queue_controls ADD COLUMN per_key TEXT CHECK (per_key IN ('subject', 'repo'))",
            "ALTER TABLE queue_controls ADD COLUMN per_key_max BIGINT CHECK (per_key_max >= 1)",
            "CREATE INDEX todos_wait_due ON todos(wait_due_at) WHERE wait_due_at IS NOT NULL",
            # The view fixed todos' columns when it was made: it is made again over the new ones.
            "DROP VIEW todo_rows",
            _TODO_ROWS_VIEW,
            "CREATE TABLE schedules (id TEXT PRIMARY KEY CHECK (id LIKE 'sc\\_%' ESCAPE '\\'),"
            " endpoint_id TEXT NOT NULL REFERENCES endpoints(id),"
            " name TEXT NOT NULL CHECK (length(name) BETWEEN 1 AND 128),"
            " queue TEXT NOT NULL CHECK (length(queue) BETWEEN 1 AND 64),"
            " title TEXT NOT NULL CHECK (length(title) BETWEEN 1 AND 512),"
            " cron TEXT CHECK (cron IS NULL OR length(cron) BETWEEN 9 AND 256),"
            " every_seconds BIGINT CHECK (every_seconds IS NULL OR every_seconds >= 1),"
            " timezone TEXT NOT NULL CHECK (length(timezone) BETWEEN 1 AND 64),"
            " payload TEXT CHECK (payload IS NULL OR switchboard_json_valid(payload)),"
            " work_item TEXT CHECK (work_item IS NULL OR switchboard_json_valid(work_item)),"
            " priority BIGINT NOT NULL DEFAULT 0,"
            " catch_up TEXT NOT NULL CHECK (catch_up IN ('latest', 'none', 'all')),"
            " enabled BIGINT NOT NULL CHECK (enabled IN (0, 1)), next_run_at BIGINT, last_run_at BIGINT,"
            " last_todo_id TEXT, created_at BIGINT NOT NULL, updated_at BIGINT NOT NULL,"
            " CHECK ((cron IS NULL) <> (every_seconds IS NULL)), CHECK (enabled = 1 OR next_run_at IS NULL),"
            " UNIQUE (endpoint_id, name))",
            "CREATE INDEX schedules_due ON schedules(next_run_at) WHERE enabled = 1",
            "ALTER TABLE webhook_connections ADD COLUMN commands TEXT CHECK (commands IS NULL OR"
            " (switchboard_json_valid(commands) AND switchboard_json_type(commands) = 'object'))",
            "CREATE TABLE forge_reactions (event_id TEXT PRIMARY KEY REFERENCES events(id) ON DELETE CASCADE,"
            " connection_id TEXT REFERENCES forge_connections(id) ON DELETE SET NULL, subject_key TEXT NOT NULL,"
            " repo TEXT NOT NULL, comment_id TEXT NOT NULL CHECK (length(comment_id) BETWEEN 1 AND 32),"
            " content TEXT NOT NULL CHECK (content IN ('+1', 'confused')),"
            " state TEXT NOT NULL CHECK (state IN ('pending', 'sent', 'failed')), error TEXT,"
            " attempts BIGINT NOT NULL DEFAULT 0 CHECK (attempts >= 0), next_at BIGINT NOT NULL,"
            " created_at BIGINT NOT NULL, sent_at BIGINT, CHECK ((state = 'sent') = (sent_at IS NOT NULL)),"
            " CHECK (state <> 'failed' OR error IS NOT NULL), CHECK (state <> 'pending' OR connection_id IS NOT NULL))",
            "CREATE INDEX forge_reactions_pending ON forge_reactions(next_at) WHERE state = 'pending'",
            "CREATE TABLE subject_links (human_id TEXT NOT NULL REFERENCES humans(id) ON DELETE CASCADE,"
            " pull_key TEXT NOT NULL CHECK (length(pull_key) BETWEEN 1 AND 4096),"
            " issue_key TEXT NOT NULL CHECK (length(issue_key) BETWEEN 1 AND 4096), event_id TEXT,"
            " linked_at BIGINT NOT NULL, PRIMARY KEY (human_id, pull_key, issue_key))",
            "CREATE INDEX subject_links_by_issue ON subject_links(human_id, issue_key, pull_key)")),
    13: Migration(
        "Postgres at speed: switchboard_confirm, the statement with which a transaction checks what its process"
        " remembered (a token's principal, a read found empty) in the flight of its COMMIT. SQLite: nothing changes",
        postgres=(_CONFIRM_FUNCTION,)),
}

# Columns that moved to a table of their own: (table, column) -> (new table, the copy). Whichever migration first
# rebuilds the table without the column (release 1's files meet it in their first step) makes the new table from
# schema.sql and copies the column into it before the old table goes.
MOVED_COLUMNS: dict[tuple[str, str], tuple[str, str]] = {
    ("events", "body"): ("event_bodies",
                         "INSERT INTO event_bodies (event_id, body) SELECT id, body FROM events WHERE body IS NOT NULL"),
}


def apply_schema(conn: sqlite3.Connection, migrations: dict[int, Migration] = MIGRATIONS,
                 latest: int = SCHEMA_VERSION) -> int:
    """Create a fresh database whole, or bring an older one to `latest` one step at a time, each step in a
    transaction of its own (BEGIN IMMEDIATE: another process migrating waits, then finds the steps done) and
    recorded. A step that fails rolls back itself alone: the file stays at the last step that succeeded. A
    database newer than this program is refused. Returns the version."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    _refuse_newer(version, latest)
    if version == latest:
        return version
    statements = _split_sql(SCHEMA_PATH.read_text())
    # Rebuilding a table must not fire its foreign keys (a DROP would cascade); each step checks them at its end.
    conn.execute("PRAGMA foreign_keys=OFF")
    try:
        while version < latest:
            conn.execute("BEGIN IMMEDIATE")
            try:
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                _refuse_newer(version, latest)
                if version < latest:
                    version = _apply_step(conn, version, migrations, latest, statements)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
    finally:
        conn.execute("PRAGMA foreign_keys=ON")
    return version


def _apply_step(conn: sqlite3.Connection, version: int, migrations: dict[int, Migration], latest: int,
                statements: list[str]) -> int:
    """One step inside the caller's transaction: the whole schema for a new file, else MIGRATIONS[version].
    Returns the version it reached, recorded in schema_history and user_version."""
    if version == 0:
        for statement in statements:
            conn.execute(statement)
        reached, summary = latest, CREATED
    else:
        _migrate(conn, migrations[version], statements, migrations)
        reached, summary = version + 1, migrations[version].summary
    if conn.execute("PRAGMA foreign_key_check").fetchone() is not None:
        raise sqlite3.IntegrityError(f"migration {version} -> {reached} left a dangling foreign key")
    conn.execute(RECORD_STEP, (reached, summary, int(time.time() * 1000)))
    conn.execute(f"PRAGMA user_version={reached}")
    return reached


def _refuse_newer(version: int, latest: int) -> None:
    if version > latest:
        raise ApiError("unavailable", f"the database is schema {version}, newer than this program's ({latest}): run"
                                      " the newer release, or restore a backup made before the upgrade")


def pending_migrations(version: int, engine: str = "sqlite") -> list[dict]:
    """The steps that would bring a database at `version` to SCHEMA_VERSION, without taking them; on SQLite, with
    the tables each step copies whole."""
    if version == 0:
        return [{"from": 0, "to": SCHEMA_VERSION, "summary": "create the schema"}]
    return [{"from": v, "to": v + 1, "summary": MIGRATIONS[v].summary,
             **({"rebuilds": list(MIGRATIONS[v].rebuild)} if engine == "sqlite" else {})}
            for v in range(version, SCHEMA_VERSION)]


def _migrate(conn: sqlite3.Connection, migration: Migration, statements: list[str],
             migrations: dict[int, Migration]) -> None:
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
    for table, columns in (item for later in migrations.values() for item in later.add.items()):
        present = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        for column in (c for c in columns if present and c.split()[0] not in present):
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
