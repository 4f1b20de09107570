"""Store benchmarks (SPEC section 13): claim+complete throughput and latency.

Run by hand (never collected by pytest):

    python tests/bench/bench_store.py [--quick]

A. claim+complete cycles per second over REST with 8 competing worker threads against a real
   `python switchboard.py serve` child process on a free 127.0.0.1 port, at `--synchronous full`
   and `--synchronous normal`, with p50/p99 latency of one claim+complete cycle, and a check that
   every todo ended `done` exactly once.
B. The same claim+ack cycle in-process, single thread, through the store (`Database.write_sync`)
   versus litequeue and persist-queue at the same `PRAGMA synchronous`, as a ratio.

Prints a Markdown table and writes JSON to tests/bench/results-store.json.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import datetime as dt
import hashlib
import io
import json
import math
import os
import platform
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from switchboard.cli.parser import main as switchboard_main
from switchboard.configuration import VERSION
from switchboard.database import Database
from switchboard.models import ClaimNext, Complete, EndpointCreate, TodoPush
from switchboard.store.human_actions import push_todo
from switchboard.store.principals import add_human, authenticate, vend_endpoint
from switchboard.store.transitions import claim_next, complete

RESULTS_PATH = Path(__file__).resolve().with_name("results-store.json")
QUEUE = "bench"


# ----------------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------------

def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile; `values` need not be sorted."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def run_timed(n_threads: int, body: Callable[[int, Callable[[], None]], None], name: str,
              measure: Callable[[], Callable[[], Any]] | None = None) -> tuple[float, Any]:
    """Run `body(i, ready)` on n threads, each calling `ready()` once it is set up (its connection open); the
    clock starts when all have. Returns the wall time until the last one finished and what `measure` (called as
    the clock starts, its answer called as the threads are done) said."""
    start = threading.Barrier(n_threads + 1)
    finished_at = [0.0] * n_threads

    def run(i: int) -> None:
        body(i, start.wait)
        finished_at[i] = time.perf_counter()

    threads = [threading.Thread(target=run, args=(i,), name=f"{name}-{i}") for i in range(n_threads)]
    for t in threads:
        t.start()
    stop = measure() if measure else None
    start.wait()
    t_start = time.perf_counter()
    for t in threads:
        t.join()
    return max(finished_at) - t_start, stop() if stop else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(db_path: str, *args: str) -> dict:
    """Run the real CLI (`switchboard.main`, in this process: an interpreter start per call cost 1.5 s on a slow
    machine, half a minute of set-up) with --json and parse its one JSON object; fail loudly on a non-zero exit."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = switchboard_main([*args, "--db", db_path, "--json"])
    if code != 0:
        raise RuntimeError(f"CLI {' '.join(args)} exited {code}: {out.getvalue()} {err.getvalue()}")
    return json.loads(out.getvalue())


def machine_facts() -> dict:
    """The machine a figure was taken on, and which source was measured."""
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "switchboard": VERSION,
        "source": source_fingerprint(),
        "memory": _memory(),
        "os": _os_name(),
    }


def _memory() -> str:
    try:
        kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return "?"
    return f"{kib / (1 << 20):.1f} GiB"


def _os_name() -> str:
    os_name = platform.system()
    try:
        release = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
        os_name = release.get("PRETTY_NAME", os_name).strip('"')
    except OSError:
        pass
    return f"{os_name}, kernel {platform.release()}"


def source_fingerprint() -> dict:
    """Which code was measured: git HEAD plus a hash of the package's files as they are (they may be dirty)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "switchboard.py", "switchboard"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    files = sorted(p for p in (ROOT / "switchboard").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()
    return {"git_head": head, "dirty": bool(dirty), "sha256_package": digest[:16]}


@contextlib.contextmanager
def read_only(db_path: str) -> Iterator[sqlite3.Connection]:
    """The database file opened read-only, to check what a run left in it."""
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        yield conn
    finally:
        conn.close()


def report_notes(results: dict, whose: str = "this run") -> list[str]:
    """The lines a Markdown report ends with: a warning, and the failures (a `|` would end a table cell)."""
    lines = ["", f"Warning: {results['warning']}."] if results.get("warning") else []
    if results.get("failures"):
        lines += ["", f"Failures in {whose}: " + "; ".join(x.replace("|", "/") for x in results["failures"])]
    return lines


def stop_process(proc: subprocess.Popen, grace: float = 20.0) -> int:
    """SIGTERM to a child of this benchmark (by its pid), SIGKILL if it is still there after `grace` s; its exit
    status."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
    return proc.wait()


