"""Schedules (issue 45, part 1): each due time of a schedule makes exactly one todo (source and trust mode
`schedule`, idempotency key schedule:{id}:{due time}), across restarts; after a downtime `catch_up` decides what
the missed times make; cron follows Debian's cron across daylight-saving changes; bad input is a 400 naming the
field and changes nothing. The real app and database, driven by the test's clock: the scheduler's tick is the
one the server runs (World.tick), and a restart is a new app on the same database."""

from __future__ import annotations

import contextlib
import re
import urllib.parse
from datetime import datetime

import pytest
from conftest import ManualClock, World, cli, snapshot
from starlette.testclient import TestClient
from test_board import post, sign_in

from switchboard.app import create_app
from switchboard.configuration import iso, to_ms

T0 = ManualClock().ms  # 2027-01-15T08:00:00Z


def at(text: str) -> int:
    return to_ms(datetime.fromisoformat(text.replace("Z", "+00:00")))


@contextlib.contextmanager
def running(db_path: str, clock: ManualClock):
    """An app on the database at the clock's moment: one server's lifetime (no background loop; the test ticks)."""
    app = create_app(db_path, clock=clock, background=False)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield World(client, app.state.db)


def add_schedule(world: World, human, endpoint, status: int = 201, **body):
    body = {"name": "brief", "queue": "chores", "title": "the morning brief", **body}
    r = world.client.post(f"/api/v1/endpoints/{endpoint.id}/schedules", headers=human.auth, json=body)
    assert r.status_code == status, r.text
    return r.json()


def schedule_todos(world: World, human, schedule_id: str) -> list[dict]:
    """The schedule's todos (its subject's), oldest first, from the REST list."""
    subject = urllib.parse.quote(f"schedule:{schedule_id}", safe="")
    r = world.client.get(f"/api/v1/todos?subject={subject}&limit=200", headers=human.auth)
    assert r.status_code == 200, r.text
    return sorted(r.json()["todos"], key=lambda t: t["payload"]["due_at"])


def due_times(todos: list[dict]) -> list[str]:
    return [t["payload"]["due_at"] for t in todos]


def listed(world: World, human, endpoint) -> list[dict]:
    r = world.client.get(f"/api/v1/endpoints/{endpoint.id}/schedules", headers=human.auth)
    assert r.status_code == 200, r.text
    return r.json()["schedules"]


@pytest.fixture
def scene(world, alice):
    return world, alice, world.endpoint(alice, ["chores", "other"])


def test_a_schedule_every_second_makes_one_todo_per_second_and_its_fields_are_the_schedules(scene, clock):
    world, alice, endpoint = scene
    schedule = add_schedule(world, alice, endpoint, every_seconds=1, payload={"lane": "news"}, priority=7)
    assert schedule["next_run_at"] == iso(T0 + 1000) and schedule["enabled"] is True
    assert world.tick()["scheduled"] == 0
    for second in range(1, 6):
        clock.advance(1)
        assert world.tick()["scheduled"] == 1, f"second {second}"
        assert world.tick()["scheduled"] == 0, f"a second tick at second {second} makes nothing more"
    todos = schedule_todos(world, alice, schedule["id"])
    assert due_times(todos) == [iso(T0 + k * 1000) for k in range(1, 6)]
    first = todos[0]
    assert (first["source"], first["kind"], first["queue"], first["endpoint_id"], first["title"], first["priority"],
            first["state"]) == ("schedule", "schedule", "chores", endpoint.id, "the morning brief", 7, "pending")
    assert first["key"] == f"schedule:{schedule['id']}:{iso(T0 + 1000)}"
    assert first["payload"] == {"schedule_id": schedule["id"], "due_at": iso(T0 + 1000), "lane": "news"}
    event = world.client.get(f"/api/v1/events/{first['event_id']}", headers=alice.auth).json()
    assert (event["trust_mode"], event["source"]) == ("schedule", "schedule")
    [row] = listed(world, alice, endpoint)
    assert (row["last_run_at"], row["last_todo_id"], row["next_run_at"]) == (iso(T0 + 5000), todos[-1]["id"],
                                                                            iso(T0 + 6000))
    # The endpoint's agent claims them like any todo, oldest first.
    assert world.claim(endpoint, queue="chores")["todo"]["id"] == todos[0]["id"]


