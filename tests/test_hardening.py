"""Regressions from review: each test is a defect that was found, reproduced, and fixed."""

from __future__ import annotations

import json
import sqlite3

import producers
import pytest
from conftest import cli

import switchboard.evaluator as evaluator_module
from switchboard.configuration import ApiError
from switchboard.database import Database
from switchboard.store.principals import add_human, find_human


@pytest.fixture
def router(world, alice):
    return world.endpoint(alice, ["triage", "build"], name="router", verbs=["all"])


def test_revoking_an_endpoint_that_holds_quarantined_work(world, alice, router):
    hook = world.webhook(alice, router, "generic")
    world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth,
                     json={"rules": [{"id": "hold", "expr": "true", "action": {"quarantine": True}}]})
    held = world.deliver(hook, b"{}", {"X-Delivery-Id": "h1"}).json()["todos"][0]["id"]
    revoked = world.client.post(f"/api/v1/endpoints/{router.id}/revoke", headers=alice.auth)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert world.client.get("/api/v1/me", headers=router.auth).status_code == 401
    todo = world.client.get(f"/api/v1/todos/{held}", headers=alice.auth).json()
    assert todo["state"] == "quarantined", "held work waits for a human to release or discard it"
    assert world.act(alice, held, "discard").json()["outcome"] == "discarded"


def test_the_writer_survives_a_full_disk(tmp_path):
    db = Database(str(tmp_path / "full.db"))
    try:
        human = db.write_sync(add_human, "alice")
        pages = db._writer.execute("PRAGMA page_count").fetchone()[0]
        db._writer.execute(f"PRAGMA max_page_count = {pages + 1}")
        def fill(txn):
            txn.execute("CREATE TABLE filler (x BLOB)")
            for _ in range(20):
                txn.execute("INSERT INTO filler VALUES (zeroblob(100000))")

        with pytest.raises(ApiError) as refused:
            db.write_sync(fill)
        assert refused.value.code == "unavailable"
        db._writer.execute("PRAGMA max_page_count = 1073741823")
        assert db.write_sync(add_human, "bob")["name"] == "bob", "the writer thread is still alive"
        assert db.read_sync(find_human, human["id"])["name"] == "alice"
    finally:
        db.close()


@pytest.mark.parametrize("body", [
    b'{"a": 1e999}', b'\xef\xbb\xbf{"a": 1}', '{"a": "utf-16"}'.encode("utf-16-le"), b'{"a": "\\ud800"}',
    b'[1, 2, "\\u0000"]'])
def test_hostile_bodies_are_accepted_without_a_500(world, alice, router, db_path, body):
    hook = world.webhook(alice, router, "generic")
    r = world.deliver(hook, body, {"X-Delivery-Id": "d1"})
    assert r.status_code == 202, r.text
    todo = world.client.get(f"/api/v1/todos/{r.json()['todos'][0]['id']}", headers=alice.auth)
    assert todo.status_code == 200
    if not db_path.startswith("postgresql://"):
        assert sqlite3.connect(db_path).execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_lone_surrogate_in_a_signed_title_is_no_500(world, alice, router):
    hook = world.webhook(alice, router, "github")
    raw, headers = producers.github("issues.opened", hook["secret"])
    raw = raw.replace(b'"Spelling error in the README file"', b'"x\\ud800y"')
    headers["X-Hub-Signature-256"] = "sha256=" + producers.hex_hmac(hook["secret"], raw)
    r = world.deliver(hook, raw, headers)
    assert r.status_code == 202, r.text
    todo = world.client.get(f"/api/v1/todos/{r.json()['todos'][0]['id']}", headers=alice.auth).json()
    assert todo["title"] == "Codertocat/Hello-World#1: x\ufffdy"


def test_defer_until_the_last_representable_moment(world, alice, router):
    todo = world.push(alice, router, "build")
    r = world.act(alice, todo["id"], "defer", reason="r", until="9999-12-31T23:59:59.999999+00:00")
    assert r.status_code == 200 and r.json()["deferred_until"] == "9999-12-31T23:59:59.999Z"


