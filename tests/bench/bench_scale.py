"""Flat cost as the work grows (issue 30, point 4): the same measurements on databases of 10k, 100k and 1M todos.

Run by hand (never collected by pytest):

    python tests/bench/bench_scale.py [--quick] [--sizes 10000,100000] [--keep DIR]

`--quick` builds 10k and 100k (under 10 minutes on the 2-core machine); the full run adds 1M (about 14 GB of
database and as much again for its backup; give it an hour and the disk). The last line is
`scale: N of M goals met`.

Building. Each database is built through the store's own transaction bodies, in-process and in large
transactions (synchronous OFF: the build is not measured): a human, one endpoint (queues `inbox` and `hold`) and
a signed GitHub webhook with no rules, then `record_delivery` for every delivery exactly as ingress calls it
(`issues.labeled`, padded to 12,800 bytes of JSON like bench_compare's, its own issue number and delivery id, the
envelope built by `build_envelope`), so each delivery leaves its event, its body in event_bodies, its todo, its
history line and its ring just as served ingest does. The deliveries arrive over the last 25 days. Then, through
`claim_next`, `complete`, `fail`, `needs_input`, `block`, `defer` and `reroute` on the oldest pending work
(first in, first out), the states a homelab's backlog has: a third done (each with its attempt and history),
and a few of every kind of waiting work (`MIX`); a share of the deliveries come from an untrusted sender and
are held by the trust gate. Re-rings: todos that waited longer than the last re-ring
(7 h 25 min) are marked rung five times, the state the scheduler's sweep leaves them in (the sweep itself is
measured on its own, first).

Every database is built first (they all stay on disk until the end). Then, on each:

 1. bytes per todo: the file (after a checkpoint) over the todos in it
 2. `migrate --dry-run` (median of 3) and `backup` (the CLI, a child process each; backup as MB/s of database)
 3. the re-ring sweep: how much of the backlog one pass rings (every pending todo), at 500 rings a tick
 4. retention's first pass (`prune`, nothing else running): a database past the 500,000-row cap (1M: 1M todos,
    two thirds of them open) loses its terminal todos, oldest first, and the events only they pointed at, as the
    first server on it would; the rounds measure serving on what retention leaves, not that pass

Then three rounds, each over every size in turn (another order each round, so that a machine whose pace drifts
weighs on every size alike; each figure below is the median of the rounds), a fresh server for each part:

 5. server start: `serve` spawned to its first `/healthz` 200
 6. claim + complete over REST, 8 workers, 1,000 cycles: rate, claim p50/p99
 7. ingest without rules over HTTP, 16 senders, 1,500 signed deliveries: rate, ack p50/p99
 8. Board pages (inbox, queues, deliveries, a todo, the todo list of done work, the subjects and a subject's
    page) and the human's `GET /api/v1/todos`: of a queue, of finished work (`state=done,failed,cancelled`), of
    one subject, and searched by title (`q`, matched by one todo in the whole database), and `GET
    /api/v1/subjects` (all, and `state=waiting`) and `GET /api/v1/subjects/{key}`: server time p50/p95 over 30
    requests each, in-process through Starlette's test client (bench_board's Timed)
 9. a re-ring tick: every pending todo made due (in a transaction rolled back after), then scheduler ticks of
    500 rings each, timed in-process

Last (it changes the database), on each:

10. `prune` (the CLI, a child process) once N/10 more todos, received and done 29 days ago (added now, so that
    no server of the rounds pruned them), passed 30 days, while a warmed-up server ingests
    300 deliveries a second from 16 paced senders: rows per second, and the ack p99 of the deliveries sent while
    it ran (and in the second before)

Before each round and the prune, the run waits (up to `--gate` seconds) for other processes to leave the CPUs
idle, and the report says how much CPU they took anyway.

`--pages-only` builds the sizes and measures only part 8 (the rounds' pages), three times each, for a quick look at
the pages at 1M todos without the hour of the whole run.

Goals (issue 30; issue 36 for the filtered lists and the subjects): every latency at the largest size within 1.5x
of its 10k figure; ingest and claim rates at the largest size at least 0.8x of 10k; start under 2 s and backup at
least 100 MB/s at the largest size; bytes per todo flat (within 10%); Board pages and the human's lists under 50 ms
(p95) at the largest size; the ingest p99 while a prune runs under 100 ms at every size. Writes
tests/bench/results-scale.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # tests/, for producers
import producers  # noqa: E402
from bench_board import Timed, signed_in  # noqa: E402
from bench_compare import load_gate, machine_snapshot, other_cores  # noqa: E402
from bench_store import (  # noqa: E402
    ROOT,
    Server,
    cli,
    machine_facts,
    percentile,
    run_timed,
    source_fingerprint,
)
from starlette.testclient import TestClient  # noqa: E402

from switchboard.app import create_app  # noqa: E402
from switchboard.configuration import RERING_AFTER_MS, Clock  # noqa: E402
from switchboard.database import Txn, connect  # noqa: E402
from switchboard.envelope import build_envelope, envelope_record  # noqa: E402
from switchboard.models import Block, ClaimNext, Complete, Defer, Fail, NeedsInput, Reroute  # noqa: E402
from switchboard.payload import decode_payload  # noqa: E402
from switchboard.providers import delivery_key  # noqa: E402
from switchboard.store.deliveries import Delivery, record_delivery  # noqa: E402
from switchboard.store.human_actions import defer, reroute  # noqa: E402
from switchboard.store.principals import authenticate  # noqa: E402
from switchboard.store.routing import decide, gate  # noqa: E402
from switchboard.store.transitions import block, claim_next, complete, fail, needs_input  # noqa: E402
from switchboard.store.upkeep import scheduler_tick  # noqa: E402

RESULTS_PATH = HERE / "results-scale.json"
SECRET = "bench-scale-secret-0123456789abcdef"
QUEUE = "inbox"
BODY_BYTES = 12_800
FILLER = ("Steps to reproduce: open the README, read the second paragraph, notice the typo. " * 200)
DAY_MS = 86_400_000
BATCH = 2_000  # deliveries (or transitions) per build transaction
# Shares of the N todos, besides the pending backlog: done, and each kind of waiting work.
MIX = {"done": 0.33, "held": 0.004, "failed": 0.003, "needs_input": 0.002, "review": 0.002, "blocked": 0.001,
       "deferred": 0.001, "hold": 0.002, "claimed": 0.0005}
OLD_SHARE = 0.1  # extra todos done 29 days ago, retention's work for the prune step
SIZES_QUICK = (10_000, 100_000)
SIZES_FULL = (10_000, 100_000, 1_000_000)
SENDERS, WORKERS = 16, 8
RUNS = 30  # requests per page
ROUNDS = 3  # of the server measurements, alternating the sizes
CYCLES = 1_000  # claim + complete cycles per size and round (10k todos have 6,500 pending)
INGEST = 1_500  # deliveries per size and round
PRUNE_INGEST_RATE = 300  # deliveries a second while `prune` runs: a busy day, well below what the server takes
TARGET_PAGE_MS = 50.0
GATE_MAX_S = 15.0  # before each timed part, wait up to this long for other processes to leave the CPUs idle


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------
# building a database through the store
# ----------------------------------------------------------------------------------------------------

def delivery_body(number: int, sender: str = "Codertocat") -> bytes:
    """`issues.labeled` for issue #number, padded to BODY_BYTES of JSON."""
    raw, _ = producers.github("issues.labeled", SECRET, {"issue": {"number": number}, "sender": {"login": sender}})
    body = json.loads(raw)
    text = body["issue"].get("body") or ""
    body["issue"]["body"] = text + FILLER[:max(0, BODY_BYTES - len(raw))]
    return json.dumps(body).encode()


