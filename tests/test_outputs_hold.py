"""Outputs held (issue 43): a restored copy of the database is no live server until the operator says so. While
outputs are held, nothing goes out (forge outputs, status comments, notifications) and what comes waits; `outputs
resume` sends it. Every backup's copy is born held; /healthz, `check` and `outputs status` say so."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import LiveServer, ManualClock, World, cli
from forges import FakeForge, Scene
from starlette.testclient import TestClient
from test_notify import Receiver, add_channel

from switchboard.app import create_app
from switchboard.notifier import NOTIFY_RATE_SECONDS, due_unless_held
from switchboard.store.forge_outbox import due_forge_work

TOKEN = "ghp_" + "H0ldT0ken0" * 4


@pytest.fixture(autouse=True)
def loopback_receivers_allowed(monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_NOTIFY_ALLOW_PRIVATE", "1")


@pytest.fixture
def github():
    forge = FakeForge("github", TOKEN, "switchboard-bot")
    yield forge
    forge.stop()


@pytest.fixture
def receiver():
    made = Receiver()
    yield made
    made.close()


def test_held_outputs_send_nothing_until_resumed_then_everything_that_waited(db_path, github, receiver):
    assert cli(db_path, "outputs", "hold", "--reason", "restore drill")[0] == 0
    app = create_app(db_path, clock=ManualClock(time.time_ns() // 1_000_000), background=True,
                     notify_allow_private=True)
    with TestClient(app) as client:
        world = World(client, app.state.db)
        alice = world.human("alice")
        add_channel(client, alice, "webhook", receiver.url("/alice"), ["needs_input"])
        scene = Scene(world, alice, github, mirror=True)
        todo_id = scene.open_issue(41)
        asked = scene.act(todo_id, "needs-input", lease_token=scene.claim(todo_id), question="S or M?",
                          outputs=[{"type": "add_labels", "labels": ["size/S"]}])
        assert asked.status_code == 200, asked.text
        code, status = cli(db_path, "outputs", "status")
        assert code == 0 and status["held"] and status["reason"] == "restore drill", status
        assert status["waiting"]["forge_outputs"] == 1 and status["waiting"]["notifications"] == 1, status
        assert status["waiting"]["status_comments"] == 1, status
        # The senders' own picks find nothing while held (what each loop runs, in its transaction) ...
        assert app.state.db.read_sync(due_forge_work, frozenset(), 16)[0] == []
        assert app.state.db.write_sync(due_unless_held, int(NOTIFY_RATE_SECONDS * 1000), frozenset(), {}, 16, 4)[0] == []
        # ... and woken, the running loops send nothing over more than one of their looks again.
        scene.wake()
        app.state.flows.notifier.wake()
        with receiver.changed:
            receiver.changed.wait(2.5)
        assert receiver.requests == [] and github.writes() == [], github.writes()
        health = client.get("/healthz")
        assert health.status_code == 200 and "outputs held since" in health.text, health.text

        code, resumed = cli(db_path, "outputs", "resume")
        assert code == 0 and not resumed["held"], resumed
        # The label, the status comment and the notification that waited go out now.
        github.wait_for(lambda: github.labels("acme/site", 41) == ["size/S"], what="the held label")
        github.wait_for(lambda: any("switchboard:status" in c["body"] for c in github.comments("acme/site", 41)),
                        what="the held status comment")
        [message] = receiver.wait_for(1)
        assert message.path == "/alice" and b"needs_input" in message.body
        assert client.get("/healthz").text.startswith("ok ") and "held" not in client.get("/healthz").text


def test_hold_is_idempotent_and_keeps_its_first_time_and_reason(db_path):
    first = cli(db_path, "outputs", "hold", "--reason", "drill of 7 December")[1]
    again = cli(db_path, "outputs", "hold")[1]
    assert again["held"] and again["since"] == first["since"] and again["reason"] == "drill of 7 December"
    assert cli(db_path, "outputs", "resume")[1]["held"] is False
    assert cli(db_path, "outputs", "resume")[1]["held"] is False  # resuming twice is no error


@pytest.mark.sqlite_only("backup copies a SQLite file (Postgres: pg_dump, then `outputs hold`)")
def test_a_backup_is_born_held_and_a_server_on_it_says_so_until_resume(db_path, tmp_path, live_server):
    server = live_server()
    assert httpx.get(f"{server.url}/healthz").text.startswith("ok ")
    code, made = cli(db_path, "backup", str(tmp_path / "drill.db"))
    assert code == 0 and "held" in made["outputs"], made
    # The live database goes on sending; the copy holds.
    assert cli(db_path, "outputs", "status")[1]["held"] is False
    copy = str(tmp_path / "drill.db")
    code, report = cli(copy, "check")
    assert code == 0 and report["outputs"]["held"] is True and "backup" in report["outputs"]["reason"], report
    drill = LiveServer(copy)
    try:
        health = httpx.get(f"{drill.url}/healthz")
        assert health.status_code == 200 and "outputs held since" in health.text, health.text
        assert cli(copy, "outputs", "resume")[0] == 0
        assert httpx.get(f"{drill.url}/healthz").text.startswith("ok ") and "held" not in httpx.get(
            f"{drill.url}/healthz").text
    finally:
        drill.stop()
