"""The Board without a browser (Starlette's test client): the headers on every page, the session cookie's flags,
sessions (only a hash stored, 12 hours idle, sign-out ends them server-side), CSRF and Origin refusals that change
nothing, and the scripts-off flows: every form is a POST answered 303, through the same store functions as REST."""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import re
import uuid
from pathlib import Path

import producers
import pytest
from conftest import snapshot
from helpers import connect_db
from starlette.testclient import TestClient

import switchboard.board.pages as board_pages_module
import switchboard.server as server_module
from switchboard.app import create_app
from switchboard.board.queries import BOARD_COOKIE, BOARD_PAGE_SIZE, INBOX_GROUPS
from switchboard.cli.parser import build_parser
from switchboard.configuration import SCHEMA_VERSION, ApiError
from switchboard.database import connect
from switchboard.limits import TrustedProxies
from switchboard.migrations import apply_schema
from switchboard.server import cli_serve

ORIGIN = {"Origin": "http://testserver"}
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; frame-ancestors 'none'; base-uri 'none';"
       " form-action 'self'")


def sign_in(client, human) -> str:
    """Sign in through the form; returns the session cookie."""
    answer = client.post("/board/login", data={"token": human.token}, headers=ORIGIN, follow_redirects=False)
    assert answer.status_code == 303 and answer.headers["location"] == "/board", answer.text
    return client.cookies[BOARD_COOKIE]


def csrf(client) -> str:
    page = client.get("/board/endpoints")
    assert page.status_code == 200, page.text
    return re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)


def post(client, path: str, token: str | None = "", sent: dict | None = None, **fields):
    """POST a Board form: `fields`, the session's CSRF token (unless token is None), and `sent` as the HTTP
    headers (this server's Origin unless given)."""
    data = dict(fields)
    if token is not None:
        data["csrf"] = token or csrf(client)
    return client.post(path, data=data, headers=ORIGIN if sent is None else sent, follow_redirects=False)


def state_of(world, human, todo_id: str) -> dict:
    return world.client.get(f"/api/v1/todos/{todo_id}", headers=human.auth).json()


@pytest.fixture
def lane(world, alice):
    return world.endpoint(alice, ["lane-s", "triage"], name="lane")


def review_todo(world, alice, lane) -> dict:
    todo = world.push(alice, lane, "lane-s", "gated", work_item={
        "schema": "switchboard.work_item.v1", "objective": "o", "approval_gates": ["review"]})
    claim = world.claim(lane, queue="lane-s")
    assert claim["todo"]["id"] == todo["id"]
    done = world.act(lane, todo["id"], "complete", lease_token=claim["lease_token"], summary="did it")
    assert done.json()["state"] == "review"
    return todo


def held_delivery(world, alice, lane, title: str = "Handoff") -> tuple[dict, str]:
    """A cairn delivery the trust gate holds (a new cairn webhook trusts no one yet), stamped by the app's clock."""
    hook = world.webhook(alice, lane, "cairn", queue="lane-s", trusted_actors={"actor_ids": []})
    raw, headers = producers.cairn(hook["secret"], {"event_id": str(uuid.uuid4()), "data": {"title": title}},
                                   created_at=world.db.clock.now_ms() / 1000)
    outcome = world.deliver(hook, raw, headers).json()
    assert outcome["disposition"] == "quarantined", outcome
    return hook, outcome["todos"][0]["id"]


def test_root_redirects_and_every_page_needs_a_session(client, world, alice, lane):
    assert client.get("/", follow_redirects=False).headers["location"] == "/board"
    assert client.get("/", follow_redirects=False).status_code == 303
    away = client.get("/board/queues", follow_redirects=False)
    assert away.status_code == 303 and away.headers["location"] == "/board/login?next=/board/queues"
    assert client.get("/board/events").status_code == 401
    todo = world.push(alice, lane, "lane-s", "t")
    refused = post(client, f"/board/todos/{todo['id']}/cancel", token="x", reason="r")
    assert refused.status_code == 403 and state_of(world, alice, todo["id"])["state"] == "pending"
    wrong = client.post("/board/login", data={"token": "sbh_nope"}, headers=ORIGIN)
    assert wrong.status_code == 401 and BOARD_COOKIE not in client.cookies
    endpoint_token = client.post("/board/login", data={"token": lane.token}, headers=ORIGIN)
    assert endpoint_token.status_code == 401, "an endpoint token never opens the Board"


