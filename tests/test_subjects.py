"""Subjects (SPEC 16, issue 36): one page for one issue across every lane, as the API, the Board and the CLI show it.

The app runs in-process with its background loops on (the forge sender writes the triage todo's label) on a clock
the test moves by hand; tests/forges.py plays GitHub and sends the label event back when the test posts it."""

from __future__ import annotations

import re
import shutil
import time
import urllib.parse
from pathlib import Path

import producers
import pytest
from conftest import ManualClock, cli
from forges import REPO, FakeForge, Scene
from helpers import add_route, count, query
from test_board import ORIGIN, csrf, post, sign_in

from switchboard.app import create_app
from switchboard.database import Database
from switchboard.models import SubjectAnswer, SubjectListAnswer, SubjectListQuery
from switchboard.store.principals import OPERATOR
from switchboard.store.subjects import get_subject, list_subjects
from switchboard.store.upkeep import prune_batch

TOKEN = "ghp_" + "Subj3ctT0ken" * 3
BOT = "switchboard-bot"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


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


def key(number: int) -> str:
    return f"github:{REPO}#{number}"


def subject_of(client, principal, number: int):
    return client.get(f"/api/v1/subjects/{urllib.parse.quote(key(number), safe='')}", headers=principal.auth)


def run_the_loop(scene: Scene, clock: ManualClock, number: int) -> tuple[str, str]:
    """The seed's loop: opened -> triage -> labelled size/S by the triage todo -> labelled delivery -> lane-s todo
    -> done, a second between steps. The triage and lane-s todos' ids."""
    triage = scene.open_issue(number)
    clock.advance(1)
    lease = scene.claim(triage, claimant="triage-worker")
    clock.advance(1)
    assert scene.act(triage, "complete", lease_token=lease, summary="sized S", result={"size": "S"},
                     outputs=[{"type": "add_labels", "labels": ["size/S"]}]).status_code == 200
    scene.settled(triage)
    clock.advance(1)
    [labelled] = scene.flush()
    assert labelled["disposition"] == "routed", labelled
    lane = labelled["todos"][0]["id"]
    clock.advance(1)
    lease = scene.claim(lane, claimant="lane-s-worker")
    clock.advance(1)
    assert scene.act(lane, "complete", lease_token=lease, summary="fixed the typo").status_code == 200
    return triage, lane


def story(subject: dict) -> list[tuple]:
    """The timeline as (type, what) pairs a person reads."""
    queues = {t["id"]: t["queue"] for t in subject["todos"]}
    out = []
    for entry in subject["timeline"]:
        if entry["type"] == "delivery":
            out.append(("delivery", f"{entry['kind']}.{entry['action']}", entry["sender"], entry["rule_id"],
                        [queues[t] for t in entry["todos"]]))
        elif entry["type"] == "transition":
            out.append(("transition", entry["queue"], entry["from"], entry["to"]))
        elif entry["type"] == "output":
            out.append(("output", queues[entry["todo_id"]], entry["output_type"], entry["labels"], entry["state"]))
        else:
            out.append(("receipt", entry["todo_id"]))
    return out


