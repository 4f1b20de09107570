"""SPEC section 12, table-driven: every malformed request to the routes that exist gets a clear 4xx with the
error body `{"error": code, "message": one line}`, never a 500, and changes nothing in the database (every
table of the real SQLite file is compared before and after)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

UNKNOWN_TODO = "td_" + "0" * 20
UNKNOWN_ENDPOINT = "ep_" + "0" * 20
MIB = 1 << 20
KIB64 = 64 << 10
WORK_ITEM = {"schema": "switchboard.work_item.v1", "objective": "do the thing"}
GATED = {**WORK_ITEM, "approval_gates": ["review"]}

from conftest import snapshot, template_fixtures


@dataclass
class Scene:
    """Alice, her endpoint `agent` (queues build and deploy), and todos in the states the rows need."""
    alice: object
    agent: object
    revoked: object
    ids: dict      # placeholders for paths: pending, claimed, stale, gated, ep, revoked_ep, unknown_todo, ...
    tokens: dict   # placeholders for bodies: $claimed_token, $stale_token, $gated_token


def build_scene(world, clock) -> Scene:
    alice = world.human("alice")
    agent = world.endpoint(alice, ["build", "deploy"], name="agent")

    def claim(todo_id: str, **body) -> str:
        r = world.client.post(f"/api/v1/todos/{todo_id}/claim", headers=agent.auth, json=body)
        assert r.status_code == 200, r.text
        return r.json()["lease_token"]

    pending = world.push(alice, agent, "build", "pending one")["id"]
    # A stale token: claimed with a 1 s lease that lapses, then re-claimed (a new attempt, a new token).
    stale = world.push(alice, agent, "build", "re-claimed one")["id"]
    stale_token = claim(stale, lease_seconds=1)
    clock.advance(2)
    current_token = claim(stale)
    assert current_token != stale_token
    claimed = world.push(alice, agent, "build", "claimed one")["id"]
    claimed_token = claim(claimed)
    gated = world.push(alice, agent, "build", "gated one", work_item=GATED)["id"]
    gated_token = claim(gated)

    revoked = world.endpoint(alice, ["build"], name="revoked")
    r = world.client.post(f"/api/v1/endpoints/{revoked.id}/revoke", headers=alice.auth)
    assert r.status_code == 200, r.text

    ids = {"pending": pending, "claimed": claimed, "stale": stale, "gated": gated, "ep": agent.id,
           "revoked_ep": revoked.id, "unknown_todo": UNKNOWN_TODO, "unknown_ep": UNKNOWN_ENDPOINT}
    tokens = {"$claimed_token": claimed_token, "$stale_token": stale_token, "$gated_token": gated_token,
              "$current_token": current_token}
    return Scene(alice, agent, revoked, ids, tokens)


# The scene is made once; every row starts from its own copy of that database, with an app of its own.
template, db_path, clock = template_fixtures(build_scene)


@pytest.fixture
def scene(world, template) -> Scene:
    return template.value()


def fill(value, tokens: dict):
    """Replace "$name" strings anywhere in a JSON-shaped value by the scene's lease tokens."""
    if isinstance(value, str):
        return tokens.get(value, value)
    if isinstance(value, list):
        return [fill(v, tokens) for v in value]
    if isinstance(value, dict):
        return {k: fill(v, tokens) for k, v in value.items()}
    return value


def headers_for(kind: str, scene: Scene) -> dict:
    if kind == "agent":
        return dict(scene.agent.auth)
    if kind == "human":
        return dict(scene.alice.auth)
    if kind == "revoked":
        return dict(scene.revoked.auth)
    if kind == "none":
        return {}
    if kind == "wrong-scheme":
        return {"Authorization": f"Token {scene.agent.token}"}
    if kind == "no-scheme":
        return {"Authorization": scene.agent.token}
    if kind.startswith("raw:"):
        return {"Authorization": kind[4:]}
    raise AssertionError(kind)


# -- the table -------------------------------------------------------------------------------------------
# (id, method, path template, headers kind, body, expected status, expected error code)
# body: None (no body), bytes (sent as is), a JSON value ("$…" strings become the scene's lease tokens), or a
# callable returning bytes (for the big ones, so the table stays readable).

LEASED = {  # the agent verbs that need a lease token, with their other required fields
    "heartbeat": {},
    "complete": {},
    "fail": {"error": "it broke"},
    "release": {},
    "needs-input": {"question": "which branch?"},
    "block": {"reason": "no access"},
}
HUMAN = {  # the human verbs, each with a body that is valid on its own
    "approve": {},
    "request-changes": {"note": "again"},
    "answer": {"answer": "main"},
    "resume": {},
    "retry": {},
    "defer": {"reason": "later"},
    "undefer": {},
    "cancel": {"reason": "obsolete"},
    "reroute": {"queue": "deploy"},
    "discard": {},
}
ACT = "/api/v1/todos/{%s}/%s"


def oversized_result() -> bytes:
    return json.dumps({"lease_token": "$claimed_token", "result": "x" * KIB64}).encode()


def big_body(size: int = MIB + 1):
    def make() -> bytes:
        return b'{"claimant": "' + b"x" * size + b'"}'
    return make


