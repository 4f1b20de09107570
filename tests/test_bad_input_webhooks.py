"""SPEC sections 3, 5, 9 and 12, table-driven, for the routes tests/test_bad_input.py does not cover: webhooks,
their secrets, rules, dry runs, routes and events; friends; quarantine release; ingress (`POST /hooks/{token}`);
the SSE doorbell; and MCP at /mcp.

Every row is one malformed or refused request. It must get the right 4xx (never a 500), the error body
`{"error": code, "message": one line}` where the route answers one (/mcp answers JSON-RPC for JSON-RPC
failures), leak no token or secret, and change nothing: every table of the real SQLite file is compared before
and after."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import producers
import pytest

UNKNOWN_TODO = "td_" + "0" * 20
UNKNOWN_ENDPOINT = "ep_" + "0" * 20
UNKNOWN_WEBHOOK = "wh_" + "0" * 20
UNKNOWN_EVENT = "ev_" + "0" * 20
UNKNOWN_EDGE = "fr_" + "0" * 20
MIB = 1 << 20
STRIPE_SECRET = "whsec_" + "a" * 32
SLACK_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"

from conftest import snapshot, template_fixtures
from helpers import hook_token

# -- the scene -------------------------------------------------------------------------------------

@dataclass
class Scene:
    """Three humans and what the rows refer to.

    alice: `router` (triage, hold; verbs all; owns the webhooks), `worker` (build; drain), `lane` (lane-s; a
    route of the github webhook), `capped` (triage; verbs webhooks; webhook_max 1, already used), `revoked`
    (build, lane-x: the only endpoint granting lane-x), and `doomed` (revoked after it got a generic webhook). Webhooks of router: github (one stored delivery),
    generic, stripe and slack (secrets supplied), cairn, stripe without a secret, and `held` (generic on queue
    build, which no target grants, so its one delivery is quarantined with reason no_target).
    bob: `bobs` (triage, bob-only; all) with a generic webhook, one stored delivery and one pushed todo.
    carol: `carols` (triage); alice asked carol for a friend edge that carol has not approved."""
    principals: dict  # header kind -> Authorization header value
    ids: dict         # placeholder -> id or token, for paths ({name}) and bodies ("$name")
    secrets: dict     # webhook name -> secret
    clock: Any

    def now_s(self) -> int:
        return self.clock.now_ms() // 1000

    def leaks(self) -> list[str]:
        """Strings no answer may ever contain."""
        tokens = [v.removeprefix("Bearer ") for v in self.principals.values()]
        hook_tokens = [v for k, v in self.ids.items() if k.endswith("_token")]
        return [*tokens, *hook_tokens, *self.secrets.values()]


def build_scene(world, clock) -> Scene:
    client = world.client
    alice, bob, carol = world.human("alice"), world.human("bob"), world.human("carol")

    def vend(human, name: str, queues: list[str], **extra) -> dict:
        r = client.post("/api/v1/endpoints", headers=human.auth, json={"name": name, "queues": queues, **extra})
        assert r.status_code == 201, r.text
        return r.json()

    def webhook(human, endpoint: dict, provider: str, queue: str, **extra) -> dict:
        made = world.webhook(human, endpoint, provider, queue, **extra)
        made["token"] = hook_token(made["url"])
        return made

    def ingest(hook: dict, raw: bytes, headers: dict) -> dict:
        r = world.deliver(hook, raw, headers)
        assert r.status_code == 202, r.text
        return r.json()

    def push(human, endpoint: dict, queue: str, title: str) -> dict:
        r = client.post(f"/api/v1/endpoints/{endpoint['id']}/todos", headers=human.auth,
                        json={"title": title, "queue": queue})
        assert r.status_code == 201, r.text
        return r.json()

    router = vend(alice, "router", ["triage", "hold"], verbs=["all"], webhook_max=20)
    worker = vend(alice, "worker", ["build"])
    lane = vend(alice, "lane", ["lane-s"])
    capped = vend(alice, "capped", ["triage"], verbs=["webhooks"], webhook_max=1)
    revoked = vend(alice, "revoked", ["build", "lane-x"])
    doomed = vend(alice, "doomed", ["triage"])

    gh = webhook(alice, router, "github", "triage")
    assert client.post(f"/api/v1/webhooks/{gh['id']}/routes", headers=alice.auth,
                       json={"endpoint_id": lane["id"]}).status_code == 201
    raw, headers = producers.github("issues.opened", gh["secret"])
    gh_delivery = ingest(gh, raw, headers)
    generic = webhook(alice, router, "generic", "triage")
    stripe = webhook(alice, router, "stripe", "triage", secret=STRIPE_SECRET)
    slack = webhook(alice, router, "slack", "hold", secret=SLACK_SECRET)
    cairn = webhook(alice, router, "cairn", "triage")
    stripe_unset = webhook(alice, router, "stripe", "triage")
    held_hook = webhook(alice, router, "generic", "build")
    held_delivery = ingest(held_hook, b'{"job": "held"}', {"X-Delivery-Id": "held-1"})
    assert held_delivery["disposition"] == "quarantined", held_delivery
    capped_hook = webhook(alice, capped, "generic", "triage")
    doomed_hook = webhook(alice, doomed, "generic", "triage")
    for endpoint in (revoked, doomed):
        r = client.post(f"/api/v1/endpoints/{endpoint['id']}/revoke", headers=alice.auth)
        assert r.status_code == 200, r.text
    operator_todo = push(alice, worker, "build", "operator work")

    bobs = vend(bob, "bobs", ["triage", "bob-only"], verbs=["all"])
    bob_hook = webhook(bob, bobs, "generic", "triage")
    bob_delivery = ingest(bob_hook, b'{"job": "bob"}', {"X-Delivery-Id": "bob-1"})
    bob_todo = push(bob, bobs, "triage", "bob's work")

    carols = vend(carol, "carols", ["triage"])
    edge = client.post("/api/v1/friends", headers=alice.auth, json={"human": "carol"})
    assert edge.status_code == 201, edge.text

    principals = {
        "human": f"Bearer {alice.token}", "bob": f"Bearer {bob.token}", "carol": f"Bearer {carol.token}",
        "router": f"Bearer {router['token']}", "worker": f"Bearer {worker['token']}",
        "capped": f"Bearer {capped['token']}", "revoked": f"Bearer {revoked['token']}",
        "bobs": f"Bearer {bobs['token']}",
    }
    ids = {
        "alice_id": alice.id, "router": router["id"], "worker": worker["id"], "lane": lane["id"],
        "capped": capped["id"], "revoked_ep": revoked["id"], "bob_ep": bobs["id"], "carol_ep": carols["id"],
        "unknown_ep": UNKNOWN_ENDPOINT,
        "gh": gh["id"], "generic": generic["id"], "stripe": stripe["id"], "slack": slack["id"],
        "cairn": cairn["id"], "held_hook": held_hook["id"], "capped_hook": capped_hook["id"],
        "bob_hook": bob_hook["id"], "unknown_hook": UNKNOWN_WEBHOOK,
        "gh_event": gh_delivery["event_id"], "held_event": held_delivery["event_id"],
        "bob_event": bob_delivery["event_id"], "op_event": operator_todo["event_id"], "unknown_event": UNKNOWN_EVENT,
        "pending": gh_delivery["todos"][0]["id"], "held": held_delivery["todos"][0]["id"], "bob_todo": bob_todo["id"],
        "unknown_todo": UNKNOWN_TODO,
        "pending_edge": edge.json()["id"], "unknown_edge": UNKNOWN_EDGE,
        "gh_token": gh["token"], "stripe_token": stripe["token"], "slack_token": slack["token"],
        "cairn_token": cairn["token"], "stripe_unset_token": stripe_unset["token"], "doomed_token": doomed_hook["token"],
        "generic_token": generic["token"],
    }
    assert operator_todo["event_id"], "an operator-authored todo is recorded as an event"
    secrets_ = {"gh": gh["secret"], "cairn": cairn["secret"], "stripe": STRIPE_SECRET, "slack": SLACK_SECRET}
    return Scene(principals, ids, secrets_, clock)


# The scene is made once; every row starts from its own copy of that database, with an app of its own.
template, db_path, clock = template_fixtures(build_scene)


@pytest.fixture
def scene(world, clock, template) -> Scene:
    return replace(template.value(), clock=clock)


def fill(value, ids: dict):
    """Replace "$name" strings anywhere in a JSON-shaped value by the scene's ids."""
    if isinstance(value, str) and value.startswith("$") and value[1:] in ids:
        return ids[value[1:]]
    if isinstance(value, list):
        return [fill(v, ids) for v in value]
    if isinstance(value, dict):
        return {k: fill(v, ids) for k, v in value.items()}
    return value


def headers_for(kind: str, scene: Scene) -> dict:
    if kind == "none":
        return {}
    if kind.startswith("raw:"):
        return {"Authorization": kind[4:]}
    return {"Authorization": scene.principals[kind]}


@dataclass(frozen=True)
class Raw:
    """A body built from the scene: `make(scene)` returns (bytes, extra headers)."""
    make: Callable[[Scene], tuple[bytes, dict]]


def rule(rule_id: str = "r", expr: str = "true", action: dict | None = None, **extra) -> dict:
    return {"id": rule_id, "expr": expr, "action": action if action is not None else {"drop": True}, **extra}


def rules(*items: dict, **extra) -> dict:
    return {"rules": list(items), **extra}


# -- deliveries for ingress rows -------------------------------------------------------------------

def github_bad_signature(scene: Scene) -> tuple[bytes, dict]:
    raw, headers = producers.github("issues.opened", scene.secrets["gh"], patch={"issue": {"number": 2}})
    return raw, {**headers, "X-Hub-Signature-256": "sha256=" + producers.hex_hmac("not the secret", raw)}


def github_missing_signature(scene: Scene) -> tuple[bytes, dict]:
    raw, headers = producers.github("issues.opened", scene.secrets["gh"], patch={"issue": {"number": 3}})
    return raw, {k: v for k, v in headers.items() if k != "X-Hub-Signature-256"}


