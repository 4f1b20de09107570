"""Board page benchmark: server time per page with 100,000 todos and 100,000 events in one human's database.

Run by hand (never collected by pytest):

    python tests/bench/bench_board.py [--todos 100000] [--events 100000] [--runs 30]

The human, their endpoints and a webhook are made through the store; the todos (with a history line each, and
an open attempt for the claimed ones) and the events are then inserted directly with executemany. States are a
homelab's mix: mostly done, some pending backlog, and a few hundred of each kind of waiting work. Pages are
fetched in-process through Starlette's test client after a sign-in; "server time" is measured inside the ASGI
app, from the request's arrival to the last byte of the answer, so the client's own work is not counted.
Prints a Markdown table (p50 and p95 per page) and writes JSON to tests/bench/results-board.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from starlette.testclient import TestClient  # noqa: E402

from switchboard.app import create_app
from switchboard.configuration import Clock
from switchboard.crypto import SecretBox
from switchboard.database import Database
from switchboard.models import EndpointCreate, TrustAll, WebhookCreate
from switchboard.store.principals import Principal, add_human, vend_endpoint
from switchboard.store.webhooks import create_webhook

RESULTS_PATH = Path(__file__).resolve().with_name("results-board.json")
TARGET_MS = 50.0
DAY_MS = 86_400_000
# state: share of the todos (the rest are done)
MIX = {"pending": 0.06, "failed": 0.01, "claimed": 0.0005, "needs_input": 0.002, "review": 0.002,
       "blocked": 0.001, "deferred": 0.001, "quarantined": 0.004, "cancelled": 0.01}


class Timed:
    """ASGI wrapper: how long the app took for the last request, up to its final body message."""

    def __init__(self, app):
        self.app = app
        self.last = 0.0

    async def __call__(self, scope, receive, send):
        start = time.perf_counter()

        async def timed(message):
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                self.last = time.perf_counter() - start

        await self.app(scope, receive, timed)


def principals(path: str) -> dict:
    db = Database(path, synchronous="NORMAL")
    try:
        human = db.write_sync(add_human, "alice")
        principal = Principal(kind="human", id=human["id"], human_id=human["id"], name="alice")
        endpoints = {name: db.write_sync(vend_endpoint, human["id"], EndpointCreate(name=name, queues=queues))
                     for name, queues in (("router", ["triage", "hold"]), ("lane-s", ["lane-s"]),
                                          ("lane-m", ["lane-m"]), ("lane-l", ["lane-l"]))}
        box = SecretBox.for_database(path)
        hook = db.write_sync(create_webhook, principal, box, WebhookCreate(
            provider="github", queue="triage", endpoint_id=endpoints["router"]["id"],
            trusted_actors=TrustAll(allow_all=True)), "http://127.0.0.1")
        return {"human": human, "endpoints": endpoints, "webhook": hook}
    finally:
        db.close()


def fill(path: str, made: dict, todos: int, events: int, seed: int = 7) -> None:
    """Insert `events` events and `todos` todos (each minted by one of the events) straight into SQLite."""
    rng = random.Random(seed)
    now = Clock().now_ms()
    human_id, hook_id = made["human"]["id"], made["webhook"]["id"]
    lanes = [(made["endpoints"][n]["id"], n) for n in ("lane-s", "lane-m", "lane-l")]
    router = made["endpoints"]["router"]["id"]
    payload = json.dumps({"action": "opened", "issue": {"number": 1, "title": "x" * 40, "body": "y" * 600},
                          "repository": {"full_name": "homelab/infra"}, "sender": {"login": "alice"}})
    trace = json.dumps({"stage": "rule", "rule_id": "lanes", "action": {"queue": "lane-s"}})
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("BEGIN")
    event_rows, event_ids, body_rows = [], [], []
    # A stored envelope keeps everything but .payload and .headers, which are read back from the body and headers.
    envelope = json.dumps({"provider": "github", "kind": "issues", "content_type": "application/json"})
    for n in range(events):
        event_id = f"ev_{n:020x}"
        event_ids.append(event_id)
        at = now - rng.randrange(25 * DAY_MS)
        disposition = rng.choices(["routed", "dropped", "quarantined", "repeat"], [90, 6, 2, 2])[0]
        outcome = json.dumps({"event_id": event_id, "disposition": disposition, "verified": True, "created": 1,
                              "todos": [{"id": f"td_{n:020x}", "endpoint_id": lanes[0][0], "queue": "lane-s",
                                         "created": True}]})
        event_rows.append((event_id, hook_id, human_id, "github", rng.choice(["issues", "issue_comment", "push"]),
                           "signed", 1, f"delivery-{n}", f"{n:064x}", "{}", envelope, disposition, trace, outcome, at))
        body_rows.append((event_id, payload.encode()))
    conn.executemany("INSERT INTO events (id, webhook_id, human_id, source, kind, trust_mode, verified, delivery_key,"
                     " body_hash, headers, envelope, disposition, trace, outcome, received_at)"
                     " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", event_rows)
    # Each delivery's body is stored once, beside its event (schema v3).
    conn.executemany("INSERT INTO event_bodies (event_id, body) VALUES (?, ?)", body_rows)
    states = list(MIX) + ["done"]
    weights = list(MIX.values()) + [1 - sum(MIX.values())]
    todo_rows, history_rows, attempt_rows = [], [], []
    for n in range(todos):
        todo_id = f"td_{n:020x}"
        state = rng.choices(states, weights)[0]
        created = now - rng.randrange(25 * DAY_MS)
        endpoint_id, queue = rng.choice(lanes)
        if state == "quarantined":
            endpoint_id, queue = router, "quarantine"
        elif state == "pending" and rng.random() < 0.05:
            endpoint_id, queue = router, "hold"
        lease = now + 300_000 if state == "claimed" else None
        todo_rows.append((todo_id, endpoint_id, queue, state, {"done": "completed"}.get(state), f"homelab/infra#{n}:"
                          f" issue {n}", "github", "issues", payload, trace, event_ids[n % len(event_ids)],
                          1 if state in ("claimed", "failed", "done") else 0, lease, "x" * 64 if lease else None,
                          created, {"needs_input": "which disk?", "review": "did it", "blocked": "waits",
                                    "deferred": "later", "quarantined": "rule"}.get(state),
                          1 if state == "failed" else 0, "boom" if state == "failed" else None, created,
                          created + 60_000))
        history_rows.append((todo_id, created, "system", None, "pending", None))
        if state == "claimed":
            attempt_rows.append((todo_id, 1, endpoint_id, "worker", created, lease, 300))
    conn.executemany("INSERT INTO todos (id, endpoint_id, queue, state, outcome, title, source, kind, payload, trace,"
                     " event_id, attempt, lease_expires_at, lease_token_hash, available_at, state_reason, dead_letter,"
                     " last_error, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?,"
                     " ?, ?, ?, ?)", todo_rows)
    conn.executemany("INSERT INTO todo_history (todo_id, at, actor, from_state, to_state, evidence)"
                     " VALUES (?, ?, ?, ?, ?, ?)", history_rows)
    conn.executemany("INSERT INTO attempts (todo_id, seq, endpoint_id, claimant, claimed_at, lease_expires_at,"
                     " lease_seconds) VALUES (?, ?, ?, ?, ?, ?, ?)", attempt_rows)
    conn.execute("COMMIT")
    conn.execute("ANALYZE")
    conn.close()


def signed_in(client: TestClient, app, token: str) -> str:
    """Sign the test client in to the Board with a human's token, as the login form does; the oldest todo in
    review, the one the todo page is measured on."""
    signed = client.post("/board/login", data={"token": token}, headers={"Origin": "http://bench"},
                         follow_redirects=False)
    assert signed.status_code == 303, signed.text
    return app.state.db.read_sync(lambda txn: txn.one(
        "SELECT id FROM todos WHERE state = 'review' ORDER BY created_at LIMIT 1")["id"])


def measure(path: str, made: dict, runs: int) -> list[dict]:
    app = create_app(path, background=False)
    timed = Timed(app)
    hook_id = made["webhook"]["id"]
    with TestClient(timed, base_url="http://bench") as client:
        todo_id = signed_in(client, app, made["human"]["token"])
        event_id = app.state.db.read_sync(lambda txn: txn.one(
            "SELECT id FROM events ORDER BY received_at DESC LIMIT 1")["id"])
        pages = [("inbox", "/board"), ("inbox: dead letters, page 1", "/board/inbox/dead"),
                 ("queues", "/board/queues"), ("a todo", f"/board/todos/{todo_id}"),
                 ("deliveries", f"/board/webhooks/{hook_id}/deliveries"),
                 ("deliveries: dropped", f"/board/webhooks/{hook_id}/deliveries?disposition=dropped"),
                 ("a delivery", f"/board/deliveries/{event_id}"), ("webhooks", "/board/webhooks"),
                 ("webhook + rules", f"/board/webhooks/{hook_id}"), ("endpoints", "/board/endpoints")]
        results = []
        for name, path_ in pages:
            times = []
            for run in range(runs + 3):
                answer = client.get(path_)
                assert answer.status_code == 200, (path_, answer.status_code, answer.text[:300])
                if run >= 3:
                    times.append(timed.last * 1000)
            times.sort()
            results.append({"page": name, "path": path_, "p50_ms": statistics.median(times),
                            "p95_ms": times[min(len(times) - 1, int(len(times) * 0.95))], "bytes": len(answer.content)})
        return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--todos", type=int, default=100_000)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "switchboard.db")
        started = time.perf_counter()
        made = principals(path)
        fill(path, made, args.todos, args.events)
        loaded = time.perf_counter() - started
        results = measure(path, made, args.runs)
        size = Path(path).stat().st_size
    print(f"\nBoard pages, {args.todos:,} todos and {args.events:,} events in one human's database"
          f" ({size / 1e6:.0f} MB, loaded in {loaded:.1f} s); server time over {args.runs} requests each\n")
    print("| page | p50 ms | p95 ms | under 50 ms | HTML bytes |\n|---|---:|---:|:---:|---:|")
    for r in results:
        print(f"| {r['page']} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | {'yes' if r['p95_ms'] < TARGET_MS else 'NO'}"
              f" | {r['bytes']:,} |")
    RESULTS_PATH.write_text(json.dumps({"todos": args.todos, "events": args.events, "runs": args.runs,
                                        "results": results}, indent=2))
    return 0 if all(r["p50_ms"] < TARGET_MS for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