class ChildServer:
    """A server as a child process on a free 127.0.0.1 port, logging to a file beside its database, answering
    `/healthz` before this returns, and stopped by its own pid. `command` says what to run."""

    def __init__(self, db_path: str, *args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(db_path).with_suffix(".log")
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, *self.command(db_path, *args)],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=str(Path(db_path).parent))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{type(self).__name__} did not start; log:\n"
                           f"{self.log_path.read_text(errors='replace')[-2000:]}")

    def __enter__(self) -> ChildServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def command(self, db_path: str, *args) -> list[str]:
        raise NotImplementedError

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self.log.closed:
            self.log.close()



class Server(ChildServer):
    """`python switchboard.py serve` at `--synchronous synchronous`, with extra serve arguments."""

    def command(self, db_path: str, synchronous: str, *extra_args: str) -> list[str]:
        return [str(ROOT / "switchboard.py"), "serve", "--db", db_path, "--port", str(self.port),
                "--synchronous", synchronous, *extra_args]

    def cpu_seconds(self) -> float | None:
        """user+system CPU the server process has used so far (Linux /proc), to show who is the bottleneck."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def log_tracebacks(self, limit: int = 3) -> list[str]:
        """Each logged traceback with the line before it and up to 40 lines of it, for the report."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        found = []
        for i, line in enumerate(lines):
            if line.startswith("Traceback"):
                block = lines[max(0, i - 1):i + 40]
                end = next((j for j in range(2, len(block)) if block[j] and not block[j].startswith(" ")),
                           len(block) - 1)
                found.append("\n".join(block[:end + 1]))
                if len(found) >= limit:
                    break
        return found

    def log_problems(self) -> list[str]:
        text = self.log_path.read_text(errors="replace")
        return [line for line in text.splitlines()
                if "internal error" in line or "Traceback" in line or " ERROR " in line]


# ----------------------------------------------------------------------------------------------------
# A. REST, 8 competing workers
# ----------------------------------------------------------------------------------------------------

