"""Fairness benchmark: another tenant's ack latency while one tenant's rules loop.

Run by hand (never collected by pytest):

    python tests/bench/bench_fairness.py [--deliveries 200] [--noisy-senders 8]

A real `python switchboard.py serve` on a fresh database, two humans. Alice's GitHub webhook has one rule that
loops until the sandbox stops it (`last(range(1e15)) > 0`); Bob's has one trivial rule. First Bob alone sends
`--deliveries` signed deliveries one after another (his idle latency); then the same while
`--noisy-senders` threads keep Alice's looping deliveries coming as fast as the server takes them. The goal is
Bob's p99 under load within 2x of his idle p99: one tenant's runaway rules must only ever slow that tenant.
Also reported: /healthz p99 under load, and what Alice's deliveries were answered (held by a timeout fault, or
503 when her queue was full). Prints a Markdown table and writes JSON to tests/bench/results-fairness.json.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import hmac
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
RESULTS_PATH = Path(__file__).resolve().with_name("results-fairness.json")
LOOP_FOREVER = "last(range(1e15)) > 0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(db: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "switchboard.py"), *args, "--db", db, "--json"],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def tenant(db: str, name: str, expr: str, tmp: Path) -> dict:
    human = cli(db, "human", "add", name)
    endpoint = cli(db, "endpoint", "vend", "--human", name, "--name", "w", "--queues", "work")
    hook = cli(db, "webhook", "create", "--endpoint", endpoint["id"], "--provider", "github", "--queue", "work",
               "--allow-all")
    rules = tmp / f"{name}.json"
    rules.write_text(json.dumps({"rules": [{"id": "only", "expr": expr, "action": {"queue": "work"}}]}))
    cli(db, "rules", "set", hook["id"], "--file", str(rules))
    return {"human": human, "hook": hook, "path": "/hooks/" + hook["url"].rsplit("/hooks/", 1)[1]}


def delivery(hook: dict, number: int) -> tuple[bytes, dict]:
    body = json.dumps({"action": "opened", "issue": {"number": number, "title": f"issue {number}",
                                                     "user": {"login": "someone"}, "labels": []},
                       "repository": {"full_name": "lab/bench"}, "sender": {"login": "someone"}}).encode()
    signature = "sha256=" + hmac.new(hook["secret"].encode(), body, hashlib.sha256).hexdigest()
    return body, {"X-GitHub-Event": "issues", "X-GitHub-Delivery": str(uuid.uuid4()),
                  "X-Hub-Signature-256": signature, "Content-Type": "application/json"}


def latencies(url: str, who: dict, count: int, first: int) -> tuple[list[float], collections.Counter]:
    times, answers = [], collections.Counter()
    with httpx.Client(base_url=url, timeout=30) as client:
        for n in range(first, first + count):
            body, headers = delivery(who["hook"], n)
            start = time.perf_counter()
            answer = client.post(who["path"], content=body, headers=headers)
            times.append((time.perf_counter() - start) * 1000)
            answers[f"{answer.status_code} {answer.json().get('disposition', answer.json().get('error'))}"] += 1
    return times, answers


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deliveries", type=int, default=200)
    parser.add_argument("--noisy-senders", type=int, default=8)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sb-fairness-"))
    db = str(tmp / "switchboard.db")
    cli(db, "init")
    alice = tenant(db, "alice", LOOP_FOREVER, tmp)
    bob = tenant(db, "bob", ".issue != null", tmp)
    port = free_port()
    server = subprocess.Popen([sys.executable, str(ROOT / "switchboard.py"), "serve", "--db", db, "--port", str(port),
                               "--ingest-rate", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        latencies(url, bob, 20, 0)  # warm-up
        idle, _ = latencies(url, bob, args.deliveries, 1000)
        stop = threading.Event()
        noisy: collections.Counter = collections.Counter()
        health: list[float] = []

        def flood(worker: int) -> None:
            n = 100_000 * (worker + 1)
            with httpx.Client(base_url=url, timeout=30) as client:
                while not stop.is_set():
                    body, headers = delivery(alice["hook"], n)
                    n += 1
                    answer = client.post(alice["path"], content=body, headers=headers)
                    noisy[f"{answer.status_code} {answer.json().get('disposition', answer.json().get('error'))}"] += 1

        def probe() -> None:
            with httpx.Client(base_url=url, timeout=30) as client:
                while not stop.is_set():
                    start = time.perf_counter()
                    client.get("/healthz")
                    health.append((time.perf_counter() - start) * 1000)
                    time.sleep(0.05)

        threads = [threading.Thread(target=flood, args=(i,)) for i in range(args.noisy_senders)]
        threads.append(threading.Thread(target=probe))
        for thread in threads:
            thread.start()
        time.sleep(2)  # let the noise build up
        loaded, answers = latencies(url, bob, args.deliveries, 5000)
        stop.set()
        for thread in threads:
            thread.join()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    result = {
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "load_average": os.getloadavg(), "cpus": os.cpu_count(),
        "bob_idle_ms": {"p50": statistics.median(idle), "p99": p(idle, 99)},
        "bob_loaded_ms": {"p50": statistics.median(loaded), "p99": p(loaded, 99)},
        "bob_answers_loaded": dict(answers),
        "p99_ratio": p(loaded, 99) / p(idle, 99),
        "healthz_loaded_ms": {"p50": statistics.median(health), "p99": p(health, 99)},
        "alice_answers": dict(noisy),
    }
    RESULTS_PATH.write_text(json.dumps(result, indent=1))
    print("| figure | p50 | p99 |\n|---|---:|---:|")
    print(f"| Bob alone | {result['bob_idle_ms']['p50']:.1f} ms | {result['bob_idle_ms']['p99']:.1f} ms |")
    print(f"| Bob while Alice's rules loop ({args.noisy_senders} senders) | {result['bob_loaded_ms']['p50']:.1f} ms |"
          f" {result['bob_loaded_ms']['p99']:.1f} ms |")
    print(f"| /healthz while Alice's rules loop | {result['healthz_loaded_ms']['p50']:.1f} ms |"
          f" {result['healthz_loaded_ms']['p99']:.1f} ms |")
    print(f"\nBob's p99 under load / idle: {result['p99_ratio']:.2f}x (goal: within 2x). Bob's answers under load:"
          f" {dict(answers)}. Alice's answers: {dict(noisy)}. Load average {result['load_average']}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
