"""What a new user tripped on in the Board (issue 25) and the Board's forms under bad input (issue 26), through
Starlette's test client against the real app: trusting an actor stands whatever the rules then do, and the
banner says what happened; the queue lists offer only what the todo's webhook reaches; a dry run says that
nothing changed; a signed body that is not JSON is held for what it is; names where a human needs them;
webhooks that can be told apart (a name, last delivery, failed checks), named over REST too and kept through
the migration; and every Board form parsed by the API's own models, so that no form can answer 500. The
phone layout is checked in Chromium (tests/test_board_browser.py)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import sqlite3

import producers
import pytest
from conftest import ROOT, snapshot
from helpers import add_route, count
from starlette.testclient import TestClient

from switchboard.app import create_app
from switchboard.cli.parser import main
from switchboard.configuration import SCHEMA_VERSION
from switchboard.database import connect
from switchboard.migrations import apply_schema

ORIGIN = {"Origin": "http://testserver"}


def sign_in(client, human) -> None:
    answer = client.post("/board/login", data={"token": human.token}, headers=ORIGIN, follow_redirects=False)
    assert answer.status_code == 303, answer.text


def csrf(client) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', client.get("/board/endpoints").text).group(1)


def post(client, path: str, session_csrf: str | None = None, **fields):
    """A Board form with the session's CSRF token, from the Board's own origin."""
    return client.post(path, data={**fields, "csrf": session_csrf or csrf(client)}, headers=ORIGIN,
                       follow_redirects=False)


def text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", html))


def notice(client) -> str:
    """The one-shot notice the next page shows."""
    found = re.search(r'<p class="notice \w+" role="\w+">(.*?)(?: <a href|</p>)', client.get("/board/queues").text)
    return found.group(1) if found else ""


def rest(world, human, method: str, path: str, **body):
    return world.client.request(method, path, headers=human.auth, json=body or None)


def put_rules(world, human, hook: dict, *rules: dict) -> None:
    answer = rest(world, human, "PUT", f"/api/v1/webhooks/{hook['id']}/rules", rules=list(rules))
    assert answer.status_code == 200, answer.text


def options(page: str, select_id: str) -> list[tuple[str, str]]:
    """A select's options as (value, flags): flags holds `d` (disabled) and `s` (selected)."""
    body = re.search(rf'<select id="{re.escape(select_id)}"[^>]*>(.*?)</select>', page, re.S).group(1)
    return [(value, ("d" if disabled else "") + ("s" if selected else ""))
            for value, disabled, selected in re.findall(r'<option value="([^"]*)"( disabled)?( selected)?>', body)]


def item_of(page: str, todo_id: str) -> str:
    """The inbox card of one todo."""
    return re.search(rf'<li class="item">(?:(?!<li class="item">).)*?/board/todos/{todo_id}".*?</li>\s*(?=<li class'
                     rf'="item">|</ul>)', page, re.S).group(0)


@pytest.fixture
def router(world, alice):
    return world.endpoint(alice, ["triage"], name="router")


# -- 1. trusting an actor stands whatever the rules then do ---------------------------------------------------

def test_trusting_the_actor_stands_when_the_rules_then_drop_the_delivery(client, world, alice, router):
    hook = world.webhook(alice, router, "github", trusted_actors={"logins": ["alice"]})
    # The trust gate runs after the rules and holds only what they would not drop: these drop trusted actors' work.
    put_rules(world, alice, hook, {"id": "drop-trusted", "expr": ".actor.trusted == true", "action": {"drop": True}})
    held = world.deliver(hook, *producers.github("issues.opened", hook["secret"])).json()["todos"][0]["id"]
    sign_in(client, alice)
    assert "Trust Codertocat and release" in item_of(client.get("/board").text, held), "the button names the login"
    assert post(client, f"/board/todos/{held}/release", trust_actor="1", back="/board").status_code == 303
    assert notice(client) == "Trusted Codertocat; the rules dropped it: rule drop-trusted"
    webhook = rest(world, alice, "GET", f"/api/v1/webhooks/{hook['id']}").json()
    assert webhook["trusted_actors"] == {"logins": ["alice", "Codertocat"], "match": "sender"}
    todo = rest(world, alice, "GET", f"/api/v1/todos/{held}").json()
    assert (todo["state"], todo["outcome"], todo["state_reason"]) == ("done", "discarded", "dropped")
    assert todo["trace"]["rule_id"] == "drop-trusted"
    assert todo["history"][-1]["evidence"]["trusted"] == ["Codertocat"]
    again = world.deliver(hook, *producers.github("issues.opened", hook["secret"], {"issue": {"number": 2}})).json()
    assert again["disposition"] == "dropped", "Codertocat passes the gate now; the rules decide"


