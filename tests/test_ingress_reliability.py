"""Ingress reliability: dedup under concurrent redelivery and replay, fan-out over routes, friend edges,
crash safety under SIGKILL, the webhook lifecycle, and a server log free of credentials.

Everything here is real: a `switchboard.py serve` subprocess or the app through Starlette's test client, a
real SQLite file, and deliveries signed with real HMAC-SHA256 exactly as each producer signs them (SPEC §3).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from pathlib import Path

import httpx
from conftest import cli, workdir
from helpers import (
    TLS,
    add_route,
    assert_storage_intact,
    count,
    hook_path,
    hook_token,
    make_webhook,
    post_delivery,
    query,
)
from producers import deep_merge, github_headers, hex_hmac, stripe_headers

FIXTURES = Path(os.environ.get("SWITCHBOARD_FIXTURES") or Path(__file__).resolve().parent / "fixtures")
ISSUE_OPENED = (FIXTURES / "github" / "issues.opened.json").read_bytes()
QUEUE = "triage"


# -- helpers ----------------------------------------------------------------------------------------

def issue_body(patch: dict | None = None) -> bytes:
    """The GitHub `issues.opened` fixture, verbatim or with a patch merged in (signed after patching)."""
    if patch is None:
        return ISSUE_OPENED
    return json.dumps(deep_merge(json.loads(ISSUE_OPENED), patch)).encode()


def deliver(http, webhook: dict, body: bytes | None = None, delivery: str | None = None) -> httpx.Response:
    """The `issues.opened` fixture (or `body`), signed with the webhook's secret, to its ingest URL."""
    body = issue_body() if body is None else body
    return post_delivery(http, webhook, body, github_headers(webhook["secret"], body, delivery))


class Auth:
    """A bearer principal made over REST against a live server (no store helpers in another process)."""

    def __init__(self, token: str, id: str):
        self.token = token
        self.id = id

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"}


def live_principals(db_path: str, http: httpx.Client, name: str = "alice", endpoints: int = 1) -> tuple[Auth, list[Auth]]:
    """A human made by the operator CLI (run in-process), and endpoints that human vends over REST, all scoped
    to QUEUE."""
    code, human = cli(db_path, "human", "add", name)
    assert code == 0, human
    owner = Auth(human["token"], human["id"])
    made = []
    for i in range(endpoints):
        r = http.post("/api/v1/endpoints", headers=owner.auth,
                      json={"name": f"{name}-ep{i}", "queues": [QUEUE], "verbs": ["all"]})
        assert r.status_code == 201, r.text
        made.append(Auth(r.json()["token"], r.json()["id"]))
    return owner, made


# -- 1. concurrent redelivery -----------------------------------------------------------------------

def test_32_concurrent_redeliveries_of_one_delivery_mint_exactly_one_todo(db_path, live_server):
    assert cli(db_path, "init")[0] == 0
    server = live_server("--ingest-rate", "0")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        human, (owner,) = live_principals(db_path, http)
        webhook = make_webhook(http, human, owner.id)
    assert webhook["url"].startswith(server.url + "/hooks/")

    body = issue_body()
    headers = github_headers(webhook["secret"], body, str(uuid.uuid4()))
    barrier = threading.Barrier(32)
    answers: list = [None] * 32

    def send(i: int) -> None:
        try:
            barrier.wait(timeout=20)
            with httpx.Client(timeout=30, verify=TLS) as c:
                r = c.post(webhook["url"], content=body, headers=headers)
            answers[i] = (r.status_code, r.json())
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            answers[i] = ("error", repr(exc))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)

    assert all(a is not None and a[0] == 202 for a in answers), answers
    firsts = [body for _, body in answers if not body.get("duplicate")]
    dupes = [body for _, body in answers if body.get("duplicate")]
    assert len(firsts) == 1, firsts
    first = firsts[0]
    assert first["created"] == 1 and first["disposition"] == "routed" and first["verified"] is True
    assert "duplicate" not in first
    assert len(first["todos"]) == 1 and first["todos"][0]["endpoint_id"] == owner.id
    assert first["todos"][0]["queue"] == QUEUE and first["todos"][0]["created"] is True
    assert len(dupes) == 31
    for dupe in dupes:
        assert dupe["duplicate"] is True and dupe["created"] == 0
        assert dupe["event_id"] == first["event_id"]
        assert [t["id"] for t in dupe["todos"]] == [t["id"] for t in first["todos"]]
        assert all(t["created"] is False for t in dupe["todos"])

    assert count(db_path, "events", "webhook_id = ?", (webhook["id"],)) == 1
    assert count(db_path, "todos") == 1
    assert query(db_path, "SELECT id, event_id, endpoint_id FROM todos") == [
        (first["todos"][0]["id"], first["event_id"], owner.id)]


