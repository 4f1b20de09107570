"""Stand on its own (the issue of that name): a database restored without its key is refused with the fix named,
backup and restore round-trip, the CLI never creates a database by accident, GitHub's ping and form bodies,
did-you-mean, a CLI for people, migration of a previous release's file, and nothing reaching outside the
repository."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import secrets
import shutil
import sqlite3
import stat
import subprocess
import sys
import time
import urllib.parse
import uuid
from pathlib import Path

import httpx
import producers
import pytest
from conftest import ROOT, LiveServer, cli, free_port
from helpers import connect_db

from switchboard.cli.parser import build_parser
from switchboard.configuration import SCHEMA_VERSION
from switchboard.crypto import SecretBox, sealed_sample
from switchboard.engines import open_database
from switchboard.models import EndpointCreate, WebhookCreate
from switchboard.store.principals import OPERATOR, add_human, vend_endpoint
from switchboard.store.webhooks import create_webhook

RELEASE1 = ROOT / "tests" / "fixtures" / "release1"
RELEASE2 = ROOT / "tests" / "fixtures" / "release2"


def run(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """The real CLI, without --json unless given."""
    return subprocess.run([sys.executable, str(ROOT / "switchboard.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})} if env is not None else None,
                          cwd=str(cwd) if cwd else None)


def hook_path(url: str) -> str:
    return "/hooks/" + url.rsplit("/hooks/", 1)[1]


def copy_database(source: Path, target: Path) -> None:
    """The database file as an operator copies it (with its WAL, if one is left)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target)
    for suffix in ("-wal",):
        if Path(str(source) + suffix).exists():
            shutil.copy2(str(source) + suffix, str(target) + suffix)


@pytest.fixture(autouse=True)
def _no_key_in_the_environment(monkeypatch):
    """These tests are about the key file beside the database."""
    monkeypatch.delenv("SWITCHBOARD_SECRET_KEY", raising=False)


# -- A. a database restored without its key ----------------------------------------------------------------

def make_signed_webhook(db_path: str) -> dict:
    """A human, an endpoint and a GitHub webhook with a minted secret, sealed with the key file beside the
    database (made here, as `webhook create` makes it), written through the store's own functions."""
    db = open_database(db_path)
    try:
        human = db.write_sync(add_human, "alice")
        endpoint = db.write_sync(vend_endpoint, human["id"], EndpointCreate(name="w", queues=["build"]))
        box = SecretBox.for_database(db_path, db.read_sync(sealed_sample))
        hook = db.write_sync(create_webhook, OPERATOR, box, WebhookCreate.model_validate(
            {"provider": "github", "queue": "build", "endpoint_id": endpoint["id"]}), "http://unused")
    finally:
        db.close()
    assert hook["secret"].startswith("whsec_"), hook
    return hook


def serve_refused(db_path: Path) -> subprocess.CompletedProcess:
    started = time.monotonic()
    done = run("serve", "--db", str(db_path), "--port", str(free_port()), timeout=30)
    assert time.monotonic() - started < 20, "refused at once, not after a timeout"
    return done


def test_a_database_restored_without_its_key_is_refused_with_the_fix_named(tmp_path):
    old = tmp_path / "old" / "switchboard.db"
    old.parent.mkdir()
    hook = make_signed_webhook(str(old))
    assert (old.parent / "switchboard.key").exists()
    new = tmp_path / "new" / "switchboard.db"
    copy_database(old, new)
    key = new.parent / "switchboard.key"

    done = serve_refused(new)
    assert done.returncode == 1, done.stderr
    assert str(key) in done.stderr and "missing" in done.stderr, done.stderr
    assert "restore" in done.stderr and "SWITCHBOARD_SECRET_KEY" in done.stderr, done.stderr
    assert not key.exists(), "no new key was made: it could never open the secrets"
    code, body = cli(str(new), "check")
    assert code == 1 and "key" in body["message"] and "missing" in body["message"], body
    assert not key.exists()

    # Some other key is no better.
    key.write_text(base64.b64encode(secrets.token_bytes(32)).decode() + "\n")
    key.chmod(0o600)
    done = serve_refused(new)
    assert done.returncode == 1 and "does not open" in done.stderr, done.stderr
    code, body = cli(str(new), "check")
    assert code == 1 and "wrong key" in body["message"], body

    # The right key serves.
    shutil.copy2(old.parent / "switchboard.key", key)
    assert cli(str(new), "check")[0] == 0
    server = LiveServer(str(new))
    try:
        assert httpx.get(server.url + "/healthz").status_code == 200
        raw, headers = producers.github("issues.opened", hook["secret"])
        signed = httpx.post(server.url + hook_path(hook["url"]), content=raw, headers=headers)
        assert signed.status_code == 202 and signed.json()["verified"] is True, signed.text
    finally:
        server.stop()


