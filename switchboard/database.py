"""Connections and the single writer: every write is a transaction body run on the writer thread, which
group-commits the bodies that arrive together; readers run on their own connections."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import contextvars
import queue as queue_module
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncio import AbstractEventLoop


from switchboard.configuration import (
    CHECKPOINTS_PER_SECOND,
    WAL_LIMIT_BYTES,
    WRITER_BATCH,
    WRITER_CACHE_KIB,
    WRITER_CHECKPOINT_BYTES,
    ApiError,
    Clock,
    log,
)
from switchboard.migrations import apply_schema


def connect(path: str, synchronous: str = "FULL") -> sqlite3.Connection:
    """A connection with the pragmas every Switchboard connection runs under."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=5.0)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={'NORMAL' if synchronous.upper() == 'NORMAL' else 'FULL'}")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA busy_timeout=5000")
    conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
    return conn


_CHECKPOINT = object()


# What a body's reads return: columns by name and by position.
Row = sqlite3.Row


# The re-check of the principal the current request acts for, when a process's memory supplied it
# (Flows.principal): each transaction the request runs confirms it before COMMIT (Postgres). A context variable, so
# that every store call of the request is covered, whatever it passes; a task the request starts for others runs in
# a context of its own.
PRINCIPAL_RECHECK: contextvars.ContextVar[tuple[str, tuple] | None] = contextvars.ContextVar("principal_recheck",
                                                                                              default=None)


class Txn:
    """What a transaction body sees: the connection, one fixed `now`, and what to do after commit.

    The lock vocabulary (`lock`, `lock_key`, `skip_locked`) is what a body that reads and then writes must hold
    where writers run side by side (Postgres, several processes). SQLite's one writer runs every write transaction
    alone (BEGIN IMMEDIATE), so there they cost nothing."""

    skip_locked = ""  # appended to the subquery that picks one of many rows (a claim): skip rows others hold
    for_update = ""  # appended to the read of the one row a verb is about to change: hold it until commit
    engine = "sqlite"
    # The app's secret box (`SecretBox.open`), given to write transactions: a body that must compare a sealed
    # credential with text (a comment holding the forge connection's token) opens it with `unseal`.
    opener: Callable[[bytes, str], bytes] | None = None
    # Span records (plain dicts of ids, times and strings; switchboard.tracing makes them spans) for the process's
    # exporter, handed over only after COMMIT. None when nothing exports: then no body builds one.
    spans: list[dict] | None = None
    # (trace id, parent span id) a todo made in this transaction is sent under (a delivery's route span); None: a
    # todo starts a trace of its own.
    trace_context: tuple[str, str] | None = None

    def __init__(self, conn: sqlite3.Connection, now: int, inline_rings: bool):
        self.conn = conn
        self.now = now
        self.inline_rings = inline_rings
        self.rings: list[dict] = []
        self.outbox = False  # whether this transaction queued notifications (the sender wakes after commit)
        self.logs: list[str] = []
        self.counts: collections.Counter = collections.Counter()
        # Todos whose row this transaction holds (read FOR UPDATE, or picked by a claim): their state cannot move
        # under it, so a transition of one needs no word back on whether it still found the state it read.
        self.held: set[str] = set()
        # Events this transaction recorded for a webhook that mirrors through no connection (mark_status).
        self.unmirrored: set[str] = set()

    def unseal(self, sealed: bytes, bound_to: str) -> bytes:
        if self.opener is None:
            raise ApiError("unavailable", "this process holds no secret key to open a sealed credential with")
        return self.opener(sealed, bound_to)

    def lock(self, table: str, where: str, params: Iterable = ()) -> None:
        """Hold the rows of `table` meeting `where` until commit: the row a verb read and is about to change."""

    def lock_key(self, *parts: str) -> None:
        """Hold a named lock until commit: one webhook's deliveries, one owner's count limits, one queue's caps."""

    def execute(self, sql: str, params: Iterable = ()) -> sqlite3.Cursor:
        return self.conn.execute(sql, tuple(params))

    def executemany(self, sql: str, rows: Iterable[Iterable]) -> None:
        self.conn.executemany(sql, rows)

    def one(self, sql: str, params: Iterable = ()) -> sqlite3.Row | None:
        return self.conn.execute(sql, tuple(params)).fetchone()

    def all(self, sql: str, params: Iterable = ()) -> list[sqlite3.Row]:
        return self.conn.execute(sql, tuple(params)).fetchall()

    def read_ahead(self, sql: str, params: Iterable = ()) -> None:
        """A read the body will (likely) make later with these very statement and parameters, sent now where reads
        cost a round trip (Postgres: in the flight of the next read; `one`/`all` then take its rows). SQLite reads
        when asked."""

    def confirm_exists(self, sql: str, params: Iterable = ()) -> None:
        """The body goes on as if `sql` finds a row now. Where a read judged other tables as they were when it
        began while writers run side by side (Postgres), the transaction checks it before its COMMIT and runs again
        if it does not hold; SQLite's one writer read it in this very transaction, so it holds."""

    def all_usually_none(self, sql: str, params: Iterable = ()) -> list[sqlite3.Row]:
        """`all` for a read whose answer is nearly always no rows and seldom changes (a queue without controls, an
        event whose webhook mirrors nowhere). Where a read costs a round trip (Postgres), a "none" is remembered
        by the process and confirmed inside each transaction that relies on it; SQLite just reads."""
        return self.all(sql, params)

    def settle(self) -> None:
        """Have every statement sent so far run, raising here what one of them met (Postgres sends statements whose
        results are not read later, together; SQLite runs each as it is called)."""

    def has_table(self, name: str) -> bool:
        """Whether the table exists (a body that also reads databases older migrations have not reached yet)."""
        return self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (name,)).fetchone() is not None

    def schema_version(self) -> int:
        return self.conn.execute("PRAGMA user_version").fetchone()[0]


