"""The forge steers the work: a commander's command in a comment (`/answer`, `/approve`, ...), a commander closing
the issue, and the pull request that says it closes an issue (the link, the merge that approves, the review that
asks for changes). Each acts through the human's own actions (human_actions), as the webhook's human, inside the
transaction that records the delivery: a redelivery is a duplicate and acts no more.

Who may steer is the webhook's connection's `commands.logins` (nobody until the human names them); a command is
read only from a verified, signed delivery, acts only on the todos that webhook made for its own human about the
subject the comment was written on, and is acknowledged on its comment by a reaction (forge_reactions)."""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from pydantic import ValidationError

from switchboard.configuration import TERMINAL_STATES, ApiError
from switchboard.database import Txn
from switchboard.envelope import ASCII_FOLD, forge_view
from switchboard.models import Answer, Cancel, Defer, HumanNote, RequestChanges
from switchboard.payload import value_at
from switchboard.store import human_actions
from switchboard.store.outputs import MARKER_PREFIX, covers
from switchboard.store.principals import Principal
from switchboard.store.subjects import parse_subject_key

# Each verb: the states a todo it acts on is in.
VERB_STATES: dict[str, tuple[str, ...]] = {
    "answer": ("needs_input",), "approve": ("review",), "changes": ("review",), "retry": ("failed",),
    "resume": ("blocked",), "cancel": human_actions.ACTION_STATES["cancel"], "defer": ("pending",),
    "undefer": ("deferred",),
}
# What each verb's reply looks like in the status comment, for the commanders to copy.
VERB_USAGE = {"answer": "/answer YOUR ANSWER", "approve": "/approve", "changes": "/changes WHAT TO CHANGE",
              "retry": "/retry", "resume": "/resume", "cancel": "/cancel REASON", "defer": "/defer 2h REASON",
              "undefer": "/undefer"}
# The first non-empty line of a comment: `/verb` and what follows it. A line starting with any other word after a
# slash (`/cc`, `/etc/fstab`) is no command: an ordinary comment.
_COMMAND = re.compile(r"^/(" + "|".join(VERB_STATES) + r")(?![^\s])[ \t]*(.*)$")
_DURATION = re.compile(r"^([1-9][0-9]{0,4})([mhd])$")
_DURATION_UNITS = {"m": 60, "h": 3600, "d": 86400}
MAX_ANSWER_BYTES = 4096
_TODO_ID = re.compile(r"^td_[A-Za-z0-9_-]{1,64}$")
_WEB_URL = re.compile(r"^https?://[^\s<>\"]+$")
# GitHub's closing keywords, then `#N` or `OWNER/REPO#N`.
_CLOSES = re.compile(r"(?<![A-Za-z0-9_])(?:close[sd]?|fix(?:e[sd])?|resolve[sd]?)[ \t]*:?[ \t]+"
                     r"((?:[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)?)#([1-9][0-9]{0,17})(?![0-9A-Za-z_])", re.IGNORECASE)
MAX_LINKS = 20


def is_commander(commands: dict, login: object) -> bool:
    """Logins compare ASCII case-insensitively, as the forges compare them."""
    return isinstance(login, str) and bool(login) and login.translate(ASCII_FOLD) in {
        name.translate(ASCII_FOLD) for name in commands["logins"]}


def _forge_kind(envelope: dict) -> str | None:
    """The forge event kind of a verified, signed delivery about a forge subject; None for anything else."""
    if not (envelope["verified"] and envelope["trust_mode"] == "signed" and envelope["subject_key"]):
        return None
    forge = forge_view(envelope["source"], envelope["kind"], envelope["headers"] or {})
    return forge[1] if forge else None


def _login(payload: object, *path: str) -> str | None:
    value = value_at(payload, *path)
    return value if isinstance(value, str) and value else None


@dataclass
class Command:
    verb: str
    text: str  # what follows the verb: the first line's rest and the lines after it
    login: str
    comment_id: str
    comment_url: str | None


