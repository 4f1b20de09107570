"""The operator's commands, each a function of the parsed arguments."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sqlite3
import sys
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from switchboard.cli.output import existing, read_json_file, with_out
from switchboard.configuration import MAX_CLOCK_SKEW_MS, PACKS_DIR, SCHEMA_VERSION, ApiError
from switchboard.crypto import SecretBox, key_file_path, parse_key, sealed_sample
from switchboard.database import Database
from switchboard.engine_copy import copy_database
from switchboard.engines import is_postgres, migrate_postgres, shown_database
from switchboard.evaluator import Evaluator, EvaluatorUnavailable
from switchboard.migrations import pending_migrations
from switchboard.models import (
    BulkAction,
    EndpointCreate,
    EventListQuery,
    NotifyCreate,
    QueueLimits,
    QueuePause,
    QueueResume,
    ReleaseQuarantine,
    ReplayMany,
    RouteAdd,
    RuleSet,
    RulesTest,
    ScheduleCreate,
    ScheduleUpdate,
    TodoListQuery,
    TodoPush,
    TrustedActors,
    WebhookCreate,
    WebhookSecret,
    WebhookUpdate,
    parse_model,
)
from switchboard.providers import PROVIDER_TABLE
from switchboard.store.bulk import BULK_STEP_TODOS, BulkRun, bulk_dry_run, bulk_matches, bulk_step, step_pacing
from switchboard.store.deliveries import list_events
from switchboard.store.human_actions import push_todo
from switchboard.store.outbox import (
    BACKUP_HOLD_REASON,
    add_channel,
    hold_outputs,
    list_channels,
    outputs_status,
    queue_test_message,
    remove_channel,
    resume_outputs,
)
from switchboard.store.principals import (
    OPERATOR,
    add_human,
    endpoint_view,
    find_human,
    friend_link,
    list_endpoints,
    list_humans,
    reissue_human_token,
    set_human_login,
    vend_endpoint,
)
from switchboard.store.quarantine import apply_quarantine_release, prepare_quarantine_release
from switchboard.store.queues import list_queues, pause_queue, resume_queue, set_queue_limits
from switchboard.store.replay import (
    apply_replays,
    decide_again,
    replay_batches,
    replay_events,
    replay_subjects,
    replay_summary,
)
from switchboard.store.routing import dry_run_rules, set_rules
from switchboard.store.rules import get_rules
from switchboard.store.schedules import create_schedule, delete_schedule, list_schedules, update_schedule
from switchboard.store.todos import get_todo, list_todos
from switchboard.store.transitions import revoke_endpoint
from switchboard.store.upkeep import HUMAN_ACTIONS, check_database, prune
from switchboard.store.webhooks import (
    add_route,
    add_trusted_actors,
    create_webhook,
    delete_webhook,
    list_routes,
    list_webhooks,
    remove_route,
    rotate_webhook,
    set_trusted_actors,
    set_webhook_secret,
    update_webhook,
    visible_webhook,
)

# -- handlers ----------------------------------------------------------------------------------------

def cli_init(args: argparse.Namespace, db: Database) -> dict:
    return {"path": shown_database(args.db), "schema_version": SCHEMA_VERSION}


def cli_human_add(args: argparse.Namespace, db: Database) -> dict:
    return with_out(args, db.write_sync(add_human, args.name, args.login))


def cli_human_list(args: argparse.Namespace, db: Database) -> dict:
    return db.read_sync(list_humans)


def cli_human_token(args: argparse.Namespace, db: Database) -> dict:
    """A lost or leaked human token: a new one, printed once; the old one and its Board sessions end."""
    return with_out(args, db.write_sync(reissue_human_token, args.name))


def cli_human_set_login(args: argparse.Namespace, db: Database) -> dict:
    return db.write_sync(set_human_login, args.name, args.login)


def cli_endpoint_vend(args: argparse.Namespace, db: Database) -> dict:
    spec = parse_model(EndpointCreate, {
        "name": args.name, "queues": [q for q in args.queues.split(",") if q],
        "verbs": [v for v in args.verbs.split(",") if v],
        **({"default_lease_seconds": args.lease} if args.lease is not None else {})})
    human = db.read_sync(find_human, args.human)
    if args.if_missing:
        found = db.read_sync(lambda txn: txn.one("SELECT * FROM endpoints WHERE human_id = ? AND name = ?",
                                                 (human["id"], spec.name)))
        if found is not None:
            return _existing_endpoint(args, endpoint_view(found), spec)
    vended = db.write_sync(vend_endpoint, human["id"], spec)
    return with_out(args, {k: vended[k] for k in ("id", "name", "token", "queues", "verbs")})


def _existing_endpoint(args: argparse.Namespace, found: dict, spec: EndpointCreate) -> dict:
    """An endpoint of that name, reused only as it is: a scope is immutable (SPEC 2), so another one is refused."""
    what = f"endpoint {spec.name!r}"
    if found["revoked_at"] is not None:
        raise ApiError("conflict", f"{what} ({found['id']}) is revoked; its name stays taken: vend under another name")
    wanted = {"queues": spec.queues, "verbs": spec.expanded_verbs(),
              "default_lease_seconds": spec.default_lease_seconds or found["default_lease_seconds"]}
    differs = [k for k, v in wanted.items() if found[k] != v]
    if differs:
        raise ApiError("conflict", f"{what} exists ({found['id']}) with another {' and '.join(differs)}"
                                   f" ({', '.join(f'{k}: {json.dumps(found[k])}' for k in differs)}); a scope"
                                   " cannot change: vend a new endpoint and revoke the old one")
    return existing(args, {k: found[k] for k in ("id", "name", "queues", "verbs")}, what, "token")


def cli_endpoint_list(args: argparse.Namespace, db: Database) -> dict:
    return db.read_sync(list_endpoints, OPERATOR)


def cli_endpoint_revoke(args: argparse.Namespace, db: Database) -> dict:
    return db.write_sync(revoke_endpoint, OPERATOR, args.id)


def cli_todo_push(args: argparse.Namespace, db: Database) -> dict:
    fields: dict[str, Any] = {"title": args.title, "queue": args.queue, "priority": args.priority}
    if args.payload is not None:
        try:
            fields["payload"] = json.loads(args.payload)
        except json.JSONDecodeError as exc:
            raise ApiError("invalid_argument", f"--payload is not JSON: {exc}") from None
    if args.key is not None:
        fields["key"] = args.key
    if args.work_item is not None:
        fields["work_item"] = read_json_file(args.work_item)
    return db.write_sync(push_todo, OPERATOR, args.endpoint, parse_model(TodoPush, json.dumps(fields)))


def cli_todo_list(args: argparse.Namespace, db: Database) -> dict:
    query = parse_model(TodoListQuery, {k: v for k, v in (
        ("queue", args.queue), ("state", args.state), ("endpoint", args.endpoint), ("subject", args.subject),
        ("q", args.q), ("cursor", args.cursor), ("limit", args.limit)) if v is not None})
    return db.read_sync(list_todos, OPERATOR, query)


def cli_todo_bulk(args: argparse.Namespace, db: Database) -> dict:
    """ACTION on --ids, or on what the filter options match: a dry run unless --apply, as the server runs it."""
    filters = {k: v for k, v in (("endpoint", args.endpoint), ("queue", args.queue), ("state", args.state),
                                 ("subject", args.subject), ("q", args.q), ("since", args.since)) if v is not None}
    if args.ids is not None and filters:
        raise ApiError("invalid_argument", "give --ids or filter options (--queue, --state, …), not both")
    fields: dict[str, Any] = {"action": args.action, "dry_run": not args.apply}
    if args.ids is not None:
        fields["ids"] = [i for i in args.ids.split(",") if i]
    else:
        fields["filter"] = filters
    fields.update({k: v for k, v in (("reason", args.reason), ("queue", args.to), ("until", args.until))
                   if v is not None})
    body = parse_model(BulkAction, json.dumps(fields))
    if body.dry_run:
        answer = db.read_sync(bulk_dry_run, OPERATOR, body)
    else:
        run = BulkRun(body, db.read_sync(bulk_matches, OPERATOR, body))
        budget_ms, pause_ms = step_pacing(db.one_writer)
        while run.remaining:
            run.add(db.write_sync(bulk_step, OPERATOR, body, run.remaining[:BULK_STEP_TODOS], budget_ms))
            if run.remaining and pause_ms:  # a server's writer beside this process takes the lock meanwhile
                time.sleep(pause_ms / 1000)
        answer = run.answer()
    if args.json:
        return answer
    skipped = ", ".join(f"{n} {state}" for state, n in answer["skipped"].items())
    more = f"; the filter matched more than {answer['matched']:,}: run it again for the rest" \
        if answer["truncated"] else ""
    if answer["dry_run"]:
        result = (f"dry run, nothing changed: {args.action} would act on {answer['acted']} of {answer['matched']}"
                  f"{' (skipping ' + skipped + ')' if skipped else ''}{more}; --apply acts")
    else:
        result = (f"{args.action}: acted on {answer['acted']} of {answer['matched']}"
                  f"{' (skipped ' + skipped + ')' if skipped else ''}{more}")
    return {"result": result, **answer}


def cli_queue_list(args: argparse.Namespace, db: Database) -> dict:
    answer = db.read_sync(list_queues, OPERATOR, args.endpoint)
    return answer if args.json else {"queues": [_queue_line(q) for q in answer["queues"]]}


def _queue_line(queue: dict) -> dict:
    """A queue on one table line for people: its pause in words, each cap beside how full it is."""
    paused, limits = queue["paused"], queue["limits"]
    if paused:
        paused = f"until {paused['until'] or 'resumed'}{': ' + paused['reason'] if paused['reason'] else ''}"
    window = limits["max_claims_per_window"]
    return {"queue": queue["queue"], "paused": paused or None,
            "in_flight": f"{queue['in_flight']}/{limits['max_in_flight']}" if limits["max_in_flight"] is not None
            else queue["in_flight"],
            "claims_in_window": f"{queue['claims_in_window']}/{window['count']} per {window['window_seconds']} s"
            if window else None, "pending": queue["pending"]}


def cli_queue_pause(args: argparse.Namespace, db: Database) -> dict:
    until = args.duration if args.duration is not None else args.until
    body = parse_model(QueuePause, {k: v for k, v in (("until", until), ("reason", args.reason)) if v is not None})
    return db.write_sync(pause_queue, OPERATOR, args.endpoint, args.queue, body)


def cli_queue_resume(args: argparse.Namespace, db: Database) -> dict:
    return db.write_sync(resume_queue, OPERATOR, args.endpoint, args.queue, QueueResume())


def _wait_limit(text: str) -> tuple[str, dict | None]:
    """`STATE=SECONDS:THEN[:QUEUE]` (or `STATE=none`) as the state and its limit."""
    state, _, limit = text.partition("=")
    if limit == "none":
        return state, None
    seconds, _, rest = limit.partition(":")
    then, _, queue = rest.partition(":")
    if not seconds.isdigit() or not then:
        raise ApiError("invalid_argument", f"--wait-limit: {text!r} is not STATE=SECONDS:THEN[:QUEUE] or STATE=none")
    return state, {"after_seconds": int(seconds), "then": then, **({"queue": queue} if queue else {})}


def cli_queue_limits(args: argparse.Namespace, db: Database) -> dict:
    """--max-in-flight N, --max-claims N --window SECONDS and --max-per-subject N (or --max-per-repo N) set those
    caps (the others stay); --clear clears them all; 0 admits no claim. Each --wait-limit sets (or, with `none`,
    clears) one state's wait limit; the others stay."""
    if (args.max_claims is None) != (args.window is None):
        raise ApiError("invalid_argument", "--max-claims and --window go together")
    fields: dict[str, Any] = {}
    if args.wait_limits:
        fields["wait_limits"] = dict(_wait_limit(text) for text in args.wait_limits)
    if args.max_in_flight is not None:
        fields["max_in_flight"] = args.max_in_flight
    if args.max_claims is not None:
        fields["max_claims_per_window"] = {"count": args.max_claims, "window_seconds": args.window}
    for key, most in (("subject", args.max_per_subject), ("repo", args.max_per_repo)):
        if most is not None:
            fields["max_in_flight_per_key"] = {"key": key, "max": most}
    if args.clear:
        if fields:
            raise ApiError("invalid_argument", "--clear clears every cap: give it alone")
        fields = {"max_in_flight": None, "max_claims_per_window": None, "max_in_flight_per_key": None}
    if not fields:
        raise ApiError("invalid_argument", "give --max-in-flight N, --max-claims N --window SECONDS,"
                                           " --max-per-subject N, --max-per-repo N,"
                                           " --wait-limit STATE=SECONDS:THEN[:QUEUE], or --clear")
    return db.write_sync(set_queue_limits, OPERATOR, args.endpoint, args.queue,
                         parse_model(QueueLimits, json.dumps(fields)))


