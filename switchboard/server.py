"""Serving: uvicorn with our connection limits and header deadlines, logging, and the process's lifetime."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import logging.handlers
import queue as queue_module
import resource
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from switchboard.app import create_app
from switchboard.configuration import (
    FD_RESERVE,
    HEADER_SECONDS,
    KEEPALIVE_IDLE_SECONDS,
    LOG_BATCH_SECONDS,
    MAX_CONNECTIONS,
    VERSION,
    ApiError,
    Nap,
    iso,
    log,
    switch_value,
)
from switchboard.engines import shown_database
from switchboard.limits import TrustedProxies
from switchboard.tracing import ExtraMissing, start_tracing

# -- serve -----------------------------------------------------------------------------------------

class _HeaderDeadline(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus a deadline for request headers: a connection that sends no complete
    header block within HEADER_SECONDS of opening (or of starting its next request) is closed, so half-sent
    requests cannot hold sockets open forever.

    And the connection cap (uvicorn's limit_concurrency, fitted to the file limit at start) sheds the idle first:
    a connection that brings the count to the cap closes the one that has waited longest for request headers (a
    half-sent request, or a keep-alive connection between requests). A flood of half-sent requests therefore
    holds at most the cap's descriptors and never /healthz's way in; only when every connection is busy with a
    request does a newcomer get uvicorn's 503."""

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        if self.limit_concurrency is not None and len(self.connections) >= self.limit_concurrency:
            self._shed_longest_waiting()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._waiting().pop(self, None)
        if self.limit_concurrency is not None and len(self.connections) >= self.limit_concurrency:
            self._shed_longest_waiting()  # a whole request goes before a half-sent one
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline:
            self._wait_for_headers()  # idle until the next request

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._waiting().pop(self, None)
        super().connection_lost(exc)

    def _waiting(self) -> dict[_HeaderDeadline, None]:
        """The server's connections waiting for request headers, longest-waiting first."""
        waiting = getattr(self.server_state, "waiting_for_headers", None)
        if waiting is None:
            waiting = self.server_state.waiting_for_headers = {}  # type: ignore[attr-defined]
        return waiting

    def _wait_for_headers(self) -> None:
        waiting = self._waiting()
        waiting.pop(self, None)
        waiting[self] = None

    def _shed_longest_waiting(self) -> None:
        waiting = self._waiting()
        victim = next((c for c in waiting if c is not self), None)
        if victim is not None:
            del waiting[victim]
            victim._disarm()
            victim.transport.close()
            # Counted out now, not when its close completes: connections that arrive meanwhile see the room.
            self.connections.discard(victim)

    def _arm(self) -> None:
        self._disarm()
        self._wait_for_headers()
        self._header_timer = self.loop.call_later(HEADER_SECONDS, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn, plus: on SIGTERM or SIGINT the doorbell first ends its streams and wakes waiting claims (an
    open stream would otherwise hold graceful shutdown forever), and a clean shutdown exits 0. When a long-lived
    part dies, it stops too, and `fatal` says why (the process exits 1 for its supervisor)."""

    def __init__(self, config: uvicorn.Config, app: Starlette):
        super().__init__(config)
        self.app = app
        self.fatal: str | None = None
        self._nap = Nap()  # main_loop's, between two looks at should_exit
        app.state.vitals.on_death = self.stop_for

    async def main_loop(self) -> None:
        """uvicorn's own loop looks at `should_exit` ten times a second; idle, those wake-ups are most of the
        process's CPU (each costs about 0.2 ms here). This one looks once a second, in step with the scheduler's
        loop (configuration.in_step), which still refreshes the Date header as often as uvicorn does (its
        `on_tick` refreshes it on every tenth count), and is woken at once by a signal or a dying part."""
        count = 0
        while not await self.on_tick(count):
            count = (count + 10) % 864000
            await self._nap.until_next_step()

    def stop_for(self, reason: str) -> None:
        self.fatal = reason
        self.should_exit = True
        self._nap.wake()

    def handle_exit(self, sig: int, frame: Any) -> None:
        loop = self.app.state.db.loop
        if loop is not None:
            loop.call_soon_threadsafe(self.app.state.doorbell.close_all)
        super().handle_exit(sig, frame)
        self._nap.wake()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line (for journald, Loki and friends): time, level, logger, event."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": iso(int(record.created * 1000)), "level": record.levelname.lower(), "logger": record.name,
                "event": record.getMessage()}
        if record.exc_info:
            line["error"] = type(record.exc_info[1]).__name__
        return json.dumps(line, ensure_ascii=False)


class _HandOver(logging.handlers.QueueHandler):
    """Puts each record on the queue as it is: formatting it is the log writer's work, in its own thread."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


class LogWriter:
    """Formats and writes the records handed over, from a thread of its own, a batch at a time: after a record
    arrives it waits LOG_BATCH_SECONDS and writes every line that came meanwhile with one write and one flush.
    (logging's QueueListener wrote and flushed each line: a system call per state change, each handing the GIL
    to the writer or the event loop and waiting to get it back, cost a tenth of the claim+complete rate.) A
    record that cannot be formatted goes to logging's handleError; a stream that refuses a write loses those
    lines, never the thread."""

    def __init__(self, records: queue_module.SimpleQueue, handler: logging.StreamHandler):
        self.records = records
        self.handler = handler
        self.thread = threading.Thread(target=self._run, name="switchboard-log", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Write what is queued, then end the thread."""
        self.records.put(None)
        self.thread.join()

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch = [self.records.get()]
            if batch[0] is not None:
                time.sleep(LOG_BATCH_SECONDS)
            with contextlib.suppress(queue_module.Empty):
                while True:
                    batch.append(self.records.get_nowait())
            lines = []
            for record in batch:
                if record is None:
                    stopping = True
                    break
                try:
                    lines.append(self.handler.format(record) + "\n")
                except Exception:  # noqa: BLE001 - logging's own answer to a record it cannot format
                    self.handler.handleError(record)
            if lines:
                self._write("".join(lines))

    def _write(self, text: str) -> None:
        with self.handler.lock, contextlib.suppress(OSError, ValueError):
            self.handler.stream.write(text)
            self.handler.stream.flush()


@contextlib.contextmanager
def configure_logging(log_format: str) -> Iterator[None]:
    """Log lines to stderr, formatted and written by the log writer's thread: the writer and the event loop
    only hand records over (formatting and writing a line cost about as much as a delivery's transaction).
    Every line is written by the time this exits."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter() if log_format == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    records: queue_module.SimpleQueue = queue_module.SimpleQueue()
    writer = LogWriter(records, handler)
    # No line shows a thread, process or source location: not looking them up saves a third of each record.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None
    root = logging.getLogger()
    root.handlers[:] = [_HandOver(records)]
    root.setLevel(logging.INFO)
    # httpx logs every request's URL at INFO, and a notification channel's URL is a credential (the path of a
    # Slack, Discord or ntfy URL, the user and password in one): only their warnings reach the log.
    for talkative in ("httpx", "httpcore"):
        logging.getLogger(talkative).setLevel(logging.WARNING)
    writer.start()
    try:
        yield
    finally:
        writer.stop()
        root.handlers[:] = [handler]


def _raise_file_limit() -> int:
    """Many open connections need many descriptors: raise the soft limit to the hard one (65536 when the hard
    one is unlimited). Returns the soft limit in effect."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 65536
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def connection_limits(file_limit: int) -> tuple[int, int]:
    """(connection cap, listen backlog) that fit `file_limit` descriptors. FD_RESERVE stay for the database, the
    evaluator, the log and notification sends. Of the rest, at most three quarters (and MAX_CONNECTIONS) are
    open connections, and the remainder is the listen backlog: connections that arrive together are all accepted
    before the cap sheds any, so that many descriptors must be free at the cap."""
    usable = max(file_limit - FD_RESERVE, 32)
    cap = min(MAX_CONNECTIONS, usable * 3 // 4)
    return cap, min(MAX_CONNECTIONS, usable - cap)


def cli_serve(args: argparse.Namespace) -> int:
    for name, allowed in (("synchronous", ("full", "normal")), ("log_format", ("plain", "json"))):
        if getattr(args, name) not in allowed:
            raise ApiError("invalid_argument", f"{name.replace('_', '-')} must be one of {', '.join(allowed)}"
                                               f" (from SWITCHBOARD_{name.upper()})")
    with configure_logging(args.log_format):
        return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    file_limit = _raise_file_limit()
    cap, backlog = connection_limits(file_limit)
    if cap < MAX_CONNECTIONS:
        log.warning("the file limit is %d descriptors: at most %d connections at once (raise LimitNOFILE or"
                    " ulimit -n for %d)", file_limit, cap, MAX_CONNECTIONS)
    proxies = TrustedProxies.parse(args.trust_proxy, "--trust-proxy (or SWITCHBOARD_TRUST_PROXY)")
    try:
        tracing = start_tracing(required=switch_value("otel", getattr(args, "otel", False)))
    except ExtraMissing as missing:
        log.critical("exiting: %s", missing)
        return 1
    app = create_app(args.db, synchronous=args.synchronous, ingest_rate=args.ingest_rate,
                     ingest_burst=args.ingest_burst, verified_rate=args.verified_rate,
                     verified_burst=args.verified_burst, base_url=args.base_url,
                     allowed_origins=args.allowed_origins, trust_proxy=proxies, auth_header=args.auth_header,
                     notify_allow_private=switch_value("notify-allow-private", args.notify_allow_private),
                     notify_allow=args.notify_allow or "", key_file=getattr(args, "key_file", None),
                     db_pool_size=args.db_pool_size, db_listen=args.db_listen, tracing=tracing)
    if tracing is not None:
        log.info("traces: exported over OTLP/HTTP (the OTEL_* variables say where)")
    if app.state.db.engine == "postgres" and app.state.db.synchronous == "off":
        app.state.db.close()
        raise ApiError("invalid_argument", "the database runs with synchronous_commit off: a 202 would not survive a"
                                           " power cut. Set it on (ALTER DATABASE … SET synchronous_commit = on, or"
                                           " in postgresql.conf) and start again")
    # The access log is off because ingest URLs carry credentials; Switchboard logs its own lines. uvicorn's
    # own lines go through the handler above (log_config=None), so they share its format. uvicorn's own proxy
    # headers are off: it would believe X-Forwarded-For and -Proto from any local process (FORWARDED_ALLOW_IPS),
    # where only the proxies --trust-proxy names are believed (limits.TrustedProxies), each request's peer
    # being the address a connection really came from.
    config = uvicorn.Config(app, host=args.host, port=args.port, access_log=False, log_config=None, proxy_headers=False,
                            timeout_graceful_shutdown=30, timeout_keep_alive=KEEPALIVE_IDLE_SECONDS,
                            limit_concurrency=cap, backlog=backlog, http=_HeaderDeadline)
    shown_host = f"[{args.host}]" if ":" in args.host else args.host
    log.info("switchboard %s: database %s, listening on http://%s:%d, board at %s/board/", VERSION,
             shown_database(args.db), shown_host, args.port, (args.base_url or f"http://{shown_host}:{args.port}").rstrip("/"))
    server = _Server(config, app)
    server.run()
    if server.fatal:
        log.critical("exiting: %s", server.fatal)
        return 1
    return 0
