"""Webhooks, their secrets, trusted actors and routes."""

from __future__ import annotations

import json
import secrets
import sqlite3

from switchboard.configuration import RESERVED_QUEUES, ApiError, iso
from switchboard.crypto import SecretBox, new_id, token_hash
from switchboard.database import Txn
from switchboard.envelope import ASCII_FOLD
from switchboard.models import (
    RouteAdd,
    TrustActorIds,
    TrustAll,
    TrustedActors,
    TrustLogins,
    WebhookCreate,
    WebhookSecret,
    WebhookUpdate,
    parse_model,
)
from switchboard.providers import PROVIDER_TABLE
from switchboard.store.principals import Principal, own_endpoint
from switchboard.store.todos import stored_json

# -- webhooks and routes ----------------------------------------------------------------------------

def webhook_view(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "name": row["name"], "endpoint_id": row["endpoint_id"], "provider": row["provider"],
            "queue": row["queue"], "trust_mode": row["trust_mode"], "secret_set": row["secret_sealed"] is not None,
            "trusted_actors": stored_json(row["trusted_actors"]), "pinged_at": iso(row["pinged_at"]),
            "created_at": iso(row["created_at"]), "rotated_at": iso(row["rotated_at"])}


def visible_webhook(txn: Txn, principal: Principal, webhook_id: str, verb: str) -> sqlite3.Row:
    if principal.kind == "endpoint":
        principal.require_verb(verb)
        row = txn.one("SELECT * FROM webhooks WHERE id = ? AND endpoint_id = ?", (webhook_id, principal.id))
    elif principal.kind == "human":
        row = txn.one("SELECT w.* FROM webhooks w JOIN endpoints e ON e.id = w.endpoint_id"
                      " WHERE w.id = ? AND e.human_id = ?", (webhook_id, principal.human_id))
    else:
        row = txn.one("SELECT * FROM webhooks WHERE id = ?", (webhook_id,))
    if row is None:
        raise ApiError("not_found", f"no webhook {webhook_id}")
    return row


def _human_grants_queue(txn: Txn, human_id: str, queue: str) -> bool:
    return any(queue in json.loads(r["queues"]) for r in txn.all(
        "SELECT queues FROM endpoints WHERE human_id = ? AND revoked_at IS NULL", (human_id,)))


def _ingest_url(base_url: str, token: str) -> str:
    return f"{base_url.rstrip('/')}/hooks/{token}"


def _initial_secret(provider: str, supplied: str | None) -> str | None:
    if provider == "generic":
        if supplied is not None:
            raise ApiError("invalid_argument", "secret: a generic webhook has no secret; its URL is the credential")
        return None
    if provider == "stripe" and supplied is not None and not supplied.startswith("whsec_"):
        raise ApiError("invalid_argument", "secret: a Stripe signing secret starts with whsec_")
    if supplied is None and PROVIDER_TABLE[provider].mints_secret:
        return "whsec_" + secrets.token_hex(32)
    return supplied


def create_webhook(txn: Txn, principal: Principal, box: SecretBox, spec: WebhookCreate, base_url: str) -> dict:
    if principal.kind == "endpoint":
        principal.require_verb("create_webhook")
        if spec.endpoint_id not in (None, principal.id):
            raise ApiError("forbidden", "an endpoint creates webhooks only for itself")
        owner = txn.one("SELECT * FROM endpoints WHERE id = ?", (principal.id,))
    elif spec.endpoint_id is None:
        raise ApiError("invalid_argument", "endpoint_id: name the owner endpoint")
    else:
        owner = own_endpoint(txn, principal, spec.endpoint_id)
    if owner["revoked_at"] is not None:
        raise ApiError("conflict", f"endpoint {owner['id']} is revoked")
    if spec.queue in RESERVED_QUEUES:
        raise ApiError("invalid_argument", f"queue: {spec.queue} is reserved")
    if not _human_grants_queue(txn, owner["human_id"], spec.queue):
        raise ApiError("invalid_argument", f"queue: no endpoint of the owner is scoped to {spec.queue}")
    # Creations for one endpoint take turns, so that each counts the others' webhooks (as the connections' quota).
    txn.lock_key("webhooks", owner["id"])
    count = txn.one("SELECT count(*) FROM webhooks WHERE endpoint_id = ?", (owner["id"],))[0]
    if count >= owner["webhook_max"]:
        raise ApiError("conflict", f"endpoint {owner['id']} already has its {owner['webhook_max']} webhooks")
    secret = _initial_secret(spec.provider, spec.secret)
    webhook_id = new_id("wh")
    token = secrets.token_urlsafe(16)
    trusted = trust_list(spec.provider, spec.trusted_actors)
    txn.execute("INSERT INTO webhooks (id, endpoint_id, provider, queue, trust_mode, token_hash, secret_sealed,"
                " trusted_actors, created_at, name) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (webhook_id, owner["id"], spec.provider, spec.queue,
                 "token" if spec.provider == "generic" else "signed", token_hash(token),
                 box.seal(secret, webhook_id) if secret else None, json.dumps(trusted) if trusted else None,
                 txn.now, spec.name))
    txn.logs.append(f"webhook {webhook_id} ({spec.provider}) created on {owner['id']}")
    made = {"id": webhook_id, "name": spec.name, "url": _ingest_url(base_url, token), "secret": secret,
            "provider": spec.provider,
            "queue": spec.queue, "trust_mode": "token" if spec.provider == "generic" else "signed",
            "endpoint_id": owner["id"], "trusted_actors": trusted}
    if trusted is not None and not trusted.get("allow_all") and not (trusted.get("logins") or
                                                                      trusted.get("actor_ids")):
        made["warning"] = ("no trusted actors yet: every delivery is held until you name them (PUT"
                           f" /api/v1/webhooks/{webhook_id}/trusted-actors, or `webhook trust {webhook_id}`)")
    return made