def cli_schedule_add(args: argparse.Namespace, db: Database) -> dict:
    fields: dict[str, Any] = {"name": args.name, "queue": args.queue, "title": args.title, "catch_up": args.catch_up}
    for name, value in (("cron", args.cron), ("every_seconds", args.every), ("timezone", args.tz)):
        if value is not None:
            fields[name] = value
    if args.payload is not None:
        try:
            fields["payload"] = json.loads(args.payload)
        except json.JSONDecodeError as exc:
            raise ApiError("invalid_argument", f"--payload is not JSON: {exc}") from None
    return db.write_sync(create_schedule, OPERATOR, args.endpoint, parse_model(ScheduleCreate, json.dumps(fields)))


def cli_schedule_list(args: argparse.Namespace, db: Database) -> dict:
    answer = db.read_sync(list_schedules, OPERATOR, args.endpoint)
    if args.json:
        return answer
    return {"schedules": [{"id": s["id"], "name": s["name"], "queue": s["queue"],
                           "when": f"cron {s['cron']} ({s['timezone']})" if s["cron"] else f"every {s['every_seconds']} s",
                           "catch_up": s["catch_up"], "enabled": s["enabled"], "next_run_at": s["next_run_at"],
                           "last_run_at": s["last_run_at"], "last_todo_id": s["last_todo_id"]}
                          for s in answer["schedules"]]}


