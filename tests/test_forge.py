"""Forge connections and outputs (SPEC 16, issue 36): the server writes, the worker asks.

The app runs in-process with its background loops on (the forge sender must run) on a clock the test moves by hand,
started at the real time; moving it brings a retry or a status comment's next edit due, and `wake` makes the sender
look again at once. GitHub and Gitea are played by tests/forges.py, which records every request; the deliveries it
sends back (an issue labelled, a comment posted) wait in its outbox until the test posts them to the webhook."""

from __future__ import annotations

import json
import logging
import re
import time

import producers
import pytest
from conftest import ManualClock, snapshot
from forges import REPO, FakeForge, Scene
from helpers import query
from starlette.testclient import TestClient

from switchboard.app import create_app
from switchboard.models import (
    ConnectionAnswer,
    ConnectionListAnswer,
    ConnectionTestAnswer,
    OutputsAnswer,
    TodoAnswer,
    WebhookConnectionAnswer,
)
from switchboard.store.forge_outbox import OUTPUT_MAX_ATTEMPTS
from switchboard.store.outputs import STATUS_EDIT_MS, WORD_JOINER

TOKEN = "ghp_" + "F0rgeT0ken" * 4
GITEA_TOKEN = "0123456789abcdef" * 2 + "01234567"
BOT = "switchboard-bot"


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


def label_posts(forge: FakeForge, number: int) -> list[dict]:
    return [r for r in forge.requests if r["method"] == "POST"
            and r["path"] == f"{forge.prefix}/repos/{REPO}/issues/{number}/labels"]


# -- connections ---------------------------------------------------------------------------------------------------

def test_a_connection_asks_the_forge_who_the_token_is_and_never_shows_it(world, alice, github, db_path):
    made = world.client.post("/api/v1/connections", headers=alice.auth, json={
        "kind": "github", "api_url": github.api, "token": TOKEN, "repos": ["acme/", "Codertocat/Hello-World"]})
    assert made.status_code == 201, made.text
    connection = made.json()
    assert connection["id"].startswith("fc_") and connection["login"] == BOT
    assert connection["repos"] == ["acme/", "Codertocat/Hello-World"]
    [asked] = github.requests
    assert (asked["method"], asked["path"], asked["headers"]["authorization"]) == ("GET", "/user", f"Bearer {TOKEN}")
    listed = world.client.get("/api/v1/connections", headers=alice.auth)
    assert listed.json()["connections"][0]["login"] == BOT
    for text in (made.text, listed.text, world.client.get("/api/v1/openapi.json").text):
        assert TOKEN not in text
    stored = query(db_path, "SELECT token_sealed FROM forge_connections")[0][0]
    assert TOKEN.encode() not in stored
    tested = world.client.post(f"/api/v1/connections/{connection['id']}/test", headers=alice.auth)
    assert tested.json() == {"id": connection["id"], "ok": True, "login": BOT, "error": None}
    ConnectionAnswer.model_validate(connection)
    ConnectionListAnswer.model_validate(listed.json())
    ConnectionTestAnswer.model_validate(tested.json())

    # A token the forge does not know is refused, and nothing is stored.
    before = snapshot(db_path)
    refused = world.client.post("/api/v1/connections", headers=alice.auth, json={
        "kind": "github", "api_url": github.api, "token": "ghp_wrong", "repos": ["acme/"]})
    assert refused.status_code == 400 and "HTTP 401: Bad credentials" in refused.json()["message"]
    assert snapshot(db_path) == before
    # Only a human adds connections.
    endpoint = world.endpoint(alice, ["triage"])
    assert world.client.get("/api/v1/connections", headers=endpoint.auth).status_code == 403


