"""A work item in the issue body (SPEC 17, issue 44 part 3): a verified GitHub or Gitea issue's one `switchboard`
block is read as a work item; the envelope shows it or why not; the routed todo carries it to the worker as a
pushed todo's work item, and its gate only adds; the fleet pack's `require_work_item` holds an issue without one.

Signed deliveries go to the real app (its test client) on the engine the run chooses; the worker's side is a claim
over REST, as `switchboard worker` and `worker --exec` (the claimed todo on its child's stdin) make it."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import producers
import pytest

from switchboard.configuration import MAX_WORK_ITEM_BYTES
from switchboard.envelope import body_work_item

ROOT = Path(__file__).resolve().parent.parent
FLEET = json.loads((ROOT / "packs" / "fleet.json").read_text())
FLEET_PARAMS = json.loads((ROOT / "packs" / "fleet.cases.json").read_text())["params"]

ITEM = {"schema": "switchboard.work_item.v1", "objective": "Rotate the restic key on nas01",
        "constraints": ["no downtime"], "definition_of_done": ["the nightly job runs with the new key"],
        "validation_commands": ["restic check"]}
GATED = {**ITEM, "approval_gates": ["review"]}


def block(item, fence: str = "```", newline: str = "\n") -> str:
    text = item if isinstance(item, str) else json.dumps(item, indent=2)
    return newline.join(["Rotate the backup key, please.", "", f"{fence}switchboard", text, fence, "", "Thanks!"])


# -- a deployment: the fleet pack on a GitHub and a Gitea webhook, lanes on endpoints of their own ------------

@pytest.fixture
def owner(world, alice):
    return world.endpoint(alice, ["hold"], name="router", verbs=["all"])


@pytest.fixture
def lane(world, alice):
    return world.endpoint(alice, ["lane-s", "lane-m", "lane-l", "lane-vision", "triage"], name="lanes")


def fleet_hook(world, alice, owner, lane, provider: str, **params) -> dict:
    hook = world.webhook(alice, owner, provider, "hold")
    assert world.client.post(f"/api/v1/webhooks/{hook['id']}/routes", headers=alice.auth,
                             json={"endpoint_id": lane.id}).status_code == 201
    saved = world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth,
                             json={**FLEET, "params": {**FLEET_PARAMS, **params}})
    assert saved.status_code == 200, saved.text
    return hook


def issue_delivery(hook: dict, provider: str, number: int, body: str | None, action: str = "opened",
                   labels: tuple[str, ...] = ("size/S",)) -> tuple[bytes, dict]:
    patch = {"issue": {"number": number, "body": body, "labels": [{"name": name} for name in labels]}}
    if provider == "github":
        fixture = "issues.labeled" if action == "labeled" else "issues.opened"
        return producers.github(fixture, hook["secret"], patch)
    fixture = "issues.label_updated" if action == "labeled" else "issues.opened"
    return producers.gitea(fixture, hook["secret"], patch, delivery=str(uuid.uuid4()))


def deliver(world, hook, provider, number, body, **extra) -> dict:
    answer = world.deliver(hook, *issue_delivery(hook, provider, number, body, **extra))
    assert answer.status_code == 202, answer.text
    return answer.json()


def envelope_issue(world, alice, event_id: str) -> dict:
    event = world.client.get(f"/api/v1/events/{event_id}", headers=alice.auth)
    assert event.status_code == 200, event.text
    return event.json()["envelope"]["issue"]


def todo_of(world, alice, outcome: dict) -> dict:
    assert outcome["disposition"] == "routed" and outcome["created"] == 1, outcome
    return world.client.get(f"/api/v1/todos/{outcome['todos'][0]['id']}", headers=alice.auth).json()


PROVIDERS = ["github", "gitea"]


# -- a valid block reaches the worker ---------------------------------------------------------------------------

@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_valid_block_reaches_the_worker_that_claims_the_todo(world, alice, owner, lane, provider):
    hook = fleet_hook(world, alice, owner, lane, provider, require_work_item=True)
    # GitHub's web editor sends CRLF line ends; a tilde fence is a fence too.
    body = block(ITEM, newline="\r\n") if provider == "github" else block(ITEM, fence="~~~~")
    outcome = deliver(world, hook, provider, 501, body)
    issue = envelope_issue(world, alice, outcome["event_id"])
    assert issue["work_item"] == ITEM and issue["work_item_error"] is None
    assert outcome["todos"][0]["queue"] == "lane-s" and outcome["todos"][0]["endpoint_id"] == lane.id

    claim = world.claim(lane, queue="lane-s")
    todo = claim["todo"]
    assert todo["id"] == outcome["todos"][0]["id"]
    assert todo["work_item"] == ITEM, "the worker gets the block as the todo's work item, as a pushed one's"
    order = todo["work_order"]
    assert order["work_item"] == ITEM and order["authority"].startswith("semi-trusted task")
    # No gate in the block, none from the rules: completing finishes it.
    done = world.act(lane, todo["id"], "complete", lease_token=claim["lease_token"], summary="rotated")
    assert done.json()["state"] == "done", done.text


# -- an invalid block is named, and require_work_item holds it ------------------------------------------------------

INVALID = [
    ({k: v for k, v in ITEM.items() if k != "objective"}, "objective: Field required"),
    ({**ITEM, "depends_on": ["td_0123"]}, "depends_on: an issue's work item cannot depend on todos"),
    ({**ITEM, "schema": "switchboard.work_item.v2"}, "schema: Input should be 'switchboard.work_item.v1'"),
    ('{"schema": "switchboard.work_item.v1", "objective": "x",}', "not JSON: "),
    ('["switchboard.work_item.v1"]', "the switchboard block holds JSON that is not an object"),
]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_an_invalid_block_is_named_and_require_work_item_holds_the_issue_not_ready(world, alice, owner, lane,
                                                                                   provider):
    hook = fleet_hook(world, alice, owner, lane, provider, require_work_item=True)
    for number, (item, error) in enumerate(INVALID, 510):
        outcome = deliver(world, hook, provider, number, block(item))
        issue = envelope_issue(world, alice, outcome["event_id"])
        assert issue["work_item"] is None and issue["work_item_error"].startswith(error), issue["work_item_error"]
        held = todo_of(world, alice, outcome)
        assert (held["queue"], held["endpoint_id"], held["state"]) == ("hold", owner.id, "pending")
        assert held["trace"]["rule_id"] == "not_ready" and held["work_item"] is None
        assert "work_item" not in held["work_order"]
    # No block at all: no error, and still not ready.
    outcome = deliver(world, hook, provider, 520, "Just do the thing.")
    issue = envelope_issue(world, alice, outcome["event_id"])
    assert issue["work_item"] is None and issue["work_item_error"] is None
    assert todo_of(world, alice, outcome)["trace"]["rule_id"] == "not_ready"
    # Two blocks, even two valid ones: exactly one counts.
    outcome = deliver(world, hook, provider, 521, block(ITEM) + "\n" + block(ITEM))
    issue = envelope_issue(world, alice, outcome["event_id"])
    assert issue["work_item"] is None and "more than one switchboard block" in issue["work_item_error"]
    assert todo_of(world, alice, outcome)["trace"]["rule_id"] == "not_ready"
    # Nothing held reached the lane.
    assert world.claim(lane, queue="lane-s").get("empty") is True


@pytest.mark.parametrize("provider", PROVIDERS)
def test_without_require_work_item_an_issue_without_one_still_routes(world, alice, owner, lane, provider):
    hook = fleet_hook(world, alice, owner, lane, provider)
    bare = todo_of(world, alice, deliver(world, hook, provider, 530, None))
    assert bare["queue"] == "lane-s" and bare["work_item"] is None
    invalid = todo_of(world, alice, deliver(world, hook, provider, 531, block({"schema": "switchboard.work_item.v1"})))
    assert invalid["queue"] == "lane-s" and invalid["work_item"] is None


def test_the_dry_run_shows_the_error_and_an_unverified_body_is_not_read(world, alice, owner, lane):
    hook = fleet_hook(world, alice, owner, lane, "github", require_work_item=True)
    payload = producers.deep_merge(json.loads((producers.FIXTURES / "github" / "issues.opened.json").read_text()),
                                   {"issue": {"labels": [{"name": "size/S"}],
                                              "body": block({**ITEM, "approval_gates": ["deploy"]})}})
    dry = world.client.post(f"/api/v1/webhooks/{hook['id']}/rules/test", headers=alice.auth,
                            json={"payload": payload, "headers": {"X-GitHub-Event": "issues"}}).json()
    assert dry["envelope"]["issue"]["work_item_error"] == "approval_gates.0: Input should be 'review'"
    assert dry["decision"]["queue"] == "hold" and dry["trace"]["rule_id"] == "not_ready"
    # An unverified delivery's body decides nothing: its block is not read, whatever it holds.
    payload["issue"]["body"] = block(ITEM)
    unverified = world.client.post(f"/api/v1/webhooks/{hook['id']}/rules/test", headers=alice.auth, json={
        "payload": payload, "headers": {"X-GitHub-Event": "issues"}, "verified": False,
        "params": {**FLEET_PARAMS, "require_verified": False, "require_work_item": True}}).json()
    issue = unverified["envelope"]["issue"]
    assert issue["work_item"] is None and issue["work_item_error"] == "not read: the delivery is not verified"
    assert unverified["trace"]["rule_id"] == "not_ready"


# -- gates only add ---------------------------------------------------------------------------------------------

def complete(world, lane, queue: str) -> dict:
    claim = world.claim(lane, queue=queue)
    return world.act(lane, claim["todo"]["id"], "complete", lease_token=claim["lease_token"], summary="did it").json()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_block_adds_a_gate_and_cannot_take_one_away(world, alice, owner, lane, provider):
    hook = fleet_hook(world, alice, owner, lane, provider)
    opened = deliver(world, hook, provider, 540, block(GATED))
    gated = todo_of(world, alice, opened)
    assert gated["work_item"] == GATED
    # The issue is edited to drop the gate (an empty list, then none at all) and labelled again: the same issue
    # and lane is a repeat, and the todo the first body made keeps its gate.
    for number_of_edit, item in enumerate(({**ITEM, "approval_gates": []}, ITEM)):
        again = deliver(world, hook, provider, 540, block(item), action="labeled")
        assert again["disposition"] == "repeat", (number_of_edit, again)
    finished = complete(world, lane, "lane-s")
    assert finished["id"] == gated["id"] and finished["state"] == "review", finished
    # A block that tries to say "no gate" in a shape of its own is not a work item at all: nothing it says counts.
    for number, item in ((541, {**ITEM, "approval_gates": ["none"]}), (542, {**ITEM, "gated": False})):
        outcome = deliver(world, hook, provider, number, block(item))
        assert envelope_issue(world, alice, outcome["event_id"])["work_item_error"] in (
            "approval_gates.0: Input should be 'review'", "gated: unknown field")
        assert todo_of(world, alice, outcome)["work_item"] is None


def test_a_released_delivery_keeps_its_blocks_gate(world, alice, owner, lane):
    """A delivery the trust gate held becomes routed work on release: the todo then carries the block and its gate,
    as one routed at once would."""
    hook = world.webhook(alice, owner, "github", "hold", trusted_actors={"logins": []})
    assert world.client.post(f"/api/v1/webhooks/{hook['id']}/routes", headers=alice.auth,
                             json={"endpoint_id": lane.id}).status_code == 201
    rules = {"rules": [{"id": "all", "expr": ".issue != null",
                        "action": {"queue": "lane-s", "exclusive": True, "once": True, "work_order": True}}]}
    assert world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth, json=rules).status_code == 200
    outcome = deliver(world, hook, "github", 550, block(GATED))
    assert outcome["disposition"] == "quarantined", outcome
    held = world.client.get(f"/api/v1/todos/{outcome['todos'][0]['id']}", headers=alice.auth).json()
    assert held["state"] == "quarantined" and held["work_item"] is None
    released = world.client.post(f"/api/v1/todos/{held['id']}/release-quarantine", headers=alice.auth, json={})
    assert released.status_code == 200, released.text
    assert released.json()["work_item"] == GATED and released.json()["work_order"]["work_item"] == GATED
    assert complete(world, lane, "lane-s")["state"] == "review"


# -- the reading itself: bounded, one block, only a fence ------------------------------------------------------------

def test_reading_the_body_is_bounded_and_exact():
    assert body_work_item(None, True) == (None, None)
    assert body_work_item("mentions switchboard but has no block", True) == (None, None)
    assert body_work_item("```json\n" + json.dumps(ITEM) + "\n```", True) == (None, None)
    assert body_work_item(block(ITEM), True) == (ITEM, None)
    assert body_work_item("   ```switchboard  \n" + json.dumps(ITEM) + "\n   ````", True) == (ITEM, None)
    assert body_work_item("```switchboard\n" + json.dumps(ITEM), True) == (None, "the switchboard block is never closed")
    assert body_work_item(block(ITEM), False) == (None, "not read: the delivery is not verified")
    # A block past the cap is refused before any parsing; absurd nesting within it is an error, not a crash.
    huge = block('{"objective": "' + "x" * MAX_WORK_ITEM_BYTES + '"}')
    assert body_work_item(huge, True) == (None, f"the switchboard block is over {MAX_WORK_ITEM_BYTES} bytes")
    assert body_work_item(block("[" * 60_000), True) == (None, "not JSON: nested too deep")
    # A field's name is producer text: the error keeps it on one safe line.
    error = body_work_item(block({**ITEM, "evil\n\u202ename": 1}), True)[1]
    assert error == "evil name: unknown field"


def test_the_issue_template_in_the_docs_holds_a_valid_work_item():
    """docs/issue-template.md is the template docs/forge.md tells people to copy: its block must validate."""
    template = (ROOT / "docs" / "issue-template.md").read_text()
    item, error = body_work_item(template, True)
    assert error is None and item["objective"] and item["approval_gates"] == ["review"]
    forge_doc = (ROOT / "docs" / "forge.md").read_text()
    assert "issue-template.md" in forge_doc
    shown = re.search(r"```switchboard\n.*?\n```", forge_doc, re.S)
    assert shown and body_work_item(shown.group(0), True)[1] is None, "the block docs/forge.md shows validates too"
