"""Switchboard side by side with the ceiling of its architecture and with the peer SQLite queues, in one run.

    python tests/bench/bench_compare.py [--quick] [--out PATH]     (also run first by tests/bench/run_all.py)

The reference point is tests/bench/minimal_app.py: a Starlette + uvicorn app (uvloop + httptools, like `serve`)
that does only what every delivery must do -- verify the HMAC-SHA256 signature, parse the JSON, insert one row
in SQLite (WAL, synchronous=FULL) and commit -- plus the smallest claim/complete. It runs in a child process on
a free 127.0.0.1 port, once with one commit per request and once with group commit (one writer thread batches
the waiting writes), the latter for information.

Figures (FULL everywhere):

1. Signed deliveries/s, no rules, 16 senders, and the p99 ack: Switchboard (a human; an endpoint with verbs
   `webhooks,drain` on queue `inbox`; a GitHub webhook on it trusting the fixtures' sender, no rules, so each
   delivery is fanned out into one pending todo; `serve --ingest-rate 0`) vs the minimal app.
2. The same with the fleet pack installed (bench_ingest.fleet_topology), vs the minimal app with one sandboxed jq
   child running the same fleet program over each delivery's envelope (`--jq-program`: the least any design
   with jq in a child must do), and, for information, vs the plain minimal app.
3. claim + complete cycles/s over REST, 8 workers, on pre-pushed todos, vs the minimal app's /claim + /complete.
4. In-process claim + ack, single thread, two commits per cycle: Switchboard's store (bench_store part B) vs
   litequeue, persist-queue and huey (SqliteHuey: dequeue, then execute, which stores the result) at
   synchronous=FULL; and, for information, the writer floor: two one-row commits through Switchboard's writer
   thread per cycle, doing none of a transition's work.
5. Idle CPU (server + children, /proc) after 10,000 deliveries left 10,000 pending todos, vs the minimal app idle.
6. Database size (db + -wal while serving, after stopping, and after `PRAGMA wal_checkpoint(TRUNCATE)` from a
   separate connection) after those deliveries, as a ratio to the bytes of bodies received.
7. RSS (VmRSS) of the server and all its children after those deliveries, and after as many fleet-pack
   deliveries (the same measurements, on the fleet template).

Every delivery is the `issues.labeled` fixture with its own issue number, a rotating size/S|M|L label and an
issue body padded to 12,800 bytes of JSON, signed with one fixed secret (set on Switchboard's webhooks with
`--secret`), so both systems receive byte-identical requests. All deliveries are built and signed before any
clock starts; 16 threads with one keep-alive httpx.Client each send them (as bench_ingest does). Every run is
verified (every delivery answered 202, the rows in the file) before its number counts.

Throughput figures (1)-(4) run three repetitions, interleaving the systems, and report medians and the ratio of
medians. Before each repetition round the load gate waits (up to 30 s) until other processes use under 0.15
cores over 0.5 s (/proc/stat busy time minus this process tree's); every measured window records the 1-minute
load average and the other processes' CPU, and a figure with a window above 0.25 cores is marked busy instead
of being reported as the result. Switchboard is only driven through its CLI (`--json`), HTTP, and, for (4), the
store API bench_store part B uses.

`--runs N` repeats the whole run N times and calls a goal met only when the median of the runs' figures meets
it, with the spread of the runs beside it (`spread(runs)`).

Writes tests/bench/results-compare.json and prints a Markdown table (`markdown(results)`).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import json
import math
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # tests/, for producers
import bench_ingest  # noqa: E402
import minimal_app  # noqa: E402
import producers  # noqa: E402
from bench_ingest import PACK, PARAMS, SIZES, fleet_topology, labeled_delivery  # noqa: E402
from bench_store import (  # noqa: E402
    SYNC_CODE,
    ChildServer,
    Server,
    cli,
    inproc_litequeue,
    inproc_persistqueue,
    inproc_switchboard,
    machine_facts,
    percentile,
    read_only,
    report_notes,
    run_timed,
    source_fingerprint,
    timed_loop,
)

from switchboard.database import Database, Txn  # noqa: E402 - on the path bench_store put it on
from switchboard.evaluator import combined_program  # noqa: E402

RESULTS_PATH = HERE / "results-compare.json"
MINIMAL_APP = HERE / "minimal_app.py"
SECRET = "bench-compare-secret-0123456789abcdef"
MINIMAL_HOOK = "/hooks/bench"
INBOX = "inbox"
CLAIM_QUEUE = "bench"
BODY_BYTES = 12_800  # ~12.5 KB per delivery, as JSON on the wire
SENDERS = 16
WORKERS = 8

GATE_CORES = 0.15   # start a round only when other processes use less than this
GATE_WINDOW_S = 0.5  # ...over a window this long
BUSY_CORES = 0.25   # a measured window above this is marked busy
GATE_MAX_S = 30.0

SIZES_FULL = {"deliveries": 1500, "cycles": 1000, "inproc_cycles": 1000, "reps": 3, "footprint": 10_000,
              "idle_s": 15.0, "settle_s": 3.0, "gate_max_s": GATE_MAX_S}
SIZES_QUICK = {"deliveries": 300, "cycles": 300, "inproc_cycles": 300, "reps": 1, "footprint": 1000,
               "idle_s": 5.0, "settle_s": 1.0, "gate_max_s": 10.0}

FILLER = ("Steps to reproduce: open the README, read the second paragraph, notice the typo. " * 200)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------
# /proc: CPU of the machine, of our own process tree, of a server tree; RSS
# ----------------------------------------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def _proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, CPU seconds: utime + stime + cutime + cstime, so reaped descendants stay counted)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(entry)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / TICK)
    return table


def _tree(root: int, table: dict[int, tuple[int, float]]) -> set[int]:
    children = collections.defaultdict(list)
    for pid, (ppid, _) in table.items():
        children[ppid].append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in table and pid not in found:
            found.add(pid)
            todo.extend(children[pid])
    return found


def tree_pids(root: int) -> set[int]:
    """root and every live process under it."""
    return _tree(root, _proc_table())


def tree_cpu(root: int) -> float:
    table = _proc_table()
    return sum(table[p][1] for p in _tree(root, table))


def machine_snapshot() -> dict:
    """Wall clock; CPU seconds of the whole machine (user, nice, system), of this process tree (servers and their
    children included), of kernel threads, of interrupts (irq + softirq), and steal."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    table = _proc_table()
    return {"t": time.monotonic(), "busy": sum(fields[:3]) / TICK, "irq": sum(fields[5:7]) / TICK,
            "steal": (fields[7] if len(fields) > 7 else 0) / TICK,
            "own": sum(table[p][1] for p in _tree(os.getpid(), table)),
            "kernel": sum(cpu for pid, (ppid, cpu) in table.items() if pid == 2 or ppid == 2)}


def other_cores(before: dict, after: dict) -> dict:
    """Other processes' CPU: the machine's user+system time less this process tree's and the kernel threads'
    (which mostly flush this run's own fsyncs; interrupts, mostly this run's loopback traffic and disk, are left
    out the same way). Both left-out parts are recorded. `other_cores` allows two clock ticks of rounding."""
    wall = max(1e-9, after["t"] - before["t"])
    d = {k: after[k] - before[k] for k in ("busy", "irq", "steal", "own", "kernel")}
    other = d["busy"] - d["own"] - d["kernel"]
    return {"wall_s": wall, "other_cores": max(0.0, (other - 2 / TICK) / wall), "own_cores": d["own"] / wall,
            "kernel_thread_cores": d["kernel"] / wall, "irq_cores": d["irq"] / wall, "steal_cores": d["steal"] / wall}


