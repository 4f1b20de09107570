"""Routing decisions: the evaluator's side of the store (the rules' verdict for a delivery, dry runs)."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from switchboard.configuration import ApiError
from switchboard.database import Database, Txn
from switchboard.envelope import actor_view, build_envelope, stored_envelope
from switchboard.evaluator import Evaluator, combined_program, fault_detail, forbidden_in_program
from switchboard.models import Rule, RuleSet, RulesTest, parse_model
from switchboard.store.connections import connection_login
from switchboard.store.deliveries import EVENT_WITH_BODY, plan_delivery
from switchboard.store.principals import Principal
from switchboard.store.rules import (
    check_rule_targets,
    check_rules_statically,
    latest_envelopes,
    rule_label,
    rules_view,
    save_rules,
)
from switchboard.store.todos import dump_json, stored_json
from switchboard.store.webhooks import visible_webhook

# -- routing decisions (the evaluator's side of the store) ------------------------------------------

# Forge events that say someone commented: the server's own comments (outputs, status comments) come back as these.
COMMENT_KINDS = frozenset({"issue_comment", "pull_request_review_comment", "pull_request_comment", "commit_comment",
                           "discussion_comment"})


def gate(envelope: dict) -> tuple[dict, dict] | None:
    """What is decided before any rule runs. A producer's hello (GitHub's `ping`, sent when a webhook is
    created) proves the secret and is recorded, but is never work. A comment the webhook's own forge connection
    wrote (an output, the status comment) is the server's own echo: dropped, reason `own_output`."""
    if envelope["source"] == "github" and envelope["kind"] == "ping":
        return {"ping": True}, {"stage": "ping", "action": {"ping": True}}
    if envelope["actor"].get("via_connection") and envelope["kind"] in COMMENT_KINDS:
        action = {"drop": True}
        return action, {"stage": "own_output", "cause": "own_output", "action": action}
    return None


def trust_gate(actor: dict, action: dict, trace: dict) -> tuple[dict, dict]:
    """The trust gate, after the rules: a delivery whose `actor` (the envelope's) the webhook does not trust is held for its human
    when the rules would make work of it (route it, hold it, or fault on it), under `trace.rules` what they said.
    One the rules drop stays dropped, its trace saying the gate would have held it: a public repository's chatter
    (an outsider's "+1") costs the human nothing."""
    if actor["trusted"] is not False or action.get("ping"):
        return action, trace
    if action.get("drop"):
        return action, {**trace, "trust_gate": "untrusted_actor"}
    held = {"quarantine": True}
    return held, {"stage": "trust_gate", "cause": "untrusted_actor", "action": held, "rules": trace}


def decide(evaluator: Evaluator, rules: list[dict], default: dict | None, params: dict, fallback_queue: str,
           doc: bytes, tenant: str | None = None) -> tuple[dict, dict]:
    """The action for one envelope and the trace saying why. No rules: the child is never touched."""
    if not rules:
        fallback = default or {"queue": fallback_queue}
        return fallback, {"stage": "default", "cause": "no_rules", "action": fallback}
    return verdict(rules, default, fallback_queue, evaluator.run([r["expr"] for r in rules], params, doc, tenant))


def verdict(rules: list[dict], default: dict | None, fallback_queue: str, result: dict) -> tuple[dict, dict]:
    """The action and trace for the evaluator's result over a rule set that has rules."""
    fallback = default or {"queue": fallback_queue}
    if "match" in result:
        rule = rules[result["match"]]
        return rule["action"], {"stage": "rule", "rule_index": result["match"], "rule_id": rule["id"],
                                "rule_name": rule.get("name"), "action": rule["action"]}
    if result.get("none"):
        return fallback, {"stage": "default", "cause": "no_match_default", "action": fallback}
    index = result["rule_index"]
    fault = {"rule_index": index, "rule_id": rules[index]["id"] if index is not None else None,
             "cause": result["fault"], "detail": result["detail"]}
    action = {"quarantine": True}
    return action, {"stage": "fault", "cause": result["fault"], "rule_index": index, "rule_id": fault["rule_id"],
                    "action": action, "faults": [fault]}


def decide_for_webhook(evaluator: Evaluator, webhook: sqlite3.Row, doc: bytes,
                       tenant: str | None = None) -> tuple[dict, dict]:
    stored = rules_view(webhook)
    return decide(evaluator, stored["rules"], stored["default_action"], stored["params"], webhook["queue"], doc,
                  tenant)


def _first_faulting_rule(evaluator: Evaluator, rules: list[dict], params: dict, doc: bytes,
                         tenant: str | None) -> int | None:
    """Pin a fault the one-pass program could not attribute (a timeout) by running the rules one by one."""
    for index, rule in enumerate(rules):
        result = evaluator.run([rule["expr"]], params, doc, tenant)
        if "fault" in result:
            return index
        if "match" in result:
            return None
    return None


def validate_rule_set(evaluator: Evaluator, rules: list[Rule], params: dict, tenant: str | None = None) -> None:
    """Static checks, then a compile of each rule and of the combined program in the sandbox."""
    check_rules_statically(rules, params)
    exprs = [r.expr for r in rules]
    for error in evaluator.compile_errors(exprs, params, tenant):
        raise ApiError("invalid_argument", f"{rule_label(error['index'], rules[error['index']])}: "
                                           f"{fault_detail(error['detail'])}")
    program = combined_program(tuple(exprs))
    # What runs is the combined program: its identifiers are checked as jq will read them.
    forbidden = forbidden_in_program(program)
    if forbidden:
        raise ApiError("invalid_argument", f"rules: {forbidden[0]} is not allowed in rules")
    if exprs and evaluator.compile_errors([program], params, tenant):
        raise ApiError("invalid_argument", "rules: the rules do not combine into one program")