def github_malformed_signature(scene: Scene) -> tuple[bytes, dict]:
    raw, headers = producers.github("issues.opened", scene.secrets["gh"], patch={"issue": {"number": 4}})
    return raw, {**headers, "X-Hub-Signature-256": "sha256=not-hex"}


def github_tampered_body(scene: Scene) -> tuple[bytes, dict]:
    raw, headers = producers.github("issues.opened", scene.secrets["gh"], patch={"issue": {"number": 5}})
    return raw.replace(b'"number": 5', b'"number": 6'), headers


def github_over_5mib(scene: Scene) -> tuple[bytes, dict]:
    big = b"{" + b" " * (5 * MIB) + b"}"
    _, headers = producers.github("ping", scene.secrets["gh"])
    return big, {**headers, "X-Hub-Signature-256": "sha256=" + producers.hex_hmac(scene.secrets["gh"], big)}


def cairn_stale(scene: Scene) -> tuple[bytes, dict]:
    return producers.cairn(scene.secrets["cairn"], patch={"event_id": "e-stale"}, created_at=scene.now_s() - 301)


def cairn_future(scene: Scene) -> tuple[bytes, dict]:
    return producers.cairn(scene.secrets["cairn"], patch={"event_id": "e-future"}, created_at=scene.now_s() + 301)


def cairn_created_at(value: bytes, event_id: str) -> Raw:
    """A correctly signed cairn body whose `created_at` is the raw JSON `value` (a number, say)."""
    def make(scene: Scene) -> tuple[bytes, dict]:
        raw, headers = producers.cairn(scene.secrets["cairn"], patch={"event_id": event_id}, created_at=scene.now_s())
        stamp = json.loads(raw)["created_at"]
        raw = raw.replace(json.dumps(stamp).encode(), value, 1)
        return raw, {**headers, "X-Cairn-Signature": "sha256=" + producers.hex_hmac(scene.secrets["cairn"], raw)}
    return Raw(make)


def cairn_event_id_mismatch(scene: Scene) -> tuple[bytes, dict]:
    raw, headers = producers.cairn(scene.secrets["cairn"], patch={"event_id": "e-1"}, created_at=scene.now_s())
    return raw, {**headers, "X-Cairn-Event-Id": "someone-else"}


STRIPE_EVENT = {"id": "evt_1", "type": "invoice.paid", "data": {"object": {"id": "in_1"}}}
SLACK_EVENT = {"type": "event_callback", "event_id": "Ev1", "event": {"type": "app_mention", "text": "hi"}}


def stripe_stale(scene: Scene) -> tuple[bytes, dict]:
    return producers.stripe(STRIPE_SECRET, STRIPE_EVENT, at=scene.now_s() - 301)


def stripe_future(scene: Scene) -> tuple[bytes, dict]:
    return producers.stripe(STRIPE_SECRET, STRIPE_EVENT, at=scene.now_s() + 301)


def stripe_wrong_secret(scene: Scene) -> tuple[bytes, dict]:
    return producers.stripe("whsec_" + "b" * 32, STRIPE_EVENT, at=scene.now_s())


def stripe_no_timestamp(scene: Scene) -> tuple[bytes, dict]:
    raw, headers = producers.stripe(STRIPE_SECRET, STRIPE_EVENT, at=scene.now_s())
    return raw, {**headers, "Stripe-Signature": headers["Stripe-Signature"].split(",", 1)[1]}


def stripe_fresh(scene: Scene) -> tuple[bytes, dict]:
    return producers.stripe(STRIPE_SECRET, STRIPE_EVENT, at=scene.now_s())


def slack_stale(scene: Scene) -> tuple[bytes, dict]:
    return producers.slack(SLACK_SECRET, SLACK_EVENT, at=scene.now_s() - 301)


def slack_future(scene: Scene) -> tuple[bytes, dict]:
    return producers.slack(SLACK_SECRET, SLACK_EVENT, at=scene.now_s() + 301)


def slack_bad_timestamp(scene: Scene) -> tuple[bytes, dict]:
    raw, headers = producers.slack(SLACK_SECRET, SLACK_EVENT, at=scene.now_s())
    return raw, {**headers, "X-Slack-Request-Timestamp": "yesterday"}


def slack_missing_timestamp(scene: Scene) -> tuple[bytes, dict]:
    raw, headers = producers.slack(SLACK_SECRET, SLACK_EVENT, at=scene.now_s())
    return raw, {k: v for k, v in headers.items() if k != "X-Slack-Request-Timestamp"}


def slack_forged_challenge(scene: Scene) -> tuple[bytes, dict]:
    return producers.slack("not the secret", {"type": "url_verification", "challenge": "c"}, at=scene.now_s())


def generic_delivery(scene: Scene) -> tuple[bytes, dict]:
    return b'{"job": "x"}', {"X-Delivery-Id": "fresh-1"}


def big_json(field: str, size: int = MIB + 1) -> Raw:
    return Raw(lambda scene: (json.dumps({field: "x" * size}).encode(), {"Content-Type": "application/json"}))


# -- the table ---------------------------------------------------------------------------------------
# (id, method, path template, headers kind, body, expected status, expected error code)
# body: None (no body), bytes (sent as is), Raw (built from the scene), or a JSON value ("$name" -> scene id).

HOOK = {"provider": "github", "queue": "triage", "endpoint_id": "$router"}
WH = "/api/v1/webhooks/{gh}"
RULES = "/api/v1/webhooks/{gh}/rules"
TEST = "/api/v1/webhooks/{gh}/rules/test"
ROUTES = "/api/v1/webhooks/{gh}/routes"
RQ = "/api/v1/todos/{%s}/release-quarantine"
BAD, FORBIDDEN, NOT_FOUND, CONFLICT = "invalid_argument", "forbidden", "not_found", "conflict"

FORBIDDEN_EXPRS = [
    ("env", "env.HOME"), ("env-bare", "env"), ("dollar-env", "$ENV.PATH"), ("input", "input"),
    ("inputs", "[inputs]"), ("input-filename", "input_filename"), ("input-line-number", "input_line_number"),
    ("debug", ". | debug"), ("stderr", ". | stderr"), ("halt", "halt"), ("halt-error", 'halt_error("x")'),
    ("now", "now > 0"), ("localtime", "0 | localtime"), ("gmtime", "0 | gmtime"), ("mktime", "[] | mktime"),
    ("strftime", '0 | strftime("%Y")'), ("strflocaltime", '0 | strflocaltime("%Y")'), ("loc", "$__loc__"),
    ("import", 'import "a" as a; .'), ("include", 'include "a"; .'), ("get-search-list", "get_search_list"),
    ("env-in-interpolation", '"\\(env)" | length > 0'), ("now-after-pipe", ".payload | now"),
    ("env-in-second-rule-position", "false or (env | length > 0)"),
]

