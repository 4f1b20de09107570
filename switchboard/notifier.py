"""Telling humans they are needed: the outbox sender (ntfy, Gotify, Slack, Discord, signed webhooks)."""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import hashlib
import hmac
import ipaddress
import json
import os
import re
import socket
import threading
import urllib.parse
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from prometheus_client import Counter

from switchboard.configuration import UNSAFE_TEXT, VERSION, ApiError, iso, log, switch_value
from switchboard.crypto import SecretBox
from switchboard.database import Database, Txn
from switchboard.store.outbox import (
    OUTPUTS_HELD_RECHECK_MS,
    Outgoing,
    due_messages,
    outputs_held,
    record_sending,
    todo_traceparent,
)
from switchboard.store.transitions import span_record
from switchboard.tracing import new_span_id, new_trace_id, parse_traceparent

if TYPE_CHECKING:
    import httpx

# The outbox rows are written by the store in the transaction that made the human needed; this sender
# delivers them after commit: one message per channel per 30 s (the rest become one digest), retries with
# backoff, each channel on its own so a hanging receiver delays nobody else. Messages name the work and quote
# producer text as data, on one line and short; never a payload, token, secret or lease.

NOTIFY_RATE_SECONDS = 30.0
# One send's whole deadline: resolving the name, connecting, sending, and reading the answer. httpx's own
# timeouts (the same number) restart with every byte, so a receiver trickling one byte a second would never
# meet them; this one it meets.
NOTIFY_TIMEOUT_SECONDS = 10.0
NOTIFY_MAX_RESPONSE_BYTES = 64 << 10
# Sends in flight at once, every human's together, and to one human's channels: however many channels are
# due, the sender starts no more, so its work on the event loop stays small, and a human whose receivers hang
# holds at most NOTIFY_SENDS_PER_HUMAN slots (for at most NOTIFY_TIMEOUT_SECONDS each).
NOTIFY_MAX_SENDS = 64
NOTIFY_SENDS_PER_HUMAN = 4
NOTIFY_HEADLINES = {"needs_input": "A worker asks a question", "review": "Work waits for your review",
                    "held": "A delivery is held", "dead_letter": "Work failed for good",
                    "verification_failures": "A webhook keeps failing its signature check",
                    "test": "Switchboard test message"}
# A wait limit's reminder says what still waits, by the todo's state (store.wait_sweep sends it).
REMINDER_HEADLINES = {"pending": "Work still waits for a worker", "needs_input": "A worker's question still waits",
                      "review": "Work still waits for your review", "blocked": "Blocked work still waits for you"}
NTFY_TAGS = {"needs_input": "question", "review": "eyes", "held": "pause_button", "dead_letter": "x",
             "verification_failures": "warning", "test": "white_check_mark", "digest": "inbox_tray"}
# Sent at high priority (ntfy `high`, Gotify 8), the rest at the default (ntfy `default`, Gotify 5). A digest has
# the highest priority of what it carries, names those events first, and besides its own tag carries the tag of
# each failure in it (something broke, where the inbox tray says only that things wait).
NOTIFY_URGENT = ("needs_input", "dead_letter", "verification_failures")
NOTIFY_FAILURES = ("dead_letter", "verification_failures")
GOTIFY_PRIORITY = {"high": 8, "default": 5}
NOTIFY_DIGEST_TITLES = 3  # a digest names this many of its messages, then says how many more


def quoted(text: Any, limit: int = 80) -> str:
    """Producer text as a message may quote it: one line, no control or bidi characters, short."""
    clean = " ".join(re.sub(f"[{UNSAFE_TEXT}]", " ", str(text)).split())
    return clean if len(clean) <= limit else clean[:limit - 1] + "…"


@dataclass(frozen=True)
class Composed:
    """A message in words and as data, before it is shaped for one kind of receiver."""
    id: str
    event: str
    title: str
    text: str
    link: str | None
    data: dict
    priority: str = "default"  # "high" or "default"
    tags: tuple[str, ...] = ()


