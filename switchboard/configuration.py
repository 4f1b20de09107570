"""Constants, limits, the clock, the error every answer is made of, and the serve flags' environment defaults."""

from __future__ import annotations

import functools
import logging
import logging.handlers
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

VERSION = "0.5.0"


def shipped_path(name: str) -> Path:
    """schema.sql and packs/ live once, at the top of the repository (the design card's layout); a wheel carries
    them inside the package (setup.py copies them in). Inside the package when installed, else beside it."""
    inside = Path(__file__).with_name(name)
    return inside if inside.exists() else Path(__file__).resolve().parent.parent / name


SCHEMA_PATH = shipped_path("schema.sql")
# The rule packs that ship with Switchboard (`rules set --pack fleet`), wherever it is installed.
PACKS_DIR = shipped_path("packs")
PACK_NAMES = ("fleet", "pool-review")
SCHEMA_VERSION = 14
# `check` fails when the clocks of the processes serving one Postgres database are further apart: leases,
# deferrals and backoff are stamped by whichever process runs the verb.
MAX_CLOCK_SKEW_MS = 2000

DEFAULT_LEASE_SECONDS = 300
MAX_REQUEST_BYTES = 1 << 20
MAX_DELIVERY_BYTES = 5 << 20
# Per source address, for what nobody authenticated (generic deliveries, failed signature checks).
DEFAULT_INGEST_RATE = 50.0
DEFAULT_INGEST_BURST = 100
# Per webhook, for deliveries whose signature verified: a forge's bulk relabel arrives as one burst, and GitHub
# never redelivers a delivery it was refused.
DEFAULT_VERIFIED_RATE = 200.0
DEFAULT_VERIFIED_BURST = 2000
MAX_RESULT_BYTES = 64 << 10
MAX_SUMMARY_BYTES = 2048
PARSE_PROBLEMS_SHOWN = 5  # a body wrong in many places names the first few; the rest follow once these are fixed
BACKOFF_BASE_SECONDS = 30
BACKOFF_CAP_SECONDS = 15 * 60
SCHEDULER_TICK_SECONDS = 1.0


def in_step(now: float, period: float = SCHEDULER_TICK_SECONDS) -> float:
    """Seconds from `now` (the event loop's clock) to its next multiple of `period`. The server's once-a-second
    loops (uvicorn's, the scheduler's) sleep this long, so they wake in the same turn of the event loop: each
    wake-up of an idle process costs about 0.2 ms of CPU here, and two loops out of step cost twice one."""
    return period - now % period