def trust_list(provider: str, spec: TrustLogins | TrustActorIds | TrustAll | None) -> dict | None:
    """The trusted actors a webhook of `provider` keeps: its own shape, or allow_all. A forge or cairn webhook
    without a list trusts no one (secure by default); the other providers have no gate at all."""
    kind = PROVIDER_TABLE[provider].trust
    if kind is None:
        if spec is not None:
            raise ApiError("invalid_argument", f"trusted_actors: a {provider} webhook has no trust gate"
                                               " (github, gitea and cairn have one)")
        return None
    if spec is None:
        return {"logins": [], "match": "sender"} if kind == "logins" else {"actor_ids": []}
    if not isinstance(spec, TrustAll) and not isinstance(spec, TrustLogins if kind == "logins" else TrustActorIds):
        raise ApiError("invalid_argument", f"trusted_actors: a {provider} webhook trusts {kind}, or allow_all")
    return spec.model_dump()


def set_trusted_actors(txn: Txn, principal: Principal, webhook_id: str, body: TrustedActors) -> dict:
    row = visible_webhook(txn, principal, webhook_id, "set_trusted_actors")
    trusted = trust_list(row["provider"], body.root)
    if trusted is None:
        raise ApiError("invalid_argument", f"trusted_actors: a {row['provider']} webhook has no trust gate")
    txn.execute("UPDATE webhooks SET trusted_actors = ? WHERE id = ?", (json.dumps(trusted), webhook_id))
    txn.logs.append(f"webhook {webhook_id} trusted actors set")
    return webhook_view(txn.one("SELECT * FROM webhooks WHERE id = ?", (webhook_id,)))


def add_trusted_actors(txn: Txn, principal: Principal, webhook_id: str, names: list[str],
                       match: str | None = None) -> dict:
    """`webhook trust WEBHOOK --add A,B`: the names join the webhook's list instead of replacing it (a name
    already on it is not added twice; logins compare ASCII case-insensitively, as the gate does), and `match`,
    when given, replaces the list's. A webhook that trusts every actor keeps doing so only by its human's
    choice: adding to it is refused, since a list would trust fewer."""
    txn.lock("webhooks", "id = ?", (webhook_id,))
    row = visible_webhook(txn, principal, webhook_id, "set_trusted_actors")
    kind = PROVIDER_TABLE[row["provider"]].trust
    if kind is None:
        raise ApiError("invalid_argument", f"trusted_actors: a {row['provider']} webhook has no trust gate")
    trusted = stored_json(row["trusted_actors"]) or trust_list(row["provider"], None)
    if trusted.get("allow_all"):
        raise ApiError("conflict", f"webhook {webhook_id} trusts every actor (allow_all); to trust only some, set"
                                   " the list with --trust A,B")
    if match is not None and kind != "logins":
        raise ApiError("invalid_argument", "--match is for github and gitea logins")
    fold = (lambda name: name.translate(ASCII_FOLD)) if kind == "logins" else (lambda name: name)
    listed = list(trusted[kind])
    known = {fold(name) for name in listed}
    for name in names:
        if fold(name) not in known:
            listed.append(name)
            known.add(fold(name))
    document = {**trusted, kind: listed, **({"match": match} if match is not None else {})}
    return set_trusted_actors(txn, principal, webhook_id, parse_model(TrustedActors, document))
