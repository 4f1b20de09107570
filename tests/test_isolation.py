"""Tenancy (SPEC section 2, 7, 9): two humans whose endpoints use the same queue name never see, list, get,
claim, touch or get rung for each other's todos; a foreign id answers exactly like an unknown id; verbs outside
an endpoint's scope, human tokens on agent verbs and endpoint tokens on human routes are 403 and change nothing;
a revoked endpoint's token is 401 at once and its open todos fail `endpoint_revoked`.

Every refused call is checked three ways: the answer, alice's todos as alice sees them (full `get_todo` views,
history included), and a snapshot of every table of the real SQLite file."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from conftest import snapshot, template_fixtures

from switchboard.doorbell import Session

UNKNOWN_TODO = "td_" + "0" * 20
UNKNOWN_ENDPOINT = "ep_" + "0" * 20
QUEUE = "build"
GATED = {"schema": "switchboard.work_item.v1", "objective": "ship it", "approval_gates": ["review"]}


# -- helpers ---------------------------------------------------------------------------------------



def assert_error(response, status: int, code: str) -> None:
    assert response.status_code != 500, response.text
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert body["error"] == code, body
    message = body.get("message")
    assert isinstance(message, str) and message.strip() and "\n" not in message and "\r" not in message, body


def same_refusal(foreign, unknown, foreign_id: str, unknown_id: str) -> None:
    """A foreign id must be indistinguishable from an unknown one: status, code, and message (modulo the id)."""
    assert foreign.status_code == unknown.status_code, (foreign.text, unknown.text)
    assert foreign.json()["error"] == unknown.json()["error"], (foreign.text, unknown.text)
    assert foreign.json()["message"].replace(foreign_id, "<id>") == \
        unknown.json()["message"].replace(unknown_id, "<id>"), (foreign.text, unknown.text)


@dataclass
class Tenants:
    world: object
    db_path: str
    alice: object
    bob: object
    alice_ep: object
    bob_ep: object
    todos: dict          # alice's todos by state name
    tokens: dict         # lease tokens alice's agent was handed, by state name

    def alice_views(self) -> dict:
        """Alice's own full view of each of her todos (attempts and history included)."""
        views = {}
        for name, todo_id in self.todos.items():
            r = self.world.client.get(f"/api/v1/todos/{todo_id}", headers=self.alice.auth)
            assert r.status_code == 200, r.text
            views[name] = r.json()
        return views

    def frozen(self) -> tuple[dict, dict]:
        return self.alice_views(), snapshot(self.db_path)

    def assert_unchanged(self, before: tuple[dict, dict]) -> None:
        views, snap = before
        now_views = self.alice_views()
        for name, view in views.items():
            assert len(now_views[name]["history"]) == len(view["history"]), name
            assert len(now_views[name]["attempts"]) == len(view["attempts"]), name
            assert now_views[name] == view, name
        assert snapshot(self.db_path) == snap


def _claim_by_id(world, endpoint, todo_id: str) -> str:
    r = world.client.post(f"/api/v1/todos/{todo_id}/claim", headers=endpoint.auth, json={})
    assert r.status_code == 200, r.text
    return r.json()["lease_token"]