def read_command(envelope: dict, commands: dict) -> Command | None:
    """The command a delivery carries: a commander's new comment whose first non-empty line is `/verb …`, that
    is not the server's own (an output or the status comment carries its marker). None: an ordinary delivery."""
    if _forge_kind(envelope) != "issue_comment" or not commands["logins"]:
        return None
    payload = envelope["payload"]
    if value_at(payload, "action") != "created":  # an edited comment is not a second command
        return None
    login, body, comment_id = _login(payload, "sender", "login"), value_at(payload, "comment", "body"), value_at(
        payload, "comment", "id")
    if not is_commander(commands, login) or not isinstance(body, str) or MARKER_PREFIX in body:
        return None
    if isinstance(comment_id, bool) or not isinstance(comment_id, int) or not 0 < comment_id < 10 ** 18:
        return None
    lines = body.replace("\r\n", "\n").split("\n")
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        return None
    match = _COMMAND.match(lines[first].strip())
    if match is None:
        return None
    text = "\n".join([match.group(2), *lines[first + 1:]]).strip()
    url = value_at(payload, "comment", "html_url")
    url = url if isinstance(url, str) and len(url) <= 2048 and _WEB_URL.match(url) else None
    return Command(match.group(1), text, login, str(comment_id), url)


def _principal(txn: Txn, human_id: str) -> Principal:
    row = txn.one("SELECT name FROM humans WHERE id = ?", (human_id,))
    return Principal(kind="human", id=human_id, human_id=human_id, name=row["name"] if row else "")


def _webhook_todos(txn: Txn, webhook: sqlite3.Row, key: str, states: tuple[str, ...]) -> list[sqlite3.Row]:
    """The todos about `key` that this webhook's deliveries made for its own human, in `states`, oldest first."""
    marks = ", ".join("?" * len(states))
    return txn.all(f"SELECT t.id, t.queue, t.state FROM todos t JOIN events e ON e.id = t.event_id"
                   f" JOIN endpoints ep ON ep.id = t.endpoint_id WHERE t.subject_key = ? AND e.webhook_id = ?"
                   f" AND ep.human_id = ? AND t.state IN ({marks}) ORDER BY t.created_at, t.id",
                   (key, webhook["id"], webhook["human_id"], *states))


def _act(txn: Txn, principal: Principal, verb: str, todo_id: str, text: str, via: dict) -> None:
    """The human's own action for `verb` (its 409s and checks), with the forge in its evidence."""
    if verb == "answer":
        if len(text.encode("utf-8", "surrogatepass")) > MAX_ANSWER_BYTES:
            raise ApiError("invalid_argument", f"an answer is at most {MAX_ANSWER_BYTES} bytes")
        human_actions.answer(txn, principal, todo_id, Answer(answer=text), via)
    elif verb == "approve":
        human_actions.approve(txn, principal, todo_id, HumanNote(note=text or None), via)
    elif verb == "changes":
        human_actions.request_changes(txn, principal, todo_id, RequestChanges(note=text), via)
    elif verb == "retry":
        human_actions.retry(txn, principal, todo_id, HumanNote(note=text or None), via)
    elif verb == "resume":
        human_actions.resume(txn, principal, todo_id, HumanNote(note=text or None), via)
    elif verb == "cancel":
        human_actions.cancel(txn, principal, todo_id, Cancel(reason=text), via)
    elif verb == "undefer":
        human_actions.undefer(txn, principal, todo_id, HumanNote(note=text or None), via)
    else:
        words = text.split(None, 1)
        duration = _DURATION.match(words[0]) if words else None
        until = None
        if duration:
            seconds = int(duration.group(1)) * _DURATION_UNITS[duration.group(2)]
            until = datetime.fromtimestamp(txn.now / 1000, UTC) + timedelta(seconds=seconds)
            text = words[1] if len(words) > 1 else ""
        human_actions.defer(txn, principal, todo_id, Defer(reason=text, until=until), via)


def _refusal(error: Exception) -> str:
    if isinstance(error, ValidationError):
        problem = error.errors()[0]
        field = ".".join(str(p) for p in problem["loc"])
        return f"{field or 'the command'}: {problem['msg']}" if problem["type"] != "missing" else (
            f"the command needs its text ({field})")
    return error.message if isinstance(error, ApiError) else str(error)


