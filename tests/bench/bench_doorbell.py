"""Doorbell latency benchmark (SPEC section 13): from a delivery's 202 to the worker's notification.

    python tests/bench/bench_doorbell.py [--quick]      (normally run through tests/bench/run_all.py)

One `serve --ingest-rate 0` (synchronous FULL, the default) and, per channel, its own endpoint scoped to `build`
that owns its own GitHub webhook (queue `build`, no rules: plain fan-out, so the doorbell is isolated from the
evaluator). Each delivery is `issues.opened` with a fresh delivery id and issue number, signed, and built before
the clock starts. Deliveries are sent one at a time; the next goes only after the previous one's notification
arrived, so every ring is measured on an idle system.

Design, the same for all three channels: 50 sessions of that channel are connected on the measured endpoint
itself. The doorbell rings exactly one session of the endpoint per todo (the oldest waiting claim, else the
streams round-robin), so the latency is taken on whichever session was rung, and the run also checks that each
todo rang exactly one session and how evenly the rings were spread.

  sse   50 `GET /api/v1/doorbell` streams (one httpx.AsyncClient, one connection each); timed when the
        `todo.ready` data line carrying the todo id is parsed.
  mcp   50 official `mcp` Clients in handshake ("legacy") mode, each with its own httpx2.AsyncClient and a
        `notifications/claude/channel` NotificationBinding; timed when the handler runs. A warm-up rings every
        session at least once first, which proves all 50 GET streams are attached.
  wait  50 workers each with a `POST /api/v1/todos/claim {"queue": "build", "wait_seconds": 30}` in flight
        (own keep-alive httpx.AsyncClient each; a worker re-issues its wait after each answer); timed when the
        claim's 200 with the todo is parsed. This includes the claim's own write transaction (one more commit).
        After each ring the sender waits WAIT_SETTLE_SECONDS so the rung worker's re-issued claim is waiting
        again before the next delivery; the run checks that every measured todo went to a claim sent before
        that delivery's POST (a claim racing the delivery would take the todo without any ring).

Latency = notification time - time the 202 was parsed by the sender (same process, `time.perf_counter`). The
server queues the ring right after the delivery's COMMIT and before it writes the 202, so a notification can be
parsed before the 202 is: such latencies are negative and are reported as they are, with their share; the time
from the start of the POST to the notification is reported too.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import producers  # noqa: E402
from bench_store import Server, cli, percentile  # noqa: E402

CHANNELS = ("sse", "mcp", "wait")
WAIT_SETTLE_SECONDS = 0.05
QUEUE = "build"


class RingBook:
    """Notifications by todo id, with the time they were parsed and which session got them."""

    def __init__(self) -> None:
        self.rings: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
        self.per_session: collections.Counter = collections.Counter()
        self.claim_sent: dict[int, float] = {}  # wait channel: when each worker's current claim was sent
        self.answered_claim_sent: dict[str, float] = {}  # todo id -> when the claim that got it was sent
        self._waiters: dict[str, asyncio.Future] = {}

    def record(self, todo_id: str, session: int) -> None:
        now = time.perf_counter()
        self.rings[todo_id].append((now, session))
        self.per_session[session] += 1
        waiter = self._waiters.pop(todo_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, todo_id: str, timeout: float) -> float:
        if todo_id not in self.rings:
            future = asyncio.get_running_loop().create_future()
            self._waiters[todo_id] = future
            try:
                await asyncio.wait_for(future, timeout)
            finally:
                self._waiters.pop(todo_id, None)
        return self.rings[todo_id][0][0]


# -- the three kinds of session -----------------------------------------------------------------------

async def sse_sessions(stack: AsyncExitStack, url: str, token: str, n: int, book: RingBook, group) -> None:
    client = await stack.enter_async_context(httpx.AsyncClient(
        headers={"Authorization": f"Bearer {token}"}, timeout=httpx.Timeout(30, read=None),
        limits=httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)))
    connected = anyio.Event()
    count = [0]

    async def listen(k: int) -> None:
        async with client.stream("GET", f"{url}/api/v1/doorbell", params={"queue": QUEUE}) as stream:
            if stream.status_code != 200:
                raise RuntimeError(f"doorbell stream {k}: HTTP {stream.status_code}")
            event = None
            async for line in stream.aiter_lines():
                if line == ": connected":
                    count[0] += 1
                    if count[0] == n:
                        connected.set()
                elif line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "todo.ready":
                    book.record(json.loads(line[6:])["todo_id"], k)

    for k in range(n):
        group.start_soon(listen, k)
    with anyio.fail_after(30):
        await connected.wait()


async def mcp_sessions(stack: AsyncExitStack, url: str, token: str, n: int, book: RingBook, group) -> None:
    import httpx2
    from mcp import Client
    from mcp.client import ClientExtension, NotificationBinding
    from mcp.client.streamable_http import streamable_http_client
    from pydantic import BaseModel, ConfigDict

    class ChannelParams(BaseModel):
        model_config = ConfigDict(extra="allow")
        content: str
        meta: dict[str, Any] | None = None

    def extension(k: int) -> ClientExtension:
        class ClaudeChannel(ClientExtension):
            identifier = "claude/channel"

            def notifications(self):
                async def handler(params: ChannelParams) -> None:
                    book.record((params.meta or {}).get("todo_id"), k)
                return [NotificationBinding(method="notifications/claude/channel", params_type=ChannelParams,
                                            handler=handler)]
        return ClaudeChannel()

    for k in range(n):
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                                  timeout=httpx2.Timeout(30, read=300))
        await stack.enter_async_context(Client(streamable_http_client(f"{url}/mcp", http_client=http),
                                               mode="legacy", extensions=[extension(k)]))


async def wait_sessions(stack: AsyncExitStack, url: str, token: str, n: int, book: RingBook, group) -> None:
    stop = anyio.Event()
    errors: list[str] = []

    async def worker(k: int) -> None:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                                     timeout=httpx.Timeout(60)) as client:
            while not stop.is_set():
                book.claim_sent[k] = time.perf_counter()
                r = await client.post(f"{url}/api/v1/todos/claim", json={"queue": QUEUE, "wait_seconds": 30})
                if r.status_code != 200:
                    errors.append(f"waiter {k}: {r.status_code} {r.text[:200]}")
                    await anyio.sleep(0.5)
                    continue
                body = r.json()
                if not body.get("empty"):
                    book.answered_claim_sent[body["todo"]["id"]] = book.claim_sent[k]
                    book.record(body["todo"]["id"], k)

    for k in range(n):
        group.start_soon(worker, k)
    stack.callback(stop.set)
    book.errors = errors  # type: ignore[attr-defined]
    await anyio.sleep(1.5)  # let every waiting claim reach the server and attach before the first delivery


SESSIONS = {"sse": sse_sessions, "mcp": mcp_sessions, "wait": wait_sessions}


# -- one channel ----------------------------------------------------------------------------------

async def measure_channel(channel: str, url: str, ep: dict, hook_url: str, secret: str, sessions: int,
                          rings: int, warmup: int) -> dict:
    book = RingBook()
    deliveries = [producers.github("issues.opened", secret, {"issue": {"number": 50_000 + i}},
                                   delivery=str(uuid.uuid4())) for i in range(warmup + rings + sessions * 4)]
    sent = iter(deliveries)
    lat_202: list[float] = []
    lat_post: list[float] = []
    ack_ms: list[float] = []
    todo_ids: list[str] = []
    missed: list[str] = []
    not_waiting: list[str] = []
    async with anyio.create_task_group() as group:
        async with AsyncExitStack() as stack:
            await SESSIONS[channel](stack, url, ep["token"], sessions, book, group)
            async with httpx.AsyncClient(timeout=30) as sender:
                await sender.get(f"{url}/healthz")

                async def deliver() -> tuple[str, float, float]:
                    raw, headers = next(sent)
                    t0 = time.perf_counter()
                    r = await sender.post(hook_url, content=raw, headers=headers)
                    t1 = time.perf_counter()
                    if r.status_code != 202:
                        raise RuntimeError(f"delivery: {r.status_code} {r.text[:300]}")
                    answer = r.json()
                    if answer.get("disposition") != "routed" or len(answer["todos"]) != 1:
                        raise RuntimeError(f"delivery not routed to one todo: {answer}")
                    return answer["todos"][0]["id"], t0, t1

                # Warm-up: for MCP, until every session was rung once (so all 50 GET streams are attached).
                n_warm = 0
                while n_warm < warmup or (channel == "mcp" and len(book.per_session) < sessions):
                    if n_warm >= warmup + sessions * 4:
                        raise RuntimeError(f"{channel}: only {len(book.per_session)} of {sessions} sessions rang")
                    todo_id, _, _ = await deliver()
                    await book.wait(todo_id, 10)
                    n_warm += 1
                warm_counts = collections.Counter(book.per_session)
                for _ in range(rings):
                    todo_id, t0, t1 = await deliver()
                    try:
                        rung_at = await book.wait(todo_id, 10)
                    except TimeoutError:
                        missed.append(todo_id)
                        continue
                    todo_ids.append(todo_id)
                    ack_ms.append((t1 - t0) * 1e3)
                    lat_202.append((rung_at - t1) * 1e3)
                    lat_post.append((rung_at - t0) * 1e3)
                    if channel == "wait":
                        if book.answered_claim_sent[todo_id] >= t0:
                            not_waiting.append(todo_id)
                        # The rung worker re-issues its claim at once; give it time to reach the server and
                        # attach, so the next delivery again finds 50 claims waiting (and none racing it).
                        await anyio.sleep(WAIT_SETTLE_SECONDS)
                await anyio.sleep(0.5)  # catch any second ring of the same todo
            group.cancel_scope.cancel()
    measured_counts = {k: book.per_session[k] - warm_counts[k] for k in range(sessions)}
    multi = [t for t in todo_ids if len(book.rings[t]) != 1]
    errors = getattr(book, "errors", [])
    return {
        "channel": channel, "sessions": sessions, "rings": len(lat_202), "warmup_deliveries": n_warm,
        "p50_ms": percentile(lat_202, 50), "p99_ms": percentile(lat_202, 99),
        "mean_ms": statistics.fmean(lat_202) if lat_202 else float("nan"),
        "min_ms": min(lat_202, default=float("nan")), "max_ms": max(lat_202, default=float("nan")),
        "share_before_202": sum(1 for x in lat_202 if x < 0) / len(lat_202) if lat_202 else float("nan"),
        "from_post_p50_ms": percentile(lat_post, 50), "from_post_p99_ms": percentile(lat_post, 99),
        "ack_p50_ms": percentile(ack_ms, 50), "ack_p99_ms": percentile(ack_ms, 99),
        "sessions_rung": sum(1 for v in measured_counts.values() if v), "per_session_min":
            min(measured_counts.values()), "per_session_max": max(measured_counts.values()),
        "verified": {"missed": missed[:10], "todos_rung_not_once": multi[:10], "errors": errors[:10],
                     "claims_not_waiting_before_the_delivery": not_waiting[:10],
                     "ok": not missed and not multi and not errors and not not_waiting},
    }


def bench_doorbell(rings: int, sessions: int = 50, warmup: int = 10) -> dict:
    tmp = tempfile.mkdtemp(prefix="sb-bench-doorbell-")
    db_path = os.path.join(tmp, "switchboard.db")
    server = None
    try:
        cli(db_path, "init")
        cli(db_path, "human", "add", "bench")
        setup = {}
        for channel in CHANNELS:
            ep = cli(db_path, "endpoint", "vend", "--human", "bench", "--name", channel, "--queues", QUEUE)
            hook = cli(db_path, "webhook", "create", "--endpoint", ep["id"], "--provider", "github", "--queue", QUEUE,
                       "--base-url", "http://placeholder", "--trust", "Codertocat")
            setup[channel] = (ep, hook)
        server = Server(db_path, "full", "--ingest-rate", "0")
        results = []
        for channel in CHANNELS:
            ep, hook = setup[channel]
            hook_url = server.url + "/hooks/" + hook["url"].rsplit("/hooks/", 1)[1]
            results.append(anyio.run(measure_channel, channel, server.url, ep, hook_url, hook["secret"], sessions,
                                     rings, warmup))
        server.stop()
        problems = server.log_problems()
        tracebacks = server.log_tracebacks()
        server = None
        for r in results:
            r["verified"]["server_log_problems"] = problems[:10]
            r["verified"]["server_tracebacks"] = tracebacks
            r["verified"]["ok"] = r["verified"]["ok"] and not problems
        return {"synchronous": "FULL", "sessions": sessions, "channels": results}
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(bench_doorbell(40 if "--quick" in sys.argv else 200), indent=2))
