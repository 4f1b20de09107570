"""Switchboard on Postgres side by side with SQLite mode, the database's own ceiling and a Python peer, in one run
(issue 38).

    python tests/bench/bench_postgres.py [--quick] [--rounds N] [--page] [--out PATH]

Postgres is a throw-away cluster this run starts with tests/pg_cluster.py (initdb and pg_ctl in a temporary
directory on this machine's disk, as the `postgres` user when run as root; 127.0.0.1, trust authentication,
shared_buffers 64MB, max_connections 200), with durability turned back on: pg_cluster starts it with fsync,
full_page_writes, autovacuum and JIT off, and this run sets them on again (`ALTER SYSTEM`, then
`pg_reload_conf()`: each is reloaded without a restart) and reads them back. synchronous_commit is on (the
default, and `serve` refuses off), wal_sync_method the platform's default (fdatasync on Linux): every commit waits
for its WAL fsync, as SQLite mode's synchronous=FULL does. The report names every setting as read back, and the
run stops if one is off.

Servers are real `python switchboard.py serve --ingest-rate 0` children on free loopback ports: on a SQLite file
(synchronous FULL, the default) or on the cluster with `--db postgresql://… --key-file KEY` (32 random bytes,
base64, in a 0600 file); "two processes" is two `serve` on the same database with the load split across both
ports. Each run gets a fresh copy of a database set up once through the CLI: the SQLite file copied, the Postgres
database made with `CREATE DATABASE … TEMPLATE`. Measured, each against its goal:

1. No-rules ingest: bench_compare's signed `issues.labeled` deliveries (12.8 KB, one fixed secret) to a GitHub
   webhook with no rules (each delivery one pending todo), 16 closed-loop senders; deliveries/s and the ack
   p50/p99, on SQLite mode, Postgres with one process and with two (8 senders on each). Checked: every delivery
   answered 202 `routed` with one todo, and the database holds that many routed events and pending todos.
2. claim + complete over REST: 8 workers (4 on each process with two), each a claim then a complete per cycle,
   on 1,000 todos pushed over REST beforehand; cycles/s. Checked: each todo completed once, all `done`, one
   completed attempt each.
3. The doorbell across processes: two processes A and B on one database, 20 sessions of one endpoint on B only
   (SSE `GET /api/v1/doorbell` streams, then waiting claims with `wait_seconds`), signed deliveries to that
   endpoint's webhook on A one at a time; from A's 202 to B's ring (the stream's `todo.ready` line, or the waiting
   claim's answer, which includes that claim's commit), p50/p99, and from the send. bench_doorbell.measure_channel
   does the sending and the joining (each todo rang exactly one session, none missed; a waiting claim was waiting
   before its delivery); the first delivery goes only once B's listener row is in `ring_listeners`.
4. The database's own ceiling: a plain psycopg 3 loop, 8 threads each on its own connection, on a database of its
   own in the same cluster: enqueue = INSERT one row + COMMIT; a cycle = SELECT … FOR UPDATE SKIP LOCKED + UPDATE
   to claimed + COMMIT, then UPDATE to done + COMMIT (two commits, as a Switchboard claim + complete and the
   peer's fetch + finish); and one thread's INSERT + COMMIT latency, the durable commit's own time here.
5. A Python peer on the same cluster, its own database: procrastinate (optional: `pip install procrastinate`;
   without it the rows say skipped). Enqueue: `defer_async` of a no-op async task from 8 concurrent tasks;
   dequeue: `run_worker_async(concurrency=8, wait=False)` until the queue is empty (each job one fetch and one
   finish, each its own transaction). Checked: every job `succeeded`, each run once.

The client is this process: asyncio over raw keep-alive sockets (tests/bench/load_generator.py's Connection, on
uvloop when installed), because an httpx client costs most of a core at these rates and the client, the servers
and Postgres share the machine's 2 cores. Each measured window records the CPU each part took: every server
process, the Postgres cluster (the postmaster's tree: backends, WAL writer, checkpointer; it is no child of this
process, so its CPU is taken out of the other processes' share), this client, and the other processes
(bench_compare's Window and load gate). Rounds interleave the systems (the order rotates each round), three by default and one
with --quick; the tables give medians over rounds, and a figure whose window saw other processes above 0.25
cores is marked busy, not met or missed.

Writes tests/bench/results-postgres.json, prints a Markdown block and, with --page, rewrites the lines between
`<!-- bench-postgres:start -->` and `<!-- bench-postgres:end -->` in docs/speed.md. Exit status 2 when Postgres or
psycopg is missing (or --page finds no markers), 1 when a run failed its checks; a goal not met is no failure.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import importlib.util
import itertools
import json
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import anyio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # tests/, for pg_cluster and producers
import bench_doorbell  # noqa: E402
import pg_cluster  # noqa: E402
from bench_compare import (  # noqa: E402
    BUSY_CORES,
    SECRET,
    Window,
    build_deliveries,
    checkpoint_truncate,
    copy_dir,
    hook_path,
    load_gate,
    log,
    passes,
    tree_cpu,
)
from bench_peer_webhook import Child, healthy, wait_until  # noqa: E402
from bench_store import (  # noqa: E402
    ROOT,
    cli,
    free_port,
    machine_facts,
    percentile,
    read_only,
    report_notes,
    run_timed,
    source_fingerprint,
)
from load_generator import Connection, Unanswered, build_request  # noqa: E402
from run_all import SPEED_PAGE, report  # noqa: E402

try:
    import psycopg
except ImportError:  # said at start, with what to install
    psycopg = None

RESULTS_PATH = HERE / "results-postgres.json"
PAGE_START, PAGE_END = "<!-- bench-postgres:start -->", "<!-- bench-postgres:end -->"
HOST = "127.0.0.1"
INBOX = "inbox"
CLAIM_QUEUE = "bench"
DOORBELL_QUEUE = bench_doorbell.QUEUE
DOORBELL_CHANNELS = ("sse", "wait")
RAW_PARTS = ("commit", "enqueue", "cycle")
PEER_PARTS = ("enqueue", "dequeue")
DOORBELL_SESSIONS = 20
PEER_QUEUE = "bench"
SENDERS = 16
WORKERS = 8
CONCURRENCY = 8  # the raw loop's threads and the peer's enqueuers and worker slots
PUSHERS = 8
ROUND_TRIP_OPS = 50  # deliveries, and claim + complete cycles, counted one at a time
MAX_STRIKES = 5

# What each run is: its engine and how many `serve` processes share the load.
CONFIGS = {"sqlite": ("sqlite", 1), "pg1": ("postgres", 1), "pg2": ("postgres", 2)}
LABELS = {"sqlite": "SQLite mode", "pg1": "Postgres, one process", "pg2": "Postgres, two processes"}
POSTGRES_SETTINGS = ("server_version", "fsync", "full_page_writes", "synchronous_commit", "wal_sync_method",
                     "wal_level", "shared_buffers", "max_connections", "commit_delay", "checkpoint_timeout",
                     "max_wal_size", "autovacuum", "jit")
# Durable, vacuumed and planned as a kept database is (pg_cluster turns autovacuum and JIT off for tests)
DURABLE = {"fsync": "on", "full_page_writes": "on", "synchronous_commit": "on", "autovacuum": "on", "jit": "on"}

# The raw loop and the peer get more operations than the HTTP runs: at their rates a smaller run lasts a few
# hundred milliseconds, too short for /proc's 10 ms CPU ticks to say who used what.
SIZES_FULL = {"rounds": 3, "deliveries": 1500, "cycles": 1000, "rings": 200, "warmup": 10, "raw": 5000,
              "commits": 3000, "peer": 2000, "gate_max_s": 30.0}
SIZES_QUICK = {"rounds": 1, "deliveries": 300, "cycles": 300, "rings": 40, "warmup": 5, "raw": 2000,
               "commits": 1000, "peer": 500, "gate_max_s": 10.0}

MISSING_POSTGRES = ("Postgres is needed: {reason}. On Debian or Ubuntu `apt-get install postgresql` (the run starts "
                    "its own throw-away cluster with its initdb and pg_ctl; nothing is configured).")
MISSING_PSYCOPG = ("psycopg 3 is needed (Switchboard's Postgres extra): `pip install -e \".[postgres]\"` in a checkout, or "
                   "`pip install \"psycopg[binary]>=3.2\" \"psycopg-pool>=3.2\"`.")
PEER_MISSING = "procrastinate is not installed (`pip install procrastinate`)"


# ----------------------------------------------------------------------------------------------------
# the cluster, with durability on
# ----------------------------------------------------------------------------------------------------

def durable(cluster: pg_cluster.Cluster) -> dict:
    """Turn fsync, full-page writes, autovacuum and JIT back on (pg_cluster turns them off for tests), and read
    back every setting the report names; raise if a commit would not be durable."""
    with psycopg.connect(cluster.url(), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET fsync = on")
        conn.execute("ALTER SYSTEM SET full_page_writes = on")
        conn.execute("ALTER SYSTEM SET synchronous_commit = on")
        conn.execute("ALTER SYSTEM SET autovacuum = on")
        conn.execute("ALTER SYSTEM SET jit = on")
        conn.execute("SELECT pg_reload_conf()")
    deadline = time.monotonic() + 10
    while True:
        # A new session reads the reloaded file; the postmaster signals the backends, so give it a moment.
        with psycopg.connect(cluster.url(), autocommit=True) as conn:
            settings = {name: conn.execute(f"SHOW {name}").fetchone()[0] for name in POSTGRES_SETTINGS}
            pending = conn.execute("SELECT count(*) FROM pg_settings WHERE pending_restart").fetchone()[0]
        if all(settings[k] == v for k, v in DURABLE.items()) and not pending:
            return settings
        if time.monotonic() > deadline:
            raise RuntimeError(f"Postgres did not take the durable settings: {settings}, pending restart {pending}")
        time.sleep(0.1)


def postmaster_pid(cluster: pg_cluster.Cluster) -> int:
    return int((cluster.data / "postmaster.pid").read_text().split()[0])


def filesystem(path: Path) -> str:
    """The type and device of the mount a path lies on (the disk a durable commit waits for)."""
    real, best = os.path.realpath(path), ("?", "?", "")
    for line in Path("/proc/mounts").read_text().splitlines():
        device, mount, kind = line.split()[:3]
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[2]):
            best = (kind, device, mount)
    return f"{best[0]} ({best[1]})"


def copy_database(cluster: pg_cluster.Cluster, name: str, template: str) -> str:
    """A fresh copy of a template database (its last sessions, which may still be closing, ended first)."""
    with psycopg.connect(cluster.url(), autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s"
                     " AND pid <> pg_backend_pid()", (template,))
    return cluster.create_database(name, template)


def drop_database(cluster: pg_cluster.Cluster, name: str) -> None:
    from psycopg import sql

    with psycopg.connect(cluster.url(), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def query(db: str, statement: str, params: tuple = ()) -> list[tuple]:
    """Rows from a run's database, either engine (the statements here are portable)."""
    if db.startswith("postgresql://"):
        with psycopg.connect(db) as conn:
            return conn.execute(statement.replace("?", "%s"), params).fetchall()
    with read_only(db) as ro:
        return ro.execute(statement, params).fetchall()


