"""One numbered list of migrations for both engines (SPEC 17): a database the fourth release wrote, on SQLite or on
Postgres, migrates in place step by step, keeps every row, token, secret and rule, and ends with the catalog of a
new database; each step is its own transaction, recorded and shown by `check`; a failing step rolls back alone;
two processes migrating at once apply each step once; a database newer than the program is refused. And
`migrate-to` copies only into an empty database, refusing one that holds another application's tables.

The fourth release's databases are in tests/fixtures/release4 (made by make_release4.py with release 4 itself):
release4.db, and for Postgres release 4's schema.postgres.sql with the rows release 4 wrote there."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import subprocess
import sys
import time
import uuid

import pytest
from conftest import ROOT
from producers import github
from starlette.testclient import TestClient

from switchboard.app import create_app
from switchboard.configuration import SCHEMA_VERSION, ApiError
from switchboard.engines import is_postgres, open_database
from switchboard.migrations import MIGRATIONS, POSTGRES_FIRST_VERSION, Migration, apply_schema

RELEASE4 = ROOT / "tests" / "fixtures" / "release4"
FACTS = json.loads((RELEASE4 / "release4.json").read_text())
MIGRATE_LOCK = 0x5357_4d49_4752  # switchboard.postgres.MIGRATE_LOCK, spelled out: the race holds it from outside

# The steps a database the fourth release wrote (schema 9) takes to this program's schema.
RELEASE4_STEPS = [(v, v + 1) for v in range(9, SCHEMA_VERSION)]


def run_cli(db: str, *args: str) -> tuple[int, dict]:
    """The real CLI, as an operator runs it, with --json (and no `init` first: these databases exist)."""
    done = subprocess.run([sys.executable, str(ROOT / "switchboard.py"), *args, "--db", db, "--json"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    # An answer is on stdout; an error is one JSON object on stderr.
    text = done.stdout.strip() or done.stderr.strip()
    return done.returncode, json.loads(text) if text.startswith("{") else {"stderr": done.stderr}


# -- a database as the fourth release left it, on the suite's engine ---------------------------------------------

def postgres_cluster(postgres_databases):
    if postgres_databases is None:
        pytest.skip("the Postgres run (SWITCHBOARD_TEST_ENGINE=postgres) runs it")
    return postgres_databases.cluster


def release4_postgres(cluster) -> str:
    """A Postgres database exactly as release 4 made and filled it: its switchboard_schema (made before the file,
    as release 4's engine did), its schema.postgres.sql, and the rows it wrote."""
    import psycopg

    url = cluster.create_database(f"release4_{uuid.uuid4().hex[:8]}")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE switchboard_schema (version INTEGER NOT NULL)")
        conn.execute((RELEASE4 / "schema.postgres.sql").read_text())
        conn.execute((RELEASE4 / "release4.postgres-rows.sql").read_text())
    return url


def new_postgres(cluster) -> str:
    url = cluster.create_database(f"new_{uuid.uuid4().hex[:8]}")
    open_database(url, inline_rings=False).close()
    return url


@pytest.fixture
def release4(tmp_path, postgres_databases, monkeypatch) -> str:
    """The release-4 database on the suite's engine, with release 4's key in the environment."""
    monkeypatch.setenv("SWITCHBOARD_SECRET_KEY", FACTS["secret_key_hex"])
    monkeypatch.delenv("SWITCHBOARD_KEY_FILE", raising=False)
    if postgres_databases is not None:
        return release4_postgres(postgres_databases.cluster)
    path = tmp_path / "release4.db"
    shutil.copy2(RELEASE4 / "release4.db", path)
    return str(path)


@pytest.fixture
def new_database(tmp_path, postgres_databases) -> str:
    if postgres_databases is not None:
        return new_postgres(postgres_databases.cluster)
    path = str(tmp_path / "new.db")
    open_database(path, inline_rings=False).close()
    return path


class Raw:
    """Plain SQL on either engine, outside Switchboard (what the test reads and writes behind its back)."""

    def __init__(self, db: str):
        self.postgres = is_postgres(db)
        if self.postgres:
            import psycopg

            self.conn = psycopg.connect(db, autocommit=True)
        else:
            self.conn = sqlite3.connect(db, isolation_level=None)

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc) -> None:
        self.conn.close()

    def rows(self, sql: str, params=()) -> list[tuple]:
        if self.postgres:
            sql = sql.replace("?", "%s")
        return [tuple(row) for row in self.conn.execute(sql, params).fetchall()]

    def version(self) -> int:
        if self.postgres:
            return self.rows("SELECT version FROM switchboard_schema")[0][0]
        return self.rows("PRAGMA user_version")[0][0]

    def set_version(self, version: int) -> None:
        if self.postgres:
            self.conn.execute("UPDATE switchboard_schema SET version = %s", (version,))
        else:
            self.conn.execute(f"PRAGMA user_version = {version}")

    def tables(self) -> list[str]:
        if self.postgres:
            return [t for (t,) in self.rows("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
                                            " ORDER BY 1")]
        return [t for (t,) in self.rows("SELECT name FROM sqlite_master WHERE type = 'table'"
                                        " AND name NOT LIKE 'sqlite%' ORDER BY 1")]

    def everything(self) -> dict[str, list]:
        """Every row of every table, in a fixed order, each a tuple of (column, value as text, so the engines'
        types compare); the version, which a migration moves, is version()'s."""
        found = {}
        for table in self.tables():
            if table != "switchboard_schema":
                cursor = self.conn.execute(f"SELECT * FROM {table}")
                names = [column[0] for column in cursor.description]
                found[table] = sorted(tuple(zip(names, map(repr, row), strict=True)) for row in cursor.fetchall())
        return found


    def has(self, table: str) -> bool:
        return table in self.tables()

    def catalog(self) -> dict:
        """Every definition the database holds, as the engine prints it back."""
        if not self.postgres:
            # A table a step rebuilt was renamed into place, and SQLite prints its renamed name quoted.
            return {"objects": sorted((kind, name, table, re.sub(r'^CREATE TABLE "(\w+)"', r"CREATE TABLE \1",
                                                                 " ".join((sql or "").split())))
                                      for kind, name, table, sql in
                                      self.rows("SELECT type, name, tbl_name, sql FROM sqlite_master"))}
        here = "current_schema()::regnamespace"
        return {
            "relations": self.rows(f"SELECT relname, relkind, relpersistence FROM pg_class WHERE relnamespace = {here}"
                                   " ORDER BY 1"),
            "columns": self.rows("SELECT table_name, column_name, ordinal_position, data_type, is_nullable,"
                                 " column_default, is_identity FROM information_schema.columns"
                                 " WHERE table_schema = current_schema() ORDER BY 1, 3"),
            "constraints": self.rows(f"SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)"
                                     f" FROM pg_constraint WHERE connamespace = {here} ORDER BY 1, 2"),
            "indexes": self.rows("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema()"
                                 " ORDER BY 1"),
            "views": self.rows("SELECT viewname, definition FROM pg_views WHERE schemaname = current_schema()"
                               " ORDER BY 1"),
            "triggers": self.rows("SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger WHERE NOT tgisinternal"
                                  " ORDER BY 1"),
            "functions": self.rows(f"SELECT proname, pg_get_functiondef(oid) FROM pg_proc WHERE pronamespace = {here}"
                                   " ORDER BY 1"),
        }