def commands_of(stored: str | None) -> dict:
    """A webhook connection's `commands` as stored (NULL: nobody may command, and closing cancels)."""
    return {"logins": [], "on_close": "cancel", **(json.loads(stored) if stored else {})}


def _with_connections(txn: Txn, views: list[dict]) -> list[dict]:
    """Each webhook with the forge connection it writes through (its login is one of its trusted actors) and who
    may command through it, or None."""
    ids = [view["id"] for view in views]
    found = {r["webhook_id"]: {"id": r["connection_id"], "kind": r["kind"], "login": r["login"],
                               "mirror": bool(r["mirror"]),
                               "commands": commands_of(r["commands"])}
             for r in txn.all(f"SELECT wc.webhook_id, wc.connection_id, wc.mirror, wc.commands, c.kind, c.login"
                              f" FROM webhook_connections wc JOIN forge_connections c ON c.id = wc.connection_id"
                              f" WHERE wc.webhook_id IN ({', '.join('?' * len(ids))})", ids)} if ids else {}
    return [{**view, "connection": found.get(view["id"])} for view in views]


def list_webhooks(txn: Txn, principal: Principal) -> dict:
    if principal.kind == "endpoint":
        principal.require_verb("list_webhooks")
        rows = txn.all("SELECT * FROM webhooks WHERE endpoint_id = ? ORDER BY created_at, rowid", (principal.id,))
    elif principal.kind == "human":
        rows = txn.all("SELECT w.* FROM webhooks w JOIN endpoints e ON e.id = w.endpoint_id WHERE e.human_id = ?"
                       " ORDER BY w.created_at, w.id", (principal.human_id,))
    else:
        rows = txn.all("SELECT * FROM webhooks ORDER BY created_at, rowid")
    return {"webhooks": _with_connections(txn, [webhook_view(r) for r in rows])}


def get_webhook(txn: Txn, principal: Principal, webhook_id: str) -> dict:
    return _with_connections(txn, [webhook_view(visible_webhook(txn, principal, webhook_id, "list_webhooks"))])[0]


def rotate_webhook(txn: Txn, principal: Principal, box: SecretBox, webhook_id: str, base_url: str) -> dict:
    """A new URL (the old one is 404 at once) and a new secret: minted for the providers whose secrets we mint,
    cleared for Stripe and Slack, whose new secret the owner sets once the producer issued it."""
    row = visible_webhook(txn, principal, webhook_id, "rotate_webhook")
    token = secrets.token_urlsafe(16)
    secret = _initial_secret(row["provider"], None)
    txn.execute("UPDATE webhooks SET token_hash = ?, secret_sealed = ?, rotated_at = ? WHERE id = ?",
                (token_hash(token), box.seal(secret, webhook_id) if secret else None, txn.now, webhook_id))
    txn.logs.append(f"webhook {webhook_id} rotated")
    return {"id": webhook_id, "url": _ingest_url(base_url, token), "secret": secret, "provider": row["provider"],
            "queue": row["queue"], "trust_mode": row["trust_mode"], "endpoint_id": row["endpoint_id"]}


def update_webhook(txn: Txn, principal: Principal, webhook_id: str, body: WebhookUpdate) -> dict:
    """Rename a webhook (its human's label for it; null clears it)."""
    principal.require_human("renaming a webhook")
    visible_webhook(txn, principal, webhook_id, "update_webhook")
    txn.execute("UPDATE webhooks SET name = ? WHERE id = ?", (body.name, webhook_id))
    txn.logs.append(f"webhook {webhook_id} renamed")
    return webhook_view(txn.one("SELECT * FROM webhooks WHERE id = ?", (webhook_id,)))


def set_webhook_secret(txn: Txn, principal: Principal, box: SecretBox, webhook_id: str, body: WebhookSecret) -> dict:
    row = visible_webhook(txn, principal, webhook_id, "set_webhook_secret")
    secret = _initial_secret(row["provider"], body.secret)
    txn.execute("UPDATE webhooks SET secret_sealed = ? WHERE id = ?", (box.seal(secret, webhook_id), webhook_id))
    txn.logs.append(f"webhook {webhook_id} secret set")
    return webhook_view(txn.one("SELECT * FROM webhooks WHERE id = ?", (webhook_id,)))


