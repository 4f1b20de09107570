"""The subject answer names its todos and links them (issue 43): one issue with many deliveries answers a few KB,
not every todo with its delivery's whole body again; `subject show` prints each timeline line with its action,
sender, rule, queue and actor."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse

from conftest import ROOT, cli

from switchboard.models import SubjectAnswer

KEY = "github:acme/site#7"
DELIVERIES = 25


def _many_deliveries(world, alice) -> tuple[object, dict]:
    endpoint = world.endpoint(alice, ["triage"])
    hook = world.webhook(alice, endpoint, "github", "triage", trusted_actors={"allow_all": True})
    rules = world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth, json={
        "rules": [{"id": "every-edit", "expr": ".kind == \"issues\"", "action": {"queue": "triage"}}]})
    assert rules.status_code == 200, rules.text
    import producers

    for n in range(DELIVERIES):
        raw, headers = producers.github("issues.edited", hook["secret"], {
            "issue": {"number": 7, "title": "Spelling error", "body": f"edit {n}: " + "x" * 6000,
                      "html_url": "https://github.com/acme/site/issues/7", "pull_request": None},
            "repository": {"full_name": "acme/site"}, "sender": {"login": "alice"}})
        answer = world.deliver(hook, raw, headers)
        assert answer.status_code == 202 and answer.json()["disposition"] == "routed", answer.text
    return endpoint, hook


def test_one_issue_with_many_deliveries_answers_its_todos_named_and_linked(world, alice, client):
    _many_deliveries(world, alice)
    answer = client.get(f"/api/v1/subjects/{urllib.parse.quote(KEY, safe='')}", headers=alice.auth)
    assert answer.status_code == 200, answer.text
    subject = SubjectAnswer.model_validate(answer.json()).model_dump()
    assert len(subject["todos"]) == DELIVERIES
    # What it was: every todo whole, as the list answers them (each with its delivery's body).
    whole = client.get("/api/v1/todos", headers=alice.auth, params={"subject": KEY, "limit": 200})
    before = len(json.dumps(whole.json()["todos"]))
    after = len(json.dumps(answer.json()["todos"]))
    assert before > 8 * after, (before, after)
    assert len(answer.content) < 40_000, len(answer.content)
    for todo in answer.json()["todos"]:
        assert not {"payload", "work_order", "work_item", "trace", "result"} & set(todo), todo
        assert todo["link"] == f"/api/v1/todos/{todo['id']}" and todo["title"] and todo["queue"] == "triage"
        assert client.get(todo["link"], headers=alice.auth).json()["payload"]["issue"]["body"].startswith("edit")
    deliveries = [e for e in answer.json()["timeline"] if e["type"] == "delivery"]
    assert len(deliveries) == DELIVERIES
    assert {(e["action"], e["sender"], e["rule_id"], e["queue"]) for e in deliveries} == {
        ("edited", "alice", "every-edit", "triage")}


def test_subject_show_prints_action_sender_rule_queue_and_actor_on_each_line(world, alice, client, db_path):
    _many_deliveries(world, alice)
    done = subprocess.run([sys.executable, str(ROOT / "switchboard.py"), "subject", "show", KEY, "--db", db_path],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("AT "))
    assert header.split() == ["AT", "TYPE", "TODO_ID", "QUEUE", "KIND", "ACTION", "SENDER", "RULE", "ACTOR", "WHAT"]
    delivery = next(line for line in lines if " delivery " in line)
    assert delivery.split()[3:8] == ["triage", "issues", "edited", "alice", "every-edit"], delivery
    transition = next(line for line in lines if " transition " in line)
    assert transition.split()[3] == "triage" and "system" in transition.split() and "new -> pending" in transition
    # --json keeps the answer's shape.
    code, shown = cli(db_path, "subject", "show", KEY)
    assert code == 0 and len(shown["todos"]) == DELIVERIES and "payload" not in shown["todos"][0]
