"""The trust gate: a forge or cairn webhook's trusted actors are checked before any rule runs, `.actor` tells
rules the verdict, untrusted deliveries are held for their human, and a human can trust the actor and release."""

from __future__ import annotations

import producers
import pytest

from switchboard.migrations import MIGRATIONS


@pytest.fixture
def owner(world, alice):
    return world.endpoint(alice, ["triage", "lane-s"], name="router")


def issue_opened(secret: str, author: str, sender: str) -> tuple[bytes, dict]:
    return producers.github("issues.opened", secret, {"issue": {"user": {"login": author}},
                                                     "sender": {"login": sender}})


def comment_on(secret: str, thread_author: str, commenter: str) -> tuple[bytes, dict]:
    return producers.github("issue_comment.created", secret, {"issue": {"user": {"login": thread_author}},
                                                             "comment": {"user": {"login": commenter}},
                                                             "sender": {"login": commenter}})


def envelope_of(world, human, outcome: dict) -> dict:
    return world.client.get(f"/api/v1/events/{outcome['event_id']}", headers=human.auth).json()["envelope"]


def test_a_new_forge_webhook_without_a_list_holds_everything_and_says_so(world, alice, owner):
    hook = world.webhook(alice, owner, "github", trusted_actors=None)
    assert hook["trusted_actors"] == {"logins": [], "match": "sender"} and "held" in hook["warning"]
    outcome = world.deliver(hook, *issue_opened(hook["secret"], "alice", "alice")).json()
    assert outcome["disposition"] == "quarantined" and outcome["held"] is True and outcome["created"] == 1
    todo = world.client.get(f"/api/v1/todos/{outcome['todos'][0]['id']}", headers=alice.auth).json()
    assert todo["state"] == "quarantined" and todo["state_reason"] == "untrusted_actor"
    assert todo["trace"]["stage"] == "trust_gate" and todo["trace"]["cause"] == "untrusted_actor"
    raw, headers = issue_opened(hook["secret"], "alice", "alice")
    first = world.deliver(hook, raw, headers).json()
    again = world.deliver(hook, raw, headers).json()
    assert again["duplicate"] is True and again["event_id"] == first["event_id"] and again["created"] == 0


def test_sender_match_is_ascii_case_insensitive_and_the_untrusted_are_held(world, alice, owner):
    hook = world.webhook(alice, owner, "github", trusted_actors={"logins": ["Alice"]})
    assert world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth, json={
        "rules": [{"id": "all", "expr": "true", "action": {"queue": "lane-s"}}]}).status_code == 200
    trusted = world.deliver(hook, *issue_opened(hook["secret"], "mallory", "ALICE")).json()
    assert trusted["disposition"] == "routed" and trusted["todos"][0]["queue"] == "lane-s"
    actor = envelope_of(world, alice, trusted)["actor"]
    assert actor == {"sender": "ALICE", "author": "mallory", "sender_trusted": True, "author_trusted": False,
                     "trusted": True, "via_connection": None}
    outsider = world.deliver(hook, *issue_opened(hook["secret"], "alice", "mallory")).json()
    assert outsider["disposition"] == "quarantined"
    event = world.client.get(f"/api/v1/events/{outsider['event_id']}", headers=alice.auth).json()
    # The gate runs after the rules: what they would have done is kept under `rules`.
    assert event["trace"]["stage"] == "trust_gate" and event["trace"]["rules"]["rule_id"] == "all"
    # Non-ASCII letters do not fold: "ALİCE" is not "alice".
    lookalike = world.deliver(hook, *issue_opened(hook["secret"], "alice", "ALİCE")).json()
    assert lookalike["disposition"] == "quarantined"


def test_author_match_needs_the_thread_author_trusted_too(world, alice, owner):
    hook = world.webhook(alice, owner, "github", trusted_actors={"logins": ["maintainer"], "match": "author"})
    ours = world.deliver(hook, *comment_on(hook["secret"], "maintainer", "maintainer")).json()
    assert ours["disposition"] == "routed"
    theirs = world.deliver(hook, *comment_on(hook["secret"], "outsider", "maintainer")).json()
    assert theirs["disposition"] == "quarantined", "a maintainer's comment on an outsider's issue is not trusted"
    actor = envelope_of(world, alice, theirs)["actor"]
    assert actor["author"] == "maintainer" and actor["author_trusted"] is False and actor["sender_trusted"] is True


