"""Humans' own credentials (issue 35 item 17, issue 37's logins): a lost human token is reissued by the operator
(`human token NAME`) or rotated by the human (`POST /api/v1/me/token`, the Board's account page), shown once, and
the old token and every Board session signed in with it stop working at once; `human add --login` and `human
set-login` tie a human to the login an identity proxy names them by (a migration adds the column); and
`webhook trust --add` adds to a trust list instead of replacing it.

The CLI runs as the operator runs it: each new command once as a child process, and its refusals through the same
main() in this process; REST and the Board through Starlette's test client against the real app; every refused
call leaves every table as it was."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sqlite3
import stat

import producers
import pytest
from conftest import ROOT, cli, snapshot
from helpers import connect_db, integrity_errors, post_delivery
from starlette.testclient import TestClient

from switchboard.app import create_app
from switchboard.board.queries import BOARD_COOKIE
from switchboard.configuration import SCHEMA_VERSION
from switchboard.database import connect
from switchboard.migrations import apply_schema

ORIGIN = {"Origin": "http://testserver"}


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def sign_in(client, token: str) -> str:
    answer = client.post("/board/login", data={"token": token}, headers=ORIGIN, follow_redirects=False)
    assert answer.status_code == 303, answer.text
    return answer.cookies[BOARD_COOKIE]


def csrf_of(page: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', page).group(1)


@contextlib.contextmanager
def browser(client, cookie: str | None = None):
    """Another browser on the same app: the client with its own cookie jar (holding `cookie`, if given) while
    inside; the client's own jar is back afterwards."""
    own = client.cookies
    client.cookies = type(own)({BOARD_COOKIE: cookie} if cookie else {})
    try:
        yield client
    finally:
        client.cookies = own


def signed_in(client, cookie: str) -> bool:
    """Whether a browser holding this session cookie gets a Board page (else it is sent to sign in)."""
    with browser(client, cookie):
        return client.get("/board/queues", follow_redirects=False).status_code == 200


def other_session(client, token: str) -> str:
    """The cookie of a sign-in from another browser."""
    with browser(client):
        return sign_in(client, token)


# -- the operator reissues -----------------------------------------------------------------------------------------

def test_the_operator_reissues_a_lost_token_and_the_old_one_and_its_sessions_end(db_path, tmp_path, app, client):
    _, alice = cli(db_path, "human", "add", "alice")
    _, bob = cli(db_path, "human", "add", "bob")
    phone, laptop = other_session(client, alice["token"]), other_session(client, alice["token"])
    bobs = other_session(client, bob["token"])
    out = tmp_path / "alice-new.json"
    code, made = cli(db_path, "human", "token", "alice", "--out", str(out))
    assert code == 0, made
    assert set(made) == {"id", "name", "token", "token_prefix", "sessions_ended"}
    assert made["id"] == alice["id"] and made["name"] == "alice" and made["sessions_ended"] == 2
    assert made["token"].startswith("sbh_") and made["token"] != alice["token"]
    assert json.loads(out.read_text())["token"] == made["token"] and stat.S_IMODE(out.stat().st_mode) == 0o600
    assert client.get("/api/v1/me", headers=bearer(alice["token"])).status_code == 401, "the old token: 401"
    me = client.get("/api/v1/me", headers=bearer(made["token"]))
    assert me.status_code == 200 and me.json()["id"] == alice["id"] and me.json()["token_prefix"] == made["token"][:12]
    assert not signed_in(client, phone) and not signed_in(client, laptop), "alice's Board sessions ended"
    assert signed_in(client, bobs) and client.get("/api/v1/me", headers=bearer(bob["token"])).status_code == 200
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("switchboard.db*"))
    assert made["token"].encode() not in raw, "only its hash is stored"
    code, unknown = cli(db_path, "human", "token", "carol")
    assert code == 1 and unknown["error"] == "not_found"


def test_a_reissued_token_keeps_the_humans_endpoints_and_work(db_path, world):
    alice = world.human("alice")
    worker = world.endpoint(alice, ["build"], name="w")
    todo = world.push(alice, worker, "build", "keep me")
    _, made = cli(db_path, "human", "token", alice.id)
    assert world.client.get("/api/v1/me", headers=worker.auth).status_code == 200, "endpoint tokens are untouched"
    shown = world.client.get(f"/api/v1/todos/{todo['id']}", headers=bearer(made["token"]))
    assert shown.status_code == 200 and shown.json()["title"] == "keep me"


