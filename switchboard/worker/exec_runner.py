"""`--exec -- CMD [ARG …]` (SPEC sections 15 and 16): a child process per todo.

The child gets the claimed todo as JSON on stdin, its ids in the environment (none of the worker's own
SWITCHBOARD_* settings, nor systemd's CREDENTIALS_DIRECTORY: they name the worker's secrets), a fresh private
working directory removed afterwards, and a session of its own. With `--exec-user USER` (the worker runs as root)
it runs as USER, in a directory USER owns, and cannot read the worker's token. Producer text reaches it only on
stdin. Its outcome is the JSON object it wrote to $SWITCHBOARD_OUTCOME_FILE when it wrote one, else its last
non-empty stdout line when that is a JSON object naming an outcome, else its exit status: 0 completes with the
stdout tail, 75 parks, anything else fails with the stderr tail.

Nothing a job started outlives the job. The worker is a child subreaper, so a process that leaves the child's
tree (a double fork, a parent that exits) is reparented to the worker rather than to init; and a job's processes
are found, whatever session or group they moved to, as the child's descendants (the kernel's
/proc/PID/task/TID/children lists) and as the processes reparented to the worker whose environment
(/proc/PID/environ) names the job's SWITCHBOARD_TODO_ID, or names no running job at all (one that cleared its
environment cannot be told apart, so it ends with the first job that ends). When the child exits, or the job is
stopped (SIGTERM to all of them, SIGKILL KILL_GRACE_SECONDS later), every one left is killed and the worker reaps
the ones it inherited. A worker killed outright (SIGKILL, the OOM killer) takes its jobs along too: a watcher
process it starts once (JOB_WATCHER, a few MiB) learns each child's pid as it starts and, when the worker's end of
its pipe closes, kills every running job's child, its group, its descendants and every process whose environment
names one of those jobs. (A parent-death signal set in each child would need a preexec_fn, which costs every job
start a fork of the whole worker instead of a vfork: 2-3 ms or more, where a start is about 3 ms.)"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError

from switchboard.worker.job import OUTCOME_KINDS, OUTCOMES, Complete, ConfigError, Fail, Job, Outcome, Park
from switchboard.worker.park import open_regular
from switchboard.worker.tracing import valid_traceparent

log = logging.getLogger("switchboard.worker")

KILL_GRACE_SECONDS = 10.0  # SIGTERM to a job's processes, SIGKILL this much later
STDOUT_KEPT_BYTES = 1 << 20  # a child's stdout tail: room for an outcome line with a whole result (<= 64 KiB)
OUTCOME_FILE_NAME = ".switchboard-outcome.json"  # in the job's directory, named by SWITCHBOARD_OUTCOME_FILE
OUTCOME_FILE_BYTES = 1 << 20
OUTPUT_BYTES = 4096  # `result.output` of a child that exits 0 without an outcome line
ERROR_BYTES = 2048  # `error` of a child that fails without one: its stderr tail
NOTE_CHARS = 200  # a heartbeat's progress note: the child's last stderr line, cut
EXIT_PARK = 75  # EX_TEMPFAIL: the child hit a quota wall
END_JOB_ROUNDS = 40  # rounds of "find what is left of the job, kill it", about 3 s in all
PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)

# The watcher (run as `python -I -S -c JOB_WATCHER`, standard library only): reads "+ PID TODO_ID" and "- PID"
# lines from the worker; at the end of its input (the worker exited or was killed) it kills what is left of every
# job it was told of, twice over (a process may fork while it is being found).
JOB_WATCHER = r"""
import os, signal, sys
def children(pid):
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as listing:
                found += [int(child) for child in listing.read().split()]
        except OSError:
            pass
    return found
