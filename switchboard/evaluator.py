"""jq rule sets run in a pool of sandboxed child processes (memory, CPU and time limits, no environment)."""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import importlib.util
import json
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from switchboard.configuration import ApiError

# Rules never run in the server process. Each child is `python -I -S` (no site hooks; jq's directory is the one
# path it is given) with an empty environment, a 256 MiB address-space cap, and only json and jq imported. The
# whole rule set is one jq program evaluated in one pass over one parsed copy of the envelope; first truthy
# output wins, the first error stops evaluation. Deliveries for one rule set that wait together go to a child in
# one frame (a batch), and it answers each on its own line as it finishes it, so every delivery keeps its own
# budget.

EVAL_BUDGET_SECONDS = 0.25
EVAL_KILL_SECONDS = 2.0
EVAL_MEMORY_BYTES = 256 << 20
# Three children: one owner (a homelab's usual case) uses at most two at once, and another owner always finds the
# third free. An owner's deliveries go one frame at a time, so a flood holds one child (its frames grow instead);
# the second serves a rules save, a dry run or a replay meanwhile, or replaces a child that overran.
EVAL_POOL_SIZE = 3
EVAL_BATCH = 8  # deliveries in one frame at most: the last of them waits for the ones before it (8 budgets)
EVAL_FRAME_BYTES = 1 << 20  # and their envelopes' bytes at most (a frame always takes one, however large)
EVAL_PROGRAMS_PER_CHILD = 128  # compiled rule sets a child keeps (and the pool the same count of keys)
# Deliveries of one owner waiting for the evaluator beyond this are refused (503) rather than queued.
EVAL_QUEUE_PER_TENANT = 256
# A delivery waits at most this long for a sandbox child (its owner's line, then a free child). Past it, ingress
# answers 503 with Retry-After and stores nothing: producers give up on an answer within about 10 s, and their
# redelivery is evaluated then (dedup keeps one). Once taken, a delivery waits for its frame: the envelopes before
# it (EVAL_BATCH budgets at most) and, on a child new to its rule set, the compile.
EVAL_WAIT_SECONDS = 5.0
EVAL_THREADS = 16
# A webhook failing its signature check this many times within the window tells its human (at most hourly).
VERIFICATION_ALERT_COUNT = 5
VERIFICATION_ALERT_WINDOW = 600.0
DRY_RUN_EVENTS = 50

# The child's whole program. Frames: a JSON header line, then, for an evaluation, the envelopes' JSON one after
# another (`sizes` says how many bytes each); one answer line per envelope, written as soon as it is known.
EVALUATOR_CHILD = r'''
import json, os, resource, signal, sys
sys.path.append(sys.argv[1])
import jq

resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
parent = os.getppid()
programs = {}
read, write = sys.stdin.buffer, sys.stdout.buffer

def answer(message):
    write.write(json.dumps(message).encode() + b"\n")
    write.flush()

answer({"ready": True})

def guarded(work):
    """Run `work` (which answers) under the hard deadline; a failure is answered as a fault instead."""
    signal.alarm(DEADLINE)
    try:
        work()
    except MemoryError:
        answer({"fault": "budget_exhausted", "detail": "memory cap reached"})
    except Exception as exc:
        answer({"fault": "error", "detail": str(exc)[:500]})
    finally:
        signal.alarm(0)

def evaluate(program, doc):
    if program is None:
        answer({"fault": "error", "detail": "the rule set is not loaded"})
    else:
        answer({"result": program.input_text(doc.decode()).first()})

def compile_or_load(request):
    if request["op"] == "compile":
        errors = []
        for index, program in enumerate(request["programs"]):
            try:
                jq.compile(program, args={"params": request["params"]})
            except ValueError as exc:
                errors.append({"index": index, "detail": str(exc)[:500]})
        answer({"errors": errors})
    elif request["op"] == "load":
        if len(programs) >= PROGRAMS:
            programs.clear()
        programs[request["key"]] = jq.compile(request["program"], args={"params": request["params"]})
        answer({"loaded": True})

# The child dies with the server: at end of input when idle, and (SIGALRM's default action, which ends the
# process even inside jq's C loop) at its hard deadline when busy, whether or not anyone is left to kill it.
for header in read:
    if os.getppid() != parent:
        break
    request = json.loads(header)
    if request["op"] == "eval":
        program = programs.get(request["key"])
        # The whole frame is read first: the server writes it in one go, and must not block on a full pipe while
        # this child is busy with the frame's first envelope. Each envelope gets the deadline of its own.
        for doc in [read.read(size) for size in request["sizes"]]:
            guarded(lambda: evaluate(program, doc))
    else:
        guarded(lambda: compile_or_load(request))
'''.replace("MEMORY", str(EVAL_MEMORY_BYTES)).replace("DEADLINE", str(int(EVAL_KILL_SECONDS) + 1)).replace(
    "PROGRAMS", str(EVAL_PROGRAMS_PER_CHILD))

