"""Round trips to Postgres (issue 46), and what the process remembers to save them: a principal behind a token,
and the reads that are nearly always empty (a queue without controls, nothing mirrored to a forge). The count is
libpq's own protocol trace of the pooled connections (SWITCHBOARD_PG_TRACE), never a time; what is remembered is
proven by a second app on the same database changing it underneath (on SQLite, where nothing is remembered, the
same tests hold trivially and keep the two engines' behaviour one)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ENGINE, World
from producers import github
from starlette.testclient import TestClient

from switchboard.app import create_app

# The goals of issue 46: one delivery, and one claim with its completion, as round trips to the database server.
DELIVERY_ROUND_TRIPS = 3
CLAIM_AND_COMPLETE_ROUND_TRIPS = 4


def traced(directory: Path) -> dict[str, int]:
    from switchboard.postgres import round_trips

    return {p.name: round_trips(p.read_text()) for p in directory.glob("*.trace")}


def spent(directory: Path, before: dict[str, int]) -> int:
    return sum(n - before.get(name, 0) for name, n in traced(directory).items())


@pytest.mark.skipif(ENGINE != "postgres", reason="round trips to a database server: the Postgres run counts them")
def test_a_delivery_and_a_claim_with_its_completion_take_the_round_trips_of_the_goal(tmp_path, db_path, clock,
                                                                                       monkeypatch):
    trace_dir = tmp_path / "trace"
    monkeypatch.setenv("SWITCHBOARD_PG_TRACE", str(trace_dir))
    app = create_app(db_path, clock=clock, background=False)
    with TestClient(app, raise_server_exceptions=False) as client:
        world = World(client, app.state.db)
        alice = world.human("alice")
        endpoint = world.endpoint(alice, ["triage"])
        webhook = world.webhook(alice, endpoint)
        counted: dict[str, list[int]] = {"delivery": [], "claim + complete": []}
        # The first of each fills the process's memory (the token's principal, the empty reads); the next ones are
        # what a running server spends on each.
        for number in range(3):
            raw, headers = github("issues.labeled", webhook["secret"], {"issue": {"number": 100 + number}})
            before = traced(trace_dir)
            r = world.deliver(webhook, raw, headers)
            assert r.status_code == 202 and r.json()["todos"], r.text
            counted["delivery"].append(spent(trace_dir, before))
        for _ in range(3):
            before = traced(trace_dir)
            claimed = world.claim(endpoint)
            r = world.act(endpoint, claimed["todo"]["id"], "complete", lease_token=claimed["lease_token"])
            assert r.status_code == 200 and r.json()["state"] == "done", r.text
            counted["claim + complete"].append(spent(trace_dir, before))
    print("round trips:", counted)
    assert max(counted["delivery"][1:]) <= DELIVERY_ROUND_TRIPS, counted
    assert max(counted["claim + complete"][1:]) <= CLAIM_AND_COMPLETE_ROUND_TRIPS, counted


@pytest.fixture
def second_app(db_path, clock):
    """Another server's app on the same database: what it changes, the first app's memory has not seen."""
    app = create_app(db_path, clock=clock, background=False)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield World(client, app.state.db)


def test_a_human_token_replaced_elsewhere_stops_at_once_where_its_principal_was_remembered(world, second_app,
                                                                                            alice):
    assert world.client.get("/api/v1/me", headers=alice.auth).status_code == 200  # remembered now
    r = second_app.client.post("/api/v1/me/token", headers=alice.auth)
    assert r.status_code in (200, 201), r.text
    new_token = r.json()["token"]
    r = world.client.get("/api/v1/me", headers=alice.auth)
    assert r.status_code == 401 and r.json()["error"] == "unauthenticated", r.text
    r = world.client.post("/api/v1/endpoints", headers=alice.auth, json={"name": "late", "queues": ["triage"]})
    assert r.status_code == 401 and r.json()["error"] == "unauthenticated", r.text
    r = world.client.get("/api/v1/me", headers={"Authorization": f"Bearer {new_token}"})
    assert r.status_code == 200 and r.json()["id"] == alice.id, r.text


def test_an_endpoint_revoked_elsewhere_is_refused_at_once_where_its_principal_was_remembered(world, second_app):
    alice = world.human("alice")
    endpoint = world.endpoint(alice, ["triage"])
    world.push(alice, endpoint, "triage", "first")
    assert world.claim(endpoint)["todo"]["title"] == "first"
    r = second_app.client.post(f"/api/v1/endpoints/{endpoint.id}/revoke", headers=alice.auth, json={})
    assert r.status_code == 200, r.text
    for method, path, body in (("POST", "/api/v1/todos/claim", {}), ("GET", "/api/v1/todos", None)):
        r = world.client.request(method, path, headers=endpoint.auth, json=body)
        assert r.status_code == 401 and r.json()["error"] == "unauthenticated", (path, r.text)


def test_a_queue_paused_elsewhere_holds_the_next_claim_where_it_was_remembered_uncontrolled(world, second_app,
                                                                                          alice):
    endpoint = world.endpoint(alice, ["triage"])
    for title in ("one", "two"):
        world.push(alice, endpoint, "triage", title)
    assert world.claim(endpoint)["todo"]["title"] == "one"  # "triage has no controls" is remembered now
    r = second_app.client.post(f"/api/v1/endpoints/{endpoint.id}/queues/triage/pause", headers=alice.auth, json={})
    assert r.status_code == 200, r.text
    answer = world.claim(endpoint)
    assert answer.get("empty") and [a["reason"] for a in answer["admission"]] == ["paused"], answer