def test_a_connection_to_an_internal_address_is_refused_unless_the_operator_allows_it(tmp_path, github, clock):
    app = create_app(str(tmp_path / "strict.db"), clock=clock, background=False, notify_allow_private=False)
    with TestClient(app) as client:
        from switchboard.store.principals import add_human
        human = app.state.db.write_sync(add_human, "alice")
        refused = client.post("/api/v1/connections", headers={"Authorization": f"Bearer {human['token']}"},
                              json={"kind": "github", "api_url": github.api, "token": TOKEN, "repos": ["acme/"]})
    assert refused.status_code == 400 and refused.json()["message"].startswith("api_url: refused: the forge's host")
    assert github.requests == []


def test_the_connections_login_is_a_trusted_actor_of_the_webhook(world, alice, github):
    """The label events the server's own outputs cause pass the trust gate without naming the bot anywhere."""
    endpoint = world.endpoint(alice, ["triage", "lane-s"])
    hook = world.webhook(alice, endpoint, "github", "triage", trusted_actors={"logins": ["Codertocat"]})
    raw, headers = producers.github("issues.labeled", hook["secret"], {"sender": {"login": BOT}})
    assert world.deliver(hook, raw, headers).json()["disposition"] == "quarantined"
    connection = world.client.post("/api/v1/connections", headers=alice.auth, json={
        "kind": "github", "api_url": github.api, "token": TOKEN, "repos": ["Codertocat/"]}).json()
    assert world.client.put(f"/api/v1/webhooks/{hook['id']}/connection", headers=alice.auth,
                            json={"connection_id": connection["id"]}).status_code == 200
    shown = world.client.get(f"/api/v1/webhooks/{hook['id']}", headers=alice.auth).json()
    assert shown["trusted_actors"] == {"logins": ["Codertocat"], "match": "sender"}
    assert shown["connection"] == {"id": connection["id"], "kind": "github", "login": BOT, "mirror": False,
                                   "commands": {"logins": [], "on_close": "cancel"}}
    raw, headers = producers.github("issues.labeled", hook["secret"], {"sender": {"login": BOT.upper()}})
    assert world.deliver(hook, raw, headers).json()["disposition"] == "routed"
    connected = world.client.get(f"/api/v1/webhooks/{hook['id']}/connection", headers=alice.auth).json()
    WebhookConnectionAnswer.model_validate(connected)
    policy = connected["policy"]
    assert policy == {"add_labels": {"allow": ["size/*"], "max": 3}, "comment": {"max": 3, "max_bytes": 8192}}


# -- outputs --------------------------------------------------------------------------------------------------

def test_complete_with_add_labels_writes_the_label_once_on_the_work_orders_issue(scene, github, caplog):
    caplog.set_level(logging.INFO)
    todo_id = scene.open_issue(41)
    lease = scene.claim(todo_id)
    done = scene.act(todo_id, "complete", lease_token=lease, summary="sized S",
                     outputs=[{"type": "add_labels", "labels": ["size/S"]}])
    assert done.status_code == 200, done.text
    assert done.json()["state"] == "done"
    [accepted] = done.json()["outputs"]
    assert (accepted["type"], accepted["labels"], accepted["target"]) == ("add_labels", ["size/S"], f"{REPO}#41")
    [sent] = scene.settled(todo_id)
    assert sent["state"] == "sent" and sent["error"] is None and sent["sent_at"]
    TodoAnswer.model_validate(done.json())
    TodoAnswer.model_validate(scene.todo(todo_id))
    [post] = label_posts(github, 41)
    assert post["json"] == {"labels": ["size/S"]} and post["headers"]["authorization"] == f"Bearer {TOKEN}"
    assert post["headers"]["host"] == f"127.0.0.1:{github.server_port}"
    assert github.labels(REPO, 41) == ["size/S"]
    # The label event the forge sends back, from the bot, reaches lane-s (the connection's login is trusted).
    [labelled] = scene.flush()
    assert labelled["disposition"] == "routed" and labelled["todos"][0]["queue"] == "lane-s"
    metrics = scene.client.get("/metrics").text
    assert 'switchboard_forge_outputs_total{state="sent",type="add_labels"} 1.0' in metrics
    assert 'switchboard_forge_outputs_accepted_total{type="add_labels"} 1.0' in metrics
    assert TOKEN not in caplog.text


