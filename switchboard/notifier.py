"""Telling humans they are needed: the outbox sender (ntfy, Gotify, Slack, Discord, signed webhooks)."""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import Counter

from switchboard.configuration import UNSAFE_TEXT, VERSION, ApiError, iso, log
from switchboard.crypto import SecretBox
from switchboard.database import Database
from switchboard.store.outbox import Outgoing, due_messages, record_sending

# The outbox rows are written by the store in the transaction that made the human needed; this sender
# delivers them after commit: one message per channel per 30 s (the rest become one digest), retries with
# backoff, each channel on its own so a hanging receiver delays nobody else. Messages name the work and quote
# producer text as data, on one line and short; never a payload, token, secret or lease.

NOTIFY_RATE_SECONDS = 30.0
NOTIFY_TIMEOUT_SECONDS = 10.0
NOTIFY_MAX_RESPONSE_BYTES = 64 << 10
NOTIFY_HEADLINES = {"needs_input": "A worker asks a question", "review": "Work waits for your review",
                    "held": "A delivery is held", "dead_letter": "Work failed for good",
                    "verification_failures": "A webhook keeps failing its signature check",
                    "test": "Switchboard test message"}
NTFY_TAGS = {"needs_input": "question", "review": "eyes", "held": "pause_button", "dead_letter": "x",
             "verification_failures": "warning", "test": "white_check_mark", "digest": "inbox_tray"}


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


def compose(message: Outgoing, base_url: str | None) -> Composed:
    rows = message.rows
    if message.digest:
        counts = dict(collections.Counter(r["event"] for r in rows))
        first = json.loads(rows[0]["data"])
        what = ", ".join(f"{n} {event.replace('_', ' ')}" for event, n in counts.items())
        return Composed(message.id, "digest", f"Switchboard: {len(rows)} things need you", f"{what} since the last"
                        f" message (first: {quoted(first.get('title', first.get('webhook_id', '')))})",
                        f"{base_url.rstrip('/')}/board" if base_url else None, {"counts": counts})
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
    return Composed(message.id, row["event"], f"Switchboard: {NOTIFY_HEADLINES[row['event']]}", subject, link,
                    {**shown, "board_url": link} if "todo_id" in data else shown)


def _header_text(text: str) -> str:
    """A header value: ASCII as is, else RFC 2047 (ntfy reads encoded titles)."""
    return text if text.isascii() else "=?UTF-8?B?" + base64.b64encode(text.encode()).decode() + "?="


