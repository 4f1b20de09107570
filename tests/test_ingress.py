"""Ingress: each producer's signature, freshness and delivery id; the envelope field for field; the caps."""

from __future__ import annotations

import hashlib
import hmac
import json

import producers
import pytest
from conftest import workdir
from helpers import connect_db

from switchboard.app import create_app
from switchboard.configuration import ApiError
from switchboard.crypto import SecretBox, key_file_path, parse_key
from switchboard.providers import VerificationFailed, verify_delivery
from switchboard.store.principals import add_human


@pytest.fixture
def owner(world, alice):
    return world.endpoint(alice, ["triage", "payments", "chat", "inbox"], name="router", verbs=["all"])


def counts(db_path) -> tuple[int, int]:
    conn = connect_db(db_path)
    return conn.execute("SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM todos)").fetchone()


def now_s(clock) -> int:
    return clock.now_ms() // 1000


def test_githubs_documented_signature_example():
    body = b"Hello, World!"
    assert verify_delivery("github", b"It's a Secret to Everybody", {
        "x-hub-signature-256": "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"}, body, 0)
    with pytest.raises(VerificationFailed, match="bad_signature"):
        verify_delivery("github", b"It's a Secret to Everybody", {
            "x-hub-signature-256": "sha256=" + "0" * 64}, body, 0)


def test_webhook_creation_mints_a_secret_and_a_128_bit_url(world, alice, owner):
    hook = world.webhook(alice, owner, "github")
    assert hook["secret"].startswith("whsec_") and len(hook["secret"]) == 6 + 64
    token = hook["url"].rsplit("/hooks/", 1)[1]
    assert hook["id"] not in hook["url"] and len(token) >= 22
    stored = connect_db(world.db.path).execute("SELECT secret_sealed, token_hash FROM webhooks").fetchone()
    assert hook["secret"].encode() not in stored[0] and token not in stored[1], "secret sealed, token hashed"
    listed = world.client.get("/api/v1/webhooks", headers=alice.auth).json()["webhooks"]
    assert "secret" not in json.dumps(listed).replace("secret_set", "")


def test_supplied_secret_rules(world, alice, owner):
    short = world.client.post("/api/v1/webhooks", headers=alice.auth, json={
        "provider": "github", "queue": "triage", "endpoint_id": owner.id, "secret": "too-short"})
    assert short.status_code == 400
    stripe = world.client.post("/api/v1/webhooks", headers=alice.auth, json={
        "provider": "stripe", "queue": "payments", "endpoint_id": owner.id, "secret": "not-a-stripe-secret-value"})
    assert stripe.status_code == 400
    generic = world.client.post("/api/v1/webhooks", headers=alice.auth, json={
        "provider": "generic", "queue": "triage", "endpoint_id": owner.id, "secret": "x" * 20})
    assert generic.status_code == 400
    unknown = world.client.post("/api/v1/webhooks", headers=alice.auth, json={
        "provider": "gitlab", "queue": "triage", "endpoint_id": owner.id})
    assert unknown.status_code == 400
    unscoped = world.client.post("/api/v1/webhooks", headers=alice.auth, json={
        "provider": "github", "queue": "nobody-has-it", "endpoint_id": owner.id})
    assert unscoped.status_code == 400
    own = world.webhook(alice, owner, "github", secret="my own secret, 16+ chars")
    assert own["secret"] == "my own secret, 16+ chars"


@pytest.mark.parametrize("fixture", ["issues.opened", "issues.labeled", "issue_comment.created",
                                     "pull_request.opened", "push", "ping"])