def run_command(txn: Txn, webhook: sqlite3.Row, envelope: dict, command: Command, event_id: str) -> dict:
    """Act on the one todo the command means, or refuse: nothing waits for it, more than one does and the command
    names none (its first word may name a todo id or a queue), or the action itself refuses. The command's trace."""
    key = envelope["subject_key"]
    candidates = _webhook_todos(txn, webhook, key, VERB_STATES[command.verb])
    text = command.text
    words = text.split(None, 1)
    if words and (_TODO_ID.match(words[0]) or words[0] in {c["queue"] for c in candidates}):
        chosen = [c for c in candidates if words[0] in (c["id"], c["queue"])]
        if not chosen:
            return _refused(command, [], f"no todo {words[0]} about this issue waits for /{command.verb}")
        candidates, text = chosen, (words[1] if len(words) > 1 else "")
    if not candidates:
        return _refused(command, [], f"nothing about this issue waits for /{command.verb}")
    if len(candidates) > 1:
        named = ", ".join(f"{c['id']} in {c['queue']}" for c in candidates[:8])
        return _refused(command, [c["id"] for c in candidates],
                        f"{len(candidates)} todos wait for /{command.verb} ({named}): name one, by id or queue")
    todo_id = candidates[0]["id"]
    via = {"via": "forge", "login": command.login, "comment_url": command.comment_url, "event_id": event_id}
    try:  # every refusal is raised before the action writes anything
        _act(txn, _principal(txn, webhook["human_id"]), command.verb, todo_id, text, via)
    except (ApiError, ValidationError) as error:
        return _refused(command, [todo_id], _refusal(error))
    txn.logs.append(f"forge command /{command.verb} by {command.login} acted on {todo_id}")
    return {"verb": command.verb, "todo_ids": [todo_id], "result": "acted", "login": command.login}


def _refused(command: Command, todo_ids: list[str], reason: str) -> dict:
    return {"verb": command.verb, "todo_ids": todo_ids, "result": "refused", "reason": reason[:500],
            "login": command.login}


def queue_reaction(txn: Txn, webhook_id: str, subject_key: str, comment_id: str, acted: bool, event_id: str) -> bool:
    """The command's acknowledgement on its comment, sent after commit by the forge sender: only where the
    connection may write (its forge, its repositories), as for any output. False: none is sent."""
    row = txn.one("SELECT wc.connection_id, c.kind, c.repos FROM webhook_connections wc JOIN forge_connections c"
                  " ON c.id = wc.connection_id WHERE wc.webhook_id = ?", (webhook_id,))
    facts = parse_subject_key(subject_key)
    if (row is None or facts["provider"] != row["kind"] or facts["repo"] is None
            or not covers(json.loads(row["repos"]), facts["repo"])):
        return False
    txn.execute("INSERT INTO forge_reactions (event_id, connection_id, subject_key, repo, comment_id, content, state,"
                " next_at, created_at) VALUES (?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
                (event_id, row["connection_id"], subject_key, facts["repo"], comment_id,
                 "+1" if acted else "confused", txn.now, txn.now))
    txn.outbox = True
    return True


# -- closing, and the pull request that closes an issue ---------------------------------------------------------------

def close_issue(txn: Txn, webhook: sqlite3.Row, envelope: dict, commands: dict, event_id: str) -> dict | None:
    """A commander closed the issue and the webhook's `on_close` is `cancel`: its open todos are cancelled."""
    payload = envelope["payload"]
    login = _login(payload, "sender", "login")
    if (_forge_kind(envelope) != "issues" or value_at(payload, "action") != "closed" or commands["on_close"] != "cancel"
            or not is_commander(commands, login)):
        return None
    open_states = tuple(s for s in human_actions.ACTION_STATES["cancel"] if s not in TERMINAL_STATES)
    principal = _principal(txn, webhook["human_id"])
    via = {"via": "forge", "login": login, "comment_url": None, "event_id": event_id}
    cancelled = []
    for todo in _webhook_todos(txn, webhook, envelope["subject_key"], open_states):
        try:
            human_actions.cancel(txn, principal, todo["id"], Cancel(reason=f"closed on the forge by {login}"), via)
            cancelled.append(todo["id"])
        except ApiError:  # it left its state since it was read (the refusal writes nothing)
            pass
    return {"closed_by": login, "cancelled": cancelled}


def closed_issues(envelope: dict, repo: str, title: object, body: object) -> list[str]:
    """The issues of `repo` a pull request's title or body says it closes (GitHub's closing keywords)."""
    provider = parse_subject_key(envelope["subject_key"])["provider"]
    keys = []
    for text in (title, body):
        for match in _CLOSES.finditer(text if isinstance(text, str) else ""):
            if match.group(1) and match.group(1).lower() != repo.lower():
                continue  # another repository's issue: never linked
            keys.append(f"{provider}:{repo}#{int(match.group(2))}")
    return list(dict.fromkeys(k for k in keys if k != envelope["subject_key"]))[:MAX_LINKS]


def _trusted_author(envelope: dict, commands: dict, connection_login: str | None) -> bool:
    author = _login(envelope["payload"], "pull_request", "user", "login")
    if author is None:
        return False
    own = connection_login is not None and author.translate(ASCII_FOLD) == connection_login.translate(ASCII_FOLD)
    return own or is_commander(commands, author) or (
        envelope["actor"].get("author_trusted") is True and envelope["actor"].get("author") == author)