ROWS: list[tuple] = [
    # POST /api/v1/webhooks
    ("create-unknown-provider", "POST", "/api/v1/webhooks", "human", {**HOOK, "provider": "gitlab"}, 400, BAD),
    ("create-provider-case", "POST", "/api/v1/webhooks", "human", {**HOOK, "provider": "GitHub"}, 400, BAD),
    ("create-provider-int", "POST", "/api/v1/webhooks", "human", {**HOOK, "provider": 1}, 400, BAD),
    ("create-missing-provider", "POST", "/api/v1/webhooks", "human", {"queue": "triage", "endpoint_id": "$router"},
     400, BAD),
    ("create-missing-queue", "POST", "/api/v1/webhooks", "human", {"provider": "github", "endpoint_id": "$router"},
     400, BAD),
    ("create-malformed-queue", "POST", "/api/v1/webhooks", "human", {**HOOK, "queue": "Bad Queue"}, 400, BAD),
    ("create-queue-too-long", "POST", "/api/v1/webhooks", "human", {**HOOK, "queue": "q" * 65}, 400, BAD),
    ("create-queue-leading-dot", "POST", "/api/v1/webhooks", "human", {**HOOK, "queue": ".triage"}, 400, BAD),
    ("create-reserved-queue", "POST", "/api/v1/webhooks", "human", {**HOOK, "queue": "quarantine"}, 400, BAD),
    ("create-queue-list", "POST", "/api/v1/webhooks", "human", {**HOOK, "queue": ["triage"]}, 400, BAD),
    ("create-queue-unscoped", "POST", "/api/v1/webhooks", "human", {**HOOK, "queue": "nobody-has-it"}, 400, BAD),
    ("create-queue-only-bobs", "POST", "/api/v1/webhooks", "bob",
     {"provider": "github", "queue": "build", "endpoint_id": "$bob_ep"}, 400, BAD),
    ("create-queue-only-revoked", "POST", "/api/v1/webhooks", "human",
     {**HOOK, "queue": "lane-x"}, 400, BAD),
    ("create-secret-15", "POST", "/api/v1/webhooks", "human", {**HOOK, "secret": "s" * 15}, 400, BAD),
    ("create-secret-513", "POST", "/api/v1/webhooks", "human", {**HOOK, "secret": "s" * 513}, 400, BAD),
    ("create-secret-newline", "POST", "/api/v1/webhooks", "human", {**HOOK, "secret": "a" * 16 + "\n"}, 400, BAD),
    ("create-secret-tab", "POST", "/api/v1/webhooks", "human", {**HOOK, "secret": "a" * 8 + "\t" + "a" * 8}, 400,
     BAD),
    ("create-secret-nul", "POST", "/api/v1/webhooks", "human", {**HOOK, "secret": "\u0000" + "a" * 16}, 400, BAD),
    ("create-secret-del", "POST", "/api/v1/webhooks", "human", {**HOOK, "secret": "a" * 16 + "\u007f"}, 400, BAD),
    ("create-secret-int", "POST", "/api/v1/webhooks", "human", {**HOOK, "secret": 1234567890123456789}, 400, BAD),
    ("create-stripe-secret-without-whsec", "POST", "/api/v1/webhooks", "human",
     {**HOOK, "provider": "stripe", "secret": "not-a-stripe-secret-value"}, 400, BAD),
    ("create-stripe-secret-wrong-case", "POST", "/api/v1/webhooks", "human",
     {**HOOK, "provider": "stripe", "secret": "WHSEC_" + "a" * 32}, 400, BAD),
    ("create-generic-with-secret", "POST", "/api/v1/webhooks", "human",
     {**HOOK, "provider": "generic", "secret": "x" * 20}, 400, BAD),
    ("create-no-endpoint-id-human", "POST", "/api/v1/webhooks", "human", {"provider": "github", "queue": "triage"},
     400, BAD),
    ("create-endpoint-id-null-human", "POST", "/api/v1/webhooks", "human", {**HOOK, "endpoint_id": None}, 400, BAD),
    ("create-foreign-endpoint", "POST", "/api/v1/webhooks", "human", {**HOOK, "endpoint_id": "$bob_ep"}, 404,
     NOT_FOUND),
    ("create-unknown-endpoint", "POST", "/api/v1/webhooks", "human", {**HOOK, "endpoint_id": "$unknown_ep"}, 404,
     NOT_FOUND),
    ("create-malformed-endpoint-id", "POST", "/api/v1/webhooks", "human", {**HOOK, "endpoint_id": "router"}, 400,
     BAD),
    ("create-endpoint-id-int", "POST", "/api/v1/webhooks", "human", {**HOOK, "endpoint_id": 7}, 400, BAD),
    ("create-revoked-endpoint", "POST", "/api/v1/webhooks", "human", {**HOOK, "endpoint_id": "$revoked_ep",
                                                                       "queue": "build"}, 409, CONFLICT),
    ("create-extra-field", "POST", "/api/v1/webhooks", "human", {**HOOK, "trust_mode": "token"}, 400, BAD),
    ("create-token-field", "POST", "/api/v1/webhooks", "human", {**HOOK, "token": "chosen-url-token"}, 400, BAD),
    ("create-rules-field", "POST", "/api/v1/webhooks", "human", {**HOOK, "rules": []}, 400, BAD),
    ("create-not-object", "POST", "/api/v1/webhooks", "human", ["github", "triage"], 400, BAD),
    ("create-invalid-json", "POST", "/api/v1/webhooks", "human", b'{"provider": "github", "queue": ', 400, BAD),
    ("create-empty-body", "POST", "/api/v1/webhooks", "human", None, 400, BAD),
    ("create-over-webhook-max", "POST", "/api/v1/webhooks", "human", {**HOOK, "endpoint_id": "$capped"}, 409,
     CONFLICT),
    ("create-over-webhook-max-endpoint-token", "POST", "/api/v1/webhooks", "capped",
     {"provider": "github", "queue": "triage"}, 409, CONFLICT),
    ("create-endpoint-token-without-verb", "POST", "/api/v1/webhooks", "worker",
     {"provider": "github", "queue": "build"}, 403, FORBIDDEN),
    ("create-endpoint-token-bad-provider", "POST", "/api/v1/webhooks", "router",
     {"provider": "gitlab", "queue": "triage"}, 400, BAD),
    ("create-no-auth", "POST", "/api/v1/webhooks", "none", HOOK, 401, "unauthenticated"),
    ("create-revoked-token", "POST", "/api/v1/webhooks", "revoked", {"provider": "github", "queue": "build"}, 401,
     "unauthenticated"),
    ("create-body-over-1mib", "POST", "/api/v1/webhooks", "human", big_json("provider"), 413, "too_large"),
    ("list-webhooks-without-verb", "GET", "/api/v1/webhooks", "worker", None, 403, FORBIDDEN),

    # GET|DELETE /api/v1/webhooks/{id}
    ("get-unknown-webhook", "GET", "/api/v1/webhooks/{unknown_hook}", "human", None, 404, NOT_FOUND),
    ("get-foreign-webhook", "GET", "/api/v1/webhooks/{bob_hook}", "human", None, 404, NOT_FOUND),
    ("get-malformed-webhook-id", "GET", "/api/v1/webhooks/wh_%27%20OR%201=1--", "human", None, 404, NOT_FOUND),
    ("get-todo-id-as-webhook", "GET", "/api/v1/webhooks/{pending}", "human", None, 404, NOT_FOUND),
    ("get-webhook-without-verb", "GET", WH, "worker", None, 403, FORBIDDEN),
    ("get-webhook-of-another-endpoint", "GET", "/api/v1/webhooks/{capped_hook}", "router", None, 404, NOT_FOUND),
    ("get-foreign-webhook-endpoint-token", "GET", "/api/v1/webhooks/{bob_hook}", "router", None, 404, NOT_FOUND),
    ("get-webhook-no-auth", "GET", WH, "none", None, 401, "unauthenticated"),
    ("delete-unknown-webhook", "DELETE", "/api/v1/webhooks/{unknown_hook}", "human", None, 404, NOT_FOUND),
    ("delete-foreign-webhook", "DELETE", "/api/v1/webhooks/{bob_hook}", "human", None, 404, NOT_FOUND),
    ("delete-webhook-without-verb", "DELETE", WH, "worker", None, 403, FORBIDDEN),
    ("delete-webhook-of-another-endpoint", "DELETE", "/api/v1/webhooks/{capped_hook}", "router", None, 404,
     NOT_FOUND),
    ("delete-webhook-no-auth", "DELETE", WH, "none", None, 401, "unauthenticated"),
    ("delete-webhook-bob", "DELETE", WH, "bob", None, 404, NOT_FOUND),

    # POST /api/v1/webhooks/{id}/rotate
    ("rotate-unknown", "POST", "/api/v1/webhooks/{unknown_hook}/rotate", "human", None, 404, NOT_FOUND),
    ("rotate-foreign", "POST", "/api/v1/webhooks/{bob_hook}/rotate", "human", None, 404, NOT_FOUND),
    ("rotate-without-verb", "POST", WH + "/rotate", "worker", None, 403, FORBIDDEN),
    ("rotate-of-another-endpoint", "POST", "/api/v1/webhooks/{capped_hook}/rotate", "router", None, 404, NOT_FOUND),
    ("rotate-extra-field", "POST", WH + "/rotate", "human", {"secret": "whsec_" + "c" * 64}, 400, BAD),
    ("rotate-invalid-json", "POST", WH + "/rotate", "human", b"{", 400, BAD),
    ("rotate-no-auth", "POST", WH + "/rotate", "none", None, 401, "unauthenticated"),

    # PUT /api/v1/webhooks/{id}/secret
    ("secret-generic", "PUT", "/api/v1/webhooks/{generic}/secret", "human", {"secret": "x" * 20}, 400, BAD),
    ("secret-short", "PUT", "/api/v1/webhooks/{stripe}/secret", "human", {"secret": "whsec_short"}, 400, BAD),
    ("secret-long", "PUT", "/api/v1/webhooks/{slack}/secret", "human", {"secret": "s" * 513}, 400, BAD),
    ("secret-non-printable", "PUT", "/api/v1/webhooks/{slack}/secret", "human", {"secret": "s" * 16 + "\r\n"}, 400,
     BAD),
    ("secret-stripe-without-whsec", "PUT", "/api/v1/webhooks/{stripe}/secret", "human",
     {"secret": "sk_live_" + "a" * 32}, 400, BAD),
    ("secret-missing", "PUT", "/api/v1/webhooks/{stripe}/secret", "human", {}, 400, BAD),
    ("secret-null", "PUT", "/api/v1/webhooks/{stripe}/secret", "human", {"secret": None}, 400, BAD),
    ("secret-int", "PUT", "/api/v1/webhooks/{stripe}/secret", "human", {"secret": 12345678901234567890}, 400, BAD),
    ("secret-extra-field", "PUT", "/api/v1/webhooks/{stripe}/secret", "human",
     {"secret": STRIPE_SECRET, "rotate": True}, 400, BAD),
    ("secret-invalid-json", "PUT", "/api/v1/webhooks/{stripe}/secret", "human", b'{"secret": "whsec_', 400, BAD),
    ("secret-unknown-webhook", "PUT", "/api/v1/webhooks/{unknown_hook}/secret", "human", {"secret": STRIPE_SECRET},
     404, NOT_FOUND),
    ("secret-foreign-webhook", "PUT", "/api/v1/webhooks/{bob_hook}/secret", "human", {"secret": STRIPE_SECRET}, 404,
     NOT_FOUND),
    ("secret-without-verb", "PUT", "/api/v1/webhooks/{stripe}/secret", "worker", {"secret": STRIPE_SECRET}, 403,
     FORBIDDEN),

    # GET|PUT /api/v1/webhooks/{id}/rules
    ("rules-get-unknown", "GET", "/api/v1/webhooks/{unknown_hook}/rules", "human", None, 404, NOT_FOUND),
    ("rules-get-foreign", "GET", "/api/v1/webhooks/{bob_hook}/rules", "human", None, 404, NOT_FOUND),
    ("rules-get-without-verb", "GET", RULES, "worker", None, 403, FORBIDDEN),
    ("rules-get-no-auth", "GET", RULES, "none", None, 401, "unauthenticated"),
    ("rules-put-unknown", "PUT", "/api/v1/webhooks/{unknown_hook}/rules", "human", rules(rule()), 404, NOT_FOUND),
    ("rules-put-foreign", "PUT", "/api/v1/webhooks/{bob_hook}/rules", "human", rules(rule()), 404, NOT_FOUND),
    ("rules-put-of-another-endpoint", "PUT", "/api/v1/webhooks/{capped_hook}/rules", "router", rules(rule()), 404,
     NOT_FOUND),
    ("rules-put-without-verb", "PUT", RULES, "worker", rules(rule()), 403, FORBIDDEN),
    ("rules-invalid-json", "PUT", RULES, "human", b'{"rules": [{"id": "a", "expr": "true"', 400, BAD),
    ("rules-trailing-data", "PUT", RULES, "human", b'{"rules": []} {"rules": []}', 400, BAD),
    ("rules-not-object", "PUT", RULES, "human", [rule()], 400, BAD),
    ("rules-rules-object", "PUT", RULES, "human", {"rules": {"r": rule()}}, 400, BAD),
    ("rules-rule-string", "PUT", RULES, "human", {"rules": ["true"]}, 400, BAD),
    ("rules-unknown-top-field", "PUT", RULES, "human", rules(rule(), extra=1), 400, BAD),
    ("rules-unknown-rule-field", "PUT", RULES, "human", rules(rule(priority=1)), 400, BAD),
    ("rules-unknown-action-field", "PUT", RULES, "human", rules(rule(action={"queue": "triage", "fanout": True})),
     400, BAD),
    ("rules-action-drop-and-queue", "PUT", RULES, "human", rules(rule(action={"drop": True, "queue": "triage"})),
     400, BAD),
    ("rules-action-queue-and-quarantine", "PUT", RULES, "human",
     rules(rule(action={"queue": "triage", "quarantine": True})), 400, BAD),
    ("rules-action-drop-and-quarantine", "PUT", RULES, "human",
     rules(rule(action={"drop": True, "quarantine": True})), 400, BAD),
    ("rules-action-drop-false", "PUT", RULES, "human", rules(rule(action={"drop": False})), 400, BAD),
    ("rules-action-empty", "PUT", RULES, "human", rules(rule(action={})), 400, BAD),
    ("rules-action-string", "PUT", RULES, "human", rules(rule(action="drop")), 400, BAD),
    ("rules-action-exclusive-str", "PUT", RULES, "human",
     rules(rule(action={"queue": "triage", "exclusive": "yes"})), 400, BAD),
    ("rules-missing-action", "PUT", RULES, "human", {"rules": [{"id": "a", "expr": "true"}]}, 400, BAD),
    ("rules-missing-expr", "PUT", RULES, "human", {"rules": [{"id": "a", "action": {"drop": True}}]}, 400, BAD),
    ("rules-missing-id", "PUT", RULES, "human", {"rules": [{"expr": "true", "action": {"drop": True}}]}, 400, BAD),
    ("rules-bad-id-space", "PUT", RULES, "human", rules(rule("bad id")), 400, BAD),
    ("rules-bad-id-dot", "PUT", RULES, "human", rules(rule("a.b")), 400, BAD),
    ("rules-bad-id-empty", "PUT", RULES, "human", rules(rule("")), 400, BAD),
    ("rules-bad-id-65", "PUT", RULES, "human", rules(rule("i" * 65)), 400, BAD),
    ("rules-bad-id-int", "PUT", RULES, "human", rules(rule(1)), 400, BAD),
    ("rules-repeated-id", "PUT", RULES, "human", rules(rule("a"), rule("a", "false")), 400, BAD),
    ("rules-name-newline", "PUT", RULES, "human", rules(rule(name="line\nbreak")), 400, BAD),
    ("rules-expr-empty", "PUT", RULES, "human", rules(rule(expr="")), 400, BAD),
    ("rules-expr-blank", "PUT", RULES, "human", rules(rule(expr=" \n\t ")), 400, BAD),
    ("rules-expr-4097", "PUT", RULES, "human", rules(rule(expr="true" + " " * 4093)), 400, BAD),
    ("rules-expr-int", "PUT", RULES, "human", rules(rule(expr=1)), 400, BAD),
    ("rules-expr-nul", "PUT", RULES, "human", rules(rule(expr="true\u0000")), 400, BAD),
    ("rules-33", "PUT", RULES, "human", rules(*(rule(f"r{i}") for i in range(33))), 400, BAD),
    *((f"rules-forbidden-{name}", "PUT", RULES, "human", rules(rule("ok"), rule("sneaky", expr)), 400, BAD)
      for name, expr in FORBIDDEN_EXPRS),
    ("rules-parse-error-if", "PUT", RULES, "human", rules(rule(expr="if . then")), 400, BAD),
    ("rules-parse-error-bracket", "PUT", RULES, "human", rules(rule("ok"), rule("b", ".payload[")), 400, BAD),
    ("rules-parse-error-paren", "PUT", RULES, "human", rules(rule(expr="(true))")), 400, BAD),
    ("rules-unknown-function", "PUT", RULES, "human", rules(rule(expr="no_such_function(1)")), 400, BAD),
    ("rules-unknown-variable", "PUT", RULES, "human", rules(rule(expr="$secret == 1")), 400, BAD),
    ("rules-params-nested", "PUT", RULES, "human", rules(params={"nested": {"a": 1}}), 400, BAD),
    ("rules-params-mixed-list", "PUT", RULES, "human", rules(params={"mixed": ["a", 1]}), 400, BAD),
    ("rules-params-list-of-lists", "PUT", RULES, "human", rules(params={"lists": [[1], [2]]}), 400, BAD),
    ("rules-params-list-of-objects", "PUT", RULES, "human", rules(params={"objs": [{"a": 1}]}), 400, BAD),
    ("rules-params-bool-list", "PUT", RULES, "human", rules(params={"flags": [True, False]}), 400, BAD),
    ("rules-params-null-value", "PUT", RULES, "human", rules(params={"n": None}), 400, BAD),
    ("rules-params-over-16kib", "PUT", RULES, "human", rules(params={"big": "x" * 17000}), 400, BAD),
    ("rules-params-over-16kib-many", "PUT", RULES, "human",
     rules(params={f"k{i}": "v" * 100 for i in range(170)}), 400, BAD),
    ("rules-params-list", "PUT", RULES, "human", rules(params=["a"]), 400, BAD),
    ("rules-params-string", "PUT", RULES, "human", rules(params="x"), 400, BAD),
    ("rules-params-nan", "PUT", RULES, "human", b'{"rules": [], "params": {"x": NaN}}', 400, BAD),
    ("rules-queue-nobody-scoped", "PUT", RULES, "human", rules(rule(action={"queue": "nobody-scoped"})), 400, BAD),
    ("rules-queue-only-non-target", "PUT", RULES, "human", rules(rule(action={"queue": "build"})), 400, BAD),
    ("rules-queue-only-foreign", "PUT", RULES, "human", rules(rule(action={"queue": "bob-only"})), 400, BAD),
    ("rules-queue-only-revoked", "PUT", RULES, "human", rules(rule(action={"queue": "lane-x"})), 400, BAD),
    ("rules-queue-reserved", "PUT", RULES, "human", rules(rule(action={"queue": "quarantine"})), 400, BAD),
    ("rules-queue-malformed", "PUT", RULES, "human", rules(rule(action={"queue": "Lane S"})), 400, BAD),
    ("rules-exclusive-no-scoped-target", "PUT", RULES, "human",
     rules(rule(action={"queue": "build", "exclusive": True})), 400, BAD),
    ("rules-endpoints-not-targets", "PUT", RULES, "human",
     rules(rule(action={"queue": "build", "endpoints": ["$worker"]})), 400, BAD),
    ("rules-endpoints-non-target-with-target", "PUT", RULES, "human",
     rules(rule(action={"queue": "lane-s", "endpoints": ["$lane", "$worker"]})), 400, BAD),
    ("rules-endpoints-foreign", "PUT", RULES, "human",
     rules(rule(action={"queue": "triage", "endpoints": ["$bob_ep"]})), 400, BAD),
    ("rules-endpoints-unknown", "PUT", RULES, "human",
     rules(rule(action={"queue": "triage", "endpoints": ["$unknown_ep"]})), 400, BAD),
    ("rules-endpoints-target-without-queue", "PUT", RULES, "human",
     rules(rule(action={"queue": "lane-s", "endpoints": ["$router"]})), 400, BAD),
    ("rules-endpoints-empty", "PUT", RULES, "human", rules(rule(action={"queue": "triage", "endpoints": []})), 400,
     BAD),
    ("rules-endpoints-malformed", "PUT", RULES, "human",
     rules(rule(action={"queue": "triage", "endpoints": ["router"]})), 400, BAD),
    ("rules-endpoints-revoked", "PUT", RULES, "human",
     rules(rule(action={"queue": "build", "endpoints": ["$revoked_ep"]})), 400, BAD),
    ("rules-default-no-target", "PUT", RULES, "human", rules(default_action={"queue": "nobody-scoped"}), 400, BAD),
    ("rules-default-two-kinds", "PUT", RULES, "human", rules(default_action={"drop": True, "quarantine": True}),
     400, BAD),
    ("rules-default-exclusive-no-target", "PUT", RULES, "human",
     rules(default_action={"queue": "build", "exclusive": True}), 400, BAD),
    ("rules-fault-on-stored-delivery", "PUT", RULES, "human",
     rules(rule("fine", '.kind == "push"'), rule("fragile", '.payload.issue.title | test("[")')), 400, BAD),
    ("rules-error-on-stored-delivery", "PUT", RULES, "human",
     rules(rule("boom", '.payload.issue.number | error("no")')), 400, BAD),
    ("rules-put-no-auth", "PUT", RULES, "none", rules(rule()), 401, "unauthenticated"),
    ("rules-put-body-over-1mib", "PUT", RULES, "human", big_json("rules"), 413, "too_large"),

    # POST /api/v1/webhooks/{id}/rules/test
    ("test-neither", "POST", TEST, "human", {}, 400, BAD),
    ("test-only-headers", "POST", TEST, "human", {"headers": {"X-GitHub-Event": "issues"}}, 400, BAD),
    ("test-both", "POST", TEST, "human", {"payload": {}, "event_id": "$gh_event"}, 400, BAD),
    ("test-unknown-event", "POST", TEST, "human", {"event_id": "$unknown_event"}, 404, NOT_FOUND),
    ("test-foreign-event", "POST", TEST, "human", {"event_id": "$bob_event"}, 404, NOT_FOUND),
    ("test-event-of-another-webhook", "POST", TEST, "human", {"event_id": "$held_event"}, 404, NOT_FOUND),
    ("test-operator-event", "POST", TEST, "human", {"event_id": "$op_event"}, 404, NOT_FOUND),
    ("test-malformed-event-id", "POST", TEST, "human", {"event_id": "nope"}, 400, BAD),
    ("test-event-id-int", "POST", TEST, "human", {"event_id": 1}, 400, BAD),
    ("test-candidate-forbidden", "POST", TEST, "human", {"payload": {}, "rules": [rule(expr="env.HOME")]}, 400,
     BAD),
    ("test-candidate-parse-error", "POST", TEST, "human", {"payload": {}, "rules": [rule(expr="if . then")]}, 400,
     BAD),
    ("test-candidate-33", "POST", TEST, "human", {"payload": {}, "rules": [rule(f"r{i}") for i in range(33)]}, 400,
     BAD),
    ("test-candidate-repeated-id", "POST", TEST, "human", {"payload": {}, "rules": [rule("a"), rule("a")]}, 400,
     BAD),
    ("test-candidate-no-target", "POST", TEST, "human",
     {"payload": {}, "rules": [rule(action={"queue": "nobody-scoped"})]}, 400, BAD),
    ("test-candidate-two-kinds", "POST", TEST, "human",
     {"payload": {}, "rules": [rule(action={"drop": True, "queue": "triage"})]}, 400, BAD),
    ("test-candidate-default-no-target", "POST", TEST, "human",
     {"payload": {}, "default_action": {"queue": "build", "exclusive": True}}, 400, BAD),
    ("test-candidate-params-nested", "POST", TEST, "human", {"payload": {}, "params": {"n": {"a": 1}}}, 400, BAD),
    ("test-headers-not-strings", "POST", TEST, "human", {"payload": {}, "headers": {"X-Event-Type": 1}}, 400, BAD),
    ("test-headers-list", "POST", TEST, "human", {"payload": {}, "headers": ["X-Event-Type: a"]}, 400, BAD),
    ("test-verified-str", "POST", TEST, "human", {"payload": {}, "verified": "yes"}, 400, BAD),
    ("test-extra-field", "POST", TEST, "human", {"payload": {}, "store": True}, 400, BAD),
    ("test-payload-nan", "POST", TEST, "human", b'{"payload": {"x": NaN}}', 400, BAD),
    ("test-invalid-json", "POST", TEST, "human", b'{"payload": ', 400, BAD),
    ("test-unknown-webhook", "POST", "/api/v1/webhooks/{unknown_hook}/rules/test", "human", {"payload": {}}, 404,
     NOT_FOUND),
    ("test-foreign-webhook", "POST", "/api/v1/webhooks/{bob_hook}/rules/test", "human", {"payload": {}}, 404,
     NOT_FOUND),
    ("test-without-verb", "POST", TEST, "worker", {"payload": {}}, 403, FORBIDDEN),
    ("test-no-auth", "POST", TEST, "none", {"payload": {}}, 401, "unauthenticated"),

    # GET|POST /api/v1/webhooks/{id}/routes, DELETE /api/v1/webhooks/{id}/routes/{endpoint_id}
    ("routes-list-unknown", "GET", "/api/v1/webhooks/{unknown_hook}/routes", "human", None, 404, NOT_FOUND),
    ("routes-list-foreign", "GET", "/api/v1/webhooks/{bob_hook}/routes", "human", None, 404, NOT_FOUND),
    ("routes-list-without-verb", "GET", ROUTES, "worker", None, 403, FORBIDDEN),
    ("route-add-unknown-endpoint", "POST", ROUTES, "human", {"endpoint_id": "$unknown_ep"}, 404, NOT_FOUND),
    ("route-add-bobs-endpoint-no-friend", "POST", ROUTES, "human", {"endpoint_id": "$bob_ep"}, 403, FORBIDDEN),
    ("route-add-carols-endpoint-unapproved", "POST", ROUTES, "human", {"endpoint_id": "$carol_ep"}, 403,
     FORBIDDEN),
    ("route-add-revoked-endpoint", "POST", ROUTES, "human", {"endpoint_id": "$revoked_ep"}, 409, CONFLICT),
    ("route-add-malformed-endpoint", "POST", ROUTES, "human", {"endpoint_id": "worker"}, 400, BAD),
    ("route-add-endpoint-int", "POST", ROUTES, "human", {"endpoint_id": 1}, 400, BAD),
    ("route-add-endpoint-list", "POST", ROUTES, "human", {"endpoint_id": ["$worker"]}, 400, BAD),
    ("route-add-missing", "POST", ROUTES, "human", {}, 400, BAD),
    ("route-add-extra", "POST", ROUTES, "human", {"endpoint_id": "$worker", "exclusive": True}, 400, BAD),
    ("route-add-invalid-json", "POST", ROUTES, "human", b'{"endpoint_id": ', 400, BAD),
    ("route-add-unknown-webhook", "POST", "/api/v1/webhooks/{unknown_hook}/routes", "human",
     {"endpoint_id": "$worker"}, 404, NOT_FOUND),
    ("route-add-foreign-webhook", "POST", "/api/v1/webhooks/{bob_hook}/routes", "human", {"endpoint_id": "$worker"},
     404, NOT_FOUND),
    ("route-add-bob-onto-alices-webhook", "POST", ROUTES, "bob", {"endpoint_id": "$bob_ep"}, 404, NOT_FOUND),
    ("route-add-without-verb", "POST", ROUTES, "worker", {"endpoint_id": "$worker"}, 403, FORBIDDEN),
    ("route-add-endpoint-token-foreign", "POST", ROUTES, "router", {"endpoint_id": "$bob_ep"}, 403, FORBIDDEN),
    ("route-add-no-auth", "POST", ROUTES, "none", {"endpoint_id": "$worker"}, 401, "unauthenticated"),
    ("route-delete-unknown-route", "DELETE", ROUTES + "/{worker}", "human", None, 404, NOT_FOUND),
    ("route-delete-unknown-endpoint", "DELETE", ROUTES + "/{unknown_ep}", "human", None, 404, NOT_FOUND),
    ("route-delete-foreign-endpoint", "DELETE", ROUTES + "/{bob_ep}", "human", None, 404, NOT_FOUND),
    ("route-delete-owner", "DELETE", ROUTES + "/{router}", "human", None, 404, NOT_FOUND),
    ("route-delete-unknown-webhook", "DELETE", "/api/v1/webhooks/{unknown_hook}/routes/{lane}", "human", None, 404,
     NOT_FOUND),
    ("route-delete-foreign-webhook", "DELETE", "/api/v1/webhooks/{bob_hook}/routes/{lane}", "human", None, 404,
     NOT_FOUND),
    ("route-delete-by-bob", "DELETE", ROUTES + "/{lane}", "bob", None, 404, NOT_FOUND),
    ("route-delete-without-verb", "DELETE", ROUTES + "/{lane}", "worker", None, 403, FORBIDDEN),
    ("route-delete-no-auth", "DELETE", ROUTES + "/{lane}", "none", None, 401, "unauthenticated"),

    # GET /api/v1/webhooks/{id}/events, GET /api/v1/events/{id}
    ("events-bad-disposition", "GET", WH + "/events?disposition=bogus", "human", None, 400, BAD),
    ("events-disposition-case", "GET", WH + "/events?disposition=Routed", "human", None, 400, BAD),
    ("events-limit-0", "GET", WH + "/events?limit=0", "human", None, 400, BAD),
    ("events-limit-201", "GET", WH + "/events?limit=201", "human", None, 400, BAD),
    ("events-limit-negative", "GET", WH + "/events?limit=-1", "human", None, 400, BAD),
    ("events-limit-str", "GET", WH + "/events?limit=ten", "human", None, 400, BAD),
    ("events-limit-huge", "GET", WH + "/events?limit=" + "9" * 40, "human", None, 400, BAD),
    ("events-unknown-param", "GET", WH + "/events?state=routed", "human", None, 400, BAD),
    ("events-unknown-webhook", "GET", "/api/v1/webhooks/{unknown_hook}/events", "human", None, 404, NOT_FOUND),
    ("events-foreign-webhook", "GET", "/api/v1/webhooks/{bob_hook}/events", "human", None, 404, NOT_FOUND),
    ("events-without-verb", "GET", WH + "/events", "worker", None, 403, FORBIDDEN),
    ("events-no-auth", "GET", WH + "/events", "none", None, 401, "unauthenticated"),
    ("event-unknown", "GET", "/api/v1/events/{unknown_event}", "human", None, 404, NOT_FOUND),
    ("event-foreign", "GET", "/api/v1/events/{bob_event}", "human", None, 404, NOT_FOUND),
    ("event-alices-for-bob", "GET", "/api/v1/events/{gh_event}", "bob", None, 404, NOT_FOUND),
    ("event-foreign-endpoint-token", "GET", "/api/v1/events/{bob_event}", "router", None, 404, NOT_FOUND),
    ("event-operator-authored-endpoint-token", "GET", "/api/v1/events/{op_event}", "router", None, 404, NOT_FOUND),
    ("event-malformed-id", "GET", "/api/v1/events/ev_%27%20OR%201=1--", "human", None, 404, NOT_FOUND),
    ("event-todo-id", "GET", "/api/v1/events/{pending}", "human", None, 404, NOT_FOUND),
    ("event-without-verb", "GET", "/api/v1/events/{gh_event}", "worker", None, 403, FORBIDDEN),
    ("event-no-auth", "GET", "/api/v1/events/{gh_event}", "none", None, 401, "unauthenticated"),

    # POST /api/v1/friends, POST /api/v1/friends/{id}/approve
    ("friend-unknown-human", "POST", "/api/v1/friends", "human", {"human": "nobody"}, 404, NOT_FOUND),
    ("friend-unknown-human-id", "POST", "/api/v1/friends", "human", {"human": "hu_" + "0" * 20}, 404, NOT_FOUND),
    ("friend-self-by-name", "POST", "/api/v1/friends", "human", {"human": "alice"}, 400, BAD),
    ("friend-self-by-id", "POST", "/api/v1/friends", "human", {"human": "$alice_id"}, 400, BAD),
    ("friend-extra-field", "POST", "/api/v1/friends", "human", {"human": "bob", "approved": True}, 400, BAD),
    ("friend-human-int", "POST", "/api/v1/friends", "human", {"human": 1}, 400, BAD),
    ("friend-human-empty", "POST", "/api/v1/friends", "human", {"human": ""}, 400, BAD),
    ("friend-human-newline", "POST", "/api/v1/friends", "human", {"human": "bob\nx"}, 400, BAD),
    ("friend-missing-human", "POST", "/api/v1/friends", "human", {}, 400, BAD),
    ("friend-invalid-json", "POST", "/api/v1/friends", "human", b'{"human": "bob"', 400, BAD),
    ("friend-endpoint-token", "POST", "/api/v1/friends", "router", {"human": "bob"}, 403, FORBIDDEN),
    ("friend-no-auth", "POST", "/api/v1/friends", "none", {"human": "bob"}, 401, "unauthenticated"),
    ("friend-list-endpoint-token", "GET", "/api/v1/friends", "router", None, 403, FORBIDDEN),
    ("friend-approve-by-requester", "POST", "/api/v1/friends/{pending_edge}/approve", "human", None, 404,
     NOT_FOUND),
    ("friend-approve-by-stranger", "POST", "/api/v1/friends/{pending_edge}/approve", "bob", None, 404, NOT_FOUND),
    ("friend-approve-unknown", "POST", "/api/v1/friends/{unknown_edge}/approve", "carol", None, 404, NOT_FOUND),
    ("friend-approve-endpoint-token", "POST", "/api/v1/friends/{pending_edge}/approve", "router", None, 403,
     FORBIDDEN),
    ("friend-approve-extra-field", "POST", "/api/v1/friends/{pending_edge}/approve", "carol", {"scope": "all"}, 400,
     BAD),
    ("friend-approve-no-auth", "POST", "/api/v1/friends/{pending_edge}/approve", "none", None, 401,
     "unauthenticated"),

    # POST /api/v1/todos/{id}/release-quarantine
    ("release-not-quarantined", "POST", RQ % "pending", "human", {}, 409, CONFLICT),
    ("release-not-quarantined-with-queue", "POST", RQ % "pending", "human", {"queue": "triage"}, 409, CONFLICT),
    ("release-endpoint-token", "POST", RQ % "held", "router", {}, 403, FORBIDDEN),
    ("release-malformed-queue", "POST", RQ % "held", "human", {"queue": "Bad Queue"}, 400, BAD),
    ("release-queue-int", "POST", RQ % "held", "human", {"queue": 1}, 400, BAD),
    ("release-queue-nobody-scoped", "POST", RQ % "held", "human", {"queue": "nobody-scoped"}, 400, BAD),
    ("release-queue-only-non-target", "POST", RQ % "held", "human", {"queue": "build"}, 400, BAD),
    ("release-queue-reserved", "POST", RQ % "held", "human", {"queue": "quarantine"}, 400, BAD),
    ("release-held-again", "POST", RQ % "held", "human", {}, 409, CONFLICT),
    ("release-extra-field", "POST", RQ % "held", "human", {"queue": "triage", "force": True}, 400, BAD),
    ("release-invalid-json", "POST", RQ % "held", "human", b'{"queue": "triage"', 400, BAD),
    ("release-unknown", "POST", RQ % "unknown_todo", "human", {}, 404, NOT_FOUND),
    ("release-foreign", "POST", RQ % "bob_todo", "human", {}, 404, NOT_FOUND),
    ("release-by-bob", "POST", RQ % "held", "bob", {}, 404, NOT_FOUND),
    ("release-no-auth", "POST", RQ % "held", "none", {}, 401, "unauthenticated"),

    # POST /hooks/{token}
    ("hook-unknown-token", "POST", "/hooks/not-a-real-token", "none", Raw(generic_delivery), 404, NOT_FOUND),
    ("hook-webhook-id-as-token", "POST", "/hooks/{gh}", "none", Raw(github_bad_signature), 404, NOT_FOUND),
    ("hook-github-bad-signature", "POST", "/hooks/{gh_token}", "none", Raw(github_bad_signature), 401,
     "unauthenticated"),
    ("hook-github-missing-signature", "POST", "/hooks/{gh_token}", "none", Raw(github_missing_signature), 401,
     "unauthenticated"),
    ("hook-github-malformed-signature", "POST", "/hooks/{gh_token}", "none", Raw(github_malformed_signature), 401,
     "unauthenticated"),
    ("hook-github-tampered-body", "POST", "/hooks/{gh_token}", "none", Raw(github_tampered_body), 401,
     "unauthenticated"),
    ("hook-cairn-stale", "POST", "/hooks/{cairn_token}", "none", Raw(cairn_stale), 401, "unauthenticated"),
    ("hook-cairn-future", "POST", "/hooks/{cairn_token}", "none", Raw(cairn_future), 401, "unauthenticated"),
    ("hook-cairn-created-at-1e308", "POST", "/hooks/{cairn_token}", "none", cairn_created_at(b"1e308", "e-big"), 401,
     "unauthenticated"),
    ("hook-cairn-created-at-minus-1e308", "POST", "/hooks/{cairn_token}", "none",
     cairn_created_at(b"-1e308", "e-small"), 401, "unauthenticated"),
    ("hook-cairn-created-at-1e400", "POST", "/hooks/{cairn_token}", "none", cairn_created_at(b"1e400", "e-inf"), 401,
     "unauthenticated"),
    ("hook-cairn-created-at-object", "POST", "/hooks/{cairn_token}", "none",
     cairn_created_at(b'{"at": 1}', "e-obj"), 401, "unauthenticated"),
    ("hook-cairn-created-at-bad-date", "POST", "/hooks/{cairn_token}", "none",
     cairn_created_at(b'"2027-13-45T99:00:00Z"', "e-date"), 401, "unauthenticated"),
    ("hook-cairn-event-id-mismatch", "POST", "/hooks/{cairn_token}", "none", Raw(cairn_event_id_mismatch), 401,
     "unauthenticated"),
    ("hook-stripe-stale", "POST", "/hooks/{stripe_token}", "none", Raw(stripe_stale), 401, "unauthenticated"),
    ("hook-stripe-future", "POST", "/hooks/{stripe_token}", "none", Raw(stripe_future), 401, "unauthenticated"),
    ("hook-stripe-wrong-secret", "POST", "/hooks/{stripe_token}", "none", Raw(stripe_wrong_secret), 401,
     "unauthenticated"),
    ("hook-stripe-no-timestamp", "POST", "/hooks/{stripe_token}", "none", Raw(stripe_no_timestamp), 401,
     "unauthenticated"),
    ("hook-slack-stale", "POST", "/hooks/{slack_token}", "none", Raw(slack_stale), 401, "unauthenticated"),
    ("hook-slack-future", "POST", "/hooks/{slack_token}", "none", Raw(slack_future), 401, "unauthenticated"),
    ("hook-slack-bad-timestamp", "POST", "/hooks/{slack_token}", "none", Raw(slack_bad_timestamp), 401,
     "unauthenticated"),
    ("hook-slack-missing-timestamp", "POST", "/hooks/{slack_token}", "none", Raw(slack_missing_timestamp), 401,
     "unauthenticated"),
    ("hook-slack-forged-url-verification", "POST", "/hooks/{slack_token}", "none", Raw(slack_forged_challenge), 401,
     "unauthenticated"),
    ("hook-body-over-5mib", "POST", "/hooks/{gh_token}", "none", Raw(github_over_5mib), 413, "too_large"),
    ("hook-generic-body-over-5mib", "POST", "/hooks/{generic_token}", "none",
     Raw(lambda scene: (b"x" * (5 * MIB + 1), {"X-Delivery-Id": "big"})), 413, "too_large"),
    ("hook-body-streamed-over-5mib", "POST", "/hooks/{generic_token}", "none", "stream", 413, "too_large"),
    ("hook-bad-content-length", "POST", "/hooks/{generic_token}", "none", "bad-length", 400, BAD),
    ("hook-stripe-secret-not-set", "POST", "/hooks/{stripe_unset_token}", "none", Raw(stripe_fresh), 503,
     "unavailable"),
    ("hook-owner-revoked", "POST", "/hooks/{doomed_token}", "none", Raw(generic_delivery), 503, "unavailable"),

    # GET /api/v1/doorbell (Server-Sent Events; every row here is refused before the stream opens)
    ("doorbell-bad-queue", "GET", "/api/v1/doorbell?queue=Bad%20Queue", "worker", None, 400, BAD),
    ("doorbell-queue-too-long", "GET", "/api/v1/doorbell?queue=" + "q" * 65, "worker", None, 400, BAD),
    ("doorbell-unknown-param", "GET", "/api/v1/doorbell?queues=build", "worker", None, 400, BAD),
    ("doorbell-human-token", "GET", "/api/v1/doorbell", "human", None, 403, FORBIDDEN),
    ("doorbell-human-token-with-queue", "GET", "/api/v1/doorbell?queue=build", "human", None, 403, FORBIDDEN),
    ("doorbell-queue-outside-scope", "GET", "/api/v1/doorbell?queue=triage", "worker", None, 403, FORBIDDEN),
    ("doorbell-reserved-queue", "GET", "/api/v1/doorbell?queue=quarantine", "router", None, 403, FORBIDDEN),
    ("doorbell-endpoint-without-claim-verb", "GET", "/api/v1/doorbell", "capped", None, 403, FORBIDDEN),
    ("doorbell-no-auth", "GET", "/api/v1/doorbell", "none", None, 401, "unauthenticated"),
    ("doorbell-revoked-token", "GET", "/api/v1/doorbell", "revoked", None, 401, "unauthenticated"),
]


