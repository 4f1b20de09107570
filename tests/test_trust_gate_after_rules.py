"""The trust gate runs after the rules (issue 43, item 10): an untrusted actor's delivery is held for the human only
when a rule would make work of it. One the rules drop stays dropped, its trace naming the gate, so a public
repository's chatter (an outsider's "+1") makes no held todo, moves no subject and edits no status comment.

The app runs with its forge sender on a clock the test moves; GitHub is played by tests/forges.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from urllib.parse import quote

import producers
import pytest
from conftest import ManualClock
from forges import REPO, FakeForge
from helpers import query

from switchboard.app import create_app
from switchboard.store.outputs import STATUS_EDIT_MS

TOKEN = "ghp_" + "F0rgeT0ken" * 4
BOT = "switchboard-bot"
FLEET = json.loads((Path(__file__).resolve().parent.parent / "packs" / "fleet.json").read_text())
FLEET_QUEUES = ["hold", "triage", "lane-s", "lane-m", "lane-l", "lane-vision"]
STATUS = "<!-- switchboard:status -->"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(time.time_ns() // 1_000_000)


@pytest.fixture
def app(db_path, clock):
    return create_app(db_path, clock=clock, background=True, notify_allow_private=True)


@pytest.fixture
def github():
    forge = FakeForge("github", TOKEN, BOT)
    yield forge
    forge.stop()


def comment(secret: str, number: int, commenter: str, body: str) -> tuple[bytes, dict]:
    return producers.github("issue_comment.created", secret, {
        "issue": {"number": number, "title": "Spelling error", "state": "open", "labels": [],
                  "user": {"login": "Codertocat"}, "pull_request": None},
        "repository": {"full_name": REPO}, "comment": {"user": {"login": commenter}, "body": body},
        "sender": {"login": commenter}})


def test_an_outsiders_plus_one_under_the_fleet_pack_creates_nothing_and_moves_nothing(world, alice, github, clock,
                                                                                       db_path):
    endpoint = world.endpoint(alice, FLEET_QUEUES, verbs=["all"])
    hook = world.webhook(alice, endpoint, "github", "hold", trusted_actors={"logins": ["Codertocat"]})
    saved = world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth, json={
        **FLEET, "params": {"require_verified": True, "trusted_humans": ["Codertocat"], "trusted_agents": [],
                            "repo_prefixes": ["acme/"]}})
    assert saved.status_code == 200, saved.text
    connection = world.client.post("/api/v1/connections", headers=alice.auth, json={
        "kind": "github", "api_url": github.api, "token": TOKEN, "repos": ["acme/"]}).json()
    assert world.client.put(f"/api/v1/webhooks/{hook['id']}/connection", headers=alice.auth, json={
        "connection_id": connection["id"], "mirror": True}).status_code == 200

    def post(raw: bytes, headers: dict) -> dict:
        signed = producers.github_headers(hook["secret"], raw, headers.get("X-GitHub-Delivery"),
                                          headers["X-GitHub-Event"])
        answer = world.deliver(hook, raw, signed)
        assert answer.status_code == 202, answer.text
        return answer.json()

    # The maintainer's issue is triaged and finished; its status comment says so.
    github.issue(REPO, 70, author="Codertocat")
    opened = post(*producers.github("issues.opened", "", {
        "issue": {"number": 70, "title": "Spelling error", "state": "open", "labels": [], "pull_request": None,
                  "user": {"login": "Codertocat"}}, "repository": {"full_name": REPO},
        "sender": {"login": "Codertocat"}}))
    assert opened["disposition"] == "routed" and opened["todos"][0]["queue"] == "triage", opened
    todo_id = opened["todos"][0]["id"]
    # The status comment's first post, recorded (its next edit is due 10 s after it, by the test's clock).
    github.wait_for(lambda: query(db_path, "SELECT due_at IS NULL AND edited_at IS NOT NULL FROM forge_status")
                    == [(True,)], what="the first status comment recorded")
    claimed = world.client.post(f"/api/v1/todos/{todo_id}/claim", headers=endpoint.auth, json={})
    done = world.act(endpoint, todo_id, "complete", lease_token=claimed.json()["lease_token"], summary="sized")
    assert done.status_code == 200, done.text
    clock.advance(STATUS_EDIT_MS / 1000 + 1)
    world.client.app.state.flows.forge.wake()

    def status() -> dict | None:
        found = [c for c in github.comments(REPO, 70) if STATUS in c["body"]]
        return found[0] if found and "**triage**: done" in found[0]["body"] else None

    before_status = dict(github.wait_for(status, what="the done status comment"))
    # The sender records the edit after the forge answered it: then nothing is due.
    github.wait_for(lambda: query(db_path, "SELECT due_at FROM forge_status") == [(None,)], what="the edit recorded")
    echoes = github.flush(post)  # the bot's own comment events: dropped as its echo
    assert echoes and all(e["disposition"] == "dropped" for e in echoes)
    key = quote("github:acme/site#70", safe="")
    assert world.client.get(f"/api/v1/subjects/{key}", headers=alice.auth).json()["state"] == "done"
    todos_before = query(db_path, "SELECT id, state FROM todos ORDER BY id")
    writes_before = len(github.writes())

    # An outsider's "+1": the rules drop it (a comment is no work), so the trust gate holds nothing.
    plus_one = world.deliver(hook, *comment(hook["secret"], 70, "mallory", "+1"))
    assert plus_one.status_code == 202
    answer = plus_one.json()
    assert answer["disposition"] == "dropped" and answer["created"] == 0 and "held" not in answer, answer
    event = world.client.get(f"/api/v1/events/{answer['event_id']}", headers=alice.auth).json()
    assert event["trace"]["stage"] == "rule" and event["trace"]["rule_id"] == "not-work"
    assert event["trace"]["trust_gate"] == "untrusted_actor"
    assert query(db_path, "SELECT id, state FROM todos ORDER BY id") == todos_before
    assert world.client.get("/api/v1/todos?state=quarantined", headers=alice.auth).json()["todos"] == []
    assert world.client.get(f"/api/v1/subjects/{key}", headers=alice.auth).json()["state"] == "done"
    # The status comment is not due again, and says what it said.
    assert query(db_path, "SELECT due_at FROM forge_status") == [(None,)]
    assert len(github.writes()) == writes_before and status()["body"] == before_status["body"]


def test_what_a_rule_would_route_is_held_as_before_and_what_it_drops_is_dropped(world, alice):
    endpoint = world.endpoint(alice, ["triage"], name="router")
    hook = world.webhook(alice, endpoint, "github", "triage", trusted_actors={"logins": ["alice"]})
    assert world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth, json={"rules": [
        {"id": "no-spam", "expr": ".payload.issue.title == \"spam\"", "action": {"drop": True}},
        {"id": "all", "expr": "true", "action": {"queue": "triage"}}]}).status_code == 200

    def opened(title: str, sender: str) -> dict:
        raw, headers = producers.github("issues.opened", hook["secret"], {
            "issue": {"title": title, "user": {"login": sender}}, "sender": {"login": sender}})
        return world.deliver(hook, raw, headers).json()

    held = opened("a real bug", "mallory")
    assert held["disposition"] == "quarantined" and held["held"] is True and held["created"] == 1
    todo = world.client.get(f"/api/v1/todos/{held['todos'][0]['id']}", headers=alice.auth).json()
    assert todo["state"] == "quarantined" and todo["state_reason"] == "untrusted_actor"
    trace = world.client.get(f"/api/v1/events/{held['event_id']}", headers=alice.auth).json()["trace"]
    assert trace["stage"] == "trust_gate" and trace["cause"] == "untrusted_actor" and trace["hold"] == "untrusted_actor"
    assert trace["rules"]["rule_id"] == "all" and trace["untrusted"] == ["mallory"]

    spam = opened("spam", "mallory")
    assert spam["disposition"] == "dropped" and spam["created"] == 0
    trace = world.client.get(f"/api/v1/events/{spam['event_id']}", headers=alice.auth).json()["trace"]
    assert trace["rule_id"] == "no-spam" and trace["trust_gate"] == "untrusted_actor"

    # The dry run and a replay decide alike.
    dry = world.client.post(f"/api/v1/webhooks/{hook['id']}/rules/test", headers=alice.auth, json={
        "event_id": spam["event_id"]}).json()
    assert dry["decision"]["disposition"] == "dropped" and dry["trace"]["trust_gate"] == "untrusted_actor"
    dry = world.client.post(f"/api/v1/webhooks/{hook['id']}/rules/test", headers=alice.auth, json={
        "event_id": held["event_id"]}).json()
    assert dry["decision"]["disposition"] == "quarantined" and dry["trace"]["stage"] == "trust_gate"
    assert world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth, json={"rules": [
        {"id": "drop-all", "expr": "true", "action": {"drop": True}}]}).status_code == 200
    replayed = world.client.post(f"/api/v1/events/{held['event_id']}/replay", headers=alice.auth, json={}).json()
    assert replayed["after"]["disposition"] == "dropped", replayed
