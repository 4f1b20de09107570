"""Several Switchboard processes on one Postgres database keep SQLite mode's promises: one claim per todo, a
delivery recorded once, a doorbell that rings one session, one leader that another replaces when it dies, counts
that equal the rows, and the operations that differ (the key, synchronous_commit, check, migrate, backup).
Real servers (`switchboard.py serve`) on a cluster the tests start themselves; the Postgres run only."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import psycopg
import pytest
from conftest import ENGINE, ROOT, LiveServer, ManualClock, World, cli
from helpers import make_webhook, post_delivery
from producers import github
from starlette.testclient import TestClient
from test_notify import Receiver

import switchboard.flows as flows_module
from switchboard.app import create_app
from switchboard.board.queries import board_sign_in
from switchboard.configuration import SCHEMA_VERSION
from switchboard.postgres import LEADER_LOCK, Postgres
from switchboard.store.principals import add_human

pytestmark = pytest.mark.skipif(ENGINE != "postgres", reason="about Postgres mode: SWITCHBOARD_TEST_ENGINE=postgres")


class Principal:
    def __init__(self, token: str, id_: str):
        self.id = id_
        self.auth = {"Authorization": f"Bearer {token}"}


# No ingest limits (the races send a hundred deliveries at once); notifications may go to the loopback receiver.
SERVE_FLAGS = ("--ingest-rate", "0", "--notify-allow-private")


@pytest.fixture
def two_servers(db_path):
    """Two server processes on one database, each with its own pool, leader election and ring listener."""
    servers = [LiveServer(db_path, *SERVE_FLAGS), LiveServer(db_path, *SERVE_FLAGS)]
    yield servers
    for server in servers:
        server.stop()


def setup_endpoint(db_path: str, server: LiveServer, queues=("q",), lease: int | None = None,
                   human: Principal | None = None):
    if human is None:
        db = Postgres(db_path)
        try:
            made = db.write_sync(add_human, f"h{uuid.uuid4().hex[:6]}")
        finally:
            db.close()
        human = Principal(made["token"], made["id"])
    body = {"name": f"ep-{uuid.uuid4().hex[:6]}", "queues": list(queues)}
    if lease:
        body["default_lease_seconds"] = lease
    r = httpx.post(f"{server.url}/api/v1/endpoints", headers=human.auth, json=body)
    assert r.status_code == 201, r.text
    return human, Principal(r.json()["token"], r.json()["id"])


def query(db_path: str, sql: str, params=()):
    with psycopg.connect(db_path) as conn:
        return conn.execute(sql, params).fetchall()


def leader_of(db_path: str, servers: list[LiveServer], timeout: float = 15) -> LiveServer:
    """The server whose process holds the leader's lock now: the last process the shared log names as leader,
    found by its pid in the processes table."""
    deadline = time.monotonic() + timeout
    while True:
        named = re.findall(r"this process \((pr_\w+)\) is the leader", servers[0].logged())
        pids = {pid for (pid,) in query(db_path, "SELECT pid FROM processes WHERE id = %s", (named[-1],))} if named else set()
        leader = [s for s in servers if s.proc.poll() is None and s.proc.pid in pids]
        if leader:
            return leader[0]
        assert time.monotonic() < deadline, "no live server became the leader"
        time.sleep(0.2)


def rings_heard(servers: list[LiveServer]) -> int:
    """The rings a session heard when a todo was pushed (those passed on from one waiting claim to the next left
    out), summed over the servers' /metrics."""
    total = 0
    for server in servers:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        total += int(float(re.search(r'^switchboard_doorbell_rings_total\{heard="true"\} (\S+)$', text, re.M)[1]))
        total -= int(float(re.search(r"^switchboard_doorbell_rings_passed_on_total (\S+)$", text, re.M)[1]))
    return total


