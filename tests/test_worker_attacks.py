"""The worker under attack (issue 35, items 1-14): real servers, real worker processes, real children.

The lanes, workers and children are tests/test_worker.py's (one `serve` for this module). Where the server must
misbehave (answer at once, grant no lease, answer garbage) a small server of ours plays it (OddServer), speaking the
claim, heartbeat and complete calls of the REST API and recording every request."""

from __future__ import annotations

import gzip
import json
import os
import pwd
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import test_worker
from test_worker import CHILD, SHELL_COMPLETE, alive, eventually

from switchboard.worker.park import LONGEST_PARK_SECONDS, PARK_FILE_BYTES, QuotaPark

site, lane, workers = test_worker.site, test_worker.lane, test_worker.workers  # the same fixtures, one server here

# A child that starts processes escaping its process group and session, each writing its pid to a file in
# payload["pids"], each ignoring SIGTERM, then sleeps (or exits at once with payload["exit_now"]).
ESCAPER = [sys.executable, "-c", r"""
import json, os, signal, sys, time
do = json.load(sys.stdin)["payload"]
def note(name):
    with open(os.path.join(do["pids"], name + ".tmp"), "w") as out:
        out.write(str(os.getpid()))
    os.replace(os.path.join(do["pids"], name + ".tmp"), os.path.join(do["pids"], name))
def escape(name, how):
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if how == "setsid":
            os.setsid()
        elif how == "setpgid":
            os.setpgid(0, 0)
        elif how in ("double_fork", "clean_env"):
            os.setsid()
            if os.fork():
                os._exit(0)  # the intermediate exits: the grandchild is an orphan
            if how == "clean_env":  # and it drops the environment that names its job
                note(name)
                os.execve("/bin/sleep", ["sleep", "120"], {})
        note(name)
        time.sleep(120)
        os._exit(0)
for name in ("setsid", "setpgid", "double_fork", "clean_env"):
    escape(name, name)
while len(os.listdir(do["pids"])) < 4:
    time.sleep(0.01)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if not do.get("exit_now"):
    time.sleep(120)
"""]
ESCAPEES = ("setsid", "setpgid", "double_fork", "clean_env")


def escapee_pids(directory: Path) -> dict[str, int]:
    eventually(lambda: all((directory / name).exists() for name in ESCAPEES), 10, "the escapees started")
    return {name: int((directory / name).read_text()) for name in ESCAPEES}


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- 1. nothing a job started outlives it ---------------------------------------------------------------------------

def test_processes_that_leave_the_jobs_group_and_session_end_within_a_third_of_the_lease_plus_10_s_of_a_cancel(
        lane, workers):
    pid_dir = lane.dir / "pids"
    pid_dir.mkdir()
    todo_id = lane.push({"pids": str(pid_dir)})
    worker = workers(lane, "--lease", "3", command=ESCAPER)
    pids = escapee_pids(pid_dir)
    assert all(alive(pid) for pid in pids.values())
    try:
        cancelled = time.monotonic()
        assert lane.act(todo_id, "cancel", reason="changed my mind").status_code == 200
        eventually(lambda: not any(alive(pid) for pid in pids.values()), 1 + 10 + 4,
                   "every process of the job ended")  # lease/3 + 10 s, and room for a busy host
        assert time.monotonic() - cancelled >= 9.5, "they ignore SIGTERM: the SIGKILL 10 s later ends them"
    finally:
        kill_all(pids.values())
    worker.logged("lease lost")
    assert worker.proc.poll() is None and worker.stop() == 0


def test_a_job_that_exits_leaves_nothing_running_and_timeouts_end_its_escapees_too(lane, workers):
    quick_dir, slow_dir = lane.dir / "quick", lane.dir / "slow"
    quick_dir.mkdir()
    slow_dir.mkdir()
    quick = lane.push({"pids": str(quick_dir), "exit_now": True})
    slow = lane.push({"pids": str(slow_dir)})
    worker = workers(lane, "--concurrency", "2", "--timeout", "3", command=ESCAPER)
    pids = {**{f"quick-{k}": v for k, v in escapee_pids(quick_dir).items()},
            **{f"slow-{k}": v for k, v in escapee_pids(slow_dir).items()}}
    try:
        assert lane.settled(quick, ("done",))["state"] == "done"
        todo = lane.settled(slow, ("pending",), seconds=30)
        assert todo["last_error"] == "timeout"
        eventually(lambda: not any(alive(pid) for pid in pids.values()), 5, "every process of both jobs ended")
    finally:
        kill_all(pids.values())
    assert worker.stop() == 0


