"""The rule sandbox's frames (issue 30): deliveries of one owner under one rule set that wait together go to one
child in one frame, each with its own verdict and its own budget; one that overruns or kills its child is the
fault, the ones after it are evaluated again; an owner's flood holds one child; and its rules saves and replays do
not hold up its deliveries.

The evaluator here is the real pool of sandboxed children; the served tests run `python switchboard.py serve`."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx
import producers
from conftest import LiveServer, cli, workdir

from switchboard.evaluator import EVAL_BATCH, Evaluator

LOOP_WHEN_ASKED = 'if .loop then last(range(1e15)) > 0 else .n % 3 == 0 end'


def doc(n: int, loop: bool = False, pad: int = 0) -> bytes:
    return json.dumps({"n": n, "loop": loop, "pad": "x" * pad}).encode()


def test_a_frame_gives_each_envelope_its_own_verdict_in_order():
    evaluator = Evaluator(size=1)
    try:
        verdicts = evaluator.run_batch([".n % 3 == 0", ".n % 3 == 1"], {}, [doc(n) for n in range(12)])
        assert verdicts == [{"match": 0} if n % 3 == 0 else {"match": 1} if n % 3 == 1 else {"none": True}
                            for n in range(12)]
        assert len(evaluator._idle) == 1, "one child did the whole frame"
    finally:
        evaluator.close()


def test_the_envelope_that_overruns_is_the_fault_and_the_ones_after_it_are_not_evaluated():
    evaluator = Evaluator(size=1, budget=0.1, kill_after=0.5)
    try:
        started = time.monotonic()
        verdicts = evaluator.run_batch([LOOP_WHEN_ASKED], {}, [doc(3), doc(4), doc(5, loop=True), doc(6), doc(7)])
        assert time.monotonic() - started < 2, "the frame did not wait for the looping envelope"
        assert verdicts[:2] == [{"match": 0}, {"none": True}]
        assert verdicts[2]["fault"] == "timeout"
        assert verdicts[3:] == [None, None]
        assert evaluator.run_batch([LOOP_WHEN_ASKED], {}, [doc(6), doc(7)]) == [{"match": 0}, {"none": True}]
    finally:
        evaluator.close()


def test_a_frame_larger_than_a_pipe_does_not_block_on_a_busy_child():
    """The child reads a whole frame before evaluating any of it: a frame of 16 envelopes of 100 KB (more than a
    pipe holds) whose first loops is still the first's timeout within the budget, not a writer stuck on a full
    pipe until the child's own alarm kills it."""
    evaluator = Evaluator(size=1, budget=0.1, kill_after=0.5)
    try:
        started = time.monotonic()
        verdicts = evaluator.run_batch([LOOP_WHEN_ASKED], {},
                                       [doc(0, loop=True, pad=100_000)] + [doc(n, pad=100_000) for n in range(1, 16)])
        assert time.monotonic() - started < 1.5
        assert verdicts[0]["fault"] == "timeout" and verdicts[1:] == [None] * 15
    finally:
        evaluator.close()


def test_when_the_child_dies_mid_frame_that_envelope_is_the_fault_and_the_rest_go_again():
    """The child is killed (as the kernel would, at its memory cap) while it is on the frame's second envelope:
    the first keeps its verdict, the second is the `budget_exhausted` fault, the third was never evaluated."""
    evaluator = Evaluator(size=1, budget=5, kill_after=6)
    try:
        assert evaluator.run([LOOP_WHEN_ASKED], {}, doc(3)) == {"match": 0}
        (child,) = evaluator._idle
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(evaluator.run_batch, [LOOP_WHEN_ASKED], {}, [doc(3), doc(4, loop=True), doc(6)])
            time.sleep(0.5)
            os.kill(child.proc.pid, signal.SIGKILL)
            verdicts = call.result(timeout=10)
        assert verdicts[0] == {"match": 0}
        assert verdicts[1]["fault"] == "budget_exhausted" and verdicts[1]["rule_index"] is None
        assert verdicts[2] is None
        assert evaluator.run_batch([LOOP_WHEN_ASKED], {}, [doc(6)]) == [{"match": 0}], "a fresh child took its place"
    finally:
        evaluator.close()