def test_both_needs_sender_and_author(world, alice, owner):
    hook = world.webhook(alice, owner, "github", trusted_actors={"logins": ["alice", "bot"], "match": "both"})
    assert world.deliver(hook, *issue_opened(hook["secret"], "alice", "bot")).json()["disposition"] == "routed"
    held = world.deliver(hook, *issue_opened(hook["secret"], "alice", "stranger")).json()
    assert held["disposition"] == "quarantined"
    held = world.deliver(hook, *issue_opened(hook["secret"], "stranger", "alice")).json()
    assert held["disposition"] == "quarantined"


def test_cairn_actor_ids_compare_exactly(world, alice, owner, clock):
    hook = world.webhook(alice, owner, "cairn", trusted_actors={"actor_ids": ["agent-7"]})
    raw, headers = producers.cairn(hook["secret"], {"data": {"actor_id": "agent-7"}}, created_at=clock.ms / 1000)
    assert world.deliver(hook, raw, headers).json()["disposition"] == "routed"
    raw, headers = producers.cairn(hook["secret"], {"event_id": "e-2", "data": {"actor_id": "Agent-7"}},
                                   created_at=clock.ms / 1000)
    outcome = world.deliver(hook, raw, headers).json()
    assert outcome["disposition"] == "quarantined"
    assert envelope_of(world, alice, outcome)["actor"]["sender_trusted"] is False


def test_allow_all_trusts_with_null_flags_and_a_wrong_type_names_nobody(world, alice, owner):
    hook = world.webhook(alice, owner, "github", trusted_actors={"allow_all": True})
    outcome = world.deliver(hook, *producers.github("issues.opened", hook["secret"], {"sender": {"login": 7}})).json()
    assert outcome["disposition"] == "routed"
    actor = envelope_of(world, alice, outcome)["actor"]
    assert actor["sender"] is None and actor["sender_trusted"] is None and actor["trusted"] is True
    listed = world.webhook(alice, owner, "github", trusted_actors={"logins": ["7"]})
    wrong = world.deliver(listed, *producers.github("issues.opened", listed["secret"], {"sender": {"login": 7}}))
    assert wrong.json()["disposition"] == "quarantined"


@pytest.mark.parametrize("provider", ["generic", "stripe", "slack"])
def test_providers_without_a_gate_refuse_a_list_and_have_a_null_actor(world, alice, owner, provider):
    extra = {"secret": "whsec_" + "a" * 32} if provider in ("stripe", "slack") else {}
    refused = world.client.post("/api/v1/webhooks", headers=alice.auth, json={
        "provider": provider, "queue": "triage", "endpoint_id": owner.id, "trusted_actors": {"allow_all": True},
        **extra})
    assert refused.status_code == 400 and "no trust gate" in refused.json()["message"]
    hook = world.webhook(alice, owner, provider, **extra)
    assert hook["trusted_actors"] is None
    put = world.client.put(f"/api/v1/webhooks/{hook['id']}/trusted-actors", headers=alice.auth,
                           json={"allow_all": True})
    assert put.status_code == 400


def test_setting_the_list_is_validated_and_changes_the_gate(world, alice, owner):
    hook = world.webhook(alice, owner, "github", trusted_actors=None)
    url = f"/api/v1/webhooks/{hook['id']}/trusted-actors"
    for bad in ({"logins": ["x"] * 257}, {"logins": ["x" * 129]}, {"logins": ["é" * 65]}, {"actor_ids": ["a"]},
                {"allow_all": False}, {"logins": ["a"], "match": "anyone"}, {"logins": [""]}, {}):
        answer = world.client.put(url, headers=alice.auth, json=bad)
        assert answer.status_code == 400 and answer.json()["error"] == "invalid_argument", bad
    assert world.client.get(f"/api/v1/webhooks/{hook['id']}", headers=alice.auth).json()["trusted_actors"] == {
        "logins": [], "match": "sender"}
    ok = world.client.put(url, headers=alice.auth, json={"logins": ["alice"] * 2 + ["x" * 128]})
    assert ok.status_code == 200 and ok.json()["trusted_actors"]["logins"][-1] == "x" * 128
    assert world.deliver(hook, *issue_opened(hook["secret"], "a", "alice")).json()["disposition"] == "routed"


