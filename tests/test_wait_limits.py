"""Wait limits (issue 45 part 2, SPEC 17 "Time"): per queue, how long a todo may sit pending, needs_input, review or
blocked, and what then: remind the human (their channels and the status comment, again after each further period,
at most three times), cancel, defer or reroute. The change is the system's, with the limit in its evidence, on the
todo's history and the subject's timeline. The sweep finds due waits through an index and fires each once, also
when sweepers race; bad limits are a 400 naming the field and change nothing. The app runs on the test's clock and
the test ticks the scheduler."""

from __future__ import annotations

import threading
import time
import urllib.parse

import producers
import pytest
from conftest import ENGINE, ManualClock, World, cli, snapshot
from starlette.testclient import TestClient
from test_board import csrf, post, sign_in
from test_notify import Receiver, all_sent

from switchboard.app import create_app
from switchboard.engines import open_database
from switchboard.models import QueueAnswer
from switchboard.store.upkeep import scheduler_tick
from switchboard.store.wait_sweep import DUE_WAITS

QUEUE = "build"


@pytest.fixture
def worker(world, alice):
    return world.endpoint(alice, [QUEUE, "docs"], name="pool")


def set_limits(world, human, endpoint, queue: str = QUEUE, **body):
    return world.client.put(f"/api/v1/endpoints/{endpoint.id}/queues/{queue}/limits", headers=human.auth, json=body)


def wait_limits(world, human, endpoint, **states) -> dict:
    answer = set_limits(world, human, endpoint, wait_limits=states)
    assert answer.status_code == 200, answer.text
    QueueAnswer.model_validate(answer.json())
    return answer.json()["limits"]["wait_limits"]


def todo_of(world, human, todo_id: str) -> dict:
    answer = world.client.get(f"/api/v1/todos/{todo_id}", headers=human.auth)
    assert answer.status_code == 200, answer.text
    return answer.json()


def system_lines(todo: dict) -> list[dict]:
    """The history lines a wait limit wrote."""
    return [h for h in todo["history"] if h["actor"] == "system" and "wait_limit" in (h["evidence"] or {})]


def issue_todo(world, alice, worker, number: int = 1) -> dict:
    """A todo about a GitHub issue (a subject), made by a signed delivery to a webhook on `build`."""
    hook = world.webhook(alice, worker, "github", QUEUE)
    answer = world.deliver(hook, *producers.github("issues.opened", hook["secret"], {"issue": {"number": number}}))
    assert answer.status_code == 202 and answer.json()["created"] == 1, answer.text
    todos = world.client.get(f"/api/v1/todos?endpoint={worker.id}&queue={QUEUE}", headers=alice.auth).json()
    todo = todos["todos"][0]
    assert todo["subject_key"], todo
    return todo


def timeline_of(world, human, key: str) -> list[dict]:
    answer = world.client.get(f"/api/v1/subjects/{urllib.parse.quote(key, safe='')}", headers=human.auth)
    assert answer.status_code == 200, answer.text
    return answer.json()["timeline"]


def claimed(world, alice, worker, title: str = "work", **extra) -> tuple[dict, str]:
    todo = world.push(alice, worker, QUEUE, title, **extra)
    answer = world.client.post(f"/api/v1/todos/{todo['id']}/claim", headers=worker.auth, json={})
    assert answer.status_code == 200, answer.text
    return todo, answer.json()["lease_token"]


def test_cancel_fires_once_after_the_limit_and_is_seen_on_the_history_and_the_subject(
        world, alice, worker, clock):
    todo = issue_todo(world, alice, worker)
    assert wait_limits(world, alice, worker, pending={"after_seconds": 2, "then": "cancel"})["pending"] == {
        "after_seconds": 2, "then": "cancel", "queue": None}
    assert world.tick()["next_due"] == clock.ms + 2000, "the scheduler wakes when the wait comes due"
    clock.advance(1.999)
    assert world.tick()["waits"] == 0 and todo_of(world, alice, todo["id"])["state"] == "pending"
    clock.advance(0.001)
    assert world.tick()["waits"] == 1
    after = todo_of(world, alice, todo["id"])
    assert after["state"] == "cancelled"
    evidence = {"wait_limit": "pending", "after_seconds": 2}
    assert [(h["from"], h["to"], h["evidence"]) for h in system_lines(after)] == [("pending", "cancelled", evidence)]
    entries = [e for e in timeline_of(world, alice, todo["subject_key"])
               if e["type"] == "transition" and "wait_limit" in (e["evidence"] or {})]
    assert [(e["todo_id"], e["to"], e["evidence"]) for e in entries] == [(todo["id"], "cancelled", evidence)]
    clock.advance(60)
    assert world.tick()["waits"] == 0 and len(system_lines(todo_of(world, alice, todo["id"]))) == 1


