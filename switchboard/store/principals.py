"""Principals, humans, endpoints and friends: who may do what, as transaction bodies."""

from __future__ import annotations

import hmac
import json
import re
import sqlite3
from dataclasses import dataclass
from typing import Literal

from switchboard.configuration import ApiError, iso
from switchboard.crypto import new_id, new_token, token_hash
from switchboard.database import Txn
from switchboard.models import EndpointCreate, FriendRequest, HumanNote

# Every function here is a transaction body `fn(txn, ...)` run by Database.write or Database.read.
# Isolation lives here: every query a caller can reach is filtered by the caller's principal.

@dataclass(frozen=True)
class Principal:
    kind: Literal["endpoint", "human", "operator"]
    id: str
    human_id: str | None = None
    name: str = ""
    queues: tuple[str, ...] = ()
    verbs: frozenset[str] = frozenset()
    default_lease_seconds: int | None = None
    def recheck(self, digest: str) -> tuple[str, tuple]:
        """The statement (and its parameters) that finds a row only while the token whose hash is `digest` still
        names this principal: an endpoint's token is its own for good, until it is revoked; a human's is replaced
        by a new one. Run by each transaction acting for a principal a process remembered (Flows.principal)."""
        if self.kind == "endpoint":
            return "SELECT 1 FROM endpoints WHERE id = ? AND revoked_at IS NULL", (self.id,)
        return "SELECT 1 FROM humans WHERE id = ? AND token_hash = ?", (self.id, digest)

    @property
    def actor(self) -> str:
        return {"endpoint": f"endpoint:{self.id}", "human": f"human:{self.id}"}.get(self.kind, "system")

    def require_verb(self, verb: str) -> None:
        if self.kind != "endpoint":
            raise ApiError("forbidden", f"{verb} is an endpoint verb; use an endpoint token")
        if verb not in self.verbs:
            raise ApiError("forbidden", f"verb {verb} is outside this endpoint's scope")

    def require_human(self, action: str) -> None:
        if self.kind == "endpoint":
            raise ApiError("forbidden", f"{action} needs a human token")


OPERATOR = Principal(kind="operator", id="operator")


def authenticate(txn: Txn, token: str) -> Principal | None:
    digest = token_hash(token)
    if token.startswith("sbk_"):
        row = txn.one("SELECT * FROM endpoints WHERE token_hash = ? AND revoked_at IS NULL", (digest,))
        if row is None or not hmac.compare_digest(row["token_hash"], digest):
            return None
        return Principal(kind="endpoint", id=row["id"], human_id=row["human_id"], name=row["name"],
                         queues=tuple(json.loads(row["queues"])), verbs=frozenset(json.loads(row["verbs"])),
                         default_lease_seconds=row["default_lease_seconds"])
    if token.startswith("sbh_"):
        row = txn.one("SELECT * FROM humans WHERE token_hash = ?", (digest,))
        if row is None or not hmac.compare_digest(row["token_hash"], digest):
            return None
        return Principal(kind="human", id=row["id"], human_id=row["id"], name=row["name"])
    return None


# -- humans and endpoints --------------------------------------------------------------------------

def human_view(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "name": row["name"], "login": row["login"], "token_prefix": row["token_prefix"],
            "created_at": iso(row["created_at"])}


LOGIN_PATTERN = re.compile(r"[!-~]{1,254}")


def normal_login(login: str) -> str:
    """A login as it is kept and compared: 1 to 254 printable ASCII characters without spaces, lower-cased. The
    proxies' logins (usernames, e-mail addresses, GitHub logins) name one account whatever their case, so two
    humans can never hold logins that differ only in case."""
    if not LOGIN_PATTERN.fullmatch(login):
        raise ApiError("invalid_argument", "login: 1 to 254 printable ASCII characters, without spaces")
    return login.lower()


def _claim_login(txn: Txn, human_id: str, login: str) -> str:
    login = normal_login(login)
    holder = txn.one("SELECT name FROM humans WHERE login = ? AND id <> ?", (login, human_id))
    if holder is not None:
        raise ApiError("conflict", f"login {login!r} already signs in {holder['name']}")
    return login


