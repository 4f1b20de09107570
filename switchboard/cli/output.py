"""How the CLI prints: tables and key-value text for people, JSON for scripts."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from switchboard.configuration import ApiError
from switchboard.payload import refuse_constant

# Each subcommand has its own handler (set with set_defaults); a handler takes the parsed arguments and an
# open Database and returns one JSON object, which --json prints as is and otherwise prints for people.

TABLE_COLUMNS = {
    "humans": ("id", "name", "login", "created_at"),
    "endpoints": ("id", "name", "queues", "verbs", "revoked_at"),
    "webhooks": ("id", "name", "provider", "queue", "endpoint_id", "secret_set", "pinged_at"),
    "todos": ("id", "state", "queue", "attempt", "updated_at", "title"),
    "events": ("id", "kind", "disposition", "verified", "received_at"),
    "routes": ("endpoint_id", "granted_at", "granted_by"),
    "friends": ("id", "requester_id", "approver_id", "approved_at"),
    "attempts": ("seq", "claimant", "claimed_at", "ended_at", "outcome", "summary"),
    "history": ("at", "actor", "from", "to", "evidence"),
    "queues": ("queue", "paused", "in_flight", "claims_in_window", "pending"),
    "connections": ("id", "kind", "login", "api_url", "repos", "last_used_at", "last_error"),
    "subjects": ("key", "state", "open_todos", "queues", "last_activity_at", "title"),
    "outputs": ("id", "type", "state", "target", "error", "sent_at"),
    "timeline": ("at", "type", "todo_id", "queue", "kind", "action", "sender", "rule", "actor", "what"),
}


def _cell(value: Any, width: int = 48) -> str:
    if value is None:
        return "-"
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        text = ",".join(value)
    elif isinstance(value, (dict, list)):
        text = json.dumps(value, ensure_ascii=False)
    else:
        text = str(value)
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def format_table(rows: list[dict], columns: Iterable[str]) -> str:
    """Rows as aligned columns under an upper-case header (the last column is not padded)."""
    columns = list(columns)
    cells = [[c.upper() for c in columns]] + [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in cells)


def format_for_people(obj: dict) -> str:
    """Scalars as `key: value` lines, lists of objects as tables; a bare listing is just its table."""
    if len(obj) == 1 and isinstance(next(iter(obj.values())), list):
        key, rows = next(iter(obj.items()))
        if not rows:
            return f"(no {key})"
        if all(isinstance(r, dict) for r in rows):
            return format_table(rows, TABLE_COLUMNS.get(key) or [k for k, v in rows[0].items()
                                                                  if not isinstance(v, (dict, list))])
    lines: list[str] = []
    for key, value in obj.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            columns = TABLE_COLUMNS.get(key) or [k for k, v in value[0].items() if not isinstance(v, (dict, list))]
            lines += ["", f"{key}:", format_table(value, columns)]
        elif isinstance(value, list) and not value:
            lines.append(f"{key}: (none)")
        elif value is not None:
            lines.append(f"{key}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")
    return "\n".join(lines).strip("\n")


def print_answer(args: argparse.Namespace, obj: dict) -> None:
    print(json.dumps(obj) if args.json else format_for_people(obj))


def read_json_file(path: str) -> Any:
    try:
        return json.loads(Path(path).read_text(), parse_constant=refuse_constant)
    except (OSError, ValueError, RecursionError) as exc:
        raise ApiError("invalid_argument", f"{path}: not a readable JSON file ({type(exc).__name__})") from None


def write_private(path: str, obj: dict) -> str:
    """Credentials the CLI writes to a file: created (or truncated) with mode 0600, never left readable."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(obj) + "\n")
    return str(Path(path).resolve())


def with_out(args: argparse.Namespace, made: dict) -> dict:
    if getattr(args, "out", None):
        write_private(args.out, made)
    return made


def existing(args: argparse.Namespace, found: dict, what: str, credential: str | None) -> dict:
    """--if-missing found `what` made already: its answer, marked `existing`, and nothing made. A `credential`
    (token, secret) was shown once, by the run that made it: a --out file must hold that run's answer (the same
    id), or the command fails loudly rather than leave a file without it; the file is never rewritten. An answer
    without a credential is written to --out as usual."""
    out = getattr(args, "out", None)
    if out is not None and credential is not None:
        try:
            saved = json.loads(Path(out).read_text())
        except (OSError, ValueError):
            saved = None
        if not isinstance(saved, dict) or saved.get("id") != found["id"]:
            raise ApiError("conflict", f"{what} exists ({found['id']}) but {out} does not hold it: its {credential}"
                                       " was shown once, to the run that made it; restore that file, or replace"
                                       f" the {what.split()[0]} (its {credential} cannot be shown again)")
        return {**found, "existing": True}
    return with_out(args, {**found, "existing": True})