def test_defer_parks_a_question_nobody_answered_until_the_human_undefers_it(world, alice, worker, clock):
    todo, lease = claimed(world, alice, worker)
    wait_limits(world, alice, worker, needs_input={"after_seconds": 1, "then": "defer"})
    asked = world.act(worker, todo["id"], "needs-input", lease_token=lease, question="which branch?")
    assert asked.status_code == 200 and asked.json()["state"] == "needs_input", asked.text
    clock.advance(1)
    assert world.tick()["waits"] == 1
    after = todo_of(world, alice, todo["id"])
    assert after["state"] == "deferred" and after["deferred_until"] is None
    assert [(h["from"], h["to"], h["evidence"]) for h in system_lines(after)] == [
        ("needs_input", "deferred", {"wait_limit": "needs_input", "after_seconds": 1})]
    clock.advance(86_400)
    assert world.tick()["waits"] == 0 and todo_of(world, alice, todo["id"])["state"] == "deferred"
    assert world.act(alice, todo["id"], "undefer").json()["state"] == "pending"


def test_reroute_moves_blocked_work_to_the_named_queue_once(world, alice, worker, clock):
    todo, lease = claimed(world, alice, worker)
    wait_limits(world, alice, worker, blocked={"after_seconds": 2, "then": "reroute", "queue": "docs"})
    blocked = world.act(worker, todo["id"], "block", lease_token=lease, reason="the CI is down")
    assert blocked.status_code == 200 and blocked.json()["state"] == "blocked", blocked.text
    clock.advance(2)
    assert world.tick()["waits"] == 1
    after = todo_of(world, alice, todo["id"])
    assert (after["state"], after["queue"]) == ("pending", "docs")
    assert [(h["from"], h["to"], h["evidence"]) for h in system_lines(after)] == [
        ("blocked", "pending", {"from_queue": QUEUE, "to_queue": "docs", "endpoint_id": worker.id,
                                "wait_limit": "blocked", "after_seconds": 2})]
    assert world.claim(worker, queue="docs")["todo"]["id"] == todo["id"]
    clock.advance(60)
    assert world.tick()["waits"] == 0


def test_remind_fires_after_each_period_three_times_and_stays_in_its_state(world, alice, worker, clock):
    todo = issue_todo(world, alice, worker)
    wait_limits(world, alice, worker, pending={"after_seconds": 2, "then": "remind"})
    fired = []
    for _ in range(5):
        clock.advance(1)
        fired.append(world.tick()["waits"])
    clock.advance(60)
    fired.append(world.tick()["waits"])
    assert fired == [0, 1, 0, 1, 0, 1], "at 2, 4 and 6 s, and never a fourth time"
    after = todo_of(world, alice, todo["id"])
    assert after["state"] == "pending"
    assert [(h["from"], h["to"], h["evidence"]) for h in system_lines(after)] == [
        ("pending", "pending", {"wait_limit": "pending", "after_seconds": 2, "reminder": n}) for n in (1, 2, 3)]
    reminders = [e for e in timeline_of(world, alice, todo["subject_key"]) if "wait_limit" in (e.get("evidence") or {})]
    assert [e["evidence"]["reminder"] for e in reminders] == [1, 2, 3]
    # A new stay in the state is a new wait: the claim ends this one, a release starts the next.
    lease = world.claim(worker, queue=QUEUE)["lease_token"]
    assert world.act(worker, todo["id"], "release", lease_token=lease).status_code == 200
    clock.advance(2)
    assert world.tick()["waits"] == 1


def test_changing_the_limits_recomputes_the_waits_under_way_and_null_clears_them(world, alice, worker, clock):
    old = [world.push(alice, worker, QUEUE, f"old {n}")["id"] for n in range(3)]
    clock.advance(10)
    new = world.push(alice, worker, QUEUE, "new")["id"]
    wait_limits(world, alice, worker, pending={"after_seconds": 5, "then": "cancel"})
    assert world.tick()["waits"] == 3, "the todos that waited 10 s already are past a new 5 s limit"
    assert {todo_of(world, alice, i)["state"] for i in old} == {"cancelled"}
    assert todo_of(world, alice, new)["state"] == "pending"
    # A state left out keeps its limit; null clears it, and the wait under way with it.
    assert wait_limits(world, alice, worker, review={"after_seconds": 60, "then": "remind"})["pending"]["then"] == \
        "cancel"
    assert set_limits(world, alice, worker, max_in_flight=3).json()["limits"]["wait_limits"]["pending"] is not None
    assert wait_limits(world, alice, worker, pending=None)["pending"] is None
    cleared = set_limits(world, alice, worker, wait_limits=None).json()["limits"]["wait_limits"]
    assert cleared == {"pending": None, "needs_input": None, "review": None, "blocked": None}
    clock.advance(60)
    assert world.tick()["waits"] == 0 and todo_of(world, alice, new)["state"] == "pending"
    # A remind limit set over a wait of 60 s: the first reminder is due at once, the next a period after it.
    wait_limits(world, alice, worker, pending={"after_seconds": 5, "then": "remind"})
    assert [world.tick()["waits"], world.tick()["waits"]] == [1, 0]
    clock.advance(5)
    assert world.tick()["waits"] == 1
    assert [h["evidence"]["reminder"] for h in system_lines(todo_of(world, alice, new))] == [1, 2]