def catalog_differences(got: dict, expected: dict) -> list[str]:
    return [f"{part}: {entry} {'only in the migrated database' if entry in got[part] else 'missing there'}"
            for part in expected for entry in sorted(set(got[part]) ^ set(expected[part]), key=repr)]


def as_before(after: dict, before: dict) -> dict:
    """`after`'s rows of the tables `before` had, cut to the columns they had then; a column a step added since
    must be NULL in every row the earlier release wrote."""
    kept = {}
    for table, rows in before.items():
        columns = {name for row in rows[:1] for name, _ in row}
        kept[table] = []
        for row in after.get(table, []):
            added = {name: value for name, value in row if columns and name not in columns}
            assert set(added.values()) <= {"None"}, f"{table}: columns added since hold {added}"
            kept[table].append(tuple((name, value) for name, value in row if not columns or name in columns))
    return kept



# -- the fourth release's database, migrated in place --------------------------------------------------------------

def test_the_step_list_has_both_forms_from_the_first_postgres_version_on():
    assert sorted(MIGRATIONS) == list(range(1, SCHEMA_VERSION)), "one step per version, none missing"
    for version, step in MIGRATIONS.items():
        if version < POSTGRES_FIRST_VERSION:
            assert step.postgres is None, f"step {version}: no Postgres database is that old"
        else:
            assert isinstance(step.postgres, tuple), f"step {version} has no Postgres form"


