"""The forge sender's side of the store: which outputs and status comments are due (in order per subject), what a
status comment says, and how each send went."""

from __future__ import annotations

import json
import re
import sqlite3
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from switchboard.configuration import HOLD_QUEUE, TERMINAL_STATES, UNSAFE_TEXT, iso
from switchboard.database import Txn
from switchboard.store.admission import is_paused
from switchboard.store.outbox import OUTPUTS_HELD_RECHECK_MS, outputs_held
from switchboard.store.outputs import STATUS_EDIT_MS, neutralize_mentions

STATUS_MARKER = "<!-- switchboard:status -->"
# A transient failure is tried again after 5 s, doubling to at most 15 min; after this many tries it fails. A rate
# limit waits at least as long, so the tries span over an hour (backoff_ms's sum), the longest a forge's rate limit
# lasts (GitHub's hour).
OUTPUT_BACKOFF_MS = 5_000
OUTPUT_BACKOFF_CAP_MS = 15 * 60_000
OUTPUT_MAX_ATTEMPTS = 12
# A send (every request of it) ends within SEND_DEADLINE_MS. Its attempt is counted before its first request and
# the output (or status comment) leased to it until SEND_LEASE_MS: no other sender (a new leader) takes it while its
# request may still reach the forge, and the next one, after an unknown outcome, looks for its marker first.
SEND_DEADLINE_MS = 60_000
SEND_LEASE_MS = SEND_DEADLINE_MS + 15_000
# Worker and producer text a status comment quotes: at most this many characters each. The whole comment: at
# most STATUS_MAX_CHARS, under GitHub's 65,536 (a longer comment is refused, and would never be edited again).
STATUS_QUOTE_CHARS = 600
STATUS_MAX_CHARS = 60_000
# A pause or a resume brings due the status comments of at most this many of the lane's waiting todos.
LANE_MARK_TODOS = 200
_ASCII_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")


def output_marker(output_id: str) -> str:
    return f"<!-- switchboard:{output_id} -->"


@dataclass
class ForgeJob:
    """One send the forge sender makes: an output, a status comment (its text rendered when it was picked), or a
    command's reaction."""
    what: str  # "output", "status" or "reaction"
    key: str  # what it is busy with while in flight: the subject (outputs), the status comment (statuses)
    connection: dict  # id, kind, api_url, token_sealed, login
    repo: str
    number: int
    output: dict | None = None  # id, type, labels, body, attempts, created_at
    status: dict | None = None  # subject_key, version, comment_id, attempts, due_at, text
    reaction: dict | None = None  # event_id, comment_id, content, attempts


@dataclass
class SendOutcome:
    """How one send went: done (with the forge's id of what it made), retry at `retry_at`, or failed for good."""
    ok: bool
    error: str | None = None
    retry_at: int | None = None  # ms; None with an error: failed for good
    forge_id: str | None = None


def backoff_ms(attempt: int) -> int:
    return min(OUTPUT_BACKOFF_MS * 2 ** max(attempt - 1, 0), OUTPUT_BACKOFF_CAP_MS)


def _connection(row: sqlite3.Row) -> dict:
    return {"id": row["connection_id"], "kind": row["kind"], "api_url": row["api_url"],
            "token_sealed": row["token_sealed"], "login": row["login"]}