def test_a_worker_killed_outright_takes_its_jobs_processes_along(lane, workers):
    pid_dir = lane.dir / "pids"
    pid_dir.mkdir()
    lane.push({"pids": str(pid_dir)})
    worker = workers(lane, "--lease", "3", command=ESCAPER)
    pids = escapee_pids(pid_dir)
    child = int(Path(f"/proc/{pids['setsid']}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
    try:
        worker.stop(signal.SIGKILL)
        # Everything that still names the job in its environment, wherever it moved; the one that cleared its
        # environment and left the tree is beyond finding once the worker is gone (the unit's cgroup ends it).
        ended = [child, pids["setsid"], pids["setpgid"], pids["double_fork"]]
        eventually(lambda: not any(alive(pid) for pid in ended), 5, "the killed worker's jobs ended")
    finally:
        kill_all([child, *pids.values()])


def test_sighup_is_a_shutdown_like_sigterm(lane, workers):
    pid_file = lane.dir / "child.pid"
    todo_id = lane.push({"sleep": {"1": 1.5}, "pid_file": str(pid_file),
                         "stdout": ['{"outcome": "complete", "result": "finished after the hangup"}']})
    worker = workers(lane, "--lease", "5", command=CHILD)
    eventually(pid_file.exists, 10, "the child started")
    assert worker.stop(signal.SIGHUP) == 0, worker.output()
    assert "stopping: no more claims" in worker.output()
    assert lane.todo(todo_id)["result"] == "finished after the hangup"


# -- 2. the child cannot read the worker's token -------------------------------------------------------------------

@pytest.fixture
def shared_tmp():
    """A directory every user may enter (job directories under pytest's private tmp_path could not be reached by
    the job's user)."""
    directory = tempfile.mkdtemp(prefix="sb-exec-user-", dir="/tmp")
    os.chmod(directory, 0o711)
    yield Path(directory)
    shutil.rmtree(directory, ignore_errors=True)


def test_with_exec_user_the_child_runs_as_that_user_and_cannot_read_the_token(lane, workers, shared_tmp):
    if os.geteuid() != 0:
        pytest.skip("--exec-user needs the worker to run as root")
    nobody = pwd.getpwnam("nobody")
    # The token where systemd puts a credential: a directory of its own, the file 0400, its path in
    # CREDENTIALS_DIRECTORY and on the worker's command line (which every process can read in /proc).
    credentials = shared_tmp / "credentials"
    credentials.mkdir(mode=0o755)
    token_file = credentials / "token"
    shutil.copy(lane.token_file, token_file)
    os.chmod(token_file, 0o400)
    probe = ["/bin/sh", "-c", """cat >/dev/null
token=$(tr '\\0' '\\n' < /proc/$PPID/cmdline | sed -n '/^--token-file$/{n;p;q}')
if cat "$token" >/dev/null 2>&1; then read=yes; else read=no; fi
printf '{"outcome": "complete", "result": {"uid": %s, "read_token": "%s", "token_path": "%s", "cwd_owner": %s,\
 "credentials": "%s", "home": "%s", "outcome_file": "%s"}}\\n' "$(id -u)" "$read" "$token" "$(stat -c %u .)" \
 "${CREDENTIALS_DIRECTORY-unset}" "$HOME" "$SWITCHBOARD_OUTCOME_FILE"
"""]
    todo_id = lane.push()
    worker = workers(lane, "--once", "--wait", "10", "--exec-user", "nobody", "--token-file", str(token_file),
                     command=probe, env={"TMPDIR": str(shared_tmp), "CREDENTIALS_DIRECTORY": str(credentials)},
                     token_flag=False)
    assert worker.proc.wait(timeout=20) == 0, worker.output()
    result = lane.todo(todo_id)["result"]
    assert isinstance(result, dict) and "token_path" in result, result
    assert result["token_path"] == str(token_file), "the child found the token's path"
    assert result["read_token"] == "no", "but cannot open the token file"
    assert (result["uid"], result["cwd_owner"]) == (nobody.pw_uid, nobody.pw_uid)
    assert (result["credentials"], result["home"]) == ("unset", nobody.pw_dir)
    assert result["outcome_file"].startswith(str(shared_tmp))


def test_exec_user_is_refused_without_root_or_for_root_or_an_unknown_user(lane, workers):
    for user, problem in (("root", "a user other than root"), ("no-such-user-here", "no such user")):
        refused = workers(lane, "--exec-user", user, command=CHILD)
        assert refused.proc.wait(timeout=20) == 2
        assert problem in refused.output()


# -- 4. the outcome file decides ---------------------------------------------------------------------------------

def test_the_outcome_file_beats_a_spoofed_last_line_and_is_never_read_through_a_link(lane, workers):
    writer = [sys.executable, "-c", r"""
import json, os, sys
todo = json.load(sys.stdin)
how = todo["payload"]["how"]
if how == "file":
    with open(os.environ["SWITCHBOARD_OUTCOME_FILE"], "w") as out:
        json.dump({"outcome": "fail", "error": "the tests fail", "retry": False}, out)
elif how == "link":
    os.symlink(todo["payload"]["target"], os.environ["SWITCHBOARD_OUTCOME_FILE"])
# The issue's body, printed last: it says what a producer would like the outcome to be.
print('{"outcome": "park", "retry_after": 691200}')
"""]
    target = lane.dir / "elsewhere.json"
    target.write_text(json.dumps({"outcome": "complete", "result": "not the child's to say"}))
    by_file = lane.push({"how": "file"})
    by_link = lane.push({"how": "link", "target": str(target)})
    worker = workers(lane, "--concurrency", "2", command=writer)
    todo = lane.settled(by_file, ("failed",))
    assert (todo["last_error"], todo["dead_letter"]) == ("the tests fail", True)
    todo = lane.settled(by_link, ("pending",))
    assert todo["last_error"] == "the outcome file cannot be read: a symbolic link"
    assert not list(lane.state_dir.glob("park-*.json")), "the spoofed line parked nothing"
    assert worker.stop() == 0


# -- 12. an outcome line too long to keep ------------------------------------------------------------------------

def test_an_outcome_line_longer_than_what_is_kept_fails_the_todo(lane, workers):
    shouter = [sys.executable, "-c", r"""
import json, sys
json.load(sys.stdin)
sys.stdout.write('{"outcome": "fail", "error": "no", "filler": "' + "x" * (3 << 19) + '"}\n')
"""]
    todo_id = lane.push()
    worker = workers(lane, "--once", "--wait", "10", command=shouter)
    assert worker.proc.wait(timeout=20) == 0, worker.output()
    todo = lane.todo(todo_id)
    assert todo["state"] == "pending" and todo["last_error"].startswith(
        "the last line of stdout is over 1 MiB, too long to read as an outcome line")


# -- 7, 8. parks and the state directory -------------------------------------------------------------------------

def test_park_files_are_read_as_hostile(tmp_path):
    park = QuotaPark(tmp_path, "group")
    now = time.time()
    for planted in ({"until": now + 30 * 86400, "parks": 1}, {"until": 10 ** 12, "parks": 1},
                    {"until": 10 ** 400, "parks": 2}):  # 30 days out, the year 33658, past any float
        park.path.write_text(json.dumps(planted))
        until = park.until(now)
        assert until is None or until <= now + LONGEST_PARK_SECONDS + 1, planted
    park.path.write_text('{"until": 100000000000000, "parks": 1}')
    assert park.until(now) == pytest.approx(now + LONGEST_PARK_SECONDS, abs=2), "the 8 days hold when read"
    for garbage in ('{"until": Infinity, "parks": 1}', '{"until": NaN, "parks": 1}', '{"until": 1e400, "parks": 1}',
                    '{"until": true, "parks": 1}', "[]", "[" * 100_000, '{"until": 5}'):
        park.path.write_text(garbage)
        assert park.until(now) is None, garbage
    # A huge file is not read: the first PARK_FILE_BYTES + 1 at most.
    with open(park.path, "wb") as out:
        out.truncate(100 << 20)
    assert park.until(now) is None
    # A FIFO does not block the reader; a link is not followed, for reading or for the lock.
    park.path.unlink()
    os.mkfifo(park.path)
    started = time.monotonic()
    assert park.until(now) is None and time.monotonic() - started < 1
    park.path.unlink()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"until": now + 3600, "parks": 1}))
    park.path.symlink_to(elsewhere)
    assert park.until(now) is None
    park.path.unlink()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    park.lock_path.symlink_to(victim)
    until = park.park(None, now)
    assert until > now and victim.read_text() == "precious" and not park.path.exists()
    assert PARK_FILE_BYTES < 100 << 20