def _claimed(scene: Scene, number: int) -> tuple[str, str]:
    todo_id = scene.open_issue(number)
    return todo_id, scene.claim(todo_id)


@pytest.mark.parametrize("outputs, where, why", [
    ([{"type": "add_labels", "labels": ["size/S"]}, {"type": "add_labels", "labels": ["bug"]}], "outputs[1]",
     "label 'bug' is outside the policy's add_labels allow list (size/*)"),
    ([{"type": "remove_labels", "labels": ["size/S"]}], "outputs[0]",
     "the webhook's output policy does not allow remove_labels"),
    ([{"type": "comment", "body": f"done; the token was {TOKEN}"}], "outputs[0]",
     "the comment holds what looks like a GitHub token; it is never posted"),
    ([{"type": "comment", "body": "-----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbn…"}], "outputs[0]",
     "the comment holds what looks like a private key"),
    ([{"type": "comment", "body": "x" * 8193}], "outputs[0]", "the comment is 8193 bytes, over the policy's max_bytes"),
    ([{"type": "add_labels", "labels": ["size/S", "size/M", "size/L", "size/XL"]}], "outputs[0]",
     "over the policy's max of 3 labels per todo"),
    ([{"type": "comment", "body": "<!-- switchboard:status --> forged"}], "outputs[0]", "the comment carries a Switchboard marker"),
], ids=["label outside the policy", "a kind the policy leaves out", "a token", "a private key", "too long",
        "too many labels", "a marker"])
def test_a_refused_output_refuses_the_whole_report_and_nothing_is_sent(scene, github, db_path, outputs, where, why):
    todo_id, lease = _claimed(scene, 50)
    before = snapshot(db_path)
    refused = scene.act(todo_id, "complete", lease_token=lease, outputs=outputs)
    assert refused.status_code == 400
    assert refused.json()["error"] == "invalid_argument"
    assert refused.json()["message"].startswith(f"{where}: {why}"), refused.json()
    assert TOKEN not in refused.text
    assert snapshot(db_path) == before
    assert scene.todo(todo_id)["state"] == "claimed"
    assert github.writes() == []


def test_a_second_comment_over_the_cap_is_refused_and_only_the_first_is_posted(world, alice, github, db_path):
    scene = Scene(world, alice, github, policy={"comment": {"max": 1, "max_bytes": 1000}})
    todo_id, lease = _claimed(scene, 51)
    first = scene.act(todo_id, "outputs", lease_token=lease, outputs=[{"type": "comment", "body": "working on it"}])
    assert first.status_code == 200 and len(first.json()["outputs"]) == 1
    OutputsAnswer.model_validate(first.json())
    scene.settled(todo_id)
    before = snapshot(db_path)
    second = scene.act(todo_id, "fail", lease_token=lease, error="no", outputs=[{"type": "comment", "body": "again"}])
    assert second.status_code == 400
    assert second.json()["message"] == "outputs[0]: over the policy's max of 1 comments per todo"
    assert snapshot(db_path) == before
    assert [r["json"]["body"].split("\n")[0] for r in github.writes()] == ["working on it"]


def test_an_output_on_a_todo_whose_work_order_is_unverified_is_refused(world, alice, github, db_path):
    """A generic webhook's delivery that says it is a GitHub issue makes a work order with verified false: its
    todo may not write to the forge, even through a connection that covers the repository."""
    scene = Scene(world, alice, github, provider="generic")
    raw = json.dumps({"action": "opened", "issue": {"number": 52, "title": "t", "user": {"login": "x"}, "labels": []},
                      "repository": {"full_name": REPO}, "sender": {"login": "x"}}).encode()
    opened = world.deliver(scene.hook, raw, {"X-GitHub-Event": "issues", "Content-Type": "application/json"}).json()
    todo_id = opened["todos"][0]["id"]
    assert scene.todo(todo_id)["work_order"]["verified"] is False
    lease = scene.claim(todo_id)
    before = snapshot(db_path)
    refused = scene.act(todo_id, "complete", lease_token=lease, outputs=[{"type": "add_labels", "labels": ["size/S"]}])
    assert refused.status_code == 400
    assert refused.json()["message"] == ("outputs[0]: the todo's work order names no verified issue, so nothing may be"
                                         " written to a forge")
    assert snapshot(db_path) == before and github.writes() == []