def due_forge_work(txn: Txn, busy: frozenset[str], room: int) -> tuple[list[ForgeJob], int | None]:
    """What to send now, at most `room` jobs: for each subject, its oldest pending output once due (the later ones
    wait for it: outputs reach an issue in the order they were accepted), each status comment that is due and
    each command's reaction; and when the next one falls due. Pending work is few rows, read through partial indexes."""
    if outputs_held(txn) is not None:  # a restored copy (outputs hold): nothing goes out until the operator resumes
        return [], txn.now + OUTPUTS_HELD_RECHECK_MS
    jobs: list[ForgeJob] = []
    # With each output, the span of the attempt that asked for it (its `forge` span's parent).
    heads = txn.all("SELECT o.*, c.kind, c.api_url, c.token_sealed, c.login, (SELECT a.span_id FROM attempts a"
                    " WHERE a.todo_id = o.todo_id AND a.claimed_at <= o.created_at ORDER BY a.seq DESC LIMIT 1)"
                    " AS attempt_span_id FROM forge_outputs o"
                    " JOIN forge_connections c ON c.id = o.connection_id WHERE o.state = 'pending'"
                    " AND NOT EXISTS (SELECT 1 FROM forge_outputs p WHERE p.state = 'pending'"
                    " AND p.subject_key = o.subject_key AND (p.created_at < o.created_at"
                    " OR (p.created_at = o.created_at AND p.id < o.id))) ORDER BY o.next_at, o.id")
    outputs, next_output = _due(heads, busy, txn.now, lambda row: f"output:{row['subject_key']}", "next_at")
    for key, row in outputs[:room]:
        jobs.append(ForgeJob("output", key, _connection(row), row["repo"], row["number"], output={
            "id": row["id"], "type": row["type"], "labels": row["labels"], "body": row["body"],
            "attempts": row["attempts"], "created_at": row["created_at"], "todo_id": row["todo_id"],
            "subject_key": row["subject_key"], "traceparent": row["traceparent"],
            "attempt_span_id": row["attempt_span_id"]}))
    statuses = txn.all("SELECT s.*, c.kind, c.api_url, c.token_sealed, c.login FROM forge_status s"
                       " JOIN forge_connections c ON c.id = s.connection_id WHERE s.due_at IS NOT NULL ORDER BY s.due_at")
    statuses, next_status = _due(statuses, busy, txn.now,
                                 lambda row: f"status:{row['connection_id']}:{row['subject_key']}", "due_at")
    for key, row in statuses[:room - len(jobs)]:
        jobs.append(ForgeJob("status", key, _connection(row), row["repo"], row["number"], status={
            "subject_key": row["subject_key"], "version": row["version"], "comment_id": row["comment_id"],
            "attempts": row["attempts"], "due_at": row["due_at"],
            "text": status_text(txn, row["connection_id"], row["subject_key"])}))
    reactions = txn.all("SELECT r.*, c.kind, c.api_url, c.token_sealed, c.login FROM forge_reactions r"
                        " JOIN forge_connections c ON c.id = r.connection_id WHERE r.state = 'pending'"
                        " ORDER BY r.next_at, r.event_id LIMIT ?", (max(room, 1) + len(busy),))
    reactions, next_reaction = _due(reactions, busy, txn.now, lambda row: f"reaction:{row['event_id']}", "next_at")
    for key, row in reactions[:room - len(jobs)]:
        jobs.append(ForgeJob("reaction", key, _connection(row), row["repo"], 0, reaction={
            "event_id": row["event_id"], "comment_id": row["comment_id"], "content": row["content"],
            "attempts": row["attempts"]}))
    later = [moment for moment in (next_output, next_status, next_reaction) if moment is not None]
    return jobs, min(later) if later else None


def _due(rows: list[sqlite3.Row], busy: frozenset[str], now: int, key_of: Callable[[sqlite3.Row], str],
         due_column: str) -> tuple[list[tuple[str, sqlite3.Row]], int | None]:
    """Of one kind of send's rows, those due now that no send is busy with (with their busy keys), in order, and
    the earliest due moment still to come."""
    due, later = [], None
    for row in rows:
        key = key_of(row)
        if key in busy:
            continue
        if row[due_column] > now:
            later = row[due_column] if later is None else min(later, row[due_column])
            continue
        due.append((key, row))
    return due, later


def begin_reaction(txn: Txn, event_id: str, attempts: int) -> bool:
    """begin_output's lease, for a command's reaction."""
    return txn.execute("UPDATE forge_reactions SET attempts = attempts + 1, next_at = ? WHERE event_id = ? AND state ="
                       " 'pending' AND attempts = ? AND next_at <= ?",
                       (txn.now + SEND_LEASE_MS, event_id, attempts, txn.now)).rowcount == 1