def _digest_line(row: Any) -> str:
    """One message a digest names: its event and its subject, producer text quoted as a single message quotes it."""
    data = json.loads(row["data"])
    what = row["event"].replace("_", " ")
    if "todo_id" in data:
        return f"• {what}: {quoted(data['title'])} (queue {data['queue']})"
    return f"• {what}: webhook {data['webhook_id']} ({data['provider']}), {data['failures']} failed checks"


def _digest(message: Outgoing, base_url: str | None) -> Composed:
    """The messages the rate limit held back, as one: the counts, the first NOTIFY_DIGEST_TITLES named (the urgent
    ones first, else in the order they came), and how many more. Given the same rows it says the same (a digest
    is resent exactly as formed)."""
    rows = sorted(message.rows, key=lambda r: r["event"] not in NOTIFY_URGENT)  # stable: by arrival within
    counts = dict(collections.Counter(r["event"] for r in rows))
    what = ", ".join(f"{n} {event.replace('_', ' ')}" for event, n in counts.items())
    lines = [f"{what} since the last message:", *(_digest_line(r) for r in rows[:NOTIFY_DIGEST_TITLES])]
    if len(rows) > NOTIFY_DIGEST_TITLES:
        lines.append(f"and {len(rows) - NOTIFY_DIGEST_TITLES} more")
    urgent = any(event in NOTIFY_URGENT for event in counts)
    return Composed(message.id, "digest", f"Switchboard: {len(rows)} things need you", "\n".join(lines),
                    f"{base_url.rstrip('/')}/board" if base_url else None, {"counts": counts},
                    "high" if urgent else "default",
                    (NTFY_TAGS["digest"], *(NTFY_TAGS[event] for event in counts if event in NOTIFY_FAILURES)))


def compose(message: Outgoing, base_url: str | None) -> Composed:
    rows = message.rows
    if message.digest:
        return _digest(message, base_url)
    row = rows[0]
    data = json.loads(row["data"])
    if "todo_id" in data:
        subject = f"{quoted(data['title'])} (queue {data['queue']}, {data['todo_id']})"
        link = f"{base_url.rstrip('/')}/board/todos/{data['todo_id']}" if base_url else None
    elif "webhook_id" in data:
        subject = f"webhook {data['webhook_id']} ({data['provider']}): {data['failures']} failed checks, {data['reason']}"
        link = f"{base_url.rstrip('/')}/board/webhooks/{data['webhook_id']}" if base_url else None
    else:
        subject, link = "this channel works", f"{base_url.rstrip('/')}/board" if base_url else None
    shown = {k: quoted(v) if k == "title" else v for k, v in data.items()}
    headline = NOTIFY_HEADLINES[row["event"]]
    if "reminder" in data:
        headline = f"{REMINDER_HEADLINES[data['state']]} (reminder {data['reminder']})"
    return Composed(message.id, row["event"], f"Switchboard: {headline}", subject, link,
                    {**shown, "board_url": link} if "todo_id" in data else shown,
                    "high" if row["event"] in NOTIFY_URGENT else "default", (NTFY_TAGS[row["event"]],))


def _header_text(text: str) -> str:
    """A header value: ASCII as is, else RFC 2047 (ntfy reads encoded titles)."""
    return text if text.isascii() else "=?UTF-8?B?" + base64.b64encode(text.encode()).decode() + "?="