def bench_rest(synchronous: str, n_todos: int, n_workers: int, push_threads: int = 8) -> dict:
    tmp = tempfile.mkdtemp(prefix="sb-bench-rest-")
    db_path = os.path.join(tmp, "switchboard.db")
    server = None
    try:
        # Set-up through the CLI (before the server starts, so nothing else holds the file).
        cli(db_path, "init")
        human = cli(db_path, "human", "add", "bench")
        endpoint = cli(db_path, "endpoint", "vend", "--human", "bench", "--name", "w", "--queues", QUEUE)
        server = Server(db_path, synchronous)
        human_auth = {"Authorization": f"Bearer {human['token']}"}
        ep_auth = {"Authorization": f"Bearer {endpoint['token']}"}

        # Push N todos (not timed as part of the cycle benchmark; the push rate is reported for interest).
        pushed: list[str] = []
        push_errors: list[str] = []
        push_lock = threading.Lock()

        def pusher(indexes: range) -> None:
            with httpx.Client(base_url=server.url, headers=human_auth, timeout=30) as client:
                for i in indexes:
                    r = client.post(f"/api/v1/endpoints/{endpoint['id']}/todos", json={"title": f"t{i}", "queue": QUEUE})
                    with push_lock:
                        if r.status_code == 201:
                            pushed.append(r.json()["id"])
                        else:
                            push_errors.append(f"push {i}: {r.status_code} {r.text[:200]}")

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(push_threads) as pool:
            list(pool.map(pusher, [range(k, n_todos, push_threads) for k in range(push_threads)]))
        push_seconds = time.perf_counter() - t0
        if push_errors or len(pushed) != n_todos:
            raise RuntimeError(f"push failed ({len(pushed)}/{n_todos}): {push_errors[:5]}")

        # Workers: claim_next then complete, each on its own keep-alive client, until the queue is empty.
        start = threading.Barrier(n_workers + 1)
        completed: list[list[str]] = [[] for _ in range(n_workers)]
        cycle_ms: list[list[float]] = [[] for _ in range(n_workers)]
        claim_ms: list[list[float]] = [[] for _ in range(n_workers)]
        complete_ms: list[list[float]] = [[] for _ in range(n_workers)]
        errors: list[str] = []
        finished_at: list[float] = [0.0] * n_workers

        def worker(w: int) -> None:
            with httpx.Client(base_url=server.url, headers=ep_auth, timeout=30) as client:
                client.get("/healthz")  # open the keep-alive connection before the clock starts
                start.wait()
                strikes = 0
                while strikes < 5:
                    c0 = time.perf_counter()
                    r = client.post("/api/v1/todos/claim", json={"queue": QUEUE})
                    c1 = time.perf_counter()
                    if r.status_code != 200:
                        errors.append(f"worker {w} claim: {r.status_code} {r.text[:300]}")
                        strikes += 1
                        continue
                    body = r.json()
                    if body.get("empty"):
                        break
                    todo_id = body["todo"]["id"]
                    r = client.post(f"/api/v1/todos/{todo_id}/complete", json={"lease_token": body["lease_token"]})
                    c2 = time.perf_counter()
                    if r.status_code != 200 or r.json().get("state") != "done":
                        errors.append(f"worker {w} complete {todo_id}: {r.status_code} {r.text[:300]}")
                        strikes += 1
                        continue
                    completed[w].append(todo_id)
                    claim_ms[w].append((c1 - c0) * 1e3)
                    complete_ms[w].append((c2 - c1) * 1e3)
                    cycle_ms[w].append((c2 - c0) * 1e3)
            finished_at[w] = time.perf_counter()

        threads = [threading.Thread(target=worker, args=(w,), name=f"bench-worker-{w}") for w in range(n_workers)]
        for t in threads:
            t.start()
        server_cpu0, client_cpu0 = server.cpu_seconds(), time.process_time()
        start.wait()
        t_start = time.perf_counter()
        for t in threads:
            t.join()
        wall = max(finished_at) - t_start
        server_cpu1, client_cpu1 = server.cpu_seconds(), time.process_time()
        # CPU used per wall second during the worker phase (1.0 = one core busy); the 8 client threads
        # share this machine's cores with the server.
        cpu = {"server_cores": None if server_cpu0 is None or server_cpu1 is None
               else (server_cpu1 - server_cpu0) / wall,
               "client_cores": (client_cpu1 - client_cpu0) / wall}

        # Checks through REST while the server is still up. The list endpoint has no cursor (limit <= 200),
        # so REST can only prove "nothing pending or claimed" and sample the done list; the exact-once
        # count is done on the file itself below.
        rest_checks = {}
        with httpx.Client(base_url=server.url, headers=human_auth, timeout=30) as client:
            for state in ("pending", "claimed"):
                r = client.get("/api/v1/todos", params={"state": state, "limit": 200})
                rest_checks[state] = len(r.json()["todos"]) if r.status_code == 200 else f"HTTP {r.status_code}"
            r = client.get("/api/v1/todos", params={"state": "done", "limit": 200})
            rest_checks["done_page"] = len(r.json()["todos"]) if r.status_code == 200 else f"HTTP {r.status_code}"
        server.stop()
        log_problems = server.log_problems()
        tracebacks = server.log_tracebacks()
        server = None

        # Exactly-once: from the clients' side and from the database file (opened read-only).
        all_completed = [tid for per in completed for tid in per]
        dupes = [tid for tid, n in collections.Counter(all_completed).items() if n > 1]
        missing = sorted(set(pushed) - set(all_completed))
        with read_only(db_path) as ro:
            states = dict(ro.execute("SELECT state, count(*) FROM todos GROUP BY state").fetchall())
            multi_attempts = ro.execute("SELECT count(*) FROM (SELECT todo_id FROM attempts GROUP BY todo_id"
                                        " HAVING count(*) <> 1)").fetchone()[0]
            completed_attempts = ro.execute("SELECT count(*) FROM attempts WHERE outcome = 'completed'").fetchone()[0]
            done_transitions = ro.execute("SELECT count(*) FROM (SELECT todo_id FROM todo_history"
                                          " WHERE to_state = 'done' GROUP BY todo_id HAVING count(*) <> 1)").fetchone()[0]
        verified = {
            "client_completed": len(all_completed),
            "client_duplicates": dupes[:10],
            "client_missing": missing[:10],
            "db_states": states,
            "db_todos_with_attempts_not_1": multi_attempts,
            "db_completed_attempts": completed_attempts,
            "db_todos_with_done_transitions_not_1": done_transitions,
            "rest": rest_checks,
            "http_errors": errors[:20],
            "server_log_problems": log_problems[:20],
            "server_tracebacks": tracebacks,
        }
        ok = (not dupes and not missing and not errors and not log_problems
              and states == {"done": n_todos} and multi_attempts == 0 and completed_attempts == n_todos
              and done_transitions == 0 and rest_checks["pending"] == 0 and rest_checks["claimed"] == 0
              and rest_checks["done_page"] == min(200, n_todos))
        verified["ok"] = ok

        cycles = [x for per in cycle_ms for x in per]
        claims = [x for per in claim_ms for x in per]
        completes = [x for per in complete_ms for x in per]
        return {
            "synchronous": synchronous.upper(),
            "todos": n_todos,
            "workers": n_workers,
            "push_per_s": n_todos / push_seconds,
            "wall_s": wall,
            "cycles_per_s": len(cycles) / wall,
            "cycle_p50_ms": percentile(cycles, 50),
            "cycle_p99_ms": percentile(cycles, 99),
            "claim_p50_ms": percentile(claims, 50),
            "claim_p99_ms": percentile(claims, 99),
            "complete_p50_ms": percentile(completes, 50),
            "complete_p99_ms": percentile(completes, 99),
            "per_worker_cycles": [len(per) for per in completed],
            "cpu_during_cycles": cpu,
            "verified": verified,
        }
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------
# B. In-process, single thread: Switchboard store vs litequeue vs persist-queue
# ----------------------------------------------------------------------------------------------------
# Database group-commits: its one writer thread drains whatever bodies are queued (up to WRITER_BATCH)
# into one BEGIN IMMEDIATE ... COMMIT. A single-threaded caller of write_sync always waits for its own
# COMMIT before submitting the next body, so every batch holds exactly one body and every claim and every
# complete pays its own commit (and, at FULL, its own WAL fsync) -- no batching advantage. That is the
# honest comparison with the peers, which also commit once per pop/get and once per done/ack: two
# commits per cycle for all three systems. What Switchboard pays on top is the hand-off to the writer
# thread, Principal checks, the lease token and its hash, the attempts row and the history row.

