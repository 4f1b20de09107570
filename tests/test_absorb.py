"""Absorbed updates and receipts: one run per head, and no worker-written text can ever make work skip."""

from __future__ import annotations

import threading

import producers
import pytest


@pytest.fixture
def reviewer(world, alice):
    return world.endpoint(alice, ["review"], name="reviewer")


@pytest.fixture
def hook(world, alice, reviewer):
    return world.webhook(alice, reviewer, "github", "review")


def push(world, hook, n: int, number: int = 2) -> str:
    """The pull request gets a new head: a `synchronize` delivery about the same subject."""
    raw, headers = producers.github("pull_request.synchronize", hook["secret"],
                                    {"number": number, "pull_request": {"number": number, "head": {"sha": f"{n:040x}"}}})
    outcome = world.deliver(hook, raw, headers).json()
    return outcome["todos"][0]["id"]


def show(world, human, todo_id) -> dict:
    return world.client.get(f"/api/v1/todos/{todo_id}", headers=human.auth).json()


@pytest.fixture
def three_pushes(world, alice, reviewer, hook):
    """The first push is claimed; two more arrive while it runs, and the run absorbs them."""
    first = push(world, hook, 1)
    claim = world.claim(reviewer)
    assert claim["todo"]["id"] == first
    followups = [push(world, hook, 2), push(world, hook, 3)]
    absorbed = world.act(reviewer, first, "absorb", lease_token=claim["lease_token"])
    assert absorbed.status_code == 200, absorbed.text
    assert [t["id"] for t in absorbed.json()["absorbed"]] == followups
    assert absorbed.json()["absorbed"][1]["payload"]["pull_request"]["head"]["sha"] == f"{3:040x}"
    return first, claim["lease_token"], followups


def test_three_pushes_one_run_one_receipt(world, alice, reviewer, three_pushes):
    first, lease, followups = three_pushes
    assert world.claim(reviewer) == {"empty": True}, "absorbed follow-ups are not claimable while the run holds them"
    done = world.act(reviewer, first, "complete", lease_token=lease, summary="reviewed head 3")
    assert done.json()["state"] == "done"
    receipt = show(world, alice, first)["receipt"]
    assert receipt["id"].startswith("rc_") and receipt["absorbed"] == followups and receipt["attempt_seq"] == 1
    for todo_id in followups:
        todo = show(world, alice, todo_id)
        assert todo["state"] == "done" and todo["outcome"] == "absorbed"
        assert todo["result"] == {"absorbed_by": first, "receipt": receipt["id"]}
        assert todo["receipt"] == receipt, "get_todo shows the receipt on both sides"
    assert world.claim(reviewer) == {"empty": True}


def test_absorb_only_takes_the_same_subject_endpoint_and_queue(world, alice, reviewer, hook):
    first = push(world, hook, 1, number=2)
    claim = world.claim(reviewer)
    other_pr = push(world, hook, 2, number=3)
    same_pr = push(world, hook, 3, number=2)
    absorbed = world.act(reviewer, first, "absorb", lease_token=claim["lease_token"]).json()["absorbed"]
    assert [t["id"] for t in absorbed] == [same_pr]
    assert world.claim(reviewer)["todo"]["id"] == other_pr


@pytest.mark.parametrize("ending", ["fail", "release", "needs-input", "block", "lease-expiry", "revoke"])
def test_every_unsuccessful_end_leaves_the_followups_claimable(world, alice, reviewer, three_pushes, clock, ending):
    first, lease, followups = three_pushes
    if ending == "fail":
        world.act(reviewer, first, "fail", lease_token=lease, error="crashed", retry_in_seconds=3600)
    elif ending == "release":
        world.act(reviewer, first, "release", lease_token=lease)
    elif ending == "needs-input":
        world.act(reviewer, first, "needs-input", lease_token=lease, question="which base?")
    elif ending == "block":
        world.act(reviewer, first, "block", lease_token=lease, reason="CI down")
    elif ending == "lease-expiry":
        clock.advance(301)
    elif ending == "revoke":
        world.client.post(f"/api/v1/endpoints/{reviewer.id}/revoke", headers=alice.auth)
        for todo_id in followups:
            assert show(world, alice, todo_id)["outcome"] is None
        return
    claimed = []
    for _ in range(4):
        answer = world.claim(reviewer)
        if answer.get("empty"):
            break
        claimed.append(answer["todo"]["id"])
    assert set(followups) <= set(claimed), "fail open: the follow-ups run as ordinary work"
    assert set(claimed) <= {first, *followups}
    for todo_id in followups:
        assert show(world, alice, todo_id)["receipt"] is None


def gate(world, todo_id: str) -> None:
    """Put the head run behind a review gate. Only operator work items carry approval gates, and those have no
    subject, so the test sets the flag a work item would set on a delivery's todo."""
    world.db.write_sync(lambda txn: txn.execute("UPDATE todos SET gated = 1 WHERE id = ?", (todo_id,)))


def test_review_holds_followups_until_approval_writes_the_receipt(world, alice, reviewer, hook):
    first = push(world, hook, 1)
    gate(world, first)
    claim = world.claim(reviewer)
    followup = push(world, hook, 2)
    world.act(reviewer, first, "absorb", lease_token=claim["lease_token"])
    review = world.act(reviewer, first, "complete", lease_token=claim["lease_token"], summary="ready").json()
    assert review["state"] == "review"
    assert world.claim(reviewer) == {"empty": True}, "held while the review may still approve the run"
    assert show(world, alice, first)["receipt"] is None
    world.act(alice, first, "approve")
    receipt = show(world, alice, first)["receipt"]
    assert receipt["absorbed"] == [followup]
    assert show(world, alice, followup)["outcome"] == "absorbed"


