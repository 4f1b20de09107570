"""Deliveries shaped and signed the way each producer sends them, built from tests/fixtures (see its README)."""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
import os
import time
import uuid
from pathlib import Path

# The fixtures live in the repository (tests/fixtures); SWITCHBOARD_FIXTURES may point at another copy.
FIXTURES = Path(os.environ.get("SWITCHBOARD_FIXTURES") or Path(__file__).resolve().parent / "fixtures")


def deep_merge(base, patch):
    """Objects merge key by key; anything else replaces (the fixtures README's rule)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = deep_merge(base.get(key), value) if key in base else copy.deepcopy(value)
        return merged
    return copy.deepcopy(patch)


def hex_hmac(secret: str, message: bytes) -> str:
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def github(event: str, secret: str, patch: dict | None = None, delivery: str | None = None) -> tuple[bytes, dict]:
    """`event` is a fixture name such as 'issues.opened'; the header event is its first part."""
    body = json.loads((FIXTURES / "github" / f"{event}.json").read_text())
    raw = json.dumps(deep_merge(body, patch) if patch else body).encode()
    return raw, github_headers(secret, raw, delivery, event.split(".")[0])


def github_headers(secret: str, raw: bytes, delivery: str | None = None, event: str = "issues") -> dict:
    """GitHub's headers for a body as sent: the event, a delivery id (fresh unless given), the signature."""
    return {"X-GitHub-Event": event, "X-GitHub-Delivery": delivery or str(uuid.uuid4()),
            "Content-Type": "application/json", "X-Hub-Signature-256": "sha256=" + hex_hmac(secret, raw)}


def gitea(event: str, secret: str, patch: dict | None = None, delivery: str | None = None) -> tuple[bytes, dict]:
    fixture = json.loads((FIXTURES / "gitea" / f"{event}.json").read_text())
    raw = json.dumps(deep_merge(fixture["body"], patch) if patch else fixture["body"]).encode()
    headers = dict(fixture["headers"])
    if delivery:
        for name in ("X-Gitea-Delivery", "X-GitHub-Delivery", "X-Gogs-Delivery"):
            headers[name] = delivery
    headers["X-Gitea-Signature"] = hex_hmac(secret, raw)
    return raw, headers


def cairn(secret: str, patch: dict | None = None, created_at: float | None = None) -> tuple[bytes, dict]:
    fixture = json.loads((FIXTURES / "cairn" / "artifact.created.json").read_text())
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created_at if created_at is not None else time.time()))
    body = deep_merge(fixture["body"], {"created_at": stamp, **(patch or {})})
    raw = json.dumps(body).encode()
    headers = {**fixture["headers"], "X-Cairn-Event-Id": body["event_id"],
               "X-Cairn-Signature": "sha256=" + hex_hmac(secret, raw)}
    return raw, headers


def stripe(secret: str, body: dict, at: int | None = None, extra_signatures: tuple[str, ...] = ()) -> tuple[bytes, dict]:
    raw = json.dumps(body).encode()
    return raw, stripe_headers(secret, raw, at if at is not None else int(time.time()), extra_signatures)


def stripe_headers(secret: str, raw: bytes, at: int, extra_signatures: tuple[str, ...] = ()) -> dict:
    """Stripe's headers for a body as sent at `at` (unix seconds): `t=`, any extra `v1=`, then the signature."""
    signature = hex_hmac(secret, str(at).encode() + b"." + raw)
    header = ",".join([f"t={at}", *(f"v1={s}" for s in extra_signatures), f"v1={signature}"])
    return {"Stripe-Signature": header, "Content-Type": "application/json"}


def slack(secret: str, body: dict, at: int | None = None) -> tuple[bytes, dict]:
    raw = json.dumps(body).encode()
    stamp = str(at if at is not None else int(time.time()))
    return raw, {"X-Slack-Signature": "v0=" + hex_hmac(secret, b"v0:" + stamp.encode() + b":" + raw),
                 "X-Slack-Request-Timestamp": stamp, "Content-Type": "application/json"}