def test_every_page_has_the_security_headers_and_no_inline_script_or_style(client, world, alice, lane):
    hook, held = held_delivery(world, alice, lane)
    event_id = state_of(world, alice, held)["event_id"]
    login = client.get("/board/login")
    assert login.status_code == 200 and login.headers["content-security-policy"] == CSP
    sign_in(client, alice)
    pages = ["/board", "/board/queues", "/board/webhooks", "/board/endpoints",
             f"/board/todos/{held}", f"/board/webhooks/{hook['id']}", f"/board/webhooks/{hook['id']}/deliveries",
             f"/board/deliveries/{event_id}", f"/board/endpoints/{lane.id}/revoke", "/board/nowhere",
             "/board/todos/td_00", *(f"/board/inbox/{g}" for g in INBOX_GROUPS),
             "/board/static/board.css", "/board/static/board.js"]
    for path in pages:
        page = client.get(path, follow_redirects=False)
        assert page.status_code in (200, 404), (path, page.status_code)
        assert page.headers["content-security-policy"] == CSP, path
        assert page.headers["referrer-policy"] == "same-origin", path
        assert page.headers["x-content-type-options"] == "nosniff", path
        if page.headers["content-type"].startswith("text/html"):
            assert page.headers["cache-control"] == "no-store", path
            assert not re.search(r"<script(?![^>]*\bsrc=)", page.text), f"inline script on {path}"
            assert not re.search(r"\sstyle=|<style", page.text), f"inline style on {path}"
            assert not re.search(r"\son[a-z]+=", page.text), f"inline handler on {path}"
            assert "<form" not in page.text or 'method="post"' in page.text or 'method="get"' in page.text
    refused = post(client, "/board/logout", token="wrong")
    assert refused.status_code == 403 and refused.headers["content-security-policy"] == CSP


def test_cookie_flags_and_secure_only_behind_a_declared_https_proxy(db_path, clock, world, alice):
    def cookie_from(client, headers: dict) -> str:
        answer = client.post("/board/login", data={"token": alice.token}, headers={**ORIGIN, **headers},
                             follow_redirects=False)
        assert answer.status_code == 303, answer.text
        return answer.headers["set-cookie"]

    plain = cookie_from(world.client, {"X-Forwarded-Proto": "https"})
    assert "httponly" in plain.lower() and "samesite=strict" in plain.lower() and "path=/board" in plain.lower()
    assert "secure" not in plain.lower(), "X-Forwarded-Proto counts only when the operator declared a proxy"
    proxied = create_app(db_path, clock=clock, background=False, trust_proxy=True)
    with TestClient(proxied, base_url="http://board.lab") as client:
        forwarded = {"X-Forwarded-Proto": "https", "Origin": "https://board.lab"}
        secure = cookie_from(client, forwarded)
        assert "; secure" in secure.lower() and "httponly" in secure.lower() and "samesite=strict" in secure.lower()
        assert "secure" not in cookie_from(client, {"Origin": "http://board.lab"}).lower()
    with TestClient(create_app(db_path, clock=clock, background=False), base_url="https://board.lab") as client:
        assert "; secure" in cookie_from(client, {"Origin": "https://board.lab"}).lower()


def test_only_the_session_hash_is_stored(client, alice, db_path):
    cookie = sign_in(client, alice)
    conn = connect_db(db_path)
    rows = conn.execute("SELECT id, human_id, csrf, created_at, last_seen_at, expires_at FROM board_sessions").fetchall()
    conn.close()
    assert len(rows) == 1 and rows[0][0] == hashlib.sha256(cookie.encode()).hexdigest() and rows[0][1] == alice.id
    assert rows[0][5] - rows[0][4] == 12 * 3600 * 1000
    raw = b"".join(p.read_bytes() for p in Path(db_path).parent.glob("switchboard.db*"))
    assert cookie.encode() not in raw and alice.token.encode() not in raw