def test_trusting_stands_when_the_rules_hold_it_again_and_without_trust_nothing_changes(world, alice, router, db_path):
    hook = world.webhook(alice, router, "github", trusted_actors={"logins": []})
    put_rules(world, alice, hook, {"id": "hold-all", "expr": "true", "action": {"quarantine": True}})
    held = world.deliver(hook, *producers.github("issues.opened", hook["secret"])).json()["todos"][0]["id"]
    before = snapshot(db_path)
    plain = rest(world, alice, "POST", f"/api/v1/todos/{held}/release-quarantine", note="try")
    assert plain.status_code == 409 and snapshot(db_path) == before, "without trust: held again, nothing changed"
    trusted = rest(world, alice, "POST", f"/api/v1/todos/{held}/release-quarantine", trust_actor=True)
    assert trusted.status_code == 200, trusted.text
    answer = trusted.json()
    assert answer["state"] == "quarantined" and answer["state_reason"] == "rule"
    assert answer["trace"]["rule_id"] == "hold-all"
    assert answer["history"][-1]["evidence"] == {**answer["history"][-1]["evidence"], "disposition": "quarantined",
                                                 "trusted": ["Codertocat"]}
    assert rest(world, alice, "GET", f"/api/v1/webhooks/{hook['id']}").json()["trusted_actors"]["logins"] == [
        "Codertocat"]


# -- 2. the queue lists offer only what the todo's webhook reaches -------------------------------------------

def test_send_reroute_and_release_offer_only_the_webhooks_queues(client, world, alice):
    hold = world.endpoint(alice, ["hold"], name="hold-router")
    lane = world.endpoint(alice, ["lane-s"], name="lane")
    world.endpoint(alice, ["build"], name="builder")  # first in the alphabet, and no target of these webhooks
    pack_like = world.webhook(alice, hold, "github", queue="hold")
    gated = world.webhook(alice, hold, "github", queue="hold", trusted_actors={"logins": []})
    for hook in (pack_like, gated):
        assert add_route(world.client, alice.auth, hook["id"], lane.id).status_code == 201
    waiting = world.deliver(pack_like, *producers.github("issues.opened", pack_like["secret"])).json()["todos"][0]
    held = world.deliver(gated, *producers.github("issues.opened", gated["secret"])).json()["todos"][0]
    assert waiting["queue"] == "hold" and held["queue"] == "quarantine"
    sign_in(client, alice)
    inbox = client.get("/board").text
    assert options(inbox, f"f-{waiting['id']}-rr") == [("", "ds"), ("lane-s", "")], "Send to: no build, no default"
    assert options(inbox, f"f-{held['id']}-rq") == [("", "s"), ("hold", ""), ("lane-s", "")], \
        "Release to: the rules decide unless the human picks a queue"
    page = client.get(f"/board/todos/{waiting['id']}").text
    assert options(page, f"f-{waiting['id']}-rr") == [("", "ds"), ("lane-s", "")]
    refused = post(client, f"/board/todos/{waiting['id']}/reroute", queue="build")
    assert refused.status_code == 400 and "no live target endpoint is scoped to build" in refused.text
    assert post(client, f"/board/todos/{waiting['id']}/reroute", queue="lane-s", back="/board").status_code == 303
    sent = rest(world, alice, "GET", f"/api/v1/todos/{waiting['id']}").json()
    assert (sent["queue"], sent["endpoint_id"], sent["state"]) == ("lane-s", lane.id, "pending")


# -- 3. a dry run says that nothing changed; the CLI says what it did -----------------------------------------

def test_a_dry_run_replay_says_what_would_happen_and_that_nothing_changed(client, world, alice, router, db_path):
    hook = world.webhook(alice, router, "github")
    put_rules(world, alice, hook, {"id": "drop-all", "expr": "true", "action": {"drop": True}})
    event_id = world.deliver(hook, *producers.github("issues.opened", hook["secret"])).json()["event_id"]
    put_rules(world, alice, hook, {"id": "to-lane", "expr": ".issue != null", "action": {"queue": "triage"}})
    sign_in(client, alice)
    post(client, f"/board/deliveries/{event_id}/replay", apply="no")
    dry = notice(client)
    assert dry.startswith("Checked, nothing changed:") and "would be routed to triage" in dry and "Replayed" not in dry
    post(client, f"/board/webhooks/{hook['id']}/replay", apply="no", limit="5")
    bulk = notice(client)
    assert bulk.startswith("Checked 1 deliveries, nothing changed: 1 would change") and "Replayed" not in bulk
    assert count(db_path, "todos") == 0 and count(db_path, "event_replays") == 0

    def people(*args: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["events", "replay", *args, "--db", db_path]) == 0
        return out.getvalue()

    assert people("--webhook", hook["id"]).startswith(
        "result: dry run, nothing changed: 1 of 1 deliveries would change; --apply acts")
    assert people(event_id).startswith("result: dry run, nothing changed: it would be routed to triage (now dropped)")
    assert count(db_path, "todos") == 0
    assert people(event_id, "--apply").startswith("result: replayed: dropped -> routed to triage, 1 todo(s) created")
    post(client, f"/board/webhooks/{hook['id']}/replay", apply="yes")
    assert notice(client).startswith("Replayed 1 deliveries under the current rules:")
    assert count(db_path, "todos") == 1, "never minted twice"


