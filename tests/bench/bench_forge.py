"""Forge outputs (issue 36): how soon an accepted output reaches the forge, over loopback.

    python tests/bench/bench_forge.py [--quick]

One `serve --ingest-rate 0 --notify-allow 127.0.0.1` (synchronous FULL, the default): an endpoint scoped to `triage`
that owns a GitHub webhook whose one rule sends an opened issue to `triage` with a work order, connected (default
policy) to a GitHub of our own (tests/forges.py's FakeForge on loopback, which records when each request reached it,
`time.monotonic()` in this process). For each issue: its signed `issues.opened` delivery, a claim, then `complete`
with an `add_labels` output. Latency = when the forge got `POST /repos/acme/site/issues/N/labels` minus when the
complete's 200 was parsed (the output is committed with the report, and the sender wakes after that commit).

A. One at a time: the next todo is completed only once the previous label arrived (the sender idle each time).
B. A burst: BURST todos completed back to back, their outputs on as many issues (the sender sends up to 16 at once).

Goals: A p50 under 10 ms and p99 under 50 ms on the 2-core machine; B every label within 2 s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import producers  # noqa: E402
from bench_store import Server, cli, machine_facts, percentile  # noqa: E402
from forges import FakeForge  # noqa: E402

TOKEN = "ghp_" + "B3nchT0ken" * 4
RULES = {"rules": [{"id": "triage", "expr": ".issue != null and .issue.action == \"opened\"",
                    "action": {"queue": "triage", "work_order": True}}], "default_action": {"drop": True}}


class Site:
    def __init__(self, folder: str):
        db = str(Path(folder) / "bench.db")
        cli(db, "init")
        human = cli(db, "human", "add", "bench")
        self.server = Server(db, "full", "--ingest-rate", "0", "--notify-allow", "127.0.0.1")
        self.forge = FakeForge("github", TOKEN, "bench-bot")
        self.http = httpx.Client(base_url=self.server.url, timeout=30)
        self.human = {"Authorization": f"Bearer {human['token']}"}
        endpoint = self.call("POST", "/endpoints", self.human, name="triage", queues=["triage"], verbs=["all"])
        self.endpoint = {"Authorization": f"Bearer {endpoint['token']}"}
        self.hook = self.call("POST", "/webhooks", self.human, provider="github", queue="triage",
                              endpoint_id=endpoint["id"], trusted_actors={"allow_all": True})
        self.call("PUT", f"/webhooks/{self.hook['id']}/rules", self.human, **RULES)
        connection = self.call("POST", "/connections", self.human, kind="github", api_url=self.forge.api,
                               token=TOKEN, repos=["acme/"])
        self.call("PUT", f"/webhooks/{self.hook['id']}/connection", self.human, connection_id=connection["id"])
        self.hook_path = "/hooks/" + self.hook["url"].rsplit("/hooks/", 1)[1]

    def call(self, method: str, path: str, auth: dict, **body) -> dict:
        answer = self.http.request(method, f"/api/v1{path}", headers=auth, json=body or None)
        assert answer.status_code in (200, 201), answer.text
        return answer.json()

    def claimed(self, number: int) -> tuple[str, str]:
        """Issue `number` opened (a signed delivery) and its triage todo claimed: (todo id, lease token)."""
        self.forge.issue("acme/site", number)
        raw, headers = producers.github("issues.opened", self.hook["secret"], {
            "issue": {"number": number, "labels": []}, "repository": {"full_name": "acme/site"}})
        todo_id = self.http.post(self.hook_path, content=raw, headers=headers).json()["todos"][0]["id"]
        claim = self.call("POST", f"/todos/{todo_id}/claim", self.endpoint)
        return todo_id, claim["lease_token"]

    def complete(self, todo_id: str, lease: str) -> float:
        """Complete with an add_labels output; when its 200 was parsed."""
        self.call("POST", f"/todos/{todo_id}/complete", self.endpoint, lease_token=lease,
                  outputs=[{"type": "add_labels", "labels": ["size/S"]}])
        return time.monotonic()

    def arrived(self, number: int, timeout: float = 10) -> float:
        path = f"/repos/acme/site/issues/{number}/labels"
        found = self.forge.wait_for(lambda: next((r for r in self.forge.requests if r["path"] == path
                                                  and r["method"] == "POST"), None), timeout, f"label on #{number}")
        return found["at"]

    def close(self) -> None:
        self.http.close()
        self.forge.stop()
        self.server.stop()


def one_at_a_time(site: Site, n: int, first: int) -> list[float]:
    latencies = []
    for number in range(first, first + n):
        todo_id, lease = site.claimed(number)
        done = site.complete(todo_id, lease)
        latencies.append((site.arrived(number) - done) * 1e3)
    return latencies


def burst(site: Site, n: int, first: int) -> list[float]:
    ready = [(number, *site.claimed(number)) for number in range(first, first + n)]
    completed = {number: site.complete(todo_id, lease) for number, todo_id, lease in ready}
    return [(site.arrived(number) - at) * 1e3 for number, at in completed.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer outputs (a quick look)")
    args = parser.parse_args(argv)
    n, n_burst = (50, 20) if args.quick else (300, 100)
    folder = tempfile.mkdtemp(prefix="sb-bench-forge-")
    try:
        site = Site(folder)
        try:
            one_at_a_time(site, 10, 1)  # warm: the sender's client, the server's caches
            single = one_at_a_time(site, n, 100)
            many = burst(site, n_burst, 10_000)
        finally:
            site.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report = {"machine": machine_facts(), "one_at_a_time": {"n": n, "p50_ms": percentile(single, 50),
                                                            "p99_ms": percentile(single, 99), "max_ms": max(single)},
              "burst": {"n": n_burst, "p50_ms": percentile(many, 50), "p99_ms": percentile(many, 99),
                        "max_ms": max(many)}}
    goals = [("one at a time p50 under 10 ms", report["one_at_a_time"]["p50_ms"] < 10),
             ("one at a time p99 under 50 ms", report["one_at_a_time"]["p99_ms"] < 50),
             (f"a burst of {n_burst}: every label within 2 s", report["burst"]["max_ms"] < 2000)]
    (HERE / "results-forge.json").write_text(json.dumps({**report, "goals": goals}, indent=2) + "\n")
    print("| outputs | n | p50 (ms) | p99 (ms) | max (ms) |\n|---|---:|---:|---:|---:|")
    for name in ("one_at_a_time", "burst"):
        r = report[name]
        print(f"| {name.replace('_', ' ')} | {r['n']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} |")
    met = sum(ok for _, ok in goals)
    print(f"\nforge: {met} of {len(goals)} goals met")
    return 0 if met == len(goals) else 1


if __name__ == "__main__":
    sys.exit(main())