def _slack_text(text: str) -> str:
    """Slack's mrkdwn: `&`, `<` and `>` escaped as its documentation asks, so producer text can make no link
    (`<url|text>`), mention (`<!channel>`) or date; `[text](url)` is no link syntax there."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


_ASCII_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")


def _discord_text(text: str) -> str:
    """Text as Discord shows it: literally. Discord reads `content` as Markdown (masked links `[text](url)`,
    headers, emphasis, `<…>` mentions and timestamps), and a backslash before any ASCII punctuation character
    makes it plain; a URL whose `:` is escaped is not made a link either."""
    return _ASCII_PUNCTUATION.sub(r"\\\1", text)


def shape_request(kind: str, url: str, token: str | None, message: Composed,
                  now_s: int) -> tuple[str, dict[str, str], bytes]:
    """(url, headers, body) for one kind of receiver, as its public documentation describes. Producer text is
    plain text everywhere: ntfy and Gotify get no Markdown switch, Slack's and Discord's markup is escaped."""
    headers = {"X-Switchboard-Message-Id": message.id, "User-Agent": f"switchboard/{VERSION}"}
    if kind == "ntfy":
        headers.update({"Title": _header_text(message.title), "Tags": ",".join(message.tags),
                        "Priority": message.priority, "Content-Type": "text/plain; charset=utf-8"})
        if message.link:
            headers["Click"] = message.link
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return url, headers, message.text.encode()
    if kind == "gotify":
        headers.update({"X-Gotify-Key": token or "", "Content-Type": "application/json"})
        extras = {"client::notification": {"click": {"url": message.link}}} if message.link else {}
        body = {"title": message.title, "message": message.text, "priority": GOTIFY_PRIORITY[message.priority],
                "extras": extras}
        target = url if url.rstrip("/").endswith("/message") else url.rstrip("/") + "/message"
        return target, headers, json.dumps(body).encode()
    if kind in ("slack", "discord"):
        headers["Content-Type"] = "application/json"
        link = f"\n{message.link}" if message.link else ""
        body = ({"text": _slack_text(f"{message.title}\n{message.text}{link}")} if kind == "slack" else
                {"content": f"{message.title}\n{_discord_text(message.text)}{link}"[:2000],
                 "allowed_mentions": {"parse": []}})
        return url, headers, json.dumps(body).encode()
    payload = json.dumps({"type": message.event, "timestamp": iso(now_s * 1000), "data": message.data}).encode()
    key = base64.b64decode((token or "").removeprefix("whsec_"))
    signature = base64.b64encode(hmac.new(key, f"{message.id}.{now_s}.".encode() + payload,
                                          hashlib.sha256).digest()).decode()
    headers.update({"Content-Type": "application/json", "webhook-id": message.id, "webhook-timestamp": str(now_s),
                    "webhook-signature": f"v1,{signature}"})
    return url, headers, payload


# -- where a channel may send ---------------------------------------------------------------------------

# What a human is told about a channel whose host is internal: the same whatever the port and whether anything
# listens there, so a channel's test cannot scan the box's ports.
REFUSED_ADDRESS = ("refused: the channel's host is a loopback, link-local or unspecified address, which this"
                   " server does not send to")
# … and what adding such a channel answers (400): the same whatever the port, with what the operator may do. A CLI
# command is not the server: its allowance is its own environment's, so its refusal names the variables.
SERVE_ALLOWANCE = "unless the server's operator allows it: serve --notify-allow-private, or --notify-allow ADDRESS[:PORT]"
COMMAND_ALLOWANCE = ("unless this command's environment allows it: SWITCHBOARD_NOTIFY_ALLOW_PRIVATE=1, or"
                     " SWITCHBOARD_NOTIFY_ALLOW=ADDRESS[:PORT]")
REFUSED_CHANNEL = f"url: {REFUSED_ADDRESS} ({SERVE_ALLOWANCE})"
# How long adding a channel waits for its host name to resolve; past that (or when it does not resolve) the
# channel is added, and every send resolves and checks it again.
NOTIFY_CHECK_RESOLVE_SECONDS = 2.0
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def _plain(address: IpAddress) -> IpAddress:
    """An IPv4-mapped IPv6 address (::ffff:127.0.0.1) as the IPv4 address it reaches."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def internal(address: IpAddress) -> bool:
    """Loopback, link-local (169.254/16 holds cloud metadata services) or unspecified (0.0.0.0 and :: reach the
    box itself): no channel's business unless the operator says so. LAN ranges (10/8, 172.16/12, 192.168/16) are
    not internal here: a LAN ntfy or Gotify is a real use."""
    address = _plain(address)
    return (address.is_loopback or address.is_link_local or address.is_unspecified
            or (address.version == 4 and address in _THIS_NETWORK))