def test_a_session_ends_after_12_hours_idle_and_each_use_moves_it_on(client, alice, clock):
    sign_in(client, alice)
    clock.advance(11 * 3600)
    assert client.get("/board", follow_redirects=False).status_code == 200
    clock.advance(11 * 3600)
    assert client.get("/board", follow_redirects=False).status_code == 200, "the use at 11 h moved expiry on"
    clock.advance(12 * 3600 + 1)
    away = client.get("/board", follow_redirects=False)
    assert away.status_code == 303 and away.headers["location"].startswith("/board/login")


def test_sign_out_ends_the_session_on_the_server(client, alice, db_path):
    cookie = sign_in(client, alice)
    token = csrf(client)
    out = post(client, "/board/logout", token=token)
    assert out.status_code == 303 and out.headers["location"] == "/board/login"
    conn = connect_db(db_path)
    assert conn.execute("SELECT count(*) FROM board_sessions").fetchone()[0] == 0
    conn.close()
    client.cookies.set(BOARD_COOKIE, cookie, path="/board")
    assert client.get("/board", follow_redirects=False).status_code == 303, "the old cookie opens nothing"


def test_forms_without_the_csrf_token_or_from_another_origin_are_refused_and_change_nothing(
        client, world, alice, lane, db_path):
    todo = review_todo(world, alice, lane)
    sign_in(client, alice)
    token = csrf(client)
    before = snapshot(db_path)
    path = f"/board/todos/{todo['id']}/approve"
    attempts = [post(client, path, token=None),
                post(client, path, token="0" * 43),
                post(client, path, token=token, sent={"Origin": "https://evil.example"}),
                post(client, path, token=token, sent={"Origin": "null"}),
                post(client, path, token=token, sent={}),
                post(client, path, token=token, sent={"Referer": "https://evil.example/board"}),
                client.post(path, json={"csrf": token}, headers=ORIGIN, follow_redirects=False)]
    assert [a.status_code for a in attempts] == [403] * 7
    assert "CSRF" in attempts[0].text and "Origin" in attempts[2].text
    assert snapshot(db_path) == before
    login = client.post("/board/login", data={"token": alice.token}, headers={"Origin": "https://evil.example"})
    assert login.status_code == 403
    same_via_referer = post(client, path, token=token, sent={"Referer": "http://testserver/board"})
    assert same_via_referer.status_code == 303 and state_of(world, alice, todo["id"])["state"] == "done"


def test_the_configured_base_url_is_an_origin_too(db_path, clock, world, alice, lane):
    todo = world.push(alice, lane, "lane-s", "t")
    app = create_app(db_path, clock=clock, background=False, base_url="https://switchboard.lab.example")
    with TestClient(app) as client:
        assert client.post("/board/login", data={"token": alice.token},
                           headers={"Origin": "https://switchboard.lab.example"}, follow_redirects=False).status_code == 303
        token = csrf(client)
        done = post(client, f"/board/todos/{todo['id']}/cancel", token=token,
                    sent={"Origin": "https://switchboard.lab.example"}, reason="no")
        assert done.status_code == 303 and state_of(world, alice, todo["id"])["state"] == "cancelled"


def test_scripts_off_the_whole_loop_is_post_redirect_get_through_the_store(client, world, alice, lane):
    review = review_todo(world, alice, lane)
    question = world.push(alice, lane, "lane-s", "asks")
    claim = world.claim(lane, queue="lane-s")
    assert world.act(lane, question["id"], "needs-input", lease_token=claim["lease_token"],
                     question="Which disk?").status_code == 200
    dead = world.push(alice, lane, "triage", "breaks")
    claim = world.claim(lane, queue="triage")
    world.act(lane, dead["id"], "fail", lease_token=claim["lease_token"], error="boom", retry=False)
    _, held = held_delivery(world, alice, lane)
    sign_in(client, alice)
    inbox = client.get("/board").text
    for needle in ("Which disk?", "did it", "boom", "untrusted_actor", "Trust alice-agent and release"):
        assert needle in inbox, needle
    assert re.search(r'data-count="held">1<', inbox) and re.search(r'data-count="review">1<', inbox)

    answered = post(client, f"/board/todos/{question['id']}/answer", answer="sdb", back="/board")
    assert answered.status_code == 303 and answered.headers["location"] == "/board"
    assert "Answered: asks" in client.get("/board").text
    assert "Answered: asks" not in client.get("/board").text, "a notice is shown once"
    assert post(client, f"/board/todos/{review['id']}/request-changes", note="tests too").status_code == 303
    assert post(client, f"/board/todos/{dead['id']}/retry").status_code == 303
    released = post(client, f"/board/todos/{held}/release", queue="lane-s", back="/board/inbox/held")
    assert released.headers["location"] == "/board/inbox/held"
    for todo_id, wanted in ((question["id"], "pending"), (review["id"], "pending"), (dead["id"], "pending"),
                            (held, "pending")):
        seen = state_of(world, alice, todo_id)
        assert seen["state"] == wanted and seen["history"][-1]["actor"] == f"human:{alice.id}", seen
    assert state_of(world, alice, question["id"])["answer"] == "sdb"
    assert state_of(world, alice, held)["queue"] == "lane-s"
    conflict = post(client, f"/board/todos/{held}/discard", back="/board/inbox/held")
    assert conflict.status_code == 409 and "cannot discard a todo that is pending" in conflict.text
    assert 'href="/board/inbox/held">Back to the page you were on' in conflict.text