def set_rules(db: Database, evaluator: Evaluator, principal: Principal, webhook_id: str, body: RuleSet) -> dict:
    """Validate like the spec says (statically, compiled, targets, then a dry run over the latest stored
    deliveries in which any faulting rule refuses the save) and store. Params omitted are kept."""
    current = db.read_sync(lambda txn: rules_view(visible_webhook(txn, principal, webhook_id, "set_webhook_rules")))
    explicit_params = body.params if "params" in body.model_fields_set and body.params is not None else None
    params = explicit_params if explicit_params is not None else current["params"]
    validate_rule_set(evaluator, body.rules, params, principal.human_id)
    docs = db.read_sync(_targets_checked_envelopes, principal, webhook_id, body.rules, body.default_action)
    rules = [r.model_dump(exclude_none=True) for r in body.rules]
    for event_id, doc in docs:
        _, trace = decide(evaluator, rules, None, params, "unused", doc, principal.human_id)
        if trace["stage"] == "fault":
            index = trace["rule_index"]
            if index is None:
                index = _first_faulting_rule(evaluator, rules, params, doc, principal.human_id)
            where = rule_label(index, body.rules[index]) if index is not None else "rules"
            raise ApiError("invalid_argument", f"{where}: faults on stored delivery {event_id}"
                                               f" ({trace['cause']}: {trace['faults'][0]['detail']})")
    return db.write_sync(save_rules, principal, webhook_id, body.rules, body.default_action, explicit_params)


def _targets_checked_envelopes(txn: Txn, principal: Principal, webhook_id: str, rules: list[Rule],
                               default: Any) -> list[tuple[str, bytes]]:
    webhook = visible_webhook(txn, principal, webhook_id, "set_webhook_rules")
    check_rule_targets(txn, webhook, rules, default)
    return latest_envelopes(txn, webhook_id)


def _test_subject(txn: Txn, principal: Principal, webhook_id: str,
                  event_id: str | None) -> tuple[sqlite3.Row, dict | None, str | None]:
    webhook = visible_webhook(txn, principal, webhook_id, "test_webhook_rules")
    login = connection_login(txn, webhook_id)
    if event_id is None:
        return webhook, None, login
    row = txn.one(f"{EVENT_WITH_BODY} WHERE id = ? AND webhook_id = ?", (event_id, webhook_id))
    if row is None or row["envelope"] is None:
        raise ApiError("not_found", f"no event {event_id} on this webhook")
    return webhook, with_current_actor(stored_envelope(row["envelope"], row["headers"], row["body"]), webhook,
                                       connection_login=login), login


def dry_run_rules(db: Database, evaluator: Evaluator, principal: Principal, webhook_id: str, body: RulesTest) -> dict:
    """The dry run: what would happen to this envelope, storing nothing."""
    webhook, envelope, login = db.read_sync(_test_subject, principal, webhook_id, body.event_id)
    stored = rules_view(webhook)
    if body.rules is not None:
        rules_models, default = body.rules, body.default_action
    else:
        rules_models = [Rule.model_validate(r) for r in stored["rules"]]
        default = body.default_action if "default_action" in body.model_fields_set else (
            parse_model(RuleSet, {"default_action": stored["default_action"]}).default_action)
    params = body.params if body.params is not None else stored["params"]
    validate_rule_set(evaluator, rules_models, params, principal.human_id)
    db.read_sync(lambda txn: check_rule_targets(txn, webhook, rules_models, default))
    if envelope is None:
        raw = dump_json(body.payload, "payload").encode() if body.payload is not None else b""
        headers = {k.lower(): v for k, v in (body.headers or {}).items()}
        verified = body.verified if body.verified is not None else webhook["trust_mode"] == "signed"
        envelope = build_envelope(provider=webhook["provider"], webhook_id=webhook["id"],
                                  trust_mode=webhook["trust_mode"], verified=verified, headers=headers, body=raw,
                                  payload=body.payload, trusted_actors=stored_json(webhook["trusted_actors"]),
                                  connection_login=login)
    elif body.verified is not None:
        envelope["verified"] = body.verified
    action, trace = gate(envelope) or trust_gate(envelope["actor"], *decide(
        evaluator, [r.model_dump(exclude_none=True) for r in rules_models],
        default.model_dump(exclude_none=True) if default else None, params, webhook["queue"],
        json.dumps(envelope).encode(), principal.human_id))
    plan = db.read_sync(plan_delivery, webhook, envelope, action, trace)
    return {"decision": {"drop": bool(action.get("drop")), "queue": plan.targets[0][1] if plan.targets else None,
                         "endpoints": [t[0] for t in plan.targets], "disposition": plan.disposition,
                         "fault": trace["faults"][0] if trace["stage"] == "fault" else None},
            "trace": plan.trace, "once_key": plan.once_key, "work_order": plan.work_order, "envelope": envelope}


def with_current_actor(envelope: dict, webhook: sqlite3.Row, trusted_actors: dict | None = None,
                       connection_login: str | None = None) -> dict:
    """A stored envelope with `.actor` as the webhook's trusted actors (or `trusted_actors`) and the login of the
    connection it writes through say now."""
    trusted = trusted_actors or stored_json(webhook["trusted_actors"])
    return {**envelope, "actor": actor_view(webhook["provider"], envelope["payload"], trusted, connection_login)}
