"""The worker (SPEC section 15, issue 28): a real server, real worker processes, real children.

One `serve` for the module; each test works a lane of its own: an endpoint with a queue of its own, its token in
a file of mode 0600, and a state directory for quota parks. Workers run as `worker_command()` processes. Most
children are CHILD, a Python one-liner that does what its todo's payload says (print these lines, sleep this long
on that attempt, exit so), so a test's todos script the scene; bulk work uses a shell one-liner.

Leases are 2-3 s, so a heartbeat comes every second and a lost lease shows within about one."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, LiveServer, cli
from helpers import TLS, query

from switchboard.worker.park import (
    FIRST_PARK_SECONDS,
    LONGEST_BACKOFF_SECONDS,
    LONGEST_PARK_SECONDS,
    SHORTEST_PARK_SECONDS,
    QuotaPark,
)


def worker_command() -> list[str]:
    """How the tests start `switchboard worker`: the launcher a checkout runs, as the README shows."""
    return [sys.executable, str(ROOT / "switchboard.py"), "worker"]


# The child most tests run: it reads its todo from stdin and does what the payload says.
CHILD = [sys.executable, "-c", r"""
import json, os, signal, sys, time
do = json.load(sys.stdin)["payload"] or {}
if do.get("ignore_term"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if do.get("pid_file"):
    with open(do["pid_file"] + ".tmp", "w") as out:
        out.write(str(os.getpid()))
    os.replace(do["pid_file"] + ".tmp", do["pid_file"])
for line in do.get("stderr", []):
    print(line, file=sys.stderr, flush=True)
time.sleep(do.get("sleep", {}).get(os.environ["SWITCHBOARD_ATTEMPT"], 0))
if do.get("park_once") and not os.path.exists(do["park_once"]):
    open(do["park_once"], "w").close()
    print(json.dumps({"outcome": "park", "retry_after": do["retry_after"]}))
    sys.exit(0)
for line in do.get("stdout", []):
    print(line)
sys.exit(do.get("exit", 0))
"""]

# A child that completes at once with its todo id and its worker's name.
SHELL_COMPLETE = ["sh", "-c", "cat >/dev/null; printf '{\"outcome\": \"complete\", \"result\": {\"todo\": \"%s\","
                              " \"worker\": \"%s\"}}\\n' \"$SWITCHBOARD_TODO_ID\" \"$SWITCHBOARD_WORKER\""]


def eventually(check: Callable[[], object], seconds: float, what: str) -> object:
    deadline = time.monotonic() + seconds
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead but not yet reaped by whoever inherited it, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@dataclass
class Lane:
    """An endpoint and its one queue, with the human who owns it and a directory for its files."""
    server: LiveServer
    human_token: str
    endpoint_id: str
    token: str
    queue: str
    dir: Path

    @property
    def token_file(self) -> Path:
        return self.dir / "endpoint.token"

    @property
    def state_dir(self) -> Path:
        return self.dir / "state"

    def as_human(self) -> httpx.Client:
        """A client of the REST API with the human's token."""
        return httpx.Client(base_url=self.server.url, headers={"Authorization": f"Bearer {self.human_token}"},
                            timeout=10, verify=TLS)

    def push(self, payload: object = None, title: str = "work") -> str:
        with self.as_human() as http:
            r = http.post(f"/api/v1/endpoints/{self.endpoint_id}/todos",
                          json={"title": title, "queue": self.queue, "payload": payload})
        assert r.status_code == 201, r.text
        return r.json()["id"]

    def todo(self, todo_id: str) -> dict:
        with self.as_human() as http:
            r = http.get(f"/api/v1/todos/{todo_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def act(self, todo_id: str, action: str, **body) -> httpx.Response:
        with self.as_human() as http:
            return http.post(f"/api/v1/todos/{todo_id}/{action}", json=body)

    def board(self, path: str) -> str:
        """A Board page as the human sees it, signed in."""
        with httpx.Client(base_url=self.server.url, headers={"Origin": self.server.url}, timeout=10) as browser:
            signed_in = browser.post("/board/login", data={"token": self.human_token}, follow_redirects=False)
            assert signed_in.status_code == 303, signed_in.text
            page = browser.get(path)
        assert page.status_code == 200, page.text
        return page.text

    def settled(self, todo_id: str, states: tuple[str, ...], seconds: float = 15) -> dict:
        """The todo once it was claimed and is in one of `states` with no attempt open."""
        def check() -> dict | None:
            todo = self.todo(todo_id)
            ended = todo["attempts"] and all(a["ended_at"] is not None for a in todo["attempts"])
            return todo if todo["state"] in states and ended else None
        return eventually(check, seconds, f"todo {todo_id} in {states}")


class WorkerProcess:
    """A worker process of a lane; its stdout and stderr go to one file."""
    numbers = itertools.count(1)

    def __init__(self, lane: Lane, *flags: str, command: list[str], env: dict | None = None,
                 token_flag: bool = True):
        self.lane = lane
        self.log_path = lane.dir / f"worker-{next(self.numbers)}.log"
        args = [*worker_command(), "--server", lane.server.url, "--state-dir", str(lane.state_dir)]
        if token_flag:
            args += ["--token-file", str(lane.token_file)]
        environment = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
        # Job directories under the test's own: a killed worker leaves its job's behind.
        environment["TMPDIR"] = str(lane.dir)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([*args, *flags, "--exec", "--", *command], stdout=log,
                                         stderr=subprocess.STDOUT, cwd=ROOT, env={**environment, **(env or {})})

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def logged(self, text: str, seconds: float = 10) -> None:
        eventually(lambda: text in self.output(), seconds, f"worker logs {text!r} (its log: {self.log_path})")

    def job_lines(self) -> list[dict]:
        """The one line per job of a worker run with --log-format json."""
        lines = [json.loads(line) for line in self.output().splitlines()]
        return [line for line in lines if "outcome" in line]

    def stop(self, sig: int = signal.SIGTERM, seconds: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=seconds)


@dataclass
class Site:
    """A running server and the human whose endpoints the lanes are."""
    server: LiveServer
    human_token: str


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    db_path = str(tmp_path_factory.mktemp("worker") / "switchboard.db")
    code, human = cli(db_path, "human", "add", "alice")
    assert code == 0, human
    server = LiveServer(db_path)
    yield Site(server, human["token"])
    server.stop()


def make_lane(server: LiveServer, human_token: str, directory: Path) -> Lane:
    name = f"lane-{os.urandom(4).hex()}"
    r = httpx.post(f"{server.url}/api/v1/endpoints", headers={"Authorization": f"Bearer {human_token}"},
                   json={"name": name, "queues": [name]}, timeout=10, verify=TLS)
    assert r.status_code == 201, r.text
    made = r.json()
    lane = Lane(server, human_token, made["id"], made["token"], name, directory)
    fd = os.open(lane.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(lane.token + "\n")
    return lane


@pytest.fixture
def lane(site, tmp_path) -> Lane:
    return make_lane(site.server, site.human_token, tmp_path)


@pytest.fixture
def workers():
    """Start workers (`workers(lane, *flags, command=…)`); at the end, any still running is killed, and no
    worker's output may hold its endpoint's token."""
    started: list[WorkerProcess] = []

    def start(lane: Lane, *flags: str, **options) -> WorkerProcess:
        worker = WorkerProcess(lane, *flags, **options)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait()
        assert worker.lane.token not in worker.output()


def test_a_todo_completes_with_the_childs_result_and_the_child_sees_only_what_it_should(lane, workers):
    reporter = [sys.executable, "-c", r"""
import json, os, stat, sys
todo = json.load(sys.stdin)
open("scratch.txt", "w").write("left behind")
print("looking around", file=sys.stderr)
print("some output first")
print(json.dumps({"outcome": "complete", "summary": "looked around", "result": {
    "todo": todo, "argv": sys.argv, "cwd": os.getcwd(), "cwd_mode": stat.S_IMODE(os.stat(".").st_mode),
    "env": dict(os.environ), "own_group": os.getpgrp() == os.getpid()}}))
"""]
    payload = {"note": "PRODUCER-TEXT from the webhook"}
    todo_id = lane.push(payload, title="PRODUCER-TITLE")
    # The token file given by environment (SWITCHBOARD_<FLAG>), which the child must not inherit either; nor
    # systemd's credentials directory, nor any other setting of the worker's own that names a secret.
    worker = workers(lane, "--once", "--wait", "10", "--name", "lane-worker", "--log-format", "json",
                     command=reporter, token_flag=False,
                     env={"SWITCHBOARD_TOKEN_FILE": str(lane.token_file), "CREDENTIALS_DIRECTORY": str(lane.dir),
                          "SWITCHBOARD_FORGE_TOKEN_FILE": str(lane.token_file), "OPERATOR_SETTING": "for the job"})
    assert worker.proc.wait(timeout=20) == 0, worker.output()

    todo = lane.todo(todo_id)
    assert todo["state"] == "done" and todo["outcome"] == "completed"
    result = todo["result"]
    assert result["todo"]["id"] == todo_id and result["todo"]["payload"] == payload
    assert result["todo"]["title"] == "PRODUCER-TITLE"
    env = result["env"]
    assert (env["SWITCHBOARD_TODO_ID"], env["SWITCHBOARD_QUEUE"], env["SWITCHBOARD_ATTEMPT"],
            env["SWITCHBOARD_WORKER"]) == (todo_id, lane.queue, "1", "lane-worker")
    assert not [name for name in env if name.startswith("SWITCHBOARD_TOKEN")]
    assert "CREDENTIALS_DIRECTORY" not in env and "SWITCHBOARD_FORGE_TOKEN_FILE" not in env
    assert str(lane.token_file) not in json.dumps(env) and env["OPERATOR_SETTING"] == "for the job"
    assert env["SWITCHBOARD_OUTCOME_FILE"] == os.path.join(result["cwd"], ".switchboard-outcome.json")
    for text in (lane.token, "PRODUCER"):
        assert text not in json.dumps(env) and text not in json.dumps(result["argv"])
    assert result["cwd_mode"] == 0o700 and result["cwd"] != str(ROOT)
    assert not os.path.exists(result["cwd"]), "the job's directory is removed afterwards"
    assert result["own_group"], "the child leads a process group of its own"
    assert "error" not in worker.job_lines()[0]

    [attempt] = todo["attempts"]
    assert (attempt["claimant"], attempt["outcome"], attempt["summary"]) == ("lane-worker", "completed",
                                                                             "looked around")
    [line] = worker.job_lines()
    assert (line["todo"], line["queue"], line["outcome"], line["level"]) == (todo_id, lane.queue, "complete", "info")
    assert 0 <= line["seconds"] < 10 and todo_id in line["event"]
    assert lane.token not in worker.output()


def test_once_with_nothing_to_do_waits_then_exits(lane, workers):
    started = time.monotonic()
    worker = workers(lane, "--once", "--wait", "1", command=CHILD)
    assert worker.proc.wait(timeout=20) == 0, worker.output()
    assert time.monotonic() - started >= 1


def test_a_failing_childs_stderr_becomes_the_error_and_a_timeout_kills_the_child(lane, workers):
    stderr_tail = lane.push({"stdout": ["half done"], "stderr": ["compiling", "error: disk on fire"], "exit": 3})
    silent = lane.push({"exit": 4})
    pid_file = lane.dir / "slow.pid"
    slow = lane.push({"sleep": {"1": 60}, "pid_file": str(pid_file)})
    worker = workers(lane, "--concurrency", "3", "--timeout", "2", command=CHILD)

    expected = {stderr_tail: "compiling\nerror: disk on fire", silent: "exit 4", slow: "timeout"}
    for todo_id, error in expected.items():
        todo = lane.settled(todo_id, ("pending",))
        assert todo["last_error"] == error and todo["attempt"] == 1, todo
        assert [a["outcome"] for a in todo["attempts"]] == ["failed"]
    assert not alive(int(pid_file.read_text())), "the timed-out child was killed"
    assert worker.stop() == 0
    # The job's log line says why it failed: the error's first line.
    output = worker.output()
    assert f"todo {stderr_tail} queue {lane.queue} outcome fail in" in output and ": compiling\n" in output
    assert f"todo {slow} queue {lane.queue} outcome timeout in" in output and "s: timeout\n" in output


def test_the_childs_outcome_line_decides(lane, workers):
    def says(**outcome) -> dict:
        return {"stdout": ["working…", json.dumps(outcome)]}

    asks = lane.push(says(outcome="needs_input", question="which branch?"))
    blocked = lane.push(says(outcome="block", reason="waiting on the network"))
    gives_up = lane.push(says(outcome="fail", error="not mine to do", retry=False))
    released = lane.push(says(outcome="release"))
    garbled = lane.push(says(outcome="complete", verdict="fine"))
    no_outcome = lane.push({"stdout": ['{"verdict": "fine"}', ""]})
    worker = workers(lane, "--concurrency", "4", command=CHILD)

    assert lane.settled(asks, ("needs_input",))["state"] == "needs_input"
    assert lane.settled(blocked, ("blocked",))["state"] == "blocked"
    todo = lane.settled(gives_up, ("failed",))
    assert todo["dead_letter"] and todo["last_error"] == "not mine to do"
    todo = lane.settled(garbled, ("pending",))
    assert todo["last_error"] == "the outcome line is not valid: verdict: Extra inputs are not permitted"
    todo = lane.settled(no_outcome, ("done",))
    assert todo["result"] == {"output": '{"verdict": "fine"}\n\n'}, "exit 0 without an outcome: stdout's tail"
    eventually(lambda: "released" in [a["outcome"] for a in lane.todo(released)["attempts"]], 10, "a release")
    assert worker.stop() == 0


def test_exit_75_parks_the_quota_group_on_the_host_while_another_group_drains_the_queue(lane, workers):
    todo_id = lane.push({"exit": 75})
    parked_at = time.time()
    first = workers(lane, "--quota-group", "provider-a", "--name", "first", command=CHILD)
    todo = lane.settled(todo_id, ("pending",))
    assert todo["attempt"] == 0, "a park releases the todo: its attempt is refunded"
    assert [(a["claimant"], a["outcome"]) for a in todo["attempts"]] == [("first", "released")]
    first.logged("quota group provider-a parked until")
    park = json.loads((lane.state_dir / "park-provider-a.json").read_text())
    assert park["parks"] == 1 and abs(park["until"] - (parked_at + FIRST_PARK_SECONDS)) < 10

    # Another worker of the group on this host (or the first one restarted) reads the park and claims nothing.
    second = workers(lane, "--quota-group", "provider-a", "--name", "second", command=SHELL_COMPLETE)
    second.logged("quota group provider-a parked until")
    time.sleep(1.5)
    assert [a["claimant"] for a in lane.todo(todo_id)["attempts"]] == ["first"]

    other = workers(lane, "--quota-group", "provider-b", "--name", "other", command=SHELL_COMPLETE)
    todo = lane.settled(todo_id, ("done",))
    assert [(a["claimant"], a["outcome"]) for a in todo["attempts"]] == [("first", "released"),
                                                                         ("other", "completed")]
    assert todo["result"] == {"todo": todo_id, "worker": "other"}
    for worker in (first, second, other):
        assert worker.stop() == 0


def test_a_park_of_a_second_lasts_a_minute_then_the_worker_claims_again(lane, workers):
    todo_id = lane.push({"park_once": str(lane.dir / "parked"), "retry_after": 1,
                         "stdout": ['{"outcome": "complete", "result": "after the park"}']})
    parked_at = time.time()
    worker = workers(lane, "--quota-group", "provider-a", command=CHILD)
    worker.logged("quota group provider-a parked until")
    park_file = lane.state_dir / "park-provider-a.json"
    park = json.loads(park_file.read_text())
    assert 59 <= park["until"] - parked_at <= 65, "a park lasts at least a minute, whatever the outcome says"
    time.sleep(2.5)  # the worker reads the park file every 2 s: it still holds
    assert lane.todo(todo_id)["state"] == "pending"
    # Another worker of the group ends the park early (as the minute passing would): this one claims again.
    park_file.write_text(json.dumps({"until": time.time(), "parks": 1}))
    todo = lane.settled(todo_id, ("done",))
    assert [a["outcome"] for a in todo["attempts"]] == ["released", "completed"]
    assert todo["result"] == "after the park"
    assert "the park is over" in worker.output()
    assert worker.stop() == 0


def test_parks_double_up_to_six_hours_never_pass_eight_days_and_a_served_job_starts_over(tmp_path):
    park = QuotaPark(tmp_path, "provider")
    now = 1_000_000.0
    assert park.until(now) is None
    assert park.park(None, now) == now + FIRST_PARK_SECONDS
    assert park.park(None, now + 1) == now + FIRST_PARK_SECONDS, "a park already running is not doubled"
    now += FIRST_PARK_SECONDS
    assert park.until(now) is None
    assert park.park(None, now) == now + 2 * FIRST_PARK_SECONDS
    for _ in range(10):
        now = park.until(now) or now
        until = park.park(None, now)
    assert until == now + LONGEST_BACKOFF_SECONDS
    assert park.park(30 * 86400, until) == until + LONGEST_PARK_SECONDS
    park.served(until + 1)
    assert park.until(until + 1) is not None, "a job that started before the park does not lift it"
    now = park.until(until + 1)
    park.served(now)
    assert park.park(None, now) == now + FIRST_PARK_SECONDS
    assert park.park(5, now + FIRST_PARK_SECONDS) == now + FIRST_PARK_SECONDS + SHORTEST_PARK_SECONDS
    now = park.until(now + FIRST_PARK_SECONDS)
    assert park.park(0, now) == now + SHORTEST_PARK_SECONDS, "Retry-After: 0 waits a minute, not 0 s"
    now += SHORTEST_PARK_SECONDS
    assert park.park(-3600, now) == now + SHORTEST_PARK_SECONDS, "nor a date in the past"


def test_cancelling_a_running_todo_kills_its_child_within_a_third_of_the_lease_plus_10_s(lane, workers):
    pid_file = lane.dir / "child.pid"
    todo_id = lane.push({"ignore_term": True, "sleep": {"1": 60}, "pid_file": str(pid_file),
                         "stderr": ["step 1 of 3: fetching"]})
    worker = workers(lane, "--lease", "3", "--name", "deployer", command=CHILD)
    eventually(pid_file.exists, 10, "the child started")
    pid = int(pid_file.read_text())
    # The heartbeat's note is the child's last stderr line; the Board's queues page shows it beside the claimant.
    eventually(lambda: lane.todo(todo_id)["attempts"][0]["summary"] == "step 1 of 3: fetching", 5, "the note")
    assert "deployer" in lane.board("/board/queues") and "step 1 of 3: fetching" in lane.board("/board/queues")

    cancelled = time.monotonic()
    assert lane.act(todo_id, "cancel", reason="changed my mind").status_code == 200
    eventually(lambda: not alive(pid), 1 + 10 + 4, "the child killed")  # lease/3 + 10 s, and room for a busy host
    took = time.monotonic() - cancelled
    assert took >= 9.5, f"{took:.1f} s: this child ignores SIGTERM, so it ends by the SIGKILL 10 s later"
    worker.logged("lease lost")
    todo = lane.todo(todo_id)
    assert todo["state"] == "cancelled"
    assert [h["actor"].split(":")[0] for h in todo["history"]][-1] == "human", "nothing reported after the cancel"
    assert worker.proc.poll() is None, "the worker goes on"
    assert worker.stop() == 0


def test_a_worker_that_cannot_reach_the_server_kills_the_child_when_the_lease_would_lapse(tmp_path, workers):
    db_path = str(tmp_path / "own.db")
    _, human = cli(db_path, "human", "add", "bob")
    own_server = LiveServer(db_path)
    try:
        lane = make_lane(own_server, human["token"], tmp_path)
        pid_file = tmp_path / "child.pid"
        lane.push({"sleep": {"1": 60}, "pid_file": str(pid_file)})
        worker = workers(lane, "--lease", "3", command=CHILD)
        eventually(pid_file.exists, 10, "the child started")
        pid = int(pid_file.read_text())
    finally:
        own_server.stop(signal.SIGKILL)
    gone = time.monotonic()
    eventually(lambda: not alive(pid), 3 + 4, "the child killed as the lease lapses")
    assert time.monotonic() - gone >= 1, "the worker kept trying while the lease held"
    worker.logged("unreachable")
    assert worker.stop() == 0


def test_sigterm_lets_a_running_job_finish_and_releases_one_that_outlasts_the_lease(lane, workers):
    quick_pid, slow_pid = lane.dir / "quick.pid", lane.dir / "slow.pid"
    quick = lane.push({"sleep": {"1": 1.5}, "pid_file": str(quick_pid),
                       "stdout": ['{"outcome": "complete", "result": "finished in time"}']})
    slow = lane.push({"sleep": {"1": 60}, "pid_file": str(slow_pid)})
    worker = workers(lane, "--lease", "3", "--concurrency", "2", command=CHILD)
    eventually(lambda: quick_pid.exists() and slow_pid.exists(), 10, "both children started")
    stopped = time.monotonic()
    assert worker.stop(signal.SIGTERM) == 0, worker.output()
    assert time.monotonic() - stopped < 3 + 4

    assert lane.todo(quick)["state"] == "done" and lane.todo(quick)["result"] == "finished in time"
    todo = lane.todo(slow)
    assert todo["state"] == "pending" and todo["attempt"] == 0, "released, its attempt refunded"
    assert [a["outcome"] for a in todo["attempts"]] == ["released"]
    assert not alive(int(slow_pid.read_text()))


def test_kill_9_of_the_worker_loses_nothing(lane, workers):
    pid_file = lane.dir / "orphan.pid"
    todo_id = lane.push({"sleep": {"1": 30}, "pid_file": str(pid_file),
                         "stdout": ['{"outcome": "complete", "result": "second time lucky"}']})
    crashed = workers(lane, "--lease", "2", "--name", "crashed", command=CHILD)
    eventually(pid_file.exists, 10, "the child started")
    orphan = int(pid_file.read_text())
    try:
        crashed.stop(signal.SIGKILL)
        # The worker's job watcher ends the child: it does not outlive its worker (work it did would be lost).
        eventually(lambda: not alive(orphan), 5, "the killed worker's child ended")
        workers(lane, "--lease", "2", "--name", "survivor", command=CHILD)
        todo = lane.settled(todo_id, ("done",))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(orphan, signal.SIGKILL)
    assert [(a["claimant"], a["outcome"]) for a in todo["attempts"]] == [("crashed", "lease_expired"),
                                                                         ("survivor", "completed")]
    assert todo["result"] == "second time lucky"


def test_a_token_file_others_can_read_is_refused(lane, workers):
    os.chmod(lane.token_file, 0o640)
    refused = workers(lane, command=CHILD)
    assert refused.proc.wait(timeout=20) == 2
    assert f"chmod 600 {lane.token_file}" in refused.output()
    assert stat.S_IMODE(os.stat(lane.token_file).st_mode) == 0o640, "the worker changes nothing itself"

    missing = workers(lane, command=CHILD, token_flag=False)
    assert missing.proc.wait(timeout=20) == 2
    assert "--token-file" in missing.output()


def test_a_worker_whose_endpoint_is_revoked_stops_with_exit_1(lane, workers):
    with lane.as_human() as http:
        assert http.post(f"/api/v1/endpoints/{lane.endpoint_id}/revoke").status_code == 200
    worker = workers(lane, "--concurrency", "2", command=CHILD)
    assert worker.proc.wait(timeout=20) == 1
    assert "the server refused the claim: 401" in worker.output()


def test_two_workers_with_concurrency_4_complete_200_todos_each_exactly_once(lane, workers):
    crew = [workers(lane, "--concurrency", "4", "--name", f"crew-{n}", "--log-format", "json",
                    command=SHELL_COMPLETE) for n in (1, 2)]
    with lane.as_human() as http:
        pushed = []
        for n in range(200):
            r = http.post(f"/api/v1/endpoints/{lane.endpoint_id}/todos", json={"title": f"t{n}", "queue": lane.queue})
            assert r.status_code == 201, r.text
            pushed.append(r.json()["id"])

        def done() -> list[dict] | None:
            todos = http.get("/api/v1/todos", params={"queue": lane.queue, "state": "done", "limit": 200}).json()
            return todos["todos"] if len(todos["todos"]) == 200 else None
        finished = eventually(done, 60, "200 todos done")
    assert sorted(t["id"] for t in finished) == sorted(pushed)
    assert all(t["result"]["todo"] == t["id"] and t["attempt"] == 1 for t in finished)
    attempts = query(lane.server.db_path, "SELECT todo_id, count(*), min(outcome), max(outcome) FROM attempts"
                     " WHERE endpoint_id = ? GROUP BY todo_id", (lane.endpoint_id,))
    assert len(attempts) == 200 and all(row[1:] == (1, "completed", "completed") for row in attempts)
    for worker in crew:
        assert worker.stop() == 0
    jobs = [line["todo"] for worker in crew for line in worker.job_lines()]
    assert sorted(jobs) == sorted(pushed), "one log line per job"


def test_a_completion_claims_the_slots_next_todo_in_the_same_call(lane, workers):
    """A slot whose job completed asks for its next todo in the completion itself (complete's `claim_next`): each
    claim after the first is made in the transaction that ended the attempt before it, and a failed job's slot
    claims as before."""
    pushed = [lane.push({"exit": 1 if n == 4 else 0}, title=f"t{n}") for n in range(8)]
    worker = workers(lane, "--concurrency", "1", "--name", "chain", command=CHILD)
    for todo_id in pushed:
        lane.settled(todo_id, ("done", "pending"), seconds=30)
    assert worker.stop() == 0
    attempts = query(lane.server.db_path, "SELECT todo_id, claimed_at, ended_at, outcome, claimant FROM attempts"
                     " WHERE endpoint_id = ? ORDER BY claimed_at, seq", (lane.endpoint_id,))
    assert [row[0] for row in attempts] == pushed and {row[4] for row in attempts} == {"chain"}
    chained = [attempts[n][1] == attempts[n - 1][2] for n in range(1, len(attempts))]
    assert attempts[4][3] == "failed" and chained == [True, True, True, True, False, True, True]