def test_github_good_and_bad_signatures(world, alice, owner, db_path, fixture):
    hook = world.webhook(alice, owner, "github")
    raw, headers = producers.github(fixture, hook["secret"])
    ok = world.deliver(hook, raw, headers)
    # A ping (GitHub's hello when a webhook is made) verifies and is recorded, but is never work.
    minted = 0 if fixture == "ping" else 1
    assert ok.status_code == 202 and ok.json()["verified"] is True and ok.json()["created"] == minted
    assert (ok.json()["disposition"] == "ping") == (fixture == "ping")
    before = counts(db_path)
    bad_cases = [
        {**headers, "X-Hub-Signature-256": "sha256=" + producers.hex_hmac("wrong secret", raw)},
        {k: v for k, v in headers.items() if k != "X-Hub-Signature-256"},
        {**headers, "X-Hub-Signature-256": "sha1=" + "0" * 40},
        {**headers, "X-Hub-Signature-256": "sha256=zz"},
    ]
    for bad in bad_cases:
        bad = {**bad, "X-GitHub-Delivery": "another-" + str(bad_cases.index(bad))}
        r = world.deliver(hook, raw, bad)
        assert r.status_code == 401 and r.json()["error"] == "unauthenticated"
    tampered = world.deliver(hook, raw.replace(b'"', b"'", 1) if raw else b"x", headers)
    assert tampered.status_code == 401
    assert counts(db_path) == before, "a refused delivery stores nothing"
    metrics = world.client.get("/metrics").text
    assert 'switchboard_verification_failures_total{provider="github",reason="bad_signature"}' in metrics
    assert 'reason="missing_signature"' in metrics and 'reason="malformed_signature"' in metrics


@pytest.mark.parametrize("fixture", ["issues.opened", "issues.label_updated", "issues.closed",
                                     "issue_comment.created", "pull_request.review_requested",
                                     "pull_request_approved"])
def test_gitea_good_and_bad_signatures(world, alice, owner, fixture):
    hook = world.webhook(alice, owner, "gitea")
    raw, headers = producers.gitea(fixture, hook["secret"])
    assert world.deliver(hook, raw, headers).status_code == 202
    wrong = {**headers, "X-Gitea-Signature": producers.hex_hmac("wrong", raw), "X-Gitea-Delivery": "x2"}
    assert world.deliver(hook, raw, wrong).status_code == 401
    # Without its own header, Gitea's GitHub-style header is accepted.
    raw2, headers2 = producers.gitea(fixture, hook["secret"], patch={"extra": 1}, delivery="d-2")
    github_style = {k: v for k, v in headers2.items() if k != "X-Gitea-Signature"}
    github_style["X-Hub-Signature-256"] = "sha256=" + producers.hex_hmac(hook["secret"], raw2)
    assert world.deliver(hook, raw2, github_style).status_code == 202


def test_cairn_signature_freshness_and_event_id(world, alice, owner, clock, db_path):
    hook = world.webhook(alice, owner, "cairn")
    at = now_s(clock)
    raw, headers = producers.cairn(hook["secret"], created_at=at)
    ok = world.deliver(hook, raw, headers)
    assert ok.status_code == 202 and ok.json()["verified"] is True
    before = counts(db_path)
    stale_raw, stale_headers = producers.cairn(hook["secret"], patch={"event_id": "e-stale"}, created_at=at - 301)
    assert world.deliver(hook, stale_raw, stale_headers).json()["message"].endswith("stale_timestamp")
    future_raw, future_headers = producers.cairn(hook["secret"], patch={"event_id": "e-future"}, created_at=at + 301)
    assert world.deliver(hook, future_raw, future_headers).status_code == 401
    edge_raw, edge_headers = producers.cairn(hook["secret"], patch={"event_id": "e-edge"}, created_at=at - 299)
    mismatch = {**edge_headers, "X-Cairn-Event-Id": "someone-else"}
    assert world.deliver(hook, edge_raw, mismatch).json()["message"].endswith("event_id_mismatch")
    assert counts(db_path) == before
    assert world.deliver(hook, edge_raw, edge_headers).status_code == 202
    without_header = {k: v for k, v in headers.items() if k != "X-Cairn-Event-Id"}
    again = world.deliver(hook, raw, without_header).json()
    assert again["duplicate"] is True, "the signed body's event_id is the delivery id"


