"""`migrate-to`: every row of one database copied into an empty database of the other engine (a SQLite file into
Postgres, or back), in one transaction on the target, then checked table by table.

Rows keep their ids and their rowids (the order ties and pages follow). The todos' triggers rebuild what they keep
as rows are copied: todo_counts is not copied but compared, and subjects are copied last, over what the triggers
made, so their counts and facts are the source's. schema_history is each database's own (the target's says it was
made new). A target holding anything that is not Switchboard's (another application's tables) is refused before
anything is written to it."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from switchboard.configuration import SCHEMA_PATH, SCHEMA_VERSION, ApiError, shipped_path
from switchboard.crypto import shown
from switchboard.engines import is_postgres, open_database

BATCH_ROWS = 1000
REBUILT = "todo_counts"  # kept by the todos' triggers on the target
COPIED_LAST = "subjects"  # the triggers make these rows as todos arrive; the source's then replace them
OWN_HISTORY = "schema_history"  # the migration steps this database took: never copied


def table_order() -> list[str]:
    """The tables copied, in schema.sql's order, which creates every table after the tables its keys point at."""
    return [t for t in re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", SCHEMA_PATH.read_text()) if t != OWN_HISTORY]


def own_relations(postgres: bool) -> set[str]:
    """The tables and views an engine's schema file makes (on Postgres, with the version's table beside them)."""
    text = shipped_path("schema.postgres.sql").read_text() if postgres else SCHEMA_PATH.read_text()
    made = set(re.findall(r"CREATE (?:UNLOGGED )?TABLE IF NOT EXISTS (\w+)|CREATE (?:OR REPLACE )?VIEW"
                          r" (?:IF NOT EXISTS )?(\w+)", text))
    return {name for pair in made for name in pair if name} | ({"switchboard_schema"} if postgres else set())


def foreign_relations(target: str) -> list[str]:
    """The tables and views in `target` that are not Switchboard's (a file not there yet holds none)."""
    if is_postgres(target):
        import psycopg

        with psycopg.connect(target, autocommit=True) as conn:
            found = conn.execute(
                "SELECT n.nspname, c.relname, n.nspname = current_schema() FROM pg_class c JOIN pg_namespace n"
                " ON n.oid = c.relnamespace WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f')"
                " AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg\\_%'"
                " ORDER BY 1, 2").fetchall()
        own = own_relations(postgres=True)
        return [f"{schema}.{name}" for schema, name, current in found if not (current and name in own)]
    if not Path(target).exists():
        return []
    conn = sqlite3.connect(f"file:{Path(target).resolve()}?mode=ro", uri=True)
    try:
        found = conn.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')"
                             " AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name").fetchall()
    finally:
        conn.close()
    own = own_relations(postgres=False)
    return [name for (name,) in found if name not in own]