def tree_rss(root: int) -> dict:
    table = _proc_table()
    per = {}
    for pid in sorted(_tree(root, table)):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
            name = next(line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Name:"))
        except (OSError, StopIteration, ValueError):
            continue
        per[pid] = {"name": name, "rss_kib": kib}
    return {"total_mib": sum(p["rss_kib"] for p in per.values()) / 1024, "processes": list(per.values())}


def load_gate(label: str, max_wait: float = GATE_MAX_S) -> dict:
    """Wait until processes outside this tree use under GATE_CORES over GATE_WINDOW_S (or max_wait passed)."""
    t0 = time.monotonic()
    while True:
        before = machine_snapshot()
        time.sleep(GATE_WINDOW_S)
        other = other_cores(before, machine_snapshot())["other_cores"]
        waited = time.monotonic() - t0
        if other < GATE_CORES or waited >= max_wait:
            gate = {"label": label, "waited_s": round(waited, 1), "other_cores": round(other, 3),
                    "quiet": other < GATE_CORES, "loadavg1": os.getloadavg()[0]}
            if not gate["quiet"]:
                log(f"gate {label}: still {other:.2f} cores used by other processes after {waited:.0f} s; going on")
            return gate
        log(f"gate {label}: other processes use {other:.2f} cores; waiting")


class Window:
    """One measured window: other processes' CPU, this client's CPU, a server tree's CPU, the load average."""

    def __init__(self, server_pid: int | None = None):
        self.server_pid = server_pid
        self.m0 = machine_snapshot()
        self.server0 = tree_cpu(server_pid) if server_pid else None
        self.client0 = time.process_time()

    def close(self) -> dict:
        client1 = time.process_time()
        server1 = tree_cpu(self.server_pid) if self.server_pid else None
        out = other_cores(self.m0, machine_snapshot())
        wall = out["wall_s"]
        out["client_cores"] = (client1 - self.client0) / wall
        out["server_cores"] = None if server1 is None else (server1 - self.server0) / wall
        out["loadavg1"] = os.getloadavg()[0]
        out["busy"] = out["other_cores"] > BUSY_CORES
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------------
# systems under test
# ----------------------------------------------------------------------------------------------------

class MinimalServer(ChildServer):
    """tests/bench/minimal_app.py as a child process (bench_store.ChildServer starts and stops it)."""

    def command(self, db_path: str, group_commit: bool = False, jq_program: str | None = None) -> list[str]:
        return [str(MINIMAL_APP), "--db", db_path, "--port", str(self.port), "--secret", SECRET,
                *(["--group-commit"] if group_commit else []),
                *(["--jq-program", jq_program, "--jq-params", json.dumps(PARAMS)] if jq_program else [])]

    def log_problems(self) -> list[str]:
        return [line for line in self.log_path.read_text(errors="replace").splitlines()
                if "Traceback" in line or "ERROR" in line]


def db_files(db_path: str) -> dict:
    sizes = {}
    for suffix in ("", "-wal", "-shm"):
        p = Path(db_path + suffix)
        sizes["db" if not suffix else suffix[1:]] = p.stat().st_size if p.exists() else 0
    sizes["db_plus_wal"] = sizes["db"] + sizes["wal"]
    return sizes


def checkpoint_truncate(db_path: str) -> list:
    conn = sqlite3.connect(db_path)
    try:
        return list(conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone())
    finally:
        conn.close()


@contextlib.contextmanager
def scratch(path: str) -> Iterator[str]:
    """A repetition's own directory, removed when it ends (however it ends)."""
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def copy_dir(src: str, prefix: str) -> str:
    """A fresh working copy of a template directory (database and key; never logs or a stale -shm)."""
    dst = tempfile.mkdtemp(prefix=prefix)
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.log", "*-shm"))
    return dst


def hook_path(hook: dict) -> str:
    return "/hooks/" + hook["url"].rsplit("/hooks/", 1)[1]


def make_templates(tmp_root: str, n_cycles: int) -> dict:
    """Set-up through the CLI (and, for the claim template, todos pushed over REST), done once; each repetition
    then runs on a copy, so every repetition starts from the same file."""
    t = {}
    # No rules: one endpoint that owns the webhook and may drain its queue.
    d = os.path.join(tmp_root, "plain")
    os.mkdir(d)
    db = os.path.join(d, "switchboard.db")
    cli(db, "init")
    cli(db, "human", "add", "bench")
    ep = cli(db, "endpoint", "vend", "--human", "bench", "--name", "inbox", "--queues", INBOX,
             "--verbs", "webhooks,drain")
    hook = cli(db, "webhook", "create", "--endpoint", ep["id"], "--provider", "github", "--queue", INBOX,
               "--trust", "Codertocat", "--secret", SECRET, "--base-url", "http://placeholder")
    if hook.get("secret") != SECRET:
        raise RuntimeError(f"webhook create did not take the fixed secret: {hook}")
    t["plain"] = {"dir": d, "hook_path": hook_path(hook), "endpoint": ep}

    # The fleet pack, as bench_ingest lays it out, with the same fixed secret.
    d = os.path.join(tmp_root, "fleet")
    os.mkdir(d)
    topo = fleet_topology(os.path.join(d, "switchboard.db"), d, secret=SECRET)
    if topo["hook"].get("secret") != SECRET:
        raise RuntimeError(f"webhook create did not take the fixed secret: {topo['hook']}")
    t["fleet"] = {"dir": d, "hook_path": topo["hook_path"]}
    # The same fleet program for the minimal app's jq child: the one Switchboard's children compile.
    program = os.path.join(tmp_root, "fleet.jq")
    Path(program).write_text(combined_program(tuple(r["expr"] for r in json.loads(PACK.read_text())["rules"])))
    t["fleet_program"] = program

    # claim+complete: n_cycles todos pushed over REST (8 threads), then the server stopped.
    d = os.path.join(tmp_root, "claim")
    os.mkdir(d)
    db = os.path.join(d, "switchboard.db")
    cli(db, "init")
    human = cli(db, "human", "add", "bench")
    ep = cli(db, "endpoint", "vend", "--human", "bench", "--name", "w", "--queues", CLAIM_QUEUE)
    server = Server(db, "full")
    try:
        errors: list[str] = []

        def pusher(indexes: range) -> None:
            with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {human['token']}"},
                              timeout=30) as client:
                for i in indexes:
                    try:
                        r = client.post(f"/api/v1/endpoints/{ep['id']}/todos",
                                        json={"title": f"t{i}", "queue": CLAIM_QUEUE})
                    except httpx.HTTPError as exc:
                        errors.append(f"push {i}: {type(exc).__name__}: {exc}")
                        return
                    if r.status_code != 201:
                        errors.append(f"push {i}: {r.status_code} {r.text[:200]}")

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(pusher, [range(k, n_cycles, 8) for k in range(8)]))
        if errors:
            exited = server.proc.poll()
            server.stop()
            raise RuntimeError(f"pushing the claim template failed: {errors[:5]}; server "
                               f"{'exited ' + str(exited) if exited is not None else 'still running'}; log tail:\n"
                               + server.log_path.read_text(errors="replace")[-3000:])
    finally:
        server.stop()
    checkpoint_truncate(db)
    t["claim"] = {"dir": d, "endpoint": ep}

    # The minimal app's claim template: the same number of small pending rows, written directly.
    d = os.path.join(tmp_root, "minimal-claim")
    os.mkdir(d)
    conn = minimal_app.connect(os.path.join(d, "minimal.db"))
    with conn:
        conn.execute("BEGIN")
        conn.executemany("INSERT INTO deliveries (delivery, body, received_at) VALUES (?, ?, ?)",
                         [(f"d{i}", json.dumps({"title": f"t{i}"}).encode(), time.time()) for i in range(n_cycles)])
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    t["minimal_claim"] = {"dir": d}
    return t


def build_deliveries(n: int) -> list[tuple[bytes, dict]]:
    """`issues.labeled` deliveries padded to BODY_BYTES, each with its own issue number and delivery id."""
    out = []
    for i in range(n):
        raw, _ = labeled_delivery(SECRET, 10_000 + i, SIZES[i % len(SIZES)])
        body = json.loads(raw)
        text = body["issue"].get("body") or ""
        body["issue"]["body"] = text
        pad = BODY_BYTES - len(json.dumps(body).encode())  # the filler is plain ASCII: one byte per character
        body["issue"]["body"] = text + FILLER[:max(0, pad)]
        raw = json.dumps(body).encode()
        if abs(len(raw) - BODY_BYTES) > 8:
            raise RuntimeError(f"delivery {i} is {len(raw)} bytes, wanted {BODY_BYTES}")
        out.append((raw, producers.github_headers(SECRET, raw, str(uuid.uuid4()), "issues")))
    return out


