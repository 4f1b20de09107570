"""Batch claims (issue 45 part 4, SPEC 17): `POST /api/v1/todos/claim` with `max_todos` hands out up to that many
todos in one transaction, each its own attempt and lease token, answered as `{"claims": [...]}` (or the usual
empty answer). Caps, per-key limits, pauses and dependencies hold exactly as for single claims; MCP's claim_next
takes it too; `switchboard worker` fills all its free slots with one call."""

from __future__ import annotations

import os
import threading
import time

import httpx
import producers
import pytest
from conftest import cli, snapshot
from helpers import TLS, count, hook_path, query
from test_worker import SHELL_COMPLETE, lane, site, workers  # noqa: F401 - the worker tests' fixtures

from switchboard.models import ClaimAnswer

QUEUE = "build"


@pytest.fixture
def pool(world, alice):
    return world.endpoint(alice, [QUEUE, "docs"], name="pool")


def limits(world, human, endpoint, queue: str = QUEUE, **body) -> None:
    answer = world.client.put(f"/api/v1/endpoints/{endpoint.id}/queues/{queue}/limits", headers=human.auth,
                              json=body)
    assert answer.status_code == 200, answer.text


def batch(world, endpoint, **body) -> dict:
    answer = world.claim(endpoint, **body)
    ClaimAnswer.model_validate(answer)
    return answer


def test_a_batch_of_8_from_5_claimable_gives_5_distinct_todos_each_with_its_own_lease(world, alice, pool, clock,
                                                                                     db_path):
    ready = [world.push(alice, pool, QUEUE, f"ready {n}", priority=n % 2)["id"] for n in range(5)]
    later = world.push(alice, pool, QUEUE, "retry later")["id"]
    held = world.claim(pool)
    assert held["todo"]["id"] == ready[1], "priority first"
    waits = world.push(alice, pool, QUEUE, "waits for its dependency",
                       work_item={"schema": "switchboard.work_item.v1", "objective": "after", "depends_on": [held["todo"]["id"]]})["id"]
    assert world.act(pool, held["todo"]["id"], "fail", lease_token=held["lease_token"], error="again",
                     retry=True, retry_in_seconds=60).status_code == 200
    answer = batch(world, pool, max_todos=8)
    claims = answer["claims"]
    ids = [c["todo"]["id"] for c in claims]
    assert ids == [ready[3], ready[0], ready[2], ready[4], later], "best first; the retry and the dependent wait"
    assert len({c["lease_token"] for c in claims}) == 5
    assert all(c["todo"]["state"] == "claimed" and c["todo"]["attempt"] == 1 for c in claims)
    assert count(db_path, "attempts", "ended_at IS NULL") == 5
    assert len({row[0] for row in query(db_path, "SELECT claimed_at FROM attempts WHERE ended_at IS NULL")}) == 1, \
        "one transaction"
    for claim in claims:  # each lease is its own: a token fences only its todo
        other = next(c for c in claims if c is not claim)
        assert world.act(pool, claim["todo"]["id"], "heartbeat", lease_token=other["lease_token"]).status_code == 409
        assert world.act(pool, claim["todo"]["id"], "complete", lease_token=claim["lease_token"]).status_code == 200
    assert world.claim(pool, max_todos=8) == {"empty": True}, "nothing claimable: the usual empty answer"
    assert waits not in ids


def test_a_batch_respects_max_in_flight_the_window_and_pauses(world, alice, pool):
    for n in range(5):
        world.push(alice, pool, QUEUE, f"build {n}")
    docs = [world.push(alice, pool, "docs", f"docs {n}")["id"] for n in range(3)]
    limits(world, alice, pool, max_in_flight=3)
    limits(world, alice, pool, queue="docs", max_claims_per_window={"count": 2, "window_seconds": 3600})
    answer = batch(world, pool, max_todos=8)
    queues = [c["todo"]["queue"] for c in answer["claims"]]
    assert sorted(queues) == ["build"] * 3 + ["docs"] * 2, queues
    shut = world.claim(pool, max_todos=8)
    assert shut["empty"] and [(a["queue"], a["reason"]) for a in shut["admission"]] == [
        (QUEUE, "max_in_flight"), ("docs", "max_claims_per_window")]
    paused = world.client.post(f"/api/v1/endpoints/{pool.id}/queues/{QUEUE}/pause", headers=alice.auth, json={})
    assert paused.status_code == 200
    limits(world, alice, pool, max_in_flight=None)
    limits(world, alice, pool, queue="docs", max_claims_per_window=None)
    taken = {c["todo"]["id"] for c in answer["claims"]}
    answer = batch(world, pool, max_todos=8)
    assert [c["todo"]["id"] for c in answer["claims"]] == [d for d in docs if d not in taken], \
        "the paused queue gives nothing; docs had one left"


def issue(world, hook, number: int) -> str:
    raw, headers = producers.github("issues.opened", hook["secret"], {
        "issue": {"number": number, "body": os.urandom(8).hex()}, "repository": {"full_name": "acme/site"}})
    answer = world.deliver(hook, raw, headers)
    assert answer.status_code == 202, answer.text
    return answer.json()["todos"][0]["id"]


def test_a_batch_respects_the_per_key_limit(world, alice, pool):
    hook = world.webhook(alice, pool, "github", QUEUE)
    for number in (1, 1, 1, 2, 2, 3):
        issue(world, hook, number)
    limits(world, alice, pool, max_in_flight_per_key={"key": "subject", "max": 1})
    answer = batch(world, pool, max_todos=8)
    keys = [c["todo"]["subject_key"] for c in answer["claims"]]
    assert sorted(keys) == [f"github:acme/site#{n}" for n in (1, 2, 3)], keys
    assert world.claim(pool, max_todos=8)["admission"] == [{"queue": QUEUE, "reason": "max_in_flight_per_key",
                                                           "until": None}]


