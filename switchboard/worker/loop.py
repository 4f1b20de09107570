"""The worker's loop (SPEC section 15): each of `--concurrency` slots claims with a waiting claim (the doorbell wakes
it at once; the slots free at one moment share one claim of as many todos, `max_todos`, one todo each), works the
todo as a job under the claim's own lease, heartbeating every third of it, and reports the job's outcome. What a job does is a runner's business (switchboard.worker.job). The loop keeps the lease, stops a
job whose lease is lost, enforces `--timeout`, parks the quota group (switchboard.worker.park) and shuts down
cleanly."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import signal
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from switchboard.worker.api import Backoff, OddAnswer, Refused, ServerApi, Unanswered
from switchboard.worker.job import (
    CompleteWithOutputs,
    Fail,
    Job,
    JobRunner,
    Misconfigured,
    Outcome,
    Park,
    refused_outputs_error,
    scrub,
)
from switchboard.worker.park import QuotaPark

log = logging.getLogger("switchboard.worker")

CLAIM_WAIT_SECONDS = 30.0  # one waiting claim; the server allows up to MAX_CLAIM_WAIT_SECONDS
MAX_CLAIM_WAIT_SECONDS = 60.0
PARK_POLL_SECONDS = 2.0  # how often the park file is read again: another worker of the group may park it
RELEASE_PAUSE_SECONDS = 5.0  # a slot whose job released its todo waits this long before claiming again
MESSAGE_CHARS = 2048  # the worker's own error texts (a job that raised, an answer refused) are cut to this
LOG_ERROR_CHARS = 200  # a job's log line carries the first line of its error, cut to this
INSTANT_EMPTY_SECONDS = 1.0  # a waiting claim answered empty sooner than this was not a wait: back off
SHORTEST_HEARTBEAT_SECONDS = 0.5  # between two heartbeats of one job, whatever lease the server granted
LONGEST_LEASE_SECONDS = 7 * 86400  # a granted lease past this is not an answer the server gives
TODO_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,100}")  # it goes into the URL of every call on the todo


@dataclass
class Lease:
    """A claim's lease as this worker must assume it: `deadline` (loop time) counts from when the claim or the
    last heartbeat that renewed it was sent, so it never ends later than the server's."""
    todo_id: str
    token: str
    seconds: float
    renewed_at: float

    @property
    def deadline(self) -> float:
        return self.renewed_at + self.seconds


@dataclass(eq=False)
class RunningJob:
    job: Job
    lease: Lease
    task: asyncio.Task
    stopped: str | None = None  # why the worker stopped it: "timeout", "shutdown" or "lease_lost"
    error: str | None = None  # the error the todo was failed with, for the job's log line
    next: tuple[Job, Lease] | None = None  # the todo its completion claimed for the slot (claim_next)

    def stop(self, reason: str) -> None:
        """Cancel the job (its runner kills what it started); the first reason given is the one that counts."""
        if self.stopped is None and not self.task.done():
            self.stopped = reason
            self.task.cancel()


# -- the worker ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Settings:
    server: str
    token: str
    queues: list[str] | None
    name: str
    concurrency: int
    once: bool
    wait: float
    state_dir: Path
    quota_group: str
    lease: int | None
    timeout: float | None


