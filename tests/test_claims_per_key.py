"""Concurrency per key (issue 45 part 3, SPEC 17): a queue's `max_in_flight_per_key` lets at most `max` of its
claimed todos share a subject key (or a repository). A claim passes over the others (they stay pending, and ring
when the key frees up) and says why (`admission` reason `max_in_flight_per_key`); racing claims on both engines
never hold more than the limit."""

from __future__ import annotations

import os
import threading
import time

import httpx
import producers
import pytest
from conftest import cli
from helpers import TLS, count, hook_path

from switchboard.models import ClaimAnswer, QueueAnswer

QUEUE = "lanes"


@pytest.fixture
def pool(world, alice):
    return world.endpoint(alice, [QUEUE, "docs"], name="pool")


@pytest.fixture
def hook(world, alice, pool):
    return world.webhook(alice, pool, "github", QUEUE)


def issue(world, hook, repo: str, number: int) -> dict:
    """A signed GitHub `issues` delivery about `repo#number`: one todo, whose subject key names them."""
    raw, headers = producers.github("issues.opened", hook["secret"], {
        "issue": {"number": number, "body": os.urandom(8).hex()}, "repository": {"full_name": repo}})
    answer = world.deliver(hook, raw, headers)
    assert answer.status_code == 202, answer.text
    [todo] = answer.json()["todos"]
    return {**todo, "subject_key": f"github:{repo}#{number}"}


def limits(world, human, endpoint, **body):
    answer = world.client.put(f"/api/v1/endpoints/{endpoint.id}/queues/{QUEUE}/limits", headers=human.auth,
                              json=body)
    assert answer.status_code == 200, answer.text
    QueueAnswer.model_validate(answer.json())
    return answer.json()


def claimed_key(world, human, claim: dict) -> str:
    return world.client.get(f"/api/v1/todos/{claim['todo']['id']}", headers=human.auth).json()["subject_key"]


def waiting_sessions(app, endpoint, n: int) -> None:
    deadline = time.monotonic() + 10
    while sum(s["via"] == "claim" for s in app.state.doorbell.sessions_of(endpoint.id)) < n:
        assert time.monotonic() < deadline, app.state.doorbell.sessions_of(endpoint.id)
        time.sleep(0.01)


def test_a_subject_at_its_limit_is_passed_over_says_why_and_rings_when_it_frees_up(world, app, alice, pool, hook):
    first, second = issue(world, hook, "acme/site", 1), issue(world, hook, "acme/site", 1)
    other = issue(world, hook, "acme/site", 2)
    view = limits(world, alice, pool, max_in_flight_per_key={"key": "subject", "max": 1})
    assert view["limits"]["max_in_flight_per_key"] == {"key": "subject", "max": 1}
    held = world.claim(pool, queue=QUEUE)
    assert held["todo"]["id"] == first["id"]
    assert world.claim(pool, queue=QUEUE)["todo"]["id"] == other["id"], "the full subject is passed over"
    refused = world.claim(pool, queue=QUEUE)
    ClaimAnswer.model_validate(refused)
    assert refused == {"empty": True, "admission": [{"queue": QUEUE, "reason": "max_in_flight_per_key",
                                                     "until": None}]}
    by_id = world.client.post(f"/api/v1/todos/{second['id']}/claim", headers=pool.auth, json={})
    assert by_id.status_code == 409 and "max in flight per key" in by_id.json()["message"], by_id.text
    result: dict = {}
    waiter = threading.Thread(daemon=True, target=lambda: result.update(
        world.claim(pool, queue=QUEUE, wait_seconds=10)))
    waiter.start()
    waiting_sessions(app, pool, 1)
    assert world.act(pool, first["id"], "complete", lease_token=held["lease_token"]).status_code == 200
    waiter.join(timeout=5)
    assert not waiter.is_alive() and result["todo"]["id"] == second["id"], "the freed subject rang its next todo"
    cleared = limits(world, alice, pool, max_in_flight_per_key=None)
    assert cleared["limits"]["max_in_flight_per_key"] is None


def test_a_repository_limit_counts_every_subject_of_the_repository_and_a_todo_without_a_key_is_not_limited(
        world, alice, pool, hook):
    limits(world, alice, pool, max_in_flight_per_key={"key": "repo", "max": 2})
    site = [issue(world, hook, "acme/site", n) for n in (1, 2, 3)]
    docs = issue(world, hook, "acme/docs", 1)
    plain = world.push(alice, pool, QUEUE, "no subject")
    taken = [world.claim(pool, queue=QUEUE) for _ in range(4)]
    assert [c["todo"]["id"] for c in taken] == [site[0]["id"], site[1]["id"], docs["id"], plain["id"]]
    assert world.claim(pool, queue=QUEUE)["admission"][0]["reason"] == "max_in_flight_per_key"
    assert world.act(pool, site[0]["id"], "fail", lease_token=taken[0]["lease_token"], error="x",
                     retry=False).status_code == 200
    assert world.claim(pool, queue=QUEUE)["todo"]["id"] == site[2]["id"], "a finished claim frees the repository"