# ----------------------------------------------------------------------------------------------------
# the HTTP client: 16 senders, 8 workers
# ----------------------------------------------------------------------------------------------------

def send_deliveries(base_url: str, path: str, deliveries: list[tuple[bytes, dict]], server_pid: int) -> dict:
    """bench_ingest's 16 senders, with this run's measured window around them."""
    return bench_ingest.send_deliveries(base_url, path, deliveries, SENDERS, lambda: Window(server_pid).close)


def claim_complete(base_url: str, headers: dict, claim, complete, server_pid: int, n_workers: int = WORKERS) -> dict:
    """Each worker claims and completes until the queue is empty; a cycle is one claim plus one complete."""
    completed: list[list] = [[] for _ in range(n_workers)]
    cycle_ms: list[list[float]] = [[] for _ in range(n_workers)]
    errors: list[str] = []

    def worker(w: int, ready) -> None:
        with httpx.Client(base_url=base_url, headers=headers, timeout=30) as client:
            client.get("/healthz")
            ready()
            strikes = 0
            while strikes < 5:
                c0 = time.perf_counter()
                try:
                    got = claim(client)
                    if got is None:
                        break
                    complete(client, got)
                except Exception as exc:  # noqa: BLE001 - counted, and the run fails its checks
                    errors.append(f"worker {w}: {exc}")
                    strikes += 1
                    continue
                cycle_ms[w].append((time.perf_counter() - c0) * 1e3)
                completed[w].append(got[0])

    wall, window = run_timed(n_workers, worker, "worker", lambda: Window(server_pid).close)
    cycles = [x for per in cycle_ms for x in per]
    done = [x for per in completed for x in per]
    return {"wall_s": round(wall, 3), "rate": len(cycles) / wall, "p50_ms": percentile(cycles, 50),
            "p99_ms": percentile(cycles, 99), "window": window, "completed": done, "errors": errors[:20]}


# ----------------------------------------------------------------------------------------------------
# one repetition of each system
# ----------------------------------------------------------------------------------------------------

def _strip(out: dict) -> dict:
    out.pop("answers", None)
    out.pop("completed", None)
    for k in ("p50_ms", "p99_ms", "max_ms", "rate"):
        if isinstance(out.get(k), float):
            out[k] = round(out[k], 3)
    return out


def _send_and_stop(server: ChildServer, path: str, deliveries: list) -> tuple[dict, list[str]]:
    """One measured ingest run on a started server: the figures, its RSS after them, then the log's problems."""
    out = send_deliveries(server.url, path, deliveries, server.proc.pid)
    out["rss_after"] = tree_rss(server.proc.pid)
    server.stop()
    return out, server.log_problems()


def rep_switchboard_ingest(template: dict, deliveries: list, fleet: bool) -> dict:
    tmp = copy_dir(template["dir"], "sb-cmp-ingest-")
    db = os.path.join(tmp, "switchboard.db")
    with scratch(tmp), Server(db, "full", "--ingest-rate", "0") as server:
        out, problems = _send_and_stop(server, template["hook_path"], deliveries)
        n = len(deliveries)
        answers = out["answers"]
        dispositions = collections.Counter("duplicate" if a.get("duplicate") else a.get("disposition")
                                           for a in answers if a is not None)
        with read_only(db) as ro:
            db_dispositions = dict(ro.execute("SELECT disposition, count(*) FROM events GROUP BY disposition"))
            db_queues = dict(ro.execute("SELECT queue, count(*) FROM todos GROUP BY queue"))
            db_states = dict(ro.execute("SELECT state, count(*) FROM todos GROUP BY state"))
        if fleet:
            wrong_lane = sum(1 for i, a in enumerate(answers) if a is not None and a.get("disposition") == "routed"
                             and [t["queue"] for t in a["todos"]] != [f"lane-{SIZES[i % len(SIZES)].lower()}"])
            queues_ok = set(db_queues) == {f"lane-{s.lower()}" for s in SIZES} and sum(db_queues.values()) == n
        else:
            wrong_lane = sum(1 for a in answers
                             if a is not None and [t["queue"] for t in a.get("todos", [])] != [INBOX])
            queues_ok = db_queues == {INBOX: n}
        verified = {"http_errors": out["errors"][:10], "server_log_problems": problems[:10],
                    "dispositions": dict(dispositions), "db_event_dispositions": db_dispositions,
                    "db_todo_queues": db_queues, "db_todo_states": db_states, "wrong_queue": wrong_lane}
        verified["ok"] = (not out["errors"] and not problems and dispositions == {"routed": n}
                          and db_dispositions == {"routed": n} and queues_ok and db_states == {"pending": n}
                          and wrong_lane == 0)
        out["verified"] = verified
        return _strip(out)


# The fleet pack's rules that route issue #i's `size/<SIZES[i % 3]>` label to its lane, by position in the pack.
FLEET_SIZE_RULES = {size: f"issue-size-{size.lower()}" for size in SIZES}


def rep_minimal_ingest(deliveries: list, group_commit: bool, jq_program: str | None = None) -> dict:
    tmp = tempfile.mkdtemp(prefix="sb-cmp-minimal-")
    db = os.path.join(tmp, "minimal.db")
    with scratch(tmp), MinimalServer(db, group_commit, jq_program) as server:
        out, problems = _send_and_stop(server, MINIMAL_HOOK, deliveries)
        n = len(deliveries)
        duplicates = sum(1 for a in out["answers"] if a is not None and a["duplicate"])
        with read_only(db) as ro:
            rows, distinct, pending = ro.execute("SELECT count(*), count(DISTINCT delivery), "
                                                 "sum(state = 'pending') FROM deliveries").fetchone()
            decisions = dict(ro.execute("SELECT delivery, decision FROM deliveries"))
        wrong_decision = 0
        if jq_program:
            # The child's answer for each delivery must be the rule Switchboard routes it by.
            rule_ids = [r["id"] for r in json.loads(PACK.read_text())["rules"]]
            for i, (_, headers) in enumerate(deliveries):
                want = {"result": {"match": rule_ids.index(FLEET_SIZE_RULES[SIZES[i % len(SIZES)]])}}
                got = decisions.get(headers["X-GitHub-Delivery"])
                wrong_decision += got is None or json.loads(got) != want
        out["verified"] = {"http_errors": out["errors"][:10], "server_log_problems": problems[:10],
                           "duplicates": duplicates, "db_rows": rows, "db_distinct": distinct, "db_pending": pending,
                           "wrong_decision": wrong_decision,
                           "ok": not out["errors"] and not problems and duplicates == 0 and rows == n
                           and distinct == n and pending == n and wrong_decision == 0}
        return _strip(out)


def rep_switchboard_claim(template: dict, n: int) -> dict:
    tmp = copy_dir(template["dir"], "sb-cmp-claim-")
    db = os.path.join(tmp, "switchboard.db")

    def claim(client: httpx.Client):
        r = client.post("/api/v1/todos/claim", json={"queue": CLAIM_QUEUE})
        if r.status_code != 200:
            raise RuntimeError(f"claim: {r.status_code} {r.text[:200]}")
        body = r.json()
        return None if body.get("empty") else (body["todo"]["id"], body["lease_token"])

    def complete(client: httpx.Client, got) -> None:
        r = client.post(f"/api/v1/todos/{got[0]}/complete", json={"lease_token": got[1]})
        if r.status_code != 200 or r.json().get("state") != "done":
            raise RuntimeError(f"complete {got[0]}: {r.status_code} {r.text[:200]}")

    with scratch(tmp), Server(db, "full") as server:
        out = claim_complete(server.url, {"Authorization": f"Bearer {template['endpoint']['token']}"},
                             claim, complete, server.proc.pid)
        server.stop()
        problems = server.log_problems()
        dupes = [k for k, c in collections.Counter(out["completed"]).items() if c > 1]
        with read_only(db) as ro:
            states = dict(ro.execute("SELECT state, count(*) FROM todos GROUP BY state"))
            completed_attempts = ro.execute("SELECT count(*) FROM attempts WHERE outcome = 'completed'").fetchone()[0]
            attempts_not_1 = ro.execute("SELECT count(*) FROM (SELECT todo_id FROM attempts GROUP BY todo_id "
                                        "HAVING count(*) <> 1)").fetchone()[0]
        out["cycles"] = len(out["completed"])
        out["verified"] = {"http_errors": out["errors"], "server_log_problems": problems[:10], "duplicates": dupes[:10],
                           "db_states": states, "db_completed_attempts": completed_attempts,
                           "db_todos_with_attempts_not_1": attempts_not_1,
                           "ok": not out["errors"] and not problems and not dupes and len(out["completed"]) == n
                           and states == {"done": n} and completed_attempts == n and attempts_not_1 == 0}
        return _strip(out)