def delete_webhook(txn: Txn, principal: Principal, webhook_id: str) -> dict:
    """The webhook and its routes go; its events stay for audit until retention prunes them."""
    visible_webhook(txn, principal, webhook_id, "delete_webhook")
    txn.execute("DELETE FROM webhooks WHERE id = ?", (webhook_id,))
    txn.logs.append(f"webhook {webhook_id} deleted")
    return {"id": webhook_id, "deleted": True}


def route_view(row: sqlite3.Row) -> dict:
    return {"webhook_id": row["webhook_id"], "endpoint_id": row["endpoint_id"], "granted_at": iso(row["granted_at"]),
            "granted_by": row["granted_by"]}


def add_route(txn: Txn, principal: Principal, webhook_id: str, body: RouteAdd) -> dict:
    """Another target for a webhook. Another human's endpoint needs that human's approved friend edge."""
    hook = visible_webhook(txn, principal, webhook_id, "add_webhook_route")
    owner_human = txn.one("SELECT human_id FROM endpoints WHERE id = ?", (hook["endpoint_id"],))["human_id"]
    target = txn.one("SELECT * FROM endpoints WHERE id = ?", (body.endpoint_id,))
    if target is None:
        raise ApiError("not_found", f"no endpoint {body.endpoint_id}")
    if target["human_id"] != owner_human and not txn.one(
            "SELECT 1 FROM friend_edges WHERE requester_id = ? AND approver_id = ? AND approved_at IS NOT NULL",
            (owner_human, target["human_id"])):
        raise ApiError("forbidden", "routing to another human's endpoint needs that human's approved friend edge")
    if target["revoked_at"] is not None:
        raise ApiError("conflict", f"endpoint {body.endpoint_id} is revoked")
    if target["id"] == hook["endpoint_id"]:
        raise ApiError("conflict", "the owner endpoint is always the first target")
    txn.execute("INSERT OR IGNORE INTO webhook_routes (webhook_id, endpoint_id, granted_at, granted_by)"
                " VALUES (?, ?, ?, ?)", (webhook_id, target["id"], txn.now, principal.actor))
    txn.logs.append(f"webhook {webhook_id} routes to {target['id']}")
    return route_view(txn.one("SELECT * FROM webhook_routes WHERE webhook_id = ? AND endpoint_id = ?",
                              (webhook_id, target["id"])))


def list_routes(txn: Txn, principal: Principal, webhook_id: str) -> dict:
    visible_webhook(txn, principal, webhook_id, "list_webhook_routes")
    return {"routes": [route_view(r) for r in txn.all(
        "SELECT * FROM webhook_routes WHERE webhook_id = ? ORDER BY granted_at, endpoint_id", (webhook_id,))]}


def remove_route(txn: Txn, principal: Principal, webhook_id: str, endpoint_id: str) -> dict:
    visible_webhook(txn, principal, webhook_id, "remove_webhook_route")
    if txn.execute("DELETE FROM webhook_routes WHERE webhook_id = ? AND endpoint_id = ?",
                   (webhook_id, endpoint_id)).rowcount == 0:
        raise ApiError("not_found", f"no route from {webhook_id} to {endpoint_id}")
    txn.logs.append(f"webhook {webhook_id} no longer routes to {endpoint_id}")
    return {"webhook_id": webhook_id, "endpoint_id": endpoint_id, "removed": True}


_TARGETS = ("SELECT e.* FROM (SELECT ? AS endpoint_id, 0 AS tier, 0 AS granted_at UNION ALL"
            " SELECT endpoint_id, 1, granted_at FROM webhook_routes WHERE webhook_id = ?) t"
            " JOIN endpoints e ON e.id = t.endpoint_id WHERE e.revoked_at IS NULL"
            " ORDER BY t.tier, t.granted_at, e.id")


def webhook_targets(txn: Txn, webhook: sqlite3.Row) -> list[sqlite3.Row]:
    """The fixed target order: the owner endpoint, then routes by grant time and endpoint id; live ones only."""
    return txn.all(_TARGETS, (webhook["endpoint_id"], webhook["id"]))


def read_targets_ahead(txn: Txn, endpoint_id: str, webhook_id: str) -> None:
    """webhook_targets, sent before the body knows it will route (a webhook's owner endpoint never changes)."""
    txn.read_ahead(_TARGETS, (endpoint_id, webhook_id))