def test_a_todo_without_a_work_order_or_a_connection_may_not_ask_for_outputs(world, alice, github):
    endpoint = world.endpoint(alice, ["build"], verbs=["all"])
    pushed = world.push(alice, endpoint, "build")
    lease = world.claim(endpoint)["lease_token"]
    refused = world.act(endpoint, pushed["id"], "complete", lease_token=lease,
                        outputs=[{"type": "comment", "body": "hi"}])
    assert refused.status_code == 400 and "names no verified issue" in refused.json()["message"]
    # Outputs are fenced by the lease: without it, a conflict, as for a heartbeat.
    stale = world.act(endpoint, pushed["id"], "outputs", lease_token="stale",
                      outputs=[{"type": "comment", "body": "hi"}])
    assert stale.status_code == 409


def test_a_forge_that_answers_500_twice_then_succeeds_gets_one_label(scene, github, clock):
    github.plan = [500, 500]
    todo_id, lease = _claimed(scene, 60)
    assert scene.act(todo_id, "complete", lease_token=lease,
                     outputs=[{"type": "add_labels", "labels": ["size/S"]}]).status_code == 200
    pending = scene.tried(todo_id, 1)
    assert pending["state"] == "pending" and pending["error"] == "HTTP 500: Internal Server Error"
    clock.advance(30)
    scene.wake()
    scene.tried(todo_id, 2)
    clock.advance(30)
    scene.wake()
    [sent] = scene.settled(todo_id)
    assert len(label_posts(github, 60)) == 3
    assert sent["state"] == "sent" and sent["attempts"] == 3
    assert github.labels(REPO, 60) == ["size/S"]


def test_a_lost_answer_followed_by_a_retry_posts_one_comment(scene, github, clock):
    github.plan = ["lose"]
    todo_id, lease = _claimed(scene, 61)
    assert scene.act(todo_id, "complete", lease_token=lease,
                     outputs=[{"type": "comment", "body": "Fixed in abc123, thanks @alice and a@b.example"}]
                     ).status_code == 200
    assert "RemoteProtocolError" in scene.tried(todo_id, 1)["error"]
    assert len(github.comments(REPO, 61)) == 1
    clock.advance(30)
    scene.wake()
    [sent] = scene.settled(todo_id)
    [comment] = github.comments(REPO, 61)
    assert sent["state"] == "sent" and sent["attempts"] == 2
    assert comment["body"] == (f"Fixed in abc123, thanks @{WORD_JOINER}alice and a@b.example\n\n"
                               f"<!-- switchboard:{sent['id']} -->")
    posts = [r for r in github.requests if r["method"] == "POST"]
    looks = [r for r in github.requests if r["method"] == "GET" and r["path"].startswith(f"/repos/{REPO}/issues/61/")]
    assert len(posts) == 1 and len(looks) == 1 and "since=" in looks[0]["path"]


def test_a_redirect_is_not_followed_and_the_token_reaches_no_other_host(scene, github):
    elsewhere = FakeForge("github", "other")
    try:
        github.plan = [f"redirect:{elsewhere.url}/repos/{REPO}/issues/62/labels"]
        todo_id, lease = _claimed(scene, 62)
        scene.act(todo_id, "complete", lease_token=lease, outputs=[{"type": "add_labels", "labels": ["size/S"]}])
        [failed] = scene.settled(todo_id)
        assert failed["state"] == "failed" and "redirect, which is not followed" in failed["error"]
        time.sleep(0.2)
        assert elsewhere.requests == []
    finally:
        elsewhere.stop()