def test_trust_this_actor_and_release(world, alice, owner):
    hook = world.webhook(alice, owner, "github", trusted_actors={"logins": ["alice"]})
    held = world.deliver(hook, *issue_opened(hook["secret"], "newcomer", "newcomer")).json()
    todo_id = held["todos"][0]["id"]
    released = world.client.post(f"/api/v1/todos/{todo_id}/release-quarantine", headers=alice.auth,
                                 json={"trust_actor": True})
    assert released.status_code == 200 and released.json()["state"] == "pending"
    assert released.json()["queue"] == "triage"
    listed = world.client.get(f"/api/v1/webhooks/{hook['id']}", headers=alice.auth).json()["trusted_actors"]
    assert listed["logins"] == ["alice", "newcomer"]
    later = world.deliver(hook, *issue_opened(hook["secret"], "newcomer", "NewComer")).json()
    assert later["disposition"] == "routed"


def test_trust_actor_is_refused_for_rule_faults_and_changes_nothing(world, alice, owner):
    hook = world.webhook(alice, owner, "github", trusted_actors={"allow_all": True})
    assert world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth, json={
        "rules": [{"id": "boom", "expr": ".payload.issue.title | error", "action": {"drop": True}}]}
    ).status_code == 200
    held = world.deliver(hook, *issue_opened(hook["secret"], "a", "b")).json()
    todo_id = held["todos"][0]["id"]
    refused = world.client.post(f"/api/v1/todos/{todo_id}/release-quarantine", headers=alice.auth,
                                json={"trust_actor": True})
    assert refused.status_code == 409 and "rule_fault" in refused.json()["message"]
    assert world.client.get(f"/api/v1/todos/{todo_id}", headers=alice.auth).json()["state"] == "quarantined"


def test_work_orders_carry_author_trusted_and_released_by(world, alice, owner):
    hook = world.webhook(alice, owner, "github", trusted_actors={"logins": ["alice"]})
    assert world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth, json={
        "rules": [{"id": "lane", "expr": ".issue != null",
                   "action": {"queue": "lane-s", "exclusive": True, "work_order": True}}]}).status_code == 200
    routed = world.deliver(hook, *issue_opened(hook["secret"], "alice", "alice")).json()
    order = world.client.get(f"/api/v1/todos/{routed['todos'][0]['id']}", headers=alice.auth).json()["work_order"]
    assert order["author_trusted"] is True and "released_by" not in order
    assert {"event_type", "state", "label", "body_size"} <= set(order["subject"])
    held = world.deliver(hook, *issue_opened(hook["secret"], "bob", "bob")).json()
    released = world.client.post(f"/api/v1/todos/{held['todos'][0]['id']}/release-quarantine", headers=alice.auth,
                                 json={"trust_actor": True}).json()
    assert released["work_order"]["released_by"] == f"human:{alice.id}"
    assert released["work_order"]["author_trusted"] is True


def test_envelope_edges_match_the_reference(world, alice, owner):
    hook = world.webhook(alice, owner, "github", trusted_actors={"allow_all": True})
    for patch in ({"issue": {"pull_request": {}}}, {"pull_request": {"number": 1}}):
        outcome = world.deliver(hook, *producers.github("issues.opened", hook["secret"], patch)).json()
        assert envelope_of(world, alice, outcome)["issue"] is None, patch
    plain = world.deliver(hook, *producers.github("issues.opened", hook["secret"], {
        "issue": {"pull_request": None, "title": None, "state": 3}})).json()
    issue = envelope_of(world, alice, plain)["issue"]
    assert issue is not None and issue["title"] == "" and issue["state"] == ""
    generic = world.webhook(alice, owner, "generic")
    raw, headers = producers.gitea("issues.opened", "unused")
    outcome = world.deliver(generic, raw, {"X-Gitea-Event": "issues", "Content-Type": "application/json"}).json()
    projected = envelope_of(world, alice, outcome)
    assert projected["issue"]["provider"] == "gitea" and projected["subject_key"].startswith("gitea:")
    assert projected["actor"]["trusted"] is None


def test_the_migration_trusts_everyone_on_existing_forge_webhooks():
    migration = MIGRATIONS[1]
    assert "allow_all" in migration.fill["webhooks"]["trusted_actors"]