def test_trust_this_actor_and_release_adds_the_actor(client, world, alice, lane):
    hook, held = held_delivery(world, alice, lane)
    sign_in(client, alice)
    assert post(client, f"/board/todos/{held}/release", trust_actor="1").status_code == 303
    assert state_of(world, alice, held)["state"] == "pending"
    trusted = world.client.get(f"/api/v1/webhooks/{hook['id']}", headers=alice.auth).json()["trusted_actors"]
    assert trusted == {"actor_ids": ["alice-agent"]}


def test_a_second_human_sees_none_of_the_first_ones_work(client, world, alice, lane):
    hook, held = held_delivery(world, alice, lane, title="alice's secret plan")
    review = review_todo(world, alice, lane)
    bob = world.human("bob")
    world.endpoint(bob, ["lane-s"], name="bobs")
    sign_in(client, bob)
    for path in ("/board", "/board/queues", "/board/webhooks", "/board/endpoints", "/board/inbox/held"):
        page = client.get(path).text
        assert "secret plan" not in page and held not in page and lane.id not in page and hook["id"] not in page
    for path in (f"/board/todos/{held}", f"/board/webhooks/{hook['id']}", f"/board/webhooks/{hook['id']}/deliveries",
                 f"/board/deliveries/{state_of(world, alice, held)['event_id']}", f"/board/endpoints/{lane.id}/revoke"):
        assert client.get(path).status_code == 404, path
    token = csrf(client)
    approve = post(client, f"/board/todos/{review['id']}/approve", token=token)
    revoke = post(client, f"/board/endpoints/{lane.id}/revoke", token=token, confirm="yes")
    rotate = post(client, f"/board/webhooks/{hook['id']}/rotate", token=token)
    assert [approve.status_code, revoke.status_code, rotate.status_code] == [404] * 3
    assert state_of(world, alice, review["id"])["state"] == "review"
    assert world.client.get("/api/v1/me", headers=lane.auth).status_code == 200, "alice's endpoint still works"
    assert f"no todo {review['id']}" in approve.text and f"no endpoint {lane.id}" in revoke.text
    assert f"no webhook {hook['id']}" in rotate.text


def test_producer_text_is_escaped_everywhere(client, world, alice, lane):
    evil = "<img src=x onerror=alert(1)></script><script>alert(2)</script>"
    hook, held = held_delivery(world, alice, lane, title=evil)
    sign_in(client, alice)
    event_id = state_of(world, alice, held)["event_id"]
    for path in ("/board", f"/board/todos/{held}", f"/board/deliveries/{event_id}"):
        page = client.get(path).text
        assert "<img src=x" not in page and "<script>alert" not in page, path
        assert "&lt;img src=x onerror=alert(1)&gt;" in page, path


def test_bidirectional_controls_never_reach_a_page(client, world, alice, lane):
    todo = world.push(alice, lane, "lane-s", "plain", payload={"name": "abc\u202etxt.exe"})
    sign_in(client, alice)
    page = client.get(f"/board/todos/{todo['id']}").text
    assert "\u202e" not in page and "\\u202e" in page