def test_a_worker_starts_past_a_hostile_park_file_and_refuses_a_state_directory_others_can_write(lane, workers):
    lane.state_dir.mkdir(mode=0o700)
    # The year 10000 (which datetime cannot print): a park of 8 days at most, and the worker starts, logs it and
    # stops on SIGTERM.
    (lane.state_dir / "park-far.json").write_text(json.dumps({"until": 253_402_300_800 + 86400, "parks": 1}))
    far = workers(lane, "--quota-group", "far", command=CHILD)
    far.logged("quota group far parked until")
    logged_until = far.output().split("quota group far parked until ")[1].split()[0].rstrip(":")
    assert datetime.fromisoformat(logged_until) <= datetime.now(UTC) + timedelta(days=8, minutes=1)
    # A FIFO as the park file neither freezes a worker nor keeps it from its work.
    os.mkfifo(lane.state_dir / "park-fifo.json")
    todo_id = lane.push({"stdout": ['{"outcome": "complete", "result": "past the fifo"}']})
    fifo = workers(lane, "--quota-group", "fifo", command=CHILD)
    assert lane.settled(todo_id, ("done",))["result"] == "past the fifo"
    for worker in (far, fifo):
        stopped = time.monotonic()
        assert worker.stop() == 0 and time.monotonic() - stopped < 5

    os.chmod(lane.state_dir, 0o777)
    refused = workers(lane, command=CHILD)
    assert refused.proc.wait(timeout=20) == 2 and f"run chmod 700 {lane.state_dir}" in refused.output()
    os.chmod(lane.state_dir, 0o700)
    os.chown(lane.state_dir, pwd.getpwnam("nobody").pw_uid, -1)
    refused = workers(lane, command=CHILD)
    assert refused.proc.wait(timeout=20) == 2 and "not to this worker's user" in refused.output()
    os.chown(lane.state_dir, 0, -1)
    assert stat.S_IMODE(os.stat(lane.state_dir).st_mode) == 0o700


