"""What REST, MCP, the CLI and the Board all do the same way: deliveries, waiting claims, ring streams,
rules, replay."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import hashlib
import json
import math
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from switchboard.configuration import (
    KEEPALIVE_SECONDS,
    PRUNE_EVERY_SECONDS,
    SCHEDULER_IDLE_SECONDS,
    ApiError,
    Nap,
    Vitals,
    log,
)
from switchboard.crypto import SecretBox, token_hash
from switchboard.database import PRINCIPAL_RECHECK, Database
from switchboard.doorbell import RING_FIELDS, Doorbell, Session
from switchboard.envelope import build_envelope, envelope_document, envelope_record
from switchboard.evaluator import (
    EVAL_BATCH,
    EVAL_FRAME_BYTES,
    EVAL_QUEUE_PER_TENANT,
    EVAL_THREADS,
    EVAL_WAIT_SECONDS,
    VERIFICATION_ALERT_COUNT,
    VERIFICATION_ALERT_WINDOW,
    Evaluator,
    EvaluatorBusy,
    EvaluatorUnavailable,
)
from switchboard.forge import ForgeSender, test_connection, token_login
from switchboard.limits import PendingRules, RateLimited, RateLimiter, TenantGate
from switchboard.metrics import Metrics
from switchboard.models import (
    BulkAction,
    ClaimNext,
    ConnectionCreate,
    NotifyCreate,
    ReleaseQuarantine,
    ReplayMany,
    ReplayOne,
    RuleSet,
    RulesTest,
)
from switchboard.notifier import Notifier
from switchboard.payload import decode_payload, payload_text, value_at
from switchboard.providers import VerificationFailed, delivery_key, verify_delivery
from switchboard.store.bulk import BULK_STEP_TODOS, BulkRun, bulk_dry_run, bulk_matches, bulk_step, step_pacing
from switchboard.store.connections import add_connection
from switchboard.store.deliveries import Delivery, DeliverySpans, duplicate_of, find_webhook, record_delivery
from switchboard.store.forge_control import read_command
from switchboard.store.outbox import add_channel, notify_verification_failures, queue_test_message
from switchboard.store.principals import Principal, authenticate
from switchboard.store.quarantine import apply_quarantine_release, prepare_quarantine_release
from switchboard.store.replay import (
    apply_replays,
    decide_again,
    replay_batches,
    replay_events,
    replay_subjects,
    replay_summary,
)
from switchboard.store.routing import decide_for_webhook, dry_run_rules, gate, set_rules, trust_gate, verdict
from switchboard.store.rules import rules_view
from switchboard.store.todos import stored_json
from switchboard.store.transitions import claim_next, claim_queues, hand_back_unheard, pending_among, span_record
from switchboard.store.upkeep import next_due, prune, rings_for_new_session, scheduler_tick
from switchboard.store.webhooks import commands_of
from switchboard.tracing import new_span_id, new_trace_id, parse_traceparent

# A remembered principal (Flows.principal) is looked up afresh after this long (each transaction re-checks it
# anyway), and at most this many are kept.
PRINCIPAL_CACHE_SECONDS = 10.0
PRINCIPAL_CACHE_SIZE = 4096


async def stream_queue(queue: asyncio.Queue, first: list[str]) -> AsyncIterator[str]:
    """An SSE body: the first frames, then whatever is queued, with keep-alive comments; None ends it."""
    for frame in first:
        yield frame
    while True:
        try:
            frame = await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
        except TimeoutError:
            yield ": keepalive\n\n"
            continue
        if frame is None:
            return
        yield frame


def ingest_spans(webhook: sqlite3.Row, envelope: dict, headers: dict[str, str], outcome: dict,
                 spans: DeliverySpans, times: tuple[int, int, int, int]) -> list[dict]:
    """A recorded delivery's `ingest {provider}` span (SERVER) and its `route` span (INTERNAL) inside. The ingest
    span is the root of its trace, or, for the server's own label write coming back, a child of that write's span
    and linked to it. A `traceparent` header the producer sent is a link only: producer text never places a span."""
    started, routing, routed, ended = times
    attributes = {"messaging.system": "switchboard", "switchboard.endpoint_id": webhook["endpoint_id"],
                  "switchboard.webhook_id": webhook["id"], "switchboard.event_id": outcome.get("event_id"),
                  "switchboard.outcome": outcome.get("disposition"), "switchboard.subject_key": envelope["subject_key"]}
    attributes = {name: value for name, value in attributes.items() if value is not None}
    links = []
    if spans.follows is not None:
        links.append((spans.trace_id, spans.follows, {"switchboard.link": "forge_write"}))
    producer = parse_traceparent(headers.get("traceparent"))
    if producer is not None:
        links.append((*producer, {"switchboard.link": "producer"}))
    return [span_record(f"ingest {webhook['provider']}", "server", spans.trace_id, spans.ingest_span, spans.follows,
                        started, ended, attributes, links),
            span_record("route", "internal", spans.trace_id, spans.route_span, spans.ingest_span, routing, routed,
                        {"messaging.system": "switchboard", "switchboard.outcome": outcome.get("disposition", "")})]


class WaitingClaim:
    """One `claim_next` with `wait_seconds`: claim now, or wait for a ring and try again, until the deadline.

    The waiter is attached before each attempt, so a todo that arrives between the attempt and the wait still
    wakes it; at the deadline it tries once more. A ring this waiter took but did not use is passed on, so no
    other session misses it. If the asker goes away (`gone`) the wait ends, and a todo claimed for an asker
    already gone is handed back, uncharged. With `max_todos`, the wait is for the first claimable todo: the
    attempt that finds one takes up to `max_todos` then."""

    EMPTY = {"empty": True}

    def __init__(self, flows: Flows, principal: Principal, body: ClaimNext, gone: asyncio.Future):
        self.flows = flows
        self.principal = principal
        self.body = body
        self.gone = gone
        self.queues = claim_queues(principal, body.queue_filter())
        self.owed: dict | None = None  # a ring this waiter was given and has not yet claimed
        self.claimed: set[str] = set()
        self.empty = self.EMPTY  # the last empty answer (with the queues a pause or a cap kept shut)

    async def run(self) -> dict:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body.wait_seconds
        last_try = False
        try:
            while True:
                listening = not (last_try or self.flows.doorbell.closing)
                session, rung = (self.flows.doorbell.waiter(self.principal.id, self.queues, self.owed is not None)
                                 if listening else (None, None))
                try:
                    result = await self._attempt()
                    if result is not None or session is None or self.gone.done():
                        return result or self.empty
                    heard = await self._wait(rung, deadline - loop.time())
                    if self.gone.done():
                        return self.EMPTY
                    last_try = heard == "deadline"
                finally:
                    self._settle(session, rung)
        finally:
            self.gone.cancel()

    async def _attempt(self) -> dict | None:
        """One claim: the answer, or None when nothing was claimable."""
        result = await self.flows.db.write(claim_next, self.principal, self.body,
                                           self.owed["todo_id"] if self.owed else None)
        if result.get("empty"):
            self.owed = None
            self.empty = result
            return None
        claims = result.get("claims") or [result]
        if self.gone.done():
            for claim in claims:
                await self.flows.db.write(hand_back_unheard, self.principal, claim["todo"]["id"], claim["lease_token"])
            return self.EMPTY
        self.claimed = {claim["todo"]["id"] for claim in claims}
        return result

    async def _wait(self, rung: asyncio.Future, remaining: float) -> str:
        """Wait for the ring ("rung": the ring is now owed), the asker leaving, or the deadline ("deadline"). With
        several processes (db.poll_seconds) the wait also ends to look again ("poll"): a ring can be lost on its way
        from another process (a lost connection, a session that left as it came), and the queue is the ledger."""
        if remaining <= 0:
            return "deadline"
        poll = self.flows.db.poll_seconds
        timeout = remaining if poll is None else min(remaining, poll)
        done, _ = await asyncio.wait({rung, self.gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if rung in done:
            self.owed = rung.result()
            return "rung"
        return "poll" if timeout < remaining else "deadline"

    def _settle(self, session: Session | None, rung: asyncio.Future | None) -> None:
        """Leave the doorbell; pass on any ring not used once this claim is over (or a ring came late)."""
        if session is not None:
            self.flows.doorbell.detach(session)
        late = rung.result() if rung is not None and rung.done() and rung.result() is not self.owed else None
        if self.claimed or self.gone.done() or late:
            unused = {r["todo_id"]: r for r in (self.owed, late) if r and r["todo_id"] not in self.claimed}
            if unused:
                self.flows.pass_on([{**r, "endpoint_id": self.principal.id} for r in unused.values()])
            self.owed = None


class Changes:
    """That the database changed, for whoever shows it live (the Board's streams): `moved()` is called when the
    scheduler's probe sees PRAGMA data_version move (any commit: this server's writer, the CLI, another process),
    and every callback `subscribe`d is told at once. Nothing is read or timed for a listener until then, so open
    views cost nothing while nothing changes."""

    def __init__(self) -> None:
        self._listeners: dict[Callable[[], None], None] = {}
        self.on_watch: Callable[[], None] | None = None  # a live view opened (Postgres: look at the marker soon)

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners[listener] = None
        if self.on_watch is not None:
            self.on_watch()

    def watched(self) -> bool:
        return bool(self._listeners)

    def unsubscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.pop(listener, None)

    def moved(self) -> None:
        for listener in list(self._listeners):
            listener()


class FailedChecks:
    """Failed signature checks, per webhook, by the minute over the last WINDOW_MS (a day): exact to the minute,
    and at most 1,440 (minute, count) pairs a webhook however many fail. Kept in memory only: a failure is a
    request nobody authenticated, and counting it must cost no write (see docs/board.md). `started_at` says
    since when the server has counted."""

    WINDOW_MS = 86_400_000
    MINUTE_MS = 60_000

    def __init__(self, now_ms: int):
        self.started_at = now_ms
        self.by_webhook: dict[str, collections.deque] = {}

    def add(self, webhook_id: str, now_ms: int) -> None:
        minute = now_ms // self.MINUTE_MS
        kept = self.by_webhook.setdefault(webhook_id, collections.deque())
        if kept and kept[-1][0] == minute:
            kept[-1][1] += 1
        else:
            kept.append([minute, 1])
        self._forget(kept, minute)

    def count(self, webhook_id: str, now_ms: int) -> int:
        """How many failed in the last day (the minute now and the 1,439 before it)."""
        kept = self.by_webhook.get(webhook_id)
        if not kept:
            return 0
        self._forget(kept, now_ms // self.MINUTE_MS)
        if not kept:
            del self.by_webhook[webhook_id]
        return sum(n for _, n in kept)

    def _forget(self, kept: collections.deque, minute: int) -> None:
        while kept and kept[0][0] <= minute - self.WINDOW_MS // self.MINUTE_MS:
            kept.popleft()


def _settle(pending: PendingRules, result: Any) -> None:
    """A delivery's answer: its result, or the error to raise; nothing when its caller has left."""
    if pending.answer.done():
        return
    if isinstance(result, BaseException):
        pending.answer.set_exception(result)
    else:
        pending.answer.set_result(result)