def test_rules_are_validated_dry_run_and_saved_from_the_editor(client, world, alice, lane):
    hook = world.webhook(alice, lane, "github", queue="triage", trusted_actors={"allow_all": True})
    world.deliver(hook, *producers.github("issues.opened", hook["secret"]))
    sign_in(client, alice)
    page = client.get(f"/board/webhooks/{hook['id']}")
    assert page.status_code == 200 and '&#34;rules&#34;: []' in page.text
    event_id = re.search(r'<option value="(ev_[0-9a-f]+)"', page.text).group(1)
    bad = '{"rules": [{"id": "broken", "expr": "input_filename", "action": {"queue": "lane-s"}}]}'
    refused = post(client, f"/board/webhooks/{hook['id']}/rules", rules=bad, do="save", source="event",
                   event_id=event_id)
    assert refused.status_code == 400 and "rules[0] (id &#39;broken&#39;)" in refused.text
    assert "input_filename" in refused.text, "the candidate stays in the editor"
    not_json = post(client, f"/board/webhooks/{hook['id']}/rules", rules="{nope", do="save")
    assert not_json.status_code == 400 and "not JSON" in not_json.text
    good = ('{"rules": [{"id": "opened", "expr": ".kind == \\"issues\\"", "action": {"queue": "lane-s"}}],'
            ' "default_action": null, "params": {}}')
    dry = post(client, f"/board/webhooks/{hook['id']}/rules", rules=good, do="dry-run", source="event",
               event_id=event_id)
    assert dry.status_code == 200 and "Dry run:" in dry.text and "lane-s" in dry.text and "opened" in dry.text
    assert world.client.get(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth).json()["rules"] == []
    pasted = post(client, f"/board/webhooks/{hook['id']}/rules", rules=good, do="dry-run", source="payload",
                  payload='{"ref": "refs/heads/main"}', headers="X-GitHub-Event: push")
    assert pasted.status_code == 200 and "github · push" in pasted.text and "no_match_default" in pasted.text
    saved = post(client, f"/board/webhooks/{hook['id']}/rules", rules=good, do="save", source="event",
                 event_id=event_id)
    assert saved.status_code == 303 and saved.headers["location"] == f"/board/webhooks/{hook['id']}#rules"
    rules = world.client.get(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth).json()
    assert rules["rules"][0]["id"] == "opened"


def test_trusted_actors_routes_and_rotation(client, world, alice, lane):
    hook = world.webhook(alice, lane, "github", queue="triage")
    other = world.endpoint(alice, ["triage"], name="other")
    sign_in(client, alice)
    assert post(client, f"/board/webhooks/{hook['id']}/trusted-actors", mode="list", kind="logins",
                names="alice\nbob", match="both").status_code == 303
    assert world.client.get(f"/api/v1/webhooks/{hook['id']}", headers=alice.auth).json()["trusted_actors"] == {
        "logins": ["alice", "bob"], "match": "both"}
    assert post(client, f"/board/webhooks/{hook['id']}/routes", endpoint_id=other.id).status_code == 303
    assert other.id in client.get(f"/board/webhooks/{hook['id']}").text
    assert post(client, f"/board/webhooks/{hook['id']}/routes/{other.id}/remove").status_code == 303
    rotated = post(client, f"/board/webhooks/{hook['id']}/rotate")
    assert rotated.status_code == 303
    shown = client.get(rotated.headers["location"]).text
    url = re.search(r'id="new-url" class="mono" readonly value="([^"]+)"', shown).group(1)
    secret = re.search(r'id="new-secret" class="mono" readonly value="(whsec_[0-9a-f]+)"', shown).group(1)
    assert url != hook["url"] and secret != hook["secret"]
    assert "whsec_" not in client.get(rotated.headers["location"]).text, "the secret is shown once"
    assert world.deliver(hook, *producers.github("issues.opened", hook["secret"])).status_code == 404


