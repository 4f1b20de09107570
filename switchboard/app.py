"""The app: every part put together (store, evaluator, doorbell, notifier, REST, MCP, Board)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route

from switchboard.board.pages import Board
from switchboard.configuration import (
    DEFAULT_INGEST_BURST,
    DEFAULT_INGEST_RATE,
    DEFAULT_VERIFIED_BURST,
    DEFAULT_VERIFIED_RATE,
    ApiError,
    Clock,
    Vitals,
)
from switchboard.crypto import SecretBox, sealed_sample
from switchboard.doorbell import Doorbell
from switchboard.engines import is_postgres, open_database
from switchboard.evaluator import Evaluator
from switchboard.flows import Flows
from switchboard.forge import ForgeSender
from switchboard.http.mcp import Mcp, api_error, http_error, unexpected_error
from switchboard.http.rest import MCP_ROUTES, Api
from switchboard.limits import RateLimiter, TrustedProxies
from switchboard.metrics import Metrics
from switchboard.models import build_validators
from switchboard.notifier import Addresses, Notifier
from switchboard.tracing import Tracing

LEADER_POLL_SECONDS = 1.0

# -- the app: every part put together ----------------------------------------------------------------

def auth_header_name(name: str | None, proxies: TrustedProxies) -> str | None:
    """`--auth-header NAME`, checked: a header name, believed only from proxies named by `--trust-proxy
    ADDRESSES` (without them, anyone who reaches the port could sign in as anyone)."""
    if not name:
        return None
    if not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}", name):
        raise ApiError("invalid_argument", f"--auth-header: {name[:64]!r} is not a header name (e.g. Remote-User)")
    if not proxies.named:
        raise ApiError("invalid_argument", "--auth-header needs --trust-proxy ADDRESSES: the addresses of the proxies"
                                           " whose header signs a Board visitor in")
    return name.lower()


async def leader_only(db, run) -> None:
    """`run()` while this process is the leader (always, on SQLite): started when it becomes the leader, cancelled
    when it stops being one (its database connection lost), started again when it is again."""
    while True:
        while not db.is_leader:
            await asyncio.sleep(LEADER_POLL_SECONDS)
        task = asyncio.ensure_future(run())
        try:
            while db.is_leader and not task.done():
                await asyncio.wait({task}, timeout=LEADER_POLL_SECONDS)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()


def create_app(db_path: str, *, synchronous: str = "FULL", clock: Clock | None = None, background: bool = True,
               ingest_rate: float = DEFAULT_INGEST_RATE, ingest_burst: int = DEFAULT_INGEST_BURST,
               verified_rate: float = DEFAULT_VERIFIED_RATE, verified_burst: int = DEFAULT_VERIFIED_BURST,
               base_url: str | None = None, allowed_origins: str | None = None,
               trust_proxy: TrustedProxies | bool | str = False, auth_header: str | None = None,
               notify_allow_private: bool | None = None, notify_allow: str | None = None,
               key_file: str | None = None, db_pool_size: int = 8, db_listen: str | None = None,
               tracing: Tracing | None = None) -> Starlette:
    """The ASGI app. `background=False` leaves the scheduler to the caller (tests drive it by hand).
    `ingest_rate`/`ingest_burst`: per source address, for unauthenticated deliveries and failed signature checks;
    `verified_rate`/`verified_burst`: per webhook, for deliveries whose signature verified; an ingest rate of 0
    turns both off. `trust_proxy`: the proxies in front (TrustedProxies: True, the bare flag, believes
    X-Forwarded-Proto from anyone; addresses also have X-Forwarded-For believed, and `auth_header`, the header
    such a proxy signs a Board visitor in with). `notify_allow_private` / `notify_allow`: notification channels
    and forge connections may reach loopback, link-local and unspecified addresses (all, or those listed); not given,
    SWITCHBOARD_NOTIFY_ALLOW_PRIVATE / SWITCHBOARD_NOTIFY_ALLOW say. `db_path` is a SQLite file or a
    postgresql:// URL (then `key_file` names the secrets' key, `db_pool_size` its connections, and `db_listen` a
    direct URL for LISTEN and the leader's lock when `db_path` goes through a transaction pooler). `tracing`: the
    span exporter (switchboard.tracing.start_tracing), shut down with the app; None exports nothing."""
    build_validators()
    proxies = trust_proxy if isinstance(trust_proxy, TrustedProxies) else TrustedProxies.parse(trust_proxy)
    auth_header = auth_header_name(auth_header, proxies)
    addresses = Addresses.configured(notify_allow_private, notify_allow)
    if db_listen and not is_postgres(db_listen):
        raise ApiError("invalid_argument", "--db-listen takes a postgresql:// URL: the direct connection for LISTEN"
                                           " and the leader's lock")
    db = open_database(db_path, synchronous=synchronous, clock=clock, pool_size=db_pool_size, listen=background,
                       listen_url=db_listen)
    try:
        box = SecretBox.for_database(db_path, db.read_sync(sealed_sample), key_file)
    except ApiError:
        db.close()
        raise
    db.opener = box.open
    vitals = Vitals()
    db.on_fatal = vitals.died
    doorbell = Doorbell(getattr(db, "listening", None))
    db.on_rings = doorbell.ring
    evaluator = Evaluator()
    evaluator.on_death = vitals.died
    base_url = base_url or os.environ.get("SWITCHBOARD_BASE_URL")
    metrics = Metrics(db, doorbell)
    notifier = Notifier(db, box, base_url, metrics.notify_failures, metrics.notify_sent, addresses)
    forge = ForgeSender(db, box, addresses, metrics.forge_outputs, metrics.forge_status)

    def wake_senders() -> None:
        """A commit wrote to an outbox: the notifier's, the forge's, or both (each looks at its own)."""
        notifier.wake()
        forge.wake()

    db.on_outbox = wake_senders
    if tracing is not None:
        db.on_spans = notifier.tracing = forge.tracing = tracing.emit
    flows = Flows(db, doorbell, evaluator, box, RateLimiter(ingest_rate, ingest_burst), metrics, vitals, notifier,
                  forge, RateLimiter(verified_rate if ingest_rate > 0 else 0, verified_burst))
    flows.tracing = tracing.emit if tracing is not None else None
    if db.engine == "postgres":
        # The ring thread reads the change marker: it tells the scheduler's loop when it moved, and looks once a
        # second while a live view is open (see Postgres.look_soon)
        db.on_change = flows.looks.wake
        db.watched = flows.changes.watched
        flows.changes.on_watch = db.look_soon
    origins = allowed_origins if allowed_origins is not None else os.environ.get("SWITCHBOARD_ALLOWED_ORIGINS", "")
    api = Api(flows, base_url, frozenset(o.strip().rstrip("/") for o in origins.split(",") if o.strip()), proxies)

    def watch(task: asyncio.Task, what: str) -> None:
        """A long-lived loop that ends (it never should) is a death: /healthz says so and the process exits."""
        task.add_done_callback(lambda done: None if done.cancelled() else vitals.died(
            f"the {what} stopped: {done.exception()!r}"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        db.loop = asyncio.get_running_loop()
        # Several processes on one Postgres database: the scheduler's ticks, retention and the senders run on the
        # leader alone (the scheduler still tells this process's Board streams of changes).
        loops = ({"scheduler": flows.background(), "retention": leader_only(db, flows.retention),
                  "notifier": leader_only(db, notifier.run), "forge sender": leader_only(db, forge.run)}
                 if background else {})
        tasks = [asyncio.create_task(coroutine) for coroutine in loops.values()]
        for task, what in zip(tasks, loops, strict=True):
            watch(task, what)
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await flows.close()
            db.close()
            if tracing is not None:
                tracing.shutdown()

    mcp = Mcp(api)
    routes = [*(Route(r.path, getattr(mcp, r.handler), methods=[r.method]) for r in MCP_ROUTES), *api.route_table()]
    routes += Board(flows, api, mcp, proxies, auth_header).routes()
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: unexpected_error})
    app.state.db = db
    app.state.doorbell = doorbell
    app.state.api = api
    app.state.flows = flows
    app.state.evaluator = evaluator
    app.state.mcp = mcp
    app.state.vitals = vitals
    return app