def _allowed_entry(entry: str) -> tuple[IpNetwork, int | None]:
    """One `--notify-allow` entry: an address or a network, with an optional port (`127.0.0.1:8090`,
    `[::1]:8090`, `169.254.0.0/16`)."""
    text, port = entry.strip(), None
    if text.startswith("["):
        text, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") if rest else None
        text = text if not rest or rest.startswith(":") else ""
    elif text.count(":") == 1:
        text, port = text.split(":")
    try:
        network = ipaddress.ip_network(text, strict=False)
        number = None if port is None else int(port)
        if number is not None and not 0 < number < 65536:
            raise ValueError(port)
    except ValueError:
        raise ApiError("invalid_argument", f"notify-allow: {entry.strip()!r} is not an address or network with an"
                                           " optional :port (e.g. 127.0.0.1:8090, [::1]:8090, 169.254.0.0/16)"
                                           " (from --notify-allow or SWITCHBOARD_NOTIFY_ALLOW)") from None
    return network, number


@dataclass(frozen=True)
class Addresses:
    """Where channels may send: anywhere but internal addresses, unless the operator allows them all
    (`serve --notify-allow-private`) or some (`--notify-allow`)."""
    allow_private: bool = False
    allowed: tuple[tuple[IpNetwork, int | None], ...] = ()

    @classmethod
    def configured(cls, allow_private: bool | str | None = None, allow: str | None = None) -> Addresses:
        """From the serve flags; one not given comes from SWITCHBOARD_NOTIFY_ALLOW_PRIVATE or
        SWITCHBOARD_NOTIFY_ALLOW (the CLI's `notify test` reads them too)."""
        if allow_private is None:
            allow_private = os.environ.get("SWITCHBOARD_NOTIFY_ALLOW_PRIVATE", "")
        if allow is None:
            allow = os.environ.get("SWITCHBOARD_NOTIFY_ALLOW", "")
        return cls(switch_value("notify-allow-private", allow_private),
                   tuple(_allowed_entry(entry) for entry in allow.split(",") if entry.strip()))

    def permits(self, address: IpAddress, port: int) -> bool:
        """Whether a channel may connect to `address` on `port`."""
        if self.allow_private or not internal(address):
            return True
        address = _plain(address)
        return any(address in network and wanted in (None, port) for network, wanted in self.allowed)

    async def vet(self, url: str, refusal: str = REFUSED_CHANNEL) -> None:
        """Refuse a new channel (400, `refusal`) whose host is, or names, an address `permits` refuses:
        an address literal at once; a name resolved in a thread of its own, waiting at most
        NOTIFY_CHECK_RESOLVE_SECONDS. A name that does not resolve in time, or at all, passes: each send resolves
        and checks its host again (a name may point elsewhere by then), so nothing reaches a refused address."""
        if self.allow_private:
            return
        import httpx  # with the first channel: see outbound_client
        try:
            host, port = host_and_port(httpx.URL(url))
        except (httpx.InvalidURL, UnicodeError, ValueError):
            return  # no send can go there either: it fails on the URL
        try:
            with anyio.fail_after(NOTIFY_CHECK_RESOLVE_SECONDS):
                found = await resolve(host, port)
        except (TimeoutError, OSError):
            return
        if not all(self.permits(address, port) for address in found):
            raise ApiError("invalid_argument", refusal)


def host_and_port(url: httpx.URL) -> tuple[str, int]:
    """The host a channel's (or a forge connection's) URL names (as sent: no brackets around IPv6) and the port it
    connects to."""
    return url.raw_host.decode("ascii"), url.port or (443 if url.scheme == "https" else 80)