def _param(row):
    row_id, *rest = row
    return pytest.param(*rest, id=row_id)


def send(scene: Scene, client, method: str, path: str, auth: str, body, extra_headers: dict | None = None):
    url = path.format(**scene.ids)
    headers = {**headers_for(auth, scene), **(extra_headers or {})}
    kwargs: dict = {}
    if body == "stream":
        kwargs["content"] = (b"x" * MIB for _ in range(6))
    elif body == "bad-length":
        kwargs["content"] = b"{}"
        headers["Content-Length"] = "2x"
    elif isinstance(body, Raw):
        content, more = body.make(scene)
        kwargs["content"] = content
        headers.update(more)
    elif isinstance(body, bytes):
        kwargs["content"] = body
        headers.setdefault("Content-Type", "application/json")
    elif body is not None:
        kwargs["json"] = fill(body, scene.ids)
    return client.request(method, url, headers=headers, **kwargs)


def assert_clean(response, scene: Scene) -> None:
    for secret in scene.leaks():
        assert secret not in response.text, "an answer leaked a token or a secret"


def test_row_ids_are_unique():
    ids = [row[0] for row in ROWS]
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]


@pytest.mark.parametrize("method,path,auth,body,status,code", [_param(r) for r in ROWS])
def test_bad_input_is_refused_cleanly_and_changes_nothing(world, scene, db_path, method, path, auth, body, status,
                                                          code):
    before = snapshot(db_path)
    response = send(scene, world.client, method, path, auth, body)

    assert response.status_code != 500, f"500 on bad input: {response.text}"
    assert response.status_code == status, (response.status_code, response.text[:300])
    assert response.headers["content-type"].startswith("application/json"), response.headers
    answer = response.json()
    assert answer.get("error") == code, answer
    message = answer.get("message")
    assert isinstance(message, str) and message.strip(), answer
    assert "\n" not in message and "\r" not in message, answer
    assert_clean(response, scene)
    assert snapshot(db_path) == before, "a refused request changed the database"


