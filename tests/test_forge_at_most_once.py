"""At most once across a crash (issue 43, item 1): a comment in flight when its server dies (the forge stored it,
the answer never came back) is not posted again by the server that sends next, on either engine.

Real `serve` processes, killed with SIGKILL while the forge of tests/forges.py holds the comment's answer after
storing it. The attempt was recorded before the request, so whoever sends next looks for the comment's marker
among the issue's comments and records the one it finds. The send's lease (SEND_LEASE_MS, which keeps other
senders off while a request may still reach the forge) is moved into the past instead of being waited out, as
test_postgres moves a claim's lease."""

from __future__ import annotations

import signal
import threading
import uuid

import httpx
import producers
import pytest
from conftest import ENGINE, LiveServer, cli
from forges import REPO, RULES, FakeForge
from helpers import make_webhook, post_delivery, query
from test_postgres import leader_of

TOKEN = "ghp_" + "Cr4shT0ken" * 4
BOT = "switchboard-bot"
SERVE_FLAGS = ("--ingest-rate", "0", "--notify-allow-private")


class Principal:
    def __init__(self, token: str):
        self.auth = {"Authorization": f"Bearer {token}"}


class StoreThenStall:
    """A plan step: the forge stores the comment, then holds its answer until released (the server is killed
    meanwhile: the answer is lost)."""

    def __init__(self, forge: FakeForge):
        self.forge, self.stored, self.release = forge, threading.Lock(), threading.Event()
        self.held = 0

    def __call__(self, request: dict):
        with self.stored:
            answer = self.forge.answer(request)
            self.held += 1
        self.release.wait(60)
        return answer


@pytest.fixture
def github():
    forge = FakeForge("github", TOKEN, BOT)
    forge.handle_error = lambda request, address: None  # a held answer written, once released, to a dead server
    yield forge
    forge.stop()


def comments_in_flight(db_path: str, server: LiveServer, forge: FakeForge, issues: range) -> tuple[StoreThenStall,
                                                                                                    list[str]]:
    """A webhook writing through a connection to `forge`, one triage todo per issue completed with a comment; the
    forge stores each comment and holds its answer. The todos' ids, once every comment is stored."""
    code, made = cli(db_path, "human", "add", f"h{uuid.uuid4().hex[:6]}")
    assert code == 0, made
    human = Principal(made["token"])
    stall = StoreThenStall(forge)
    with httpx.Client(base_url=server.url, headers=human.auth, timeout=10) as client:
        endpoint = client.post("/api/v1/endpoints", json={"name": "lanes", "queues": ["triage", "lane-s"],
                                                          "verbs": ["all"]}).json()
        worker = Principal(endpoint["token"])
        hook = make_webhook(client, human, endpoint["id"], "github", "triage")
        assert client.put(f"/api/v1/webhooks/{hook['id']}/rules", json=RULES).status_code == 200
        connection = client.post("/api/v1/connections", json={"kind": "github", "api_url": forge.api,
                                                               "token": TOKEN, "repos": ["acme/"]})
        assert connection.status_code == 201, connection.text
        assert client.put(f"/api/v1/webhooks/{hook['id']}/connection",
                          json={"connection_id": connection.json()["id"]}).status_code == 200
        forge.plan = [stall] * len(issues)
        todos = []
        for number in issues:
            forge.issue(REPO, number)
            raw, headers = producers.github("issues.opened", hook["secret"], {
                "issue": {"number": number, "title": "Spelling error", "labels": [], "user": {"login": "Codertocat"},
                          "pull_request": None}, "repository": {"full_name": REPO}, "sender": {"login": "Codertocat"}})
            opened = post_delivery(client, hook, raw, headers).json()
            [todo] = opened["todos"]
            lease = client.post(f"/api/v1/todos/{todo['id']}/claim", headers=worker.auth, json={}).json()
            done = client.post(f"/api/v1/todos/{todo['id']}/complete", headers=worker.auth, json={
                "lease_token": lease["lease_token"], "outputs": [{"type": "comment", "body": f"Fixed #{number}"}]})
            assert done.status_code == 200, done.text
            todos.append(todo["id"])
    forge.wait_for(lambda: stall.held == len(issues), what="every comment stored and its answer held")
    return stall, todos


def outputs_of(db_path: str, todos: list[str]) -> list[tuple]:
    marks = ", ".join("?" * len(todos))
    return query(db_path, f"SELECT id, state, attempts, forge_id FROM forge_outputs WHERE todo_id IN ({marks})"
                          f" ORDER BY id", tuple(todos))


def lease_run_out(db_path: str, todos: list[str]) -> None:
    """The in-flight sends' lease moved into the past (it lasts longer than a test should wait), and the senders
    told an outbox changed, as a commit tells them."""
    marks = ", ".join("?" * len(todos))
    sql = f"UPDATE forge_outputs SET next_at = 1 WHERE state = 'pending' AND todo_id IN ({marks})"
    if db_path.startswith("postgresql://"):
        import psycopg

        from switchboard.postgres import OUTBOX_CHANNEL, dialect_sql
        with psycopg.connect(db_path, autocommit=True) as conn:
            conn.execute(dialect_sql(sql), tuple(todos))
            conn.execute(f"NOTIFY {OUTBOX_CHANNEL}")
    else:
        import sqlite3
        conn = sqlite3.connect(db_path, timeout=10)
        try:
            with conn:
                conn.execute(sql, tuple(todos))
        finally:
            conn.close()