def _ok(response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def build_tenants(world, clock) -> Tenants:
    alice, bob = world.human("alice"), world.human("bob")
    # Same queue, and even the same endpoint name: names are unique per human, not across humans.
    alice_ep = world.endpoint(alice, [QUEUE], name="builder")
    bob_ep = world.endpoint(bob, [QUEUE], name="builder")
    todos, tokens = {}, {}

    todos["pending"] = world.push(alice, alice_ep, QUEUE, "alice pending", payload={"secret": "alice"})["id"]

    todos["claimed"] = world.push(alice, alice_ep, QUEUE, "alice claimed")["id"]
    tokens["claimed"] = _claim_by_id(world, alice_ep, todos["claimed"])

    todos["needs_input"] = world.push(alice, alice_ep, QUEUE, "alice needs input")["id"]
    tokens["needs_input"] = _claim_by_id(world, alice_ep, todos["needs_input"])
    _ok(world.act(alice_ep, todos["needs_input"], "needs-input", lease_token=tokens["needs_input"], question="q?"))

    todos["blocked"] = world.push(alice, alice_ep, QUEUE, "alice blocked")["id"]
    tokens["blocked"] = _claim_by_id(world, alice_ep, todos["blocked"])
    _ok(world.act(alice_ep, todos["blocked"], "block", lease_token=tokens["blocked"], reason="stuck"))

    todos["review"] = world.push(alice, alice_ep, QUEUE, "alice review", work_item=GATED)["id"]
    tokens["review"] = _claim_by_id(world, alice_ep, todos["review"])
    _ok(world.act(alice_ep, todos["review"], "complete", lease_token=tokens["review"], summary="done, see PR"))

    todos["deferred"] = world.push(alice, alice_ep, QUEUE, "alice deferred")["id"]
    _ok(world.act(alice, todos["deferred"], "defer", reason="later"))

    todos["failed"] = world.push(alice, alice_ep, QUEUE, "alice failed")["id"]
    tokens["failed"] = _claim_by_id(world, alice_ep, todos["failed"])
    _ok(world.act(alice_ep, todos["failed"], "fail", lease_token=tokens["failed"], error="boom", retry=False))

    # No ingress yet makes quarantined todos, so hold one by hand on the reserved queue (set-up only).
    todos["quarantined"] = world.push(alice, alice_ep, QUEUE, "alice quarantined")["id"]
    world.db.write_sync(lambda txn, tid: txn.execute(
        "UPDATE todos SET state = 'quarantined', queue = 'quarantine' WHERE id = ?", (tid,)), todos["quarantined"])

    t = Tenants(world, None, alice, bob, alice_ep, bob_ep, todos, tokens)
    states = {name: view["state"] for name, view in t.alice_views().items()}
    assert states == {name: name for name in todos}
    return replace(t, world=None)


# The tenants are made once; every test starts from its own copy of that database, with an app of its own.
template, db_path, clock = template_fixtures(build_tenants)


@pytest.fixture
def tenants(world, db_path, template) -> Tenants:
    return replace(template.value(), world=world, db_path=db_path)


# Agent verbs with a body that would be valid for alice's worker (the lease token is filled in per todo).
AGENT_BODIES = {
    "heartbeat": {"note": "still here"},
    "complete": {"result": {"stolen": True}, "summary": "mine now"},
    "fail": {"error": "sabotage", "retry": False},
    "release": {},
    "needs-input": {"question": "whose is this?"},
    "block": {"reason": "taken"},
}

# Human verbs with a valid body, and the state in which alice herself could perform them.
HUMAN_BODIES = {
    "approve": ("review", {"note": "lgtm"}),
    "request-changes": ("review", {"note": "redo"}),
    "answer": ("needs_input", {"answer": "42"}),
    "resume": ("blocked", {}),
    "retry": ("failed", {}),
    "defer": ("pending", {"reason": "mine"}),
    "undefer": ("deferred", {}),
    "cancel": ("pending", {"reason": "mine"}),
    "reroute": ("pending", {"queue": QUEUE}),
    "discard": ("quarantined", {}),
}


# -- seeing: get and list ---------------------------------------------------------------------------

@pytest.mark.parametrize("who", ["bob_ep", "bob"])
def test_foreign_todos_cannot_be_got(tenants, who):
    principal = getattr(tenants, who)
    client = tenants.world.client
    before = tenants.frozen()
    unknown = client.get(f"/api/v1/todos/{UNKNOWN_TODO}", headers=principal.auth)
    assert_error(unknown, 404, "not_found")
    for name, todo_id in tenants.todos.items():
        foreign = client.get(f"/api/v1/todos/{todo_id}", headers=principal.auth)
        assert_error(foreign, 404, "not_found")
        same_refusal(foreign, unknown, todo_id, UNKNOWN_TODO)
        assert "alice" not in foreign.text
    tenants.assert_unchanged(before)


@pytest.mark.parametrize("who", ["bob_ep", "bob"])
def test_foreign_todos_are_never_listed(tenants, who):
    world, principal = tenants.world, getattr(tenants, who)
    own = world.push(tenants.bob, tenants.bob_ep, QUEUE, "bob's own")["id"]
    before = tenants.frozen()
    queries = ["", f"?queue={QUEUE}", f"?endpoint={tenants.alice_ep.id}", "?state=pending", "?state=claimed",
               "?state=quarantined", "?state=review", "?limit=200", f"?queue={QUEUE}&state=pending"]
    for query in queries:
        r = world.client.get(f"/api/v1/todos{query}", headers=principal.auth)
        assert r.status_code == 200, (query, r.text)
        ids = {t["id"] for t in r.json()["todos"]}
        assert not ids & set(tenants.todos.values()), query
        assert ids <= {own}, query
        assert all(t["endpoint_id"] == tenants.bob_ep.id for t in r.json()["todos"]), query
    everything = world.client.get("/api/v1/todos?limit=200", headers=principal.auth).json()["todos"]
    assert [t["id"] for t in everything] == [own]
    assert world.client.get(f"/api/v1/todos?endpoint={tenants.alice_ep.id}", headers=principal.auth).json() == \
        {"todos": [], "next_cursor": None}
    tenants.assert_unchanged(before)
    # And alice sees all of hers and none of bob's.
    alice_list = world.client.get("/api/v1/todos?limit=200", headers=tenants.alice.auth).json()["todos"]
    assert {t["id"] for t in alice_list} == set(tenants.todos.values())


def test_bob_endpoint_list_of_endpoints_and_me_show_only_bob(tenants):
    client = tenants.world.client
    me = client.get("/api/v1/me", headers=tenants.bob_ep.auth)
    assert me.status_code == 200 and me.json()["id"] == tenants.bob_ep.id
    listed = client.get("/api/v1/endpoints", headers=tenants.bob.auth)
    assert listed.status_code == 200
    assert [e["id"] for e in listed.json()["endpoints"]] == [tenants.bob_ep.id]
    assert tenants.alice_ep.id not in listed.text


def test_quarantined_todo_is_invisible_to_every_agent_even_its_own(tenants):
    """SPEC 7: no agent can list, claim or be rung for a quarantined todo; to an agent it is an unknown id."""
    client, todo_id = tenants.world.client, tenants.todos["quarantined"]
    before = tenants.frozen()
    for ep in (tenants.alice_ep, tenants.bob_ep):
        got = client.get(f"/api/v1/todos/{todo_id}", headers=ep.auth)
        unknown = client.get(f"/api/v1/todos/{UNKNOWN_TODO}", headers=ep.auth)
        assert_error(got, 404, "not_found")
        same_refusal(got, unknown, todo_id, UNKNOWN_TODO)
        claimed = client.post(f"/api/v1/todos/{todo_id}/claim", headers=ep.auth, json={})
        assert_error(claimed, 404, "not_found")
        for query in ("", "?state=quarantined", "?queue=quarantine"):
            listed = client.get(f"/api/v1/todos{query}", headers=ep.auth)
            assert listed.status_code == 200 and todo_id not in listed.text, query
    tenants.assert_unchanged(before)


# -- claiming -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("body", [{}, {"queue": QUEUE}, {"queues": [QUEUE]}, {"lease_seconds": 60}],
                         ids=["no-filter", "queue", "queues", "lease"])