def rep_minimal_claim(template: dict, n: int, group_commit: bool) -> dict:
    tmp = copy_dir(template["dir"], "sb-cmp-minimal-claim-")
    db = os.path.join(tmp, "minimal.db")

    def claim(client: httpx.Client):
        r = client.post("/claim")
        if r.status_code != 200:
            raise RuntimeError(f"claim: {r.status_code} {r.text[:200]}")
        body = r.json()
        return None if body.get("empty") else (body["id"], None)

    def complete(client: httpx.Client, got) -> None:
        r = client.post(f"/complete/{got[0]}")
        if r.status_code != 200 or r.json().get("state") != "done":
            raise RuntimeError(f"complete {got[0]}: {r.status_code} {r.text[:200]}")

    with scratch(tmp), MinimalServer(db, group_commit) as server:
        out = claim_complete(server.url, {}, claim, complete, server.proc.pid)
        server.stop()
        problems = server.log_problems()
        dupes = [k for k, c in collections.Counter(out["completed"]).items() if c > 1]
        with read_only(db) as ro:
            states = dict(ro.execute("SELECT state, count(*) FROM deliveries GROUP BY state"))
        out["cycles"] = len(out["completed"])
        out["verified"] = {"http_errors": out["errors"], "server_log_problems": problems[:10], "duplicates": dupes[:10],
                           "db_states": states,
                           "ok": not out["errors"] and not problems and not dupes and len(out["completed"]) == n
                           and states == {"done": n}}
        return _strip(out)


# ----------------------------------------------------------------------------------------------------
# in-process: bench_store part B plus huey
# ----------------------------------------------------------------------------------------------------

def inproc_huey(tmp: str, synchronous: str, n: int) -> dict:
    """SqliteHuey in this process: tasks enqueued first; a cycle is `dequeue()` (select + delete of the task in one
    exclusive transaction) and `execute(task)` (runs it and stores its result in the kv table: the second commit),
    the consumer's own two steps without its threads. huey has no lease: a dequeued task is gone."""
    from huey import SqliteHuey

    huey = SqliteHuey("bench", filename=os.path.join(tmp, "huey.db"))
    huey.storage.conn.execute(f"PRAGMA synchronous={synchronous}")  # its one connection (fsync= offers FULL or OFF)
    pragma = huey.storage.conn.execute("PRAGMA synchronous").fetchone()[0]
    try:
        @huey.task()
        def work(i: int) -> int:
            return i

        for i in range(n):
            work(i)
        seen = set()

        def cycle() -> None:
            task = huey.dequeue()
            if task.id in seen:
                raise AssertionError(f"huey handed out {task.id} twice")
            seen.add(task.id)
            huey.execute(task)

        seconds, lat = timed_loop(n, cycle)
        assert huey.dequeue() is None, "huey: tasks left after the loop"
        results = huey.storage.sql("SELECT count(*) FROM kv WHERE queue = ?", ("bench",), results=True)[0][0]
        assert results == n, f"huey: {results} results stored of {n}"
        return {"seconds": seconds, "lat": lat, "pragma": pragma}
    finally:
        huey.storage.close()


def inproc_writer_floor(tmp: str, synchronous: str, n: int) -> dict:
    """What Switchboard's store cannot go below: a cycle of two one-row UPDATEs, each its own transaction through
    `Database.write_sync` (the hand-off to the one writer thread, BEGIN IMMEDIATE, COMMIT, the answer back), with
    no lease, no fencing, no attempt and no history. Goal (4) is measured against this too, so a reader sees how
    much of the gap to the peers is the single-writer design and how much is the work a transition does."""
    db = Database(os.path.join(tmp, "floor.db"), synchronous=synchronous)
    try:
        pragma = db.write_sync(lambda txn: txn.one("PRAGMA synchronous")[0])
        db.write_sync(lambda txn: txn.execute("CREATE TABLE floor (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)"))
        db.write_sync(lambda txn: txn.execute("INSERT INTO floor VALUES (1, 0)"))

        def bump(txn: Txn) -> None:
            txn.execute("UPDATE floor SET n = n + 1 WHERE id = 1")

        def cycle() -> None:
            db.write_sync(bump)
            db.write_sync(bump)

        seconds, lat = timed_loop(n, cycle)
        count = db.read_sync(lambda txn: txn.one("SELECT n FROM floor")[0])
        assert count == 2 * n, f"writer floor: {count} updates committed of {2 * n}"
        return {"seconds": seconds, "lat": lat, "pragma": pragma}
    finally:
        db.close()


INPROC = {"switchboard": inproc_switchboard, "litequeue": inproc_litequeue, "persist-queue": inproc_persistqueue,
          "huey": inproc_huey, "writer floor": inproc_writer_floor}


def inproc_round(r: int, n: int) -> dict[str, dict]:
    names = list(INPROC)
    order = names[r % len(names):] + names[:r % len(names)]
    out = {}
    for name in order:
        tmp = tempfile.mkdtemp(prefix=f"sb-cmp-{name}-")
        try:
            window = Window(None)
            got = INPROC[name](tmp, "FULL", n)
            w = window.close()
        except Exception:  # noqa: BLE001
            out[name] = {"error": traceback.format_exc(limit=6)}
            continue
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if got["pragma"] != SYNC_CODE["FULL"]:
            out[name] = {"error": f"PRAGMA synchronous is {got['pragma']}, wanted FULL (2)"}
            continue
        # The window includes each system's pre-fill; the other processes' CPU over it is what the gate watches.
        out[name] = {"rate": round(n / got["seconds"], 1), "p50_ms": round(percentile(got["lat"], 50), 3),
                     "p99_ms": round(percentile(got["lat"], 99), 3), "window": w,
                     "verified": {"ok": True}}
    return out


# ----------------------------------------------------------------------------------------------------
# footprint: 10,000 deliveries, then idle CPU, RSS, database size
# ----------------------------------------------------------------------------------------------------

def footprint(system: str, template: dict | None, deliveries: list, idle_s: float, settle_s: float) -> dict:
    if system.startswith("switchboard"):
        tmp = copy_dir(template["dir"], "sb-cmp-footprint-")
        db = os.path.join(tmp, "switchboard.db")
        path = template["hook_path"]
        server_type, server_args = Server, ("full", "--ingest-rate", "0")
    else:
        tmp = tempfile.mkdtemp(prefix="sb-cmp-minimal-footprint-")
        db = os.path.join(tmp, "minimal.db")
        path = MINIMAL_HOOK
        server_type, server_args = MinimalServer, ()
    before = db_files(db)
    with scratch(tmp), server_type(db, *server_args) as server:
        if not system.startswith("switchboard"):
            before = db_files(db)  # the minimal app makes its (empty) schema at start
        pid = server.proc.pid
        rss_start = tree_rss(pid)
        sent = send_deliveries(server.url, path, deliveries, pid)
        time.sleep(settle_s)
        window = Window(pid)
        time.sleep(idle_s)
        idle = window.close()
        rss = tree_rss(pid)
        serving = db_files(db)
        server.stop()
        problems = server.log_problems()
        stopped = db_files(db)
        checkpoint = checkpoint_truncate(db)
        truncated = db_files(db)
        n = len(deliveries)
        received = sum(len(raw) for raw, _ in deliveries)
        with read_only(db) as ro:
            if system.startswith("switchboard"):
                events = ro.execute("SELECT count(*) FROM events").fetchone()[0]
                pending = ro.execute("SELECT count(*) FROM todos WHERE state = 'pending'").fetchone()[0]
            else:
                events = pending = ro.execute("SELECT count(*) FROM deliveries WHERE state = 'pending'").fetchone()[0]
        acked = sum(1 for a in sent["answers"] if a is not None)
        verified = {"http_errors": sent["errors"][:10], "server_log_problems": problems[:10], "acked": acked,
                    "db_events": events, "db_pending": pending,
                    "ok": not sent["errors"] and not problems and acked == n and events == n and pending == n}
        growth = truncated["db_plus_wal"] - before["db_plus_wal"]
        return {
            "deliveries": n, "bytes_received": received,
            "ingest": {"rate": round(sent["rate"], 1), "p50_ms": round(sent["p50_ms"], 2),
                       "p99_ms": round(sent["p99_ms"], 2), "window": sent["window"]},
            "idle": {"seconds": idle["wall_s"], "server_cores": idle["server_cores"], "window": idle},
            "rss_start": rss_start, "rss": rss,
            "size": {"before": before, "serving": serving, "stopped": stopped, "checkpoint": checkpoint,
                     "after_checkpoint": truncated, "growth_bytes": growth,
                     "serving_ratio": round((serving["db_plus_wal"] - before["db_plus_wal"]) / received, 3),
                     "growth_ratio": round(growth / received, 3)},
            "verified": verified,
        }


