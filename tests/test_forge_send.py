"""The forge sender against what a forge may say (issue 43): rate limits whose reset is not in the future, labels
and logins that would change a URL's path or a log line, and a status comment the forge must be able to take.

As in test_forge.py, the app runs in-process with its loops on, on a clock the test moves by hand; GitHub and Gitea
are played by tests/forges.py, which records every request."""

from __future__ import annotations

import logging
import re
import time
from urllib.parse import unquote, urlsplit

import producers
import pytest
from conftest import ManualClock, snapshot
from forges import REPO, FakeForge, Scene
from helpers import query

from switchboard.app import create_app
from switchboard.configuration import UNSAFE_TEXT
from switchboard.store.forge_outbox import OUTPUT_MAX_ATTEMPTS, backoff_ms
from switchboard.store.outputs import STATUS_EDIT_MS

TOKEN = "ghp_" + "S3ndT0ken" * 4
BOT = "switchboard-bot"
HOUR_MS = 3_600_000


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(time.time_ns() // 1_000_000)


@pytest.fixture
def app(db_path, clock):
    return create_app(db_path, clock=clock, background=True, notify_allow_private=True, ingest_rate=0)


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


# -- names that are path segments ------------------------------------------------------------------------------

PERMISSIVE = {"add_labels": {"allow": ["*"], "max": 10}, "remove_labels": {"allow": ["*"], "max": 10}}


@pytest.mark.parametrize("label", [".", "..", "...."])
@pytest.mark.parametrize("kind", ["add_labels", "remove_labels"])
def test_a_label_of_only_dots_is_refused_naming_it(world, alice, github, db_path, kind, label):
    scene = Scene(world, alice, github, policy=PERMISSIVE)
    todo_id, lease = _claimed(scene, 40)
    before = snapshot(db_path)
    refused = scene.act(todo_id, "complete", lease_token=lease,
                        outputs=[{"type": kind, "labels": ["size/S", label]}])
    assert refused.status_code == 400 and refused.json()["error"] == "invalid_argument", refused.text
    assert f"label {label!r} is only dots" in refused.json()["message"]
    assert snapshot(db_path) == before and github.writes() == []


def test_labels_that_look_like_paths_or_queries_stay_one_segment_of_the_url(world, alice, github):
    """With a policy that allows any label, `a/b`, `%2F` and `?x` each reach the forge as the last segment of
    `…/issues/N/labels/{name}`: the path the forge sees names that label of that issue, and nothing else."""
    scene = Scene(world, alice, github, policy=PERMISSIVE)
    todo_id, lease = _claimed(scene, 41)
    names = ["a/b", "%2F", "?x", "#frag", "size/S"]
    github.labels(REPO, 41).extend(names)
    done = scene.act(todo_id, "complete", lease_token=lease, outputs=[{"type": "remove_labels", "labels": names[:4]}])
    assert done.status_code == 200, done.text
    [sent] = scene.settled(todo_id)
    assert sent["state"] == "sent", sent
    assert github.labels(REPO, 41) == ["size/S"]
    deletes = [r["path"] for r in github.requests if r["method"] == "DELETE"]
    assert len(deletes) == 4
    for path, name in zip(deletes, names, strict=False):
        parts = urlsplit(path)
        assert parts.query == "" and parts.fragment == "", path
        *issue, last = parts.path.split("/")
        assert issue == ["", "repos", "acme", "site", "issues", "41", "labels"] and unquote(last) == name, path


def test_a_gitea_label_id_of_dots_is_not_put_into_a_url(world, alice, db_path):
    """Gitea removes a label by the id its own answer gave: an id that is a dot segment fails the output, and no
    DELETE goes out."""
    gitea = FakeForge("gitea", "0123456789abcdef" * 2 + "01234567", BOT)
    try:
        scene = Scene(world, alice, gitea, policy=PERMISSIVE)
        todo_id, lease = _claimed(scene, 42)
        gitea.labels(REPO, 42).append("triage")
        gitea.label_ids["triage"] = ".."
        scene.act(todo_id, "complete", lease_token=lease, outputs=[{"type": "remove_labels", "labels": ["triage"]}])
        [failed] = scene.settled(todo_id)
        assert failed["state"] == "failed" and "cannot be named in a forge URL" in failed["error"]
        assert [r for r in gitea.requests if r["method"] == "DELETE"] == []
    finally:
        gitea.stop()


# -- the forge's word about itself -------------------------------------------------------------------------------

FORGED_LOGINS = {
    "a newline": "bot\n2026-12-07 INFO forged line",
    "an escape code": "bot\x1b[31mred\x1b[0m",
    "300 characters": "b" * 300,
    "a space": "two words",
}


@pytest.mark.parametrize("login", FORGED_LOGINS.values(), ids=FORGED_LOGINS.keys())
def test_a_login_that_is_no_login_refuses_the_connection_with_a_clear_400(world, alice, db_path, caplog, login):
    caplog.set_level(logging.DEBUG)
    forge = FakeForge("github", TOKEN, login)
    try:
        before = snapshot(db_path)
        refused = world.client.post("/api/v1/connections", headers=alice.auth, json={
            "kind": "github", "api_url": forge.api, "token": TOKEN, "repos": ["acme/"]})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"] == "invalid_argument"
        message = refused.json()["message"]
        assert "which is not a login" in message and f"({len(login)} characters)" in message, message
        assert not re.search(f"[{UNSAFE_TEXT}]", message), message
        assert snapshot(db_path) == before
    finally:
        forge.stop()
    logged = caplog.text + "".join(r.getMessage() for r in caplog.records)
    assert "\x1b" not in logged and "\nforged line" not in logged and "b" * 61 not in logged


def test_a_gitea_login_with_dots_and_underscores_is_a_login(world, alice):
    gitea = FakeForge("gitea", "0123456789abcdef" * 2 + "01234567", "ci.bot_2")
    try:
        made = world.client.post("/api/v1/connections", headers=alice.auth, json={
            "kind": "gitea", "api_url": gitea.api, "token": gitea.token, "repos": ["acme/"]})
        assert made.status_code == 201 and made.json()["login"] == "ci.bot_2", made.text
    finally:
        gitea.stop()


def test_the_forges_own_words_reach_the_log_and_the_output_escaped(scene, github, caplog):
    caplog.set_level(logging.DEBUG)
    github.plan = [lambda request: (422, {}, {"message": "Validation Failed\n2026-12-07 ERROR forged\x1b[2J"})]
    todo_id, lease = _claimed(scene, 43)
    scene.act(todo_id, "complete", lease_token=lease, outputs=[{"type": "add_labels", "labels": ["size/S"]}])
    [failed] = scene.settled(todo_id)
    assert failed["error"] == "HTTP 422: Validation Failed\\n2026-12-07 ERROR forged\\x1b[2J"
    logged = caplog.text + "".join(r.getMessage() for r in caplog.records)
    assert "\x1b" not in logged and "\n2026-12-07 ERROR forged" not in logged


# -- the status comment ------------------------------------------------------------------------------------------

def _status(github: FakeForge, number: int) -> list[dict]:
    return [c for c in github.comments(REPO, number) if "<!-- switchboard:status -->" in c["body"]]


def _edited(scene: Scene, github: FakeForge, clock: ManualClock, number: int, what: str, check) -> str:
    """The status comment's body once an edit made after the next STATUS_EDIT_MS passes `check`."""
    clock.advance(STATUS_EDIT_MS / 1000 + 1)
    scene.wake()
    return github.wait_for(lambda: (found := _status(github, number)) and check(found[0]["body"]) and found[0]["body"],
                           what=what)


EVERY_ISSUE_EVENT = {"rules": [{"id": "any", "expr": ".issue != null",
                                "action": {"queue": "triage", "work_order": True}}], "default_action": {"drop": True}}


def test_sixty_done_todos_with_long_summaries_fold_into_a_comment_the_forge_takes(world, alice, github, clock):
    scene = Scene(world, alice, github, mirror=True)
    assert scene.call("PUT", f"/webhooks/{scene.hook['id']}/rules", **EVERY_ISSUE_EVENT).status_code == 200
    github.issue(REPO, 50)
    for n in range(60):
        raw, headers = producers.github("issues.edited", "", {
            "issue": {"number": 50, "title": "Spelling error", "labels": [], "user": {"login": "Codertocat"},
                      "pull_request": None}, "repository": {"full_name": REPO}, "sender": {"login": "Codertocat"},
            "changes": {"body": {"from": f"v{n}"}}})
        [todo] = scene.deliver(raw, headers)["todos"]
        lease = scene.claim(todo["id"])
        # Punctuation and short lines: each is escaped and quoted, so a summary of 600 grows to about 1,800.
        summary = f"summary {n:02d}\n" + "-.\n" * 200
        assert scene.act(todo["id"], "complete", lease_token=lease, summary=summary).status_code == 200
    body = _edited(scene, github, clock, 50, "the sixtieth summary", lambda body: "summary 59" in body)
    assert len(body) <= 65_536, len(body)
    assert "summary 59" in body and "summary 58" in body and "summary 00" not in body
    folded = re.search(r"^- (\d+) older entries are folded to fit: (\d+) done$", body, re.M)
    assert folded and folded[1] == folded[2], body[:500]
    shown = len(re.findall(r"^- \*\*triage\*\*: done by ", body, re.M))
    assert shown + int(folded[1]) == 60 and shown >= 20


def test_the_status_comment_says_a_lane_is_paused_why_and_until_when(world, alice, github, clock):
    scene = Scene(world, alice, github, mirror=True)
    scene.open_issue(51)
    github.wait_for(lambda: _status(github, 51), what="the status comment")
    paused = scene.call("POST", f"/endpoints/{scene.endpoint.id}/queues/triage/pause", until="2h",
                        reason="the GPU box is being moved")
    assert paused.status_code == 200, paused.text
    body = _edited(scene, github, clock, 51, "the pause", lambda body: "paused" in body)
    until = time.strftime("%Y-%m-%d %H:%M", time.gmtime((clock.now_ms() - STATUS_EDIT_MS - 1000) / 1000 + 7200))
    assert f"- **triage**: waiting; the lane is paused until {until} UTC:\n  > the GPU box is being moved" in body
    assert "waiting for a worker" not in body
    assert scene.call("POST", f"/endpoints/{scene.endpoint.id}/queues/triage/resume").status_code == 200
    body = _edited(scene, github, clock, 51, "the resume", lambda body: "paused" not in body)
    assert "- **triage**: waiting for a worker" in body


def test_the_status_comment_names_no_claimant_and_says_who_finished_and_when(world, alice, github, clock):
    scene = Scene(world, alice, github, mirror=True)
    todo_id = scene.open_issue(52)
    github.wait_for(lambda: _status(github, 52), what="the status comment")
    lease = scene.claim(todo_id, claimant="homelab-nas.local:4242")
    assert scene.act(todo_id, "complete", lease_token=lease, summary="fixed the typo").status_code == 200
    finished = time.strftime("%Y-%m-%d %H:%M", time.gmtime(clock.now_ms() / 1000))
    body = _edited(scene, github, clock, 52, "the done edit", lambda body: "done" in body)
    assert re.search(rf"^- \*\*triage\*\*: done by ep\\-2\\-[0-9a-f]{{6}}, {finished} UTC:\n  > fixed the typo$",
                     body, re.M), body
    assert "homelab" not in body and "4242" not in body
    for word in ("lease", "dead letter", "claimed"):
        assert word not in body


def test_a_stranger_held_by_the_trust_gate_is_not_told_on_the_status_comment(world, alice, github, clock):
    scene = Scene(world, alice, github, mirror=True)
    gate = scene.call("PUT", f"/webhooks/{scene.hook['id']}/trusted-actors", logins=["Codertocat"])
    assert gate.status_code == 200, gate.text
    todo_id = scene.open_issue(53)
    github.wait_for(lambda: _status(github, 53), what="the status comment")
    # A stranger's label a rule would route (sized-s): the gate, after the rules, holds it for the human.
    raw, headers = producers.github("issues.labeled", "", {
        "issue": {"number": 53, "title": "Spelling error", "labels": [{"name": "size/S"}],
                  "user": {"login": "Codertocat"}}, "label": {"name": "size/S"},
        "repository": {"full_name": REPO}, "sender": {"login": "stranger"}})
    held = scene.deliver(raw, headers)
    assert held["disposition"] == "quarantined", held
    scene.claim(todo_id)
    body = _edited(scene, github, clock, 53, "the claim's edit", lambda body: "waiting for a worker" not in body)
    entries = re.findall(r"^- .*$", body, re.M)
    assert len(entries) == 1, body
    assert entries[0].startswith("- **triage**: being worked on by ") and "stranger" not in body
