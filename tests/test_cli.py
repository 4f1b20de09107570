"""The operator CLI: --json output shapes, exit codes, the same rules as the API, and online backup."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading

import httpx
import pytest
from conftest import ROOT, cli, cli_program

from switchboard.configuration import SCHEMA_VERSION


@pytest.mark.sqlite_only("PRAGMA user_version and the WAL journal")
def test_init_is_idempotent_and_versions_the_schema(db_path):
    assert cli_program(db_path, "init") == (0, {"path": db_path, "schema_version": SCHEMA_VERSION})
    assert cli_program(db_path, "init")[0] == 0
    conn = sqlite3.connect(db_path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_people_endpoints_and_todos_through_the_cli(db_path):
    code, human = cli_program(db_path, "human", "add", "alice")
    assert code == 0 and set(human) == {"id", "name", "token"} and human["token"].startswith("sbh_")
    assert cli_program(db_path, "human", "add", "alice") == (1, {"error": "conflict", "message": "human 'alice' already exists"})
    code, endpoint = cli_program(db_path, "endpoint", "vend", "--human", "alice", "--name", "w", "--queues", "build,docs",
                                 "--lease", "600")
    assert code == 0 and set(endpoint) == {"id", "name", "token", "queues", "verbs"}
    assert endpoint["queues"] == ["build", "docs"] and "claim_next" in endpoint["verbs"]
    code, todo = cli_program(db_path, "todo", "push", endpoint["id"], "--queue", "build", "--title", "ship",
                             "--payload", '{"pr": 7}', "--key", "k1")
    assert code == 0 and todo["state"] == "pending" and todo["payload"] == {"pr": 7} and todo["created"] is True
    code, again = cli_program(db_path, "todo", "push", endpoint["id"], "--queue", "build", "--title", "ship", "--key", "k1")
    assert again["id"] == todo["id"] and again["created"] is False
    code, listed = cli_program(db_path, "todo", "list", "--queue", "build")
    assert [t["id"] for t in listed["todos"]] == [todo["id"]]
    code, cancelled = cli_program(db_path, "todo", "cancel", todo["id"], "--reason", "obsolete")
    assert code == 0 and cancelled["state"] == "cancelled"
    code, shown = cli_program(db_path, "todo", "show", todo["id"])
    assert shown["history"][-1]["actor"] == "system" and shown["history"][-1]["evidence"] == {"reason": "obsolete"}
    assert cli_program(db_path, "todo", "cancel", todo["id"], "--reason", "twice")[1]["error"] == "conflict"
    code, revoked = cli_program(db_path, "endpoint", "revoke", endpoint["id"])
    assert code == 0 and revoked["revoked_at"] is not None


def test_cli_refuses_bad_input_with_exit_1_and_usage_with_exit_2(db_path):
    cli_program(db_path, "human", "add", "alice")
    code, body = cli_program(db_path, "endpoint", "vend", "--human", "alice", "--name", "w", "--queues", "quarantine")
    assert code == 1 and body["error"] == "invalid_argument"
    code, body = cli_program(db_path, "endpoint", "vend", "--human", "nobody", "--name", "w", "--queues", "a")
    assert code == 1 and body["error"] == "not_found"
    code, body = cli_program(db_path, "todo", "push", "ep_00", "--queue", "a", "--title", "t", "--payload", "{nope")
    assert code == 1 and body["error"] == "invalid_argument"
    usage = subprocess.run([sys.executable, str(ROOT / "switchboard.py"), "todo", "frobnicate"], capture_output=True)
    assert usage.returncode == 2


@pytest.mark.sqlite_only("SQLite's online file backup (Postgres: pg_dump)")
def test_backup_while_serving_is_consistent(live_server, db_path, tmp_path):
    server = live_server()
    _, human = cli(db_path, "human", "add", "alice")
    _, endpoint = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "w", "--queues", "build")
    auth = {"Authorization": f"Bearer {human['token']}"}
    stop = threading.Event()

    def write_load():
        with httpx.Client(base_url=server.url, headers=auth) as c:
            while not stop.is_set():
                c.post(f"/api/v1/endpoints/{endpoint['id']}/todos", json={"title": "t", "queue": "build"})

    writer = threading.Thread(target=write_load)
    writer.start()
    try:
        out = tmp_path / "copy.db"
        code, report = cli_program(db_path, "backup", str(out))
        assert code == 0
        assert cli_program(db_path, "backup", str(out))[0] == 1, "an existing file is never overwritten"
    finally:
        stop.set()
        writer.join()
    copy = sqlite3.connect(out)
    assert copy.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    todos, events = copy.execute("SELECT (SELECT count(*) FROM todos), (SELECT count(*) FROM events)").fetchone()
    assert todos == events, "every operator todo is in the copy with its event"
    code, check = cli_program(str(out), "check")
    assert code == 0 and check["integrity"] == "ok" and check["schema_version"] == SCHEMA_VERSION


def test_human_output_without_json_is_readable(db_path):
    cli_program(db_path, "init")
    done = subprocess.run([sys.executable, str(ROOT / "switchboard.py"), "human", "add", "bob", "--db", db_path],
                          capture_output=True, text=True)
    assert done.returncode == 0 and "token: sbh_" in done.stdout
    listing = subprocess.run([sys.executable, str(ROOT / "switchboard.py"), "human", "list", "--db", db_path],
                             capture_output=True, text=True)
    assert listing.stdout.split("\n")[0].split() == ["ID", "NAME", "LOGIN", "CREATED_AT"] and " bob " in listing.stdout