def cli_schedule_pause(args: argparse.Namespace, db: Database) -> dict:
    return db.write_sync(update_schedule, OPERATOR, args.id, ScheduleUpdate(enabled=False))


def cli_schedule_resume(args: argparse.Namespace, db: Database) -> dict:
    return db.write_sync(update_schedule, OPERATOR, args.id, ScheduleUpdate(enabled=True))


def cli_schedule_remove(args: argparse.Namespace, db: Database) -> dict:
    return db.write_sync(delete_schedule, OPERATOR, args.id)


def cli_todo_show(args: argparse.Namespace, db: Database) -> dict:
    return db.read_sync(get_todo, OPERATOR, args.id)


def cli_todo_release(args: argparse.Namespace, db: Database) -> dict:
    body = parse_model(ReleaseQuarantine, {k: v for k, v in (("queue", args.queue), ("note", args.note),
                                                             ("trust_actor", args.trust_actor or None)) if v is not None})
    with _evaluator() as evaluator:
        release = prepare_quarantine_release(db, evaluator, OPERATOR, args.id, body)
    return db.write_sync(apply_quarantine_release, OPERATOR, release, body.note)


def cli_todo_action(args: argparse.Namespace, db: Database) -> dict:
    fields = {name: getattr(args, name) for name in ("note", "answer", "reason", "until", "queue")
              if getattr(args, name, None) is not None}
    model, fn = HUMAN_ACTIONS[args.action]
    return db.write_sync(fn, OPERATOR, args.id, parse_model(model, json.dumps(fields)))