SYNC_CODE = {"FULL": 2, "NORMAL": 1}


def timed_loop(n: int, cycle) -> tuple[float, list[float]]:
    lat: list[float] = []
    t0 = time.perf_counter()
    for _ in range(n):
        c0 = time.perf_counter()
        cycle()
        lat.append((time.perf_counter() - c0) * 1e3)
    return time.perf_counter() - t0, lat


def inproc_switchboard(tmp: str, synchronous: str, n: int) -> dict:
    db = Database(os.path.join(tmp, "sb.db"), synchronous=synchronous)
    try:
        pragma = db.write_sync(lambda txn: txn.one("PRAGMA synchronous")[0])  # the writer's connection
        human = db.write_sync(add_human, "bench")
        human_p = db.read_sync(authenticate, human["token"])
        endpoint = db.write_sync(vend_endpoint, human["id"], EndpointCreate(name="w", queues=[QUEUE]))
        ep_p = db.read_sync(authenticate, endpoint["token"])
        # Pre-fill from several threads so the pushes do group-commit (not measured).
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: db.write_sync(push_todo, human_p, endpoint["id"],
                                                  TodoPush(title=f"t{i}", queue=QUEUE)), range(n)))
        seen: set[str] = set()

        def cycle() -> None:
            got = db.write_sync(claim_next, ep_p, ClaimNext(queue=QUEUE))
            todo_id = got["todo"]["id"]
            if todo_id in seen:
                raise AssertionError(f"switchboard handed out {todo_id} twice")
            seen.add(todo_id)
            done = db.write_sync(complete, ep_p, todo_id, Complete(lease_token=got["lease_token"]))
            if done["state"] != "done":
                raise AssertionError(f"complete left {todo_id} in {done['state']}")

        seconds, lat = timed_loop(n, cycle)
        assert db.write_sync(claim_next, ep_p, ClaimNext(queue=QUEUE)) == {"empty": True}
        done_count = db.read_sync(lambda txn: txn.one("SELECT count(*) FROM todos WHERE state = 'done'")[0])
        assert done_count == n, f"switchboard: {done_count} done of {n}"
        return {"seconds": seconds, "lat": lat, "pragma": pragma}
    finally:
        db.close()


