"""A bulk retry of 5,000 dead letters while deliveries keep arriving (issue 37): the ingest ack p99 stays under
100 ms while it runs, because the action holds the writer a short step at a time.

Run by hand (never collected by pytest):

    python tests/bench/bench_bulk.py [--dead 5000] [--rate 200]

Built through the store (in-process, synchronous OFF: the build is not measured): bench_scale's human, endpoint
and signed GitHub webhook, then DEAD todos pushed, claimed and failed for good (dead letters). Then a real
`serve` (synchronous FULL, no ingest limit) takes signed 12.8 KB `issues.labeled` deliveries from 16 paced
senders at `--rate` a second; after two seconds (the baseline) the human's `POST /api/v1/todos/bulk` dry-runs,
then retries every dead letter. Reported: the dry run's and the act's wall time, todos acted on per second, and
the ack p50/p99 of the deliveries sent while the act ran against the two seconds before. Checks: every dead
letter is pending after, each with the human as the actor of its retry, and every delivery was routed. Writes
tests/bench/results-bulk.json; the last line is `bulk: N of M goals met`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench_scale import BATCH, Builder, Deliveries, send, setup  # noqa: E402
from bench_store import Server, machine_facts, percentile  # noqa: E402

from switchboard.configuration import Clock  # noqa: E402
from switchboard.models import ClaimById, Fail, TodoPush  # noqa: E402
from switchboard.store.human_actions import push_todo  # noqa: E402
from switchboard.store.transitions import claim_todo, fail  # noqa: E402

RESULTS_PATH = HERE / "results-bulk.json"
GOAL_P99_MS = 100.0


def build(path: str, dead: int) -> dict:
    """The principals and webhook (bench_scale's), and `dead` dead letters on the endpoint's inbox queue."""
    made = setup(path)
    builder = Builder(path, made)
    now = Clock().now_ms()
    for start in range(0, dead, BATCH):
        txn = builder.transaction(now)
        for n in range(start, min(dead, start + BATCH)):
            todo = push_todo(txn, builder.human, builder.endpoint.id, TodoPush(title=f"dead letter {n}", queue="inbox"))
            lease = claim_todo(txn, builder.endpoint, todo["id"], ClaimById())["lease_token"]
            fail(txn, builder.endpoint, todo["id"], Fail(lease_token=lease, error="the rules were wrong", retry=False))
        builder.commit()
    builder.close()
    return made


def measure(path: str, made: dict, dead: int, rate: float) -> dict:
    auth = {"Authorization": f"Bearer {made['human']['token']}"}
    body = {"action": "retry", "filter": {"queue": "inbox", "state": "failed"}, "reason": "the rules are fixed"}
    stop = threading.Event()
    with Server(path, "full", "--ingest-rate", "0") as server:
        sending = concurrent.futures.ThreadPoolExecutor(1).submit(send, server.url + made["hook_path"],
                                                                  Deliveries(10 * dead), None, stop, rate)
        try:
            time.sleep(2.0)
            with httpx.Client(base_url=server.url, headers=auth, timeout=300) as client:
                t0 = time.perf_counter()
                dry = client.post("/api/v1/todos/bulk", json=body).json()
                dry_s = time.perf_counter() - t0
                begun, t0 = time.time(), time.perf_counter()
                acted = client.post("/api/v1/todos/bulk", json={**body, "dry_run": False}).json()
                act_s, ended = time.perf_counter() - t0, time.time()
            time.sleep(0.5)
        finally:
            stop.set()
            sent = sending.result()
        problems = server.log_problems()
    during = [ms for at, ms in sent["acks"] if begun <= at <= ended]
    before = [ms for at, ms in sent["acks"] if begun - 2 <= at < begun]
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        pending = conn.execute("SELECT count(*) FROM todos WHERE queue = 'inbox' AND state = 'pending'"
                               " AND title LIKE 'dead letter %'").fetchone()[0]
        by_human = conn.execute("SELECT count(DISTINCT todo_id) FROM todo_history WHERE actor = ? AND from_state ="
                                " 'failed' AND to_state = 'pending'", (f"human:{made['human']['id']}",)).fetchone()[0]
    finally:
        conn.close()
    return {"dead": dead, "rate": rate, "dry_run": dry, "dry_run_s": dry_s, "acted": acted, "act_s": act_s,
            "todos_per_s": acted.get("acted", 0) / act_s, "acks_during": len(during),
            "ack_p50_during_ms": percentile(during, 50), "ack_p99_during_ms": percentile(during, 99),
            "ack_p99_before_ms": percentile(before, 99), "pending_after": pending, "retried_by_human": by_human,
            "delivery_errors": sent["errors"], "server_problems": problems[:5]}


def goals(result: dict) -> list[dict]:
    dead = result["dead"]
    return [
        {"goal": "the dry run matches every dead letter and changes nothing",
         "value": f"{result['dry_run'].get('matched')} matched", "met": result["dry_run"].get("acted") == dead},
        {"goal": "every dead letter pending after, the human the actor of each retry",
         "value": f"{result['pending_after']} pending, {result['retried_by_human']} by the human",
         "met": result["pending_after"] == result["retried_by_human"] == dead},
        {"goal": f"ingest ack p99 while the bulk retry runs under {GOAL_P99_MS:g} ms",
         "value": f"{result['ack_p99_during_ms']:.1f} ms over {result['acks_during']} acks",
         "met": result["ack_p99_during_ms"] < GOAL_P99_MS and result["acks_during"] > 0},
        {"goal": "every delivery routed, no server error", "value": f"{len(result['delivery_errors'])} errors",
         "met": not result["delivery_errors"] and not result["server_problems"]},
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dead", type=int, default=5_000, help="dead letters to retry (default 5000)")
    parser.add_argument("--rate", type=float, default=200.0, help="deliveries a second meanwhile (default 200)")
    parser.add_argument("--out", default=str(RESULTS_PATH))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sb-bulk-") as folder:
        path = str(Path(folder) / "bulk.db")
        started = time.perf_counter()
        made = build(path, args.dead)
        print(f"built {args.dead:,} dead letters in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        result = measure(path, made, args.dead, args.rate)
    report = {"machine": machine_facts(), "result": result, "goals": goals(result)}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"bulk retry of {result['dead']:,} dead letters: dry run {result['dry_run_s']:.2f} s, act"
          f" {result['act_s']:.2f} s ({result['todos_per_s']:,.0f} todos/s); ingest at {result['rate']:g}/s: ack"
          f" p50 {result['ack_p50_during_ms']:.1f} ms, p99 {result['ack_p99_during_ms']:.1f} ms during it"
          f" ({result['acks_during']} acks), p99 {result['ack_p99_before_ms']:.1f} ms in the 2 s before")
    print("\n| goal | value | met |\n|---|---:|:---:|")
    for goal in report["goals"]:
        print(f"| {goal['goal']} | {goal['value']} | {'yes' if goal['met'] else '**no**'} |")
    met = sum(goal["met"] for goal in report["goals"])
    print(f"\nbulk: {met} of {len(report['goals'])} goals met")
    return 0 if met == len(report["goals"]) else 1


if __name__ == "__main__":
    sys.exit(main())
