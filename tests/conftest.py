"""Shared fixtures: a real SQLite file per test, the real app (through Starlette's test client or a real
uvicorn process on a free loopback port), and principals made through the store itself."""

from __future__ import annotations

import compileall
import contextlib
import copy
import io
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from helpers import TLS, make_webhook, post_delivery
from starlette.testclient import TestClient

from switchboard.app import create_app
from switchboard.cli.parser import main
from switchboard.configuration import Clock
from switchboard.database import Database
from switchboard.store.principals import add_human
from switchboard.store.upkeep import scheduler_tick

ROOT = Path(__file__).resolve().parent.parent

# Which engine the suite runs on: `SWITCHBOARD_TEST_ENGINE=postgres python3 -m pytest` runs every test that
# opens a database on a Postgres cluster the tests start themselves (tests/pg_cluster.py), a fresh database per
# test; tests that open none run in the SQLite run only, and so do those about SQLite itself (sqlite_only).
ENGINE = os.environ.get("SWITCHBOARD_TEST_ENGINE", "sqlite")
DATABASE_FIXTURES = {"db_path", "template", "postgres_databases"}
# A database URL's working directory (logs, key file), as a SQLite file's is the directory it lies in.
WORKDIRS: dict[str, Path] = {}


def workdir(db_path: str) -> Path:
    return WORKDIRS[db_path] if db_path in WORKDIRS else Path(db_path).parent


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "sqlite_only(reason): about SQLite itself; the Postgres run leaves it out")


# Workers for `-n auto` (pyproject's addopts), sized for the 2-core machine the suite is measured on. The SQLite
# run waits a good part of its time (leases lapsing, kill grace, servers starting), so a third worker fills those
# waits: 6 min 39 s with two, 5 min 25 s with three, 5 min 6 s with four (same machine, same commit). The Postgres
# run was bound by the kernel time of CREATE DATABASE on disk (9 min 34 s with two workers); with its clusters in
# memory (pg_cluster) it waits too, and a third worker fills those waits: 8 min 51 s with two, 7 min 10 s with
# three.
AUTO_WORKERS = 3


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config) -> int:
    return AUTO_WORKERS


# The files that take longest, longest first: by the larger of a file's share of the SQLite run and of the Postgres
# run (each measured with --durations; test_postgres.py is the longest on Postgres, test_docs_examples.py on
# SQLite). xdist's --dist loadfile hands whole files to the workers in this order, so the long files start
# at once and the many short ones even out the end, where a long file handed out last ran alone.
LONGEST_FILES = (
    "test_postgres.py", "test_docs_examples.py", "test_worker_attacks.py", "test_ingress_reliability.py",
    "test_standalone.py", "test_queue_control.py", "test_replay.py", "test_cli.py", "test_readme.py",
    "test_worker.py", "test_bulk.py", "test_notify.py", "test_cli_forge.py", "test_triage.py", "test_mcp.py",
    "test_reliability.py", "test_operations.py", "test_packs.py", "test_hardening_network.py", "test_limits.py",
    "test_ingest_limits.py", "test_forge_live.py", "test_proxy_sign_in.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: n for n, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests stay in order
    if ENGINE != "postgres":
        return
    for item in items:
        marker = item.get_closest_marker("sqlite_only")
        if marker is not None:
            item.add_marker(pytest.mark.skip(reason=f"SQLite only: {marker.args[0] if marker.args else ''}"))
        elif not DATABASE_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.skip(reason="opens no database: it runs in the SQLite run"))