def _secret_box(args: argparse.Namespace, db: Database) -> SecretBox:
    return SecretBox.for_database(args.db, db.read_sync(sealed_sample), args.key_file)


def _base_url(args: argparse.Namespace) -> str:
    return getattr(args, "base_url", None) or os.environ.get("SWITCHBOARD_BASE_URL") or "http://127.0.0.1:8080"


def _trust_fields(args: argparse.Namespace, provider: str) -> dict | None:
    """--trust A,B [--match M] or --allow-all, as the trusted-actors document for `provider`."""
    if args.allow_all:
        if args.trust is not None:
            raise ApiError("invalid_argument", "give --trust or --allow-all, not both")
        return {"allow_all": True}
    if args.trust is None:
        if args.match is not None:
            raise ApiError("invalid_argument", "--match goes with --trust")
        return None
    names = [n.strip() for n in args.trust.split(",") if n.strip()]
    if PROVIDER_TABLE[provider].trust == "actor_ids":
        if args.match is not None:
            raise ApiError("invalid_argument", "--match is for github and gitea logins")
        return {"actor_ids": names}
    return {"logins": names, **({"match": args.match} if args.match else {})}


def cli_webhook_create(args: argparse.Namespace, db: Database) -> dict:
    fields = {"endpoint_id": args.endpoint, "provider": args.provider, "queue": args.queue}
    if args.name is not None:
        fields["name"] = args.name
    if args.secret is not None:
        fields["secret"] = args.secret
    trusted = _trust_fields(args, args.provider)
    if trusted is not None:
        fields["trusted_actors"] = trusted
    if args.if_missing:
        found = _webhook_named(args, db)
        if found is not None:
            if trusted is not None:  # the trust list as this run says, like `webhook trust --trust`
                db.write_sync(set_trusted_actors, OPERATOR, found["id"], parse_model(TrustedActors, trusted))
            return existing(args, found, f"webhook {args.name!r}", "secret")
    made = db.write_sync(create_webhook, OPERATOR, _secret_box(args, db), parse_model(WebhookCreate, fields),
                         _base_url(args))
    if "warning" in made:
        print(f"warning: {made['warning']}", file=sys.stderr)
    # The shape SPEC section 9 names (`webhook list` shows the name).
    return with_out(args, {k: made[k] for k in ("id", "url", "secret", "provider", "queue")})