# ----------------------------------------------------------------------------------------------------
# measured windows: each server, the cluster, this client, the other processes
# ----------------------------------------------------------------------------------------------------

class CoresWindow(Window):
    """bench_compare's Window, plus each server's process tree and the Postgres cluster's (the postmaster's tree,
    reaped backends included). The cluster is not this process's child (pg_ctl detaches it), so the Window counts
    it among the other processes: its share is moved out of there, and `busy` judged on the rest."""

    def __init__(self, server_pids: list[int], postmaster: int):
        self.server_pids = list(server_pids)
        self.postmaster = postmaster
        self.servers0 = [tree_cpu(pid) for pid in self.server_pids]
        self.postgres0 = tree_cpu(postmaster)
        super().__init__(None)

    def close(self) -> dict:
        servers1 = [tree_cpu(pid) for pid in self.server_pids]
        postgres1 = tree_cpu(self.postmaster)
        out = super().close()
        wall = out["wall_s"]
        out["servers_cores"] = [round((b - a) / wall, 3) for a, b in zip(self.servers0, servers1)]
        out["server_cores"] = round(sum(out["servers_cores"]), 3) if self.server_pids else None
        out["postgres_cores"] = round((postgres1 - self.postgres0) / wall, 3)
        out["other_cores"] = round(max(0.0, out["other_cores"] - out["postgres_cores"]), 3)
        out["busy"] = out["other_cores"] > BUSY_CORES
        return out


def cpu_ms_per_op(window: dict, ops: int) -> float | None:
    """The CPU this run's parts (servers, Postgres, client) spent per operation over the window."""
    if not ops:
        return None
    cores = (window.get("server_cores") or 0) + window["postgres_cores"] + window["client_cores"]
    return round(cores * window["wall_s"] / ops * 1e3, 3)


# ----------------------------------------------------------------------------------------------------
# servers and the databases they run on
# ----------------------------------------------------------------------------------------------------