# ----------------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------------

def _attempt(label: str, fn, *args) -> dict:
    log(label)
    try:
        out = fn(*args)
    except Exception:  # noqa: BLE001 - recorded; the figure reports FAILED and the run exits 1
        out = {"error": traceback.format_exc(limit=8)}
        log(f"{label}: FAILED\n{out['error']}")
        return out
    if "rate" in out:
        w = out.get("window", {})
        log(f"{label}: {out['rate']:.0f}/s, p99 {out.get('p99_ms', float('nan')):.1f} ms, "
            f"server {w.get('server_cores')} client {w.get('client_cores')} other {w.get('other_cores')} cores"
            f"{'' if out.get('verified', {}).get('ok') else ', CHECKS FAILED'}")
    return out


def summarize(reps: list[dict]) -> dict:
    good = [r for r in reps if "error" not in r and r.get("verified", {}).get("ok")]
    windows = [r["window"] for r in reps if "window" in r]
    summary = {
        "ok": len(good) == len(reps) and bool(reps),
        "reps": len(reps),
        "median": statistics.median(r["rate"] for r in good) if good else None,
        "rates": [r.get("rate") for r in reps],
        "p50_median_ms": statistics.median(r["p50_ms"] for r in good) if good else None,
        "p99_median_ms": statistics.median(r["p99_ms"] for r in good) if good else None,
        "max_other_cores": max((w["other_cores"] for w in windows), default=None),
        "busy": any(w["busy"] for w in windows),
    }
    for key in ("client_cores", "server_cores"):
        vals = [w[key] for w in windows if w.get(key) is not None]
        summary[f"{key}_median"] = statistics.median(vals) if vals else None
    rss = [r["rss_after"]["total_mib"] for r in good if "rss_after" in r]
    if rss:
        summary["rss_after_max_mib"] = max(rss)
        summary["rss_after_processes"] = max(len(r["rss_after"]["processes"]) for r in good if "rss_after" in r)
    return summary


def run(quick: bool = False, **overrides) -> dict:
    sizes = dict(SIZES_QUICK if quick else SIZES_FULL)
    sizes.update({k: v for k, v in overrides.items() if v is not None})
    t0 = time.perf_counter()
    results: dict = {"machine": machine_facts(), "quick": quick, "sizes": sizes, "loadavg_start": os.getloadavg(),
                     "thresholds": {"gate_cores": GATE_CORES, "busy_cores": BUSY_CORES,
                                    "gate_max_s": sizes["gate_max_s"]},
                     "gates": [], "figures": {}}
    tmp_root = tempfile.mkdtemp(prefix="sb-cmp-")
    try:
        log(f"set-up: templates through the CLI, {sizes['cycles']} todos pushed; "
            f"{sizes['footprint']} deliveries signed")
        templates = make_templates(tmp_root, sizes["cycles"])
        deliveries = build_deliveries(max(sizes["footprint"], sizes["deliveries"]))
        ingest_set = deliveries[:sizes["deliveries"]]
        results["body_bytes"] = statistics.fmean(len(raw) for raw, _ in deliveries)
        results["setup_s"] = round(time.perf_counter() - t0, 1)

        # (1) + (2): interleaved rounds.
        ingest = {k: [] for k in ("switchboard_plain", "minimal_one", "switchboard_fleet", "minimal_jq",
                                  "minimal_group")}
        for rep in range(sizes["reps"]):
            results["gates"].append(load_gate(f"ingest rep {rep + 1}", sizes["gate_max_s"]))
            ingest["switchboard_plain"].append(_attempt(
                f"ingest rep {rep + 1}: switchboard, no rules", rep_switchboard_ingest, templates["plain"],
                ingest_set, False))
            ingest["minimal_one"].append(_attempt(
                f"ingest rep {rep + 1}: minimal app, one commit per request", rep_minimal_ingest, ingest_set, False))
            ingest["switchboard_fleet"].append(_attempt(
                f"ingest rep {rep + 1}: switchboard, fleet pack", rep_switchboard_ingest, templates["fleet"],
                ingest_set, True))
            ingest["minimal_jq"].append(_attempt(
                f"ingest rep {rep + 1}: minimal app, one jq child", rep_minimal_ingest, ingest_set, False,
                templates["fleet_program"]))
            ingest["minimal_group"].append(_attempt(
                f"ingest rep {rep + 1}: minimal app, group commit", rep_minimal_ingest, ingest_set, True))
        results["figures"]["ingest"] = {k: {"summary": summarize(v), "reps": v} for k, v in ingest.items()}

        # (3)
        claim = {k: [] for k in ("switchboard", "minimal_one", "minimal_group")}
        for rep in range(sizes["reps"]):
            results["gates"].append(load_gate(f"claim rep {rep + 1}", sizes["gate_max_s"]))
            claim["switchboard"].append(_attempt(f"claim+complete rep {rep + 1}: switchboard", rep_switchboard_claim,
                                                 templates["claim"], sizes["cycles"]))
            claim["minimal_one"].append(_attempt(f"claim+complete rep {rep + 1}: minimal app, one commit",
                                                 rep_minimal_claim, templates["minimal_claim"], sizes["cycles"], False))
            claim["minimal_group"].append(_attempt(f"claim+complete rep {rep + 1}: minimal app, group commit",
                                                   rep_minimal_claim, templates["minimal_claim"], sizes["cycles"],
                                                   True))
        results["figures"]["claim"] = {k: {"summary": summarize(v), "reps": v} for k, v in claim.items()}

        # (4)
        inproc = {k: [] for k in INPROC}
        for rep in range(sizes["reps"]):
            results["gates"].append(load_gate(f"in-process rep {rep + 1}", sizes["gate_max_s"]))
            log(f"in-process rep {rep + 1}: {', '.join(INPROC)} ({sizes['inproc_cycles']} cycles each)")
            for name, out in inproc_round(rep, sizes["inproc_cycles"]).items():
                inproc[name].append(out)
                if "error" in out:
                    log(f"in-process {name}: FAILED\n{out['error']}")
        results["figures"]["inproc"] = {k: {"summary": summarize(v), "reps": v} for k, v in inproc.items()}
        log("in-process cycles/s: " + ", ".join(f"{k} {results['figures']['inproc'][k]['summary']['median']}"
                                                for k in INPROC))

        # (5) (6) (7)
        foot = {}
        for system in ("switchboard", "switchboard_fleet", "minimal"):
            results["gates"].append(load_gate(f"footprint {system}", sizes["gate_max_s"]))
            template = {"switchboard": templates["plain"], "switchboard_fleet": templates["fleet"]}.get(system)
            foot[system] = _attempt(f"footprint {system}: {sizes['footprint']} deliveries, then "
                                    f"{sizes['idle_s']:.0f} s idle", footprint, system, template,
                                    deliveries[:sizes["footprint"]], sizes["idle_s"], sizes["settle_s"])
            if "error" not in foot[system]:
                f_ = foot[system]
                log(f"footprint {system}: ingest {f_['ingest']['rate']:.0f}/s, idle {f_['idle']['server_cores']} "
                    f"cores, RSS {f_['rss']['total_mib']:.1f} MiB, size x{f_['size']['growth_ratio']} of bytes "
                    f"received{'' if f_['verified']['ok'] else ', CHECKS FAILED'}")
        results["figures"]["footprint"] = foot
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    results["loadavg_end"] = os.getloadavg()
    results["elapsed_s"] = round(time.perf_counter() - t0, 1)
    if source_fingerprint() != results["machine"]["source"]:
        results["warning"] = "the package changed on disk during the run"
    results["goals"] = goals(results)
    results["failures"] = failures(results)
    return results