# -- 2. replay and generic dedup --------------------------------------------------------------------

def test_replayed_signed_body_under_a_new_delivery_id_is_a_duplicate(world, client, db_path):
    human = world.human("alice")
    owner = world.endpoint(human, [QUEUE], verbs=["all"])
    webhook = make_webhook(client, human, owner.id)

    body = issue_body()
    first = deliver(client, webhook, body, "delivery-one")
    assert first.status_code == 202, first.text
    first = first.json()
    assert first["created"] == 1 and "duplicate" not in first

    # An attacker (or a confused proxy) resends the captured signed bytes under a fresh delivery id.
    replay = deliver(client, webhook, body, str(uuid.uuid4()))
    assert replay.status_code == 202, replay.text
    replay = replay.json()
    assert replay["duplicate"] is True and replay["created"] == 0
    assert replay["event_id"] == first["event_id"]
    assert [t["id"] for t in replay["todos"]] == [t["id"] for t in first["todos"]]
    assert count(db_path, "events") == 1 and count(db_path, "todos") == 1
    # The stored event keeps the headers with the signature redacted (SPEC §3 step 5, §4).
    signature = github_headers(webhook["secret"], body)["X-Hub-Signature-256"]
    (headers_text, envelope_text), = query(db_path, "SELECT headers, envelope FROM events")
    assert json.loads(headers_text)["x-hub-signature-256"] == "«redacted»"
    assert json.loads(headers_text)["x-github-delivery"] == "delivery-one"
    assert signature[7:] not in headers_text and signature[7:] not in envelope_text
    assert webhook["secret"] not in headers_text + envelope_text

    # A genuinely new body under a new id is new work.
    other = deliver(client, webhook, issue_body({"issue": {"number": 2, "title": "another"}}), str(uuid.uuid4()))
    assert other.status_code == 202 and other.json()["created"] == 1 and "duplicate" not in other.json()
    assert count(db_path, "events") == 2 and count(db_path, "todos") == 2


def test_generic_webhook_is_deduped_by_its_delivery_id(world, client, db_path):
    human = world.human("alice")
    owner = world.endpoint(human, [QUEUE], verbs=["all"])
    webhook = make_webhook(client, human, owner.id, provider="generic")
    assert webhook["trust_mode"] == "token" and webhook["secret"] is None
    path = hook_path(webhook["url"])

    def post(body: dict, **headers) -> dict:
        r = client.post(path, content=json.dumps(body).encode(),
                        headers={"Content-Type": "application/json", **headers})
        assert r.status_code == 202, r.text
        return r.json()

    first = post({"n": 1}, **{"X-Delivery-Id": "gen-1", "X-Event-Type": "build.failed"})
    assert first["created"] == 1 and first["verified"] is False and "duplicate" not in first
    again = post({"n": 1}, **{"X-Delivery-Id": "gen-1", "X-Event-Type": "build.failed"})
    assert again["duplicate"] is True and again["created"] == 0 and again["event_id"] == first["event_id"]
    # The delivery id is the key: a producer retry whose bytes changed is still the same delivery.
    retried = post({"n": 1, "retry": 2}, **{"X-Delivery-Id": "gen-1"})
    assert retried["duplicate"] is True and retried["created"] == 0 and retried["event_id"] == first["event_id"]
    assert count(db_path, "events") == 1 and count(db_path, "todos") == 1

    # Another delivery id is another delivery.
    second = post({"n": 2}, **{"X-Delivery-Id": "gen-2"})
    assert second["created"] == 1 and "duplicate" not in second and second["event_id"] != first["event_id"]
    # `Webhook-Id` is the fallback delivery id.
    third = post({"n": 3}, **{"Webhook-Id": "msg_3"})
    third_again = post({"n": 3}, **{"Webhook-Id": "msg_3"})
    assert third["created"] == 1 and third_again["duplicate"] is True and third_again["event_id"] == third["event_id"]
    assert count(db_path, "events") == 3 and count(db_path, "todos") == 3
    keys = {k for (k,) in query(db_path, "SELECT delivery_key FROM events")}
    assert keys == {"gen-1", "gen-2", "msg_3"}