class Serve:
    """`python switchboard.py serve --ingest-rate 0` as a child on a free loopback port: on a SQLite file
    (synchronous FULL, the default), or on a Postgres URL with its key file. Stopped by its pid."""

    def __init__(self, db: str, key_file: str | None, log_path: Path, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        argv = [sys.executable, str(ROOT / "switchboard.py"), "serve", "--db", db, "--port", str(self.port),
                "--ingest-rate", "0", *(("--key-file", key_file) if key_file else ())]
        self.child = Child("serve", argv, log_path, {**os.environ, **env} if env else None, ROOT)

    @property
    def pid(self) -> int:
        return self.child.pid

    def wait_ready(self) -> None:
        wait_until(lambda: healthy(self.port), f"serve on port {self.port} answering /healthz", 60, self.child)

    def stop(self) -> None:
        self.child.stop()

    def log_problems(self) -> list[str]:
        return [line for line in self.child.logged().splitlines()
                if "Traceback" in line or " ERROR " in line or "internal error" in line]


@dataclass
class Bench:
    """What every run shares: the cluster, the key, a scratch directory, and the templates each run copies."""
    cluster: pg_cluster.Cluster
    key_file: str
    root: Path
    postmaster: int
    templates: dict
    copies: Iterator[int]


def setup_cli(db: str, key_file: str | None) -> Callable[..., dict]:
    """The real CLI (`--json`) on one database; a Postgres URL names the key file on every command."""
    def run(*args: str) -> dict:
        return cli(db, *args, *(("--key-file", key_file) if key_file else ()))
    return run


def plain_topology(run: Callable[..., dict]) -> dict:
    """bench_compare's no-rules set-up: an endpoint owning a GitHub webhook (fixed secret, trusting the fixtures'
    sender) on its queue, so each delivery is fanned out into one pending todo."""
    run("init")
    run("human", "add", "bench")
    endpoint = run("endpoint", "vend", "--human", "bench", "--name", "inbox", "--queues", INBOX,
                   "--verbs", "webhooks,drain")
    hook = run("webhook", "create", "--endpoint", endpoint["id"], "--provider", "github", "--queue", INBOX,
               "--trust", "Codertocat", "--secret", SECRET, "--base-url", "http://placeholder")
    if hook.get("secret") != SECRET:
        raise RuntimeError(f"webhook create did not take the fixed secret: {hook}")
    return {"hook_path": hook_path(hook)}


def claim_topology(run: Callable[..., dict]) -> dict:
    run("init")
    human = run("human", "add", "bench")
    endpoint = run("endpoint", "vend", "--human", "bench", "--name", "w", "--queues", CLAIM_QUEUE)
    return {"human": human, "endpoint": endpoint}


def doorbell_topology(run: Callable[..., dict]) -> dict:
    """Per channel, its own endpoint owning its own webhook (no rules), as bench_doorbell sets up."""
    run("init")
    run("human", "add", "bench")
    out = {}
    for channel in DOORBELL_CHANNELS:
        endpoint = run("endpoint", "vend", "--human", "bench", "--name", channel, "--queues", DOORBELL_QUEUE)
        hook = run("webhook", "create", "--endpoint", endpoint["id"], "--provider", "github", "--queue",
                   DOORBELL_QUEUE, "--trust", "Codertocat", "--secret", SECRET, "--base-url", "http://placeholder")
        out[channel] = {"endpoint": endpoint, "hook_path": hook_path(hook)}
    return out


def make_templates(bench: Bench, cycles: int) -> dict:
    """Set-up through the CLI once per engine; the claim templates get their todos pushed over REST by a server
    that is then stopped. Every run copies one of these."""
    templates: dict = {"sqlite": {}, "postgres": {}}
    for engine in ("sqlite", "postgres"):
        for name, topology in (("plain", plain_topology), ("claim", claim_topology), ("doorbell", doorbell_topology)):
            if engine == "sqlite" and name == "doorbell":
                continue  # the doorbell across processes is Postgres mode's
            if engine == "sqlite":
                directory = bench.root / f"template-{name}"
                directory.mkdir()
                db, key, where = str(directory / "switchboard.db"), None, str(directory)
            else:
                db, key, where = bench.cluster.create_database(f"template_{name}"), bench.key_file, f"template_{name}"
            templates[engine][name] = {"db": where, **topology(setup_cli(db, key))}
            if name == "claim":
                server = Serve(db, key, bench.root / f"template-{engine}-claim.log")
                try:
                    server.wait_ready()
                    made = templates[engine][name]
                    run_loop(push_todos(server.port, made["human"]["token"], made["endpoint"]["id"], cycles))
                finally:
                    server.stop()
                if engine == "sqlite":
                    checkpoint_truncate(db)
    return templates


@contextlib.contextmanager
def serving(bench: Bench, config: str, template: str, env: dict | None = None) -> Iterator[tuple[str, list[Serve]]]:
    """A fresh copy of a template database and its `serve` processes, answering before this yields; when the block
    ends, however it ends, the servers are stopped by their pids and the copy removed."""
    engine, processes = CONFIGS[config]
    made = bench.templates[engine][template]
    copy = next(bench.copies)
    with contextlib.ExitStack() as stack:
        if engine == "sqlite":
            directory = copy_dir(made["db"], f"sb-bench-pg-{template}-")
            stack.callback(shutil.rmtree, directory, True)
            db, key, logs = os.path.join(directory, "switchboard.db"), None, Path(directory)
        else:
            name = f"{template}_{copy}"
            db = copy_database(bench.cluster, name, made["db"])
            stack.callback(drop_database, bench.cluster, name)
            key, logs = bench.key_file, bench.root
        servers = []
        for p in range(processes):
            server = Serve(db, key, logs / f"{config}-{template}-{copy}-{p}.log", env)
            stack.callback(server.stop)
            servers.append(server)
        for server in servers:
            server.wait_ready()
        yield db, servers


# ----------------------------------------------------------------------------------------------------
# the client: asyncio over raw keep-alive sockets
# ----------------------------------------------------------------------------------------------------

def run_loop(coroutine):
    """The client's event loop: uvloop when installed, as load_generator.py runs."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def _sent() -> None:
    """Connection.exchange's hook for the moment a request is written: the callers time their own requests."""


async def post_json(conn: Connection, path: str, token: str, body: dict) -> tuple[int, dict]:
    request = build_request(HOST, conn.port, path, {"headers": {"Authorization": f"Bearer {token}",
                                                                "Content-Type": "application/json"},
                                                    "body": json.dumps(body)})
    status, data = await conn.exchange(request, _sent)
    return status, json.loads(data) if data else {}


async def open_connections(ports: list[int], n: int) -> list[Connection]:
    """n keep-alive connections, dealt across the ports in turn, open before any clock starts."""
    conns = [Connection(HOST, ports[k % len(ports)]) for k in range(n)]
    await asyncio.gather(*(c.open() for c in conns))
    return conns


async def push_todos(port: int, human_token: str, endpoint_id: str, n: int) -> None:
    conns = await open_connections([port], PUSHERS)
    errors: list[str] = []
    indexes = iter(range(n))

    async def pusher(conn: Connection) -> None:
        for i in indexes:
            status, body = await post_json(conn, f"/api/v1/endpoints/{endpoint_id}/todos", human_token,
                                           {"title": f"t{i}", "queue": CLAIM_QUEUE})
            if status != 201:
                errors.append(f"push {i}: {status} {body}")

    await asyncio.gather(*(pusher(c) for c in conns))
    for conn in conns:
        conn.drop()
    if errors:
        raise RuntimeError(f"pushing the claim template's todos failed: {errors[:5]}")


async def send_deliveries(servers: list[Serve], path: str, deliveries: list[tuple[bytes, dict]],
                          postmaster: int) -> dict:
    """Every delivery from SENDERS closed loops (dealt across the servers' ports), each sending its next as soon as
    the last is answered; the ack time runs from just before the request is written to its whole answer."""
    ports = [s.port for s in servers]
    requests = {port: [build_request(HOST, port, path, {"headers": headers, "body": raw.decode()})
                       for raw, headers in deliveries] for port in ports}
    senders = await open_connections(ports, SENDERS)
    n = len(deliveries)
    answers: list[dict | None] = [None] * n
    answered_by: collections.Counter = collections.Counter()
    ack_ms: list[float] = []
    errors: list[str] = []
    indexes = iter(range(n))

    async def sender(conn: Connection) -> None:
        for i in indexes:
            t0 = time.perf_counter()
            try:
                status, body = await conn.exchange(requests[conn.port][i], _sent)
            except Unanswered as exc:
                errors.append(f"delivery {i}: {exc}")
                continue
            took = (time.perf_counter() - t0) * 1e3
            if status != 202:
                errors.append(f"delivery {i}: {status} {body[:300]!r}")
                continue
            ack_ms.append(took)
            answers[i] = json.loads(body)
            answered_by[conn.port] += 1

    window = CoresWindow([s.pid for s in servers], postmaster)
    t0 = time.perf_counter()
    await asyncio.gather(*(sender(c) for c in senders))
    wall = time.perf_counter() - t0
    measured = window.close()
    for conn in senders:
        conn.drop()
    return {"wall_s": round(wall, 3), "rate": len(ack_ms) / wall, "p50_ms": percentile(ack_ms, 50),
            "p99_ms": percentile(ack_ms, 99), "window": measured, "cpu_ms_per_op": cpu_ms_per_op(measured, n),
            "answered_per_process": [answered_by[p] for p in ports], "answers": answers, "errors": errors[:20]}


async def claim_and_complete(servers: list[Serve], token: str, postmaster: int) -> dict:
    """WORKERS closed loops (dealt across the servers' ports), each a claim then a complete, until the queue is
    empty; a cycle is the two."""
    ports = [s.port for s in servers]
    workers = await open_connections(ports, WORKERS)
    completed_by: collections.Counter = collections.Counter()
    completed: list[str] = []
    cycle_ms: list[float] = []
    errors: list[str] = []

    async def worker(w: int, conn: Connection) -> None:
        strikes = 0
        while strikes < MAX_STRIKES:
            c0 = time.perf_counter()
            try:
                status, claimed = await post_json(conn, "/api/v1/todos/claim", token, {"queue": CLAIM_QUEUE})
                if status != 200:
                    raise RuntimeError(f"claim: {status} {claimed}")
                if claimed.get("empty"):
                    return
                todo_id = claimed["todo"]["id"]
                status, done = await post_json(conn, f"/api/v1/todos/{todo_id}/complete", token,
                                               {"lease_token": claimed["lease_token"]})
                if status != 200 or done.get("state") != "done":
                    raise RuntimeError(f"complete {todo_id}: {status} {done}")
            except (Unanswered, RuntimeError, ValueError) as exc:
                errors.append(f"worker {w}: {exc}")
                strikes += 1
                continue
            cycle_ms.append((time.perf_counter() - c0) * 1e3)
            completed.append(todo_id)
            completed_by[conn.port] += 1

    window = CoresWindow([s.pid for s in servers], postmaster)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w, c) for w, c in enumerate(workers)))
    wall = time.perf_counter() - t0
    measured = window.close()
    for conn in workers:
        conn.drop()
    return {"wall_s": round(wall, 3), "rate": len(cycle_ms) / wall, "p50_ms": percentile(cycle_ms, 50),
            "p99_ms": percentile(cycle_ms, 99), "window": measured,
            "cpu_ms_per_op": cpu_ms_per_op(measured, len(cycle_ms)),
            "answered_per_process": [completed_by[p] for p in ports], "completed": completed, "errors": errors[:20]}


# ----------------------------------------------------------------------------------------------------
# one run of each figure
# ----------------------------------------------------------------------------------------------------

def _problems(servers: list[Serve]) -> list[str]:
    return [line for server in servers for line in server.log_problems()][:10]


def rep_ingest(bench: Bench, config: str, deliveries: list[tuple[bytes, dict]]) -> dict:
    made = bench.templates[CONFIGS[config][0]]["plain"]
    n = len(deliveries)
    with serving(bench, config, "plain") as (db, servers):
        out = run_loop(send_deliveries(servers, made["hook_path"], deliveries, bench.postmaster))
        for server in servers:
            server.stop()
        answers = out.pop("answers")
        dispositions = collections.Counter("duplicate" if a.get("duplicate") else a.get("disposition")
                                           for a in answers if a is not None)
        wrong_queue = sum(1 for a in answers if a is not None and [t["queue"] for t in a.get("todos", [])] != [INBOX])
        db_dispositions = dict(query(db, "SELECT disposition, count(*) FROM events GROUP BY disposition"))
        db_todos = dict(query(db, "SELECT queue, count(*) FROM todos WHERE state = 'pending' GROUP BY queue"))
        verified = {"http_errors": out["errors"], "server_log_problems": _problems(servers),
                    "dispositions": dict(dispositions), "wrong_queue": wrong_queue,
                    "db_event_dispositions": db_dispositions, "db_pending_todos": db_todos}
    verified["ok"] = (not out["errors"] and not verified["server_log_problems"] and dispositions == {"routed": n}
                      and wrong_queue == 0 and db_dispositions == {"routed": n} and db_todos == {INBOX: n}
                      and all(out["answered_per_process"]))
    out["verified"] = verified
    return out