def test_401_403_404_and_422_fail_at_once_with_the_forges_message(scene, github):
    for number, status, message in ((63, 401, "Bad credentials"), (64, 403, "error"), (65, 404, "Not Found"),
                                    (66, 422, "Validation Failed")):
        github.plan = [status]
        todo_id, lease = _claimed(scene, number)
        scene.act(todo_id, "complete", lease_token=lease, outputs=[{"type": "add_labels", "labels": ["size/S"]}])
        [failed] = scene.settled(todo_id)
        assert (failed["state"], failed["error"], failed["attempts"]) == ("failed", f"HTTP {status}: {message}", 1)


def test_a_rate_limit_waits_for_the_forges_reset_time(scene, github, clock):
    reset = clock.now_ms() // 1000 + 120
    github.plan = [lambda request: (403, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(reset)},
                                    {"message": "API rate limit exceeded"})]
    todo_id, lease = _claimed(scene, 67)
    scene.act(todo_id, "complete", lease_token=lease, outputs=[{"type": "add_labels", "labels": ["size/S"]}])
    assert "rate limited" in scene.tried(todo_id, 1)["error"]
    clock.advance(60)
    scene.wake()
    time.sleep(0.3)
    assert len(label_posts(github, 67)) == 1, "asked again before the reset"
    clock.advance(61)
    scene.wake()
    assert scene.settled(todo_id)[0]["state"] == "sent" and len(label_posts(github, 67)) == 2


def test_a_network_error_is_retried_and_given_up_on_at_last(scene, github, clock):
    github.plan = [502] * OUTPUT_MAX_ATTEMPTS
    todo_id, lease = _claimed(scene, 68)
    scene.act(todo_id, "complete", lease_token=lease, outputs=[{"type": "add_labels", "labels": ["size/S"]}])
    for tries in range(1, OUTPUT_MAX_ATTEMPTS):
        scene.tried(todo_id, tries)
        clock.advance(15 * 60)
        scene.wake()
    [failed] = scene.settled(todo_id)
    assert len(label_posts(github, 68)) == OUTPUT_MAX_ATTEMPTS
    assert failed["state"] == "failed"
    assert failed["error"] == f"gave up after {OUTPUT_MAX_ATTEMPTS} attempts: HTTP 502: Bad Gateway"


def test_outputs_reach_an_issue_in_the_order_they_were_accepted(scene, github, clock):
    github.plan = [500]
    todo_id, lease = _claimed(scene, 69)
    scene.act(todo_id, "outputs", lease_token=lease, outputs=[{"type": "comment", "body": "first"}])
    scene.act(todo_id, "complete", lease_token=lease, outputs=[{"type": "add_labels", "labels": ["size/S"]},
                                                               {"type": "comment", "body": "second"}])
    scene.tried(todo_id, 1)
    time.sleep(0.3)
    assert len(github.writes()) == 1, "a later output went before the first was sent"
    clock.advance(30)
    scene.wake()
    scene.settled(todo_id)
    writes = [(r["method"], (r["json"].get("body") or "").split("\n")[0] or r["json"].get("labels"))
              for r in github.writes()]
    assert writes == [("POST", "first"), ("POST", "first"), ("POST", ["size/S"]), ("POST", "second")]