class Builder:
    """Deliveries and transitions through the store's transaction bodies, many to a transaction."""

    def __init__(self, path: str, made: dict):
        self.conn = connect(path, "NORMAL")
        self.conn.execute("PRAGMA synchronous=OFF")
        self.made = made
        self.webhook = self.conn.execute("SELECT w.*, e.human_id FROM webhooks w JOIN endpoints e"
                                         " ON e.id = w.endpoint_id WHERE w.id = ?", (made["hook"]["id"],)).fetchone()
        txn = Txn(self.conn, 0, True)
        self.endpoint = authenticate(txn, made["endpoint"]["token"])
        self.human = authenticate(txn, made["human"]["token"])
        self.bodies = {sender: delivery_body(1, sender) for sender in ("Codertocat", "mallory")}

    def transaction(self, now: int) -> Txn:
        self.conn.execute("BEGIN IMMEDIATE")
        return Txn(self.conn, now, True)

    def commit(self) -> None:
        self.conn.execute("COMMIT")

    def deliver(self, txn: Txn, number: int, untrusted: bool = False) -> None:
        """One delivery as ingress records it (accept_delivery without the HTTP and the signature check)."""
        template = self.bodies["mallory" if untrusted else "Codertocat"]
        raw = template.replace(b'"number": 1,', f'"number": {number},'.encode(), 1)
        headers = {k.lower(): v for k, v in producers.github_headers(SECRET, raw, str(uuid.uuid4())).items()}
        payload, _ = decode_payload(headers, raw)
        envelope = build_envelope(provider="github", webhook_id=self.webhook["id"], trust_mode="signed", verified=True,
                                  headers=headers, body=raw, payload=payload,
                                  trusted_actors=json.loads(self.webhook["trusted_actors"]))
        action, trace = gate(envelope) or decide(None, [], None, {}, self.webhook["queue"], b"")
        record_delivery(txn, Delivery(
            webhook_id=self.webhook["id"], endpoint_id=self.webhook["endpoint_id"],
            token_hash=self.webhook["token_hash"], body=raw, envelope=envelope,
            envelope_record=envelope_record(envelope), headers_json=json.dumps(envelope["headers"]),
            delivery_key=delivery_key("github", headers, payload, raw),
            body_hash=f"{number:064x}", action=action, trace=trace))

    def work(self, txn: Txn, outcome: str) -> None:
        """Claim the oldest pending todo and take it to `outcome`."""
        if outcome in ("hold", "deferred"):  # a human's move on the oldest pending todo
            row = txn.one("SELECT id FROM todos WHERE endpoint_id = ? AND state = 'pending' AND queue = ?"
                          " ORDER BY priority DESC, created_at, rowid LIMIT 1", (self.endpoint.id, QUEUE))
            if outcome == "hold":
                reroute(txn, self.human, row["id"], Reroute(queue="hold"))
            else:
                until = datetime.fromtimestamp(txn.now / 1000 + 7 * 86_400, UTC)
                defer(txn, self.human, row["id"], Defer(reason="after the holidays", until=until))
            return
        lease = 86_400 if outcome == "claimed" else None
        got = claim_next(txn, self.endpoint, ClaimNext(queue=QUEUE, lease_seconds=lease))
        todo_id, token = got["todo"]["id"], got["lease_token"]
        if outcome == "done":
            complete(txn, self.endpoint, todo_id, Complete(lease_token=token, summary="done"))
        elif outcome == "review":
            txn.execute("UPDATE todos SET gated = 1 WHERE id = ?", (todo_id,))
            complete(txn, self.endpoint, todo_id, Complete(lease_token=token, summary="please look"))
        elif outcome == "failed":
            fail(txn, self.endpoint, todo_id, Fail(lease_token=token, error="boom", retry=False))
        elif outcome == "needs_input":
            needs_input(txn, self.endpoint, todo_id, NeedsInput(lease_token=token, question="which disk?"))
        elif outcome == "blocked":
            block(txn, self.endpoint, todo_id, Block(lease_token=token, reason="waits on the router"))

    def close(self) -> None:
        self.conn.close()