def big_push_body() -> bytes:
    return json.dumps({"title": "t", "queue": "build", "payload": "x" * (MIB + 10)}).encode()


def chunked_big_body():
    for _ in range(11):
        yield b"x" * (100 * 1024)


ROWS: list = [
    # GET /api/v1/me: authentication
    ("me-no-auth", "GET", "/api/v1/me", "none", None, 401, "unauthenticated"),
    ("me-basic", "GET", "/api/v1/me", "raw:Basic YWxpY2U6c2VjcmV0", None, 401, "unauthenticated"),
    ("me-bearer-empty", "GET", "/api/v1/me", "raw:Bearer", None, 401, "unauthenticated"),
    ("me-bearer-spaces", "GET", "/api/v1/me", "raw:Bearer    ", None, 401, "unauthenticated"),
    ("me-garbage", "GET", "/api/v1/me", "raw:garbage", None, 401, "unauthenticated"),
    ("me-unknown-sbk", "GET", "/api/v1/me", "raw:Bearer sbk_" + "A" * 43, None, 401, "unauthenticated"),
    ("me-unknown-sbh", "GET", "/api/v1/me", "raw:Bearer sbh_" + "A" * 43, None, 401, "unauthenticated"),
    ("me-no-prefix", "GET", "/api/v1/me", "raw:Bearer " + "A" * 43, None, 401, "unauthenticated"),
    ("me-wrong-scheme", "GET", "/api/v1/me", "wrong-scheme", None, 401, "unauthenticated"),
    ("me-no-scheme", "GET", "/api/v1/me", "no-scheme", None, 401, "unauthenticated"),
    ("me-revoked", "GET", "/api/v1/me", "revoked", None, 401, "unauthenticated"),

    # GET /api/v1/todos: query parameters are validated like bodies
    ("list-no-auth", "GET", "/api/v1/todos", "none", None, 401, "unauthenticated"),
    ("list-bad-state", "GET", "/api/v1/todos?state=bogus", "human", None, 400, "invalid_argument"),
    ("list-state-case", "GET", "/api/v1/todos?state=Pending", "human", None, 400, "invalid_argument"),
    ("list-limit-0", "GET", "/api/v1/todos?limit=0", "human", None, 400, "invalid_argument"),
    ("list-limit-201", "GET", "/api/v1/todos?limit=201", "human", None, 400, "invalid_argument"),
    ("list-limit-x", "GET", "/api/v1/todos?limit=x", "human", None, 400, "invalid_argument"),
    ("list-limit-neg", "GET", "/api/v1/todos?limit=-1", "human", None, 400, "invalid_argument"),
    ("list-limit-empty", "GET", "/api/v1/todos?limit=", "human", None, 400, "invalid_argument"),
    ("list-unknown-param", "GET", "/api/v1/todos?colour=red", "human", None, 400, "invalid_argument"),
    ("list-bad-queue", "GET", "/api/v1/todos?queue=Bad%20Queue", "human", None, 400, "invalid_argument"),
    ("list-bad-queue-agent", "GET", "/api/v1/todos?queue=-build", "agent", None, 400, "invalid_argument"),
    ("list-bad-endpoint", "GET", "/api/v1/todos?endpoint=not-an-id", "human", None, 400, "invalid_argument"),
    ("list-revoked", "GET", "/api/v1/todos", "revoked", None, 401, "unauthenticated"),

    # POST /api/v1/todos/claim
    ("claim-no-auth", "POST", "/api/v1/todos/claim", "none", {}, 401, "unauthenticated"),
    ("claim-invalid-json", "POST", "/api/v1/todos/claim", "agent", b"{", 400, "invalid_argument"),
    ("claim-not-json", "POST", "/api/v1/todos/claim", "agent", b"queue=build", 400, "invalid_argument"),
    ("claim-trailing", "POST", "/api/v1/todos/claim", "agent", b"{} {}", 400, "invalid_argument"),
    ("claim-array", "POST", "/api/v1/todos/claim", "agent", b"[]", 400, "invalid_argument"),
    ("claim-null", "POST", "/api/v1/todos/claim", "agent", b"null", 400, "invalid_argument"),
    ("claim-string", "POST", "/api/v1/todos/claim", "agent", b'"build"', 400, "invalid_argument"),
    ("claim-bad-utf8", "POST", "/api/v1/todos/claim", "agent", b'{"claimant": "\xff\xfe"}', 400, "invalid_argument"),
    ("claim-unknown-field", "POST", "/api/v1/todos/claim", "agent", {"bogus": 1}, 400, "invalid_argument"),
    ("claim-lease-str", "POST", "/api/v1/todos/claim", "agent", {"lease_seconds": "30"}, 400, "invalid_argument"),
    ("claim-lease-0", "POST", "/api/v1/todos/claim", "agent", {"lease_seconds": 0}, 400, "invalid_argument"),
    ("claim-lease-86401", "POST", "/api/v1/todos/claim", "agent", {"lease_seconds": 86401}, 400, "invalid_argument"),
    ("claim-lease-neg", "POST", "/api/v1/todos/claim", "agent", {"lease_seconds": -5}, 400, "invalid_argument"),
    ("claim-lease-float", "POST", "/api/v1/todos/claim", "agent", {"lease_seconds": 30.5}, 400, "invalid_argument"),
    ("claim-lease-bool", "POST", "/api/v1/todos/claim", "agent", {"lease_seconds": True}, 400, "invalid_argument"),
    ("claim-wait-61", "POST", "/api/v1/todos/claim", "agent", {"wait_seconds": 61}, 400, "invalid_argument"),
    ("claim-wait-neg", "POST", "/api/v1/todos/claim", "agent", {"wait_seconds": -1}, 400, "invalid_argument"),
    ("claim-wait-str", "POST", "/api/v1/todos/claim", "agent", {"wait_seconds": "1"}, 400, "invalid_argument"),
    ("claim-wait-nan", "POST", "/api/v1/todos/claim", "agent", b'{"wait_seconds": NaN}', 400, "invalid_argument"),
    ("claim-bad-queue", "POST", "/api/v1/todos/claim", "agent", {"queue": "Bad Queue"}, 400, "invalid_argument"),
    ("claim-empty-queue", "POST", "/api/v1/todos/claim", "agent", {"queue": ""}, 400, "invalid_argument"),
    ("claim-long-queue", "POST", "/api/v1/todos/claim", "agent", {"queue": "a" * 65}, 400, "invalid_argument"),
    ("claim-queue-int", "POST", "/api/v1/todos/claim", "agent", {"queue": 5}, 400, "invalid_argument"),
    ("claim-queues-empty", "POST", "/api/v1/todos/claim", "agent", {"queues": []}, 400, "invalid_argument"),
    ("claim-queues-str", "POST", "/api/v1/todos/claim", "agent", {"queues": "build"}, 400, "invalid_argument"),
    ("claim-queues-bad", "POST", "/api/v1/todos/claim", "agent", {"queues": ["build", "Bad Queue"]}, 400,
     "invalid_argument"),
    ("claim-queue-and-queues", "POST", "/api/v1/todos/claim", "agent", {"queue": "build", "queues": ["build"]}, 400,
     "invalid_argument"),
    ("claim-claimant-empty", "POST", "/api/v1/todos/claim", "agent", {"claimant": ""}, 400, "invalid_argument"),
    ("claim-claimant-long", "POST", "/api/v1/todos/claim", "agent", {"claimant": "c" * 129}, 400, "invalid_argument"),
    ("claim-queue-out-of-scope", "POST", "/api/v1/todos/claim", "agent", {"queue": "elsewhere"}, 403, "forbidden"),
    ("claim-human-token", "POST", "/api/v1/todos/claim", "human", {}, 403, "forbidden"),
    ("claim-revoked", "POST", "/api/v1/todos/claim", "revoked", {}, 401, "unauthenticated"),

    # POST /api/v1/todos/{id}/claim
    ("claim-id-claimed", "POST", ACT % ("claimed", "claim"), "agent", {}, 409, "conflict"),
    ("claim-id-lease-str", "POST", ACT % ("pending", "claim"), "agent", {"lease_seconds": "30"}, 400,
     "invalid_argument"),
    ("claim-id-lease-0", "POST", ACT % ("pending", "claim"), "agent", {"lease_seconds": 0}, 400, "invalid_argument"),
    ("claim-id-lease-86401", "POST", ACT % ("pending", "claim"), "agent", {"lease_seconds": 86401}, 400,
     "invalid_argument"),
    ("claim-id-unknown-field", "POST", ACT % ("pending", "claim"), "agent", {"queue": "build"}, 400,
     "invalid_argument"),
    ("claim-id-invalid-json", "POST", ACT % ("pending", "claim"), "agent", b"{lease_seconds: 30}", 400,
     "invalid_argument"),
    ("claim-id-unknown-todo", "POST", ACT % ("unknown_todo", "claim"), "agent", {}, 404, "not_found"),
]