class Database:
    """One writer thread that owns the only writing connection, plus a pool of reader connections.

    Writes are transaction bodies `fn(txn, *args)`. The writer runs whatever is queued as one
    `BEGIN IMMEDIATE` transaction with a savepoint per body (group commit: one fsync for many
    callers, each body still all-or-nothing), and answers every caller only after COMMIT returned.
    One process serves a SQLite file, so it is always the leader (switchboard.postgres has several).
    """

    engine = "sqlite"
    one_writer = True  # every write of every process waits for the one lock on the file
    caches_principals = False  # a token's lookup is one indexed row in this process: cheaper than a cache's checks
    is_leader = True
    poll_seconds = None  # a waiting claim needs no poll: every ring is this process's own

    def __init__(self, path: str, *, synchronous: str = "FULL", clock: Clock | None = None,
                 inline_rings: bool = True, migrate: bool = True):
        self.path = path
        self.synchronous = synchronous
        self.clock = clock or Clock()
        self.inline_rings = inline_rings
        self.on_rings: Callable[[list[dict]], None] | None = None
        self.on_spans: Callable[[list[dict]], None] | None = None  # the exporter's, after commit (see Txn.spans)
        self.on_outbox: Callable[[], None] | None = None
        self.opener: Callable[[bytes, str], bytes] | None = None  # the app's SecretBox.open, for write transactions
        self.loop: AbstractEventLoop | None = None
        # What committed transactions counted (todos created, claimed, completed, lease expiries), for /metrics.
        self.counts: collections.Counter = collections.Counter()
        self.counts_lock = threading.Lock()
        writer = connect(path, synchronous)
        # The checkpointer thread copies the WAL back beside the writer, so the checkpoint a commit runs once the
        # WAL passes WRITER_CHECKPOINT_BYTES finds most of it copied already (SQLite's default, every 4 MiB and all
        # of it inside the commit, stalled every delivery queued behind that commit). Under steady writes the
        # checkpointer seldom catches up at the moment a transaction starts, so this one starts the WAL over; the
        # file keeps its size, and later commits reuse it (one that grows the file costs about twice as much).
        # Most pages the writer touches are bodies it writes once. 1 MiB still keeps the index pages a commit walks:
        # with 1M todos a served delivery costs the writer about 20 page reads with 1 or 2 MiB, and 32 with 512 KiB.
        # SQLite's 2 MiB default held about 1 MiB more after 10,000 deliveries.
        writer.execute(f"PRAGMA cache_size=-{WRITER_CACHE_KIB}")
        page_size = writer.execute("PRAGMA page_size").fetchone()[0]
        writer.execute(f"PRAGMA wal_autocheckpoint={WRITER_CHECKPOINT_BYTES // page_size}")
        if migrate:
            apply_schema(writer)
        self._writer = writer
        self._jobs: queue_module.SimpleQueue = queue_module.SimpleQueue()
        self._carried_job: tuple | None = None
        self.failure: str | None = None
        self.on_fatal: Callable[[str], None] | None = None
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        # Reads under way on the reader connections and the probe. Closing a sqlite3 connection while another thread
        # steps a statement on it crashes the interpreter (a segmentation fault), and a read can outlive the task
        # that awaited it (a cancelled task's thread runs on), so close waits for these to end and refuses new ones.
        self._readers_lock = threading.Lock()
        self._reads_ended = threading.Condition(self._readers_lock)
        self._reads_under_way = 0
        self._reads_refused = False
        self._probe: sqlite3.Connection | None = None
        self._thread = threading.Thread(target=self._write_loop, name="switchboard-writer", daemon=True)
        self._thread.start()
        self._committed = threading.Event()
        self._closing = threading.Event()
        self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="switchboard-checkpointer",
                                              daemon=True)
        self._checkpointer.start()

    # -- writing ---------------------------------------------------------------------------------
    def write_sync(self, fn: Callable, *args) -> Any:
        """For threads outside the event loop (the CLI, evaluator services): rings go to the server's loop."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, args, future))
        result, rings = future.result()
        if rings and self.on_rings and self.loop is not None:
            self.loop.call_soon_threadsafe(self.on_rings, rings)
        return result

    async def write(self, fn: Callable, *args) -> Any:
        import asyncio  # here, not at the top: the CLI's commands never wait on a loop, and start faster without it

        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, args, future))
        result, rings = await asyncio.wrap_future(future)
        if rings and self.on_rings:
            self.on_rings(rings)
        return result

    def checkpoint(self) -> tuple:
        """PRAGMA wal_checkpoint(TRUNCATE) on the writer, outside any transaction: the WAL file emptied (`prune`)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((_CHECKPOINT, (), future))
        return tuple(future.result())

    def _write_loop(self) -> None:
        """Take jobs in arrival order: a checkpoint alone, transaction bodies in batches. Whatever a job does,
        the loop goes on; if the loop itself breaks, `failure` says why and `on_fatal` is told."""
        try:
            while (batch := self._next_batch()) is not None:
                if batch[0][0] is _CHECKPOINT:
                    self._run_checkpoint(batch[0][2])
                else:
                    self._run_batch(self._writer, batch)
        except BaseException as exc:  # noqa: BLE001 - a dead writer must be reported, never silent
            self._stopped("writer", exc)
        finally:
            self._writer.close()

    def _stopped(self, part: str, exc: BaseException) -> None:
        """A long-lived part of the database died: `failure` says why, and `on_fatal` is told."""
        self.failure = f"the {part} stopped: {type(exc).__name__}: {exc}"
        log.critical(self.failure)
        if self.on_fatal:
            self.on_fatal(self.failure)

    def _next_batch(self) -> list | None:
        """The next job, plus (for transaction bodies) what else is already waiting, up to WRITER_BATCH. A job
        whose caller stopped waiting (a cancelled future) is dropped unrun; None means close."""
        batch: list = []
        while not batch or (batch[0][0] is not _CHECKPOINT and len(batch) < WRITER_BATCH):
            if self._carried_job is not None:
                job, self._carried_job = self._carried_job, None
            elif batch:
                try:
                    job = self._jobs.get_nowait()
                except queue_module.Empty:
                    break
            else:
                job = self._jobs.get()
            if job is None:
                if batch:
                    self._jobs.put(None)
                    break
                return None
            if batch and job[0] is _CHECKPOINT:
                self._carried_job = job
                break
            if job[2].set_running_or_notify_cancel():
                batch.append(job)
        return batch

    def _checkpoint_loop(self) -> None:
        """After commits, PASSIVE checkpoints from a connection of its own: they copy the WAL back while the writer
        goes on (never waiting on it or making it wait), and once one has caught up, the writer's next transaction
        starts the WAL over. A failed round is logged (the writer's own checkpoint is the backstop); if the loop
        itself breaks, `failure` says why and `on_fatal` is told, as for the writer."""
        try:
            conn = connect(self.path, self.synchronous)
            try:
                while True:
                    self._committed.wait()
                    if self._closing.is_set():
                        break
                    self._committed.clear()
                    try:
                        conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                    except sqlite3.Error as exc:
                        log.warning("checkpoint failed: %s", exc)
                    # At most CHECKPOINTS_PER_SECOND: each one syncs the database file, which commits that come
                    # one at a time would otherwise pay for twice.
                    self._closing.wait(1 / CHECKPOINTS_PER_SECOND)
            finally:
                conn.close()
        except BaseException as exc:  # noqa: BLE001 - a dead checkpointer must be reported, never silent
            self._stopped("checkpointer", exc)

    def _run_checkpoint(self, future: concurrent.futures.Future) -> None:
        """TRUNCATE, tried again for up to a second while it is turned away: SQLite answers "busy" at once, without
        the busy handler, when another checkpoint is in progress (the checkpointer thread's, or another process's),
        and one of those takes milliseconds. Readers it must wait for are waited on inside each try."""
        deadline = time.monotonic() + 1.0
        try:
            while (answer := self._writer.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone())[0] \
                    and time.monotonic() < deadline:
                time.sleep(0.005)
            future.set_result(answer)
        except sqlite3.Error as exc:
            future.set_exception(exc)

    def _run_batch(self, conn: sqlite3.Connection, batch: list) -> None:
        """The batch as one transaction. Its jobs first run straight, one after another. If one fails, its
        writes so far are mixed with its batch-mates', so the batch runs again from the start with each job in a
        savepoint of its own: the failing job loses only its own writes, and the others commit (a job is a
        transaction body, so running it twice is safe). Failures are rare, and two calls into SQLite per job,
        each handing the GIL over, had cost a sixth of ingest's server CPU."""
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            for _, _, waiting in batch:
                waiting.set_exception(ApiError("unavailable", f"database is busy: {exc}"))
            return
        try:
            outcomes = self._run_jobs(conn, batch, savepoints=False)
            if len(outcomes) < len(batch):
                if conn.in_transaction:  # a disk-full or I/O error may have rolled it back already
                    conn.execute("ROLLBACK")
                conn.execute("BEGIN IMMEDIATE")
                outcomes = self._run_jobs(conn, batch, savepoints=True)
            if len(batch) == 1 and not outcomes[0][0]:
                conn.execute("ROLLBACK")
            else:
                conn.execute("COMMIT")
                self._committed.set()
        except sqlite3.Error as exc:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            log.error("write transaction lost: %s", exc)
            for _, _, future in batch:
                future.set_exception(ApiError("unavailable", f"the database refused the write: {exc}"))
            return
        for (_, _, future), (ok, value, txn) in zip(batch, outcomes, strict=True):
            if ok:
                for line in txn.logs:
                    log.info(line)
                if txn.counts:
                    with self.counts_lock:
                        self.counts.update(txn.counts)
                if txn.outbox and self.on_outbox:
                    self.on_outbox()
                if txn.spans and self.on_spans:
                    self.on_spans(txn.spans)
                future.set_result((value, txn.rings))
            else:
                future.set_exception(value)

    def _run_jobs(self, conn: sqlite3.Connection, batch: list, savepoints: bool) -> list[tuple[bool, Any, Txn | None]]:
        """Each job's (ok, result or exception, txn). Without savepoints, the outcomes stop at the first failure of
        a batch of several (the batch must run again); a job alone is its whole transaction and needs none."""
        outcomes: list[tuple[bool, Any, Txn | None]] = []
        for fn, args, _ in batch:
            txn = Txn(conn, self.clock.now_ms(), self.inline_rings)
            txn.opener = self.opener
            if self.on_spans:
                txn.spans = []
            if savepoints:
                conn.execute("SAVEPOINT job")
            try:
                result = fn(txn, *args)
            except BaseException as exc:  # noqa: BLE001 - every failure must roll back its own writes
                if savepoints:
                    # A disk-full or I/O error may already have rolled the whole transaction back; then there
                    # is no savepoint left and the batch as a whole fails.
                    conn.execute("ROLLBACK TO job")
                    conn.execute("RELEASE job")
                elif len(batch) > 1:
                    return outcomes
                outcomes.append((False, exc, None))
            else:
                if savepoints:
                    conn.execute("RELEASE job")
                outcomes.append((True, result, txn))
        return outcomes

    # -- reading ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Counts a read as under way for its whole length; once close has begun, a new read is refused."""
        with self._readers_lock:
            if self._reads_refused:
                raise sqlite3.ProgrammingError("the database is closed")
            self._reads_under_way += 1
        try:
            yield
        finally:
            with self._readers_lock:
                self._reads_under_way -= 1
                if not self._reads_under_way:
                    self._reads_ended.notify_all()

    def _reader(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = connect(self.path, self.synchronous)
            self._local.conn = conn
            with self._readers_lock:
                self._readers.append(conn)
        return conn

    def read_sync(self, fn: Callable, *args) -> Any:
        with self._reading():
            conn = self._reader()
            conn.execute("BEGIN")
            try:
                return fn(Txn(conn, self.clock.now_ms(), False), *args)
            finally:
                conn.execute("COMMIT")

    def read_statement(self, fn: Callable, *args) -> Any:
        """read_sync for a body that runs one statement, which SQLite makes its own read transaction. It saves the
        BEGIN and COMMIT: on the event loop each call into SQLite lets the writer take the GIL, and waits to get it
        back."""
        with self._reading():
            return fn(Txn(self._reader(), self.clock.now_ms(), False), *args)

    async def lookup(self, fn: Callable, *args) -> Any:
        """read_statement from the event loop: inline, where one indexed row under WAL (which never waits on the
        writer) costs less than the hop to a thread and back."""
        return self.read_statement(fn, *args)

    async def read(self, fn: Callable, *args) -> Any:
        import anyio.to_thread  # as in write()

        return await anyio.to_thread.run_sync(self.read_sync, fn, *args)

    @property
    def change_marker_at_hand(self) -> bool:
        return True  # the pragma is answered from memory: the event loop reads it inline

    def change_marker(self) -> int:
        """PRAGMA data_version on a connection of its own: it moves on any commit by another connection (this
        server's writer, the CLI, another process). For the background loop only (one thread)."""
        with self._reading():
            if self._probe is None:
                self._probe = connect(self.path, self.synchronous)
            return self._probe.execute("PRAGMA data_version").fetchone()[0]

    def alive(self) -> bool:
        return self.failure is None and self._thread.is_alive() and self._checkpointer.is_alive()

    def close(self) -> None:
        """Ends the writer and the checkpointer (each closes its own connection), then closes the reader connections
        and the probe once the reads under way on them have ended; a read begun after this is refused."""
        self._jobs.put(None)
        self._thread.join()
        self._closing.set()
        self._committed.set()
        self._checkpointer.join()
        with self._readers_lock:
            self._reads_refused = True
            self._reads_ended.wait_for(lambda: not self._reads_under_way)
            for conn in self._readers:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            self._readers.clear()
            if self._probe is not None:
                self._probe.close()

    def backup(self, out_path: str) -> None:
        """A consistent single-file copy through SQLite's online backup, safe while serving."""
        source = connect(self.path, self.synchronous)
        target = sqlite3.connect(out_path)
        try:
            source.backup(target)
        finally:
            target.close()
            source.close()
