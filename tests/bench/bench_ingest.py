"""Ingest benchmark (SPEC section 13): signed GitHub issue deliveries per second end to end over HTTP, with the
fleet pack installed on a router webhook the way packs/README.md lays out the lanes.

    python tests/bench/bench_ingest.py [--quick]      (normally run through tests/bench/run_all.py)

Set-up, all through the real CLI before the server starts: a human; a router endpoint scoped to `hold` with verb
`webhooks` that owns a GitHub webhook (queue `hold`); one `drain` endpoint per lane (lane-s, lane-m, lane-l,
lane-vision, triage), each added as a route of the webhook; `rules set WEBHOOK --file packs/fleet.json --params
PARAMS.json` with params that make the deliveries eligible. Then `serve --ingest-rate 0`.

Every delivery is `issues.labeled` from tests/fixtures/github, patched to a distinct issue number and one
`size/S|M|L` label (rotating), with a fresh X-GitHub-Delivery, and signed with the webhook's secret. All
deliveries are built and signed before the clock starts. 16 sender threads, each with its own keep-alive
httpx.Client, take the next delivery from a shared counter and POST it; the ack latency is the time from just
before the POST to the parsed 202.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # tests/, for producers
import producers  # noqa: E402
from bench_store import ROOT, Server, cli, percentile, read_only, run_timed  # noqa: E402

PACK = ROOT / "packs" / "fleet.json"
LANES = ("lane-s", "lane-m", "lane-l", "lane-vision", "triage")
SIZES = ("S", "M", "L")
PARAMS = {"require_verified": True, "trusted_humans": ["Codertocat"], "trusted_agents": [],
          "cairn_actors": [], "repo_prefixes": ["Codertocat/"]}


def fleet_topology(db_path: str, tmp: str, secret: str | None = None) -> dict:
    """The lane topology of packs/README.md through the CLI; returns tokens, ids and the webhook. The webhook
    trusts the fixtures' sender (Codertocat), so the trust gate lets the deliveries reach the rules; `secret`
    sets the webhook's signing secret (else one is generated)."""
    cli(db_path, "init")
    human = cli(db_path, "human", "add", "bench")
    router = cli(db_path, "endpoint", "vend", "--human", "bench", "--name", "router", "--queues", "hold",
                 "--verbs", "webhooks")
    lanes = {q: cli(db_path, "endpoint", "vend", "--human", "bench", "--name", q, "--queues", q, "--verbs", "drain")
             for q in LANES}
    hook = cli(db_path, "webhook", "create", "--endpoint", router["id"], "--provider", "github", "--queue", "hold",
               "--base-url", "http://placeholder", "--trust", "Codertocat", *(("--secret", secret) if secret else ()))
    for q in LANES:
        cli(db_path, "route", "add", hook["id"], lanes[q]["id"])
    params_path = os.path.join(tmp, "params.json")
    Path(params_path).write_text(json.dumps(PARAMS))
    installed = cli(db_path, "rules", "set", hook["id"], "--file", str(PACK), "--params", params_path)
    pack = json.loads(PACK.read_text())
    if [r["id"] for r in installed["rules"]] != [r["id"] for r in pack["rules"]]:
        raise RuntimeError(f"rules set did not install the fleet pack: {installed}")
    return {"human": human, "router": router, "lanes": lanes, "hook": hook,
            "hook_path": "/hooks/" + hook["url"].rsplit("/hooks/", 1)[1]}


def labeled_delivery(secret: str, number: int, size: str) -> tuple[bytes, dict]:
    """issues.labeled for issue #number, whose whole label set is one size/<size> label (the changed label too)."""
    label = {"id": 9000 + SIZES.index(size), "node_id": "LA_bench", "name": f"size/{size}", "color": "ededed",
             "default": False, "description": None,
             "url": f"https://api.github.com/repos/Codertocat/Hello-World/labels/size/{size}"}
    patch = {"issue": {"number": number, "labels": [label]}, "label": label}
    return producers.github("issues.labeled", secret, patch, delivery=str(uuid.uuid4()))


def send_deliveries(base_url: str, path: str, deliveries: list[tuple[bytes, dict]], n_senders: int = 16,
                    measure: Callable[[], Callable[[], Any]] | None = None) -> dict:
    """POST every delivery from `n_senders` threads, each with its own keep-alive client, taking the next one
    from a shared counter; the ack time runs from just before the POST to the parsed 202. `window` is what
    `measure` said (see run_timed)."""
    n = len(deliveries)
    lock = threading.Lock()
    next_index = [0]
    ack_ms: list[float] = []
    answers: list[dict | None] = [None] * n
    errors: list[str] = []
    url = base_url + path

    def sender(_: int, ready: Callable[[], None]) -> None:
        with httpx.Client(timeout=60) as client:
            client.get(f"{base_url}/healthz")  # open the keep-alive connection before the clock starts
            ready()
            while True:
                with lock:
                    i = next_index[0]
                    next_index[0] += 1
                if i >= n:
                    break
                raw, headers = deliveries[i]
                t0 = time.perf_counter()
                try:
                    r = client.post(url, content=raw, headers=headers)
                except httpx.HTTPError as exc:
                    errors.append(f"delivery {i}: {type(exc).__name__}: {exc}")
                    continue
                took = (time.perf_counter() - t0) * 1e3
                if r.status_code != 202:
                    errors.append(f"delivery {i}: {r.status_code} {r.text[:300]}")
                    continue
                answers[i] = r.json()
                with lock:
                    ack_ms.append(took)

    wall, window = run_timed(n_senders, sender, "sender", measure)
    return {"deliveries": n, "wall_s": round(wall, 3), "rate": len(ack_ms) / wall,
            "p50_ms": percentile(ack_ms, 50), "p99_ms": percentile(ack_ms, 99),
            "max_ms": max(ack_ms) if ack_ms else float("nan"),
            "window": window, "answers": answers, "errors": errors}


