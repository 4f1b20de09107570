"""The red team on queue control and bulk actions (issue 37), as tests/test_isolation.py does for the rest: another
human's queue or todos named by id answer like unknown ones, a filter never reaches past the caller's own todos,
endpoint tokens are refused, and every new Board form refuses a missing CSRF token or another origin. Each refused
call is checked against a snapshot of every table of the real SQLite file: nothing changed."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from conftest import snapshot, template_fixtures
from test_board import ORIGIN, post, sign_in

QUEUE = "build"


@dataclass
class Scene:
    alice: object
    bob: object
    alice_ep: object
    bob_ep: object
    alice_failed: str
    bob_failed: str


def _failed(world, human, endpoint, title: str) -> str:
    todo = world.push(human, endpoint, QUEUE, title)["id"]
    lease = world.client.post(f"/api/v1/todos/{todo}/claim", headers=endpoint.auth, json={}).json()["lease_token"]
    assert world.act(endpoint, todo, "fail", lease_token=lease, error="boom", retry=False).status_code == 200
    return todo


def build_scene(world, clock) -> Scene:
    alice, bob = world.human("alice"), world.human("bob")
    # The same queue and endpoint name on both sides: names are per human.
    alice_ep, bob_ep = world.endpoint(alice, [QUEUE], name="pool"), world.endpoint(bob, [QUEUE], name="pool")
    return Scene(alice, bob, alice_ep, bob_ep, _failed(world, alice, alice_ep, "alice's dead letter"),
                 _failed(world, bob, bob_ep, "bob's dead letter"))


template, db_path, clock = template_fixtures(build_scene)


@pytest.fixture
def scene(template) -> Scene:
    return template.value()


UNKNOWN_ENDPOINT = "ep_" + "0" * 20


@pytest.mark.parametrize("method, what, body", [
    ("GET", "", None), ("POST", f"/{QUEUE}/pause", {"until": "2h"}), ("POST", f"/{QUEUE}/resume", {}),
    ("PUT", f"/{QUEUE}/limits", {"max_in_flight": 0}),
])
def test_another_humans_queue_answers_like_an_unknown_one(world, scene, db_path, method, what, body):
    before = snapshot(db_path)
    foreign = world.client.request(method, f"/api/v1/endpoints/{scene.alice_ep.id}/queues{what}",
                                   headers=scene.bob.auth, json=body)
    unknown = world.client.request(method, f"/api/v1/endpoints/{UNKNOWN_ENDPOINT}/queues{what}",
                                   headers=scene.bob.auth, json=body)
    assert foreign.status_code == unknown.status_code == 404
    assert foreign.json()["message"].replace(scene.alice_ep.id, "<id>") == \
        unknown.json()["message"].replace(UNKNOWN_ENDPOINT, "<id>")
    own_token = world.client.request(method, f"/api/v1/endpoints/{scene.alice_ep.id}/queues{what}",
                                     headers=scene.alice_ep.auth, json=body)
    assert own_token.status_code == 403, "an endpoint cannot control its own queues"
    assert snapshot(db_path) == before


def test_another_humans_todos_by_id_are_skipped_as_not_found_and_left_alone(world, scene, db_path):
    before = snapshot(db_path)
    for dry_run in (True, False):
        answer = world.client.post("/api/v1/todos/bulk", headers=scene.bob.auth, json={
            "action": "cancel", "reason": "mine now", "ids": [scene.alice_failed], "dry_run": dry_run})
        assert answer.json()["matched"] == 1 and answer.json()["acted"] == 0
        assert answer.json()["skipped"] == {"not_found": 1}, "exactly as an id nobody has"
    assert snapshot(db_path) == before


@pytest.mark.parametrize("filter_", [
    {}, {"endpoint": "ep_" + "0" * 20}, {"queue": QUEUE, "state": "failed"}, {"q": "alice"},
    {"subject": "github:alice/private#1"},
])
def test_a_filter_never_reaches_another_humans_todos(world, scene, db_path, filter_):
    before = snapshot(db_path)
    named_alice = {**filter_, "endpoint": scene.alice_ep.id} if "endpoint" in filter_ else filter_
    answer = world.client.post("/api/v1/todos/bulk", headers=scene.bob.auth,
                               json={"action": "retry", "filter": named_alice, "dry_run": False}).json()
    acted_on_bobs = answer["acted"]
    assert world.client.get(f"/api/v1/todos/{scene.alice_failed}", headers=scene.alice.auth).json()["state"] == \
        "failed", "alice's dead letter is still hers, still dead"
    listed = world.client.get("/api/v1/todos", headers=scene.bob.auth, params={**named_alice, "limit": 200}).json()
    assert scene.alice_failed not in [t["id"] for t in listed["todos"]]
    if acted_on_bobs:
        assert world.client.get(f"/api/v1/todos/{scene.bob_failed}", headers=scene.bob.auth).json()["state"] == \
            "pending"
    else:
        assert snapshot(db_path) == before


def test_endpoint_tokens_cannot_act_in_bulk_even_on_their_own_todos(world, scene, db_path):
    before = snapshot(db_path)
    answer = world.client.post("/api/v1/todos/bulk", headers=scene.alice_ep.auth,
                               json={"action": "retry", "ids": [scene.alice_failed], "dry_run": False})
    assert answer.status_code == 403 and answer.json()["error"] == "forbidden"
    assert snapshot(db_path) == before


def _board_forms(scene) -> list[tuple[str, dict]]:
    base = f"/board/endpoints/{scene.alice_ep.id}/queues/{QUEUE}"
    return [(f"{base}/pause", {"for": "2h"}), (f"{base}/resume", {}),
            (f"{base}/limits", {"max_in_flight": "0"}),
            ("/board/todos/bulk", {"action": "retry", "scope": "selected", "ids": scene.alice_failed,
                                   "apply": "yes"})]


@pytest.mark.parametrize("refusal", ["no csrf", "wrong csrf", "another origin", "no origin", "not a form"])
def test_every_new_board_form_refuses_a_forged_post_and_changes_nothing(client, scene, db_path, refusal):
    sign_in(client, scene.alice)
    before = snapshot(db_path)
    for path, fields in _board_forms(scene):
        if refusal == "not a form":
            answer = client.post(path, json={**fields, "csrf": "x"}, headers=ORIGIN, follow_redirects=False)
        else:
            token = {"no csrf": None, "wrong csrf": "forged"}.get(refusal, "")
            sent = {"another origin": {"Origin": "https://evil.example"}, "no origin": {}}.get(refusal)
            answer = post(client, path, token=token, sent=sent, **fields)
        assert answer.status_code == 403 and "Refused" in answer.text, (path, refusal, answer.status_code)
    assert snapshot(db_path) == before


def test_another_humans_board_session_cannot_touch_alices_queue_or_todos(client, world, scene, db_path):
    sign_in(client, scene.bob)
    before = snapshot(db_path)
    for path, fields in _board_forms(scene)[:3]:
        answer = post(client, path, **fields)
        assert answer.status_code == 404 and "Nothing was changed" in answer.text, path
    confirm = post(client, "/board/todos/bulk", **_board_forms(scene)[3][1])
    assert confirm.status_code == 303
    assert snapshot(db_path) == before
    assert "skipped 1 not found" in client.get("/board/todos").text
    page = client.get("/board/todos", params={"endpoint": scene.alice_ep.id, "state": "failed"})
    assert scene.alice_failed not in page.text and "alice's dead letter" not in page.text
    assert scene.alice_ep.id not in client.get("/board/queues").text