class Nap:
    """A loop's pause until its next step (in_step) that any thread, or a signal handler, can end at once
    (`wake`). A wake-up that comes while the loop is not napping ends its next nap at once, so none is lost."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._napping: asyncio.Future | None = None
        self._woken = False

    async def until_next_step(self, period: float = SCHEDULER_TICK_SECONDS) -> None:
        import asyncio  # here, not at the top: the CLI, which imports this module, runs no event loop

        self._loop = loop = asyncio.get_running_loop()
        if self._woken:
            self._woken = False
            return
        self._napping = napping = loop.create_future()
        timer = loop.call_later(in_step(loop.time(), period), self._end, napping)
        try:
            await napping
        finally:
            timer.cancel()
            self._napping = None

    def wake(self) -> None:
        loop = self._loop
        if loop is None:
            self._woken = True
        else:
            loop.call_soon_threadsafe(self._rouse)

    def _rouse(self) -> None:
        if self._napping is None:
            self._woken = True
        else:
            self._end(self._napping)

    @staticmethod
    def _end(napping: asyncio.Future) -> None:
        if not napping.done():
            napping.set_result(None)


# With nothing committed and nothing due, the scheduler reads when the next thing falls due this often (next_due:
# a due moment a change it cannot see brought, such as a schedule another process wrote).
SCHEDULER_IDLE_SECONDS = 10.0
CHECKPOINTS_PER_SECOND = 10
# Log lines wait this long in memory, so that one write carries every line that came meanwhile.
LOG_BATCH_SECONDS = 0.05
WRITER_CHECKPOINT_BYTES = 16 << 20
PRUNE_EVERY_SECONDS = 3600.0
WRITER_BATCH = 64
WAL_LIMIT_BYTES = 64 << 20
WRITER_CACHE_KIB = 1024
QUARANTINE_DAYS = 30
# An open stream with nothing to say sends a comment this often, so proxies keep it open.
KEEPALIVE_SECONDS = 15.0
# The re-ring sweep: after the first ring, again about 5 min, 20 min, 1 h and 6 h after the previous one.
RERING_AFTER_MS = (5 * 60_000, 20 * 60_000, 60 * 60_000, 6 * 3_600_000)

# Request bodies must arrive within this many seconds of the headers, and headers within HEADER_SECONDS of the
# connection (or of the previous response): a client that trickles bytes holds nothing for long.
BODY_SECONDS = 10.0
HEADER_SECONDS = 10.0
KEEPALIVE_IDLE_SECONDS = 5
MAX_CONNECTIONS = 2048
# File descriptors kept out of the connection cap (at start, the cap is lowered to fit the file limit): the
# database's reader connections (one per thread), the evaluator's pipes, the log, and notification sends.
FD_RESERVE = 256
# Bytes of delivery bodies buffered at once, across every in-flight delivery (each is capped at 5 MiB).
INGEST_BUFFER_BYTES = 64 << 20
# A payload nested deeper than this is kept as its raw body with `payload: null` (reason `too_deep`).
MAX_PAYLOAD_DEPTH = 128
# An issue body's `switchboard` block is read as a work item only up to this size (GitHub caps a whole body at
# 65,536 characters; Gitea does not): a larger block is an error, never parsed.
MAX_WORK_ITEM_BYTES = 65_536
# Characters producer text never keeps on a line: C0 controls, DEL, and the bidirectional marks, overrides
# and isolates, which make a title read differently from what it is.
UNSAFE_TEXT = "\x00-\x1f\x7f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"

QUEUE_PATTERN = r"^[a-z0-9][a-z0-9._:-]{0,63}$"
# Where a human hears they are needed, and about what.
NOTIFY_KINDS = ("ntfy", "gotify", "slack", "discord", "webhook")
NOTIFY_EVENTS = ("needs_input", "review", "held", "dead_letter", "verification_failures")
# Channels one human may have: each due message is a send, and every send costs the server a socket and a slot.
NOTIFY_MAX_CHANNELS = 20
# The lane where rules put work that waits for a human (packs/fleet.json's `hold`): like quarantine, it notifies.
HOLD_QUEUE = "hold"
RESERVED_QUEUES = frozenset({"quarantine"})
# A bulk action acts on at most this many todos a call (a filter that matches more acts on the newest this many).
BULK_MAX = 10_000

DRAIN_VERBS = ("list_todos", "get_todo", "claim_next", "claim", "heartbeat", "complete", "fail", "release",
               "needs_input", "block", "absorb")
WEBHOOK_VERBS = ("create_webhook", "list_webhooks", "rotate_webhook", "delete_webhook", "set_webhook_secret",
                 "get_webhook_rules", "set_webhook_rules", "test_webhook_rules", "add_webhook_route",
                 "list_webhook_routes", "remove_webhook_route", "list_webhook_events", "get_webhook_event",
                 "set_trusted_actors")
VERB_PRESETS = {"drain": DRAIN_VERBS, "webhooks": WEBHOOK_VERBS, "all": DRAIN_VERBS + WEBHOOK_VERBS}
ALL_VERBS = frozenset(VERB_PRESETS["all"])

TERMINAL_STATES = ("done", "failed", "cancelled")
TODO_STATES = ("pending", "claimed", "needs_input", "blocked", "review", "deferred", *TERMINAL_STATES,
               "quarantined")

log = logging.getLogger("switchboard")


class Clock:
    """Wall-clock milliseconds; tests substitute a clock they move by hand."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class ApiError(Exception):
    """An answer with the spec's error body: {"error": code, "message": one line}."""

    STATUS = {"invalid_argument": 400, "unauthenticated": 401, "forbidden": 403, "not_found": 404,
              "conflict": 409, "too_large": 413, "rate_limited": 429, "internal": 500, "unavailable": 503}

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message.splitlines()[0] if message else code

    @property
    def status(self) -> int:
        return self.STATUS[self.code]

    def body(self) -> dict:
        return {"error": self.code, "message": self.message}


class Vitals:
    """Where the long-lived parts (the writer, the scheduler, the evaluator pool) report their death. Then
    /healthz answers 503 and `on_death` (the server) stops the process, so its supervisor starts a fresh one."""

    def __init__(self) -> None:
        self.deaths: list[str] = []
        self.on_death: Callable[[str], None] | None = None

    def died(self, what: str) -> None:
        self.deaths.append(what)
        if self.on_death:
            self.on_death(what)


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@functools.lru_cache(maxsize=4096)
def _iso_second(seconds: int) -> str:
    return (EPOCH + timedelta(seconds=seconds)).isoformat()[:-len("+00:00")]


def iso(ms: int | None) -> str | None:
    """Integer milliseconds as ISO-8601 UTC, exactly (no float rounding into another year). The seconds part is
    cached: a todo's times are mostly the same few seconds, and every answer shows several."""
    if ms is None:
        return None
    seconds, millis = divmod(ms, 1000)
    return f"{_iso_second(seconds)}.{millis:03d}Z"


def to_ms(moment: datetime) -> int:
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - EPOCH) // timedelta(milliseconds=1)


def default_db_path() -> str:
    return os.environ.get("SWITCHBOARD_DB") or "./switchboard.db"


# -- the parser --------------------------------------------------------------------------------------

def env_default(flag: str, default: Any) -> Any:
    """A serve flag's default from SWITCHBOARD_<FLAG>, so a unit file or a container sets it once. argparse
    converts (and refuses) it like a value given on the command line, and only when `serve` runs."""
    return os.environ.get("SWITCHBOARD_" + flag.upper().replace("-", "_"), default)


def switch_value(flag: str, value: bool | str) -> bool:
    """A switch's value: True when given on the command line, else SWITCHBOARD_<FLAG> as 1/true/yes/on or
    0/false/no/off (any case); anything else refuses to serve."""
    if isinstance(value, bool):
        return value
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise ApiError("invalid_argument", f"{flag} must be 1, true, yes, on, 0, false, no or off"
                                       f" (from SWITCHBOARD_{flag.upper().replace('-', '_')})")