def test_workers_on_two_servers_claim_each_todo_once(db_path, two_servers):
    """2 × 8 workers, each server's half pushing and then draining 2,000 todos with complete-and-claim-next."""
    human, endpoint = setup_endpoint(db_path, two_servers[0])
    total = 2000

    def push(i: int) -> None:
        with httpx.Client(base_url=two_servers[i % 2].url, headers=human.auth, timeout=30) as c:
            for n in range(i, total, 16):
                assert c.post(f"/api/v1/endpoints/{endpoint.id}/todos", json={"title": f"t{n}", "queue": "q"}
                              ).status_code == 201

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(push, range(16)))
    claimed: list[str] = []
    lock = threading.Lock()

    def worker(server: LiveServer) -> None:
        with httpx.Client(base_url=server.url, headers=endpoint.auth, timeout=30) as c:
            r = c.post("/api/v1/todos/claim", json={})
            while True:
                assert r.status_code == 200, r.text
                if r.json().get("empty"):
                    return
                todo = r.json()["todo"]["id"]
                with lock:
                    claimed.append(todo)
                done = c.post(f"/api/v1/todos/{todo}/complete",
                              json={"lease_token": r.json()["lease_token"], "claim_next": {}})
                assert done.status_code == 200, done.text
                r = httpx.Response(200, json=done.json()["next"])

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(worker, [two_servers[i % 2] for i in range(16)]))
    assert len(claimed) == total and len(set(claimed)) == total
    assert query(db_path, "SELECT count(*) FROM attempts")[0][0] == total
    assert query(db_path, "SELECT state, count(*) FROM todos GROUP BY state") == [("done", total)]
    counts = dict(query(db_path, "SELECT state, n FROM todo_counts WHERE n > 0"))
    assert counts == {"done": total}


def test_one_delivery_sent_to_both_servers_is_recorded_once(db_path, two_servers):
    human, endpoint = setup_endpoint(db_path, two_servers[0])
    with httpx.Client(base_url=two_servers[0].url) as c:
        hook = make_webhook(c, human, endpoint.id, "github", "q")
    raw, headers = github("issues.opened", hook["secret"], {"issue": {"number": 1}}, delivery="the-one")

    def send(server: LiveServer):
        with httpx.Client(base_url=server.url, timeout=30) as c:
            return post_delivery(c, hook, raw, headers)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(send, [two_servers[i % 2] for i in range(100)]))
    assert {a.status_code for a in answers} == {202}, [a.text for a in answers if a.status_code != 202]
    assert sum(1 for a in answers if not a.json().get("duplicate")) == 1
    assert len({a.json()["event_id"] for a in answers}) == 1
    assert query(db_path, "SELECT count(*) FROM events WHERE webhook_id = %s", (hook["id"],))[0][0] == 1
    assert query(db_path, "SELECT count(*) FROM todos WHERE endpoint_id = %s", (endpoint.id,))[0][0] == 1


def test_fifty_deliveries_about_one_subject_over_both_servers_mint_one_todo(db_path, two_servers):
    human, endpoint = setup_endpoint(db_path, two_servers[0], queues=("lane",))
    with httpx.Client(base_url=two_servers[0].url) as c:
        hook = make_webhook(c, human, endpoint.id, "github", "lane", trusted_actors={"allow_all": True})
        rules = {"rules": [{"id": "once", "expr": '.source == "github"', "action": {"queue": "lane", "once": True}}]}
        assert c.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=human.auth, json=rules).status_code == 200
    deliveries = [github("issues.edited", hook["secret"], {"issue": {"number": 12}, "changes": {"body": {"from": f"v{n}"}}},
                         delivery=f"e-{n}") for n in range(50)]
    go = threading.Barrier(16)

    def send(args):
        i, (raw, headers) = args
        with httpx.Client(base_url=two_servers[i % 2].url, timeout=30) as c:
            if i < 16:
                go.wait(10)
            return post_delivery(c, hook, raw, headers)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(send, enumerate(deliveries)))
    assert {a.status_code for a in answers} == {202}
    assert sum(a.json()["created"] for a in answers) == 1, [a.json() for a in answers]
    assert sorted(a.json()["disposition"] for a in answers) == ["repeat"] * 49 + ["routed"]
    assert query(db_path, "SELECT count(*) FROM events WHERE webhook_id = %s", (hook["id"],))[0][0] == 50
    assert query(db_path, "SELECT count(*) FROM todos WHERE endpoint_id = %s", (endpoint.id,))[0][0] == 1
    assert query(db_path, "SELECT count(*) FROM routing_once WHERE webhook_id = %s", (hook["id"],))[0][0] == 1


