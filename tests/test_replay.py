"""Replay: a stored delivery evaluated again under its webhook's current rules, by its human. One at a time it
acts (unless a dry run); in bulk it is a dry run unless told otherwise. Once claims hold, a todo the delivery
already minted on a target is never minted again, and the delivery's own disposition and first answer stay."""

from __future__ import annotations

import hashlib
import json
import threading
import types
import uuid

import httpx
import producers
import pytest
from conftest import cli, snapshot
from helpers import TLS, add_route, count, hook_token, make_webhook, post_delivery, query

from switchboard.app import create_app
from switchboard.configuration import iso
from switchboard.crypto import token_hash
from switchboard.envelope import build_envelope, envelope_record
from switchboard.payload import decode_payload
from switchboard.providers import delivery_key
from switchboard.store.deliveries import Delivery, record_delivery

DROP_ALL = {"rules": [{"id": "drop-all", "expr": "true", "action": {"drop": True}}]}


def route_to_lane(once: bool = False, exclusive: bool = False) -> dict:
    action = {"queue": "lane", **({"once": True} if once else {}), **({"exclusive": True} if exclusive else {})}
    return {"rules": [{"id": "to-lane", "expr": '.source == "github"', "action": action}]}


@pytest.fixture
def app(db_path, clock):
    return create_app(db_path, clock=clock, background=False, ingest_rate=0)


@pytest.fixture
def owner(world, alice):
    return world.endpoint(alice, ["triage", "lane"], name="owner")


@pytest.fixture
def hook(world, alice, owner):
    """A GitHub webhook that trusts every actor (so the rules decide), dropping everything for now."""
    made = world.webhook(alice, owner, "github", trusted_actors={"allow_all": True})
    set_rules(world.client, alice, made["id"], DROP_ALL)
    return made


def set_rules(client, human, webhook_id: str, rules: dict) -> None:
    r = client.put(f"/api/v1/webhooks/{webhook_id}/rules", headers=human.auth, json=rules)
    assert r.status_code == 200, r.text


def signed_issue(hook: dict, number: int = 1, event: str = "issues.opened") -> tuple[bytes, dict]:
    """One signed delivery with a fixed delivery id, to redeliver byte for byte."""
    return producers.github(event, hook["secret"], {"issue": {"number": number}}, delivery=str(uuid.uuid4()))


def replay(client, human, event_id: str, **body):
    return client.post(f"/api/v1/events/{event_id}/replay", headers=human.auth, json=body)


def replay_many(client, human, webhook_id: str, **body):
    return client.post(f"/api/v1/webhooks/{webhook_id}/replay", headers=human.auth, json=body)


def todos_of(db_path: str, event_id: str) -> list[tuple]:
    return query(db_path, "SELECT id, endpoint_id, queue, state FROM todos WHERE event_id = ? ORDER BY created_at, id",
                 (event_id,))


# -- 1. a delivery dropped by a wrong rule, replayed after the fix ---------------------------------------