# -- 4. a signed body that is not JSON is held for what it is ------------------------------------------------

def test_a_signed_body_that_is_not_json_is_held_as_a_payload_error_not_an_untrusted_actor(client, world, alice,
                                                                                          router):
    hook = world.webhook(alice, router, "github", trusted_actors={"logins": ["alice"]})
    raw = b"<html>this is not json</html>"
    outcome = world.deliver(hook, raw, producers.github_headers(hook["secret"], raw)).json()
    assert outcome["disposition"] == "quarantined" and outcome["payload_error"] == "not_json"
    held = outcome["todos"][0]["id"]
    todo = rest(world, alice, "GET", f"/api/v1/todos/{held}").json()
    assert todo["state_reason"] == "payload_error"
    assert todo["trace"]["payload_detail"] == "not JSON: Expecting value: line 1 column 1 (char 0)"
    sign_in(client, alice)
    card = item_of(client.get("/board").text, held)
    assert "payload_error" in card and "not JSON: Expecting value: line 1 column 1 (char 0)" in card
    assert "Trust" not in card and 'name="trust_actor"' not in card
    assert "/release" in card and "/discard" in card
    deliveries = text(client.get(f"/board/webhooks/{hook['id']}/deliveries").text)
    assert "issues · no payload (not json)" in deliveries
    refused = rest(world, alice, "POST", f"/api/v1/todos/{held}/release-quarantine", trust_actor=True)
    assert refused.status_code == 409 and "held as payload_error" in refused.text
    assert post(client, f"/board/todos/{held}/release", back="/board").status_code == 303
    assert rest(world, alice, "GET", f"/api/v1/todos/{held}").json()["state"] == "pending"


# -- 5. names where a human needs them -----------------------------------------------------------------------

def test_pages_show_names_and_route_targets_are_picked_from_a_list(client, world, alice, router):
    lane = world.endpoint(alice, ["lane-s"], name="lane-worker")
    spare = world.endpoint(alice, ["lane-m"], name="spare-worker")
    hook = world.webhook(alice, router, "github")
    assert add_route(world.client, alice.auth, hook["id"], lane.id).status_code == 201
    todo = world.push(alice, router, "triage", "by hand")
    sign_in(client, alice)
    post(client, f"/board/todos/{todo['id']}/cancel", reason="not needed")
    page = client.get(f"/board/todos/{todo['id']}").text
    assert re.search(r"<dt>Endpoint</dt><dd[^>]*>router</dd>", page)
    assert f"human:{alice.id}</span>" not in page and re.search(r'class="tl-who" title="human:hu_\w+">alice<', page)
    webhook = client.get(f"/board/webhooks/{hook['id']}").text
    assert re.search(rf'<strong title="{lane.id}">lane-worker</strong>', webhook) and "granted" in webhook
    assert 'id="route-ep" name="endpoint_id" list=' not in webhook, "no typing an id"
    assert options(webhook, "route-ep") == [("", "ds"), (spare.id, "")], "only endpoints not routed yet"
    assert f'<option value="{spare.id}">spare-worker (lane-m)</option>' in webhook
    assert post(client, f"/board/webhooks/{hook['id']}/routes", endpoint_id=spare.id).status_code == 303
    assert notice(client) == "Deliveries now also go to spare-worker."