# -- the human rotates their own ------------------------------------------------------------------------------------

def test_a_human_rotates_their_own_token_over_rest(app, client, world, db_path):
    alice, bob = world.human("alice"), world.human("bob")
    board = other_session(client, alice.token)
    rotated = client.post("/api/v1/me/token", headers=alice.auth)
    assert rotated.status_code == 200, rotated.text
    made = rotated.json()
    assert made["id"] == alice.id and made["token"].startswith("sbh_") and made["sessions_ended"] == 1
    assert client.get("/api/v1/me", headers=alice.auth).status_code == 401
    assert client.post("/api/v1/me/token", headers=alice.auth).status_code == 401, "the old token cannot rotate again"
    assert client.get("/api/v1/me", headers=bearer(made["token"])).json()["name"] == "alice"
    assert not signed_in(client, board)
    assert client.get("/api/v1/me", headers=bob.auth).status_code == 200, "nobody else's token moved"
    document = client.get("/api/v1/openapi.json").json()
    assert document["paths"]["/api/v1/me/token"]["post"]["description"] == "Credential: a human token (sbh_…)."


def test_me_token_refuses_everyone_but_a_human_and_changes_nothing(world, db_path):
    alice = world.human("alice")
    worker = world.endpoint(alice, ["build"], name="w", verbs=["all"])
    before = snapshot(db_path)
    for headers, status, code in ((worker.auth, 403, "forbidden"), ({}, 401, "unauthenticated"),
                                  (bearer("sbh_" + "x" * 43), 401, "unauthenticated"),
                                  (bearer("sbs_" + "x" * 43), 401, "unauthenticated")):
        answer = world.client.post("/api/v1/me/token", headers=headers)
        assert answer.status_code == status and answer.json()["error"] == code, answer.text
    assert world.client.get("/api/v1/me/token", headers=alice.auth).status_code == 405
    assert snapshot(db_path) == before


def test_the_board_rotates_the_token_shows_it_once_and_ends_the_other_sessions(app, client, world, db_path):
    alice = world.human("alice")
    other = other_session(client, alice.token)
    sign_in(client, alice.token)
    account = client.get("/board/account")
    assert account.status_code == 200 and "Issue a new token" in account.text
    assert alice.token[:12] in account.text and alice.token not in account.text, "only the prefix is shown"
    assert re.search(r'<a class="who" href="/board/account"', account.text), "the header links to the account"
    done = client.post("/board/account/token", data={"csrf": csrf_of(account.text), "confirm": "yes"},
                       headers=ORIGIN, follow_redirects=False)
    assert done.status_code == 303 and done.headers["location"] == "/board/account"
    cookie = done.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/board" in cookie
    shown = client.get("/board/account").text
    token = re.search(r'id="new-human-token" class="mono" readonly value="(sbh_[^"]+)"', shown).group(1)
    assert "Copy it now" in shown and "1 other Board session(s) ended" in shown
    assert token not in client.get("/board/account").text, "shown once"
    assert world.client.get("/api/v1/me", headers=alice.auth).status_code == 401
    assert world.client.get("/api/v1/me", headers=bearer(token)).json()["id"] == alice.id
    assert not signed_in(client, other), "the other browser's session ended"
    assert client.get("/board/queues", follow_redirects=False).status_code == 200, "this browser stays signed in"
    rows = connect_db(db_path).execute("SELECT count(*) FROM board_sessions").fetchone()[0]
    assert rows == 1


def test_the_board_rotation_refuses_a_form_from_elsewhere_or_unconfirmed(app, client, world, db_path):
    alice = world.human("alice")
    sign_in(client, alice.token)
    token = csrf_of(client.get("/board/account").text)
    before = snapshot(db_path)
    refusals = [
        ({"confirm": "yes"}, ORIGIN, 403, "CSRF check"),
        ({"csrf": "x" * 43, "confirm": "yes"}, ORIGIN, 403, "CSRF check"),
        ({"csrf": token, "confirm": "yes"}, {"Origin": "https://evil.example"}, 403, "Origin check"),
        ({"csrf": token, "confirm": "yes"}, {}, 403, "Origin check"),
        ({"csrf": token}, ORIGIN, 400, "tick the box first"),
        ({"csrf": token, "confirm": "no"}, ORIGIN, 400, "tick the box first"),
    ]
    for form, headers, status, why in refusals:
        answer = client.post("/board/account/token", data=form, headers=headers, follow_redirects=False)
        assert answer.status_code == status and why in answer.text, (form, headers, answer.status_code)
    as_json = client.post("/board/account/token", json={"csrf": token, "confirm": "yes"}, headers=ORIGIN)
    assert as_json.status_code == 403
    with browser(client):
        assert client.post("/board/account/token", data={"csrf": token, "confirm": "yes"}, headers=ORIGIN,
                           follow_redirects=False).status_code == 403, "no session: nothing runs"
    assert snapshot(db_path) == before
    assert world.client.get("/api/v1/me", headers=alice.auth).status_code == 200


