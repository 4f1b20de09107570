-- Switchboard schema for PostgreSQL (15 and later): schema.sql's tables, columns, indexes, constraints, view and
-- triggers under the same names, for the Postgres engine. schema.sql is the reference: a change there is made here
-- too (tests/test_schema_parity.py compares the two). This file makes a new database, at the version it records in
-- switchboard_schema; an existing one takes each missing step of switchboard/migrations.py in its Postgres form,
-- and a database migrated so must equal one made new (tests/test_migrations_both_engines.py). Every statement is
-- idempotent.
-- Times are integer milliseconds since the Unix epoch (UTC), BIGINT. JSON is stored as TEXT, as the store reads it.
-- What differs from schema.sql, and why:
-- - A table with a rowid in SQLite has a real `rowid` column (its last): the store orders ties and retention
--   pages and deletes by it. An index the store walks in (..., rowid) order names rowid last, as SQLite's indexes
--   end in the rowid implicitly; retention deletes by rowid through a unique index on it.
-- - json_valid/json_type/json_array_length are the switchboard_json_* functions below (PostgreSQL 15 has no
--   pg_input_is_valid, so an invalid document is caught as the cast's error).
-- - Triggers are PL/pgSQL functions, each fired AFTER ... FOR EACH ROW with schema.sql's UPDATE OF columns and
--   WHEN condition (`IS NOT` is IS DISTINCT FROM); the subject counts' cases are written once, as functions.

-- SQLite's json_valid: whether a text is one well-formed JSON document (NULL for NULL).
CREATE OR REPLACE FUNCTION switchboard_json_valid(document text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
BEGIN
    PERFORM document::json;
    RETURN true;
EXCEPTION WHEN data_exception OR program_limit_exceeded THEN
    -- A syntax error, or nesting too deep for the parser (SQLite's json_valid says false past depth 1000 too).
    RETURN false;
END $$;

-- The SQLite functions the store's statements call, under their SQLite names (the dialect passes them through):
-- json_valid; json_extract for the paths the store reads ('$.a.b': a scalar as text, an object or array as JSON
-- text); bytes_as_text for a body read as text (`CAST(body AS TEXT)`). A document that is not JSON, or bytes that
-- are not UTF-8, read as NULL, where SQLite would raise or read bytes: both only ever ask for what a producer sent.
CREATE OR REPLACE FUNCTION json_valid(document text) RETURNS boolean
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE RETURN switchboard_json_valid(document);

CREATE OR REPLACE FUNCTION json_extract(document text, path text) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
BEGIN
    RETURN document::json #>> string_to_array(substr(path, 3), '.');
EXCEPTION WHEN data_exception OR program_limit_exceeded THEN
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION bytes_as_text(body bytea) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
BEGIN
    RETURN convert_from(body, 'UTF8');
EXCEPTION WHEN data_exception THEN
    RETURN NULL;
END $$;

-- A transaction's check of what its process remembered (a token's principal, a read found empty): it fails the
-- transaction, and so the COMMIT sent behind it, when the check no longer holds (switchboard.postgres.PgTxn).
CREATE OR REPLACE FUNCTION switchboard_confirm(holds boolean, what text) RETURNS boolean
    LANGUAGE plpgsql AS $$
BEGIN
    IF holds IS NOT TRUE THEN
        RAISE EXCEPTION 'switchboard_confirm: % changed', what;
    END IF;
    RETURN true;
END $$;

-- SQLite's json_type for what schema.sql asks of it ('object', 'array'); NULL for a text that is not JSON, where
-- SQLite raises instead (every CHECK asks switchboard_json_valid first, so both refuse the row).
CREATE OR REPLACE FUNCTION switchboard_json_type(document text) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
BEGIN
    RETURN json_typeof(document::json);
EXCEPTION WHEN data_exception OR program_limit_exceeded THEN
    RETURN NULL;
END $$;

-- SQLite's json_array_length: an array's length, 0 for any other document.
CREATE OR REPLACE FUNCTION switchboard_json_array_length(document text) RETURNS integer
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN CASE WHEN switchboard_json_type(document) = 'array' THEN json_array_length(document::json) ELSE 0 END;

-- Whether a todo in this state counts as open for its subject, and whether it waits on the human: schema.sql's
-- subject triggers spell these cases out in each trigger.
CREATE OR REPLACE FUNCTION switchboard_todo_open(todo_state text) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE WHEN todo_state IN ('done', 'failed', 'cancelled') THEN 0 ELSE 1 END;

CREATE OR REPLACE FUNCTION switchboard_todo_waiting(todo_state text, todo_dead_letter bigint, todo_queue text)
    RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE WHEN todo_state IN ('quarantined', 'needs_input', 'blocked', 'review')
                     OR (todo_state = 'failed' AND todo_dead_letter = 1)
                     OR (todo_state = 'pending' AND todo_queue = 'hold') THEN 1 ELSE 0 END;

CREATE TABLE IF NOT EXISTS humans (
    id            TEXT PRIMARY KEY CHECK (id LIKE 'hu\_%' ESCAPE '\'),
    name          TEXT NOT NULL UNIQUE CHECK (length(name) BETWEEN 1 AND 64),
    token_hash    TEXT NOT NULL UNIQUE CHECK (length(token_hash) = 64),
    token_prefix  TEXT NOT NULL,
    created_at    BIGINT NOT NULL,
    -- The login an identity proxy names this human by (`serve --auth-header`): printable ASCII, kept lower-cased,
    -- one human's at most.
    login         TEXT UNIQUE CHECK (login IS NULL OR (length(login) BETWEEN 1 AND 254 AND login = lower(login))),
    rowid         BIGINT GENERATED BY DEFAULT AS IDENTITY
);

-- The Board's sign-ins. The browser keeps a random session token in an HttpOnly cookie; only its SHA-256 is
-- stored here. A session ends at sign-out, or once 12 hours pass without a request (each request moves
-- expires_at on); `csrf` is the token every state-changing form of that session must carry.
CREATE TABLE IF NOT EXISTS board_sessions (
    id            TEXT PRIMARY KEY CHECK (length(id) = 64),
    human_id      TEXT NOT NULL REFERENCES humans(id) ON DELETE CASCADE,
    csrf          TEXT NOT NULL CHECK (length(csrf) BETWEEN 32 AND 128),
    created_at    BIGINT NOT NULL,
    last_seen_at  BIGINT NOT NULL CHECK (last_seen_at >= created_at),
    expires_at    BIGINT NOT NULL CHECK (expires_at > last_seen_at),
    rowid         BIGINT GENERATED BY DEFAULT AS IDENTITY
);
CREATE INDEX IF NOT EXISTS board_sessions_by_human ON board_sessions(human_id);
CREATE INDEX IF NOT EXISTS board_sessions_expiry ON board_sessions(expires_at);

CREATE TABLE IF NOT EXISTS endpoints (
    id                     TEXT PRIMARY KEY CHECK (id LIKE 'ep\_%' ESCAPE '\'),
    human_id               TEXT NOT NULL REFERENCES humans(id),
    name                   TEXT NOT NULL CHECK (length(name) BETWEEN 1 AND 64),
    token_hash             TEXT NOT NULL UNIQUE CHECK (length(token_hash) = 64),
    token_prefix           TEXT NOT NULL,
    queues                 TEXT NOT NULL CHECK (switchboard_json_valid(queues)
                                                AND switchboard_json_type(queues) = 'array'),
    verbs                  TEXT NOT NULL CHECK (switchboard_json_valid(verbs)
                                                AND switchboard_json_type(verbs) = 'array'),
    default_lease_seconds  BIGINT CHECK (default_lease_seconds BETWEEN 60 AND 86400),
    webhook_max            BIGINT NOT NULL DEFAULT 5 CHECK (webhook_max >= 0),
    created_at             BIGINT NOT NULL,
    revoked_at             BIGINT,
    rowid                  BIGINT GENERATED BY DEFAULT AS IDENTITY,
    UNIQUE (human_id, name)
);

-- A human may route webhooks to another human's endpoints once that human approved the edge.
CREATE TABLE IF NOT EXISTS friend_edges (
    id            TEXT PRIMARY KEY CHECK (id LIKE 'fr\_%' ESCAPE '\'),
    requester_id  TEXT NOT NULL REFERENCES humans(id),
    approver_id   TEXT NOT NULL REFERENCES humans(id),
    requested_at  BIGINT NOT NULL,
    approved_at   BIGINT,
    rowid         BIGINT GENERATED BY DEFAULT AS IDENTITY,
    CHECK (requester_id <> approver_id),
    UNIQUE (requester_id, approver_id)
);

-- A webhook belongs to one owner endpoint. Its ingest URL token and its secret are credentials: the token is
-- stored only as SHA-256, the secret only encrypted (AES-256-GCM, the webhook id as associated data).
CREATE TABLE IF NOT EXISTS webhooks (
    id                TEXT PRIMARY KEY CHECK (id LIKE 'wh\_%' ESCAPE '\'),
    endpoint_id       TEXT NOT NULL REFERENCES endpoints(id),
    provider          TEXT NOT NULL CHECK (provider IN ('github', 'gitea', 'cairn', 'stripe', 'slack', 'generic')),
    queue             TEXT NOT NULL CHECK (length(queue) BETWEEN 1 AND 64 AND queue <> 'quarantine'),
    trust_mode        TEXT NOT NULL CHECK (trust_mode IN ('signed', 'token')),
    token_hash        TEXT NOT NULL UNIQUE CHECK (length(token_hash) = 64),
    secret_sealed     BYTEA,
    rules             TEXT CHECK (rules IS NULL OR switchboard_json_valid(rules)),
    params            TEXT NOT NULL DEFAULT '{}' CHECK (switchboard_json_valid(params)
                                                      AND switchboard_json_type(params) = 'object'),
    created_at        BIGINT NOT NULL,
    rotated_at        BIGINT,
    -- The trust gate's list (forge and cairn webhooks only): {"logins": [...], "match": ...},
    -- {"actor_ids": [...]} or {"allow_all": true}. An empty list holds every delivery.
    trusted_actors    TEXT CHECK (trusted_actors IS NULL
                                  OR (switchboard_json_valid(trusted_actors)
                                      AND switchboard_json_type(trusted_actors) = 'object')),
    -- When the producer last proved it holds the secret with a ping (GitHub's first delivery).
    pinged_at         BIGINT,
    -- A name its human chose, to tell apart webhooks of the same provider and queue (NULL: none yet).
    name              TEXT CHECK (name IS NULL OR length(name) BETWEEN 1 AND 64),
    rowid             BIGINT GENERATED BY DEFAULT AS IDENTITY,
    CHECK ((provider IN ('github', 'gitea', 'cairn')) = (trusted_actors IS NOT NULL)),
    CHECK ((trust_mode = 'token') = (provider = 'generic')),
    CHECK (provider <> 'generic' OR secret_sealed IS NULL)
);
CREATE INDEX IF NOT EXISTS webhooks_by_endpoint ON webhooks(endpoint_id);

-- Extra targets of a webhook, in grant order after the owner endpoint.
CREATE TABLE IF NOT EXISTS webhook_routes (
    webhook_id   TEXT NOT NULL REFERENCES webhooks(id) ON DELETE CASCADE,
    endpoint_id  TEXT NOT NULL REFERENCES endpoints(id),
    granted_at   BIGINT NOT NULL,
    granted_by   TEXT NOT NULL,
    PRIMARY KEY (webhook_id, endpoint_id)
);

-- Events: every accepted delivery and every operator-authored todo, with its routing decision.
CREATE TABLE IF NOT EXISTS events (
    id            TEXT PRIMARY KEY CHECK (id LIKE 'ev\_%' ESCAPE '\'),
    webhook_id    TEXT,
    human_id      TEXT NOT NULL REFERENCES humans(id),
    source        TEXT NOT NULL,
    kind          TEXT,
    trust_mode    TEXT NOT NULL CHECK (trust_mode IN ('signed', 'token', 'operator', 'schedule')),
    verified      BIGINT NOT NULL CHECK (verified IN (0, 1)),
    delivery_key  TEXT,
    body_hash     TEXT,
    headers       TEXT NOT NULL DEFAULT '{}' CHECK (switchboard_json_valid(headers)),
    -- The envelope without `.payload` and `.headers` (read from event_bodies and headers when it is shown).
    envelope      TEXT CHECK (envelope IS NULL OR switchboard_json_valid(envelope)),
    -- ping: a producer's hello (GitHub's `ping`), recorded and answered, never work. command: a commander's
    -- comment on the forge, acted on (or refused) by the server itself, never through the rules.
    disposition   TEXT NOT NULL CHECK (disposition IN ('routed', 'dropped', 'repeat', 'quarantined', 'ping', 'command')),
    trace         TEXT CHECK (trace IS NULL OR switchboard_json_valid(trace)),
    outcome       TEXT CHECK (outcome IS NULL OR switchboard_json_valid(outcome)),
    received_at   BIGINT NOT NULL,
    -- What the delivery is about (the envelope's subject_key), for the subject's timeline. Last, as the migration
    -- that added it left it.
    subject_key   TEXT,
    rowid         BIGINT GENERATED BY DEFAULT AS IDENTITY
);
CREATE UNIQUE INDEX IF NOT EXISTS events_delivery ON events(webhook_id, delivery_key) WHERE webhook_id IS NOT NULL;
-- One event per body on a signed webhook: a signed body replayed under a fresh delivery id is that event's
-- duplicate, and of two deliveries of one body recorded at once only one commits (the other finds it).
CREATE UNIQUE INDEX IF NOT EXISTS events_signed_body ON events(webhook_id, body_hash)
    WHERE webhook_id IS NOT NULL AND trust_mode = 'signed';
CREATE INDEX IF NOT EXISTS events_received ON events(received_at, rowid);
CREATE UNIQUE INDEX IF NOT EXISTS events_rowid ON events(rowid);
CREATE INDEX IF NOT EXISTS events_by_webhook ON events(webhook_id, received_at) WHERE webhook_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS events_by_subject ON events(subject_key, received_at) WHERE subject_key IS NOT NULL;

-- A delivery's body as received, the only copy: its payload (in its envelope and its todos) is read from it. It
-- lives apart from the event's row so that reading events never reads bodies: a row longer than a page keeps its
-- later columns in overflow pages, and packing a 2 KB event beside a 12 KB body wasted most of a page per row.
CREATE TABLE IF NOT EXISTS event_bodies (
    event_id  TEXT PRIMARY KEY REFERENCES events(id) ON DELETE CASCADE,
    body      BYTEA NOT NULL,
    rowid     BIGINT GENERATED BY DEFAULT AS IDENTITY
);

-- Once-only routing claims. event_id is deliberately not a foreign key: retention may prune the event,
-- and the claim must outlive it. Never pruned.
CREATE TABLE IF NOT EXISTS routing_once (
    webhook_id  TEXT NOT NULL,
    once_key    TEXT NOT NULL CHECK (once_key LIKE 'once:%'),
    event_id    TEXT NOT NULL,
    queue       TEXT NOT NULL,
    claimed_at  BIGINT NOT NULL,
    PRIMARY KEY (webhook_id, once_key)
);

CREATE TABLE IF NOT EXISTS todos (
    id               TEXT PRIMARY KEY CHECK (id LIKE 'td\_%' ESCAPE '\'),
    endpoint_id      TEXT NOT NULL REFERENCES endpoints(id),
    queue            TEXT NOT NULL CHECK (length(queue) BETWEEN 1 AND 64),
    state            TEXT NOT NULL CHECK (state IN ('pending', 'claimed', 'needs_input', 'blocked', 'review',
                                                    'deferred', 'done', 'failed', 'cancelled', 'quarantined')),
    outcome          TEXT CHECK (outcome IN ('completed', 'approved', 'absorbed', 'discarded')),
    title            TEXT NOT NULL CHECK (length(title) BETWEEN 1 AND 512),
    source           TEXT NOT NULL,
    kind             TEXT,
    subject_key      TEXT,
    -- NULL: the payload is the event's body (see todo_rows). Set only on a todo from an earlier release's database
    -- whose event retention had already pruned (since release 3 an event outlives every todo that points at it).
    payload          TEXT CHECK (payload IS NULL OR switchboard_json_valid(payload)),
    work_order       TEXT CHECK (work_order IS NULL OR switchboard_json_valid(work_order)),
    work_item        TEXT CHECK (work_item IS NULL OR switchboard_json_valid(work_item)),
    trace            TEXT CHECK (trace IS NULL OR switchboard_json_valid(trace)),
    event_id         TEXT REFERENCES events(id) ON DELETE SET NULL,
    idempotency_key  TEXT CHECK (idempotency_key IS NULL OR length(idempotency_key) BETWEEN 1 AND 256),
    priority         BIGINT NOT NULL DEFAULT 0,
    gated            BIGINT NOT NULL DEFAULT 0 CHECK (gated IN (0, 1)),
    attempt          BIGINT NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts     BIGINT NOT NULL DEFAULT 5 CHECK (max_attempts >= 1),
    lease_expires_at BIGINT,
    lease_token_hash TEXT,
    available_at     BIGINT NOT NULL,
    state_reason     TEXT,
    answer           TEXT,
    deferred_until   BIGINT,
    result           TEXT CHECK (result IS NULL OR switchboard_json_valid(result)),
    last_error       TEXT,
    dead_letter      BIGINT NOT NULL DEFAULT 0 CHECK (dead_letter IN (0, 1)),
    silent           BIGINT NOT NULL DEFAULT 0 CHECK (silent IN (0, 1)),
    ring_count       BIGINT NOT NULL DEFAULT 0 CHECK (ring_count >= 0),
    last_ring_at     BIGINT,
    ring_acked_at    BIGINT,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL,
    rowid            BIGINT GENERATED BY DEFAULT AS IDENTITY,
    -- After rowid: where the migration's ADD COLUMN puts them. traceparent: the W3C traceparent of the span that
    -- made the todo (`send {queue}`), kept export or not.
    wait_due_at      BIGINT,
    wait_reminders   BIGINT,
    traceparent      TEXT,
    -- A claimed todo always has a lease; any other state never does.
    CHECK ((state = 'claimed') = (lease_expires_at IS NOT NULL AND lease_token_hash IS NOT NULL)),
    -- Only done carries an outcome, and done always does.
    CHECK ((state = 'done') = (outcome IS NOT NULL)),
    CHECK (dead_letter = 0 OR state = 'failed'),
    -- Held items live only on the reserved queue, and nothing on it is ever claimable.
    CHECK (state <> 'quarantined' OR queue = 'quarantine'),
    CHECK (queue <> 'quarantine' OR state IN ('quarantined', 'done', 'cancelled'))
);
-- Todos as they are shown: each with the body and content type of its event, from which its payload is read.
-- t.* includes the rowid column here; todo_rowid names it again, as the store reads it from this view. A \u0000
-- escape anywhere in an envelope (valid JSON, a title may carry one) makes ->> fail, as PostgreSQL text holds no
-- NUL: it is read as U+FFFD, which changes only a content type that itself holds one.
-- The event's columns are scalar subqueries, not LEFT JOINs (the same rows): a verb reads the todo it is about to
-- change from this view FOR UPDATE, which Postgres refuses on the nullable side of an outer join.
CREATE OR REPLACE VIEW todo_rows AS
    SELECT t.*, t.rowid AS todo_rowid,
           (SELECT b.body FROM event_bodies b WHERE b.event_id = t.event_id) AS event_body,
           (SELECT replace(e.envelope, '\u0000', '\ufffd')::json ->> 'content_type' FROM events e
            WHERE e.id = t.event_id) AS event_content_type
    FROM todos t;
CREATE INDEX IF NOT EXISTS todos_claimable ON todos(endpoint_id, queue, priority DESC, created_at, rowid)
    WHERE state = 'pending';
-- Leases, by endpoint (a claim reaps its own endpoint's lapsed leases first). It also serves the reaper and the
-- next-due time across endpoints: it holds only claimed todos, which are few, so a scan of it is short.
CREATE INDEX IF NOT EXISTS todos_lapsed_by_endpoint ON todos(endpoint_id, lease_expires_at) WHERE state = 'claimed';
CREATE INDEX IF NOT EXISTS todos_unrung ON todos(available_at) WHERE state = 'pending' AND ring_count = 0;
CREATE INDEX IF NOT EXISTS todos_rerung ON todos(ring_count, last_ring_at) WHERE state = 'pending' AND ring_count > 0;
CREATE INDEX IF NOT EXISTS todos_deferred ON todos(deferred_until) WHERE state = 'deferred';
CREATE INDEX IF NOT EXISTS todos_held ON todos(created_at) WHERE state = 'quarantined';
CREATE INDEX IF NOT EXISTS todos_wait_due ON todos(wait_due_at) WHERE wait_due_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS todos_by_endpoint ON todos(endpoint_id, created_at);
CREATE INDEX IF NOT EXISTS todos_by_event ON todos(event_id);
CREATE UNIQUE INDEX IF NOT EXISTS todos_rowid ON todos(rowid);
CREATE INDEX IF NOT EXISTS todos_finished ON todos(updated_at, rowid) WHERE state IN ('done', 'failed', 'cancelled');
-- Todos by group (endpoint, state, queue), oldest first: each group's first page is one ordered range of it, so
-- the Board's inbox and the human's list pick a page from the few groups todo_counts names, at any size.
CREATE INDEX IF NOT EXISTS todos_by_state ON todos(endpoint_id, state, queue, created_at);
-- Todos about one subject, newest last: the todo list filtered by subject (and the subject pages) read one range.
CREATE INDEX IF NOT EXISTS todos_by_subject ON todos(subject_key, created_at, rowid);
-- Idempotency: one live todo per (endpoint, key); a finished one frees the key.
CREATE UNIQUE INDEX IF NOT EXISTS todos_idempotency ON todos(endpoint_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL AND state NOT IN ('done', 'failed', 'cancelled');

-- How many todos each group (endpoint, queue, state) holds, kept by the triggers below in the transaction that
-- changes the todos, so that no code path can let it drift: the Board's counts, the queues page and the metrics
-- read these few rows instead of counting the todos. `changes` moves whenever a todo enters or leaves the group
-- (the live view's digest). A row stays when its count reaches 0.
CREATE TABLE IF NOT EXISTS todo_counts (
    endpoint_id  TEXT NOT NULL,
    queue        TEXT NOT NULL,
    state        TEXT NOT NULL,
    n            BIGINT NOT NULL CHECK (n >= 0),
    changes      BIGINT NOT NULL,
    PRIMARY KEY (endpoint_id, queue, state)
);
CREATE OR REPLACE FUNCTION todo_counts_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO todo_counts (endpoint_id, queue, state, n, changes) VALUES (NEW.endpoint_id, NEW.queue, NEW.state, 1, 1)
        ON CONFLICT (endpoint_id, queue, state) DO UPDATE SET n = todo_counts.n + 1, changes = todo_counts.changes + 1;
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER todo_counts_insert AFTER INSERT ON todos
    FOR EACH ROW EXECUTE FUNCTION todo_counts_insert();

-- The two rows are locked in their key's order, whichever way the todo moves: a claim (pending to claimed) and a
-- completion followed by a claim (claimed to done, pending to claimed) taking them in opposite orders deadlock.
CREATE OR REPLACE FUNCTION todo_counts_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (OLD.endpoint_id, OLD.queue, OLD.state) < (NEW.endpoint_id, NEW.queue, NEW.state) THEN
        UPDATE todo_counts SET n = n - 1, changes = changes + 1
            WHERE endpoint_id = OLD.endpoint_id AND queue = OLD.queue AND state = OLD.state;
    END IF;
    INSERT INTO todo_counts (endpoint_id, queue, state, n, changes) VALUES (NEW.endpoint_id, NEW.queue, NEW.state, 1, 1)
        ON CONFLICT (endpoint_id, queue, state) DO UPDATE SET n = todo_counts.n + 1, changes = todo_counts.changes + 1;
    IF (OLD.endpoint_id, OLD.queue, OLD.state) > (NEW.endpoint_id, NEW.queue, NEW.state) THEN
        UPDATE todo_counts SET n = n - 1, changes = changes + 1
            WHERE endpoint_id = OLD.endpoint_id AND queue = OLD.queue AND state = OLD.state;
    END IF;
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER todo_counts_update AFTER UPDATE OF endpoint_id, queue, state ON todos
    FOR EACH ROW
    WHEN (OLD.endpoint_id IS DISTINCT FROM NEW.endpoint_id OR OLD.queue IS DISTINCT FROM NEW.queue
          OR OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION todo_counts_update();

CREATE OR REPLACE FUNCTION todo_counts_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE todo_counts SET n = n - 1, changes = changes + 1
        WHERE endpoint_id = OLD.endpoint_id AND queue = OLD.queue AND state = OLD.state;
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER todo_counts_delete AFTER DELETE ON todos
    FOR EACH ROW EXECUTE FUNCTION todo_counts_delete();

-- Queue control, per endpoint and queue, set by the endpoint's human: a pause (until a moment, or until resumed)
-- and admission caps (claimed at once; claims per window). A queue without a row is open; a row goes once nothing
-- is set. Windows are fixed, aligned to the epoch (a window of 3600 s turns on the hour): `window_claims` counts
-- the claims of the window that began at `window_started_at`, so a cap reads one row, never the claims.
-- `ring_due_at` is when the scheduler next rings for the queue (a pause ends, a full window turns).
CREATE TABLE IF NOT EXISTS queue_controls (
    endpoint_id        TEXT NOT NULL REFERENCES endpoints(id),
    queue              TEXT NOT NULL CHECK (length(queue) BETWEEN 1 AND 64),
    paused_at          BIGINT,
    paused_until       BIGINT,
    paused_by          TEXT,
    paused_reason      TEXT CHECK (paused_reason IS NULL OR length(paused_reason) BETWEEN 1 AND 4096),
    max_in_flight      BIGINT CHECK (max_in_flight >= 0),
    window_count       BIGINT CHECK (window_count >= 0),
    window_seconds     BIGINT CHECK (window_seconds >= 1),
    window_started_at  BIGINT,
    window_claims      BIGINT NOT NULL DEFAULT 0 CHECK (window_claims >= 0),
    ring_due_at        BIGINT,
    updated_at         BIGINT NOT NULL,
    wait_limits        TEXT,
    -- At most per_key_max claimed todos of the queue share a subject key (per_key 'subject') or a
    -- repository (per_key 'repo'); both null: no such limit.
    per_key            TEXT CHECK (per_key IN ('subject', 'repo')),
    per_key_max        BIGINT CHECK (per_key_max >= 1),
    CHECK ((paused_at IS NULL) = (paused_by IS NULL)),
    CHECK (paused_at IS NOT NULL OR (paused_until IS NULL AND paused_reason IS NULL)),
    CHECK ((window_count IS NULL) = (window_seconds IS NULL)),
    PRIMARY KEY (endpoint_id, queue)
);

-- Schedules: a human's recurring work for one of their endpoints, cron (five fields, in a time zone) or every N
-- seconds. next_run_at is the earliest due time not yet made into a todo (NULL while disabled): the leader's tick
-- makes each due time's todo and moves next_run_at on in one transaction, compare-and-set on the value it read,
-- so a due time is made once across restarts and processes. last_todo_id is not a foreign key: retention may
-- prune the todo.
CREATE TABLE IF NOT EXISTS schedules (
    id             TEXT PRIMARY KEY CHECK (id LIKE 'sc\_%' ESCAPE '\'),
    endpoint_id    TEXT NOT NULL REFERENCES endpoints(id),
    name           TEXT NOT NULL CHECK (length(name) BETWEEN 1 AND 128),
    queue          TEXT NOT NULL CHECK (length(queue) BETWEEN 1 AND 64),
    title          TEXT NOT NULL CHECK (length(title) BETWEEN 1 AND 512),
    cron           TEXT CHECK (cron IS NULL OR length(cron) BETWEEN 9 AND 256),
    every_seconds  BIGINT CHECK (every_seconds IS NULL OR every_seconds >= 1),
    timezone       TEXT NOT NULL CHECK (length(timezone) BETWEEN 1 AND 64),
    payload        TEXT CHECK (payload IS NULL OR switchboard_json_valid(payload)),
    work_item      TEXT CHECK (work_item IS NULL OR switchboard_json_valid(work_item)),
    priority       BIGINT NOT NULL DEFAULT 0,
    catch_up       TEXT NOT NULL CHECK (catch_up IN ('latest', 'none', 'all')),
    enabled        BIGINT NOT NULL CHECK (enabled IN (0, 1)),
    next_run_at    BIGINT,
    last_run_at    BIGINT,
    last_todo_id   TEXT,
    created_at     BIGINT NOT NULL,
    updated_at     BIGINT NOT NULL,
    CHECK ((cron IS NULL) <> (every_seconds IS NULL)),
    CHECK (enabled = 1 OR next_run_at IS NULL),
    UNIQUE (endpoint_id, name)
);
-- The leader's tick finds the due schedules, and the scheduler its next moment, through this alone.
CREATE INDEX IF NOT EXISTS schedules_due ON schedules(next_run_at) WHERE enabled = 1;

CREATE TABLE IF NOT EXISTS todo_deps (
    todo_id        TEXT NOT NULL REFERENCES todos(id) ON DELETE CASCADE,
    depends_on_id  TEXT NOT NULL REFERENCES todos(id) ON DELETE CASCADE,
    PRIMARY KEY (todo_id, depends_on_id),
    CHECK (todo_id <> depends_on_id)
);
CREATE INDEX IF NOT EXISTS todo_deps_reverse ON todo_deps(depends_on_id);

CREATE TABLE IF NOT EXISTS attempts (
    todo_id           TEXT NOT NULL REFERENCES todos(id) ON DELETE CASCADE,
    seq               BIGINT NOT NULL CHECK (seq >= 1),
    endpoint_id       TEXT NOT NULL REFERENCES endpoints(id),
    claimant          TEXT NOT NULL,
    claimed_at        BIGINT NOT NULL,
    lease_expires_at  BIGINT NOT NULL,
    lease_seconds     BIGINT NOT NULL CHECK (lease_seconds BETWEEN 1 AND 86400),
    heartbeats        BIGINT NOT NULL DEFAULT 0,
    ended_at          BIGINT,
    outcome           TEXT CHECK (outcome IN ('completed', 'failed', 'released', 'lease_expired', 'needs_input',
                                              'blocked', 'absorbed_into_other', 'cancelled')),
    summary           TEXT,
    artifact          TEXT,
    span_id           TEXT,  -- the attempt's `process {queue}` span, under its todo's traceparent (last)
    CHECK ((ended_at IS NULL) = (outcome IS NULL)),
    PRIMARY KEY (todo_id, seq)
);
-- At most one open attempt per todo: the one holding the lease.
CREATE UNIQUE INDEX IF NOT EXISTS attempts_open ON attempts(todo_id) WHERE ended_at IS NULL;

CREATE TABLE IF NOT EXISTS todo_history (
    id          BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    todo_id     TEXT NOT NULL REFERENCES todos(id) ON DELETE CASCADE,
    at          BIGINT NOT NULL,
    actor       TEXT NOT NULL CHECK (actor = 'system' OR actor LIKE 'endpoint:ep\_%' ESCAPE '\'
                                     OR actor LIKE 'human:hu\_%' ESCAPE '\'),
    from_state  TEXT,
    to_state    TEXT NOT NULL,
    evidence    TEXT CHECK (evidence IS NULL OR switchboard_json_valid(evidence))
);
CREATE INDEX IF NOT EXISTS todo_history_by_todo ON todo_history(todo_id, id);

-- Follow-ups a running attempt folded into its run. A row lives only while its holder's attempt may still
-- succeed; success turns the rows into a receipt, any other end deletes them (fail open).
CREATE TABLE IF NOT EXISTS absorptions (
    absorbed_id  TEXT PRIMARY KEY REFERENCES todos(id) ON DELETE CASCADE,
    holder_id    TEXT NOT NULL REFERENCES todos(id) ON DELETE CASCADE,
    holder_seq   BIGINT NOT NULL,
    absorbed_at  BIGINT NOT NULL,
    CHECK (absorbed_id <> holder_id)
);
CREATE INDEX IF NOT EXISTS absorptions_by_holder ON absorptions(holder_id);

-- Receipts are written only by the server, in the transaction that records the holder's success, and name
-- only todos the server handed to that attempt. Each todo is absorbed at most once.
CREATE TABLE IF NOT EXISTS receipts (
    id           TEXT PRIMARY KEY CHECK (id LIKE 'rc\_%' ESCAPE '\'),
    todo_id      TEXT NOT NULL REFERENCES todos(id) ON DELETE CASCADE,
    attempt_seq  BIGINT NOT NULL,
    written_at   BIGINT NOT NULL,
    rowid        BIGINT GENERATED BY DEFAULT AS IDENTITY,
    UNIQUE (todo_id, attempt_seq)
);
CREATE TABLE IF NOT EXISTS receipt_items (
    todo_id     TEXT PRIMARY KEY REFERENCES todos(id) ON DELETE CASCADE,
    receipt_id  TEXT NOT NULL REFERENCES receipts(id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS receipt_items_by_receipt ON receipt_items(receipt_id);

-- Notification channels: where a human hears that they are needed. The URL and the token are sealed
-- (AES-GCM, like webhook secrets); only a display form of the URL is kept in the clear.
CREATE TABLE IF NOT EXISTS notify_channels (
    id             TEXT PRIMARY KEY CHECK (id LIKE 'nc\_%' ESCAPE '\'),
    human_id       TEXT NOT NULL REFERENCES humans(id) ON DELETE CASCADE,
    kind           TEXT NOT NULL CHECK (kind IN ('ntfy', 'gotify', 'slack', 'discord', 'webhook')),
    url_sealed     BYTEA NOT NULL,
    url_shown      TEXT NOT NULL,
    token_sealed   BYTEA,
    events         TEXT NOT NULL CHECK (switchboard_json_valid(events) AND switchboard_json_type(events) = 'array'
                                        AND switchboard_json_array_length(events) > 0),
    created_at     BIGINT NOT NULL,
    last_sent_at   BIGINT,
    last_error     TEXT,
    last_error_at  BIGINT,
    failures       BIGINT NOT NULL DEFAULT 0 CHECK (failures >= 0),
    rowid          BIGINT GENERATED BY DEFAULT AS IDENTITY
);
CREATE INDEX IF NOT EXISTS notify_channels_by_human ON notify_channels(human_id);

-- The outbox: a message is written in the same transaction as the state change that causes it, and sent
-- after commit (again after a crash). Its id is the stable message id a receiver deduplicates on. Rows held
-- back by the per-channel rate limit are folded into one digest message (digest_id) when it is sent.
CREATE TABLE IF NOT EXISTS notify_outbox (
    id          TEXT PRIMARY KEY CHECK (id LIKE 'nm\_%' ESCAPE '\'),
    channel_id  TEXT NOT NULL REFERENCES notify_channels(id) ON DELETE CASCADE,
    event       TEXT NOT NULL CHECK (event IN ('needs_input', 'review', 'held', 'dead_letter',
                                               'verification_failures', 'test')),
    data        TEXT NOT NULL CHECK (switchboard_json_valid(data)),
    created_at  BIGINT NOT NULL,
    attempts    BIGINT NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_at     BIGINT NOT NULL,
    digest_id   TEXT CHECK (digest_id IS NULL OR digest_id LIKE 'nm\_%' ESCAPE '\'),
    sent_at     BIGINT,
    gave_up_at  BIGINT,
    rowid       BIGINT GENERATED BY DEFAULT AS IDENTITY,
    CHECK (sent_at IS NULL OR gave_up_at IS NULL)
);
CREATE UNIQUE INDEX IF NOT EXISTS notify_outbox_rowid ON notify_outbox(rowid);
CREATE INDEX IF NOT EXISTS notify_outbox_due ON notify_outbox(next_at) WHERE sent_at IS NULL AND gave_up_at IS NULL;
CREATE INDEX IF NOT EXISTS notify_outbox_by_channel ON notify_outbox(channel_id, created_at)
    WHERE sent_at IS NULL AND gave_up_at IS NULL;

-- Outputs held: while this one row exists, nothing goes out (forge outputs, status comments, notifications);
-- it accumulates and is sent once the operator resumes. Every backup is born with it, so a restored copy (a drill)
-- is no live server until the operator says so.
CREATE TABLE IF NOT EXISTS outputs_hold (
    scope   TEXT PRIMARY KEY CHECK (scope = 'all'),
    since   BIGINT NOT NULL,
    reason  TEXT NOT NULL CHECK (length(reason) BETWEEN 1 AND 512)
);

-- Replays: a stored delivery evaluated again under the webhook's current rules, by a human.
CREATE TABLE IF NOT EXISTS event_replays (
    id          TEXT PRIMARY KEY CHECK (id LIKE 'rp\_%' ESCAPE '\'),
    event_id    TEXT NOT NULL REFERENCES events(id) ON DELETE CASCADE,
    actor       TEXT NOT NULL,
    at          BIGINT NOT NULL,
    before      TEXT NOT NULL CHECK (switchboard_json_valid(before)),
    after       TEXT NOT NULL CHECK (switchboard_json_valid(after)),
    created     BIGINT NOT NULL CHECK (created >= 0),
    rowid       BIGINT GENERATED BY DEFAULT AS IDENTITY
);
CREATE INDEX IF NOT EXISTS event_replays_by_event ON event_replays(event_id, at);

-- Subjects: what work is about (an issue, a pull request, a cairn artifact: its subject_key), one row for each
-- human whose webhooks received a delivery about it or whose endpoints hold a todo about it. The delivery
-- transaction writes the title, link and labels as last delivered; the triggers below keep the counts of the
-- human's todos about it that are open and that wait on the human (held, quarantined, needs_input, blocked,
-- review, dead letter) in the transaction that changes the todos, and `state` with them, so that the list
-- filters by state through an index at any size. A row outlives the todos and events retention prunes.
CREATE TABLE IF NOT EXISTS subjects (
    human_id          TEXT NOT NULL REFERENCES humans(id) ON DELETE CASCADE,
    key               TEXT NOT NULL CHECK (length(key) BETWEEN 1 AND 4096),
    title             TEXT,
    url               TEXT,
    labels            TEXT NOT NULL DEFAULT '[]' CHECK (switchboard_json_valid(labels)
                                                      AND switchboard_json_type(labels) = 'array'),
    open_todos        BIGINT NOT NULL DEFAULT 0 CHECK (open_todos >= 0),
    waiting_todos     BIGINT NOT NULL DEFAULT 0 CHECK (waiting_todos >= 0),
    state             TEXT NOT NULL DEFAULT 'done'
                      CHECK (state = CASE WHEN waiting_todos > 0 THEN 'waiting' WHEN open_todos > 0 THEN 'open'
                                          ELSE 'done' END),
    first_seen_at     BIGINT NOT NULL,
    last_activity_at  BIGINT NOT NULL CHECK (last_activity_at >= first_seen_at),
    PRIMARY KEY (human_id, key)
);
-- Most recently active first, per state: the list reads one range per state (a page at any size).
CREATE INDEX IF NOT EXISTS subjects_by_state ON subjects(human_id, state, last_activity_at, key);

-- A todo joins its subject's row for the human of its endpoint (made at its first todo or delivery), and leaves it.
CREATE OR REPLACE FUNCTION switchboard_subject_join(todo_endpoint text, subject text, opens integer, waits integer,
                                                    at_ms bigint) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO subjects (human_id, key, open_todos, waiting_todos, state, first_seen_at, last_activity_at)
        SELECT human_id, subject, opens, waits,
               CASE WHEN waits > 0 THEN 'waiting' WHEN opens > 0 THEN 'open' ELSE 'done' END, at_ms, at_ms
        FROM endpoints WHERE id = todo_endpoint
        ON CONFLICT (human_id, key) DO UPDATE SET
            open_todos = subjects.open_todos + excluded.open_todos,
            waiting_todos = subjects.waiting_todos + excluded.waiting_todos,
            state = CASE WHEN subjects.waiting_todos + excluded.waiting_todos > 0 THEN 'waiting'
                         WHEN subjects.open_todos + excluded.open_todos > 0 THEN 'open' ELSE 'done' END,
            last_activity_at = CASE WHEN excluded.last_activity_at > subjects.last_activity_at
                                    THEN excluded.last_activity_at ELSE subjects.last_activity_at END;
END $$;

CREATE OR REPLACE FUNCTION switchboard_subject_leave(todo_endpoint text, subject text, opens integer,
                                                     waits integer) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    UPDATE subjects SET
        open_todos = open_todos - opens,
        waiting_todos = waiting_todos - waits,
        state = CASE WHEN waiting_todos - waits > 0 THEN 'waiting' WHEN open_todos - opens > 0 THEN 'open'
                     ELSE 'done' END
    WHERE human_id = (SELECT human_id FROM endpoints WHERE id = todo_endpoint) AND key = subject;
END $$;

CREATE OR REPLACE FUNCTION subjects_todo_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM switchboard_subject_join(NEW.endpoint_id, NEW.subject_key, switchboard_todo_open(NEW.state),
                                     switchboard_todo_waiting(NEW.state, NEW.dead_letter, NEW.queue), NEW.created_at);
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER subjects_todo_insert AFTER INSERT ON todos
    FOR EACH ROW WHEN (NEW.subject_key IS NOT NULL) EXECUTE FUNCTION subjects_todo_insert();

-- A todo on the same human's endpoint that opens, finishes, or starts or stops waiting on the human moves its
-- subject's counts and its last activity. A change that moves neither count (a claim, a release, a retry's
-- backoff) writes nothing here: the hottest transitions cost no subject write.
CREATE OR REPLACE FUNCTION subjects_todo_update() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    opens integer := switchboard_todo_open(NEW.state) - switchboard_todo_open(OLD.state);
    waits integer := switchboard_todo_waiting(NEW.state, NEW.dead_letter, NEW.queue)
                     - switchboard_todo_waiting(OLD.state, OLD.dead_letter, OLD.queue);
BEGIN
    UPDATE subjects SET
        open_todos = open_todos + opens,
        waiting_todos = waiting_todos + waits,
        state = CASE WHEN waiting_todos + waits > 0 THEN 'waiting' WHEN open_todos + opens > 0 THEN 'open'
                     ELSE 'done' END,
        last_activity_at = CASE WHEN NEW.updated_at > last_activity_at THEN NEW.updated_at ELSE last_activity_at END
    WHERE human_id = (SELECT human_id FROM endpoints WHERE id = NEW.endpoint_id) AND key = NEW.subject_key;
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER subjects_todo_update AFTER UPDATE OF state, queue, dead_letter, endpoint_id ON todos
    FOR EACH ROW
    WHEN (NEW.subject_key IS NOT NULL AND OLD.endpoint_id IS NOT DISTINCT FROM NEW.endpoint_id
          AND (switchboard_todo_open(OLD.state) <> switchboard_todo_open(NEW.state)
               OR switchboard_todo_waiting(OLD.state, OLD.dead_letter, OLD.queue)
                  <> switchboard_todo_waiting(NEW.state, NEW.dead_letter, NEW.queue)))
    EXECUTE FUNCTION subjects_todo_update();

-- A todo moved to another endpoint (a held delivery released to a friend's lane) leaves its old endpoint's
-- human's subject row and joins its new one's (which may be another human's).
CREATE OR REPLACE FUNCTION subjects_todo_moved() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM switchboard_subject_leave(OLD.endpoint_id, OLD.subject_key, switchboard_todo_open(OLD.state),
                                      switchboard_todo_waiting(OLD.state, OLD.dead_letter, OLD.queue));
    PERFORM switchboard_subject_join(NEW.endpoint_id, NEW.subject_key, switchboard_todo_open(NEW.state),
                                     switchboard_todo_waiting(NEW.state, NEW.dead_letter, NEW.queue), NEW.updated_at);
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER subjects_todo_moved AFTER UPDATE OF endpoint_id ON todos
    FOR EACH ROW WHEN (NEW.subject_key IS NOT NULL AND OLD.endpoint_id IS DISTINCT FROM NEW.endpoint_id)
    EXECUTE FUNCTION subjects_todo_moved();

CREATE OR REPLACE FUNCTION subjects_todo_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM switchboard_subject_leave(OLD.endpoint_id, OLD.subject_key, switchboard_todo_open(OLD.state),
                                      switchboard_todo_waiting(OLD.state, OLD.dead_letter, OLD.queue));
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER subjects_todo_delete AFTER DELETE ON todos
    FOR EACH ROW WHEN (OLD.subject_key IS NOT NULL) EXECUTE FUNCTION subjects_todo_delete();

-- Todos done, by endpoint, queue and minute, over the last day: the queues page's "done in the last hour and
-- day" reads at most 1,440 rows a queue instead of the day's finished todos. Kept by the trigger (which also
-- drops the queue's minutes older than a day) in the transaction that finishes the todo.
CREATE TABLE IF NOT EXISTS todo_done_minutes (
    endpoint_id  TEXT NOT NULL,
    queue        TEXT NOT NULL,
    minute       BIGINT NOT NULL,
    n            BIGINT NOT NULL CHECK (n > 0),
    PRIMARY KEY (endpoint_id, queue, minute)
);
CREATE OR REPLACE FUNCTION todo_done_minutes_count() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM todo_done_minutes WHERE endpoint_id = NEW.endpoint_id AND queue = NEW.queue
        AND minute < NEW.updated_at / 60000 - 1440;
    INSERT INTO todo_done_minutes (endpoint_id, queue, minute, n) VALUES (NEW.endpoint_id, NEW.queue,
                                                                          NEW.updated_at / 60000, 1)
        ON CONFLICT (endpoint_id, queue, minute) DO UPDATE SET n = todo_done_minutes.n + 1;
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER todo_done_minutes_count AFTER UPDATE OF state ON todos
    FOR EACH ROW WHEN (NEW.state = 'done' AND OLD.state IS DISTINCT FROM 'done')
    EXECUTE FUNCTION todo_done_minutes_count();

-- Forge connections: a human's credential for writing to GitHub or Gitea (labels, comments) on the repositories
-- `repos` names (owners `acme/` or repositories `acme/site`). The token is sealed (AES-GCM, the connection's id as
-- associated data) and never shown again; `login` is who the forge said the token is when it was added.
CREATE TABLE IF NOT EXISTS forge_connections (
    id             TEXT PRIMARY KEY CHECK (id LIKE 'fc\_%' ESCAPE '\'),
    human_id       TEXT NOT NULL REFERENCES humans(id) ON DELETE CASCADE,
    kind           TEXT NOT NULL CHECK (kind IN ('github', 'gitea')),
    api_url        TEXT NOT NULL CHECK (length(api_url) BETWEEN 1 AND 2048),
    token_sealed   BYTEA NOT NULL,
    login          TEXT NOT NULL CHECK (length(login) BETWEEN 1 AND 256),
    repos          TEXT NOT NULL CHECK (switchboard_json_valid(repos) AND switchboard_json_type(repos) = 'array'
                                        AND switchboard_json_array_length(repos) > 0),
    created_at     BIGINT NOT NULL,
    last_used_at   BIGINT,
    last_error     TEXT,
    last_error_at  BIGINT,
    rowid          BIGINT GENERATED BY DEFAULT AS IDENTITY
);
CREATE INDEX IF NOT EXISTS forge_connections_by_human ON forge_connections(human_id);

-- The connection a webhook writes through, whether it keeps a status comment on each issue (`mirror`), and its
-- output policy: which outputs a worker holding one of its todos may ask for, which labels, how many per todo.
CREATE TABLE IF NOT EXISTS webhook_connections (
    webhook_id     TEXT PRIMARY KEY REFERENCES webhooks(id) ON DELETE CASCADE,
    connection_id  TEXT NOT NULL REFERENCES forge_connections(id) ON DELETE CASCADE,
    mirror         BIGINT NOT NULL DEFAULT 0 CHECK (mirror IN (0, 1)),
    policy         TEXT NOT NULL CHECK (switchboard_json_valid(policy)
                                        AND switchboard_json_type(policy) = 'object'),
    connected_at   BIGINT NOT NULL,
    rowid          BIGINT GENERATED BY DEFAULT AS IDENTITY,
    -- Who may steer the work from the forge (`commands`: logins, on_close); NULL: nobody, as before commands.
    commands       TEXT CHECK (commands IS NULL OR (switchboard_json_valid(commands)
                                                    AND switchboard_json_type(commands) = 'object'))
);
CREATE INDEX IF NOT EXISTS webhook_connections_by_connection ON webhook_connections(connection_id);

-- Outputs: what a worker asked the server to write on the forge, accepted in the transaction of the worker's
-- report and sent after commit, in order per subject, by the forge sender. The target (repository and number)
-- is the work order's, never the worker's. `error` is the last failure (a pending output is being retried).
CREATE TABLE IF NOT EXISTS forge_outputs (
    id             TEXT PRIMARY KEY CHECK (id LIKE 'out\_%' ESCAPE '\'),
    todo_id        TEXT NOT NULL REFERENCES todos(id) ON DELETE CASCADE,
    connection_id  TEXT REFERENCES forge_connections(id) ON DELETE SET NULL,
    subject_key    TEXT NOT NULL,
    repo           TEXT NOT NULL,
    number         BIGINT NOT NULL CHECK (number > 0),
    type           TEXT NOT NULL CHECK (type IN ('add_labels', 'remove_labels', 'comment')),
    labels         TEXT CHECK (labels IS NULL
                               OR (switchboard_json_valid(labels) AND switchboard_json_type(labels) = 'array')),
    body           TEXT,
    state          TEXT NOT NULL CHECK (state IN ('pending', 'sent', 'failed')),
    error          TEXT,
    attempts       BIGINT NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_at        BIGINT NOT NULL,
    created_at     BIGINT NOT NULL,
    sent_at        BIGINT,
    forge_id       TEXT,
    rowid          BIGINT GENERATED BY DEFAULT AS IDENTITY,
    -- Its `forge {type}` span, which the label event it causes links to. Last, as its migration adds it.
    traceparent    TEXT,
    CHECK ((type = 'comment') = (body IS NOT NULL)),
    CHECK ((type = 'comment') = (labels IS NULL)),
    CHECK ((state = 'sent') = (sent_at IS NOT NULL)),
    CHECK (state <> 'failed' OR error IS NOT NULL),
    CHECK (state <> 'pending' OR connection_id IS NOT NULL)
);
CREATE INDEX IF NOT EXISTS forge_outputs_by_todo ON forge_outputs(todo_id, created_at);
CREATE INDEX IF NOT EXISTS forge_outputs_by_subject ON forge_outputs(subject_key, created_at);
CREATE INDEX IF NOT EXISTS forge_outputs_pending ON forge_outputs(subject_key, created_at, id) WHERE state = 'pending';

-- The status comment of each issue a mirroring webhook's todos are about: one comment, found again by its
-- marker, edited in place. `version` moves with every change of those todos; `shown_version` is what the comment
-- last said; `due_at` is when the sender edits it next (at least 10 s after the last edit), NULL when it is
-- up to date.
CREATE TABLE IF NOT EXISTS forge_status (
    connection_id  TEXT NOT NULL REFERENCES forge_connections(id) ON DELETE CASCADE,
    subject_key    TEXT NOT NULL,
    repo           TEXT NOT NULL,
    number         BIGINT NOT NULL CHECK (number > 0),
    comment_id     TEXT,
    version        BIGINT NOT NULL DEFAULT 1 CHECK (version >= 1),
    shown_version  BIGINT NOT NULL DEFAULT 0 CHECK (shown_version >= 0),
    due_at         BIGINT,
    edited_at      BIGINT,
    edits          BIGINT NOT NULL DEFAULT 0 CHECK (edits >= 0),
    attempts       BIGINT NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    error          TEXT,
    PRIMARY KEY (connection_id, subject_key)
);
CREATE INDEX IF NOT EXISTS forge_status_due ON forge_status(due_at) WHERE due_at IS NOT NULL;

-- The server's acknowledgement of each forge command it read: a reaction on the command's comment (`+1` it acted,
-- `confused` it refused), one per command delivery, sent after commit by the forge sender. A reaction is the
-- forge's own idempotent act (the same reaction again is the one already there), so a retry after a lost answer
-- adds nothing; `next_at` leases a send in flight as forge_outputs' does.
CREATE TABLE IF NOT EXISTS forge_reactions (
    event_id       TEXT PRIMARY KEY REFERENCES events(id) ON DELETE CASCADE,
    connection_id  TEXT REFERENCES forge_connections(id) ON DELETE SET NULL,
    subject_key    TEXT NOT NULL,
    repo           TEXT NOT NULL,
    comment_id     TEXT NOT NULL CHECK (length(comment_id) BETWEEN 1 AND 32),
    content        TEXT NOT NULL CHECK (content IN ('+1', 'confused')),
    state          TEXT NOT NULL CHECK (state IN ('pending', 'sent', 'failed')),
    error          TEXT,
    attempts       BIGINT NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_at        BIGINT NOT NULL,
    created_at     BIGINT NOT NULL,
    sent_at        BIGINT,
    CHECK ((state = 'sent') = (sent_at IS NOT NULL)),
    CHECK (state <> 'failed' OR error IS NOT NULL),
    CHECK (state <> 'pending' OR connection_id IS NOT NULL)
);
CREATE INDEX IF NOT EXISTS forge_reactions_pending ON forge_reactions(next_at) WHERE state = 'pending';

-- A pull request that says it closes an issue ("Fixes #12", same repository, from a trusted actor), per human:
-- both subjects' pages show the link, and merging the pull request approves the issue's todos in review.
CREATE TABLE IF NOT EXISTS subject_links (
    human_id     TEXT NOT NULL REFERENCES humans(id) ON DELETE CASCADE,
    pull_key     TEXT NOT NULL CHECK (length(pull_key) BETWEEN 1 AND 4096),
    issue_key    TEXT NOT NULL CHECK (length(issue_key) BETWEEN 1 AND 4096),
    event_id     TEXT,
    linked_at    BIGINT NOT NULL,
    PRIMARY KEY (human_id, pull_key, issue_key)
);
CREATE INDEX IF NOT EXISTS subject_links_by_issue ON subject_links(human_id, issue_key, pull_key);

-- The migration steps this database took (switchboard/migrations.py), each with the version it reached, what it
-- did and when; a new database has one row, the version it was made at. `check` shows them. (The version itself
-- is kept in switchboard_schema, which the engine makes before applying this file.)
CREATE TABLE IF NOT EXISTS schema_history (
    version     BIGINT PRIMARY KEY,
    summary     TEXT NOT NULL,
    applied_at  BIGINT NOT NULL
);

-- Postgres only: what several processes on one database share.
-- The processes serving the database, each heard of every few seconds (`check` reports them and their clocks'
-- distance from the database's: clock_ms is the process's clock, db_ms the database's, at the same moment).
CREATE UNLOGGED TABLE IF NOT EXISTS processes (
    id          TEXT PRIMARY KEY,
    host        TEXT NOT NULL,
    pid         BIGINT NOT NULL,
    started_at  BIGINT NOT NULL,
    seen_at     BIGINT NOT NULL,
    clock_ms    BIGINT NOT NULL,
    db_ms       BIGINT NOT NULL
);
-- Which process has doorbell sessions for which endpoint and queues (NULL: every queue), and whether one of them
-- is a waiting claim: a committing transaction reads this to send each ring to exactly one process. Unlogged: it
-- is rebuilt by the processes themselves after a crash of the database server.
CREATE UNLOGGED TABLE IF NOT EXISTS ring_listeners (
    process_id   TEXT NOT NULL,
    endpoint_id  TEXT NOT NULL,
    queues       TEXT[],
    waiting      BIGINT NOT NULL CHECK (waiting IN (0, 1))
);
CREATE INDEX IF NOT EXISTS ring_listeners_by_endpoint ON ring_listeners(endpoint_id);