def _webhook_named(args: argparse.Namespace, db: Database) -> dict | None:
    """The endpoint's webhook named --name, for --if-missing: reused only for the same provider and queue."""
    if args.name is None:
        raise ApiError("invalid_argument", "--if-missing needs --name: the name tells this webhook from others")
    rows = db.read_sync(lambda txn: txn.all("SELECT id, name, provider, queue FROM webhooks WHERE endpoint_id = ?"
                                            " AND name = ? ORDER BY created_at, id", (args.endpoint, args.name)))
    if not rows:
        return None
    found = dict(rows[0])
    if len(rows) > 1:
        raise ApiError("conflict", f"endpoint {args.endpoint} has {len(rows)} webhooks named {args.name!r}: rename"
                                   " or delete all but one")
    if (found["provider"], found["queue"]) != (args.provider, args.queue):
        raise ApiError("conflict", f"webhook {args.name!r} exists ({found['id']}) for {found['provider']} into"
                                   f" {found['queue']}: give another --name, or delete it first")
    return found


def cli_webhook_rename(args: argparse.Namespace, db: Database) -> dict:
    """NAME, or --clear: through the model PATCH /api/v1/webhooks/{id} takes."""
    body = parse_model(WebhookUpdate, {"name": None if args.clear else args.name})
    return db.write_sync(update_webhook, OPERATOR, args.id, body)


def cli_webhook_trust(args: argparse.Namespace, db: Database) -> dict:
    """--trust A,B replaces the list, --add A,B adds to it, --allow-all trusts everyone."""
    if args.add is not None:
        if args.trust is not None or args.allow_all:
            raise ApiError("invalid_argument", "give one of --trust, --add or --allow-all")
        names = [n.strip() for n in args.add.split(",") if n.strip()]
        if not names:
            raise ApiError("invalid_argument", "--add names at least one login (or cairn actor id)")
        return db.write_sync(add_trusted_actors, OPERATOR, args.id, names, args.match)
    provider = db.read_sync(lambda txn: visible_webhook(txn, OPERATOR, args.id, "set_trusted_actors"))["provider"]
    trusted = _trust_fields(args, provider)
    if trusted is None:
        raise ApiError("invalid_argument", "give --trust A,B (with --match for logins), --add A,B or --allow-all")
    return db.write_sync(set_trusted_actors, OPERATOR, args.id, parse_model(TrustedActors, trusted))


def cli_webhook_list(args: argparse.Namespace, db: Database) -> dict:
    return db.read_sync(list_webhooks, OPERATOR)


def cli_webhook_rotate(args: argparse.Namespace, db: Database) -> dict:
    return with_out(args, db.write_sync(rotate_webhook, OPERATOR, _secret_box(args, db), args.id, _base_url(args)))


def cli_webhook_delete(args: argparse.Namespace, db: Database) -> dict:
    return db.write_sync(delete_webhook, OPERATOR, args.id)


def cli_webhook_set_secret(args: argparse.Namespace, db: Database) -> dict:
    return db.write_sync(set_webhook_secret, OPERATOR, _secret_box(args, db), args.id,
                         parse_model(WebhookSecret, {"secret": args.secret}))


def cli_route_add(args: argparse.Namespace, db: Database) -> dict:
    return db.write_sync(add_route, OPERATOR, args.webhook, parse_model(RouteAdd, {"endpoint_id": args.endpoint}))