def test_waiting_claims_on_both_servers_get_distinct_todos_and_one_ring_each(db_path, two_servers):
    human, endpoint = setup_endpoint(db_path, two_servers[0])
    got: list[str] = []
    lock = threading.Lock()
    heard_before = rings_heard(two_servers)

    def wait_once(server: LiveServer) -> None:
        with httpx.Client(base_url=server.url, headers=endpoint.auth, timeout=30) as c:
            r = c.post("/api/v1/todos/claim", json={"wait_seconds": 15})
            assert r.status_code == 200, r.text
            if not r.json().get("empty"):
                with lock:
                    got.append(r.json()["todo"]["id"])

    waiters = [threading.Thread(target=wait_once, args=(two_servers[i % 2],)) for i in range(6)]
    for thread in waiters:
        thread.start()
    # Push as soon as both processes published their parked claims (the rings then go by NOTIFY), well before
    # a claim's poll (every 2 s, the fallback for a lost ring) could take a todo without one.
    deadline = time.monotonic() + 10
    while query(db_path, "SELECT count(DISTINCT process_id) FROM ring_listeners WHERE endpoint_id = %s AND waiting = 1",
                (endpoint.id,))[0][0] < 2:
        assert time.monotonic() < deadline, "the waiting claims were never published"
        time.sleep(0.02)
    pushed_at = time.monotonic()
    with httpx.Client(base_url=two_servers[0].url, headers=human.auth) as c:
        for i in range(6):
            assert c.post(f"/api/v1/endpoints/{endpoint.id}/todos", json={"title": f"w{i}", "queue": "q"}
                          ).status_code == 201
    for thread in waiters:
        thread.join()
    assert len(got) == 6 and len(set(got)) == 6
    assert time.monotonic() - pushed_at < 10
    # One ring per todo across both processes (a broadcast, each process ringing its own, would ring 12). A ring
    # may go unheard when it reaches a process whose last waiting claim was just served: the poll then finds it.
    assert rings_heard(two_servers) - heard_before <= 6, "no todo rang more than one session"


def test_the_leader_dies_and_another_reaps_a_lapsed_lease_and_sends_each_notification_once(db_path, two_servers):
    rx = Receiver()
    try:
        leader = leader_of(db_path, two_servers)
        other = next(s for s in two_servers if s is not leader)
        human, endpoint = setup_endpoint(db_path, other)
        hooks = []
        with httpx.Client(base_url=other.url) as c:
            for topic in ("before", "after"):  # two humans: each channel's first message goes out at once
                someone, owned = setup_endpoint(db_path, other)
                r = c.post("/api/v1/notify", headers=someone.auth,
                           json={"kind": "ntfy", "url": rx.url(f"/{topic}"), "events": ["held"]})
                assert r.status_code == 201, r.text
                hooks.append((someone, make_webhook(c, someone, owned.id, "github", "q", trusted_actors=None)))
            assert c.post(f"/api/v1/endpoints/{endpoint.id}/todos", headers=human.auth,
                          json={"title": "lapses", "queue": "q"}).status_code == 201
            claim = c.post("/api/v1/todos/claim", headers=endpoint.auth, json={}).json()

            def hold(hook: dict) -> None:  # the trust gate holds a stranger's delivery: one "held" message
                raw, headers = github("issues.opened", hook["secret"], {"sender": {"login": "stranger"}})
                assert post_delivery(c, hook, raw, headers).json()["disposition"] == "quarantined"

            hold(hooks[0][1])  # taken by the non-leader; the leader sends it
            rx.wait_for(1, timeout=15)
        # Once it is marked sent (a leader killed between sending and marking sends again: at least once).
        deadline = time.monotonic() + 10
        while query(db_path, "SELECT count(*) FROM notify_outbox WHERE sent_at IS NULL")[0][0]:
            assert time.monotonic() < deadline, "the first message was never marked sent"
            time.sleep(0.05)
        leader.proc.send_signal(signal.SIGKILL)
        leader.proc.wait()
        with httpx.Client(base_url=other.url) as c:
            hold(hooks[1][1])  # taken by the one left, the leader within seconds
        # The shortest lease is a minute: the claim's lease is moved into the past instead of waiting one out.
        with psycopg.connect(db_path, autocommit=True) as conn:
            conn.execute("UPDATE todos SET lease_expires_at = 1 WHERE id = %s", (claim["todo"]["id"],))
            conn.execute("UPDATE attempts SET lease_expires_at = 1 WHERE todo_id = %s", (claim["todo"]["id"],))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            state = query(db_path, "SELECT state FROM todos WHERE id = %s", (claim["todo"]["id"],))[0][0]
            if state == "pending":
                break
            time.sleep(0.2)
        assert state == "pending", "no process reaped the lapsed lease within 10 s of the leader's death"
        assert leader_of(db_path, two_servers) is other
        rx.wait_for(2, timeout=15)
        time.sleep(1.5)  # a second sender would have sent by now
        assert sorted(r.path for r in rx.requests) == ["/after", "/before"], "each notification sent once"
        assert query(db_path, "SELECT count(*) FROM notify_outbox WHERE sent_at IS NULL")[0][0] == 0
    finally:
        rx.close()


