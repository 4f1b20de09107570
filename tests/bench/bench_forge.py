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
C. Commands (issue 44): a todo waiting for an answer, then a commander's signed `issue_comment` `/answer …`
   delivery. "State change" = from sending it to its 202 (the answer is committed before the 202 is written; the
   bench checks the todo is pending); "reaction" = from sending it to the forge getting the `+1` reaction's POST.

Goals: A p50 under 10 ms and p99 under 50 ms on the 2-core machine; B every label within 2 s; C the reaction's p50
under 20 ms and p99 under 100 ms.
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
COMMANDER = "bench-human"
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
        self.call("PUT", f"/webhooks/{self.hook['id']}/connection", self.human, connection_id=connection["id"],
                  commands={"logins": [COMMANDER]})
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

    def asking(self, number: int) -> str:
        """Issue `number`'s todo, claimed and waiting for an answer."""
        todo_id, lease = self.claimed(number)
        self.call("POST", f"/todos/{todo_id}/needs-input", self.endpoint, lease_token=lease, question="Which disk?")
        return todo_id

    def command(self, number: int, comment_id: int, todo_id: str) -> tuple[float, float]:
        """A commander's `/answer` comment delivered: (ms to its 202, ms to the reaction reaching the forge)."""
        self.forge.issues[("acme/site", number)]["comments"].append({
            "id": comment_id, "body": "/answer sdb", "user": COMMANDER, "created_at": "", "updated_at": "",
            "edits": 0})
        raw, headers = producers.github("issue_comment.created", self.hook["secret"], {
            "action": "created", "issue": {"number": number, "labels": []}, "repository": {"full_name": "acme/site"},
            "sender": {"login": COMMANDER}, "comment": {"id": comment_id, "body": "/answer sdb",
                                                        "user": {"login": COMMANDER}}})
        sent = time.monotonic()
        answer = self.http.post(self.hook_path, content=raw, headers=headers)
        acted = time.monotonic()
        assert answer.status_code == 202 and answer.json()["command"]["result"] == "acted", answer.text
        path = f"/repos/acme/site/issues/comments/{comment_id}/reactions"
        found = self.forge.wait_for(lambda: next((r for r in self.forge.requests if r["path"] == path), None), 10,
                                    f"the reaction on comment {comment_id}")
        assert self.call("GET", f"/todos/{todo_id}", self.human)["state"] == "pending"
        return (acted - sent) * 1e3, (found["at"] - sent) * 1e3

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


def commands(site: Site, n: int, first: int) -> tuple[list[float], list[float]]:
    acted, reacted = [], []
    for number in range(first, first + n):
        todo_id = site.asking(number)
        to_state, to_reaction = site.command(number, 500_000 + number, todo_id)
        acted.append(to_state)
        reacted.append(to_reaction)
    return acted, reacted


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
            commands(site, 5, 20_000)  # warm
            acted, reacted = commands(site, n, 30_000)
        finally:
            site.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report = {"machine": machine_facts(), "one_at_a_time": {"n": n, "p50_ms": percentile(single, 50),
                                                            "p99_ms": percentile(single, 99), "max_ms": max(single)},
              "burst": {"n": n_burst, "p50_ms": percentile(many, 50), "p99_ms": percentile(many, 99),
                        "max_ms": max(many)},
              "command_state_change": {"n": n, "p50_ms": percentile(acted, 50), "p99_ms": percentile(acted, 99),
                                       "max_ms": max(acted)},
              "command_reaction": {"n": n, "p50_ms": percentile(reacted, 50), "p99_ms": percentile(reacted, 99),
                                   "max_ms": max(reacted)}}
    goals = [("one at a time p50 under 10 ms", report["one_at_a_time"]["p50_ms"] < 10),
             ("one at a time p99 under 50 ms", report["one_at_a_time"]["p99_ms"] < 50),
             (f"a burst of {n_burst}: every label within 2 s", report["burst"]["max_ms"] < 2000),
             ("a command's reaction p50 under 20 ms", report["command_reaction"]["p50_ms"] < 20),
             ("a command's reaction p99 under 100 ms", report["command_reaction"]["p99_ms"] < 100)]
    (HERE / "results-forge.json").write_text(json.dumps({**report, "goals": goals}, indent=2) + "\n")
    print("| outputs | n | p50 (ms) | p99 (ms) | max (ms) |\n|---|---:|---:|---:|---:|")
    for name in ("one_at_a_time", "burst", "command_state_change", "command_reaction"):
        r = report[name]
        print(f"| {name.replace('_', ' ')} | {r['n']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} |")
    met = sum(ok for _, ok in goals)
    print(f"\nforge: {met} of {len(goals)} goals met")
    return 0 if met == len(goals) else 1


if __name__ == "__main__":
    sys.exit(main())