def test_bad_limits_are_a_400_naming_the_field_and_change_nothing(world, alice, worker, db_path):
    world.endpoint(alice, ["elsewhere"], name="other")
    wait_limits(world, alice, worker, pending={"after_seconds": 60, "then": "remind"})
    world.push(alice, worker, QUEUE, "waiting")
    before = snapshot(db_path)
    cases = [
        ({"pending": {"after_seconds": 5, "then": "reroute"}}, "wait_limits.pending.queue: "),
        ({"review": {"after_seconds": 5, "then": "reroute", "queue": "nowhere"}}, "wait_limits.review.queue: "),
        ({"blocked": {"after_seconds": 5, "then": "reroute", "queue": QUEUE}}, "wait_limits.blocked.queue: "),
        ({"blocked": {"after_seconds": 5, "then": "reroute", "queue": "quarantine"}}, "wait_limits.blocked.queue: "),
        ({"needs_input": {"after_seconds": 5, "then": "cancel", "queue": "docs"}}, "wait_limits.needs_input.queue: "),
        ({"pending": {"after_seconds": 0, "then": "cancel"}}, "wait_limits.pending.after_seconds: "),
        ({"pending": {"after_seconds": 10 ** 9, "then": "cancel"}}, "wait_limits.pending.after_seconds: "),
        ({"pending": {"after_seconds": 5, "then": "nap"}}, "wait_limits.pending.then: "),
        ({"claimed": {"after_seconds": 5, "then": "cancel"}}, "wait_limits.claimed"),
    ]
    for states, field in cases:
        answer = set_limits(world, alice, worker, max_in_flight=1, wait_limits=states)
        assert answer.status_code == 400 and answer.json()["error"] == "invalid_argument", (states, answer.text)
        assert answer.json()["message"].startswith(field), (states, answer.json()["message"])
    assert "nowhere" in set_limits(world, alice, worker, wait_limits=cases[1][0]).json()["message"]
    assert snapshot(db_path) == before
    # A queue some endpoint of the human takes is a target, even one this endpoint does not.
    assert wait_limits(world, alice, worker, blocked={"after_seconds": 5, "then": "reroute", "queue": "elsewhere"})[
        "blocked"]["queue"] == "elsewhere"


def test_the_sweeps_query_walks_its_partial_index(app):
    def plan(txn) -> str:
        if txn.engine == "postgres":
            txn.execute("SET LOCAL enable_seqscan = off")  # an empty table: the planner would scan it anyway
            return "\n".join(row[0] for row in txn.all(f"EXPLAIN {DUE_WAITS}", (0, 500)))
        return "\n".join(row[3] for row in txn.all(f"EXPLAIN QUERY PLAN {DUE_WAITS}", (0, 500)))

    shown = app.state.db.read_sync(plan)
    assert "todos_wait_due" in shown and "Seq Scan" not in shown and "SCAN todos" not in shown, shown