def test_claim_next_never_takes_a_foreign_todo(tenants, body):
    client = tenants.world.client
    before = tenants.frozen()
    r = client.post("/api/v1/todos/claim", headers=tenants.bob_ep.auth, json=body)
    assert r.status_code == 200, r.text
    assert r.json() == {"empty": True}
    tenants.assert_unchanged(before)

    # Bob's own todo on the same queue name is what bob gets; alice's stay untouched.
    own = tenants.world.push(tenants.bob, tenants.bob_ep, QUEUE, "bob's own")["id"]
    before = tenants.frozen()[0]
    got = client.post("/api/v1/todos/claim", headers=tenants.bob_ep.auth, json=body)
    assert got.status_code == 200 and got.json()["todo"]["id"] == own
    assert tenants.alice_views() == before
    again = client.post("/api/v1/todos/claim", headers=tenants.bob_ep.auth, json=body)
    assert again.json() == {"empty": True}
    assert tenants.alice_views() == before


def test_claim_next_skips_foreign_todos_even_with_expired_leases(tenants, clock):
    """Bob's claim reaps only bob's lapsed leases: alice's expired claim stays alice's business."""
    clock.advance(301)
    before = tenants.frozen()
    r = tenants.world.client.post("/api/v1/todos/claim", headers=tenants.bob_ep.auth, json={})
    assert r.status_code == 200 and r.json() == {"empty": True}
    tenants.assert_unchanged(before)