def setup(path: str) -> dict:
    """The principals and the webhook, through the CLI (in this process)."""
    cli(path, "init")
    human = cli(path, "human", "add", "bench")
    endpoint = cli(path, "endpoint", "vend", "--human", "bench", "--name", "inbox", "--queues", f"{QUEUE},hold",
                   "--verbs", "all")
    hook = cli(path, "webhook", "create", "--endpoint", endpoint["id"], "--provider", "github", "--queue", QUEUE,
               "--trust", "Codertocat", "--secret", SECRET, "--base-url", "http://placeholder")
    return {"human": human, "endpoint": endpoint, "hook": hook, "hook_path": "/hooks/" + hook["url"].rsplit("/hooks/", 1)[1]}


def build(path: str, n: int) -> dict:
    """A database of n todos; returns the principals and the build's figures."""
    started = time.perf_counter()
    made = setup(path)
    builder = Builder(path, made)
    now = Clock().now_ms()
    number = 0
    held_every = round(1 / MIX["held"])

    def deliveries(count: int, first_ms: int, last_ms: int, held: bool = True) -> None:
        nonlocal number
        for start in range(0, count, BATCH):
            txn = builder.transaction(first_ms)
            for i in range(start, min(count, start + BATCH)):
                number += 1
                txn.now = first_ms + (last_ms - first_ms) * i // max(1, count)
                builder.deliver(txn, number, untrusted=held and number % held_every == 0)
            builder.commit()

    def transitions(outcomes: list[str], at_ms: int) -> None:
        for start in range(0, len(outcomes), BATCH):
            txn = builder.transaction(at_ms)
            for outcome in outcomes[start:start + BATCH]:
                builder.work(txn, outcome)
            builder.commit()

    deliveries(n, now - 25 * DAY_MS, now - 3_600_000)
    plan = [outcome for outcome in MIX if outcome != "held" for _ in range(round(n * MIX[outcome]))]
    plan.sort(key=lambda outcome: outcome != "done")  # the oldest work was done first
    transitions(plan, now - 1_800_000)
    # The state the re-ring sweep leaves a todo in once it has rung it five times (its last re-ring is 7 h 25 min
    # after the first ring): done here in one statement for every todo that waited that long.
    last = sum(RERING_AFTER_MS)
    txn = builder.transaction(now)
    txn.execute("UPDATE todos SET ring_count = ?, last_ring_at = last_ring_at + ? WHERE state = 'pending'"
                " AND ring_count = 1 AND last_ring_at < ?", (len(RERING_AFTER_MS) + 1, last, now - last - 600_000))
    builder.commit()
    builder.close()
    return {**made, "build_s": round(time.perf_counter() - started, 1)}


def add_old_work(path: str, made: dict, n: int) -> int:
    """n/10 deliveries received 29 days ago and done then (the oldest pending work, so `claim_next` takes them):
    the work the prune step's retention finds past 30 days once their stamps move back two days."""
    builder = Builder(path, made)
    now = Clock().now_ms()
    old = round(n * OLD_SHARE)
    first_ms, last_ms = now - 29 * DAY_MS - 6 * 3_600_000, now - 29 * DAY_MS - 3_600_000
    number = 20 * n  # issue numbers nobody else uses: the build's are 1..n, the ingest rounds' from 10n + 1
    for start in range(0, old, BATCH):
        txn = builder.transaction(first_ms)
        for i in range(start, min(old, start + BATCH)):
            number += 1
            txn.now = first_ms + (last_ms - first_ms) * i // max(1, old)
            builder.deliver(txn, number)
        builder.commit()
    for start in range(0, old, BATCH):
        txn = builder.transaction(now - 29 * DAY_MS)
        for _ in range(start, min(old, start + BATCH)):
            builder.work(txn, "done")
        builder.commit()
    builder.close()
    return old