def add_human(txn: Txn, name: str, login: str | None = None) -> dict:
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", name):
        raise ApiError("invalid_argument", "name: letters, digits, '.', '_' and '-', at most 64")
    if txn.one("SELECT 1 FROM humans WHERE name = ?", (name,)):
        raise ApiError("conflict", f"human {name!r} already exists")
    token = new_token("sbh")
    human_id = new_id("hu")
    login = _claim_login(txn, human_id, login) if login is not None else None
    txn.execute("INSERT INTO humans (id, name, token_hash, token_prefix, created_at, login) VALUES (?, ?, ?, ?, ?, ?)",
                (human_id, name, token_hash(token), token[:12], txn.now, login))
    txn.logs.append(f"human {human_id} added")
    # The shape SPEC section 9 names, and the login when one was given.
    return {"id": human_id, "name": name, "token": token, **({"login": login} if login else {})}


def set_human_login(txn: Txn, name_or_id: str, login: str) -> dict:
    """Tie a human to the login an identity proxy names them by (`serve --auth-header`)."""
    human = find_human(txn, name_or_id)
    txn.lock("humans", "id = ?", (human["id"],))
    txn.execute("UPDATE humans SET login = ? WHERE id = ?", (_claim_login(txn, human["id"], login), human["id"]))
    txn.logs.append(f"human {human['id']} login set")
    return human_view(txn.one("SELECT * FROM humans WHERE id = ?", (human["id"],)))


def find_human_by_login(txn: Txn, login: str) -> sqlite3.Row | None:
    return txn.one("SELECT * FROM humans WHERE login = ?", (normal_login(login),))


def reissue_human_token(txn: Txn, name_or_id: str) -> dict:
    """A new human token (shown once); the old one stops working at once, and every Board session signed in
    with it ends. The human's endpoints, webhooks and work are untouched."""
    human = find_human(txn, name_or_id)
    txn.lock("humans", "id = ?", (human["id"],))
    token = new_token("sbh")
    txn.execute("UPDATE humans SET token_hash = ?, token_prefix = ? WHERE id = ?",
                (token_hash(token), token[:12], human["id"]))
    ended = txn.execute("DELETE FROM board_sessions WHERE human_id = ?", (human["id"],)).rowcount
    txn.logs.append(f"human {human['id']} token reissued, {ended} board session(s) ended")
    return {"id": human["id"], "name": human["name"], "token": token, "token_prefix": token[:12],
            "sessions_ended": ended}


def reissue_own_token(txn: Txn, principal: Principal) -> dict:
    """POST /api/v1/me/token: a human rotates their own token."""
    principal.require_human("a new human token")
    return reissue_human_token(txn, principal.id)


def list_humans(txn: Txn) -> dict:
    return {"humans": [human_view(r) for r in txn.all("SELECT * FROM humans ORDER BY created_at, rowid")]}


def find_human(txn: Txn, name_or_id: str) -> sqlite3.Row:
    row = txn.one("SELECT * FROM humans WHERE id = ? OR name = ?", (name_or_id, name_or_id))
    if row is None:
        raise ApiError("not_found", f"no human {name_or_id!r}")
    return row


def endpoint_view(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "human_id": row["human_id"], "name": row["name"],
            "queues": json.loads(row["queues"]), "verbs": json.loads(row["verbs"]),
            "default_lease_seconds": row["default_lease_seconds"], "webhook_max": row["webhook_max"],
            "token_prefix": row["token_prefix"], "created_at": iso(row["created_at"]),
            "revoked_at": iso(row["revoked_at"])}


def vend_endpoint(txn: Txn, human_id: str, spec: EndpointCreate) -> dict:
    if txn.one("SELECT 1 FROM endpoints WHERE human_id = ? AND name = ?", (human_id, spec.name)):
        raise ApiError("conflict", f"endpoint name {spec.name!r} is taken")
    token = new_token("sbk")
    endpoint_id = new_id("ep")
    txn.execute(
        "INSERT INTO endpoints (id, human_id, name, token_hash, token_prefix, queues, verbs,"
        " default_lease_seconds, webhook_max, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (endpoint_id, human_id, spec.name, token_hash(token), token[:12], json.dumps(spec.queues),
         json.dumps(spec.expanded_verbs()), spec.default_lease_seconds, spec.webhook_max, txn.now))
    txn.logs.append(f"endpoint {endpoint_id} vended for {human_id}")
    view = endpoint_view(txn.one("SELECT * FROM endpoints WHERE id = ?", (endpoint_id,)))
    return {**view, "token": token}