def rep_claim(bench: Bench, config: str, n: int) -> dict:
    made = bench.templates[CONFIGS[config][0]]["claim"]
    with serving(bench, config, "claim") as (db, servers):
        out = run_loop(claim_and_complete(servers, made["endpoint"]["token"], bench.postmaster))
        for server in servers:
            server.stop()
        completed = out.pop("completed")
        duplicates = [k for k, c in collections.Counter(completed).items() if c > 1]
        states = dict(query(db, "SELECT state, count(*) FROM todos GROUP BY state"))
        completed_attempts = query(db, "SELECT count(*) FROM attempts WHERE outcome = 'completed'")[0][0]
        attempts_not_1 = query(db, "SELECT count(*) FROM (SELECT todo_id FROM attempts GROUP BY todo_id "
                                   "HAVING count(*) <> 1) AS t")[0][0]
        verified = {"http_errors": out["errors"], "server_log_problems": _problems(servers),
                    "completed": len(completed), "duplicates": duplicates[:10], "db_states": states,
                    "db_completed_attempts": completed_attempts, "db_todos_with_attempts_not_1": attempts_not_1}
    verified["ok"] = (not out["errors"] and not verified["server_log_problems"] and not duplicates
                      and len(completed) == n and states == {"done": n} and completed_attempts == n
                      and attempts_not_1 == 0 and all(out["answered_per_process"]))
    out["verified"] = verified
    out["cycles"] = len(completed)
    return out


def traced_turns(directory: Path) -> int:
    """Round trips so far on every traced connection (switchboard.postgres.round_trips over libpq's trace)."""
    from switchboard.postgres import round_trips

    return sum(round_trips(p.read_text(errors="replace")) for p in directory.glob("*.trace"))


async def one_at_a_time(port: int, requests: list[bytes], expect: Callable[[int, dict], bool]) -> list[str]:
    conn = Connection(HOST, port)
    await conn.open()
    errors = []
    for i, request in enumerate(requests):
        status, body = await conn.exchange(request, _sent)
        if not expect(status, json.loads(body) if body else {}):
            errors.append(f"request {i}: {status} {body[:200]!r}")
    conn.drop()
    return errors


async def claim_complete_cycles(port: int, token: str, n: int) -> list[str]:
    conn = Connection(HOST, port)
    await conn.open()
    errors = []
    for i in range(n):
        status, claimed = await post_json(conn, "/api/v1/todos/claim", token, {"queue": CLAIM_QUEUE})
        if status != 200 or "todo" not in claimed:
            errors.append(f"claim {i}: {status} {claimed}")
            continue
        status, done = await post_json(conn, f"/api/v1/todos/{claimed['todo']['id']}/complete", token,
                                       {"lease_token": claimed["lease_token"]})
        if status != 200 or done.get("state") != "done":
            errors.append(f"complete {i}: {status} {done}")
    conn.drop()
    return errors


def rep_round_trips(bench: Bench, deliveries: list[tuple[bytes, dict]], n: int, warmup: int) -> dict:
    """Round trips to Postgres per delivery and per claim + complete, from libpq's own protocol trace of one
    process's pooled connections (SWITCHBOARD_PG_TRACE; switchboard.postgres.round_trips), not by hand: one
    request at a time after `warmup` of each (the process then knows its principals and its empty reads), less
    what the process's own background work (the scheduler's ticks, the senders) made while as long idle."""
    out: dict = {}
    for figure, template in (("delivery", "plain"), ("claim + complete", "claim")):
        made = bench.templates["postgres"][template]
        trace_dir = bench.root / f"trace-{template}-{next(bench.copies)}"
        with serving(bench, "pg1", template, {"SWITCHBOARD_PG_TRACE": str(trace_dir)}) as (_, servers):
            port = servers[0].port
            if figure == "delivery":
                requests = [build_request(HOST, port, made["hook_path"], {"headers": headers, "body": raw.decode()})
                            for raw, headers in deliveries[:warmup + n]]

                async def run(part: slice) -> list[str]:
                    return await one_at_a_time(port, requests[part], lambda status, body: status == 202)
            else:
                async def run(part: slice) -> list[str]:
                    return await claim_complete_cycles(port, made["endpoint"]["token"], part.stop - part.start)
            errors = run_loop(run(slice(0, warmup)))
            before, t0 = traced_turns(trace_dir), time.perf_counter()
            errors += run_loop(run(slice(warmup, warmup + n)))
            busy_s, during = time.perf_counter() - t0, traced_turns(trace_dir)
            time.sleep(busy_s)
            idle = traced_turns(trace_dir) - during
            problems = _problems(servers)
        out[figure] = {"per_op": round((during - before - idle) / n, 2), "turns": during - before,
                       "idle_turns": idle, "ops": n, "errors": errors[:10], "server_log_problems": problems}
    out["verified"] = {"ok": not any(out[f]["errors"] or out[f]["server_log_problems"]
                                     for f in ("delivery", "claim + complete"))}
    return out


def listener_published(sessions: Callable, db: str, endpoint_id: str, waiting: bool) -> Callable:
    """bench_doorbell's sessions, and then a wait until their process has published them in `ring_listeners`
    (its ring thread does so within a fraction of a second): a delivery committed before that finds no process
    to ring, and an SSE session would never hear of it."""
    async def attach_then_published(stack, url, token, n, book, group) -> None:
        await sessions(stack, url, token, n, book, group)
        with anyio.fail_after(10):
            while not query(db, "SELECT 1 FROM ring_listeners WHERE endpoint_id = ? AND waiting = ?",
                            (endpoint_id, int(waiting))):
                await anyio.sleep(0.02)
    return attach_then_published


def rep_doorbell(bench: Bench, rings: int, warmup: int) -> dict:
    """Process A takes the deliveries, process B holds every session; per channel, bench_doorbell's measurement."""
    made = bench.templates["postgres"]["doorbell"]
    out: dict = {}
    with serving(bench, "pg2", "doorbell") as (db, servers):
        ingest_process, ring_process = servers
        for channel in DOORBELL_CHANNELS:
            endpoint = made[channel]["endpoint"]
            sessions = listener_published(bench_doorbell.SESSIONS[channel], db, endpoint["id"], channel == "wait")
            window = CoresWindow([s.pid for s in servers], bench.postmaster)
            try:
                with mock.patch.dict(bench_doorbell.SESSIONS, {channel: sessions}):
                    result = anyio.run(bench_doorbell.measure_channel, channel, ring_process.url, endpoint,
                                       ingest_process.url + made[channel]["hook_path"], SECRET, DOORBELL_SESSIONS,
                                       rings, warmup)
            except Exception:  # noqa: BLE001 - this channel fails its checks; the other still runs
                out[channel] = {"error": traceback.format_exc(limit=8)}
                continue
            result["window"] = window.close()
            out[channel] = result
        for server in servers:
            server.stop()
        problems = _problems(servers)
    for result in out.values():
        if "verified" in result:
            result["verified"]["server_log_problems"] = problems
            result["verified"]["ok"] = result["verified"]["ok"] and not problems
    return out


def _threads(name: str, url: str, body: Callable, postmaster: int) -> tuple[float, dict, list[str]]:
    """CONCURRENCY threads, each on its own connection, running `body(t, conn)` once every one is connected."""
    errors: list[str] = []

    def thread(t: int, ready: Callable[[], None]) -> None:
        try:
            conn = psycopg.connect(url)
        except psycopg.Error as exc:
            errors.append(f"{name} {t}: {exc}")
            ready()
            return
        with conn:
            ready()
            try:
                body(t, conn)
            except psycopg.Error as exc:
                errors.append(f"{name} {t}: {type(exc).__name__}: {exc}")

    wall, window = run_timed(CONCURRENCY, thread, name, lambda: CoresWindow([], postmaster).close)
    return wall, window, errors