FORBIDDEN_IDENTIFIERS = frozenset({
    "env", "$ENV", "input", "inputs", "input_filename", "input_line_number", "debug", "stderr", "halt",
    "halt_error", "now", "localtime", "gmtime", "mktime", "strftime", "strflocaltime", "$__loc__", "import",
    "include", "get_search_list", "get_prog_origin", "get_jq_origin", "$__prog_args"})


class JqText:
    """A jq expression read the way jq reads it: its identifiers in code (outside string literals, but inside
    `\\(...)` interpolations, which are code; a name right after `.` is a field access and is left out) and its
    text with comments removed. A comment that ends in a backslash would run on into the next line (jq 1.7), so
    it is refused rather than guessed at."""

    NAME = re.compile(r"\$?[A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*")

    def __init__(self, expr: str):
        self.identifiers: list[str] = []
        self.continued_comment = False
        kept: list[str] = []
        last = ""  # the last character kept that is not white space
        modes, depth = ["code"], [0]  # a stack of "code" and "string"; open parentheses per code level
        i = 0
        while i < len(expr):
            ch = expr[i]
            if modes[-1] == "string":
                step = 2 if ch == "\\" else 1
                if expr[i:i + 2] == "\\(":
                    modes.append("code")
                    depth.append(0)
                elif ch == '"':
                    modes.pop()
                kept.append(expr[i:i + step])
                last = expr[i + step - 1]
                i += step
                continue
            if ch == "#":
                end = expr.find("\n", i)
                end = len(expr) if end < 0 else end
                self.continued_comment |= expr[i:end].rstrip("\r").endswith("\\")
                i = end
                continue
            match = self.NAME.match(expr, i)
            if match:
                if last != "." or match.group().startswith("$"):
                    self.identifiers.append(match.group())
                kept.append(match.group())
                last = match.group()[-1]
                i = match.end()
                continue
            if ch == '"':
                modes.append("string")
            elif ch == "(":
                depth[-1] += 1
            elif ch == ")":
                if depth[-1] == 0 and len(modes) > 1:
                    modes.pop()
                    depth.pop()
                else:
                    depth[-1] -= 1
            kept.append(ch)
            last = last if ch.isspace() else ch
            i += 1
        self.code = "".join(kept)

    def forbidden(self) -> list[str]:
        return sorted({name for name in self.identifiers if name in FORBIDDEN_IDENTIFIERS})


@functools.lru_cache(maxsize=1024)
def read_rule(expr: str) -> JqText:
    """A rule's text read once: every save, dry run and replay checks a rule set's texts again, and reading one
    character by character costs more than evaluating it."""
    return JqText(expr)


@functools.lru_cache(maxsize=64)
def forbidden_in_program(program: str) -> tuple[str, ...]:
    """The forbidden identifiers of a combined program (read as a whole, as jq will read it), once per program."""
    return tuple(JqText(program).forbidden())


@functools.lru_cache(maxsize=256)
def combined_program(exprs: tuple[str, ...]) -> str:
    """One jq program for a whole rule set: rule i is tried only when rules 0..i-1 neither matched nor
    faulted. Its reply is {"match": i}, {"fault": i, "detail": …} or {"none": true}. Each rule runs without
    its comments, inside its own parentheses: having compiled alone, it cannot reach into its neighbours.
    Cached: reading the rules costs more than evaluating them, and a webhook's rule set rarely changes."""
    program = '{"none": true}'
    for index, expr in reversed(list(enumerate(exprs))):
        program = (f'(try ([limit(1; ({read_rule(expr).code}\n))] | if length > 0 and (.[0] | . != false and . != null)'
                   f' then 1 else 0 end) catch {{"error": .}}) as $__r{index}'
                   f' | if $__r{index} == 1 then {{"match": {index}}} elif $__r{index} == 0 then {program}'
                   f' else {{"fault": {index}, "detail": $__r{index}.error}} end')
    return program