# -- /mcp: transport-level refusals ------------------------------------------------------------------

INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
LIST = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
ACCEPT = {"Accept": "application/json, text/event-stream"}

# (id, headers kind, extra headers, body, expected status, expected answer)
# expected answer: ("error", code) for the error body, ("rpc", code) for a JSON-RPC error object.
MCP_ROWS: list[tuple] = [
    ("no-token", "none", {}, INIT, 401, ("error", "unauthenticated")),
    ("unknown-token", "raw:Bearer sbk_nope", {}, INIT, 401, ("error", "unauthenticated")),
    ("wrong-scheme", "raw:Basic c2JrOm5vcGU=", {}, INIT, 401, ("error", "unauthenticated")),
    ("revoked-token", "revoked", {}, INIT, 401, ("error", "unauthenticated")),
    ("human-token", "human", {}, INIT, 403, ("error", "forbidden")),
    ("bad-origin", "router", {"Origin": "https://evil.example"}, INIT, 403, ("error", "forbidden")),
    ("null-origin", "router", {"Origin": "null"}, INIT, 403, ("error", "forbidden")),
    ("lookalike-origin", "router", {"Origin": "http://testserver.evil.example"}, INIT, 403, ("error", "forbidden")),
    ("malformed-json", "router", {}, b"{nope", 400, ("rpc", -32700)),
    ("empty-body", "router", {}, b"", 400, ("rpc", -32700)),
    ("nan-json", "router", {}, b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"x": NaN}}', 400,
     ("rpc", -32700)),
    ("not-an-object", "router", {}, b"[]", 400, ("rpc", -32600)),
    ("wrong-jsonrpc-version", "router", {}, {**INIT, "jsonrpc": "1.0"}, 400, ("rpc", -32600)),
    ("unknown-session", "router", {"Mcp-Session-Id": "forged"}, LIST, 404, ("rpc", None)),
    ("unknown-session-get", "router", {"Mcp-Session-Id": "forged"}, "GET", 404, ("rpc", None)),
    ("unknown-session-delete", "router", {"Mcp-Session-Id": "forged"}, "DELETE", 404, ("rpc", None)),
    ("bad-content-length", "router", {"Content-Length": "2x"}, b"{}", 400, ("error", BAD)),
    ("no-session-tools-list", "router", {}, LIST, 400, ("rpc", -32600)),
    ("get-without-session", "router", {}, "GET", 400, ("rpc", -32600)),
    ("body-over-1mib", "router", {}, Raw(lambda scene: (b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "x": "'
                                                        + b"x" * (MIB + 1) + b'"}', {})), 413,
     ("error", "too_large")),
]