# Bob's endpoint gets 404 for a foreign id; bob's human token is refused on any agent verb (403) before any
# lookup. Either way the foreign id answers exactly like an unknown one.
WHO_AGENT = [("bob_ep", 404, "not_found"), ("bob", 403, "forbidden")]


@pytest.mark.parametrize("who,status,code", WHO_AGENT, ids=[w[0] for w in WHO_AGENT])
@pytest.mark.parametrize("name", ["pending", "claimed", "needs_input", "blocked", "review", "deferred", "failed",
                                  "quarantined"])
def test_claim_by_id_of_a_foreign_todo_is_refused_like_an_unknown_one(tenants, name, who, status, code):
    client, todo_id, principal = tenants.world.client, tenants.todos[name], getattr(tenants, who)
    before = tenants.frozen()
    foreign = client.post(f"/api/v1/todos/{todo_id}/claim", headers=principal.auth, json={})
    unknown = client.post(f"/api/v1/todos/{UNKNOWN_TODO}/claim", headers=principal.auth, json={})
    assert_error(foreign, status, code)
    same_refusal(foreign, unknown, todo_id, UNKNOWN_TODO)
    tenants.assert_unchanged(before)


def test_bob_human_token_cannot_claim_next(tenants):
    before = tenants.frozen()
    for body in ({}, {"queue": QUEUE}, {"queues": [QUEUE]}):
        r = tenants.world.client.post("/api/v1/todos/claim", headers=tenants.bob.auth, json=body)
        assert_error(r, 403, "forbidden")
    tenants.assert_unchanged(before)


# -- touching: agent verbs with a valid-looking lease token ----------------------------------------------

@pytest.mark.parametrize("who,status,code", WHO_AGENT, ids=[w[0] for w in WHO_AGENT])
@pytest.mark.parametrize("action", list(AGENT_BODIES))
def test_foreign_agent_verbs_are_refused_even_with_the_real_lease_token(tenants, action, who, status, code):
    client, principal = tenants.world.client, getattr(tenants, who)
    before = tenants.frozen()
    live_token = tenants.tokens["claimed"]
    for name, todo_id in tenants.todos.items():
        # Alice's worker's real lease token where there is one, else her live one: bob must still get 404.
        token = tenants.tokens.get(name, live_token)
        body = {"lease_token": token, **AGENT_BODIES[action]}
        foreign = client.post(f"/api/v1/todos/{todo_id}/{action}", headers=principal.auth, json=body)
        unknown = client.post(f"/api/v1/todos/{UNKNOWN_TODO}/{action}", headers=principal.auth, json=body)
        assert_error(foreign, status, code)
        same_refusal(foreign, unknown, todo_id, UNKNOWN_TODO)
    tenants.assert_unchanged(before)
    # Alice's worker still holds its lease: the fence was never moved by bob.
    beat = client.post(f"/api/v1/todos/{tenants.todos['claimed']}/heartbeat", headers=tenants.alice_ep.auth,
                       json={"lease_token": live_token})
    assert beat.status_code == 200, beat.text


# Bob's human token gets 404 for a foreign id; bob's endpoint token is refused on any human verb (403).
WHO_HUMAN = [("bob", 404, "not_found"), ("bob_ep", 403, "forbidden")]


@pytest.mark.parametrize("who,status,code", WHO_HUMAN, ids=[w[0] for w in WHO_HUMAN])
@pytest.mark.parametrize("action", list(HUMAN_BODIES))
def test_foreign_human_verbs_are_refused_like_an_unknown_id(tenants, action, who, status, code):
    client, principal = tenants.world.client, getattr(tenants, who)
    _, body = HUMAN_BODIES[action]
    before = tenants.frozen()
    unknown = client.post(f"/api/v1/todos/{UNKNOWN_TODO}/{action}", headers=principal.auth, json=body)
    assert_error(unknown, status, code)
    # Every state, including the one in which alice could do it: no 409 may betray that the todo exists.
    for name, todo_id in tenants.todos.items():
        foreign = client.post(f"/api/v1/todos/{todo_id}/{action}", headers=principal.auth, json=body)
        assert_error(foreign, status, code)
        same_refusal(foreign, unknown, todo_id, UNKNOWN_TODO)
    tenants.assert_unchanged(before)