def test_the_seeds_loop_reads_as_one_story_on_one_subject_page(scene, world, alice, client, clock):
    triage, lane = run_the_loop(scene, clock, 7)
    answer = subject_of(client, alice, 7)
    assert answer.status_code == 200, answer.text
    subject = answer.json()
    assert (subject["key"], subject["provider"], subject["repo"], subject["number"]) == (key(7), "github", REPO, 7)
    assert (subject["title"], subject["labels"], subject["state"]) == ("Spelling error", ["size/S"], "done")
    assert subject["url"] == f"{scene.forge.url}/{REPO}/issues/7"
    assert [(t["id"], t["queue"], t["state"]) for t in subject["todos"]] == [(triage, "triage", "done"),
                                                                            (lane, "lane-s", "done")]
    assert story(subject) == [
        ("delivery", "issues.opened", "Codertocat", "triage", ["triage"]),
        ("transition", "triage", None, "pending"),
        ("transition", "triage", "pending", "claimed"),
        ("transition", "triage", "claimed", "done"),
        ("output", "triage", "add_labels", ["size/S"], "sent"),
        ("delivery", "issues.labeled", BOT, "sized-s", ["lane-s"]),
        ("transition", "lane-s", None, "pending"),
        ("transition", "lane-s", "pending", "claimed"),
        ("transition", "lane-s", "claimed", "done")]
    stamps = [entry["at"] for entry in subject["timeline"]]
    assert stamps == sorted(stamps)
    SubjectAnswer.model_validate(subject)  # the OpenAPI document's model is the answer's
    SubjectListAnswer.model_validate(client.get("/api/v1/subjects", headers=alice.auth).json())

    # The Board's subject page tells the same story, in the same order, with the issue's link and its labels.
    sign_in(client, alice)
    page = client.get(f"/board/subjects/{urllib.parse.quote(key(7))}")
    assert page.status_code == 200, page.text
    html = page.text
    assert f'href="{scene.forge.url}/{REPO}/issues/7"' in html and '<span class="label">size/S</span>' in html
    order = [html.index(text) for text in ("issues.opened", "add labels", "issues.labeled", "fixed the typo")]
    assert order == sorted(order)
    # Every todo page links its subject; the subjects list names it.
    todo_page = client.get(f"/board/todos/{lane}").text
    assert f'href="/board/subjects/{urllib.parse.quote(key(7))}"' in todo_page
    listing = client.get("/board/subjects").text
    assert f'href="/board/subjects/{urllib.parse.quote(key(7))}"' in listing and "Spelling error" in listing
    # And the CLI prints it.
    code, shown = cli(world.db.path, "subject", "show", key(7))
    assert code == 0 and story(shown) == story(subject)


def test_a_human_sees_their_own_part_and_an_endpoint_only_its_own_todos(scene, world, alice, client, clock):
    triage, lane = run_the_loop(scene, clock, 8)
    bob = world.human("bob")
    assert subject_of(client, bob, 8).status_code == 404
    assert client.get("/api/v1/subjects", headers=bob.auth).json()["subjects"] == []
    lane_only = world.endpoint(alice, ["lane-s"], verbs=["drain"])
    assert subject_of(client, lane_only, 8).status_code == 404, "another endpoint's todos"
    seen = subject_of(client, scene.endpoint, 8).json()
    assert {t["id"] for t in seen["todos"]} == {triage, lane}
    assert client.get("/api/v1/subjects", headers=scene.endpoint.auth).status_code == 403
    assert client.get(f"/api/v1/subjects/{urllib.parse.quote('github:nobody/none#1', safe='')}",
                      headers=alice.auth).json() == {"error": "not_found", "message": "no subject github:nobody/none#1"}


def test_the_list_filters_by_state_and_text_and_pages_with_a_cursor(scene, world, alice, client, clock):
    waiting = scene.open_issue(20)  # a question: waiting on the human
    scene.act(waiting, "needs-input", lease_token=scene.claim(waiting), question="which one?")
    clock.advance(1)
    scene.open_issue(21)  # pending: open
    clock.advance(1)
    done = scene.open_issue(22)
    scene.act(done, "complete", lease_token=scene.claim(done))
    clock.advance(1)
    raw, headers = producers.github("issues.opened", "", {"issue": {"number": 23, "title": "Another thing",
                                                                    "labels": [], "user": {"login": "Codertocat"}},
                                                          "repository": {"full_name": "acme/docs"}})
    scene.deliver(raw, headers)

    def listed(**params) -> list[str]:
        answer = client.get("/api/v1/subjects", headers=alice.auth, params=params)
        assert answer.status_code == 200, answer.text
        return [s["key"] for s in answer.json()["subjects"]]

    assert listed() == ["github:acme/docs#23", key(22), key(21), key(20)]
    assert listed(state="waiting") == [key(20)]
    assert listed(state="open") == ["github:acme/docs#23", key(21)]
    assert listed(state="done") == [key(22)]
    assert listed(q="ANOTHER") == ["github:acme/docs#23"] and listed(q="site#2") == [key(22), key(21), key(20)]
    assert listed(provider="gitea") == [] and len(listed(provider="github")) == 4
    [line] = client.get("/api/v1/subjects", headers=alice.auth, params={"state": "waiting"}).json()["subjects"]
    assert line == {"key": key(20), "title": "Spelling error", "url": f"{scene.forge.url}/{REPO}/issues/20",
                    "provider": "github", "repo": REPO, "number": 20, "state": "waiting",
                    "last_activity_at": line["last_activity_at"], "open_todos": 1, "queues": ["triage"]}
    pages, cursor = [], None
    while True:
        answer = client.get("/api/v1/subjects", headers=alice.auth,
                            params={"limit": 3, **({"cursor": cursor} if cursor else {})}).json()
        pages.append([s["key"] for s in answer["subjects"]])
        cursor = answer["next_cursor"]
        if cursor is None:
            break
    assert pages == [["github:acme/docs#23", key(22), key(21)], [key(20)]]
    bad = client.get("/api/v1/subjects", headers=alice.auth, params={"cursor": "bm90IGEgY3Vyc29y"})
    assert bad.status_code == 400 and bad.json()["message"] == "cursor: not a cursor this list gave"
    assert client.get("/api/v1/subjects", headers=alice.auth, params={"state": "closed"}).status_code == 400
    code, out = cli(world.db.path, "subject", "list", "--state", "waiting")
    assert code == 0 and [s["key"] for s in out["subjects"]] == [key(20)]


