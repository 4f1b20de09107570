"""Routing rules: save-time validation, the sandboxed evaluator, fail-closed faults, exclusive lanes,
once-only work orders, and the quarantine a human releases."""

from __future__ import annotations

import importlib.util
import json
import threading

import producers
import pytest
from helpers import connect_db

import switchboard.evaluator as evaluator_module
from switchboard.evaluator import (
    EVAL_MEMORY_BYTES,
    EVAL_PROGRAMS_PER_CHILD,
    Evaluator,
    EvaluatorUnavailable,
    _Child,
    _jq_directory,
)
from switchboard.store.deliveries import WORK_ORDER_AUTHORITY, once_key


@pytest.fixture
def router(world, alice):
    return world.endpoint(alice, ["hold", "triage"], name="router", verbs=["all"])


@pytest.fixture
def lane_s(world, alice):
    return world.endpoint(alice, ["lane-s"], name="lane-s")


@pytest.fixture
def hook(world, alice, router, lane_s):
    made = world.webhook(alice, router, "github", "triage")
    assert world.client.post(f"/api/v1/webhooks/{made['id']}/routes", headers=alice.auth,
                             json={"endpoint_id": lane_s.id}).status_code == 201
    return made


def put_rules(world, human, hook, document):
    return world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=human.auth, json=document)


def deliver(world, hook, fixture="issues.opened", patch=None):
    raw, headers = producers.github(fixture, hook["secret"], patch)
    return world.deliver(hook, raw, headers)


LANE_S = {"queue": "lane-s", "exclusive": True, "once": True, "work_order": True}
SIZE_S = '.issue != null and (.issue.labels | index("size/S")) != null'


def test_rules_route_to_a_lane_with_a_work_order(world, alice, hook, lane_s):
    saved = put_rules(world, alice, hook, {"rules": [{"id": "small", "name": "Small issues", "expr": SIZE_S,
                                                      "action": LANE_S}], "params": {"x": 1}})
    assert saved.status_code == 200, saved.text
    outcome = deliver(world, hook, "issues.labeled", {"issue": {"labels": [{"name": "size/S"}]}}).json()
    assert outcome["disposition"] == "routed" and outcome["created"] == 1
    assert outcome["todos"][0]["endpoint_id"] == lane_s.id and outcome["todos"][0]["queue"] == "lane-s"
    assert "trace" not in outcome, "the routing trace is never echoed to the producer"
    todo = world.client.get(f"/api/v1/todos/{outcome['todos'][0]['id']}", headers=alice.auth).json()
    order = todo["work_order"]
    assert order == {
        "version": 1, "lane": "lane-s", "source": "github", "webhook_id": hook["id"], "trust_mode": "signed",
        "verified": True, "authorized_by": {"stage": "rule", "rule_id": "small", "rule_name": "Small issues"},
        "subject": {"type": "issue", "provider": "github", "repo": "Codertocat/Hello-World", "number": 1,
                    "url": "https://github.com/Codertocat/Hello-World/issues/1",
                    "title": "Spelling error in the README file", "author": "Codertocat", "sender": "Codertocat",
                    "action": "labeled", "labels": ["size/S"], "event_type": "issues", "state": "open",
                    "label": "bug", "body_size": order["subject"]["body_size"]},
        "author_trusted": None, "authority": WORK_ORDER_AUTHORITY}
    assert order["authority"].startswith("semi-trusted task: verified provenance made this eligible")
    assert todo["trace"]["stage"] == "rule" and todo["trace"]["rule_id"] == "small"
    assert todo["trace"]["once_key"] == once_key("github:Codertocat/Hello-World#1", "lane-s")
    event = world.client.get(f"/api/v1/events/{outcome['event_id']}", headers=alice.auth).json()
    assert event["trace"]["rule_index"] == 0