def test_stripe_any_v1_may_match_and_the_window_holds(world, alice, owner, clock, db_path):
    hook = world.webhook(alice, owner, "stripe", queue="payments")
    event = {"id": "evt_1", "type": "invoice.paid", "data": {"object": {"id": "in_1"}}}
    raw, headers = producers.stripe("whsec_" + "a" * 32, event, at=now_s(clock))
    assert world.deliver(hook, raw, headers).status_code == 503, "no secret set yet"
    r = world.client.put(f"/api/v1/webhooks/{hook['id']}/secret", headers=alice.auth,
                         json={"secret": "whsec_" + "a" * 32})
    assert r.status_code == 200 and r.json()["secret_set"] is True and "whsec_" not in r.text
    raw, headers = producers.stripe("whsec_" + "a" * 32, event, at=now_s(clock), extra_signatures=("0" * 64,))
    ok = world.deliver(hook, raw, headers).json()
    assert ok["created"] == 1
    shown = world.client.get(f"/api/v1/events/{ok['event_id']}", headers=alice.auth).json()
    assert shown["envelope"]["kind"] == "invoice.paid" and shown["delivery_key"] == "evt_1"
    stale_raw, stale = producers.stripe("whsec_" + "a" * 32, {**event, "id": "evt_2"}, at=now_s(clock) - 301)
    assert world.deliver(hook, stale_raw, stale).status_code == 401
    wrong_raw, wrong = producers.stripe("whsec_" + "b" * 32, {**event, "id": "evt_3"}, at=now_s(clock))
    assert world.deliver(hook, wrong_raw, wrong).status_code == 401
    assert world.deliver(hook, raw, {**headers, "Stripe-Signature": "v1=abc"}).status_code == 401


def test_slack_signature_window_and_url_verification(world, alice, owner, clock, db_path):
    hook = world.webhook(alice, owner, "slack", queue="chat")
    secret = "8f742231b10e8888abcd99yyyzzz85a5"
    world.client.put(f"/api/v1/webhooks/{hook['id']}/secret", headers=alice.auth, json={"secret": secret})
    before = counts(db_path)
    challenge = {"type": "url_verification", "challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"}
    raw, headers = producers.slack(secret, challenge, at=now_s(clock))
    r = world.deliver(hook, raw, headers)
    assert r.status_code == 200 and r.json() == {"challenge": challenge["challenge"]}
    assert counts(db_path) == before, "url_verification stores nothing"
    forged_raw, forged = producers.slack("not the secret", challenge, at=now_s(clock))
    assert world.deliver(hook, forged_raw, forged).status_code == 401
    message = {"type": "event_callback", "event_id": "Ev1", "event": {"type": "app_mention", "text": "hi"}}
    raw, headers = producers.slack(secret, message, at=now_s(clock))
    ok = world.deliver(hook, raw, headers).json()
    assert ok["created"] == 1
    assert world.client.get(f"/api/v1/events/{ok['event_id']}", headers=alice.auth).json()["envelope"]["kind"] \
        == "app_mention"
    old_raw, old = producers.slack(secret, {**message, "event_id": "Ev2"}, at=now_s(clock) - 301)
    assert world.deliver(hook, old_raw, old).status_code == 401


def test_generic_trusts_the_url_and_dedups_by_delivery_id(world, alice, owner):
    hook = world.webhook(alice, owner, "generic", queue="inbox")
    assert hook["trust_mode"] == "token" and hook["secret"] is None
    first = world.deliver(hook, b'{"job": "backup"}', {"X-Delivery-Id": "run-1", "X-Event-Type": "cron"}).json()
    assert first["verified"] is False and first["created"] == 1
    again = world.deliver(hook, b'{"job": "backup"}', {"X-Delivery-Id": "run-1"}).json()
    assert again["duplicate"] is True
    same_body_new_id = world.deliver(hook, b'{"job": "backup"}', {"Webhook-Id": "run-2"}).json()
    assert same_body_new_id["created"] == 1, "a token-trust webhook may send the same body twice"
    envelope = world.client.get(f"/api/v1/events/{first['event_id']}", headers=alice.auth).json()["envelope"]
    assert envelope["kind"] == "cron" and envelope["trust_mode"] == "token" and envelope["verified"] is False