def rep_raw(bench: Bench, n: int, commits: int) -> dict:
    """The cluster's own ceiling, with nothing but psycopg: one thread's durable commit, then enqueue and claim +
    complete from CONCURRENCY threads."""
    name = f"raw_{next(bench.copies)}"
    url = bench.cluster.create_database(name)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE jobs (id bigserial PRIMARY KEY, payload text NOT NULL,"
                         " state text NOT NULL DEFAULT 'pending', claims integer NOT NULL DEFAULT 0)")
            conn.execute("CREATE INDEX jobs_pending ON jobs (id) WHERE state = 'pending'")
            conn.execute("CREATE TABLE pings (id bigserial PRIMARY KEY)")
        out = {}

        window = CoresWindow([], bench.postmaster)
        commit_ms = []
        with psycopg.connect(url) as conn:
            t0 = time.perf_counter()
            for _ in range(commits):
                c0 = time.perf_counter()
                conn.execute("INSERT INTO pings DEFAULT VALUES")
                conn.commit()
                commit_ms.append((time.perf_counter() - c0) * 1e3)
            wall = time.perf_counter() - t0
        pings = query(url, "SELECT count(*) FROM pings")[0][0]
        out["commit"] = {"rate": commits / wall, "p50_ms": percentile(commit_ms, 50),
                         "p99_ms": percentile(commit_ms, 99), "window": window.close(),
                         "verified": {"db_rows": pings, "ok": pings == commits}}

        enqueue_ms: list[list[float]] = [[] for _ in range(CONCURRENCY)]

        def enqueue(t: int, conn) -> None:
            for i in range(t, n, CONCURRENCY):
                c0 = time.perf_counter()
                conn.execute("INSERT INTO jobs (payload) VALUES (%s)", (f"t{i}",))
                conn.commit()
                enqueue_ms[t].append((time.perf_counter() - c0) * 1e3)

        wall, window, errors = _threads("raw-enqueue", url, enqueue, bench.postmaster)
        lat = [x for per in enqueue_ms for x in per]
        rows = query(url, "SELECT count(*) FROM jobs WHERE state = 'pending'")[0][0]
        out["enqueue"] = {"rate": len(lat) / wall, "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
                          "window": window, "cpu_ms_per_op": cpu_ms_per_op(window, len(lat)),
                          "verified": {"errors": errors[:10], "db_pending": rows, "ok": not errors and rows == n}}

        done: list[list[int]] = [[] for _ in range(CONCURRENCY)]
        cycle_ms: list[list[float]] = [[] for _ in range(CONCURRENCY)]

        def claim_complete(t: int, conn) -> None:
            while True:
                c0 = time.perf_counter()
                row = conn.execute("SELECT id FROM jobs WHERE state = 'pending' ORDER BY id LIMIT 1"
                                   " FOR UPDATE SKIP LOCKED").fetchone()
                if row is None:
                    conn.rollback()
                    return
                conn.execute("UPDATE jobs SET state = 'claimed', claims = claims + 1 WHERE id = %s", row)
                conn.commit()
                conn.execute("UPDATE jobs SET state = 'done' WHERE id = %s AND state = 'claimed'", row)
                conn.commit()
                cycle_ms[t].append((time.perf_counter() - c0) * 1e3)
                done[t].append(row[0])

        wall, window, errors = _threads("raw-cycle", url, claim_complete, bench.postmaster)
        lat = [x for per in cycle_ms for x in per]
        ids = [x for per in done for x in per]
        states = dict(query(url, "SELECT state, count(*) FROM jobs GROUP BY state"))
        claimed_not_once = query(url, "SELECT count(*) FROM jobs WHERE claims <> 1")[0][0]
        out["cycle"] = {"rate": len(lat) / wall, "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
                        "window": window, "cpu_ms_per_op": cpu_ms_per_op(window, len(lat)),
                        "verified": {"errors": errors[:10], "done": len(ids), "distinct": len(set(ids)),
                                     "db_states": states, "db_claimed_not_once": claimed_not_once,
                                     "ok": not errors and len(ids) == n == len(set(ids)) and states == {"done": n}
                                     and claimed_not_once == 0}}
        return out
    finally:
        drop_database(bench.cluster, name)


async def procrastinate_rep(url: str, n: int, postmaster: int) -> dict:
    """procrastinate on its own database: its schema, then n no-op jobs deferred from CONCURRENCY tasks, then one
    worker with CONCURRENCY slots that stops when the queue is empty."""
    import procrastinate

    # Its warning that an app made in __main__ cannot be found by a worker started elsewhere: ours runs here.
    logging.getLogger("procrastinate").setLevel(logging.ERROR)
    ran: list[int] = []
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url, min_size=2,
                                                                     max_size=CONCURRENCY + 4))

    @app.task(name="noop", queue=PEER_QUEUE)
    async def noop(i: int) -> None:
        ran.append(i)

    out = {}
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        enqueue_ms: list[float] = []
        indexes = iter(range(n))

        async def deferrer() -> None:
            for i in indexes:
                c0 = time.perf_counter()
                await noop.defer_async(i=i)
                enqueue_ms.append((time.perf_counter() - c0) * 1e3)

        window = CoresWindow([], postmaster)
        t0 = time.perf_counter()
        await asyncio.gather(*(deferrer() for _ in range(CONCURRENCY)))
        wall = time.perf_counter() - t0
        measured = window.close()
        todo = query(url, "SELECT count(*) FROM procrastinate_jobs WHERE status = 'todo'")[0][0]
        out["enqueue"] = {"rate": len(enqueue_ms) / wall, "p50_ms": percentile(enqueue_ms, 50),
                          "p99_ms": percentile(enqueue_ms, 99), "window": measured,
                          "cpu_ms_per_op": cpu_ms_per_op(measured, n),
                          "verified": {"db_todo": todo, "ok": todo == n == len(enqueue_ms)}}

        window = CoresWindow([], postmaster)
        t0 = time.perf_counter()
        await app.run_worker_async(queues=[PEER_QUEUE], concurrency=CONCURRENCY, wait=False, listen_notify=False,
                                   install_signal_handlers=False)
        wall = time.perf_counter() - t0
        measured = window.close()
    statuses = dict(query(url, "SELECT status::text, count(*) FROM procrastinate_jobs GROUP BY status"))
    out["dequeue"] = {"rate": len(ran) / wall, "p50_ms": None, "p99_ms": None, "window": measured,
                      "cpu_ms_per_op": cpu_ms_per_op(measured, len(ran)),
                      "verified": {"ran": len(ran), "distinct": len(set(ran)), "db_statuses": statuses,
                                   "ok": sorted(ran) == list(range(n)) and statuses == {"succeeded": n}}}
    return out


def rep_peer(bench: Bench, n: int) -> dict:
    name = f"peer_{next(bench.copies)}"
    url = bench.cluster.create_database(name)
    try:
        return asyncio.run(procrastinate_rep(url, n, bench.postmaster))
    finally:
        drop_database(bench.cluster, name)


def attempt(label: str, fn: Callable, *args) -> dict:
    """One run; an exception is recorded (the figure then reports FAILED and the exit status is 1)."""
    log(label)
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - recorded, reported, and the run exits 1
        error = traceback.format_exc(limit=8)
        log(f"{label}: FAILED\n{error}")
        return {"error": error}


def log_result(label: str, out: dict) -> None:
    if "error" in out:
        return
    w = out.get("window", {})
    rate = f"{out['rate']:,.0f}/s, " if out.get("rate") is not None else ""
    p99 = out.get("p99_ms")
    log(f"{label}: {rate}p99 {'?' if p99 is None else f'{p99:.1f}'} ms; cores: servers {w.get('servers_cores')}, "
        f"Postgres {w.get('postgres_cores')}, client {w.get('client_cores')}, other {w.get('other_cores')}"
        f"{'' if out.get('verified', {}).get('ok') else '; CHECKS FAILED'}")


def record(label: str, out: dict, parts: tuple[str, ...], into: dict[str, list]) -> None:
    """A run that measured several figures at once, logged and kept by figure (an error counts against each)."""
    for part in parts:
        value = out if "error" in out else out[part]
        log_result(f"{label}: {part}", value)
        into[part].append(value)


# ----------------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------------

CORE_KEYS = ("server_cores", "postgres_cores", "client_cores", "kernel_thread_cores", "irq_cores", "other_cores")


def summarize(reps: list[dict]) -> dict:
    """Medians over the rounds that passed their checks; the windows' CPU shares as medians over all rounds."""
    good = [r for r in reps if "error" not in r and r.get("verified", {}).get("ok")]
    windows = [r["window"] for r in reps if "window" in r]

    def median(key: str, rows: list[dict]):
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(values) if values else None

    per_server = [w["servers_cores"] for w in windows if w.get("servers_cores")]
    return {
        "ok": bool(reps) and len(good) == len(reps), "reps": len(reps), "median": median("rate", good),
        "rates": [r.get("rate") for r in reps], "p50_median_ms": median("p50_ms", good),
        "p99_median_ms": median("p99_ms", good), "from_post_p50_median_ms": median("from_post_p50_ms", good),
        "from_post_p99_median_ms": median("from_post_p99_ms", good),
        "cpu_ms_per_op_median": median("cpu_ms_per_op", good),
        "cores": {key: median(key, windows) for key in CORE_KEYS},
        "servers_cores": [statistics.median(column) for column in zip(*per_server)] if per_server else [],
        "max_other_cores": max((w["other_cores"] for w in windows), default=None),
        "busy": any(w["busy"] for w in windows),
    }


