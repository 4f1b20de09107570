"""Schedules on real `serve` processes and the real clock (issue 45, part 1): a schedule every second keeps making
one todo per second, none twice and none skipped, across a server killed and started again, and on Postgres
across the leader killed, or cut off from its lock while it lives on, with the other server taking over.

The schedule is made with the real CLI while the server runs. What each due time made is read from the database
itself: every todo's idempotency key names its due time (schedule:{id}:{due time})."""

from __future__ import annotations

import signal
import time
from datetime import datetime

import pytest
from conftest import ENGINE, LiveServer, cli
from helpers import query
from test_forge_at_most_once import cut_leaders_lock
from test_postgres import leader_of


def every_second(db_path: str) -> str:
    """A human, an endpoint and (through the CLI) a schedule every second on it; the schedule's id."""
    assert cli(db_path, "human", "add", "alice")[0] == 0
    code, endpoint = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "lane", "--queues",
                         "chores")
    assert code == 0, endpoint
    code, schedule = cli(db_path, "schedule", "add", endpoint["id"], "--name", "tick", "--queue", "chores",
                         "--title", "every second", "--every", "1")
    assert code == 0 and schedule["every_seconds"] == 1 and schedule["catch_up"] == "latest", schedule
    return schedule["id"]


def keys(db_path: str) -> list[str]:
    return [key for (key,) in query(db_path, "SELECT idempotency_key FROM todos WHERE source = 'schedule'")]


def wait_for_todos(db_path: str, count: int, servers: list[LiveServer]) -> None:
    deadline = time.monotonic() + 20
    while len(keys(db_path)) < count:
        assert time.monotonic() < deadline, (f"{len(keys(db_path))} of {count} todos made; logs:\n"
                                             + "\n".join(s.logged()[-1500:] for s in servers))
        time.sleep(0.1)


def one_todo_per_second(db_path: str, schedule_id: str) -> None:
    """Every due time from the first made to the last made has exactly one todo."""
    made = keys(db_path)
    assert all(key.startswith(f"schedule:{schedule_id}:") for key in made), made
    seconds = sorted(int(datetime.fromisoformat(key.split(":", 2)[2].replace("Z", "+00:00")).timestamp())
                     for key in made)
    assert len(set(seconds)) == len(seconds), f"a due time made twice: {sorted(made)}"
    assert seconds == list(range(seconds[0], seconds[-1] + 1)), f"a due time skipped: {sorted(made)}"


def test_a_server_killed_and_started_again_neither_repeats_nor_skips_a_second(db_path):
    server = LiveServer(db_path)
    try:
        schedule_id = every_second(db_path)
        wait_for_todos(db_path, 3, [server])
        server.stop(signal.SIGKILL)
        down = len(keys(db_path))
        server = LiveServer(db_path)
        wait_for_todos(db_path, down + 3, [server])
        server.stop()
        one_todo_per_second(db_path, schedule_id)
        assert "Traceback" not in server.log_path.read_text(errors="replace")
    finally:
        server.stop()


@pytest.mark.skipif(ENGINE != "postgres", reason="two servers on one database: SWITCHBOARD_TEST_ENGINE=postgres")
def test_two_servers_make_each_second_once_and_a_new_leader_takes_over_where_the_killed_one_stopped(db_path):
    servers = [LiveServer(db_path), LiveServer(db_path)]
    try:
        schedule_id = every_second(db_path)
        leader = leader_of(db_path, servers)
        other = next(s for s in servers if s is not leader)
        wait_for_todos(db_path, 3, servers)
        leader.proc.send_signal(signal.SIGKILL)
        leader.proc.wait()
        assert leader_of(db_path, servers) is other
        wait_for_todos(db_path, len(keys(db_path)) + 3, servers)
        other.stop()
        one_todo_per_second(db_path, schedule_id)
    finally:
        for server in servers:
            server.stop()


@pytest.mark.skipif(ENGINE != "postgres", reason="two servers on one database: SWITCHBOARD_TEST_ENGINE=postgres")
def test_a_leader_cut_off_from_its_lock_while_it_lives_on_and_the_new_leader_make_each_second_once(db_path):
    servers = [LiveServer(db_path), LiveServer(db_path)]
    try:
        schedule_id = every_second(db_path)
        leader = leader_of(db_path, servers)
        other = next(s for s in servers if s is not leader)
        wait_for_todos(db_path, 3, servers)
        while True:  # the old leader may win the lock back: cut it again until the other holds it
            named = leader.logged().count(") is the leader")
            cut_leaders_lock(db_path)
            deadline = time.monotonic() + 15
            while leader.logged().count(") is the leader") <= named:
                assert time.monotonic() < deadline, "no leader again"
                time.sleep(0.1)
            if leader_of(db_path, servers) is other:
                break
        assert leader.proc.poll() is None, "the old leader lives on"
        wait_for_todos(db_path, len(keys(db_path)) + 3, servers)
        for server in servers:
            server.stop()
        one_todo_per_second(db_path, schedule_id)
    finally:
        for server in servers:
            server.stop()