# -- 10, 11. a server that answers oddly, at once, or with no lease ----------------------------------------------

def a_todo(todo_id: str, lease_seconds: float, **fields) -> dict:
    now = datetime.now(UTC)
    return {"id": todo_id, "queue": "odd", "attempt": 1, "payload": None, "title": "t",
            "updated_at": now.isoformat(), "lease_expires_at": (now + timedelta(seconds=lease_seconds)).isoformat(),
            **fields}


class _OddHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests.append((time.monotonic(), self.path, body))
        status, headers, data = self.server.answer(self.path)
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **headers}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


class OddServer(ThreadingHTTPServer):
    """The worker's side of the REST API on a loopback port, answering claims from `claims` (then `empty`) and
    any other call with `{}`."""
    daemon_threads = True

    def __init__(self, claims: list[tuple[int, dict, bytes]], empty: tuple[int, dict, bytes]):
        super().__init__(("127.0.0.1", 0), _OddHandler)
        self.claims, self.empty, self.requests = list(claims), empty, []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def answer(self, path: str) -> tuple[int, dict, bytes]:
        if path.endswith("/todos/claim"):
            return self.claims.pop(0) if self.claims else self.empty
        return 200, {}, b"{}"

    def calls(self, suffix: str) -> list[tuple[float, str, bytes]]:
        return [r for r in self.requests if r[1].endswith(suffix)]

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def json_answer(value: object, status: int = 200, **headers: str) -> tuple[int, dict, bytes]:
    return status, headers, json.dumps(value).encode()


@pytest.fixture
def odd_server():
    servers: list[OddServer] = []

    def start(claims, empty=json_answer({"empty": True})) -> OddServer:
        servers.append(OddServer(claims, empty))
        return servers[-1]
    yield start
    for server in servers:
        server.stop()