# ----------------------------------------------------------------------------------------------------
# goals and report
# ----------------------------------------------------------------------------------------------------

def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def passes(test: tuple | None, value, ratio) -> bool:
    """A goal as data: ("value" or "ratio", "<", "<=" or ">=", bound)."""
    field, op, bound = test
    x = value if field == "value" else ratio
    return x is not None and {"<": x < bound, "<=": x <= bound, ">=": x >= bound}[op]


def goals(results: dict) -> list[dict]:
    """One entry per table row: value, reference, ratio, goal, met (True/False, 'busy', 'failed', None = info)."""
    fig = results["figures"]
    rows: list[dict] = []

    def add(key, figure, unit, sb_sum, ref_sum, ref_label, goal, test, value=None, reference=None, ratio="auto",
            info=False, note="", load_sensitive=True):
        ok = sb_sum is not None and sb_sum["ok"] and (ref_sum is None or ref_sum["ok"])
        value = sb_sum["median"] if value is None and sb_sum else value
        if reference is None and ref_sum is not None:
            reference = ref_sum["median"]
        if ratio == "auto":
            ratio = _ratio(value, reference)
        # Sizes and RSS do not depend on how busy the machine was; times and rates do.
        busy = load_sensitive and (bool(sb_sum and sb_sum.get("busy")) or bool(ref_sum and ref_sum.get("busy")))
        if not ok:
            met = "failed"
        elif info:
            met = None
        elif busy:
            met = "busy"
        else:
            met = passes(test, value, ratio)
        other = max([s["max_other_cores"] for s in (sb_sum, ref_sum) if s and s.get("max_other_cores") is not None],
                    default=None)
        rows.append({"key": key, "figure": figure, "unit": unit, "value": value, "reference": reference,
                     "reference_label": ref_label, "ratio": ratio, "goal": goal, "test": test, "met": met, "busy": busy,
                     "max_other_cores": other, "note": note})

    ing = fig.get("ingest", {})
    s = {k: v["summary"] for k, v in ing.items()}
    if s:
        add("ingest_plain", "(1) signed deliveries/s, no rules, 16 senders", "/s", s["switchboard_plain"],
            s["minimal_one"], "minimal app, one commit per request", "≥ 0.8×", ("ratio", ">=", 0.8))
        add("ingest_p99", "(1) p99 ack, no rules, 16 senders", "ms", s["switchboard_plain"], s["minimal_one"],
            "minimal app, one commit per request", "< 50 ms", ("value", "<", 50),
            value=s["switchboard_plain"]["p99_median_ms"], reference=s["minimal_one"]["p99_median_ms"])
        add("ingest_plain_vs_group", "(1) info: vs the minimal app with group commit", "/s", s["switchboard_plain"],
            s["minimal_group"], "minimal app, group commit", "info", None, info=True)
        add("ingest_fleet", "(2) signed deliveries/s, fleet pack, 16 senders", "/s", s["switchboard_fleet"],
            s["minimal_jq"], "minimal app, one jq child, same program", "≥ 0.7×", ("ratio", ">=", 0.7))
        add("ingest_fleet_vs_plain", "(2) info: fleet pack vs the plain minimal app", "/s", s["switchboard_fleet"],
            s["minimal_one"], "minimal app, one commit per request", "info", None, info=True)
        add("ingest_fleet_p99", "(2) info: p99 ack, fleet pack", "ms", s["switchboard_fleet"], s["minimal_one"],
            "minimal app, one commit per request", "info", None, info=True,
            value=s["switchboard_fleet"]["p99_median_ms"], reference=s["minimal_one"]["p99_median_ms"])
    cl = {k: v["summary"] for k, v in fig.get("claim", {}).items()}
    if cl:
        add("claim", "(3) claim+complete cycles/s, 8 workers, REST", "/s", cl["switchboard"], cl["minimal_one"],
            "minimal app, one commit per request", "≥ 0.8×", ("ratio", ">=", 0.8))
        add("claim_vs_group", "(3) info: vs the minimal app with group commit", "/s", cl["switchboard"],
            cl["minimal_group"], "minimal app, group commit", "info", None, info=True)
    ip = {k: v["summary"] for k, v in fig.get("inproc", {}).items()}
    if ip:
        add("inproc", "(4) info: in-process claim+ack cycles/s, single thread", "/s", ip["switchboard"],
            ip["litequeue"], "litequeue", "info", None, info=True)
        for peer in ("persist-queue", "huey"):
            add(f"inproc_{peer}", f"(4) info: vs {peer}", "/s", ip["switchboard"], ip[peer], peer, "info", None,
                info=True)
        add("inproc_floor", "(4) info: the writer floor (two one-row commits through the writer thread, no work)",
            "/s", ip["writer floor"], ip["litequeue"], "litequeue", "info", None, info=True)
        add("inproc_vs_floor", "(4) info: claim+ack vs the writer floor", "/s", ip["switchboard"],
            ip["writer floor"], "writer floor", "info", None, info=True)
    foot = fig.get("footprint", {})
    if foot:
        sbf, mf, fleet = foot.get("switchboard", {}), foot.get("minimal", {}), foot.get("switchboard_fleet", {})

        def fsum(f: dict, value) -> dict:
            ok = "error" not in f and f.get("verified", {}).get("ok", False)
            w = f.get("idle", {}).get("window", {}) if ok else {}
            return {"ok": ok, "median": value if ok else None, "busy": bool(w.get("busy")),
                    "max_other_cores": w.get("other_cores")}

        def get(f, *path):
            try:
                for p in path:
                    f = f[p]
                return f
            except (KeyError, TypeError):
                return None

        n = results["sizes"]["footprint"]
        add("idle", f"(5) idle CPU, {n:,} pending todos after {n:,} deliveries", "cores",
            fsum(sbf, get(sbf, "idle", "server_cores")), fsum(mf, get(mf, "idle", "server_cores")),
            "minimal app idle", "< 0.5% of a core", ("value", "<", 0.005))
        add("db_size", f"(6) database growth after {n:,} deliveries (checkpointed), × bytes of bodies received", "x",
            fsum(sbf, get(sbf, "size", "growth_ratio")), fsum(mf, get(mf, "size", "growth_ratio")),
            "minimal app", "≤ 1.3×", ("value", "<=", 1.3), load_sensitive=False)
        add("db_size_serving", "(6) info: db + -wal while serving, × bytes received", "x",
            fsum(sbf, get(sbf, "size", "serving_ratio")), fsum(mf, get(mf, "size", "serving_ratio")),
            "minimal app", "info", None, info=True, load_sensitive=False)
        add("rss", f"(7) RSS, server + children, after {n:,} deliveries", "MiB",
            fsum(sbf, get(sbf, "rss", "total_mib")), fsum(mf, get(mf, "rss", "total_mib")),
            "minimal app", "< 80 MiB", ("value", "<", 80), load_sensitive=False)
        if fleet:
            add("rss_fleet_footprint", f"(7) RSS, server + evaluator children, after {n:,} fleet-pack deliveries",
                "MiB", fsum(fleet, get(fleet, "rss", "total_mib")), fsum(mf, get(mf, "rss", "total_mib")),
                "minimal app", "< 80 MiB", ("value", "<", 80), load_sensitive=False)
    if s and s["switchboard_fleet"].get("rss_after_max_mib") is not None:
        fl, mo = s["switchboard_fleet"], s["minimal_one"]
        children = fl["rss_after_processes"] - 1
        add("rss_fleet", f"(7) info: RSS after a fleet-pack run ({results['sizes']['deliveries']:,} deliveries), "
            f"server + {children} evaluator child{'' if children == 1 else 'ren'}", "MiB", fl, mo, "minimal app",
            "info", None,
            value=fl["rss_after_max_mib"], reference=mo.get("rss_after_max_mib"), info=True, load_sensitive=False)
    return rows


