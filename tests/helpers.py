"""Webhook and delivery helpers shared by the test modules: make a webhook and its routes over REST, post a
delivery to a webhook's ingest URL, and read the database file directly. They take any HTTP client with the
app's base URL: the Starlette test client or an httpx.Client on a live server."""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

# The tests' own HTTP clients share one TLS context: httpx builds one for each client it makes (the module-level
# httpx.get and friends make a client per call), loading the CA bundle at about 15 ms of CPU, and a polling loop
# makes hundreds. Our servers answer plain HTTP on loopback, so the context is only ever built, never used.
TLS = httpx.create_ssl_context()


def system_tool(name: str, package: str) -> str:
    """The path of a tool a check needs from the system's packages. Missing, the check skips with a line naming
    the Debian package; under CI (`CI` set) it fails instead, so CI can never silently skip it."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which(name)
    if found:
        return found
    why = f"`{name}` is not installed (Debian package `{package}`: apt-get install -y {package})"
    if os.environ.get("CI"):
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


def hook_path(url: str) -> str:
    """The path part of an ingest URL (`/hooks/<token>`), to post through a client with another base."""
    path = urlsplit(url).path
    assert re.fullmatch(r"/hooks/[A-Za-z0-9_-]{16,}", path), url
    return path


def hook_token(url: str) -> str:
    return hook_path(url).rsplit("/", 1)[1]


# Forge and cairn webhooks hold every delivery until their trusted actors are named. Tests about routing make
# them trusting everyone; the trust gate's own tests (test_trust_gate.py) pass their lists explicitly.
GATED_PROVIDERS = ("github", "gitea", "cairn")


def make_webhook(client, human, endpoint, provider: str = "github", queue: str = "triage", **extra) -> dict:
    """A webhook `human` makes over REST for `endpoint` (an endpoint, its JSON, or its id); the answer must be 201.
    A forge or cairn webhook trusts every actor unless `trusted_actors` is given."""
    endpoint_id = endpoint if isinstance(endpoint, str) else (
        endpoint["id"] if isinstance(endpoint, dict) else endpoint.id)
    if provider in GATED_PROVIDERS:
        extra.setdefault("trusted_actors", {"allow_all": True})
    r = client.post("/api/v1/webhooks", headers=human.auth,
                    json={"provider": provider, "queue": queue, "endpoint_id": endpoint_id, **extra})
    assert r.status_code == 201, r.text
    made = r.json()
    assert made["provider"] == provider and made["queue"] == queue
    return made


def add_route(client, auth: dict, webhook_id: str, endpoint_id: str):
    return client.post(f"/api/v1/webhooks/{webhook_id}/routes", headers=auth, json={"endpoint_id": endpoint_id})


def post_delivery(client, webhook: dict, raw: bytes, headers: dict):
    """POST `raw` with `headers` to the webhook's ingest URL, as the producer would."""
    return client.post(hook_path(webhook["url"]), content=raw, headers=headers)


class _PostgresConnection:
    """A connection to a test's Postgres database that takes the SQL a SQLite connection takes (`?` placeholders,
    through the engine's dialect), in autocommit: what a test that reads or writes rows directly needs."""

    def __init__(self, url: str):
        import psycopg

        self._conn = psycopg.connect(url, autocommit=True)

    def execute(self, sql: str, params: tuple = ()):
        from switchboard.postgres import dialect_sql

        if sql.strip().upper() == "BEGIN":
            # A test's BEGIN … COMMIT reads one snapshot, as it does on SQLite; READ COMMITTED, Postgres's default,
            # would let a running server's commit land between two of its reads.
            sql = "BEGIN ISOLATION LEVEL REPEATABLE READ"
        return self._conn.execute(dialect_sql(sql), tuple(params))

    def commit(self) -> None:
        """Autocommit: every statement is committed already."""

    def close(self) -> None:
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect_db(db_path: str):
    """A connection of a test's own to its database, on either engine: sqlite3's for a file, else one that speaks
    the same SQL to the Postgres URL."""
    if db_path.startswith("postgresql://"):
        return _PostgresConnection(db_path)
    return sqlite3.connect(db_path)


def integrity_errors() -> tuple[type[BaseException], ...]:
    """What a constraint's refusal raises, on either engine."""
    try:
        import psycopg
    except ImportError:
        return (sqlite3.IntegrityError,)
    return (sqlite3.IntegrityError, psycopg.errors.IntegrityError)


def query(db_path: str, sql: str, params: tuple = ()) -> list[tuple]:
    """Read the real database through a read-only connection of our own: the SQLite file, or the Postgres URL
    (the same statement, through the engine's own dialect)."""
    if db_path.startswith("postgresql://"):
        import psycopg

        from switchboard.postgres import dialect_sql

        with psycopg.connect(db_path) as conn:
            return [tuple(r) for r in conn.execute(dialect_sql(sql), params).fetchall()]
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def assert_storage_intact(db_path: str) -> None:
    """The database survived what the test did to its server: SQLite's own page and foreign-key checks on a file;
    on Postgres, which enforces its foreign keys on every write, no index left invalid."""
    if db_path.startswith("postgresql://"):
        assert query(db_path, "SELECT indexrelid::regclass::text FROM pg_index WHERE NOT indisvalid") == []
        return
    assert query(db_path, "PRAGMA integrity_check") == [("ok",)]
    assert query(db_path, "PRAGMA foreign_key_check") == []


def count(db_path: str, table: str, where: str = "1 = 1", params: tuple = ()) -> int:
    return query(db_path, f"SELECT count(*) FROM {table} WHERE {where}", params)[0][0]
