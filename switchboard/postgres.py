"""Postgres: the same transaction bodies as SQLite mode, each run on a pooled connection of its own, for several
processes (on several machines) sharing one database.

What differs from SQLite lives here, and nowhere in the store: the statements' placeholders and the few spellings
SQLite alone knows (`dialect_sql`), the lock vocabulary (`PgTxn.lock`, `lock_key`, `skip_locked`, `for_update`),
bodies run again after a serialization failure, a deadlock or the unique violation a constraint arbitrates, the
schema applied once under an advisory lock, and what several processes share: the leader (an advisory lock held by
one process's connection), the rings (each sent by NOTIFY to the one process whose session is chosen in the
committing transaction) and the processes' heartbeats (for `check`'s clock skew)."""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import json
import math
import os
import random
import re
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import psycopg.adapt
import psycopg.errors
import psycopg_pool
from psycopg.pq import Format

from switchboard.configuration import SCHEDULER_TICK_SECONDS, SCHEMA_VERSION, ApiError, Clock, log, shipped_path
from switchboard.crypto import new_id
from switchboard.database import PRINCIPAL_RECHECK, Txn
from switchboard.migrations import CREATED, MIGRATIONS, POSTGRES_FIRST_VERSION, RECORD_STEP, Migration

if TYPE_CHECKING:
    from asyncio import AbstractEventLoop

# A body meeting one of these ran against others' writes: it runs again, from the start, in a new transaction.
RETRIED = (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected, psycopg.errors.UniqueViolation,
           psycopg.errors.LockNotAvailable)
MAX_ATTEMPTS = 8
_traced_connections = itertools.count(1)
LEADER_LOCK = 0x5357_4c45_4144  # "SWLEAD": pg_try_advisory_lock's key for the leader
MIGRATE_LOCK = 0x5357_4d49_4752  # "SWMIGR": one process migrates, the others wait for it
# What change_marker reads (see there)
CHANGE_MARKER = ("SELECT (SELECT coalesce(sum(changes), 0) FROM todo_counts), (SELECT count(*) FROM board_sessions),"
                 " (SELECT coalesce(max(rowid), 0) FROM board_sessions),"
                 " (SELECT max(updated_at) FROM todos WHERE state = 'claimed')")
HEARTBEAT_SECONDS = 5.0  # also how often the leader drops the processes gone
# This process's listeners are published at most this often: a busy worker's waiting claims come and go many
# times a second, and each publication is a transaction
PUBLISH_GAP_SECONDS = 0.1
PROCESS_STALE_MS = 15_000  # a process not heard of for this long is gone: its ring listeners are dropped
RING_CHANNEL = "switchboard_ring_"  # + the process id: NOTIFY payloads are the rings chosen for that process
PROTOCOL_TRACE = "SWITCHBOARD_PG_TRACE"  # a directory: each pooled connection's libpq trace (_trace_protocol)
OUTBOX_CHANNEL = "switchboard_outbox"  # a commit wrote to an outbox: the leader's senders look (whoever committed)
BEGIN = "BEGIN"
CONFIRM_FAILED = "switchboard_confirm:"  # how the message of a failed check of what the process remembered begins
PRINCIPAL_GONE = "principal"
STALE_NONE = "none"
SAVEPOINT_COMMANDS = ("SAVEPOINT ", "ROLLBACK TO ", "RELEASE ")
BEGIN_READING = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"  # one snapshot for every read of the body


