"""The operator's commands for forge connections, webhooks' connections and subjects."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from switchboard.cli.output import existing, read_json_file, with_out
from switchboard.configuration import ApiError
from switchboard.crypto import SecretBox, sealed_sample
from switchboard.database import Database
from switchboard.models import ConnectionCreate, SubjectListQuery, WebhookConnect, parse_model
from switchboard.store.connections import (
    add_connection,
    connect_webhook,
    connection_view,
    disconnect_webhook,
    list_connections,
)
from switchboard.store.connections import remove_connection as remove_connection_body
from switchboard.store.principals import OPERATOR, find_human
from switchboard.store.subjects import list_subjects, subject_answer

if TYPE_CHECKING:
    from switchboard.forge import ForgeSender


def _sender(args: argparse.Namespace, db: Database) -> ForgeSender:
    """The forge module's sender, for one question to a forge from here (it and asyncio load with the command that
    asks: every other command starts without them)."""
    from switchboard.forge import ForgeSender
    from switchboard.notifier import Addresses

    return ForgeSender(db, SecretBox.for_database(args.db, db.read_sync(sealed_sample), args.key_file), Addresses.configured())


def read_token_file(path: str) -> str:
    """A credential from a file only its owner may read (the token never goes on a command line)."""
    try:
        mode = os.stat(path).st_mode
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise ApiError("invalid_argument", f"--token-file {path}: cannot be read ({exc.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ApiError("invalid_argument", f"--token-file {path}: others may read it; chmod 600 it first")
    if not text:
        raise ApiError("invalid_argument", f"--token-file {path}: is empty")
    return text


def cli_connection_add(args: argparse.Namespace, db: Database) -> dict:
    """Ask the forge who the token is (from here, under this command's own allowance of internal addresses:
    SWITCHBOARD_NOTIFY_ALLOW_PRIVATE, SWITCHBOARD_NOTIFY_ALLOW), then store the connection with its sealed token."""
    import asyncio

    from switchboard.forge import REFUSED_FORGE, token_login
    from switchboard.notifier import COMMAND_ALLOWANCE

    human = db.read_sync(find_human, args.human)
    body = parse_model(ConnectionCreate, {"kind": args.kind, "api_url": args.api, "token": read_token_file(
        args.token_file), "repos": [r.strip() for r in args.repos.split(",") if r.strip()]})
    if args.if_missing:
        found = _connection_to(db, human["id"], body)
        if found is not None:
            return existing(args, found, f"connection to {body.api_url}", None)
    sender = _sender(args, db)
    # Checked here first, so that a refusal names what allows it for this command (not serve's flags).
    asyncio.run(sender.addresses.vet(body.api_url, f"api_url: {REFUSED_FORGE} ({COMMAND_ALLOWANCE})"))
    login = asyncio.run(token_login(sender, body.kind, body.api_url, body.token))
    return with_out(args, db.write_sync(add_connection, OPERATOR, sender.box, body, login, human["id"]))


def _connection_to(db: Database, human_id: str, body: ConnectionCreate) -> dict | None:
    """The human's connection of that kind to that API, for --if-missing: reused only for the same repos (its
    token stays as it is: `connection remove` and add again replaces it)."""
    rows = db.read_sync(lambda txn: txn.all("SELECT * FROM forge_connections WHERE human_id = ? AND kind = ? AND"
                                            " api_url = ? ORDER BY created_at, id",
                                            (human_id, body.kind, body.api_url.rstrip("/"))))
    if not rows:
        return None
    found = connection_view(rows[0])
    if len(rows) > 1 or found["repos"] != list(dict.fromkeys(body.repos)):
        raise ApiError("conflict", f"{len(rows)} connection(s) of this human to {body.api_url} exist"
                                   f" ({', '.join(r['id'] for r in rows)}, repos {', '.join(found['repos'])}): remove"
                                   " them, or add with the same --repos")
    return found


def cli_connection_list(args: argparse.Namespace, db: Database) -> dict:
    return db.read_sync(list_connections, OPERATOR)


def cli_connection_test(args: argparse.Namespace, db: Database) -> dict:
    import asyncio

    from switchboard.forge import test_connection

    answer = asyncio.run(test_connection(_sender(args, db), OPERATOR, args.id))
    if not answer["ok"]:
        raise ApiError("unavailable", f"connection {args.id} does not work: {answer['error']}")
    return answer


def cli_connection_remove(args: argparse.Namespace, db: Database) -> dict:
    return db.write_sync(remove_connection_body, OPERATOR, args.id)


def cli_webhook_connect(args: argparse.Namespace, db: Database) -> dict:
    fields = {"connection_id": args.connection, "mirror": args.mirror}
    if args.policy is not None:
        fields["policy"] = read_json_file(args.policy)
    if args.commanders is not None or args.on_close is not None:
        fields["commands"] = {"logins": [name.strip() for name in (args.commanders or "").split(",") if name.strip()],
                              **({"on_close": args.on_close} if args.on_close else {})}
    return db.write_sync(connect_webhook, OPERATOR, args.webhook, parse_model(WebhookConnect, fields))


def cli_webhook_disconnect(args: argparse.Namespace, db: Database) -> dict:
    return db.write_sync(disconnect_webhook, OPERATOR, args.webhook)


def cli_subject_show(args: argparse.Namespace, db: Database) -> dict:
    answer = db.read_sync(subject_answer, OPERATOR, args.key)
    return answer if args.json else {**answer, "timeline": [_timeline_line(e) for e in answer["timeline"]]}


def _timeline_line(entry: dict) -> dict:
    """A timeline entry on one table line for people: who did it (sender, actor), by which rule, in which queue,
    and what happened in words."""
    if entry["type"] == "delivery":
        made = f" -> {','.join(entry['todos'])}" if entry.get("todos") else ""
        what = f"{entry['disposition']}{' (' + entry['cause'] + ')' if entry.get('cause') else ''}{made}"
    elif entry["type"] == "transition":
        what = f"{entry['from'] or 'new'} -> {entry['to']}"
    elif entry["type"] == "output":
        what = f"{entry['output_type']} {entry['state']}{': ' + entry['error'] if entry.get('error') else ''}"
    else:
        what = f"absorbed {','.join(entry.get('absorbed') or []) or 'nothing'}"
    return {"at": entry["at"], "type": entry["type"], "todo_id": entry.get("todo_id"), "queue": entry.get("queue"),
            "kind": entry.get("kind"), "action": entry.get("action"), "sender": entry.get("sender"),
            "rule": entry.get("rule_id"), "actor": entry.get("actor"), "what": what}


def cli_subject_list(args: argparse.Namespace, db: Database) -> dict:
    query = parse_model(SubjectListQuery, {k: v for k, v in (("q", args.q), ("state", args.state),
                                                             ("provider", args.provider), ("limit", args.limit),
                                                             ("cursor", args.cursor)) if v is not None})
    return db.read_sync(list_subjects, OPERATOR, query)