@pytest.mark.parametrize("action", list(HUMAN_BODIES))
def test_human_verb_is_real_for_the_owner(tenants, action):
    """Control for the test above: the same call by alice on her todo in the right state succeeds."""
    state, body = HUMAN_BODIES[action]
    r = tenants.world.client.post(f"/api/v1/todos/{tenants.todos[state]}/{action}", headers=tenants.alice.auth,
                                  json=body)
    assert r.status_code == 200, r.text


def test_depends_on_a_foreign_todo_is_not_found(tenants):
    client = tenants.world.client
    before = tenants.frozen()
    path = f"/api/v1/endpoints/{tenants.bob_ep.id}/todos"
    for name, todo_id in tenants.todos.items():
        work_item = {"schema": "switchboard.work_item.v1", "objective": "o", "depends_on": [todo_id]}
        foreign = client.post(path, headers=tenants.bob.auth, json={"title": "t", "queue": QUEUE,
                                                                     "work_item": work_item})
        work_item["depends_on"] = [UNKNOWN_TODO]
        unknown = client.post(path, headers=tenants.bob.auth, json={"title": "t", "queue": QUEUE,
                                                                     "work_item": work_item})
        assert_error(foreign, 404, "not_found")
        same_refusal(foreign, unknown, todo_id, UNKNOWN_TODO)
    tenants.assert_unchanged(before)


# -- endpoints of another human ------------------------------------------------------------------------

def test_pushing_to_another_humans_endpoint_is_not_found(tenants):
    client = tenants.world.client
    before = tenants.frozen()
    body = {"title": "from bob", "queue": QUEUE}
    foreign = client.post(f"/api/v1/endpoints/{tenants.alice_ep.id}/todos", headers=tenants.bob.auth, json=body)
    unknown = client.post(f"/api/v1/endpoints/{UNKNOWN_ENDPOINT}/todos", headers=tenants.bob.auth, json=body)
    assert_error(foreign, 404, "not_found")
    same_refusal(foreign, unknown, tenants.alice_ep.id, UNKNOWN_ENDPOINT)
    tenants.assert_unchanged(before)


def test_revoking_another_humans_endpoint_is_not_found(tenants):
    client = tenants.world.client
    before = tenants.frozen()
    foreign = client.post(f"/api/v1/endpoints/{tenants.alice_ep.id}/revoke", headers=tenants.bob.auth)
    unknown = client.post(f"/api/v1/endpoints/{UNKNOWN_ENDPOINT}/revoke", headers=tenants.bob.auth)
    assert_error(foreign, 404, "not_found")
    same_refusal(foreign, unknown, tenants.alice_ep.id, UNKNOWN_ENDPOINT)
    tenants.assert_unchanged(before)
    assert client.get("/api/v1/me", headers=tenants.alice_ep.auth).status_code == 200


# -- the doorbell ---------------------------------------------------------------------------------------

def test_doorbell_rings_only_the_owner(tenants, app):
    rings: dict[str, list] = {"alice": [], "bob": []}
    bell = app.state.doorbell
    bell.attach(Session(tenants.alice_ep.id, None, "stream", rings["alice"].append))
    bell.attach(Session(tenants.bob_ep.id, None, "stream", rings["bob"].append))
    bell.attach(Session(tenants.bob_ep.id, frozenset({QUEUE}), "stream", rings["bob"].append))
    alice_new = tenants.world.push(tenants.alice, tenants.alice_ep, QUEUE, "alice again")
    assert [r["todo_id"] for r in rings["alice"]] == [alice_new["id"]]
    assert rings["bob"] == []
    # A todo alice makes claimable again (answer) rings alice only, too.
    r = tenants.world.act(tenants.alice, tenants.todos["needs_input"], "answer", answer="yes")
    assert r.status_code == 200
    assert rings["bob"] == [] and rings["alice"][-1]["todo_id"] == tenants.todos["needs_input"]
    bob_new = tenants.world.push(tenants.bob, tenants.bob_ep, QUEUE, "bob's")
    assert [r["todo_id"] for r in rings["bob"]] == [bob_new["id"]]
    assert len(rings["alice"]) == 2


