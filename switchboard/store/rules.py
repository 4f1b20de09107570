"""Rule sets: static checks, targets, and their storage."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from switchboard.configuration import RESERVED_QUEUES, ApiError
from switchboard.database import Txn
from switchboard.envelope import stored_envelope
from switchboard.evaluator import DRY_RUN_EVENTS, read_rule
from switchboard.models import QueueAction, Rule
from switchboard.store.deliveries import EVENT_WITH_BODY, plan_targets
from switchboard.store.principals import Principal
from switchboard.store.webhooks import visible_webhook, webhook_targets

# -- rules ------------------------------------------------------------------------------------------

MAX_RULES = 32
MAX_EXPR_BYTES = 4096
MAX_PARAMS_BYTES = 16 << 10


def rule_label(index: int, rule: Rule) -> str:
    return f"rules[{index}] (id {rule.id!r})"


def check_rules_statically(rules: list[Rule], params: dict) -> None:
    """Everything about a rule set that needs neither the database nor the evaluator."""
    if len(rules) > MAX_RULES:
        raise ApiError("invalid_argument", f"rules: at most {MAX_RULES} rules, got {len(rules)}")
    seen: set[str] = set()
    for index, rule in enumerate(rules):
        label = rule_label(index, rule)
        if rule.id in seen:
            raise ApiError("invalid_argument", f"{label}: id is repeated")
        seen.add(rule.id)
        size = len(rule.expr.encode())
        if not rule.expr.strip() or size > MAX_EXPR_BYTES:
            raise ApiError("invalid_argument", f"{label}: expr must be 1..{MAX_EXPR_BYTES} bytes")
        if "\x00" in rule.expr:
            raise ApiError("invalid_argument", f"{label}: expr holds a NUL byte")
        text = read_rule(rule.expr)
        if text.continued_comment:
            raise ApiError("invalid_argument", f"{label}: a comment may not end with a backslash")
        forbidden = text.forbidden()
        if forbidden:
            raise ApiError("invalid_argument", f"{label}: {forbidden[0]} is not allowed in rules")
    try:
        encoded = json.dumps(params, allow_nan=False)
    except ValueError:
        raise ApiError("invalid_argument", "params: NaN and Infinity are not JSON") from None
    if len(encoded.encode()) > MAX_PARAMS_BYTES:
        raise ApiError("invalid_argument", f"params: over {MAX_PARAMS_BYTES} bytes")
    for name, value in params.items():
        if not _param_value_ok(value):
            raise ApiError("invalid_argument", f"params.{name}: a string, number, bool, or a list of all strings"
                                               " or all numbers")


def _param_value_ok(value: Any) -> bool:
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if isinstance(value, (str, bool)) or number(value):
        return True
    return isinstance(value, list) and (all(isinstance(v, str) for v in value) or all(number(v) for v in value))


def check_rule_targets(txn: Txn, webhook: sqlite3.Row, rules: list[Rule], default: Any) -> None:
    """Every queue action must be receivable by some target; `exclusive` needs a target scoped to its queue."""
    targets = webhook_targets(txn, webhook)
    target_ids = {t["id"] for t in targets}
    actions = [(rule_label(i, r), r.action) for i, r in enumerate(rules)] + [("default_action", default)]
    for label, action in actions:
        if not isinstance(action, QueueAction):
            continue
        if action.queue in RESERVED_QUEUES:
            raise ApiError("invalid_argument", f"{label}: queue {action.queue} is reserved")
        unknown = [e for e in action.endpoints or () if e not in target_ids]
        if unknown:
            raise ApiError("invalid_argument", f"{label}: endpoint {unknown[0]} is not a target of this webhook")
        if not plan_targets(txn, webhook, action.model_dump()):
            what = "exclusive delivery has no target scoped to" if action.exclusive else "no target endpoint receives"
            raise ApiError("invalid_argument", f"{label}: {what} queue {action.queue}")


def rules_view(webhook: sqlite3.Row) -> dict:
    stored = json.loads(webhook["rules"]) if webhook["rules"] else {"rules": [], "default_action": None}
    return {"webhook_id": webhook["id"], "rules": stored["rules"], "default_action": stored.get("default_action"),
            "params": json.loads(webhook["params"])}


def get_rules(txn: Txn, principal: Principal, webhook_id: str) -> dict:
    return rules_view(visible_webhook(txn, principal, webhook_id, "get_webhook_rules"))


def latest_envelopes(txn: Txn, webhook_id: str) -> list[tuple[str, bytes]]:
    rows = txn.all(f"{EVENT_WITH_BODY} WHERE webhook_id = ? AND envelope IS NOT NULL"
                   " ORDER BY received_at DESC, id DESC LIMIT ?", (webhook_id, DRY_RUN_EVENTS))
    return [(r["id"], json.dumps(stored_envelope(r["envelope"], r["headers"], r["body"])).encode()) for r in rows]


def save_rules(txn: Txn, principal: Principal, webhook_id: str, rules: list[Rule], default: Any,
               params: dict | None) -> dict:
    webhook = visible_webhook(txn, principal, webhook_id, "set_webhook_rules")
    check_rule_targets(txn, webhook, rules, default)
    stored = {"rules": [r.model_dump(exclude_none=True) for r in rules],
              "default_action": default.model_dump(exclude_none=True) if default else None}
    txn.execute("UPDATE webhooks SET rules = ?, params = COALESCE(?, params) WHERE id = ?",
                (json.dumps(stored), json.dumps(params) if params is not None else None, webhook_id))
    txn.logs.append(f"webhook {webhook_id} rules set: {len(rules)} rules")
    return rules_view(txn.one("SELECT * FROM webhooks WHERE id = ?", (webhook_id,)))