def inproc_litequeue(tmp: str, synchronous: str, n: int) -> dict:
    from litequeue import LiteQueue, MessageStatus

    q = LiteQueue(os.path.join(tmp, "lq.db"))
    try:
        # litequeue hard-codes `PRAGMA synchronous = NORMAL` in __init__ and has no option for it; the pragma
        # is per connection, so set it on its (only) connection afterwards.
        q.conn.execute(f"PRAGMA synchronous={synchronous}")
        pragma = q.conn.execute("PRAGMA synchronous").fetchone()[0]
        for i in range(n):
            q.put(f"t{i}")

        def cycle() -> None:
            message = q.pop()
            q.done(message.message_id)

        seconds, lat = timed_loop(n, cycle)
        assert q.pop() is None
        done_count = q.conn.execute(f"SELECT count(*) FROM {q.table} WHERE status = ?",
                                    (MessageStatus.DONE.value,)).fetchone()[0]
        assert done_count == n, f"litequeue: {done_count} done of {n}"
        return {"seconds": seconds, "lat": lat, "pragma": pragma}
    finally:
        q.close()


def inproc_persistqueue(tmp: str, synchronous: str, n: int) -> dict:
    import persistqueue

    q = persistqueue.SQLiteAckQueue(os.path.join(tmp, "pq"), multithreading=True)
    try:
        # persist-queue only runs `PRAGMA journal_mode=WAL` on its connections and exposes no synchronous
        # option (so it runs at SQLite's compiled default, FULL). We set the pragma on both of its private
        # connections (_getter selects, _putter writes) to match.
        conns = {id(c): c for c in (q._getter, q._putter)}.values()
        for conn in conns:
            conn.execute(f"PRAGMA synchronous={synchronous}")
        pragma = sorted({c.execute("PRAGMA synchronous").fetchone()[0] for c in conns})
        pragma = pragma[0] if len(pragma) == 1 else pragma
        for i in range(n):
            q.put(f"t{i}")

        def cycle() -> None:
            item = q.get(block=False, raw=True)
            q.ack(id=item["pqid"])

        seconds, lat = timed_loop(n, cycle)
        try:
            q.get(block=False)
            raise AssertionError("persist-queue: items left after the loop")
        except persistqueue.Empty:
            pass
        assert q.acked_count() == n, f"persist-queue: {q.acked_count()} acked of {n}"
        return {"seconds": seconds, "lat": lat, "pragma": pragma}
    finally:
        q.close()


INPROC = {"switchboard": inproc_switchboard, "litequeue": inproc_litequeue, "persist-queue": inproc_persistqueue}