@pytest.mark.parametrize("auth,extra,body,status,expected", [_param(r) for r in MCP_ROWS])
def test_mcp_refusals_are_clean_and_change_nothing(world, scene, db_path, auth, extra, body, status, expected):
    before = snapshot(db_path)
    method = body if body in ("GET", "DELETE") else "POST"
    response = send(scene, world.client, method, "/mcp", auth, None if method != "POST" else body,
                    {**ACCEPT, "Content-Type": "application/json", **extra})

    assert response.status_code != 500, f"500 on bad input: {response.text}"
    assert response.status_code == status, (response.status_code, response.text[:300])
    answer = response.json()
    kind, code = expected
    if kind == "error":
        assert answer.get("error") == code, answer
        assert isinstance(answer.get("message"), str) and "\n" not in answer["message"], answer
    else:
        assert answer.get("jsonrpc") == "2.0" and isinstance(answer.get("error"), dict), answer
        assert isinstance(answer["error"].get("code"), int), answer
        if code is not None:
            assert answer["error"]["code"] == code, answer
    assert_clean(response, scene)
    assert snapshot(db_path) == before, "a refused MCP request changed the database"


# -- /mcp: tool errors inside a session -------------------------------------------------------------
# (id, endpoint, tool, arguments ("$name" -> scene id), expected error code in structuredContent)