def test_gitea_takes_its_token_header_and_removes_labels_by_id(world, alice, db_path):
    gitea = FakeForge("gitea", GITEA_TOKEN, BOT)
    try:
        scene = Scene(world, alice, gitea, policy={"add_labels": {"allow": ["size/*"], "max": 3},
                                                   "remove_labels": {"allow": ["size/*", "triage"], "max": 3}})
        todo_id, lease = _claimed(scene, 70)
        gitea.labels(REPO, 70).append("triage")
        scene.act(todo_id, "complete", lease_token=lease, outputs=[{"type": "remove_labels", "labels": ["triage"]},
                                                                   {"type": "add_labels", "labels": ["size/M"]}])
        assert [o["state"] for o in scene.settled(todo_id)] == ["sent", "sent"]
        assert gitea.labels(REPO, 70) == ["size/M"]
        assert {r["headers"]["authorization"] for r in gitea.requests} == {f"token {GITEA_TOKEN}"}
        assert [(r["method"], r["path"]) for r in gitea.writes()] == [
            ("DELETE", f"/api/v1/repos/{REPO}/issues/70/labels/{gitea.label_ids['triage']}"),
            ("POST", f"/api/v1/repos/{REPO}/issues/70/labels")]
    finally:
        gitea.stop()


def test_removing_a_connection_fails_its_unsent_outputs(scene, github, clock):
    github.plan = [500]
    todo_id, lease = _claimed(scene, 71)
    scene.act(todo_id, "complete", lease_token=lease, outputs=[{"type": "add_labels", "labels": ["size/S"]}])
    scene.tried(todo_id, 1)
    removed = scene.call("DELETE", f"/connections/{scene.connection['id']}")
    assert removed.status_code == 200 and removed.json()["removed"] is True
    assert removed.json()["webhooks"] == [scene.hook["id"]]
    [failed] = scene.todo(todo_id)["outputs"]
    assert (failed["state"], failed["error"]) == ("failed", "the forge connection was removed")
    assert scene.call("GET", f"/webhooks/{scene.hook['id']}/connection").status_code == 404


# -- the status comment and no echo ------------------------------------------------------------------------------

def _status(github: FakeForge, number: int) -> list[dict]:
    return [c for c in github.comments(REPO, number) if "<!-- switchboard:status -->" in c["body"]]


def test_the_status_comment_follows_claim_needs_input_and_done_in_one_comment(world, alice, github, clock):
    scene = Scene(world, alice, github, mirror=True)
    todo_id = scene.open_issue(80)
    first = github.wait_for(lambda: _status(github, 80), what="the status comment")[0]
    assert "**triage**: waiting for a worker" in first["body"]
    lease = scene.claim(todo_id, claimant="qwen <img src=x> @maintainers")
    clock.advance(STATUS_EDIT_MS / 1000 + 1)
    scene.wake()
    github.wait_for(lambda: _status(github, 80)[0]["edits"] == 1, what="the claim's edit")
    claimed = _status(github, 80)[0]["body"]
    # The worker is named by its endpoint's name, escaped; the claimant it sent (by default its host) is not shown.
    assert re.search(r"\*\*triage\*\*: being worked on by ep\\-2\\-[0-9a-f]{6} since ", claimed), claimed
    assert "qwen" not in claimed

    # Two changes within 10 s of the last edit: one edit, no sooner than 10 s after the last.
    assert scene.act(todo_id, "needs-input", lease_token=lease, question="Which README?\n[click](http://evil)"
                     ).status_code == 200
    time.sleep(0.3)
    assert _status(github, 80)[0]["edits"] == 1, "edited again within 10 s"
    clock.advance(STATUS_EDIT_MS / 1000 + 1)
    scene.wake()
    github.wait_for(lambda: _status(github, 80)[0]["edits"] == 2, what="the question's edit")
    asked = _status(github, 80)[0]["body"]
    assert "**triage**: waiting for an answer to its question:\n  > Which README\\?\n  > \\[click\\]\\(http\\:\\/\\/evil\\)" in asked
    assert scene.call("POST", f"/todos/{todo_id}/answer", answer="the top one").status_code == 200
    lease = scene.claim(todo_id)
    assert scene.act(todo_id, "complete", lease_token=lease, summary="fixed the typo").status_code == 200
    clock.advance(STATUS_EDIT_MS / 1000 + 1)
    scene.wake()
    github.wait_for(lambda: "**triage**: done" in _status(github, 80)[0]["body"], what="the done edit")
    [status] = _status(github, 80)
    assert status["edits"] == 3 and "  > fixed the typo" in status["body"]
    assert [r["method"] for r in github.writes()] == ["POST", "PATCH", "PATCH", "PATCH"]
    # The forge's comment events, the bot's own, mint nothing.
    echoes = scene.flush()
    assert echoes and all(e["disposition"] == "dropped" and e["todos"] == [] for e in echoes)
    event = scene.call("GET", f"/events/{echoes[0]['event_id']}").json()
    assert event["trace"]["stage"] == "own_output" and event["trace"]["cause"] == "own_output"