def _counted(db_path: str) -> list[tuple]:
    """Each subject row's counts, and the same counted from the todos."""
    return query(db_path, """
        SELECT s.human_id, s.key, s.open_todos, s.waiting_todos, s.state,
               (SELECT count(*) FROM todos t JOIN endpoints e ON e.id = t.endpoint_id WHERE t.subject_key = s.key
                 AND e.human_id = s.human_id AND t.state NOT IN ('done', 'failed', 'cancelled')),
               (SELECT count(*) FROM todos t JOIN endpoints e ON e.id = t.endpoint_id WHERE t.subject_key = s.key
                 AND e.human_id = s.human_id AND (t.state IN ('quarantined', 'needs_input', 'blocked', 'review')
                 OR (t.state = 'failed' AND t.dead_letter = 1) OR (t.state = 'pending' AND t.queue = 'hold')))
        FROM subjects s ORDER BY s.human_id, s.key""")


def test_each_humans_counts_follow_every_change_and_retention(world, alice, client, clock, db_path):
    """A delivery routed to a friend's endpoint too makes a row for each human, counting only their own todos; the
    counts move with a reroute to another endpoint, a question, a dead letter, and retention's deletes."""
    bob = world.human("bob")
    assert cli(db_path, "friend", "link", "alice", "bob")[0] == 0
    mine = world.endpoint(alice, ["lane-b"], verbs=["all"])
    other = world.endpoint(alice, ["lane-x"], verbs=["all"])
    theirs = world.endpoint(bob, ["lane-b"], verbs=["all"])
    hook = world.webhook(alice, mine, "github", "lane-b")
    for target in (theirs, other):
        assert add_route(client, alice.auth, hook["id"], target.id).status_code == 201
    raw, headers = producers.github("issues.opened", hook["secret"], {"issue": {"number": 30}})
    routed = world.deliver(hook, raw, headers).json()
    assert sorted(t["endpoint_id"] for t in routed["todos"]) == sorted([mine.id, theirs.id])
    subject = "github:Codertocat/Hello-World#30"

    def rows() -> dict:
        return {r[0]: r[2:5] for r in _counted(db_path) if r[1] == subject}

    assert rows() == {alice.id: (1, 0, "open"), bob.id: (1, 0, "open")}
    alices = next(t["id"] for t in routed["todos"] if t["endpoint_id"] == mine.id)
    assert world.act(alice, alices, "reroute", queue="lane-x").json()["endpoint_id"] == other.id
    claim = world.claim(other)
    world.act(other, alices, "needs-input", lease_token=claim["lease_token"], question="which?")
    assert rows() == {alice.id: (1, 1, "waiting"), bob.id: (1, 0, "open")}
    claim = world.claim(theirs)
    world.act(theirs, claim["todo"]["id"], "fail", lease_token=claim["lease_token"], error="x", retry=False)
    assert rows()[bob.id] == (0, 1, "waiting")
    world.act(alice, alices, "cancel", reason="not needed")
    assert rows()[alice.id] == (0, 0, "done")
    for row in _counted(db_path):
        assert row[2:4] == row[5:7], row
    # Retention deletes finished todos: the counts follow (a dead letter no longer waits once it is gone).
    clock.advance(31 * 86400)
    world.db.write_sync(prune_batch)
    assert count(db_path, "todos") == 0
    assert rows() == {alice.id: (0, 0, "done"), bob.id: (0, 0, "done")}


