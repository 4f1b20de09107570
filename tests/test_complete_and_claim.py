"""`complete` with `claim_next` (issue 39): one call, one transaction, that finishes the held todo and claims the
endpoint's next one, over REST and MCP on the real app. A refused call (bad input, a scope it lacks, a lease it
does not hold) changes nothing, and under racing callers every todo is still claimed once and fenced."""

from __future__ import annotations

import threading
from collections import Counter

import anyio
import httpx
import pytest
from conftest import cli, snapshot
from helpers import TLS, connect_db
from test_mcp import connect

from switchboard.models import CompleteAnswer


@pytest.fixture
def worker(world, alice):
    return world.endpoint(alice, ["build", "docs"])


def complete(world, endpoint, todo_id: str, lease_token: str, **body) -> httpx.Response:
    return world.act(endpoint, todo_id, "complete", lease_token=lease_token, **body)


def test_complete_claims_the_next_todo_in_the_same_transaction(world, alice, worker, db_path):
    first, second = world.push(alice, worker, "build", "first"), world.push(alice, worker, "build", "second")
    claim = world.claim(worker, queue="build")
    assert claim["todo"]["id"] == first["id"]
    r = complete(world, worker, first["id"], claim["lease_token"], result={"ok": 1},
                 claim_next={"queue": "build", "lease_seconds": 120, "claimant": "box-1"})
    assert r.status_code == 200, r.text
    answer = CompleteAnswer.model_validate(r.json())
    assert answer.id == first["id"] and answer.state == "done" and answer.result == {"ok": 1}
    following = r.json()["next"]
    assert following["todo"]["id"] == second["id"] and following["todo"]["state"] == "claimed"
    assert following["prior_attempts"] == []
    conn = connect_db(db_path)
    ended = conn.execute("SELECT ended_at, outcome FROM attempts WHERE todo_id = ?", (first["id"],)).fetchone()
    started = conn.execute("SELECT claimed_at, claimant, lease_seconds FROM attempts WHERE todo_id = ?",
                           (second["id"],)).fetchone()
    assert ended[1] == "completed" and started == (ended[0], "box-1", 120), "one transaction, the claim's fields"
    beat = world.act(worker, second["id"], "heartbeat", lease_token=following["lease_token"])
    assert beat.status_code == 200, "the lease token handed out is the one that fences the todo"
    last = complete(world, worker, second["id"], following["lease_token"], claim_next={})
    assert last.status_code == 200 and last.json()["next"] == {"empty": True}
    assert "next" not in complete(world, worker, world.push(alice, worker, "docs")["id"],
                                  world.claim(worker)["lease_token"]).json(), "no claim asked, none answered"


def test_the_claim_keeps_the_claims_rules(world, alice, worker, clock):
    """The claim is claim_next's own: its queue filter, the queue's pause (named in `admission`), review gates."""
    gated = world.push(alice, worker, "build", "gated", work_item={"schema": "switchboard.work_item.v1",
                                                                    "objective": "o", "approval_gates": ["review"]})
    docs = world.push(alice, worker, "docs", "docs work")
    claim = world.claim(worker, queue="build")
    r = complete(world, worker, gated["id"], claim["lease_token"], summary="ready",
                 claim_next={"queues": ["build"]})
    assert r.status_code == 200 and r.json()["state"] == "review" and r.json()["next"] == {"empty": True}
    paused = world.client.post(f"/api/v1/endpoints/{worker.id}/queues/docs/pause", headers=alice.auth,
                               json={"reason": "maintenance"})
    assert paused.status_code == 200, paused.text
    other = world.push(alice, worker, "build", "other")
    claim = world.claim(worker, queue="build")
    r = complete(world, worker, other["id"], claim["lease_token"], claim_next={"queue": "docs"})
    assert r.status_code == 200, r.text
    assert r.json()["next"]["empty"] is True and r.json()["next"]["admission"][0]["reason"] == "paused"
    assert world.client.get(f"/api/v1/todos/{docs['id']}", headers=alice.auth).json()["state"] == "pending"


def test_the_openapi_document_shows_claim_next_on_complete(world):
    document = world.client.get("/api/v1/openapi.json").json()
    schemas = document["components"]["schemas"]
    assert "claim_next" in schemas["Complete"]["properties"]
    assert set(schemas["ClaimNow"]["properties"]) == {"queue", "queues", "lease_seconds", "claimant"}
    assert schemas["ClaimNow"]["additionalProperties"] is False
    operation = document["paths"]["/api/v1/todos/{todo_id}/complete"]["post"]
    assert operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("CompleteAnswer")


@pytest.mark.parametrize("claim_next, status, error", [
    ({"queue": "build", "wait_seconds": 5}, 400, "invalid_argument"),  # the combined claim never waits
    ({"queue": "Not A Queue"}, 400, "invalid_argument"),
    ({"queue": "build", "queues": ["docs"]}, 400, "invalid_argument"),
    ({"lease_seconds": 0}, 400, "invalid_argument"),
    ({"queue": "elsewhere"}, 403, "forbidden"),
    ("build", 400, "invalid_argument"),
])
def test_a_refused_claim_next_changes_nothing(world, alice, worker, db_path, claim_next, status, error):
    held = world.push(alice, worker, "build", "held")
    world.push(alice, worker, "build", "waiting")
    claim = world.claim(worker, queue="build")
    before = snapshot(db_path)
    r = complete(world, worker, held["id"], claim["lease_token"], claim_next=claim_next)
    assert (r.status_code, r.json()["error"]) == (status, error), r.text
    assert snapshot(db_path) == before
    assert complete(world, worker, held["id"], claim["lease_token"]).status_code == 200, "the lease still holds"


