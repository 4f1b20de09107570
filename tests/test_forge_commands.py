"""The forge steers the work (issue 44, SPEC 17): a commander's `/answer`, `/approve`, `/changes`, `/retry`,
`/resume`, `/cancel`, `/defer` and `/undefer` comments act on the issue's todo as the Board's buttons do, and each
command gets a reaction on its comment through the outbox; a commander closing the issue cancels its work; a trusted
pull request that says "Fixes #N" links to the issue, and its merge by a commander approves the issue's work in
review.

The app runs in-process with its background loops on (the forge sender must run) on a clock the test moves by hand.
GitHub and Gitea are played by tests/forges.py, which records every request and keeps each comment's reactions; the
deliveries a person's acts would make (a comment, a close, a pull request opened, merged or reviewed) are built from
the forges' own payload shapes (tests/fixtures) and signed with the webhook's secret, as the forge signs them."""

from __future__ import annotations

import datetime
import json
import logging
import time
import urllib.parse
import uuid

import producers
import pytest
from conftest import ManualClock, cli
from forges import REPO, RULES, FakeForge, Scene

from switchboard.app import create_app
from switchboard.models import SubjectAnswer, WebhookConnectionAnswer
from switchboard.store.outputs import STATUS_EDIT_MS

TOKEN = "ghp_" + "C0mmandT0k" * 4
GITEA_TOKEN = "fedcba9876543210" * 2 + "76543210"
BOT = "switchboard-bot"
COMMANDER = "alice-gh"
STRANGER = "mallory"
WORK_ITEM = {"schema": "switchboard.work_item.v1", "objective": "Fix the spelling in the README",
             "definition_of_done": ["the README says 'receive'"], "approval_gates": ["review"]}


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(time.time_ns() // 1_000_000)


@pytest.fixture
def app(db_path, clock):
    return create_app(db_path, clock=clock, background=True, notify_allow_private=True)


@pytest.fixture(params=["github", "gitea"])
def forge(request):
    made = FakeForge(request.param, TOKEN if request.param == "github" else GITEA_TOKEN, BOT)
    yield made
    made.stop()


@pytest.fixture
def github():
    made = FakeForge("github", TOKEN, BOT)
    yield made
    made.stop()


def commanded(world, human, forge: FakeForge, mirror: bool = True, **commands) -> Scene:
    return Scene(world, human, forge, mirror=mirror, commands={"logins": [COMMANDER], **commands})


def issue_body(item: dict | None) -> str:
    return "The README says 'recieve'.\n" + (f"\n```switchboard\n{json.dumps(item)}\n```\n" if item else "")


def _issue(number: int, forge: FakeForge) -> dict:
    return {"number": number, "title": "Spelling error", "labels": [], "user": {"login": COMMANDER},
            "pull_request": None, "html_url": f"{forge.url}/{REPO}/issues/{number}", "body": issue_body(WORK_ITEM)}


def post(scene: Scene, event: str, patch: dict, gitea_event: str | None = None) -> dict:
    """A delivery the forge would send for `event` (a fixture's name), patched, signed and posted."""
    if scene.forge.kind == "github":
        # GitHub's payload examples have no `issues.closed`: a reopened issue's shape with its action changed.
        raw, headers = producers.github({"issues.closed": "issues.reopened"}.get(event, event), "", patch)
    else:
        fixture = {"issue_comment.created": "issue_comment.created", "issues.opened": "issues.opened",
                   "issues.closed": "issues.closed"}.get(event, "pull_request.review_requested")
        raw, headers = producers.gitea(fixture, "", patch, delivery=str(uuid.uuid4()))
        if gitea_event:
            headers = {**headers, **{f"X-{name}-Event": gitea_event for name in ("Gitea", "GitHub", "Gogs")}}
    return scene.deliver(raw, headers)


def open_issue(scene: Scene, number: int, item: dict | None = WORK_ITEM) -> str:
    """The issue on the forge, with a work item in its body, and its `issues.opened`: the triage todo's id."""
    scene.forge.issue(REPO, number, title="Spelling error", author=COMMANDER, body=issue_body(item))
    patch = {"issue": {**_issue(number, scene.forge), "body": issue_body(item)}, "repository": {"full_name": REPO},
             "sender": {"login": COMMANDER}, "action": "opened"}
    opened = post(scene, "issues.opened", patch)
    assert opened["disposition"] == "routed", opened
    return opened["todos"][0]["id"]


def comment(scene: Scene, number: int, login: str, body: str, action: str = "created",
            comment_id: int | None = None) -> tuple[dict, int]:
    """`login` comments on the issue (or edits comment `comment_id`): the forge keeps it and sends the delivery."""
    forge = scene.forge
    if comment_id is None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        comment_id = next(forge.comment_ids)
        forge.issues[(REPO, number)]["comments"].append({"id": comment_id, "body": body, "user": login,
                                                         "created_at": stamp, "updated_at": stamp, "edits": 0})
    patch = {"action": action, "issue": _issue(number, forge), "repository": {"full_name": REPO},
             "sender": {"login": login},
             "comment": {"id": comment_id, "body": body, "user": {"login": login},
                         "html_url": f"{forge.url}/{REPO}/issues/{number}#issuecomment-{comment_id}"}}
    return post(scene, "issue_comment.created", patch), comment_id


def pull_request(scene: Scene, number: int, action: str, author: str, sender: str, body: str,
                 merged_by: str | None = None) -> dict:
    merged = {"merged": merged_by is not None, "merged_by": {"login": merged_by} if merged_by else None}
    patch = {"action": action, "number": number, "repository": {"full_name": REPO}, "sender": {"login": sender},
             "pull_request": {"number": number, "title": "Fix the spelling", "body": body,
                              "user": {"login": author}, "state": "closed" if action == "closed" else "open",
                              "html_url": f"{scene.forge.url}/{REPO}/pull/{number}", **merged}}
    if scene.forge.kind == "gitea":
        return post(scene, "pull_request", patch, gitea_event="pull_request")
    return post(scene, "pull_request.opened", patch)


def changes_requested(scene: Scene, number: int, reviewer: str, text: str) -> dict:
    pull = {"number": number, "title": "Fix the spelling", "user": {"login": COMMANDER}}
    if scene.forge.kind == "github":
        return post(scene, "pull_request_review.submitted", {
            "action": "submitted", "repository": {"full_name": REPO}, "sender": {"login": reviewer},
            "pull_request": pull, "review": {"state": "changes_requested", "body": text,
                                             "user": {"login": reviewer}}})
    raw, headers = producers.gitea("pull_request_approved", "", delivery=str(uuid.uuid4()), patch={
        "action": "reviewed", "number": number, "repository": {"full_name": REPO}, "sender": {"login": reviewer},
        "pull_request": pull, "review": {"type": "pull_request_review_rejected", "content": text}})
    headers = {**headers, **{f"X-{name}-Event": "pull_request_rejected" for name in ("Gitea", "GitHub", "Gogs")}}
    return scene.deliver(raw, headers)


def close(scene: Scene, number: int, login: str) -> dict:
    return post(scene, "issues.closed", {"action": "closed", "issue": {**_issue(number, scene.forge), "state": "closed"},
                                         "repository": {"full_name": REPO}, "sender": {"login": login}})


def reactions(forge: FakeForge, number: int, comment_id: int) -> list[str]:
    found = next(c for c in forge.comments(REPO, number) if c["id"] == comment_id)
    return [r["content"] for r in found.get("reactions", [])]


def reaction_posts(forge: FakeForge) -> list[dict]:
    return [r for r in forge.requests if r["method"] == "POST" and r["path"].endswith("/reactions")]


def status(forge: FakeForge, number: int) -> str:
    found = [c for c in forge.comments(REPO, number) if "<!-- switchboard:status -->" in c["body"]]
    return found[0]["body"] if found else ""


def edit_due(scene: Scene, clock: ManualClock) -> None:
    """The status comment's next edit due: once the sender has recorded every send it began (a send recorded after
    the clock moved would set its next edit from the moved clock), the clock moves past the edit interval."""
    sender = scene.world.client.app.state.flows.forge
    scene.forge.wait_for(lambda: not sender.busy, what="the forge sender idle")
    clock.advance(STATUS_EDIT_MS / 1000 + 1)
    scene.wake()


def history(scene: Scene, todo_id: str) -> list[dict]:
    return scene.todo(todo_id)["history"]


def subject(scene: Scene, number: int) -> dict:
    key = f"{scene.forge.kind}:{REPO}#{number}"
    answer = scene.call("GET", f"/subjects/{urllib.parse.quote(key, safe='')}")
    assert answer.status_code == 200, answer.text
    return SubjectAnswer.model_validate(answer.json()).model_dump(mode="json")


def to_lane(scene: Scene, number: int) -> str:
    """Triage sizes the issue S (a label through the outbox), and the label's delivery makes the lane's todo."""
    triage = open_issue(scene, number)
    lease = scene.claim(triage, claimant="triage")
    done = scene.act(triage, "complete", lease_token=lease, summary="sized S",
                     outputs=[{"type": "add_labels", "labels": ["size/S"]}])
    assert done.status_code == 200, done.text
    assert [o["state"] for o in scene.settled(triage)] == ["sent"]  # the forge sent its delivery before answering
    if done.json()["state"] == "review":  # the issue's work item gates every todo about it: the human approves triage
        assert scene.call("POST", f"/todos/{triage}/approve").status_code == 200
    made = [t for answer in scene.flush() for t in answer["todos"] if t["queue"] == "lane-s"]
    assert len(made) == 1, made
    return made[0]["id"]


# -- the seed's loop, steered from the issue -----------------------------------------------------------------------

def test_the_seeds_loop_is_steered_from_the_issue_and_merged_through_its_pull_request(world, alice, forge, clock):
    scene = commanded(world, alice, forge)
    lane = to_lane(scene, 12)
    todo = scene.todo(lane)
    assert todo["work_item"]["objective"] == WORK_ITEM["objective"], todo

    # The worker asks; the status comment shows the question and the reply a commander copies.
    lease = scene.claim(lane, claimant="lane-worker")
    assert scene.act(lane, "needs-input", lease_token=lease, question="Which README?").status_code == 200
    edit_due(scene, clock)
    forge.wait_for(lambda: "waiting for an answer" in status(forge, 12), what="the question on the status comment")
    assert "reply `/answer …`" in status(forge, 12), status(forge, 12)

    answered, comment_id = comment(scene, 12, COMMANDER, "/answer the top-level one,\nnot docs/README")
    assert answered["disposition"] == "command" and answered["todos"] == [], answered
    assert answered["command"] == {"verb": "answer", "todo_ids": [lane], "result": "acted", "login": COMMANDER}
    assert scene.todo(lane)["state"] == "pending"
    step = history(scene, lane)[-1]
    assert (step["from"], step["to"], step["actor"]) == ("needs_input", "pending", f"human:{alice.id}"), step
    assert step["evidence"]["answer"] == "the top-level one,\nnot docs/README"
    assert step["evidence"]["via"] == "forge" and step["evidence"]["login"] == COMMANDER
    assert step["evidence"]["event_id"] == answered["event_id"]
    assert step["evidence"]["comment_url"].endswith(f"#issuecomment-{comment_id}")
    forge.wait_for(lambda: reactions(forge, 12, comment_id) == ["+1"], what="the +1 on the command")
    forge.wait_for(lambda: [e["reaction"] for e in subject(scene, 12)["timeline"] if e.get("reaction")] == [
        {"content": "+1", "state": "sent"}], what="the reaction recorded as sent")
    assert [r["json"] for r in reaction_posts(forge)] == [{"content": "+1"}]
    assert reaction_posts(forge)[0]["path"] == f"{forge.prefix}/repos/{REPO}/issues/comments/{comment_id}/reactions"

    # The next claim sees the answer; the work completes into review (the work item's gate).
    claimed = scene.client.post(f"/api/v1/todos/{lane}/claim", headers=scene.endpoint.auth, json={})
    assert claimed.status_code == 200 and claimed.json()["todo"]["answer"] == "the top-level one,\nnot docs/README"
    done = scene.act(lane, "complete", lease_token=claimed.json()["lease_token"], summary="fixed in PR 13")
    assert done.status_code == 200 and done.json()["state"] == "review", done.text
    edit_due(scene, clock)
    forge.wait_for(lambda: "waiting for review" in status(forge, 12), what="the review on the status comment")
    assert "reply `/approve` or `/changes …`" in status(forge, 12)

    # A trusted actor's pull request says it fixes the issue: linked, and the status comment names it.
    opened = pull_request(scene, 13, "opened", author=COMMANDER, sender=COMMANDER, body="Fixes #12, I hope")
    assert opened["disposition"] != "command", opened
    assert [link["kind"] for link in subject(scene, 12)["links"]] == ["closed_by"]
    assert subject(scene, 12)["links"][0]["key"] == f"{forge.kind}:{REPO}#13"
    assert subject(scene, 13)["links"][0] == {**subject(scene, 13)["links"][0], "key": f"{forge.kind}:{REPO}#12",
                                              "kind": "closes"}
    edit_due(scene, clock)
    forge.wait_for(lambda: "pull request #13 closes this issue" in status(forge, 12), what="the pull request named")

    # A commander merges it: the work is approved through the merge.
    pull_request(scene, 13, "closed", author=COMMANDER, sender=COMMANDER, body="Fixes #12, I hope",
                 merged_by=COMMANDER)
    final = scene.todo(lane)
    assert (final["state"], final["outcome"]) == ("done", "approved"), final
    approved = final["history"][-1]
    assert approved["evidence"]["via"] == "forge" and approved["evidence"]["merged"] == f"{forge.kind}:{REPO}#13"
    assert approved["evidence"]["login"] == COMMANDER and approved["actor"] == f"human:{alice.id}"

    # The subject tells all of it, in order.
    story = subject(scene, 12)["timeline"]
    steps = [(e["type"], e.get("to") or e.get("kind") or e.get("disposition")) for e in story
             if e["type"] in ("transition", "link") and e.get("todo_id", lane) == lane]
    assert steps == [("transition", "pending"), ("transition", "claimed"), ("transition", "needs_input"),
                     ("transition", "pending"), ("transition", "claimed"), ("transition", "review"),
                     ("link", "closed_by"), ("transition", "done")], steps
    commands = [e for e in story if e["type"] == "delivery" and e.get("command")]
    assert [(c["disposition"], c["command"]["verb"], c["command"]["result"], c["reaction"]) for c in commands] == [
        ("command", "answer", "acted", {"content": "+1", "state": "sent"})]


# -- what changes nothing ---------------------------------------------------------------------------------------------

def test_a_strangers_command_is_an_ordinary_comment_and_gets_no_reaction(world, alice, forge, clock):
    scene = commanded(world, alice, forge)
    lane = to_lane(scene, 20)
    lease = scene.claim(lane)
    assert scene.act(lane, "needs-input", lease_token=lease, question="Which disk?").status_code == 200
    answer, _ = comment(scene, 20, STRANGER, "/answer the wrong one")
    assert answer["disposition"] == "dropped" and "command" not in answer, answer
    assert scene.todo(lane)["state"] == "needs_input"
    # The same words from a commander in an edited comment are no second command either.
    edited, _ = comment(scene, 20, COMMANDER, "/answer sdb", action="edited", comment_id=999)
    assert edited["disposition"] == "dropped" and scene.todo(lane)["state"] == "needs_input", edited
    scene.wake()
    time.sleep(0.3)
    assert reaction_posts(forge) == []


def test_a_redelivered_command_acts_once_and_is_acknowledged_once(world, alice, github, clock):
    scene = commanded(world, alice, github)
    lane = to_lane(scene, 21)
    lease = scene.claim(lane)
    assert scene.act(lane, "needs-input", lease_token=lease, question="Which disk?").status_code == 200
    github.issues[(REPO, 21)]["comments"].append({"id": 4242, "body": "/answer sdb", "user": COMMANDER,
                                                   "created_at": "", "updated_at": "", "edits": 0})
    raw, headers = producers.github("issue_comment.created", "", {
        "action": "created", "issue": _issue(21, github), "repository": {"full_name": REPO},
        "sender": {"login": COMMANDER}, "comment": {"id": 4242, "body": "/answer sdb", "user": {"login": COMMANDER}}})
    first, again = scene.deliver(raw, headers), scene.deliver(raw, headers)
    assert first["command"]["result"] == "acted" and again.get("duplicate") is True, (first, again)
    assert [h["to"] for h in history(scene, lane)].count("pending") == 2  # made, then answered once
    github.wait_for(lambda: reactions(github, 21, 4242) == ["+1"], what="the reaction")
    time.sleep(0.3)
    assert len(reaction_posts(github)) == 1


def test_an_ambiguous_command_is_refused_until_it_names_a_todo(world, alice, github, clock):
    scene = commanded(world, alice, github)
    first = to_lane(scene, 22)
    lease = scene.claim(first)
    assert scene.act(first, "needs-input", lease_token=lease, question="Which disk?").status_code == 200
    second = _second_waiting_todo(scene, 22)
    refused, comment_id = comment(scene, 22, COMMANDER, "/answer sdb")
    assert refused["command"]["result"] == "refused" and "name one" in refused["command"]["reason"], refused
    assert sorted(refused["command"]["todo_ids"]) == sorted([first, second])
    assert {scene.todo(first)["state"], scene.todo(second)["state"]} == {"needs_input"}
    github.wait_for(lambda: reactions(github, 22, comment_id) == ["confused"], what="the confused reaction")
    named, named_id = comment(scene, 22, COMMANDER, f"/answer {second} sdb")
    assert named["command"] == {"verb": "answer", "todo_ids": [second], "result": "acted", "login": COMMANDER}
    assert scene.todo(second)["state"] == "pending" and scene.todo(first)["state"] == "needs_input"
    assert history(scene, second)[-1]["evidence"]["answer"] == "sdb"
    github.wait_for(lambda: reactions(github, 22, named_id) == ["+1"], what="the +1")


def _second_waiting_todo(scene: Scene, number: int) -> str:
    """Another lane's todo about the same issue, from the same webhook, waiting for an answer."""
    again = {"id": "again", "expr": ".kind == \"issue_comment\" and (.payload.comment.body | startswith(\"again\"))",
             "action": {"queue": "triage"}}
    assert scene.call("PUT", f"/webhooks/{scene.hook['id']}/rules", rules=[again, *RULES["rules"]],
                      default_action=RULES["default_action"]).status_code == 200
    made, _ = comment(scene, number, STRANGER, "again, please")
    [todo] = made["todos"]
    lease = scene.claim(todo["id"])
    assert scene.act(todo["id"], "needs-input", lease_token=lease, question="Which one?").status_code == 200
    return todo["id"]


def test_a_command_with_nothing_to_act_on_is_refused_and_changes_nothing(world, alice, github, clock):
    scene = commanded(world, alice, github)
    lane = to_lane(scene, 23)
    before = scene.todo(lane)
    refused, comment_id = comment(scene, 23, COMMANDER, "/retry please")
    assert refused["command"]["result"] == "refused", refused
    assert refused["command"]["reason"] == "nothing about this issue waits for /retry"
    assert scene.todo(lane)["history"] == before["history"]
    github.wait_for(lambda: reactions(github, 23, comment_id) == ["confused"], what="the confused reaction")
    cancel, cancel_id = comment(scene, 23, COMMANDER, "/cancel")
    assert cancel["command"]["result"] == "refused" and "reason" in cancel["command"]["reason"], cancel
    assert scene.todo(lane)["state"] == "pending"


def test_a_command_never_crosses_humans(world, alice, github, clock):
    """Bob's webhook on the same repository has no commanders; Alice's commander's `/approve` on the issue reaches
    Alice's webhook (which has nothing in review) and Bob's (where it is an ordinary comment): Bob's todo stays."""
    bob = world.human("bob")
    alices = commanded(world, alice, github)
    bobs = Scene(world, bob, github, mirror=False)
    to_lane(alices, 24)
    bob_lane = open_issue(bobs, 24)
    lease = bobs.claim(bob_lane)
    assert bobs.act(bob_lane, "complete", lease_token=lease, summary="done").status_code == 200
    assert bobs.todo(bob_lane)["state"] == "review"
    refused, _ = comment(alices, 24, COMMANDER, "/approve")
    assert refused["command"]["result"] == "refused", refused
    ordinary, _ = comment(bobs, 24, COMMANDER, "/approve")
    assert ordinary["disposition"] != "command" and bobs.todo(bob_lane)["state"] == "review", ordinary


def test_closing_and_merging_by_anyone_but_a_commander_moves_nothing(world, alice, github, clock):
    scene = commanded(world, alice, github)
    lane = to_lane(scene, 25)
    lease = scene.claim(lane)
    assert scene.act(lane, "complete", lease_token=lease, summary="fixed").status_code == 200
    # Another repository's issue 25 is never linked, nor is a pull request by an untrusted author.
    other = pull_request(scene, 30, "opened", author=COMMANDER, sender=COMMANDER, body="Fixes other/repo#25")
    untrusted = pull_request(scene, 31, "opened", author=STRANGER, sender=STRANGER, body="Fixes #25")
    assert subject(scene, 25)["links"] == [], (other, untrusted)
    pull_request(scene, 32, "opened", author=COMMANDER, sender=COMMANDER, body="closes #25")
    pull_request(scene, 32, "closed", author=COMMANDER, sender=STRANGER, body="closes #25", merged_by=STRANGER)
    assert scene.todo(lane)["state"] == "review"
    close(scene, 25, STRANGER)
    assert scene.todo(lane)["state"] == "review"
    # Changes requested by a commander on the linked pull request send the work back with the review's text.
    asked = changes_requested(scene, 32, COMMANDER, "Also fix the second typo")
    assert asked["disposition"] != "command", asked
    assert scene.todo(lane)["state"] == "pending"
    step = history(scene, lane)[-1]
    assert step["evidence"]["note"] == "Also fix the second typo" and step["evidence"]["review"].endswith("#32")
    # A commander's close cancels what is left.
    closed = close(scene, 25, COMMANDER)
    assert scene.todo(lane)["state"] == "cancelled", closed
    assert scene.todo(lane)["state_reason"] == f"closed on the forge by {COMMANDER}"


def test_on_close_keep_leaves_the_work(world, alice, github, clock):
    scene = commanded(world, alice, github, on_close="keep")
    lane = to_lane(scene, 26)
    close(scene, 26, COMMANDER)
    assert scene.todo(lane)["state"] == "pending"


def test_gitea_requested_changes_and_the_defer_duration(world, alice, clock):
    gitea = FakeForge("gitea", GITEA_TOKEN, BOT)
    try:
        scene = commanded(world, alice, gitea)
        lane = to_lane(scene, 27)
        deferred, comment_id = comment(scene, 27, COMMANDER, "/defer 2h waiting for the new disk")
        assert deferred["command"]["result"] == "acted", deferred
        todo = scene.todo(lane)
        assert todo["state"] == "deferred" and todo["state_reason"] == "waiting for the new disk"
        assert todo["deferred_until"].startswith(datetime.datetime.fromtimestamp(
            clock.now_ms() / 1000 + 7200, datetime.UTC).strftime("%Y-%m-%dT%H:%M"))
        gitea.wait_for(lambda: reactions(gitea, 27, comment_id) == ["+1"], what="the +1 on Gitea")
        assert reaction_posts(gitea)[0]["path"] == f"/api/v1/repos/{REPO}/issues/comments/{comment_id}/reactions"
        assert comment(scene, 27, COMMANDER, "/undefer")[0]["command"]["result"] == "acted"
        assert scene.todo(lane)["state"] == "pending"
    finally:
        gitea.stop()


def test_a_reaction_the_forge_fails_twice_is_sent_once(world, alice, github, clock, caplog):
    scene = commanded(world, alice, github, mirror=False)  # the forge's two 500s are the reaction's alone
    lane = to_lane(scene, 28)
    github.plan = [500, 500]
    caplog.set_level(logging.INFO)
    cancelled, comment_id = comment(scene, 28, COMMANDER, "/cancel a duplicate of #7")
    assert cancelled["command"]["result"] == "acted" and scene.todo(lane)["state"] == "cancelled"
    sender, busy = world.client.app.state.flows.forge, f"reaction:{cancelled['event_id']}"

    def recorded(tries: int) -> bool:
        """The try is over and its failure recorded (its retry time set from the clock): only then may the clock
        move, or the retry would be set from the moved clock and not come due."""
        row = world.db.read_sync(lambda txn: txn.one("SELECT attempts, error FROM forge_reactions WHERE event_id = ?",
                                                     (cancelled["event_id"],)))
        return row["attempts"] == tries and row["error"] is not None and busy not in sender.busy

    for tries in (1, 2):
        github.wait_for(lambda tries=tries: recorded(tries), what=f"try {tries} recorded")
        clock.advance(60)
        scene.wake()
    github.wait_for(lambda: reactions(github, 28, comment_id) == ["+1"], what="the reaction after two 500s")
    time.sleep(0.3)
    assert len(reaction_posts(github)) == 3 and reactions(github, 28, comment_id) == ["+1"]
    everything = caplog.text + json.dumps(scene.call("GET", f"/webhooks/{scene.hook['id']}/connection").json())
    assert TOKEN not in everything


# -- setting the commanders -------------------------------------------------------------------------------------

def test_the_connection_names_its_commanders_and_refuses_a_login_that_is_none(world, alice, github):
    scene = Scene(world, alice, github)
    shown = WebhookConnectionAnswer.model_validate(scene.call("GET", f"/webhooks/{scene.hook['id']}/connection").json())
    assert shown.commands == {"logins": [], "on_close": "cancel"}
    bad = scene.call("PUT", f"/webhooks/{scene.hook['id']}/connection", connection_id=scene.connection["id"],
                     commands={"logins": ["ok", "no spaces allowed"]})
    assert bad.status_code == 400 and "commands.logins" in bad.text, bad.text
    assert scene.call("GET", f"/webhooks/{scene.hook['id']}/connection").json()["commands"]["logins"] == []


def test_the_cli_sets_commanders_and_what_closing_does(world, alice, github, db_path):
    scene = Scene(world, alice, github)
    code, answer = cli(db_path, "webhook", "connect", scene.hook["id"], scene.connection["id"], "--mirror",
                       "--commanders", f"{COMMANDER}, bob-gh", "--on-close", "keep")
    assert code == 0, answer
    assert answer["commands"] == {"logins": [COMMANDER, "bob-gh"], "on_close": "keep"} and answer["mirror"] is True
    code, answer = cli(db_path, "webhook", "connect", scene.hook["id"], scene.connection["id"], "--on-close", "never")
    assert code == 2, answer


def test_the_servers_own_comment_is_no_command_even_when_its_login_commands(world, alice, github, clock):
    """A human who steers with the connection's own login: their comment is a command, but an output or the status
    comment (which carry the server's marker) never is, whatever it says."""
    scene = Scene(world, alice, github, mirror=False, commands={"logins": [BOT]})
    lane = to_lane(scene, 40)
    lease = scene.claim(lane)
    assert scene.act(lane, "needs-input", lease_token=lease, question="Which disk?").status_code == 200
    echo, _ = comment(scene, 40, BOT, "/answer sdb\n\n<!-- switchboard:out_01234567890123456789 -->")
    assert echo["disposition"] == "dropped" and scene.todo(lane)["state"] == "needs_input", echo
    own, _ = comment(scene, 40, BOT, "/answer sdb")
    assert own["command"]["result"] == "acted" and scene.todo(lane)["state"] == "pending", own


def test_a_command_outside_the_connections_repositories_acts_without_a_reaction(world, alice, github, clock):
    scene = commanded(world, alice, github, mirror=False)
    lane = to_lane(scene, 41)
    elsewhere = scene.call("POST", "/connections", kind="github", api_url=github.api, token=TOKEN, repos=["other/"])
    assert scene.call("PUT", f"/webhooks/{scene.hook['id']}/connection", connection_id=elsewhere.json()["id"],
                      commands={"logins": [COMMANDER]}).status_code == 200
    cancelled, _ = comment(scene, 41, COMMANDER, "/cancel not ours any more")
    assert cancelled["command"]["result"] == "acted" and scene.todo(lane)["state"] == "cancelled", cancelled
    scene.wake()
    time.sleep(0.3)
    assert reaction_posts(github) == []