class PostgresDatabases:
    """A cluster for this test process, with the schema applied once to a template database that every test's
    database is copied from (CREATE DATABASE … TEMPLATE: milliseconds, where applying the schema takes longer)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.made = 0
        base = cluster.create_database("switchboard_template")
        from switchboard.postgres import Postgres

        Postgres(base, migrate=True).close()

    def fresh(self, directory: Path, template: str = "switchboard_template") -> str:
        self.made += 1
        url = self.cluster.create_database(f"t{os.getpid()}_{self.made}", template)
        WORKDIRS[url] = directory
        return url

    def drop(self, url: str) -> None:
        """A test's database, once the test is over: the cluster lives in memory (pg_cluster.start), and a run
        makes a thousand databases."""
        WORKDIRS.pop(url, None)
        self.cluster.drop_database_later(url.rsplit("/", 1)[1])


@pytest.fixture(scope="session")
def postgres_databases():
    if ENGINE != "postgres":
        yield None
        return
    import pg_cluster

    reason = pg_cluster.available()
    if reason is not None:
        pytest.fail(f"SWITCHBOARD_TEST_ENGINE=postgres {reason}")
    cluster = pg_cluster.start(in_memory=True)
    try:
        yield PostgresDatabases(cluster)
    finally:
        cluster.stop()


def fresh_database(directory: Path, databases: PostgresDatabases | None, template: str | None = None) -> str:
    """A new, empty database for a test, on the suite's engine: a SQLite file in `directory`, or a Postgres
    database (its key file in `directory`, named by SWITCHBOARD_KEY_FILE for the app and every child process)."""
    if databases is None:
        return str(directory / "switchboard.db")
    os.environ["SWITCHBOARD_KEY_FILE"] = str(directory / "switchboard.key")
    return databases.fresh(directory, template or "switchboard_template")


def dropped_after(database: str, databases: PostgresDatabases | None) -> Iterator[str]:
    """Yield `database` to a test, then drop it (Postgres; a SQLite file goes with the test's directory)."""
    yield database
    if databases is not None:
        databases.drop(database)


# Where Python writes no bytecode cache (PYTHONDONTWRITEBYTECODE), each server and CLI process the tests start
# would compile the package's 10,000 lines again: compile them once here instead. And pytest keeps the test
# modules it rewrites for their asserts: rewriting all of them was 8 s of CPU for every worker of every run.
compileall.compile_dir(str(ROOT / "switchboard"), quiet=1)
sys.dont_write_bytecode = False


class ManualClock(Clock):
    """A clock the test moves by hand, so leases and backoff are tested without sleeping."""

    def __init__(self, start_ms: int = 1_800_000_000_000):
        self.ms = start_ms

    def now_ms(self) -> int:
        return self.ms

    def advance(self, seconds: float) -> None:
        self.ms += int(seconds * 1000)


@dataclass
class Endpoint:
    id: str
    token: str
    human_id: str

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"}


@dataclass
class Human:
    id: str
    name: str
    token: str

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"}


class World:
    """Principals and helpers over one app's database."""

    def __init__(self, client, db: Database):
        self.client = client
        self.db = db

    def human(self, name: str) -> Human:
        made = self.db.write_sync(add_human, name)
        return Human(made["id"], name, made["token"])

    def endpoint(self, human: Human, queues: list[str], name: str | None = None, verbs: list[str] | None = None,
                 lease: int | None = None) -> Endpoint:
        body = {"name": name or f"ep-{len(queues)}-{os.urandom(3).hex()}", "queues": queues}
        if verbs is not None:
            body["verbs"] = verbs
        if lease is not None:
            body["default_lease_seconds"] = lease
        r = self.client.post("/api/v1/endpoints", headers=human.auth, json=body)
        assert r.status_code == 201, r.text
        made = r.json()
        return Endpoint(made["id"], made["token"], human.id)

    def webhook(self, human: Human, endpoint, provider: str = "github", queue: str = "triage", **extra) -> dict:
        """A webhook `human` makes over REST for `endpoint`; the answer must be 201."""
        return make_webhook(self.client, human, endpoint, provider, queue, **extra)

    def deliver(self, webhook: dict, raw: bytes, headers: dict) -> httpx.Response:
        """POST a delivery, bytes and headers as given, to the webhook's ingest URL."""
        return post_delivery(self.client, webhook, raw, headers)

    def push(self, human: Human, endpoint: Endpoint, queue: str, title: str = "work", **extra) -> dict:
        r = self.client.post(f"/api/v1/endpoints/{endpoint.id}/todos", headers=human.auth,
                             json={"title": title, "queue": queue, **extra})
        assert r.status_code in (200, 201), r.text
        return r.json()

    def claim(self, endpoint: Endpoint, **body) -> dict:
        r = self.client.post("/api/v1/todos/claim", headers=endpoint.auth, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def act(self, principal, todo_id: str, action: str, **body) -> httpx.Response:
        return self.client.post(f"/api/v1/todos/{todo_id}/{action}", headers=principal.auth, json=body)

    def tick(self) -> dict:
        """One scheduler pass, run on the app's own loop so that its rings reach the doorbell before it returns."""
        return self.client.portal.call(self.db.write, scheduler_tick)


@dataclass
class Template:
    """A database state made once and copied for each test. `build(world, clock)` runs against a fresh app and
    database of its own and returns what the tests need to know of it (ids, tokens); then that app closes. Each
    test starts from its own copy of the files left behind, with its own app and a clock at the same moment, so
    set-up that hundreds of table rows share is made once, and no test sees another's changes.

    A module opts in with `template_fixtures`, and takes `template.value()` (a deep copy each time) for its
    scene."""
    directory: Path
    clock_ms: int
    made: object

    database: str = ""
    databases: PostgresDatabases | None = None

    @classmethod
    def build(cls, directory: Path, build, databases: PostgresDatabases | None = None) -> Template:
        clock = ManualClock()
        database = fresh_database(directory, databases)
        app = create_app(database, clock=clock, background=False)
        with TestClient(app, raise_server_exceptions=False) as client:
            made = build(World(client, app.state.db), clock)
        return cls(directory, clock.ms, made, database, databases)

    def copy_into(self, directory: Path) -> str:
        """The database and its key file, copied; the app that made them is closed, so they are at rest."""
        for path in self.directory.iterdir():
            if path.is_file():
                shutil.copy2(path, directory / path.name)
        if self.databases is None:
            return str(directory / "switchboard.db")
        return fresh_database(directory, self.databases, self.database.rsplit("/", 1)[1])

    def clock(self) -> ManualClock:
        return ManualClock(self.clock_ms)

    def value(self):
        return copy.deepcopy(self.made)


def template_fixtures(build):
    """For a module whose tests all start from the state `build(world, clock)` makes: a module-scoped `template`
    (made once) and the `db_path` and `clock` that start each test from its own copy of it, with an app of its
    own. At module level: `template, db_path, clock = template_fixtures(build)`."""

    @pytest.fixture(scope="module")
    def template(tmp_path_factory, postgres_databases) -> Iterator[Template]:
        made = Template.build(tmp_path_factory.mktemp("template"), build, postgres_databases)
        yield made
        if postgres_databases is not None:
            postgres_databases.drop(made.database)

    @pytest.fixture
    def db_path(template, tmp_path) -> Iterator[str]:
        yield from dropped_after(template.copy_into(tmp_path), template.databases)

    @pytest.fixture
    def clock(template) -> ManualClock:
        return template.clock()

    return template, db_path, clock


@pytest.fixture
def db_path(tmp_path, postgres_databases) -> Iterator[str]:
    yield from dropped_after(fresh_database(tmp_path, postgres_databases), postgres_databases)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def app(db_path, clock):
    return create_app(db_path, clock=clock, background=False)


@pytest.fixture
def client(app):
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def world(client, app) -> World:
    return World(client, app.state.db)


@pytest.fixture
def alice(world) -> Human:
    """The usual first human of a test."""
    return world.human("alice")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`python switchboard.py serve` as a child process on a free loopback port (`program` replaces the path of
    switchboard.py: e.g. `-c CODE` for a patched copy), logging to a file beside the database."""

    def __init__(self, db_path: str, *extra: str, program: tuple[str, ...] = (), env: dict | None = None,
                 wait: bool = True):
        self.db_path = db_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = (WORKDIRS[db_path] / "switchboard.log" if db_path in WORKDIRS
                         else Path(db_path).with_suffix(".log"))
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, *(program or (str(ROOT / "switchboard.py"),)), "serve", "--db", db_path,
             "--port", str(self.port), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=str(workdir(db_path)),
            env={**os.environ, **(env or {})})
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1, verify=TLS).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server did not start: {self.log_path.read_text(errors='replace')[-2000:]}")

    def logged(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()


@pytest.fixture
def live_server(db_path):
    servers: list[LiveServer] = []

    def start(*extra: str) -> LiveServer:
        server = LiveServer(db_path, *extra)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def cli_program(db_path: str, *args: str) -> tuple[int, dict]:
    """Run the CLI as the program it is (`python switchboard.py … --json`) and parse its one JSON object: for the
    tests of the program itself (test_cli.py, test_cli_json_errors.py; the README's and docs' blocks run it too)."""
    _init_first(db_path, args)
    done = subprocess.run([sys.executable, str(ROOT / "switchboard.py"), *args, "--db", db_path, "--json"],
                          capture_output=True, text=True, timeout=60)
    text = done.stdout if done.stdout.strip() else done.stderr.strip().rpartition("\n")[2]  # an error: stderr
    return done.returncode, json.loads(text) if text.strip().startswith("{") else {}


def cli(db_path: str, *args: str) -> tuple[int, dict]:
    """An operator's command with --json, run in this process through the CLI's `main`: the same parser, command,
    exit code and JSON object as the program, without a Python start-up (0.2 s of CPU) per call. The program
    itself is tested by `cli_program`'s callers."""
    _init_first(db_path, args)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([*args, "--db", db_path, "--json"])
        except SystemExit as exc:  # a usage error: argparse exits 2, as the real CLI would
            code = exc.code
    text = out.getvalue() if out.getvalue().strip() else err.getvalue().strip().rpartition("\n")[2]  # an error
    return code, json.loads(text) if text.strip().startswith("{") else {}


def _init_first(db_path: str, args: tuple) -> None:
    """Like the README, the operator runs `init` once before any other command (only init and serve create a
    database)."""
    if db_path not in WORKDIRS and not Path(db_path).exists() and args[:1] not in (("init",), ("serve",)):
        with contextlib.redirect_stdout(io.StringIO()):
            main(["init", "--db", db_path, "--json"])


def snapshot(db_path: str) -> dict:
    """Every row of every table (ordered by primary key, else rowid), plus the schema version: what a refused
    request must leave exactly as it found it."""
    if db_path in WORKDIRS:
        return _postgres_snapshot(db_path)
    conn = sqlite3.connect(db_path)
    try:
        out: dict = {"user_version": conn.execute("PRAGMA user_version").fetchone()[0]}
        tables = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")]
        for table in tables:
            info = conn.execute(f'PRAGMA table_info("{table}")').fetchall()
            pk = [row[1] for row in sorted(info, key=lambda r: r[5]) if row[5] > 0]
            order = ", ".join(f'"{c}"' for c in pk) if pk else "rowid"
            out[table] = conn.execute(f'SELECT * FROM "{table}" ORDER BY {order}').fetchall()
        return out
    finally:
        conn.close()


def _postgres_snapshot(url: str) -> dict:
    """snapshot() on Postgres: every table of the schema (the processes' heartbeats and ring listeners, which move
    by themselves, left out), each ordered by its primary key, else its rowid. Two round trips: the tables with
    their keys, then every table's rows in one pipeline (a bad-input test takes two snapshots)."""
    import psycopg

    with psycopg.connect(url) as conn:
        out: dict = {"user_version": conn.execute("SELECT version FROM switchboard_schema").fetchone()[0]}
        tables = conn.execute(
            "SELECT t.relname, ARRAY(SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid"
            "  AND a.attnum = ANY(i.indkey) WHERE i.indrelid = t.oid AND i.indisprimary ORDER BY a.attnum)"
            " FROM pg_class t JOIN pg_namespace n ON n.oid = t.relnamespace WHERE n.nspname = 'public'"
            " AND t.relkind = 'r' AND t.relname NOT IN ('processes', 'ring_listeners', 'switchboard_schema')"
            " ORDER BY t.relname").fetchall()
        cursors = {}
        with conn.pipeline():
            for table, key in tables:
                order = ", ".join(f'"{column}"' for column in key) or "rowid"
                cursors[table] = conn.cursor().execute(f'SELECT * FROM "{table}" ORDER BY {order}')
        out.update((table, cursor.fetchall()) for table, cursor in cursors.items())
        return out
