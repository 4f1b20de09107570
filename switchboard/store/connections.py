"""Forge connections (a human's sealed credential for GitHub or Gitea) and the connection each webhook writes
through, with its output policy."""

from __future__ import annotations

import json
import sqlite3

from switchboard.configuration import ApiError, iso
from switchboard.crypto import SecretBox, new_id
from switchboard.database import Txn
from switchboard.models import DEFAULT_OUTPUT_POLICY, ConnectionCreate, WebhookConnect
from switchboard.store.principals import Principal, owned_rows
from switchboard.store.webhooks import commands_of, visible_webhook

# A human's connections: each is a credential the sender opens, and a row of the Board's connections page.
MAX_CONNECTIONS = 20


def connection_view(row: sqlite3.Row, webhooks: list[str] | None = None) -> dict:
    view = {"id": row["id"], "kind": row["kind"], "api_url": row["api_url"], "login": row["login"],
            "repos": json.loads(row["repos"]), "created_at": iso(row["created_at"]),
            "last_used_at": iso(row["last_used_at"]), "last_error": row["last_error"]}
    return {**view, "webhooks": webhooks} if webhooks is not None else view


def _webhooks_of(txn: Txn, connection_id: str) -> list[str]:
    return [r["webhook_id"] for r in txn.all("SELECT webhook_id FROM webhook_connections WHERE connection_id = ?"
                                             " ORDER BY connected_at, webhook_id", (connection_id,))]


def own_connection(txn: Txn, principal: Principal, connection_id: str) -> sqlite3.Row:
    principal.require_human("forge connections")
    rows = owned_rows(txn, principal, "forge_connections", connection_id)
    if not rows:
        raise ApiError("not_found", f"no connection {connection_id}")
    return rows[0]


def add_connection(txn: Txn, principal: Principal, box: SecretBox, body: ConnectionCreate, login: str,
                   human_id: str | None = None) -> dict:
    """A connection whose token the forge said belongs to `login` (asked just before, outside the transaction).
    The token is sealed at once and never shown again."""
    principal.require_human("forge connections")
    owner = human_id or principal.human_id
    txn.lock_key("forge_connections", owner)
    held = txn.one("SELECT count(*) FROM forge_connections WHERE human_id = ?", (owner,))[0]
    if held >= MAX_CONNECTIONS:
        raise ApiError("conflict", f"this human already has {held} forge connections, the most one may have")
    connection_id = new_id("fc")
    txn.execute("INSERT INTO forge_connections (id, human_id, kind, api_url, token_sealed, login, repos, created_at,"
                " last_used_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (connection_id, owner, body.kind, body.api_url.rstrip("/"), box.seal(body.token, connection_id), login,
                 json.dumps(list(dict.fromkeys(body.repos))), txn.now, txn.now))
    txn.logs.append(f"forge connection {connection_id} ({body.kind}, as {login}) added for {owner}")
    return connection_view(txn.one("SELECT * FROM forge_connections WHERE id = ?", (connection_id,)), [])


def list_connections(txn: Txn, principal: Principal) -> dict:
    principal.require_human("forge connections")
    return {"connections": [connection_view(r, _webhooks_of(txn, r["id"]))
                            for r in owned_rows(txn, principal, "forge_connections")]}


def record_connection_test(txn: Txn, connection_id: str, error: str | None) -> None:
    if error is None:
        txn.execute("UPDATE forge_connections SET last_used_at = ?, last_error = NULL WHERE id = ?",
                    (txn.now, connection_id))
    else:
        txn.execute("UPDATE forge_connections SET last_error = ?, last_error_at = ? WHERE id = ?",
                    (error[:300], txn.now, connection_id))


def remove_connection(txn: Txn, principal: Principal, connection_id: str) -> dict:
    """The connection goes, and with it every webhook's use of it; its outputs not yet sent fail (their todos
    show why)."""
    txn.lock("forge_connections", "id = ?", (connection_id,))
    row = own_connection(txn, principal, connection_id)
    webhooks = _webhooks_of(txn, connection_id)
    txn.execute("UPDATE forge_outputs SET state = 'failed', error = 'the forge connection was removed'"
                " WHERE connection_id = ? AND state = 'pending'", (connection_id,))
    txn.execute("DELETE FROM forge_connections WHERE id = ?", (connection_id,))
    txn.logs.append(f"forge connection {connection_id} removed")
    return {**connection_view(row, webhooks), "removed": True}


