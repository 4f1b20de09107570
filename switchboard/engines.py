"""Which engine a `--db` names: a SQLite file (the default) or a postgresql:// URL, opened the same way."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from switchboard.configuration import SCHEMA_VERSION, ApiError, Clock
from switchboard.crypto import shown

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres(target: str) -> bool:
    return target.startswith(POSTGRES_SCHEMES)


def shown_database(target: str) -> str:
    """The database as answers and logs name it: a SQLite file's full path, a URL without its password."""
    return shown(target) if is_postgres(target) else str(Path(target).resolve())


def migrate_postgres(url: str, dry_run: bool) -> dict:
    """`migrate` on Postgres: the version found and the steps to this program's; unless a dry run, those steps
    taken (the ones another process took meanwhile are not this one's: `steps` says what this run applied)."""
    import psycopg

    from switchboard.migrations import pending_migrations
    from switchboard.postgres import apply_postgres_schema, current_version

    with psycopg.connect(url, autocommit=True) as conn:
        before = current_version(conn)
        if before > SCHEMA_VERSION:
            raise ApiError("conflict", f"{shown(url)} is schema {before}, newer than this program ({SCHEMA_VERSION}):"
                                       " run the newer program")
        if dry_run:
            steps = pending_migrations(before, engine="postgres")
        else:
            before, steps = apply_postgres_schema(conn)
    return {"path": shown(url), "from": before, "to": SCHEMA_VERSION, "steps": steps,
            "applied": bool(steps) and not dry_run}


def database_errors() -> tuple[type[BaseException], ...]:
    """The engines' own error classes, for the few places that turn a database's refusal into an answer."""
    try:
        import psycopg
    except ImportError:
        return (sqlite3.Error,)
    return (sqlite3.Error, psycopg.Error)


def open_database(target: str, *, synchronous: str = "FULL", clock: Clock | None = None, inline_rings: bool = True,
                  migrate: bool = True, pool_size: int = 8, listen: bool = False, listen_url: str | None = None):
    """A Database (SQLite) or a Postgres, by what `target` is. `listen` (Postgres only): this process serves, so it
    takes part in the rings, the leader election and the heartbeats, over `listen_url` when one is given (a direct
    connection, where `target` goes through a transaction pooler)."""
    if not is_postgres(target):
        from switchboard.database import Database

        return Database(target, synchronous=synchronous, clock=clock, inline_rings=inline_rings, migrate=migrate)
    try:
        from switchboard.postgres import Postgres
    except ImportError:
        raise ApiError("invalid_argument", "a postgresql:// database needs the postgres extra:"
                                           ' pip install ".[postgres]" in a checkout, or'
                                           ' pip install "psycopg[binary]>=3.2" "psycopg-pool>=3.2"') from None
    return Postgres(target, clock=clock, inline_rings=inline_rings, migrate=migrate, pool_size=pool_size,
                    listen=listen, listen_url=listen_url)