def rotated(items: tuple, by: int) -> list:
    return list(items[by % len(items):] + items[:by % len(items)])


def run(sizes: dict) -> dict:
    t0 = time.perf_counter()
    results: dict = {"machine": machine_facts(), "quick": sizes["quick"], "sizes": sizes,
                     "loadavg_start": os.getloadavg(), "gates": [], "figures": {}}
    peer_missing = None if importlib.util.find_spec("procrastinate") else PEER_MISSING
    if peer_missing:
        log(f"{peer_missing}: the peer's rows are skipped")
    root = Path(tempfile.mkdtemp(prefix="sb-bench-pg-"))
    cluster = None
    try:
        log("starting a Postgres cluster, durability on")
        cluster = pg_cluster.start()
        results["postgres"] = {"settings": durable(cluster), "data_filesystem": filesystem(cluster.data),
                               "scratch_filesystem": filesystem(Path(tempfile.gettempdir()))}
        key_file = root / "switchboard.key"
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as key:
            key.write(base64.b64encode(os.urandom(32)).decode() + "\n")
        bench = Bench(cluster, str(key_file), root, postmaster_pid(cluster), {}, itertools.count(1))
        log(f"set-up: templates through the CLI on both engines, {sizes['cycles']} todos pushed on each; "
            f"{sizes['deliveries']} deliveries signed")
        bench.templates = make_templates(bench, sizes["cycles"])
        deliveries = build_deliveries(sizes["deliveries"])
        results["body_bytes"] = statistics.fmean(len(raw) for raw, _ in deliveries)
        results["setup_s"] = round(time.perf_counter() - t0, 1)

        reps: dict = {"ingest": {c: [] for c in CONFIGS}, "claim": {c: [] for c in CONFIGS},
                      "doorbell": {c: [] for c in DOORBELL_CHANNELS}, "raw": {p: [] for p in RAW_PARTS},
                      "peer": {p: [] for p in PEER_PARTS}}
        for r in range(sizes["rounds"]):
            k = r + 1
            results["gates"].append(load_gate(f"ingest round {k}", sizes["gate_max_s"]))
            for config in rotated(tuple(CONFIGS), r):
                out = attempt(f"ingest round {k}: {LABELS[config]}", rep_ingest, bench, config, deliveries)
                log_result(f"ingest round {k}: {LABELS[config]}", out)
                reps["ingest"][config].append(out)
            results["gates"].append(load_gate(f"claim round {k}", sizes["gate_max_s"]))
            for config in rotated(tuple(CONFIGS), r):
                out = attempt(f"claim + complete round {k}: {LABELS[config]}", rep_claim, bench, config,
                              sizes["cycles"])
                log_result(f"claim + complete round {k}: {LABELS[config]}", out)
                reps["claim"][config].append(out)
            results["gates"].append(load_gate(f"doorbell round {k}", sizes["gate_max_s"]))
            out = attempt(f"doorbell round {k}: {sizes['rings']} rings per channel, A → B", rep_doorbell, bench,
                          sizes["rings"], sizes["warmup"])
            record(f"doorbell round {k}", out, DOORBELL_CHANNELS, reps["doorbell"])
            results["gates"].append(load_gate(f"raw round {k}", sizes["gate_max_s"]))
            out = attempt(f"raw psycopg round {k}: {sizes['raw']} rows, {CONCURRENCY} threads", rep_raw, bench,
                          sizes["raw"], sizes["commits"])
            record(f"raw round {k}", out, RAW_PARTS, reps["raw"])
            if not peer_missing:
                results["gates"].append(load_gate(f"peer round {k}", sizes["gate_max_s"]))
                out = attempt(f"procrastinate round {k}: {sizes['peer']} jobs", rep_peer, bench, sizes["peer"])
                record(f"procrastinate round {k}", out, PEER_PARTS, reps["peer"])
        results["gates"].append(load_gate("round trips", sizes["gate_max_s"]))
        results["round_trips"] = attempt(f"round trips: {ROUND_TRIP_OPS} deliveries, {ROUND_TRIP_OPS} claim + complete",
                                         rep_round_trips, bench, deliveries, ROUND_TRIP_OPS, sizes["warmup"])
        if "error" not in results["round_trips"]:
            log("round trips per operation: " + ", ".join(f"{f} {results['round_trips'][f]['per_op']}"
                                                           for f in ("delivery", "claim + complete")))
        for figure, by_part in reps.items():
            if figure == "peer" and peer_missing:
                results["figures"]["peer"] = {"skipped": peer_missing}
                continue
            results["figures"][figure] = {part: {"summary": summarize(v), "reps": v} for part, v in by_part.items()}
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    results["loadavg_end"] = os.getloadavg()
    results["elapsed_s"] = round(time.perf_counter() - t0, 1)
    if source_fingerprint() != results["machine"]["source"]:
        results["warning"] = "the package changed on disk during the run"
    results["goals"] = goals(results)
    results["failures"] = failures(results)
    return results


# ----------------------------------------------------------------------------------------------------
# goals and report
# ----------------------------------------------------------------------------------------------------

def goals(results: dict) -> list[dict]:
    """The table's rows: value, reference, ratio, goal, met (True/False, 'busy', 'failed', 'skipped', None = info)."""
    fig = results["figures"]
    ing = {k: v["summary"] for k, v in fig["ingest"].items()}
    cl = {k: v["summary"] for k, v in fig["claim"].items()}
    door = {k: v["summary"] for k, v in fig["doorbell"].items()}
    raw = {k: v["summary"] for k, v in fig["raw"].items()}
    peer = None if "skipped" in fig["peer"] else {k: v["summary"] for k, v in fig["peer"].items()}
    rows: list[dict] = []

    def add(key, figure, unit, value_sum, ref_sum, ref_label, goal, test, field="median", info=False,
            needs_peer=False):
        value = value_sum[field] if value_sum else None
        reference = ref_sum[field] if ref_sum else None
        ratio = None if unit != "/s" or value is None or not reference else value / reference
        sums = [s for s in (value_sum, ref_sum) if s]
        busy = any(s["busy"] for s in sums)
        if needs_peer and peer is None:
            met = "skipped"
        elif not all(s["ok"] for s in sums):
            met = "failed"
        elif info:
            met = None
        elif busy:
            met = "busy"
        else:
            met = passes(test, value, ratio)
        rows.append({"key": key, "figure": figure, "unit": unit, "value": value, "reference": reference,
                     "reference_label": ref_label, "ratio": ratio, "goal": goal, "test": test, "met": met,
                     "busy": busy, "max_other_cores": max((s["max_other_cores"] or 0 for s in sums), default=0)})

    add("ingest_pg1", "no-rules ingest, 16 senders: Postgres, one process", "/s", ing["pg1"], ing["sqlite"],
        "SQLite mode", "≥ 0.6×", ("ratio", ">=", 0.6))
    add("claim_pg1", "claim + complete over REST, 8 workers: Postgres, one process", "/s", cl["pg1"], cl["sqlite"],
        "SQLite mode", "≥ 0.6×", ("ratio", ">=", 0.6))
    add("ingest_pg2", "no-rules ingest: Postgres, two processes", "/s", ing["pg2"], ing["pg1"],
        "Postgres, one process", "≥ 1.25×", ("ratio", ">=", 1.25))
    add("claim_pg2", "info: claim + complete: Postgres, two processes", "/s", cl["pg2"], cl["pg1"],
        "Postgres, one process", "info", None, info=True)
    add("doorbell_sse", "doorbell across processes, SSE stream on B: A's 202 → ring, p99", "ms", door["sse"], None,
        "", "< 25 ms", ("value", "<", 25), field="p99_median_ms")
    add("doorbell_wait", "doorbell across processes, waiting claim on B: A's 202 → claim answered, p99", "ms",
        door["wait"], None, "", "< 25 ms", ("value", "<", 25), field="p99_median_ms")
    add("claim_vs_peer", "claim + complete, Postgres one process, vs the peer's dequeue", "/s", cl["pg1"],
        peer and peer["dequeue"], f"procrastinate dequeue, {CONCURRENCY} slots", "≥ 1.5×", ("ratio", ">=", 1.5),
        needs_peer=True)
    trips = results.get("round_trips") or {}
    for key, figure, goal in (("delivery", "round trips to Postgres per delivery", 3),
                              ("claim + complete", "round trips to Postgres per claim + complete", 4)):
        ok = bool(trips.get("verified", {}).get("ok"))
        value = trips[key]["per_op"] if ok else None
        rows.append({"key": f"round_trips_{key}", "figure": figure, "unit": "round trips", "value": value,
                     "reference": None, "reference_label": "", "ratio": None, "goal": f"≤ {goal}",
                     "test": ("value", "<=", goal), "met": passes(("value", "<=", goal), value, None) if ok else "failed",
                     "busy": False, "max_other_cores": 0})
    add("claim_pg2_vs_peer", "info: claim + complete, Postgres two processes, vs the peer's dequeue", "/s",
        cl["pg2"], peer and peer["dequeue"], f"procrastinate dequeue, {CONCURRENCY} slots", "info", None, info=True,
        needs_peer=True)
    add("ingest_vs_raw", "info: ingest, Postgres one process, vs the raw INSERT + COMMIT", "/s", ing["pg1"],
        raw["enqueue"], f"raw psycopg, {CONCURRENCY} threads", "info", None, info=True)
    add("claim_vs_raw", "info: claim + complete, Postgres one process, vs the raw claim + complete", "/s", cl["pg1"],
        raw["cycle"], f"raw psycopg, {CONCURRENCY} threads", "info", None, info=True)
    add("peer_enqueue_vs_raw", "info: the peer's enqueue vs the raw INSERT + COMMIT", "/s",
        peer and peer["enqueue"], raw["enqueue"], f"raw psycopg, {CONCURRENCY} threads", "info", None, info=True,
        needs_peer=True)
    add("peer_dequeue_vs_raw", "info: the peer's dequeue vs the raw claim + complete", "/s",
        peer and peer["dequeue"], raw["cycle"], f"raw psycopg, {CONCURRENCY} threads", "info", None, info=True,
        needs_peer=True)
    return rows