def test_each_delivery_reads_as_kind_action_subject_and_title_and_the_kind_filter_takes_an_action(
        client, world, alice, router, clock):
    hook = world.webhook(alice, router, "github")
    world.deliver(hook, *producers.github("issues.opened", hook["secret"]))
    clock.advance(1)
    world.deliver(hook, *producers.github("pull_request.opened", hook["secret"]))
    clock.advance(1)
    world.deliver(hook, *producers.github("issues.opened", hook["secret"], {
        "issue": {"number": 41, "title": "A title far longer than sixty characters, which the line cuts short"}}))
    sign_in(client, alice)

    def lines(query: str = "") -> list[str]:
        page = client.get(f"/board/webhooks/{hook['id']}/deliveries{query}")
        assert page.status_code == 200
        return [re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r'<td class="line">(.*?)</td>', page.text)]

    assert lines() == [
        "issues.opened · Codertocat/Hello-World#41 · A title far longer than sixty characters, which the line…",
        "pull_request.opened · Codertocat/Hello-World#2 · Update the README with new information.",
        "issues.opened · Codertocat/Hello-World#1 · Spelling error in the README file"]
    assert 'placeholder="e.g. issues or issues.opened"' in client.get(f"/board/webhooks/{hook['id']}/deliveries").text
    assert len(lines("?kind=issues.opened")) == 2 and len(lines("?kind=issues")) == 2
    assert lines("?kind=pull_request.opened") == [lines()[1]] and lines("?kind=issues.closed") == []
    webhooks = client.get("/board/webhooks").text
    assert "issues.opened · Codertocat/Hello-World#41" in text(webhooks), "the card's last delivery reads the same"


# -- 6. webhooks that can be told apart ----------------------------------------------------------------------

def test_look_alike_webhooks_show_a_name_their_last_delivery_and_failed_signature_checks(client, world, alice,
                                                                                         router, clock):
    first = world.webhook(alice, router, "github", name="home lab")
    clock.advance(1)
    second = world.webhook(alice, router, "github")
    assert first["name"] == "home lab" and second["name"] is None
    world.deliver(second, *producers.github("pull_request.opened", second["secret"]))
    for _ in range(2):
        raw, headers = producers.github("issues.opened", "a wrong secret of sixteen+")
        assert world.deliver(first, raw, headers).status_code == 401
    sign_in(client, alice)
    cards = re.findall(r'<li class="card webhook-card">(.*?)</li>', client.get("/board/webhooks").text, re.S)
    assert len(cards) == 2
    assert ">home lab</a>" in cards[0] and "github → triage" in cards[0]
    assert re.search(r'class="failed-checks"[^>]*><span class="bad">2</span> in the last day', cards[0])
    assert "none yet" in cards[0].split("Last delivery")[1]
    assert "name it" in cards[1] and "pull_request.opened · Codertocat/Hello-World#2" in text(cards[1])
    assert re.search(r'class="failed-checks"[^>]*>none in the last day', cards[1])
    assert post(client, f"/board/webhooks/{second['id']}/name", name="  office  ").status_code == 303
    assert rest(world, alice, "GET", f"/api/v1/webhooks/{second['id']}").json()["name"] == "office"
    assert post(client, f"/board/webhooks/{second['id']}/name", name="x" * 65).status_code == 400
    assert post(client, f"/board/webhooks/{second['id']}/name", name="").status_code == 303
    assert rest(world, alice, "GET", f"/api/v1/webhooks/{second['id']}").json()["name"] is None


def test_a_webhook_is_named_over_rest_through_its_models(world, alice, router):
    hook = world.webhook(alice, router, "github", name="fleet")
    path = f"/api/v1/webhooks/{hook['id']}"
    assert [w["name"] for w in rest(world, alice, "GET", "/api/v1/webhooks").json()["webhooks"]] == ["fleet"]
    renamed = rest(world, alice, "PATCH", path, name="fleet (nas01)")
    assert renamed.status_code == 200 and renamed.json()["name"] == "fleet (nas01)"
    assert rest(world, alice, "PATCH", path, name=None).json()["name"] is None
    typo = rest(world, alice, "PATCH", path, nam="x")
    assert typo.status_code == 400 and "unknown field nam, did you mean name?" in typo.json()["message"]
    for bad in ("", "x" * 65, "two\nlines", 7):
        assert rest(world, alice, "PATCH", path, name=bad).status_code == 400, bad
    assert world.client.patch(path, headers=router.auth, json={"name": "mine"}).status_code == 403
    bob = world.human("bob")
    assert rest(world, bob, "PATCH", path, name="bob's").status_code == 404
    made = world.client.post("/api/v1/webhooks", headers=alice.auth, json={
        "provider": "generic", "queue": "triage", "endpoint_id": router.id, "name": "x" * 65})
    assert made.status_code == 400 and "name" in made.json()["message"]