def _slack_text(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def shape_request(kind: str, url: str, token: str | None, message: Composed,
                  now_s: int) -> tuple[str, dict[str, str], bytes]:
    """(url, headers, body) for one kind of receiver, as its public documentation describes."""
    headers = {"X-Switchboard-Message-Id": message.id, "User-Agent": f"switchboard/{VERSION}"}
    if kind == "ntfy":
        urgent = message.event in ("needs_input", "dead_letter", "verification_failures")
        headers.update({"Title": _header_text(message.title), "Tags": NTFY_TAGS[message.event],
                        "Priority": "high" if urgent else "default", "Content-Type": "text/plain; charset=utf-8"})
        if message.link:
            headers["Click"] = message.link
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return url, headers, message.text.encode()
    if kind == "gotify":
        headers.update({"X-Gotify-Key": token or "", "Content-Type": "application/json"})
        extras = {"client::notification": {"click": {"url": message.link}}} if message.link else {}
        body = {"title": message.title, "message": message.text, "priority": 8 if message.event != "digest" else 5,
                "extras": extras}
        target = url if url.rstrip("/").endswith("/message") else url.rstrip("/") + "/message"
        return target, headers, json.dumps(body).encode()
    if kind in ("slack", "discord"):
        headers["Content-Type"] = "application/json"
        line = f"{message.title}\n{message.text}" + (f"\n{message.link}" if message.link else "")
        body = ({"text": _slack_text(line)} if kind == "slack" else
                {"content": line[:2000], "allowed_mentions": {"parse": []}})
        return url, headers, json.dumps(body).encode()
    payload = json.dumps({"type": message.event, "timestamp": iso(now_s * 1000), "data": message.data}).encode()
    key = base64.b64decode((token or "").removeprefix("whsec_"))
    signature = base64.b64encode(hmac.new(key, f"{message.id}.{now_s}.".encode() + payload,
                                          hashlib.sha256).digest()).decode()
    headers.update({"Content-Type": "application/json", "webhook-id": message.id, "webhook-timestamp": str(now_s),
                    "webhook-signature": f"v1,{signature}"})
    return url, headers, payload


def _notify_client() -> httpx.AsyncClient:
    """The HTTP client notifications go out on: no redirects (a channel URL is the one the human set), and no proxy
    or credentials from the environment."""
    return httpx.AsyncClient(timeout=NOTIFY_TIMEOUT_SECONDS, follow_redirects=False, trust_env=False)


class Notifier:
    """The sender loop. `wake()` may be called from any thread (the writer calls it after a commit that wrote
    to the outbox); the loop also wakes when the next held-back message falls due."""

    def __init__(self, db: Database, box: SecretBox, base_url: str | None, failures: Counter | None = None,
                 sent: Counter | None = None):
        self.db = db
        self.box = box
        self.base_url = base_url
        self.failures = failures
        self.sent = sent
        self.busy: set[str] = set()
        self.tasks: set[asyncio.Task] = set()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def wake(self) -> None:
        if self._loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is stopping
                self._loop.call_soon_threadsafe(self._wake.set)

    async def run(self) -> None:
        """Send what is due, then sleep until the next message falls due or a commit wakes the loop. One bad
        round is logged and the loop goes on."""
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        # Made when the first message falls due: a client loads the TLS trust store (0.2 s on a slow box), which a
        # server that has nothing to send should not spend on the event loop as it starts.
        client: httpx.AsyncClient | None = None
        try:
            while True:
                self._wake.clear()
                try:
                    due, next_due = await self.db.write(due_messages, int(NOTIFY_RATE_SECONDS * 1000),
                                                        frozenset(self.busy))
                    for message in due:
                        client = client or _notify_client()
                        self._start(client, message)
                except Exception:  # noqa: BLE001 - the loop must outlive one bad round; the cause is logged
                    log.exception("notifier round failed")
                    next_due = None
                wait = 60.0 if next_due is None else max(0.05, (next_due - self.db.clock.now_ms()) / 1000)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
        finally:
            if client is not None:
                await client.aclose()

    def _start(self, client: httpx.AsyncClient, message: Outgoing) -> None:
        channel_id = message.channel["id"]
        self.busy.add(channel_id)
        task = asyncio.create_task(self.deliver(client, message))
        self.tasks.add(task)

        def done(finished: asyncio.Task) -> None:
            self.tasks.discard(finished)
            self.busy.discard(channel_id)
            self.wake()

        task.add_done_callback(done)

    async def deliver(self, client: httpx.AsyncClient, message: Outgoing) -> str | None:
        """Send one message and record how it went; the error, or None."""
        channel = message.channel
        error = await self.send(client, message)
        await self.db.write(record_sending, message, error)
        counter = self.failures if error else self.sent
        if counter is not None:
            counter.labels(channel["kind"]).inc()
        if error:
            log.warning("notification %s to channel %s (%s) failed: %s", message.id, channel["id"], channel["kind"],
                        error)
        return error

    async def send(self, client: httpx.AsyncClient, message: Outgoing) -> str | None:
        channel = message.channel
        try:
            url = self.box.open(channel["url_sealed"], channel["id"]).decode()
            token = (self.box.open(channel["token_sealed"], channel["id"] + ":token").decode()
                     if channel["token_sealed"] else None)
            composed = compose(message, self.base_url)
            target, headers, body = shape_request(channel["kind"], url, token, composed,
                                                  self.db.clock.now_ms() // 1000)
            async with client.stream("POST", target, headers=headers, content=body) as answer:
                read = 0
                async for chunk in answer.aiter_raw():
                    read += len(chunk)
                    if read >= NOTIFY_MAX_RESPONSE_BYTES:
                        break
                if not answer.is_success:
                    return f"HTTP {answer.status_code}"
        except (httpx.HTTPError, httpx.InvalidURL, ApiError, OSError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"[:300] or type(exc).__name__
        return None

    async def send_now(self, message: Outgoing) -> dict:
        """Send one message at once, outside the loop and its rate limit (a channel test), and say how it went."""
        async with _notify_client() as client:
            error = await self.deliver(client, message)
        return {"id": message.id, "channel_id": message.channel["id"], "sent": error is None, "error": error}

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
