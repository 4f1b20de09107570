"""Limits (issue 26): `backup --keep` below 1 is refused; the connection cap fits the file limit, so a flood of
half-sent requests larger than the file limit never keeps /healthz out; and a delivery whose rules find no sandbox
child within EVAL_WAIT_SECONDS is shed (503, Retry-After, nothing stored), counted in /metrics and on the Board.

What is about the server runs against a real one: `python switchboard.py serve` as conftest's LiveServer starts
it, once with its file limit lowered before it starts (as `prlimit` or a unit's LimitNOFILE would)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import resource
import select
import socket
import threading
import time
from pathlib import Path

import httpx
import producers
import pytest
from conftest import ROOT, LiveServer, cli
from helpers import TLS, count

from switchboard.configuration import FD_RESERVE
from switchboard.server import connection_limits

# -- 9. backup --keep ------------------------------------------------------------------------------------

@pytest.mark.sqlite_only("backup copies a SQLite file")
def test_backup_refuses_to_keep_fewer_than_one(db_path, tmp_path):
    """`--keep 0` used to delete the backup it had just made and exit 0 naming it."""
    dated = tmp_path / "dated"
    for keep, run in (("0", cli), ("-1", cli)):
        code, answer = run(db_path, "backup", "--dir", str(dated), "--keep", keep)
        assert code == 1 and answer["error"] == "invalid_argument" and "--keep" in answer["message"], answer
        assert not dated.exists(), "nothing written: not the directory, not a backup"
    code, answer = cli(db_path, "backup", "--dir", str(dated), "--keep", "1")
    assert code == 0 and Path(answer["backup"]).is_file() and answer["removed"] == [], answer


# -- 10. the connection cap and the file limit -----------------------------------------------------------

def test_the_connection_cap_fits_the_file_limit():
    for limit in (256, 512, 1024, 4096, 65536, 1 << 20):
        cap, backlog = connection_limits(limit)
        assert 0 < cap <= 2048 and 0 < backlog <= 2048
        if limit > FD_RESERVE + 64:
            assert cap + backlog <= limit - FD_RESERVE, (limit, cap, backlog)
    assert connection_limits(65536) == (2048, 2048), "a unit's LimitNOFILE=65536 keeps the full cap"


FILE_LIMIT = 512
FLOOD = FILE_LIMIT + 300
HALF_SENT = b"POST /hooks/" + b"x" * 22 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Flood:
    """Keeps `size` connections open on the server, each with a request whose headers never end: whenever the
    server closes some, as many new ones take their place. Several threads connect at once, so that a connect
    the server's full listen queue delays (a second, until the SYN is sent again) holds up only its thread."""

    THREADS = 8

    def __init__(self, port: int, size: int):
        self.port, self.share = port, size // self.THREADS + 1
        self.opened = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(self.THREADS)]

    def run(self) -> None:
        socks: list[socket.socket] = []
        try:
            while not self.stop.is_set():
                while len(socks) < self.share and not self.stop.is_set():
                    try:
                        sock = socket.create_connection(("127.0.0.1", self.port), timeout=3)
                        sock.sendall(HALF_SENT)
                    except OSError:
                        break
                    socks.append(sock)
                    with self.lock:
                        self.opened += 1
                poller = select.poll()
                for sock in socks:
                    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
                closed = {fd for fd, _ in poller.poll(100)}
                for sock in [s for s in socks if s.fileno() in closed]:
                    socks.remove(sock)
                    sock.close()
        finally:
            for sock in socks:
                sock.close()

    def __enter__(self) -> Flood:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="counts descriptors in /proc")
