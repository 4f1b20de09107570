"""Switchboard: signed webhooks in, durable leased work for AI agents out. One process and one SQLite file by default;
several processes on one Postgres database past one box.

The modules, in layers: each imports only from the layers above it in this list (tests/test_layering.py
checks it from the import graph).

  configuration      constants, limits, the clock, errors
  tracing            W3C trace ids, and span records exported over OTLP when the `otel` extra and an endpoint are there
  migrations         the schema files and one numbered list of migrations, each step in both engines' forms
  database           connections, the single writer, readers
  crypto             tokens, ids, sealed webhook secrets
  postgres           the same transaction bodies on Postgres: pool, dialect, locks, retries, leader, rings
  engines            which engine a --db names (a SQLite file or a postgresql:// URL)
  engine_copy        migrate-to: a database copied whole into an empty one of the other engine
  payload            producer JSON read safely: strict parsing, depth, fields along a path, producer strings
  providers          per-producer signature, freshness, delivery id, event kind
  models             request bodies, rule documents, work items, answers (pydantic, extra="forbid")
  envelope           the document every rule sees
  evaluator          jq rule sets in sandboxed child processes
  store.*            transaction bodies, no HTTP: principals, outbox, todos, wait_limits, admission, outputs,
                     forge_outbox, transitions, queues, webhooks, connections, human_actions, bulk, subjects,
                     forge_control (the forge's commands, closes and pull requests), deliveries, rules, routing,
                     quarantine, replay, schedules (recurring work, and the leader's tick that makes each due time's
                     todo once), wait_sweep (acting on waits past their limit), upkeep
  doorbell           waking one waiting session when work becomes claimable
  notifier           the outbox's sender (ntfy, Gotify, Slack, Discord, signed webhooks)
  forge              the forge outputs' sender and the status comments (GitHub, Gitea); "who am I"
  limits, metrics    ingest rate limits, the proxies believed, the owners' evaluator gate; Prometheus metrics
  flows              what REST, MCP, the CLI and the Board do the same way
  http.*             common answers, streams, REST and ingress, MCP
  board.*            the Board's queries, its subjects' and connections' pages, and the pages (templates and
                     static files beside them)
  app                the app factory: every part put together
  server             uvicorn, logging, the process's lifetime
  worker.*           `switchboard worker`, the client side: job, tracing (its own spans), park, api, exec_runner,
                     triage, loop, main
  cli.*              output, commands, forge_commands (connections, subjects), parser, and entry (main(): the
                     worker before the rest is imported)
"""