def test_vend_shows_the_token_once_and_revoke_asks_first(client, world, alice):
    sign_in(client, alice)
    made = post(client, "/board/endpoints/vend", name="worker-1", queues="lane-s, lane-m", verbs="drain",
                default_lease_seconds="600")
    assert made.status_code == 303
    page = client.get("/board/endpoints").text
    token = re.search(r'id="vended-token" class="mono" readonly value="(sbk_[^"]+)"', page).group(1)
    assert f"Bearer {token}" in page and "claude mcp add --transport http switchboard http://testserver/mcp" in page
    assert token not in client.get("/board/endpoints").text
    assert world.client.get("/api/v1/me", headers={"Authorization": f"Bearer {token}"}).json()["queues"] == [
        "lane-s", "lane-m"]
    endpoint_id = re.search(r"/board/endpoints/(ep_[0-9a-f]+)/revoke", page).group(1)
    confirm = client.get(f"/board/endpoints/{endpoint_id}/revoke")
    assert confirm.status_code == 200 and "cannot be undone" in confirm.text
    assert post(client, f"/board/endpoints/{endpoint_id}/revoke").status_code == 400, "no confirm: refused"
    assert world.client.get("/api/v1/me", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert post(client, f"/board/endpoints/{endpoint_id}/revoke", confirm="yes").status_code == 303
    assert world.client.get("/api/v1/me", headers={"Authorization": f"Bearer {token}"}).status_code == 401
    bad = post(client, "/board/endpoints/vend", name="x", queues="quarantine")
    assert bad.status_code == 400 and "reserved" in bad.text


def test_queues_show_counts_running_work_and_connected_sessions(client, world, alice, lane, clock):
    world.push(alice, lane, "lane-s", "waiting")
    running = world.push(alice, lane, "triage", "running")
    claim = world.client.post("/api/v1/todos/claim", headers=lane.auth,
                              json={"queue": "triage", "claimant": "worker-7"}).json()
    world.act(lane, running["id"], "heartbeat", lease_token=claim["lease_token"], note="halfway there")
    sign_in(client, alice)
    page = client.get("/board/queues").text
    assert "worker-7" in page and "halfway there" in page and "running" in page
    # A worker whose every slot is busy holds no waiting claim, yet it is connected: its live lease says so.
    assert "No worker session is connected." not in page
    assert re.search(r'<li class="working"><strong>worker-7</strong> · working 1 job of triage under a live lease',
                     page), page
    clock.advance(301)  # the lease lapsed: nobody is working it any more
    page = client.get("/board/queues").text
    assert "No worker session is connected." in page and 'class="working"' not in page


def test_pages_are_paginated(client, world, alice, lane, clock):
    for n in range(BOARD_PAGE_SIZE + 3):
        clock.advance(1)
        todo = world.push(alice, lane, "lane-s", f"q{n}")
        claim = world.claim(lane, queue="lane-s")
        world.act(lane, todo["id"], "needs-input", lease_token=claim["lease_token"], question=f"question {n}?")
    sign_in(client, alice)
    inbox = client.get("/board").text
    assert "question 0?" in inbox and "question 12?" not in inbox and "/board/inbox/questions" in inbox
    first = client.get("/board/inbox/questions").text
    assert "question 0?" in first and f"question {BOARD_PAGE_SIZE}?" not in first
    after = re.search(r'href="/board/inbox/questions\?after=([^"]+)"', first).group(1)
    second = client.get(f"/board/inbox/questions?after={after}").text
    assert f"question {BOARD_PAGE_SIZE}?" in second and "question 0?" not in second


def test_a_version_1_database_gets_the_sessions_table_on_migration(tmp_path):
    path = str(tmp_path / "old.db")
    conn = connect(path)
    apply_schema(conn)
    conn.execute("DROP TABLE board_sessions")
    conn.execute("PRAGMA user_version=1")
    assert apply_schema(conn) == SCHEMA_VERSION
    assert conn.execute("SELECT count(*) FROM board_sessions").fetchone()[0] == 0
    conn.close()


def test_serve_takes_trust_proxy_from_its_flag_or_the_environment(monkeypatch, db_path):
    seen = {}

    def fake_app(*positional, **options):
        seen.update(options)
        raise SystemExit(0)

    monkeypatch.setattr(server_module, "create_app", fake_app)
    monkeypatch.setattr(server_module, "configure_logging", lambda log_format: contextlib.nullcontext())

    def trust_proxy(*flags: str) -> TrustedProxies:
        seen.clear()
        with pytest.raises(SystemExit):
            cli_serve(build_parser().parse_args(["serve", "--db", db_path, *flags]))
        return seen["trust_proxy"]

    off, bare = TrustedProxies(), TrustedProxies(any_proto=True)
    named = TrustedProxies(networks=(ipaddress.ip_network("127.0.0.1/32"), ipaddress.ip_network("10.0.0.0/8")))
    assert trust_proxy() == off and trust_proxy("--trust-proxy") == bare, "bare: the old meaning"
    assert trust_proxy("--trust-proxy", "127.0.0.1,10.0.0.0/8") == named
    assert trust_proxy("--trust-proxy", "--port", "9999") == bare, "a flag after it is not its value"
    monkeypatch.setenv("SWITCHBOARD_TRUST_PROXY", "yes")
    assert trust_proxy() == bare
    monkeypatch.setenv("SWITCHBOARD_TRUST_PROXY", "127.0.0.1 10.0.0.0/8")
    assert trust_proxy() == named
    monkeypatch.setenv("SWITCHBOARD_TRUST_PROXY", "off")
    assert trust_proxy() == off and trust_proxy("--trust-proxy") == bare
    monkeypatch.setenv("SWITCHBOARD_TRUST_PROXY", "maybe")
    with pytest.raises(ApiError, match="SWITCHBOARD_TRUST_PROXY"):
        cli_serve(build_parser().parse_args(["serve", "--db", db_path]))


def test_a_huge_payload_is_cut_on_the_page_and_signed_in_users_skip_the_login_form(client, world, alice, lane):
    todo = world.push(alice, lane, "lane-s", "big", payload={"blob": "x" * 400_000})
    sign_in(client, alice)
    page = client.get(f"/board/todos/{todo['id']}").text
    assert len(page) < 250_000 and "more characters (the API has all of it)" in page
    again = client.get("/board/login?next=/board/queues", follow_redirects=False)
    assert again.status_code == 303 and again.headers["location"] == "/board/queues"


def test_without_its_files_the_board_is_off_and_the_api_still_serves(monkeypatch, tmp_path, alice, world):
    monkeypatch.setattr(board_pages_module, "BOARD_DIR", tmp_path / "missing")
    app = create_app(str(tmp_path / "other.db"), background=False)
    with TestClient(app) as client:
        assert client.get("/board").status_code == 404
        assert client.get("/healthz").status_code == 200


@pytest.fixture
def loopback_channels_allowed(monkeypatch):
    """The channel below points at 127.0.0.1:9, which a server refuses unless its operator allows loopback: this
    test's app reads the allowance from the environment (set before the app is made)."""
    monkeypatch.setenv("SWITCHBOARD_NOTIFY_ALLOW_PRIVATE", "1")


def test_notification_channels_are_added_tested_and_removed_from_the_board(loopback_channels_allowed, client, world,
                                                                           alice):
    sign_in(client, alice)
    refused = post(client, "/board/notify/add", kind="ntfy", url="ftp://nowhere", ev_held="on")
    assert refused.status_code in (303, 400) and client.get("/api/v1/notify", headers=alice.auth).json() == {
        "channels": []}
    added = post(client, "/board/notify/add", kind="webhook", url="http://127.0.0.1:9/hook", ev_held="on",
                 ev_review="on")
    assert added.status_code == 303 and added.headers["location"] == "/board/notify"
    page = client.get("/board/notify")
    assert "Copy its signing secret now" in page.text and "whsec_" in page.text
    [channel] = client.get("/api/v1/notify", headers=alice.auth).json()["channels"]
    assert channel["kind"] == "webhook" and channel["events"] == ["review", "held"]
    assert "whsec_" not in client.get("/board/notify").text, "the secret is shown once"
    tested = post(client, f"/board/notify/{channel['id']}/test")
    assert tested.status_code == 303 and "Test failed" in client.get("/board/notify").text
    assert post(client, f"/board/notify/{channel['id']}/remove").status_code == 303
    assert client.get("/api/v1/notify", headers=alice.auth).json() == {"channels": []}


def test_a_dropped_delivery_is_replayed_from_its_page_and_in_bulk_from_the_webhook(client, world, alice, lane):
    hook = world.webhook(alice, lane, "github", queue="lane-s")
    bad = {"rules": [{"id": "drop-all", "expr": "true", "action": {"drop": True}}]}
    assert world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth, json=bad).status_code == 200
    outcome = world.deliver(hook, *producers.github("issues.opened", hook["secret"])).json()
    assert outcome["disposition"] == "dropped"
    fixed = {"rules": [{"id": "to-lane", "expr": ".issue != null", "action": {"queue": "lane-s"}}]}
    assert world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth, json=fixed).status_code == 200
    sign_in(client, alice)
    dry = post(client, f"/board/webhooks/{hook['id']}/replay", disposition="dropped", limit="50", apply="no")
    assert dry.status_code == 303 and "1 dropped → routed (rule to-lane)" in client.get(f"/board/webhooks/{hook['id']}").text
    assert world.client.get("/api/v1/todos", headers=alice.auth).json()["todos"] == []
    done = post(client, f"/board/deliveries/{outcome['event_id']}/replay", apply="yes")
    assert done.status_code == 303
    page = client.get(f"/board/deliveries/{outcome['event_id']}")
    assert "is now routed to lane-s (created 1 todo(s))" in page.text and "dropped → routed" in page.text
    [todo] = world.client.get("/api/v1/todos", headers=alice.auth).json()["todos"]
    assert todo["queue"] == "lane-s" and todo["event_id"] == outcome["event_id"]
    post(client, f"/board/deliveries/{outcome['event_id']}/replay", apply="yes")
    assert len(world.client.get("/api/v1/todos", headers=alice.auth).json()["todos"]) == 1, "never minted twice"