# -- 3. fan-out over routes -------------------------------------------------------------------------

def test_two_routes_give_three_independently_claimable_todos_and_redelivery_adds_none(world, client, clock, db_path):
    human = world.human("alice")
    owner = world.endpoint(human, [QUEUE], verbs=["all"])
    second, third = sorted([world.endpoint(human, [QUEUE], verbs=["all"]),
                            world.endpoint(human, [QUEUE, "other"], verbs=["all"])], key=lambda e: e.id, reverse=True)
    webhook = make_webhook(client, human, owner.id)
    # Granted in the reverse of id order, a second apart: the grant time decides the order, not the id.
    for target in (second, third):
        clock.advance(1)
        r = add_route(client, human.auth, webhook["id"], target.id)
        assert r.status_code == 201, r.text
    routes = client.get(f"/api/v1/webhooks/{webhook['id']}/routes", headers=human.auth).json()["routes"]
    assert {r["endpoint_id"] for r in routes} == {second.id, third.id}

    body = issue_body()
    delivery = str(uuid.uuid4())
    r = deliver(client, webhook, body, delivery)
    assert r.status_code == 202, r.text
    out = r.json()
    assert out["created"] == 3 and out["disposition"] == "routed"
    # SPEC §6: the owner endpoint first, then the routes in grant order.
    assert [t["endpoint_id"] for t in out["todos"]] == [owner.id, second.id, third.id]
    assert all(t["queue"] == QUEUE and t["created"] is True for t in out["todos"])
    assert len({t["id"] for t in out["todos"]}) == 3
    by_endpoint = {t["endpoint_id"]: t["id"] for t in out["todos"]}

    again = deliver(client, webhook, body, delivery)
    assert again.status_code == 202 and again.json()["duplicate"] is True and again.json()["created"] == 0
    assert [t["id"] for t in again.json()["todos"]] == [t["id"] for t in out["todos"]]
    assert count(db_path, "todos") == 3 and count(db_path, "events") == 1

    # Each endpoint sees and claims only its own copy; claiming one leaves the others claimable.
    for endpoint in (owner, second, third):
        listed = client.get("/api/v1/todos", headers=endpoint.auth).json()["todos"]
        assert [t["id"] for t in listed] == [by_endpoint[endpoint.id]]
    for endpoint in (third, owner, second):
        claimed = world.claim(endpoint)
        assert claimed["todo"]["id"] == by_endpoint[endpoint.id], claimed
        assert claimed["todo"]["endpoint_id"] == endpoint.id and claimed["todo"]["state"] == "claimed"
        assert world.claim(endpoint) == {"empty": True}
    states = dict(query(db_path, "SELECT id, state FROM todos"))
    assert states == {tid: "claimed" for tid in by_endpoint.values()}
    # The human sees all three across its own endpoints.
    mine = client.get("/api/v1/todos", headers=human.auth).json()["todos"]
    assert {t["id"] for t in mine} == set(by_endpoint.values())


def test_route_targets_without_the_queue_or_revoked_get_no_todo(world, client, db_path):
    human = world.human("alice")
    owner = world.endpoint(human, [QUEUE], verbs=["all"])
    unscoped = world.endpoint(human, ["other"], verbs=["all"])
    revoked = world.endpoint(human, [QUEUE], verbs=["all"])
    live = world.endpoint(human, [QUEUE], verbs=["all"])
    webhook = make_webhook(client, human, owner.id)
    for target in (unscoped, revoked, live):
        r = add_route(client, human.auth, webhook["id"], target.id)
        assert r.status_code == 201, r.text
    r = client.post(f"/api/v1/endpoints/{revoked.id}/revoke", headers=human.auth, json={})
    assert r.status_code == 200, r.text

    r = deliver(client, webhook)
    assert r.status_code == 202, r.text
    out = r.json()
    assert out["created"] == 2 and out["disposition"] == "routed"
    assert [t["endpoint_id"] for t in out["todos"]] == [owner.id, live.id]
    assert sorted(e for (e,) in query(db_path, "SELECT endpoint_id FROM todos")) == sorted([owner.id, live.id])
    assert client.get("/api/v1/todos", headers=unscoped.auth).json()["todos"] == []
    assert world.claim(unscoped) == {"empty": True}
    # The revoked endpoint's token no longer works at all.
    assert client.get("/api/v1/todos", headers=revoked.auth).status_code == 401


