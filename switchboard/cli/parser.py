"""The command line: its parser and main()."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from switchboard.cli.commands import (
    cli_backup,
    cli_check,
    cli_endpoint_list,
    cli_endpoint_revoke,
    cli_endpoint_vend,
    cli_events_list,
    cli_events_replay,
    cli_friend_link,
    cli_human_add,
    cli_human_list,
    cli_human_set_login,
    cli_human_token,
    cli_init,
    cli_migrate,
    cli_migrate_to,
    cli_notify_add,
    cli_notify_list,
    cli_notify_remove,
    cli_notify_test,
    cli_outputs_hold,
    cli_outputs_resume,
    cli_outputs_status,
    cli_prune,
    cli_queue_limits,
    cli_queue_list,
    cli_queue_pause,
    cli_queue_resume,
    cli_route_add,
    cli_route_list,
    cli_route_remove,
    cli_rules_get,
    cli_rules_set,
    cli_rules_test,
    cli_schedule_add,
    cli_schedule_list,
    cli_schedule_pause,
    cli_schedule_remove,
    cli_schedule_resume,
    cli_todo_action,
    cli_todo_bulk,
    cli_todo_list,
    cli_todo_push,
    cli_todo_release,
    cli_todo_show,
    cli_webhook_create,
    cli_webhook_delete,
    cli_webhook_list,
    cli_webhook_rename,
    cli_webhook_rotate,
    cli_webhook_set_secret,
    cli_webhook_trust,
)
from switchboard.cli.forge_commands import (
    cli_connection_add,
    cli_connection_list,
    cli_connection_remove,
    cli_connection_test,
    cli_subject_list,
    cli_subject_show,
    cli_webhook_connect,
    cli_webhook_disconnect,
)
from switchboard.cli.output import print_answer
from switchboard.configuration import (
    DEFAULT_INGEST_BURST,
    DEFAULT_INGEST_RATE,
    DEFAULT_VERIFIED_BURST,
    DEFAULT_VERIFIED_RATE,
    NOTIFY_KINDS,
    PACK_NAMES,
    ApiError,
    default_db_path,
    env_default,
)
from switchboard.engines import database_errors, is_postgres, open_database
from switchboard.models import BULK_ACTIONS
from switchboard.providers import PROVIDERS


def cli_serve(args: argparse.Namespace) -> int:
    """`serve`: the web stack (uvicorn, Starlette, the Board) is imported here, so that the commands that only
    touch the database start without it."""
    from switchboard.server import cli_serve as serve

    return serve(args)


def _subcommand(group: argparse._SubParsersAction, name: str, handler: Callable, help_text: str,
                common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser = group.add_parser(name, parents=[common], help=help_text, description=help_text)
    parser.set_defaults(handler=handler)
    return parser


def _group(commands: argparse._SubParsersAction, name: str, help_text: str, metavar: str
           ) -> argparse._SubParsersAction:
    """A command with subcommands (human add, todo push, …)."""
    return commands.add_parser(name, help=help_text).add_subparsers(dest="sub", required=True, metavar=metavar)


def _if_missing(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--if-missing", dest="if_missing", action="store_true",
                        help=f"when {what} exists, answer it (`existing`: true) and make nothing, so a set-up script"
                             " may run again; a --out file must then hold the answer of the run that made it")


def _add_serve(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    serve = _subcommand(commands, "serve", cli_serve,
                        "run the server (creates the database on first start); every flag also reads"
                        " SWITCHBOARD_<FLAG>", common)
    serve.add_argument("--host", default=env_default("host", "127.0.0.1"), help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=env_default("port", "8080"), help="port (default 8080)")
    serve.add_argument("--synchronous", choices=["full", "normal"], default=env_default("synchronous", "full"),
                       help="full: a 202 survives power loss (default); normal: faster, survives a crash")
    serve.add_argument("--db-pool-size", dest="db_pool_size", type=int, default=env_default("db-pool-size", "8"),
                       help="Postgres only: the connections this process keeps to the database (default 8)")
    serve.add_argument("--db-listen", dest="db_listen", metavar="URL", default=env_default("db-listen", None),
                       help="Postgres only: a direct postgresql:// URL for LISTEN and the leader's lock, when --db"
                            " goes through a transaction pooler (default: --db)")
    serve.add_argument("--ingest-rate", dest="ingest_rate", type=float,
                       default=env_default("ingest-rate", str(DEFAULT_INGEST_RATE)),
                       help="unauthenticated deliveries and failed signature checks per second per source address"
                            " (0 turns every ingest limit off)")
    serve.add_argument("--ingest-burst", dest="ingest_burst", type=int,
                       default=env_default("ingest-burst", str(DEFAULT_INGEST_BURST)),
                       help="of those, how many at once")
    serve.add_argument("--verified-rate", dest="verified_rate", type=float,
                       default=env_default("verified-rate", str(DEFAULT_VERIFIED_RATE)),
                       help="deliveries whose signature verified, per second per webhook (0 turns this limit off)")
    serve.add_argument("--verified-burst", dest="verified_burst", type=int,
                       default=env_default("verified-burst", str(DEFAULT_VERIFIED_BURST)),
                       help="of those, how many at once")
    serve.add_argument("--base-url", dest="base_url", default=env_default("base-url", None),
                       help="public base of ingest URLs and Board links (default: as requested)")
    serve.add_argument("--allowed-origins", dest="allowed_origins", default=env_default("allowed-origins", None),
                       help="comma-separated browser origins allowed on /mcp (loopback origins are allowed on a"
                            " loopback address)")
    serve.add_argument("--trust-proxy", dest="trust_proxy", nargs="?", const=True, metavar="ADDRESSES",
                       default=env_default("trust-proxy", False),
                       help="a reverse proxy in front sets X-Forwarded-Proto (`https` makes the Board's session"
                            " cookie Secure). With comma-separated addresses or networks (127.0.0.1, 10.0.0.0/8):"
                            " only those proxies are believed, and their X-Forwarded-For and --auth-header too")
    serve.add_argument("--auth-header", dest="auth_header", default=env_default("auth-header", None),
                       metavar="NAME", help="sign a Board visitor in as the human whose login this header names"
                                            " (e.g. Remote-User), on requests from the --trust-proxy addresses only")
    serve.add_argument("--notify-allow-private", dest="notify_allow_private", action="store_true",
                       default=env_default("notify-allow-private", False),
                       help="let notification channels reach loopback, link-local and unspecified addresses"
                            " (refused by default; LAN addresses are always allowed)")
    serve.add_argument("--notify-allow", dest="notify_allow", default=env_default("notify-allow", None),
                       help="comma-separated addresses or networks, each with an optional :port, that notification"
                            " channels may reach although loopback or link-local (e.g. 127.0.0.1:8090)")
    serve.add_argument("--otel", action="store_true", default=env_default("otel", False),
                       help="export traces over OTLP/HTTP (needs the `otel` extra; the standard OTEL_* variables,"
                            " OTEL_EXPORTER_OTLP_ENDPOINT first, say where): without the extra, exit 1")
    serve.add_argument("--log-format", dest="log_format", choices=["plain", "json"],
                       default=env_default("log-format", "plain"), help="plain lines (default) or one JSON object per line")


def _add_principals(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    human = _group(commands, "human", "humans: the owners of endpoints and webhooks", "{add,list,token,set-login}")
    add = _subcommand(human, "add", cli_human_add, "add a human; prints its token (sbh_…) once", common)
    add.add_argument("name", help="a unique name, e.g. alice")
    add.add_argument("--login", help="the login an identity proxy names this human by (serve --auth-header)")
    add.add_argument("--out", help="also write the answer (with the token) to this file, mode 0600")
    _subcommand(human, "list", cli_human_list, "list the humans", common)
    token = _subcommand(human, "token", cli_human_token, "issue a new token for a human, printed once: the old"
                        " token and every Board session signed in with it end at once", common)
    token.add_argument("name", help="the human's name or id")
    token.add_argument("--out", help="also write the answer (with the token) to this file, mode 0600")
    login = _subcommand(human, "set-login", cli_human_set_login, "tie a human to the login an identity proxy"
                        " names them by (serve --auth-header)", common)
    login.add_argument("name", help="the human's name or id")
    login.add_argument("login", help="e.g. alice or alice@example.com (compared case-insensitively)")

    endpoint = _group(commands, "endpoint", "endpoints: agents' capability grants", "{vend,list,revoke}")
    vend = _subcommand(endpoint, "vend", cli_endpoint_vend, "vend an endpoint for a human; prints its token"
                       " (sbk_…) once", common)
    vend.add_argument("--human", required=True, help="the owning human's name or id")
    vend.add_argument("--name", required=True, help="a name unique per human, e.g. qwen")
    vend.add_argument("--queues", required=True, help="comma-separated queue names it may work on")
    vend.add_argument("--verbs", default="drain", help="comma-separated verbs or presets: drain (default),"
                                                       " webhooks, all")
    vend.add_argument("--lease", type=int, help="default lease seconds (60..86400)")
    vend.add_argument("--out", help="also write the answer (with the token) to this file, mode 0600")
    _if_missing(vend, "the human's endpoint of this name, with this scope")
    _subcommand(endpoint, "list", cli_endpoint_list, "list every endpoint", common)
    _subcommand(endpoint, "revoke", cli_endpoint_revoke, "revoke an endpoint (its open work becomes dead"
                " letters)", common).add_argument("id", help="endpoint id (ep_…)")

    friend = _group(commands, "friend", "friend edges between humans", "{link}")
    link = _subcommand(friend, "link", cli_friend_link, "let HUMAN_A's webhooks route to HUMAN_B's endpoints"
                       " (request and approval at once)", common)
    link.add_argument("human_a", help="the human whose webhooks route")
    link.add_argument("human_b", help="the human whose endpoints receive")


def _add_todos(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    todo = _group(commands, "todo", "todos: list, show, push and the human actions", "{push,list,show,release,approve,request-changes,answer,resume,retry,"
                                           "defer,undefer,cancel,reroute,discard,bulk}")
    push = _subcommand(todo, "push", cli_todo_push, "write a todo for an endpoint", common)
    push.add_argument("endpoint", help="endpoint id (ep_…)")
    push.add_argument("--queue", required=True, help="one of the endpoint's queues")
    push.add_argument("--title", required=True, help="one line, up to 512 characters")
    push.add_argument("--payload", help="a JSON value for the worker")
    push.add_argument("--key", help="idempotency key: a repeat returns the live todo instead of a new one")
    push.add_argument("--priority", type=int, default=0, help="higher is claimed first (-1000..1000)")
    push.add_argument("--work-item", dest="work_item", help="work item JSON file (switchboard.work_item.v1)")
    listing = _subcommand(todo, "list", cli_todo_list, "list todos, newest first", common)
    listing.add_argument("--queue", help="only this queue")
    listing.add_argument("--state", help="only these states, comma-separated (pending, claimed, review, done, …)")
    listing.add_argument("--endpoint", help="only this endpoint id")
    listing.add_argument("--subject", help="only todos about this subject key (github:owner/repo#12)")
    listing.add_argument("--q", help="only todos whose title holds this text (any case)")
    listing.add_argument("--cursor", help="the page after this one: the next_cursor a page printed")
    listing.add_argument("--limit", type=int, help="at most this many (1..200, default 50)")
    _subcommand(todo, "show", cli_todo_show, "one todo with its attempts, history and receipt",
                common).add_argument("id", help="todo id (td_…)")
    unhold = _subcommand(todo, "release", cli_todo_release, "release a quarantined (held) delivery", common)
    unhold.add_argument("id", help="todo id (td_…) of the held item")
    unhold.add_argument("--queue", help="send it to this queue instead of re-evaluating the rules")
    unhold.add_argument("--note", help="why, for the history")
    unhold.add_argument("--trust-actor", dest="trust_actor", action="store_true",
                        help="first add its actor to the webhook's trusted actors (trust-gate holds only)")
    for action, (options, help_text) in TODO_ACTION_OPTIONS.items():
        sub = _subcommand(todo, action, cli_todo_action, help_text, common)
        sub.set_defaults(action=action)
        sub.add_argument("id", help="todo id (td_…)")
        for option, option_help in options:
            sub.add_argument(option.rstrip("!"), required=option.endswith("!"), help=option_help)
    bulk = _subcommand(todo, "bulk", cli_todo_bulk, "one action on many todos, by --ids or by filter (at most"
                       " 10,000): a dry run unless --apply", common)
    bulk.add_argument("action", choices=BULK_ACTIONS, help="what to do to each")
    bulk.add_argument("--ids", help="comma-separated todo ids (td_…), instead of a filter")
    bulk.add_argument("--endpoint", help="filter: only this endpoint id")
    bulk.add_argument("--queue", help="filter: only this queue")
    bulk.add_argument("--state", help="filter: only these states, comma-separated")
    bulk.add_argument("--subject", help="filter: only todos about this subject key")
    bulk.add_argument("--q", help="filter: only todos whose title holds this text")
    bulk.add_argument("--since", help="filter: only todos created at or after this ISO-8601 time")
    bulk.add_argument("--reason", help="why (cancel and defer need it; a note for the others)")
    bulk.add_argument("--to", help="reroute: the queue to move them to")
    bulk.add_argument("--until", help="defer: the ISO-8601 time they come back by themselves")
    bulk.add_argument("--apply", action="store_true", help="act (default: only report what would happen)")


def _add_queues(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    queue = _group(commands, "queue", "queue control per endpoint and queue: pause, resume, caps",
                   "{list,pause,resume,limits}")
    _subcommand(queue, "list", cli_queue_list, "an endpoint's queues: pause, caps, in flight, pending",
                common).add_argument("endpoint", help="endpoint id (ep_…)")
    pause = _subcommand(queue, "pause", cli_queue_pause, "pause a queue: claims skip it and it rings no one;"
                        " deliveries still land", common)
    resume = _subcommand(queue, "resume", cli_queue_resume, "resume a paused queue (it rings for what waited)",
                         common)
    limits = _subcommand(queue, "limits", cli_queue_limits, "set or clear a queue's admission caps and wait limits", common)
    for sub in (pause, resume, limits):
        sub.add_argument("endpoint", help="endpoint id (ep_…)")
        sub.add_argument("queue", help="one of the endpoint's queues")
    when = pause.add_mutually_exclusive_group()
    when.add_argument("--for", dest="duration", help="how long: 90m, 2h, 1d12h (default: until resumed)")
    when.add_argument("--until", help="until this ISO-8601 time")
    pause.add_argument("--reason", help="why, shown with the queue (one line)")
    limits.add_argument("--max-in-flight", dest="max_in_flight", type=int, help="at most N claimed at once")
    limits.add_argument("--max-claims", dest="max_claims", type=int, help="at most N claims in each window")
    limits.add_argument("--window", type=int, help="the window, in seconds (with --max-claims)")
    per_key = limits.add_mutually_exclusive_group()
    per_key.add_argument("--max-per-subject", dest="max_per_subject", type=int,
                         help="at most N claimed at once per subject key (issue, pull request)")
    per_key.add_argument("--max-per-repo", dest="max_per_repo", type=int,
                         help="at most N claimed at once per repository")
    limits.add_argument("--clear", action="store_true", help="clear every cap")
    limits.add_argument("--wait-limit", dest="wait_limits", action="append", metavar="STATE=SECONDS:THEN[:QUEUE]",
                        help="how long a todo may wait in STATE (pending, needs_input, review, blocked) and what"
                             " then: remind, cancel, defer, or reroute:QUEUE; STATE=none clears it (repeatable)")


def _add_schedules(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    schedule = _group(commands, "schedule", "schedules: recurring todos for an endpoint (cron or every N seconds)",
                      "{add,list,pause,resume,remove}")
    add = _subcommand(schedule, "add", cli_schedule_add, "make a schedule: each due time makes one todo", common)
    add.add_argument("endpoint", help="endpoint id (ep_…)")
    add.add_argument("--name", required=True, help="the schedule's name, unique on the endpoint")
    add.add_argument("--queue", required=True, help="one of the endpoint's queues")
    add.add_argument("--title", required=True, help="each todo's title (one line)")
    timing = add.add_mutually_exclusive_group(required=True)
    timing.add_argument("--cron", help="five fields, e.g. '30 7 * * 1-5'")
    timing.add_argument("--every", type=int, help="every this many seconds")
    add.add_argument("--tz", help="the cron's IANA time zone (default UTC), e.g. Europe/Berlin")
    add.add_argument("--payload", help="a JSON object each todo's payload holds")
    add.add_argument("--catch-up", dest="catch_up", choices=("latest", "none", "all"), default="latest",
                     help="after a downtime: one todo for the latest missed time (default), none, or each")
    _subcommand(schedule, "list", cli_schedule_list, "an endpoint's schedules: next and last run, the last todo",
                common).add_argument("endpoint", help="endpoint id (ep_…)")
    for name, fn, what in (("pause", cli_schedule_pause, "stop a schedule making todos (enabled false)"),
                           ("resume", cli_schedule_resume, "let it make todos again, from now (enabled true)"),
                           ("remove", cli_schedule_remove, "delete a schedule (the todos it made stay)")):
        _subcommand(schedule, name, fn, what, common).add_argument("id", help="schedule id (sc_…)")


TODO_ACTION_OPTIONS = {
    "approve": ([("--note", "a note for the history")], "approve work waiting in review (done)"),
    "request-changes": ([("--note!", "what to change")], "send reviewed work back (pending)"),
    "answer": ([("--answer!", "the answer the next worker sees")], "answer a worker's question (pending)"),
    "resume": ([("--note", "a note for the history")], "resume blocked work (pending)"),
    "retry": ([("--note", "a note for the history")], "retry a dead letter with a fresh attempt budget"),
    "defer": ([("--reason!", "why it waits"), ("--until", "ISO-8601 time it comes back by itself")],
              "park pending work"),
    "undefer": ([("--note", "a note for the history")], "bring deferred work back (pending)"),
    "cancel": ([("--reason!", "why")], "cancel work in any live state"),
    "reroute": ([("--queue!", "the queue to move it to")], "move work to another queue"),
    "discard": ([("--note", "a note for the history")], "discard a held delivery (done, discarded)"),
}


def _add_trust_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trust", help="comma-separated trusted logins (github, gitea) or actor ids (cairn); a"
                                        " forge or cairn webhook without them holds every delivery")
    parser.add_argument("--match", choices=["sender", "author", "both"],
                        help="with --trust on github/gitea: check the sender (default), the author, or both")
    parser.add_argument("--allow-all", dest="allow_all", action="store_true", help="trust every actor")


def _add_webhooks(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    webhook = _group(commands, "webhook", "webhooks: signed ingress URLs",
                     "{create,rename,trust,list,rotate,delete,set-secret,connect,disconnect}")
    create = _subcommand(webhook, "create", cli_webhook_create, "make an ingest URL; prints its secret once",
                         common)
    create.add_argument("--endpoint", required=True, help="owner endpoint id (ep_…)")
    create.add_argument("--provider", required=True, choices=PROVIDERS, help="who signs the deliveries")
    create.add_argument("--queue", required=True, help="the queue deliveries go to when no rule decides")
    create.add_argument("--name", help="a label that tells it from the others (up to 64 characters)")
    create.add_argument("--secret", help="supply the secret instead of minting one (Stripe, Slack: theirs)")
    create.add_argument("--base-url", dest="base_url", help="public base of the ingest URL")
    create.add_argument("--out", help="also write the answer (URL and secret) to this file, mode 0600")
    _if_missing(create, "the endpoint's webhook of this --name (same provider and queue; --trust is applied)")
    _add_trust_options(create)
    rename = _subcommand(webhook, "rename", cli_webhook_rename, "name a webhook, or clear its name", common)
    rename.add_argument("id", help="webhook id (wh_…)")
    named = rename.add_mutually_exclusive_group(required=True)
    named.add_argument("name", nargs="?", help="the new name (up to 64 characters)")
    named.add_argument("--clear", action="store_true", help="remove the name")
    trust = _subcommand(webhook, "trust", cli_webhook_trust, "set whom the trust gate lets through (github,"
                        " gitea: logins; cairn: actor ids), or add to the list", common)
    trust.add_argument("id", help="webhook id (wh_…)")
    _add_trust_options(trust)
    trust.add_argument("--add", help="comma-separated logins (or cairn actor ids) to add to the list, keeping the"
                                     " ones already on it")
    _subcommand(webhook, "list", cli_webhook_list, "list every webhook", common)
    rotate = _subcommand(webhook, "rotate", cli_webhook_rotate, "new URL and secret (the old URL is 404 at once)",
                         common)
    rotate.add_argument("id", help="webhook id (wh_…)")
    rotate.add_argument("--base-url", dest="base_url", help="public base of the ingest URL")
    rotate.add_argument("--out", help="also write the answer (URL and secret) to this file, mode 0600")
    _subcommand(webhook, "delete", cli_webhook_delete, "delete a webhook (its URL is 404 at once)",
                common).add_argument("id", help="webhook id (wh_…)")
    set_secret = _subcommand(webhook, "set-secret", cli_webhook_set_secret, "set the secret Stripe or Slack"
                             " issued", common)
    set_secret.add_argument("id", help="webhook id (wh_…)")
    set_secret.add_argument("--secret", required=True, help="the producer's signing secret")
    connect = _subcommand(webhook, "connect", cli_webhook_connect, "write outputs through a forge connection (and"
                          " with --mirror keep a status comment on each issue)", common)
    connect.add_argument("webhook", help="webhook id (wh_…)")
    connect.add_argument("connection", help="connection id (fc_…) of the webhook's human")
    connect.add_argument("--mirror", action="store_true", help="keep one status comment per issue, edited in place")
    connect.add_argument("--policy", help="output policy JSON file: {add_labels?: {allow, max}, remove_labels?:"
                                          " {allow, max}, comment?: {max, max_bytes}} (default: size/* labels, 3"
                                          " comments)")
    connect.add_argument("--commanders", metavar="LOGIN,…", help="forge logins whose comments (/answer, /approve,"
                                                                  " /changes, /retry, /resume, /cancel, /defer,"
                                                                  " /undefer), closes and merges steer the work"
                                                                  " (default: nobody)")
    connect.add_argument("--on-close", choices=("cancel", "keep"), help="what a commander closing the issue does to"
                                                                        " its open todos (default cancel)")
    _subcommand(webhook, "disconnect", cli_webhook_disconnect, "stop writing through a forge connection",
                common).add_argument("webhook", help="webhook id (wh_…)")

    route = _group(commands, "route", "webhook routes to more endpoints", "{add,list,remove}")
    for name, handler, help_text in (("add", cli_route_add, "route a webhook's deliveries to an endpoint too"),
                                     ("remove", cli_route_remove, "remove a route")):
        sub = _subcommand(route, name, handler, help_text, common)
        sub.add_argument("webhook", help="webhook id (wh_…)")
        sub.add_argument("endpoint", help="endpoint id (ep_…)")
    _subcommand(route, "list", cli_route_list, "a webhook's routes", common).add_argument(
        "webhook", help="webhook id (wh_…)")

    rules = _group(commands, "rules", "routing rules (jq)", "{get,set,test}")
    _subcommand(rules, "get", cli_rules_get, "a webhook's rules and params", common).add_argument(
        "webhook", help="webhook id (wh_…)")
    rules_set = _subcommand(rules, "set", cli_rules_set, "validate and save rules (refused with the rule named)",
                            common)
    rules_set.add_argument("webhook", help="webhook id (wh_…)")
    source = rules_set.add_mutually_exclusive_group(required=True)
    source.add_argument("--file", help="rules document: {rules, default_action?, params?}")
    source.add_argument("--pack", choices=PACK_NAMES, help="a pack shipped with Switchboard (its README: packs/)")
    rules_set.add_argument("--params", help="params JSON file (replaces the params in force)")
    rules_test = _subcommand(rules, "test", cli_rules_test, "dry run: what would this payload do?", common)
    rules_test.add_argument("webhook", help="webhook id (wh_…)")
    rules_test.add_argument("--payload", required=True, help="payload JSON file")
    rules_test.add_argument("--header", action="append", default=[], help="'Name: value', repeatable")
    rules_test.add_argument("--unverified", action="store_true", help="evaluate as an unverified delivery")


def _add_events(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    events = _group(commands, "events", "deliveries (events)", "{list,replay}")
    events_list = _subcommand(events, "list", cli_events_list, "a webhook's deliveries, newest first", common)
    events_list.add_argument("webhook", help="webhook id (wh_…)")
    events_list.add_argument("--disposition", help="routed, dropped, repeat, quarantined or ping")
    events_list.add_argument("--limit", type=int, help="at most this many (1..200, default 50)")
    replay = _subcommand(events, "replay", cli_events_replay, "evaluate stored deliveries under the current rules"
                         " (a dry run unless --apply; once claims and earlier todos hold)", common)
    replay.add_argument("event", nargs="?", help="one event id (ev_…)")
    replay.add_argument("--webhook", help="or every matching event of this webhook (wh_…)")
    replay.add_argument("--disposition", help="only events that were routed, dropped, repeat, quarantined or ping")
    replay.add_argument("--kind", help="only events of this kind")
    replay.add_argument("--since", help="only events received at or after this ISO-8601 time")
    replay.add_argument("--until", help="only events received before this ISO-8601 time")
    replay.add_argument("--limit", type=int, help="at most this many events (1..1000, default 200)")
    replay.add_argument("--apply", action="store_true", help="act on the new decisions (default: only report)")


def _add_notify(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    notify = _group(commands, "notify", "humans' notification channels", "{add,list,remove,test}")
    add = _subcommand(notify, "add", cli_notify_add, "add a channel for a human (a webhook channel's secret is"
                      " printed once)", common)
    add.add_argument("--human", required=True, help="the human's name or id")
    add.add_argument("--kind", required=True, choices=NOTIFY_KINDS,
                     help="what receives the messages")
    add.add_argument("--url", required=True, help="ntfy topic URL, Gotify server URL, incoming-webhook URL, or"
                                                  " your receiver's URL")
    add.add_argument("--token", help="ntfy access token or Gotify app token")
    add.add_argument("--events", required=True, help="comma-separated: needs_input, review, held, dead_letter,"
                                                     " verification_failures")
    add.add_argument("--out", help="also write the answer (with a webhook channel's secret) to this file, mode 0600")
    _subcommand(notify, "list", cli_notify_list, "every channel (no credentials)", common)
    _subcommand(notify, "remove", cli_notify_remove, "remove a channel", common).add_argument(
        "id", help="channel id (nc_…)")
    _subcommand(notify, "test", cli_notify_test, "send one test message now", common).add_argument(
        "id", help="channel id (nc_…)")


def _add_forge(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    connection = _group(commands, "connection", "forge connections: where outputs are written", "{add,list,test,remove}")
    add = _subcommand(connection, "add", cli_connection_add, "add a GitHub or Gitea connection for a human (the forge"
                      " is asked who the token is)", common)
    add.add_argument("--human", required=True, help="the owning human's name or id")
    add.add_argument("--kind", required=True, choices=["github", "gitea"], help="which forge")
    add.add_argument("--api", required=True, help="the forge's API: https://api.github.com, https://HOST/api/v1")
    add.add_argument("--token-file", dest="token_file", required=True,
                     help="a file (mode 0600) holding the token: issues read and write, nothing else")
    add.add_argument("--repos", required=True, help="comma-separated owners (acme/) or repositories (acme/site) it"
                                                    " may write to")
    add.add_argument("--out", help="also write the answer to this file, mode 0600 (never the token)")
    _if_missing(add, "the human's connection of this kind to this API, with these repos")
    _subcommand(connection, "list", cli_connection_list, "every connection (no tokens)", common)
    _subcommand(connection, "test", cli_connection_test, "ask the forge again who the token is (exit 1 when it"
                " does not answer as before)", common).add_argument("id", help="connection id (fc_…)")
    _subcommand(connection, "remove", cli_connection_remove, "remove a connection (its unsent outputs fail)",
                common).add_argument("id", help="connection id (fc_…)")

    subject = _group(commands, "subject", "subjects: one work item (an issue) across every queue", "{list,show}")
    listing = _subcommand(subject, "list", cli_subject_list, "subjects, most recently active first", common)
    listing.add_argument("--q", help="only those whose title or key holds this text")
    listing.add_argument("--state", choices=["open", "waiting", "done"], help="open, waiting (on a human) or done")
    listing.add_argument("--provider", choices=PROVIDERS, help="only this producer's")
    listing.add_argument("--limit", type=int, help="at most this many (1..200, default 50)")
    listing.add_argument("--cursor", help="the next page: the previous page's next_cursor")
    _subcommand(subject, "show", cli_subject_show, "one subject: its todos and its timeline", common).add_argument(
        "key", help="the subject key, e.g. github:acme/site#12")


def _add_operations(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    _subcommand(commands, "init", cli_init, "create the database (or migrate it) and stop", common)
    backup = _subcommand(commands, "backup", cli_backup, "online backup to a new file (safe while serving)",
                         common)
    backup.add_argument("out", nargs="?", help="the new file")
    backup.add_argument("--dir", help="write switchboard-<UTC time>.db in this directory instead")
    backup.add_argument("--keep", type=int, help="with --dir: keep only the newest N dated backups")
    _subcommand(commands, "check", cli_check, "integrity, key, sandbox and schema report (exit 1 on a problem)",
                common)
    _subcommand(commands, "prune", cli_prune, "apply retention now and checkpoint the WAL", common)
    migrate = _subcommand(commands, "migrate", cli_migrate, "bring the schema up to this version", common)
    migrate.add_argument("--dry-run", dest="dry_run", action="store_true", help="only show what would change")
    copy = _subcommand(commands, "migrate-to", cli_migrate_to, "copy every row of --db into an empty database of"
                       " the other engine (a SQLite file into a postgresql:// URL, or back), checked table by table",
                       common)
    copy.add_argument("target", help="the empty database: a postgresql:// URL, or a new SQLite file")
    outputs = _group(commands, "outputs", "what goes out (forge outputs, status comments, notifications): held in a"
                     " restored copy until resumed", "{status,hold,resume}")
    _subcommand(outputs, "status", cli_outputs_status, "whether outputs are held, and what waits to go out", common)
    hold = _subcommand(outputs, "hold", cli_outputs_hold, "send nothing out until `outputs resume` (what comes"
                       " meanwhile waits); every backup's copy is born held", common)
    hold.add_argument("--reason", help="why, for status and check (default: held by the operator)")
    _subcommand(outputs, "resume", cli_outputs_resume, "send what waited, and what comes, again", common)


def program_name() -> str:
    """How this process was started, for its help and messages: `switchboard` (the installed command),
    `switchboard.py` (the checkout's launcher) or `python -m switchboard`."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    if name == "__main__.py":
        return "python -m switchboard"
    return "switchboard.py" if name == "switchboard.py" else "switchboard"


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=argparse.SUPPRESS,
                        help="a SQLite file or a postgresql:// URL (default $SWITCHBOARD_DB or ./switchboard.db)")
    common.add_argument("--key-file", dest="key_file", default=argparse.SUPPRESS,
                        help="the secrets' key file (default $SWITCHBOARD_KEY_FILE, else switchboard.key beside a"
                             " SQLite file; a Postgres URL needs one, the same on every process)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON object")
    program = program_name()
    parser = argparse.ArgumentParser(prog=program, parents=[common],
                                     description="Signed webhooks in, durable leased work for AI agents out.",
                                     epilog="Every command takes --db and --json. Exit codes: 0 ok, 1 failure,"
                                            f" 2 usage. `{program} COMMAND --help` tells more.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(commands, common)
    _add_operations(commands, common)
    _add_principals(commands, common)
    _add_todos(commands, common)
    _add_queues(commands, common)
    _add_schedules(commands, common)
    _add_webhooks(commands, common)
    _add_events(commands, common)
    _add_notify(commands, common)
    _add_forge(commands, common)
    commands.add_parser("worker", help="work an endpoint's queues over REST: `worker --help` lists its flags",
                        add_help=False)
    return parser


CREATES_DATABASE = (cli_init, cli_serve)


def _fail(args: argparse.Namespace, body: dict) -> int:
    """An error goes to stderr, with --json as its one JSON object: stdout stays empty, so a script's
    `--json > FILE` or `--out FILE` never saves an error as if it were the answer."""
    if args.json:
        print(json.dumps(body), file=sys.stderr)
    else:
        print(f"error: {body['error']}: {body['message']}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    # Every file this process creates (database, WAL, backups, credentials) is the owner's alone.
    os.umask(0o077)
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    args.db = getattr(args, "db", None) or default_db_path()
    args.json = getattr(args, "json", False)
    args.key_file = getattr(args, "key_file", None) or os.environ.get("SWITCHBOARD_KEY_FILE") or None
    if args.handler not in CREATES_DATABASE and not is_postgres(args.db) and not Path(args.db).exists():
        return _fail(args, {"error": "not_found", "message": f"no database at {Path(args.db).resolve()}: run"
                            f" `{program_name()} init` there first, or point --db or $SWITCHBOARD_DB at it"})
    try:
        if args.handler is cli_serve:
            return cli_serve(args)
        if args.handler in (cli_migrate, cli_migrate_to):
            print_answer(args, args.handler(args))
            return 0
        # `check` reports the schema as it is and `backup` copies the file as it is: neither migrates it.
        db = open_database(args.db, inline_rings=False, migrate=args.handler not in (cli_check, cli_backup))
        try:
            print_answer(args, args.handler(args, db))
        finally:
            db.close()
        return 0
    except ApiError as exc:
        return _fail(args, exc.body())
    except database_errors() as exc:
        return _fail(args, {"error": "unavailable", "message": f"database: {exc}"})
    except Exception as exc:  # noqa: BLE001 - the contract is one error body and exit 1, never a traceback
        return _fail(args, {"error": "internal",
                            "message": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