def test_once_repeats_across_label_events_and_routes_again_on_resize(world, alice, router, hook, lane_s):
    lane_m = world.endpoint(alice, ["lane-m"], name="lane-m")
    world.client.post(f"/api/v1/webhooks/{hook['id']}/routes", headers=alice.auth, json={"endpoint_id": lane_m.id})
    put_rules(world, alice, hook, {"rules": [
        {"id": "s", "expr": SIZE_S, "action": LANE_S},
        {"id": "m", "expr": '.issue != null and (.issue.labels | index("size/M")) != null',
         "action": {**LANE_S, "queue": "lane-m"}}]})
    first = deliver(world, hook, "issues.labeled", {"issue": {"labels": [{"name": "size/S"}]}}).json()
    again = deliver(world, hook, "issues.labeled", {"issue": {"labels": [{"name": "size/S"}, {"name": "bug"}]}}).json()
    assert first["created"] == 1 and again == {**again, "disposition": "repeat", "repeat": True, "created": 0}
    assert again["todos"] == []
    resized = deliver(world, hook, "issues.labeled", {"issue": {"labels": [{"name": "size/M"}]}}).json()
    assert resized["disposition"] == "routed" and resized["todos"][0]["endpoint_id"] == lane_m.id
    conn = connect_db(world.db.path)
    assert conn.execute("SELECT count(*) FROM routing_once").fetchone()[0] == 2
    assert conn.execute("SELECT disposition FROM events WHERE id = ?", (again["event_id"],)).fetchone()[0] == "repeat"


def test_exclusive_always_picks_the_same_first_target(world, alice, router, hook, lane_s, clock):
    twin = world.endpoint(alice, ["lane-s"], name="lane-s-twin")
    clock.advance(1)
    world.client.post(f"/api/v1/webhooks/{hook['id']}/routes", headers=alice.auth, json={"endpoint_id": twin.id})
    put_rules(world, alice, hook, {"rules": [{"id": "s", "expr": "true",
                                              "action": {"queue": "lane-s", "exclusive": True}}]})
    winners = {deliver(world, hook, "issues.opened", {"issue": {"number": n}}).json()["todos"][0]["endpoint_id"]
               for n in range(2, 8)}
    assert winners == {lane_s.id}, "routes are ordered by grant time, so the first-routed lane endpoint wins"
    put_rules(world, alice, hook, {"rules": [{"id": "s", "expr": "true", "action": {"queue": "lane-s"}}]})
    fanned = deliver(world, hook, "issues.opened", {"issue": {"number": 99}}).json()
    assert {t["endpoint_id"] for t in fanned["todos"]} == {lane_s.id, twin.id}, "without exclusive, every target"


def test_no_match_applies_the_default_and_no_default_means_the_webhook_queue(world, alice, router, hook):
    put_rules(world, alice, hook, {"rules": [{"id": "never", "expr": "false", "action": {"drop": True}}],
                                   "default_action": {"queue": "hold"}})
    held = deliver(world, hook).json()
    assert held["todos"][0]["queue"] == "hold" and held["todos"][0]["endpoint_id"] == router.id
    put_rules(world, alice, hook, {"rules": [{"id": "never", "expr": "empty", "action": {"drop": True}}]})
    plain = deliver(world, hook, patch={"issue": {"number": 3}}).json()
    assert plain["todos"][0]["queue"] == "triage"
    put_rules(world, alice, hook, {"rules": [{"id": "drop", "expr": "null, true", "action": {"drop": True}},
                                             {"id": "all", "expr": ".kind", "action": {"drop": True}}],
                                   "default_action": {"quarantine": True}})
    dropped = deliver(world, hook, patch={"issue": {"number": 4}}).json()
    assert dropped == {**dropped, "disposition": "dropped", "dropped": True, "created": 0}
    trace = world.client.get(f"/api/v1/events/{dropped['event_id']}", headers=alice.auth).json()["trace"]
    assert trace["rule_id"] == "all", "only the first output counts: null is no match"


def test_a_fault_fails_closed_into_quarantine(world, alice, router, hook, lane_s):
    put_rules(world, alice, hook, {"rules": [
        {"id": "picky", "expr": 'if .payload.issue.number == 77 then error("no sevens") else false end',
         "action": LANE_S}], "default_action": {"queue": "triage"}})
    outcome = deliver(world, hook, patch={"issue": {"number": 77}}).json()
    assert outcome["disposition"] == "quarantined" and outcome["held"] is True
    (held,) = outcome["todos"]
    assert held["queue"] == "quarantine" and held["endpoint_id"] == router.id
    todo = world.client.get(f"/api/v1/todos/{held['id']}", headers=alice.auth).json()
    assert todo["state"] == "quarantined" and todo["state_reason"] == "rule_fault"
    assert todo["trace"]["stage"] == "fault" and todo["trace"]["faults"][0]["rule_id"] == "picky"
    assert todo["trace"]["faults"][0]["cause"] == "error" and "no sevens" in todo["trace"]["faults"][0]["detail"]
    assert world.claim(router) == {"empty": True}, "no agent can claim a held item"
    assert world.client.get("/api/v1/todos", headers=router.auth).json()["todos"] == []