# -- 4. friend edges --------------------------------------------------------------------------------

def test_cross_human_route_needs_an_approved_friend_edge(world, client, db_path):
    alice = world.human("alice")
    bob = world.human("bob")
    alice_ep = world.endpoint(alice, [QUEUE], verbs=["all"])
    bob_ep = world.endpoint(bob, [QUEUE], verbs=["all"])
    webhook = make_webhook(client, alice, alice_ep.id)
    routes_url = f"/api/v1/webhooks/{webhook['id']}/routes"

    def refused() -> None:
        r = add_route(client, alice.auth, webhook["id"], bob_ep.id)
        assert r.status_code == 403, r.text
        assert r.json()["error"] == "forbidden"
        assert client.get(routes_url, headers=alice.auth).json()["routes"] == []
        assert count(db_path, "webhook_routes") == 0

    refused()
    r = client.post("/api/v1/friends", headers=alice.auth, json={"human": "bob"})
    assert r.status_code == 201, r.text
    edge = r.json()
    refused()  # requested, not approved
    # The requester cannot approve its own request.
    r = client.post(f"/api/v1/friends/{edge['id']}/approve", headers=alice.auth, json={})
    assert r.status_code in (403, 404), r.text
    refused()

    r = client.post(f"/api/v1/friends/{edge['id']}/approve", headers=bob.auth, json={})
    assert r.status_code == 200, r.text
    r = add_route(client, alice.auth, webhook["id"], bob_ep.id)
    assert r.status_code == 201, r.text
    assert [x["endpoint_id"] for x in client.get(routes_url, headers=alice.auth).json()["routes"]] == [bob_ep.id]

    out = deliver(client, webhook).json()
    assert [t["endpoint_id"] for t in out["todos"]] == [alice_ep.id, bob_ep.id]
    bob_todo = out["todos"][1]["id"]
    assert [t["id"] for t in client.get("/api/v1/todos", headers=bob.auth).json()["todos"]] == [bob_todo]
    assert world.claim(bob_ep)["todo"]["id"] == bob_todo

    # The edge is directed: alice -> bob does not let bob route to alice.
    bob_hook = make_webhook(client, bob, bob_ep.id)
    r = add_route(client, bob.auth, bob_hook["id"], alice_ep.id)
    assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
    assert count(db_path, "webhook_routes", "webhook_id = ?", (bob_hook["id"],)) == 0


def test_cross_human_route_through_the_cli(db_path):
    for name in ("alice", "bob"):
        assert cli(db_path, "human", "add", name)[0] == 0
    code, alice_ep = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "a", "--queues", QUEUE,
                         "--verbs", "all")
    assert code == 0, alice_ep
    code, bob_ep = cli(db_path, "endpoint", "vend", "--human", "bob", "--name", "b", "--queues", QUEUE,
                       "--verbs", "all")
    assert code == 0, bob_ep
    code, hook = cli(db_path, "webhook", "create", "--endpoint", alice_ep["id"], "--provider", "github",
                     "--queue", QUEUE, "--allow-all")
    assert code == 0, hook
    assert set(hook) >= {"id", "url", "secret", "provider", "queue"}
    assert hook["url"].startswith("http://127.0.0.1:8080/hooks/")

    code, refused = cli(db_path, "route", "add", hook["id"], bob_ep["id"])
    assert code == 1 and refused.get("error") == "forbidden", refused
    assert cli(db_path, "route", "list", hook["id"]) == (0, {"routes": []})

    code, linked = cli(db_path, "friend", "link", "alice", "bob")
    assert code == 0, linked
    code, route = cli(db_path, "route", "add", hook["id"], bob_ep["id"])
    assert code == 0 and route["endpoint_id"] == bob_ep["id"], route
    code, listed = cli(db_path, "route", "list", hook["id"])
    assert [r["endpoint_id"] for r in listed["routes"]] == [bob_ep["id"]]

    # Reverse direction stays refused.
    code, bob_hook = cli(db_path, "webhook", "create", "--endpoint", bob_ep["id"], "--provider", "github",
                         "--queue", QUEUE, "--allow-all")
    assert code == 0, bob_hook
    code, refused = cli(db_path, "route", "add", bob_hook["id"], alice_ep["id"])
    assert code == 1 and refused.get("error") == "forbidden", refused
    assert count(db_path, "webhook_routes", "webhook_id = ?", (bob_hook["id"],)) == 0


