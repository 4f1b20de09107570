"""The forge sender against what a forge may say (issue 43): rate limits whose reset is not in the future, labels
and logins that would change a URL's path or a log line, and a status comment the forge must be able to take.

As in test_forge.py, the app runs in-process with its loops on, on a clock the test moves by hand; GitHub and Gitea
are played by tests/forges.py, which records every request."""

from __future__ import annotations

import time

import pytest
from conftest import ManualClock
from forges import REPO, FakeForge, Scene
from helpers import query

from switchboard.app import create_app
from switchboard.store.forge_outbox import OUTPUT_MAX_ATTEMPTS, backoff_ms

TOKEN = "ghp_" + "S3ndT0ken" * 4
BOT = "switchboard-bot"
HOUR_MS = 3_600_000


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


@pytest.fixture
def scene(world, alice, github) -> Scene:
    return Scene(world, alice, github)


def _claimed(scene: Scene, number: int) -> tuple[str, str]:
    todo_id = scene.open_issue(number)
    return todo_id, scene.claim(todo_id)


def _next_at(db_path: str, output_id: str) -> int:
    return query(db_path, "SELECT next_at FROM forge_outputs WHERE id = ?", (output_id,))[0][0]


# -- rate limits ------------------------------------------------------------------------------------------------

RESET_NOT_AHEAD = {
    "429 Retry-After: 0": lambda now_s: (429, {"Retry-After": "0"}),
    "429 Retry-After: -5": lambda now_s: (429, {"Retry-After": "-5"}),
    "403 reset 30 s behind": lambda now_s: (403, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(now_s - 30)}),
}


@pytest.mark.parametrize("limited", RESET_NOT_AHEAD.values(), ids=RESET_NOT_AHEAD.keys())
def test_a_rate_limit_whose_reset_is_not_ahead_waits_the_backoff(scene, github, clock, db_path, limited):
    status, headers = limited(clock.now_ms() // 1000)
    github.plan = [lambda request: (status, headers, {"message": "API rate limit exceeded"})]
    todo_id, lease = _claimed(scene, 30)
    scene.act(todo_id, "complete", lease_token=lease, outputs=[{"type": "add_labels", "labels": ["size/S"]}])
    tried = scene.tried(todo_id, 1)
    assert tried["state"] == "pending" and "rate limited" in tried["error"]
    assert _next_at(db_path, tried["id"]) == clock.now_ms() + backoff_ms(1) == clock.now_ms() + 5_000
    clock.advance(5)
    scene.wake()
    [sent] = scene.settled(todo_id)
    assert (sent["state"], sent["attempts"]) == ("sent", 2)


def test_an_output_rate_limited_again_and_again_is_not_given_up_inside_an_hour(scene, github, clock, db_path):
    """Twelve rate limits whose resets are now or past, or a second away: each try waits at least the backoff, so
    the output is given up only after more than an hour (GitHub's rate limit window), not after 12 s."""
    def limited(request):
        now_s = clock.now_ms() // 1000
        headers = [{"Retry-After": "0"}, {"Retry-After": "1"}, {"X-RateLimit-Reset": str(now_s - 30),
                                                                 "X-RateLimit-Remaining": "0"}][len(github.requests) % 3]
        return 429, headers, {"message": "API rate limit exceeded"}

    github.plan = [limited] * OUTPUT_MAX_ATTEMPTS
    todo_id, lease = _claimed(scene, 31)
    accepted_at = clock.now_ms()
    scene.act(todo_id, "complete", lease_token=lease, outputs=[{"type": "add_labels", "labels": ["size/S"]}])
    for tries in range(1, OUTPUT_MAX_ATTEMPTS):
        output = scene.tried(todo_id, tries)
        assert output["state"] == "pending", f"given up after {tries} tries, {(clock.now_ms() - accepted_at) / 1000} s"
        due = _next_at(db_path, output["id"])
        assert due >= clock.now_ms() + backoff_ms(tries), f"try {tries + 1} due sooner than the backoff"
        clock.ms = due
        scene.wake()
    [failed] = scene.settled(todo_id)
    assert failed["state"] == "failed" and failed["error"].startswith(f"gave up after {OUTPUT_MAX_ATTEMPTS} attempts")
    assert clock.now_ms() - accepted_at > HOUR_MS
