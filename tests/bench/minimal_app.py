"""The ceiling reference for bench_compare.py: the least a signed-webhook receiver with a durable queue must do,
as a real Starlette app served by uvicorn, with nothing else.

    python tests/bench/minimal_app.py --db PATH --port PORT --secret SECRET [--group-commit]

Routes (JSON answers, no pydantic, no middleware):

- `POST /hooks/{id}`: 404 unless `id` is the one hook (`--hook-id`, default `bench`); verify `X-Hub-Signature-256`
  (HMAC-SHA256 of the raw body with the fixed secret, `hmac.compare_digest`) else 401; `json.loads` the body
  (400 if it is not JSON); INSERT one row (the `X-GitHub-Delivery` id, the raw body) and COMMIT; answer
  `202 {"id", "duplicate"}`. A repeated delivery id answers 202 with `duplicate: true` and stores nothing.
- `POST /claim`: the oldest pending row becomes `claimed` with a lease (now + 60 s); `200 {"id"}` or
  `200 {"empty": true}`.
- `POST /complete/{id}`: a claimed row becomes `done`; `200 {"id", "state": "done"}`, or 409 if it was not claimed.
- `GET /healthz`: 200.

Storage: one SQLite connection in WAL mode with `synchronous=FULL`, owned by one writer thread; the event loop
verifies and parses, then hands the statement to the writer and awaits its commit before answering (so every
202 is durable). Statements are the same strings every time, so the sqlite3 module's statement cache keeps
them prepared. By default every request is its own transaction (one commit, one WAL fsync, per request).
`--group-commit` lets the writer take every request that is waiting (up to 256) into one BEGIN ... COMMIT,
and answers them all after that one commit.

Served like `switchboard.py serve`: uvicorn with uvloop (when installed) and httptools, access log off.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import importlib.util
import json
import queue
import sqlite3
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

SCHEMA = """
CREATE TABLE IF NOT EXISTS deliveries (
    id INTEGER PRIMARY KEY,
    delivery TEXT NOT NULL UNIQUE,
    body BLOB NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    lease_until REAL,
    received_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS deliveries_pending ON deliveries (id) WHERE state = 'pending';
"""
INSERT = "INSERT INTO deliveries (delivery, body, received_at) VALUES (?, ?, ?) ON CONFLICT (delivery) DO NOTHING"
CLAIM = ("UPDATE deliveries SET state = 'claimed', lease_until = ? WHERE id = "
         "(SELECT id FROM deliveries WHERE state = 'pending' ORDER BY id LIMIT 1) RETURNING id")
COMPLETE = "UPDATE deliveries SET state = 'done', lease_until = NULL WHERE id = ? AND state = 'claimed'"
LEASE_SECONDS = 60.0
MAX_BATCH = 256


def connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=5.0)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.executescript(SCHEMA)
    return conn


class Writer:
    """One thread owns the one connection. Each job is (statement, params, future, loop); the thread runs a
    batch of jobs (1, or up to MAX_BATCH with group commit) in one transaction and resolves their futures
    after COMMIT."""

    def __init__(self, path: str, group_commit: bool):
        self.conn = connect(path)
        self.batch = MAX_BATCH if group_commit else 1
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="writer", daemon=True)
        self.thread.start()

    async def run(self, sql: str, params: tuple):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.jobs.put((sql, params, future, loop))
        return await future

    def _run(self) -> None:
        conn = self.conn
        while True:
            batch = [self.jobs.get()]
            while len(batch) < self.batch:
                try:
                    batch.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            results = []
            try:
                conn.execute("BEGIN IMMEDIATE")
                for sql, params, _, _ in batch:
                    cur = conn.execute(sql, params)
                    results.append(cur.fetchone() if sql is CLAIM else cur.rowcount)
                conn.execute("COMMIT")
            except Exception as exc:  # noqa: BLE001 - hand the failure to every waiting request
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                results = [exc] * len(batch)
            for (_, _, future, loop), result in zip(batch, results):
                loop.call_soon_threadsafe(_resolve, future, result)


def _resolve(future: asyncio.Future, result) -> None:
    if future.done():
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)


def create_app(db_path: str, secret: str, hook_id: str, group_commit: bool) -> Starlette:
    writer = Writer(db_path, group_commit)
    key = secret.encode()

    async def hook(request: Request) -> Response:
        if request.path_params["hook_id"] != hook_id:
            return JSONResponse({"error": "not_found"}, status_code=404)
        body = await request.body()
        given = request.headers.get("x-hub-signature-256", "")
        expected = "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(given.encode(), expected.encode()):
            return JSONResponse({"error": "bad_signature"}, status_code=401)
        try:
            json.loads(body)
        except ValueError:
            return JSONResponse({"error": "not_json"}, status_code=400)
        delivery = request.headers.get("x-github-delivery") or hashlib.sha256(body).hexdigest()
        inserted = await writer.run(INSERT, (delivery, body, time.time()))
        return JSONResponse({"delivery": delivery, "duplicate": inserted == 0}, status_code=202)

    async def claim(request: Request) -> Response:
        row = await writer.run(CLAIM, (time.time() + LEASE_SECONDS,))
        return JSONResponse({"empty": True} if row is None else {"id": row[0]})

    async def complete(request: Request) -> Response:
        item = request.path_params["item"]
        changed = await writer.run(COMPLETE, (item,))
        if changed != 1:
            return JSONResponse({"error": "conflict"}, status_code=409)
        return JSONResponse({"id": item, "state": "done"})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    return Starlette(routes=[
        Route("/hooks/{hook_id}", hook, methods=["POST"]),
        Route("/claim", claim, methods=["POST"]),
        Route("/complete/{item:int}", complete, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--secret", required=True)
    parser.add_argument("--hook-id", default="bench")
    parser.add_argument("--group-commit", action="store_true")
    args = parser.parse_args()
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"  # what `serve` gets from loop="auto"
    app = create_app(args.db, args.secret, args.hook_id, args.group_commit)
    uvicorn.run(app, host="127.0.0.1", port=args.port, loop=loop, http="httptools", access_log=False,
                log_level="warning")


if __name__ == "__main__":
    main()
