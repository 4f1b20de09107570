"""SPEC section 11, against a real server process: a crash (SIGKILL) while workers claim and complete loses no
acknowledged claim or completion and leaves no half-written todo; the restarted server drains the rest. A
graceful shutdown (SIGTERM) finishes in-flight requests, ends open streams, and exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest
from conftest import cli, workdir
from helpers import TLS, assert_storage_intact, connect_db

TODOS = 400
WORKERS = 4
LEASE = 3  # seconds: short, so that the claims the crash orphaned lapse soon after the restart


def query(db_path: str, sql: str, args: tuple = ()) -> list[tuple]:
    conn = connect_db(db_path)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def log_tail(db_path: str, lines: int = 30) -> str:
    path = workdir(db_path) / "switchboard.log"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def principals(db_path: str, queues: str = "build") -> tuple[dict, dict]:
    code, human = cli(db_path, "human", "add", "alice")
    assert code == 0 and human["token"].startswith("sbh_"), human
    code, endpoint = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "worker", "--queues",
                         queues)
    assert code == 0 and endpoint["token"].startswith("sbk_"), endpoint
    return human, endpoint


def bearer(principal: dict) -> dict:
    return {"Authorization": f"Bearer {principal['token']}"}


def push_all(url: str, human: dict, endpoint_id: str, count: int) -> list[str]:
    """Push `count` todos over REST from a few threads; every one must be acknowledged (201)."""
    made: list[str] = []
    lock = threading.Lock()

    def pusher(offset: int) -> None:
        with httpx.Client(base_url=url, headers=bearer(human), timeout=30, verify=TLS) as http:
            for n in range(offset, count, 4):
                r = http.post(f"/api/v1/endpoints/{endpoint_id}/todos", json={"title": f"job {n}", "queue": "build"})
                assert r.status_code == 201, r.text
                with lock:
                    made.append(r.json()["id"])

    threads = [threading.Thread(target=pusher, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(made) == count == len(set(made))
    return made


def check_no_half_written_todo(db_path: str) -> dict[str, dict]:
    """Every todo's row, attempts and history agree, read in one snapshot (a running server may be reaping).
    Returns the todos by id with their attempts."""
    conn = connect_db(db_path)
    try:
        conn.execute("BEGIN")
        todos = {row[0]: {"state": row[1], "outcome": row[2], "attempt": row[3], "lease": row[4], "token": row[5],
                          "attempts": [], "claims": 0}
                 for row in conn.execute("SELECT id, state, outcome, attempt, lease_expires_at, lease_token_hash"
                                         " FROM todos")}
        for todo_id, seq, ended_at, outcome, endpoint_id, claimant in conn.execute(
                "SELECT todo_id, seq, ended_at, outcome, endpoint_id, claimant FROM attempts ORDER BY todo_id, seq"):
            todos[todo_id]["attempts"].append({"seq": seq, "ended_at": ended_at, "outcome": outcome,
                                               "endpoint_id": endpoint_id, "claimant": claimant})
        for todo_id, claims in conn.execute("SELECT todo_id, count(*) FROM todo_history WHERE to_state = 'claimed'"
                                            " GROUP BY todo_id"):
            todos[todo_id]["claims"] = claims
        conn.execute("COMMIT")
    finally:
        conn.close()
    for todo_id, todo in todos.items():
        open_attempts = [a for a in todo["attempts"] if a["ended_at"] is None]
        if todo["state"] == "claimed":
            assert len(open_attempts) == 1, (todo_id, todo)
            assert todo["lease"] is not None and todo["token"] is not None, (todo_id, todo)
        else:
            assert open_attempts == [], (todo_id, todo)
            assert todo["lease"] is None and todo["token"] is None, (todo_id, todo)
        assert all((a["ended_at"] is None) == (a["outcome"] is None) for a in todo["attempts"]), (todo_id, todo)
        assert [a["seq"] for a in todo["attempts"]] == list(range(1, len(todo["attempts"]) + 1)), (todo_id, todo)
        assert len(todo["attempts"]) == todo["claims"], ("attempt rows and claim history disagree", todo_id, todo)
        assert todo["attempt"] == len(todo["attempts"]), ("no release or retry here: attempt counts claims", todo)
        if todo["state"] == "done":
            assert todo["outcome"] == "completed" and todo["attempts"][-1]["outcome"] == "completed", (todo_id, todo)
    assert_storage_intact(db_path)
    return todos


class ClaimRun:
    """WORKERS threads claim and complete in a loop, recording what the server acknowledged; the server is
    SIGKILLed once enough completions are in, while every worker is still busy."""

    def __init__(self, server, endpoint: dict, kill_after_completes: int = 60):
        self.claims: dict[str, dict] = {}     # todo id -> acknowledged claim {attempt, lease_token, claimant}
        self.completes: dict[str, dict] = {}  # todo id -> acknowledged completion (the todo answered)
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.enough = threading.Event()
        deadline = time.monotonic() + 30

        def worker(n: int) -> None:
            with httpx.Client(base_url=server.url, headers=bearer(endpoint), timeout=10) as http:
                for _ in range(TODOS):
                    if time.monotonic() > deadline:
                        return
                    try:
                        r = http.post("/api/v1/todos/claim", json={"lease_seconds": LEASE, "claimant": f"w{n}"})
                        with self.lock:
                            self.statuses.append(r.status_code)
                        if r.status_code != 200 or r.json().get("empty"):
                            return
                        claimed = r.json()
                        todo_id = claimed["todo"]["id"]
                        with self.lock:
                            self.claims[todo_id] = {"attempt": claimed["todo"]["attempt"],
                                                    "lease_token": claimed["lease_token"], "claimant": f"w{n}"}
                        r = http.post(f"/api/v1/todos/{todo_id}/complete",
                                      json={"lease_token": claimed["lease_token"], "summary": f"done by w{n}"})
                        with self.lock:
                            self.statuses.append(r.status_code)
                            if r.status_code == 200 and r.json()["state"] == "done":
                                self.completes[todo_id] = r.json()
                            if len(self.completes) >= kill_after_completes:
                                self.enough.set()
                    except httpx.HTTPError as exc:  # the server is gone
                        with self.lock:
                            self.errors.append(repr(exc))
                        return

        self.threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(WORKERS)]
        for t in self.threads:
            t.start()
        assert self.enough.wait(20), f"only {len(self.completes)} completions before the deadline: {self.statuses}"
        self.alive_at_kill = sum(t.is_alive() for t in self.threads)
        server.proc.kill()  # SIGKILL while the workers are mid-flight
        server.proc.wait(timeout=10)
        for t in self.threads:
            t.join(timeout=15)
        assert not any(t.is_alive() for t in self.threads)


def test_sigkill_during_claims_loses_no_acknowledged_work_and_the_restart_drains_the_rest(db_path, live_server):
    first = live_server("--ingest-rate", "0")
    human, endpoint = principals(db_path)
    pushed = push_all(first.url, human, endpoint["id"], TODOS)

    run = ClaimRun(first, endpoint)
    assert run.alive_at_kill == WORKERS, f"the kill must land while every worker is busy: {run.errors}"
    assert set(run.statuses) <= {200}, sorted(set(run.statuses))
    assert len(run.completes) < TODOS, "the kill came after all the work was done"
    assert run.errors, "no request was cut off by the kill"

    # The image the crash left (opening it runs SQLite's WAL recovery, as the restarted server will).
    todos = check_no_half_written_todo(db_path)
    assert sorted(todos) == sorted(pushed), "every acknowledged push survived, and nothing else appeared"

    # Every acknowledged completion is done, with its attempt closed as completed.
    for todo_id, answer in run.completes.items():
        todo = todos[todo_id]
        assert todo["state"] == "done" and todo["outcome"] == "completed", (todo_id, todo)
        assert answer["attempt"] == len(todo["attempts"]), (todo_id, answer, todo)
        assert todo["attempts"][answer["attempt"] - 1]["outcome"] == "completed", (todo_id, todo)
    # Every acknowledged claim has its attempt row, held by this endpoint.
    for todo_id, claim in run.claims.items():
        attempts = todos[todo_id]["attempts"]
        assert len(attempts) >= claim["attempt"], (todo_id, claim, todos[todo_id])
        assert attempts[claim["attempt"] - 1]["endpoint_id"] == endpoint["id"], (todo_id, attempts)
        assert todos[todo_id]["state"] in ("claimed", "done"), (todo_id, todos[todo_id])
        assert attempts[claim["attempt"] - 1]["claimant"] == claim["claimant"], (todo_id, attempts)
    # Whatever the server committed without the worker hearing back is a whole claim or a whole completion.
    orphaned = [t for t, todo in todos.items() if todo["state"] == "claimed"]
    assert all(todos[t]["state"] == "pending" and not todos[t]["attempts"]
               for t in todos if t not in run.claims and todos[t]["state"] not in ("claimed", "done"))

    second = live_server("--ingest-rate", "0")
    # The restarted server keeps serving: the pending todos at once, the orphaned claims once their lease lapses.
    drained: set[str] = set()
    deadline = time.monotonic() + LEASE + 30
    with httpx.Client(base_url=second.url, headers=bearer(endpoint), timeout=30) as http:
        while time.monotonic() < deadline:
            r = http.post("/api/v1/todos/claim", json={"lease_seconds": 60, "wait_seconds": 1})
            assert r.status_code == 200, r.text
            if r.json().get("empty"):
                left = query(db_path, "SELECT count(*) FROM todos WHERE state <> 'done'")[0][0]
                if left == 0:
                    break
                continue
            claimed = r.json()
            done = http.post(f"/api/v1/todos/{claimed['todo']['id']}/complete",
                             json={"lease_token": claimed["lease_token"]})
            assert done.status_code == 200 and done.json()["state"] == "done", done.text
            drained.add(claimed["todo"]["id"])
    states = dict(query(db_path, "SELECT state, count(*) FROM todos GROUP BY state"))
    assert states == {"done": TODOS}, (states, log_tail(db_path))
    assert drained | {t for t, todo in todos.items() if todo["state"] == "done"} == set(pushed)
    final = check_no_half_written_todo(db_path)
    for todo_id in orphaned:
        outcomes = [a["outcome"] for a in final[todo_id]["attempts"]]
        assert outcomes[:-1] == ["lease_expired"] * (len(outcomes) - 1) and outcomes[-1] == "completed", \
            (todo_id, outcomes)
    for todo_id in run.completes:
        assert final[todo_id]["attempts"] == todos[todo_id]["attempts"], "an acknowledged completion ran again"


def test_sigterm_finishes_in_flight_requests_ends_streams_and_exits_0(db_path, live_server):
    server = live_server("--ingest-rate", "0")
    human, endpoint = principals(db_path)
    with httpx.Client(base_url=server.url, headers=bearer(endpoint), timeout=10) as http:
        pushed = http.post(f"/api/v1/endpoints/{endpoint['id']}/todos", headers=bearer(human),
                           json={"title": "finish me before the shutdown", "queue": "build"})
        assert pushed.status_code == 201, pushed.text
        claimed = http.post("/api/v1/todos/claim", json={}).json()
        assert claimed["todo"]["id"] == pushed.json()["id"]
        done = http.post(f"/api/v1/todos/{pushed.json()['id']}/complete", json={"lease_token": claimed["lease_token"]})
        assert done.status_code == 200 and done.json()["state"] == "done", done.text

    answers: dict = {}
    stream_open = threading.Event()

    def waiting_claim() -> None:
        try:
            r = httpx.post(f"{server.url}/api/v1/todos/claim", headers=bearer(endpoint), json={"wait_seconds": 5},
                           timeout=30)
            answers["claim"] = (r.status_code, r.text)
        except httpx.HTTPError as exc:
            answers["claim"] = exc

    def doorbell() -> None:
        try:
            with httpx.stream("GET", f"{server.url}/api/v1/doorbell", headers=bearer(endpoint),
                              timeout=httpx.Timeout(30)) as stream:
                answers["stream_status"] = stream.status_code
                for line in stream.iter_lines():
                    if line == ": connected":
                        stream_open.set()
            answers["stream"] = "ended"
        except httpx.HTTPError as exc:
            answers["stream"] = exc

    claimer = threading.Thread(target=waiting_claim, daemon=True)
    listener = threading.Thread(target=doorbell, daemon=True)
    listener.start()
    assert stream_open.wait(10), answers
    claimer.start()
    time.sleep(0.7)  # the claim is waiting for a ring by now
    assert claimer.is_alive(), answers

    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        pytest.fail("the server did not exit within 10 s of SIGTERM (an open stream or request held it)\n"
                    + log_tail(db_path))
    took = time.monotonic() - started
    claimer.join(timeout=10)
    listener.join(timeout=10)

    assert code == 0, (code, log_tail(db_path))
    assert took < 10
    status, text = answers["claim"] if isinstance(answers.get("claim"), tuple) else (None, answers.get("claim"))
    assert status == 200, f"the waiting claim got no complete answer: {text!r}"
    body = json.loads(text)
    assert body == {"empty": True} or "todo" in body, body
    assert answers.get("stream_status") == 200 and not listener.is_alive(), answers
    row = query(db_path, "SELECT state, outcome FROM todos WHERE id = ?", (pushed.json()["id"],))
    assert row == [("done", "completed")]
    assert_storage_intact(db_path)