# -- wrong kind of token, verbs outside scope --------------------------------------------------------------

@pytest.mark.parametrize("action", ["claim", *AGENT_BODIES])
def test_human_token_on_agent_verbs_is_forbidden(tenants, action):
    """Even alice, on her own claimed todo with her worker's live lease token."""
    client = tenants.world.client
    todo_id = tenants.todos["pending" if action == "claim" else "claimed"]
    body = {} if action == "claim" else {"lease_token": tenants.tokens["claimed"], **AGENT_BODIES[action]}
    before = tenants.frozen()
    r = client.post(f"/api/v1/todos/{todo_id}/{action}", headers=tenants.alice.auth, json=body)
    assert_error(r, 403, "forbidden")
    tenants.assert_unchanged(before)


@pytest.mark.parametrize("path,body", [
    ("/api/v1/todos/claim", {}),
    ("/api/v1/todos/claim", {"queue": QUEUE}),
])
def test_human_token_cannot_claim_next(tenants, path, body):
    before = tenants.frozen()
    r = tenants.world.client.post(path, headers=tenants.alice.auth, json=body)
    assert_error(r, 403, "forbidden")
    tenants.assert_unchanged(before)


@pytest.mark.parametrize("action", list(HUMAN_BODIES))
def test_endpoint_token_on_human_verbs_is_forbidden(tenants, action):
    """Alice's own endpoint, on alice's todo in exactly the state the verb needs."""
    state, body = HUMAN_BODIES[action]
    before = tenants.frozen()
    r = tenants.world.client.post(f"/api/v1/todos/{tenants.todos[state]}/{action}", headers=tenants.alice_ep.auth,
                                  json=body)
    assert_error(r, 403, "forbidden")
    tenants.assert_unchanged(before)


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/api/v1/endpoints", {"name": "sneaky", "queues": [QUEUE]}),
    ("GET", "/api/v1/endpoints", None),
    ("POST", "/api/v1/endpoints/{alice_ep}/todos", {"title": "self-made", "queue": QUEUE}),
    ("POST", "/api/v1/endpoints/{alice_ep}/revoke", None),
    ("POST", "/api/v1/endpoints/{bob_ep}/revoke", None),
    ("POST", "/api/v1/me/token", None),
], ids=["vend", "list-endpoints", "push", "revoke-self", "revoke-foreign", "new-human-token"])
def test_endpoint_token_on_human_routes_is_forbidden(tenants, method, path, body):
    before = tenants.frozen()
    url = path.format(alice_ep=tenants.alice_ep.id, bob_ep=tenants.bob_ep.id)
    r = tenants.world.client.request(method, url, headers=tenants.alice_ep.auth, json=body)
    assert_error(r, 403, "forbidden")
    tenants.assert_unchanged(before)


@pytest.fixture
def lister(tenants):
    """An endpoint of alice's whose scope is only list_todos, with one pending todo of its own."""
    ep = tenants.world.endpoint(tenants.alice, [QUEUE], name="lister", verbs=["list_todos"])
    todo = tenants.world.push(tenants.alice, ep, QUEUE, "for the lister")["id"]
    tenants.todos["lister"] = todo
    return ep, todo


@pytest.mark.parametrize("call", [
    ("POST", "/api/v1/todos/claim", {}),
    ("POST", "/api/v1/todos/claim", {"queue": QUEUE}),
    ("POST", "/api/v1/todos/{todo}/claim", {}),
    ("GET", "/api/v1/todos/{todo}", None),
    *[("POST", "/api/v1/todos/{todo}/" + action, {"lease_token": "x" * 22, **body})
      for action, body in AGENT_BODIES.items()],
], ids=lambda c: f"{c[0]} {c[1].rsplit('/', 1)[-1]}")
def test_verb_outside_scope_is_forbidden_and_changes_nothing(tenants, lister, call):
    ep, todo = lister
    method, path, body = call
    before = tenants.frozen()
    r = tenants.world.client.request(method, path.format(todo=todo), headers=ep.auth, json=body)
    assert_error(r, 403, "forbidden")
    tenants.assert_unchanged(before)
    # list_todos is in scope and shows only this endpoint's todo.
    listed = tenants.world.client.get("/api/v1/todos", headers=ep.auth)
    assert listed.status_code == 200 and [t["id"] for t in listed.json()["todos"]] == [todo]