def test_body_cap_unknown_token_and_revoked_owner(world, alice, owner, db_path):
    hook = world.webhook(alice, owner, "github")
    big = b"{" + b" " * (5 * 1024 * 1024) + b"}"
    raw, headers = producers.github("ping", hook["secret"])
    headers["X-Hub-Signature-256"] = "sha256=" + producers.hex_hmac(hook["secret"], big)
    r = world.deliver(hook, big, headers)
    assert r.status_code == 413 and r.json()["error"] == "too_large"
    assert world.client.post("/hooks/not-a-real-token", content=raw, headers=headers).status_code == 404
    world.client.post(f"/api/v1/endpoints/{owner.id}/revoke", headers=alice.auth)
    raw, headers = producers.github("ping", hook["secret"])
    r = world.deliver(hook, raw, headers)
    assert r.status_code == 503 and r.json()["error"] == "unavailable"
    assert counts(db_path) == (0, 0)


def test_rate_limit_answers_429_with_retry_after(tmp_path):
    from starlette.testclient import TestClient
    app = create_app(str(tmp_path / "rl.db"), background=False, ingest_rate=1, ingest_burst=2)
    with TestClient(app) as client:
        human = app.state.db.write_sync(add_human, "alice")
        auth = {"Authorization": f"Bearer {human['token']}"}
        ep = client.post("/api/v1/endpoints", headers=auth, json={"name": "w", "queues": ["inbox"]}).json()
        hook = client.post("/api/v1/webhooks", headers=auth,
                           json={"provider": "generic", "queue": "inbox", "endpoint_id": ep["id"]}).json()
        path = hook["url"].removeprefix("http://testserver")
        answers = [client.post(path, content=b"{}", headers={"X-Delivery-Id": f"d{i}"}) for i in range(3)]
        assert [a.status_code for a in answers] == [202, 202, 429]
        assert int(answers[2].headers["Retry-After"]) >= 1 and answers[2].json()["error"] == "rate_limited"


def test_secret_is_sealed_with_the_key_file(world, alice, owner, db_path, tmp_path):
    hook = world.webhook(alice, owner, "github")
    key_file = (workdir(db_path) / "switchboard.key")
    assert key_file.exists() and (key_file.stat().st_mode & 0o777) == 0o600
    sealed = connect_db(db_path).execute("SELECT id, secret_sealed FROM webhooks").fetchone()
    box = SecretBox(parse_key(key_file.read_text()))
    assert box.open(sealed[1], sealed[0]) == hook["secret"].encode()
    with pytest.raises(ApiError):
        box.open(sealed[1], "wh_someone_else")  # the ciphertext is bound to its webhook


def test_key_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SWITCHBOARD_SECRET_KEY", (b"k" * 32).hex())
    box = SecretBox.for_database(str(tmp_path / "x.db"))
    assert not key_file_path(str(tmp_path / "x.db")).exists()
    assert box.open(box.seal("s3cret-value", "wh_1"), "wh_1") == b"s3cret-value"
    with pytest.raises(ApiError):
        parse_key("too short")


# -- the envelope ------------------------------------------------------------------------------------

def envelope_of(world, human, outcome) -> dict:
    return world.client.get(f"/api/v1/events/{outcome['event_id']}", headers=human.auth).json()["envelope"]


