"""Traces cost nothing when nobody collects them (issue 47): ingest and claim + complete, now and at a commit before.

This checkout and an earlier commit run the same operations, without the `otel` extra's endpoint.

    python tests/bench/bench_traces.py [--before REV] [--quick]

The earlier commit is checked out in a temporary git worktree (removed after). Each round runs one child process
per side, alternating which goes first: the app in-process (Starlette's test client, no sockets), SQLite with
synchronous NORMAL in a fresh temp directory, `N` signed GitHub `issues.opened` deliveries to a webhook whose one
rule routes them to `build`, then `N` claim + complete cycles of those todos by their endpoint. Rates are per wall
second of each phase; CPU per operation is the process's CPU time over the phase. The table gives medians over
rounds and the ratio this checkout / the earlier one (goal: ≥ 0.97 on both, that is within 3%).

    python tests/bench/bench_traces.py --instructions [--before REV] [--after REV]

counts instead the instructions each side executes per delivery and per claim + complete cycle, under valgrind's
cachegrind (`apt-get install valgrind`): on a machine whose rounds move by ±15% from one to the next, a wall-clock
ratio cannot resolve 3%, while an instruction count repeats to a few in ten thousand (the way CodSpeed measures
Python on shared CI machines). Each side runs three children, the same code as above with `PYTHONHASHSEED=0`:
`N1` deliveries, `N2` deliveries, and `N2` deliveries then `N2` cycles; a delivery costs (Ir(N2) − Ir(N1)) / (N2 − N1)
and a cycle (Ir(N2 + cycles) − Ir(N2)) / N2, so start-up and imports cancel out. The rules' jq child is not counted
(valgrind follows no child); traces change nothing in it. `--after` measures an earlier commit in place of this
checkout: `--before 0bd3b14 --after 8d14fd7` is the traces merge alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
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
cycles_too = sys.argv[2:] != ["ingest"]
folder = tempfile.mkdtemp(prefix="sb-bench-traces-")
import atexit, shutil
atexit.register(shutil.rmtree, folder, True)
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
    if not cycles_too:
        raise SystemExit(0)
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


def instructions(tree: Path, n: int, phases: str, folder: Path) -> int:
    """Instructions the child executes in `tree` (n deliveries, then n cycles unless phases is "ingest")."""
    out = folder / f"cachegrind.{tree.name}.{n}.{phases}"
    done = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}",
                           sys.executable, "-c", CHILD, str(n), phases], cwd=tree, capture_output=True, text=True,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"}, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"the run in {tree} failed:\n{done.stderr[-2000:]}")
    summary = next(line for line in out.read_text().splitlines() if line.startswith("summary:"))
    return int(summary.split()[1])


def count_instructions(args, before: Path, after: Path, folder: Path) -> int:
    small, large = (20, 60) if args.quick else (50, 200)
    figures = {}
    for name, tree in (("before", before), ("now", after)):
        # Compiled first: a child that writes the bytecode cache would count the compiler.
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "switchboard")], check=True)
        ingest_small = instructions(tree, small, "ingest", folder)
        ingest_large = instructions(tree, large, "ingest", folder)
        both = instructions(tree, large, "both", folder)
        figures[name] = {"delivery": (ingest_large - ingest_small) / (large - small),
                         "cycle": (both - ingest_large) / large}
    print(f"instructions per operation (cachegrind; {small} and {large} deliveries, {large} cycles); before "
          f"`{args.before}`, now `{args.after or 'this checkout'}`\n")
    print("| operation | before | now | now / before |\n|---|---:|---:|---:|")
    for key, label in (("delivery", "ingest, per delivery"), ("cycle", "claim + complete, per cycle")):
        b, a = figures["before"][key], figures["now"][key]
        print(f"| {label} | {b:,.0f} | {a:,.0f} | {a / b:.4f} |")
    met = all(figures["now"][key] <= 1.03 * figures["before"][key] for key in ("delivery", "cycle"))
    print(f"\nwithin 3% (or fewer) on both: {'yes' if met else 'no'}")
    return 0 if met else 1


def worktree(rev: str, folder: Path) -> Path:
    path = folder / rev
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="c747149", help="the earlier commit (default: the fourth release's last)")
    parser.add_argument("--after", help="with --instructions: an earlier commit in place of this checkout")
    parser.add_argument("--instructions", action="store_true", help="count instructions under valgrind instead")
    parser.add_argument("--quick", action="store_true", help="fewer operations and rounds (a quick look)")
    args = parser.parse_args(argv)
    n, rounds = (300, 2) if args.quick else (1500, 8)
    folder = Path(tempfile.mkdtemp(prefix="sb-bench-traces-tree-"))
    if args.instructions and shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind: apt-get install valgrind")
    before = worktree(args.before, folder)
    try:
        if args.instructions:
            after = worktree(args.after, folder) if args.after else ROOT
            try:
                return count_instructions(args, before, after, folder)
            finally:
                if args.after:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(after)], check=False)
        results: dict[str, list[dict]] = {"before": [], "now": []}
        for index in range(rounds):
            order = [("before", before), ("now", ROOT)]
            for name, tree in order if index % 2 == 0 else reversed(order):
                results[name].append(side(tree, n))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)
        shutil.rmtree(folder, ignore_errors=True)
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