async def resolve(host: str, port: int) -> list[IpAddress]:
    """The addresses a host names: a literal as it is, a name through getaddrinfo in a daemon thread of its own,
    so that a hanging resolver holds neither the event loop, a shared worker thread, nor the process's exit."""
    with contextlib.suppress(ValueError):
        return [ipaddress.ip_address(host)]
    loop = asyncio.get_running_loop()
    answer: asyncio.Future = loop.create_future()

    def settle(outcome: Any, failed: bool) -> None:
        if not answer.done():  # not given up (the send's deadline passed)
            if failed:
                answer.set_exception(outcome)
            else:
                answer.set_result(outcome)

    def look_up() -> None:
        try:
            outcome, failed = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM), False
        except (OSError, UnicodeError) as exc:
            outcome, failed = OSError(f"cannot resolve the host: {exc}"), True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, outcome, failed)

    threading.Thread(target=look_up, name="switchboard-notify-dns", daemon=True).start()
    found: list[IpAddress] = []
    for *_, sockaddr in await answer:
        address = ipaddress.ip_address(sockaddr[0])
        if address not in found:
            found.append(address)
    return found


def _scrubbed(error: str, url: str | None, token: str | None) -> str:
    """An error as it may be logged and shown: without the channel's URL or any credential in it (the path of a
    Slack, Discord or ntfy URL is itself one)."""
    secrets = [url, token]
    if url:
        with contextlib.suppress(ValueError):
            parts = urllib.parse.urlsplit(url)
            secrets += [parts.path, parts.query, parts.username, parts.password]
    for secret in sorted((s for s in secrets if s and len(s) >= 4), key=len, reverse=True):
        error = error.replace(secret, "…")
    return error


async def outbound_client() -> httpx.AsyncClient:
    """The HTTP client notifications (and forge outputs) go out on: no redirects (a channel URL is the one the human
    set), no proxy or credentials from the environment, and a new connection for every send (each goes to the
    address just checked, and TLS is never reused across host names that share one). The TLS trust store is loaded in a worker thread:
    0.2 s on a slow box, not to be spent on the event loop. httpx is imported here and in the send path, not
    with this module: a box without channels never spends its 2.6 MiB."""
    import httpx
    context = await anyio.to_thread.run_sync(httpx.create_ssl_context, True, None, False)
    return httpx.AsyncClient(verify=context, timeout=NOTIFY_TIMEOUT_SECONDS, follow_redirects=False, trust_env=False,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))


class _Busy(Exception):
    """No sending slot came free within a test message's patience."""


@dataclass
class _HumanSlots:
    semaphore: asyncio.Semaphore
    users: int = 0


def due_unless_held(txn: Txn, *args: Any) -> tuple[list[Outgoing], int | None]:
    """due_messages, unless outputs are held (a restored copy): then nothing, and a look again soon, in the same
    transaction, so a hold that commits first is never overtaken by a send."""
    if outputs_held(txn) is not None:
        return [], txn.now + OUTPUTS_HELD_RECHECK_MS
    return due_messages(txn, *args)