def test_claim_next_without_the_claim_next_verb_or_a_lease_changes_nothing(world, alice, worker, db_path, clock):
    closer = world.endpoint(alice, ["build"], verbs=["claim", "complete"])
    held = world.push(alice, closer, "build", "held")
    world.push(alice, closer, "build", "waiting")
    claimed = world.client.post(f"/api/v1/todos/{held['id']}/claim", headers=closer.auth, json={}).json()
    before = snapshot(db_path)
    r = complete(world, closer, held["id"], claimed["lease_token"], claim_next={})
    assert (r.status_code, r.json()["error"]) == (403, "forbidden") and snapshot(db_path) == before

    mine = world.push(alice, worker, "build", "mine")
    world.push(alice, worker, "build", "next")
    lease = world.claim(worker, queue="build", lease_seconds=5)["lease_token"]
    before = snapshot(db_path)
    assert complete(world, worker, mine["id"], "not-the-token", claim_next={}).status_code == 409
    assert complete(world, worker, "td_0123", lease, claim_next={}).status_code == 404
    assert snapshot(db_path) == before, "a todo you do not hold completes nothing and claims nothing"
    clock.advance(6)
    again = world.claim(worker, queue="build")
    assert again["todo"]["id"] == mine["id"] and again["todo"]["attempt"] == 2, "the lapsed lease is reclaimed"
    before = snapshot(db_path)
    stale = complete(world, worker, mine["id"], lease, claim_next={})
    assert stale.status_code == 409 and snapshot(db_path) == before, "fenced: the old lease claims nothing either"


def test_racing_completions_with_claim_next_claim_every_todo_once(live_server, db_path):
    """Eight threads, each claiming once and then only ever completing with claim_next, drain 160 todos: every
    todo is claimed by exactly one of them, once, and completed under that claim's lease."""
    server = live_server()
    _, human = cli(db_path, "human", "add", "racer")
    _, endpoint = cli(db_path, "endpoint", "vend", "--human", "racer", "--name", "pool", "--queues", "build")
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {human['token']}"}) as c:
        pushed = {c.post(f"/api/v1/endpoints/{endpoint['id']}/todos", json={"title": f"t{i}", "queue": "build"}
                         ).json()["id"] for i in range(160)}
    claims: Counter = Counter()
    lock = threading.Lock()
    errors: list[str] = []

    def work() -> None:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {endpoint['token']}"},
                          timeout=30, verify=TLS) as c:
            answer = c.post("/api/v1/todos/claim", json={"queue": "build"}).json()
            while "todo" in answer:
                with lock:
                    claims[answer["todo"]["id"]] += 1
                r = c.post(f"/api/v1/todos/{answer['todo']['id']}/complete",
                           json={"lease_token": answer["lease_token"], "claim_next": {"queue": "build"}})
                if r.status_code != 200 or r.json()["state"] != "done":
                    errors.append(r.text)
                    return
                answer = r.json()["next"]

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    assert set(claims) == pushed and set(claims.values()) == {1}
    conn = connect_db(db_path)
    assert conn.execute("SELECT count(*) FROM todos WHERE state = 'done'").fetchone()[0] == 160
    assert conn.execute("SELECT count(*), min(outcome), max(outcome) FROM attempts").fetchone() == (
        160, "completed", "completed")


def test_over_mcp_the_session_remembers_the_next_lease(live_server, db_path):
    server = live_server()
    _, human = cli(db_path, "human", "add", "alice")
    _, worker = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "worker", "--queues", "build")
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {human['token']}"}) as c:
        ids = [c.post(f"/api/v1/endpoints/{worker['id']}/todos", json={"title": f"t{i}", "queue": "build"}
                      ).json()["id"] for i in range(3)]

    async def run() -> None:
        async with connect(server, worker["token"], "legacy") as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert "claim_next" in tools["complete"].input_schema["properties"]
            # Which todo comes first is the queue's order, which a sweep holding a fresh todo for its ring may
            # pass over on Postgres (SKIP LOCKED): the test follows whichever it is handed.
            claimed = await client.call_tool("claim_next", {"queue": "build", "wait_seconds": 10})
            order = [claimed.structured_content["todo"]["id"]]
            refused = await client.call_tool("complete", {"id": order[0], "claim_next": {"queue": "docs"}})
            assert refused.is_error and refused.structured_content["error"] == "forbidden"
            done = await client.call_tool("complete", {"id": order[0], "claim_next": {"queue": "build"}})
            assert not done.is_error and done.structured_content["state"] == "done"
            order.append(done.structured_content["next"]["todo"]["id"])
            # No lease token passed: the session kept the one the combined call handed out.
            done = await client.call_tool("complete", {"id": order[1], "claim_next": {}})
            assert not done.is_error and done.structured_content["state"] == "done"
            order.append(done.structured_content["next"]["todo"]["id"])
            last = await client.call_tool("complete", {"id": order[2], "claim_next": {}})
            assert not last.is_error and last.structured_content["next"] == {"empty": True}
            assert sorted(order) == sorted(ids), order

    anyio.run(run)
    conn = connect_db(db_path)
    assert conn.execute("SELECT todo_id, count(*) FROM attempts GROUP BY todo_id ORDER BY todo_id").fetchall() == \
        sorted((todo_id, 1) for todo_id in ids)