# -- B. backup and restore -----------------------------------------------------------------------------------

@pytest.mark.sqlite_only("file backup and restore")
def test_backup_and_restore_round_trip_keeps_the_webhook_working(live_server, db_path, tmp_path):
    server = live_server()
    _, human = cli(db_path, "human", "add", "alice")
    auth = {"Authorization": f"Bearer {human['token']}"}
    endpoint = httpx.post(server.url + "/api/v1/endpoints", headers=auth,
                          json={"name": "w", "queues": ["triage"]}).json()
    hook = httpx.post(server.url + "/api/v1/webhooks", headers=auth,
                      json={"provider": "github", "queue": "triage", "endpoint_id": endpoint["id"],
                            "trusted_actors": {"allow_all": True}}).json()
    raw, headers = producers.github("issues.opened", hook["secret"])
    first = httpx.post(server.url + hook_path(hook["url"]), content=raw, headers=headers)
    assert first.status_code == 202 and first.json()["verified"] is True

    out = tmp_path / "backup.db"
    code, answer = cli(db_path, "backup", str(out))
    assert code == 0, answer
    restored = tmp_path / "restored" / "switchboard.db"
    restored.parent.mkdir()
    shutil.copy2(out, restored)
    shutil.copy2(Path(db_path).parent / "switchboard.key", restored.parent / "switchboard.key")
    again = LiveServer(str(restored))
    try:
        replay = httpx.post(again.url + hook_path(hook["url"]), content=raw, headers=headers)
        assert replay.status_code == 202 and replay.json()["duplicate"] is True, replay.text
        assert replay.json()["event_id"] == first.json()["event_id"], "the restored copy remembers the delivery"
        raw, headers = producers.github("issues.opened", hook["secret"], {"issue": {"body": "after restore"}})
        fresh = httpx.post(again.url + hook_path(hook["url"]), content=raw, headers=headers)
        assert fresh.status_code == 202, fresh.text
        assert fresh.json()["verified"] is True and fresh.json()["disposition"] == "routed"
        assert fresh.json()["created"] == 1
    finally:
        again.stop()


# -- C. the CLI on a missing database ------------------------------------------------------------------------