def cli_route_list(args: argparse.Namespace, db: Database) -> dict:
    return db.read_sync(list_routes, OPERATOR, args.webhook)


def cli_route_remove(args: argparse.Namespace, db: Database) -> dict:
    return db.write_sync(remove_route, OPERATOR, args.webhook, args.endpoint)


def cli_friend_link(args: argparse.Namespace, db: Database) -> dict:
    return db.write_sync(friend_link, args.human_a, args.human_b)


def cli_events_replay(args: argparse.Namespace, db: Database) -> dict:
    """One event (EVENT) or a webhook's events (--webhook): a dry run unless --apply."""
    if (args.event is None) == (args.webhook is None):
        raise ApiError("invalid_argument", "give EVENT or --webhook ID (not both)")
    dry_run = not args.apply
    if args.event is not None:
        events = [(args.event, 0)]
    else:
        fields = {k: v for k, v in (("disposition", args.disposition), ("kind", args.kind), ("since", args.since),
                                    ("until", args.until), ("limit", args.limit)) if v is not None}
        events = db.read_sync(replay_events, OPERATOR, args.webhook,
                              parse_model(ReplayMany, json.dumps({**fields, "dry_run": dry_run})))
    results: list[dict] = []
    with _evaluator() as evaluator:
        for batch in replay_batches(events):  # as the server does: a batch of bodies at a time
            replays = decide_again(evaluator, db.read_sync(replay_subjects, OPERATOR, batch), None)
            results += (db.read_sync if dry_run else db.write_sync)(apply_replays, OPERATOR, replays, dry_run)
    answer = results[0] if args.event is not None else {**replay_summary(results), "dry_run": dry_run}
    if not getattr(args, "json", False):  # people read first what it did (--json keeps the API's shape)
        answer = {"result": _replay_wording(answer, args.event is not None), **answer}
    return answer


def _replay_wording(answer: dict, one: bool) -> str:
    """What a replay did, or (a dry run, this command's default, unlike REST's) would do and that it did not."""
    if one:
        after = answer["after"]
        where = f" to {after['queue']}" if after.get("queue") else ""
        if answer["dry_run"]:
            return (f"dry run, nothing changed: it would be {after['disposition']}{where} (now"
                    f" {answer['before']['disposition']}) and create {len(answer['todos'])} todo(s); --apply acts")
        return (f"replayed: {answer['before']['disposition']} -> {after['disposition']}{where},"
                f" {answer['created']} todo(s) created")
    if answer["dry_run"]:
        return (f"dry run, nothing changed: {answer['changed']} of {answer['matched']} deliveries would change;"
                f" --apply acts")
    return f"replayed {answer['matched']} deliveries: {answer['changed']} changed, {answer['created']} todo(s) created"


def cli_notify_add(args: argparse.Namespace, db: Database) -> dict:
    human = db.read_sync(find_human, args.human)
    body = parse_model(NotifyCreate, json.dumps({"kind": args.kind, "url": args.url, "events": [
        e for e in args.events.split(",") if e], **({"token": args.token} if args.token else {})}))
    _vet_channel_url(body.url)
    return with_out(args, db.write_sync(add_channel, OPERATOR, _secret_box(args, db), body, human["id"]))


def _vet_channel_url(url: str) -> None:
    """The server's check on a new channel's host, under the same allowance (SWITCHBOARD_NOTIFY_ALLOW_PRIVATE,
    SWITCHBOARD_NOTIFY_ALLOW: the serve flags' variables)."""
    import asyncio

    from switchboard.notifier import COMMAND_ALLOWANCE, REFUSED_ADDRESS, Addresses  # httpx, for this one command

    asyncio.run(Addresses.configured().vet(url, f"url: {REFUSED_ADDRESS} ({COMMAND_ALLOWANCE})"))


def cli_notify_list(args: argparse.Namespace, db: Database) -> dict:
    return db.read_sync(list_channels, OPERATOR)


def cli_notify_remove(args: argparse.Namespace, db: Database) -> dict:
    return db.write_sync(remove_channel, OPERATOR, args.id)


def cli_notify_test(args: argparse.Namespace, db: Database) -> dict:
    """Send one test message from here, now, and say how it went."""
    import asyncio

    from switchboard.notifier import Notifier  # httpx and the senders, for this one command

    notifier = Notifier(db, _secret_box(args, db), _base_url(args))
    return asyncio.run(notifier.send_now(db.write_sync(queue_test_message, OPERATOR, args.id)))