class EvaluatorUnavailable(Exception):
    """No child could be started or reached: ingress answers 503 and stores nothing."""


class EvaluatorBusy(EvaluatorUnavailable):
    """No child came free in time (the owner's share of them, or every one, busy): retry later."""


class EvaluatorDied(EvaluatorUnavailable):
    """A running child went away mid-request (its memory cap, or a crash): for a delivery, a rule fault."""


@functools.cache
def _jq_directory() -> str:
    """Where the jq module is installed: the one path an evaluator child is given."""
    spec = importlib.util.find_spec("jq")
    if spec is None or not spec.origin:
        raise EvaluatorUnavailable("the jq module is not installed")
    return os.path.dirname(spec.origin)


class _Child:
    def __init__(self) -> None:
        try:
            # -S: no site hooks run in the sandbox (the .pth files of site-packages, a third of a child's start).
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", EVALUATOR_CHILD, _jq_directory()],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         env={}, close_fds=True)
        except OSError as exc:
            raise EvaluatorUnavailable(f"cannot start the evaluator: {exc}") from None
        self.known: set[str] = set()
        self._buffer = b""
        # poll, not select: a busy server can give the child's pipe a descriptor number above select's 1024.
        self._readable = select.poll()
        self._readable.register(self.proc.stdout.fileno(), select.POLLIN)
        try:
            ready = self.read(10.0)
        except EvaluatorUnavailable:
            ready = None
        if ready != {"ready": True}:
            self.kill()
            raise EvaluatorUnavailable("the evaluator did not start")

    def send(self, header: dict, docs: list[bytes] | None = None) -> None:
        frame = json.dumps(header if docs is None else {**header, "sizes": [len(doc) for doc in docs]}).encode()
        try:
            self.proc.stdin.write(b"".join([frame, b"\n", *(docs or ())]))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise EvaluatorDied("the evaluator is gone") from None

    def ask(self, header: dict, timeout: float) -> dict | None:
        self.send(header)
        return self.read(timeout)

    def read(self, timeout: float) -> dict | None:
        """The next reply, None when `timeout` passes first; EvaluatorUnavailable when the child died."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._readable.poll(max(1, math.ceil(remaining * 1000))):
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EvaluatorDied("the evaluator died")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            reply = None
        if not isinstance(reply, dict):
            raise EvaluatorDied("the evaluator answered something that is not a reply")
        return reply

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()


class Evaluator:
    """A pool of sandbox children. A call that overruns its budget is a fault at once and its child leaves the
    pool: it gets until the kill deadline to finish (and rejoin, if there is room) before it is killed, while a
    fresh child takes its place, so stuck rules never stall the deliveries behind them.

    Fairness: a tenant (the webhook owner) holds at most `per_tenant` children at once, counting its overrunning
    ones until they are gone, so a tenant whose rules loop waits on itself and leaves the other slots free."""

    MAX_OVERRUNNING_PER_SLOT = 2
    DEAD_AFTER_FAILED_STARTS = 3

    def __init__(self, size: int = EVAL_POOL_SIZE, budget: float = EVAL_BUDGET_SECONDS,
                 kill_after: float = EVAL_KILL_SECONDS, per_tenant: int | None = None):
        self.size = size
        self.budget = budget
        self.kill_after = kill_after
        self.per_tenant = per_tenant or max(1, size - 1)
        self._idle: list[_Child] = []
        self._changed = threading.Condition()
        self._count = 0
        self._overrunning = 0
        self._tenant_load: collections.Counter = collections.Counter()
        self._closed = False
        self._failed_starts = 0
        # Program lists that compiled cleanly, by text and params (insertion-ordered, oldest dropped first).
        self._compiled_clean: dict[str, None] = {}
        self.on_death: Callable[[str], None] | None = None

    def _wait(self, ready: Callable[[], bool], why: str, until: float | None = None) -> None:
        """Under the lock: wait until `ready()`, at most as long as a stuck child can live, and never past `until`
        (time.monotonic()) when given."""
        deadline = time.monotonic() + self.kill_after + 1
        if until is not None:
            deadline = min(deadline, until)
        while not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EvaluatorBusy(why)
            self._changed.wait(remaining)

    def _enter(self, tenant: str | None, until: float | None = None) -> None:
        if tenant is not None:
            with self._changed:
                self._wait(lambda: self._tenant_load[tenant] < self.per_tenant, "this owner's rules are all busy",
                           until)
                self._tenant_load[tenant] += 1

    def _exit(self, tenant: str | None) -> None:
        if tenant is not None:
            with self._changed:
                self._tenant_load[tenant] -= 1
                if self._tenant_load[tenant] <= 0:
                    del self._tenant_load[tenant]
                self._changed.notify_all()

    def _acquire(self, until: float | None = None) -> _Child:
        with self._changed:
            self._wait(lambda: bool(self._idle) or (
                self._count < self.size and self._overrunning < self.size * self.MAX_OVERRUNNING_PER_SLOT),
                "every evaluator is busy", until)
            if self._idle:
                return self._idle.pop()
            self._count += 1
        try:
            child = _Child()
        except EvaluatorUnavailable as exc:
            self._leave(None)
            self._failed_starts += 1
            if self._failed_starts == self.DEAD_AFTER_FAILED_STARTS and self.on_death:
                self.on_death(f"the evaluator pool cannot start a child: {exc}")
            raise
        self._failed_starts = 0
        return child

    def _release(self, child: _Child) -> None:
        with self._changed:
            if not self._closed:
                self._idle.append(child)
                self._changed.notify_all()
                return
        self._leave(child)

    def _leave(self, child: _Child | None) -> None:
        """A child leaves the pool (dead, or never started); its slot is free for a new one."""
        if child is not None:
            child.kill()
        with self._changed:
            self._count -= 1
            self._changed.notify_all()

    def _overrun(self, child: _Child, started: float, tenant: str | None, owed: int) -> None:
        """A child that overran gets until the kill deadline for the `owed` answers it still writes (the late one
        and a batch's after it, which are not used: those deliveries are evaluated again elsewhere)."""
        answered = 0
        try:
            while answered < owed and child.read(max(0.0, started + self.kill_after - time.monotonic())) is not None:
                answered += 1
        except EvaluatorUnavailable:
            pass
        with self._changed:
            self._overrunning -= 1
            rejoin = answered == owed and not self._closed and self._count < self.size
            if rejoin:
                self._count += 1
                self._idle.append(child)
            self._changed.notify_all()
        if not rejoin:
            child.kill()
        self._exit(tenant)

    def _enter_child(self, tenant: str | None, until: float | None) -> _Child:
        self._enter(tenant, until)
        try:
            return self._acquire(until)
        except BaseException:
            self._exit(tenant)
            raise

    def _done_with(self, child: _Child, tenant: str | None) -> None:
        self._release(child)
        self._exit(tenant)

    def _gone(self, child: _Child, tenant: str | None) -> None:
        self._leave(child)
        self._exit(tenant)

    def _overran(self, child: _Child, started: float, tenant: str | None, owed: int = 1) -> None:
        """The child leaves the pool at once, still counting for its tenant until it answers or is killed."""
        with self._changed:
            self._count -= 1
            self._overrunning += 1
            self._changed.notify_all()
        threading.Thread(target=self._overrun, args=(child, started, tenant, owed), daemon=True).start()

    def _ask_alone(self, header: dict, tenant: str | None) -> dict | None:
        """One request and its one reply (a compile check), within the kill deadline; None when it overran."""
        child = self._enter_child(tenant, None)
        started = time.monotonic()
        try:
            reply = child.ask(header, self.kill_after)
        except BaseException:
            self._gone(child, tenant)
            raise
        if reply is None:
            self._overran(child, started, tenant)
        else:
            self._done_with(child, tenant)
        return reply

    def compile_errors(self, programs: list[str], params: dict, tenant: str | None = None) -> list[dict]:
        """Each program's compile error. A list that compiled cleanly is remembered, so saving, dry-running or
        replaying an unchanged rule set does not compile every rule again (jq takes milliseconds per rule)."""
        key = hashlib.sha256(json.dumps([programs, params], sort_keys=True).encode()).hexdigest()
        with self._changed:
            if key in self._compiled_clean:
                return []
        reply = self._ask_alone({"op": "compile", "programs": programs, "params": params}, tenant)
        if reply is None:
            raise ApiError("invalid_argument", "rules: compiling took too long")
        errors = reply.get("errors")
        if not isinstance(errors, list) or not all(
                isinstance(e, dict) and isinstance(e.get("index"), int) and 0 <= e["index"] < len(programs)
                for e in errors):
            raise EvaluatorUnavailable("the evaluator answered nonsense")
        if not errors:
            with self._changed:
                self._compiled_clean[key] = None
                if len(self._compiled_clean) > EVAL_PROGRAMS_PER_CHILD:
                    del self._compiled_clean[next(iter(self._compiled_clean))]
        return errors

    def run(self, exprs: list[str], params: dict, doc: bytes, tenant: str | None = None) -> dict:
        """Evaluate a rule set over one envelope: {"match": i}, {"none": True} or {"fault": cause, "rule_index",
        "detail"}. A fault the child could not pin on one rule has rule_index None. The child's reply is
        untrusted: anything but a well-formed reply is a fault."""
        return self.run_batch(exprs, params, [doc], tenant)[0]

    def run_batch(self, exprs: list[str], params: dict, docs: list[bytes], tenant: str | None = None,
                  until: float | None = None) -> list[dict | None]:
        """`run` for several envelopes under one rule set, in one frame to one child: a verdict for each, in
        order, each within its own budget (counted from the answer before it). When one overruns or kills its
        child, that one is the fault and the ones after it are None: not evaluated, to be sent again. With
        `until` (time.monotonic()), no child free by then raises EvaluatorBusy."""
        program = combined_program(tuple(exprs))
        key = hashlib.sha256(program.encode() + b"\x00" + json.dumps(params, sort_keys=True).encode()).hexdigest()
        child = self._enter_child(tenant, until)
        verdicts: list[dict | None] = []
        started = time.monotonic()
        try:
            if key not in child.known:
                # Compiling gets a round trip of its own, once per child and rule set: the budget is for
                # evaluating, and compiling a large rule set on a busy machine can take a good part of it. The
                # child forgets its programs all at once when it holds EVAL_PROGRAMS_PER_CHILD, and so does `known`.
                if len(child.known) >= EVAL_PROGRAMS_PER_CHILD:
                    child.known.clear()
                loaded = child.ask({"op": "load", "key": key, "program": program, "params": params}, self.kill_after)
                if loaded is None:
                    self._overran(child, started, tenant)
                    return [self._timeout(self.kill_after), *[None] * (len(docs) - 1)]
                if loaded.get("loaded") is not True:
                    self._done_with(child, tenant)
                    return [_read_reply(loaded, len(exprs)) for _ in docs]
                child.known.add(key)
            child.send({"op": "eval", "key": key}, docs)
            for _ in docs:
                started = time.monotonic()
                reply = child.read(self.budget)
                if reply is None:
                    self._overran(child, started, tenant, owed=len(docs) - len(verdicts))
                    return [*verdicts, self._timeout(self.budget), *[None] * (len(docs) - len(verdicts) - 1)]
                verdicts.append(_read_reply(reply, len(exprs)))
        except EvaluatorDied:
            # It started and then died mid-evaluation: the memory cap, or a crash in jq. A fault, not an outage.
            self._gone(child, tenant)
            died = {"fault": "budget_exhausted", "rule_index": None,
                    "detail": "the evaluator died (memory cap or crash)"}
            return [*verdicts, died, *[None] * (len(docs) - len(verdicts) - 1)]
        except BaseException:
            self._gone(child, tenant)
            raise
        self._done_with(child, tenant)
        return verdicts

    @staticmethod
    def _timeout(seconds: float) -> dict:
        return {"fault": "timeout", "rule_index": None, "detail": f"no reply within {int(seconds * 1000)} ms"}

    def close(self) -> None:
        with self._changed:
            self._closed = True
            idle, self._idle = self._idle, []
        for child in idle:
            self._leave(child)


def _rule_index(value: Any, count: int) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < count else None


def _read_reply(reply: dict, count: int) -> dict:
    """The child's reply to an evaluation, checked field by field."""
    result = reply.get("result")
    if isinstance(result, dict) and _rule_index(result.get("match"), count) is not None:
        return {"match": result["match"]}
    if isinstance(result, dict) and _rule_index(result.get("fault"), count) is not None:
        return {"fault": "error", "rule_index": result["fault"], "detail": fault_detail(result.get("detail"))}
    if result == {"none": True}:
        return {"none": True}
    cause = reply.get("fault") if reply.get("fault") in ("error", "budget_exhausted") else "error"
    return {"fault": cause, "rule_index": None, "detail": fault_detail(reply.get("detail", "no usable reply"))}


def fault_detail(detail: Any) -> str:
    try:
        text = detail if isinstance(detail, str) else json.dumps(detail)
    except (ValueError, RecursionError):
        text = "an error value too deep to show"
    return " ".join(text.split())[:300]