# -- logins ---------------------------------------------------------------------------------------------------------

def test_logins_are_set_at_creation_or_later_unique_whatever_their_case(db_path):
    code, alice = cli(db_path, "human", "add", "alice", "--login", "Alice@Example.com")
    assert code == 0 and alice["login"] == "alice@example.com", alice
    code, bob = cli(db_path, "human", "add", "bob")
    assert code == 0 and set(bob) == {"id", "name", "token"}, "without a login: the shape SPEC 9 names"
    before = snapshot(db_path)
    for args, error in ((("human", "set-login", "bob", "ALICE@example.com"), "conflict"),
                        (("human", "add", "carol", "--login", "alice@EXAMPLE.com"), "conflict"),
                        (("human", "set-login", "bob", "two words"), "invalid_argument"),
                        (("human", "set-login", "bob", "é@example.com"), "invalid_argument"),
                        (("human", "set-login", "bob", "x" * 255), "invalid_argument"),
                        (("human", "set-login", "bob", ""), "invalid_argument"),
                        (("human", "set-login", "nobody", "n"), "not_found")):
        code, answer = cli(db_path, *args)
        assert code == 1 and answer["error"] == error, (args, answer)
    assert snapshot(db_path) == before
    code, changed = cli(db_path, "human", "set-login", "bob", "bob@github")
    assert code == 0 and changed["login"] == "bob@github" and changed["name"] == "bob" and "token" not in changed
    code, moved = cli(db_path, "human", "set-login", "alice", "Alice")
    assert code == 0 and moved["login"] == "alice"
    listed = {h["name"]: h["login"] for h in cli(db_path, "human", "list")[1]["humans"]}
    assert listed == {"alice": "alice", "bob": "bob@github"}
    conn = connect_db(db_path)
    with pytest.raises(integrity_errors()):  # the database holds the rule too
        conn.execute("UPDATE humans SET login = 'Bob@github' WHERE name = 'alice'")
    with pytest.raises(integrity_errors()):
        conn.execute("UPDATE humans SET login = 'bob@github' WHERE name = 'alice'")
    conn.close()


@pytest.mark.parametrize("release", ["release1", "release2", "release3"])
def test_the_migration_adds_logins_and_keeps_every_human_and_token(tmp_path, monkeypatch, release):
    fixture = ROOT / "tests" / "fixtures" / release
    facts = json.loads((fixture / f"{release}.json").read_text())
    path = tmp_path / "switchboard.db"
    shutil.copy2(fixture / f"{release}.db", path)
    conn = connect(str(path))
    humans = conn.execute("SELECT id, name, token_hash, token_prefix, created_at FROM humans ORDER BY id").fetchall()
    sessions = conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'board_sessions'").fetchone()[0] and \
        conn.execute("SELECT count(*) FROM board_sessions").fetchone()[0]
    assert "login" not in [row[1] for row in conn.execute("PRAGMA table_info(humans)")]
    assert apply_schema(conn) == SCHEMA_VERSION
    assert [tuple(r) + (None,) for r in humans] == [tuple(r) for r in conn.execute(
        "SELECT id, name, token_hash, token_prefix, created_at, login FROM humans ORDER BY id")]
    if sessions:
        assert conn.execute("SELECT count(*) FROM board_sessions").fetchone()[0] == sessions, "sessions kept"
    conn.close()
    fresh = connect(str(tmp_path / "fresh.db"))
    apply_schema(fresh)
    migrated = sqlite3.connect(path)
    for table in ("humans", "board_sessions"):
        assert migrated.execute(f"PRAGMA table_info({table})").fetchall() == [tuple(r) for r in fresh.execute(
            f"PRAGMA table_info({table})")], table
    assert migrated.execute("PRAGMA foreign_key_check").fetchall() == []
    migrated.close()
    fresh.close()
    monkeypatch.setenv("SWITCHBOARD_SECRET_KEY", facts["secret_key_hex"])
    with TestClient(create_app(str(path), background=False)) as client:
        me = client.get("/api/v1/me", headers=bearer(facts["human_token"]))
        assert me.status_code == 200 and me.json()["login"] is None, me.text
        assert client.post("/api/v1/me/token", headers=bearer(facts["human_token"])).status_code == 200
        assert client.get("/api/v1/me", headers=bearer(facts["human_token"])).status_code == 401