def bench_inproc(synchronous: str, n: int, rounds: int) -> dict:
    """Each round runs every system on a fresh file (rotating the order); the median round is reported."""
    runs: dict[str, list[dict]] = {name: [] for name in INPROC}
    names = list(INPROC)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            tmp = tempfile.mkdtemp(prefix=f"sb-bench-{name}-")
            try:
                out = INPROC[name](tmp, synchronous, n)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            if out["pragma"] != SYNC_CODE[synchronous]:
                raise RuntimeError(f"{name}: PRAGMA synchronous is {out['pragma']}, wanted {synchronous}")
            runs[name].append(out)
    result: dict[str, dict] = {}
    for name, outs in runs.items():
        rates = [n / o["seconds"] for o in outs]
        lat = [x for o in outs for x in o["lat"]]
        result[name] = {"ops_per_s": statistics.median(rates), "ops_per_s_rounds": rates,
                        "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99)}
    sbr = result["switchboard"]["ops_per_s"]
    for name in ("litequeue", "persist-queue"):
        result[name]["ratio_switchboard_over_peer"] = sbr / result[name]["ops_per_s"]
    return {"synchronous": synchronous, "cycles": n, "rounds": rounds, "systems": result}


# ----------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------

def fmt_cores(cpu: dict) -> str:
    server = "?" if cpu["server_cores"] is None else f"{cpu['server_cores']:.2f}"
    return f"{server} / {cpu['client_cores']:.2f}"


def markdown(results: dict) -> str:
    facts = results["machine"]
    lines = [f"Machine: {facts['nproc']} CPU ({facts['cpu_model']}), Python {facts['python']}, "
             f"SQLite {facts['sqlite']}, {facts['date']}{' (quick)' if results['quick'] else ''}; "
             f"switchboard {facts['source']['git_head']}{'+dirty' if facts['source']['dirty'] else ''} "
             f"({facts['source']['sha256_package']})", ""]
    lines += ["### A. claim+complete over REST, 8 competing workers (real server, loopback)", "",
              "| synchronous | todos | cycles/s | cycle p50 ms | cycle p99 ms | claim p50/p99 ms | "
              "complete p50/p99 ms | push/s | CPU cores server / client | exactly once |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for a in results["rest"]:
        lines.append(f"| {a['synchronous']} | {a['todos']} | {a['cycles_per_s']:.0f} | {a['cycle_p50_ms']:.1f} | "
                     f"{a['cycle_p99_ms']:.1f} | {a['claim_p50_ms']:.1f} / {a['claim_p99_ms']:.1f} | "
                     f"{a['complete_p50_ms']:.1f} / {a['complete_p99_ms']:.1f} | {a['push_per_s']:.0f} | "
                     f"{fmt_cores(a['cpu_during_cycles'])} | {'yes' if a['verified']['ok'] else 'NO'} |")
    lines += ["", "### B. claim+ack in-process, single thread (two commits per cycle for every system)", "",
              "| synchronous | system | cycles/s | p50 ms | p99 ms | switchboard / peer |",
              "|---|---|---:|---:|---:|---:|"]
    for b in results["inproc"]:
        for name, s in b["systems"].items():
            ratio = s.get("ratio_switchboard_over_peer")
            lines.append(f"| {b['synchronous']} | {name} | {s['ops_per_s']:.0f} | {s['p50_ms']:.3f} | "
                         f"{s['p99_ms']:.3f} | {'' if ratio is None else f'{ratio:.2f}x'} |")
    lines += ["", "Notes: B runs " + f"{results['inproc'][0]['cycles']} cycles x {results['inproc'][0]['rounds']} "
              "rounds per system on fresh files, median round shown. litequeue hard-codes synchronous=NORMAL and "
              "persist-queue exposes no option (SQLite default FULL); both were set by `PRAGMA synchronous` on "
              "their connections after construction and read back. Switchboard's group commit gives a single "
              "thread no batching. Rates depend on table size (Switchboard's per-claim lease reap scans every todo "
              "of the endpoint; litequeue's pop sorts all ready rows), so compare runs at the same --cycles."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, to check the harness works")
    parser.add_argument("--todos", type=int, help="todos for the REST benchmark (default 2000, quick 400)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--cycles", type=int, help="in-process cycles per round (default 3000, quick 500)")
    parser.add_argument("--rounds", type=int, help="in-process rounds (default 3, quick 1)")
    parser.add_argument("--out", default=str(RESULTS_PATH))
    args = parser.parse_args(argv)
    n_todos = args.todos or (400 if args.quick else 2000)
    cycles = args.cycles or (500 if args.quick else 3000)
    rounds = args.rounds or (1 if args.quick else 3)

    results: dict = {"machine": machine_facts(), "quick": args.quick, "rest": [], "inproc": []}
    t0 = time.perf_counter()
    for sync in ("full", "normal"):
        print(f"A: REST {sync} ({n_todos} todos, {args.workers} workers)...", file=sys.stderr, flush=True)
        results["rest"].append(bench_rest(sync, n_todos, args.workers))
    for sync in ("FULL", "NORMAL"):
        print(f"B: in-process {sync} ({cycles} cycles x {rounds})...", file=sys.stderr, flush=True)
        results["inproc"].append(bench_inproc(sync, cycles, rounds))
    results["elapsed_s"] = time.perf_counter() - t0
    if source_fingerprint() != results["machine"]["source"]:
        results["warning"] = "the package changed on disk during the run"
        print(f"WARNING: {results['warning']}", file=sys.stderr)

    # Raw per-cycle latencies are summarised above; keep the JSON small.
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    print(f"\n(wrote {args.out}; {results['elapsed_s']:.0f} s)")
    bad = [a for a in results["rest"] if not a["verified"]["ok"]]
    for a in bad:
        print(f"\nCORRECTNESS PROBLEM at synchronous={a['synchronous']}: "
              f"{json.dumps(a['verified'], indent=2)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