def failures(results: dict) -> list[str]:
    bad = []
    for figure, parts in results["figures"].items():
        if "skipped" in parts:
            continue
        for part, data in parts.items():
            for i, rep in enumerate(data["reps"]):
                if "error" in rep:
                    bad.append(f"{figure} {part} round {i + 1}: {rep['error'].strip().splitlines()[-1]}")
                elif not rep.get("verified", {}).get("ok"):
                    bad.append(f"{figure} {part} round {i + 1}: checks failed: {json.dumps(rep['verified'])[:500]}")
    trips = results.get("round_trips", {})
    if "error" in trips:
        bad.append(f"round trips: {trips['error'].strip().splitlines()[-1]}")
    elif trips and not trips["verified"]["ok"]:
        bad.append(f"round trips: checks failed: {json.dumps(trips)[:500]}")
    return bad


def _num(x, unit: str) -> str:
    if x is None or x != x:  # None, or NaN
        return "?"
    if unit == "round trips":
        return f"{x:.2f}"
    return f"{x:,.0f}/s" if unit == "/s" else f"{x:.1f} ms"


def _met(row: dict) -> str:
    return {None: "info", "failed": "FAILED (checks; see results-postgres.json)",
            "skipped": "skipped: procrastinate not installed",
            "busy": f"busy (other processes {row['max_other_cores']:.2f} cores): not a result",
            True: "**yes**", False: "**no**"}[row["met"]]


def goals_table(results: dict) -> list[str]:
    lines = ["| figure | value | reference | ratio | goal (issue 46) | met |", "|---|---:|---|---:|---|---|"]
    for row in results["goals"]:
        value = "—" if row["met"] in ("failed", "skipped") else _num(row["value"], row["unit"])
        if row["busy"] and row["met"] not in ("failed", "skipped"):
            value += " (busy)"
        ref = ""
        if row["reference_label"]:
            ref = f"{'—' if row['reference'] is None else _num(row['reference'], row['unit'])} ({row['reference_label']})"
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}×"
        lines.append(f"| {row['figure']} | {value} | {ref} | {ratio} | {row['goal']} | {_met(row)} |")
    return lines


def bound_by(s: dict, nproc: int) -> str:
    """What the window's CPU says held a figure back: the machine's cores, one process's core (a Python process's
    threads share one GIL), or neither, and then which part used most while the figure waited on round trips and
    commits."""
    cores = s["cores"]
    if cores["client_cores"] is None:
        return "?"
    total = sum(cores[k] or 0 for k in CORE_KEYS)
    parts = {"client": cores["client_cores"], "Postgres": cores["postgres_cores"],
             **{f"server {i + 1}" if len(s["servers_cores"]) > 1 else "server": x
                for i, x in enumerate(s["servers_cores"])}}
    largest = max(parts, key=lambda k: parts[k] or 0)
    if total >= 0.85 * nproc:
        return f"the cores: {total:.2f} of {nproc} busy"
    if largest != "Postgres" and parts[largest] >= 0.85:
        return f"one process's core: the {largest} at {parts[largest]:.2f}"
    return (f"neither ({total:.2f} of {nproc} cores busy, the most {largest} {parts[largest]:.2f}): "
            "round trips and commits in series")


def _cores(s: dict) -> str:
    c = s["cores"]

    def f(x):
        return "?" if x is None else f"{x:.2f}"

    servers = " + ".join(f(x) for x in s["servers_cores"]) or "—"
    return f"{servers} | {f(c['postgres_cores'])} | {f(c['client_cores'])} | {f(c['other_cores'])}"