for action, extra in LEASED.items():
    ROWS += [
        (f"{action}-missing-lease-token", "POST", ACT % ("claimed", action), "agent", extra, 400, "invalid_argument"),
        (f"{action}-empty-lease-token", "POST", ACT % ("claimed", action), "agent", {"lease_token": "", **extra},
         400, "invalid_argument"),
        (f"{action}-lease-token-int", "POST", ACT % ("claimed", action), "agent", {"lease_token": 12345, **extra},
         400, "invalid_argument"),
        (f"{action}-lease-token-129", "POST", ACT % ("claimed", action), "agent",
         {"lease_token": "t" * 129, **extra}, 400, "invalid_argument"),
        (f"{action}-wrong-lease-token", "POST", ACT % ("claimed", action), "agent",
         {"lease_token": "x" * 22, **extra}, 409, "conflict"),
        (f"{action}-other-todos-token", "POST", ACT % ("claimed", action), "agent",
         {"lease_token": "$gated_token", **extra}, 409, "conflict"),
        (f"{action}-stale-lease-token", "POST", ACT % ("stale", action), "agent",
         {"lease_token": "$stale_token", **extra}, 409, "conflict"),
        (f"{action}-unknown-field", "POST", ACT % ("claimed", action), "agent",
         {"lease_token": "$claimed_token", **extra, "bogus": True}, 400, "invalid_argument"),
        (f"{action}-invalid-json", "POST", ACT % ("claimed", action), "agent", b'{"lease_token": ', 400,
         "invalid_argument"),
        (f"{action}-pending-todo", "POST", ACT % ("pending", action), "agent",
         {"lease_token": "$claimed_token", **extra}, 409, "conflict"),
        (f"{action}-unknown-todo", "POST", ACT % ("unknown_todo", action), "agent",
         {"lease_token": "$claimed_token", **extra}, 404, "not_found"),
        (f"{action}-human-token", "POST", ACT % ("claimed", action), "human",
         {"lease_token": "$claimed_token", **extra}, 403, "forbidden"),
        (f"{action}-no-auth", "POST", ACT % ("claimed", action), "none",
         {"lease_token": "$claimed_token", **extra}, 401, "unauthenticated"),
    ]