class Worker:
    # Free slots share one claim (max_todos); off for good once a server of an earlier release refuses the field.
    batching = True

    def __init__(self, settings: Settings, runner: JobRunner):
        self.settings = settings
        self.runner = runner
        self.api = ServerApi(settings.server, settings.token, 2 * settings.concurrency + 2)
        self.park = QuotaPark(settings.state_dir, settings.quota_group)
        self.parked_until: float | None = None
        self.stopping = False
        self.exit_code = 0
        self.unreachable = False  # the outage is logged once, and its end
        self.waiting_claims: set[asyncio.Task] = set()
        self.hungry: list[tuple[asyncio.Future, float]] = []  # slots waiting for the next claim, and their waits
        self.asking: set[asyncio.Task] = set()
        self.running: set[RunningJob] = set()
        self._changed = asyncio.Event()  # set (and replaced) when the park or shutdown state changes

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: a closed terminal, a supervisor
            loop.add_signal_handler(sig, self.shut_down)
        s = self.settings
        log.info("worker %s on %s: queues %s, concurrency %d, quota group %s", s.name, s.server,
                 ",".join(s.queues) if s.queues else "(all of the endpoint's)", s.concurrency, s.quota_group)
        self._set_parked(self.park.until(time.time()))
        watcher = asyncio.create_task(self._watch_park())
        try:
            await asyncio.gather(*(self._slot() for _ in range(1 if s.once else s.concurrency)))
        finally:
            watcher.cancel()
            await self.api.close()
        log.info("worker %s stopped", s.name)
        return self.exit_code

    def shut_down(self) -> None:
        """SIGTERM, SIGINT or SIGHUP: claim nothing more and give running jobs their lease to finish (a second
        signal stops them at once); what they leave unfinished is released."""
        if self.stopping:
            log.info("stopping the running jobs now")
            for running in list(self.running):
                running.stop("shutdown")
            return
        self._stop_claiming()

    def _stop_claiming(self) -> None:
        if self.stopping:
            return
        log.info("stopping: no more claims; %d running job(s) have their lease to finish", len(self.running))
        self.stopping = True
        # A claim the server answers as it is cancelled stays claimed until its lease lapses: delayed, not lost.
        for claim in list(self.waiting_claims):
            claim.cancel()
        loop = asyncio.get_running_loop()
        for running in list(self.running):
            loop.call_later(running.lease.seconds, running.stop, "shutdown")
        self._notify()

    def _notify(self) -> None:
        """Wake everything waiting for the park or the shutdown state to change; each looks again."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _set_parked(self, until: float | None) -> None:
        if until == self.parked_until:
            return
        self.parked_until = until
        if until is None:
            log.info("quota group %s: the park is over", self.settings.quota_group)
        else:
            log.info("quota group %s parked until %s: claiming nothing", self.settings.quota_group, iso(until))
            for claim in list(self.waiting_claims):
                claim.cancel()
        self._notify()

    async def _watch_park(self) -> None:
        while True:
            await asyncio.sleep(PARK_POLL_SECONDS)
            self._set_parked(self.park.until(time.time()))

    async def _pause(self, seconds: float) -> None:
        """Sleep, ending early when the park or shutdown state changes (at once when stopping already)."""
        if self.stopping:
            return
        try:
            await asyncio.wait_for(self._changed.wait(), seconds)
        except TimeoutError:
            pass

    async def _claimable(self, deadline: float | None) -> bool:
        """Wait while the group is parked; False when the worker stops (or --once's wait ends) first."""
        loop = asyncio.get_running_loop()
        while not self.stopping and self.parked_until is not None:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return False
        return not self.stopping

    async def _slot(self) -> None:
        """Claim and work todos one at a time until the worker stops (with --once: one todo, or none in --wait)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.wait if self.settings.once else None
        retry, empties = Backoff(), Backoff()
        handed: tuple[Job, Lease] | None = None  # what the last job's completion claimed for this slot
        while handed is not None or await self._claimable(deadline):
            claimed, handed = handed, None
            if claimed is None:
                wait = CLAIM_WAIT_SECONDS if deadline is None else max(0.0, min(MAX_CLAIM_WAIT_SECONDS,
                                                                                deadline - loop.time()))
                asked = loop.time()
                try:
                    claimed = await self._claim(wait)
                except Unanswered as exc:
                    self._lost_server(exc)
                    await self._pause(retry.next())
                    continue
                except Refused as exc:
                    log.error("the server refused the claim: %s", exc)
                    self.exit_code = 1
                    self._stop_claiming()
                    return
                self._found_server()
                retry = Backoff()
                if claimed is None and wait >= INSTANT_EMPTY_SECONDS and \
                        loop.time() - asked < INSTANT_EMPTY_SECONDS:
                    # Nothing, at once, though the claim could wait (a paused queue, a cap, a server that does not
                    # wait): not straight back, or the worker would hammer it.
                    await self._pause(empties.next())
                elif claimed is not None or loop.time() - asked >= INSTANT_EMPTY_SECONDS:
                    empties = Backoff()
            if claimed is not None:
                job, lease = claimed
                if self.stopping or self.park.until(time.time()) is not None:
                    await self._hand_back(lease, "the worker is stopping" if self.stopping else
                                          f"quota group {self.settings.quota_group} is parked")
                    continue
                # The slot goes on working: its completion may claim the next todo in the same call (not --once).
                outcome, handed = await self._work(job, lease, chain=deadline is None)
                if outcome == "release":
                    # Not straight back to the queue: the todo it handed back would be its own next claim.
                    await self._pause(RELEASE_PAUSE_SECONDS)
            if deadline is not None and (claimed is not None or loop.time() >= deadline):
                return

    def _claim_fields(self) -> dict[str, Any]:
        """What every claim of this worker asks for: its name, its queues, its lease."""
        fields: dict[str, Any] = {"claimant": self.settings.name}
        if self.settings.queues:
            fields["queues"] = self.settings.queues
        if self.settings.lease is not None:
            fields["lease_seconds"] = self.settings.lease
        return fields

    async def _claim(self, wait: float) -> tuple[Job, Lease] | None:
        """This slot's next todo, from a waiting claim; None when nothing came for it (or the claim was called
        off: park or shutdown). The slots that ask in one turn of the event loop (all of them at the start, those
        a batch left without a todo) share one claim for as many todos as they are."""
        loop = asyncio.get_running_loop()
        slot = loop.create_future()
        self.hungry.append((slot, wait))
        if len(self.hungry) == 1:
            loop.call_soon(self._ask_for_hungry)
        return await slot

    def _ask_for_hungry(self) -> None:
        batch, self.hungry = self.hungry, []
        for part in [batch] if self.batching else [[slot] for slot in batch]:
            asking = asyncio.create_task(self._ask(part))
            self.asking.add(asking)
            asking.add_done_callback(self.asking.discard)

    async def _ask(self, batch: list[tuple[asyncio.Future, float]]) -> None:
        """One waiting claim for the slots of `batch` (max_todos: one todo each), its todos handed out in order;
        a slot left without one gets None, and an error the claim met reaches every slot of it."""
        if self.stopping or self.parked_until is not None:
            # Stopped or parked since the slots asked: a claim sent now would be one the stop (or the park) did
            # not call off, and the worker would wait for its answer.
            for slot, _ in batch:
                slot.set_result(None)
            return
        wait = min(w for _, w in batch)
        body = {**self._claim_fields(), "wait_seconds": wait}
        if len(batch) > 1:
            body["max_todos"] = len(batch)
        claim = asyncio.create_task(self.api.post("/todos/claim", body, wait + 10))
        self.waiting_claims.add(claim)
        try:
            await asyncio.wait([claim])
        finally:
            self.waiting_claims.discard(claim)
        claimed: list[tuple[Job, Lease]] = []
        error: Exception | None = None
        if not claim.cancelled():
            try:
                claimed = self._claimed(claim.result(), len(batch))
            except Refused as exc:
                if "max_todos" in body and exc.status == 400 and "max_todos" in exc.message:
                    log.warning("the server does not take max_todos (an earlier release): each slot claims alone")
                    self.batching = False  # the slots get nothing this time, and ask again one by one
                else:
                    error = exc
            except Exception as exc:  # noqa: BLE001 - each slot handles it as its own claim's (Unanswered, ...)
                error = exc
        for n, (slot, _) in enumerate(batch):
            if slot.done():
                continue
            if error is not None:
                slot.set_exception(error)
            else:
                slot.set_result(claimed[n] if n < len(claimed) else None)

    def _claimed(self, answer: dict, most: int) -> list[tuple[Job, Lease]]:
        """The jobs and leases of a claim's answer: none when it is empty, one, or each of its `claims`."""
        if answer.get("empty") is True and "todo" not in answer:
            return []
        claims = answer.get("claims") if most > 1 and "todo" not in answer else [answer]
        if not isinstance(claims, list) or not 1 <= len(claims) <= most:
            raise OddAnswer(f"the claim's answer holds no claims, or more than the {most} asked for")
        # The lease began when the server claimed, just before it answered (a waiting claim may have waited long
        # before that, so the time the claim was sent says nothing).
        received = asyncio.get_running_loop().time()
        jobs = []
        for claim in claims:
            claim = claim if isinstance(claim, dict) else {}
            todo, token, granted = claimed_todo(claim)
            job = Job(todo, self.settings.name, traceparent=claim.get("traceparent"))
            jobs.append((job, Lease(todo["id"], token, granted, received)))
        return jobs

    async def _work(self, job: Job, lease: Lease, chain: bool) -> tuple[str, tuple[Job, Lease] | None]:
        """Run the job under its lease and report how it ended; returns the outcome its log line names, and the
        next todo when `chain` let its completion claim one."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        running = RunningJob(job, lease, asyncio.create_task(self.runner.run(job)))
        self.running.add(running)
        timeout = (loop.call_later(self.settings.timeout, running.stop, "timeout")
                   if self.settings.timeout else None)
        keeper = asyncio.create_task(self._keep_lease(running))
        try:
            await asyncio.wait([running.task])
        finally:
            self.running.discard(running)
            if timeout is not None:
                timeout.cancel()
            keeper.cancel()
            await asyncio.wait([keeper])
        outcome = await self._finish(running, chain)
        seconds = loop.time() - started
        fields = {"todo": job.id, "queue": job.queue, "outcome": outcome, "seconds": round(seconds, 3)}
        if running.error is None:
            log.info("todo %s queue %s outcome %s in %.2f s", job.id, job.queue, outcome, seconds,
                     extra={"job": fields})
        else:
            error = first_line(scrub(running.error, (self.settings.token,)), LOG_ERROR_CHARS)
            log.info("todo %s queue %s outcome %s in %.2f s: %s", job.id, job.queue, outcome, seconds, error,
                     extra={"job": {**fields, "error": error}})
        return outcome, running.next

    async def _keep_lease(self, running: RunningJob) -> None:
        """Heartbeat every third of the lease with the job's latest note; a lease lost (409, or the server
        unreachable until the lease would lapse) stops the job, and nothing more is reported for it."""
        loop = asyncio.get_running_loop()
        lease = running.lease
        sent_note, sent = None, -math.inf
        while True:
            await asyncio.sleep(max(0.0, lease.renewed_at + lease.seconds / 3 - loop.time(),
                                    sent + SHORTEST_HEARTBEAT_SECONDS - loop.time()))
            note = running.job.note
            sent = loop.time()
            try:
                await self._call_leased(lease, "heartbeat", {"note": note} if note and note != sent_note else {})
            except (Refused, Unanswered) as exc:
                log.warning("todo %s: lease lost (%s): stopping its job", lease.todo_id,
                            exc if isinstance(exc, Refused) else "the server was unreachable until it lapsed")
                running.stop("lease_lost")
                return
            lease.renewed_at = sent
            sent_note = note

    async def _finish(self, running: RunningJob, chain: bool) -> str:
        """Report how the job ended; the outcome as the job's log line names it. With `chain`, a completion
        claims the next todo in the same call (running.next)."""
        if running.stopped == "lease_lost":
            return "lease_lost"
        if running.stopped == "shutdown":
            await self._hand_back(running.lease, "the worker stopped before the job finished")
            return "shutdown"
        if running.stopped == "timeout":
            return await self._report(running, Fail(error="timeout"), name="timeout")
        failure = running.task.exception()
        if isinstance(failure, Misconfigured):
            log.error("todo %s: %s; handing it back and stopping (exit 2)", running.job.id, failure)
            await self._hand_back(running.lease, str(failure)[:MESSAGE_CHARS])
            self.exit_code = 2
            self._stop_claiming()
            running.error = str(failure)
            return "misconfigured"
        if failure is not None:
            log.error("todo %s: the job failed in the worker", running.job.id, exc_info=failure)
            error = f"the worker's job failed: {failure!r}"[:MESSAGE_CHARS]
            return await self._report(running, Fail(error=error), fallback=True)
        return await self._report(running, running.task.result(), chain=chain)

    async def _report(self, running: RunningJob, outcome: Outcome, *, name: str | None = None,
                      fallback: bool = False, chain: bool = False) -> str:
        """Send the outcome (a park parks the group and releases the todo); returns the name the job's log line
        gives it. An outcome the server refuses (other than for a lost lease) fails the todo saying why, unless it
        is that failure (`fallback`) being refused. With `chain`, a completion sent while the worker still claims
        asks for the next todo too (`claim_next`: one round trip and one transaction fewer per job)."""
        lease = running.lease
        if isinstance(outcome, Fail):
            running.error = outcome.error
        now = time.time()
        if isinstance(outcome, Park):
            until = self.park.park(outcome.retry_after, now)
            self._set_parked(until)
            verb, body = "release", {"note": f"quota group {self.settings.quota_group} parked until {iso(until)}"}
        else:
            self.park.served(now)
            verb = outcome.outcome.replace("_", "-")
            body = outcome.model_dump(exclude={"outcome"}, exclude_none=True)
            if chain and verb == "complete" and not self.stopping and self.parked_until is None:
                body["claim_next"] = self._claim_fields()
        sent = asyncio.get_running_loop().time()  # the next claim's lease began after this, on the last try
        try:
            answer = await self._call_leased(lease, verb, body)
        except Refused as exc:
            if exc.status == 409:
                log.warning("todo %s: lease lost before the %s was reported (%s)", lease.todo_id, outcome.outcome, exc)
                return "lease_lost"
            if fallback:
                log.error("todo %s: the server refused the %s: %s", lease.todo_id, verb, exc)
                return "unreported"
            if exc.status == 400 and isinstance(outcome, CompleteWithOutputs) and exc.message.startswith("outputs["):
                error = refused_outputs_error(exc.message, running.job.todo)[:MESSAGE_CHARS]
                return await self._report(running, Fail(error=error, retry=False), fallback=True)
            return await self._report(running, Fail(error=f"the server refused the {outcome.outcome}: "
                                                          f"{exc.message}"[:MESSAGE_CHARS]), fallback=True)
        except Unanswered:
            log.error("todo %s: the server was unreachable until the lease lapsed; the %s is lost and the todo will"
                      " be claimed again", lease.todo_id, outcome.outcome)
            return "unreported"
        if "claim_next" in body:
            running.next = self._handed_over(answer.get("next"), sent)
        return name or outcome.outcome

    def _handed_over(self, answer: object, sent: float) -> tuple[Job, Lease] | None:
        """The todo a completion claimed for the slot, from its answer's `next`; None when nothing was claimable
        or the answer is odd (logged: the todo it may name comes back when its lease lapses)."""
        if not isinstance(answer, dict) or (answer.get("empty") is True and "todo" not in answer):
            return None
        try:
            todo, token, granted = claimed_todo(answer)
        except OddAnswer as exc:
            log.warning("server %s answered oddly (%s): claiming again", self.settings.server, exc)
            return None
        return Job(todo, self.settings.name, traceparent=answer.get("traceparent")), Lease(todo["id"], token, granted,
                                                                                           sent)

    async def _hand_back(self, lease: Lease, note: str) -> None:
        try:
            await self._call_leased(lease, "release", {"note": note})
        except (Refused, Unanswered) as exc:
            log.warning("todo %s: could not release it (%s); its lease will lapse", lease.todo_id, exc)

    async def _call_leased(self, lease: Lease, verb: str, body: dict) -> dict:
        """A fenced call on the lease's todo, tried again while the server cannot be reached and the lease may
        still hold; Unanswered once it cannot."""
        loop = asyncio.get_running_loop()
        retry = Backoff()
        while True:
            try:
                answer = await self.api.post(f"/todos/{lease.todo_id}/{verb}", {"lease_token": lease.token, **body},
                                             max(1.0, min(10.0, lease.deadline - loop.time())))
            except Unanswered as exc:
                self._lost_server(exc)
                pause = min(retry.next(), lease.deadline - loop.time())
                if pause <= 0:
                    raise
                await asyncio.sleep(pause)
                continue
            self._found_server()
            return answer

    def _lost_server(self, exc: Exception) -> None:
        if isinstance(exc, OddAnswer):  # every time: the backoff bounds how often
            log.warning("server %s answered oddly (%s): trying again with backoff", self.settings.server, exc)
            return
        if not self.unreachable:
            self.unreachable = True
            log.warning("server %s unreachable (%s): trying again with backoff", self.settings.server, exc)

    def _found_server(self) -> None:
        if self.unreachable:
            self.unreachable = False
            log.info("server %s reachable again", self.settings.server)


def first_line(text: str, chars: int) -> str:
    """The first non-empty line of `text`, cut to `chars`."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:chars]