def test_the_cli_never_creates_a_database_by_accident(tmp_path):
    missing = tmp_path / "xyz" / "missing.db"
    done = run("human", "list", "--db", str(missing))
    assert done.returncode == 1 and str(missing) in done.stderr, done.stderr
    assert not missing.parent.exists()
    # A relative path is named absolutely.
    done = run("human", "list", "--db", "relative.db", cwd=tmp_path)
    assert done.returncode == 1 and str(tmp_path / "relative.db") in done.stderr, done.stderr
    assert not (tmp_path / "relative.db").exists()
    done = run("human", "list", "--json", env={"SWITCHBOARD_DB": str(missing)}, cwd=tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    body = json.loads(done.stderr)
    assert body["error"] == "not_found" and str(missing) in body["message"], body
    assert not missing.parent.exists() and not (tmp_path / "switchboard.db").exists()
    # init creates it, and SWITCHBOARD_DB is where every command then looks.
    target = tmp_path / "here.db"
    env = {"SWITCHBOARD_DB": str(target)}
    assert run("init", env=env, cwd=tmp_path).returncode == 0 and target.exists()
    added = run("human", "add", "bob", "--json", env=env, cwd=tmp_path)
    assert added.returncode == 0, added.stderr
    names = [r[0] for r in sqlite3.connect(target).execute("SELECT name FROM humans")]
    assert names == ["bob"]
    assert not (tmp_path / "switchboard.db").exists()


# -- D. GitHub ping and form bodies --------------------------------------------------------------------------

@pytest.fixture
def github_hook(world, alice):
    router = world.endpoint(alice, ["triage"], name="router", verbs=["all"])
    r = world.client.post("/api/v1/webhooks", headers=alice.auth,
                          json={"provider": "github", "queue": "triage", "endpoint_id": router.id,
                                "trusted_actors": {"allow_all": True}})
    assert r.status_code == 201, r.text
    return r.json()


def post(world, hook, raw: bytes, headers: dict) -> httpx.Response:
    return world.client.post(hook_path(hook["url"]), content=raw, headers=headers)


def test_a_github_ping_is_recorded_never_work(world, alice, github_hook, db_path):
    assert world.client.get(f"/api/v1/webhooks/{github_hook['id']}", headers=alice.auth).json()["pinged_at"] is None
    raw, headers = producers.github("ping", github_hook["secret"])
    r = post(world, github_hook, raw, headers)
    assert r.status_code == 202, r.text
    answer = r.json()
    assert answer["disposition"] == "ping" and answer["created"] == 0 and answer["ping"] is True
    assert answer["verified"] is True and answer["todos"] == []
    view = world.client.get(f"/api/v1/webhooks/{github_hook['id']}", headers=alice.auth).json()
    assert view["pinged_at"] is not None
    assert connect_db(db_path).execute("SELECT count(*) FROM todos").fetchone()[0] == 0
    # A ping that does not verify is refused like any other delivery.
    headers["X-Hub-Signature-256"] = "sha256=" + producers.hex_hmac("wrong", raw)
    headers["X-GitHub-Delivery"] = str(uuid.uuid4())
    assert post(world, github_hook, raw, headers).status_code == 401


def test_a_form_encoded_github_delivery_verifies_over_the_raw_form(world, alice, github_hook):
    document = json.loads((producers.FIXTURES / "github" / "issues.opened.json").read_text())
    raw = b"payload=" + urllib.parse.quote_plus(json.dumps(document)).encode()
    headers = {"X-GitHub-Event": "issues", "X-GitHub-Delivery": str(uuid.uuid4()),
               "Content-Type": "application/x-www-form-urlencoded",
               "X-Hub-Signature-256": "sha256=" + producers.hex_hmac(github_hook["secret"], raw)}
    r = post(world, github_hook, raw, headers)
    assert r.status_code == 202, r.text
    answer = r.json()
    assert answer["verified"] is True and answer["disposition"] == "routed" and "payload_error" not in answer
    todo = world.client.get(f"/api/v1/todos/{answer['todos'][0]['id']}", headers=alice.auth).json()
    assert todo["payload"] == document
    assert todo["title"] == "Codertocat/Hello-World#1: Spelling error in the README file"
    # Signed over the JSON instead of the form bytes, it does not verify.
    headers = {**headers, "X-GitHub-Delivery": str(uuid.uuid4()),
               "X-Hub-Signature-256": "sha256=" + producers.hex_hmac(github_hook["secret"], json.dumps(document).encode())}
    assert post(world, github_hook, raw, headers).status_code == 401


@pytest.mark.parametrize("raw, content_type, why", [
    (b"not json", "application/json", "not_json"),
    (b"", "application/json", "empty"),
    (b"payload=%7B%22a%22%3A&payload=2", "application/x-www-form-urlencoded", "form_without_payload"),
    (b"other=1", "application/x-www-form-urlencoded", "form_without_payload"),
])
def test_a_signed_body_that_is_no_json_says_why(world, alice, github_hook, raw, content_type, why):
    headers = {"X-GitHub-Event": "issues", "X-GitHub-Delivery": str(uuid.uuid4()), "Content-Type": content_type,
               "X-Hub-Signature-256": "sha256=" + producers.hex_hmac(github_hook["secret"], raw)}
    r = post(world, github_hook, raw, headers)
    assert r.status_code == 202, r.text
    assert r.json()["payload_error"] == why and r.json()["verified"] is True
    todo = world.client.get(f"/api/v1/todos/{r.json()['todos'][0]['id']}", headers=alice.auth).json()
    assert todo["payload"] is None


# -- E. did you mean -------------------------------------------------------------------------------------------

def test_an_unknown_field_suggests_the_known_one(world, alice):
    router = world.endpoint(alice, ["triage"], name="router", verbs=["all"])
    r = world.client.post("/api/v1/webhooks", headers=alice.auth,
                          json={"provider": "github", "queue": "triage", "endpoint": router.id})
    assert r.status_code == 400 and r.json()["error"] == "invalid_argument"
    assert "did you mean endpoint_id" in r.json()["message"], r.json()
    r = world.client.post(f"/api/v1/endpoints/{router.id}/todos", headers=alice.auth,
                          json={"titel": "x", "queue": "triage"})
    # The typo is both an unknown field and a missing one; the unknown one leads, whatever pydantic's order.
    assert r.status_code == 400, r.json()
    assert r.json()["message"] == "unknown field titel, did you mean title?; title: Field required", r.json()
    r = world.client.post("/api/v1/endpoints", headers=alice.auth, json={"name": "e2", "queuez": ["build"]})
    assert r.status_code == 400 and r.json()["message"].startswith("unknown field queuez, did you mean queues?")
    r = world.client.post(f"/api/v1/endpoints/{router.id}/todos", headers=alice.auth,
                          json={"title": "x", "queue": "triage", "zzzz": 1})
    assert r.status_code == 400 and "title" in r.json()["message"] and "queue" in r.json()["message"], r.json()


# -- F. a CLI for people -----------------------------------------------------------------------------------

def test_todo_show_for_people_prints_attempts_and_history_tables(world, alice, db_path):
    worker = world.endpoint(alice, ["build"], name="worker")
    todo = world.push(alice, worker, "build", title="ship it")
    claim = world.claim(worker, claimant="qwen-1")
    world.act(worker, todo["id"], "release", lease_token=claim["lease_token"], note="later")
    done = run("todo", "show", todo["id"], "--db", db_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert f"id: {todo['id']}" in lines and "title: ship it" in lines
    attempts = lines.index("attempts:")
    assert lines[attempts + 1].split() == ["SEQ", "CLAIMANT", "CLAIMED_AT", "ENDED_AT", "OUTCOME", "SUMMARY"]
    assert lines[attempts + 2].split()[:2] == ["1", "qwen-1"]
    history = lines.index("history:")
    assert lines[history + 1].split() == ["AT", "ACTOR", "FROM", "TO", "EVIDENCE"]
    rows = [line.split() for line in lines[history + 2:history + 5]]
    assert [row[2:4] for row in rows] == [["-", "pending"], ["pending", "claimed"], ["claimed", "pending"]]


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from ((f"{name} {n}", s) for n, s in _subparsers(sub))


def test_every_option_of_every_command_has_help():
    parser = build_parser()
    commands = dict(_subparsers(parser))
    assert {"serve", "init", "backup", "check", "migrate", "human add", "todo show", "webhook create",
            "rules set", "events list"} <= set(commands)
    missing = []
    for name, sub in [("", parser), *commands.items()]:
        assert sub.format_help()  # every help text formats (a stray % would raise here)
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{name} {choice.dest}" for choice in action._choices_actions if not choice.help]
                continue
            if not (action.help or "").strip():
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"options without help: {missing}"


def test_out_files_hold_the_credentials_and_are_0600(db_path, tmp_path):
    human_out, endpoint_out, hook_out = tmp_path / "human.json", tmp_path / "endpoint.json", tmp_path / "hook.json"
    human_out.write_text("left readable by someone")
    human_out.chmod(0o644)
    code, human = cli(db_path, "human", "add", "alice", "--out", str(human_out))
    assert code == 0
    code, endpoint = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "w", "--queues", "build",
                         "--out", str(endpoint_out))
    assert code == 0
    code, hook = cli(db_path, "webhook", "create", "--endpoint", endpoint["id"], "--provider", "github",
                     "--queue", "build", "--out", str(hook_out))
    assert code == 0
    for path, secret in ((human_out, human["token"]), (endpoint_out, endpoint["token"]), (hook_out, hook["secret"])):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, f"{path.name} is {oct(path.stat().st_mode)}"
        written = json.loads(path.read_text())
        assert secret in (written.get("token"), written.get("secret")), written
    assert json.loads(hook_out.read_text())["url"] == hook["url"]


# -- G. migrating a previous release's file ------------------------------------------------------------------

def _counts(path: Path) -> dict:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                for t in ("humans", "endpoints", "webhooks", "todos", "events")}
    finally:
        conn.close()