def failures(results: dict) -> list[str]:
    bad = []
    for name, fig in results["figures"].items():
        if name == "footprint":
            for system, out in fig.items():
                if "error" in out:
                    bad.append(f"footprint {system}: {out['error'].strip().splitlines()[-1]}")
                elif not out["verified"]["ok"]:
                    bad.append(f"footprint {system}: checks failed: {json.dumps(out['verified'])[:500]}")
            continue
        for system, data in fig.items():
            for i, rep in enumerate(data["reps"]):
                if "error" in rep:
                    bad.append(f"{name} {system} rep {i + 1}: {rep['error'].strip().splitlines()[-1]}")
                elif not rep.get("verified", {}).get("ok"):
                    bad.append(f"{name} {system} rep {i + 1}: checks failed: {json.dumps(rep['verified'])[:500]}")
    return bad


def _num(x, unit: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "?"
    if unit == "/s":
        return f"{x:,.0f}/s"
    if unit == "ms":
        return f"{x:.1f} ms"
    if unit == "cores":
        return f"{x * 100:.2f}% of a core"
    if unit == "x":
        return f"{x:.2f}× bytes"
    if unit == "MiB":
        return f"{x:.1f} MiB"
    return f"{x}"


def _met(row: dict) -> str:
    if row["met"] is None:
        return "info"
    if row["met"] == "failed":
        return "FAILED (checks; see results-compare.json)"
    if row["met"] == "busy":
        return f"busy (other processes {row['max_other_cores']:.2f} cores): not a result"
    return "**yes**" if row["met"] else "**no**"


def table(results: dict) -> list[str]:
    lines = ["| figure | Switchboard | reference point | ratio | goal | met |", "|---|---:|---|---:|---|---|"]
    for row in results["goals"]:
        value = "—" if row["met"] == "failed" else _num(row["value"], row["unit"])
        if row["busy"] and row["met"] != "failed":
            value += " (busy)"
        ref = f"{_num(row['reference'], row['unit'])} ({row['reference_label']})"
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}×"
        lines.append(f"| {row['figure']} | {value} | {ref} | {ratio} | {row['goal']} | {_met(row)} |")
    return lines


def _cores(x) -> str:
    return "?" if x is None else f"{x:.2f}"


def _conditions(data: dict) -> str:
    """The load average and other processes' CPU over a figure's measured windows."""
    windows = [rep["window"] for d in data.values() for rep in d["reps"] if "window" in rep]
    if not windows:
        return ""
    loads = [w["loadavg1"] for w in windows]
    return (f" Load average (1 min) {min(loads):.2f}–{max(loads):.2f}; other processes at most "
            f"{max(w['other_cores'] for w in windows):.2f} cores.")


def client_bound(summary: dict) -> bool:
    """The one-process client, not the server, set the pace: it used more CPU than the server and at least 0.9
    cores (a Python process's threads get about one core between them)."""
    c, s = summary.get("client_cores_median"), summary.get("server_cores_median")
    return c is not None and s is not None and c > s and c >= 0.9


def details(results: dict) -> list[str]:
    fig, sz = results["figures"], results["sizes"]
    out = []
    ing = fig.get("ingest")
    if ing:
        parts = []
        for key, label in (("switchboard_plain", "Switchboard no rules"), ("switchboard_fleet", "Switchboard fleet"),
                           ("minimal_one", "minimal one-commit"), ("minimal_jq", "minimal + one jq child"),
                           ("minimal_group", "minimal group commit")):
            s = ing[key]["summary"]
            parts.append(f"{label} {', '.join('?' if r is None else f'{r:,.0f}' for r in s['rates'])}/s "
                         f"(p50 {_num(s['p50_median_ms'], 'ms')}; CPU cores server {_cores(s['server_cores_median'])},"
                         f" client {_cores(s['client_cores_median'])})")
        bound = [label for key, label in (("minimal_one", "one-commit"), ("minimal_group", "group-commit"))
                 if client_bound(ing[key]["summary"])]
        out.append(f"- Ingest, {sz['deliveries']:,} deliveries of {results['body_bytes'] / 1000:.1f} KB per "
                   "repetition: "
                   + "; ".join(parts) + "." + _conditions(ing)
                   + (f" The client, not the minimal app ({' and '.join(bound)}), set that pace: the ceiling is "
                      "higher than measured, so the ratios flatter Switchboard." if bound else ""))
    cl = fig.get("claim")
    if cl:
        parts = []
        for key, label in (("switchboard", "Switchboard"), ("minimal_one", "minimal one-commit"),
                           ("minimal_group", "minimal group commit")):
            s = cl[key]["summary"]
            parts.append(f"{label} {', '.join('?' if r is None else f'{r:,.0f}' for r in s['rates'])}/s "
                         f"(cycle p50/p99 {_num(s['p50_median_ms'], 'ms')}/{_num(s['p99_median_ms'], 'ms')}; CPU "
                         f"cores server {_cores(s['server_cores_median'])}, client {_cores(s['client_cores_median'])})")
        bound = [label for key, label in (("minimal_one", "one-commit"), ("minimal_group", "group-commit"))
                 if client_bound(cl[key]["summary"])]
        out.append(f"- claim+complete, {sz['cycles']:,} todos per repetition, each done exactly once: "
                   + "; ".join(parts) + "." + _conditions(cl)
                   + (f" The client, not the minimal app ({' and '.join(bound)}), set that pace: the ceiling is "
                      "higher than measured, so the ratios flatter Switchboard." if bound else ""))
    ip = fig.get("inproc")
    if ip:
        out.append(f"- In-process, {sz['inproc_cycles']:,} cycles per repetition, two commits per cycle, FULL: "
                   + "; ".join(f"{k} {', '.join('?' if r is None else f'{r:,.0f}' for r in v['summary']['rates'])}"
                               f"/s (p50 {_num(v['summary']['p50_median_ms'], 'ms')})" for k, v in ip.items()) + "."
                   + _conditions(ip))
    foot = fig.get("footprint")
    if foot:
        for system, f in foot.items():
            if "error" in f:
                out.append(f"- Footprint, {system}: FAILED.")
                continue
            size = f["size"]
            procs = ", ".join(f"{p['name']} {p['rss_kib'] / 1024:.1f}" for p in f["rss"]["processes"])
            procs = f"{len(f['rss']['processes'])} process{'es' if len(f['rss']['processes']) > 1 else ''}: {procs}"
            out.append(
                f"- Footprint, {system}: {f['deliveries']:,} deliveries ({f['bytes_received'] / 1e6:.1f} MB of bodies) "
                f"at {f['ingest']['rate']:,.0f}/s (p99 {f['ingest']['p99_ms']:.1f} ms); idle "
                f"{f['idle']['server_cores'] * 100:.2f}% of a core over {f['idle']['seconds']:.0f} s; RSS "
                f"{f['rss']['total_mib']:.1f} MiB ({procs}; {f['rss_start']['total_mib']:.1f} MiB before the "
                f"deliveries); size: db+wal {size['serving']['db_plus_wal'] / 1e6:.1f} MB serving, "
                f"{size['stopped']['db_plus_wal'] / 1e6:.1f} MB stopped, "
                f"{size['after_checkpoint']['db_plus_wal'] / 1e6:.1f} MB after the checkpoint "
                f"({size['before']['db_plus_wal'] / 1e3:.0f} KB before). Load average (1 min) "
                f"{f['idle']['window']['loadavg1']:.2f}; other processes {f['ingest']['window']['other_cores']:.2f} "
                f"cores while sending, {f['idle']['window']['other_cores']:.2f} idle.")
    return out