def test_reroute_never_crosses_humans(world, alice, router, db_path):
    bob = world.human("bob")
    bobs = world.endpoint(bob, ["review"], name="bobs")
    cli(db_path, "friend", "link", "alice", "bob")
    hook = world.webhook(alice, router, "generic", queue="triage")
    world.client.post(f"/api/v1/webhooks/{hook['id']}/routes", headers=alice.auth, json={"endpoint_id": bobs.id})
    world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth,
                     json={"rules": [{"id": "review", "expr": "true", "action": {"queue": "review"}}]})
    todo = world.deliver(hook, b"{}", {"X-Delivery-Id": "r1"}).json()["todos"][0]
    assert todo["endpoint_id"] == bobs.id
    trace = world.client.get(f"/api/v1/todos/{todo['id']}", headers=bob.auth).json()["trace"]
    assert trace["endpoints"] == [bobs.id], "a friend's todo names no endpoint of the webhook's owner"
    moved = world.act(bob, todo["id"], "reroute", queue="build")
    assert moved.status_code == 400, "alice's endpoint is a target of the webhook, but not bob's"


def test_reroute_lets_go_of_an_absorbed_todo(world, alice):
    reviewer = world.endpoint(alice, ["review"], name="reviewer")
    elsewhere = world.endpoint(alice, ["other"], name="elsewhere")
    hook = world.webhook(alice, reviewer, "github", queue="review")
    world.client.post(f"/api/v1/webhooks/{hook['id']}/routes", headers=alice.auth, json={"endpoint_id": elsewhere.id})
    for n in (1, 2):
        raw, headers = producers.github("issues.opened", hook["secret"], {"issue": {"body": f"v{n}"}})
        world.deliver(hook, raw, headers)
    claim = world.claim(reviewer)
    absorbed = world.act(reviewer, claim["todo"]["id"], "absorb", lease_token=claim["lease_token"]).json()["absorbed"]
    moved = world.act(alice, absorbed[0]["id"], "reroute", queue="other").json()
    assert moved["endpoint_id"] == elsewhere.id
    assert world.claim(elsewhere)["todo"]["id"] == moved["id"], "claimable where it now lives"
    world.act(reviewer, claim["todo"]["id"], "complete", lease_token=claim["lease_token"])
    assert world.client.get(f"/api/v1/todos/{moved['id']}", headers=alice.auth).json()["state"] == "claimed"


def test_a_redelivery_is_answered_even_when_the_sandbox_is_down(world, alice, router, app, monkeypatch):
    hook = world.webhook(alice, router, "generic")
    world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth,
                     json={"rules": [{"id": "all", "expr": "true", "action": {"queue": "triage"}}]})
    first = world.deliver(hook, b'{"n": 1}', {"X-Delivery-Id": "once"}).json()
    app.state.evaluator.close()
    monkeypatch.setattr(evaluator_module, "EVALUATOR_CHILD", "import sys; sys.exit(3)")
    again = world.deliver(hook, b'{"n": 1}', {"X-Delivery-Id": "once"})
    assert again.status_code == 202 and again.json()["duplicate"] is True
    assert again.json()["event_id"] == first["event_id"]
    assert world.deliver(hook, b'{"n": 2}', {"X-Delivery-Id": "new"}).status_code == 503


def test_an_endpoint_may_set_rules_without_the_get_verb(world, alice, router):
    setter = world.endpoint(alice, ["triage"], name="setter", verbs=["create_webhook", "set_webhook_rules"])
    hook = world.client.post("/api/v1/webhooks", headers=setter.auth,
                             json={"provider": "generic", "queue": "triage"}).json()
    r = world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=setter.auth,
                         json={"rules": [{"id": "a", "expr": "true", "action": {"drop": True}}]})
    assert r.status_code == 200, r.text
    assert world.client.get(f"/api/v1/webhooks/{hook['id']}/rules", headers=setter.auth).status_code == 403


def test_cli_reports_an_unreadable_file_as_an_error_body(db_path, tmp_path):
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    code, body = cli(db_path, "rules", "set", "wh_0", "--file", str(binary))
    assert code == 1 and body["error"] == "invalid_argument" and str(binary) in body["message"]
    code, body = cli(db_path, "todo", "push", "ep_0", "--queue", "q", "--title", "t", "--work-item", str(binary))
    assert code == 1 and body["error"] == "invalid_argument"
    assert json.dumps(body)