def test_a_release4_database_migrates_in_place_keeping_every_row_token_secret_and_rule(release4):
    with Raw(release4) as raw:
        assert raw.version() == 9 and not raw.has("schema_history")
        before = raw.everything()
    assert len(before["todos"]) == 4 and len(before["webhooks"]) == 2 and before["board_sessions"]

    code, plan = run_cli(release4, "migrate", "--dry-run")
    assert code == 0 and plan["from"] == 9 and plan["applied"] is False, plan
    assert [(s["from"], s["to"]) for s in plan["steps"]] == RELEASE4_STEPS
    code, migrated = run_cli(release4, "migrate")
    assert code == 0 and migrated["applied"] is True, migrated
    assert [(s["from"], s["to"]) for s in migrated["steps"]] == RELEASE4_STEPS

    with Raw(release4) as raw:
        assert raw.version() == SCHEMA_VERSION
        after = raw.everything()
    history = after.pop("schema_history")
    added = {table: rows for table, rows in after.items() if table not in before}
    assert all(rows == [] for rows in added.values()), added
    assert as_before(after, before) == before, "every row the fourth release wrote is there, unchanged"
    assert [dict(row)["version"] for row in history] == [str(to) for _, to in RELEASE4_STEPS]

    code, report = run_cli(release4, "check")
    assert code == 0, report
    assert report["schema_version"] == SCHEMA_VERSION
    assert [(step["version"], step["summary"]) for step in report["schema_history"]] == [
        (to, MIGRATIONS[start].summary) for start, to in RELEASE4_STEPS]
    assert run_cli(release4, "migrate")[1]["steps"] == [], "a second run has nothing to do"

    app = create_app(release4, background=False)
    with TestClient(app) as client:
        human = {"Authorization": f"Bearer {FACTS['human_token']}"}
        todos = client.get("/api/v1/todos", headers=human).json()["todos"]
        assert {t["id"] for t in todos} == set(FACTS["todos"].values())
        hook = FACTS["webhook"]
        rules = client.get(f"/api/v1/webhooks/{hook['id']}/rules", headers=human)
        assert rules.status_code == 200 and rules.json()["rules"], rules.text
        # The sealed secret opens with the release's key: a signed delivery is verified and routed by its rules.
        raw, headers = github("issues.opened", hook["secret"], {"issue": {"number": 9, "labels": []}})
        answer = client.post(f"/hooks/{hook['path']}", content=raw, headers=headers)
        assert answer.status_code == 202 and answer.json()["verified"] is True, answer.text
        assert answer.json()["disposition"] == "routed" and answer.json()["created"] == 1, answer.text
        worker = {"Authorization": f"Bearer {FACTS['endpoint_token']}"}
        claimed = client.post("/api/v1/todos/claim", headers=worker, json={"queue": "build"})
        assert claimed.status_code == 200 and claimed.json()["todo"]["id"] == FACTS["todos"]["pushed"], claimed.text


def test_a_migrated_release4_database_has_the_catalog_of_a_new_one(release4, new_database):
    open_database(release4, inline_rings=False).close()
    with Raw(release4) as migrated, Raw(new_database) as new:
        assert migrated.version() == new.version() == SCHEMA_VERSION
        found = catalog_differences(migrated.catalog(), new.catalog())
    assert not found, "the database migrated step by step differs from a new one:\n" + "\n".join(found)


# -- the machinery: a failing step, a newer database, two processes at once ----------------------------------------

# A step after this program's last that fails half way: its first statement made a table, its second fails.
FAILING = {**MIGRATIONS, SCHEMA_VERSION: Migration(
    "a step that fails half way", after=("CREATE TABLE half_done (n INTEGER)", "INSERT INTO no_such_table VALUES (1)"),
    postgres=("CREATE TABLE half_done (n BIGINT)", "INSERT INTO no_such_table VALUES (1)"))}


def test_a_failing_step_rolls_back_alone_and_leaves_the_last_good_version(release4):
    with Raw(release4) as raw:
        before = raw.everything()
        if raw.postgres:
            import psycopg

            from switchboard.postgres import apply_postgres_schema

            with pytest.raises(psycopg.errors.UndefinedTable):
                apply_postgres_schema(raw.conn, FAILING, SCHEMA_VERSION + 1)
        else:
            with pytest.raises(sqlite3.OperationalError, match="no_such_table"):
                apply_schema(raw.conn, FAILING, SCHEMA_VERSION + 1)
        assert raw.version() == SCHEMA_VERSION, "the step before the failing one stays applied"
        assert not raw.has("half_done"), "the failing step's own work is rolled back"
        after = raw.everything()
    assert [dict(row)["version"] for row in after.pop("schema_history")] == [repr(to) for _, to in RELEASE4_STEPS]
    assert as_before(after, before) == before
    open_database(release4, inline_rings=False).close()  # the program's own list finds it current