def marker(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            entries = environ.read(1 << 20).split(b"\0")
    except OSError:
        return None
    return next((e[20:].decode(errors="replace") for e in entries if e.startswith(b"SWITCHBOARD_TODO_ID=")), None)
jobs = {}
for line in sys.stdin.buffer:
    parts = line.split()
    if len(parts) == 3 and parts[0] == b"+":
        jobs[int(parts[1])] = parts[2].decode(errors="replace")
    elif len(parts) == 2 and parts[0] == b"-":
        jobs.pop(int(parts[1]), None)
for _ in range(2 if jobs else 0):
    todos = set(jobs.values())
    roots = list(jobs) + [int(n) for n in os.listdir("/proc") if n.isdigit() and marker(int(n)) in todos]
    seen = {os.getpid()}
    while roots:
        pid = roots.pop()
        if pid not in seen:
            seen.add(pid)
            roots += children(pid)
            for kill, target in ((os.killpg, pid), (os.kill, pid)) if pid in jobs else ((os.kill, pid),):
                try:
                    kill(target, signal.SIGKILL)
                except OSError:
                    pass
"""


def prctl(option: int, value: int) -> None:
    if _libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def become_subreaper() -> None:
    """Orphans among the worker's descendants are reparented to the worker, not to init, so it can end them."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def start_watcher() -> subprocess.Popen:
    """The job watcher (JOB_WATCHER), in a session of its own so that a signal to the worker's group spares it."""
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", JOB_WATCHER], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, start_new_session=True)


def children_of(pid: int) -> list[int]:
    """The children of a process, from the kernel's per-thread lists; [] when it is gone."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as listing:
                found += [int(child) for child in listing.read().split()]
        except OSError:
            pass
    return found


def job_marker(pid: int) -> str | None:
    """The SWITCHBOARD_TODO_ID in a process's environment as it was exec'd; None when it has none or it cannot
    be read (another user's process without CAP_SYS_PTRACE, a zombie)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            entries = environ.read(1 << 20).split(b"\0")
    except OSError:
        return None
    for entry in entries:
        if entry.startswith(b"SWITCHBOARD_TODO_ID="):
            return entry[len(b"SWITCHBOARD_TODO_ID="):].decode(errors="replace")
    return None


def job_processes(job_id: str, child: int, worker: int, running: dict[int, str], keep: int | None) -> list[int]:
    """Every process of the job: the child, the processes reparented to the worker that belong to it (their
    environment names it, or names no running job), and all their descendants. `running` maps each running job's
    child to its todo id; those children and the orphans whose environment names their job are left alone, and
    so is `keep` (the job watcher)."""
    others = {todo for pid, todo in running.items() if pid != child}
    roots = [child]
    for pid in children_of(worker):
        if pid not in running and pid != keep and job_marker(pid) not in others:
            roots.append(pid)
    found, seen = [], set()
    while roots:
        pid = roots.pop()
        if pid not in seen:
            seen.add(pid)
            found.append(pid)
            roots += children_of(pid)
    return found


@dataclass(frozen=True)
class JobUser:
    """The user `--exec-user` names: each child runs as it, in a directory it owns."""
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


def job_user(name: str) -> JobUser:
    """The user a child runs as: the worker must be root to start it so, and it must not be root itself."""
    if os.geteuid() != 0:
        raise ConfigError(f"--exec-user {name}: the worker must run as root to start each child as another user")
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, OverflowError):
        raise ConfigError(f"--exec-user {name}: no such user") from None
    if entry.pw_uid == 0:
        raise ConfigError(f"--exec-user {name}: name a user other than root (the children must not hold the"
                          " worker's own rights)")
    return JobUser(entry.pw_name, entry.pw_uid, entry.pw_gid,
                   tuple(os.getgrouplist(entry.pw_name, entry.pw_gid)), entry.pw_dir)


class ExecRunner:
    """Runs CMD once per todo (the module's docstring says how)."""

    def __init__(self, command: list[str], exec_user: str | None = None):
        program = shutil.which(command[0])
        if program is None:
            raise ConfigError(f"cannot run {command[0]!r}: not found or not executable")
        self.command = command
        self.program = os.path.abspath(program)  # the child runs in its own directory: resolve a relative path now
        self.user = job_user(exec_user) if exec_user else None
        # Workers running the same command meet the same provider's quota.
        self.quota_group = "exec-" + hashlib.sha256("\0".join(command).encode()).hexdigest()[:12]
        self.children: dict[int, str] = {}  # the pid of each running job's child -> its todo id
        self.worker_pid = os.getpid()
        become_subreaper()
        self.watcher = start_watcher()

    async def run(self, job: Job) -> Outcome:
        workdir = tempfile.mkdtemp(prefix="switchboard-job-")  # mode 0700
        try:
            if self.user is not None:
                os.chown(workdir, self.user.uid, self.user.gid)
            return await self._run_child(job, workdir)
        finally:
            await asyncio.to_thread(remove_tree, workdir)

    def _tell_watcher(self, line: str) -> None:
        try:
            self.watcher.stdin.write(line.encode())
            self.watcher.stdin.flush()
        except OSError as exc:  # it died: jobs still end with their job, only no longer with a killed worker
            log.error("the job watcher is gone (%s): a worker killed outright would leave its jobs running; starting"
                      " another", exc)
            self.watcher = start_watcher()
            with contextlib.suppress(OSError):
                self.watcher.stdin.write("".join(f"+ {pid} {todo}\n" for pid, todo in self.children.items()).encode())
                self.watcher.stdin.flush()

    def spawn(self, job: Job, workdir: str, outcome_file: str, **options) -> subprocess.Popen:
        """The job's child, in a session of its own. Nothing runs in the child before exec (no preexec_fn), so
        subprocess keeps its vfork fast path (a user to switch to makes it fork)."""
        identity = {} if self.user is None else {"user": self.user.uid, "group": self.user.gid,
                                                 "extra_groups": list(self.user.groups)}
        return subprocess.Popen(self.command, executable=self.program, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir,
                                env=child_environment(job, outcome_file, self.user), start_new_session=True,
                                **identity, **options)

    async def _run_child(self, job: Job, workdir: str) -> Outcome:
        loop = asyncio.get_running_loop()
        outcome_file = os.path.join(workdir, OUTCOME_FILE_NAME)
        child = self.spawn(job, workdir, outcome_file)
        self.children[child.pid] = job.id
        self._tell_watcher(f"+ {child.pid} {job.id}\n")
        exited = watch_exit(child.pid)
        stdout = Capture(STDOUT_KEPT_BYTES)
        stderr = Capture(ERROR_BYTES, lambda data: setattr(job, "note", last_line(data, NOTE_CHARS)))
        readers: list[asyncio.ReadTransport] = []
        feed: asyncio.WriteTransport | None = None
        try:
            for capture, pipe in ((stdout, child.stdout), (stderr, child.stderr)):
                readers.append((await loop.connect_read_pipe(lambda c=capture: c, pipe))[0])
            feed, _ = await loop.connect_write_pipe(asyncio.BaseProtocol, child.stdin)
            feed.write(json.dumps(job.todo).encode() + b"\n")
            feed.close()  # once the JSON is written: the child sees the end of its input
            await asyncio.shield(exited)
        except asyncio.CancelledError:
            await self._stop(job.id, child.pid, exited)
            raise
        finally:
            if not exited.done():  # an error while connecting the pipes: the child must not outlive its job
                self._signal_job(job.id, child.pid, signal.SIGKILL)
                await asyncio.shield(exited)
            # Whatever the child left running ends with it, wherever it moved: its group, its session, an orphan.
            await asyncio.shield(self._end_job(job.id, child.pid))
            child.wait()  # reaped only now: until here its pid, the group's id, could not be reused
            del self.children[child.pid]
            self._tell_watcher(f"- {child.pid}\n")
            # A process that escaped may have held the pipes: read what is there, do not wait for it.
            await asyncio.wait([stdout.closed, stderr.closed], timeout=1)
            for reader in readers:
                reader.close()
            if feed is not None and feed.get_write_buffer_size():  # input nobody will read
                feed.abort()
        return outcome_of(child.returncode, stdout, bytes(stderr.data), outcome_file)

    async def _stop(self, job_id: str, pid: int, exited: asyncio.Future) -> None:
        """SIGTERM to every process of the job at once, SIGKILL KILL_GRACE_SECONDS later if the child is still
        there (the caller's cleanup then kills what is left)."""
        self._signal_job(job_id, pid, signal.SIGTERM)
        await asyncio.wait([exited], timeout=KILL_GRACE_SECONDS)

    def _signal_job(self, job_id: str, pid: int, sig: int) -> list[int]:
        """Send `sig` to the child's process group and to every process of the job; the processes found."""
        signal_group(pid, sig)
        found = job_processes(job_id, pid, self.worker_pid, self.children, self.watcher.pid)
        for member in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(member, sig)
        return found

    async def _end_job(self, job_id: str, pid: int) -> None:
        """SIGKILL every process of the job until none is left, reaping the ones reparented to the worker (the
        subreaper) and leaving the child itself, exited, to its Popen."""
        for attempt in range(END_JOB_ROUNDS):
            found = [member for member in self._signal_job(job_id, pid, signal.SIGKILL) if member != pid]
            if not found:
                return
            for member in found:
                with contextlib.suppress(ChildProcessError):  # not ours to reap: its own parent will
                    os.waitpid(member, os.WNOHANG)
            await asyncio.sleep(min(0.001 * 2 ** attempt, 0.1))
        log.warning("todo %s: %d process(es) it started did not end: %s", job_id, len(found),
                    " ".join(map(str, found[:20])))


class Capture(asyncio.Protocol):
    """The last `keep` bytes of one of a child's output pipes, read as they come; `on_data` sees the tail after
    each read."""

    def __init__(self, keep: int, on_data: Callable[[bytes], None] | None = None):
        self.keep = keep
        self.on_data = on_data
        self.data = bytearray()
        self.total = 0  # bytes read in all, kept or not
        self.closed = asyncio.get_running_loop().create_future()

    def data_received(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.data += chunk
        del self.data[:-self.keep]
        if self.on_data is not None:
            self.on_data(bytes(self.data))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def child_environment(job: Job, outcome_file: str, user: JobUser | None) -> dict[str, str]:
    """The worker's environment for the child, less what configures the worker itself (every SWITCHBOARD_*: some
    hold or name its secrets) and systemd's CREDENTIALS_DIRECTORY (where its token is), plus the job's own: its
    ids, and as TRACEPARENT (what otel-cli and the OpenTelemetry SDKs read) the attempt's span, so a job that traces
    itself joins the todo's trace. The worker's own TRACEPARENT and TRACESTATE never pass: they are not the job's."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("SWITCHBOARD_") and name not in ("CREDENTIALS_DIRECTORY", "TRACEPARENT", "TRACESTATE")}
    if valid_traceparent(job.traceparent):
        env["TRACEPARENT"] = job.traceparent
    if user is not None:
        env.update(HOME=user.home, USER=user.name, LOGNAME=user.name)
    env.update(SWITCHBOARD_TODO_ID=job.id, SWITCHBOARD_QUEUE=job.queue, SWITCHBOARD_ATTEMPT=str(job.todo["attempt"]),
               SWITCHBOARD_WORKER=job.worker, SWITCHBOARD_OUTCOME_FILE=outcome_file)
    return env


def watch_exit(pid: int) -> asyncio.Future:
    """A future done once the process has exited, left unreaped (waitid with WNOWAIT, in a thread of its own), so
    its pid, which is its process group's id too, stays its own while the worker signals the group."""
    loop = asyncio.get_running_loop()
    exited = loop.create_future()

    def wait() -> None:
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        finally:  # whatever waitid says, the job must not wait for ever
            loop.call_soon_threadsafe(exited.set_result, None)

    threading.Thread(target=wait, name=f"switchboard-wait-{pid}", daemon=True).start()
    return exited


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # the group is gone (or nothing left in it is ours to signal)
        pass


def remove_tree(path: str) -> None:
    """Remove a job's directory, even the directories the child left without write or search permission (made
    usable again top-down; a symbolic link is never followed)."""
    try:
        shutil.rmtree(path)
    except OSError:
        with contextlib.suppress(OSError):
            os.chmod(path, 0o700)
        for directory, subdirectories, _ in os.walk(path):
            for name in subdirectories:
                if not os.path.islink(os.path.join(directory, name)):
                    with contextlib.suppress(OSError):
                        os.chmod(os.path.join(directory, name), 0o700)
        shutil.rmtree(path, ignore_errors=True)


def tail_text(data: bytes, size: int) -> str:
    """The last `size` bytes as text: a character cut at the start is dropped, NUL (which the API refuses) is
    replaced."""
    tail = data[-size:]
    start = 0
    while start < min(3, len(tail)) and tail[start] & 0xC0 == 0x80:
        start += 1
    return tail[start:].decode("utf-8", "replace").replace("\x00", "\ufffd")


def last_line(data: bytes, chars: int) -> str | None:
    """The last non-empty line (a carriage return starts a line too: progress bars), cut to `chars`."""
    for line in reversed(re.split(r"[\r\n]", tail_text(data, len(data)))):
        if line.strip():
            return line.strip()[:chars]
    return None


def outcome_of(returncode: int, stdout: Capture, stderr: bytes, outcome_file: str) -> Outcome:
    """A child's outcome: the outcome file when it wrote one; else its last non-empty stdout line when that is a
    JSON object naming an outcome (a last line too long to keep, or one that starts an outcome object but is not
    JSON, fails the todo: never a guess); else its exit status (0 completes with the stdout tail, 75 parks,
    anything else fails with the stderr tail)."""
    written = read_outcome_file(outcome_file)
    if written is not None:
        return written
    kept = bytes(stdout.data).rstrip()
    if kept and b"\n" not in kept and stdout.total > len(stdout.data):
        return Fail(error=f"the last line of stdout is over {STDOUT_KEPT_BYTES >> 20} MiB, too long to read as an"
                          " outcome line: write the outcome to $SWITCHBOARD_OUTCOME_FILE")
    stated = stated_outcome(kept.rsplit(b"\n", 1)[-1])
    if stated is not None:
        return stated
    if returncode == 0:
        return Complete(result={"output": tail_text(bytes(stdout.data), OUTPUT_BYTES)})
    if returncode == EXIT_PARK:
        return Park()
    return Fail(error=tail_text(stderr, ERROR_BYTES).strip() or exit_text(returncode))


def read_outcome_file(path: str) -> Outcome | None:
    """The outcome the child wrote to its outcome file; None when it wrote none. Read as hostile: a regular file
    only, never through a link, at most OUTCOME_FILE_BYTES, and never quoted back."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        return Fail(error=f"the outcome file cannot be read: {why}")
    try:
        data = bytearray()
        while len(data) <= OUTCOME_FILE_BYTES:
            chunk = os.read(fd, OUTCOME_FILE_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) > OUTCOME_FILE_BYTES:
        return Fail(error=f"the outcome file is over {OUTCOME_FILE_BYTES >> 20} MiB")
    return stated_outcome(bytes(data).strip(), "the outcome file") or Fail(
        error='the outcome file holds no outcome: write one JSON object, {"outcome": "complete", …}')


def exit_text(returncode: int) -> str:
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:  # a real-time signal has no name
        return f"killed by signal {-returncode}"


def stated_outcome(line: bytes, where: str = "the outcome line") -> Outcome | None:
    """The outcome a line states, None when it states none; one that names an outcome (or starts like one) but
    does not validate fails the todo, saying why (never a guess at what was meant)."""
    try:
        stated = json.loads(line)
    except (ValueError, RecursionError):
        if line.startswith(b"{") and b'"outcome"' in line:
            return Fail(error=f"{where} is not valid JSON")
        return None
    if not isinstance(stated, dict) or stated.get("outcome") not in OUTCOME_KINDS:
        return None
    try:
        return OUTCOMES.validate_python(stated)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(part) for part in e['loc'][1:]) or 'outcome'}: {e['msg']}"
                             for e in exc.errors())
        return Fail(error=f"{where} is not valid: {problems}".replace("\x00", "\ufffd")[:ERROR_BYTES])