def test_runaway_rule_is_quarantined_within_budget_while_the_server_answers(world, alice, router, hook):
    put_rules(world, alice, hook, {"rules": [
        {"id": "runaway", "expr": 'if .payload.issue.number == 13 then [limit(1e9; repeat(1))] | length > 0'
                                  ' else false end', "action": {"drop": True}}]})
    answers = {}

    def stuck():
        answers["stuck"] = deliver(world, hook, patch={"issue": {"number": 13}})

    worker = threading.Thread(target=stuck)
    worker.start()
    healthy = [world.client.get("/healthz").status_code for _ in range(3)]
    normal = deliver(world, hook, patch={"issue": {"number": 14}})
    worker.join(timeout=30)
    assert healthy == [200, 200, 200] and normal.status_code == 202
    assert normal.json()["disposition"] == "routed", "one stuck delivery does not stall the others"
    outcome = answers["stuck"].json()
    assert outcome["disposition"] == "quarantined"
    trace = world.client.get(f"/api/v1/events/{outcome['event_id']}", headers=alice.auth).json()["trace"]
    assert trace["stage"] == "fault" and trace["cause"] in ("timeout", "budget_exhausted")


def test_params_are_kept_when_omitted_and_cleared_by_an_empty_object(world, alice, hook):
    rules = [{"id": "trusted", "expr": '.issue.author as $a | ($params.trusted // []) | index($a) != null',
              "action": {"drop": True}}]
    first = put_rules(world, alice, hook, {"rules": rules, "params": {"trusted": ["Codertocat"]}}).json()
    assert first["params"] == {"trusted": ["Codertocat"]}
    kept = put_rules(world, alice, hook, {"rules": rules}).json()
    assert kept["params"] == {"trusted": ["Codertocat"]}
    assert world.client.get(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth).json()["params"] == \
        {"trusted": ["Codertocat"]}
    assert deliver(world, hook).json()["disposition"] == "dropped"
    cleared = put_rules(world, alice, hook, {"rules": rules, "params": {}}).json()
    assert cleared["params"] == {}
    assert deliver(world, hook, patch={"issue": {"number": 2}}).json()["disposition"] == "routed"


@pytest.mark.parametrize("expr, fragment", [
    ("env.HOME", "env"), ("$ENV.PATH", "$ENV"), ("input", "input"), ("[inputs]", "inputs"), ("now > 0", "now"),
    ('"\\(env)"', "env"), ("debug", "debug"), ('halt_error("x")', "halt_error"), ("$__loc__", "$__loc__"),
    ('import "a" as a; .', "import"), ("input_filename", "input_filename"), ("mktime", "mktime")])
def test_forbidden_identifiers_are_refused_at_save_naming_the_rule(world, alice, hook, expr, fragment):
    r = put_rules(world, alice, hook, {"rules": [{"id": "ok", "expr": "true", "action": {"drop": True}},
                                                 {"id": "sneaky", "expr": expr, "action": {"drop": True}}]})
    assert r.status_code == 400 and r.json()["error"] == "invalid_argument"
    assert "rules[1] (id 'sneaky')" in r.json()["message"] and fragment in r.json()["message"]
    assert world.client.get(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth).json()["rules"] == []