# -- 5. crash safety --------------------------------------------------------------------------------

class CrashRun:
    """Four senders post distinct signed deliveries while the server is SIGKILLed; the server is restarted."""

    def __init__(self, db_path: str, live_server, kill_after: float = 1.5):
        assert cli(db_path, "init")[0] == 0
        self.db_path = db_path
        self.first = live_server("--ingest-rate", "0")
        with httpx.Client(base_url=self.first.url, timeout=10) as http:
            self.human, (owner, extra) = live_principals(db_path, http, endpoints=2)
            self.endpoints = [owner, extra]
            self.webhook = make_webhook(http, self.human, owner.id)
            r = add_route(http, self.human.auth, self.webhook["id"], extra.id)
            assert r.status_code == 201, r.text
            # A few bad-signature deliveries and an unknown token, for the log test.
            self.bad_signatures = [hex_hmac("not-the-secret-" + str(i), ISSUE_OPENED) for i in range(3)]
            for sig in self.bad_signatures:
                r = http.post(hook_path(self.webhook["url"]), content=ISSUE_OPENED,
                              headers={**github_headers(self.webhook["secret"], ISSUE_OPENED),
                                       "X-Hub-Signature-256": "sha256=" + sig})
                assert r.status_code == 401, r.text
            self.unknown_token = "Zz" + uuid.uuid4().hex
            assert http.post(f"/hooks/{self.unknown_token}", content=b"{}").status_code == 404

        self.acked: dict[str, dict] = {}  # delivery id -> {body, headers, outcome}
        self.statuses: list = []
        self.errors: list = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        url = self.first.url + hook_path(self.webhook["url"])

        def sender(n: int) -> None:
            deadline = time.monotonic() + 15
            with httpx.Client(timeout=5, verify=TLS) as c:
                for i in range(5000):
                    if self.stop.is_set() or time.monotonic() > deadline:
                        return
                    number = 1000 + n * 100_000 + i
                    body = issue_body({"issue": {"number": number, "title": f"crash probe {n}/{i}"}})
                    headers = github_headers(self.webhook["secret"], body)
                    try:
                        r = c.post(url, content=body, headers=headers)
                    except httpx.HTTPError as exc:
                        with self.lock:
                            self.errors.append((time.monotonic() - started, repr(exc)))
                        return  # the server is gone
                    with self.lock:
                        self.statuses.append(r.status_code)
                        if r.status_code == 202:
                            self.acked[headers["X-GitHub-Delivery"]] = {"body": body, "headers": headers,
                                                                        "outcome": r.json()}

        started = time.monotonic()
        threads = [threading.Thread(target=sender, args=(n,), daemon=True) for n in range(4)]
        for t in threads:
            t.start()
        time.sleep(kill_after)
        self.senders_alive_at_kill = sum(t.is_alive() for t in threads)
        self.first.proc.kill()  # SIGKILL while the senders are mid-flight
        self.first.proc.wait(timeout=10)
        self.stop.set()
        for t in threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in threads)
        self.second = live_server("--ingest-rate", "0")