def test_github_issue_envelope_field_for_field(world, alice, owner):
    hook = world.webhook(alice, owner, "github")
    raw, headers = producers.github("issues.labeled", hook["secret"])
    env = envelope_of(world, alice, world.deliver(hook, raw, headers).json())
    payload = json.loads(raw)
    assert env["source"] == "github" and env["kind"] == "issues" and env["webhook_id"] == hook["id"]
    assert env["trust_mode"] == "signed" and env["verified"] is True
    assert env["content_type"] == "application/json" and env["size"] == len(raw)
    assert env["payload"] == payload
    assert env["headers"]["x-hub-signature-256"] == "«redacted»" and env["headers"]["x-github-event"] == "issues"
    assert env["subject_key"] == "github:Codertocat/Hello-World#1"
    assert env["artifact"] is None and env["release"] is None
    assert env["issue"] == {
        "provider": "github", "action": "labeled", "event_type": "issues", "repo": "Codertocat/Hello-World",
        "number": 1, "title": payload["issue"]["title"], "url": payload["issue"]["html_url"],
        "state": payload["issue"]["state"], "author": "Codertocat", "sender": "Codertocat",
        "labels": [label["name"] for label in payload["issue"]["labels"]], "label": payload["label"]["name"],
        "label_event": True, "body_size": len(payload["issue"]["body"].encode()),
        "key": "github:Codertocat/Hello-World#1", "work_item": None, "work_item_error": None}


def test_pull_requests_and_comments_have_a_subject_but_no_issue(world, alice, owner):
    hook = world.webhook(alice, owner, "github")
    for fixture, key in (("pull_request.opened", "github:Codertocat/Hello-World#2"),
                         ("pull_request_review.submitted", "github:Codertocat/Hello-World#2"),
                         ("issue_comment.created", "github:Codertocat/Hello-World#1"),
                         ("push", "github:Codertocat/Hello-World@refs/tags/simple-tag"),
                         ("ping", None)):
        raw, headers = producers.github(fixture, hook["secret"])
        env = envelope_of(world, alice, world.deliver(hook, raw, headers).json())
        assert env["issue"] is None, fixture
        assert env["subject_key"] == key, fixture
    raw, headers = producers.github("issues.opened", hook["secret"], patch={"issue": {"pull_request": {"url": "x"}}})
    assert envelope_of(world, alice, world.deliver(hook, raw, headers).json())["issue"] is None


def test_gitea_label_update_envelope(world, alice, owner):
    hook = world.webhook(alice, owner, "gitea")
    raw, headers = producers.gitea("issues.label_updated", hook["secret"])
    env = envelope_of(world, alice, world.deliver(hook, raw, headers).json())
    assert env["kind"] == "issues" and env["headers"]["x-gitea-signature"] == "«redacted»"
    issue = env["issue"]
    assert issue["event_type"] == "issue_label" and issue["action"] == "label_updated"
    assert issue["label_event"] is True and issue["label"] is None, "Gitea does not say which label changed"
    assert issue["labels"] == ["size/S"] and issue["repo"] == "homelab/infra" and issue["number"] == 57
    assert issue["author"] == "alice" and issue["key"] == "gitea:homelab/infra#57"
    raw, headers = producers.gitea("pull_request_approved", hook["secret"])
    env = envelope_of(world, alice, world.deliver(hook, raw, headers).json())
    assert env["issue"] is None and env["subject_key"].startswith("gitea:homelab/infra#")


def test_cairn_artifact_envelope(world, alice, owner, clock):
    hook = world.webhook(alice, owner, "cairn")
    raw, headers = producers.cairn(hook["secret"], created_at=now_s(clock))
    env = envelope_of(world, alice, world.deliver(hook, raw, headers).json())
    body = json.loads(raw)
    data = body["data"]
    assert env["kind"] == "artifact.created" and env["subject_key"] == "cairn:Kp3vT9" and env["issue"] is None
    assert env["artifact"] == {
        "id": "Kp3vT9", "handle": "mcp://cairn/Kp3vT9", "event_id": body["event_id"], "kind": "artifact.created",
        "created_at": body["created_at"], "url": data["url"], "title": data["title"], "share_type": "markdown",
        "channel": "mcp", "model": "local-qwen", "actor_id": "alice-agent", "on_behalf_of": "claude-code/2.1.0",
        "expires_at": data["expires_at"], "tags": data["tags"], "metadata": None}


