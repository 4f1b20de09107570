"""Running for months: metrics an operator can scrape, retention that never eats live work, a WAL that stays
bounded under a reader, and the health check."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import producers
import pytest
from conftest import ROOT, LiveServer, cli, workdir
from helpers import connect_db
from starlette.testclient import TestClient

import switchboard.database as database_module
import switchboard.flows as flows_module
import switchboard.store.upkeep as store_upkeep_module
from switchboard.app import create_app
from switchboard.configuration import SCHEMA_VERSION, WRITER_CHECKPOINT_BYTES, iso, to_ms
from switchboard.database import Database
from switchboard.limits import RateLimiter
from switchboard.store.upkeep import prune, scheduler_tick


def scrape(world, **headers) -> str:
    r = world.client.get("/metrics", headers=headers)
    assert r.status_code == 200, r.text
    return r.text


def metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start + " ") or line == line_start:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_start} not in metrics")


def test_metrics_count_what_happened_without_naming_tenants(world, clock):
    alice = world.human("alice")
    worker = world.endpoint(alice, ["secret-project"], name="secret-worker", verbs=["all"])
    hook = world.client.post("/api/v1/webhooks", headers=alice.auth, json={
        "provider": "github", "queue": "secret-project", "endpoint_id": worker.id,
        "trusted_actors": {"allow_all": True}}).json()
    path = hook["url"].removeprefix("http://testserver")
    raw, headers = producers.github("issues.opened", hook["secret"])
    world.client.post(path, content=raw, headers=headers)
    world.client.post(path, content=raw, headers=headers)
    world.client.post(path, content=raw, headers={**headers, "X-Hub-Signature-256": "sha256=" + "0" * 64,
                                                  "X-GitHub-Delivery": "forged"})
    first = world.claim(worker, lease_seconds=10)
    clock.advance(11)
    world.tick()
    second = world.claim(worker)
    world.act(worker, second["todo"]["id"], "complete", lease_token=second["lease_token"])
    world.push(alice, worker, "secret-project", "pending one")
    text = scrape(world)
    assert metric(text, 'switchboard_deliveries_total{provider="github",verdict="routed"}') == 1
    assert metric(text, 'switchboard_deliveries_total{provider="github",verdict="duplicate"}') == 1
    assert metric(text, 'switchboard_verification_failures_total{provider="github",reason="bad_signature"}') == 1
    assert metric(text, 'switchboard_routing_decisions_total{disposition="routed",stage="default"}') == 1
    assert metric(text, "switchboard_todos_created_total") == 2
    assert metric(text, "switchboard_todos_claimed_total") == 2
    assert metric(text, "switchboard_lease_expiries_total") == 1
    assert metric(text, 'switchboard_todos_completed_total{outcome="completed"}') == 1
    assert metric(text, 'switchboard_todos{state="done"}') == 1 and metric(text, 'switchboard_todos{state="pending"}') == 1
    assert metric(text, "switchboard_oldest_pending_seconds") == 0
    assert metric(text, 'switchboard_doorbell_rings_total{heard="false"}') >= 1
    for private in ("secret-project", "secret-worker", worker.id, hook["id"], alice.id, first["todo"]["id"]):
        assert private not in text


def test_metrics_token_guards_the_scrape(world, monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_METRICS_TOKEN", "scrape-me")
    assert world.client.get("/metrics").status_code == 401
    assert world.client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert "switchboard_todos" in scrape(world, Authorization="Bearer scrape-me")


def test_retention_prunes_old_finished_work_and_never_live_work(world, clock, db_path):
    alice = world.human("alice")
    worker = world.endpoint(alice, ["lane"], name="worker", verbs=["all"])
    router = world.endpoint(alice, ["triage"], name="router", verbs=["all"])
    hook = world.client.post("/api/v1/webhooks", headers=alice.auth, json={
        "provider": "github", "queue": "triage", "endpoint_id": router.id,
        "trusted_actors": {"allow_all": True}}).json()
    world.client.post(f"/api/v1/webhooks/{hook['id']}/routes", headers=alice.auth, json={"endpoint_id": worker.id})
    world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth, json={"rules": [
        {"id": "lane", "expr": "true", "action": {"queue": "lane", "once": True}}]})
    raw, headers = producers.github("issues.opened", hook["secret"])
    world.client.post(hook["url"].removeprefix("http://testserver"), content=raw, headers=headers)
    claim = world.claim(worker)
    world.act(worker, claim["todo"]["id"], "complete", lease_token=claim["lease_token"])
    pending = world.push(alice, worker, "lane", "still waiting")
    held = world.push(alice, worker, "lane", "claimed for a month")
    held_claim = world.claim(worker, queue="lane")
    assert held_claim["todo"]["id"] in (pending["id"], held["id"])
    clock.advance(29 * 86400)
    assert prune(world.db) == {"todos": 0, "events": 0, "notifications": 0}
    clock.advance(2 * 86400)
    pruned = prune(world.db)
    assert pruned == {"todos": 1, "events": 1, "notifications": 0}, "the done todo and its delivery; live work and its events stay"
    conn = connect_db(db_path)
    assert {r[0] for r in conn.execute("SELECT state FROM todos")} == {"pending", "claimed"}
    assert conn.execute("SELECT count(*) FROM routing_once").fetchone()[0] == 1, "once claims are never pruned"
    again = world.client.post(hook["url"].removeprefix("http://testserver"), content=raw,
                              headers={**headers, "X-GitHub-Delivery": "after-retention"}).json()
    assert again["disposition"] in ("repeat", "routed") and again["created"] == 0


def test_retention_keeps_at_most_the_row_cap(world, monkeypatch):
    monkeypatch.setattr(store_upkeep_module, "RETENTION_ROWS", 5)
    alice = world.human("alice")
    worker = world.endpoint(alice, ["build"], name="worker")
    for n in range(8):
        todo = world.push(alice, worker, "build", f"job {n}")
        world.act(alice, todo["id"], "cancel", reason="done with it")
    live = world.push(alice, worker, "build", "live")
    pruned = prune(world.db)
    assert pruned["todos"] == 4 and pruned["events"] == 4
    remaining = world.client.get("/api/v1/todos?limit=200", headers=alice.auth).json()["todos"]
    assert len(remaining) == 5 and live["id"] in {t["id"] for t in remaining}


def _cancelled_todos(world, count: int) -> None:
    alice = world.human("alice")
    worker = world.endpoint(alice, ["build"], name="worker")
    for n in range(count):
        todo = world.push(alice, worker, "build", f"job {n}")
        world.act(alice, todo["id"], "cancel", reason="done with it")


def test_retention_stopped_ends_after_its_step_and_the_next_pass_goes_on(world, monkeypatch):
    monkeypatch.setattr(store_upkeep_module, "RETENTION_ROWS", 1)
    monkeypatch.setattr(store_upkeep_module, "PRUNE_BATCH", 2)
    _cancelled_todos(world, 7)
    stopped = threading.Event()
    stopped.set()
    assert prune(world.db, stopped) == {"todos": 2, "events": 0, "notifications": 0}, "one step, then the stop"
    assert prune(world.db) == {"todos": 4, "events": 6, "notifications": 0}, "down to the cap; the events follow"


def test_a_stopping_server_does_not_wait_for_retention_to_finish(world, app, db_path, monkeypatch):
    """A big box's first pass past the row cap takes minutes; cancelling the retention loop (a shutdown) ends it
    after the step under way, before the writer closes, and cuts the pause between two steps short."""
    monkeypatch.setattr(store_upkeep_module, "RETENTION_ROWS", 1)
    monkeypatch.setattr(store_upkeep_module, "PRUNE_BATCH", 1)
    monkeypatch.setattr(store_upkeep_module, "PRUNE_PAUSE_MS", 600_000)  # a pause no test could wait out
    _cancelled_todos(world, 4)
    conn = connect_db(db_path)

    def todos() -> int:
        return conn.execute("SELECT count(*) FROM todos").fetchone()[0]

    async def stop_during_the_pass() -> None:
        loop = asyncio.create_task(app.state.flows.retention())
        while todos() == 4:
            await asyncio.sleep(0.01)
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(loop, 30)

    asyncio.run(stop_during_the_pass())
    assert todos() == 3, "one step ran; the stop ended the pass in the pause after it"
    conn.close()


@pytest.mark.sqlite_only("SQLite's WAL file")
def test_wal_stays_bounded_over_deliveries_with_a_reader_open(world, app, db_path):
    # 4,000 deliveries wrote well over 100 MB through the WAL, so 1,500 write more than twice the point where it
    # starts over (WRITER_CHECKPOINT_BYTES). The long soak is tests/bench/bench_wal.py (20,000 by default).
    deliveries = 1_500
    app.state.flows.limiter = RateLimiter(0, 1)  # as `serve --ingest-rate 0`: one sender, flat out
    alice = world.human("alice")
    worker = world.endpoint(alice, ["inbox"], name="worker", verbs=["all"])
    hook = world.client.post("/api/v1/webhooks", headers=alice.auth, json={
        "provider": "generic", "queue": "inbox", "endpoint_id": worker.id}).json()
    path = hook["url"].removeprefix("http://testserver")
    wal = db_path + "-wal"
    stop = threading.Event()
    reads = []

    def reader():
        # A dashboard that keeps its connection open and reads all the time. It yields between reads, as a real
        # one would: a busy loop here only starves the sender of the GIL and measures the machine, not the WAL.
        conn = connect_db(db_path)
        try:
            while not stop.is_set():
                reads.append(conn.execute("SELECT count(*) FROM todos").fetchone()[0])
                stop.wait(0.001)
        finally:
            conn.close()

    body = b'{"job": "' + b"x" * 1000 + b'"}'

    async def deliver_all() -> int:
        # The one sender posts straight into the app on the app's own event loop (the same ASGI app and requests
        # as through the test client, without a thread hop per request).
        largest = 0
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as http:
            for n in range(deliveries):
                r = await http.post(path, content=body, headers={"X-Delivery-Id": f"d{n}"})
                assert r.status_code == 202, r.text
                if n % 100 == 99:  # no manual checkpoint: the checkpointer and the writer keep it bounded
                    largest = max(largest, os.path.getsize(wal))
        return largest

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        largest = world.client.portal.call(deliver_all)
    finally:
        stop.set()
        thread.join()
    assert reads and reads[-1] > 0
    assert any(0 < r < deliveries for r in reads), "the reader read while the deliveries went in"
    assert largest <= WRITER_CHECKPOINT_BYTES + (1 << 20), f"WAL grew to {largest} bytes"
    busy, _, _ = world.db.checkpoint()
    assert busy == 0 and os.path.getsize(wal) == 0


def test_an_explicit_checkpoint_is_never_turned_away_by_the_background_checkpointer(tmp_path, monkeypatch):
    # SQLite answers a checkpoint that meets another one in progress with "busy" at once, busy timeout or not;
    # `prune` must still empty the WAL while the checkpointer copies it back after every commit.
    monkeypatch.setattr(database_module, "CHECKPOINTS_PER_SECOND", 100_000)
    db = Database(str(tmp_path / "race.db"))
    stop = threading.Event()

    def fill(txn):
        txn.execute("INSERT INTO filler VALUES (zeroblob(20000))")

    def writes():
        while not stop.is_set():
            db.write_sync(fill)

    try:
        db.write_sync(lambda txn: txn.execute("CREATE TABLE filler (x BLOB)"))
        writer = threading.Thread(target=writes)
        writer.start()
        try:
            answers = [db.checkpoint() for _ in range(300)]
        finally:
            stop.set()
            writer.join()
        assert [a for a in answers if a[0] != 0] == []
    finally:
        db.close()


def test_check_reports_integrity_key_sandbox_and_schema(db_path):
    code, report = cli(db_path, "check")
    assert code == 0 and report["integrity"] == "ok" and report["sandbox"] == "ok"
    assert report["schema_version"] == SCHEMA_VERSION and report["key"] == "missing"
    cli(db_path, "human", "add", "alice")
    _, endpoint = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "w", "--queues", "q",
                      "--verbs", "all")
    cli(db_path, "webhook", "create", "--endpoint", endpoint["id"], "--provider", "github", "--queue", "q")
    code, report = cli(db_path, "check")
    assert code == 0 and report["key"] == "file"
    (workdir(db_path) / "switchboard.key").unlink()
    code, failed = cli(db_path, "check")
    assert code == 1 and failed["error"] == "internal" and "missing" in failed["message"]
    code, pruned = cli(db_path, "prune")
    assert code == 0 and pruned["pruned"] == {"todos": 0, "events": 0, "notifications": 0}


def test_next_due_is_the_earliest_thing_the_scheduler_must_do(world, alice, clock):
    endpoint = world.endpoint(alice, ["build"], lease=600)
    assert world.tick()["next_due"] is None, "nothing waits: the scheduler has nothing to wake for"
    world.push(alice, endpoint, "build", "first")
    claim = world.claim(endpoint)
    lease_end = to_ms(datetime.fromisoformat(claim["todo"]["lease_expires_at"].replace("Z", "+00:00")))
    assert world.tick()["next_due"] == lease_end
    later = world.push(alice, endpoint, "build", "later")
    world.act(alice, later["id"], "defer", reason="after lunch", until=iso(clock.ms + 60_000))
    assert world.tick()["next_due"] == clock.ms + 60_000


@pytest.mark.sqlite_only("PRAGMA data_version (Postgres: the counters' change total)")
def test_an_idle_scheduler_looks_every_second_but_only_works_when_something_changed(db_path, monkeypatch):
    """Idle, the background loop reads one pragma a second and runs no tick; a commit from another connection
    (the CLI's, here) is noticed within about a second and ticked on."""
    ticks: list[float] = []
    real_tick = scheduler_tick

    def counting_tick(txn, *args, **kwargs):
        ticks.append(time.monotonic())
        return real_tick(txn, *args, **kwargs)

    monkeypatch.setattr(flows_module, "scheduler_tick", counting_tick)
    app = create_app(db_path, background=True)
    with TestClient(app):
        time.sleep(3.5)
        assert len(ticks) <= 2, f"{len(ticks)} ticks in 3.5 idle seconds"
        before = len(ticks)
        code, human = cli(db_path, "human", "add", "idle-alice")
        assert code == 0, human
        deadline = time.monotonic() + 5
        while len(ticks) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(ticks) > before, "a commit by another connection wakes the scheduler"


def test_serve_run_as_a_script_from_the_checkout_serves_and_stops_on_sigterm(db_path):
    """`python switchboard.py serve` (the launcher beside the package) is the process a supervisor started: the
    same pid serves, with the interpreter's options as given, and it stops cleanly on SIGTERM."""
    server = LiveServer(db_path, program=("-X", "utf8", str(ROOT / "switchboard.py")))
    try:
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[1:3] == [b"-X", b"utf8"] and cmdline[3].endswith(b"switchboard.py"), cmdline
        assert cmdline[4:7] == [b"serve", b"--db", db_path.encode()]
        assert httpx.get(f"{server.url}/healthz").text.startswith("ok ")
    finally:
        server.stop()
    assert server.proc.returncode == 0


def test_a_server_loads_httpx_and_jinja2_only_when_it_first_needs_them(tmp_path):
    """The footprint goal (RSS under 80 MiB with the fleet pack) counts on it: a box with no notification channel
    never sends, and one only agents use never renders a Board page, so neither library is loaded at start. (The
    Board and notification tests show both load when they are needed.)"""
    program = (
        "import asyncio, sys\n"
        "from switchboard.app import create_app\n"
        "app = create_app(sys.argv[1])\n"
        "async def serve_briefly():\n"
        "    async with app.router.lifespan_context(app):\n"
        "        await asyncio.sleep(0.5)\n"
        "asyncio.run(serve_briefly())\n"
        "print(sorted(name for name in ('httpx', 'jinja2') if name in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", program, str(tmp_path / "sb.db")], capture_output=True, text=True,
                          cwd=str(ROOT), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"loaded at start: {done.stdout.strip()}"