ROWS += [
    # heartbeat
    ("heartbeat-lease-0", "POST", ACT % ("claimed", "heartbeat"), "agent",
     {"lease_token": "$claimed_token", "lease_seconds": 0}, 400, "invalid_argument"),
    ("heartbeat-lease-str", "POST", ACT % ("claimed", "heartbeat"), "agent",
     {"lease_token": "$claimed_token", "lease_seconds": "60"}, 400, "invalid_argument"),
    ("heartbeat-note-int", "POST", ACT % ("claimed", "heartbeat"), "agent",
     {"lease_token": "$claimed_token", "note": 5}, 400, "invalid_argument"),
    ("heartbeat-note-long", "POST", ACT % ("claimed", "heartbeat"), "agent",
     {"lease_token": "$claimed_token", "note": "n" * 4097}, 400, "invalid_argument"),
    # complete
    ("complete-result-too-large", "POST", ACT % ("claimed", "complete"), "agent", oversized_result, 413,
     "too_large"),
    ("complete-result-nan", "POST", ACT % ("claimed", "complete"), "agent",
     lambda: b'{"lease_token": "$claimed_token", "result": NaN}', 400, "invalid_argument"),
    ("complete-result-infinity", "POST", ACT % ("claimed", "complete"), "agent",
     lambda: b'{"lease_token": "$claimed_token", "result": {"score": Infinity}}', 400, "invalid_argument"),
    ("complete-summary-int", "POST", ACT % ("claimed", "complete"), "agent",
     {"lease_token": "$claimed_token", "summary": 5}, 400, "invalid_argument"),
    ("complete-artifact-http", "POST", ACT % ("claimed", "complete"), "agent",
     {"lease_token": "$claimed_token", "artifact": "http://x"}, 400, "invalid_argument"),
    ("complete-artifact-ftp", "POST", ACT % ("claimed", "complete"), "agent",
     {"lease_token": "$claimed_token", "artifact": "ftp://x"}, 400, "invalid_argument"),
    ("complete-artifact-javascript", "POST", ACT % ("claimed", "complete"), "agent",
     {"lease_token": "$claimed_token", "artifact": "javascript:alert(1)"}, 400, "invalid_argument"),
    ("complete-artifact-file", "POST", ACT % ("claimed", "complete"), "agent",
     {"lease_token": "$claimed_token", "artifact": "file:///etc/passwd"}, 400, "invalid_argument"),
    ("complete-artifact-https-no-host", "POST", ACT % ("claimed", "complete"), "agent",
     {"lease_token": "$claimed_token", "artifact": "https://"}, 400, "invalid_argument"),
    ("complete-artifact-space", "POST", ACT % ("claimed", "complete"), "agent",
     {"lease_token": "$claimed_token", "artifact": "https://x y"}, 400, "invalid_argument"),
    ("complete-artifact-mcp-empty", "POST", ACT % ("claimed", "complete"), "agent",
     {"lease_token": "$claimed_token", "artifact": "mcp://"}, 400, "invalid_argument"),
    ("complete-artifact-int", "POST", ACT % ("claimed", "complete"), "agent",
     {"lease_token": "$claimed_token", "artifact": 5}, 400, "invalid_argument"),
    ("complete-gated-without-summary", "POST", ACT % ("gated", "complete"), "agent",
     {"lease_token": "$gated_token"}, 400, "invalid_argument"),
    # fail
    ("fail-without-error", "POST", ACT % ("claimed", "fail"), "agent", {"lease_token": "$claimed_token"}, 400,
     "invalid_argument"),
    ("fail-empty-error", "POST", ACT % ("claimed", "fail"), "agent",
     {"lease_token": "$claimed_token", "error": ""}, 400, "invalid_argument"),
    ("fail-error-obj", "POST", ACT % ("claimed", "fail"), "agent",
     {"lease_token": "$claimed_token", "error": {"msg": "x"}}, 400, "invalid_argument"),
    ("fail-retry-str", "POST", ACT % ("claimed", "fail"), "agent",
     {"lease_token": "$claimed_token", "error": "e", "retry": "no"}, 400, "invalid_argument"),
    ("fail-retry-in-neg", "POST", ACT % ("claimed", "fail"), "agent",
     {"lease_token": "$claimed_token", "error": "e", "retry_in_seconds": -1}, 400, "invalid_argument"),
    ("fail-retry-in-big", "POST", ACT % ("claimed", "fail"), "agent",
     {"lease_token": "$claimed_token", "error": "e", "retry_in_seconds": 86401}, 400, "invalid_argument"),
    # release, needs-input, block
    ("release-note-int", "POST", ACT % ("claimed", "release"), "agent",
     {"lease_token": "$claimed_token", "note": 5}, 400, "invalid_argument"),
    ("needs-input-without-question", "POST", ACT % ("claimed", "needs-input"), "agent",
     {"lease_token": "$claimed_token"}, 400, "invalid_argument"),
    ("needs-input-empty-question", "POST", ACT % ("claimed", "needs-input"), "agent",
     {"lease_token": "$claimed_token", "question": ""}, 400, "invalid_argument"),
    ("block-without-reason", "POST", ACT % ("claimed", "block"), "agent",
     {"lease_token": "$claimed_token"}, 400, "invalid_argument"),
    ("block-reason-list", "POST", ACT % ("claimed", "block"), "agent",
     {"lease_token": "$claimed_token", "reason": ["x"]}, 400, "invalid_argument"),
]

