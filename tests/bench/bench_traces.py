"""Traces cost nothing when nobody collects them (issue 47): ingest and claim + complete with this checkout against
the same at an earlier commit, without the `otel` extra's endpoint.

    python tests/bench/bench_traces.py [--before REV] [--quick]

The earlier commit is checked out in a temporary git worktree (removed after). Each round runs one child process
per side, alternating which goes first: the app in-process (Starlette's test client, no sockets), SQLite with
synchronous NORMAL in a fresh temp directory, `N` signed GitHub `issues.opened` deliveries to a webhook whose one
rule routes them to `build`, then `N` claim + complete cycles of those todos by their endpoint. Rates are per wall
second of each phase; CPU per operation is the process's CPU time over the phase. The table gives medians over
rounds and the ratio this checkout / the earlier one (goal: ≥ 0.97 on both, that is within 3%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# The child: one side's measurement, its figures as one JSON line.
CHILD = r"""
import hashlib, hmac, json, os, sys, tempfile, time, uuid
from starlette.testclient import TestClient
from switchboard.app import create_app
from switchboard.cli.parser import main

n = int(sys.argv[1])
folder = tempfile.mkdtemp(prefix="sb-bench-traces-")
db = os.path.join(folder, "bench.db")
out = os.path.join(folder, "human.json")
main(["init", "--db", db, "--json"])
import contextlib, io
with contextlib.redirect_stdout(io.StringIO()) as said:
    main(["human", "add", "bench", "--db", db, "--json"])
human = json.loads(said.getvalue())
app = create_app(db, background=False, synchronous="NORMAL", ingest_rate=0)
with TestClient(app) as client:
    auth = {"Authorization": f"Bearer {human['token']}"}
    endpoint = client.post("/api/v1/endpoints", headers=auth, json={"name": "build", "queues": ["build"],
                                                                   "verbs": ["all"]}).json()
    hook = client.post("/api/v1/webhooks", headers=auth, json={"provider": "github", "queue": "build",
                       "endpoint_id": endpoint["id"], "trusted_actors": {"allow_all": True}}).json()
    path = "/hooks/" + hook["url"].rsplit("/hooks/", 1)[1]
    body = {"action": "opened", "issue": {"number": 1, "title": "Spelling error", "labels": [], "body": "x" * 2000,
            "user": {"login": "alice"}, "pull_request": None}, "repository": {"full_name": "acme/site"},
            "sender": {"login": "alice"}}
    bodies = []
    for number in range(1, n + 1):
        body["issue"]["number"] = number
        raw = json.dumps(body).encode()
        signature = "sha256=" + hmac.new(hook["secret"].encode(), raw, hashlib.sha256).hexdigest()
        bodies.append((raw, {"X-GitHub-Event": "issues", "X-GitHub-Delivery": str(uuid.uuid4()),
                             "Content-Type": "application/json", "X-Hub-Signature-256": signature}))
    wall, cpu = time.perf_counter(), time.process_time()
    for raw, headers in bodies:
        assert client.post(path, content=raw, headers=headers).status_code == 202
    ingest = (time.perf_counter() - wall, time.process_time() - cpu)
    worker = {"Authorization": f"Bearer {endpoint['token']}"}
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        claim = client.post("/api/v1/todos/claim", headers=worker, json={"queue": "build"}).json()
        done = client.post(f"/api/v1/todos/{claim['todo']['id']}/complete", headers=worker,
                           json={"lease_token": claim["lease_token"]})
        assert done.status_code == 200
    cycles = (time.perf_counter() - wall, time.process_time() - cpu)
print(json.dumps({"ingest_per_s": n / ingest[0], "ingest_cpu_ms": ingest[1] * 1e3 / n,
                  "cycles_per_s": n / cycles[0], "cycle_cpu_ms": cycles[1] * 1e3 / n}))
"""


def side(tree: Path, n: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(n)], cwd=tree, capture_output=True, text=True,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"the run in {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="c747149", help="the earlier commit (default: the fourth release's last)")
    parser.add_argument("--quick", action="store_true", help="fewer operations and rounds (a quick look)")
    args = parser.parse_args(argv)
    n, rounds = (300, 2) if args.quick else (1500, 8)
    folder = Path(tempfile.mkdtemp(prefix="sb-bench-traces-tree-"))
    before = folder / "before"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(before), args.before], check=True)
    try:
        results: dict[str, list[dict]] = {"before": [], "now": []}
        for index in range(rounds):
            order = [("before", before), ("now", ROOT)]
            for name, tree in order if index % 2 == 0 else reversed(order):
                results[name].append(side(tree, n))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)
    medians = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
               for name, runs in results.items()}
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    print(f"{rounds} rounds of {n} deliveries and {n} claim + complete cycles; before `{args.before}`, now `{head}`\n")
    print("| figure | before | now | now / before | each round's now / before |\n|---|---:|---:|---:|---|")
    for key, label in (("ingest_per_s", "ingest, deliveries/s"), ("ingest_cpu_ms", "ingest, CPU ms per delivery"),
                       ("cycles_per_s", "claim + complete, cycles/s"), ("cycle_cpu_ms", "claim + complete, CPU ms per cycle")):
        b, a = medians["before"][key], medians["now"][key]
        each = ", ".join(f"{now[key] / then[key]:.2f}" for then, now in zip(results["before"], results["now"], strict=True))
        print(f"| {label} | {b:,.2f} | {a:,.2f} | {a / b:.3f} | {each} |")
    met = (medians["now"]["ingest_per_s"] >= 0.97 * medians["before"]["ingest_per_s"]
           and medians["now"]["cycles_per_s"] >= 0.97 * medians["before"]["cycles_per_s"])
    print(f"\nwithin 3% (or faster) on both: {'yes' if met else 'no'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