# -- webhooks' connections --------------------------------------------------------------------------------

def webhook_connection_view(row: sqlite3.Row) -> dict:
    return {"webhook_id": row["webhook_id"], "connection_id": row["connection_id"], "kind": row["kind"],
            "login": row["login"], "mirror": bool(row["mirror"]), "policy": json.loads(row["policy"]),
            "commands": commands_of(row["commands"]),
            "connected_at": iso(row["connected_at"])}


_WEBHOOK_CONNECTION = ("SELECT wc.*, c.kind, c.login FROM webhook_connections wc"
                       " JOIN forge_connections c ON c.id = wc.connection_id WHERE wc.webhook_id = ?")


def _human_webhook(txn: Txn, principal: Principal, webhook_id: str) -> sqlite3.Row:
    principal.require_human("connecting a webhook to a forge")
    webhook = visible_webhook(txn, principal, webhook_id, "connect_webhook")
    return txn.one("SELECT w.*, e.human_id FROM webhooks w JOIN endpoints e ON e.id = w.endpoint_id WHERE w.id = ?",
                   (webhook["id"],))


def connect_webhook(txn: Txn, principal: Principal, webhook_id: str, body: WebhookConnect) -> dict:
    """The webhook writes through the connection (its own human's), under `policy` (DEFAULT_OUTPUT_POLICY when
    omitted), keeps a status comment on each issue when `mirror` is on, and takes commands from `commands.logins`
    (nobody when omitted). Replaces what it had."""
    webhook = _human_webhook(txn, principal, webhook_id)
    connection = txn.one("SELECT * FROM forge_connections WHERE id = ? AND human_id = ?",
                         (body.connection_id, webhook["human_id"]))
    if connection is None:
        raise ApiError("not_found", f"no connection {body.connection_id} of this webhook's human")
    if webhook["provider"] not in (connection["kind"], "generic"):
        raise ApiError("invalid_argument", f"connection_id: a {webhook['provider']} webhook cannot write through a"
                                           f" {connection['kind']} connection")
    policy = body.policy.model_dump(exclude_none=True) if body.policy is not None else DEFAULT_OUTPUT_POLICY
    commands = body.commands.model_dump() if body.commands is not None else None
    if commands is not None:
        commands["logins"] = list(dict.fromkeys(commands["logins"]))
    txn.execute("INSERT INTO webhook_connections (webhook_id, connection_id, mirror, policy, connected_at, commands)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (webhook_id) DO UPDATE SET"
                " connection_id = excluded.connection_id, mirror = excluded.mirror, policy = excluded.policy,"
                " connected_at = excluded.connected_at, commands = excluded.commands",
                (webhook_id, connection["id"], int(body.mirror), json.dumps(policy), txn.now,
                 json.dumps(commands) if commands is not None else None))
    txn.logs.append(f"webhook {webhook_id} writes through forge connection {connection['id']}")
    return webhook_connection_view(txn.one(_WEBHOOK_CONNECTION, (webhook_id,)))


def get_webhook_connection(txn: Txn, principal: Principal, webhook_id: str) -> dict:
    visible_webhook(txn, principal, webhook_id, "list_webhooks")
    row = txn.one(_WEBHOOK_CONNECTION, (webhook_id,))
    if row is None:
        raise ApiError("not_found", f"webhook {webhook_id} writes through no forge connection")
    return webhook_connection_view(row)


def disconnect_webhook(txn: Txn, principal: Principal, webhook_id: str) -> dict:
    _human_webhook(txn, principal, webhook_id)
    if txn.execute("DELETE FROM webhook_connections WHERE webhook_id = ?", (webhook_id,)).rowcount == 0:
        raise ApiError("not_found", f"webhook {webhook_id} writes through no forge connection")
    txn.logs.append(f"webhook {webhook_id} no longer writes through a forge connection")
    return {"webhook_id": webhook_id, "disconnected": True}


def connection_login(txn: Txn, webhook_id: str) -> str | None:
    """The login of the connection the webhook writes through: a trusted actor of the webhook, and the author
    whose comments are the server's own."""
    row = txn.one("SELECT c.login FROM webhook_connections wc JOIN forge_connections c ON c.id = wc.connection_id"
                  " WHERE wc.webhook_id = ?", (webhook_id,))
    return row["login"] if row else None