def test_claim_of_a_queue_outside_scope_is_forbidden(tenants):
    before = tenants.frozen()
    r = tenants.world.client.post("/api/v1/todos/claim", headers=tenants.bob_ep.auth, json={"queue": "deploy"})
    assert_error(r, 403, "forbidden")
    r = tenants.world.client.post("/api/v1/todos/claim", headers=tenants.bob_ep.auth,
                                  json={"queues": [QUEUE, "deploy"]})
    assert_error(r, 403, "forbidden")
    tenants.assert_unchanged(before)


# -- revocation -----------------------------------------------------------------------------------------

def test_revoked_endpoint_token_is_refused_at_once_and_its_open_todos_fail(tenants):
    world, client = tenants.world, tenants.world.client
    ep = world.endpoint(tenants.alice, [QUEUE], name="doomed")
    waiting = world.push(tenants.alice, ep, QUEUE, "waiting")["id"]
    held = world.push(tenants.alice, ep, QUEUE, "held")["id"]
    finished = world.push(tenants.alice, ep, QUEUE, "finished")["id"]
    token = _claim_by_id(world, ep, held)
    done_token = _claim_by_id(world, ep, finished)
    _ok(world.act(ep, finished, "complete", lease_token=done_token, result={"ok": True}))
    assert client.get("/api/v1/me", headers=ep.auth).status_code == 200

    r = client.post(f"/api/v1/endpoints/{ep.id}/revoke", headers=tenants.alice.auth)
    assert r.status_code == 200, r.text
    assert r.json()["revoked_at"] is not None

    before = tenants.frozen()
    snap = snapshot(tenants.db_path)
    refused = [
        client.get("/api/v1/me", headers=ep.auth),
        client.get("/api/v1/todos", headers=ep.auth),
        client.get(f"/api/v1/todos/{held}", headers=ep.auth),
        client.post("/api/v1/todos/claim", headers=ep.auth, json={}),
        client.post(f"/api/v1/todos/{waiting}/claim", headers=ep.auth, json={}),
        client.post(f"/api/v1/todos/{held}/heartbeat", headers=ep.auth, json={"lease_token": token}),
        client.post(f"/api/v1/todos/{held}/complete", headers=ep.auth, json={"lease_token": token}),
        client.post(f"/api/v1/todos/{held}/release", headers=ep.auth, json={"lease_token": token}),
    ]
    for response in refused:
        assert_error(response, 401, "unauthenticated")
    tenants.assert_unchanged(before)
    assert snapshot(tenants.db_path) == snap

    for todo_id in (waiting, held):
        view = client.get(f"/api/v1/todos/{todo_id}", headers=tenants.alice.auth).json()
        assert view["state"] == "failed", view
        assert view["last_error"] == "endpoint_revoked", view
        assert view["lease_expires_at"] is None
        assert view["history"][-1]["to"] == "failed"
        assert view["history"][-1]["actor"] == f"human:{tenants.alice.id}"
    held_view = client.get(f"/api/v1/todos/{held}", headers=tenants.alice.auth).json()
    assert held_view["attempts"][-1]["ended_at"] is not None and held_view["attempts"][-1]["outcome"] == "failed"
    finished_view = client.get(f"/api/v1/todos/{finished}", headers=tenants.alice.auth).json()
    assert finished_view["state"] == "done" and finished_view["outcome"] == "completed"
    # Alice's other endpoint, and bob's, are untouched.
    assert client.get("/api/v1/me", headers=tenants.alice_ep.auth).status_code == 200
    assert client.get("/api/v1/me", headers=tenants.bob_ep.auth).status_code == 200