def test_a_waiting_batch_claim_waits_for_the_first_todo_then_takes_what_is_there(world, app, alice, pool):
    result: dict = {}
    waiter = threading.Thread(daemon=True, target=lambda: result.update(
        world.claim(pool, max_todos=4, wait_seconds=10)))
    waiter.start()
    deadline = time.monotonic() + 10
    while not any(s["via"] == "claim" for s in app.state.doorbell.sessions_of(pool.id)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    pushed = world.push(alice, pool, QUEUE, "arrives")["id"]
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    assert [c["todo"]["id"] for c in result["claims"]] == [pushed]


def test_bad_max_todos_is_a_400_naming_the_field_and_changes_nothing(world, alice, pool, db_path):
    world.push(alice, pool, QUEUE, "stays pending")
    before = snapshot(db_path)
    for value in (0, 33, "2", 2.5, None):
        answer = world.client.post("/api/v1/todos/claim", headers=pool.auth, json={"max_todos": value})
        assert answer.status_code == 400 and "max_todos" in answer.json()["message"], answer.text
    assert snapshot(db_path) == before


def test_mcp_claim_next_takes_max_todos_and_the_session_keeps_each_lease(world, alice, pool, db_path):
    for n in range(3):
        world.push(alice, pool, QUEUE, f"job {n}")
    headers = {**pool.auth, "Accept": "application/json, text/event-stream"}
    opened = world.client.post("/mcp", headers=headers, json={
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
    assert opened.status_code == 200, opened.text
    session = {**headers, "Mcp-Session-Id": opened.headers["Mcp-Session-Id"]}

    def call(name: str, arguments: dict) -> dict:
        r = world.client.post("/mcp", headers=session, json={"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                                                             "params": {"name": name, "arguments": arguments}})
        assert r.status_code == 200, r.text
        return r.json()["result"]

    claimed = call("claim_next", {"max_todos": 2})
    assert not claimed["isError"], claimed
    ids = [c["todo"]["id"] for c in claimed["structuredContent"]["claims"]]
    assert len(set(ids)) == 2
    for todo_id in ids:  # without a lease token: the session kept each claim's
        done = call("complete", {"id": todo_id})
        assert not done["isError"] and done["structuredContent"]["state"] == "done", done
    refused = call("claim_next", {"max_todos": 33})
    assert refused["isError"] and "max_todos" in refused["structuredContent"]["message"]


def test_the_worker_fills_its_free_slots_with_one_claim(lane, workers):  # noqa: F811 - fixtures from test_worker
    """Four todos wait before a worker of concurrency 4 starts: its first claim takes all four in one transaction
    (the same claimed_at on every attempt) and works them side by side, one per slot."""
    pushed = [lane.push(title=f"t{n}") for n in range(4)]
    worker = workers(lane, "--concurrency", "4", "--name", "batcher", command=SHELL_COMPLETE)
    for todo_id in pushed:
        lane.settled(todo_id, ("done",), seconds=30)
    assert worker.stop() == 0
    attempts = query(lane.server.db_path, "SELECT todo_id, claimed_at, claimant FROM attempts WHERE endpoint_id = ?",
                     (lane.endpoint_id,))
    assert sorted(row[0] for row in attempts) == sorted(pushed), "one attempt per todo"
    assert len({row[1] for row in attempts}) == 1, f"one claim for the four free slots: {attempts}"


def test_racing_batch_claims_hold_max_in_flight_and_the_per_key_limit(live_server, db_path):
    """A real server, 8 threads released together, each asking for 4 todos: 5 in flight at most across them all,
    one per subject, whatever the engine runs side by side."""
    server = live_server("--synchronous", "normal")
    _, human = cli(db_path, "human", "add", "racer")
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {human['token']}"}, timeout=30) as http:
        endpoint = http.post("/api/v1/endpoints", json={"name": "pool", "queues": [QUEUE]}).json()
        hook = http.post("/api/v1/webhooks", json={"provider": "github", "queue": QUEUE, "endpoint_id": endpoint["id"],
                                                  "trusted_actors": {"allow_all": True}}).json()
        for number in range(1, 8):
            for _ in range(3):
                raw, headers = producers.github("issues.opened", hook["secret"], {
                    "issue": {"number": number, "body": os.urandom(8).hex()}, "repository": {"full_name": "acme/site"}})
                assert http.post(hook_path(hook["url"]), content=raw, headers=headers).status_code == 202
        assert http.put(f"/api/v1/endpoints/{endpoint['id']}/queues/{QUEUE}/limits", json={
            "max_in_flight": 5, "max_in_flight_per_key": {"key": "subject", "max": 1}}).status_code == 200
    start, got, lock = threading.Barrier(8), [], threading.Lock()

    def racer() -> None:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {endpoint['token']}"},
                          timeout=30, verify=TLS) as c:
            start.wait()
            answer = c.post("/api/v1/todos/claim", json={"max_todos": 4}).json()
        with lock:
            got.append(answer)

    threads = [threading.Thread(daemon=True, target=racer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    claims = [c for answer in got for c in answer.get("claims", [])]
    keys = [c["todo"]["subject_key"] for c in claims]
    claimed = count(db_path, "todos", "endpoint_id = ? AND state = 'claimed'", (endpoint["id"],))
    assert len(claims) == claimed == 5 and len(set(keys)) == 5, (claimed, keys, got)