def test_a_restart_neither_repeats_nor_skips_a_due_time(db_path):
    clock = ManualClock()
    with running(db_path, clock) as world:
        alice = world.human("alice")
        endpoint = world.endpoint(alice, ["chores"])
        schedule = add_schedule(world, alice, endpoint, every_seconds=1)
        for _ in range(3):
            clock.advance(1)
            world.tick()
        assert len(schedule_todos(world, alice, schedule["id"])) == 3
    with running(db_path, clock) as world:  # the same moment, a new server: nothing is due again
        assert world.tick()["scheduled"] == 0
        for _ in range(2):
            clock.advance(1)
            assert world.tick()["scheduled"] == 1
        todos = schedule_todos(world, alice, schedule["id"])
    assert due_times(todos) == [iso(T0 + k * 1000) for k in range(1, 6)]
    assert len({t["key"] for t in todos}) == 5


@pytest.mark.parametrize("catch_up, made", [
    ("latest", [T0 + 600_000]),
    ("none", []),
    ("all", [T0 + k * 60_000 for k in range(1, 11)]),
])
def test_after_a_downtime_catch_up_decides_what_the_missed_times_make(db_path, catch_up, made):
    clock = ManualClock()
    with running(db_path, clock) as world:
        alice = world.human("alice")
        endpoint = world.endpoint(alice, ["chores"])
        schedule = add_schedule(world, alice, endpoint, every_seconds=60, catch_up=catch_up)
    clock.advance(600)  # down for ten minutes: ten due times pass with no server
    with running(db_path, clock) as world:
        world.tick()
        assert due_times(schedule_todos(world, alice, schedule["id"])) == [iso(ms) for ms in made]
        [row] = listed(world, alice, endpoint)
        assert row["next_run_at"] == iso(T0 + 660_000), "the next due time is the first in the future"
        clock.advance(60)
        assert world.tick()["scheduled"] == 1, "on time again: the next due time makes its todo"


def test_catch_up_all_makes_at_most_the_latest_hundred(scene, clock):
    world, alice, endpoint = scene
    schedule = add_schedule(world, alice, endpoint, every_seconds=1, catch_up="all")
    clock.advance(1000)
    assert world.tick()["scheduled"] == 100
    assert due_times(schedule_todos(world, alice, schedule["id"])) == [iso(T0 + k * 1000) for k in range(901, 1001)]


@pytest.mark.parametrize("catch_up, made", [
    ("latest", [T0 + 175 * 60_000]),
    ("none", []),
    ("all", [T0 + (5 + 5 * k) * 60_000 for k in range(35)]),
])
def test_a_cron_schedule_catches_up_on_its_own_times(scene, clock, catch_up, made):
    world, alice, endpoint = scene
    schedule = add_schedule(world, alice, endpoint, cron="*/5 * * * *", catch_up=catch_up)
    assert schedule["next_run_at"] == "2027-01-15T08:05:00.000Z"
    clock.advance(176 * 60)  # 10:56: the times from 08:05 to 10:55 were missed
    world.tick()
    assert due_times(schedule_todos(world, alice, schedule["id"])) == [iso(ms) for ms in made]
    assert listed(world, alice, endpoint)[0]["next_run_at"] == "2027-01-15T11:00:00.000Z"


def run_through(world: World, human, endpoint, clock: ManualClock, until: str) -> list[str]:
    """Move the clock to each next_run_at the schedule names, ticking there, until `until`: the due times made."""
    while True:
        [row] = listed(world, human, endpoint)
        if row["next_run_at"] > until:
            return due_times(schedule_todos(world, human, row["id"]))
        clock.ms = at(row["next_run_at"])
        assert world.tick()["scheduled"] == 1


def test_a_fixed_time_in_the_spring_forward_gap_runs_once_just_after_the_change(world, alice):
    """Europe/Berlin, 28 March 2027: 02:00 CET becomes 03:00 CEST, so 02:30 does not exist that night."""
    clock = world.db.clock
    clock.ms = at("2027-03-26T12:00:00Z")
    endpoint = world.endpoint(alice, ["chores"])
    add_schedule(world, alice, endpoint, cron="30 2 * * *", timezone="Europe/Berlin")
    assert run_through(world, alice, endpoint, clock, "2027-03-29T12:00:00Z") == [
        "2027-03-27T01:30:00.000Z",  # 02:30 CET
        "2027-03-28T01:00:00.000Z",  # 03:00 CEST: the first minute after the gap, once
        "2027-03-29T00:30:00.000Z",  # 02:30 CEST
    ]