def test_odd_server_answers_are_logged_and_tried_again_never_a_traceback(lane, workers, odd_server):
    odd = [[json_answer([1, 2, 3]), json_answer({"todo": "td_x", "lease_token": "t"}),
            json_answer({"todo": a_todo("td_badtime", 30, updated_at="yesterday"), "lease_token": "t"})],
           [json_answer({"todo": a_todo("../../endpoints", 30), "lease_token": "t"}),
            (302, {"Location": "http://127.0.0.1:1/"}, b'{"todo": {"id": "td_moved"}}'),
            (200, {"Content-Encoding": "gzip"}, b"\x1f\x8b\x08\x00garbled" * 100)],
           [(200, {}, b"[" * 5000 + b"]" * 5000), (200, {}, b'{"empty": NaN}'),
            json_answer({"todo": a_todo("td_nolease", -5), "lease_token": "t"})]]
    # One worker per server, each met by three odd answers and then a real todo (its backoff grows per answer).
    servers = [odd_server([*answers, json_answer({"todo": a_todo(f"td_good{n}", 30), "lease_token": f"lt_{n}"})])
               for n, answers in enumerate(odd)]
    started = [workers(lane, "--server", server.url, "--once", "--wait", "60", command=SHELL_COMPLETE)
               for server in servers]
    for n, (server, worker) in enumerate(zip(servers, started)):
        assert worker.proc.wait(timeout=60) == 0, worker.output()
        output = worker.output()
        assert "Traceback" not in output and output.count("answered oddly") == 3, output
        [(_, _, completed)] = server.calls(f"/todos/td_good{n}/complete")
        assert json.loads(completed)["lease_token"] == f"lt_{n}"
        assert [r[1] for r in server.requests if not r[1].endswith("/todos/claim")] == [
            f"/api/v1/todos/td_good{n}/complete"], "no call on a todo from an odd answer"


def test_a_server_that_answers_empty_at_once_or_grants_no_lease_is_not_hammered(lane, workers, odd_server):
    empty = odd_server([])
    eager = workers(lane, "--server", empty.url, command=SHELL_COMPLETE)
    eventually(lambda: empty.calls("/todos/claim"), 20, "the first claim")
    time.sleep(4)
    claims = len(empty.calls("/todos/claim"))
    assert 2 <= claims <= 9, f"{claims} claims in 4 s against a server that answers empty at once"
    assert eager.stop() == 0

    no_lease = odd_server([json_answer({"todo": a_todo("td_nolease", 0), "lease_token": "lt"})])
    sleeper = [sys.executable, "-c", "import sys, time; sys.stdin.read(); time.sleep(3)"]
    holder = workers(lane, "--server", no_lease.url, command=sleeper)
    eventually(lambda: no_lease.calls("/todos/td_nolease/complete"), 15, "the job completed")
    beats = len(no_lease.calls("/todos/td_nolease/heartbeat"))
    assert 1 <= beats <= 8, f"{beats} heartbeats in 3 s for a lease of 0 s"
    assert holder.stop() == 0


def test_a_servers_answer_is_capped_after_decompression(lane, workers, odd_server):
    bomb = gzip.compress(b" " * (64 << 20), compresslevel=9)  # 64 MiB of JSON whitespace, 64 KiB on the wire
    server = odd_server([(200, {"Content-Encoding": "gzip"}, bomb)])
    worker = workers(lane, "--server", server.url, "--once", "--wait", "5", command=SHELL_COMPLETE)
    assert worker.proc.wait(timeout=30) == 0, worker.output()
    assert "answered oddly (/todos/claim: an answer over 32 MiB)" in worker.output()


# -- 13. proxies and credentials in --server ---------------------------------------------------------------------

def test_a_loopback_server_is_never_reached_through_a_proxy_and_server_urls_with_a_password_are_refused(
        lane, workers, odd_server):
    proxy = odd_server([])  # it records whatever reaches it
    todo_id = lane.push({"stdout": ['{"outcome": "complete", "result": "direct"}']})
    worker = workers(lane, "--once", "--wait", "10", command=CHILD,
                     env={"HTTP_PROXY": proxy.url, "HTTPS_PROXY": proxy.url, "ALL_PROXY": proxy.url,
                          "http_proxy": proxy.url, "all_proxy": proxy.url, "NO_PROXY": "", "no_proxy": ""})
    assert worker.proc.wait(timeout=20) == 0, worker.output()
    assert lane.todo(todo_id)["result"] == "direct"
    assert proxy.requests == [], "the proxy saw the endpoint token"

    with_password = lane.server.url.replace("http://", "http://worker:hunter2secret@")
    refused = workers(lane, "--server", with_password, command=CHILD)
    assert refused.proc.wait(timeout=20) == 2
    assert "user name or password is refused" in refused.output() and "hunter2secret" not in refused.output()