class EvaluationShed(ApiError):
    """A delivery whose rules found no sandbox child within EVAL_WAIT_SECONDS: 503 with Retry-After (the HTTP layer
    sends `retry_after`), and nothing stored, so the producer's redelivery is evaluated then."""

    def __init__(self, waited: float):
        super().__init__("unavailable", f"this owner's rules are all busy: not evaluated within {waited:g} s and"
                                        " not stored; retry later")
        self.retry_after = max(1, math.ceil(waited))


@dataclass
class Shedding:
    """Deliveries to one webhook shed since the server started, and the last one's time (ms)."""
    count: int = 0
    last: int = 0
    logged: float = -math.inf


class Flows:
    """The shared flows, over one database, doorbell, evaluator and secret box."""

    def __init__(self, db: Database, doorbell: Doorbell, evaluator: Evaluator, box: SecretBox,
                 limiter: RateLimiter, metrics: Metrics, vitals: Vitals, notifier: Notifier, forge: ForgeSender,
                 verified_limiter: RateLimiter | None = None):
        self.db = db
        self.notifier = notifier
        self.forge = forge
        self.failed_checks = FailedChecks(db.clock.now_ms())  # the Board's "failed signature checks" count
        self.recent_failures: dict[str, collections.deque] = {}  # the last few, for the repeated-failures alert
        self.failures_told: dict[str, float] = {}
        self.doorbell = doorbell
        self.evaluator = evaluator
        self.box = box
        # Two ingest limits: `limiter` per source address, for what nobody authenticated (a generic webhook's
        # deliveries, failed signature checks); `verified_limiter` per webhook, a generous one, for deliveries whose
        # signature verified (behind a proxy or a tunnel they all come from one address, and a producer such as
        # GitHub never redelivers one it was refused).
        self.limiter = limiter
        self.verified_limiter = verified_limiter or RateLimiter(0, 1)
        self.metrics = metrics
        self.vitals = vitals
        # Evaluator calls get threads of their own, so reads, claims and /healthz never queue behind rules.
        self.eval_threads = concurrent.futures.ThreadPoolExecutor(EVAL_THREADS, thread_name_prefix="switchboard-eval")
        self.tenant_gates: dict[str, TenantGate] = {}
        self.dispatchers: set[asyncio.Task] = set()  # one per owner with deliveries waiting (a task needs a holder)
        self.closing = False
        self.shed: dict[str, Shedding] = {}  # by webhook id: what the Board's webhook page shows
        self.changes = Changes()  # told by the background loop's probe; the Board's live view listens
        self.looks = Nap()  # the background loop's pause between looks, ended early when a change is told
        self.passing: set[asyncio.Task] = set()  # rings being passed on (a task needs a holder)
        self.tracing: Callable[[list[dict]], None] | None = None  # the span exporter's emit (app), if any
        self.principals: dict[str, tuple[Principal, float]] = {}  # by token hash: (principal, monotonic expiry)

    async def principal(self, token: str, *, remembered: bool = False) -> Principal | None:
        """Who a bearer token names (None: nobody). Where a lookup is a round trip to a database server (Postgres)
        and the caller answers only through transactions (`remembered`), a principal found is remembered for
        PRINCIPAL_CACHE_SECONDS, and the request it serves then has every transaction confirm in its first flight
        that the token still names it (PRINCIPAL_RECHECK): a revoked or replaced token stops at once, in every
        process. Any other caller (an MCP session opening, a doorbell stream) looks the token up. SQLite's lookup
        is one indexed row in this process, which costs less than remembering."""
        PRINCIPAL_RECHECK.set(None)
        if not (remembered and self.db.caches_principals):
            return await self.db.lookup(authenticate, token)
        digest = token_hash(token)
        now = time.monotonic()
        hit = self.principals.get(digest)
        if hit is not None and hit[1] > now:
            PRINCIPAL_RECHECK.set(hit[0].recheck(digest))
            return hit[0]
        principal = await self.db.read(authenticate, token)
        self.principals.pop(digest, None)
        if principal is not None:
            if len(self.principals) >= PRINCIPAL_CACHE_SIZE:
                self.principals.pop(next(iter(self.principals)))
            self.principals[digest] = (principal, now + PRINCIPAL_CACHE_SECONDS)
        return principal

    def pass_on(self, rings: list[dict]) -> None:
        """Rings a waiting claim was given and did not use, for the next session in line: only those whose todo is
        still pending. Where claims run side by side (Postgres) a claim rung for one todo may take another, and
        the ring of a todo claimed meanwhile would wake a worker in vain, which would pass it on in turn."""
        task = asyncio.get_running_loop().create_task(self._pass_on(rings), context=contextvars.Context())
        self.passing.add(task)
        task.add_done_callback(self.passing.discard)

    async def _pass_on(self, rings: list[dict]) -> None:
        try:
            pending = await self.db.read(pending_among, [ring["todo_id"] for ring in rings])
        except Exception:  # noqa: BLE001 - unread, every ring goes on: a ring in vain costs less than one lost
            log.warning("could not read which todos are still pending; passing every ring on", exc_info=True)
            pending = {ring["todo_id"] for ring in rings}
        passing = [ring for ring in rings if ring["todo_id"] in pending]
        self.doorbell.passed_on += len(passing)
        self.doorbell.ring(passing)

    # -- the evaluator's fair share ------------------------------------------------------------------
    async def evaluate(self, tenant: str, fn: Callable, *args) -> Any:
        """Run `fn` (which talks to the evaluator: a rules save, a dry run, a release, a replay) on the evaluator's
        threads, at most `per_tenant` at once per tenant: the others wait in line here, on the event loop, holding
        no thread. A tenant with EVAL_QUEUE_PER_TENANT already waiting is refused (503) at once."""
        gate = self._gate(tenant)
        if gate.waiting + len(gate.deliveries) >= EVAL_QUEUE_PER_TENANT:
            raise ApiError("unavailable", "this owner's deliveries are queued too deep; retry later")
        gate.waiting += 1
        try:
            await gate.slots.acquire()
        finally:
            gate.waiting -= 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.eval_threads, functools.partial(fn, *args))
        except EvaluatorBusy as exc:
            raise ApiError("unavailable", f"the rule evaluator is busy ({exc}); retry later") from None
        except EvaluatorUnavailable as exc:
            log.error("rules not evaluated: %s", exc)
            raise ApiError("unavailable", f"the rule evaluator cannot run ({exc}); retry later") from None
        finally:
            gate.slots.release()

    def _gate(self, tenant: str) -> TenantGate:
        return self.tenant_gates.setdefault(tenant, TenantGate(asyncio.Semaphore(self.evaluator.per_tenant)))

    async def evaluate_delivery(self, tenant: str, stored: dict, doc: bytes) -> dict:
        """The evaluator's result for one delivery's envelope under its webhook's rule set (`rules_view`). It
        waits in its owner's line, and goes to a child in a frame with the deliveries that wait with it under the
        same rule set (`_dispatch`). Not taken within EVAL_WAIT_SECONDS: EvaluationShed, and not evaluated."""
        gate = self._gate(tenant)
        if self.closing or gate.waiting + len(gate.deliveries) >= EVAL_QUEUE_PER_TENANT:
            raise EvaluationShed(EVAL_WAIT_SECONDS)
        pending = PendingRules((tuple(rule["expr"] for rule in stored["rules"]),
                                json.dumps(stored["params"], sort_keys=True)), stored["params"], doc,
                               time.monotonic() + EVAL_WAIT_SECONDS, asyncio.get_running_loop().create_future())
        gate.deliveries.append(pending)
        if not gate.dispatching:
            gate.dispatching = True
            task = asyncio.get_running_loop().create_task(self._dispatch(tenant, gate), context=contextvars.Context())
            self.dispatchers.add(task)
            task.add_done_callback(self.dispatchers.discard)
        try:
            await asyncio.wait({pending.answer}, timeout=EVAL_WAIT_SECONDS)
            if not pending.answer.done() and not pending.taken:
                raise EvaluationShed(EVAL_WAIT_SECONDS)
            return await pending.answer
        finally:
            if not pending.taken:
                with contextlib.suppress(ValueError):
                    gate.deliveries.remove(pending)
            # Whatever its frame still brings is for nobody now (a caller that left, or one that was shed).
            pending.answer.cancel()

    async def _dispatch(self, tenant: str, gate: TenantGate) -> None:
        """While the owner has deliveries waiting: one frame of them at a time, so a flood holds one child and its
        frames grow instead."""
        try:
            while gate.deliveries and not self.closing:
                frame = self._take_frame(gate)
                if frame:
                    await self._evaluate_frame(tenant, gate, frame)
        finally:
            gate.dispatching = False
            if self.closing:
                while gate.deliveries:
                    _settle(gate.deliveries.popleft(), ApiError("unavailable", "the server is stopping; retry"))

    @staticmethod
    def _take_frame(gate: TenantGate) -> list[PendingRules]:
        """The first waiting delivery and up to EVAL_BATCH - 1 more under its rule set, in their order, within
        EVAL_FRAME_BYTES of envelopes; the others keep their places. One whose caller left is dropped, one whose
        time has passed is shed."""
        now, frame, kept, size = time.monotonic(), [], collections.deque(), 0
        while gate.deliveries:
            pending = gate.deliveries.popleft()
            if pending.answer.done():
                continue
            if now >= pending.until:
                pending.answer.set_exception(EvaluationShed(EVAL_WAIT_SECONDS))
            elif not frame or (len(frame) < EVAL_BATCH and size + len(pending.doc) <= EVAL_FRAME_BYTES
                               and pending.rule_set == frame[0].rule_set):
                pending.taken = True
                frame.append(pending)
                size += len(pending.doc)
            else:
                kept.append(pending)
        gate.deliveries = kept
        return frame

    async def _evaluate_frame(self, tenant: str, gate: TenantGate, frame: list[PendingRules]) -> None:
        """One frame through the evaluator's threads. Each delivery gets its result, is shed or refused with the
        pool's reason, or goes back to the front of the line (after one that overran or killed its child)."""
        first = frame[0]
        try:
            results: list = await asyncio.get_running_loop().run_in_executor(self.eval_threads, functools.partial(
                self.evaluator.run_batch, first.rule_set[0], first.params, [p.doc for p in frame], tenant,
                min(p.until for p in frame)))
        except EvaluatorBusy:
            now = time.monotonic()
            results = [EvaluationShed(EVAL_WAIT_SECONDS) if now >= p.until else None for p in frame]
        except EvaluatorUnavailable as exc:
            log.error("rules not evaluated: %s", exc)
            results = [ApiError("unavailable", f"the rule evaluator cannot run ({exc}); retry later") for _ in frame]
        except Exception:  # noqa: BLE001 - the owner's line must outlive one bad frame; the cause is logged
            log.exception("rules not evaluated")
            results = [ApiError("unavailable", "the rule evaluator failed; retry later") for _ in frame]
        except BaseException:
            for pending in frame:
                _settle(pending, ApiError("unavailable", "the server is stopping; retry later"))
            raise
        again = []
        for pending, result in zip(frame, results, strict=True):
            if result is None and not pending.answer.done():
                pending.taken = False
                again.append(pending)
            else:
                _settle(pending, result)
        gate.deliveries.extendleft(reversed(again))

    # -- deliveries ----------------------------------------------------------------------------------
    async def open_webhook(self, token: str, source: str) -> sqlite3.Row:
        """The webhook behind an ingest URL, ready to take a delivery from `source`, before any body is read.
        (Database.lookup: on the event loop in SQLite mode.)"""
        webhook = await self.db.lookup(find_webhook, token)
        if webhook is None:
            raise ApiError("not_found", "no such webhook")
        if webhook["owner_revoked_at"] is not None:
            raise ApiError("unavailable", "this webhook's owner endpoint is revoked")
        if webhook["trust_mode"] == "signed" and webhook["secret_sealed"] is None:
            raise ApiError("unavailable", "this webhook's signing secret is not set yet")
        if webhook["trust_mode"] != "signed":
            # The URL is the only credential: each delivery is stored, so each counts against its address now.
            self._limit(self.limiter, source, webhook["provider"], "too many deliveries from this address")
        return webhook

    def _limit(self, limiter: RateLimiter, key: str, provider: str, message: str) -> None:
        wait = limiter.retry_after(key)
        if wait:
            self.metrics.deliveries.labels(provider, "rate_limited").inc()
            raise RateLimited(wait, message)

    async def _verify(self, webhook: sqlite3.Row, headers: dict[str, str], body: bytes, source: str) -> bool:
        provider = webhook["provider"]
        secret = self.box.open(webhook["secret_sealed"], webhook["id"]) if webhook["secret_sealed"] else None
        try:
            verified = verify_delivery(provider, secret, headers, body, self.db.clock.now_ms())
        except VerificationFailed as failure:
            self.metrics.verification_failures.labels(provider, failure.reason).inc()
            await self._count_failed_check(webhook["id"], failure.reason)
            # Failed checks count against their address: past its limit they are answered 429, and not logged one
            # by one (the metric and the Board's count still have every one).
            self._limit(self.limiter, source, provider, "too many failed signature checks from this address")
            self.metrics.deliveries.labels(provider, "unverified").inc()
            log.warning("delivery refused: webhook %s (%s) from %s: %s", webhook["id"], provider, source,
                        failure.reason)
            raise ApiError("unauthenticated", f"signature verification failed: {failure.reason}") from None
        if verified:
            self._limit(self.verified_limiter, webhook["id"], provider,
                        f"too many deliveries to this webhook (over {self.verified_limiter.rate:g}/s, bursts of"
                        f" {self.verified_limiter.burst})")
        return verified

    async def _count_failed_check(self, webhook_id: str, reason: str) -> None:
        """Tell the human when a webhook fails its check again and again (a wrong secret, or someone probing):
        at VERIFICATION_ALERT_COUNT failures within VERIFICATION_ALERT_WINDOW, at most once an hour."""
        self.failed_checks.add(webhook_id, self.db.clock.now_ms())
        now = time.monotonic()
        recent = self.recent_failures.setdefault(webhook_id, collections.deque(maxlen=VERIFICATION_ALERT_COUNT))
        recent.append(now)
        told = self.failures_told.get(webhook_id, -math.inf)
        if (len(recent) == VERIFICATION_ALERT_COUNT and now - recent[0] <= VERIFICATION_ALERT_WINDOW
                and now - told >= 3600):
            self.failures_told[webhook_id] = now
            await self.db.write(notify_verification_failures, webhook_id, len(recent), reason)

    async def _decide(self, webhook: sqlite3.Row, envelope: dict, record: str, headers_json: str,
                      body: bytes) -> tuple[dict, dict]:
        if webhook["connection_commands"] and read_command(envelope, commands_of(webhook["connection_commands"])):
            # A commander's command: acted on by the server (record_delivery), never through the rules.
            return {"command": True}, {"stage": "command", "action": {"command": True}}
        gated = gate(envelope)
        if gated is not None:
            return gated
        if not webhook["rules"]:
            return trust_gate(envelope["actor"], *decide_for_webhook(self.evaluator, webhook, b""))
        stored = rules_view(webhook)
        document = envelope_document(record, headers_json, payload_text(envelope["payload"], body)).encode()
        try:
            result = await self.evaluate_delivery(webhook["human_id"], stored, document)
        except EvaluationShed:
            self._count_shed(webhook)
            raise
        return trust_gate(envelope["actor"], *verdict(stored["rules"], stored["default_action"], webhook["queue"], result))

    def _count_shed(self, webhook: sqlite3.Row) -> None:
        """A shed delivery, counted for /metrics and the Board's webhook page, and logged at most once a minute
        per webhook."""
        self.metrics.shed.labels(webhook["provider"]).inc()
        shed = self.shed.setdefault(webhook["id"], Shedding())
        shed.count += 1
        shed.last = self.db.clock.now_ms()
        now = time.monotonic()
        if now - shed.logged >= 60:
            shed.logged = now
            log.warning("delivery to webhook %s shed: its owner's rules found no evaluator within %g s (503, not"
                        " stored; %d shed since start)", webhook["id"], EVAL_WAIT_SECONDS, shed.count)

    async def accept_delivery(self, webhook: sqlite3.Row, headers: dict[str, str], body: bytes,
                              source: str) -> tuple[int, dict]:
        """Verify, project, dedup, decide and record one delivery: (status, answer)."""
        provider = webhook["provider"]
        started = self.db.clock.now_ms()
        verified = await self._verify(webhook, headers, body, source)
        payload, payload_error = decode_payload(headers, body)
        envelope = build_envelope(provider=provider, webhook_id=webhook["id"], trust_mode=webhook["trust_mode"],
                                  verified=verified, headers=headers, body=body, payload=payload,
                                  trusted_actors=stored_json(webhook["trusted_actors"]),
                                  connection_login=webhook["connection_login"])
        if provider == "slack" and value_at(payload, "type") == "url_verification":
            return 200, {"challenge": value_at(payload, "challenge")}
        key, body_hash = delivery_key(provider, headers, payload, body), hashlib.sha256(body).hexdigest()
        # With rules, dedup comes before evaluation: a redelivery answers its first outcome even when the sandbox
        # is down. The write transaction checks again (and alone, without rules), so racing redeliveries mint once.
        seen = await self.db.lookup(duplicate_of, webhook, key, body_hash) if webhook["rules"] else None
        if seen is not None:
            self.metrics.deliveries.labels(provider, "duplicate").inc()
            return 202, seen
        record, headers_json = envelope_record(envelope), json.dumps(envelope["headers"])
        routing = self.db.clock.now_ms()
        action, trace = await self._decide(webhook, envelope, record, headers_json, body)
        routed = self.db.clock.now_ms()
        if payload_error:
            trace = {**trace, "payload_error": payload_error}
        # Its trace's ids, minted whether or not anything exports: its todos are sent under its route span.
        spans = DeliverySpans(new_trace_id(), new_span_id(), new_span_id())
        outcome = await self.db.write(record_delivery, Delivery(
            webhook_id=webhook["id"], endpoint_id=webhook["endpoint_id"], token_hash=webhook["token_hash"], body=body,
            envelope=envelope,
            envelope_record=record, headers_json=headers_json,
            delivery_key=key, body_hash=body_hash, action=action, trace=trace, spans=spans))
        self.metrics.count_delivery(provider, outcome, trace)
        if self.tracing is not None:
            self.tracing(ingest_spans(webhook, envelope, headers, outcome, spans, (started, routing, routed,
                                                                                  self.db.clock.now_ms())))
        return 202, outcome

    # -- claims and rings ----------------------------------------------------------------------------
    async def claim(self, principal: Principal, body: ClaimNext, gone: asyncio.Future | None) -> dict:
        """claim_next, waiting up to `wait_seconds` for a ring when the asker can wait (`gone` resolves when it
        leaves)."""
        principal.require_verb("claim_next")
        if not body.wait_seconds or gone is None:
            return await self.db.write(claim_next, principal, body)
        return await WaitingClaim(self, principal, body, gone).run()

    async def ring_frames(self, principal: Principal, queues: list[str] | None, render: Callable[[dict], str],
                          lead: list[str], queue: asyncio.Queue | None = None, via: str = "sse") -> AsyncIterator[str]:
        """A doorbell session as a stream of frames: `lead`, then rings for up to 3 of the oldest pending todos,
        then every ring the doorbell sends it, rendered by `render`, until the reader stops or the server shuts
        down (the session's close puts None on the queue). The session is attached before this returns."""
        queue = queue or asyncio.Queue()
        connected = await self.db.write(rings_for_new_session, principal.id, queues or principal.queues)
        first = [*lead, *(render({k: r[k] for k in RING_FIELDS}) for r in connected)]
        bell = self.doorbell.attach(Session(principal.id, frozenset(queues) if queues else None, "stream",
                                            lambda ring: queue.put_nowait(render(ring)), lambda: queue.put_nowait(None),
                                            via=via))

        async def frames() -> AsyncIterator[str]:
            try:
                async for frame in stream_queue(queue, first):
                    yield frame
            finally:
                self.doorbell.detach(bell)

        return frames()

    # -- rules and held work -------------------------------------------------------------------------
    async def set_rules(self, principal: Principal, webhook_id: str, body: RuleSet) -> dict:
        return await self.evaluate(principal.human_id or principal.id, set_rules, self.db, self.evaluator,
                                   principal, webhook_id, body)

    async def dry_run(self, principal: Principal, webhook_id: str, body: RulesTest) -> dict:
        return await self.evaluate(principal.human_id or principal.id, dry_run_rules, self.db, self.evaluator,
                                   principal, webhook_id, body)

    async def release_quarantined(self, principal: Principal, todo_id: str, body: ReleaseQuarantine) -> dict:
        """Re-evaluate a held delivery off the writer, then apply the decision in one transaction."""
        principal.require_human("release-quarantine")
        release = await self.evaluate(principal.human_id or principal.id, prepare_quarantine_release, self.db,
                                      self.evaluator, principal, todo_id, body)
        return await self.db.write(apply_quarantine_release, principal, release, body.note)

    # -- replay ---------------------------------------------------------------------------------------
    async def replay(self, principal: Principal, events: list[tuple[str, int]], dry_run: bool) -> list[dict]:
        """Replay events (id, body size) a batch at a time under REPLAY_BATCH_BYTES of bodies: each batch is read,
        decided and applied (one transaction each) before the next is read. Each replay stands alone (a dry run
        judges each event alone; applying is idempotent), so batches answer what one pass over all would."""
        results: list[dict] = []
        run = self.db.read if dry_run else self.db.write
        for batch in replay_batches(events):
            subjects = await self.db.read(replay_subjects, principal, batch)
            replays = await self.evaluate(principal.human_id, decide_again, self.evaluator, subjects,
                                          principal.human_id)
            del subjects  # the batch's documents go before the next batch is read
            results += await run(apply_replays, principal, replays, dry_run)
        return results

    async def replay_one(self, principal: Principal, event_id: str, body: ReplayOne) -> dict:
        [result] = await self.replay(principal, [(event_id, 0)], body.dry_run)
        return result

    async def replay_webhook(self, principal: Principal, webhook_id: str, body: ReplayMany) -> dict:
        events = await self.db.read(replay_events, principal, webhook_id, body)
        return {**replay_summary(await self.replay(principal, events, body.dry_run)), "dry_run": body.dry_run}

    # -- bulk actions --------------------------------------------------------------------------------
    async def bulk(self, principal: Principal, body: BulkAction) -> dict:
        """A dry run reads; acting reads the matches once, then writes them a short step at a time, each step a
        transaction of its own with a pause after it (a delivery waits one step at most)."""
        principal.require_human("bulk actions")
        if body.dry_run:
            return await self.db.read(bulk_dry_run, principal, body)
        run = BulkRun(body, await self.db.read(bulk_matches, principal, body))
        budget_ms, pause_ms = step_pacing(self.db.one_writer)
        while run.remaining:
            run.add(await self.db.write(bulk_step, principal, body, run.remaining[:BULK_STEP_TODOS], budget_ms))
            if run.remaining and pause_ms:
                await asyncio.sleep(pause_ms / 1000)
        return run.answer()

    # -- notifications -------------------------------------------------------------------------------
    async def add_channel(self, principal: Principal, body: NotifyCreate) -> dict:
        """A human's new channel, unless its URL's host is (or names) an address the operator does not let
        channels reach: the notifier's own policy, checked off the event loop before the write."""
        principal.require_human("notification channels")
        await self.notifier.addresses.vet(body.url)
        return await self.db.write(add_channel, principal, self.box, body)

    async def test_channel(self, principal: Principal, channel_id: str) -> dict:
        return await self.notifier.send_now(await self.db.write(queue_test_message, principal, channel_id))

    # -- forge connections ---------------------------------------------------------------------------
    async def add_connection(self, principal: Principal, body: ConnectionCreate) -> dict:
        """A new forge connection: the forge is asked who the token is first (forge.token_login)."""
        principal.require_human("forge connections")
        login = await token_login(self.forge, body.kind, body.api_url, body.token)
        return await self.db.write(add_connection, principal, self.box, body, login)

    async def test_connection(self, principal: Principal, connection_id: str) -> dict:
        return await test_connection(self.forge, principal, connection_id)

    # -- the background loop -------------------------------------------------------------------------
    async def background(self) -> None:
        """Every second, look; run a tick (leases, deferrals, rings) only when another connection committed
        (PRAGMA data_version moved: a request, the CLI; on Postgres the counters' change total), or when what the
        last tick saw falls due, or when this process has just become the leader (Postgres: the lock may come after
        the first look, or from a leader that died). At least every SCHEDULER_IDLE_SECONDS it reads when the next
        thing falls due again (one statement, next_due), for a due moment that came without a move it sees (a
        schedule or a pause another process wrote). Idle, that costs one look a second, not a scan. A move is also
        told to `changes` (the Board's open streams then read their counts again; idle, they read nothing). One
        bad round is logged and the loop goes on. (Checkpoints are the checkpointer thread's and the writer's: the
        WAL file keeps its size, because a commit that grows the file costs about twice one that reuses it.)"""
        last_look = -math.inf
        seen, due_ms = None, None
        led = False  # the leader at the last look: a process that has just become the leader ticks at once
        while True:
            try:
                now = time.monotonic()
                # SQLite's pragma is answered from memory, as is a listening Postgres's marker (its ring thread
                # reads it); otherwise the look is a round trip, kept off the loop.
                version = (self.db.change_marker() if self.db.change_marker_at_hand
                           else await asyncio.to_thread(self.db.change_marker))
                if seen is not None and version != seen:
                    self.changes.moved()
                leading = self.db.is_leader  # the leader's thread may change it: read once
                became_leader, led = leading and not led, leading
                if led:
                    if not became_leader and version == seen and now - last_look >= SCHEDULER_IDLE_SECONDS:
                        last_look = now
                        due_ms = await self.db.read(next_due)
                    if became_leader or version != seen or (due_ms is not None and self.db.clock.now_ms() >= due_ms):
                        seen, last_look = version, now
                        due_ms = (await self.db.write(scheduler_tick))["next_due"]
                seen = version
            except Exception:  # noqa: BLE001 - the loop must outlive one bad round; the cause is logged
                log.exception("scheduler tick failed")
            await self.looks.until_next_step()

    async def retention(self) -> None:
        """At start and hourly, retention (`prune`), in a loop of its own: a big box's first pass past the row cap
        takes minutes, and the scheduler's ticks (lapsed leases, rings) must not wait for it. Cancelled (the server
        stopping), it ends the pass after the step under way, before the writer closes. One failed pass is logged
        and the next comes an hour later."""
        stop = threading.Event()
        while True:
            passing = asyncio.ensure_future(asyncio.to_thread(prune, self.db, stop))
            try:
                pruned = await asyncio.shield(passing)
            except asyncio.CancelledError:
                stop.set()
                await asyncio.wait([passing])
                raise
            except Exception:  # noqa: BLE001 - the loop must outlive one bad pass; the cause is logged
                log.exception("retention failed")
            else:
                if any(pruned.values()):
                    log.info("retention: pruned %d todos, %d events and %d sent notifications", pruned["todos"],
                             pruned["events"], pruned["notifications"])
            await asyncio.sleep(PRUNE_EVERY_SECONDS)

    async def close(self) -> None:
        self.closing = True
        for task in list(self.dispatchers):
            task.cancel()
        await asyncio.gather(*self.dispatchers, return_exceptions=True)
        await self.notifier.close()
        await self.forge.close()
        self.eval_threads.shutdown(wait=False, cancel_futures=True)
        self.evaluator.close()