def test_across_the_fall_back_an_hourly_job_runs_every_real_hour_and_a_fixed_time_once(world, alice):
    """Europe/Berlin, 31 October 2027: 03:00 CEST becomes 02:00 CET, so 02:00-02:59 happens twice."""
    clock = world.db.clock
    clock.ms = at("2027-10-30T21:30:00Z")
    hourly = world.endpoint(alice, ["chores"])
    made = add_schedule(world, alice, hourly, cron="0 * * * *", timezone="Europe/Berlin")
    assert run_through(world, alice, hourly, clock, "2027-10-31T02:30:00Z") == [
        "2027-10-30T22:00:00.000Z",  # 00:00 CEST
        "2027-10-30T23:00:00.000Z",  # 01:00 CEST
        "2027-10-31T00:00:00.000Z",  # 02:00 CEST
        "2027-10-31T01:00:00.000Z",  # 02:00 CET, the second 02:00
        "2027-10-31T02:00:00.000Z",  # 03:00 CET
    ]
    assert world.client.delete(f"/api/v1/schedules/{made['id']}", headers=alice.auth).status_code == 200
    clock.ms = at("2027-10-30T12:00:00Z")
    daily = world.endpoint(alice, ["chores"])
    add_schedule(world, alice, daily, cron="30 2 * * *", timezone="Europe/Berlin")
    assert run_through(world, alice, daily, clock, "2027-11-01T12:00:00Z") == [
        "2027-10-31T00:30:00.000Z",  # 02:30 CEST, the first 02:30; not again at 02:30 CET
        "2027-11-01T01:30:00.000Z",  # 02:30 CET
    ]


def test_a_schedule_made_in_the_second_pass_of_the_fall_back_hour_is_next_due_tomorrow(world, alice):
    world.db.clock.ms = at("2027-10-31T01:15:00Z")  # 02:15 CET, after 02:30 CEST has been
    endpoint = world.endpoint(alice, ["chores"])
    made = add_schedule(world, alice, endpoint, cron="30 2 * * *", timezone="Europe/Berlin")
    assert made["next_run_at"] == "2027-11-01T01:30:00.000Z"


BAD = [
    ({"cron": "* * * * * *"}, "cron"),
    ({"cron": "61 * * * *"}, "cron"),
    ({"cron": "0 0 31 2 *"}, "cron"),
    ({"every_seconds": 60, "timezone": "Mars/Olympus_Mons"}, "timezone"),
    ({"every_seconds": 0}, "every_seconds"),
    ({"every_seconds": 60, "cron": "* * * * *"}, "cron, every_seconds"),
    ({}, "cron, every_seconds"),
    ({"every_seconds": 60, "queue": "elsewhere"}, "queue"),
    ({"every_seconds": 60, "catch_up": "some"}, "catch_up"),
    ({"every_seconds": 60, "payload": {"due_at": "now"}}, "payload"),
    ({"every_seconds": 60, "work_item": {"schema": "switchboard.work_item.v1", "objective": "x",
                                         "depends_on": ["td_00"]}}, "work_item.depends_on"),
]


@pytest.mark.parametrize("body, field", BAD, ids=[field + ":" + repr(body)[:30] for body, field in BAD])
def test_bad_input_is_a_400_naming_the_field_and_changes_nothing(scene, db_path, body, field):
    world, alice, endpoint = scene
    before = snapshot(db_path)
    answer = add_schedule(world, alice, endpoint, status=400, **body)
    assert answer["error"] == "invalid_argument"
    assert field in answer["message"].split(":")[0] or answer["message"].startswith(f"body: {field}"), answer
    assert snapshot(db_path) == before


@pytest.mark.parametrize("change, field", [({"cron": "0 0 * * * *"}, "cron"), ({"timezone": "Nowhere/City"}, "timezone"),
                                           ({"every_seconds": 0}, "every_seconds"), ({"queue": "elsewhere"}, "queue"),
                                           ({"enabled": None}, "enabled"), ({"cron": None}, "cron")])
def test_a_bad_change_is_a_400_naming_the_field_and_changes_nothing(scene, db_path, change, field):
    world, alice, endpoint = scene
    schedule = add_schedule(world, alice, endpoint, every_seconds=60)
    before = snapshot(db_path)
    r = world.client.patch(f"/api/v1/schedules/{schedule['id']}", headers=alice.auth, json=change)
    assert r.status_code == 400 and field in r.json()["message"], r.text
    assert snapshot(db_path) == before


