"""The ceiling reference for bench_compare.py: the least a signed-webhook receiver with a durable queue must do,
as a real Starlette app served by uvicorn, with nothing else.

    python tests/bench/minimal_app.py --db PATH --port PORT --secret SECRET [--group-commit]
                                      [--jq-program FILE --jq-params JSON]

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

`--jq-program` is the sandbox's own limit (issue 30): the same app, but each delivery's envelope also goes
through one sandboxed jq child running the given program before its row is written, and the row keeps the
child's answer (`decision`). The child is sandboxed the way Switchboard's are (`python -I -S`, an empty
environment, a 256 MiB address-space cap, a hard deadline) and reads frames the way they do (a header line with
the byte count, then the document); the event loop writes each frame to the child's pipe and awaits its answer,
one delivery at a time. The envelope is the least the fleet pack reads: source, kind, verified, the raw body as
`payload`, and the issue fields its rules decide on.

Served like `switchboard.py serve`: uvicorn with uvloop (when installed) and httptools, access log off.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import importlib.util
import json
import os
import queue
import sqlite3
import sys
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
    decision TEXT,
    lease_until REAL,
    received_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS deliveries_pending ON deliveries (id) WHERE state = 'pending';
"""
INSERT = ("INSERT INTO deliveries (delivery, body, received_at, decision) VALUES (?, ?, ?, ?) "
          "ON CONFLICT (delivery) DO NOTHING")
CLAIM = ("UPDATE deliveries SET state = 'claimed', lease_until = ? WHERE id = "
         "(SELECT id FROM deliveries WHERE state = 'pending' ORDER BY id LIMIT 1) RETURNING id")
COMPLETE = "UPDATE deliveries SET state = 'done', lease_until = NULL WHERE id = ? AND state = 'claimed'"
LEASE_SECONDS = 60.0
MAX_BATCH = 256

JQ_CHILD = r'''
import json, resource, signal, sys
sys.path.append(sys.argv[1])
import jq
resource.setrlimit(resource.RLIMIT_AS, (256 << 20, 256 << 20))
program = jq.compile(sys.argv[2], args={"params": json.loads(sys.argv[3])})
read, write = sys.stdin.buffer, sys.stdout.buffer
for header in read:
    signal.alarm(3)
    doc = read.read(json.loads(header)["doc_bytes"]).decode()
    try:
        write.write(json.dumps({"result": program.input_text(doc).first()}).encode() + b"\n")
    except Exception as exc:
        write.write(json.dumps({"fault": str(exc)[:200]}).encode() + b"\n")
    write.flush()
    signal.alarm(0)
'''


class JqChild:
    """One sandboxed jq child, one frame at a time, driven from the event loop (no thread in between)."""

    def __init__(self, program: str, params: str):
        self.program, self.params = program, params
        self.lock = asyncio.Lock()
        self.proc: asyncio.subprocess.Process | None = None

    async def ask(self, doc: bytes) -> bytes:
        async with self.lock:
            if self.proc is None:
                jq_dir = os.path.dirname(importlib.util.find_spec("jq").origin)
                self.proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-I", "-S", "-c", JQ_CHILD, jq_dir, self.program, self.params,
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env={})
            self.proc.stdin.write(b'{"doc_bytes": %d}\n' % len(doc) + doc)
            return await self.proc.stdout.readline()


def envelope_document(headers, payload: dict, body: bytes) -> bytes:
    """The envelope the fleet pack reads: the raw body as the payload, and the issue fields it decides on."""
    issue = payload.get("issue") if isinstance(payload.get("issue"), dict) else None
    action = payload.get("action")
    view = None if issue is None else {
        "action": action, "repo": (payload.get("repository") or {}).get("full_name"), "number": issue.get("number"),
        "title": issue.get("title"), "state": issue.get("state"), "author": (issue.get("user") or {}).get("login"),
        "sender": (payload.get("sender") or {}).get("login"),
        "labels": [label.get("name") for label in issue.get("labels") or () if isinstance(label, dict)],
        "label_event": action in ("labeled", "unlabeled"),
    }
    event = headers.get("x-github-event", "")
    head = {"source": "github", "kind": f"{event}.{action}" if action else event, "verified": True,
            "issue": view, "artifact": None}
    return json.dumps(head)[:-1].encode() + b', "payload": ' + body + b"}"


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


def create_app(db_path: str, secret: str, hook_id: str, group_commit: bool,
               jq_child: JqChild | None = None) -> Starlette:
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
            payload = json.loads(body)
        except ValueError:
            return JSONResponse({"error": "not_json"}, status_code=400)
        decision = None
        if jq_child is not None:
            decision = (await jq_child.ask(envelope_document(request.headers, payload, body))).decode().strip()
        delivery = request.headers.get("x-github-delivery") or hashlib.sha256(body).hexdigest()
        inserted = await writer.run(INSERT, (delivery, body, time.time(), decision))
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
    parser.add_argument("--jq-program", help="a file holding the jq program every delivery's envelope goes through")
    parser.add_argument("--jq-params", default="{}", help="the program's $params, as JSON")
    args = parser.parse_args()
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"  # what `serve` gets from loop="auto"
    jq_child = JqChild(open(args.jq_program).read(), args.jq_params) if args.jq_program else None
    app = create_app(args.db, args.secret, args.hook_id, args.group_commit, jq_child)
    uvicorn.run(app, host="127.0.0.1", port=args.port, loop=loop, http="httptools", access_log=False,
                log_level="warning")


if __name__ == "__main__":
    main()