def record_reaction(txn: Txn, event_id: str, attempt: int, outcome: SendOutcome) -> str:
    """record_output's bookkeeping, for a command's reaction: sent, tried again later, or failed for good."""
    txn.lock("forge_reactions", "event_id = ?", (event_id,))
    row = txn.one("SELECT * FROM forge_reactions WHERE event_id = ?", (event_id,))
    if row is None or row["state"] != "pending" or row["attempts"] != attempt:
        return row["state"] if row is not None else "failed"
    if outcome.ok:
        txn.execute("UPDATE forge_reactions SET state = 'sent', sent_at = ?, error = NULL WHERE event_id = ?",
                    (txn.now, event_id))
        txn.logs.append(f"reaction {row['content']} on comment {row['comment_id']} of {row['repo']} sent")
        return "sent"
    error = (outcome.error or "failed")[:500]
    if outcome.retry_at is not None and row["attempts"] < OUTPUT_MAX_ATTEMPTS:
        txn.execute("UPDATE forge_reactions SET next_at = ?, error = ? WHERE event_id = ?",
                    (max(outcome.retry_at, txn.now), error, event_id))
        return "pending"
    if outcome.retry_at is not None:
        error = f"gave up after {row['attempts']} attempts: {error}"[:500]
    txn.execute("UPDATE forge_reactions SET state = 'failed', error = ? WHERE event_id = ?", (error, event_id))
    txn.logs.append(f"reaction on comment {row['comment_id']} of {row['repo']} failed: {error}")
    return "failed"


def begin_output(txn: Txn, output_id: str, attempts: int) -> bool:
    """Before a send's first request: its attempt counted and the output leased to it (see SEND_LEASE_MS), in one
    statement that re-checks it is still pending, due and at the attempt the sender read. False: another sender
    began it first (or it is sent, failed, or gone), and this one sends nothing."""
    return txn.execute("UPDATE forge_outputs SET attempts = attempts + 1, next_at = ? WHERE id = ? AND state ="
                       " 'pending' AND attempts = ? AND next_at <= ?",
                       (txn.now + SEND_LEASE_MS, output_id, attempts, txn.now)).rowcount == 1


def record_output(txn: Txn, output_id: str, attempt: int, outcome: SendOutcome) -> str:
    """After a send begun as `attempt` (begin_output): the output is sent, waits to be tried again, or failed (with
    the forge's word). Returns its state. A send overtaken by a later attempt changes nothing."""
    txn.lock("forge_outputs", "id = ?", (output_id,))
    row = txn.one("SELECT * FROM forge_outputs WHERE id = ?", (output_id,))
    if row is None or row["state"] != "pending" or row["attempts"] != attempt:
        return row["state"] if row is not None else "failed"
    if outcome.ok:
        txn.execute("UPDATE forge_outputs SET state = 'sent', sent_at = ?, forge_id = ?, error = NULL WHERE id = ?",
                    (txn.now, outcome.forge_id, output_id))
        txn.execute("UPDATE forge_connections SET last_used_at = ? WHERE id = ?", (txn.now, row["connection_id"]))
        txn.logs.append(f"forge output {output_id} ({row['type']}) sent to {row['repo']}#{row['number']}")
        return "sent"
    attempts = row["attempts"]
    error = (outcome.error or "failed")[:500]
    if outcome.retry_at is not None and attempts < OUTPUT_MAX_ATTEMPTS:
        txn.execute("UPDATE forge_outputs SET next_at = ?, error = ? WHERE id = ?",
                    (max(outcome.retry_at, txn.now), error, output_id))
        return "pending"
    if outcome.retry_at is not None:
        error = f"gave up after {attempts} attempts: {error}"[:500]
    txn.execute("UPDATE forge_outputs SET state = 'failed', error = ? WHERE id = ?", (error, output_id))
    txn.execute("UPDATE forge_connections SET last_error = ?, last_error_at = ? WHERE id = ?",
                (error[:300], txn.now, row["connection_id"]))
    txn.logs.append(f"forge output {output_id} ({row['type']}) to {row['repo']}#{row['number']} failed: {error}")
    return "failed"