def test_a_database_newer_than_the_program_is_refused(new_database):
    with Raw(new_database) as raw:
        raw.set_version(SCHEMA_VERSION + 1)
        before = raw.everything()
    code, answer = run_cli(new_database, "migrate")
    assert code == 1 and f"schema {SCHEMA_VERSION + 1}, newer than this program" in answer["message"], answer
    with pytest.raises(ApiError, match=f"schema {SCHEMA_VERSION + 1}, newer than this program"):
        open_database(new_database, inline_rings=False)
    with Raw(new_database) as raw:
        assert raw.version() == SCHEMA_VERSION + 1 and raw.everything() == before


def test_two_processes_migrating_a_release4_postgres_database_at_once_apply_the_step_once(postgres_databases):
    """Both `migrate` processes are started while the test holds the migrate lock, and it lets go only once both
    wait on it: one applies the step, the other then finds the database current."""
    import psycopg

    url = release4_postgres(postgres_cluster(postgres_databases))
    with psycopg.connect(url) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK,))
        racers = [subprocess.Popen([sys.executable, str(ROOT / "switchboard.py"), "migrate", "--db", url, "--json"],
                                   cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                  for _ in range(2)]
        waiting, deadline = 0, time.monotonic() + 30
        with psycopg.connect(url, autocommit=True) as watcher:
            while waiting < 2 and time.monotonic() < deadline and all(r.poll() is None for r in racers):
                waiting = watcher.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                                          " AND database = (SELECT oid FROM pg_database WHERE datname ="
                                          " current_database())").fetchone()[0]
                time.sleep(0.01)
        holder.rollback()  # lets go of the lock
    got = [(racer.wait(timeout=60), *racer.communicate()) for racer in racers]
    shown = "\n".join(f"racer {n}: exit {code}, {out.strip()} {err.strip()}" for n, (code, out, err) in enumerate(got))
    assert waiting == 2, f"both racers should have waited on the lock:\n{shown}"
    answers = [json.loads(out) for code, out, _ in got if code == 0]
    assert len(answers) == 2, shown
    # Each step is its own transaction under the lock, so the two may share the steps out; each is applied once.
    applied = sorted((s["from"], s["to"]) for answer in answers for s in answer["steps"])
    assert applied == RELEASE4_STEPS, shown
    with Raw(url) as raw:
        assert raw.version() == SCHEMA_VERSION and raw.rows("SELECT version FROM schema_history ORDER BY version") == [
            (to,) for _, to in RELEASE4_STEPS]


# -- migrate-to copies only into an empty database -----------------------------------------------------------------

def test_migrate_to_refuses_a_database_holding_another_applications_tables(postgres_databases, tmp_path,
                                                                            monkeypatch):
    import psycopg

    cluster = postgres_cluster(postgres_databases)
    monkeypatch.setenv("SWITCHBOARD_SECRET_KEY", FACTS["secret_key_hex"])
    source = str(tmp_path / "source.db")
    shutil.copy2(RELEASE4 / "release4.db", source)
    theirs = cluster.create_database(f"theirs_{uuid.uuid4().hex[:8]}")
    with psycopg.connect(theirs, autocommit=True) as conn:
        conn.execute("CREATE TABLE invoices (id bigint PRIMARY KEY, total numeric)")
        conn.execute("INSERT INTO invoices VALUES (1, 9.5)")
    code, answer = run_cli(source, "migrate-to", theirs)
    assert code == 1 and "public.invoices" in answer["message"] and "empty" in answer["message"], answer
    with Raw(theirs) as raw:
        assert raw.tables() == ["invoices"], "nothing of Switchboard's was made beside their tables"
        assert raw.rows("SELECT id FROM invoices") == [(1,)]

    empty = cluster.create_database(f"empty_{uuid.uuid4().hex[:8]}")
    code, answer = run_cli(source, "migrate-to", empty)
    assert code == 0 and answer["rows"]["todos"] == 4, answer

    # The other way: a SQLite file that is another application's.
    their_file = tmp_path / "notes.db"
    with sqlite3.connect(their_file) as conn:
        conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")
    before = their_file.read_bytes()
    code, answer = run_cli(empty, "migrate-to", str(their_file))
    assert code == 1 and "notes" in answer["message"], answer
    assert their_file.read_bytes() == before
    code, answer = run_cli(empty, "migrate-to", str(tmp_path / "back.db"))
    assert code == 0 and answer["rows"]["todos"] == 4, answer