def test_forbidden_words_inside_strings_and_field_names_are_fine(world, alice, hook):
    r = put_rules(world, alice, hook, {"rules": [
        {"id": "strings", "expr": '.payload.env == "env" or .headers["x-input"] == "now"', "action": {"drop": True}}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("document, fragment", [
    ({"rules": [{"id": f"r{i}", "expr": "true", "action": {"drop": True}} for i in range(33)]}, "at most 32"),
    ({"rules": [{"id": "a", "expr": "true", "action": {"drop": True}},
                {"id": "a", "expr": "false", "action": {"drop": True}}]}, "rules[1] (id 'a'): id is repeated"),
    ({"rules": [{"id": "bad id", "expr": "true", "action": {"drop": True}}]}, "rules.0.id"),
    ({"rules": [{"id": "e", "expr": "  ", "action": {"drop": True}}]}, "rules[0] (id 'e'): expr"),
    ({"rules": [{"id": "big", "expr": "true or " * 600 + "true", "action": {"drop": True}}]}, "rules[0] (id 'big')"),
    ({"rules": [{"id": "parse", "expr": "if . then", "action": {"drop": True}}]}, "rules[0] (id 'parse')"),
    ({"rules": [{"id": "q", "expr": "true", "action": {"queue": "nobody-scoped"}}]}, "no target endpoint receives"),
    ({"rules": [{"id": "x", "expr": "true", "action": {"queue": "lane-x", "exclusive": True}}]}, "exclusive"),
    ({"rules": [{"id": "z", "expr": "true", "action": {"queue": "quarantine"}}]}, "reserved"),
    ({"rules": [{"id": "n", "expr": "true", "action": {"queue": "lane-s", "endpoints": ["ep_0000"]}}]},
     "not a target"),
    ({"rules": [], "default_action": {"queue": "nobody-scoped"}}, "default_action"),
    ({"rules": [], "params": {"nested": {"a": 1}}}, "params.nested"),
    ({"rules": [], "params": {"mixed": ["a", 1]}}, "params.mixed"),
    ({"rules": [], "params": {"big": "x" * 17000}}, "params"),
    ({"rules": [{"id": "a", "expr": "true", "action": {"drop": True, "queue": "triage"}}]}, "rules.0.action"),
    ({"rules": [], "extra": 1}, "extra"),
])
def test_bad_rule_documents_are_refused_and_change_nothing(world, alice, hook, document, fragment):
    before = world.client.get(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth).json()
    r = put_rules(world, alice, hook, document)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == "invalid_argument" and fragment in r.json()["message"]
    assert world.client.get(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth).json() == before


def test_dry_run_over_stored_deliveries_refuses_a_faulting_rule(world, alice, hook):
    outcome = deliver(world, hook).json()
    r = put_rules(world, alice, hook, {"rules": [
        {"id": "fine", "expr": ".kind == \"push\"", "action": {"drop": True}},
        {"id": "fragile", "expr": ".payload.issue.title | test(\"[\")", "action": {"drop": True}}]})
    assert r.status_code == 400
    assert "rules[1] (id 'fragile')" in r.json()["message"] and outcome["event_id"] in r.json()["message"]
    slow = put_rules(world, alice, hook, {"rules": [
        {"id": "slow", "expr": "[limit(1e9; repeat(1))] | length > 0", "action": {"drop": True}}]})
    assert slow.status_code == 400 and "rules[0] (id 'slow')" in slow.json()["message"]


def test_rules_test_is_a_dry_run_that_stores_nothing(world, alice, hook, lane_s, db_path):
    put_rules(world, alice, hook, {"rules": [{"id": "s", "expr": SIZE_S, "action": LANE_S}]})
    before = connect_db(db_path).execute("SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM todos),"
                                              " (SELECT count(*) FROM routing_once)").fetchone()
    payload = producers.deep_merge(producers.json.loads((producers.FIXTURES / "github" / "issues.labeled.json")
                                                         .read_text()), {"issue": {"labels": [{"name": "size/S"}]}})
    r = world.client.post(f"/api/v1/webhooks/{hook['id']}/rules/test", headers=alice.auth,
                          json={"payload": payload, "headers": {"X-GitHub-Event": "issues"}})
    assert r.status_code == 200, r.text
    result = r.json()
    assert result["decision"] == {"drop": False, "queue": "lane-s", "endpoints": [lane_s.id],
                                  "disposition": "routed", "fault": None}
    assert result["once_key"] == once_key("github:Codertocat/Hello-World#1", "lane-s")
    assert result["work_order"]["lane"] == "lane-s" and result["envelope"]["verified"] is True
    assert result["trace"]["rule_id"] == "s"
    candidate = world.client.post(f"/api/v1/webhooks/{hook['id']}/rules/test", headers=alice.auth, json={
        "payload": payload, "headers": {"X-GitHub-Event": "issues"}, "verified": False,
        "rules": [{"id": "v", "expr": ".verified", "action": {"drop": True}}], "default_action": {"queue": "hold"}})
    assert candidate.json()["decision"]["queue"] == "hold" and candidate.json()["envelope"]["verified"] is False
    stored = deliver(world, hook, "issues.opened").json()
    by_event = world.client.post(f"/api/v1/webhooks/{hook['id']}/rules/test", headers=alice.auth,
                                 json={"event_id": stored["event_id"]}).json()
    assert by_event["decision"]["disposition"] == "routed" and by_event["decision"]["queue"] == "triage"
    faulty = world.client.post(f"/api/v1/webhooks/{hook['id']}/rules/test", headers=alice.auth, json={
        "payload": {}, "rules": [{"id": "boom", "expr": "error(\"x\")", "action": {"drop": True}}]}).json()
    assert faulty["decision"]["disposition"] == "quarantined" and faulty["decision"]["fault"]["rule_id"] == "boom"
    refused = world.client.post(f"/api/v1/webhooks/{hook['id']}/rules/test", headers=alice.auth, json={
        "payload": {}, "rules": [{"id": "bad", "expr": "env", "action": {"drop": True}}]})
    assert refused.status_code == 400
    after = connect_db(db_path).execute("SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM todos),"
                                             " (SELECT count(*) FROM routing_once)").fetchone()
    assert after[0] == before[0] + 1 and after[2] == before[2], "only the one real delivery was stored"


def test_release_reevaluates_with_release_set(world, alice, router, hook, lane_s):
    put_rules(world, alice, hook, {"rules": [
        {"id": "gate", "expr": ".release == null", "action": {"quarantine": True}},
        {"id": "go", "expr": "true", "action": LANE_S}]})
    held = deliver(world, hook).json()
    assert held["disposition"] == "quarantined"
    todo_id = held["todos"][0]["id"]
    todo = world.client.get(f"/api/v1/todos/{todo_id}", headers=alice.auth).json()
    assert todo["state_reason"] == "rule"
    assert world.client.post(f"/api/v1/todos/{todo_id}/release-quarantine", headers=router.auth,
                             json={}).status_code == 403
    released = world.client.post(f"/api/v1/todos/{todo_id}/release-quarantine", headers=alice.auth, json={})
    assert released.status_code == 200, released.text
    body = released.json()
    assert body["state"] == "pending" and body["queue"] == "lane-s" and body["endpoint_id"] == lane_s.id
    assert body["work_order"]["lane"] == "lane-s"
    assert world.claim(lane_s)["todo"]["id"] == todo_id
    history = world.client.get(f"/api/v1/todos/{todo_id}", headers=alice.auth).json()["history"]
    assert history[-2]["from"] == "quarantined" and history[-2]["evidence"]["release"]["by"] == f"human:{alice.id}"


def test_release_to_a_named_queue_and_discard(world, alice, router, hook, lane_s):
    put_rules(world, alice, hook, {"rules": [{"id": "hold-all", "expr": "true", "action": {"quarantine": True}}]})
    first = deliver(world, hook).json()["todos"][0]["id"]
    second = deliver(world, hook, patch={"issue": {"number": 2}}).json()["todos"][0]["id"]
    again = world.client.post(f"/api/v1/todos/{first}/release-quarantine", headers=alice.auth, json={})
    assert again.status_code == 409, "the rules hold it again, and nothing changed"
    named = world.client.post(f"/api/v1/todos/{first}/release-quarantine", headers=alice.auth,
                              json={"queue": "lane-s"}).json()
    assert named["queue"] == "lane-s" and named["endpoint_id"] == lane_s.id and named["state"] == "pending"
    nowhere = world.client.post(f"/api/v1/todos/{second}/release-quarantine", headers=alice.auth,
                                json={"queue": "lane-z"})
    assert nowhere.status_code == 400
    discarded = world.act(alice, second, "discard", note="spam").json()
    assert discarded["state"] == "done" and discarded["outcome"] == "discarded"


def test_held_items_expire_after_30_days(world, alice, hook, clock):
    put_rules(world, alice, hook, {"rules": [{"id": "hold-all", "expr": "true", "action": {"quarantine": True}}]})
    todo_id = deliver(world, hook).json()["todos"][0]["id"]
    clock.advance(29 * 86400)
    assert world.tick()["expired"] == 0
    clock.advance(86400)
    assert world.tick()["expired"] == 1
    todo = world.client.get(f"/api/v1/todos/{todo_id}", headers=alice.auth).json()
    assert todo["state"] == "done" and todo["outcome"] == "discarded" and todo["state_reason"] == "expired"


def test_no_target_holds_the_delivery(world, alice, router, hook, lane_s):
    put_rules(world, alice, hook, {"rules": [{"id": "s", "expr": "true", "action": LANE_S}]})
    world.client.post(f"/api/v1/endpoints/{lane_s.id}/revoke", headers=alice.auth)
    outcome = deliver(world, hook).json()
    assert outcome["disposition"] == "quarantined"
    todo = world.client.get(f"/api/v1/todos/{outcome['todos'][0]['id']}", headers=alice.auth).json()
    assert todo["state_reason"] == "no_target" and todo["trace"]["hold"] == "no_target"


def test_a_webhook_without_rules_never_touches_the_evaluator(world, alice, hook, app):
    assert deliver(world, hook).status_code == 202
    assert app.state.evaluator._count == 0


def test_an_evaluator_that_cannot_run_answers_503_and_stores_nothing(world, alice, hook, app, db_path, monkeypatch):
    put_rules(world, alice, hook, {"rules": [{"id": "s", "expr": "true", "action": {"queue": "triage"}}]})
    app.state.evaluator.close()
    monkeypatch.setattr(evaluator_module, "EVALUATOR_CHILD", "import sys; sys.exit(3)")
    before = connect_db(db_path).execute("SELECT count(*) FROM events").fetchone()[0]
    r = deliver(world, hook)
    assert r.status_code == 503 and r.json()["error"] == "unavailable"
    assert connect_db(db_path).execute("SELECT count(*) FROM events").fetchone()[0] == before


def test_rules_over_the_cli(db_path, tmp_path):
    from conftest import cli
    cli(db_path, "human", "add", "alice")
    _, router = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "router", "--queues", "triage,hold",
                    "--verbs", "all")
    _, made = cli(db_path, "webhook", "create", "--endpoint", router["id"], "--provider", "github", "--queue", "triage",
                  "--allow-all")
    pack = tmp_path / "pack.json"
    pack.write_text(json.dumps({"rules": [{"id": "hold-bugs", "expr": '.issue.labels | index("bug") != null',
                                              "action": {"queue": "hold"}}]}))
    params = tmp_path / "params.json"
    params.write_text('{"who": ["Codertocat"]}')
    code, saved = cli(db_path, "rules", "set", made["id"], "--file", str(pack), "--params", str(params))
    assert code == 0 and saved["params"] == {"who": ["Codertocat"]} and saved["rules"][0]["id"] == "hold-bugs"
    payload = tmp_path / "payload.json"
    payload.write_text((producers.FIXTURES / "github" / "issues.opened.json").read_text())
    code, tested = cli(db_path, "rules", "test", made["id"], "--payload", str(payload), "--header",
                       "X-GitHub-Event: issues")
    assert code == 0 and tested["decision"]["queue"] == "hold"
    code, unverified = cli(db_path, "rules", "test", made["id"], "--payload", str(payload), "--unverified")
    assert unverified["envelope"]["verified"] is False
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rules": [{"id": "x", "expr": "input", "action": {"drop": True}}]}))
    code, refused = cli(db_path, "rules", "set", made["id"], "--file", str(bad))
    assert code == 1 and refused["error"] == "invalid_argument"
    code, shown = cli(db_path, "rules", "get", made["id"])
    assert shown["rules"][0]["id"] == "hold-bugs"


def test_reroute_of_a_delivery_chooses_among_the_webhooks_targets(world, alice, router, hook, lane_s):
    bystander = world.endpoint(alice, ["lane-m"], name="bystander")
    lane_m = world.endpoint(alice, ["lane-m"], name="lane-m")
    world.client.post(f"/api/v1/webhooks/{hook['id']}/routes", headers=alice.auth, json={"endpoint_id": lane_m.id})
    todo_id = deliver(world, hook).json()["todos"][0]["id"]
    moved = world.act(alice, todo_id, "reroute", queue="lane-m").json()
    assert moved["endpoint_id"] == lane_m.id, "a webhook target, not the human's older endpoint"
    assert bystander.id != lane_m.id


def test_compiling_a_rule_set_is_not_charged_to_the_evaluation_budget():
    """A child's first use of a rule set compiles it in a round trip of its own: a large set that takes longer to
    compile than the budget allows an evaluation (here 20 rules of 4,000 definitions: 50-150 ms against 30 ms)
    still evaluates, and is not held as a timeout. Evaluating keeps its budget."""
    evaluator = Evaluator(size=1, budget=0.03)
    slow_to_compile = [" ".join(f"def f{i}: {i};" for i in range(4000)) + f" .n == {n}" for n in range(20)]
    document = json.dumps({"n": 7}).encode()
    try:
        assert evaluator.run(slow_to_compile, {}, document) == {"match": 7}
        assert evaluator.run(slow_to_compile, {}, document) == {"match": 7}, "and again, compiled already"
        assert evaluator.run(["(.n | until(false; .))"], {}, document)["fault"] == "timeout"
    finally:
        evaluator.close()


def test_a_child_that_forgot_its_programs_loads_a_rule_set_again():
    """A child keeps EVAL_PROGRAMS_PER_CHILD compiled rule sets, then forgets them all at once; the pool forgets its
    list of them at the same moment, so a rule set from before is compiled again, never asked for by key alone."""
    evaluator = Evaluator(size=1)
    document = json.dumps({"n": 7}).encode()
    try:
        for n in range(EVAL_PROGRAMS_PER_CHILD + 3):
            assert evaluator.run([f".n == {n}"], {}, document) == ({"match": 0} if n == 7 else {"none": True}), n
        for n in (7, 8, 0):
            assert evaluator.run([f".n == {n}"], {}, document) == ({"match": 0} if n == 7 else {"none": True}), n
    finally:
        evaluator.close()


def test_an_evaluator_child_is_isolated_capped_and_runs_no_site_hooks():
    """What the docs promise of the sandbox, read from the running child: `python -I -S`, an empty environment,
    the address-space cap; and it still evaluates, with jq found through the one path it is given."""
    evaluator = Evaluator(size=1)
    try:
        assert evaluator.run(['.n == 7'], {}, b'{"n": 7}') == {"match": 0}
        (child,) = evaluator._idle
        pid = child.proc.pid
        arguments = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        assert arguments[1:4] == [b"-I", b"-S", b"-c"]
        assert open(f"/proc/{pid}/environ", "rb").read() == b""
        (address_space,) = [line.split()[3:5] for line in open(f"/proc/{pid}/limits") if line.startswith("Max address")]
        assert address_space == [str(EVAL_MEMORY_BYTES)] * 2
    finally:
        evaluator.close()


def test_a_rule_set_that_compiled_cleanly_is_not_compiled_again():
    """Saves, dry runs and replays validate the same rule set over and over: a program list that compiled cleanly is
    remembered by its text and params, while a changed list, other params, or a list with an error go to the child
    every time."""
    evaluator = Evaluator(size=1)
    compiles = []
    call = evaluator._ask_alone

    def counting(header, *args, **kwargs):
        if header["op"] == "compile":
            compiles.append(header["programs"])
        return call(header, *args, **kwargs)

    evaluator._ask_alone = counting
    try:
        good, bad = [".n == 1", ".n == 2"], [".n == 1", ".n =="]
        assert evaluator.compile_errors(good, {}) == []
        assert evaluator.compile_errors(good, {}) == []
        assert len(compiles) == 1
        assert evaluator.compile_errors(good, {"x": 1}) == []
        assert evaluator.compile_errors(good + [".n == 3"], {}) == []
        assert len(compiles) == 3
        for _ in range(2):
            (error,) = evaluator.compile_errors(bad, {})
            assert error["index"] == 1
        assert len(compiles) == 5
    finally:
        evaluator.close()


def test_without_jq_installed_no_child_starts_and_nothing_is_imported_from_the_working_directory(monkeypatch):
    """The child's one added path is jq's directory; when jq cannot be found there is no child (never an empty
    path, which would import from the working directory)."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "jq" else real_find_spec(name, *rest))
    _jq_directory.cache_clear()
    try:
        with pytest.raises(EvaluatorUnavailable, match="jq"):
            _Child()
    finally:
        _jq_directory.cache_clear()