def test_the_queues_page_shows_what_was_done_in_the_last_hour_and_day(world, alice, client, clock):
    """Five todos done 30 h, 20 h, 90 min, 30 min and 0 min before the page is read: 2 in the last hour, 4 in
    the last day."""
    endpoint = world.endpoint(alice, ["build"], verbs=["all"])
    for n in range(5):
        world.push(alice, endpoint, "build", f"job {n}")
    for hours_after in (0, 10, 18.5, 1, 0.5):
        clock.advance(hours_after * 3600)
        claim = world.claim(endpoint)
        assert world.act(endpoint, claim["todo"]["id"], "complete", lease_token=claim["lease_token"]).status_code == 200
    sign_in(client, alice)
    page = client.get("/board/queues").text
    assert re.search(r'<th scope="row">build</th>.*?<td class="done">2 / 4</td>', page, re.S), page


def test_the_board_adds_tests_and_removes_a_connection_and_connects_a_webhook(world, alice, client, github):
    endpoint = world.endpoint(alice, ["triage"])
    hook = world.webhook(alice, endpoint, "github", "triage")
    sign_in(client, alice)
    added = client.post("/board/connections/add", headers=ORIGIN, follow_redirects=False, data={
        "csrf": csrf(client), "kind": "github", "api_url": github.api, "token": TOKEN, "repos": "acme/"})
    assert added.status_code == 303
    page = client.get("/board/connections").text
    assert BOT in page and TOKEN not in page
    connection_id = re.search(r"fc_[0-9a-f]{20}", page).group(0)
    assert post(client, f"/board/connections/{connection_id}/test").status_code == 303
    assert "still says the token is switchboard-bot" in client.get("/board/connections").text
    connected = post(client, f"/board/webhooks/{hook['id']}/connection", connection_id=connection_id, mirror="on",
                     policy='{"comment": {"max": 1, "max_bytes": 100}}')
    assert connected.status_code == 303
    shown = client.get(f"/api/v1/webhooks/{hook['id']}/connection", headers=alice.auth).json()
    assert shown["mirror"] is True and shown["policy"] == {"comment": {"max": 1, "max_bytes": 100}}
    webhook_page = client.get(f"/board/webhooks/{hook['id']}").text
    assert f"Also trusted: <strong>{BOT}</strong>" in webhook_page and TOKEN not in webhook_page
    refused = post(client, f"/board/webhooks/{hook['id']}/connection", connection_id=connection_id, policy="{bad")
    assert refused.status_code == 400 and "policy: not JSON" in refused.text
    assert post(client, f"/board/webhooks/{hook['id']}/disconnect").status_code == 303
    assert client.get(f"/api/v1/webhooks/{hook['id']}/connection", headers=alice.auth).status_code == 404
    assert post(client, f"/board/connections/{connection_id}/remove").status_code == 303
    assert client.get("/api/v1/connections", headers=alice.auth).json() == {"connections": []}


def test_a_release3_database_migrates_into_subjects(tmp_path):
    shutil.copy(FIXTURES / "release3" / "release3.db", tmp_path / "release3.db")
    db = Database(str(tmp_path / "release3.db"))
    try:
        listed = db.read_sync(list_subjects, OPERATOR, SubjectListQuery())["subjects"]
        by_key = {s["key"]: s for s in listed}
        assert set(by_key) == {"github:Codertocat/Hello-World#7", "github:Codertocat/Hello-World#8",
                               "gitea:homelab/infra#57"}
        assert by_key["github:Codertocat/Hello-World#8"]["state"] == "waiting"  # the held delivery
        seven = db.read_sync(get_subject, OPERATOR, "github:Codertocat/Hello-World#7")
        assert [t["queue"] for t in seven["todos"]] == ["triage", "lane-s"]
        assert seven["labels"] == ["size/S"] and seven["state"] == "open"
        assert [e["kind"] for e in seven["timeline"] if e["type"] == "delivery"] == ["issues", "issues"]
    finally:
        db.close()