# ----------------------------------------------------------------------------------------------------
# measuring
# ----------------------------------------------------------------------------------------------------

def db_bytes(path: str) -> int:
    return sum(Path(path + suffix).stat().st_size for suffix in ("", "-wal") if Path(path + suffix).exists())


def run_cli(path: str, *args: str) -> tuple[float, dict]:
    """The real CLI as a child process (what the operator runs): its wall time and its JSON answer."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "switchboard.py"), *args, "--db", path, "--json"],
                          capture_output=True, text=True, cwd=str(Path(path).parent), timeout=3600)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"switchboard {' '.join(args)} exited {done.returncode}: {done.stdout} {done.stderr}")
    return took, json.loads(done.stdout)


def start_server(path: str) -> tuple[Server, float]:
    """A fresh `serve --ingest-rate 0` child, and how long it took from spawn to its first /healthz 200."""
    started = time.perf_counter()
    server = Server(path, "full", "--ingest-rate", "0")
    return server, time.perf_counter() - started


class Deliveries:
    """Signed `issues.labeled` deliveries (BODY_BYTES each), each with its own issue number and delivery id, made as
    they are sent."""

    def __init__(self, first: int):
        self.template = delivery_body(1)
        self.next = first
        self.lock = threading.Lock()

    def make(self) -> tuple[bytes, dict]:
        with self.lock:
            self.next += 1
            number = self.next
        raw = self.template.replace(b'"number": 1,', f'"number": {number},'.encode(), 1)
        return raw, producers.github_headers(SECRET, raw, str(uuid.uuid4()))


def send(url: str, deliveries: Deliveries, count: int | None = None, stop: threading.Event | None = None,
         rate: float | None = None) -> dict:
    """16 senders, each with a keep-alive client, until `count` deliveries were sent or `stop` is set; flat out,
    or together at about `rate` deliveries a second. Each ack is (wall time at the POST, ms to the parsed 202)."""
    acks: list[tuple[float, float]] = []
    errors: list[str] = []
    lock = threading.Lock()
    sent = [0]

    def sender(index: int, ready) -> None:
        with httpx.Client(timeout=60) as client:
            while not (stop is not None and stop.is_set()):  # the server may be starting still
                try:
                    client.get(url.split("/hooks/")[0] + "/healthz")
                    break
                except httpx.TransportError:
                    time.sleep(0.005)
            ready()
            due = time.perf_counter() + (index / rate if rate else 0)  # paced senders take turns
            while not (stop is not None and stop.is_set()):
                if rate:
                    due += SENDERS / rate
                    time.sleep(max(0.0, due - time.perf_counter()))
                with lock:
                    if count is not None and sent[0] >= count:
                        return
                    sent[0] += 1
                raw, headers = deliveries.make()
                at, t0 = time.time(), time.perf_counter()
                try:
                    answer = client.post(url, content=raw, headers=headers)
                except httpx.HTTPError as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                took = (time.perf_counter() - t0) * 1e3
                if answer.status_code != 202 or answer.json().get("disposition") != "routed":
                    errors.append(f"{answer.status_code} {answer.text[:200]}")
                    continue
                with lock:
                    acks.append((at, took))

    wall, _ = run_timed(SENDERS, sender, "sender")
    latencies = [ms for _, ms in acks]
    return {"sent": len(acks), "wall_s": wall, "rate": len(acks) / wall, "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99), "acks": acks, "errors": errors[:10]}


def claim_complete(url: str, token: str, cycles: int) -> dict:
    """8 workers claim and complete until `cycles` cycles were done: the rate, and the claim's latency."""
    claims: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    taken = [0]

    def worker(_: int, ready) -> None:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as client:
            client.get("/healthz")
            ready()
            while True:
                with lock:
                    if taken[0] >= cycles:
                        return
                    taken[0] += 1
                t0 = time.perf_counter()
                got = client.post("/api/v1/todos/claim", json={"queue": QUEUE})
                took = (time.perf_counter() - t0) * 1e3
                body = got.json() if got.status_code == 200 else {}
                if "todo" not in body:
                    errors.append(f"claim: {got.status_code} {got.text[:200]}")
                    continue
                done = client.post(f"/api/v1/todos/{body['todo']['id']}/complete",
                                   json={"lease_token": body["lease_token"]})
                if done.status_code != 200 or done.json().get("state") != "done":
                    errors.append(f"complete: {done.status_code} {done.text[:200]}")
                    continue
                with lock:
                    claims.append(took)

    wall, _ = run_timed(WORKERS, worker, "worker")
    return {"cycles": len(claims), "rate": len(claims) / wall, "claim_p50_ms": percentile(claims, 50),
            "claim_p99_ms": percentile(claims, 99), "errors": errors[:10]}


