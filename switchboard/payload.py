"""Producer JSON, read safely: the body parsed as one JSON value (strictly, within a depth limit, from a form
when GitHub sends one), fields looked up along a path in whatever shape arrived, and producer strings made safe to
keep. The providers (signatures, delivery ids, kinds) and the envelope read payloads through these."""

from __future__ import annotations

import contextlib
import json
import math
import urllib.parse
from typing import Any

from switchboard.configuration import MAX_PAYLOAD_DEPTH


def value_at(document: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(document, dict):
            return None
        document = document.get(key)
    return document


def producer_text(value: Any) -> str | None:
    """A producer string, or None. Lone surrogates (legal in JSON escapes, not in UTF-8) become U+FFFD."""
    if not isinstance(value, str):
        return None
    if value.isascii():
        return value
    return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def parse_json(body: bytes) -> Any:
    """The body as one JSON value, or None: empty, invalid, trailing data, NaN, a number too large for a
    float, or absurd nesting."""
    try:
        return json.loads(body, parse_constant=refuse_constant, parse_float=finite_float)
    except (ValueError, RecursionError):
        return None


def refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} does not fit a float")
    return value


def deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON containers nest more than `limit` deep; iterative, so depth itself cannot break it."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def decode_payload(headers: dict[str, str], body: bytes) -> tuple[Any, str | None]:
    """The body as one JSON value, or None and why not. GitHub's form encoding (its default content type)
    carries the JSON in the `payload` field; the signature covers the raw form bytes, verified before this."""
    return parse_payload(headers, body)[:2]


def parse_payload(headers: dict[str, str], body: bytes) -> tuple[Any, str | None, str | None]:
    """decode_payload, with the parser's own words when the body gives no payload (shown to the human)."""
    media_type = headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type == "application/x-www-form-urlencoded":
        try:
            fields = urllib.parse.parse_qs(body, keep_blank_values=True, strict_parsing=True, max_num_fields=64)
        except ValueError as exc:
            return None, "bad_form", f"not a form: {exc}"
        if len(fields.get(b"payload", ())) != 1:
            return None, "form_without_payload", "a form without exactly one payload field"
        body = fields[b"payload"][0]
    if not body.strip():
        return None, "empty", "the body is empty"
    try:
        payload = json.loads(body, parse_constant=refuse_constant, parse_float=finite_float)
    except RecursionError:
        return None, "too_deep", f"JSON nested deeper than {MAX_PAYLOAD_DEPTH} levels"
    except ValueError as exc:
        return None, "not_json", f"not JSON: {exc}"
    if body.count(b"[") + body.count(b"{") > MAX_PAYLOAD_DEPTH and deeper_than(payload, MAX_PAYLOAD_DEPTH):
        return None, "too_deep", f"JSON nested deeper than {MAX_PAYLOAD_DEPTH} levels"
    return payload, None, None


def payload_text(payload: Any, body: bytes) -> str:
    """The payload as JSON text: the body itself when it is a plain UTF-8 JSON object or array (no re-encoding),
    else the parsed value written out again (a form, a BOM, UTF-16, a NUL or a lone surrogate)."""
    if payload is not None and body[:1] in (b"{", b"[") and b"\x00" not in body and b"\\ud" not in body.lower():
        with contextlib.suppress(UnicodeDecodeError):
            return body.decode("utf-8")
    return json.dumps(payload)


def stored_payload(body: bytes | str | None, content_type: str | None) -> Any:
    """A stored body's payload, parsed as it was on arrival (an operator-pushed todo's body is its JSON)."""
    if body is None:
        return None
    raw = body.encode() if isinstance(body, str) else body
    return decode_payload({"content-type": content_type} if content_type else {}, raw)[0]
