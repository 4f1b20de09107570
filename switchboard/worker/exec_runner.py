"""`--exec -- CMD [ARG …]` (SPEC section 15): a child process per todo.

The child gets the claimed todo as JSON on stdin, its ids in the environment (never any SWITCHBOARD_TOKEN*), a
fresh private working directory removed afterwards, and a process group of its own, so that stopping the job
stops everything it started. Producer text reaches it only on stdin. Its outcome is its last non-empty stdout line
when that is a JSON object naming an outcome, else its exit status: 0 completes with the stdout tail, 75 parks,
anything else fails with the stderr tail."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable

from pydantic import ValidationError

from switchboard.worker.job import OUTCOME_KINDS, OUTCOMES, Complete, ConfigError, Fail, Job, Outcome, Park

KILL_GRACE_SECONDS = 10.0  # SIGTERM to a job's process group, SIGKILL this much later
STDOUT_KEPT_BYTES = 1 << 20  # a child's stdout tail: room for an outcome line with a whole result (<= 64 KiB)
OUTPUT_BYTES = 4096  # `result.output` of a child that exits 0 without an outcome line
ERROR_BYTES = 2048  # `error` of a child that fails without one: its stderr tail
NOTE_CHARS = 200  # a heartbeat's progress note: the child's last stderr line, cut
EXIT_PARK = 75  # EX_TEMPFAIL: the child hit a quota wall


class ExecRunner:
    """Runs CMD once per todo (the module's docstring says how)."""

    def __init__(self, command: list[str]):
        program = shutil.which(command[0])
        if program is None:
            raise ConfigError(f"cannot run {command[0]!r}: not found or not executable")
        self.command = command
        self.program = os.path.abspath(program)  # the child runs in its own directory: resolve a relative path now
        # Workers running the same command meet the same provider's quota.
        self.quota_group = "exec-" + hashlib.sha256("\0".join(command).encode()).hexdigest()[:12]

    async def run(self, job: Job) -> Outcome:
        workdir = tempfile.mkdtemp(prefix="switchboard-job-")  # mode 0700
        try:
            return await self._run_child(job, workdir)
        finally:
            await asyncio.to_thread(remove_tree, workdir)

    async def _run_child(self, job: Job, workdir: str) -> Outcome:
        loop = asyncio.get_running_loop()
        child = subprocess.Popen(self.command, executable=self.program, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir,
                                 env=child_environment(job), start_new_session=True)
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
            await stop_group(child.pid, exited)
            raise
        finally:
            if not exited.done():  # an error while connecting the pipes: the child must not outlive its job
                signal_group(child.pid, signal.SIGKILL)
                await asyncio.shield(exited)
            signal_group(child.pid, signal.SIGKILL)  # what the child left running in its group ends with it
            child.wait()  # reaped only now: until here its pid, the group's id, could not be reused
            # A process that left the group may still hold the pipes: read what is there, do not wait for it.
            await asyncio.wait([stdout.closed, stderr.closed], timeout=1)
            for reader in readers:
                reader.close()
            if feed is not None and feed.get_write_buffer_size():  # input nobody will read
                feed.abort()
        return outcome_of(child.returncode, bytes(stdout.data), bytes(stderr.data))


class Capture(asyncio.Protocol):
    """The last `keep` bytes of one of a child's output pipes, read as they come; `on_data` sees the tail after
    each read."""

    def __init__(self, keep: int, on_data: Callable[[bytes], None] | None = None):
        self.keep = keep
        self.on_data = on_data
        self.data = bytearray()
        self.closed = asyncio.get_running_loop().create_future()

    def data_received(self, chunk: bytes) -> None:
        self.data += chunk
        del self.data[:-self.keep]
        if self.on_data is not None:
            self.on_data(bytes(self.data))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def child_environment(job: Job) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("SWITCHBOARD_TOKEN")}
    env.update(SWITCHBOARD_TODO_ID=job.id, SWITCHBOARD_QUEUE=job.queue, SWITCHBOARD_ATTEMPT=str(job.todo["attempt"]),
               SWITCHBOARD_WORKER=job.worker)
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


async def stop_group(pgid: int, exited: asyncio.Future) -> None:
    """SIGTERM to the job's process group at once, SIGKILL KILL_GRACE_SECONDS later if the child is still there."""
    signal_group(pgid, signal.SIGTERM)
    await asyncio.wait([exited], timeout=KILL_GRACE_SECONDS)
    if not exited.done():
        signal_group(pgid, signal.SIGKILL)
        await asyncio.shield(exited)


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


def outcome_of(returncode: int, stdout: bytes, stderr: bytes) -> Outcome:
    """A child's outcome: its last non-empty stdout line when that is a JSON object naming an outcome, else its
    exit status (0 completes with the stdout tail, 75 parks, anything else fails with the stderr tail)."""
    stated = stated_outcome(stdout.rstrip().rsplit(b"\n", 1)[-1])
    if stated is not None:
        return stated
    if returncode == 0:
        return Complete(result={"output": tail_text(stdout, OUTPUT_BYTES)})
    if returncode == EXIT_PARK:
        return Park()
    return Fail(error=tail_text(stderr, ERROR_BYTES).strip() or exit_text(returncode))


def exit_text(returncode: int) -> str:
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:  # a real-time signal has no name
        return f"killed by signal {-returncode}"


def stated_outcome(line: bytes) -> Outcome | None:
    """The outcome a line states, None when it states none; one that names an outcome but does not validate fails
    the todo, saying why (never a guess at what was meant)."""
    try:
        stated = json.loads(line)
    except ValueError:
        return None
    if not isinstance(stated, dict) or stated.get("outcome") not in OUTCOME_KINDS:
        return None
    try:
        return OUTCOMES.validate_python(stated)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(part) for part in e['loc'][1:]) or 'outcome'}: {e['msg']}"
                             for e in exc.errors())
        return Fail(error=f"the outcome line is not valid: {problems}".replace("\x00", "\ufffd")[:ERROR_BYTES])