def test_healthz_answers_throughout_a_flood_of_half_sent_requests_past_the_file_limit(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FLOOD + 200:  # the flood's own sockets, in this process
        if hard != resource.RLIM_INFINITY and hard < FLOOD + 200:
            pytest.skip(f"this process may open only {hard} files")
        resource.setrlimit(resource.RLIMIT_NOFILE, (FLOOD + 200, hard))
    db_path = str(tmp_path / "switchboard.db")
    # The server starts with soft and hard limit both FILE_LIMIT, as `prlimit --nofile=512:512` would start it.
    code = (f"import resource, sys\nresource.setrlimit(resource.RLIMIT_NOFILE, ({FILE_LIMIT}, {FILE_LIMIT}))\n"
            f"sys.path.insert(0, {str(ROOT)!r})\nfrom switchboard.cli.parser import main\nsys.exit(main(sys.argv[1:]))\n")
    server = LiveServer(db_path, program=("-c", code))
    try:
        pid = server.proc.pid
        checks, most_fds = [], 0
        with Flood(server.port, FLOOD) as flood:
            # From the flood's first connections until it has opened more than the file limit, and then some.
            deadline = time.monotonic() + 30
            while (flood.opened < FLOOD or len(checks) < 10) and time.monotonic() < deadline:
                try:
                    checks.append(httpx.get(server.url + "/healthz", timeout=5, verify=TLS).status_code)
                except httpx.HTTPError as exc:
                    checks.append(type(exc).__name__)
                most_fds = max(most_fds, open_fds(pid))
            opened = flood.opened
        assert opened >= FLOOD, f"the flood opened only {opened} connections"
        assert checks == [200] * len(checks), checks
        assert most_fds < FILE_LIMIT, f"the server held {most_fds} of its {FILE_LIMIT} descriptors"
        assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200
        logged = server.logged()
        assert "at most " in logged and "connections at once" in logged, "the lowered cap is logged at start"
        assert "Too many open files" not in logged and "out of system resource" not in logged
    finally:
        server.stop()


# -- 11. shedding a looping owner's deliveries -----------------------------------------------------------

LOOP_FOREVER = "last(range(1e15)) > 0"
SHED_FLOOD = 24
WAIT_SECONDS = 2.0  # the evaluation wait in this test's server (EVAL_WAIT_SECONDS, 5 s, in production)


def test_a_looping_owners_flood_is_shed_in_bounded_time_and_redelivered_once(db_path):
    assert cli(db_path, "init")[0] == 0
    token = cli(db_path, "human", "add", "alice")[1]["token"]
    auth = {"Authorization": f"Bearer {token}"}
    # The wait at 2 s and a child that overruns killed after 0.5 s instead of 2 s: the same flood in less time.
    code = (f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom switchboard.cli.parser import main\n"
            f"import switchboard.app, switchboard.flows\nswitchboard.flows.EVAL_WAIT_SECONDS = {WAIT_SECONDS}\n"
            "class Evaluator(switchboard.app.Evaluator):\n"
            "    def __init__(self, *args, **kwargs):\n"
            "        super().__init__(*args, **{**kwargs, 'kill_after': 0.5})\n"
            "switchboard.app.Evaluator = Evaluator\n"
            "sys.exit(main(sys.argv[1:]))\n")
    server = LiveServer(db_path, "--ingest-rate", "0", program=("-c", code))
    try:
        with httpx.Client(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=64)) as http:
            endpoint = http.post("/api/v1/endpoints", headers=auth, json={"name": "owner", "queues": ["triage"]})
            assert endpoint.status_code == 201, endpoint.text
            hook = http.post("/api/v1/webhooks", headers=auth, json={
                "provider": "github", "queue": "triage", "endpoint_id": endpoint.json()["id"],
                "trusted_actors": {"allow_all": True}}).json()
            saved = http.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=auth, json={
                "rules": [{"id": "loops", "expr": LOOP_FOREVER, "action": {"queue": "triage"}}]})
            assert saved.status_code == 200, saved.text
            path = "/hooks/" + hook["url"].rsplit("/hooks/", 1)[1]
            deliveries = [producers.github("issues.opened", hook["secret"], {"issue": {"number": n}})
                          for n in range(SHED_FLOOD)]

            def deliver(raw_headers: tuple[bytes, dict]) -> tuple[httpx.Response, float]:
                started = time.monotonic()
                answer = http.post(path, content=raw_headers[0], headers=raw_headers[1])
                return answer, time.monotonic() - started

            with concurrent.futures.ThreadPoolExecutor(SHED_FLOOD) as pool:
                answers = list(pool.map(deliver, deliveries))

            statuses = [a.status_code for a, _ in answers]
            assert set(statuses) <= {202, 503}, statuses
            shed = [(d, a) for d, (a, _) in zip(deliveries, answers, strict=True) if a.status_code == 503]
            assert shed, "the flood outran the owner's share of the evaluator, so some deliveries were shed"
            for _, answer in shed:
                assert answer.headers["retry-after"] == str(int(WAIT_SECONDS))
                assert answer.json()["error"] == "unavailable" and "not stored" in answer.json()["message"]
            slowest = max(elapsed for _, elapsed in answers)
            assert slowest < WAIT_SECONDS + 10, f"an answer took {slowest:.1f} s"  # liveness, not a benchmark
            evaluated = [a.json() for a, _ in answers if a.status_code == 202]
            assert all(o["disposition"] == "quarantined" for o in evaluated), evaluated
            assert count(db_path, "events") == len(evaluated), "a shed delivery stores nothing"

            # The producer redelivers a shed one: evaluated now, and stored once however often it comes again.
            (raw, headers), _ = shed[0]
            for _ in range(5):  # as a producer would: again after Retry-After while the owner's rules are busy
                first = http.post(path, content=raw, headers=headers)
                if first.status_code != 503:
                    break
                time.sleep(float(first.headers["retry-after"]))
            assert first.status_code == 202 and first.json()["disposition"] == "quarantined", first.text
            again = http.post(path, content=raw, headers=headers)
            assert again.status_code == 202 and again.json()["duplicate"] is True
            assert again.json()["event_id"] == first.json()["event_id"]
            assert count(db_path, "events") == len(evaluated) + 1

            metrics = http.get("/metrics").text
            counted = re.search(r'^switchboard_deliveries_shed_total\{provider="github"\} (\S+)$', metrics, re.M)
            assert counted and float(counted.group(1)) >= len(shed), metrics[-2000:]
            shed_count = int(float(counted.group(1)))  # the flood's, and any redelivery shed again above

            signed_in = http.post("/board/login", data={"token": token}, headers={"Origin": server.url})
            assert signed_in.status_code == 303, signed_in.text
            page = http.get(f"/board/webhooks/{hook['id']}")
            assert page.status_code == 200
            line = re.search(r'<p class="notice error" id="shed"[^>]*>(.*?)</p>', page.text, re.S)
            assert line and f"Shed: {shed_count} deliver" in line.group(1), page.text[:3000]
        assert "shed: its owner's rules found no evaluator" in server.logged()
    finally:
        with contextlib.suppress(Exception):
            server.stop()
