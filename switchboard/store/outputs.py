"""Forge outputs: what a worker holding a lease asks the server to write on its work order's issue (labels,
comments), checked and queued in the transaction of the worker's report; and the status comments' marks."""

from __future__ import annotations

import fnmatch
import html
import json
import re
import sqlite3
from collections.abc import Sequence

from switchboard.configuration import ApiError
from switchboard.crypto import new_id, token_hash
from switchboard.database import Txn
from switchboard.models import MAX_COMMENT_BYTES, AddLabels, CommentOutput, RemoveLabels
from switchboard.store.todos import output_view, stored_json
from switchboard.tracing import new_span_id, parse_traceparent, traceparent

# A status comment is edited at most this often (SPEC 16).
STATUS_EDIT_MS = 10_000
MARKER_PREFIX = "<!-- switchboard:"
# A repository as outputs may name it: owner/name, neither `.` nor `..`.
_REPO = re.compile(r"^(?!\.{1,2}/)[A-Za-z0-9_.-]+/(?!\.{1,2}$)[A-Za-z0-9_.-]+$")
# Credentials of the shapes we know, by what they are (the name is all a refusal says of them). A prefix that
# names a token is matched wherever it starts, even glued to a word by `_` or `-` (`key_ghp_…`): only a letter or
# digit before it makes it part of another word.
_START = r"(?<![A-Za-z0-9])"
CREDENTIAL_SHAPES: tuple[tuple[str, re.Pattern], ...] = tuple((name, re.compile(pattern)) for name, pattern in (
    ("a GitHub token", rf"{_START}(?:gh[pousr]_[A-Za-z0-9]{{30,}}|github_pat_[A-Za-z0-9_]{{20,}})"),
    ("a GitLab token", rf"{_START}glpat-[A-Za-z0-9_-]{{20,}}"),
    ("a private key", r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----"),
    ("an AWS access key", rf"{_START}(?:AKIA|ASIA)[0-9A-Z]{{16}}(?![A-Za-z0-9])"),
    ("an AWS secret key", r"(?i)aws_?secret_?access_?key\W{0,4}[A-Za-z0-9/+]{40}"),
    ("a Google API key", rf"{_START}AIza[0-9A-Za-z_-]{{35}}"),
    ("a Slack token", rf"{_START}xox[abposr]-[A-Za-z0-9-]{{10,}}"),
    ("a Slack webhook URL", r"hooks\.slack\.com/services/T[A-Za-z0-9_]+/[A-Za-z0-9_]+/[A-Za-z0-9_]+"),
    ("a Stripe key", rf"{_START}(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{{16,}}"),
    ("a signing secret", rf"{_START}whsec_[A-Za-z0-9+/=_-]{{16,}}"),
    ("a model provider's API key", rf"{_START}sk-[A-Za-z0-9_-]{{20,}}"),
    ("a Switchboard token", rf"{_START}sb[hks]_[A-Za-z0-9_-]{{40,}}"),
    ("a JSON Web Token", rf"{_START}eyJ[A-Za-z0-9_-]{{8,}}\.eyJ[A-Za-z0-9_-]{{8,}}\.[A-Za-z0-9_-]{{8,}}"),
    # A name ending in one of these words (`GITEA_TOKEN=`, `access_token:`, `Authorization: token `), then 40 hex.
    ("a Gitea or other hex token", r"(?i)(?:token|bearer|authorization|password|passwd|secret|api_?key)"
                                   r"[\W_]{0,12}(?:(?:token|bearer)\s+)?[0-9a-f]{40}(?![0-9a-f])"),
))
# What a forge renders as nothing: HTML comments, tags (their text stays), and the characters Unicode says to
# ignore when shown (format characters such as U+200B and the soft hyphen, variation selectors, fillers).
_HTML_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_HTML_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9-]*(?:\s[^<>]*)?/?>")
_MARKDOWN_ESCAPE = re.compile(r"\\([!-/:-@\[-`{-~])")
_IGNORABLE = re.compile("[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e"
                        "\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8\U0001bca0-\U0001bca3"
                        "\U0001d173-\U0001d17a\U000e0000-\U000e0fff]")
# The server's own tokens, by shape: endpoint and human tokens (`sbk_`/`sbh_` and 43 URL-safe characters), and a
# webhook's ingest URL token (22 URL-safe characters, no prefix; see store.webhooks and crypto.new_token).
_OWN_TOKEN = re.compile(r"(?=(sb[hk]_[A-Za-z0-9_-]{43}))")
_URL_SAFE_RUN = re.compile(r"[A-Za-z0-9_-]{22,}")
INGEST_TOKEN_CHARS = 22
# An @mention pings on GitHub after anything but an ASCII letter or digit (html-pipeline's MentionFilter: `^` or
# `\W`, on each text node, so after markup too: `_x_@alice`, `-@alice`, `+@alice`), and on Gitea after a space,
# `(` or `[` (modules/references: mentionPattern). An `@` written as an HTML entity (`&#64;`, `&#x40;`,
# `&commat;`) renders as `@` and pings the same. Each of them gets U+2060 (word joiner) after it: it shows the same
# and pings nobody. Inside a URL (autolinked, so never a mention) nothing is added, or the link would break.
_AT = r"(?:@|&#0*64;?|&#[xX]0*40;?|&commat;?)"
_MENTION = re.compile(rf"(?<![A-Za-z0-9])({_AT})(?=\S)")
_URL = re.compile(r"(https?://[^\s<>]*)")
WORD_JOINER = "\u2060"
# What both forges take as a comment's body: GitHub refuses one over 65,536 characters (422 "Body is too long");
# Gitea's API sets no limit (a LONGTEXT column). Counted in UTF-8 bytes, which are never fewer than characters.
FORGE_COMMENT_BYTES = MAX_COMMENT_BYTES
# What the sender adds to an output comment: a blank line and `<!-- switchboard:out_<20 hex> -->`.
OUTPUT_MARKER_BYTES = len(f"\n\n{MARKER_PREFIX}out_{'0' * 20} -->")


