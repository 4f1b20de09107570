"""The document every rule sees: Switchboard decides its top-level fields; producer data lives only under
.payload and .headers."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

from switchboard.configuration import MAX_WORK_ITEM_BYTES, UNSAFE_TEXT
from switchboard.models import WorkItem
from switchboard.payload import finite_float, producer_text, refuse_constant, stored_payload, value_at
from switchboard.providers import PROVIDER_TABLE, event_kind

_FORGE_KEY = re.compile(r"^(github|gitea):([^#@\s]+/[^#@\s]+)#([1-9][0-9]{0,17})$")


def parse_subject_key(key: str) -> dict:
    """What a subject key names: its provider, and for a forge issue or pull request its repository and number
    (`github:acme/site#12`); a push (`github:acme/site@refs/heads/main`) names its repository."""
    provider, _, rest = key.partition(":")
    found = _FORGE_KEY.match(key)
    if found:
        return {"provider": provider, "repo": found[2], "number": int(found[3])}
    repo = rest.split("@", 1)[0] if provider in ("github", "gitea") and "@" in rest else None
    return {"provider": provider or None, "repo": repo, "number": None}


# Switchboard decides the top-level fields; producer data lives only under .payload and .headers.

SECRET_HEADER_PARTS = ("signature", "token", "secret", "auth", "cookie", "api-key")
REDACTED = "«redacted»"


def lower_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, value in raw:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return headers


def redact_headers(headers: dict[str, str]) -> dict[str, str]:
    return {k: REDACTED if any(part in k for part in SECRET_HEADER_PARTS) else v for k, v in headers.items()}


def _forge_number(payload: Any) -> int | None:
    for path in (("issue", "number"), ("pull_request", "number"), ("number",)):
        number = value_at(payload, *path)
        if isinstance(number, int) and not isinstance(number, bool) and number > 0:
            return number
    return None


def forge_view(provider: str, kind: str | None, headers: dict[str, str]) -> tuple[str, str | None] | None:
    """Which forge a delivery speaks for, and its event kind: a forge webhook's own, or (as the reference
    design does) a generic webhook whose request carries X-Gitea-Event (which wins) or X-GitHub-Event."""
    if PROVIDER_TABLE[provider].forge:
        return provider, kind
    if provider == "generic":
        for forge in ("gitea", "github"):
            if f"x-{forge}-event" in headers:
                return forge, headers[f"x-{forge}-event"]
    return None


def subject_key(provider: str, kind: str | None, payload: Any, headers: dict[str, str]) -> str | None:
    if provider == "cairn":
        artifact_id = producer_text(value_at(payload, "data", "id"))
        return f"cairn:{artifact_id}" if artifact_id else None
    forge = forge_view(provider, kind, headers)
    if forge is None or forge[1] is None:
        return None
    provider, kind = forge
    repo = producer_text(value_at(payload, "repository", "full_name"))
    if not repo:
        return None
    if kind == "push":
        ref = producer_text(value_at(payload, "ref"))
        return f"{provider}:{repo}@{ref}" if ref else None
    if kind.startswith("issue") or kind.startswith("pull_request"):
        number = _forge_number(payload)
        return f"{provider}:{repo}#{number}" if number else None
    return None


def _label_names(labels: Any) -> list[str]:
    if not isinstance(labels, list):
        return []
    return [producer_text(label["name"]) for label in labels if isinstance(label, dict) and isinstance(label.get("name"), str)]


def _string(value: Any) -> str:
    """A producer string inside .issue: absent or of the wrong type reads as "" (rules may call string
    functions on it unguarded, as packs written for the reference design do)."""
    return producer_text(value) or ""


def issue_view(provider: str, kind: str | None, headers: dict[str, str], payload: Any, key: str | None,
               verified: bool) -> dict | None:
    """Forge issue events only: kind `issues`, a positive issue number, and no pull request (a non-null
    `issue.pull_request` or top-level `pull_request`; Gitea sends `"pull_request": null` on plain issues)."""
    forge = forge_view(provider, kind, headers)
    issue = value_at(payload, "issue")
    if forge is None or forge[1] != "issues" or not isinstance(issue, dict):
        return None
    number = issue.get("number")
    if (not isinstance(number, int) or isinstance(number, bool) or number <= 0
            or issue.get("pull_request") is not None or value_at(payload, "pull_request") is not None):
        return None
    action = _string(value_at(payload, "action"))
    body = issue.get("body")
    return {
        "provider": forge[0], "action": action,
        "event_type": headers.get("x-gitea-event-type") or "issues",
        "repo": _string(value_at(payload, "repository", "full_name")), "number": number,
        "title": _string(issue.get("title")), "url": _string(issue.get("html_url")),
        "state": _string(issue.get("state")), "author": _string(value_at(issue, "user", "login")),
        "sender": _string(value_at(payload, "sender", "login")), "labels": _label_names(issue.get("labels")),
        "label": producer_text(value_at(payload, "label", "name")),
        "label_event": action in ("labeled", "unlabeled", "label_updated", "label_cleared"),
        "body_size": len(body.encode("utf-8", "surrogatepass")) if isinstance(body, str) else 0,
        "key": key,
        **dict(zip(("work_item", "work_item_error"), body_work_item(body, verified), strict=True)),
    }


# A work item in an issue body (SPEC section 17): a fenced block opened by ``` or ~~~ (three or more, indented at
# most three spaces) with the info string `switchboard`, closed by a fence of the same character at least as long.
_WORK_ITEM_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})[ \t]*switchboard[ \t]*\r?$", re.MULTILINE)
# Why a block did not validate is shown to rules and humans as one short line.
_WORK_ITEM_ERROR_CHARS = 300


def body_work_item(body: Any, verified: bool) -> tuple[dict | None, str | None]:
    """The issue body's work item and why it is not one: (object, None), (None, why), or (None, None) when the
    body has no `switchboard` block. Producer text: only a verified delivery's block is read at all, at most one
    block counts, and a block is parsed only within MAX_WORK_ITEM_BYTES, so any body costs one linear scan."""
    if not isinstance(body, str) or "switchboard" not in body:
        return None, None
    blocks = _fenced_blocks(body)
    if not blocks:
        return None, None
    if not verified:
        return None, "not read: the delivery is not verified"
    if len(blocks) > 1:
        return None, "the body holds more than one switchboard block; exactly one is read"
    text = blocks[0]
    if text is None:
        return None, "the switchboard block is never closed"
    if len(text) > MAX_WORK_ITEM_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_WORK_ITEM_BYTES:
        return None, f"the switchboard block is over {MAX_WORK_ITEM_BYTES} bytes"
    try:
        document = json.loads(text, parse_constant=refuse_constant, parse_float=finite_float)
    except RecursionError:
        return None, "not JSON: nested too deep"
    except ValueError as exc:
        return None, _one_line(f"not JSON: {exc}")
    if not isinstance(document, dict):
        return None, "the switchboard block holds JSON that is not an object"
    if "depends_on" in document:
        return None, "depends_on: an issue's work item cannot depend on todos"
    try:
        item = WorkItem.model_validate(document)
    except ValidationError as exc:
        # Which field and why, never the value (producer text); a field's name is producer text too, kept safe.
        return None, _one_line("; ".join(
            f"{'.'.join(str(part) for part in e['loc']) or 'work item'}: "
            + ("unknown field" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, "))
            for e in exc.errors()[:3]))
    return item.model_dump(mode="json", by_alias=True, exclude_none=True), None


def _fenced_blocks(body: str) -> list[str | None]:
    """The text of the first two `switchboard` blocks (None for one never closed): two are enough to refuse."""
    blocks: list[str | None] = []
    position = 0
    while len(blocks) < 2 and (opening := _WORK_ITEM_FENCE.search(body, position)):
        fence = opening.group(1)
        start = opening.end() + 1
        closing = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}[ \t]*\r?$", re.MULTILINE).search(body, start)
        if closing is None:
            blocks.append(None)
            break
        blocks.append(body[start:closing.start()])
        position = closing.end()
    return blocks


def _one_line(text: str) -> str:
    return " ".join(re.sub(f"[{UNSAFE_TEXT}]", " ", producer_text(text) or "").split())[:_WORK_ITEM_ERROR_CHARS]


def _thread_author(payload: Any) -> str | None:
    """Who opened the thread (issue, pull request or discussion) a delivery is about."""
    return next((login for part in ("issue", "pull_request", "discussion")
                 if (login := _login(value_at(payload, part, "user", "login")))), None)


ASCII_FOLD = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _login(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def actor_view(provider: str, payload: Any, trusted_actors: dict | None, connection_login: str | None = None) -> dict:
    """`.actor`: who sent the delivery and who wrote what it is about, from the verified body, and whether the
    webhook's trusted actors name them. Logins compare ASCII case-insensitively, cairn actor ids exactly; a
    field of the wrong type names nobody. The author is trusted only when the thread's author is too (a
    maintainer's comment on an outsider's issue is not author-trusted). Under allow_all the per-actor flags
    are null and the delivery is trusted; a webhook with no gate has everything null. A forge webhook that writes
    through a connection trusts the connection's login too, and `via_connection` says whether the sender is it
    (what the server itself wrote on the forge); null without a connection."""
    if provider == "cairn":
        sender = author = thread = _login(value_at(payload, "data", "actor_id"))
        connection_login = None
    elif PROVIDER_TABLE[provider].forge:
        sender = _login(value_at(payload, "sender", "login"))
        author = next((login for part in ("comment", "review", "pull_request", "issue", "discussion")
                       if (login := _login(value_at(payload, part, "user", "login")))), None)
        thread = _thread_author(payload)
    else:
        return {"sender": None, "author": None, "sender_trusted": None, "author_trusted": None, "trusted": None,
                "via_connection": None}
    own = connection_login.translate(ASCII_FOLD) if connection_login else None
    view = {"sender": sender, "author": author, "sender_trusted": None, "author_trusted": None, "trusted": None,
            "via_connection": None if own is None else sender is not None and sender.translate(ASCII_FOLD) == own}
    if trusted_actors is None:
        return view
    if trusted_actors.get("allow_all"):
        return {**view, "trusted": True}
    if "actor_ids" in trusted_actors:
        names, fold = set(trusted_actors["actor_ids"]), (lambda name: name)
    else:
        names = {n.translate(ASCII_FOLD) for n in trusted_actors["logins"]} | ({own} if own else set())
        fold = lambda n: n.translate(ASCII_FOLD)  # noqa: E731 - a one-line key
    known = lambda name: name is not None and fold(name) in names  # noqa: E731 - a one-line predicate
    view["sender_trusted"] = known(sender)
    view["author_trusted"] = known(author) and (thread is None or known(thread)) if author else known(sender)
    match = trusted_actors.get("match", "sender")
    view["trusted"] = {"sender": view["sender_trusted"], "author": view["author_trusted"],
                       "both": view["sender_trusted"] and view["author_trusted"]}[match]
    return view


def actors_to_trust(envelope: dict, trusted_actors: dict) -> list[str]:
    """The names a human's "trust this actor" adds: whoever the webhook's match mode found untrusted."""
    actor, match = envelope["actor"], trusted_actors.get("match", "sender")
    names = [actor["sender"]] if match in ("sender", "both") or "actor_ids" in trusted_actors else []
    if match in ("author", "both"):
        names += [actor["author"], _thread_author(envelope["payload"])]
    return [n for n in dict.fromkeys(names) if n]


def untrusted_names(envelope: dict, trusted_actors: dict | None) -> list[str]:
    """Of actors_to_trust, those the list does not name yet (logins compare ASCII case-insensitively): what
    "trust this actor" would add."""
    if not trusted_actors or trusted_actors.get("allow_all"):
        return []
    if "actor_ids" in trusted_actors:
        known, fold = set(trusted_actors["actor_ids"]), (lambda name: name)
    else:
        known, fold = {n.translate(ASCII_FOLD) for n in trusted_actors["logins"]}, (lambda n: n.translate(ASCII_FOLD))
    return [n for n in actors_to_trust(envelope, trusted_actors) if fold(n) not in known]


def artifact_view(payload: Any) -> dict | None:
    data = value_at(payload, "data")
    if not isinstance(data, dict) or not isinstance(data.get("id"), str):
        return None
    return {
        "id": data["id"], "handle": f"mcp://cairn/{data['id']}", "event_id": value_at(payload, "event_id"),
        "kind": value_at(payload, "kind"), "created_at": value_at(payload, "created_at"),
        **{name: data.get(name) for name in ("url", "title", "share_type", "channel", "model", "actor_id",
                                             "on_behalf_of", "expires_at", "tags", "metadata")},
    }


def build_envelope(*, provider: str, webhook_id: str, trust_mode: str, verified: bool, headers: dict[str, str],
                   body: bytes, payload: Any, trusted_actors: dict | None, released: dict | None = None,
                   connection_login: str | None = None) -> dict:
    kind = event_kind(provider, headers, payload)
    key = subject_key(provider, kind, payload, headers)
    return {
        "source": provider, "kind": kind, "webhook_id": webhook_id, "trust_mode": trust_mode, "verified": verified,
        "content_type": headers.get("content-type"), "size": len(body), "headers": redact_headers(headers),
        "payload": payload, "issue": issue_view(provider, kind, headers, payload, key, verified),
        "artifact": artifact_view(payload) if provider == "cairn" else None,
        "subject_key": key, "release": released, "actor": actor_view(provider, payload, trusted_actors, connection_login),
    }


# A delivery's body is stored once, in event_bodies. The envelope is stored without `.payload` and `.headers` (its
# record; the event keeps the headers in a column of their own), and the payload is parsed from the body again
# wherever a whole envelope or a todo's payload is read.

def envelope_record(envelope: dict) -> str:
    """The envelope as its event stores it: every field but `.payload` and `.headers`."""
    return json.dumps({k: v for k, v in envelope.items() if k not in ("payload", "headers")})


def envelope_document(record: str, headers_json: str, payload_json: str) -> str:
    """The whole envelope as JSON text, for jq: the record with the headers' and the payload's text appended, so
    that a large body is never encoded again."""
    return f'{record[:-1]}, "headers": {headers_json}, "payload": {payload_json}}}'


def stored_envelope(record: str, headers_json: str, body: bytes | None) -> dict:
    envelope = json.loads(record)
    return {**envelope, "headers": json.loads(headers_json), "payload": stored_payload(body, envelope["content_type"])}


def envelope_title(envelope: dict) -> str:
    """A one-line title for a todo made from a delivery; producer text, so only ever shown as data."""
    payload = envelope["payload"]
    repo = producer_text(value_at(payload, "repository", "full_name"))
    number = _forge_number(payload)
    title = (producer_text(value_at(payload, "issue", "title")) or producer_text(value_at(payload, "pull_request", "title"))
             if number else None)
    if envelope["artifact"]:
        text = envelope["artifact"].get("title") or envelope["artifact"]["id"]
    elif repo and number:
        text = f"{repo}#{number}: {title or envelope['kind']}"
    elif repo and envelope["kind"] == "push":
        text = f"{repo}: push to {producer_text(value_at(payload, 'ref'))}"
    else:
        text = f"{envelope['source']} {envelope['kind'] or 'delivery'}"
    text = " ".join(re.sub(f"[{UNSAFE_TEXT}]", " ", producer_text(str(text))).split())
    return text[:512] or "delivery"