def test_request_changes_lets_go_of_the_followups(world, alice, reviewer, hook):
    first = push(world, hook, 1)
    gate(world, first)
    claim = world.claim(reviewer)
    followup = push(world, hook, 2)
    world.act(reviewer, first, "absorb", lease_token=claim["lease_token"])
    world.act(reviewer, first, "complete", lease_token=claim["lease_token"], summary="ready")
    assert world.act(alice, first, "request-changes", note="needs tests").json()["state"] == "pending"
    assert {world.claim(reviewer)["todo"]["id"] for _ in range(2)} == {first, followup}
    assert show(world, alice, followup)["receipt"] is None


def test_no_text_is_ever_a_receipt(world, alice, reviewer, hook):
    first = push(world, hook, 1)
    followups = [push(world, hook, 2), push(world, hook, 3)]
    claim = world.claim(reviewer)
    assert claim["todo"]["id"] == first
    forged = {"absorbed": followups, "receipt": {"id": "rc_forged", "absorbed": followups}}
    world.act(reviewer, first, "heartbeat", lease_token=claim["lease_token"], note=f"absorbed {followups}")
    world.act(reviewer, first, "complete", lease_token=claim["lease_token"], result=forged,
              summary=f"absorbed_by {first}; receipt rc_forged absorbed {' '.join(followups)}")
    assert show(world, alice, first)["receipt"] is None
    for todo_id in followups:
        assert show(world, alice, todo_id)["state"] == "pending"
    assert {world.claim(reviewer)["todo"]["id"] for _ in range(2)} == set(followups)


def test_a_payload_claiming_to_be_absorbed_changes_nothing(world, alice, reviewer, hook):
    first = push(world, hook, 1)
    raw, headers = producers.github("pull_request.synchronize", hook["secret"], {
        "pull_request": {"head": {"sha": "f" * 40}}, "absorbed_by": first, "receipt": {"absorbed": ["td_x"]}})
    world.client.post(hook["url"].removeprefix("http://testserver"), content=raw, headers=headers)
    claim = world.claim(reviewer)
    world.act(reviewer, first, "complete", lease_token=claim["lease_token"])
    assert world.claim(reviewer)["todo"]["payload"]["absorbed_by"] == first, "still ordinary work"


def test_absorb_with_a_stale_lease_token_is_refused(world, alice, reviewer, hook, clock):
    first = push(world, hook, 1)
    stale = world.claim(reviewer, lease_seconds=10)["lease_token"]
    push(world, hook, 2)
    clock.advance(11)
    fresh = world.claim(reviewer)
    assert fresh["todo"]["id"] == first
    refused = world.act(reviewer, first, "absorb", lease_token=stale)
    assert refused.status_code == 409 and refused.json()["error"] == "conflict"
    assert world.act(reviewer, first, "absorb", lease_token=fresh["lease_token"]).status_code == 200


def test_racing_absorbers_share_nothing(world, alice, reviewer, hook):
    heads = [push(world, hook, 1), push(world, hook, 2)]
    runs = [world.claim(reviewer) for _ in heads]
    assert {r["todo"]["id"] for r in runs} == set(heads), "two live runs about the same subject"
    followups = [push(world, hook, n) for n in range(3, 11)]
    barrier = threading.Barrier(2)
    taken: dict[str, list[str]] = {}

    def absorb(run: dict) -> None:
        barrier.wait()
        answer = world.act(reviewer, run["todo"]["id"], "absorb", lease_token=run["lease_token"])
        taken[run["todo"]["id"]] = [t["id"] for t in answer.json()["absorbed"]]

    threads = [threading.Thread(target=absorb, args=(run,)) for run in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    first, second = taken.values()
    assert not set(first) & set(second), "each follow-up is absorbed by at most one run"
    assert sorted(first + second) == sorted(followups)
    for run in runs:
        world.act(reviewer, run["todo"]["id"], "complete", lease_token=run["lease_token"])
    receipts = [show(world, alice, run["todo"]["id"])["receipt"] for run in runs]
    named = [todo for receipt in receipts if receipt for todo in receipt["absorbed"]]
    assert sorted(named) == sorted(followups) and len(named) == len(set(named))


@pytest.mark.sqlite_only("a SQLite TEMP TRIGGER refuses the receipt")
def test_a_receipt_that_cannot_be_written_fails_open(world, alice, reviewer, three_pushes):
    first, lease, followups = three_pushes
    # The database itself refuses the receipt, as a full disk or a corrupt page would.
    world.db.write_sync(lambda txn: txn.execute(
        "CREATE TEMP TRIGGER refuse_receipts BEFORE INSERT ON receipts BEGIN SELECT RAISE(ABORT, 'disk full'); END"))
    done = world.act(reviewer, first, "complete", lease_token=lease, summary="done anyway")
    assert done.status_code == 200 and done.json()["state"] == "done"
    assert show(world, alice, first)["receipt"] is None
    assert {world.claim(reviewer)["todo"]["id"] for _ in followups} == set(followups)
