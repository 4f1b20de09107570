"""Races that Postgres's READ COMMITTED allows and SQLite's one writer never runs: two requests meeting on one
todo, one quota, one body, one dead letter. Each race is made to happen every time: a transaction of the test's own
holds a row one racer needs next (a count row its trigger writes, the row its foreign key names), so that racer
stops at a known place while holding its own locks; the other racer then runs until it waits on the first (or
finishes), and only then does the test let go. Waits are on conditions (pg_stat_activity), never on sleeps. The app
is driven through its test client with the scheduler off, so the racers are the only sessions that can wait."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from conftest import ENGINE
from helpers import connect_db, integrity_errors, make_webhook, post_delivery, query
from producers import github

from switchboard.configuration import NOTIFY_MAX_CHANNELS, RERING_AFTER_MS
from switchboard.store.upkeep import RETENTION_MS, prune_batch, scheduler_tick

postgres_only = pytest.mark.skipif(
    ENGINE != "postgres", reason="a race between two writers: SQLite's one writer runs them one after the other"
                                 " (SWITCHBOARD_TEST_ENGINE=postgres runs it)")


class Held:
    """Rows locked by a transaction of the test's own until `release`: the racer that needs one waits there."""

    def __init__(self, url: str, *statements: tuple[str, tuple]):
        self.conn = psycopg.connect(url)
        for sql, params in statements:
            self.conn.execute(sql, params)

    def release(self) -> None:
        self.conn.commit()
        self.conn.close()


def count_row(endpoint_id: str, queue: str, state: str) -> list[tuple[str, tuple]]:
    """Hold the todo_counts row of a group (made, at 0, if the group has none yet): a todo moving into or out of
    the group stops at its count trigger, holding the todo's row."""
    key = (endpoint_id, queue, state)
    return [("INSERT INTO todo_counts (endpoint_id, queue, state, n, changes) VALUES (%s, %s, %s, 0, 0)"
             " ON CONFLICT DO NOTHING", key),
            ("SELECT 1 FROM todo_counts WHERE endpoint_id = %s AND queue = %s AND state = %s FOR UPDATE", key)]


def parent_row(table: str, row_id: str) -> list[tuple[str, tuple]]:
    """Hold a row that others name by foreign key: an insert naming it stops at its foreign key's check."""
    return [(f"SELECT 1 FROM {table} WHERE id = %s FOR UPDATE", (row_id,))]


def lock_waits(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                            " AND wait_event_type = 'Lock'").fetchone()[0]