# -- webhook trust --add -----------------------------------------------------------------------------------------

def test_webhook_trust_add_keeps_the_list_and_adds_to_it(db_path, app, client):
    _, alice = cli(db_path, "human", "add", "alice")
    _, router = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "router", "--queues", "hold",
                    "--verbs", "webhooks")
    _, hook = cli(db_path, "webhook", "create", "--endpoint", router["id"], "--provider", "github", "--queue",
                  "hold", "--trust", "alice,alice-agent", "--match", "both")
    code, added = cli(db_path, "webhook", "trust", hook["id"], "--add", "alice-triage,ALICE, alice-triage")
    assert code == 0, added
    assert added["trusted_actors"] == {"logins": ["alice", "alice-agent", "alice-triage"], "match": "both"}, \
        "kept, added once; ALICE is alice (the gate compares logins ASCII case-insensitively)"
    code, matched = cli(db_path, "webhook", "trust", hook["id"], "--add", "renovate-fork", "--match", "sender")
    assert code == 0 and matched["trusted_actors"]["match"] == "sender"
    assert matched["trusted_actors"]["logins"][-1] == "renovate-fork"
    # The gate now lets the added login through: a delivery it sends reaches the rules.
    raw, headers = producers.github("issues.opened", hook["secret"], {"sender": {"login": "Alice-Triage"}})
    outcome = post_delivery(client, hook, raw, headers).json()
    assert outcome["disposition"] == "routed", outcome

    before = snapshot(db_path)
    refusals = [(("--add", "x", "--trust", "y"), 1, "invalid_argument"), (("--add", "x", "--allow-all"), 1,
                "invalid_argument"), (("--add", " , "), 1, "invalid_argument"), (("--add", "x" * 129), 1,
                "invalid_argument"), (("--add", "two\nlines"), 1, "invalid_argument")]
    for args, exit_code, error in refusals:
        code, answer = cli(db_path, "webhook", "trust", hook["id"], *args)
        assert code == exit_code and answer["error"] == error, (args, answer)
    assert cli(db_path, "webhook", "trust", "wh_0123456789abcdef01", "--add", "x")[1]["error"] == "not_found"
    assert snapshot(db_path) == before

    # A webhook made without a list (it holds everything) gets one; allow_all is not narrowed by an --add.
    _, holding = cli(db_path, "webhook", "create", "--endpoint", router["id"], "--provider", "cairn",
                     "--queue", "hold")
    assert cli(db_path, "webhook", "trust", holding["id"], "--add", "agent-1")[1]["trusted_actors"] == {
        "actor_ids": ["agent-1"]}
    assert cli(db_path, "webhook", "trust", holding["id"], "--add", "Agent-1")[1]["trusted_actors"] == {
        "actor_ids": ["agent-1", "Agent-1"]}, "cairn actor ids compare exactly"
    assert cli(db_path, "webhook", "trust", holding["id"], "--add", "a", "--match", "author")[1]["error"] == \
        "invalid_argument"
    everyone = client.post("/api/v1/webhooks", headers=bearer(alice["token"]), json={
        "provider": "github", "queue": "hold", "endpoint_id": router["id"], "trusted_actors": {"allow_all": True}}).json()
    code, refused = cli(db_path, "webhook", "trust", everyone["id"], "--add", "alice")
    assert code == 1 and refused["error"] == "conflict" and "allow_all" in refused["message"]
    _, generic = cli(db_path, "webhook", "create", "--endpoint", router["id"], "--provider", "generic",
                     "--queue", "hold")
    assert cli(db_path, "webhook", "trust", generic["id"], "--add", "x")[1]["error"] == "invalid_argument"