def test_sigkill_loses_no_acknowledged_delivery_and_leaves_no_half_written_one(db_path, live_server):
    run = CrashRun(db_path, live_server)
    assert set(run.statuses) <= {202}, sorted(set(run.statuses))
    assert run.senders_alive_at_kill == 4, f"the kill must land while all senders are posting: {run.errors}"
    assert len(run.acked) >= 10, f"only {len(run.acked)} deliveries acknowledged before the kill"

    owner, extra = run.endpoints
    events = {ev_id: key for ev_id, key in query(
        db_path, "SELECT id, delivery_key FROM events WHERE webhook_id = ?", (run.webhook["id"],))}
    todos: dict[str, set] = {}
    for todo_id, event_id, endpoint_id, state, queue in query(
            db_path, "SELECT id, event_id, endpoint_id, state, queue FROM todos"):
        assert state == "pending" and queue == QUEUE
        todos.setdefault(event_id, set()).add((todo_id, endpoint_id))

    # Every acknowledged delivery survived with all of its todos.
    missing = [d for d, a in run.acked.items() if a["outcome"]["event_id"] not in events]
    assert not missing, f"{len(missing)} of {len(run.acked)} acknowledged deliveries lost"
    for delivery, acked in run.acked.items():
        outcome = acked["outcome"]
        assert outcome["created"] == 2 and "duplicate" not in outcome
        assert events[outcome["event_id"]] == delivery
        assert todos.get(outcome["event_id"]) == {(t["id"], t["endpoint_id"]) for t in outcome["todos"]}
    # No half-written delivery anywhere: every stored event (acknowledged or not) has both of its todos.
    assert set(todos) <= set(events)
    half = {ev: len(todos.get(ev, ())) for ev in events if len(todos.get(ev, ())) != 2}
    assert not half, half
    assert all({e for _, e in pair} == {owner.id, extra.id} for pair in todos.values())
    assert_storage_intact(db_path)

    # A producer retrying an acknowledged delivery after the restart gets the stored outcome.
    with httpx.Client(base_url=run.second.url, timeout=10) as http:
        for delivery in list(run.acked)[:3] + list(run.acked)[-3:]:
            acked = run.acked[delivery]
            r = http.post(hook_path(run.webhook["url"]), content=acked["body"], headers=acked["headers"])
            assert r.status_code == 202, r.text
            again = r.json()
            assert again["duplicate"] is True and again["created"] == 0
            assert again["event_id"] == acked["outcome"]["event_id"]
            assert [t["id"] for t in again["todos"]] == [t["id"] for t in acked["outcome"]["todos"]]
        # And the restarted server takes new work.
        fresh = deliver(http, run.webhook, issue_body({"issue": {"number": 7, "title": "after restart"}}))
        assert fresh.status_code == 202 and fresh.json()["created"] == 2
    assert count(db_path, "events", "webhook_id = ?", (run.webhook["id"],)) == len(events) + 1


# -- 6. webhook lifecycle ---------------------------------------------------------------------------

def test_rotate_and_delete_over_rest(world, client, db_path):
    human = world.human("alice")
    owner = world.endpoint(human, [QUEUE], verbs=["all"])
    webhook = make_webhook(client, human, owner.id)
    assert re.fullmatch(r"whsec_[0-9a-f]{64}", webhook["secret"])
    assert webhook["id"] not in webhook["url"]
    assert deliver(client, webhook).status_code == 202

    r = client.post(f"/api/v1/webhooks/{webhook['id']}/rotate", headers=human.auth, json={})
    assert r.status_code == 200, r.text
    rotated = r.json()
    assert rotated["id"] == webhook["id"]
    assert rotated["url"] != webhook["url"] and hook_token(rotated["url"]) != hook_token(webhook["url"])
    assert rotated["secret"] != webhook["secret"] and re.fullmatch(r"whsec_[0-9a-f]{64}", rotated["secret"])

    body = issue_body({"issue": {"number": 11}})
    old_url_new_sig = client.post(hook_path(webhook["url"]), content=body,
                                  headers=github_headers(rotated["secret"], body))
    assert old_url_new_sig.status_code == 404 and old_url_new_sig.json()["error"] == "not_found"
    old_everything = deliver(client, webhook, body)
    assert old_everything.status_code == 404
    new_url_old_sig = client.post(hook_path(rotated["url"]), content=body,
                                  headers=github_headers(webhook["secret"], body))
    assert new_url_old_sig.status_code == 401 and new_url_old_sig.json()["error"] == "unauthenticated"
    assert count(db_path, "events") == 1
    ok = deliver(client, rotated, body)
    assert ok.status_code == 202 and ok.json()["created"] == 1, ok.text
    assert count(db_path, "events") == 2

    listed = client.get("/api/v1/webhooks", headers=human.auth)
    assert listed.status_code == 200
    for secret in (webhook["secret"], rotated["secret"], hook_token(webhook["url"]), hook_token(rotated["url"])):
        assert secret not in listed.text
    assert all("secret" not in w for w in listed.json()["webhooks"])

    r = client.delete(f"/api/v1/webhooks/{webhook['id']}", headers=human.auth)
    assert r.status_code == 200, r.text
    gone = deliver(client, rotated, issue_body({"issue": {"number": 12}}))
    assert gone.status_code == 404 and gone.json()["error"] == "not_found"
    assert client.get(f"/api/v1/webhooks/{webhook['id']}", headers=human.auth).status_code == 404
    assert webhook["id"] not in [w["id"] for w in client.get("/api/v1/webhooks", headers=human.auth).json()["webhooks"]]
    assert count(db_path, "events") == 2


