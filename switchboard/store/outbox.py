"""Notification channels and the outbox: what a human is to be told, written in the same transaction as
the change that calls for it."""

from __future__ import annotations

import base64
import collections
import json
import secrets
import sqlite3
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

from switchboard.configuration import BACKOFF_BASE_SECONDS, NOTIFY_MAX_CHANNELS, ApiError, iso
from switchboard.crypto import SecretBox, new_id
from switchboard.database import Txn
from switchboard.models import NotifyCreate
from switchboard.store.principals import Principal, owned_rows

# -- notifications: channels and the outbox ---------------------------------------------------------

NOTIFY_MAX_ATTEMPTS = 10


def _shown_url(url: str) -> str:
    """A channel URL for display: scheme and host only (the path of a Slack, Discord or ntfy URL is itself the
    credential)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host  # an IPv6 address, bracketed as in the URL
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}/…"


def channel_view(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "kind": row["kind"], "url": row["url_shown"], "events": json.loads(row["events"]),
            "created_at": iso(row["created_at"]), "last_sent_at": iso(row["last_sent_at"]),
            "last_error": row["last_error"], "last_error_at": iso(row["last_error_at"]), "failures": row["failures"]}


def add_channel(txn: Txn, principal: Principal, box: SecretBox, body: NotifyCreate, human_id: str | None = None) -> dict:
    """A human's new channel. For `webhook` a signing secret is made and shown once; all credentials are sealed.
    A human has at most NOTIFY_MAX_CHANNELS channels."""
    owner = human_id or principal.human_id
    if principal.kind != "operator":
        principal.require_human("notification channels")
    # Additions for one human take turns, so that each counts the others' channels (as the connections' quota).
    txn.lock_key("notify_channels", owner)
    held = txn.one("SELECT count(*) AS n FROM notify_channels WHERE human_id = ?", (owner,))["n"]
    if held >= NOTIFY_MAX_CHANNELS:
        raise ApiError("conflict", f"this human already has {held} notification channels, the most one may have:"
                                   " remove one before adding another")
    channel_id = new_id("nc")
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode() if body.kind == "webhook" else None
    token = secret or body.token
    txn.execute("INSERT INTO notify_channels (id, human_id, kind, url_sealed, url_shown, token_sealed, events,"
                " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (channel_id, owner, body.kind, box.seal(body.url, channel_id), _shown_url(body.url),
                 box.seal(token, channel_id + ":token") if token else None, json.dumps(list(dict.fromkeys(body.events))),
                 txn.now))
    txn.logs.append(f"notification channel {channel_id} ({body.kind}) added for {owner}")
    view = channel_view(txn.one("SELECT * FROM notify_channels WHERE id = ?", (channel_id,)))
    return {**view, "secret": secret} if secret else view


def _own_channel(txn: Txn, principal: Principal, channel_id: str) -> sqlite3.Row:
    principal.require_human("notification channels")
    rows = owned_rows(txn, principal, "notify_channels", channel_id)
    if not rows:
        raise ApiError("not_found", f"no notification channel {channel_id}")
    return rows[0]


def list_channels(txn: Txn, principal: Principal) -> dict:
    principal.require_human("notification channels")
    return {"channels": [channel_view(r) for r in owned_rows(txn, principal, "notify_channels")]}


def remove_channel(txn: Txn, principal: Principal, channel_id: str) -> dict:
    row = _own_channel(txn, principal, channel_id)
    txn.execute("DELETE FROM notify_channels WHERE id = ?", (row["id"],))
    return {**channel_view(row), "removed": True}


def notify(txn: Txn, human_id: str, event: str, data: dict) -> None:
    """Queue a message for each of the human's channels that listen for `event`, in this transaction: it is
    sent after commit, and after a crash it is still in the outbox."""
    channels = txn.all("SELECT id FROM notify_channels WHERE human_id = ?"
                       " AND EXISTS (SELECT 1 FROM json_each(events) WHERE value = ?)", (human_id, event))
    for channel in channels:
        txn.execute("INSERT INTO notify_outbox (id, channel_id, event, data, created_at, next_at)"
                    " VALUES (?, ?, ?, ?, ?, ?)", (new_id("nm"), channel["id"], event, json.dumps(data), txn.now,
                                                   txn.now))
    txn.outbox |= bool(channels)


def notify_todo(txn: Txn, todo_id: str, event: str) -> None:
    """A todo now needs its human: data names it, never its payload, result or lease."""
    row = txn.one("SELECT t.id, t.queue, t.state, t.title, e.human_id FROM todos t"
                  " JOIN endpoints e ON e.id = t.endpoint_id WHERE t.id = ?", (todo_id,))
    notify(txn, row["human_id"], event, {"todo_id": row["id"], "queue": row["queue"], "state": row["state"],
                                         "title": row["title"]})


def notify_verification_failures(txn: Txn, webhook_id: str, failures: int, reason: str) -> None:
    webhook = txn.one("SELECT w.id, w.provider, e.human_id FROM webhooks w JOIN endpoints e ON e.id = w.endpoint_id"
                      " WHERE w.id = ?", (webhook_id,))
    if webhook is not None:
        notify(txn, webhook["human_id"], "verification_failures",
               {"webhook_id": webhook_id, "provider": webhook["provider"], "failures": failures, "reason": reason})


def queue_test_message(txn: Txn, principal: Principal, channel_id: str) -> Outgoing:
    """A test message for the channel, in the outbox (so it has a stable id), to be sent at once."""
    channel = _own_channel(txn, principal, channel_id)
    message_id = new_id("nm")
    txn.execute("INSERT INTO notify_outbox (id, channel_id, event, data, created_at, next_at)"
                " VALUES (?, ?, 'test', '{}', ?, ?)", (message_id, channel["id"], txn.now, txn.now))
    return Outgoing(message_id, channel, [txn.one("SELECT * FROM notify_outbox WHERE id = ?", (message_id,))])


def todo_traceparent(txn: Txn, todo_id: str) -> str | None:
    """The todo's traceparent (its `send` span): a notification about it is traced under it."""
    row = txn.one("SELECT traceparent FROM todos WHERE id = ?", (todo_id,))
    return row["traceparent"] if row else None


