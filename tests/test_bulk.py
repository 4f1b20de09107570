"""Bulk actions and the todo list at volume (issue 37, issue 36's finished work): one human action on many todos by
id or by filter, a dry run first, at most 10,000 a call, each todo on its own (the ones their state no longer
allows are skipped and counted by state), the human as the actor on each, and the writer held a short step at a
time; and GET /api/v1/todos over every state, by subject and title, newest first, a page at a time.

The scene is made once through the store (10,000 of alice's todos: 5,000 dead letters and 5,001 pending, a few
of every other state on another queue, a held delivery, deliveries about two issues, and bob's own todos) and
copied for each test."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

import producers
import pytest
from conftest import cli, template_fixtures
from helpers import query
from test_board import ORIGIN, post, sign_in

from switchboard.models import BulkAnswer, ClaimById, Fail, TodoListAnswer, TodoPush
from switchboard.store.human_actions import push_todo
from switchboard.store.principals import authenticate
from switchboard.store.transitions import claim_todo, fail

DEAD, PENDING = 5_000, 5_001
NEEDLES = 5  # dead letters titled "… Needle …", one in a thousand
PUSH_PACE_S = 0.02


@dataclass
class Scene:
    alice: object
    bob: object
    pool: object
    bob_pool: object
    dead: list[str]
    lane: dict[str, str]  # one of alice's todos (on `lane`) per state name
    bob_failed: str
    issue_seven: list[str]  # todos about github:…#7, oldest first


def _many(world, human, endpoint, count: int, title, dead: bool) -> list[str]:
    """`count` todos pushed (and, when `dead`, claimed and failed for good) through the store, 500 a transaction."""
    made: list[str] = []

    def batch(txn, start: int, end: int) -> list[str]:
        owner, worker = authenticate(txn, human.token), authenticate(txn, endpoint.token)
        ids = []
        for n in range(start, end):
            todo = push_todo(txn, owner, endpoint.id, TodoPush(title=title(n), queue="build"))
            if dead:
                token = claim_todo(txn, worker, todo["id"], ClaimById())["lease_token"]
                fail(txn, worker, todo["id"], Fail(lease_token=token, error="boom", retry=False))
            ids.append(todo["id"])
        return ids

    for start in range(0, count, 500):
        made += world.db.write_sync(batch, start, min(count, start + 500))
    return made


def build_scene(world, clock) -> Scene:
    alice, bob = world.human("alice"), world.human("bob")
    pool = world.endpoint(alice, ["build", "lane", "other"], name="pool")
    bob_pool = world.endpoint(bob, ["build"], name="pool")
    dead = _many(world, alice, pool, DEAD, lambda n: f"dead letter {n}" if n % 1000 != 500 else f"the Needle {n}",
                 dead=True)
    clock.advance(1)
    _many(world, alice, pool, PENDING, lambda n: f"job {n}", dead=False)
    clock.advance(1)
    lane = {}

    def pushed(title: str, **extra) -> str:
        return world.push(alice, pool, "lane", title, **extra)["id"]

    def claimed(title: str, **extra) -> tuple[str, str]:
        todo_id = pushed(title, **extra)
        answer = world.client.post(f"/api/v1/todos/{todo_id}/claim", headers=pool.auth, json={})
        return todo_id, answer.json()["lease_token"]

    lane["pending"], lane["pending_2"] = pushed("lane pending"), pushed("lane pending 2")
    lane["claimed"], _ = claimed("lane claimed")
    gated = {"schema": "switchboard.work_item.v1", "objective": "ship it", "approval_gates": ["review"]}
    lane["review"], token = claimed("lane review", work_item=gated)
    world.act(pool, lane["review"], "complete", lease_token=token, summary="see the PR")
    lane["done"], token = claimed("lane done")
    world.act(pool, lane["done"], "complete", lease_token=token)
    lane["cancelled"] = pushed("lane cancelled")
    world.act(alice, lane["cancelled"], "cancel", reason="not needed")
    for name in ("failed", "failed_2"):
        lane[name], token = claimed(f"lane {name}")
        world.act(pool, lane[name], "fail", lease_token=token, error="boom", retry=False)
    lane["deferred"] = pushed("lane deferred")
    world.act(alice, lane["deferred"], "defer", reason="later")
    lane["needs_input"], token = claimed("lane needs input")
    world.act(pool, lane["needs_input"], "needs-input", lease_token=token, question="which disk?")
    guarded = world.webhook(alice, pool, "github", "lane", trusted_actors={"logins": ["Codertocat"]})
    held = world.deliver(guarded, *producers.github("issues.opened", guarded["secret"],
                                                    {"sender": {"login": "mallory"}}))
    lane["quarantined"] = held.json()["todos"][0]["id"]
    hook = world.webhook(alice, pool, "github", "other")
    issue_seven = []
    for number, action in ((7, "opened"), (8, "opened"), (7, "edited"), (7, "labeled")):
        clock.advance(1)
        answer = world.deliver(hook, *producers.github(f"issues.{action}", hook["secret"],
                                                       {"issue": {"number": number}}))
        if number == 7:
            issue_seven += [t["id"] for t in answer.json()["todos"]]
    bob_failed = _many(world, bob, bob_pool, 3, lambda n: f"bob's {n}", dead=True)[0]
    return Scene(alice, bob, pool, bob_pool, dead, lane, bob_failed, issue_seven)


template, db_path, clock = template_fixtures(build_scene)


@pytest.fixture
def scene(template) -> Scene:
    return template.value()


def bulk(world, who, **body):
    answer = world.client.post("/api/v1/todos/bulk", headers=who.auth, json=body)
    if answer.status_code == 200:
        BulkAnswer.model_validate(answer.json())
    return answer


def state_counts(db_path: str) -> list[tuple]:
    return query(db_path, "SELECT endpoint_id, queue, state, n FROM todo_counts WHERE n > 0 ORDER BY 1, 2, 3")


def history_size(db_path: str) -> int:
    return query(db_path, "SELECT max(id) FROM todo_history")[0][0]


def listed(world, who, **params) -> dict:
    answer = world.client.get("/api/v1/todos", headers=who.auth, params=params)
    assert answer.status_code == 200, answer.text
    TodoListAnswer.model_validate(answer.json())
    return answer.json()


def every_page(world, who, **params) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        page = listed(world, who, **params, **({"cursor": cursor} if cursor else {}))
        pages.append([t["id"] for t in page["todos"]])
        cursor = page["next_cursor"]
        if cursor is None:
            return pages


# -- bulk actions -----------------------------------------------------------------------------------------

def test_bulk_retry_of_5000_dead_letters_dry_runs_then_acts_a_step_at_a_time_with_the_human_as_actor(
        world, scene, db_path):
    alice = scene.alice
    counts, history = state_counts(db_path), history_size(db_path)
    spec = {"action": "retry", "filter": {"queue": "build", "state": "failed"}, "reason": "the rules are fixed"}
    dry = bulk(world, alice, **spec)
    assert dry.json() == {"dry_run": True, "action": "retry", "matched": DEAD, "acted": DEAD, "skipped": {},
                          "truncated": False}
    assert state_counts(db_path) == counts and history_size(db_path) == history, "a dry run changes nothing"

    acted: dict = {}
    running = threading.Thread(target=lambda: acted.update(bulk(world, alice, **spec, dry_run=False).json()))
    running.start()
    pushed = []
    # Deliveries meanwhile, each waiting one step of the bulk action at most; paced as a busy producer would send
    # them, not in a loop that would hold the interpreter's lock (this process is the server too) against the
    # action under test: unpaced, they doubled its time alone and made it 62 s in a loaded full run.
    while running.is_alive():
        pushed.append(world.push(alice, scene.pool, "other", f"meanwhile {len(pushed)}")["id"])
        time.sleep(PUSH_PACE_S)
    running.join()
    assert acted == {"dry_run": False, "action": "retry", "matched": DEAD, "acted": DEAD, "skipped": {},
                     "truncated": False}
    marks = ",".join("?" * len(scene.dead))
    moved = query(db_path, f"SELECT h.todo_id, h.actor, h.from_state, h.to_state, t.state, t.attempt, t.dead_letter"
                           f" FROM todo_history h JOIN todos t ON t.id = h.todo_id WHERE h.id > ? AND h.todo_id IN"
                           f" ({marks})", (history, *scene.dead))
    assert sorted(r[0] for r in moved) == sorted(scene.dead)
    assert {r[1:] for r in moved} == {(f"human:{alice.id}", "failed", "pending", "pending", 0, 0)}
    assert dict(((q, s), n) for e, q, s, n in state_counts(db_path) if e == scene.pool.id and q == "build") == {
        ("build", "pending"): DEAD + PENDING}
    # The bulk action ran as many transactions, deliveries between them: some push's history line lies
    # between the bulk action's first and last.
    first, last = query(db_path, f"SELECT min(id), max(id) FROM todo_history WHERE id > ? AND todo_id IN ({marks})",
                        (history, *scene.dead))[0]
    between = query(db_path, f"SELECT count(*) FROM todo_history WHERE id > ? AND id < ? AND todo_id IN"
                             f" ({','.join('?' * len(pushed))})", (first, last, *pushed))[0][0]
    assert pushed and between > 0, "the bulk action held the writer in one go"


def test_a_filter_matching_more_than_10000_takes_the_newest_10000_and_says_so(world, scene):
    answer = bulk(world, scene.alice, action="cancel", reason="start over", filter={"queue": "build"})
    assert answer.json() == {"dry_run": True, "action": "cancel", "matched": 10_000, "acted": 10_000,
                             "skipped": {}, "truncated": True}


def test_a_bulk_call_over_a_mix_of_states_reports_the_skipped_by_state(world, scene, db_path):
    unknown = "td_" + "0" * 20
    ids = [*scene.lane.values(), unknown, scene.bob_failed]
    bob_before = world.client.get(f"/api/v1/todos/{scene.bob_failed}", headers=scene.bob.auth).json()
    expected = {"dry_run": True, "action": "retry", "matched": len(ids), "acted": 2, "truncated": False,
                "skipped": {"cancelled": 1, "claimed": 1, "deferred": 1, "done": 1, "needs_input": 1,
                            "not_found": 2, "pending": 2, "quarantined": 1, "review": 1}}
    assert bulk(world, scene.alice, action="retry", ids=ids).json() == expected
    assert bulk(world, scene.alice, action="retry", ids=ids, dry_run=False).json() == {**expected, "dry_run": False}
    states = {name: world.client.get(f"/api/v1/todos/{todo_id}", headers=scene.alice.auth).json()["state"]
              for name, todo_id in scene.lane.items()}
    assert states["failed"] == states["failed_2"] == "pending" and states["review"] == "review"
    assert world.client.get(f"/api/v1/todos/{scene.bob_failed}", headers=scene.bob.auth).json() == bob_before


@pytest.mark.parametrize("action, body, acts_on, becomes", [
    ("cancel", {"reason": "not needed"}, ["pending", "claimed", "review", "failed", "deferred", "needs_input"],
     "cancelled"),
    ("reroute", {"queue": "other"}, ["pending", "failed", "deferred", "needs_input"], "pending"),
    ("defer", {"reason": "after the release", "until": "2030-01-01T00:00:00Z"}, ["pending"], "deferred"),
    ("approve", {}, ["review"], "done"),
    ("discard", {"reason": "spam"}, ["quarantined"], "done"),
])
def test_each_bulk_action_takes_the_todos_its_state_allows(world, scene, action, body, acts_on, becomes):
    names = ["pending", "claimed", "review", "done", "cancelled", "failed", "deferred", "needs_input", "quarantined"]
    ids = [scene.lane[name] for name in names]
    answer = bulk(world, scene.alice, action=action, ids=ids, dry_run=False, **body).json()
    assert answer["acted"] == len(acts_on) and sum(answer["skipped"].values()) == len(names) - len(acts_on)
    for name in names:
        todo = world.client.get(f"/api/v1/todos/{scene.lane[name]}", headers=scene.alice.auth).json()
        if name in acts_on:
            assert todo["state"] == becomes and todo["history"][-1]["actor"] == f"human:{scene.alice.id}", name
            assert action != "reroute" or todo["queue"] == "other"
        else:
            assert todo["history"][-1]["to"] == name.removesuffix("_2"), name


@pytest.mark.parametrize("body, words", [
    ({"action": "retry"}, "give ids or filter"),
    ({"action": "retry", "ids": ["td_01"], "filter": {}}, "give ids or filter"),
    ({"action": "retry", "ids": []}, "ids"),
    ({"action": "retry", "ids": ["td_01"] * 10_001}, "ids"),
    ({"action": "retry", "ids": ["not-an-id"]}, "ids.0"),
    ({"action": "explode", "filter": {}}, "action"),
    ({"action": "cancel", "filter": {}}, "cancel needs a reason"),
    ({"action": "defer", "filter": {}}, "defer needs a reason"),
    ({"action": "reroute", "filter": {}}, "reroute's target queue"),
    ({"action": "retry", "queue": "other", "filter": {}}, "reroute's target queue"),
    ({"action": "cancel", "reason": "x", "until": "2030-01-01T00:00:00Z", "filter": {}}, "until: given with defer"),
    ({"action": "retry", "filter": {"state": "failed,lost"}}, "unknown state 'lost'"),
    ({"action": "retry", "filter": {"owner": "bob"}}, "filter.owner"),
    ({"action": "retry", "filter": {}, "dry_run": "no"}, "dry_run"),
])
def test_bulk_refuses_bad_input_with_a_clear_400_and_changes_nothing(world, scene, db_path, body, words):
    counts, history = state_counts(db_path), history_size(db_path)
    answer = bulk(world, scene.alice, **body)
    assert answer.status_code == 400 and answer.json()["error"] == "invalid_argument", answer.text
    assert words in answer.json()["message"], answer.text
    assert state_counts(db_path) == counts and history_size(db_path) == history


def test_an_endpoint_token_cannot_act_in_bulk(world, scene, db_path):
    history = history_size(db_path)
    answer = bulk(world, scene.pool, action="retry", filter={}, dry_run=False)
    assert answer.status_code == 403 and "human token" in answer.json()["message"]
    assert history_size(db_path) == history


def test_the_cli_dry_runs_then_applies_as_the_operator(world, scene, db_path):
    code, dry = cli(db_path, "todo", "bulk", "retry", "--queue", "lane", "--state", "failed")
    assert code == 0 and (dry["dry_run"], dry["matched"], dry["acted"]) == (True, 2, 2)
    code, done = cli(db_path, "todo", "bulk", "retry", "--ids", f"{scene.lane['failed']},{scene.lane['done']}",
                     "--reason", "again", "--apply")
    assert code == 0 and (done["acted"], done["skipped"]) == (1, {"done": 1})
    todo = world.client.get(f"/api/v1/todos/{scene.lane['failed']}", headers=scene.alice.auth).json()
    assert todo["state"] == "pending" and todo["history"][-1]["actor"] == "system"
    code, refused = cli(db_path, "todo", "bulk", "retry", "--ids", scene.lane["failed"], "--queue", "lane")
    assert code == 1 and "not both" in refused["message"]


# -- the todo list ------------------------------------------------------------------------------------------

def test_the_todo_list_pages_through_every_state_newest_first_each_todo_once(world, scene, db_path):
    pages = every_page(world, scene.alice, state="failed", queue="build", limit=200)
    ids = [todo_id for page in pages for todo_id in page]
    assert len(pages) == DEAD // 200 and sorted(ids) == sorted(scene.dead) and len(set(ids)) == DEAD
    rows = dict(query(db_path, f"SELECT id, created_at FROM todos WHERE id IN ({','.join('?' * 200)})",
                      tuple(pages[0])))
    assert [(rows[i], i) for i in pages[0]] == sorted(((rows[i], i) for i in pages[0]), reverse=True)
    finished = listed(world, scene.alice, state="done,cancelled", queue="lane")
    assert [t["title"] for t in finished["todos"]] == ["lane cancelled", "lane done"]
    assert finished["next_cursor"] is None


def test_the_todo_list_finds_by_subject_and_by_title(world, scene):
    subject = listed(world, scene.alice, subject="github:Codertocat/Hello-World#7")
    assert [t["id"] for t in subject["todos"]] == scene.issue_seven[::-1]
    assert listed(world, scene.bob, subject="github:Codertocat/Hello-World#7")["todos"] == []
    assert [t["title"] for t in listed(world, scene.alice, q="LANE NEEDS")["todos"]] == ["lane needs input"]
    # Five needles among 10,000: each page reads a bounded stretch, so a page may be short (even empty) and
    # still name the next; every needle is found once, newest first.
    pages = every_page(world, scene.alice, q="needle", limit=2)
    found = [todo_id for page in pages for todo_id in page]
    needles = [todo_id for n, todo_id in enumerate(scene.dead) if n % 1000 == 500]
    assert found == needles[::-1] and len(found) == NEEDLES
    assert any(len(page) < 2 for page in pages[:-1]), "the search stopped at its bound and went on from there"


def test_an_endpoint_lists_only_its_own_and_never_what_is_held(world, scene):
    own = listed(world, scene.pool, queue="lane", state="quarantined,pending")
    assert {t["state"] for t in own["todos"]} == {"pending"}
    assert listed(world, scene.bob_pool, state="failed", limit=200)["todos"][0]["endpoint_id"] == scene.bob_pool.id


@pytest.mark.parametrize("params, words", [
    ({"state": "failed,lost"}, "unknown state 'lost'"),
    ({"state": "failed,"}, "state"),
    ({"cursor": "yesterday"}, "cursor"),
    ({"cursor": "1.td_zz"}, "cursor"),
    ({"q": "x" * 129}, "q"),
    ({"subject": "a\nb"}, "subject"),
])
def test_bad_list_filters_are_a_clear_400(world, scene, params, words):
    answer = world.client.get("/api/v1/todos", headers=scene.alice.auth, params=params)
    assert answer.status_code == 400 and words in answer.json()["message"], answer.text


# -- the Board ------------------------------------------------------------------------------------------

def test_the_board_lists_every_state_and_acts_in_bulk_after_showing_the_count(client, world, scene, db_path):
    sign_in(client, scene.alice)
    page = client.get("/board/todos", params={"state": ["failed", "done"], "queue": "lane"})
    assert page.status_code == 200
    assert len(re.findall(r'<input type="checkbox" class="pick" name="ids"', page.text)) == 3
    assert "all 3 matching this filter" in page.text
    dead = client.get("/board/inbox/dead")
    assert f"all {DEAD + 2:,} matching this filter" in dead.text and 'class="pick"' in dead.text
    assert 'form="bulk-running"' in client.get("/board/queues").text
    history = history_size(db_path)
    confirm = post(client, "/board/todos/bulk", action="retry", scope="selected",
                   ids=f"{scene.lane['failed']},{scene.lane['done']}", back="/board/todos")
    assert confirm.status_code == 200 and "Retry 1 todo(s)?" in confirm.text and "1 done" in confirm.text
    assert history_size(db_path) == history, "the confirmation changed nothing"
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', confirm.text))
    assert fields["apply"] == "yes" and fields["ids"] == f"{scene.lane['failed']},{scene.lane['done']}"
    applied = client.post("/board/todos/bulk", data=fields, headers=ORIGIN, follow_redirects=False)
    assert applied.status_code == 303 and applied.headers["location"] == "/board/todos"
    assert "Retried 1 of 2 todos; skipped 1 done." in client.get("/board/todos").text
    todo = world.client.get(f"/api/v1/todos/{scene.lane['failed']}", headers=scene.alice.auth).json()
    assert todo["state"] == "pending" and todo["history"][-1]["actor"] == f"human:{scene.alice.id}"
    every = post(client, "/board/todos/bulk", action="cancel", reason="closing the lane", scope="all",
                 f_queue="lane", f_state="pending,deferred", back="/board/todos")
    assert "Cancel 4 todo(s)?" in every.text and "4 matched the filter" in every.text
    nothing = post(client, "/board/todos/bulk", action="retry", scope="selected", back="/board/todos")
    assert nothing.status_code == 400 and "tick the todos" in nothing.text