def begin_status(txn: Txn, connection_id: str, subject_key: str, due_at: int) -> bool:
    """Before a status comment's send: leased to it (see SEND_LEASE_MS; a change meanwhile keeps the lease, as
    mark_status leaves a due_at standing), re-checked in the statement. False: another sender began it first."""
    return txn.execute("UPDATE forge_status SET due_at = ? WHERE connection_id = ? AND subject_key = ? AND due_at = ?",
                       (txn.now + SEND_LEASE_MS, connection_id, subject_key, due_at)).rowcount == 1


def record_status(txn: Txn, connection_id: str, subject_key: str, shown: int, outcome: SendOutcome) -> None:
    """After a status comment's send: the version it showed (and its comment's id), and whether it is due again
    (changed meanwhile: at least STATUS_EDIT_MS after this edit), or tried again, or left until the next change."""
    txn.lock("forge_status", "connection_id = ? AND subject_key = ?", (connection_id, subject_key))
    row = txn.one("SELECT * FROM forge_status WHERE connection_id = ? AND subject_key = ?", (connection_id, subject_key))
    if row is None:
        return
    if outcome.ok:
        due = None if row["version"] == shown else txn.now + STATUS_EDIT_MS
        txn.execute("UPDATE forge_status SET comment_id = ?, shown_version = ?, edited_at = ?, edits = edits + 1,"
                    " attempts = 0, error = NULL, due_at = ? WHERE connection_id = ? AND subject_key = ?",
                    (outcome.forge_id or row["comment_id"], shown, txn.now, due, connection_id, subject_key))
        txn.execute("UPDATE forge_connections SET last_used_at = ? WHERE id = ?", (txn.now, connection_id))
        return
    attempts = row["attempts"] + 1
    retry = outcome.retry_at is not None and attempts < OUTPUT_MAX_ATTEMPTS
    txn.execute("UPDATE forge_status SET attempts = ?, error = ?, due_at = ? WHERE connection_id = ? AND subject_key = ?",
                (0 if not retry else attempts, (outcome.error or "failed")[:500],
                 max(outcome.retry_at, txn.now) if retry else None, connection_id, subject_key))
    if not retry:
        txn.logs.append(f"status comment of {subject_key} not written: {outcome.error}")


def lane_changed(txn: Txn, endpoint_id: str, queue: str) -> None:
    """A lane was paused or resumed: the status comments that tell of its waiting todos are due again (at least
    STATUS_EDIT_MS after their last edit, as mark_status makes them), to say so: those of its newest
    LANE_MARK_TODOS waiting todos (read through todos_by_state, so a pause costs the same however long the lane);
    an older one's comment says so at its issue's next change."""
    shown = {(row["connection_id"], row["subject_key"]) for row in txn.all(
        "SELECT wc.connection_id, t.subject_key FROM (SELECT event_id, subject_key FROM todos WHERE endpoint_id = ?"
        " AND state = 'pending' AND queue = ? ORDER BY created_at DESC LIMIT ?) t JOIN events e ON e.id = t.event_id"
        " JOIN webhook_connections wc ON wc.webhook_id = e.webhook_id"
        " WHERE t.subject_key IS NOT NULL AND wc.mirror = 1 AND e.verified = 1", (endpoint_id, queue, LANE_MARK_TODOS))}
    for connection_id, subject_key in shown:
        marked = txn.execute(
            "UPDATE forge_status SET version = version + 1, due_at = CASE WHEN due_at IS NOT NULL THEN due_at"
            " WHEN edited_at IS NOT NULL AND edited_at + ? > ? THEN edited_at + ? ELSE ? END"
            " WHERE connection_id = ? AND subject_key = ?",
            (STATUS_EDIT_MS, txn.now, STATUS_EDIT_MS, txn.now, connection_id, subject_key)).rowcount
        txn.outbox = txn.outbox or marked == 1


# -- what a status comment says -------------------------------------------------------------------------------

def quoted_markdown(text: str | None, limit: int = STATUS_QUOTE_CHARS) -> str:
    """Worker or producer text as a comment quotes it: no control or bidirectional characters, every ASCII
    punctuation character backslash-escaped (so it makes no link, image, HTML, heading or marker), @mentions that
    ping nobody, cut to `limit`, as a block quote."""
    clean = str(text or "")
    clean = clean if len(clean) <= limit else clean[:limit - 1] + "…"
    lines = [neutralize_mentions(_ASCII_PUNCTUATION.sub(r"\\\1", re.sub(f"[{UNSAFE_TEXT}]", " ", line)))
             for line in clean.replace("\r\n", "\n").split("\n")]
    return "\n".join(f"  > {line}" if line.strip() else "  >" for line in lines)