def test_a_release1_database_migrates_and_serves(tmp_path, monkeypatch):
    fixture = RELEASE1 / "release1.db"
    assert fixture.exists(), f"{fixture} is missing (note: .gitignore ignores *.db; it must be added with -f)"
    facts = json.loads((RELEASE1 / "release1.json").read_text())
    path = tmp_path / "switchboard.db"
    shutil.copy2(fixture, path)
    before_bytes = hashlib.sha256(path.read_bytes()).hexdigest()
    before = _counts(path)
    assert before["todos"] == 3 and before["events"] == 3
    conn = sqlite3.connect(path)
    payloads_before = {i: p and json.loads(p) for i, p in conn.execute("SELECT id, payload FROM todos")}
    envelopes_before = {i: json.loads(e) for i, e in conn.execute("SELECT id, envelope FROM events")
                        if e is not None}
    conn.close()
    assert any(p is not None for p in payloads_before.values()) and envelopes_before

    code, plan = cli(str(path), "migrate", "--dry-run")
    assert code == 0, plan
    assert plan["from"] == 1 and plan["to"] == SCHEMA_VERSION and plan["applied"] is False
    assert [(s["from"], s["to"]) for s in plan["steps"]] == [(v, v + 1) for v in range(1, SCHEMA_VERSION)]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before_bytes, "a dry run changes nothing"
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 1

    code, applied = cli(str(path), "migrate")
    assert code == 0 and applied["applied"] is True and applied["from"] == 1, applied
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert _counts(path) == before
    trusted = dict(conn.execute("SELECT id, trusted_actors FROM webhooks").fetchall())
    # Each body is stored once now: the todos' and the envelopes' copies of it are gone from the file.
    assert conn.execute("SELECT count(*) FROM todos WHERE payload IS NOT NULL").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM events WHERE json_type(envelope, '$.payload') IS NOT NULL"
                        " OR json_type(envelope, '$.headers') IS NOT NULL").fetchone()[0] == 0
    conn.close()
    assert json.loads(trusted[facts["github"]["id"]]) == {"allow_all": True}
    assert trusted[facts["generic"]["id"]] is None
    assert cli(str(path), "migrate")[1]["applied"] is False, "a second run has nothing to do"

    monkeypatch.setenv("SWITCHBOARD_SECRET_KEY", facts["secret_key_hex"])
    server = LiveServer(str(path))
    try:
        auth = {"Authorization": f"Bearer {facts['human_token']}"}
        todos = httpx.get(server.url + "/api/v1/todos", headers=auth)
        assert todos.status_code == 200 and len(todos.json()["todos"]) == 3, todos.text
        # ...and read back from the event's body, every payload and envelope is what release 1 stored.
        assert {t["id"]: t["payload"] for t in todos.json()["todos"]} == payloads_before
        for event_id, envelope in envelopes_before.items():
            shown = httpx.get(f"{server.url}/api/v1/events/{event_id}", headers=auth)
            assert shown.status_code == 200 and shown.json()["envelope"] == envelope, shown.text
        hooks = {h["id"]: h for h in httpx.get(server.url + "/api/v1/webhooks", headers=auth).json()["webhooks"]}
        assert hooks[facts["github"]["id"]]["trusted_actors"] == {"allow_all": True}
        assert facts["github"]["secret"] == "s" * 32
        raw, headers = producers.github("issues.opened", facts["github"]["secret"],
                                        {"issue": {"body": "after the upgrade"}})
        r = httpx.post(server.url + hook_path(facts["github"]["url"]), content=raw, headers=headers)
        assert r.status_code == 202, r.text
        assert r.json()["verified"] is True and r.json()["disposition"] == "routed" and r.json()["created"] == 1
        generic = httpx.post(server.url + hook_path(facts["generic"]["url"]), content=b'{"n": 1}',
                             headers={"X-Delivery-Id": "after-upgrade"})
        assert generic.status_code == 202 and generic.json()["disposition"] == "routed", generic.text
    finally:
        server.stop()