class _Side:
    """One database of the copy, through its own driver: columns, rows in order, inserts, counts."""

    def __init__(self, target: str):
        self.target = target
        self.postgres = is_postgres(target)
        if self.postgres:
            import psycopg

            self.conn = psycopg.connect(target)
        else:
            self.conn = sqlite3.connect(target, isolation_level=None)
            self.conn.execute("PRAGMA foreign_keys=ON")
        self.mark = "%s" if self.postgres else "?"

    def version(self) -> int:
        if self.postgres:
            return self.conn.execute("SELECT version FROM switchboard_schema").fetchone()[0]
        return self.conn.execute("PRAGMA user_version").fetchone()[0]

    def columns(self, table: str) -> list[str]:
        if self.postgres:
            return [r[0] for r in self.conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema()"
                " AND table_name = %s ORDER BY ordinal_position", (table,))]
        names = [r[1] for r in self.conn.execute(f"PRAGMA table_info({table})")]
        sql = self.conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
        has_rowid = "WITHOUT ROWID" not in sql.upper() and not any(
            r[2].upper() == "INTEGER" and r[5] == 1 for r in self.conn.execute(f"PRAGMA table_info({table})"))
        return [*names, "rowid"] if has_rowid else names

    def count(self, table: str) -> int:
        return self.conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]

    def rows(self, table: str, columns: list[str]) -> Iterator[tuple]:
        order = "rowid" if "rowid" in columns else ", ".join(columns)
        query = f"SELECT {', '.join(columns)} FROM {table} ORDER BY {order}"
        cursor = self.conn.cursor(name=f"copy_{table}") if self.postgres else self.conn.cursor()
        cursor.execute(query)
        while batch := cursor.fetchmany(BATCH_ROWS):
            yield from batch
        cursor.close()

    def insert(self, table: str, columns: list[str], rows: list[tuple], replace_key: tuple[str, ...] = ()) -> None:
        marks = ", ".join([self.mark] * len(columns))
        sql = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})"
        if replace_key:
            sets = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in replace_key)
            sql += f" ON CONFLICT ({', '.join(replace_key)}) DO UPDATE SET {sets}"
        if self.postgres:
            with self.conn.cursor() as cursor:
                cursor.executemany(sql, rows)
        else:
            self.conn.executemany(sql, rows)

    def begin(self) -> None:
        if not self.postgres:
            self.conn.execute("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self.conn.commit() if self.postgres else self.conn.execute("COMMIT")

    def rollback(self) -> None:
        self.conn.rollback() if self.postgres else self.conn.execute("ROLLBACK")

    def advance_identities(self) -> None:
        """Postgres's identity columns (rowid, todo_history.id) go on after the highest value copied."""
        if not self.postgres:
            return
        for table, column in self.conn.execute(
                "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema ="
                " current_schema() AND is_identity = 'YES'").fetchall():
            self.conn.execute(f"SELECT setval(pg_get_serial_sequence(%s, %s), coalesce(max({column}), 0) + 1, false)"
                              f" FROM {table}", (table, column))

    def close(self) -> None:
        self.conn.close()


def copy_database(source: str, target: str) -> dict:
    """Copy `source` into `target` (which must be empty, of the other engine); the rows per table, checked."""
    if is_postgres(source) == is_postgres(target):
        raise ApiError("invalid_argument", "migrate-to copies between engines: from a SQLite file to a"
                                           " postgresql:// URL, or from a URL to a file")
    foreign = foreign_relations(target)
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise ApiError("conflict", f"{shown(target)} holds tables that are not Switchboard's ({', '.join(foreign[:5])}"
                                   f"{more}): migrate-to copies into an empty database only; create a new one for"
                                   " Switchboard and copy into that")
    open_database(source, inline_rings=False).close()  # the source at this program's schema first
    open_database(target, inline_rings=False).close()  # the target's schema made
    src, dst = _Side(source), _Side(target)
    try:
        if src.version() != SCHEMA_VERSION or dst.version() != SCHEMA_VERSION:
            raise ApiError("conflict", "both databases must be at this program's schema")
        tables = table_order()
        occupied = [t for t in tables if dst.count(t)]
        if occupied:
            raise ApiError("conflict", f"{shown(target)} is not empty ({', '.join(occupied[:3])} hold rows):"
                                       " migrate-to copies into an empty database only")
        dst.begin()
        try:
            for table in [t for t in tables if t not in (REBUILT, COPIED_LAST)] + [COPIED_LAST]:
                wanted = dst.columns(table)
                columns = [c for c in src.columns(table) if c in wanted]
                replace = ("human_id", "key") if table == COPIED_LAST else ()
                batch: list[tuple] = []
                for row in src.rows(table, columns):
                    batch.append(tuple(row))
                    if len(batch) == BATCH_ROWS:
                        dst.insert(table, columns, batch, replace)
                        batch = []
                if batch:
                    dst.insert(table, columns, batch, replace)
            dst.advance_identities()
            copied = {table: dst.count(table) for table in tables}
            differ = [t for t in tables if t != REBUILT and copied[t] != src.count(t)]
            counts = "SELECT endpoint_id, queue, state, n FROM todo_counts WHERE n > 0 ORDER BY 1, 2, 3"
            if sorted(map(tuple, src.conn.execute(counts).fetchall())) != sorted(
                    map(tuple, dst.conn.execute(counts).fetchall())):
                differ.append(REBUILT)
            if differ:
                raise ApiError("internal", f"the copy does not match its source in {', '.join(differ)}: nothing"
                                           " was written")
            dst.commit()
        except BaseException:
            dst.rollback()
            raise
    finally:
        src.close()
        dst.close()
    return {"from": shown(source), "to": shown(target), "schema_version": SCHEMA_VERSION, "rows": copied}