HOW = (
    "**How measured.** `python tests/bench/bench_compare.py` on the machine above; client and servers share its "
    "cores over loopback, and the client is one Python process (16 sender threads or 8 worker threads with one "
    "keep-alive httpx client each), so its CPU, reported above, is part of every HTTP figure. Servers are child "
    "processes on fresh copies of a database set up through the CLI (`--json`), stopped by their pid; all at "
    "synchronous=FULL. The reference, tests/bench/minimal_app.py, is Starlette + uvicorn (uvloop, httptools) "
    "verifying the HMAC, parsing the JSON and inserting one row per delivery from one writer thread on one WAL "
    "connection; one commit per request unless noted as group commit; with one jq child, each envelope also "
    "goes through one sandboxed child running the fleet program before its row is written. Both systems get "
    "byte-identical signed "
    "`issues.labeled` deliveries (one fixed secret). Throughput: median of the repetitions, systems interleaved; "
    "ratio = Switchboard's median / the reference's. In-process: bench_store part B's loops plus huey (dequeue, "
    "then execute storing the result), each on a fresh file, order rotated. Idle: server + children CPU from "
    "/proc over the idle window after the deliveries (and a settle pause). Database growth: db + -wal after "
    "`PRAGMA wal_checkpoint(TRUNCATE)` from a separate connection once the server stopped, minus the size "
    "before the deliveries, over the bytes of bodies received. RSS: VmRSS summed over the server and all its "
    "descendants. Other processes' CPU is the machine's user + system time from /proc/stat less this run's "
    "process tree and the kernel threads (which flush its fsyncs); interrupts are left out. Load gate: each round "
    f"waits for other processes to use < {GATE_CORES} cores over {GATE_WINDOW_S} s (up to {GATE_MAX_S:.0f} s, 10 s with "
    f"--quick); a figure with a measured window where other processes used > {BUSY_CORES} cores is marked busy, "
    "not reported as met or missed (sizes and RSS, which do not depend on load, never are).")


def markdown(results: dict, header: bool = True) -> str:
    """The table, details and method. `header=False` leaves out the date and machine lines (run_all.py writes its
    own) but keeps this run's load figures."""
    m = results["machine"]
    src = m["source"]
    gates = results.get("gates", [])
    windows = [w for w in _all_windows(results)]
    conditions = (
        f"Load average (1/5/15 min) {_load(results['loadavg_start'])} at the start of `bench_compare.py`, "
        f"{_load(results['loadavg_end'])} at its end (its own servers and client count in it). Other processes "
        f"used at most {max((w['other_cores'] for w in windows), default=0):.2f} cores during a measured window (mean "
        f"{statistics.fmean([w['other_cores'] for w in windows]) if windows else 0:.2f}); the load gate waited "
        f"{sum(g['waited_s'] for g in gates):.0f} s in all"
        f"{'' if all(g['quiet'] for g in gates) else ' and gave up waiting at least once'}; "
        f"`bench_compare.py` took {results['elapsed_s']:.0f} s.")
    if not header:
        lines = [conditions, "", *table(results), "", *details(results), "", HOW]
        return "\n".join(lines + report_notes({"failures": results.get("failures")}, "bench_compare"))
    lines = [
        f"Measured {m['date'].replace('+00:00', '').replace('T', ' ')} UTC"
        f"{' (QUICK RUN: small sizes, one repetition, not representative)' if results['quick'] else ''}, "
        f"switchboard {m['switchboard']} at `{src['git_head']}`{' + uncommitted changes' if src['dirty'] else ''} "
        f"(source hash {src['sha256_package']}).",
        "",
        f"Machine: {m['nproc']} CPUs ({m['cpu_model'] or 'model unknown'}), {m.get('memory', '?')} memory, "
        f"Python {m['python']}, SQLite {m['sqlite']}, {m.get('os', m['platform'])}. {conditions}",
        "",
        *table(results),
        "",
        *details(results),
        "",
        HOW,
    ]
    return "\n".join(lines + report_notes(results))


def _load(triple) -> str:
    return "/".join(f"{x:.2f}" for x in triple)


def _all_windows(results: dict):
    for name, fig in results["figures"].items():
        if name == "footprint":
            for f in fig.values():
                if "error" not in f:
                    yield f["ingest"]["window"]
                    yield f["idle"]["window"]
            continue
        for data in fig.values():
            for rep in data["reps"]:
                if "window" in rep:
                    yield rep["window"]


def spread(runs: list[dict]) -> dict:
    """Several whole runs judged together: per goal, every run's figure and the median of them, met only when
    that median meets the goal (and every run's checks passed)."""
    out = []
    for first in runs[0]["goals"]:
        rows = [next((r for r in run["goals"] if r["key"] == first["key"]), None) for run in runs]
        rows = [r for r in rows if r is not None]
        field = "value" if first["test"] is None or first["test"][0] == "value" else "ratio"
        figures = [r[field] for r in rows if r["met"] not in ("failed", "busy") and r[field] is not None]
        median = statistics.median(figures) if figures else None
        if any(r["met"] == "failed" for r in rows):
            met = "failed"
        elif first["test"] is None:
            met = None
        elif len(figures) < len(rows):
            met = "busy"
        else:
            met = passes(first["test"], median, median)
        ratios = [r["ratio"] for r in rows if r["met"] not in ("failed", "busy") and r["ratio"] is not None]
        out.append({"key": first["key"], "figure": first["figure"], "unit": first["unit"], "field": field,
                    "runs": [r[field] if r["met"] not in ("failed", "busy") else r["met"] for r in rows],
                    "median": median, "median_ratio": statistics.median(ratios) if ratios else None,
                    "goal": first["goal"], "met": met})
    return {"runs": len(runs), "goals": out}


def spread_table(combined: dict) -> list[str]:
    lines = [f"| figure | {combined['runs']} runs | median | goal | met |", "|---|---|---:|---|---|"]
    for row in combined["goals"]:
        def show(x):
            if isinstance(x, str) or x is None:
                return str(x)
            return f"{x:.2f}×" if row["field"] == "ratio" else _num(x, row["unit"])
        met = {None: "info", "failed": "FAILED", "busy": "busy: not a result", True: "**yes**", False: "**no**"}
        median = show(row["median"])
        if row["field"] == "value" and row["median_ratio"] is not None and row["met"] is None:
            median += f" ({row['median_ratio']:.2f}×)"  # an information row: its ratio to the reference too
        lines.append(f"| {row['figure']} | {', '.join(show(x) for x in row['runs'])} | {median} | "
                     f"{row['goal']} | {met[row['met']]} |")
    return lines


def print_goals(results: dict) -> None:
    for row in results["goals"]:
        if row["met"] is None:
            continue
        verdict = {True: "PASS", False: "FAIL", "busy": "BUSY", "failed": "FAILED"}[row["met"]]
        ratio = "" if row["ratio"] is None else f" ({row['ratio']:.2f}x {row['reference_label']})"
        print(f"{verdict:6} {row['figure']}: {_num(row['value'], row['unit'])}{ratio}; goal {row['goal']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and one repetition (about a minute)")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--deliveries", type=int, help="deliveries per ingest repetition")
    parser.add_argument("--cycles", type=int, help="claim+complete todos per repetition")
    parser.add_argument("--inproc-cycles", type=int)
    parser.add_argument("--footprint", type=int, help="deliveries before the idle/RSS/size measurements")
    parser.add_argument("--idle-seconds", type=float, dest="idle_s")
    parser.add_argument("--runs", type=int, default=1,
                        help="whole runs; with more than one, a goal is met when the median of the runs meets it")
    parser.add_argument("--out", default=str(RESULTS_PATH))
    args = parser.parse_args(argv)
    runs = []
    for number in range(args.runs):
        if args.runs > 1:
            log(f"run {number + 1} of {args.runs}")
        results = run(args.quick, reps=args.reps, deliveries=args.deliveries, cycles=args.cycles,
                      inproc_cycles=args.inproc_cycles, footprint=args.footprint, idle_s=args.idle_s)
        runs.append(results)
        print(markdown(results))
        print()
        print_goals(results)
    combined = spread(runs) if args.runs > 1 else None
    saved = runs[0] if combined is None else {"runs": runs, "spread": combined}
    Path(args.out).write_text(json.dumps(saved, indent=2) + "\n")
    if combined:
        print("\n" + "\n".join(spread_table(combined)))
    print(f"\n(wrote {args.out}; {sum(r['elapsed_s'] for r in runs):.0f} s)", file=sys.stderr)
    failures = [problem for r in runs for problem in r["failures"]]
    for problem in failures:
        print(f"FAILURE: {problem}", file=sys.stderr)
    for r in runs:
        if r.get("warning"):
            print(f"WARNING: {r['warning']}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