def cli_events_list(args: argparse.Namespace, db: Database) -> dict:
    query = parse_model(EventListQuery, {k: v for k, v in (("disposition", args.disposition), ("limit", args.limit))
                                         if v is not None})
    return db.read_sync(list_events, OPERATOR, args.webhook, query)


@contextlib.contextmanager
def _evaluator() -> Iterable[Evaluator]:
    """A one-child evaluator for one CLI command; a sandbox that cannot start is `unavailable`."""
    evaluator = Evaluator(size=1)
    try:
        yield evaluator
    except EvaluatorUnavailable as exc:
        raise ApiError("unavailable", str(exc)) from None
    finally:
        evaluator.close()


def cli_rules_get(args: argparse.Namespace, db: Database) -> dict:
    return db.read_sync(get_rules, OPERATOR, args.webhook)


def cli_rules_set(args: argparse.Namespace, db: Database) -> dict:
    source = args.file or str(PACKS_DIR / f"{args.pack}.json")
    pack = read_json_file(source)
    if not isinstance(pack, dict):
        raise ApiError("invalid_argument", f"{source}: a rules document is a JSON object")
    if args.params is not None:
        pack = {**pack, "params": read_json_file(args.params)}
    with _evaluator() as evaluator:
        return set_rules(db, evaluator, OPERATOR, args.webhook, parse_model(RuleSet, json.dumps(pack)))


def cli_rules_test(args: argparse.Namespace, db: Database) -> dict:
    headers = {}
    for line in args.header:
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise ApiError("invalid_argument", f"--header {line!r}: write 'Name: value'")
        headers[name.strip()] = value.strip()
    fields = {"payload": read_json_file(args.payload), "headers": headers}
    if args.unverified:
        fields["verified"] = False
    with _evaluator() as evaluator:
        return dry_run_rules(db, evaluator, OPERATOR, args.webhook, parse_model(RulesTest, json.dumps(fields)))


BACKUP_NAME = re.compile(r"^switchboard-\d{8}T\d{6}Z\.db$")