@pytest.mark.parametrize("once_exclusive", [False, True], ids=["plain", "once-exclusive"])
def test_a_wrongly_dropped_delivery_is_replayed_once_and_keeps_its_first_answer(world, alice, owner, hook, db_path,
                                                                                 clock, once_exclusive):
    # A second target on the lane: a plain rule mints a todo for each, an exclusive one for the owner only.
    other = world.endpoint(alice, ["lane"], name="second")
    assert add_route(world.client, alice.auth, hook["id"], other.id).status_code == 201
    raw, headers = signed_issue(hook)
    first = world.deliver(hook, raw, headers)
    assert first.status_code == 202 and first.json()["disposition"] == "dropped" and first.json()["created"] == 0
    event_id = first.json()["event_id"]
    set_rules(world.client, alice, hook["id"], route_to_lane(once=once_exclusive, exclusive=once_exclusive))

    r = replay(world.client, alice, event_id)
    assert r.status_code == 200, r.text
    answer = r.json()
    targets = [owner.id] if once_exclusive else [owner.id, other.id]
    assert answer["event_id"] == event_id and answer["dry_run"] is False
    assert answer["before"] == {"disposition": "dropped"}
    assert answer["after"] == {"disposition": "routed", "queue": "lane", "rule_id": "to-lane", "stage": "rule"}
    assert answer["created"] == len(targets)
    assert [(t["endpoint_id"], t["queue"], t["created"]) for t in answer["todos"]] == [
        (e, "lane", True) for e in targets]
    minted = todos_of(db_path, event_id)
    assert sorted(minted) == sorted((t["id"], t["endpoint_id"], "lane", "pending") for t in answer["todos"])
    todo = world.client.get(f"/api/v1/todos/{answer['todos'][0]['id']}", headers=alice.auth).json()
    assert todo["event_id"] == event_id and todo["source"] == "github" and todo["kind"] == "issues"
    assert todo["payload"] == json.loads(raw), "the todo carries the delivery's payload, as a fresh one would"
    if once_exclusive:
        assert query(db_path, "SELECT event_id, queue FROM routing_once WHERE webhook_id = ?", (hook["id"],)) == [
            (event_id, "lane")]

    clock.advance(1)
    again = replay(world.client, alice, event_id)
    assert again.status_code == 200 and again.json()["created"] == 0 and again.json()["todos"] == []
    assert again.json()["after"]["disposition"] == ("repeat" if once_exclusive else "routed")
    assert len(todos_of(db_path, event_id)) == len(targets), "replaying again mints nothing"

    event = world.client.get(f"/api/v1/events/{event_id}", headers=alice.auth).json()
    assert event["disposition"] == "dropped" and event["outcome"] == first.json()
    assert [(p["actor"], p["before"], p["after"]["disposition"], p["created"]) for p in event["replays"]] == [
        (f"human:{alice.id}", {"disposition": "dropped"}, "routed", len(targets)),
        (f"human:{alice.id}", {"disposition": "dropped"}, again.json()["after"]["disposition"], 0)]
    assert all(p["id"].startswith("rp_") and p["at"].endswith("Z") for p in event["replays"])
    assert event["replays"][0]["after"] == answer["after"]

    # The producer redelivers the same delivery: its first answer, as a duplicate; nothing minted.
    redelivered = world.deliver(hook, raw, headers)
    assert redelivered.status_code == 202
    assert redelivered.json() == {**first.json(), "duplicate": True}
    assert len(todos_of(db_path, event_id)) == len(targets)
    assert count(db_path, "events") == 1


# -- 2. a dry run --------------------------------------------------------------------------------------

def test_a_dry_run_reports_the_same_decision_and_writes_nothing(world, alice, owner, hook, db_path):
    event_id = world.deliver(hook, *signed_issue(hook)).json()["event_id"]
    set_rules(world.client, alice, hook["id"], route_to_lane(once=True))
    before = snapshot(db_path)
    dry = replay(world.client, alice, event_id, dry_run=True)
    assert dry.status_code == 200, dry.text
    assert dry.json()["dry_run"] is True and dry.json()["created"] == 0
    assert dry.json()["after"] == {"disposition": "routed", "queue": "lane", "rule_id": "to-lane", "stage": "rule"}
    assert dry.json()["todos"] == [{"id": None, "endpoint_id": owner.id, "queue": "lane", "created": False}]
    assert replay(world.client, alice, event_id, dry_run=True).json() == dry.json()
    assert snapshot(db_path) == before, "a dry run writes nothing: no todo, no once claim, no replay record"

    done = replay(world.client, alice, event_id).json()
    assert done["after"] == dry.json()["after"] and done["before"] == dry.json()["before"]
    assert done["created"] == 1 and [(t["endpoint_id"], t["queue"]) for t in done["todos"]] == [(owner.id, "lane")]
    # After the real one, a dry run says what a replay would do now: nothing new (the key is claimed).
    later = snapshot(db_path)
    assert replay(world.client, alice, event_id, dry_run=True).json()["after"]["disposition"] == "repeat"
    assert snapshot(db_path) == later


# -- 3. races, against a real server -------------------------------------------------------------------