def test_the_queues_page_pauses_caps_and_resumes_a_queue(client, world, alice, lane, clock):
    """The Board's queues page: a pause with its reason and time left, caps and how full they are, then Resume;
    each form does what the REST call does (a claim skips the paused queue and says why)."""
    world.push(alice, lane, "lane-s", "first")
    world.push(alice, lane, "lane-s", "second")
    sign_in(client, alice)
    base = f"/board/endpoints/{lane.id}/queues/lane-s"
    paused = post(client, f"{base}/pause", **{"for": "2h", "reason": "quota until 18:00", "back": "/board/queues"})
    assert paused.status_code == 303 and paused.headers["location"] == "/board/queues", paused.text
    page = client.get("/board/queues").text
    assert "Paused lane-s until" in page, "the notice says what was done"
    row = re.search(r'<tr>\s*<th scope="row"><a [^>]*>lane-s</a></th>(.*?)</tr>', page, re.S).group(1)
    assert "paused</span> resumes" in row and ">in 2 h</time>: quota until 18:00" in row, row
    assert f'action="{base}/resume"' in row and f'action="{base}/pause"' not in row
    shut = world.claim(lane, queue="lane-s")
    assert shut["empty"] is True and [(a["queue"], a["reason"]) for a in shut["admission"]] == [("lane-s", "paused")]

    capped = post(client, f"{base}/limits", max_in_flight="1", max_claims="5", window_seconds="60",
                  back="/board/queues")
    assert capped.status_code == 303, capped.text
    assert post(client, f"{base}/resume", back="/board/queues").status_code == 303
    assert "todo" in world.claim(lane, queue="lane-s")
    row = re.search(r'<tr>\s*<th scope="row"><a [^>]*>lane-s</a></th>(.*?)</tr>',
                    client.get("/board/queues").text, re.S).group(1)
    assert re.search(r'data-label="Claims">\s*open', row), row
    assert re.search(r'data-label="In flight">1 of 1 <span class="state s-paused">full</span>', row), row
    assert "1 of 5 per 60 s" in row and f'action="{base}/pause"' in row
    full = world.claim(lane, queue="lane-s")
    assert full["empty"] is True and [(a["queue"], a["reason"]) for a in full["admission"]] == [("lane-s", "max_in_flight")]

    refused = post(client, f"{base}/pause", token=None, **{"for": "1h"})  # no CSRF token: refused, nothing changes
    assert refused.status_code == 403
    queues = world.client.get(f"/api/v1/endpoints/{lane.id}/queues", headers=alice.auth).json()["queues"]
    assert all(q["paused"] is None for q in queues)