for action, body in HUMAN.items():
    ROWS += [
        (f"{action}-unknown-field", "POST", ACT % ("pending", action), "human", {**body, "bogus": 1}, 400,
         "invalid_argument"),
        (f"{action}-invalid-json", "POST", ACT % ("pending", action), "human", b"{,}", 400, "invalid_argument"),
        (f"{action}-array-body", "POST", ACT % ("pending", action), "human", b"[]", 400, "invalid_argument"),
        (f"{action}-unknown-todo", "POST", ACT % ("unknown_todo", action), "human", body, 404, "not_found"),
        (f"{action}-endpoint-token", "POST", ACT % ("pending", action), "agent", body, 403, "forbidden"),
        (f"{action}-no-auth", "POST", ACT % ("pending", action), "none", body, 401, "unauthenticated"),
    ]

ROWS += [
    # wrong types on human verbs
    ("approve-note-int", "POST", ACT % ("pending", "approve"), "human", {"note": 5}, 400, "invalid_argument"),
    ("request-changes-without-note", "POST", ACT % ("pending", "request-changes"), "human", {}, 400,
     "invalid_argument"),
    ("answer-without-answer", "POST", ACT % ("pending", "answer"), "human", {}, 400, "invalid_argument"),
    ("answer-int", "POST", ACT % ("pending", "answer"), "human", {"answer": 42}, 400, "invalid_argument"),
    ("answer-too-long", "POST", ACT % ("pending", "answer"), "human", {"answer": "a" * 16385}, 400,
     "invalid_argument"),
    ("defer-without-reason", "POST", ACT % ("pending", "defer"), "human", {}, 400, "invalid_argument"),
    ("defer-until-garbage", "POST", ACT % ("pending", "defer"), "human", {"reason": "r", "until": "tomorrow"}, 400,
     "invalid_argument"),
    ("defer-until-int", "POST", ACT % ("pending", "defer"), "human", {"reason": "r", "until": True}, 400,
     "invalid_argument"),
    ("defer-until-year-0", "POST", ACT % ("pending", "defer"), "human",
     {"reason": "r", "until": "0001-01-01T00:00:00+14:00"}, 400, "invalid_argument"),
    ("defer-until-year-10000", "POST", ACT % ("pending", "defer"), "human",
     {"reason": "r", "until": "9999-12-31T23:59:59-14:00"}, 400, "invalid_argument"),
    ("cancel-without-reason", "POST", ACT % ("pending", "cancel"), "human", {}, 400, "invalid_argument"),
    ("cancel-empty-reason", "POST", ACT % ("pending", "cancel"), "human", {"reason": ""}, 400, "invalid_argument"),
    ("cancel-reason-int", "POST", ACT % ("pending", "cancel"), "human", {"reason": 1}, 400, "invalid_argument"),
    ("reroute-quarantine", "POST", ACT % ("pending", "reroute"), "human", {"queue": "quarantine"}, 400,
     "invalid_argument"),
    ("reroute-malformed", "POST", ACT % ("pending", "reroute"), "human", {"queue": "Bad Queue"}, 400,
     "invalid_argument"),
    ("reroute-leading-dash", "POST", ACT % ("pending", "reroute"), "human", {"queue": "-build"}, 400,
     "invalid_argument"),
    ("reroute-without-queue", "POST", ACT % ("pending", "reroute"), "human", {}, 400, "invalid_argument"),
    ("reroute-queue-int", "POST", ACT % ("pending", "reroute"), "human", {"queue": 7}, 400, "invalid_argument"),
    ("reroute-unserved-queue", "POST", ACT % ("pending", "reroute"), "human", {"queue": "nobody-serves-this"}, 400,
     "invalid_argument"),
    # invalid state transitions
    ("approve-pending", "POST", ACT % ("pending", "approve"), "human", {}, 409, "conflict"),
    ("request-changes-pending", "POST", ACT % ("pending", "request-changes"), "human", {"note": "n"}, 409,
     "conflict"),
    ("answer-pending", "POST", ACT % ("pending", "answer"), "human", {"answer": "a"}, 409, "conflict"),
    ("resume-pending", "POST", ACT % ("pending", "resume"), "human", {}, 409, "conflict"),
    ("retry-pending", "POST", ACT % ("pending", "retry"), "human", {}, 409, "conflict"),
    ("undefer-pending", "POST", ACT % ("pending", "undefer"), "human", {}, 409, "conflict"),
    ("discard-pending", "POST", ACT % ("pending", "discard"), "human", {}, 409, "conflict"),
    ("defer-claimed", "POST", ACT % ("claimed", "defer"), "human", {"reason": "r"}, 409, "conflict"),
    ("reroute-claimed", "POST", ACT % ("claimed", "reroute"), "human", {"queue": "deploy"}, 409, "conflict"),
    ("approve-claimed", "POST", ACT % ("claimed", "approve"), "human", {}, 409, "conflict"),
    # unknown actions and ids
    ("unknown-action", "POST", ACT % ("pending", "explode"), "human", {}, 404, "not_found"),
    ("unknown-action-agent", "POST", ACT % ("claimed", "finish"), "agent", {"lease_token": "$claimed_token"}, 404,
     "not_found"),
    ("unknown-action-case", "POST", ACT % ("claimed", "Complete"), "agent", {"lease_token": "$claimed_token"}, 404,
     "not_found"),
    ("unknown-action-underscore", "POST", ACT % ("claimed", "needs_input"), "agent",
     {"lease_token": "$claimed_token", "question": "q"}, 404, "not_found"),
    ("get-unknown-todo", "GET", "/api/v1/todos/{unknown_todo}", "human", None, 404, "not_found"),
    ("get-unknown-todo-agent", "GET", "/api/v1/todos/{unknown_todo}", "agent", None, 404, "not_found"),
    ("get-malformed-todo-id", "GET", "/api/v1/todos/td_ZZ%27%20OR%201=1--", "human", None, 404, "not_found"),
    ("get-endpoint-id-as-todo", "GET", "/api/v1/todos/{ep}", "human", None, 404, "not_found"),
    ("get-todo-no-auth", "GET", "/api/v1/todos/{pending}", "none", None, 401, "unauthenticated"),

    # POST /api/v1/endpoints
    ("vend-reserved-queue", "POST", "/api/v1/endpoints", "human", {"name": "q", "queues": ["quarantine"]}, 400,
     "invalid_argument"),
    ("vend-reserved-among-others", "POST", "/api/v1/endpoints", "human",
     {"name": "q", "queues": ["build", "quarantine"]}, 400, "invalid_argument"),
    ("vend-malformed-queue", "POST", "/api/v1/endpoints", "human", {"name": "q", "queues": ["Bad Queue"]}, 400,
     "invalid_argument"),
    ("vend-queue-too-long", "POST", "/api/v1/endpoints", "human", {"name": "q", "queues": ["q" * 65]}, 400,
     "invalid_argument"),
    ("vend-no-queues", "POST", "/api/v1/endpoints", "human", {"name": "q", "queues": []}, 400, "invalid_argument"),
    ("vend-queues-str", "POST", "/api/v1/endpoints", "human", {"name": "q", "queues": "build"}, 400,
     "invalid_argument"),
    ("vend-unknown-verb", "POST", "/api/v1/endpoints", "human", {"name": "q", "queues": ["build"], "verbs": ["fly"]},
     400, "invalid_argument"),
    ("vend-no-verbs", "POST", "/api/v1/endpoints", "human", {"name": "q", "queues": ["build"], "verbs": []}, 400,
     "invalid_argument"),
    ("vend-lease-59", "POST", "/api/v1/endpoints", "human",
     {"name": "q", "queues": ["build"], "default_lease_seconds": 59}, 400, "invalid_argument"),
    ("vend-lease-86401", "POST", "/api/v1/endpoints", "human",
     {"name": "q", "queues": ["build"], "default_lease_seconds": 86401}, 400, "invalid_argument"),
    ("vend-lease-str", "POST", "/api/v1/endpoints", "human",
     {"name": "q", "queues": ["build"], "default_lease_seconds": "120"}, 400, "invalid_argument"),
    ("vend-webhook-max-neg", "POST", "/api/v1/endpoints", "human",
     {"name": "q", "queues": ["build"], "webhook_max": -1}, 400, "invalid_argument"),
    ("vend-duplicate-name", "POST", "/api/v1/endpoints", "human", {"name": "agent", "queues": ["build"]}, 409,
     "conflict"),
    ("vend-duplicate-name-of-revoked", "POST", "/api/v1/endpoints", "human", {"name": "revoked", "queues": ["build"]},
     409, "conflict"),
    ("vend-extra-field", "POST", "/api/v1/endpoints", "human", {"name": "q", "queues": ["build"], "admin": True},
     400, "invalid_argument"),
    ("vend-token-field", "POST", "/api/v1/endpoints", "human",
     {"name": "q", "queues": ["build"], "token": "sbk_chosen"}, 400, "invalid_argument"),
    ("vend-missing-name", "POST", "/api/v1/endpoints", "human", {"queues": ["build"]}, 400, "invalid_argument"),
    ("vend-bad-name", "POST", "/api/v1/endpoints", "human", {"name": "bad name", "queues": ["build"]}, 400,
     "invalid_argument"),
    ("vend-long-name", "POST", "/api/v1/endpoints", "human", {"name": "n" * 65, "queues": ["build"]}, 400,
     "invalid_argument"),
    ("vend-invalid-json", "POST", "/api/v1/endpoints", "human", b'{"name": "q", "queues": ["build"]', 400,
     "invalid_argument"),
    ("vend-empty-body", "POST", "/api/v1/endpoints", "human", None, 400, "invalid_argument"),
    ("vend-endpoint-token", "POST", "/api/v1/endpoints", "agent", {"name": "q", "queues": ["build"]}, 403,
     "forbidden"),
    ("vend-no-auth", "POST", "/api/v1/endpoints", "none", {"name": "q", "queues": ["build"]}, 401,
     "unauthenticated"),
    ("list-endpoints-endpoint-token", "GET", "/api/v1/endpoints", "agent", None, 403, "forbidden"),

    # POST /api/v1/endpoints/{id}/revoke
    ("revoke-unknown", "POST", "/api/v1/endpoints/{unknown_ep}/revoke", "human", None, 404, "not_found"),
    ("revoke-extra-field", "POST", "/api/v1/endpoints/{ep}/revoke", "human", {"force": True}, 400,
     "invalid_argument"),
    ("revoke-endpoint-token", "POST", "/api/v1/endpoints/{ep}/revoke", "agent", None, 403, "forbidden"),

    # POST /api/v1/endpoints/{id}/todos
    ("push-title-513", "POST", "/api/v1/endpoints/{ep}/todos", "human", {"title": "t" * 513, "queue": "build"}, 400,
     "invalid_argument"),
    ("push-title-empty", "POST", "/api/v1/endpoints/{ep}/todos", "human", {"title": "", "queue": "build"}, 400,
     "invalid_argument"),
    ("push-title-int", "POST", "/api/v1/endpoints/{ep}/todos", "human", {"title": 1, "queue": "build"}, 400,
     "invalid_argument"),
    ("push-title-nul", "POST", "/api/v1/endpoints/{ep}/todos", "human", {"title": "\u0000", "queue": "build"}, 400,
     "invalid_argument"),
    ("push-missing-title", "POST", "/api/v1/endpoints/{ep}/todos", "human", {"queue": "build"}, 400,
     "invalid_argument"),
    ("push-missing-queue", "POST", "/api/v1/endpoints/{ep}/todos", "human", {"title": "t"}, 400, "invalid_argument"),
    ("push-queue-out-of-scope", "POST", "/api/v1/endpoints/{ep}/todos", "human", {"title": "t", "queue": "other"},
     400, "invalid_argument"),
    ("push-queue-quarantine", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     {"title": "t", "queue": "quarantine"}, 400, "invalid_argument"),
    ("push-queue-malformed", "POST", "/api/v1/endpoints/{ep}/todos", "human", {"title": "t", "queue": "Bad Queue"},
     400, "invalid_argument"),
    ("push-priority-str", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     {"title": "t", "queue": "build", "priority": "1"}, 400, "invalid_argument"),
    ("push-priority-big", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     {"title": "t", "queue": "build", "priority": 10 ** 30}, 400, "invalid_argument"),
    ("push-key-empty", "POST", "/api/v1/endpoints/{ep}/todos", "human", {"title": "t", "queue": "build", "key": ""},
     400, "invalid_argument"),
    ("push-key-257", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     {"title": "t", "queue": "build", "key": "k" * 257}, 400, "invalid_argument"),
    ("push-key-nul", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     {"title": "t", "queue": "build", "key": "\u0000k"}, 400, "invalid_argument"),
    ("push-payload-nan", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     b'{"title": "t", "queue": "build", "payload": NaN}', 400, "invalid_argument"),
    ("push-payload-infinity", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     b'{"title": "t", "queue": "build", "payload": {"x": -Infinity}}', 400, "invalid_argument"),
    ("push-payload-deep", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     lambda: b'{"title": "t", "queue": "build", "payload": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400,
     "invalid_argument"),
    ("push-extra-field", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     {"title": "t", "queue": "build", "state": "done"}, 400, "invalid_argument"),
    ("push-work-item-wrong-schema", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     {"title": "t", "queue": "build", "work_item": {**WORK_ITEM, "schema": "switchboard.work_item.v2"}}, 400,
     "invalid_argument"),
    ("push-work-item-no-schema", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     {"title": "t", "queue": "build", "work_item": {"objective": "o"}}, 400, "invalid_argument"),
    ("push-work-item-no-objective", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     {"title": "t", "queue": "build", "work_item": {"schema": "switchboard.work_item.v1"}}, 400, "invalid_argument"),
    ("push-work-item-unknown-field", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     {"title": "t", "queue": "build", "work_item": {**WORK_ITEM, "priority": "high"}}, 400, "invalid_argument"),
    ("push-work-item-bad-gate", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     {"title": "t", "queue": "build", "work_item": {**WORK_ITEM, "approval_gates": ["deploy"]}}, 400,
     "invalid_argument"),
    ("push-work-item-not-object", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     {"title": "t", "queue": "build", "work_item": "do it"}, 400, "invalid_argument"),
    ("push-depends-on-unknown", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     {"title": "t", "queue": "build", "work_item": {**WORK_ITEM, "depends_on": [UNKNOWN_TODO]}}, 404, "not_found"),
    ("push-depends-on-malformed", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     {"title": "t", "queue": "build", "work_item": {**WORK_ITEM, "depends_on": ["not-a-todo"]}}, 400,
     "invalid_argument"),
    ("push-depends-on-str", "POST", "/api/v1/endpoints/{ep}/todos", "human",
     {"title": "t", "queue": "build", "work_item": {**WORK_ITEM, "depends_on": UNKNOWN_TODO}}, 400,
     "invalid_argument"),
    ("push-unknown-endpoint", "POST", "/api/v1/endpoints/{unknown_ep}/todos", "human",
     {"title": "t", "queue": "build"}, 404, "not_found"),
    ("push-revoked-endpoint", "POST", "/api/v1/endpoints/{revoked_ep}/todos", "human",
     {"title": "t", "queue": "build"}, 409, "conflict"),
    ("push-endpoint-token", "POST", "/api/v1/endpoints/{ep}/todos", "agent", {"title": "t", "queue": "build"}, 403,
     "forbidden"),
    ("push-no-auth", "POST", "/api/v1/endpoints/{ep}/todos", "none", {"title": "t", "queue": "build"}, 401,
     "unauthenticated"),

    # request bodies over 1 MiB, declared or streamed
    ("claim-body-over-1mib", "POST", "/api/v1/todos/claim", "agent", big_body(), 413, "too_large"),
    ("push-body-over-1mib", "POST", "/api/v1/endpoints/{ep}/todos", "human", big_push_body, 413, "too_large"),
    ("complete-body-over-1mib", "POST", ACT % ("claimed", "complete"), "agent",
     lambda: json.dumps({"lease_token": "$claimed_token", "result": "r" * (MIB + 1)}).encode(), 413, "too_large"),
    ("vend-body-over-1mib", "POST", "/api/v1/endpoints", "human", big_body(), 413, "too_large"),
    ("claim-body-streamed-over-1mib", "POST", "/api/v1/todos/claim", "agent", "stream", 413, "too_large"),
    ("claim-bad-content-length", "POST", "/api/v1/todos/claim", "agent", "bad-length", 400, "invalid_argument"),

    # unknown routes answer the error body too
    ("unknown-route", "GET", "/nope", "none", None, 404, "not_found"),
    ("unknown-api-route", "GET", "/api/v1/nope", "human", None, 404, "not_found"),
    ("unknown-api-version", "GET", "/api/v2/me", "human", None, 404, "not_found"),
    ("unknown-deeper-route", "POST", ACT % ("pending", "approve") + "/now", "human", {}, 404, "not_found"),
    ("unknown-endpoint-subroute", "POST", "/api/v1/endpoints/{ep}/explode", "human", {}, 404, "not_found"),
]