@pytest.mark.parametrize("release", ["release1", "release2"])
def test_the_migration_gives_older_webhooks_a_name_they_can_set(tmp_path, monkeypatch, release):
    fixture = ROOT / "tests" / "fixtures" / release
    facts = json.loads((fixture / f"{release}.json").read_text())
    path = tmp_path / "switchboard.db"
    shutil.copy2(fixture / f"{release}.db", path)
    conn = connect(str(path))
    old = [tuple(r) for r in conn.execute("SELECT id FROM webhooks ORDER BY id")]
    assert "name" not in [row[1] for row in conn.execute("PRAGMA table_info(webhooks)")]
    assert apply_schema(conn) == SCHEMA_VERSION
    assert [tuple(r) for r in conn.execute("SELECT id, name FROM webhooks ORDER BY id")] == [(i, None) for (i,) in old]
    conn.close()
    fresh = connect(str(tmp_path / "fresh.db"))
    apply_schema(fresh)
    migrated = sqlite3.connect(path)
    assert migrated.execute("PRAGMA table_info(webhooks)").fetchall() == [tuple(r) for r in fresh.execute(
        "PRAGMA table_info(webhooks)")], "the migrated table is the one a fresh file has"
    migrated.close()
    fresh.close()
    monkeypatch.setenv("SWITCHBOARD_SECRET_KEY", facts["secret_key_hex"])
    with TestClient(create_app(str(path), background=False)) as client:
        auth = {"Authorization": f"Bearer {facts['human_token']}"}
        hook_id = old[0][0]
        assert client.get(f"/api/v1/webhooks/{hook_id}", headers=auth).json()["name"] is None
        assert client.patch(f"/api/v1/webhooks/{hook_id}", headers=auth, json={"name": "kept"}).json()["name"] == "kept"


# -- 26.8: every Board form through the API's models: 4xx, never 500 ----------------------------------------

def test_unicode_digits_and_other_bad_fields_get_a_4xx_page_and_change_nothing(client, world, alice, router,
                                                                               db_path):
    hook = world.webhook(alice, router, "github")
    event_id = world.deliver(hook, *producers.github("issues.opened", hook["secret"])).json()["event_id"]
    sign_in(client, alice)
    before = snapshot(db_path)
    vend = post(client, "/board/endpoints/vend", name="w", queues="lane-s", default_lease_seconds="²")
    assert vend.status_code == 400 and "default_lease_seconds: Input should be a valid integer" in vend.text
    assert "Nothing was changed." in vend.text
    replay = post(client, f"/board/webhooks/{hook['id']}/replay", limit="²", apply="yes")
    assert replay.status_code == 400 and "limit: Input should be a valid integer" in replay.text
    for lease in ("٣٠٠", "1e3", "-60", "60.0", "9" * 30):
        assert post(client, "/board/endpoints/vend", name="w", queues="lane-s",
                    default_lease_seconds=lease).status_code == 400, lease
    assert snapshot(db_path) == before
    for query in ("/board/inbox/held?after=²5.td_00", f"/board/webhooks/{hook['id']}/deliveries?before=²5.ev_00",
                  "/board/queues?after=٣.td_0a"):
        assert client.get(query).status_code == 200, query
    held = world.push(alice, router, "triage", "target")
    token = csrf(client)
    fields = {
        f"/board/todos/{held['id']}/reroute": ("queue",),
        f"/board/todos/{held['id']}/cancel": ("reason",),
        f"/board/todos/{held['id']}/answer": ("answer",),
        f"/board/todos/{held['id']}/release": ("queue", "note", "trust_actor"),
        f"/board/webhooks/{hook['id']}/rules": ("rules", "do", "source", "event_id", "payload", "headers"),
        f"/board/webhooks/{hook['id']}/trusted-actors": ("mode", "kind", "names", "match"),
        f"/board/webhooks/{hook['id']}/routes": ("endpoint_id",),
        f"/board/webhooks/{hook['id']}/name": ("name",),
        f"/board/webhooks/{hook['id']}/replay": ("disposition", "kind", "since", "until", "limit"),
        f"/board/deliveries/{event_id}/replay": ("apply",),
        "/board/notify/add": ("kind", "url", "token", "ev_held"),
        "/board/endpoints/vend": ("name", "queues", "verbs", "default_lease_seconds"),
        f"/board/endpoints/{router.id}/revoke": ("confirm",),
    }
    for path, names in fields.items():
        for name in names:
            for value in ("²", "٣", "\x00", "x" * 5000, "-1", "NaN", "1e999", "{", " "):
                answer = post(client, path, token, **{name: value})
                assert answer.status_code < 500, (path, name, value, answer.text[:300])
    assert world.client.get("/api/v1/me", headers=router.auth).status_code == 200
