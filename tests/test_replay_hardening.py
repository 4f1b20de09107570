"""Replay, hardened (issue 26): a replay never creates work again after a human moved the event's todo (rerouted
it, or released it from the trust gate's hold), and a bulk replay reads its deliveries in batches under a byte
budget instead of holding every matched body at once."""

from __future__ import annotations

import os
import re
import types
import uuid
from pathlib import Path

import httpx
import producers
import pytest
from conftest import ROOT, LiveServer, cli
from helpers import add_route, count, query

from switchboard.app import create_app

ROUTE_TO_LANE_A = {"rules": [{"id": "to-a", "expr": '.source == "github"', "action": {"queue": "lane-a"}}]}
DROP_ALL = {"rules": [{"id": "drop-all", "expr": "true", "action": {"drop": True}}]}


@pytest.fixture
def app(db_path, clock):
    return create_app(db_path, clock=clock, background=False, ingest_rate=0)


@pytest.fixture
def owner(world, alice):
    return world.endpoint(alice, ["triage", "lane-a", "lane-b"], name="owner")


def set_rules(client, human, webhook_id: str, rules: dict) -> None:
    r = client.put(f"/api/v1/webhooks/{webhook_id}/rules", headers=human.auth, json=rules)
    assert r.status_code == 200, r.text


def signed_issue(hook: dict, number: int = 1) -> tuple[bytes, dict]:
    return producers.github("issues.opened", hook["secret"], {"issue": {"number": number}}, delivery=str(uuid.uuid4()))