def figures_table(results: dict) -> list[str]:
    """Every figure side by side: its median, latency, the CPU each part took, and what bound it."""
    fig, nproc = results["figures"], results["machine"]["nproc"] or 2
    lines = ["| run | median | p50 / p99 | CPU cores: servers | Postgres | client | other | CPU per op | bound by |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]

    def row(label: str, s: dict, latency: str = "", bound: str = "") -> None:
        if not s["ok"]:
            lines.append(f"| {label} | FAILED | | | | | | | |")
            return
        latency = latency or f"{_num(s['p50_median_ms'], 'ms')} / {_num(s['p99_median_ms'], 'ms')}"
        per_op = "" if s["cpu_ms_per_op_median"] is None else f"{s['cpu_ms_per_op_median']:.2f} ms"
        median = "" if s["median"] is None else _num(s["median"], "/s")
        lines.append(f"| {label} | {median} | {latency} | {_cores(s)} | {per_op} | {bound or bound_by(s, nproc)} |")

    for config in CONFIGS:
        row(f"no-rules ingest, {LABELS[config]} (ack)", fig["ingest"][config]["summary"])
    for config in CONFIGS:
        row(f"claim + complete, {LABELS[config]} (cycle)", fig["claim"][config]["summary"])
    # A ring's latency is a path, not a rate: what it waits on is the hops after A's commit.
    path = "A's commit → NOTIFY → B's ring thread → B's event loop"
    for channel, label, bound in (("sse", "SSE stream", f"the path: {path} → the stream"),
                                  ("wait", "waiting claim", f"the path: {path} → the claim's own transaction on B")):
        s = fig["doorbell"][channel]["summary"]
        row(f"doorbell A → B, {label} (from A's 202; from the send)", s,
            f"{_num(s['p50_median_ms'], 'ms')} / {_num(s['p99_median_ms'], 'ms')}; "
            f"{_num(s['from_post_p50_median_ms'], 'ms')} / {_num(s['from_post_p99_median_ms'], 'ms')}", bound)
    row("raw psycopg, one thread: INSERT + COMMIT", fig["raw"]["commit"]["summary"])
    row(f"raw psycopg, {CONCURRENCY} threads: INSERT + COMMIT", fig["raw"]["enqueue"]["summary"])
    row(f"raw psycopg, {CONCURRENCY} threads: claim + complete (two commits)", fig["raw"]["cycle"]["summary"])
    if "skipped" in fig["peer"]:
        lines.append(f"| procrastinate | skipped: {fig['peer']['skipped']} | | | | | | | |")
    else:
        row(f"procrastinate enqueue (`defer_async`, {CONCURRENCY} tasks)", fig["peer"]["enqueue"]["summary"])
        row(f"procrastinate dequeue (worker, {CONCURRENCY} slots, no-op job)", fig["peer"]["dequeue"]["summary"], "—")
    return lines


def details(results: dict) -> list[str]:
    fig, sz = results["figures"], results["sizes"]

    def each(reps: list[dict], key: str, fmt: str) -> str:
        return ", ".join("?" if r.get(key) is None else format(r[key], fmt) for r in reps)

    out = []
    for figure, what in (("ingest", f"{sz['deliveries']:,} deliveries of {results['body_bytes'] / 1000:.1f} KB"),
                         ("claim", f"{sz['cycles']:,} todos")):
        parts = []
        for config in CONFIGS:
            reps = fig[figure][config]["reps"]
            split_note = ""
            if config == "pg2":
                split_note = " (answered by each process: " + "; ".join(
                    "/".join(str(x) for x in r.get("answered_per_process", [])) for r in reps) + ")"
            parts.append(f"{LABELS[config]} {each(reps, 'rate', ',.0f')}/s, p99 {each(reps, 'p99_ms', '.1f')} ms"
                         f"{split_note}")
        out.append(f"- {'No-rules ingest' if figure == 'ingest' else 'claim + complete'}, {what}, each round: "
                   + "; ".join(parts) + ".")
    for channel in DOORBELL_CHANNELS:
        reps = [r for r in fig["doorbell"][channel]["reps"] if "error" not in r]
        if reps:
            out.append(f"- Doorbell A → B, {channel}, each round: {each(reps, 'rings', 'd')} rings, p50 "
                       f"{each(reps, 'p50_ms', '.2f')} ms, p99 {each(reps, 'p99_ms', '.2f')} ms from A's 202 (ring "
                       f"parsed before the 202: {each(reps, 'share_before_202', '.0%')}); A's ack "
                       f"p50 {each(reps, 'ack_p50_ms', '.2f')} ms; sessions rung "
                       f"{each(reps, 'sessions_rung', 'd')} of {DOORBELL_SESSIONS}.")
    raw = fig["raw"]
    out.append(f"- Raw psycopg, each round: one thread's INSERT + COMMIT p50 "
               f"{each(raw['commit']['reps'], 'p50_ms', '.2f')} ms; {CONCURRENCY} threads' INSERT + COMMIT {each(raw['enqueue']['reps'], 'rate', ',.0f')}/s; "
               f"claim + complete {each(raw['cycle']['reps'], 'rate', ',.0f')}/s ({sz['raw']:,} rows).")
    if "skipped" not in fig["peer"]:
        out.append(f"- procrastinate, each round ({sz['peer']:,} jobs): enqueue "
                   f"{each(fig['peer']['enqueue']['reps'], 'rate', ',.0f')}/s, dequeue "
                   f"{each(fig['peer']['dequeue']['reps'], 'rate', ',.0f')}/s.")
    windows = [r["window"] for parts in fig.values() if "skipped" not in parts for d in parts.values()
               for r in d["reps"] if "window" in r]
    gates, others = results["gates"], [w["other_cores"] for w in windows]
    out.append(f"- Other processes used at most {max(others, default=0):.2f} cores during a measured window (mean "
               f"{statistics.fmean(others) if others else 0:.2f}); the load gate waited {sum(g['waited_s'] for g in gates):.0f} s in all"
               f"{'' if all(g['quiet'] for g in gates) else ' and gave up waiting at least once'}.")
    return out


HOW = (
    "**How measured.** `python tests/bench/bench_postgres.py` (its docstring has the details). Servers are "
    "`switchboard.py serve --ingest-rate 0` children on 127.0.0.1, each run on a fresh copy of a database set up "
    "through the CLI (SQLite at synchronous FULL; Postgres with `--key-file`); two processes share one database "
    "and the load (8 of the 16 senders, 4 of the 8 workers on each). The client is this process: asyncio over raw "
    "keep-alive sockets (load_generator.py's connection), so it takes little of the two cores the servers and "
    "Postgres share. Ingest: bench_compare's signed 12.8 KB `issues.labeled` deliveries to a no-rules webhook, 16 "
    "closed loops; each answer checked 202 `routed` with one todo, and the database's events and pending todos "
    "counted. claim + complete: 8 closed loops of a claim and a complete on pre-pushed todos; each todo completed "
    "once, checked in the database. Doorbell: process A takes signed deliveries one at a time, process B holds 20 "
    "sessions of the endpoint (SSE streams, then waiting claims); latency from A's 202 (or from the send) to the "
    "ring parsed on B's session, joined by todo id, each todo rung once (bench_doorbell.measure_channel). Raw: "
    "psycopg 3, one connection per thread, each statement its own round trip, every COMMIT durable. Peer: "
    "procrastinate on its own database in the same cluster, an async no-op task. CPU: each server's process tree, "
    "the Postgres cluster (the postmaster's tree) and this client from /proc over each measured window; other "
    "processes are the machine's busy time less those and the kernel threads. Rounds interleave the systems (the "
    "order rotates), medians over rounds; before each group of runs the load gate waits for other processes to "
    "use under 0.15 cores (up to 30 s, 10 s with --quick), and a figure with a window above 0.25 cores is busy, "
    "not met or missed. \"Bound by\": the machine's cores when this run's parts and the others used 85% of them, "
    "else one process (a server or the client: a Python process's threads share one GIL) when it used 0.85 of a "
    "core, else neither: the requests waited on round trips and commits in series.")


def markdown(results: dict) -> str:
    m, src, sz = results["machine"], results["machine"]["source"], results["sizes"]
    pg = results["postgres"]
    s = pg["settings"]
    rounds = sz["rounds"]
    lines = [
        f"Measured {m['date'].replace('+00:00', '').replace('T', ' ')} UTC"
        f"{' (QUICK RUN: small sizes, one round, not representative)' if results['quick'] else ''}, switchboard "
        f"{m['switchboard']} at `{src['git_head']}`{' + uncommitted changes' if src['dirty'] else ''} (source hash "
        f"{src['sha256_package']}); {rounds} interleaved round{'s' if rounds > 1 else ''}, {sz['deliveries']:,} "
        f"deliveries per ingest run, {sz['cycles']:,} todos per claim run, {sz['rings']} rings per doorbell channel, "
        f"{sz['raw']:,} raw rows, {sz['peer']:,} peer jobs; {results['elapsed_s']:.0f} s.",
        "",
        f"Machine: {m['nproc']} CPUs ({m['cpu_model'] or 'model unknown'}), {m['memory']} memory, Python "
        f"{m['python']}, SQLite {m['sqlite']}, {m['os']}. Load average (1/5/15 min) "
        f"{'/'.join(f'{x:.2f}' for x in results['loadavg_start'])} at the start, "
        f"{'/'.join(f'{x:.2f}' for x in results['loadavg_end'])} at the end (this run's processes count in it).",
        "",
        f"Postgres {s['server_version']}, a cluster of this run's own on the same machine: fsync {s['fsync']}, "
        f"full_page_writes {s['full_page_writes']}, synchronous_commit {s['synchronous_commit']}, wal_sync_method "
        f"{s['wal_sync_method']}, wal_level {s['wal_level']}, shared_buffers {s['shared_buffers']}, max_connections "
        f"{s['max_connections']}, commit_delay {s['commit_delay']}; its data on {pg['data_filesystem']}, the SQLite "
        f"files on {pg['scratch_filesystem']}.",
        "",
        *goals_table(results),
        "",
        *figures_table(results),
        "",
        *details(results),
        "",
        HOW,
    ]
    return "\n".join(lines + report_notes(results))


def print_goals(results: dict) -> None:
    for row in results["goals"]:
        if row["test"] is None:
            continue
        verdict = {True: "PASS", False: "FAIL", "busy": "BUSY", "failed": "FAILED", "skipped": "SKIP"}[row["met"]]
        ratio = "" if row["ratio"] is None else f" ({row['ratio']:.2f}x {row['reference_label']})"
        print(f"{verdict:6} {row['figure']}: {_num(row['value'], row['unit'])}{ratio}; goal {row['goal']}",
              file=sys.stderr)


def page_has_markers() -> bool:
    lines = [line.strip() for line in SPEED_PAGE.read_text().splitlines()]
    return lines.count(PAGE_START) == 1 and lines.count(PAGE_END) == 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and one round (a few minutes)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3, 1 with --quick)")
    parser.add_argument("--deliveries", type=int, help="deliveries per ingest run")
    parser.add_argument("--cycles", type=int, help="todos per claim + complete run")
    parser.add_argument("--rings", type=int, help="rings per doorbell channel per round")
    parser.add_argument("--page", action="store_true",
                        help=f"rewrite docs/speed.md between {PAGE_START} and {PAGE_END}")
    parser.add_argument("--out", default=str(RESULTS_PATH))
    args = parser.parse_args(argv)
    reason = pg_cluster.available()
    if reason is not None:
        print(MISSING_POSTGRES.format(reason=reason), file=sys.stderr)
        return 2
    if psycopg is None:
        print(MISSING_PSYCOPG, file=sys.stderr)
        return 2
    if args.page and not page_has_markers():
        print(f"--page: docs/speed.md needs one {PAGE_START} line and one {PAGE_END} line where the block goes",
              file=sys.stderr)
        return 2
    sizes = dict(SIZES_QUICK if args.quick else SIZES_FULL, quick=args.quick)
    sizes.update({k: v for k, v in (("rounds", args.rounds), ("deliveries", args.deliveries),
                                    ("cycles", args.cycles), ("rings", args.rings)) if v is not None})
    # A SIGTERM unwinds like Ctrl-C, so the servers and the cluster are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = run(sizes)
    print_goals(results)
    return report(results, markdown(results), args.out, args.page, PAGE_START, PAGE_END)


if __name__ == "__main__":
    sys.exit(main())