def ingest_cpu(server: Server) -> Callable[[], Callable[[], dict]]:
    """A `measure` for send_deliveries: cores used by the server, its evaluator children and this client."""
    def start() -> Callable[[], dict]:
        server0, client0, t0 = server.cpu_seconds(), time.process_time(), time.perf_counter()
        children0 = evaluator_children_cpu(server.proc.pid) or 0.0

        def stop() -> dict:
            wall = time.perf_counter() - t0
            server1, children1 = server.cpu_seconds(), evaluator_children_cpu(server.proc.pid)
            return {"server_cores": None if server0 is None or server1 is None else (server1 - server0) / wall,
                    "client_cores": (time.process_time() - client0) / wall,
                    "evaluator_children_cores": None if children1 is None else (children1 - children0) / wall}
        return stop
    return start


def bench_ingest(synchronous: str, n_deliveries: int, n_senders: int = 16) -> dict:
    tmp = tempfile.mkdtemp(prefix="sb-bench-ingest-")
    db_path = os.path.join(tmp, "switchboard.db")
    server = None
    try:
        topo = fleet_topology(db_path, tmp)
        secret = topo["hook"]["secret"]
        deliveries = [labeled_delivery(secret, 10_000 + i, SIZES[i % len(SIZES)]) for i in range(n_deliveries)]
        body_bytes = statistics.fmean(len(raw) for raw, _ in deliveries)
        server = Server(db_path, synchronous, "--ingest-rate", "0")
        sent = send_deliveries(server.url, topo["hook_path"], deliveries, n_senders, ingest_cpu(server))
        answers, errors, wall, cpu = sent["answers"], sent["errors"], sent["wall_s"], sent["window"]
        server.stop()
        log_problems = server.log_problems()
        tracebacks = server.log_tracebacks()
        server = None

        # Dispositions from the 202 answers, then cross-checked against the file.
        dispositions = collections.Counter(
            "duplicate" if a.get("duplicate") else a["disposition"] for a in answers if a is not None)
        expected_lane = {f"lane-{s.lower()}" for s in SIZES}
        wrong_lane = [a for i, a in enumerate(answers) if a is not None and a["disposition"] == "routed"
                      and [t["queue"] for t in a["todos"]] != [f"lane-{SIZES[i % len(SIZES)].lower()}"]]
        with read_only(db_path) as ro:
            db_dispositions = dict(ro.execute("SELECT disposition, count(*) FROM events GROUP BY disposition"))
            db_queues = dict(ro.execute("SELECT queue, count(*) FROM todos GROUP BY queue"))
            lane_owner = dict(ro.execute("SELECT t.queue, count(DISTINCT t.endpoint_id) FROM todos t GROUP BY t.queue"))
        routed = dispositions.get("routed", 0)
        verified = {
            "http_errors": errors[:20], "server_log_problems": log_problems[:20], "server_tracebacks": tracebacks,
            "db_event_dispositions": db_dispositions, "db_todo_queues": db_queues,
            "wrong_lane": len(wrong_lane), "endpoints_per_queue": lane_owner,
        }
        verified["ok"] = (not errors and not log_problems and routed == n_deliveries and not wrong_lane
                          and db_dispositions == {"routed": n_deliveries}
                          and set(db_queues) == expected_lane and sum(db_queues.values()) == n_deliveries
                          and all(v == 1 for v in lane_owner.values()))
        return {
            "synchronous": synchronous.upper(),
            "deliveries": n_deliveries,
            "senders": n_senders,
            "body_bytes_mean": body_bytes,
            "wall_s": wall,
            "deliveries_per_s": sent["rate"],
            "ack_p50_ms": sent["p50_ms"],
            "ack_p99_ms": sent["p99_ms"],
            "ack_max_ms": sent["max_ms"],
            "dispositions": dict(dispositions),
            "routed_share": routed / n_deliveries,
            "cpu_during_ingest": cpu,
            "verified": verified,
        }
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def evaluator_children_cpu(pid: int) -> float | None:
    """user+system CPU seconds of the server's live children (the sandboxed evaluator pool), from /proc."""
    total, found = 0.0, False
    try:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
                found = True
    except OSError:
        return None
    return total if found else None


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    for sync in ("full", "normal"):
        print(json.dumps(bench_ingest(sync, 300 if quick else 2000), indent=2))