def test_rotate_list_and_delete_through_the_cli(client, db_path):
    assert cli(db_path, "human", "add", "alice")[0] == 0
    code, ep = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "a", "--queues", QUEUE, "--verbs", "all")
    assert code == 0, ep
    code, hook = cli(db_path, "webhook", "create", "--endpoint", ep["id"], "--provider", "github", "--queue", QUEUE,
                     "--base-url", "https://hooks.example.net", "--allow-all")
    assert code == 0, hook
    assert set(hook) == {"id", "url", "secret", "provider", "queue"}, "the --json shape SPEC section 9 names"
    assert hook["url"].startswith("https://hooks.example.net/hooks/") and hook["provider"] == "github"
    assert deliver(client, hook).status_code == 202

    code, listed = cli(db_path, "webhook", "list")
    assert code == 0 and [w["id"] for w in listed["webhooks"]] == [hook["id"]]
    text = json.dumps(listed)
    assert hook["secret"] not in text and hook_token(hook["url"]) not in text
    assert all("secret" not in w for w in listed["webhooks"])

    code, rotated = cli(db_path, "webhook", "rotate", hook["id"])
    assert code == 0, rotated
    assert rotated["secret"] != hook["secret"] and hook_token(rotated["url"]) != hook_token(hook["url"])
    body = issue_body({"issue": {"number": 21}})
    assert deliver(client, {**hook, "secret": rotated["secret"]}, body).status_code == 404
    r = deliver(client, rotated, body)
    assert r.status_code == 202 and r.json()["created"] == 1, r.text

    code, deleted = cli(db_path, "webhook", "delete", hook["id"])
    assert code == 0, deleted
    assert deliver(client, rotated, issue_body({"issue": {"number": 22}})).status_code == 404
    assert cli(db_path, "webhook", "list") == (0, {"webhooks": []})