def test_a_dead_letter_shows_on_the_status_comment(world, alice, github, clock):
    scene = Scene(world, alice, github, mirror=True)
    todo_id = scene.open_issue(81)
    github.wait_for(lambda: _status(github, 81), what="the status comment")
    lease = scene.claim(todo_id)
    scene.act(todo_id, "fail", lease_token=lease, error="the model is gone", retry=False)
    clock.advance(STATUS_EDIT_MS / 1000 + 1)
    scene.wake()
    github.wait_for(lambda: "it waits for a person to decide what next" in _status(github, 81)[0]["body"],
                    what="the dead letter")
    assert "  > the model is gone" in _status(github, 81)[0]["body"]


def test_a_comment_by_anyone_else_is_no_echo(scene, github):
    scene.forge.issue(REPO, 90)
    raw, headers = producers.github("issue_comment.created", "", {
        "issue": {"number": 90}, "repository": {"full_name": REPO}, "sender": {"login": "Codertocat"},
        "comment": {"user": {"login": "Codertocat"}}})
    answer = scene.deliver(raw, headers)
    event = scene.call("GET", f"/events/{answer['event_id']}").json()
    assert answer["disposition"] == "dropped" and event["trace"]["stage"] == "default"


def test_over_mcp_the_verbs_take_outputs_and_get_todo_shows_them(scene, github):
    """The MCP tools' schemas are the REST models: `outputs` beside complete's other fields, and get_todo's answer
    lists the outputs with their states."""
    todo_id, lease = _claimed(scene, 95)

    def rpc(method: str, params: dict, session: str | None = None) -> dict:
        headers = {**scene.endpoint.auth, "Accept": "application/json, text/event-stream"}
        if session:
            headers["Mcp-Session-Id"] = session
        answer = scene.client.post("/mcp", headers=headers, json={"jsonrpc": "2.0", "id": 1, "method": method,
                                                                   "params": params})
        assert answer.status_code == 200, answer.text
        return answer

    opened = rpc("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                "clientInfo": {"name": "test", "version": "1"}})
    session = opened.headers["mcp-session-id"]
    tools = {t["name"]: t for t in rpc("tools/list", {}, session).json()["result"]["tools"]}
    for verb in ("complete", "fail", "needs_input", "block"):
        assert "outputs" in tools[verb]["inputSchema"]["properties"], verb
    refused = rpc("tools/call", {"name": "complete", "arguments": {
        "id": todo_id, "lease_token": lease, "outputs": [{"type": "add_labels", "labels": ["wontfix"]}]}},
        session).json()["result"]
    assert refused["isError"] and refused["structuredContent"]["message"].startswith("outputs[0]: label 'wontfix'")
    done = rpc("tools/call", {"name": "complete", "arguments": {
        "id": todo_id, "lease_token": lease, "outputs": [{"type": "add_labels", "labels": ["size/M"]}]}},
        session).json()["result"]
    assert not done["isError"] and done["structuredContent"]["outputs"][0]["labels"] == ["size/M"]
    scene.settled(todo_id)
    shown = rpc("tools/call", {"name": "get_todo", "arguments": {"id": todo_id}}, session).json()["result"]
    assert [(o["type"], o["state"]) for o in shown["structuredContent"]["outputs"]] == [("add_labels", "sent")]