def test_racing_sweepers_in_two_databases_fire_each_wait_once(world, alice, worker, db_path, clock):
    """Two Database objects on one database (as two serving processes have), two sweeping threads each, released
    together on 30 due reminders: the todo stays pending, so only the re-check of the due moment keeps a second
    sweeper from reminding it again."""
    ids = [world.push(alice, worker, QUEUE, f"job {n}")["id"] for n in range(30)]
    wait_limits(world, alice, worker, pending={"after_seconds": 2, "then": "remind"})
    clock.advance(2)
    databases = [open_database(db_path, clock=clock) for _ in range(2)]
    start, got, lock = threading.Barrier(4), {}, threading.Lock()

    def sweep(name: str, db) -> None:
        start.wait()
        done = db.write_sync(scheduler_tick)
        with lock:
            got[name] = done["waits"]

    threads = [threading.Thread(target=sweep, args=(f"db{i // 2}-thread{i % 2}", databases[i // 2]), daemon=True)
               for i in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in threads)
    finally:
        for db in databases:
            db.close()
    reminders = {i: [h["evidence"]["reminder"] for h in system_lines(todo_of(world, alice, i))] for i in ids}
    assert sum(got.values()) == 30 and set(map(tuple, reminders.values())) == {(1,)}, (ENGINE, got, reminders)


def test_remind_notifies_the_humans_channels_each_time(db_path, monkeypatch):
    """A channel played by a small HTTP server of ours: each reminder is a message (the limit is longer than the
    sender's rate window, so none is folded into a digest), naming the todo and which reminder it is."""
    monkeypatch.setenv("SWITCHBOARD_NOTIFY_ALLOW_PRIVATE", "1")
    clock = ManualClock(time.time_ns() // 1_000_000)
    receiver = Receiver()
    app = create_app(db_path, clock=clock, background=True, ingest_rate=0)
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            world = World(client, app.state.db)
            alice = world.human("alice")
            worker = world.endpoint(alice, [QUEUE])
            made = client.post("/api/v1/notify", headers=alice.auth, json={
                "kind": "webhook", "url": receiver.url("/hook"), "events": ["review"]})
            assert made.status_code == 201, made.text
            todo, lease = claimed(world, alice, worker, work_item={
                "schema": "switchboard.work_item.v1", "objective": "o", "approval_gates": ["review"]})
            wait_limits(world, alice, worker, review={"after_seconds": 40, "then": "remind"})
            done = world.act(worker, todo["id"], "complete", lease_token=lease, summary="please look")
            assert done.status_code == 200 and done.json()["state"] == "review", done.text
            receiver.wait_for(1)  # review's own message
            for n in (2, 3, 4):
                all_sent(db_path, made.json()["id"])  # the sender's rate window starts when it recorded the send
                clock.advance(40)
                world.tick()
                app.state.flows.notifier.wake()
                receiver.wait_for(n)
            clock.advance(400)
            world.tick()
            assert len(system_lines(todo_of(world, alice, todo["id"]))) == 3
    finally:
        receiver.close()
    bodies = [r.json() for r in receiver.requests]
    assert [(b["type"], b["data"]["todo_id"], b["data"].get("reminder")) for b in bodies] == [
        ("review", todo["id"], None), *[("review", todo["id"], n) for n in (1, 2, 3)]]


def test_the_board_sets_and_shows_the_wait_limits(world, client, alice, worker):
    sign_in(client, alice)
    token = csrf(client)
    path = f"/board/endpoints/{worker.id}/queues/{QUEUE}/waits"
    saved = post(client, path, token, back="/board/queues", pending_seconds="3600", pending_then="reroute",
                 pending_queue="docs", review_seconds="86400", review_then="remind", blocked_seconds="",
                 blocked_then="cancel", needs_input_seconds="")
    assert saved.status_code == 303, saved.text
    page = client.get("/board/queues").text
    assert "pending 3600 s → reroute to docs" in page and "review 86400 s → remind" in page
    assert wait_limits(world, alice, worker) == {
        "pending": {"after_seconds": 3600, "then": "reroute", "queue": "docs"},
        "needs_input": None, "review": {"after_seconds": 86400, "then": "remind", "queue": None}, "blocked": None}
    refused = post(client, path, token, back="/board/queues", pending_seconds="60", pending_then="reroute")
    assert refused.status_code in (303, 400) and wait_limits(world, alice, worker)["pending"]["queue"] == "docs"


def test_the_cli_sets_and_clears_a_wait_limit(world, alice, worker, db_path):
    code, done = cli(db_path, "queue", "limits", worker.id, QUEUE, "--wait-limit", "pending=60:reroute:docs",
                     "--wait-limit", "blocked=30:cancel")
    assert code == 0, done
    assert done["limits"]["wait_limits"]["pending"] == {"after_seconds": 60, "then": "reroute", "queue": "docs"}
    assert done["limits"]["wait_limits"]["blocked"] == {"after_seconds": 30, "then": "cancel", "queue": None}
    code, done = cli(db_path, "queue", "limits", worker.id, QUEUE, "--wait-limit", "pending=none")
    assert code == 0 and done["limits"]["wait_limits"]["pending"] is None and done["limits"]["wait_limits"]["blocked"]
    code, refused = cli(db_path, "queue", "limits", worker.id, QUEUE, "--wait-limit", "pending=60:reroute")
    assert code == 1 and refused["message"].startswith("wait_limits.pending.queue"), refused