def neutralize_mentions(text: str) -> str:
    parts = _URL.split(text)
    return "".join(part if index % 2 else _MENTION.sub(lambda m: m.group(1) + WORD_JOINER, part)
                   for index, part in enumerate(parts))


def rendered_text(text: str) -> str:
    """`text` as a forge shows it, near enough to find what hides in its source: without HTML comments and tags,
    with entities and Markdown backslash escapes resolved, without invisible characters."""
    shown = _HTML_TAG.sub("", _HTML_COMMENT.sub("", text))
    return _IGNORABLE.sub("", _MARKDOWN_ESCAPE.sub(r"\1", html.unescape(shown)))


def credential_in(text: str) -> str | None:
    """What kind of credential `text` holds, by shape, in its source or as a forge shows it, or None."""
    shown = rendered_text(text)
    return next((name for name, shape in CREDENTIAL_SHAPES if shape.search(text) or shape.search(shown)), None)


def own_secret_in(txn: Txn, connection: sqlite3.Row, text: str) -> str | None:
    """Which of this server's own secrets `text` holds verbatim (in its source or as shown), or None: the token of
    the connection the comment goes through (sealed: opened here), a webhook's ingest URL token, an endpoint's or a
    human's token (only their hashes are stored: every token-shaped string in the text is hashed and looked up)."""
    views = (text, rendered_text(text))
    token = txn.unseal(connection["token_sealed"], connection["id"]).decode()
    if any(token.lower() in view.lower() for view in views):
        return "the forge connection's token"
    found = {match for view in views for match in _OWN_TOKEN.findall(view)}
    if found:
        hashes = [token_hash(candidate) for candidate in found]
        marks = ", ".join("?" * len(hashes))
        if txn.one(f"SELECT 1 FROM endpoints WHERE token_hash IN ({marks})", hashes):
            return "an endpoint's token"
        if txn.one(f"SELECT 1 FROM humans WHERE token_hash IN ({marks})", hashes):
            return "a human's token"
    ingest = {row["token_hash"] for row in txn.all("SELECT token_hash FROM webhooks")}
    for view in views:
        for run in _URL_SAFE_RUN.findall(view):
            for start in range(len(run) - INGEST_TOKEN_CHARS + 1):
                if token_hash(run[start:start + INGEST_TOKEN_CHARS]) in ingest:
                    return "a webhook's ingest URL token"
    return None


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
            # Sized as posted: with its mentions neutralised, and then with the marker the sender adds.
            body = neutralize_mentions(output.body)
            size = len(body.encode("utf-8", "surrogatepass"))
            if size > rule["max_bytes"]:
                raise _refused(index, f"the comment is {size} bytes, over the policy's max_bytes of {rule['max_bytes']}"
                                      " (as posted: each @mention gains an invisible U+2060)")
            if size + OUTPUT_MARKER_BYTES > FORGE_COMMENT_BYTES:
                raise _refused(index, f"the comment is {size} bytes and its marker {OUTPUT_MARKER_BYTES} more, over the"
                                      f" {FORGE_COMMENT_BYTES} bytes a forge takes in one comment")
            if used["comment"] + 1 > rule["max"]:
                raise _refused(index, f"over the policy's max of {rule['max']} comments per todo")
            found = credential_in(output.body)
            if found:
                raise _refused(index, f"the comment holds what looks like {found}; it is never posted")
            own = own_secret_in(txn, connection, output.body)
            if own:
                raise _refused(index, f"the comment holds this server's own secret ({own}); it is never posted")
            if MARKER_PREFIX in output.body:
                raise _refused(index, "the comment carries a Switchboard marker (<!-- switchboard:…), which only the"
                                      " server writes")
            used["comment"] += 1
            rows.append((output.type, None, body))
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
        # Its `forge` span, in the todo's trace (under the attempt that asked for it, found when it is sent).
        context = parse_traceparent(todo["traceparent"])
        txn.execute("INSERT INTO forge_outputs (id, todo_id, connection_id, subject_key, repo, number, type, labels,"
                    " body, state, next_at, created_at, traceparent)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?, ?)",
                    (output_id, todo["id"], connection["id"], todo["subject_key"] or
                     f"{subject['provider']}:{subject['repo']}#{subject['number']}", subject["repo"],
                     subject["number"], kind, labels, body, txn.now, txn.now,
                     traceparent(context[0], new_span_id()) if context else None))
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
    if subject_key is None or event_id is None or event_id in txn.unmirrored:
        return
    if not txn.all_usually_none("SELECT 1 FROM webhook_connections WHERE mirror = 1 LIMIT 1"):
        return  # nothing mirrors anywhere: no read about the event (Postgres: no round trip at all)
    rows = txn.all_usually_none("SELECT c.id, c.kind, c.repos FROM events e JOIN webhook_connections wc"
                                " ON wc.webhook_id = e.webhook_id JOIN forge_connections c ON c.id = wc.connection_id"
                                " WHERE e.id = ? AND wc.mirror = 1 AND e.verified = 1", (event_id,))
    if not rows:
        return
    row = rows[0]
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
