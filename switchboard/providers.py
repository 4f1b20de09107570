"""One row per producer (GitHub, Gitea, cairn, Stripe, Slack, generic): signature, freshness, delivery id,
event kind."""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from switchboard.configuration import to_ms
from switchboard.payload import parse_json, producer_text, value_at

# HMAC-SHA256 over the raw bytes before any parsing, compared in constant time. A failure names its
# reason (for the metric and the one log line) and never the secret or the signature. Everything that
# differs between producers is one row of PROVIDER_TABLE at the end of this section.



FRESHNESS_MS = 300_000


class VerificationFailed(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _hmac_hex(secret: bytes, message: bytes) -> str:
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _hex_signature(value: str | None, prefix: str) -> str:
    if value is None:
        raise VerificationFailed("missing_signature")
    value = value.strip()
    if not value.startswith(prefix) or not re.fullmatch(r"[0-9a-fA-F]{64}", value[len(prefix):], re.ASCII):
        raise VerificationFailed("malformed_signature")
    return value[len(prefix):].lower()


def _same(expected: str, presented: str) -> bool:
    """Constant-time comparison of bytes: a header may hold any byte, and compare_digest refuses non-ASCII str."""
    return hmac.compare_digest(expected.encode(), presented.encode("utf-8", "surrogateescape"))


def _require_match(expected: str, presented: str) -> None:
    if not _same(expected, presented):
        raise VerificationFailed("bad_signature")


def _require_fresh(moment_ms: int, now_ms: int) -> None:
    if abs(now_ms - moment_ms) > FRESHNESS_MS:
        raise VerificationFailed("stale_timestamp")


def _unix_seconds(text: str | None) -> int:
    if text is None or not re.fullmatch(r"[0-9]{1,12}", text.strip()):
        raise VerificationFailed("malformed_timestamp")
    return int(text.strip()) * 1000


def _verify_github(secret: bytes, headers: dict[str, str], body: bytes, now_ms: int) -> None:
    _require_match(_hmac_hex(secret, body), _hex_signature(headers.get("x-hub-signature-256"), "sha256="))


def _verify_gitea(secret: bytes, headers: dict[str, str], body: bytes, now_ms: int) -> None:
    if "x-gitea-signature" in headers:
        presented = _hex_signature(headers["x-gitea-signature"], "")
    else:
        presented = _hex_signature(headers.get("x-hub-signature-256"), "sha256=")
    _require_match(_hmac_hex(secret, body), presented)


def _verify_cairn(secret: bytes, headers: dict[str, str], body: bytes, now_ms: int) -> None:
    _require_match(_hmac_hex(secret, body), _hex_signature(headers.get("x-cairn-signature"), "sha256="))
    document = parse_json(body)
    if not isinstance(document, dict) or not isinstance(document.get("event_id"), str) or not document["event_id"]:
        raise VerificationFailed("missing_event_id")
    if "x-cairn-event-id" in headers and headers["x-cairn-event-id"] != document["event_id"]:
        raise VerificationFailed("event_id_mismatch")
    _require_fresh(_iso_ms(document.get("created_at")), now_ms)


def _verify_stripe(secret: bytes, headers: dict[str, str], body: bytes, now_ms: int) -> None:
    header = headers.get("stripe-signature")
    if header is None:
        raise VerificationFailed("missing_signature")
    parts = [p.split("=", 1) for p in header.split(",") if "=" in p]
    stamps = [v.strip() for k, v in parts if k.strip() == "t"]
    signatures = [v.strip().lower() for k, v in parts if k.strip() == "v1"]
    if len(stamps) != 1 or not signatures:
        raise VerificationFailed("malformed_signature")
    moment = _unix_seconds(stamps[0])
    expected = _hmac_hex(secret, stamps[0].encode() + b"." + body)
    # Every v1 is compared, so timing does not reveal which one matched.
    if not sum(_same(expected, s) for s in signatures):
        raise VerificationFailed("bad_signature")
    _require_fresh(moment, now_ms)


def _verify_slack(secret: bytes, headers: dict[str, str], body: bytes, now_ms: int) -> None:
    presented = _hex_signature(headers.get("x-slack-signature"), "v0=")
    stamp = headers.get("x-slack-request-timestamp")
    moment = _unix_seconds(stamp)
    _require_match(_hmac_hex(secret, b"v0:" + stamp.strip().encode() + b":" + body), presented)
    _require_fresh(moment, now_ms)


def _iso_ms(value: Any) -> int:
    """A signed timestamp (ISO-8601, or Unix seconds) in milliseconds; anything unrepresentable is malformed."""
    try:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value * 1000)
        if isinstance(value, str):
            return to_ms(datetime.fromisoformat(value))
    except (ValueError, OverflowError):
        pass
    raise VerificationFailed("malformed_timestamp")