class Row(tuple):
    """A result row read by name or by position, as sqlite3.Row is."""

    __slots__ = ()
    names: dict[str, int] = {}

    def __getitem__(self, key):
        if isinstance(key, str):
            return tuple.__getitem__(self, self.names[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self.names)


def _row_factory(cursor: psycopg.Cursor) -> Callable[[Any], Row]:
    """One Row class per result shape, so a row costs a tuple and the names are shared. The shape is the result's
    column names as the server sent them: `cursor.description` would build a Column (name, type, sizes) for each
    column of every result, which was an eighth of the client's time on a read-heavy run."""
    result = cursor.pgresult
    if result is None or not result.nfields:
        return tuple
    return _row_class(tuple(result.fname(i) for i in range(result.nfields)))


@functools.lru_cache(maxsize=1024)
def _row_class(names: tuple[bytes, ...]) -> Callable[[Any], Row]:
    shaped = type("Row", (Row,), {"__slots__": (), "names": {name.decode(): i for i, name in enumerate(names)}})
    return shaped


class _BoolAsInteger(psycopg.adapt.Dumper):
    """Flags are 0/1 integers in both schemas, and the store passes Python booleans for them."""

    oid = 20  # int8
    format = Format.TEXT

    def dump(self, obj: bool) -> bytes:
        return b"1" if obj else b"0"


# SQLite-only spellings the store uses, and their Postgres forms. Each is a whole phrase the store writes one way.
_REWRITES = (
    (re.compile(r"\bINDEXED BY \w+"), ""),
    (re.compile(r"\bINSERT OR IGNORE INTO\b(.*)$", re.S), r"INSERT INTO\1 ON CONFLICT DO NOTHING"),
    (re.compile(r"\bCAST\((\w+(?:\.\w+)?) AS TEXT\)"), r"bytes_as_text(\1)"),
    (re.compile(r"\bAS INTEGER\)"), "AS BIGINT)"),
    (re.compile(r"\bjson_group_array\(json_object\("), "json_agg(json_build_object("),
    (re.compile(r"\bjson_each\((\w+)\)"), r"json_array_elements_text(\1::json) AS elements(value)"),
)


_WRITES = re.compile(r"\s*(?:INSERT (?:OR \w+ )?INTO|UPDATE|DELETE FROM) (\w+)")


@functools.lru_cache(maxsize=256)
def _tables_read(sql: str) -> frozenset[str]:
    return frozenset(re.findall(r"\b(?:FROM|JOIN) (\w+)", sql))


@functools.lru_cache(maxsize=4096)
def dialect_sql(sql: str) -> str:
    """A store statement as Postgres takes it: `?` placeholders become `%s` (a literal `%` doubles), and the
    few SQLite-only phrases are rewritten."""
    for pattern, replacement in _REWRITES:
        sql = pattern.sub(replacement, sql)
    return sql.replace("%", "%%").replace("?", "%s")


def _trace_protocol(conn: psycopg.Connection, directory: Path) -> None:
    """libpq's trace of every message this connection sends and receives, in a file of its own in `directory`
    (`SWITCHBOARD_PG_TRACE`): what a statement costs on the wire, and the benchmark's and tests' count of round trips
    (round_trips). The file stays open as long as the connection. It holds the statements' parameters (tokens'
    hashes, sealed secrets, delivery bodies): a diagnostic for a test database, whose directory the operator guards
    and empties."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{os.getpid()}-{next(_traced_connections)}.trace"
    stream = open(path, "w")  # noqa: SIM115 - closed with the connection, below
    conn.pgconn.trace(stream.fileno())
    conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE)
    weakref.finalize(conn, stream.close)


def round_trips(trace: str) -> int:
    """How many times a connection sent and then waited for the server, in a libpq trace's lines: each turn from
    the frontend's messages (F) to the backend's (B) is one round trip, however many statements went in it."""
    turns, sending = 0, False
    for line in trace.splitlines():
        if line.startswith("F"):
            sending = True
        elif line.startswith("B") and sending:
            turns += 1
            sending = False
    return turns


class KnownNones:
    """The reads (statement and parameters) this process found empty, for Txn.all_usually_none: a bounded set,
    oldest forgotten first, shared by the pool's threads."""

    def __init__(self, most: int = 8192):
        self.most = most
        self._keys: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def known(self, key: tuple) -> bool:
        return key in self._keys

    def remember(self, key: tuple) -> None:
        with self._lock:
            self._keys[key] = None
            while len(self._keys) > self.most:
                self._keys.popitem(last=False)

    def forget(self, key: tuple) -> None:
        with self._lock:
            self._keys.pop(key, None)


class Sent:
    """A statement sent in the transaction's pipeline: its result is read only when the body asks for it (its rows,
    or how many rows it changed), so statements whose results nobody reads go to the server together with the next
    one that is read, or with the COMMIT."""

    __slots__ = ("pipeline", "cursor")

    def __init__(self, pipeline: psycopg.Pipeline | None, cursor: psycopg.Cursor):
        self.pipeline, self.cursor = pipeline, cursor

    @property
    def rowcount(self) -> int:
        if self.pipeline is not None:  # the count arrives with the result: send what waits, and read it
            self.pipeline.sync()
        return self.cursor.rowcount

    def fetchone(self) -> Row | None:
        return self.cursor.fetchone()

    def fetchall(self) -> list[Row]:
        return self.cursor.fetchall()

    def __iter__(self):
        return iter(self.cursor.fetchall())


class PgTxn(Txn):
    """A body's view on Postgres: the same calls, on one pooled connection inside one READ COMMITTED transaction;
    the lock vocabulary takes real locks."""

    skip_locked = " FOR UPDATE SKIP LOCKED"
    for_update = " FOR UPDATE"
    engine = "postgres"

    def __init__(self, conn: psycopg.Connection, now: int, inline_rings: bool,
                 pipeline: psycopg.Pipeline | None = None, nones: KnownNones | None = None,
                 rechecks: Iterable[tuple[str, tuple]] = ()):
        super().__init__(conn, now, inline_rings)
        self.pipeline = pipeline  # None: a one-statement read in autocommit (read_statement)
        self.nones = nones
        # Each check of what the process remembered (a principal behind a token, PRINCIPAL_RECHECK; a read found
        # empty, all_usually_none) is a statement that fails the transaction when it no longer holds
        # (switchboard_confirm): sent where the body would have read, it costs no flight of its own, and a COMMIT
        # behind a failed one is never run.
        self.checks = len(rechecks)
        for sql, params in rechecks:
            conn.execute(dialect_sql(f"SELECT switchboard_confirm(EXISTS ({sql}), '{PRINCIPAL_GONE}')"), params)
        self.relied: set[tuple] = set()
        self.written: set[str] = set()  # the tables this transaction's statements wrote (not its triggers)
        self.ahead: dict[tuple, psycopg.Cursor] = {}  # read_ahead's statements, by (statement, parameters)

    def read_ahead(self, sql: str, params: Iterable = ()) -> None:
        if self.pipeline is not None:
            key = (sql, tuple(params))
            self.ahead[key] = self.conn.execute(dialect_sql(sql), key[1])

    def all_usually_none(self, sql: str, params: Iterable = ()) -> list[Row]:
        key = (sql, tuple(params))
        if self.nones is None or (self.written and self.written & _tables_read(sql)):
            return self.all(sql, key[1])  # what this transaction wrote is read, and not remembered
        if not self.nones.known(key):
            rows = self.all(sql, key[1])
            if not rows:
                self.nones.remember(key)
            return rows
        if key not in self.relied:
            self.relied.add(key)
            self.checks += 1
            self.conn.execute(dialect_sql(f"SELECT switchboard_confirm(NOT EXISTS ({sql}), '{STALE_NONE}')"), key[1])
        return []

    def confirm_exists(self, sql: str, params: Iterable = ()) -> None:
        self.checks += 1
        self.conn.execute(dialect_sql(f"SELECT switchboard_confirm(EXISTS ({sql}), 'what was read')"), tuple(params))

    def confirm(self) -> None:
        """Before a refusal goes out: what it was decided on still held (a failed check raises here)."""
        if self.checks:
            self.settle()

    def trusted_wrongly(self, exc: psycopg.errors.RaiseException) -> bool:
        """Whether `exc` is a failed check (switchboard_confirm). A principal whose token no longer names it is
        refused, `unauthenticated`; a "none" no longer none is forgotten, and the body runs again, reading (True)."""
        message = exc.diag.message_primary or ""
        if not message.startswith(CONFIRM_FAILED):
            return False
        if PRINCIPAL_GONE in message:
            raise ApiError("unauthenticated", "unknown or revoked token") from None
        for key in self.relied:
            self.nones.forget(key)
        return True


    def reading(self) -> PgTxn:
        """A read-only body's view: a body shared with writers (a verb's checks run ahead of its write) takes no
        row locks there, which a read-only transaction refuses and nothing would write under anyway."""
        self.skip_locked = self.for_update = ""
        self.lock = lambda *args, **kwargs: None
        return self

    def lock(self, table: str, where: str, params: Iterable = ()) -> None:
        self.conn.execute(dialect_sql(f"SELECT 1 FROM {table} WHERE {where} FOR UPDATE"), tuple(params))

    def lock_key(self, *parts: str) -> None:
        self.conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", ("\x1f".join(parts),))

    def execute(self, sql: str, params: Iterable = ()) -> Sent:
        # A savepoint's commands are not prepared: psycopg would forget every prepared statement when it reads a
        # ROLLBACK TO's answer, after the pipeline already sent later statements by their prepared names
        prepare = False if sql.startswith(SAVEPOINT_COMMANDS) else None
        self._note_write(sql)
        return Sent(self.pipeline, self.conn.execute(dialect_sql(sql), tuple(params), prepare=prepare))

    def _note_write(self, sql: str) -> None:
        if (written := _WRITES.match(sql)) is not None:
            self.written.add(written.group(1))

    def executemany(self, sql: str, rows: Iterable[Iterable]) -> None:
        self._note_write(sql)
        with self.conn.cursor() as cursor:
            cursor.executemany(dialect_sql(sql), [tuple(r) for r in rows])

    def one(self, sql: str, params: Iterable = ()) -> Row | None:
        return self._read(sql, tuple(params)).fetchone()

    def all(self, sql: str, params: Iterable = ()) -> list[Row]:
        return self._read(sql, tuple(params)).fetchall()

    def _read(self, sql: str, params: tuple) -> psycopg.Cursor:
        if self.ahead and (sent := self.ahead.pop((sql, params), None)) is not None:
            return sent
        self._note_write(sql)  # a write read back (RETURNING) is a write
        return self.conn.execute(dialect_sql(sql), params)

    def settle(self) -> None:
        if self.pipeline is not None:
            self.pipeline.sync()

    def has_table(self, name: str) -> bool:
        return self.conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()[0]

    def schema_version(self) -> int:
        row = self.conn.execute("SELECT version FROM switchboard_schema").fetchone()
        return row[0] if row else 0


class _TextWithoutNul(psycopg.types.string.StrDumper):
    """Postgres text cannot hold U+0000, which SQLite keeps: a NUL in producer text (a hostile title, a header) is
    stored as U+FFFD, the replacement character, instead of failing the delivery. JSON documents are unaffected:
    they carry a NUL as the escape \\u0000."""

    def dump(self, obj: str) -> bytes:
        return super().dump(obj.replace("\x00", "\ufffd") if "\x00" in obj else obj)


def _configure(conn: psycopg.Connection) -> None:
    conn.row_factory = _row_factory
    conn.adapters.register_dumper(bool, _BoolAsInteger)
    conn.adapters.register_dumper(str, _TextWithoutNul)
    for json_type in ("json", "jsonb"):  # JSON reaches the store as text, as SQLite's json functions give it
        conn.adapters.register_loader(json_type, psycopg.types.string.TextLoader)
    conn.prepare_threshold = 0  # the store's statements are few and repeat: prepare each on its first use


def current_version(conn: psycopg.Connection) -> int:
    """The schema version a database holds (0: none yet)."""
    if not conn.execute("SELECT to_regclass('switchboard_schema') IS NOT NULL").fetchone()[0]:
        return 0
    row = conn.execute("SELECT version FROM switchboard_schema").fetchone()
    return row[0] if row else 0


def apply_postgres_schema(conn: psycopg.Connection, migrations: dict[int, Migration] = MIGRATIONS,
                          latest: int = SCHEMA_VERSION) -> tuple[int, list[dict]]:
    """Bring the database to `latest`: a new one gets schema.postgres.sql whole, an existing one each missing step
    of MIGRATIONS in order, every step in a transaction of its own under MIGRATE_LOCK (a transaction's lock, which
    a transaction pooler keeps), recorded in switchboard_schema and schema_history. Processes starting together
    wait on the lock and read the version again under it, so each step is applied once and the others find it
    done. A step that fails rolls back itself alone, leaving the version at the last step that succeeded; a
    database newer than this program is refused. `conn` is in autocommit. Returns the version found first and the
    steps this call applied."""
    found: int | None = None
    applied: list[dict] = []
    while True:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS switchboard_schema (version INTEGER NOT NULL)")
            row = conn.execute("SELECT version FROM switchboard_schema").fetchone()
            version = row[0] if row else 0
            found = version if found is None else found
            if version > latest:
                raise ApiError("conflict", f"the database is schema {version}, newer than this program's ({latest}):"
                                           " run the newer release")
            if version == latest:
                return found, applied
            if version == 0:
                conn.execute(shipped_path("schema.postgres.sql").read_text(), prepare=False)
                step = {"from": 0, "to": latest, "summary": CREATED}
            else:
                step = {"from": version, "to": version + 1, "summary": migrations[version].summary}
                if migrations[version].postgres is None:
                    raise ApiError("conflict", f"the database is schema {version}, and no Postgres database is older"
                                               f" than {POSTGRES_FIRST_VERSION}: it was not made by Switchboard")
                for statement in migrations[version].postgres:
                    conn.execute(statement, prepare=False)
            conn.execute("DELETE FROM switchboard_schema")
            conn.execute("INSERT INTO switchboard_schema (version) VALUES (%s)", (step["to"],))
            conn.execute(dialect_sql(RECORD_STEP), (step["to"], step["summary"], int(time.time() * 1000)))
        applied.append(step)


class Postgres:
    """The Database interface on Postgres. Writes are bodies `fn(txn, *args)`, each one transaction on a pooled
    connection (Postgres runs writers side by side; the lock vocabulary orders the ones that meet), committed with
    synchronous_commit on before the caller hears. `listen` turns on what serving needs: the ring listener, the
    leader election and the process heartbeat."""

    engine = "postgres"
    one_writer = False  # writers run side by side, meeting only on the rows they lock
    caches_principals = True  # a token's lookup is a round trip: Flows keeps principals, each transaction re-checks
    # How long a waiting claim trusts the rings before it looks at the queue again: a ring from another process can
    # be lost on its way. Alone on the database (no other process heard of), every ring is this process's own and
    # cannot be lost, so the look is only a slow safeguard. A process that does not listen (tests driving the app
    # by hand) hears only its own rings.
    shared_poll_seconds = 2.0
    alone_poll_seconds = 30.0
    # The ring thread looks at the change marker every SCHEDULER_TICK_SECONDS; once it saw no move for
    # quiet_after_seconds while no live view is open, every quiet_look_seconds (each look is a wake-up of this
    # process and of a Postgres backend). A live view that opens brings the next look within a second (look_soon).
    quiet_after_seconds = 10.0
    quiet_look_seconds = 4.0

    def __init__(self, url: str, *, clock: Clock | None = None, inline_rings: bool = True, migrate: bool = True,
                 pool_size: int = 8, listen: bool = False, listen_url: str | None = None):
        self.path = url
        self.url = url
        # LISTEN and the leader's advisory lock hold a session: through a transaction pooler they need a direct URL
        self.listen_url = listen_url or url
        self.clock = clock or Clock()
        self.inline_rings = inline_rings
        self.on_rings: Callable[[list[dict]], None] | None = None
        self.on_spans: Callable[[list[dict]], None] | None = None  # the exporter's, after commit (see Txn.spans)
        self.on_outbox: Callable[[], None] | None = None
        self.on_change: Callable[[], None] | None = None  # the change marker moved (told from the ring thread)
        self.watched: Callable[[], bool] = lambda: False  # whether a live view is open (the app's)
        self._marker: tuple | None = None  # as the ring thread last read it
        self._moved_at = time.monotonic()  # when a look last saw the marker move, or was asked for
        self._look_asked = False  # a live view opened since the last look
        self._looks_quiet = False  # the ring thread sleeps until a quiet look
        self.opener: Callable[[bytes, str], bytes] | None = None  # the app's SecretBox.open, for write transactions
        self.on_fatal: Callable[[str], None] | None = None
        self.loop: AbstractEventLoop | None = None
        self.counts: collections.Counter = collections.Counter()
        self.counts_lock = threading.Lock()
        self.nones = KnownNones()
        self.failure: str | None = None
        self.process_id = new_id("pr")
        self.is_leader = not listen
        self.listens = listen
        self.others = 1  # processes heard of besides this one, as of the last heartbeat (1 until the first)
        self.beats = 0
        self.listeners: dict[tuple[str, tuple[str, ...] | None], int] = {}  # this process's sessions, by filter
        self._listeners_lock = threading.Lock()
        self._listeners_dirty = threading.Event()
        self._closing = threading.Event()
        # The ring thread sleeps on its connection's socket and this pipe, written when a listener changes or the
        # process closes: idle, it wakes only for a notification or its heartbeat
        self._wake_pipe: tuple[int, int] | None = None
        self._wake_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        with psycopg.connect(url, autocommit=True) as conn:
            _configure(conn)
            if migrate:
                apply_postgres_schema(conn)
            self.synchronous = conn.execute("SHOW synchronous_commit").fetchone()[0]
        self._pool = psycopg_pool.ConnectionPool(url, min_size=1, max_size=pool_size, configure=self._on_connect,
                                                 open=True, timeout=30, name="switchboard")
        # The first connection is made before anything asks: asked while it was still being made, the pool made a
        # second one at once (a backend's start is about 7 ms of the server's CPU, and every process paid it)
        self._pool.wait(timeout=30)
        if listen:
            self._wake_pipe = os.pipe()
            for fd in self._wake_pipe:
                os.set_blocking(fd, False)
            for target, name in ((self._listen_loop, "switchboard-rings"), (self._leader_loop, "switchboard-leader")):
                thread = threading.Thread(target=self._guarded, args=(target, name), name=name, daemon=True)
                thread.start()
                self._threads.append(thread)

    @staticmethod
    def _on_connect(conn: psycopg.Connection) -> None:
        _configure(conn)
        conn.autocommit = True  # transactions are opened explicitly: a one-statement read needs none
        if os.environ.get(PROTOCOL_TRACE):
            _trace_protocol(conn, Path(os.environ[PROTOCOL_TRACE]))

    # -- writing ---------------------------------------------------------------------------------
    def _run(self, fn: Callable, args: tuple, *, read_only: bool = False) -> tuple[Any, list[dict]]:
        """The body as one transaction, run again (a new `now` and all) when it met another writer's transaction
        in a way Postgres resolves by aborting one of them. The transaction runs in pipeline mode: BEGIN, every
        statement whose result the body does not read, the rings' routing and the COMMIT go in as few flights as
        the body's reads allow (Sent), and the answer is given only once the COMMIT's own answer came back."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                with self._pool.connection() as conn:
                    try:
                        with conn.pipeline() as pipeline:
                            conn.execute(BEGIN_READING if read_only else BEGIN, prepare=False)
                            # A principal the process remembered (Flows.principal) is re-checked by each
                            # transaction acting for it, in its first flight (PgTxn: switchboard_confirm).
                            recheck = PRINCIPAL_RECHECK.get()
                            txn = PgTxn(conn, self.clock.now_ms(), self.inline_rings and not read_only, pipeline,
                                        self.nones, [recheck] if recheck else [])
                            txn.opener = self.opener
                            if self.on_spans and not read_only:
                                txn.spans = []
                            if read_only:
                                txn.reading()
                            try:
                                result = fn(txn, *args)
                            except Exception as exc:
                                if not isinstance(exc, psycopg.Error):
                                    txn.confirm()  # an answer given on trust that no longer holds is no answer
                                raise
                            routed = self._route_rings(txn) if txn.rings else None
                            if txn.outbox and not self.is_leader:
                                conn.execute(f"NOTIFY {OUTBOX_CHANNEL}", prepare=False)
                            conn.execute("COMMIT", prepare=False)
                        # The rings' answers are read while this thread still holds the connection: once it is
                        # back in the pool another thread's transaction may be using it.
                        sent = {row[0] for row in routed.fetchall()} if routed is not None else set()
                        mine = [ring for position, ring in enumerate(txn.rings, 1) if position not in sent]
                    except BaseException:
                        # psycopg's own rollback: it also forgets statements prepared in what was rolled back
                        if not conn.broken and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                            conn.rollback()
                        raise
                break
            except psycopg.errors.RaiseException as exc:
                if not txn.trusted_wrongly(exc):
                    raise
                if attempt == MAX_ATTEMPTS:
                    raise ApiError("unavailable", f"the write found {MAX_ATTEMPTS} times that what this process"
                                                  " remembered had changed") from None
            except RETRIED as exc:
                if attempt == MAX_ATTEMPTS:
                    raise ApiError("unavailable", f"the write met others {MAX_ATTEMPTS} times: {exc}") from None
                time.sleep(random.uniform(0, 0.002 * attempt))
            except psycopg.OperationalError as exc:
                raise ApiError("unavailable", f"the database is unreachable: {exc}") from None
        if read_only:
            return result, []
        for line in txn.logs:
            log.info(line)
        if txn.counts:
            with self.counts_lock:
                self.counts.update(txn.counts)
        if txn.outbox and self.on_outbox:
            self.on_outbox()
        if txn.spans and self.on_spans:
            self.on_spans(txn.spans)
        return result, mine

    def _route_rings(self, txn: PgTxn) -> Sent:
        """Choose, inside the committing transaction, the process each ring goes to: one whose sessions listen on the
        todo's endpoint and queue, waiting claims before streams. A ring for another process goes by NOTIFY, which
        Postgres delivers only if this commits; the statement answers with the positions of those rings, so the
        others (read after the COMMIT, in the same flight) are this process's, for the doorbell. A ring nobody
        listens for is not sent: the todo waits for the next claim, as in SQLite mode. All of a transaction's rings
        go in one statement: a bulk step's 250 rings as 250 statements cost a wait on the socket each, and with it
        the interpreter's lock, which a busy process hands back only every few milliseconds."""
        return txn.execute(
            "SELECT ring.position, pg_notify(? || chosen.process_id, ring.payload)"
            " FROM unnest(?::text[], ?::text[], ?::text[]) WITH ORDINALITY AS ring(payload, endpoint_id, queue, position)"
            " CROSS JOIN LATERAL (SELECT process_id FROM ring_listeners WHERE endpoint_id = ring.endpoint_id"
            " AND (queues IS NULL OR ring.queue = ANY(queues)) ORDER BY waiting DESC, random() LIMIT 1) chosen"
            " WHERE chosen.process_id <> ?",
            (RING_CHANNEL, [json.dumps(ring) for ring in txn.rings], [ring["endpoint_id"] for ring in txn.rings],
             [ring["queue"] for ring in txn.rings], self.process_id))

    def write_sync(self, fn: Callable, *args) -> Any:
        result, rings = self._run(fn, args)
        if rings and self.on_rings and self.loop is not None:
            self.loop.call_soon_threadsafe(self.on_rings, rings)
        return result

    async def write(self, fn: Callable, *args) -> Any:
        import anyio.to_thread

        result, rings = await anyio.to_thread.run_sync(self._run, fn, args)
        if rings and self.on_rings:
            self.on_rings(rings)
        return result

    def checkpoint(self) -> tuple:
        """SQLite's WAL checkpoint has no Postgres counterpart that Switchboard should run (autovacuum and the
        checkpointer are the server's): nothing to do, nothing waiting."""
        return (0, 0, 0)

    # -- reading ---------------------------------------------------------------------------------
    def read_sync(self, fn: Callable, *args) -> Any:
        return self._run(fn, args, read_only=True)[0]

    def read_statement(self, fn: Callable, *args) -> Any:
        """A one-statement body, outside a transaction (autocommit): a round trip instead of three."""
        try:
            with self._pool.connection() as conn:
                return fn(PgTxn(conn, self.clock.now_ms(), False).reading(), *args)
        except psycopg.OperationalError as exc:
            raise ApiError("unavailable", f"the database is unreachable: {exc}") from None

    async def lookup(self, fn: Callable, *args) -> Any:
        """read_statement from the event loop: on a thread, since it waits for a pooled connection and the network."""
        import anyio.to_thread

        return await anyio.to_thread.run_sync(self.read_statement, fn, *args)

    async def read(self, fn: Callable, *args) -> Any:
        import anyio.to_thread

        return await anyio.to_thread.run_sync(self.read_sync, fn, *args)

    @property
    def change_marker_at_hand(self) -> bool:
        return self._marker is not None

    def change_marker(self) -> Any:
        """What moves whenever anything a live view shows changed, in any process (SQLite's data_version moves on
        every commit; Postgres has no such counter for one database): the counters' change total (a todo entered
        or left a group), the Board sessions (one opened: the newest rowid; one ended: the count) and the running
        work's latest heartbeat. A listening process's ring thread reads it on its own connection (once a second,
        every quiet_look_seconds when all is quiet) and tells `on_change` when it moved: then this answers that
        reading, with no round trip."""
        marker = self._marker
        if marker is not None:
            return marker
        with self._pool.connection() as conn:
            return tuple(conn.execute(CHANGE_MARKER).fetchone())

    # -- what several processes share ------------------------------------------------------------------
    def listening(self, endpoint_id: str, queues: frozenset[str] | None, waiting: bool, delta: int) -> None:
        """The doorbell's sessions of this process, by endpoint and filter, counted; the table ring_listeners,
        which committing transactions read to choose a process, is brought up to date by the ring thread."""
        key = (endpoint_id, tuple(sorted(queues)) if queues is not None else None, waiting)
        with self._listeners_lock:
            self.listeners[key] = self.listeners.get(key, 0) + delta
            if self.listeners[key] <= 0:
                del self.listeners[key]
        self._listeners_dirty.set()
        self._wake_ring_thread()

    def _wake_ring_thread(self) -> None:
        with self._wake_lock, contextlib.suppress(BlockingIOError):  # a full pipe already holds a wake-up
            if self._wake_pipe is not None:
                os.write(self._wake_pipe[1], b"\0")

    def _guarded(self, target: Callable[[], None], name: str) -> None:
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - a dead part must be reported, never silent
            if not self._closing.is_set():
                self.failure = f"the {name} thread stopped: {type(exc).__name__}: {exc}"
                log.critical(self.failure)
                if self.on_fatal:
                    self.on_fatal(self.failure)

    def _listen_loop(self) -> None:
        """LISTEN for this process's rings and for outbox writes by other processes (which wake the leader's
        senders), publish its listeners and its heartbeat, and read the change marker once a second. Between these
        it sleeps until the connection has something to read, the wake-up pipe is written or the next look is due:
        no other polling while idle (psycopg's own `notifies(timeout=…)` wakes ten times a second, and each wake-up
        of an idle process costs about 0.2 ms of CPU here). A lost connection is reconnected; rings sent meanwhile
        are lost, and the waiting claims' poll finds their todos."""
        try:
            self._listen()
        finally:
            self._marker = None  # change_marker asks the database itself from now on

    def _listen(self) -> None:
        published: dict | None = None
        while not self._closing.is_set():
            try:
                with psycopg.connect(self.listen_url, autocommit=True) as conn:
                    _configure(conn)
                    conn.execute(f"LISTEN {RING_CHANNEL}{self.process_id}")
                    conn.execute(f"LISTEN {OUTBOX_CHANNEL}")
                    waiting = select.poll()
                    waiting.register(conn.fileno(), select.POLLIN)
                    wake_read = self._wake_pipe[0]
                    waiting.register(wake_read, select.POLLIN)
                    published = None
                    next_beat = last_look = published_at = 0.0
                    while not self._closing.is_set():
                        if time.monotonic() >= next_beat:
                            self._beat(conn)
                            next_beat = time.monotonic() + HEARTBEAT_SECONDS
                        if time.monotonic() >= last_look + self._look_interval():
                            self._look(conn)
                            last_look = time.monotonic()
                        next_look = last_look + self._look_interval()
                        next_publish = math.inf
                        if self._listeners_dirty.is_set() or published is None:
                            next_publish = published_at + PUBLISH_GAP_SECONDS
                            if time.monotonic() >= next_publish:
                                self._listeners_dirty.clear()
                                published = self._publish(conn, published)
                                published_at, next_publish = time.monotonic(), math.inf
                        # What arrived while the statements above ran (psycopg keeps it), then what the socket
                        # holds: a timeout of 0 reads without waiting
                        for notice in conn.notifies(timeout=0):
                            if notice.channel == OUTBOX_CHANNEL:
                                if self.on_outbox and self.is_leader:
                                    self.on_outbox()
                            else:
                                self._deliver(json.loads(notice.payload))
                        pause = max(0.0, min(next_beat, next_look, next_publish) - time.monotonic())
                        woken = waiting.poll(pause * 1000)
                        if any(fd == wake_read for fd, _ in woken):
                            with contextlib.suppress(BlockingIOError):
                                os.read(wake_read, 4096)
            except psycopg.OperationalError as exc:
                self._marker = None  # change_marker asks the database itself until the thread reads it again
                log.warning("ring listener lost its connection (%s); reconnecting", exc)
                self._closing.wait(1.0)

    @property
    def poll_seconds(self) -> float | None:
        if not self.listens:
            return None
        # Alone only from the second heartbeat on: processes started together have each beaten once by then
        alone = not self.others and self.beats >= 2
        return self.alone_poll_seconds if alone else self.shared_poll_seconds

    def _beat(self, conn: psycopg.Connection) -> None:
        now = self.clock.now_ms()
        # One statement, one round trip: the heartbeat, and the others counted (the count's snapshot is from before
        # the heartbeat, which it leaves out anyway)
        self.others = conn.execute(
            "WITH beat AS (INSERT INTO processes (id, host, pid, started_at, seen_at, clock_ms, db_ms) VALUES (%s, %s,"
            " %s, %s, %s, %s, (extract(epoch FROM clock_timestamp()) * 1000)::bigint) ON CONFLICT (id) DO UPDATE"
            " SET seen_at = excluded.seen_at, clock_ms = excluded.clock_ms, db_ms = excluded.db_ms)"
            " SELECT count(*) FROM processes WHERE id <> %s",
            (self.process_id, socket.gethostname(), os.getpid(), now, now, now, self.process_id)).fetchone()[0]
        self.beats += 1

    def look_soon(self) -> None:
        """A live view opened: the ring thread's next look at the change marker comes within
        SCHEDULER_TICK_SECONDS, however quiet it was, and the looks stay that often while a view is open."""
        self._look_asked = True
        if self._looks_quiet:  # read after the flag is set: a thread deciding to sleep long sees one or the other
            self._looks_quiet = False
            self._wake_ring_thread()

    def _look_interval(self) -> float:
        """How long after the last look the ring thread looks again: quiet_look_seconds once all is quiet."""
        self._looks_quiet = True
        quiet = (not self._look_asked and not self.watched()
                 and time.monotonic() - self._moved_at >= self.quiet_after_seconds)
        self._looks_quiet = quiet
        return self.quiet_look_seconds if quiet else SCHEDULER_TICK_SECONDS

    def _look(self, conn: psycopg.Connection) -> None:
        asked, self._look_asked = self._look_asked, False
        marker = tuple(conn.execute(CHANGE_MARKER).fetchone())
        moved = self._marker is not None and marker != self._marker
        self._marker = marker
        if moved or asked:
            self._moved_at = time.monotonic()
        if moved and self.on_change is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self.on_change)

    def _publish(self, conn: psycopg.Connection, published: dict | None) -> dict:
        wanted: dict = {}
        with self._listeners_lock:
            for (endpoint, queues, waiting), n in self.listeners.items():
                if n > 0:
                    wanted[(endpoint, queues)] = wanted.get((endpoint, queues), False) or waiting
        if wanted != published:
            with conn.transaction():
                conn.execute("DELETE FROM ring_listeners WHERE process_id = %s", (self.process_id,))
                for (endpoint, queues), waiting in wanted.items():
                    conn.execute("INSERT INTO ring_listeners (process_id, endpoint_id, queues, waiting)"
                                 " VALUES (%s, %s, %s, %s)",
                                 (self.process_id, endpoint, list(queues) if queues is not None else None, waiting))
        return wanted

    def _deliver(self, ring: dict) -> None:
        if self.on_rings and self.loop is not None:
            self.loop.call_soon_threadsafe(self.on_rings, [ring])

    def _leader_loop(self) -> None:
        """Hold the leader's advisory lock on a connection of its own, or try for it every second. The lock is the
        connection's: if this process dies or its connection is lost, Postgres lets go of it, and another process
        takes over. The leader also drops the listeners of processes no longer heard of, once a heartbeat."""
        while not self._closing.is_set():
            try:
                with psycopg.connect(self.listen_url, autocommit=True) as conn:
                    while not self._closing.is_set():
                        if not self.is_leader:
                            self.is_leader = conn.execute("SELECT pg_try_advisory_lock(%s)",
                                                          (LEADER_LOCK,)).fetchone()[0]
                            if self.is_leader:
                                log.info("this process (%s) is the leader", self.process_id)
                        if self.is_leader:
                            conn.execute("WITH gone AS (DELETE FROM processes WHERE seen_at < %s RETURNING id)"
                                         " DELETE FROM ring_listeners WHERE process_id IN (SELECT id FROM gone)",
                                         (self.clock.now_ms() - PROCESS_STALE_MS,))
                        self._closing.wait(HEARTBEAT_SECONDS if self.is_leader else 1.0)
            except psycopg.OperationalError as exc:
                if self.is_leader:
                    log.warning("the leader lost its database connection (%s): no longer the leader", exc)
                self.is_leader = False
                self._closing.wait(1.0)
        self.is_leader = False

    def alive(self) -> bool:
        return self.failure is None and all(thread.is_alive() for thread in self._threads)

    def close(self) -> None:
        self._closing.set()
        self._wake_ring_thread()
        for thread in self._threads:
            thread.join(timeout=5)
        # The pipe outlives a thread that did not stop (it may still poll it); a later wake-up writes nothing
        with self._wake_lock:
            if self._wake_pipe is not None and not any(thread.is_alive() for thread in self._threads):
                for fd in self._wake_pipe:
                    os.close(fd)
                self._wake_pipe = None
        with contextlib.suppress(psycopg.Error):
            with psycopg.connect(self.url, autocommit=True) as conn:
                conn.execute("DELETE FROM ring_listeners WHERE process_id = %s", (self.process_id,))
                conn.execute("DELETE FROM processes WHERE id = %s", (self.process_id,))
        self._pool.close()

    def backup(self, out_path: str) -> None:
        raise ApiError("invalid_argument", "backup copies a SQLite file; a Postgres database is backed up by Postgres:"
                                           " `pg_dump --format=custom` for a copy, or WAL archiving with"
                                           " pg_basebackup for point-in-time recovery (docs/postgres.md)")