def exactly_one_comment_each(db_path: str, forge: FakeForge, issues: range, todos: list[str]) -> None:
    """Each output sent, recorded as the one comment the forge holds with its marker; no comment posted twice."""
    forge.wait_for(lambda: all(state == "sent" for _, state, _, _ in outputs_of(db_path, todos)), seconds=20,
                   what="every output recorded as sent")
    outputs = outputs_of(db_path, todos)
    for output_id, _, attempts, forge_id in outputs:
        marked = [(number, c["id"]) for number in issues for c in forge.comments(REPO, number)
                  if f"<!-- switchboard:{output_id} -->" in c["body"]]
        assert len(marked) == 1, f"{output_id}: {len(marked)} comments carry its marker: {marked}"
        assert (str(marked[0][1]), attempts) == (forge_id, 2), (output_id, attempts, forge_id, marked)
    posts = [r for r in forge.requests if r["method"] == "POST" and r["path"].endswith("/comments")]
    assert len(posts) == len(issues), f"{len(posts)} comment posts for {len(issues)} comments"


def test_a_comment_in_flight_when_the_server_is_killed_is_not_posted_again_after_the_restart(db_path, github):
    server = LiveServer(db_path, *SERVE_FLAGS)
    stall = None
    try:
        stall, todos = comments_in_flight(db_path, server, github, range(1, 3))
        # The attempt is on record before the forge answered.
        assert [(state, attempts) for _, state, attempts, _ in outputs_of(db_path, todos)] == [("pending", 1)] * 2
        server.stop(signal.SIGKILL)
        lease_run_out(db_path, todos)
        server = LiveServer(db_path, *SERVE_FLAGS)
        exactly_one_comment_each(db_path, github, range(1, 3), todos)
        assert "Traceback" not in server.logged()
    finally:
        if stall is not None:
            stall.release.set()
        server.stop()


@pytest.mark.skipif(ENGINE != "postgres", reason="two servers on one database: SWITCHBOARD_TEST_ENGINE=postgres")
def test_the_leader_killed_with_eight_comments_in_flight_and_the_new_leader_posts_none_again(db_path, github):
    servers = [LiveServer(db_path, *SERVE_FLAGS), LiveServer(db_path, *SERVE_FLAGS)]
    stall = None
    try:
        leader = leader_of(db_path, servers)
        other = next(s for s in servers if s is not leader)
        stall, todos = comments_in_flight(db_path, other, github, range(1, 9))
        leader.proc.send_signal(signal.SIGKILL)
        leader.proc.wait()
        assert leader_of(db_path, servers) is other
        lease_run_out(db_path, todos)
        exactly_one_comment_each(db_path, github, range(1, 9), todos)
    finally:
        if stall is not None:
            stall.release.set()
        for server in servers:
            server.stop()


def cut_leaders_lock(db_path: str) -> None:
    """End the session that holds the leader's advisory lock (its process lives on): Postgres lets go of the lock."""
    import psycopg

    from switchboard.postgres import LEADER_LOCK
    with psycopg.connect(db_path, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                     " AND classid = %s AND objid = %s AND objsubid = 1",
                     ((LEADER_LOCK >> 32) & 0xFFFFFFFF, LEADER_LOCK & 0xFFFFFFFF))


@pytest.mark.skipif(ENGINE != "postgres", reason="two servers on one database: SWITCHBOARD_TEST_ENGINE=postgres")
def test_a_leader_cut_off_from_its_lock_with_comments_in_flight_and_the_new_leader_posts_none_again(db_path, github):
    """The old leader lives on, its requests still held by the forge; the other server leads (its lock's session
    is ended until the other one has taken the lock) and, once the sends' lease is over, finds each comment by its
    marker. The old leader's answers, arriving last, change nothing."""
    servers = [LiveServer(db_path, *SERVE_FLAGS), LiveServer(db_path, *SERVE_FLAGS)]
    stall = None
    try:
        leader = leader_of(db_path, servers)
        other = next(s for s in servers if s is not leader)
        stall, todos = comments_in_flight(db_path, other, github, range(1, 9))
        while True:  # the old leader may win the lock back: cut it again until the other holds it
            named = leader.logged().count(") is the leader")
            cut_leaders_lock(db_path)
            github.wait_for(lambda: leader.logged().count(") is the leader") > named, what="a leader again")
            if leader_of(db_path, servers) is other:
                break
        assert leader.proc.poll() is None, "the old leader lives on"
        lease_run_out(db_path, todos)
        exactly_one_comment_each(db_path, github, range(1, 9), todos)
    finally:
        if stall is not None:
            stall.release.set()
        for server in servers:
            server.stop()