def _header_kind(headers: dict[str, str], payload: Any) -> str | None:
    for name in ("x-github-event", "x-gitea-event", "x-cairn-event", "x-event-type"):
        if name in headers:
            return headers[name]
    return None


@dataclass(frozen=True)
class Provider:
    """One producer: how it signs (None: the URL is the credential), where its delivery id and event kind are,
    whether Switchboard mints its secret, whether it is a forge (issues, pull requests, pushes), and which
    actors its trust gate names (logins or actor ids; None: no gate)."""
    name: str
    verify: Callable[[bytes, dict[str, str], bytes, int], None] | None
    delivery_id: Callable[[dict[str, str], Any], Any]
    kind: Callable[[dict[str, str], Any], str | None]
    mints_secret: bool
    forge: bool = False
    trust: Literal["logins", "actor_ids"] | None = None


PROVIDER_TABLE: dict[str, Provider] = {p.name: p for p in (
    Provider("github", _verify_github, lambda h, p: h.get("x-github-delivery"), _header_kind, True, forge=True,
             trust="logins"),
    Provider("gitea", _verify_gitea, lambda h, p: h.get("x-gitea-delivery"), _header_kind, True, forge=True,
             trust="logins"),
    Provider("cairn", _verify_cairn, lambda h, p: value_at(p, "event_id"), lambda h, p: producer_text(value_at(p, "kind")), True,
             trust="actor_ids"),
    Provider("stripe", _verify_stripe, lambda h, p: value_at(p, "id"), lambda h, p: producer_text(value_at(p, "type")), False),
    Provider("slack", _verify_slack, lambda h, p: value_at(p, "event_id"), lambda h, p: producer_text(value_at(p, "event", "type")),
             False),
    Provider("generic", None, lambda h, p: h.get("x-delivery-id") or h.get("webhook-id"), _header_kind, False),
)}
PROVIDERS = tuple(PROVIDER_TABLE)


def verify_delivery(provider: str, secret: bytes | None, headers: dict[str, str], body: bytes, now_ms: int) -> bool:
    """True when the signature verified, False for token-trust providers; raises VerificationFailed."""
    verify = PROVIDER_TABLE[provider].verify
    if verify is None:
        return False
    verify(secret, headers, body, now_ms)
    return True


def event_kind(provider: str, headers: dict[str, str], payload: Any) -> str | None:
    return PROVIDER_TABLE[provider].kind(headers, payload)


def delivery_key(provider: str, headers: dict[str, str], payload: Any, body: bytes) -> str:
    """The provider's delivery id, else the body's SHA-256 (as `sha256:<hex>`)."""
    key = producer_text(PROVIDER_TABLE[provider].delivery_id(headers, payload if isinstance(payload, dict) else {}))
    if key and key.strip():
        key = key.strip()
        return key if len(key) <= 200 else "id-sha256:" + hashlib.sha256(key.encode()).hexdigest()
    return "sha256:" + hashlib.sha256(body).hexdigest()