def own_endpoint(txn: Txn, principal: Principal, endpoint_id: str) -> sqlite3.Row:
    rows = owned_rows(txn, principal, "endpoints", endpoint_id)
    if not rows:
        raise ApiError("not_found", f"no endpoint {endpoint_id}")
    return rows[0]


def owned_rows(txn: Txn, principal: Principal, table: str, row_id: str | None = None) -> list[sqlite3.Row]:
    """Rows of a table keyed by human (endpoints, notification channels) that the principal owns: the
    operator owns them all. `table` is always a name from this module, never input."""
    sql, args = f"SELECT * FROM {table} WHERE (human_id = ? OR ? = 1)", [principal.human_id, principal.kind == "operator"]
    if row_id is not None:
        sql += " AND id = ?"
        args.append(row_id)
    return txn.all(sql + " ORDER BY created_at, rowid", args)


def list_endpoints(txn: Txn, principal: Principal) -> dict:
    return {"endpoints": [endpoint_view(r) for r in owned_rows(txn, principal, "endpoints")]}


def me(txn: Txn, principal: Principal) -> dict:
    if principal.kind == "endpoint":
        return {"kind": "endpoint", **endpoint_view(txn.one("SELECT * FROM endpoints WHERE id = ?", (principal.id,)))}
    return {"kind": "human", **human_view(txn.one("SELECT * FROM humans WHERE id = ?", (principal.id,)))}


# -- friends ----------------------------------------------------------------------------------------

def friend_view(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "requester_id": row["requester_id"], "approver_id": row["approver_id"],
            "requested_at": iso(row["requested_at"]), "approved_at": iso(row["approved_at"])}


def friend_request(txn: Txn, principal: Principal, body: FriendRequest) -> dict:
    """`principal` asks `body.human` for leave to route webhooks to that human's endpoints."""
    principal.require_human("friend requests")
    other = find_human(txn, body.human)
    if other["id"] == principal.human_id:
        raise ApiError("invalid_argument", "human: a friend edge joins two different humans")
    row = txn.one("SELECT * FROM friend_edges WHERE requester_id = ? AND approver_id = ?", (principal.human_id, other["id"]))
    if row is None:
        edge_id = new_id("fr")
        txn.execute("INSERT INTO friend_edges (id, requester_id, approver_id, requested_at) VALUES (?, ?, ?, ?)",
                    (edge_id, principal.human_id, other["id"], txn.now))
        row = txn.one("SELECT * FROM friend_edges WHERE id = ?", (edge_id,))
        txn.logs.append(f"friend edge {edge_id} requested by {principal.human_id}")
    return friend_view(row)


def friend_approve(txn: Txn, principal: Principal, edge_id: str, body: HumanNote | None = None) -> dict:
    principal.require_human("approving friend requests")
    row = txn.one("SELECT * FROM friend_edges WHERE id = ? AND approver_id = ?", (edge_id, principal.human_id))
    if row is None:
        raise ApiError("not_found", f"no friend request {edge_id}")
    if row["approved_at"] is None:
        txn.execute("UPDATE friend_edges SET approved_at = ? WHERE id = ?", (txn.now, edge_id))
        txn.logs.append(f"friend edge {edge_id} approved by {principal.human_id}")
    return friend_view(txn.one("SELECT * FROM friend_edges WHERE id = ?", (edge_id,)))


def list_friends(txn: Txn, principal: Principal) -> dict:
    principal.require_human("friend edges")
    rows = txn.all("SELECT * FROM friend_edges WHERE requester_id = ? OR approver_id = ? ORDER BY requested_at, id",
                   (principal.human_id, principal.human_id))
    return {"friends": [friend_view(r) for r in rows]}


def friend_link(txn: Txn, requester: str, approver: str) -> dict:
    """The operator's shortcut: `requester` asks and `approver` approves, in one step."""
    asking = find_human(txn, requester)
    edge = friend_request(txn, Principal(kind="human", id=asking["id"], human_id=asking["id"]),
                          FriendRequest(human=approver))
    granting = find_human(txn, approver)
    return friend_approve(txn, Principal(kind="human", id=granting["id"], human_id=granting["id"]), edge["id"])
