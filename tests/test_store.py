"""The todo store's promises: leases, fencing, retries, gates, dependencies, and exactly-once claims."""

from __future__ import annotations

import threading
from collections import Counter

import httpx
import pytest
from helpers import TLS, connect_db

from switchboard.configuration import SCHEMA_VERSION, iso
from switchboard.store.transitions import backoff_ms
from switchboard.store.upkeep import rings_for_new_session


@pytest.fixture
def worker(world, alice):
    return world.endpoint(alice, ["build", "docs"], name="worker")


@pytest.mark.sqlite_only("SQLite's pragmas")
def test_database_pragmas_and_schema_version(app, db_path):
    conn = connect_db(db_path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    writer = app.state.db._writer
    assert writer.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert writer.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert writer.execute("PRAGMA busy_timeout").fetchone()[0] == 5000


def test_full_cycle_records_history_and_attempts(world, alice, worker):
    todo = world.push(alice, worker, "build", "compile", payload={"n": 1})
    assert todo["created"] is True and todo["state"] == "pending"
    claim = world.claim(worker)
    assert claim["todo"]["id"] == todo["id"] and claim["todo"]["attempt"] == 1
    assert claim["prior_attempts"] == []
    token = claim["lease_token"]
    beat = world.act(worker, todo["id"], "heartbeat", lease_token=token, note="halfway")
    assert beat.status_code == 200
    done = world.act(worker, todo["id"], "complete", lease_token=token, result={"ok": True}, summary="built",
                     artifact="https://ci.example/run/1")
    assert done.status_code == 200 and done.json()["state"] == "done" and done.json()["outcome"] == "completed"
    shown = world.client.get(f"/api/v1/todos/{todo['id']}", headers=alice.auth).json()
    assert [(h["from"], h["to"]) for h in shown["history"]] == [(None, "pending"), ("pending", "claimed"),
                                                                 ("claimed", "done")]
    assert shown["history"][1]["actor"] == f"endpoint:{worker.id}"
    assert shown["history"][0]["actor"] == f"human:{alice.id}"
    (attempt,) = shown["attempts"]
    assert attempt["outcome"] == "completed" and attempt["heartbeats"] == 1 and attempt["summary"] == "built"
    assert shown["result"] == {"ok": True}


def test_claim_heartbeat_and_complete_answer_the_todo_as_stored(world, alice, worker, clock):
    """The claim, heartbeat and complete answers (built from the row read before the write, plus what the write
    changed) equal a fresh read of the todo, for a pushed todo with a payload, a rung one, a re-claim after a
    lapsed lease, a claim by id and a gated completion."""

    def stored(todo_id: str) -> dict:
        shown = world.client.get(f"/api/v1/todos/{todo_id}", headers=worker.auth).json()
        return {k: v for k, v in shown.items() if k not in ("attempts", "history", "depends_on", "receipt", "outputs")}

    plain = world.push(alice, worker, "build", "plain", payload={"n": 1, "deep": {"list": [1, "two"]}})
    claim = world.claim(worker, queue="build", claimant="runner-1")
    assert claim["todo"] == stored(plain["id"]) and claim["todo"]["payload"]["deep"] == {"list": [1, "two"]}
    clock.advance(2)
    beat = world.act(worker, plain["id"], "heartbeat", lease_token=claim["lease_token"], lease_seconds=600)
    assert beat.status_code == 200 and beat.json() == stored(plain["id"])
    clock.advance(2)
    done = world.act(worker, plain["id"], "complete", lease_token=claim["lease_token"], result={"ok": True})
    assert done.status_code == 200 and done.json() == stored(plain["id"]) and done.json()["state"] == "done"

    lapsed = world.push(alice, worker, "docs", "lapsed")
    first = world.claim(worker, lease_seconds=60)
    clock.advance(61)
    again = world.act(worker, lapsed["id"], "claim", lease_seconds=120)
    assert again.status_code == 200, again.text
    assert again.json()["todo"] == stored(lapsed["id"]) and again.json()["todo"]["attempt"] == 2
    assert first["lease_token"] != again.json()["lease_token"]

    rung = world.push(alice, worker, "build", "rung")
    assert [r["todo_id"] for r in world.db.write_sync(rings_for_new_session, worker.id, ["build"])] == [rung["id"]]
    clock.advance(1)
    claim = world.claim(worker)
    assert claim["todo"] == stored(rung["id"]) and claim["todo"]["rings"]["count"] > 0
    assert claim["todo"]["rings"]["acked_at"] is not None

    gated = world.push(alice, worker, "build", "gated", work_item={
        "schema": "switchboard.work_item.v1", "objective": "ship it", "approval_gates": ["review"]})
    claim = world.claim(worker)
    review = world.act(worker, gated["id"], "complete", lease_token=claim["lease_token"], summary="diff ready")
    assert review.status_code == 200 and review.json() == stored(gated["id"]) and review.json()["state"] == "review"


def test_claim_order_is_priority_then_oldest(world, alice, worker, clock):
    first = world.push(alice, worker, "build", "old")
    clock.advance(1)
    second = world.push(alice, worker, "build", "new")
    clock.advance(1)
    urgent = world.push(alice, worker, "build", "urgent", priority=10)
    order = [world.claim(worker)["todo"]["id"] for _ in range(3)]
    assert order == [urgent["id"], first["id"], second["id"]]
    assert world.claim(worker) == {"empty": True}


def test_claim_respects_queue_filter(world, alice, worker):
    world.push(alice, worker, "docs", "write docs")
    assert world.claim(worker, queue="build") == {"empty": True}
    assert world.claim(worker, queues=["build", "docs"])["todo"]["queue"] == "docs"


def test_stale_lease_token_refused_after_reclaim(world, alice, worker, clock):
    todo = world.push(alice, worker, "build")
    first = world.claim(worker, lease_seconds=30)
    clock.advance(31)
    second = world.claim(worker, lease_seconds=30)
    assert second["todo"]["id"] == todo["id"] and second["todo"]["attempt"] == 2
    for action, body in (("heartbeat", {}), ("complete", {}), ("fail", {"error": "x"}), ("release", {})):
        stale = world.act(worker, todo["id"], action, lease_token=first["lease_token"], **body)
        assert stale.status_code == 409 and stale.json()["error"] == "conflict"
    ok = world.act(worker, todo["id"], "complete", lease_token=second["lease_token"])
    assert ok.json()["state"] == "done"
    attempts = world.client.get(f"/api/v1/todos/{todo['id']}", headers=alice.auth).json()["attempts"]
    assert [a["outcome"] for a in attempts] == ["lease_expired", "completed"]


def test_reaper_returns_lapsed_lease_and_next_claim_is_attempt_two(world, alice, worker, clock):
    todo = world.push(alice, worker, "build")
    claim = world.claim(worker, lease_seconds=10)
    clock.advance(5)
    assert world.tick()["lapsed"] == 0
    clock.advance(6)
    assert world.tick()["lapsed"] == 1
    reaped = world.client.get(f"/api/v1/todos/{todo['id']}", headers=alice.auth).json()
    assert reaped["state"] == "pending" and reaped["last_error"] == "lease_expired"
    again = world.claim(worker)
    assert again["todo"]["attempt"] == 2
    assert [a["outcome"] for a in again["prior_attempts"]] == ["lease_expired"]
    assert world.act(worker, todo["id"], "heartbeat", lease_token=claim["lease_token"]).status_code == 409


def test_a_claim_reaps_its_endpoints_lapsed_leases_before_it_chooses(world, alice, worker, clock):
    """Without a scheduler tick: a lapsed lease returns its todo before the claim picks the best one (here the
    lapsed todo outranks a pending one), also when the claim has nothing else to give; the answer's prior
    attempts are the todo's last five, oldest first, as GET shows them."""
    urgent = world.push(alice, worker, "build", "urgent", priority=5)
    first = world.claim(worker, lease_seconds=10)
    assert first["todo"]["id"] == urgent["id"]
    later = world.push(alice, worker, "build", "later")
    clock.advance(11)
    again = world.claim(worker, lease_seconds=10)
    assert again["todo"]["id"] == urgent["id"] and again["todo"]["attempt"] == 2
    shown = world.client.get(f"/api/v1/todos/{urgent['id']}", headers=alice.auth).json()
    assert again["prior_attempts"] == shown["attempts"][:1] and shown["attempts"][0]["outcome"] == "lease_expired"
    assert world.claim(worker)["todo"]["id"] == later["id"]

    for attempt in range(3, 6):  # alone in its queue: each claim reaps the lease before it
        clock.advance(11)
        claim = world.claim(worker, queue="build", lease_seconds=10)
        assert claim["todo"]["id"] == urgent["id"] and claim["todo"]["attempt"] == attempt
    for _ in range(2):  # a release does not count against the budget, but its attempt is history
        assert world.act(worker, urgent["id"], "release", lease_token=claim["lease_token"]).status_code == 200
        claim = world.claim(worker, queue="build", lease_seconds=10)
    shown = world.client.get(f"/api/v1/todos/{urgent['id']}", headers=alice.auth).json()
    assert [a["seq"] for a in shown["attempts"]] == [1, 2, 3, 4, 5, 6, 7]
    assert claim["prior_attempts"] == shown["attempts"][1:6], "the last five before this one, oldest first"
    clock.advance(11)  # the fifth counted attempt lapses: a claim with nothing to give still reaps it
    assert world.claim(worker, queue="docs") == {"empty": True}
    reaped = world.client.get(f"/api/v1/todos/{urgent['id']}", headers=alice.auth).json()
    assert reaped["state"] == "failed" and reaped["dead_letter"] and reaped["last_error"] == "lease_expired"


def test_heartbeat_extends_the_lease(world, alice, worker, clock):
    todo = world.push(alice, worker, "build")
    claim = world.claim(worker, lease_seconds=10)
    for _ in range(5):
        clock.advance(8)
        assert world.act(worker, todo["id"], "heartbeat", lease_token=claim["lease_token"]).status_code == 200
        assert world.tick()["lapsed"] == 0
    clock.advance(11)
    assert world.tick()["lapsed"] == 1


def test_five_failures_dead_letter_then_human_retry(world, alice, worker, clock):
    todo = world.push(alice, worker, "build")
    for attempt in range(1, 6):
        claim = world.claim(worker)
        assert claim["todo"]["attempt"] == attempt
        failed = world.act(worker, todo["id"], "fail", lease_token=claim["lease_token"], error=f"boom {attempt}").json()
        if attempt < 5:
            assert failed["state"] == "pending"
            assert world.claim(worker) == {"empty": True}, "backoff keeps it unavailable"
            clock.advance(min(30 * 2 ** (attempt - 1), 900))
    assert failed["state"] == "failed" and failed["dead_letter"] is True and failed["last_error"] == "boom 5"
    clock.advance(3600)
    assert world.claim(worker) == {"empty": True}
    assert world.act(worker, todo["id"], "retry").status_code == 403, "retry is a human verb"
    retried = world.act(alice, todo["id"], "retry").json()
    assert retried["state"] == "pending" and retried["attempt"] == 0 and retried["dead_letter"] is False
    assert world.claim(worker)["todo"]["attempt"] == 1


def test_backoff_is_exponential_and_capped(world, alice, worker, clock):
    assert [backoff_ms(a) // 1000 for a in range(1, 8)] == [30, 60, 120, 240, 480, 900, 900]
    todo = world.push(alice, worker, "build")
    claim = world.claim(worker)
    failed = world.act(worker, todo["id"], "fail", lease_token=claim["lease_token"], error="flaky",
                       retry_in_seconds=5).json()
    assert failed["state"] == "pending"
    clock.advance(4)
    assert world.claim(worker) == {"empty": True}
    clock.advance(1)
    assert world.claim(worker)["todo"]["id"] == todo["id"]


def test_fail_without_retry_is_dead_letter(world, alice, worker):
    todo = world.push(alice, worker, "build")
    claim = world.claim(worker)
    failed = world.act(worker, todo["id"], "fail", lease_token=claim["lease_token"], error="no", retry=False).json()
    assert failed["state"] == "failed" and failed["dead_letter"] is True


def test_release_refunds_the_attempt(world, alice, worker):
    todo = world.push(alice, worker, "build")
    claim = world.claim(worker)
    released = world.act(worker, todo["id"], "release", lease_token=claim["lease_token"]).json()
    assert released["state"] == "pending" and released["attempt"] == 0
    assert world.claim(worker)["todo"]["attempt"] == 1


def test_review_gate_is_approved_only_by_a_human(world, alice, worker):
    gated = world.push(alice, worker, "build", "gated", work_item={
        "schema": "switchboard.work_item.v1", "objective": "ship it", "approval_gates": ["review"]})
    claim = world.claim(worker)
    missing = world.act(worker, gated["id"], "complete", lease_token=claim["lease_token"])
    assert missing.status_code == 400, "a gated todo needs a summary for its reviewer"
    review = world.act(worker, gated["id"], "complete", lease_token=claim["lease_token"], summary="diff ready").json()
    assert review["state"] == "review" and review["outcome"] is None
    assert world.act(worker, gated["id"], "approve").status_code == 403
    changes = world.act(alice, gated["id"], "request-changes", note="add tests").json()
    assert changes["state"] == "pending"
    claim = world.claim(worker)
    world.act(worker, gated["id"], "complete", lease_token=claim["lease_token"], summary="tests added")
    approved = world.act(alice, gated["id"], "approve", note="lgtm").json()
    assert approved["state"] == "done" and approved["outcome"] == "approved"
    assert world.act(alice, gated["id"], "approve").status_code == 409


def test_dependency_holds_claim_until_parent_done(world, alice, worker):
    parent = world.push(alice, worker, "build", "parent")
    child = world.push(alice, worker, "docs", "child", work_item={
        "schema": "switchboard.work_item.v1", "objective": "document it", "depends_on": [parent["id"]]})
    assert world.claim(worker, queue="docs") == {"empty": True}
    blocked_claim = world.act(worker, child["id"], "claim")
    assert blocked_claim.status_code == 409
    claim = world.claim(worker, queue="build")
    world.act(worker, parent["id"], "complete", lease_token=claim["lease_token"])
    assert world.claim(worker, queue="docs")["todo"]["id"] == child["id"]


def test_failed_dependency_blocks_the_dependent(world, alice, worker):
    parent = world.push(alice, worker, "build", "parent")
    child = world.push(alice, worker, "docs", "child", work_item={
        "schema": "switchboard.work_item.v1", "objective": "o", "depends_on": [parent["id"]]})
    claim = world.claim(worker, queue="build")
    world.act(worker, parent["id"], "fail", lease_token=claim["lease_token"], error="broken", retry=False)
    shown = world.client.get(f"/api/v1/todos/{child['id']}", headers=alice.auth).json()
    assert shown["state"] == "blocked" and parent["id"] in shown["state_reason"]
    late = world.push(alice, worker, "docs", "late", work_item={
        "schema": "switchboard.work_item.v1", "objective": "o", "depends_on": [parent["id"]]})
    assert late["state"] == "blocked"


def test_needs_input_answer_and_block_resume(world, alice, worker):
    todo = world.push(alice, worker, "build")
    claim = world.claim(worker)
    asked = world.act(worker, todo["id"], "needs-input", lease_token=claim["lease_token"], question="which branch?")
    assert asked.json()["state"] == "needs_input" and asked.json()["state_reason"] == "which branch?"
    assert world.claim(worker) == {"empty": True}
    answered = world.act(alice, todo["id"], "answer", answer="main").json()
    assert answered["state"] == "pending" and answered["answer"] == "main"
    claim = world.claim(worker)
    blocked = world.act(worker, todo["id"], "block", lease_token=claim["lease_token"], reason="no disk").json()
    assert blocked["state"] == "blocked"
    assert world.act(alice, todo["id"], "resume", note="disk added").json()["state"] == "pending"


def test_defer_until_passes_and_undefer(world, alice, worker, clock):
    todo = world.push(alice, worker, "build")
    until = iso(clock.now_ms() + 60_000)
    deferred = world.act(alice, todo["id"], "defer", reason="after lunch", until=until).json()
    assert deferred["state"] == "deferred"
    assert world.claim(worker) == {"empty": True}
    clock.advance(61)
    assert world.tick()["undeferred"] == 1
    assert world.claim(worker)["todo"]["id"] == todo["id"]
    other = world.push(alice, worker, "build", "other")
    world.act(alice, other["id"], "defer", reason="later")
    assert world.act(alice, other["id"], "undefer").json()["state"] == "pending"


def test_cancel_fences_the_worker(world, alice, worker):
    todo = world.push(alice, worker, "build")
    claim = world.claim(worker)
    cancelled = world.act(alice, todo["id"], "cancel", reason="not needed").json()
    assert cancelled["state"] == "cancelled"
    assert world.act(worker, todo["id"], "complete", lease_token=claim["lease_token"]).status_code == 409


def test_reroute_moves_to_the_endpoint_scoped_for_the_queue(world, alice, worker):
    lane = world.endpoint(alice, ["lane-s"], name="lane-s")
    todo = world.push(alice, worker, "build")
    moved = world.act(alice, todo["id"], "reroute", queue="lane-s").json()
    assert moved["queue"] == "lane-s" and moved["endpoint_id"] == lane.id and moved["state"] == "pending"
    assert world.claim(lane)["todo"]["id"] == todo["id"]
    nowhere = world.act(alice, world.push(alice, worker, "build")["id"], "reroute", queue="nobody-has-it")
    assert nowhere.status_code == 400


def test_idempotency_key_returns_the_existing_todo(world, alice, worker):
    first = world.push(alice, worker, "build", "deploy", key="deploy-42")
    r = world.client.post(f"/api/v1/endpoints/{worker.id}/todos", headers=alice.auth,
                          json={"title": "deploy", "queue": "build", "key": "deploy-42"})
    assert r.status_code == 200 and r.json()["created"] is False and r.json()["id"] == first["id"]
    claim = world.claim(worker)
    world.act(worker, first["id"], "complete", lease_token=claim["lease_token"])
    again = world.push(alice, worker, "build", "deploy", key="deploy-42")
    assert again["created"] is True and again["id"] != first["id"], "a finished todo frees its key"


def test_waiting_claim_wakes_on_push(world, alice, worker):
    results = {}

    def wait():
        results["claim"] = world.claim(worker, wait_seconds=20)

    waiter = threading.Thread(target=wait)
    waiter.start()
    # The waiter is attached before it first reads the queue, so whenever the push lands it is woken.
    todo = world.push(alice, worker, "build", "wake up")
    waiter.join(timeout=15)
    assert not waiter.is_alive()
    assert results["claim"]["todo"]["id"] == todo["id"]


def test_waiting_claim_times_out_empty(world, worker):
    assert world.claim(worker, wait_seconds=0.2) == {"empty": True}


def test_racing_claims_claim_every_todo_exactly_once(live_server, db_path):
    from conftest import cli

    server = live_server()
    code, human = cli(db_path, "human", "add", "racer")
    assert code == 0
    code, endpoint = cli(db_path, "endpoint", "vend", "--human", "racer", "--name", "pool", "--queues", "build")
    assert code == 0
    human_auth = {"Authorization": f"Bearer {human['token']}"}
    auth = {"Authorization": f"Bearer {endpoint['token']}"}
    with httpx.Client(base_url=server.url, headers=human_auth) as c:
        pushed = {c.post(f"/api/v1/endpoints/{endpoint['id']}/todos", json={"title": f"t{i}", "queue": "build"}
                         ).json()["id"] for i in range(120)}
    claims: Counter = Counter()
    lock = threading.Lock()
    errors: list[str] = []

    def work():
        with httpx.Client(base_url=server.url, headers=auth, timeout=30, verify=TLS) as c:
            while True:
                r = c.post("/api/v1/todos/claim", json={"queue": "build"})
                if r.status_code != 200:
                    errors.append(r.text)
                    return
                body = r.json()
                if body.get("empty"):
                    return
                with lock:
                    claims[body["todo"]["id"]] += 1
                done = c.post(f"/api/v1/todos/{body['todo']['id']}/complete", json={"lease_token": body["lease_token"]})
                if done.status_code != 200:
                    errors.append(done.text)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert set(claims) == pushed and set(claims.values()) == {1}
    conn = connect_db(db_path)
    assert conn.execute("SELECT count(*) FROM todos WHERE state = 'done'").fetchone()[0] == 120
    assert conn.execute("SELECT count(*) FROM attempts").fetchone()[0] == 120


def test_a_dead_letter_can_be_cancelled_and_stops_being_one(world, alice, worker):
    todo = world.push(alice, worker, "build")
    claim = world.claim(worker)
    world.act(worker, todo["id"], "fail", lease_token=claim["lease_token"], error="broken", retry=False)
    cancelled = world.act(alice, todo["id"], "cancel", reason="not worth retrying")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["state"] == "cancelled" and cancelled.json()["dead_letter"] is False
    assert world.act(alice, todo["id"], "retry").status_code == 409
