"""Forge outputs: what a worker holding a lease asks the server to write on its work order's issue (labels,
comments), checked and queued in the transaction of the worker's report; and the status comments' marks."""

from __future__ import annotations

import fnmatch
import json
import re
import sqlite3
from collections.abc import Sequence

from switchboard.configuration import ApiError
from switchboard.crypto import new_id
from switchboard.database import Txn
from switchboard.models import AddLabels, CommentOutput, RemoveLabels
from switchboard.store.todos import output_view, stored_json

# A status comment is edited at most this often (SPEC 16).
STATUS_EDIT_MS = 10_000
MARKER_PREFIX = "<!-- switchboard:"
# A repository as outputs may name it: owner/name, neither `.` nor `..`.
_REPO = re.compile(r"^(?!\.{1,2}/)[A-Za-z0-9_.-]+/(?!\.{1,2}$)[A-Za-z0-9_.-]+$")
# Credentials of the shapes we know, by what they are (the name is all a refusal says of them).
CREDENTIAL_SHAPES: tuple[tuple[str, re.Pattern], ...] = tuple((name, re.compile(pattern)) for name, pattern in (
    ("a GitHub token", r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{20,})"),
    ("a GitLab token", r"\bglpat-[A-Za-z0-9_-]{20,}"),
    ("a private key", r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----"),
    ("an AWS access key", r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    ("an AWS secret key", r"(?i)aws_?secret_?access_?key\W{0,4}[A-Za-z0-9/+]{40}"),
    ("a Google API key", r"\bAIza[0-9A-Za-z_-]{35}"),
    ("a Slack token", r"\bxox[abposr]-[A-Za-z0-9-]{10,}"),
    ("a Slack webhook URL", r"hooks\.slack\.com/services/T[A-Za-z0-9_]+/[A-Za-z0-9_]+/[A-Za-z0-9_]+"),
    ("a Stripe key", r"\b(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{16,}"),
    ("a signing secret", r"\bwhsec_[A-Za-z0-9+/=_-]{16,}"),
    ("a model provider's API key", r"\bsk-[A-Za-z0-9_-]{20,}"),
    ("a Switchboard token", r"\bsb[hks]_[A-Za-z0-9_-]{40,}"),
    ("a JSON Web Token", r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
    ("a Gitea or other hex token", r"(?i)\b(?:token|bearer|authorization|password|secret)\W{0,4}[0-9a-f]{40}\b"),
))
# An @mention that would ping someone (GitHub's and Gitea's `@name` and `@org/team`): not inside a word or an
# e-mail address. Written `@` + U+2060 (word joiner), it shows the same and pings nobody.
_MENTION = re.compile(r"(?<![A-Za-z0-9_.+\-/`@])@(?=[A-Za-z0-9])")
WORD_JOINER = "\u2060"


def neutralize_mentions(text: str) -> str:
    return _MENTION.sub("@" + WORD_JOINER, text)


def credential_in(text: str) -> str | None:
    """What kind of credential `text` holds, by shape, or None."""
    return next((name for name, shape in CREDENTIAL_SHAPES if shape.search(text)), None)


def covers(repos: Sequence[str], repo: str) -> bool:
    """Whether a connection's `repos` (owners `acme/`, repositories `acme/site`) cover `repo`; forges compare
    names case-insensitively."""
    repo = repo.lower()
    return any(repo.startswith(entry.lower()) if entry.endswith("/") else repo == entry.lower() for entry in repos)


def _refused(index: int, why: str) -> ApiError:
    return ApiError("invalid_argument", f"outputs[{index}]: {why}")


def _connection_for(txn: Txn, order: dict | None) -> tuple[sqlite3.Row, dict]:
    """The connection and policy the todo's work order may write through, and its issue; or a refusal."""
    subject = (order or {}).get("subject") or {}
    if not order or order.get("verified") is not True or subject.get("type") != "issue":
        raise _refused(0, "the todo's work order names no verified issue, so nothing may be written to a forge")
    repo, number = subject.get("repo"), subject.get("number")
    if not isinstance(repo, str) or not _REPO.match(repo) or not isinstance(number, int) or number <= 0:
        raise _refused(0, "the work order's issue is not a repository and number outputs can name")
    row = txn.one("SELECT c.*, wc.policy FROM webhook_connections wc JOIN forge_connections c ON c.id ="
                  " wc.connection_id WHERE wc.webhook_id = ?", (order.get("webhook_id"),))
    if row is None:
        raise _refused(0, f"the work order's webhook {order.get('webhook_id')} has no forge connection")
    if row["kind"] != subject.get("provider"):
        raise _refused(0, f"the webhook's connection {row['id']} is {row['kind']}, the issue is on"
                          f" {subject.get('provider')}")
    if not covers(json.loads(row["repos"]), repo):
        raise _refused(0, f"connection {row['id']} does not cover {repo}")
    return row, subject


def accept_outputs(txn: Txn, todo: sqlite3.Row, outputs: Sequence[AddLabels | RemoveLabels | CommentOutput],
                   ) -> list[dict]:
    """Check each output against the todo's work order and its webhook's connection and policy, in the verb's
    transaction, and queue them for the forge sender. One refused output refuses them all (400 naming it), and
    the verb with them. The target is the work order's issue, always."""
    if not outputs:
        return []
    connection, subject = _connection_for(txn, stored_json(todo["work_order"]))
    policy = json.loads(connection["policy"])
    txn.lock_key("forge_outputs", todo["id"])  # the counts read below hold until the new rows are written
    used = {"add_labels": 0, "remove_labels": 0, "comment": 0}
    for row in txn.all("SELECT type, labels FROM forge_outputs WHERE todo_id = ?", (todo["id"],)):
        used[row["type"]] += len(json.loads(row["labels"])) if row["labels"] else 1
    rows = []
    for index, output in enumerate(outputs):
        rule = policy.get(output.type)
        if rule is None:
            raise _refused(index, f"the webhook's output policy does not allow {output.type}")
        if isinstance(output, CommentOutput):
            size = len(output.body.encode("utf-8", "surrogatepass"))
            if size > rule["max_bytes"]:
                raise _refused(index, f"the comment is {size} bytes, over the policy's max_bytes of {rule['max_bytes']}")
            if used["comment"] + 1 > rule["max"]:
                raise _refused(index, f"over the policy's max of {rule['max']} comments per todo")
            found = credential_in(output.body)
            if found:
                raise _refused(index, f"the comment holds what looks like {found}; it is never posted")
            if MARKER_PREFIX in output.body:
                raise _refused(index, "the comment carries a Switchboard marker (<!-- switchboard:…), which only the"
                                      " server writes")
            used["comment"] += 1
            rows.append((output.type, None, neutralize_mentions(output.body)))
            continue
        labels = list(dict.fromkeys(output.labels))
        outside = [label for label in labels if not any(fnmatch.fnmatchcase(label.lower(), glob.lower())
                                                        for glob in rule["allow"])]
        if outside:
            raise _refused(index, f"label {outside[0]!r} is outside the policy's {output.type} allow list"
                                  f" ({', '.join(rule['allow'])})")
        if used[output.type] + len(labels) > rule["max"]:
            raise _refused(index, f"over the policy's max of {rule['max']} labels per todo for {output.type}")
        used[output.type] += len(labels)
        rows.append((output.type, json.dumps(labels), None))
    made = []
    for kind, labels, body in rows:
        output_id = new_id("out")
        txn.execute("INSERT INTO forge_outputs (id, todo_id, connection_id, subject_key, repo, number, type, labels,"
                    " body, state, next_at, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
                    (output_id, todo["id"], connection["id"], todo["subject_key"] or
                     f"{subject['provider']}:{subject['repo']}#{subject['number']}", subject["repo"],
                     subject["number"], kind, labels, body, txn.now, txn.now))
        made.append(output_id)
        txn.counts[f"output_accepted:{kind}"] += 1
    txn.outbox = True  # the forge sender wakes after commit, with the notifier
    txn.logs.append(f"todo {todo['id']}: {len(made)} forge outputs queued for {subject['repo']}#{subject['number']}")
    return [output_view(r) for r in txn.all(f"SELECT * FROM forge_outputs WHERE id IN ({', '.join('?' * len(made))})"
                                            f" ORDER BY created_at, id", made)]


def mark_status(txn: Txn, todo_id: str, subject_key: str | None, event_id: str | None) -> None:
    """A todo about an issue changed: when its webhook mirrors through a connection that covers the issue, the
    issue's status comment is due again, at least STATUS_EDIT_MS after its last edit. Only verified deliveries'
    todos are mirrored (an unverified body could name any issue)."""
    if subject_key is None or event_id is None:
        return
    row = txn.one("SELECT c.id, c.kind, c.repos FROM events e JOIN webhook_connections wc ON wc.webhook_id ="
                  " e.webhook_id JOIN forge_connections c ON c.id = wc.connection_id"
                  " WHERE e.id = ? AND wc.mirror = 1 AND e.verified = 1", (event_id,))
    if row is None:
        return
    provider, _, rest = subject_key.partition(":")
    repo, _, number = rest.rpartition("#")
    if provider != row["kind"] or not number.isdigit() or not _REPO.match(repo) or not covers(
            json.loads(row["repos"]), repo):
        return
    txn.execute("INSERT INTO forge_status (connection_id, subject_key, repo, number, due_at) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (connection_id, subject_key) DO UPDATE SET version = forge_status.version + 1,"
                " due_at = CASE WHEN forge_status.due_at IS NOT NULL THEN forge_status.due_at"
                " WHEN forge_status.edited_at IS NOT NULL AND forge_status.edited_at + ? > excluded.due_at"
                " THEN forge_status.edited_at + ?"
                " ELSE excluded.due_at END",
                (row["id"], subject_key, repo, int(number), txn.now, STATUS_EDIT_MS, STATUS_EDIT_MS))
    txn.outbox = True
    txn.logs.append(f"todo {todo_id}: status comment of {subject_key} due")