def test_a_disabled_schedule_makes_nothing_and_resumes_from_now(scene, clock):
    world, alice, endpoint = scene
    schedule = add_schedule(world, alice, endpoint, every_seconds=60, enabled=False)
    assert schedule["next_run_at"] is None
    clock.advance(600)
    assert world.tick()["scheduled"] == 0
    r = world.client.patch(f"/api/v1/schedules/{schedule['id']}", headers=alice.auth, json={"enabled": True})
    assert r.json()["next_run_at"] == iso(clock.ms + 60_000), "resumed: nothing for the time it was off"
    clock.advance(60)
    assert world.tick()["scheduled"] == 1
    r = world.client.patch(f"/api/v1/schedules/{schedule['id']}", headers=alice.auth, json={"enabled": False})
    assert (r.json()["enabled"], r.json()["next_run_at"]) == (False, None)
    clock.advance(600)
    assert world.tick()["scheduled"] == 0
    assert len(schedule_todos(world, alice, schedule["id"])) == 1


def test_a_paused_queue_still_receives_the_todos(scene, clock):
    world, alice, endpoint = scene
    r = world.client.post(f"/api/v1/endpoints/{endpoint.id}/queues/chores/pause", headers=alice.auth, json={})
    assert r.status_code == 200, r.text
    schedule = add_schedule(world, alice, endpoint, every_seconds=60)
    clock.advance(60)
    assert world.tick()["scheduled"] == 1
    [todo] = schedule_todos(world, alice, schedule["id"])
    assert todo["state"] == "pending"
    shut = world.claim(endpoint, queue="chores")
    assert shut["empty"] is True and [a["queue"] for a in shut["admission"]] == ["chores"], shut


def test_the_schedules_todos_are_on_its_subject_and_the_todo_list_with_source_schedule(scene, clock):
    world, alice, endpoint = scene
    schedule = add_schedule(world, alice, endpoint, every_seconds=60, title="sweep")
    for _ in range(2):
        clock.advance(60)
        world.tick()
    subject = world.client.get(f"/api/v1/subjects/{urllib.parse.quote('schedule:' + schedule['id'], safe='')}",
                               headers=alice.auth).json()
    assert [(t["source"], t["title"]) for t in subject["todos"]] == [("schedule", "sweep")] * 2
    listed_todos = world.client.get("/api/v1/todos?queue=chores", headers=alice.auth).json()["todos"]
    assert {t["source"] for t in listed_todos} == {"schedule"} and len(listed_todos) == 2


def test_a_change_and_a_removal(scene, clock):
    world, alice, endpoint = scene
    schedule = add_schedule(world, alice, endpoint, every_seconds=60)
    r = world.client.patch(f"/api/v1/schedules/{schedule['id']}", headers=alice.auth,
                           json={"cron": "0 9 * * 1-5", "timezone": "America/New_York", "queue": "other",
                                 "title": "weekday brief", "catch_up": "none"})
    changed = r.json()
    assert r.status_code == 200, r.text
    assert (changed["cron"], changed["every_seconds"], changed["queue"], changed["catch_up"],
            changed["next_run_at"]) == ("0 9 * * 1-5", None, "other", "none", "2027-01-15T14:00:00.000Z")
    again = add_schedule(world, alice, endpoint, status=409, every_seconds=5)
    assert again["error"] == "conflict" and "name" in again["message"]
    bob = world.human("bob")
    assert world.client.delete(f"/api/v1/schedules/{schedule['id']}", headers=bob.auth).status_code == 404
    gone = world.client.delete(f"/api/v1/schedules/{schedule['id']}", headers=alice.auth)
    assert gone.status_code == 200 and gone.json()["removed"] is True
    assert listed(world, alice, endpoint) == []
    clock.advance(86400 * 7)
    assert world.tick()["scheduled"] == 0


