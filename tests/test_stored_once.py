"""Each delivery's body is stored once: its event keeps the raw bytes, and the envelope and the todos' payloads
are read from them. The API shows the same payload and envelope as before; the file grows by little more than
the bytes received; retention never separates a todo from the body its payload is read from."""

from __future__ import annotations

import json
import os
import urllib.parse

import producers
import pytest
from helpers import connect_db

from switchboard.limits import RateLimiter
from switchboard.store.upkeep import prune


def _routed_hook(world, alice):
    worker = world.endpoint(alice, ["triage"], name="worker", verbs=["all"])
    return world.webhook(alice, worker, trusted_actors={"allow_all": True}), worker


def test_a_delivery_body_is_stored_once_and_read_back_whole(world, alice, db_path):
    hook, worker = _routed_hook(world, alice)
    raw, headers = producers.github("issues.opened", hook["secret"], {"issue": {"body": "é" * 2000}})
    answer = world.deliver(hook, raw, headers).json()
    assert answer["disposition"] == "routed", answer
    conn = connect_db(db_path)
    body, envelope, stored_headers = conn.execute(
        "SELECT b.body, e.envelope, e.headers FROM events e JOIN event_bodies b ON b.event_id = e.id").fetchone()
    todo_payload, = conn.execute("SELECT payload FROM todos").fetchone()
    conn.close()
    assert body == raw, "the raw body, byte for byte"
    assert todo_payload is None, "the todo has no copy of the body"
    assert "payload" not in json.loads(envelope) and "headers" not in json.loads(envelope)
    assert len(envelope) < len(raw) // 4

    todo = world.client.get(f"/api/v1/todos/{answer['todos'][0]['id']}", headers=alice.auth).json()
    assert todo["payload"] == json.loads(raw)
    claimed = world.claim(worker)
    assert claimed["todo"]["payload"] == json.loads(raw)
    event = world.client.get(f"/api/v1/events/{answer['event_id']}", headers=alice.auth).json()
    assert event["envelope"]["payload"] == json.loads(raw)
    assert event["envelope"]["headers"] == json.loads(stored_headers) == event["headers"]
    assert event["envelope"]["issue"]["number"] == json.loads(raw)["issue"]["number"]


def test_a_form_encoded_delivery_shows_its_json_payload(world, alice):
    hook, _ = _routed_hook(world, alice)
    raw_json, headers = producers.github("issues.opened", hook["secret"])
    form = urllib.parse.urlencode({"payload": raw_json.decode()}).encode()
    headers = {**producers.github_headers(hook["secret"], form), "Content-Type": "application/x-www-form-urlencoded"}
    answer = world.deliver(hook, form, headers).json()
    assert answer["disposition"] == "routed", answer
    todo = world.client.get(f"/api/v1/todos/{answer['todos'][0]['id']}", headers=alice.auth).json()
    assert todo["payload"] == json.loads(raw_json)


def test_rules_see_the_payload_and_headers_of_the_stored_once_envelope(world, alice):
    hook, _ = _routed_hook(world, alice)
    r = world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth, json={"rules": [
        {"id": "by-title", "expr": '.payload.issue.title == "stored once" and .headers["x-github-event"] == "issues"',
         "action": {"drop": True}}]})
    assert r.status_code == 200, r.text
    raw, headers = producers.github("issues.opened", hook["secret"], {"issue": {"title": "stored once"}})
    assert world.deliver(hook, raw, headers).json()["disposition"] == "dropped"
    raw, headers = producers.github("issues.opened", hook["secret"], {"issue": {"title": "another"}})
    assert world.deliver(hook, raw, headers).json()["disposition"] == "routed"


@pytest.mark.sqlite_only("the SQLite file's size")
def test_the_file_grows_by_little_more_than_the_bodies_received(world, alice, app, db_path):
    app.state.flows.limiter = RateLimiter(0, 1)  # as `serve --ingest-rate 0`
    hook, _ = _routed_hook(world, alice)
    world.db.checkpoint()
    before = os.path.getsize(db_path)
    received = 0
    for number in range(300):
        raw, headers = producers.github("issues.opened", hook["secret"],
                                        {"issue": {"number": number + 1, "body": os.urandom(6000).hex()}})
        assert world.deliver(hook, raw, headers).status_code == 202
        received += len(raw)
    world.db.checkpoint()
    grown = os.path.getsize(db_path) - before
    assert grown <= 1.3 * received, f"the file grew {grown / received:.2f}x the bytes received"


def test_retention_keeps_an_event_while_any_todo_reads_its_payload(world, alice, clock):
    hook, worker = _routed_hook(world, alice)
    raw, headers = producers.github("issues.opened", hook["secret"])
    world.deliver(hook, raw, headers)
    clock.advance(29 * 86400)
    claim = world.claim(worker)
    world.act(worker, claim["todo"]["id"], "complete", lease_token=claim["lease_token"])
    clock.advance(2 * 86400)  # the event is 31 days old, its done todo one day
    assert prune(world.db) == {"todos": 0, "events": 0, "notifications": 0}
    todo = world.client.get(f"/api/v1/todos/{claim['todo']['id']}", headers=alice.auth).json()
    assert todo["payload"] == json.loads(raw)
    clock.advance(30 * 86400)
    assert prune(world.db) == {"todos": 1, "events": 1, "notifications": 0}