def wait_until(check, what: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


class Racer(threading.Thread):
    """One side of a race, in a thread of its own; `got` is what it answered (or raised)."""

    def __init__(self, name: str, act):
        super().__init__(name=name, daemon=True)
        self.act = act
        self.got = None
        self.done_unhindered = False  # finished while the other racer was still held: it never waited on it

    def run(self) -> None:
        try:
            self.got = self.act()
        except BaseException as exc:  # noqa: BLE001 - a racer's failure is reported with the others' answers
            self.got = exc

    def said(self) -> str:
        if hasattr(self.got, "status_code"):  # an answer of the test client
            return f"{self.got.status_code} {self.got.text[:400]}"
        return repr(self.got)


def race(url: str, first: Racer, second: Racer, held: Held) -> dict[str, str]:
    """`first` runs until it waits on what `held` holds; `second` then runs until it waits too (on `first`, or on
    what `held` holds) or is done; then `held` lets go and both finish. What each got, by name, for the asserts'
    messages."""
    first.start()
    wait_until(lambda: lock_waits(url) >= 1, f"{first.name} waits on the row the test holds")
    second.start()
    wait_until(lambda: lock_waits(url) >= 2 or not second.is_alive(), f"{second.name} waits or is done")
    second.done_unhindered = not second.is_alive()
    held.release()
    for racer in (first, second):
        racer.join(30)
        assert not racer.is_alive(), f"{racer.name} never finished"
    return {racer.name: racer.said() for racer in (first, second)}


def todo_row(url: str, todo_id: str) -> dict | None:
    rows = query(url, "SELECT state, dead_letter, last_error, ring_count FROM todos WHERE id = ?", (todo_id,))
    return dict(zip(("state", "dead_letter", "last_error", "ring_count"), rows[0], strict=True)) if rows else None


def counts_match_rows(url: str) -> bool:
    counted = {tuple(r[:3]): r[3] for r in query(url, "SELECT endpoint_id, queue, state, n FROM todo_counts"
                                                      " WHERE n > 0")}
    rows = {tuple(r[:3]): r[3] for r in query(url, "SELECT endpoint_id, queue, state, count(*) FROM todos"
                                                   " GROUP BY endpoint_id, queue, state")}
    return counted == rows


# -- 1. a revocation and a claim ------------------------------------------------------------------------

@postgres_only
def test_a_revocation_racing_a_claim_ends_the_claims_attempt_and_the_todo_can_be_rerouted(db_path, world, alice):
    """The claim holds the todo when the revocation reads it: the revocation waits, then fails the claimed todo
    and ends its attempt. Left open, that attempt made every later claim of the rerouted todo meet the
    one-open-attempt index (eight tries, then 503)."""
    agent = world.endpoint(alice, ["q"])
    spare = world.endpoint(alice, ["q"])
    todo = world.push(alice, agent, "q", "contested")["id"]
    got = race(db_path,
               Racer("claim", lambda: world.client.post("/api/v1/todos/claim", headers=agent.auth, json={})),
               Racer("revoke", lambda: world.client.post(f"/api/v1/endpoints/{agent.id}/revoke", headers=alice.auth,
                                                         json={})),
               Held(db_path, *count_row(agent.id, "q", "claimed")))
    assert got["claim"].startswith("200") and todo in got["claim"], got
    assert got["revoke"].startswith("200"), got
    assert todo_row(db_path, todo) == {"state": "failed", "dead_letter": 1, "last_error": "endpoint_revoked",
                                       "ring_count": 1}, got
    assert query(db_path, "SELECT outcome FROM attempts WHERE todo_id = ?", (todo,)) == [("failed",)], got
    rerouted = world.act(alice, todo, "reroute", queue="q")
    assert rerouted.status_code == 200 and rerouted.json()["endpoint_id"] == spare.id, rerouted.text
    again = world.client.post("/api/v1/todos/claim", headers=spare.auth, json={})
    assert again.status_code == 200 and again.json()["todo"]["id"] == todo, (again.text, got)
    assert counts_match_rows(db_path)


# -- 5. a human's verb and a transition made on a row read without a lock ----------------------------------

@postgres_only
def test_a_cancel_racing_the_failure_of_its_dependency_stays_cancelled(db_path, world, alice):
    """The agent's failure reads the dependent todo as pending while the human's cancel of it is under way:
    moving it to `blocked` must not write over the cancel the human was answered."""
    agent = world.endpoint(alice, ["q"])
    first = world.push(alice, agent, "q", "first")["id"]
    then = world.push(alice, agent, "q", "then", work_item={
        "schema": "switchboard.work_item.v1", "objective": "after first", "depends_on": [first]})["id"]
    lease = world.claim(agent)
    assert lease["todo"]["id"] == first
    got = race(db_path,
               Racer("cancel", lambda: world.act(alice, then, "cancel", reason="not wanted")),
               Racer("fail", lambda: world.act(agent, first, "fail", lease_token=lease["lease_token"],
                                               error="broken", retry=False)),
               Held(db_path, *count_row(agent.id, "q", "cancelled")))
    assert got["cancel"].startswith("200") and got["fail"].startswith("200"), got
    assert todo_row(db_path, then)["state"] == "cancelled", got
    assert query(db_path, "SELECT from_state, to_state FROM todo_history WHERE todo_id = ? ORDER BY id",
                 (then,)) == [(None, "pending"), ("pending", "cancelled")], got
    assert counts_match_rows(db_path)


@postgres_only
def test_a_defer_racing_the_receipt_that_closes_its_follow_up_stays_deferred(db_path, world, alice):
    """A run absorbed a follow-up, and completes while the human defers that follow-up: the receipt leaves the
    deferred follow-up out instead of closing it as absorbed."""
    reviewer = world.endpoint(alice, ["review"])
    hook = world.webhook(alice, reviewer, "github", "review")

    def push(n: int) -> str:
        raw, headers = github("pull_request.synchronize", hook["secret"],
                              {"number": 2, "pull_request": {"number": 2, "head": {"sha": f"{n:040x}"}}})
        return world.deliver(hook, raw, headers).json()["todos"][0]["id"]

    first = push(1)
    lease = world.claim(reviewer)
    followup = push(2)
    absorbed = world.act(reviewer, first, "absorb", lease_token=lease["lease_token"])
    assert [t["id"] for t in absorbed.json()["absorbed"]] == [followup], absorbed.text
    got = race(db_path,
               Racer("defer", lambda: world.act(alice, followup, "defer", reason="after the release")),
               Racer("complete", lambda: world.act(reviewer, first, "complete", lease_token=lease["lease_token"],
                                                   summary="reviewed")),
               Held(db_path, *count_row(reviewer.id, "review", "deferred")))
    assert got["defer"].startswith("200") and got["complete"].startswith("200"), got
    assert todo_row(db_path, followup)["state"] == "deferred", got
    assert query(db_path, "SELECT count(*) FROM receipt_items WHERE todo_id = ?", (followup,))[0][0] == 0, got
    assert counts_match_rows(db_path)


# -- 3. the scheduler's re-ring and a claim --------------------------------------------------------------

@postgres_only
def test_the_schedulers_re_ring_passes_by_a_todo_being_claimed(db_path, world, alice, clock):
    """A todo due for its re-ring is being claimed when the scheduler sweeps: the sweep leaves it to the claim
    (it neither waits for the claim nor rings a todo that is claimed by the time it writes)."""
    agent = world.endpoint(alice, ["q"])
    todo = world.push(alice, agent, "q", "rung once")["id"]
    assert todo_row(db_path, todo)["ring_count"] == 1
    clock.advance(RERING_AFTER_MS[0] / 1000 + 1)
    tick = Racer("tick", lambda: world.db.write_sync(scheduler_tick))
    got = race(db_path,
               Racer("claim", lambda: world.client.post("/api/v1/todos/claim", headers=agent.auth, json={})),
               tick, Held(db_path, *count_row(agent.id, "q", "claimed")))
    assert got["claim"].startswith("200") and todo in got["claim"], got
    assert tick.done_unhindered, f"the sweep waited on the claim: {got}"
    assert "'rerung': 0" in got["tick"], got
    assert todo_row(db_path, todo)["state"] == "claimed" and todo_row(db_path, todo)["ring_count"] == 1, got


# -- 6. quotas -----------------------------------------------------------------------------------------

@postgres_only
def test_two_webhooks_made_at_once_for_the_last_place_make_one(db_path, world, alice):
    agent = world.endpoint(alice, ["q"])
    places = query(db_path, "SELECT webhook_max FROM endpoints WHERE id = ?", (agent.id,))[0][0]
    for _ in range(places - 1):
        make_webhook(world.client, alice, agent, "generic", "q")

    def create():
        return world.client.post("/api/v1/webhooks", headers=alice.auth,
                                 json={"provider": "generic", "queue": "q", "endpoint_id": agent.id})

    got = race(db_path, Racer("first", create), Racer("second", create), Held(db_path, *parent_row("endpoints",
                                                                                                  agent.id)))
    assert sorted(answer[:3] for answer in got.values()) == ["201", "409"], got
    assert query(db_path, "SELECT count(*) FROM webhooks WHERE endpoint_id = ?", (agent.id,))[0][0] == places, got


@postgres_only
def test_two_notification_channels_added_at_once_for_the_last_place_add_one(db_path, world, alice):
    def add(n: int):
        return world.client.post("/api/v1/notify", headers=alice.auth,
                                 json={"kind": "ntfy", "url": f"https://1.1.1.1/topic-{n}", "events": ["held"]})

    for n in range(NOTIFY_MAX_CHANNELS - 1):
        assert add(n).status_code == 201
    got = race(db_path, Racer("first", lambda: add(100)), Racer("second", lambda: add(101)),
               Held(db_path, *parent_row("humans", alice.id)))
    assert sorted(answer[:3] for answer in got.values()) == ["201", "409"], got
    assert query(db_path, "SELECT count(*) FROM notify_channels WHERE human_id = ?",
                 (alice.id,))[0][0] == NOTIFY_MAX_CHANNELS, got


# -- 4. one signed body under two delivery ids -----------------------------------------------------------

@postgres_only
def test_one_signed_body_sent_twice_at_once_under_two_delivery_ids_is_one_event(db_path, world, alice):
    agent = world.endpoint(alice, ["triage"])
    hook = world.webhook(alice, agent, "github", "triage")
    raw, first_headers = github("issues.opened", hook["secret"], {"issue": {"number": 4}}, delivery="first-id")
    _, second_headers = github("issues.opened", hook["secret"], {"issue": {"number": 4}}, delivery="second-id")
    got = race(db_path,
               Racer("first", lambda: post_delivery(world.client, hook, raw, first_headers)),
               Racer("second", lambda: post_delivery(world.client, hook, raw, second_headers)),
               Held(db_path, *parent_row("humans", alice.id)))
    assert all(answer.startswith("202") for answer in got.values()), got
    assert sorted('"duplicate":true' in answer for answer in got.values()) == [False, True], got
    assert query(db_path, "SELECT count(*) FROM events WHERE webhook_id = ?", (hook["id"],))[0][0] == 1, got
    assert query(db_path, "SELECT count(*) FROM todos WHERE endpoint_id = ?", (agent.id,))[0][0] == 1, got


def test_the_database_refuses_a_second_event_of_one_signed_body(db_path, world, alice):
    """The store's check is backed by the schema, on both engines: a signed webhook keeps one event per body,
    whatever writes it."""
    agent = world.endpoint(alice, ["triage"])
    hook = world.webhook(alice, agent, "github", "triage")
    raw, headers = github("issues.opened", hook["secret"], {"issue": {"number": 5}})
    assert post_delivery(world.client, hook, raw, headers).status_code == 202
    with connect_db(db_path) as conn, pytest.raises(integrity_errors()):
        conn.execute("INSERT INTO events (id, webhook_id, human_id, source, kind, trust_mode, verified, delivery_key,"
                     " body_hash, headers, disposition, received_at) SELECT 'ev_copy', webhook_id, human_id, source,"
                     " kind, trust_mode, verified, 'another-id', body_hash, headers, disposition, received_at"
                     " FROM events WHERE webhook_id = ?", (hook["id"],))


# -- 2. retention and a human's retry --------------------------------------------------------------------

@postgres_only
def test_a_dead_letter_retried_during_a_prune_is_kept(db_path, world, alice, clock):
    """Retention reaches a month-old dead letter while a human's retry of it is under way: the prune passes it
    by, and the todo the retry answered for is still there, pending."""
    agent = world.endpoint(alice, ["q"])
    todo = world.push(alice, agent, "q", "dead letter")["id"]
    lease = world.claim(agent)
    assert world.act(agent, todo, "fail", lease_token=lease["lease_token"], error="x", retry=False).status_code == 200
    clock.advance(RETENTION_MS / 1000 + 60)
    prune = Racer("prune", lambda: world.db.write_sync(prune_batch))
    got = race(db_path, Racer("retry", lambda: world.act(alice, todo, "retry")), prune,
               Held(db_path, *count_row(agent.id, "q", "pending")))
    assert got["retry"].startswith("200"), got
    assert prune.done_unhindered and "'todos': 0" in got["prune"], f"the prune waited on the retry: {got}"
    assert todo_row(db_path, todo) is not None and todo_row(db_path, todo)["state"] == "pending", got
    assert world.client.get(f"/api/v1/todos/{todo}", headers=alice.auth).status_code == 200, got
    assert counts_match_rows(db_path)