TOOL_ROWS: list[tuple] = [
    ("create-webhook-without-verb", "worker", "create_webhook", {"provider": "github", "queue": "build"}, FORBIDDEN),
    ("create-webhook-unknown-provider", "router", "create_webhook", {"provider": "gitlab", "queue": "triage"}, BAD),
    ("create-webhook-reserved-queue", "router", "create_webhook", {"provider": "github", "queue": "quarantine"},
     BAD),
    ("create-webhook-generic-secret", "router", "create_webhook",
     {"provider": "generic", "queue": "triage", "secret": "x" * 20}, BAD),
    ("create-webhook-extra-field", "router", "create_webhook",
     {"provider": "github", "queue": "triage", "trust_mode": "token"}, BAD),
    ("create-webhook-over-max", "capped", "create_webhook", {"provider": "github", "queue": "triage"}, CONFLICT),
    ("list-webhooks-without-verb", "worker", "list_webhooks", {}, FORBIDDEN),
    ("delete-webhook-of-another-endpoint", "router", "delete_webhook", {"webhook_id": "$capped_hook"}, NOT_FOUND),
    ("delete-webhook-foreign", "router", "delete_webhook", {"webhook_id": "$bob_hook"}, NOT_FOUND),
    ("delete-webhook-malformed-id", "router", "delete_webhook", {"webhook_id": "gh"}, BAD),
    ("rotate-webhook-extra-field", "router", "rotate_webhook", {"webhook_id": "$gh", "force": True}, BAD),
    ("set-secret-generic", "router", "set_webhook_secret", {"webhook_id": "$generic", "secret": "x" * 20}, BAD),
    ("set-secret-stripe-without-whsec", "router", "set_webhook_secret",
     {"webhook_id": "$stripe", "secret": "y" * 20}, BAD),
    ("get-rules-foreign", "router", "get_webhook_rules", {"webhook_id": "$bob_hook"}, NOT_FOUND),
    ("set-rules-forbidden", "router", "set_webhook_rules", {"webhook_id": "$gh", "rules": [rule(expr="env")]}, BAD),
    ("set-rules-parse-error", "router", "set_webhook_rules", {"webhook_id": "$gh", "rules": [rule(expr="if")]},
     BAD),
    ("set-rules-no-target", "router", "set_webhook_rules",
     {"webhook_id": "$gh", "rules": [rule(action={"queue": "build"})]}, BAD),
    ("test-rules-neither", "router", "test_webhook_rules", {"webhook_id": "$gh"}, BAD),
    ("test-rules-foreign-event", "router", "test_webhook_rules", {"webhook_id": "$gh", "event_id": "$bob_event"},
     NOT_FOUND),
    ("add-route-foreign-no-friend", "router", "add_webhook_route", {"webhook_id": "$gh", "endpoint_id": "$bob_ep"},
     FORBIDDEN),
    ("add-route-revoked", "router", "add_webhook_route", {"webhook_id": "$gh", "endpoint_id": "$revoked_ep"},
     CONFLICT),
    ("remove-route-unknown", "router", "remove_webhook_route", {"webhook_id": "$gh", "endpoint_id": "$worker"},
     NOT_FOUND),
    ("list-events-bad-disposition", "router", "list_webhook_events", {"webhook_id": "$gh", "disposition": "bogus"},
     BAD),
    ("get-event-operator-authored", "router", "get_webhook_event", {"event_id": "$op_event"}, NOT_FOUND),
    ("get-event-foreign", "router", "get_webhook_event", {"event_id": "$bob_event"}, NOT_FOUND),
    ("claim-malformed-id", "worker", "claim", {"id": "nope"}, BAD),
    ("claim-foreign-todo", "worker", "claim", {"id": "$bob_todo"}, NOT_FOUND),
    ("claim-next-outside-scope", "worker", "claim_next", {"queue": "triage"}, FORBIDDEN),
]


def mcp_session(client, scene: Scene, who: str) -> dict:
    headers = {**ACCEPT, "Authorization": scene.principals[who]}
    made = client.post("/mcp", json=INIT, headers=headers)
    assert made.status_code == 200, made.text
    headers = {**headers, "Mcp-Session-Id": made.headers["mcp-session-id"], "MCP-Protocol-Version": "2025-11-25"}
    assert client.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                       headers=headers).status_code == 202
    return headers