def test_an_owners_long_rules_jobs_do_not_hold_up_its_deliveries(world, app, alice):
    """A rules save, dry run, release or replay holds one of its owner's slots for as long as it runs; the
    owner's deliveries have a line of their own, so with every slot taken they are still evaluated at once."""
    endpoint = world.endpoint(alice, ["triage", "build"], verbs=["all"])
    hook = world.webhook(alice, endpoint)
    saved = world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth, json={
        "rules": [{"id": "build", "expr": ".issue != null", "action": {"queue": "build"}}]})
    assert saved.status_code == 200, saved.text
    flows = app.state.flows
    release = threading.Event()
    jobs = [world.client.portal.start_task_soon(flows.evaluate, alice.id, release.wait, 30)
            for _ in range(flows.evaluator.per_tenant)]
    try:
        answer = world.deliver(hook, *producers.github("issues.opened", hook["secret"]))
        assert answer.status_code == 202, answer.text
        assert [t["queue"] for t in answer.json()["todos"]] == ["build"]
    finally:
        release.set()
    assert [job.result(timeout=10) for job in jobs] == [True] * len(jobs)


# -- served ------------------------------------------------------------------------------------------------

def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def issue(secret: str, number: int, label: str) -> tuple[bytes, dict]:
    return producers.github("issues.labeled", secret, {"issue": {"number": number, "labels": [{"name": label}]},
                                                      "label": {"name": label}})


def test_a_flood_from_one_owner_is_evaluated_in_frames_by_one_child_each_delivery_on_its_own_verdict(db_path):
    """64 deliveries at once from one owner, each labeled for one of three queues by its number, and one whose
    label makes its rule loop: every other delivery lands in the queue its own label names (no verdict goes to a
    neighbour in its frame), the looping one is held as a timeout, and the owner never had more than one child."""
    cli(db_path, "init")
    cli(db_path, "human", "add", "alice")
    _, endpoint = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "router", "--queues", "q0,q1,q2",
                   "--verbs", "webhooks")
    _, hook = cli(db_path, "webhook", "create", "--endpoint", endpoint["id"], "--provider", "github", "--queue", "q0",
               "--trust", "Codertocat", "--base-url", "http://placeholder")
    rules = {"rules": [
        {"id": "loops", "expr": '(.issue.labels | index("loop")) != null and (last(range(1e15)) > 0)',
         "action": {"queue": "q0"}},
        *({"id": f"to-q{k}", "expr": f'.issue.labels == ["q{k}"]', "action": {"queue": f"q{k}"}} for k in range(3))]}
    rules_path = str(workdir(db_path) / "rules.json")
    with open(rules_path, "w") as f:
        json.dump(rules, f)
    assert cli(db_path, "rules", "set", hook["id"], "--file", rules_path)[0] == 0
    server = LiveServer(db_path, "--ingest-rate", "0")
    try:
        path = "/hooks/" + hook["url"].rsplit("/hooks/", 1)[1]
        deliveries = [issue(hook["secret"], n, "loop" if n == 5 else f"q{n % 3}") for n in range(64)]
        most_children = 0

        def deliver(raw_headers: tuple[bytes, dict]) -> httpx.Response:
            return client.post(server.url + path, content=raw_headers[0], headers=raw_headers[1])

        with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=64)) as client, \
                concurrent.futures.ThreadPoolExecutor(32) as pool:
            calls = [pool.submit(deliver, d) for d in deliveries]
            while not all(call.done() for call in calls):
                most_children = max(most_children, len(children_of(server.proc.pid)))
                time.sleep(0.01)
            answers = [call.result() for call in calls]
        for n, answer in enumerate(answers):
            assert answer.status_code == 202, answer.text
            outcome = answer.json()
            if n == 5:
                assert outcome["disposition"] == "quarantined", outcome
            else:
                assert outcome["disposition"] == "routed", outcome
                assert [t["queue"] for t in outcome["todos"]] == [f"q{n % 3}"], (n, outcome)
        held = httpx.get(f"{server.url}/api/v1/events/{answers[5].json()['event_id']}",
                         headers={"Authorization": f"Bearer {endpoint['token']}"}).json()
        assert held["trace"]["cause"] == "timeout", held["trace"]
        # The looping delivery's child is replaced while it overruns: two at once at most, never one per delivery.
        assert 1 <= most_children <= 2, most_children
        assert len(deliveries) > EVAL_BATCH
    finally:
        server.stop()