def test_per_key_limits_leave_other_queues_alone_and_count_lapsed_leases_until_reaped(world, alice, pool, hook,
                                                                                   clock):
    limits(world, alice, pool, max_in_flight_per_key={"key": "subject", "max": 1})
    first, second = issue(world, hook, "acme/site", 7), issue(world, hook, "acme/site", 7)
    held = world.claim(pool, queue=QUEUE, lease_seconds=30)
    assert held["todo"]["id"] == first["id"]
    assert world.claim(pool, queue=QUEUE)["empty"] is True
    clock.advance(31)
    again = world.claim(pool, queue=QUEUE)
    assert again["todo"]["id"] in (first["id"], second["id"]), "the lapsed lease was reaped and freed the subject"


def test_bad_per_key_limits_are_refused_naming_the_field(world, alice, pool):
    for body in ({"max_in_flight_per_key": {"key": "subject", "max": 0}},
                 {"max_in_flight_per_key": {"key": "issue", "max": 1}},
                 {"max_in_flight_per_key": {"key": "repo"}},
                 {"max_in_flight_per_key": 3}):
        answer = world.client.put(f"/api/v1/endpoints/{pool.id}/queues/{QUEUE}/limits", headers=alice.auth,
                                  json=body)
        assert answer.status_code == 400 and "max_in_flight_per_key" in answer.json()["message"], answer.text
    view = world.client.get(f"/api/v1/endpoints/{pool.id}/queues", headers=alice.auth).json()
    assert {q["queue"]: q["limits"]["max_in_flight_per_key"] for q in view["queues"]} == {QUEUE: None, "docs": None}


def test_16_racing_claims_over_3_subjects_with_max_1_hold_3(live_server, db_path):
    """A real server, 16 threads released together each sending one claim, three rounds: each round exactly one
    todo of each of the 3 subjects is claimed, whatever the engine runs side by side."""
    server = live_server("--synchronous", "normal")
    _, human = cli(db_path, "human", "add", "racer")
    human_auth = {"Authorization": f"Bearer {human['token']}"}
    with httpx.Client(base_url=server.url, headers=human_auth, timeout=30) as http:
        endpoint = http.post("/api/v1/endpoints", json={"name": "pool", "queues": [QUEUE]}).json()
        hook = http.post("/api/v1/webhooks", json={"provider": "github", "queue": QUEUE,
                                                  "endpoint_id": endpoint["id"],
                                                  "trusted_actors": {"allow_all": True}}).json()
        for number in range(1, 4):
            for _ in range(4):
                raw, headers = producers.github("issues.opened", hook["secret"], {
                    "issue": {"number": number, "body": os.urandom(8).hex()}, "repository": {"full_name": "acme/site"}})
                assert http.post(hook_path(hook["url"]), content=raw, headers=headers).status_code == 202
        assert http.put(f"/api/v1/endpoints/{endpoint['id']}/queues/{QUEUE}/limits",
                        json={"max_in_flight_per_key": {"key": "subject", "max": 1}}).status_code == 200
    auth = {"Authorization": f"Bearer {endpoint['token']}"}
    for round_ in range(3):
        start, got, lock = threading.Barrier(16), [], threading.Lock()

        def racer() -> None:
            with httpx.Client(base_url=server.url, headers=auth, timeout=30, verify=TLS) as c:
                start.wait()
                answer = c.post("/api/v1/todos/claim", json={"queue": QUEUE}).json()
            with lock:
                got.append(answer)

        threads = [threading.Thread(daemon=True, target=racer) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
        claims = [a for a in got if "todo" in a]
        with httpx.Client(base_url=server.url, headers=human_auth, timeout=30) as http:
            keys = [http.get(f"/api/v1/todos/{c['todo']['id']}").json()["subject_key"] for c in claims]
        claimed = count(db_path, "todos", "endpoint_id = ? AND state = 'claimed'", (endpoint["id"],))
        assert len(claims) == 3 and len(set(keys)) == 3 and claimed == 3, (round_, claimed, keys, got)
        assert all(a.get("admission") == [{"queue": QUEUE, "reason": "max_in_flight_per_key", "until": None}]
                   for a in got if "todo" not in a), got
        with httpx.Client(base_url=server.url, headers=auth, timeout=30) as c:
            for claim in claims:
                done = c.post(f"/api/v1/todos/{claim['todo']['id']}/complete",
                              json={"lease_token": claim["lease_token"]})
                assert done.status_code == 200, done.text


def test_the_cli_sets_and_clears_the_per_key_limit(world, pool, db_path):
    code, capped = cli(db_path, "queue", "limits", pool.id, QUEUE, "--max-per-repo", "1")
    assert code == 0 and capped["limits"]["max_in_flight_per_key"] == {"key": "repo", "max": 1}, capped
    code, capped = cli(db_path, "queue", "limits", pool.id, QUEUE, "--max-per-subject", "2")
    assert code == 0 and capped["limits"]["max_in_flight_per_key"] == {"key": "subject", "max": 2}, capped
    code, cleared = cli(db_path, "queue", "limits", pool.id, QUEUE, "--clear")
    assert code == 0 and cleared["limits"]["max_in_flight_per_key"] is None, cleared
    code, refused = cli(db_path, "queue", "limits", pool.id, QUEUE, "--max-per-subject", "0")
    assert code == 1 and "max_in_flight_per_key" in refused["message"], refused