@dataclass
class Outgoing:
    """One message for one channel: a single event, or a digest of the ones the rate limit held back."""
    id: str
    channel: sqlite3.Row
    rows: list[sqlite3.Row]

    @property
    def digest(self) -> bool:
        return len(self.rows) > 1


def due_messages(txn: Txn, rate_ms: int, busy: frozenset[str], sending: Mapping[str, int] | None = None,
                 room: int | None = None, per_human: int | None = None) -> tuple[list[Outgoing], int | None]:
    """What to send now, one message per channel (a digest formed earlier is sent again exactly as formed, so
    its id stays true), and when the next one falls due. At most `room` messages, and for each human no more
    than brings their sends in flight (`sending`, by human id) to `per_human`: humans take turns, the one with
    the fewest sends in flight first, then the longest waiting. A due channel left out now is sent when a send
    ends (the sender looks again then)."""
    # A channel whose last send failed waits out its backoff before anything else goes to it.
    # A test message is sent by its own request, never by the loop, and is not counted in the window.
    # Grouped in the outbox's by-channel index first, then joined: no temporary b-tree of channel rows (a round
    # runs after every send that ends, so it stays cheap with thousands of channels waiting).
    pending = txn.all("SELECT c.*, d.due_at FROM (SELECT channel_id, coalesce(max(CASE WHEN attempts > 0 THEN next_at"
                      " END), min(next_at)) AS due_at FROM notify_outbox WHERE sent_at IS NULL AND gave_up_at IS NULL"
                      " AND event <> 'test' GROUP BY channel_id) d JOIN notify_channels c ON c.id = d.channel_id")
    next_due: int | None = None
    ready: list[tuple[int, sqlite3.Row]] = []
    for channel in pending:
        if channel["id"] in busy:
            continue  # its send in flight wakes the loop when it ends
        when = max(channel["due_at"], (channel["last_sent_at"] or -rate_ms) + rate_ms)  # the last alert's window
        if when > txn.now:
            next_due = when if next_due is None else min(next_due, when)
            continue
        ready.append((when, channel))
    ready.sort(key=lambda pair: (pair[0], pair[1]["id"]))
    in_flight = collections.Counter(sending or {})
    turns: list[tuple[int, int, str, sqlite3.Row]] = []
    for when, channel in ready:
        turns.append((in_flight[channel["human_id"]], when, channel["id"], channel))
        in_flight[channel["human_id"]] += 1
    turns.sort(key=lambda turn: turn[:3])
    chosen = [channel for place, _, _, channel in turns if per_human is None or place < per_human]
    due: list[Outgoing] = []
    for channel in chosen[:room]:
        rows = txn.all("SELECT * FROM notify_outbox WHERE channel_id = ? AND sent_at IS NULL AND gave_up_at IS NULL"
                       " AND event <> 'test' ORDER BY digest_id IS NULL, attempts = 0, created_at, id LIMIT 1000",
                       (channel["id"],))
        # A message tried before is sent again exactly as it was (a digest with its rows, or a single one alone).
        if rows[0]["digest_id"] is not None:
            rows = [r for r in rows if r["digest_id"] == rows[0]["digest_id"]]
        elif rows[0]["attempts"] > 0:
            rows = rows[:1]
        formed = rows[0]["digest_id"] is not None
        message_id = rows[0]["digest_id"] or (rows[0]["id"] if len(rows) == 1 else new_id("nm"))
        if len(rows) > 1 and not formed:
            txn.execute(f"UPDATE notify_outbox SET digest_id = ? WHERE id IN ({', '.join('?' * len(rows))})",
                        (message_id, *(r["id"] for r in rows)))
        due.append(Outgoing(message_id, channel, rows))
    return due, next_due