def inline_markdown(text: str | None) -> str:
    """A short name (a lane, a worker's endpoint) inline: one line, escaped like quoted_markdown, at most 80."""
    clean = " ".join(re.sub(f"[{UNSAFE_TEXT}]", " ", str(text or "")).split())[:80]
    return neutralize_mentions(_ASCII_PUNCTUATION.sub(r"\\\1", clean))


def _when(ms: int | None) -> str:
    return (iso(ms) or "").replace("T", " ")[:16] + " UTC" if ms else ""


def _entry(todo: sqlite3.Row, now: int) -> list[str]:
    """One todo's lines in a status comment, in a reader's words. The worker is named by its endpoint's name (which
    its human chose), never by the claimant a worker sends (by default its host's name and process id)."""
    lane = f"**{inline_markdown(todo['queue'])}**"
    worker = f" by {inline_markdown(todo['worker'])}" if todo["worker"] else ""
    state = todo["state"]
    if state == "claimed":
        return [f"- {lane}: being worked on{worker} since {_when(todo['claimed_at'])}"]
    if state == "needs_input":
        return [f"- {lane}: waiting for an answer to its question:", quoted_markdown(todo["state_reason"])]
    if state == "review":
        return [f"- {lane}: done{worker}, waiting for review:", quoted_markdown(todo["state_reason"])]
    if state == "done":
        how = f" ({todo['outcome'].replace('_', ' ')})" if todo["outcome"] != "completed" else ""
        when = f", {_when(todo['ended_at'] or todo['updated_at'])}"
        return [f"- {lane}: done{how}{worker}{when}" + (":" if todo["summary"] else "")] + (
            [quoted_markdown(todo["summary"])] if todo["summary"] else [])
    if state == "failed":
        then = "; it waits for a person to decide what next" if todo["dead_letter"] else ""
        return [f"- {lane}: failed after {todo['attempt']} of {todo['max_attempts']} tries{then}:",
                quoted_markdown(todo["last_error"])]
    if state == "blocked":
        return [f"- {lane}: blocked:", quoted_markdown(todo["state_reason"])]
    if state == "pending" and todo["paused_at"] is not None and is_paused(todo, now):
        until = f"until {_when(todo['paused_until'])}" if todo["paused_until"] else "until someone resumes it"
        return [f"- {lane}: waiting; the lane is paused {until}" + (":" if todo["paused_reason"] else "")] + (
            [quoted_markdown(todo["paused_reason"])] if todo["paused_reason"] else [])
    if state == "pending":
        again = f" (try {todo['attempt'] + 1})" if todo["attempt"] else ""
        return [f"- {lane}: waiting for a worker{again}"]
    return [f"- {lane}: {state.replace('_', ' ')}"]


# The states a todo waits on a human in, and what a commander replies to each (forge_control's verbs).
_REPLIES = {"needs_input": ("/answer{todo} …",), "review": ("/approve{todo}", "/changes{todo} …"),
            "blocked": ("/resume{todo}",), "failed": ("/retry{todo}",), "deferred": ("/undefer{todo}",)}


def _commanded(todo: sqlite3.Row) -> bool:
    return bool(todo["commands"]) and bool(json.loads(todo["commands"]).get("logins"))


def _reply_verb(todo: sqlite3.Row) -> str | None:
    if todo["state"] == "failed" and not todo["dead_letter"]:
        return None
    return todo["state"] if todo["state"] in _REPLIES else None


def _reply(todo: sqlite3.Row, waiting: Counter) -> list[str]:
    """The command a commander copies to act on a waiting todo, naming the todo when another waits the same way."""
    verb = _reply_verb(todo)
    if verb is None or not _commanded(todo):
        return []
    name = f" {todo['id']}" if waiting[verb] > 1 else ""
    return ["  reply " + " or ".join(f"`{form.format(todo=name)}`" for form in _REPLIES[verb])]