def replay(client, human, event_id: str, **body) -> dict:
    r = client.post(f"/api/v1/events/{event_id}/replay", headers=human.auth, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def replay_many(client, human, webhook_id: str, **body) -> dict:
    r = client.post(f"/api/v1/webhooks/{webhook_id}/replay", headers=human.auth, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def todos_of(db_path: str, event_id: str) -> list[tuple]:
    return query(db_path, "SELECT id, endpoint_id, queue, state FROM todos WHERE event_id = ? ORDER BY created_at, id",
                 (event_id,))


def held_messages(db_path: str) -> int:
    return count(db_path, "notify_outbox", "event = 'held'")


# -- 2a. a todo the human rerouted ----------------------------------------------------------------------

@pytest.mark.parametrize("minted_by", ["delivery", "replay"])
def test_replay_never_mints_again_where_a_rerouted_todo_came_from(world, alice, owner, db_path, minted_by):
    hook = world.webhook(alice, owner, "github")
    set_rules(world.client, alice, hook["id"], ROUTE_TO_LANE_A if minted_by == "delivery" else DROP_ALL)
    delivered = world.deliver(hook, *signed_issue(hook)).json()
    event_id = delivered["event_id"]
    if minted_by == "replay":  # dropped by a wrong rule, then replayed onto lane-a after the fix
        assert delivered["disposition"] == "dropped"
        set_rules(world.client, alice, hook["id"], ROUTE_TO_LANE_A)
        assert replay(world.client, alice, event_id)["created"] == 1
    [(todo_id, _, queue, _)] = todos_of(db_path, event_id)
    assert queue == "lane-a"
    moved = world.act(alice, todo_id, "reroute", queue="lane-b")
    assert moved.status_code == 200 and moved.json()["queue"] == "lane-b", moved.text

    dry = replay(world.client, alice, event_id, dry_run=True)
    assert dry["after"]["disposition"] == "routed" and dry["todos"] == [], "nothing would be created"
    one = replay(world.client, alice, event_id)
    assert one["after"] == {"disposition": "routed", "queue": "lane-a", "rule_id": "to-a", "stage": "rule"}
    assert one["created"] == 0 and one["todos"] == []
    bulk = replay_many(world.client, alice, hook["id"], dry_run=False)
    assert bulk["matched"] == 1 and bulk["created"] == 0
    assert todos_of(db_path, event_id) == [(todo_id, owner.id, "lane-b", "pending")], "one live todo, where moved"

    # The moved todo counts where it was minted, and only there: a target the event never reached gets its own.
    second = world.endpoint(alice, ["lane-a"], name="second")
    assert add_route(world.client, alice.auth, hook["id"], second.id).status_code == 201
    widened = replay(world.client, alice, event_id)
    assert [(t["endpoint_id"], t["queue"], t["created"]) for t in widened["todos"]] == [(second.id, "lane-a", True)]
    assert replay(world.client, alice, event_id)["created"] == 0
    assert len(todos_of(db_path, event_id)) == 2


# -- 2b. a hold the human released ----------------------------------------------------------------------

def test_replay_never_holds_or_routes_again_a_delivery_the_human_released(world, alice, owner, db_path):
    channel = world.client.post("/api/v1/notify", headers=alice.auth,
                                json={"kind": "ntfy", "url": "https://ntfy.example.com/switchboard", "events": ["held"]})
    assert channel.status_code == 201, channel.text
    gated = world.webhook(alice, owner, "github", trusted_actors=None)  # no trusted actors: the gate holds all
    held = world.deliver(gated, *signed_issue(gated)).json()
    assert held["disposition"] == "quarantined" and held_messages(db_path) == 1
    event_id, [hold] = held["event_id"], held["todos"]
    released = world.client.post(f"/api/v1/todos/{hold['id']}/release-quarantine", headers=alice.auth,
                                 json={"queue": "lane-b"})
    assert released.status_code == 200 and released.json()["state"] == "pending", released.text

    # The gate still holds the delivery: a replay of the held ones (in bulk, then alone) holds nothing again.
    bulk = replay_many(world.client, alice, gated["id"], disposition="quarantined", dry_run=False)
    assert bulk["matched"] == 1 and bulk["created"] == 0, bulk
    assert bulk["transitions"] == [{"from": "quarantined", "to": "quarantined", "rule_id": None, "count": 1}]
    one = replay(world.client, alice, event_id)
    assert one["after"]["disposition"] == "quarantined" and one["created"] == 0 and one["todos"] == []
    assert count(db_path, "todos", "state = 'quarantined'") == 0, "no second held todo"
    assert held_messages(db_path) == 1, "no second 'held' notification"

    # Trusting everyone now routes it to the webhook's queue: the human already placed its work, so nothing more.
    trusted = world.client.put(f"/api/v1/webhooks/{gated['id']}/trusted-actors", headers=alice.auth,
                               json={"allow_all": True})
    assert trusted.status_code == 200, trusted.text
    routed = replay(world.client, alice, event_id)
    assert routed["after"]["disposition"] == "routed" and routed["created"] == 0 and routed["todos"] == []
    assert todos_of(db_path, event_id) == [(hold["id"], owner.id, "lane-b", "pending")]


# -- 3. bulk replay in batches under a byte budget --------------------------------------------------------

BODY_BYTES = 1 << 20
DELIVERIES = 20
BATCH_BYTES = 2 << 20  # the server's replay budget in this test (16 MiB in production): one or two bodies a batch


def peak_rss(pid: int) -> int:
    """The process's high-water mark of resident memory (VmHWM), in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) * 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_a_bulk_replay_larger_than_its_budget_answers_the_same_in_bounded_memory(tmp_path):
    """Twenty 1 MiB deliveries (20 MiB) under a 2 MiB replay budget: the dry run and the applied replay answer as
    they always did, and the server's peak memory grows by well under the bodies' total (holding every matched
    delivery at once grew it by several times the total). The trust gate holds them at ingest and the rules are
    saved before any arrives, so nothing but the replay reads them all."""
    db_path = str(tmp_path / "switchboard.db")
    assert cli(db_path, "init")[0] == 0
    token = cli(db_path, "human", "add", "alice")[1]["token"]
    alice = types.SimpleNamespace(auth={"Authorization": f"Bearer {token}"})
    # The replay budget lowered; and the evaluation budget raised from 250 ms, so that reading a 1 MiB envelope on
    # a busy machine is never a timeout fault (which would change the answer this test compares).
    code = (f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom switchboard.cli.parser import main\n"
            f"import switchboard.store.replay\nswitchboard.store.replay.REPLAY_BATCH_BYTES = {BATCH_BYTES}\n"
            "import switchboard.app\n"
            "class Evaluator(switchboard.app.Evaluator):\n"
            "    def __init__(self, *args, **kwargs):\n"
            "        super().__init__(*args, **{**kwargs, 'budget': 5.0, 'kill_after': 10.0})\n"
            "switchboard.app.Evaluator = Evaluator\n"
            f"sys.exit(main(sys.argv[1:]))\n")
    server = LiveServer(db_path, "--ingest-rate", "0", program=("-c", code))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            endpoint = http.post("/api/v1/endpoints", headers=alice.auth, json={"name": "owner", "queues": ["lane"]})
            assert endpoint.status_code == 201, endpoint.text
            hook = http.post("/api/v1/webhooks", headers=alice.auth, json={
                "provider": "github", "queue": "lane", "endpoint_id": endpoint.json()["id"], "trusted_actors": None})
            assert hook.status_code == 201, hook.text
            hook = hook.json()
            set_rules(http, alice, hook["id"], {"rules": [
                {"id": "to-lane", "expr": ".payload.issue.number >= 0", "action": {"queue": "lane"}}]})
            path = "/hooks/" + hook["url"].rsplit("/hooks/", 1)[1]
            for n in range(DELIVERIES):
                blob = os.urandom(BODY_BYTES // 2).hex()  # one long string: quick for jq to read within its budget
                r = http.post(path, content=(raw := producers.github("issues.opened", hook["secret"], {
                    "issue": {"number": n, "body": blob}})[0]), headers=producers.github_headers(hook["secret"], raw))
                assert r.status_code == 202 and r.json()["disposition"] == "quarantined", r.text
            trusted = http.put(f"/api/v1/webhooks/{hook['id']}/trusted-actors", headers=alice.auth,
                               json={"allow_all": True})
            assert trusted.status_code == 200, trusted.text

            before = peak_rss(server.proc.pid)
            dry = http.post(f"/api/v1/webhooks/{hook['id']}/replay", headers=alice.auth, json={"limit": 1000})
            grown = peak_rss(server.proc.pid) - before
            assert dry.status_code == 200, dry.text
            assert dry.json() == {"matched": DELIVERIES, "changed": DELIVERIES, "created": 0, "dry_run": True,
                                  "transitions": [{"from": "quarantined", "to": "routed", "rule_id": "to-lane",
                                                   "count": DELIVERIES}]}
            total = DELIVERIES * BODY_BYTES
            assert grown < total // 2, f"peak memory grew by {grown >> 20} MiB for {total >> 20} MiB of bodies"

            applied = http.post(f"/api/v1/webhooks/{hook['id']}/replay", headers=alice.auth,
                                json={"limit": 1000, "dry_run": False})
            assert applied.status_code == 200, applied.text
            assert applied.json() == {**dry.json(), "created": DELIVERIES, "dry_run": False}
        assert count(db_path, "todos", "queue = 'lane' AND state = 'pending'") == DELIVERIES
        assert count(db_path, "todos", "state = 'quarantined'") == 0, "each hold closed as its delivery routed"
        assert count(db_path, "event_replays") == DELIVERIES
    finally:
        server.stop()