def test_the_ring_thread_reads_the_change_marker_and_looks_less_often_when_all_is_quiet(db_path):
    """A listening process reads the change marker on its ring thread (the scheduler's look is then no round trip)
    and tells the loop when it moved: another process's commit reaches the Board's streams within about a second.
    Quiet (no move for quiet_after_seconds, no live view open), it looks only every quiet_look_seconds; a live view
    that opens brings the next look within a second, and the looks stay at one a second while it is open."""
    other = Postgres(db_path)
    human = other.write_sync(add_human, "looker")
    app = create_app(db_path, background=True)
    told: list[float] = []

    def sign_in_elsewhere() -> None:
        other.write_sync(board_sign_in, human["token"])

    def told_after(n: int, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while len(told) <= n and time.monotonic() < deadline:
            time.sleep(0.02)
        return len(told) > n

    try:
        with TestClient(app):
            db, flows = app.state.db, app.state.flows
            wake_scheduler = db.on_change
            db.on_change = lambda: (told.append(time.monotonic()), wake_scheduler())
            deadline = time.monotonic() + 10
            while not db.change_marker_at_hand:
                assert time.monotonic() < deadline, "the ring thread never read the change marker"
                time.sleep(0.05)
            n = len(told)
            sign_in_elsewhere()
            assert told_after(n, 10), "another process's commit is told within about a second"
            assert db.change_marker() == other.change_marker()

            db.quiet_after_seconds, db.quiet_look_seconds = 0.5, 3600.0
            time.sleep(2.0)  # a look past quiet_after_seconds saw no move: the next is an hour away
            n = len(told)
            sign_in_elsewhere()
            assert not told_after(n, 2.5), f"quiet, yet a look came {told[-1] - told[n - 1]:.1f} s after the last"
            assert db.change_marker() != other.change_marker(), "the marker at hand is the last look's"

            streamed: list[float] = []
            flows.changes.subscribe(lambda: streamed.append(time.monotonic()))  # a Board stream opens
            assert told_after(n, 10), "a live view that opens brings the next look within a second"
            deadline = time.monotonic() + 10
            while not streamed:
                assert time.monotonic() < deadline, "the stream was never told of the move"
                time.sleep(0.02)
            time.sleep(2.0)
            n = len(told)
            sign_in_elsewhere()
            assert told_after(n, 10), "while a live view is open the looks stay at one a second"
    finally:
        other.close()


def test_db_listen_takes_listen_and_the_leaders_lock_on_a_connection_of_its_own(db_path):
    """`--db-listen URL`: the sessions LISTEN and the advisory lock need go to that URL (a role of its own here,
    as a direct connection would beside a transaction pooler's), every transaction to --db's."""
    with psycopg.connect(db_path, autocommit=True) as conn:
        conn.execute("DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'listener') THEN"
                     " CREATE ROLE listener LOGIN SUPERUSER; END IF; END $$")
    listen_url = db_path.replace("postgresql://postgres@", "postgresql://listener@")
    server = LiveServer(db_path, "--db-listen", listen_url)
    try:
        deadline = time.monotonic() + 10
        while True:
            sessions = query(db_path, "SELECT a.query, l.locktype FROM pg_stat_activity a LEFT JOIN pg_locks l"
                                      " ON l.pid = a.pid AND l.locktype = 'advisory' AND l.granted"
                                      " WHERE a.usename = 'listener' AND a.datname = current_database()")
            if len(sessions) == 2 and any(lock for _, lock in sessions):
                break
            assert time.monotonic() < deadline, sessions
            time.sleep(0.2)
        assert len(sessions) == 2, "the ring listener and the leader, nothing else"
        assert query(db_path, "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                              " WHERE l.locktype = 'advisory' AND l.granted AND a.usename <> 'listener'"
                              " AND a.datname = current_database()")[0][0] == 0
        human, endpoint = setup_endpoint(db_path, server)
        with httpx.Client(base_url=server.url) as c:
            waiting = concurrent.futures.ThreadPoolExecutor(1).submit(
                c.post, "/api/v1/todos/claim", headers=endpoint.auth, json={"wait_seconds": 10}, timeout=30)
            time.sleep(1)
            assert c.post(f"/api/v1/endpoints/{endpoint.id}/todos", headers=human.auth,
                          json={"title": "rung", "queue": "q"}).status_code == 201
            assert waiting.result(timeout=20).json()["todo"]["title"] == "rung"
        bad = subprocess.run([sys.executable, str(ROOT / "switchboard.py"), "serve", "--db", db_path, "--port", "1",
                              "--db-listen", "/tmp/not-a-url"], capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and "--db-listen takes a postgresql:// URL" in bad.stderr
    finally:
        server.stop()


def test_kill_of_a_server_during_a_fan_out_storm_leaves_whole_events(db_path, two_servers):
    human, endpoint = setup_endpoint(db_path, two_servers[0], queues=("a",))
    twins = [setup_endpoint(db_path, two_servers[0], queues=("a",), human=human)[1] for _ in range(2)]
    with httpx.Client(base_url=two_servers[0].url) as c:
        hook = make_webhook(c, human, endpoint.id, "github", "a")
        for twin in twins:
            assert c.post(f"/api/v1/webhooks/{hook['id']}/routes", headers=human.auth,
                          json={"endpoint_id": twin.id}).status_code == 201
    accepted: list[str] = []
    victim = two_servers[1]

    def send(n: int) -> None:
        raw, headers = github("issues.opened", hook["secret"], {"issue": {"number": n}}, delivery=f"s-{n}")
        with httpx.Client(base_url=victim.url, timeout=10) as c:
            try:
                if post_delivery(c, hook, raw, headers).status_code == 202:
                    accepted.append(f"s-{n}")
            except httpx.HTTPError:
                pass

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(send, n) for n in range(300)]
        while len(accepted) < 60:
            time.sleep(0.01)
        victim.proc.send_signal(signal.SIGKILL)
        concurrent.futures.wait(futures)
    per_event = query(db_path, "SELECT e.delivery_key, count(t.id) FROM events e LEFT JOIN todos t"
                               " ON t.event_id = e.id WHERE e.webhook_id = %s GROUP BY e.delivery_key", (hook["id"],))
    assert per_event and {n for _, n in per_event} == {3}, per_event
    recorded = {key for key, _ in per_event}
    assert all(any(key.endswith(d) for key in recorded) for d in accepted), "a 202 is missing from the database"


def test_counts_equal_the_rows_after_a_storm_of_verbs(db_path, two_servers):
    human, endpoint = setup_endpoint(db_path, two_servers[0], queues=("x", "y"))

    def storm(i: int) -> None:
        server = two_servers[i % 2]
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for n in range(15):
                c.post(f"/api/v1/endpoints/{endpoint.id}/todos", headers=human.auth,
                       json={"title": f"{i}-{n}", "queue": "xy"[n % 2]})
                r = c.post("/api/v1/todos/claim", headers=endpoint.auth, json={})
                if r.json().get("empty"):
                    continue
                todo, token = r.json()["todo"]["id"], r.json()["lease_token"]
                verb = ("complete", "fail", "release")[n % 3]
                c.post(f"/api/v1/todos/{todo}/{verb}", headers=endpoint.auth,
                       json={"lease_token": token, **({"error": "x"} if verb == "fail" else {})})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(storm, range(8)))
    counted = {tuple(r[:3]): r[3] for r in query(db_path, "SELECT endpoint_id, queue, state, n FROM todo_counts"
                                                          " WHERE n > 0")}
    rows = {tuple(r[:3]): r[3] for r in query(db_path, "SELECT endpoint_id, queue, state, count(*) FROM todos"
                                                       " GROUP BY endpoint_id, queue, state")}
    assert counted == rows