def test_a_release2_database_moves_each_body_into_event_bodies_and_reads_back_the_same(tmp_path, monkeypatch):
    """Release 2 kept each body three times (the event's body, the envelope's payload, the todo's payload).
    Migrating keeps it once, in event_bodies, and the API shows every payload and envelope as release 2 did."""
    facts = json.loads((RELEASE2 / "release2.json").read_text())
    path = tmp_path / "switchboard.db"
    shutil.copy2(RELEASE2 / "release2.db", path)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
    payloads_before = {i: p and json.loads(p) for i, p in conn.execute("SELECT id, payload FROM todos")}
    envelopes_before = {i: json.loads(e) for i, e in conn.execute("SELECT id, envelope FROM events")
                        if e is not None}
    bodies_before = dict(conn.execute("SELECT id, body FROM events WHERE body IS NOT NULL"))
    conn.close()
    assert len(payloads_before) == 3 and len(envelopes_before) == 2 and len(bodies_before) == 3

    code, applied = cli(str(path), "migrate")
    assert code == 0 and applied["applied"] is True and applied["from"] == 2, applied
    conn = sqlite3.connect(path)
    assert "body" not in [row[1] for row in conn.execute("PRAGMA table_info(events)")]
    assert dict(conn.execute("SELECT event_id, body FROM event_bodies")) == bodies_before
    assert conn.execute("SELECT count(*) FROM todos WHERE payload IS NOT NULL").fetchone()[0] == 0
    assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    indexes = "SELECT name FROM sqlite_master WHERE type = 'index' ORDER BY name"
    fresh = tmp_path / "fresh.db"
    assert cli(str(fresh), "init")[0] == 0
    assert conn.execute(indexes).fetchall() == sqlite3.connect(fresh).execute(indexes).fetchall(), \
        "the migrated file has the indexes a fresh one has (the global lease index is gone)"
    conn.close()

    monkeypatch.setenv("SWITCHBOARD_SECRET_KEY", facts["secret_key_hex"])
    server = LiveServer(str(path))
    try:
        auth = {"Authorization": f"Bearer {facts['human_token']}"}
        todos = httpx.get(server.url + "/api/v1/todos", headers=auth).json()["todos"]
        assert {t["id"]: t["payload"] for t in todos} == payloads_before
        for event_id, envelope in envelopes_before.items():
            shown = httpx.get(f"{server.url}/api/v1/events/{event_id}", headers=auth).json()
            assert shown["envelope"] == envelope and shown["size"] == len(bodies_before[event_id])
        raw, headers = producers.github("issues.opened", facts["webhook"]["secret"], {"issue": {"number": 9}})
        r = httpx.post(server.url + hook_path(facts["webhook"]["url"]), content=raw, headers=headers)
        assert r.status_code == 202 and r.json()["disposition"] == "routed", r.text
        fresh = httpx.get(f"{server.url}/api/v1/todos/{r.json()['todos'][0]['id']}", headers=auth).json()
        assert fresh["payload"] == json.loads(raw)
    finally:
        server.stop()


# -- H. nothing reaches outside the repository ----------------------------------------------------------------

def test_nothing_points_outside_the_repository():
    needle = "/".join(("..", "shared"))  # joined at run time: neither this file nor its bytecode holds it whole
    places = [ROOT / "README.md", ROOT / "docs", ROOT / "tests", ROOT / "packs", ROOT / ".ci"]
    hits = []
    for place in places:
        files = [place] if place.is_file() else sorted(p for p in place.rglob("*") if p.is_file()) if place.exists() else []
        for path in files:
            if "__pycache__" in path.parts or path.suffix in (".db", ".pyc"):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            hits += [f"{path.relative_to(ROOT)}:{n}" for n, line in enumerate(text.splitlines(), 1) if needle in line]
    assert not hits, f"{needle} is mentioned at {hits}"