def claimed_todo(answer: dict) -> tuple[dict, str, float]:
    """The todo, the lease token and the lease's length (seconds) from a claim's answer, checked so that an odd
    answer is a logged, retried error (OddAnswer) and never a traceback: the todo's id goes into URLs, its times
    decide the heartbeats."""
    todo, token = answer.get("todo"), answer.get("lease_token")
    if not isinstance(todo, dict) or not isinstance(token, str) or not token:
        raise OddAnswer("the claim's answer has no todo and lease token")
    if not isinstance(todo.get("id"), str) or not TODO_ID_PATTERN.fullmatch(todo["id"]):
        raise OddAnswer("the claim's answer names no todo id")
    if not isinstance(todo.get("queue"), str) or not isinstance(todo.get("attempt"), int) \
            or isinstance(todo["attempt"], bool):
        raise OddAnswer(f"the claim's answer for todo {todo['id']} has no queue or attempt")
    try:
        granted = (datetime.fromisoformat(todo["lease_expires_at"]) -
                   datetime.fromisoformat(todo["updated_at"])).total_seconds()  # both the server's clock
    except (KeyError, TypeError, ValueError, OverflowError):
        raise OddAnswer(f"the claim's answer for todo {todo['id']} has no readable lease times") from None
    if not 0 <= granted <= LONGEST_LEASE_SECONDS:
        raise OddAnswer(f"the claim's answer for todo {todo['id']} grants a lease of {granted:g} s")
    return todo, token, granted


def iso(unix_seconds: float) -> str:
    return datetime.fromtimestamp(unix_seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