def test_two_processes_starting_together_migrate_once(postgres_databases, tmp_path):
    url = postgres_databases.cluster.create_database(f"empty_{uuid.uuid4().hex[:8]}")
    code = ("import sys; from switchboard.postgres import Postgres; Postgres(sys.argv[1]).close()")
    procs = [subprocess.Popen([sys.executable, "-c", code, url], cwd=ROOT, stderr=subprocess.PIPE)
             for _ in range(4)]
    for proc in procs:
        assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()
    assert query(url, "SELECT version FROM switchboard_schema") == [(SCHEMA_VERSION,)]


def test_serve_refuses_synchronous_commit_off(db_path):
    with psycopg.connect(db_path, autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE {db_path.rsplit('/', 1)[1]} SET synchronous_commit = off")
    server = LiveServer(db_path, wait=False)
    assert server.proc.wait(timeout=30) != 0
    assert "synchronous_commit off" in server.logged()
    server.stop()


def test_check_reports_the_engine_the_processes_and_their_clocks(db_path, two_servers):
    time.sleep(2.5)  # both processes have beaten once
    code, report = cli(db_path, "check")
    assert code == 0, report
    assert report["engine"] == "postgres" and report["synchronous_commit"] == "on"
    assert len(report["processes"]) == 2 and report["clock_skew_ms"] < 2000


def test_a_url_needs_a_named_key_and_backup_points_at_pg_dump(db_path, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("SWITCHBOARD_KEY_FILE", "SWITCHBOARD_SECRET_KEY")}
    done = subprocess.run([sys.executable, str(ROOT / "switchboard.py"), "serve", "--db", db_path, "--port", "1"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode != 0 and "--key-file" in done.stderr
    code, answer = cli(db_path, "backup", str(tmp_path / "copy.db"))
    assert code == 1 and "pg_dump" in answer["message"]


def test_migrate_to_copies_a_sqlite_file_into_postgres_and_back(postgres_databases, tmp_path, monkeypatch):
    """A used SQLite database (principals, a signed webhook, a routed delivery and its subject, todos done,
    claimed and pending) copied into Postgres serves the same answers with the same key; copied back into a new
    file it is the same database, row for row."""
    monkeypatch.delenv("SWITCHBOARD_KEY_FILE", raising=False)
    source = str(tmp_path / "switchboard.db")
    app = create_app(source, clock=ManualClock(), background=False)
    with TestClient(app) as client:
        world = World(client, app.state.db)
        alice = world.human("alice")
        agent = world.endpoint(alice, ["triage", "build"])
        hook = world.webhook(alice, agent, "github", "triage")
        raw, headers = github("issues.opened", hook["secret"], {"issue": {"number": 7}}, delivery="m-1")
        assert world.deliver(hook, raw, headers).status_code == 202
        for n in range(5):
            world.push(alice, agent, "build", f"b{n}")
        done = world.claim(agent)
        assert world.act(agent, done["todo"]["id"], "complete", lease_token=done["lease_token"]).status_code == 200
        world.claim(agent)
        before = client.get("/api/v1/todos", headers=alice.auth).json()
    url = postgres_databases.cluster.create_database(f"copy_{uuid.uuid4().hex[:8]}")
    code, answer = cli(source, "migrate-to", url)
    assert code == 0, answer
    assert answer["rows"]["todos"] == 6 and answer["rows"]["webhooks"] == 1 and answer["rows"]["subjects"] == 1
    monkeypatch.setenv("SWITCHBOARD_KEY_FILE", str(tmp_path / "switchboard.key"))
    app = create_app(url, clock=ManualClock(), background=False)
    with TestClient(app) as client:
        assert client.get("/api/v1/todos", headers=alice.auth).json() == before
        again = github("issues.opened", hook["secret"], {"issue": {"number": 7}}, delivery="m-1")
        assert post_delivery(client, hook, *again).json()["duplicate"] is True  # the secret opens, dedup holds
        assert client.post("/api/v1/todos/claim", headers=agent.auth, json={}).status_code == 200
        after_claim = client.get("/api/v1/todos", headers=alice.auth).json()
    back = str(tmp_path / "back.db")
    code, answer = cli(url, "migrate-to", back)
    assert code == 0, answer
    app = create_app(back, clock=ManualClock(), background=False)
    with TestClient(app) as client:
        assert client.get("/api/v1/todos", headers=alice.auth).json() == after_claim
    code, answer = cli(source, "migrate-to", url)
    assert code == 1 and "not empty" in answer["message"]


def test_claims_racing_over_lapsed_leases_expire_each_once(db_path, two_servers):
    """After a crash every lease lapses at once, and every claim reaps its endpoint's lapsed leases first: 16
    claims on two servers reap 40 of them together, and each is expired once (its attempt ended once, counted out
    of `claimed` once), never a 500. The leader's sweep reaps lapsed leases too and races the claims: leases it
    holds are skipped by the claims (and by the count read right after them) until it commits, so the counts are
    read once no lapsed lease is left."""
    human, endpoint = setup_endpoint(db_path, two_servers[0])
    with httpx.Client(base_url=two_servers[0].url) as c:
        for i in range(40):
            assert c.post(f"/api/v1/endpoints/{endpoint.id}/todos", headers=human.auth,
                          json={"title": f"l{i}", "queue": "q"}).status_code == 201
            assert "todo" in c.post("/api/v1/todos/claim", headers=endpoint.auth, json={}).json()
    with psycopg.connect(db_path, autocommit=True) as conn:
        conn.execute("UPDATE todos SET lease_expires_at = 1 WHERE state = 'claimed'")
        conn.execute("UPDATE attempts SET lease_expires_at = 1 WHERE ended_at IS NULL")
    go = threading.Barrier(16)

    def claim(i: int) -> list[int]:
        codes = []
        with httpx.Client(base_url=two_servers[i % 2].url, headers=endpoint.auth, timeout=30) as c:
            go.wait(10)
            for _ in range(4):
                codes.append(c.post("/api/v1/todos/claim", json={}).status_code)
        return codes

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        codes = [code for answer in pool.map(claim, range(16)) for code in answer]
    assert set(codes) == {200}, codes
    deadline = time.monotonic() + 15
    while lapsed := query(db_path, "SELECT count(*) FROM todos WHERE state = 'claimed' AND lease_expires_at = 1")[0][0]:
        assert time.monotonic() < deadline, f"{lapsed} lapsed leases were never reaped"
        time.sleep(0.05)
    assert query(db_path, "SELECT count(*) FROM attempts WHERE outcome = 'lease_expired'")[0][0] == 40
    assert query(db_path, "SELECT count(*) FROM todos WHERE attempt = 2")[0][0] == query(
        db_path, "SELECT count(*) FROM todos WHERE state = 'claimed'")[0][0]
    counted = dict(query(db_path, "SELECT state, n FROM todo_counts WHERE n <> 0"))
    assert counted == dict(query(db_path, "SELECT state, count(*) FROM todos GROUP BY state"))


def test_a_process_that_becomes_the_leader_after_its_first_looks_ticks_at_once(db_path, monkeypatch):
    """The leader's lock may come after the scheduler's first looks (another process held it, then died or let
    go): the new leader ticks at once, though nothing changed and nothing falls due. It once waited for a change,
    and a server whose lock came late never ticked on an idle database."""
    ticks: list[float] = []
    tick = flows_module.scheduler_tick

    def counted_tick(txn, *args, **kwargs):
        ticks.append(time.monotonic())
        return tick(txn, *args, **kwargs)

    monkeypatch.setattr(flows_module, "scheduler_tick", counted_tick)
    with psycopg.connect(db_path, autocommit=True) as holder:
        assert holder.execute("SELECT pg_try_advisory_lock(%s)", (LEADER_LOCK,)).fetchone()[0]
        app = create_app(db_path, background=True)
        with TestClient(app):
            time.sleep(1.5)  # a look or two while the lock is another's
            assert not app.state.db.is_leader and ticks == [], ticks
            holder.execute("SELECT pg_advisory_unlock(%s)", (LEADER_LOCK,))
            released = time.monotonic()
            while not ticks and time.monotonic() < released + 10:
                time.sleep(0.05)
            assert app.state.db.is_leader and ticks, "the new leader never ticked"
            assert ticks[0] - released < 3, f"the first tick came {ticks[0] - released:.1f} s after the lock"