def rering_tick(path: str, ticks: int = 5) -> dict:
    """The re-ring sweep's first pass over the whole backlog: every pending todo made due for its first re-ring
    (in a transaction rolled back after), then full scheduler ticks (500 rings each), timed in-process. The pass
    takes one tick a second."""
    conn = connect(path)
    try:
        conn.execute("BEGIN IMMEDIATE")
        now = Clock().now_ms()
        due = conn.execute("UPDATE todos SET ring_count = 1, last_ring_at = ? WHERE state = 'pending'",
                           (now - RERING_AFTER_MS[0] - 60_000,)).rowcount
        times, rung = [], []
        for _ in range(min(ticks, due // 500)):
            txn = Txn(conn, now, True)
            started = time.perf_counter()
            rung.append(scheduler_tick(txn)["rerung"])
            times.append((time.perf_counter() - started) * 1e3)
        conn.execute("ROLLBACK")
    finally:
        conn.close()
    return {"due": due, "rings_per_tick": max(rung, default=0), "tick_ms": statistics.median(times or [0]),
            "first_pass_s": due / max(1, max(rung, default=0))}


def board_pages(path: str, made: dict) -> dict:
    """Server time of the Board's pages and the human's list (bench_board's Timed), in-process."""
    app = create_app(path, background=False)
    timed = Timed(app)
    hook_id = made["hook"]["id"]
    results = {}
    with TestClient(timed, base_url="http://bench") as client:
        todo_id = signed_in(client, app, made["human"]["token"])
        auth = {"Authorization": f"Bearer {made['human']['token']}"}
        key = urllib.parse.quote(client.get(f"/api/v1/todos/{todo_id}", headers=auth).json()["subject_key"], safe="")
        pages = [("inbox", "/board", {}), ("queues", "/board/queues", {}),
                 ("deliveries", f"/board/webhooks/{hook_id}/deliveries", {}), ("a todo", f"/board/todos/{todo_id}", {}),
                 ("Board todo list, done", "/board/todos?state=done", {}),
                 ("human's list", f"/api/v1/todos?queue={QUEUE}", auth),
                 ("finished work", "/api/v1/todos?state=done,failed,cancelled", auth),
                 ("a subject's todos", "/api/v1/todos?subject=github%3ACodertocat%2FHello-World%237", auth),
                 ("a title search", "/api/v1/todos?q=Hello-World%2342%3A", auth),
                 ("subjects", "/api/v1/subjects", auth), ("subjects waiting", "/api/v1/subjects?state=waiting", auth),
                 ("a subject", f"/api/v1/subjects/{key}", auth), ("subjects page", "/board/subjects", {}),
                 ("a subject's page", f"/board/subjects/{key}", {})]
        for name, page, headers in pages:
            times = []
            for run in range(RUNS + 3):
                answer = client.get(page, headers=headers)
                assert answer.status_code == 200, (page, answer.status_code, answer.text[:300])
                if run >= 3:
                    times.append(timed.last * 1e3)
            results[name] = {"p50_ms": percentile(times, 50), "p95_ms": percentile(times, 95)}
        listed = client.get(f"/api/v1/todos?queue={QUEUE}", headers=auth).json()["todos"]
        assert len(listed) == 50 and listed == sorted(listed, key=lambda t: t["created_at"], reverse=True)
    return results


def prune_under_ingest(path: str, made: dict, deliveries: Deliveries) -> dict:
    """`switchboard prune` (a child process, as the operator runs it; the server's hourly retention runs the same
    steps through its own writer) while a warmed-up server ingests PRUNE_INGEST_RATE deliveries a second. First the
    N/10 old done todos and their events pass 30 days (their stamps moved back two days). Rows per second of the
    prune (its wall time, interpreter start included), and the ack p99 of the deliveries sent while it ran, against
    the second before."""
    stop = threading.Event()
    with start_server(path)[0] as server:
        conn = connect(path)
        cutoff = Clock().now_ms() - 28 * DAY_MS
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("UPDATE todos SET updated_at = updated_at - 2 * ? WHERE state IN ('done', 'failed', 'cancelled')"
                     " AND updated_at < ?", (DAY_MS, cutoff))
        conn.execute("UPDATE events SET received_at = received_at - 2 * ? WHERE received_at < ?", (DAY_MS, cutoff))
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # not left for the server's checkpointer to copy meanwhile
        conn.close()
        sending = concurrent.futures.ThreadPoolExecutor(1).submit(send, server.url + made["hook_path"], deliveries,
                                                                  None, stop, PRUNE_INGEST_RATE)
        try:
            time.sleep(2.0)  # warm: the second before the prune is the baseline
            begun = time.time()
            took, answer = run_cli(path, "prune")
            ended = time.time()
            time.sleep(0.5)
        finally:
            stop.set()
            sent = sending.result()
    pruned = answer["pruned"]["todos"] + answer["pruned"]["events"]
    during = [ms for at, ms in sent["acks"] if begun <= at <= ended]
    before = [ms for at, ms in sent["acks"] if begun - 1 <= at < begun]
    return {"pruned": answer["pruned"], "prune_s": took, "window": (begun, ended), "rows_per_s": pruned / took, "acks_during": len(during),
            "ack_p99_during_ms": percentile(during, 99), "ack_p99_before_ms": percentile(before, 99),
            "errors": sent["errors"]}


def prepare(folder: str, n: int) -> dict:
    """Build the database of n todos, then what is measured on it alone: its size, `migrate --dry-run`, `backup`
    and the re-ring sweep. Last, retention's first pass (`switchboard prune`, unloaded): past the 500,000-row cap
    it deletes the terminal todos, oldest first, and the events only they pointed at. Every server the rounds
    start runs retention at once, so on a database past the cap the rounds would measure that pass instead."""
    path = os.path.join(folder, f"scale-{n}.db")
    log(f"{n:,} todos: building")
    made = build(path, n)
    out: dict = {"todos": n, "build_s": made["build_s"], "path": path, "made": made, "gates": [], "rounds": []}
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    held, out["pending"] = conn.execute("SELECT count(*), sum(state = 'pending') FROM todos").fetchone()
    conn.close()
    out["db_bytes"] = db_bytes(path)
    out["bytes_per_todo"] = out["db_bytes"] / held
    log(f"{n:,} todos: migrate --dry-run, backup, the re-ring sweep")
    out["migrate_dry_run_s"] = statistics.median(run_cli(path, "migrate", "--dry-run")[0] for _ in range(3))
    copy = os.path.join(folder, "backup.db")
    took, _ = run_cli(path, "backup", copy)
    os.remove(copy)
    out["backup_s"] = took
    out["backup_mb_s"] = out["db_bytes"] / 1e6 / took
    out["rering"] = rering_tick(path)
    log(f"{n:,} todos: retention's first pass")
    took, answer = run_cli(path, "prune")
    out["retention"] = {"pruned": answer["pruned"], "s": took}
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    out["todos_served"] = conn.execute("SELECT count(*) FROM todos").fetchone()[0]
    conn.close()
    out["deliveries"] = Deliveries(10 * n)
    return out


def measure_round(out: dict, round_: int) -> None:
    """One round on one database, each part on a fresh server: start, claim + complete, ingest, and the pages."""
    n, path, made = out["todos"], out["path"], out["made"]
    log(f"{n:,} todos, round {round_ + 1} of {ROUNDS}: start, claim + complete, ingest, pages")
    result: dict = {}
    run_cli(path, "prune")  # what the last round completed (see below)
    out["gates"].append(load_gate(f"{n} round {round_ + 1}", GATE_MAX_S))
    machine = machine_snapshot()
    server, result["start_s"] = start_server(path)
    server.stop()
    with start_server(path)[0] as server:
        result["claim"] = claim_complete(server.url, made["endpoint"]["token"], CYCLES)
    # Past the row cap, the todos that round completed are retention's work: the next server would delete them
    # at its start, while its part is measured.
    run_cli(path, "prune")
    with start_server(path)[0] as server:
        sent = send(server.url + made["hook_path"], out["deliveries"], INGEST)
        result["ingest"] = {k: v for k, v in sent.items() if k != "acks"}
    result["pages"] = board_pages(path, made)
    result["rering_tick_ms"] = rering_tick(path)["tick_ms"]
    result["other_cores"] = other_cores(machine, machine_snapshot())["other_cores"]
    out["rounds"].append(result)


def summarize(out: dict) -> dict:
    """The rounds' medians, in the shape the report reads; then the prune (it changes the database), last."""
    rounds = out.pop("rounds")

    def median(*path):
        return statistics.median(pick(r, path) for r in rounds)

    out["start_s"] = median("start_s")
    out["claim"] = {k: median("claim", k) for k in ("rate", "claim_p50_ms", "claim_p99_ms")}
    out["ingest"] = {k: median("ingest", k) for k in ("rate", "p50_ms", "p99_ms")}
    out["pages"] = {page: {k: median("pages", page, k) for k in ("p50_ms", "p95_ms")} for page in PAGES}
    out["rering"]["tick_ms"] = median("rering_tick_ms")
    out["other_processes"] = {"other_cores": max(r["other_cores"] for r in rounds)}
    out["rounds"] = rounds
    return out


# ----------------------------------------------------------------------------------------------------
# goals and the report
# ----------------------------------------------------------------------------------------------------

PAGES = ("inbox", "queues", "deliveries", "a todo", "Board todo list, done", "human's list", "finished work",
         "a subject's todos", "a title search", "subjects", "subjects waiting", "a subject", "subjects page",
         "a subject's page")
# Latencies (ms or s) whose figure at the largest size must stay within 1.5x of 10k's: (label, path in a result).
LATENCIES = [("claim p50 (ms)", ("claim", "claim_p50_ms")), ("claim p99 (ms)", ("claim", "claim_p99_ms")),
             ("ingest ack p50 (ms)", ("ingest", "p50_ms")), ("ingest ack p99 (ms)", ("ingest", "p99_ms")),
             *((f"{page} p95 (ms)", ("pages", page, "p95_ms")) for page in PAGES),
             ("re-ring tick, 500 rings (ms)", ("rering", "tick_ms")), ("server start (s)", ("start_s",)),
             ("migrate --dry-run (s)", ("migrate_dry_run_s",))]
RATES = [("claim + complete (/s)", ("claim", "rate")), ("ingest, no rules (/s)", ("ingest", "rate"))]


def pick(result: dict, path: tuple):
    for key in path:
        result = result[key]
    return result


def goals(results: list[dict]) -> list[dict]:
    first, last = results[0], results[-1]
    size = f"{last['todos']:,}"
    rows = []
    for label, path in LATENCIES:
        a, b = pick(first, path), pick(last, path)
        rows.append({"goal": f"{label} at {size} within 1.5x of 10k", "value": f"{b / a:.2f}x", "met": b <= 1.5 * a})
    for label, path in RATES:
        a, b = pick(first, path), pick(last, path)
        rows.append({"goal": f"{label} at {size} at least 0.8x of 10k", "value": f"{b / a:.2f}x", "met": b >= 0.8 * a})
    rows.append({"goal": f"server start at {size} under 2 s", "value": f"{last['start_s']:.2f} s",
                 "met": last["start_s"] < 2})
    rows.append({"goal": f"backup at {size} at least 100 MB/s", "value": f"{last['backup_mb_s']:.0f} MB/s",
                 "met": last["backup_mb_s"] >= 100})
    spread = [r["bytes_per_todo"] / first["bytes_per_todo"] for r in results]
    rows.append({"goal": "database bytes per todo flat (within 10% of 10k's)",
                 "value": " / ".join(f"{x:.2f}x" for x in spread), "met": all(0.9 <= x <= 1.1 for x in spread)})
    for page in PAGES:
        p95 = last["pages"][page]["p95_ms"]
        rows.append({"goal": f"{page} p95 at {size} under 50 ms", "value": f"{p95:.1f} ms", "met": p95 < TARGET_PAGE_MS})
    worst = max(r["prune"]["ack_p99_during_ms"] for r in results)
    rows.append({"goal": "ingest ack p99 while a prune runs under 100 ms, every size", "value": f"{worst:.1f} ms",
                 "met": worst < 100})
    return rows


def markdown(report: dict) -> str:
    results, m = report["results"], report["machine"]
    src = m["source"]
    head = " | ".join(f"{r['todos']:,}" for r in results)
    lines = [f"Measured {m['date']} on {m['nproc']} CPUs ({m['cpu_model'] or '?'}), Python {m['python']}, SQLite"
             f" {m['sqlite']}, switchboard {m['switchboard']} at `{src['git_head']}`"
             f"{' + uncommitted changes' if src['dirty'] else ''}; load average at the start "
             f"{'/'.join(f'{x:.2f}' for x in report['loadavg'])}; whole run {report['elapsed_s']:.0f} s"
             f"{' (--quick)' if report['quick'] else ''}.", "",
             f"| todos | {head} |", "|---|" + "---:|" * len(results)]

    def row(label: str, values) -> None:
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    row("database (MB) / bytes per todo", (f"{r['db_bytes'] / 1e6:,.0f} / {r['bytes_per_todo']:,.0f}" for r in results))
    row("build (s)", (f"{r['build_s']:.0f}" for r in results))
    row("retention's first pass: todos, events deleted; s",
        (f"{r['retention']['pruned']['todos']:,}, {r['retention']['pruned']['events']:,}; {r['retention']['s']:.0f}"
         for r in results))
    row("todos in the rounds", (f"{r['todos_served']:,}" for r in results))
    def spread(r: dict, *path) -> str:
        values = [pick(one, path) for one in r["rounds"]]
        return f"{min(values):,.0f}–{max(values):,.0f}"

    row("claim + complete, 8 workers (/s): median (rounds)",
        (f"{r['claim']['rate']:,.0f} ({spread(r, 'claim', 'rate')})" for r in results))
    row("claim p50 / p99 (ms)", (f"{r['claim']['claim_p50_ms']:.1f} / {r['claim']['claim_p99_ms']:.1f}" for r in results))
    row("ingest, no rules, 16 senders (/s): median (rounds)",
        (f"{r['ingest']['rate']:,.0f} ({spread(r, 'ingest', 'rate')})" for r in results))
    row("ingest ack p50 / p99 (ms)", (f"{r['ingest']['p50_ms']:.1f} / {r['ingest']['p99_ms']:.1f}" for r in results))
    for page in PAGES:
        row(f"{page}: server time p50 / p95 (ms)",
            (f"{r['pages'][page]['p50_ms']:.1f} / {r['pages'][page]['p95_ms']:.1f}" for r in results))
    row("re-ring sweep: tick of 500 rings (ms); first pass (s)",
        (f"{r['rering']['tick_ms']:.1f}; {r['rering']['first_pass_s']:,.0f}" for r in results))
    row("prune: rows/s; ack p99 during it, the second before (ms)",
        (f"{r['prune']['rows_per_s']:,.0f}; {r['prune']['ack_p99_during_ms']:.1f} ({r['prune']['acks_during']} acks),"
         f" {r['prune']['ack_p99_before_ms']:.1f}" for r in results))
    row("backup (s; MB/s)", (f"{r['backup_s']:.1f}; {r['backup_mb_s']:,.0f}" for r in results))
    row("server start (s)", (f"{r['start_s']:.2f}" for r in results))
    row("migrate --dry-run (s)", (f"{r['migrate_dry_run_s']:.2f}" for r in results))
    row("other processes, most in a round (cores)", (f"{r['other_processes']['other_cores']:.2f}" for r in results))
    lines += ["", "| goal | value | met |", "|---|---:|:---:|"]
    lines += [f"| {g['goal']} | {g['value']} | {'yes' if g['met'] else '**no**'} |" for g in report["goals"]]
    return "\n".join(lines)


def pages_only(sizes: list[int], args: argparse.Namespace) -> int:
    """Part 8 alone: each size built, then its pages measured in ROUNDS rounds (medians of the rounds' p50 and p95).
    Writes the report beside --out (`-pages` before the suffix) and prints its table."""
    folder = tempfile.mkdtemp(prefix="sb-scale-pages-", dir=args.dir)
    report: dict = {"machine": machine_facts(), "loadavg": os.getloadavg(), "sizes": {}}
    started = time.perf_counter()
    try:
        for n in sizes:
            path = os.path.join(folder, f"scale-{n}.db")
            log(f"{n:,} todos: building")
            made = build(path, n)
            rounds = []
            for round_ in range(ROUNDS):
                report.setdefault("gates", []).append(load_gate(f"{n} pages {round_ + 1}", GATE_MAX_S))
                rounds.append(board_pages(path, made))
            report["sizes"][n] = {"build_s": made["build_s"], "pages": {
                page: {k: statistics.median(r[page][k] for r in rounds) for k in ("p50_ms", "p95_ms")}
                for page in PAGES}}
            os.remove(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report["elapsed_s"] = time.perf_counter() - started
    out = Path(args.out)
    out.with_name(out.stem + "-pages" + out.suffix).write_text(json.dumps(report, indent=2) + "\n")
    head = " | ".join(f"{n:,}" for n in report["sizes"])
    lines = [f"| page: server time p50 / p95 (ms) | {head} |", "|---|" + "---:|" * len(report["sizes"])]
    for page in PAGES:
        lines.append(f"| {page} | " + " | ".join(f"{r['pages'][page]['p50_ms']:.1f} / {r['pages'][page]['p95_ms']:.1f}"
                                                  for r in report["sizes"].values()) + " |")
    print("\n".join(lines))
    largest = report["sizes"][sizes[-1]]["pages"]
    met = sum(largest[page]["p95_ms"] < TARGET_PAGE_MS for page in PAGES)
    print(f"\npages: {met} of {len(PAGES)} under {TARGET_PAGE_MS:g} ms (p95) at {sizes[-1]:,} todos")
    return 0 if met == len(PAGES) else 1


def main(argv: list[str] | None = None) -> int:
    global GATE_MAX_S
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10k and 100k todos only (under 10 minutes)")
    parser.add_argument("--sizes", help="comma-separated todo counts, smallest first (default: 10k,100k[,1M])")
    parser.add_argument("--dir", help="where the databases go (default: a temporary directory)")
    parser.add_argument("--out", default=str(RESULTS_PATH))
    parser.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                        help="first wait up to SECONDS for other processes to leave the CPUs idle")
    parser.add_argument("--gate", type=float, default=GATE_MAX_S, metavar="SECONDS",
                        help=f"before each timed part, wait up to SECONDS for them (default {GATE_MAX_S:g})")
    parser.add_argument("--pages-only", dest="pages_only", action="store_true",
                        help="build the sizes, then measure only the pages and the API's lists (three rounds)")
    args = parser.parse_args(argv)
    GATE_MAX_S = args.gate
    if args.wait_quiet > 0:
        load_gate("start", args.wait_quiet)
    sizes = ([int(x) for x in args.sizes.split(",")] if args.sizes
             else list(SIZES_QUICK if args.quick else SIZES_FULL))
    if args.pages_only:
        return pages_only(sizes, args)
    report: dict = {"machine": machine_facts(), "quick": args.quick, "loadavg": os.getloadavg(), "results": []}
    started = time.perf_counter()
    folder = tempfile.mkdtemp(prefix="sb-scale-", dir=args.dir)
    try:
        prepared = [prepare(folder, n) for n in sizes]
        # The rounds alternate the sizes (each round in another order), so a machine whose pace drifts over
        # minutes weighs on every size alike; each figure is the median of the rounds.
        for round_ in range(ROUNDS):
            for out in prepared[round_ % len(prepared):] + prepared[:round_ % len(prepared)]:
                measure_round(out, round_)
        for out in prepared:
            log(f"{out['todos']:,} todos: old work for the prune")
            out["old_todos"] = add_old_work(out["path"], out["made"], out["todos"])
            log(f"{out['todos']:,} todos: prune while ingesting")
            out["gates"].append(load_gate(f"{out['todos']} prune", GATE_MAX_S))
            out["prune"] = prune_under_ingest(out["path"], out["made"], out["deliveries"])
            os.remove(out["path"])
            report["results"].append(summarize({k: v for k, v in out.items()
                                                if k not in ("path", "made", "deliveries")}))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report["elapsed_s"] = time.perf_counter() - started
    report["goals"] = goals(report["results"])
    if source_fingerprint() != report["machine"]["source"]:
        report["warning"] = "the package changed on disk during the run"
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    if report.get("warning"):
        print(f"\nWARNING: {report['warning']}")
    met = sum(g["met"] for g in report["goals"])
    print(f"\nscale: {met} of {len(report['goals'])} goals met")
    return 0 if met == len(report["goals"]) else 1


if __name__ == "__main__":
    sys.exit(main())