def pull_request_effects(txn: Txn, webhook: sqlite3.Row, envelope: dict, commands: dict, connection_login: str | None,
                         event_id: str) -> dict | None:
    """A trusted author's pull request that closes issues links to them; merged by a commander, the issues' todos
    in review are approved; changes requested by a commander send them back with the review's text."""
    kind = _forge_kind(envelope)
    if kind not in ("pull_request", "pull_request_review", "pull_request_rejected"):
        return None
    payload, pull_key = envelope["payload"], envelope["subject_key"]
    facts = parse_subject_key(pull_key)
    if facts.get("number") is None:
        return None
    effects: dict = {}
    if kind == "pull_request" and _trusted_author(envelope, commands, connection_login):
        linked = closed_issues(envelope, facts["repo"], value_at(payload, "pull_request", "title"),
                               value_at(payload, "pull_request", "body"))
        for issue_key in linked:
            if txn.execute("INSERT INTO subject_links (human_id, pull_key, issue_key, event_id, linked_at)"
                           " VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                           (webhook["human_id"], pull_key, issue_key, event_id, txn.now)).rowcount:
                mark_issue_status(txn, webhook["id"], issue_key)
        if linked:
            effects["links"] = linked
    links = [r["issue_key"] for r in txn.all("SELECT issue_key FROM subject_links WHERE human_id = ? AND pull_key = ?"
                                             " ORDER BY issue_key", (webhook["human_id"], pull_key))]
    if not links:
        return effects or None
    merged_by = _login(payload, "pull_request", "merged_by", "login") or (
        _login(payload, "sender", "login") if envelope["source"] == "gitea" else None)
    if (kind == "pull_request" and value_at(payload, "action") == "closed"
            and value_at(payload, "pull_request", "merged") is True and is_commander(commands, merged_by)):
        via = {"via": "forge", "merged": pull_key, "login": merged_by, "event_id": event_id}
        effects["approved"] = _each_review_todo(txn, webhook, links, lambda principal, todo_id: human_actions.approve(
            txn, principal, todo_id, HumanNote(note=f"merged {pull_key}"), via))
        effects["merged_by"] = merged_by
    reviewer = _login(payload, "sender", "login")
    review = _requested_changes(kind, payload)
    if review is not None and is_commander(commands, reviewer):
        via = {"via": "forge", "review": pull_key, "login": reviewer, "event_id": event_id}
        note = review[:4096] or f"changes requested on {pull_key} by {reviewer}"
        effects["changes_requested"] = _each_review_todo(txn, webhook, links, lambda principal, todo_id: (
            human_actions.request_changes(txn, principal, todo_id, RequestChanges(note=note), via)))
        effects["reviewer"] = reviewer
    return effects or None


def _requested_changes(kind: str, payload: object) -> str | None:
    """The review's text when it requests changes (GitHub: `pull_request_review` submitted, state
    changes_requested; Gitea: `pull_request_rejected`), else None."""
    if kind == "pull_request_review" and value_at(payload, "action") == "submitted":
        state = value_at(payload, "review", "state")
        if isinstance(state, str) and state.lower() == "changes_requested":
            body = value_at(payload, "review", "body")
            return body.strip() if isinstance(body, str) else ""
    if kind == "pull_request_rejected":
        body = value_at(payload, "review", "content")
        return body.strip() if isinstance(body, str) else ""
    return None


def _each_review_todo(txn: Txn, webhook: sqlite3.Row, issue_keys: list[str], act) -> list[str]:
    principal, done = _principal(txn, webhook["human_id"]), []
    for issue_key in issue_keys:
        for todo in _webhook_todos(txn, webhook, issue_key, ("review",)):
            try:
                act(principal, todo["id"])
                done.append(todo["id"])
            except ApiError:  # it left review since it was read (the refusal writes nothing)
                pass
    return done


def mark_issue_status(txn: Txn, webhook_id: str, issue_key: str) -> None:
    """The issue's status comment (when there is one) is due again: it names the pull request now."""
    row = txn.one("SELECT connection_id FROM webhook_connections WHERE webhook_id = ? AND mirror = 1", (webhook_id,))
    if row is None:
        return
    if txn.execute("UPDATE forge_status SET version = version + 1, due_at = coalesce(due_at, ?)"
                   " WHERE connection_id = ? AND subject_key = ?", (txn.now, row["connection_id"], issue_key)).rowcount:
        txn.outbox = True