def test_the_board_shows_next_and_last_run_and_the_last_todo_and_pauses_and_resumes(scene, clock):
    world, alice, endpoint = scene
    client = world.client
    schedule = add_schedule(world, alice, endpoint, every_seconds=60, title="sweep the inbox")
    for _ in range(2):
        clock.advance(60)
        world.tick()
    last = schedule_todos(world, alice, schedule["id"])[-1]
    sign_in(client, alice)
    page = client.get("/board/schedules")
    assert page.status_code == 200, page.text
    row = re.search(rf'<tr id="{schedule["id"]}".*?</tr>', page.text, re.S).group(0)
    assert "brief" in row and "every 60 s" in row and "in 1 min" in row and "Pause" in row
    assert f'<a href="/board/todos/{last["id"]}">' in row and iso(T0 + 120_000) in row
    paused = post(client, f"/board/schedules/{schedule['id']}/pause", back="/board/schedules")
    assert paused.status_code == 303, paused.text
    assert listed(world, alice, endpoint)[0]["enabled"] is False
    row = re.search(rf'<tr id="{schedule["id"]}".*?</tr>', client.get("/board/schedules").text, re.S).group(0)
    assert "paused" in row and "Resume" in row
    clock.advance(600)
    assert world.tick()["scheduled"] == 0
    assert post(client, f"/board/schedules/{schedule['id']}/resume", back="/board/schedules").status_code == 303
    assert listed(world, alice, endpoint)[0]["next_run_at"] == iso(clock.ms + 60_000)
    # Without the session's CSRF token, nothing changes.
    assert post(client, f"/board/schedules/{schedule['id']}/pause", token=None).status_code == 403
    assert listed(world, alice, endpoint)[0]["enabled"] is True
    # Another human's schedule is not found, and stays as it is.
    bob = world.human("bob")
    mine = add_schedule(world, bob, world.endpoint(bob, ["chores"]), every_seconds=60)
    assert post(client, f"/board/schedules/{mine['id']}/pause").status_code == 404
    # Its todos on the todo list (their subject) and the todo's page (source schedule), and the subject's page.
    todos_page = client.get("/board/todos").text
    assert f"<code>schedule:{schedule['id']}</code>" in todos_page and last["id"] in todos_page
    assert re.search(r"<dt>Source</dt><dd>schedule", client.get(f"/board/todos/{last['id']}").text)
    subject_page = client.get(f"/board/subjects/schedule:{schedule['id']}")
    assert subject_page.status_code == 200 and last["id"] in subject_page.text


def test_the_cli_adds_lists_pauses_resumes_and_removes_and_refuses_a_bad_cron(db_path):
    assert cli(db_path, "human", "add", "alice")[0] == 0
    code, endpoint = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "lane", "--queues",
                         "chores")
    assert code == 0, endpoint
    before = snapshot(db_path)
    code, refused = cli(db_path, "schedule", "add", endpoint["id"], "--name", "brief", "--queue", "chores",
                        "--title", "brief", "--cron", "0 7 * * * *")
    assert (code, refused["error"]) == (1, "invalid_argument") and refused["message"].startswith("cron:"), refused
    assert snapshot(db_path) == before
    code, made = cli(db_path, "schedule", "add", endpoint["id"], "--name", "brief", "--queue", "chores", "--title",
                     "the brief", "--cron", "30 7 * * 1-5", "--tz", "Europe/Berlin", "--payload", '{"lane": "news"}',
                     "--catch-up", "all")
    assert code == 0 and (made["cron"], made["timezone"], made["catch_up"]) == ("30 7 * * 1-5", "Europe/Berlin",
                                                                               "all"), made
    code, paused = cli(db_path, "schedule", "pause", made["id"])
    assert code == 0 and (paused["enabled"], paused["next_run_at"]) == (False, None)
    code, resumed = cli(db_path, "schedule", "resume", made["id"])
    assert code == 0 and resumed["enabled"] is True and resumed["next_run_at"] is not None
    code, shown = cli(db_path, "schedule", "list", endpoint["id"])
    assert code == 0 and [s["id"] for s in shown["schedules"]] == [made["id"]]
    code, removed = cli(db_path, "schedule", "remove", made["id"])
    assert code == 0 and removed["removed"] is True
    assert cli(db_path, "schedule", "list", endpoint["id"])[1] == {"schedules": []}


def test_a_long_downtime_is_caught_up_without_walking_all_of_it(scene, clock):
    """Down for 400 days: `latest` makes the latest daily time, `all` the latest hundred, found quickly."""
    world, alice, endpoint = scene
    latest = add_schedule(world, alice, endpoint, name="daily", cron="0 9 * * *", catch_up="latest")
    every = add_schedule(world, alice, endpoint, name="minutely", cron="* * * * *", catch_up="all")
    clock.advance(400 * 86400 + 1800)  # 2028-02-19T08:30Z
    world.tick()
    assert due_times(schedule_todos(world, alice, latest["id"])) == ["2028-02-18T09:00:00.000Z"]
    made = due_times(schedule_todos(world, alice, every["id"]))
    assert len(made) == 100 and made[-1] == "2028-02-19T08:30:00.000Z" and made[0] == "2028-02-19T06:51:00.000Z"