def record_sending(txn: Txn, message: Outgoing, error: str | None) -> None:
    """After a send: the rows are sent, or wait to be tried again with backoff (and are given up after
    NOTIFY_MAX_ATTEMPTS); the channel keeps its last error for the Board and /metrics. A sent alert starts the
    channel's rate window (`last_sent_at`); a sent test message does not: it is no alert, and the next real one
    must not wait for it."""
    ids = [r["id"] for r in message.rows]
    marks = ", ".join("?" * len(ids))
    if error is None:
        txn.execute(f"UPDATE notify_outbox SET sent_at = ? WHERE id IN ({marks})", (txn.now, *ids))
        if message.rows[0]["event"] != "test":
            txn.execute("UPDATE notify_channels SET last_sent_at = ? WHERE id = ?", (txn.now, message.channel["id"]))
        return
    attempt = message.rows[0]["attempts"] + 1
    retry_at = txn.now + min(BACKOFF_BASE_SECONDS * 1000 * 2 ** (attempt - 1), 3_600_000)
    txn.execute(f"UPDATE notify_outbox SET attempts = ?, next_at = ?,"
                f" gave_up_at = CASE WHEN ? >= {NOTIFY_MAX_ATTEMPTS} OR event = 'test' THEN ? END WHERE id IN ({marks})",
                (attempt, retry_at, attempt, txn.now, *ids))
    txn.execute("UPDATE notify_channels SET last_error = ?, last_error_at = ?, failures = failures + 1 WHERE id = ?",
                (error[:300], txn.now, message.channel["id"]))


# -- outputs held: a restored copy sends nothing until the operator says so --------------------------------

# A held sender looks again this often: a resume may come from another process (the CLI), which wakes nothing.
OUTPUTS_HELD_RECHECK_MS = 1_000
BACKUP_HOLD_REASON = "a copy made by backup: nothing goes out until `outputs resume` (see docs/operations.md)"


def outputs_held(txn: Txn) -> dict | None:
    """The hold, when nothing may go out now ({since, reason}), else None: the senders' guard, read in the
    transaction that picks what to send, and /healthz's."""
    hold = txn.one("SELECT since, reason FROM outputs_hold")
    return None if hold is None else {"since": iso(hold["since"]), "reason": hold["reason"]}


def outputs_status(txn: Txn) -> dict:
    """Whether outputs are held (since when, why) and what waits to go out: forge outputs, status comments due,
    notifications."""
    hold = outputs_held(txn)
    waiting = {
        "forge_outputs": txn.one("SELECT count(*) FROM forge_outputs WHERE state = 'pending'")[0],
        "status_comments": txn.one("SELECT count(*) FROM forge_status WHERE due_at IS NOT NULL")[0],
        "notifications": txn.one("SELECT count(*) FROM notify_outbox WHERE sent_at IS NULL AND gave_up_at IS NULL"
                                 " AND event <> 'test'")[0]}
    return {"held": hold is not None, "since": hold["since"] if hold else None,
            "reason": hold["reason"] if hold else None, "waiting": waiting}


def hold_outputs(txn: Txn, reason: str | None) -> dict:
    """Hold everything that goes out. Held again, the first hold's time stays, and its reason unless a new one
    is given."""
    reason = " ".join((reason or "").split())[:512] or None
    txn.execute("INSERT INTO outputs_hold (scope, since, reason) VALUES ('all', ?, ?)"
                " ON CONFLICT (scope) DO UPDATE SET reason = coalesce(?, outputs_hold.reason)",
                (txn.now, reason or "held by the operator", reason))
    txn.logs.append(f"outputs held: {reason or 'again'}")
    return outputs_status(txn)


def resume_outputs(txn: Txn) -> dict:
    """Let what waited, and what comes, go out."""
    if txn.execute("DELETE FROM outputs_hold").rowcount:
        txn.logs.append("outputs resumed: what waited goes out now")
    return outputs_status(txn)