def _param(row):
    row_id, *rest = row
    return pytest.param(*rest, id=row_id)


def test_row_ids_are_unique():
    ids = [row[0] for row in ROWS]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("method,path,auth,body,status,code", [_param(r) for r in ROWS])
def test_bad_input_is_refused_cleanly_and_changes_nothing(world, scene, db_path, method, path, auth, body, status,
                                                          code):
    url = path.format(**scene.ids)
    headers = headers_for(auth, scene)
    kwargs: dict = {}
    if body == "stream":
        kwargs["content"] = chunked_big_body()
    elif body == "bad-length":
        kwargs["content"] = b"{}"
        headers["Content-Length"] = "2x"
    elif callable(body):
        raw = body()
        for name, token in scene.tokens.items():
            raw = raw.replace(name.encode(), token.encode())
        kwargs["content"] = raw
    elif isinstance(body, bytes):
        kwargs["content"] = body
    elif body is not None:
        kwargs["json"] = fill(body, scene.tokens)

    before = snapshot(db_path)
    response = world.client.request(method, url, headers=headers, **kwargs)

    assert response.status_code != 500, f"500 on bad input: {response.text}"
    assert response.status_code == status, (response.status_code, response.text[:300])
    assert response.headers["content-type"].startswith("application/json"), response.headers
    answer = response.json()
    assert answer["error"] == code, answer
    message = answer.get("message")
    assert isinstance(message, str) and message.strip(), answer
    assert "\n" not in message and "\r" not in message, answer
    for token in (scene.agent.token, scene.alice.token, *scene.tokens.values()):
        assert token not in response.text
    assert snapshot(db_path) == before, "a refused request changed the database"


def test_the_scene_is_what_the_rows_assume(world, scene):
    """Guards the table: the todos are in the states the rows rely on, and the tokens are live or stale."""
    states = {name: world.client.get(f"/api/v1/todos/{scene.ids[name]}", headers=scene.alice.auth).json()["state"]
              for name in ("pending", "claimed", "stale", "gated")}
    assert states == {"pending": "pending", "claimed": "claimed", "stale": "claimed", "gated": "claimed"}
    beat = world.act(scene.agent, scene.ids["stale"], "heartbeat", lease_token=scene.tokens["$current_token"])
    assert beat.status_code == 200, beat.text
    beat = world.act(scene.agent, scene.ids["claimed"], "heartbeat", lease_token=scene.tokens["$claimed_token"])
    assert beat.status_code == 200, beat.text
    me = world.client.get("/api/v1/me", headers=scene.agent.auth)
    assert me.status_code == 200