class Notifier:
    """The sender loop. `wake()` may be called from any thread (the writer calls it after a commit that wrote
    to the outbox); the loop also wakes when the next held-back message falls due, and when a send ends."""

    def __init__(self, db: Database, box: SecretBox, base_url: str | None, failures: Counter | None = None,
                 sent: Counter | None = None, addresses: Addresses | None = None):
        self.db = db
        self.box = box
        self.base_url = base_url
        self.failures = failures
        self.sent = sent
        self.addresses = addresses if addresses is not None else Addresses.configured()
        self.busy: set[str] = set()  # channels with a send from the loop in flight
        self.started: collections.Counter[str] = collections.Counter()  # the loop's sends in flight, by human
        self.tasks: set[asyncio.Task] = set()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._all: asyncio.Semaphore | None = None
        self._humans: dict[str, _HumanSlots] = {}
        self._client: httpx.AsyncClient | None = None
        self._client_made: asyncio.Lock | None = None
        self.tracing: Callable[[list[dict]], None] | None = None  # the span exporter's emit (app), if any

    def wake(self) -> None:
        if self._loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is stopping
                self._loop.call_soon_threadsafe(self._wake.set)

    async def client(self) -> httpx.AsyncClient:
        """The one client of the sender loop and the test messages, made when the first message is sent: a server
        that has nothing to send spends nothing on it."""
        self._client_made = self._client_made or asyncio.Lock()
        async with self._client_made:
            if self._client is None:
                self._client = await outbound_client()
            return self._client

    async def run(self) -> None:
        """Send what is due, as far as sending slots are free, then sleep until the next message falls due, a
        commit or a finished send wakes the loop. One bad round is logged and the loop goes on."""
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        while True:
            self._wake.clear()
            next_due = None
            try:
                room = NOTIFY_MAX_SENDS - len(self.tasks)
                if room > 0:  # else a send ending wakes the loop
                    due, next_due = await self.db.write(due_unless_held, int(NOTIFY_RATE_SECONDS * 1000),
                                                        frozenset(self.busy), dict(self.started), room,
                                                        NOTIFY_SENDS_PER_HUMAN)
                    client = await self.client() if due else None
                    for message in due:
                        self._start(client, message)
            except Exception:  # noqa: BLE001 - the loop must outlive one bad round; the cause is logged
                log.exception("notifier round failed")
                next_due = None
            wait = 60.0 if next_due is None else max(0.05, (next_due - self.db.clock.now_ms()) / 1000)
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel that arrives as the wake does
            # (it returns the wake), and the loop went on, so the server's stop waited for it for ever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()

    def _start(self, client: httpx.AsyncClient, message: Outgoing) -> None:
        channel_id, human_id = message.channel["id"], message.channel["human_id"]
        self.busy.add(channel_id)
        self.started[human_id] += 1
        task = asyncio.create_task(self.deliver(client, message))
        self.tasks.add(task)

        def done(finished: asyncio.Task) -> None:
            self.tasks.discard(finished)
            self.busy.discard(channel_id)
            self.started[human_id] -= 1
            if self.started[human_id] <= 0:
                del self.started[human_id]
            self.wake()

        task.add_done_callback(done)

    @contextlib.asynccontextmanager
    async def _slot(self, human_id: str, patience: float | None) -> AsyncIterator[None]:
        """One of the NOTIFY_MAX_SENDS sending slots and one of the human's NOTIFY_SENDS_PER_HUMAN, for loop
        sends and test messages alike. The loop starts no more sends than there are slots; a test message waits
        at most `patience` seconds for its slot."""
        self._all = self._all or asyncio.Semaphore(NOTIFY_MAX_SENDS)
        mine = self._humans.setdefault(human_id, _HumanSlots(asyncio.Semaphore(NOTIFY_SENDS_PER_HUMAN)))
        mine.users += 1
        held: list[asyncio.Semaphore] = []
        try:
            try:
                with anyio.fail_after(patience):
                    for semaphore in (mine.semaphore, self._all):
                        await semaphore.acquire()
                        held.append(semaphore)
            except TimeoutError:
                raise _Busy from None
            yield
        finally:
            for semaphore in held:
                semaphore.release()
            mine.users -= 1
            if not mine.users:
                del self._humans[human_id]

    async def deliver(self, client: httpx.AsyncClient, message: Outgoing, patience: float | None = None) -> str | None:
        """Send one message and record how it went; the error, or None."""
        channel = message.channel
        started = self.db.clock.now_ms()
        error = await self.send(client, message, patience)
        await self.db.write(record_sending, message, error)
        if self.tracing is not None:
            self.tracing(await self._notify_span(message, error, started))
        counter = self.failures if error else self.sent
        if counter is not None:
            counter.labels(channel["kind"]).inc()
        if error:
            log.warning("notification %s to channel %s (%s) failed: %s", message.id, channel["id"], channel["kind"],
                        error)
        return error

    async def _notify_span(self, message: Outgoing, error: str | None, started: int) -> list[dict]:
        """The `notify {channel kind}` span (CLIENT): under the `send` span of the todo it is about, else a trace of
        its own (a digest, a test message)."""
        data = json.loads(message.rows[0]["data"]) if len(message.rows) == 1 else {}
        todo_id = data.get("todo_id")
        context = parse_traceparent(await self.db.read(todo_traceparent, todo_id)) if todo_id else None
        trace_id, parent = context or (new_trace_id(), None)
        attributes = {"messaging.system": "switchboard", "switchboard.channel_id": message.channel["id"],
                      "switchboard.notification": message.rows[0]["event"] if len(message.rows) == 1 else "digest",
                      "switchboard.outcome": "failed" if error else "sent"}
        if todo_id:
            attributes["messaging.message.id"] = todo_id
        return [span_record(f"notify {message.channel['kind']}", "client", trace_id, new_span_id(), parent, started,
                            self.db.clock.now_ms(), attributes)]

    async def send(self, client: httpx.AsyncClient, message: Outgoing, patience: float | None = None) -> str | None:
        """One message to its channel within NOTIFY_TIMEOUT_SECONDS from start to end; the error, or None."""
        import httpx  # with the first channel: see outbound_client
        channel = message.channel
        url = token = None
        try:
            url = self.box.open(channel["url_sealed"], channel["id"]).decode()
            token = (self.box.open(channel["token_sealed"], channel["id"] + ":token").decode()
                     if channel["token_sealed"] else None)
            composed = compose(message, self.base_url)
            target, headers, body = shape_request(channel["kind"], url, token, composed,
                                                  self.db.clock.now_ms() // 1000)
            async with self._slot(channel["human_id"], patience):
                try:
                    with anyio.fail_after(NOTIFY_TIMEOUT_SECONDS):
                        return await self._post(client, target, headers, body)
                except TimeoutError:
                    return f"Timeout: no complete answer within {NOTIFY_TIMEOUT_SECONDS:g} s"
        except _Busy:
            return "busy: too many notifications are being sent; try again shortly"
        except (httpx.HTTPError, httpx.InvalidURL, ApiError, OSError, ValueError) as exc:
            return _scrubbed(f"{type(exc).__name__}: {exc}", url, token)[:300] or type(exc).__name__

    async def _post(self, client: httpx.AsyncClient, target: str, headers: dict[str, str], body: bytes) -> str | None:
        """POST to the channel's host at an address just resolved and checked (a name that resolves elsewhere by
        the time of connecting changes nothing), trying its addresses in turn while they refuse connections."""
        import httpx  # with the first channel: see outbound_client
        url = httpx.URL(target)
        host, port = host_and_port(url)
        addresses = await resolve(host, port)
        if not addresses:
            raise OSError("cannot resolve the host: no address")
        if not all(self.addresses.permits(address, port) for address in addresses):
            return REFUSED_ADDRESS
        headers = {**headers, "Host": url.netloc.decode("ascii")}
        extensions = {"sni_hostname": host} if url.scheme == "https" else {}
        failure: httpx.ConnectError | None = None
        for address in addresses:
            try:
                async with client.stream("POST", url.copy_with(host=str(address)), headers=headers, content=body,
                                         extensions=extensions) as answer:
                    read = 0
                    async for chunk in answer.aiter_raw():
                        read += len(chunk)
                        if read >= NOTIFY_MAX_RESPONSE_BYTES:
                            break
                    return None if answer.is_success else f"HTTP {answer.status_code}"
            except httpx.ConnectError as exc:
                failure = exc
        raise failure  # type: ignore[misc] - addresses is not empty

    async def send_now(self, message: Outgoing) -> dict:
        """Send one message at once, outside the loop and its rate limit (a channel test), and say how it went. It
        waits at most NOTIFY_TIMEOUT_SECONDS for a sending slot, then has its own deadline."""
        if self._loop is not None:
            error = await self.deliver(await self.client(), message, NOTIFY_TIMEOUT_SECONDS)
        else:  # no sender loop in this process (the CLI's `notify test`): a client for this one message
            async with await outbound_client() as client:
                error = await self.deliver(client, message, NOTIFY_TIMEOUT_SECONDS)
        return {"id": message.id, "channel_id": message.channel["id"], "sent": error is None, "error": error}

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