def test_racing_replays_and_redeliveries_mint_exactly_once(db_path, live_server):
    assert cli(db_path, "init")[0] == 0
    _, human = cli(db_path, "human", "add", "alice")
    auth = {"Authorization": f"Bearer {human['token']}"}

    Alice = types.SimpleNamespace(auth=auth)
    server = live_server("--ingest-rate", "0")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/api/v1/endpoints", headers=auth, json={"name": "owner", "queues": ["triage", "lane"]})
        assert r.status_code == 201, r.text
        owner_id = r.json()["id"]
        hook = make_webhook(http, Alice, owner_id, "github", trusted_actors={"allow_all": True})
        set_rules(http, Alice, hook["id"], DROP_ALL)
        first_raw, first_headers = signed_issue(hook, 1)
        second_raw, second_headers = signed_issue(hook, 2)
        first = post_delivery(http, hook, first_raw, first_headers).json()
        second = post_delivery(http, hook, second_raw, second_headers).json()
        assert first["disposition"] == second["disposition"] == "dropped"
        set_rules(http, Alice, hook["id"], route_to_lane())

    # A replay while the producer redelivers the same signed delivery again and again.
    go = threading.Barrier(2)
    stop = threading.Event()
    redeliveries: list = []
    replayed: list = []

    def redeliver():
        with httpx.Client(base_url=server.url, timeout=30) as c:
            go.wait(10)
            while not stop.is_set() or len(redeliveries) < 20:
                redeliveries.append(post_delivery(c, hook, first_raw, first_headers))

    def replay_first():
        with httpx.Client(base_url=server.url, timeout=30) as c:
            go.wait(10)
            replayed.append(replay(c, Alice, first["event_id"]))
            stop.set()

    threads = [threading.Thread(target=redeliver), threading.Thread(target=replay_first)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    [answer] = replayed
    assert answer.status_code == 200 and answer.json()["created"] == 1, answer.text
    assert all(r.status_code == 202 and r.json()["duplicate"] is True and r.json()["created"] == 0
               and r.json()["disposition"] == "dropped" for r in redeliveries)
    assert len(todos_of(db_path, first["event_id"])) == 1
    assert count(db_path, "events") == 2

    # Six replays of one delivery at once, under a once rule: one todo, one claim.
    with httpx.Client(base_url=server.url, timeout=30) as http:
        set_rules(http, Alice, hook["id"], route_to_lane(once=True, exclusive=True))
    barrier = threading.Barrier(6)
    answers: list = [None] * 6

    def replay_second(i: int):
        with httpx.Client(base_url=server.url, timeout=30, verify=TLS) as c:
            barrier.wait(10)
            answers[i] = replay(c, Alice, second["event_id"])

    threads = [threading.Thread(target=replay_second, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(a is not None and a.status_code == 200 for a in answers), [a and a.text for a in answers]
    assert sum(a.json()["created"] for a in answers) == 1
    assert sorted(a.json()["after"]["disposition"] for a in answers) == ["repeat"] * 5 + ["routed"]
    assert len(todos_of(db_path, second["event_id"])) == 1
    assert query(db_path, "SELECT event_id FROM routing_once WHERE webhook_id = ?", (hook["id"],)) == [
        (second["event_id"],)]
    assert count(db_path, "event_replays", "event_id = ?", (second["event_id"],)) == 6


# -- 4. replaying what was routed ----------------------------------------------------------------------

@pytest.mark.parametrize("once", [False, True], ids=["plain", "once"])
def test_replaying_a_routed_delivery_changes_nothing(world, alice, owner, hook, db_path, once):
    set_rules(world.client, alice, hook["id"], route_to_lane(once=once))
    delivered = world.deliver(hook, *signed_issue(hook)).json()
    assert delivered["disposition"] == "routed" and delivered["created"] == 1
    [todo] = todos_of(db_path, delivered["event_id"])
    todos_before = query(db_path, "SELECT * FROM todos ORDER BY id")
    claims_before = query(db_path, "SELECT * FROM routing_once")
    answer = replay(world.client, alice, delivered["event_id"]).json()
    assert answer["before"] == {"disposition": "routed"} and answer["created"] == 0 and answer["todos"] == []
    assert answer["after"]["disposition"] == ("repeat" if once else "routed")
    assert query(db_path, "SELECT * FROM todos ORDER BY id") == todos_before, "its todo exists; nothing changed"
    assert query(db_path, "SELECT * FROM routing_once") == claims_before
    assert todos_of(db_path, delivered["event_id"]) == [todo]


def test_replaying_a_held_delivery_after_trusting_routes_it_and_closes_the_hold(world, alice, owner, db_path):
    gated = world.webhook(alice, owner, "github", trusted_actors=None)  # no trusted actors: held by the trust gate
    held = world.deliver(gated, *signed_issue(gated)).json()
    assert held["disposition"] == "quarantined"
    r = world.client.put(f"/api/v1/webhooks/{gated['id']}/trusted-actors", headers=alice.auth,
                         json={"allow_all": True})
    assert r.status_code == 200, r.text
    answer = replay(world.client, alice, held["event_id"]).json()
    assert answer["before"] == {"disposition": "quarantined"} and answer["after"]["disposition"] == "routed"
    assert answer["created"] == 1 and answer["todos"][0]["queue"] == "triage"
    states = dict((t[0], t[3]) for t in todos_of(db_path, held["event_id"]))
    assert states == {held["todos"][0]["id"]: "done", answer["todos"][0]["id"]: "pending"}
    assert replay(world.client, alice, held["event_id"]).json()["created"] == 0


# -- 5. in bulk ----------------------------------------------------------------------------------------

def store_deliveries(app, hook: dict, start: int, n: int, event: str) -> None:
    """`n` deliveries, stored as ingress stores them (the same envelope, key and decision: dropped by rule
    drop-all), written in one transaction at the clock's moment, without n HTTP round trips."""
    db = app.state.db
    token = hook_token(hook["url"])
    deliveries = []
    for number in range(start, start + n):
        raw, headers = producers.github(event, hook["secret"], {"issue": {"number": number}})
        headers = {k.lower(): v for k, v in headers.items()}
        payload, _ = decode_payload(headers, raw)
        envelope = build_envelope(provider="github", webhook_id=hook["id"], trust_mode="signed", verified=True,
                                     headers=headers, body=raw, payload=payload,
                                     trusted_actors={"allow_all": True})
        action = {"drop": True}
        trace = {"stage": "rule", "rule_index": 0, "rule_id": "drop-all", "rule_name": None, "action": action}
        deliveries.append(Delivery(
            webhook_id=hook["id"], endpoint_id=hook["endpoint_id"], token_hash=token_hash(token), body=raw,
            envelope=envelope,
            envelope_record=envelope_record(envelope), headers_json=json.dumps(envelope["headers"]),
            delivery_key=delivery_key("github", headers, payload, raw), body_hash=hashlib.sha256(raw).hexdigest(),
            action=action, trace=trace))

    def write_all(txn):
        for delivery in deliveries:
            assert record_delivery(txn, delivery)["disposition"] == "dropped"
    db.write_sync(write_all)


def test_bulk_replay_is_a_dry_run_by_default_and_filters(world, alice, owner, hook, app, clock, db_path):
    # One real delivery, to know stored ones look like it; then 999 more: 4 hours of traffic, 50 of them comments.
    real = world.deliver(hook, *signed_issue(hook, 100_000)).json()
    assert real["disposition"] == "dropped"
    hours = [clock.ms]
    store_deliveries(app, hook, 1, 249, "issues.opened")
    for hour in range(1, 4):
        clock.advance(3600)
        hours.append(clock.ms)
        store_deliveries(app, hook, hour * 1000, 250 - (50 if hour == 3 else 0), "issues.opened")
    store_deliveries(app, hook, 5000, 50, "issue_comment.created")
    assert count(db_path, "events", "webhook_id = ? AND disposition = 'dropped'", (hook["id"],)) == 1000
    stored = query(db_path, "SELECT kind, trust_mode, verified, disposition FROM events"
                   " GROUP BY kind, trust_mode, verified, disposition")
    assert set(stored) == {("issues", "signed", 1, "dropped"), ("issue_comment", "signed", 1, "dropped")}
    set_rules(world.client, alice, hook["id"], {"rules": [
        {"id": "comments", "expr": '.kind == "issue_comment"', "action": {"queue": "triage"}},
        {"id": "issues", "expr": '.kind == "issues"', "action": {"queue": "lane"}}]})

    before = snapshot(db_path)
    r = replay_many(world.client, alice, hook["id"], limit=1000)
    assert r.status_code == 200, r.text
    assert r.json() == {"matched": 1000, "changed": 1000, "created": 0, "dry_run": True, "transitions": [
        {"from": "dropped", "to": "routed", "rule_id": "issues", "count": 950},
        {"from": "dropped", "to": "routed", "rule_id": "comments", "count": 50}]}
    assert snapshot(db_path) == before, "the bulk replay is a dry run by default"

    def matched(**filters) -> dict:
        answer = replay_many(world.client, alice, hook["id"], **filters)
        assert answer.status_code == 200, answer.text
        return answer.json()

    assert matched()["matched"] == 200, "the default limit"
    assert matched(limit=10)["matched"] == 10
    assert matched(kind="issue_comment", limit=1000)["transitions"] == [
        {"from": "dropped", "to": "routed", "rule_id": "comments", "count": 50}]
    assert matched(kind="push", limit=1000)["matched"] == 0
    assert matched(disposition="dropped", since=iso(hours[3]), limit=1000)["matched"] == 250
    assert matched(disposition="routed", limit=1000)["matched"] == 0
    assert matched(since=iso(hours[1]), until=iso(hours[3]), limit=1000)["matched"] == 500
    assert matched(until=iso(hours[1]), limit=1000)["matched"] == 250
    assert matched(since=iso(hours[3] + 1), limit=1000)["matched"] == 0
    for bad in ({"limit": 1001}, {"limit": 0}, {"disposition": "lost"}, {"since": "yesterday"}, {"nope": 1}):
        refused = replay_many(world.client, alice, hook["id"], **bad)
        assert refused.status_code == 400 and refused.json()["error"] == "invalid_argument", (bad, refused.text)
    assert snapshot(db_path) == before

    # Applied: first the comments, then everything; nothing is minted twice.
    applied = matched(kind="issue_comment", limit=1000, dry_run=False)
    assert applied["dry_run"] is False and applied["created"] == 50 and applied["matched"] == 50
    assert count(db_path, "todos", "queue = 'triage'") == 50
    applied = matched(limit=1000, dry_run=False)
    assert applied["created"] == 950 and applied["matched"] == 1000
    assert count(db_path, "todos") == 1000 and count(db_path, "todos", "queue = 'lane'") == 950
    assert count(db_path, "event_replays") == 1050
    assert count(db_path, "events", "disposition = 'dropped'") == 1000, "each event keeps its own disposition"


# -- 6. who may replay, and the CLI --------------------------------------------------------------------

def test_only_the_webhooks_human_may_replay(world, alice, owner, hook, db_path):
    event_id = world.deliver(hook, *signed_issue(hook)).json()["event_id"]
    set_rules(world.client, alice, hook["id"], route_to_lane())
    bob = world.human("bob")
    before = snapshot(db_path)
    for body in ({}, {"dry_run": True}):
        r = replay(world.client, bob, event_id, **body)
        assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
    for body in ({}, {"dry_run": False, "limit": 5}):
        r = replay_many(world.client, bob, hook["id"], **body)
        assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
    assert replay(world.client, owner, event_id).status_code == 403
    assert replay_many(world.client, owner, hook["id"], dry_run=False).status_code == 403
    assert world.client.post(f"/api/v1/events/{event_id}/replay", json={}).status_code == 401
    assert replay(world.client, alice, "ev_0000000000", dry_run=True).status_code == 404
    assert snapshot(db_path) == before
    assert replay(world.client, alice, event_id).json()["created"] == 1


def test_replay_through_the_cli(world, alice, owner, hook, db_path):
    first = world.deliver(hook, *signed_issue(hook, 1)).json()
    second = world.deliver(hook, *signed_issue(hook, 2)).json()
    set_rules(world.client, alice, hook["id"], route_to_lane())

    code, dry = cli(db_path, "events", "replay", "--webhook", hook["id"])
    assert code == 0 and dry == {"matched": 2, "changed": 2, "created": 0, "dry_run": True, "transitions": [
        {"from": "dropped", "to": "routed", "rule_id": "to-lane", "count": 2}]}, dry
    assert count(db_path, "todos") == 0

    code, one = cli(db_path, "events", "replay", first["event_id"], "--apply")
    assert code == 0 and one["event_id"] == first["event_id"] and one["dry_run"] is False, one
    assert one["created"] == 1 and one["after"]["disposition"] == "routed" and one["todos"][0]["queue"] == "lane"
    assert len(todos_of(db_path, first["event_id"])) == 1 and todos_of(db_path, second["event_id"]) == []
    event = world.client.get(f"/api/v1/events/{first['event_id']}", headers=alice.auth).json()
    assert [(p["created"], p["after"]["disposition"]) for p in event["replays"]] == [(1, "routed")]

    code, bulk = cli(db_path, "events", "replay", "--webhook", hook["id"], "--apply", "--limit", "1000")
    assert code == 0 and bulk["dry_run"] is False and bulk["matched"] == 2 and bulk["created"] == 1, bulk
    assert count(db_path, "todos") == 2
    code, refused = cli(db_path, "events", "replay", "--webhook", hook["id"], "--limit", "1001")
    assert code == 1 and refused["error"] == "invalid_argument"