def status_text(txn: Txn, connection_id: str, subject_key: str) -> str:
    """The status comment for one issue: the server's words about the work on it (each todo the mirroring
    webhooks of this connection made about it: lane, where it is, the question, the summary), with any worker or
    producer text quoted and escaped. Deliveries held for a human (the trust gate's, the rules') are not work and
    are not told. At most STATUS_MAX_CHARS: unfinished work first, then the newest, in full; the rest folded into
    one line that counts them."""
    todos = txn.all(
        "SELECT t.id, t.queue, t.state, t.outcome, t.state_reason, t.last_error, t.dead_letter, t.attempt,"
        " t.max_attempts, t.updated_at, a.summary, a.claimed_at, a.ended_at, ep.name AS worker, wc.commands,"
        " qc.paused_at, qc.paused_until, qc.paused_reason"
        " FROM todos t JOIN events e ON e.id = t.event_id JOIN webhook_connections wc ON wc.webhook_id = e.webhook_id"
        " LEFT JOIN attempts a ON a.todo_id = t.id AND a.seq = (SELECT max(seq) FROM attempts x WHERE x.todo_id = t.id)"
        " LEFT JOIN endpoints ep ON ep.id = a.endpoint_id"
        " LEFT JOIN queue_controls qc ON qc.endpoint_id = t.endpoint_id AND qc.queue = t.queue"
        " WHERE t.subject_key = ? AND wc.connection_id = ? AND wc.mirror = 1 AND e.verified = 1"
        " AND t.queue <> ? AND t.state <> 'quarantined'"
        " ORDER BY t.created_at, t.id", (subject_key, connection_id, HOLD_QUEUE))
    head = [STATUS_MARKER, "**Switchboard** · the work on this issue", ""]
    pulls = txn.all("SELECT l.pull_key FROM subject_links l JOIN forge_connections c ON c.human_id = l.human_id"
                    " WHERE c.id = ? AND l.issue_key = ? ORDER BY l.linked_at, l.pull_key LIMIT 10",
                    (connection_id, subject_key))
    head += [f"- pull request #{row['pull_key'].rpartition('#')[2]} closes this issue" for row in pulls] + (
        [""] if pulls else [])
    foot = ["", f"<sub>Written by Switchboard; updated {_when(txn.now)}.</sub>"]
    waiting = Counter(_reply_verb(todo) for todo in todos if _commanded(todo))
    entries = [("\n".join(_entry(todo, txn.now) + _reply(todo, waiting)), todo["state"]) for todo in todos]
    # Room for the fold's line (a few counts) besides the head and foot.
    room = STATUS_MAX_CHARS - len("\n".join(head + foot)) - 200
    shown: set[int] = set()
    for index in sorted(range(len(entries)), key=lambda i: (entries[i][1] in TERMINAL_STATES, -i)):
        if len(entries[index][0]) + 1 <= room:
            shown.add(index)
            room -= len(entries[index][0]) + 1
    folded = Counter(state for index, (_, state) in enumerate(entries) if index not in shown)
    lines = list(head)
    if folded:
        counts = ", ".join(f"{n} {state.replace('_', ' ')}" for state, n in sorted(folded.items()))
        lines.append(f"- {sum(folded.values())} older entries are folded to fit: {counts}")
    lines += [text for index, (text, _) in enumerate(entries) if index in shown]
    if not todos:
        lines.append("- nothing is open for this issue")
    return "\n".join(lines + foot)


def pending_outputs(txn: Txn) -> dict[str, int]:
    """Outputs not yet sent, by type (for /metrics): few rows, through forge_outputs_pending."""
    counts = {"add_labels": 0, "remove_labels": 0, "comment": 0}
    counts.update({r["type"]: r["n"] for r in txn.all("SELECT type, count(*) AS n FROM forge_outputs"
                                                       " WHERE state = 'pending' GROUP BY type")})
    counts["reaction"] = txn.one("SELECT count(*) AS n FROM forge_reactions WHERE state = 'pending'")["n"]
    return counts