@pytest.mark.parametrize("who,tool,arguments,code", [_param(r) for r in TOOL_ROWS])
def test_mcp_tool_errors_are_clean_and_change_nothing(world, scene, db_path, who, tool, arguments, code):
    headers = mcp_session(world.client, scene, who)
    before = snapshot(db_path)
    response = world.client.post("/mcp", headers=headers, json={
        "jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {"name": tool, "arguments": fill(arguments, scene.ids)}})
    assert response.status_code == 200, (response.status_code, response.text[:300])
    result = response.json()["result"]
    assert result["isError"] is True, result
    error = result["structuredContent"]
    assert error["error"] == code, error
    assert isinstance(error["message"], str) and error["message"].strip() and "\n" not in error["message"], error
    assert json.loads(result["content"][0]["text"]) == error
    assert_clean(response, scene)
    assert snapshot(db_path) == before, "a refused tool call changed the database"


def test_unknown_tool_is_a_json_rpc_error(world, scene, db_path):
    headers = mcp_session(world.client, scene, "router")
    before = snapshot(db_path)
    response = world.client.post("/mcp", headers=headers, json={
        "jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": {"name": "drop_tables", "arguments": {}}})
    assert response.status_code != 500
    assert response.json()["error"]["code"] == -32602, response.text
    assert snapshot(db_path) == before


def test_the_scene_is_what_the_rows_assume(world, scene):
    """Guards the table: the ids the rows rely on are in the states and places the rows assume."""
    c, ids = world.client, scene.ids
    alice = {"Authorization": scene.principals["human"]}
    assert c.get(f"/api/v1/todos/{ids['held']}", headers=alice).json()["state"] == "quarantined"
    assert c.get(f"/api/v1/todos/{ids['pending']}", headers=alice).json()["state"] == "pending"
    routes = c.get(f"/api/v1/webhooks/{ids['gh']}/routes", headers=alice).json()["routes"]
    assert [r["endpoint_id"] for r in routes] == [ids["lane"]]
    friends = c.get("/api/v1/friends", headers=alice).json()["friends"]
    assert [(f["id"], f["approved_at"]) for f in friends] == [(ids["pending_edge"], None)]
    endpoints = {e["name"]: e for e in c.get("/api/v1/endpoints", headers=alice).json()["endpoints"]}
    assert endpoints["revoked"]["revoked_at"] and endpoints["doomed"]["revoked_at"]
    hooks = {h["id"]: h for h in c.get("/api/v1/webhooks", headers=alice).json()["webhooks"]}
    assert hooks[ids["stripe"]]["secret_set"] is True
    assert sum(1 for h in hooks.values() if h["endpoint_id"] == ids["capped"]) == 1
    # The same requests, made valid, succeed: so the rows above fail for the reason they name.
    ok = c.post(f"/api/v1/webhooks/{ids['gh']}/rules/test", headers=alice, json={"event_id": ids["gh_event"]})
    assert ok.status_code == 200, ok.text
    raw, headers = stripe_fresh(scene)
    assert c.post(f"/hooks/{ids['stripe_token']}", content=raw, headers=headers).status_code == 202
    raw, headers = producers.slack(SLACK_SECRET, SLACK_EVENT, at=scene.now_s())
    assert c.post(f"/hooks/{ids['slack_token']}", content=raw, headers=headers).status_code == 202
    raw, headers = producers.cairn(scene.secrets["cairn"], created_at=scene.now_s())
    assert c.post(f"/hooks/{ids['cairn_token']}", content=raw, headers=headers).status_code == 202
    released = c.post(f"/api/v1/todos/{ids['held']}/release-quarantine", headers=alice, json={"queue": "triage"})
    assert released.status_code == 200 and released.json()["state"] == "pending", released.text
    carol = {"Authorization": scene.principals["carol"]}
    assert c.post(f"/api/v1/friends/{ids['pending_edge']}/approve", headers=carol).status_code == 200
    assert c.post(f"/api/v1/webhooks/{ids['gh']}/routes", headers=alice,
                  json={"endpoint_id": ids["carol_ep"]}).status_code == 201
    assert c.put(f"/api/v1/webhooks/{ids['gh']}/rules", headers=alice,
                 json=rules(rule(action={"queue": "lane-s", "endpoints": [ids["lane"]]}))).status_code == 200


# -- a foreign id answers exactly like an unknown one ---------------------------------------------------

SAME_AS_UNKNOWN = [  # (method, path with {id}, body, foreign placeholder, unknown placeholder)
    ("GET", "/api/v1/webhooks/{id}", None, "bob_hook", "unknown_hook"),
    ("DELETE", "/api/v1/webhooks/{id}", None, "bob_hook", "unknown_hook"),
    ("POST", "/api/v1/webhooks/{id}/rotate", None, "bob_hook", "unknown_hook"),
    ("PUT", "/api/v1/webhooks/{id}/secret", {"secret": STRIPE_SECRET}, "bob_hook", "unknown_hook"),
    ("GET", "/api/v1/webhooks/{id}/rules", None, "bob_hook", "unknown_hook"),
    ("PUT", "/api/v1/webhooks/{id}/rules", {"rules": []}, "bob_hook", "unknown_hook"),
    ("POST", "/api/v1/webhooks/{id}/rules/test", {"payload": {}}, "bob_hook", "unknown_hook"),
    ("GET", "/api/v1/webhooks/{id}/routes", None, "bob_hook", "unknown_hook"),
    ("POST", "/api/v1/webhooks/{id}/routes", {"endpoint_id": "$worker"}, "bob_hook", "unknown_hook"),
    ("GET", "/api/v1/webhooks/{id}/events", None, "bob_hook", "unknown_hook"),
    ("GET", "/api/v1/events/{id}", None, "bob_event", "unknown_event"),
    ("POST", "/api/v1/webhooks/{gh}/rules/test", {"event_id": "{id}"}, "bob_event", "unknown_event"),
    ("POST", "/api/v1/todos/{id}/release-quarantine", {}, "bob_todo", "unknown_todo"),
    ("POST", "/api/v1/webhooks", {**HOOK, "endpoint_id": "{id}"}, "bob_ep", "unknown_ep"),
]


@pytest.mark.parametrize("method,path,body,foreign,unknown", SAME_AS_UNKNOWN,
                         ids=[f"{m}-{p}-{f}" for m, p, _, f, _u in SAME_AS_UNKNOWN])
def test_a_foreign_id_is_indistinguishable_from_an_unknown_one(world, scene, db_path, method, path, body, foreign,
                                                               unknown):
    before = snapshot(db_path)
    answers = {}
    for name in (foreign, unknown):
        concrete = fill(json.loads(json.dumps(body).replace("{id}", "$" + name)), scene.ids) if body else None
        answers[name] = send(scene, world.client, method, path.replace("{id}", "{" + name + "}"), "human", concrete)
    a, b = answers[foreign], answers[unknown]
    assert a.status_code == b.status_code == 404, (a.text, b.text)
    assert a.json()["error"] == b.json()["error"] == "not_found"
    assert a.json()["message"].replace(scene.ids[foreign], "<id>") == \
        b.json()["message"].replace(scene.ids[unknown], "<id>"), (a.text, b.text)
    assert snapshot(db_path) == before


# -- a refused runaway rule does not take the evaluator down with it ------------------------------------

def test_a_refused_runaway_rule_leaves_the_evaluator_serving_the_next_save(world, scene, db_path):
    """SPEC 5: a rule that overruns is killed and restarted at 2 s. The dry run refuses a runaway rule (400);
    the save right after it, which needs the evaluator too, must be evaluated (by a restarted child, within
    the 2 s the kill takes), not refused with 503."""
    alice = {"Authorization": scene.principals["human"]}
    path = f"/api/v1/webhooks/{scene.ids['gh']}/rules"
    runaway = world.client.put(path, headers=alice, json=rules(rule("loop", "def f: f; f")))
    assert runaway.status_code == 400 and "rules[0] (id 'loop')" in runaway.json()["message"], runaway.text
    started = time.monotonic()
    valid = world.client.put(path, headers=alice, json=rules(rule("ok", '.kind == "issues"')))
    assert valid.status_code == 200, (valid.status_code, valid.text, f"after {time.monotonic() - started:.1f} s")
    assert [r["id"] for r in valid.json()["rules"]] == ["ok"]


# -- producer text holding NUL: a signed, well-formed delivery is never a 500 ------------------------------

NUL_DELIVERIES = [  # (id, provider, patch of the fixture body)
    ("github-repo-name-nul", "github", {"repository": {"full_name": "\u0000"}}),
    ("github-repo-name-leading-nul", "github", {"repository": {"full_name": "\u0000evil/repo"}}),
    ("github-issue-title-nul", "github", {"issue": {"title": "\u0000"}}),
    ("gitea-repo-name-leading-nul", "gitea", {"repository": {"full_name": "\u0000evil/repo"}}),
    ("cairn-title-nul", "cairn", {"data": {"title": "\u0000"}}),
    ("cairn-title-leading-nul", "cairn", {"data": {"title": "\u0000hidden"}}),
]


@pytest.mark.parametrize("provider,patch", [pytest.param(p, q, id=i) for i, p, q in NUL_DELIVERIES])
def test_signed_delivery_with_nul_in_producer_text_is_never_a_500(world, scene, db_path, provider, patch):
    """SPEC 3 and 12: the body is authentic and valid JSON, so it is either accepted (202, the todo titled with
    something non-empty) or refused cleanly (4xx, nothing stored), never a 500 the producer retries forever."""
    ids, secret = scene.ids, scene.secrets
    if provider == "github":
        raw, headers = producers.github("issues.opened", secret["gh"], patch)
        token = ids["gh_token"]
    elif provider == "gitea":
        made = world.client.post("/api/v1/webhooks", headers={"Authorization": scene.principals["human"]},
                                 json={"provider": "gitea", "queue": "triage", "endpoint_id": ids["router"],
                                       "trusted_actors": {"allow_all": True}}).json()
        raw, headers = producers.gitea("issues.opened", made["secret"], patch)
        token = made["url"].rsplit("/hooks/", 1)[1]
    else:
        raw, headers = producers.cairn(secret["cairn"], patch={"event_id": "e-nul", **patch}, created_at=scene.now_s())
        token = ids["cairn_token"]
    before = snapshot(db_path)
    response = world.client.post(f"/hooks/{token}", content=raw, headers=headers)
    assert response.status_code != 500, f"500 on a signed delivery: {response.text}"
    if response.status_code == 202:
        outcome = response.json()
        assert outcome["created"] == 1, outcome
        todo = world.client.get(f"/api/v1/todos/{outcome['todos'][0]['id']}",
                                headers={"Authorization": scene.principals["human"]}).json()
        assert todo["title"].replace("\u0000", "").strip(), todo["title"]
    else:
        assert 400 <= response.status_code < 500, response.text
        assert response.json()["error"] and "\n" not in response.json()["message"]
        assert snapshot(db_path) == before