def cli_backup(args: argparse.Namespace, db: Database) -> dict:
    """One file (OUT), or a dated file in --dir keeping the newest --keep of them."""
    if (args.out is None) == (args.dir is None):
        raise ApiError("invalid_argument", "give OUT.db or --dir DIR (not both)")
    if args.keep is not None and args.keep < 1:
        # --keep counts the backup this run makes: 0 would delete it and still name it.
        raise ApiError("invalid_argument", f"--keep must be at least 1 (got {args.keep})")
    if args.dir is None:
        out = Path(args.out)
        if not out.parent.is_dir():  # else SQLite's own words: "unable to open database file"
            raise ApiError("not_found", f"no directory {out.parent} for the backup: make it first, or use --dir")
    else:
        Path(args.dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        out = Path(args.dir) / f"switchboard-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.db"
    if out.exists():
        raise ApiError("conflict", f"{out} exists; choose a new file")
    db.backup(str(out))
    # The copy is born with outputs held: restored (in a drill, or for real), it sends nothing until the
    # operator runs `outputs resume` on it; this database is untouched.
    copy = Database(str(out), inline_rings=False)
    try:
        copy.write_sync(hold_outputs, BACKUP_HOLD_REASON)
    finally:
        copy.close()
    removed = []
    if args.dir is not None and args.keep is not None:
        dated = sorted(p for p in Path(args.dir).iterdir() if BACKUP_NAME.match(p.name))
        for old in dated[:max(0, len(dated) - args.keep)]:
            old.unlink()
            removed.append(str(old.resolve()))
    return {"backup": str(out.resolve()), "removed": removed,
            "key_file": "back up switchboard.key (or SWITCHBOARD_SECRET_KEY) separately, once",
            "outputs": "held in the copy: restored, it sends nothing until `outputs resume`"}


def cli_outputs_status(args: argparse.Namespace, db: Database) -> dict:
    return db.read_sync(outputs_status)


def cli_outputs_hold(args: argparse.Namespace, db: Database) -> dict:
    """Hold everything that goes out (forge outputs, status comments, notifications): before serving a restored
    copy that did not come from `backup` (pg_restore, a copied file)."""
    return db.write_sync(hold_outputs, args.reason)


def cli_outputs_resume(args: argparse.Namespace, db: Database) -> dict:
    """The operator says so: what waited goes out (a running server looks again within a second or so)."""
    return db.write_sync(resume_outputs)


def cli_prune(args: argparse.Namespace, db: Database) -> dict:
    pruned = prune(db)
    return {"pruned": pruned, "checkpoint": list(db.checkpoint())}


def _key_health(db_path: str, sealed: tuple[str, bytes] | None, key_file: str | None) -> str:
    """Where the secret key comes from: environment or file; else missing, invalid, or `wrong key` when it
    cannot open the secrets this database holds (the key is never printed)."""
    if os.environ.get("SWITCHBOARD_SECRET_KEY"):
        source, text = "environment", os.environ["SWITCHBOARD_SECRET_KEY"]
    elif key_file and Path(key_file).exists():
        source, text = "file", Path(key_file).read_text()
    elif not key_file and not is_postgres(db_path) and key_file_path(db_path).exists():
        source, text = "file", key_file_path(db_path).read_text()
    else:
        return "missing"
    try:
        box = SecretBox(parse_key(text))
    except ApiError:
        return "invalid"
    return source if sealed is None or box.opens(*sealed) else "wrong key"


def _sandbox_health() -> str:
    try:
        with _evaluator() as evaluator:
            return "ok" if evaluator.run(["true"], {}, b"{}") == {"match": 0} else "wrong answer"
    except ApiError as exc:
        return exc.message


def cli_check(args: argparse.Namespace, db: Database) -> dict:
    sealed = db.read_sync(sealed_sample)
    report = {**db.read_sync(check_database), "key": _key_health(args.db, sealed, args.key_file),
              "sandbox": _sandbox_health(), "outputs": db.read_sync(outputs_status)}
    problems = []
    if report["integrity"] != "ok" or report["foreign_keys"] != "ok":
        problems.append("the database is damaged: restore the latest backup")
    if report["sandbox"] != "ok":
        problems.append(f"the rule sandbox cannot run ({report['sandbox']}): is the jq package installed?")
    if report["schema_version"] != SCHEMA_VERSION:
        problems.append(f"the database is schema {report['schema_version']}, this program's is {SCHEMA_VERSION}:"
                        " run `switchboard.py migrate`")
    if sealed is not None and report["key"] not in ("environment", "file"):
        problems.append(f"the secret key is {report['key']}: webhook secrets cannot be opened; restore switchboard.key"
                        " (beside the database) from the backup, or set SWITCHBOARD_SECRET_KEY")
    if report.get("synchronous_commit") == "off":
        problems.append("synchronous_commit is off: a 202 would not survive a power cut; set it on (`serve` refuses)")
    if report.get("clock_skew_ms", 0) > MAX_CLOCK_SKEW_MS:
        problems.append(f"the processes' clocks are {report['clock_skew_ms']} ms apart (at most {MAX_CLOCK_SKEW_MS}):"
                        " leases and deferrals follow each process's clock; run NTP (chrony, systemd-timesyncd)")
    if problems:
        raise ApiError("internal", "check failed: " + "; ".join(problems) + f" ({json.dumps(report)})")
    return report


def cli_migrate(args: argparse.Namespace) -> dict:
    """What the schema change is; with --dry-run only that, without touching the file."""
    if is_postgres(args.db):
        return migrate_postgres(args.db, args.dry_run)
    conn = sqlite3.connect(f"file:{Path(args.db).resolve()}?mode=ro", uri=True)
    try:
        before = conn.execute("PRAGMA user_version").fetchone()[0]
    finally:
        conn.close()
    if before > SCHEMA_VERSION:
        raise ApiError("conflict", f"{args.db} is schema {before}, newer than this program ({SCHEMA_VERSION}):"
                                   " run the newer program, or restore a backup made before the upgrade")
    steps = pending_migrations(before)
    if not args.dry_run and steps:
        Database(args.db).close()
    return {"path": shown_database(args.db), "from": before, "to": SCHEMA_VERSION, "steps": steps,
            "applied": bool(steps) and not args.dry_run}


def cli_migrate_to(args: argparse.Namespace) -> dict:
    """Copy this database into an empty one of the other engine (engine_copy)."""
    return copy_database(args.db, args.target)