def test_stripe_webhook_answers_503_until_its_secret_is_set(world, client, clock, db_path):
    human = world.human("alice")
    owner = world.endpoint(human, ["billing"], verbs=["all"])
    webhook = make_webhook(client, human, owner.id, provider="stripe", queue="billing")
    assert webhook["secret"] is None and webhook["trust_mode"] == "signed"
    stripe_secret = "whsec_" + "ab12" * 8
    body = json.dumps({"id": "evt_1NG8Du2eZvKYlo2CUI79vXWy", "object": "event", "type": "invoice.paid",
                       "created": clock.ms // 1000, "data": {"object": {"id": "in_1"}}}).encode()
    headers = stripe_headers(stripe_secret, body, clock.ms // 1000)
    path = hook_path(webhook["url"])

    r = client.post(path, content=body, headers=headers)
    assert r.status_code == 503 and r.json()["error"] == "unavailable", r.text
    assert count(db_path, "events") == 0

    # Stripe's secret must look like Stripe's.
    r = client.put(f"/api/v1/webhooks/{webhook['id']}/secret", headers=human.auth, json={"secret": "x" * 32})
    assert r.status_code == 400 and r.json()["error"] == "invalid_argument", r.text
    r = client.put(f"/api/v1/webhooks/{webhook['id']}/secret", headers=human.auth, json={"secret": stripe_secret})
    assert r.status_code == 200, r.text
    assert stripe_secret not in r.text

    wrong = client.post(path, content=body, headers=stripe_headers("whsec_" + "cd34" * 8, body, clock.ms // 1000))
    assert wrong.status_code == 401
    r = client.post(path, content=body, headers=headers)
    assert r.status_code == 202, r.text
    assert r.json()["created"] == 1 and r.json()["verified"] is True
    assert count(db_path, "events") == 1
    # Stripe's dedup id is the body's `id`.
    r = client.post(path, content=body, headers=stripe_headers(stripe_secret, body, clock.ms // 1000 + 1))
    assert r.status_code == 202 and r.json()["duplicate"] is True
    assert query(db_path, "SELECT delivery_key FROM events") == [("evt_1NG8Du2eZvKYlo2CUI79vXWy",)]


def test_revoked_owner_endpoint_makes_ingress_answer_503(world, client, db_path):
    human = world.human("alice")
    owner = world.endpoint(human, [QUEUE], verbs=["all"])
    spare = world.endpoint(human, [QUEUE], verbs=["all"])
    webhook = make_webhook(client, human, owner.id)
    r = add_route(client, human.auth, webhook["id"], spare.id)
    assert r.status_code == 201
    assert deliver(client, webhook).status_code == 202
    before = (count(db_path, "events"), count(db_path, "todos"))

    r = client.post(f"/api/v1/endpoints/{owner.id}/revoke", headers=human.auth, json={})
    assert r.status_code == 200, r.text
    r = deliver(client, webhook, issue_body({"issue": {"number": 31}}))
    assert r.status_code == 503 and r.json()["error"] == "unavailable", r.text
    assert (count(db_path, "events"), count(db_path, "todos")) == before


# -- 7. secrets stay out of the server log ----------------------------------------------------------

def test_server_log_holds_no_secret_token_or_body(db_path, live_server):
    run = CrashRun(db_path, live_server, kill_after=1.0)
    assert run.acked, "no delivery acknowledged before the kill"
    with httpx.Client(base_url=run.second.url, timeout=10) as http:
        # More refused deliveries against the restarted server: wrong, malformed and missing signatures.
        body = issue_body({"issue": {"number": 99}})
        bad = hex_hmac("definitely-wrong", body)
        for sig in ("sha256=" + bad, "sha256=nothex", None):
            headers = github_headers(run.webhook["secret"], body)
            if sig is None:
                del headers["X-Hub-Signature-256"]
            else:
                headers["X-Hub-Signature-256"] = sig
            assert http.post(hook_path(run.webhook["url"]), content=body, headers=headers).status_code == 401
        # A rotation (new URL, new secret) and a delivery on it; then the old URL once more.
        r = http.post(f"/api/v1/webhooks/{run.webhook['id']}/rotate", headers=run.human.auth, json={})
        assert r.status_code == 200, r.text
        rotated = r.json()
        assert deliver(http, rotated, body).status_code == 202
        assert deliver(http, run.webhook, body).status_code == 404
        assert http.get("/api/v1/todos", headers=run.endpoints[0].auth).status_code == 200
        assert http.get("/api/v1/todos", headers={"Authorization": "Bearer sbk_" + "Q" * 43}).status_code == 401
    run.second.stop()  # flush and close the log

    log_path = workdir(db_path) / "switchboard.log"
    log = log_path.read_text(errors="replace")
    assert log.strip(), "the server log is empty: wrong file?"
    credentials = {
        "webhook secret": run.webhook["secret"], "rotated webhook secret": rotated["secret"],
        "ingest token": hook_token(run.webhook["url"]), "rotated ingest token": hook_token(rotated["url"]),
        "unknown ingest token": run.unknown_token, "human token": run.human.token,
        **{f"endpoint token {i}": ep.token for i, ep in enumerate(run.endpoints)},
        "presented bogus bearer": "sbk_" + "Q" * 43,
        **{f"bad signature {i}": sig for i, sig in enumerate(run.bad_signatures + [bad])},
    }
    leaked = [name for name, value in credentials.items() if value in log]
    assert not leaked, f"credentials in the server log: {leaked}"
    assert not re.search(r"whsec_[0-9a-f]{8,}", log)
    assert not re.search(r"/hooks/[A-Za-z0-9_-]{8,}", log)
    assert not re.search(r"\bsb[hk]_[A-Za-z0-9_-]{16,}", log)
    # SPEC §11: never a body either.
    assert "Spelling error in the README" not in log and "crash probe" not in log