def test_payload_is_null_for_invalid_json_and_trailing_data(world, alice, owner):
    hook = world.webhook(alice, owner, "generic", queue="inbox")
    for i, body in enumerate((b"", b"not json", b'{"a": 1} trailing', b'{"a": NaN}', b"[" * 100000)):
        outcome = world.deliver(hook, body, {"X-Delivery-Id": f"p{i}"}).json()
        assert envelope_of(world, alice, outcome)["payload"] is None


def test_secret_bearing_headers_are_redacted_in_the_stored_event(world, alice, owner):
    hook = world.webhook(alice, owner, "generic", queue="inbox")
    outcome = world.deliver(hook, b"{}", {"Authorization": "Bearer hunter2", "Cookie": "s=hunter2",
                                           "X-Api-Key": "hunter2", "X-Upstream-Token": "hunter2",
                                           "X-Delivery-Id": "r1"}).json()
    shown = world.client.get(f"/api/v1/events/{outcome['event_id']}", headers=alice.auth)
    assert "hunter2" not in shown.text
    row = connect_db(world.db.path).execute("SELECT headers, envelope FROM events").fetchone()
    assert "hunter2" not in row[0] and "hunter2" not in row[1]


def test_delivery_todo_carries_title_payload_and_trace(world, alice, owner):
    hook = world.webhook(alice, owner, "github")
    raw, headers = producers.github("issues.opened", hook["secret"])
    outcome = world.deliver(hook, raw, headers).json()
    todo = world.client.get(f"/api/v1/todos/{outcome['todos'][0]['id']}", headers=alice.auth).json()
    assert todo["title"] == "Codertocat/Hello-World#1: Spelling error in the README file"
    assert todo["source"] == "github" and todo["kind"] == "issues"
    assert todo["subject_key"] == "github:Codertocat/Hello-World#1" and todo["payload"] == json.loads(raw)
    assert todo["trace"]["stage"] == "default" and todo["trace"]["endpoints"] == [owner.id]
    assert todo["event_id"] == outcome["event_id"]
    claimed = world.claim(owner)
    assert claimed["todo"]["id"] == todo["id"]


def test_events_list_filters_by_disposition(world, alice, owner):
    hook = world.webhook(alice, owner, "github")
    for _ in range(2):
        raw, headers = producers.github("issues.opened", hook["secret"], patch={"issue": {"number": 5 + _}})
        world.deliver(hook, raw, headers)
    listed = world.client.get(f"/api/v1/webhooks/{hook['id']}/events?disposition=routed", headers=alice.auth).json()
    assert len(listed["events"]) == 2
    none = world.client.get(f"/api/v1/webhooks/{hook['id']}/events?disposition=dropped", headers=alice.auth).json()
    assert none["events"] == []
    bad = world.client.get(f"/api/v1/webhooks/{hook['id']}/events?disposition=bogus", headers=alice.auth)
    assert bad.status_code == 400


def test_hmac_is_over_raw_bytes_not_reserialised_json(world, alice, owner):
    hook = world.webhook(alice, owner, "github")
    raw = b'{ "zen": "spaces matter",   "hook_id": 1 }'
    signature = "sha256=" + hmac.new(hook["secret"].encode(), raw, hashlib.sha256).hexdigest()
    ok = world.deliver(hook, raw, {"X-GitHub-Event": "ping", "X-Hub-Signature-256": signature})
    assert ok.status_code == 202
    assert ok.json()["event_id"]
