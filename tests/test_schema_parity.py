"""schema.postgres.sql says what schema.sql says: the same tables and columns (in order, with their types mapped
and their NOT NULL), keys, foreign keys, indexes, CHECK constraints, view and triggers, read back from each
engine's catalog after applying the file. CHECK expressions, index predicates and the view's body are compared
as PostgreSQL prints them: schema.sql's, in the port's dialect (DIALECT below), go through the same printer. Applying it again changes nothing, its JSON checks decide as SQLite's
json functions do, and its triggers keep todo_counts, subjects and todo_done_minutes exactly as SQLite's do."""

from __future__ import annotations

import itertools
import os
import re
import sqlite3

import pg_cluster
import pytest
from conftest import ROOT

if os.environ.get("CI"):
    import psycopg
else:
    psycopg = pytest.importorskip("psycopg", reason="needs psycopg 3 (pip install 'psycopg[binary]')")

SQLITE_SCHEMA = ROOT / "schema.sql"
POSTGRES_SCHEMA = ROOT / "schema.postgres.sql"
# schema.sql's declared types and what the port makes of them (times in ms exceed int4).
TYPES = {"INTEGER": "bigint", "TEXT": "text", "BLOB": "bytea", "REAL": "double precision"}
# The port's own column: SQLite's implicit rowid made real (see schema.postgres.sql's header).
ROWID = "rowid"
# What several processes on one Postgres database share (schema.postgres.sql's last section): one SQLite process
# has no such thing, so these two are the only tables allowed on one side.
POSTGRES_ONLY = {"processes", "ring_listeners"}
FK_ACTIONS = {"a": "NO ACTION", "r": "RESTRICT", "c": "CASCADE", "n": "SET NULL", "d": "SET DEFAULT"}
_databases = itertools.count()


@pytest.fixture(scope="module")
def cluster():
    reason = pg_cluster.available()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the Postgres tests: {reason}")
        pytest.skip(reason)
    with pg_cluster.start() as running:
        yield running


def fresh_postgres(cluster) -> psycopg.Connection:
    """A new database with schema.postgres.sql applied, and an autocommit connection to it."""
    conn = psycopg.connect(cluster.create_database(f"parity_{next(_databases)}"), autocommit=True)
    conn.execute(POSTGRES_SCHEMA.read_text())
    return conn


@pytest.fixture
def postgres(cluster):
    with fresh_postgres(cluster) as conn:
        yield conn


@pytest.fixture
def sqlite(tmp_path):
    conn = sqlite3.connect(tmp_path / "parity.db", isolation_level=None)
    conn.execute("PRAGMA foreign_keys=ON")
    conn.executescript(SQLITE_SCHEMA.read_text())
    yield conn
    conn.close()


# -- each engine's catalog, as one comparable structure -------------------------------------------------------

def _without_comments(sql: str) -> str:
    return re.sub(r"--[^\n]*", "", sql)


def _parenthesised(sql: str, start: int) -> str:
    """The text inside the parenthesis that opens at sql[start], quotes respected."""
    depth, quoted = 0, False
    for end in range(start, len(sql)):
        char = sql[end]
        if char == "'":
            quoted = not quoted
        elif not quoted and char == "(":
            depth += 1
        elif not quoted and char == ")":
            depth -= 1
            if depth == 0:
                return sql[start + 1:end]
    raise ValueError(f"unbalanced: {sql[start:start + 80]}")


def _checks(create: str) -> list[str]:
    """A CREATE TABLE's CHECK expressions, as written (on its columns and on the table)."""
    return [_parenthesised(create, m.end() - 1) for m in re.finditer(r"\bCHECK\s*\(", create)]


def _predicate(create_index: str | None) -> str | None:
    """A CREATE INDEX's WHERE clause (a partial index's predicate), as written."""
    found = re.search(r"\bWHERE\b(.*?);?\s*$", _without_comments(create_index or ""), re.S)
    return found.group(1).strip() if found else None


def sqlite_structure(conn: sqlite3.Connection) -> dict:
    names = dict(conn.execute("SELECT name, type FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))
    tables, views, triggers = {}, {}, {}
    for table in sorted(name for name, kind in names.items() if kind == "table"):
        info = conn.execute(f"PRAGMA table_info({table})").fetchall()
        # A SQLite PRIMARY KEY column may hold NULL (a legacy quirk) where PostgreSQL's may not; the store never
        # writes one, so a key column counts as NOT NULL here.
        columns = [(name, TYPES[kind], bool(notnull or pk)) for _, name, kind, notnull, _, pk in info]
        primary_key = [name for *_, name, _, _, _, pk in sorted(info, key=lambda r: r[5]) if pk]
        foreign_keys = {}
        for row in conn.execute(f"PRAGMA foreign_key_list({table})"):
            fk_id, _, target, source, target_column, _, on_delete = row[:7]
            foreign_keys.setdefault(fk_id, [target, [], [], on_delete])
            foreign_keys[fk_id][1].append(source)
            foreign_keys[fk_id][2].append(target_column)
        indexes, unique_constraints = {}, set()
        for _, name, unique, origin, partial in conn.execute(f"PRAGMA index_list({table})"):
            keys = [f"{column} DESC" if desc else column
                    for _, _, column, desc, _, key in conn.execute(f"PRAGMA index_xinfo({name})") if key]
            if origin == "c":
                made = conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", (name,)).fetchone()[0]
                indexes[name] = (tuple(keys), bool(unique), _predicate(made) if partial else None)
            elif origin == "u":
                unique_constraints.add(tuple(keys))
        create = _without_comments(conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0])
        tables[table] = {"columns": columns, "primary key": primary_key,
                         "foreign keys": sorted((tuple(s), t, tuple(tc), d) for t, s, tc, d in foreign_keys.values()),
                         "indexes": indexes, "unique constraints": unique_constraints,
                         "checks": _checks(create)}
    for view in sorted(name for name, kind in names.items() if kind == "view"):
        made = _without_comments(conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", (view,)).fetchone()[0])
        views[view] = {"columns": [row[1] for row in conn.execute(f"PRAGMA table_info({view})")],
                       "body": re.split(r"\bAS\b", made, maxsplit=1)[1].strip().rstrip(";")}
    for name, sql in conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'"):
        when = re.search(r"\bAFTER\s+(INSERT|UPDATE|DELETE)(?:\s+OF\s+(.*?))?\s+ON\s+(\w+)(.*?)\bBEGIN\b", sql, re.S)
        event, columns, table, rest = when.groups()
        triggers[name] = (table, "AFTER", event, tuple(sorted(c.strip() for c in (columns or "").split(",") if c.strip())),
                          "WHEN" in rest)
    return {"tables": tables, "views": views, "triggers": triggers}


def postgres_structure(conn: psycopg.Connection) -> dict:
    one_schema = "n.nspname = current_schema()"
    relations = dict(conn.execute(f"SELECT c.relname, c.relkind FROM pg_class c JOIN pg_namespace n"
                                  f" ON n.oid = c.relnamespace WHERE {one_schema} AND c.relkind IN ('r', 'v')"))
    tables, views, triggers = {}, {}, {}
    for table in sorted(name for name, kind in relations.items() if kind == "r"):
        attributes = conn.execute("SELECT attnum, attname, format_type(atttypid, atttypmod), attnotnull"
                                  " FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0"
                                  " AND NOT attisdropped ORDER BY attnum", (table,)).fetchall()
        name_of = {number: name for number, name, *_ in attributes}
        columns = [(name, kind, notnull) for _, name, kind, notnull in attributes if name != ROWID]
        constraints = conn.execute("SELECT contype, conkey, confrelid::regclass::text, confkey, confdeltype, conindid"
                                   " FROM pg_constraint WHERE conrelid = %s::regclass", (table,)).fetchall()
        primary_key = next(([name_of[k] for k in key] for kind, key, *_ in constraints if kind == "p"), [])
        foreign_keys = sorted((tuple(name_of[k] for k in key), target,
                               tuple(_column_names(conn, target, target_key)), FK_ACTIONS[action])
                              for kind, key, target, target_key, action, _ in constraints if kind == "f")
        constraint_indexes = {index for kind, *_, index in constraints if kind in ("p", "u")}
        indexes, unique_constraints = {}, set()
        for oid, name, unique, predicate, keys, options in conn.execute(
                "SELECT i.indexrelid, c.relname, i.indisunique, pg_get_expr(i.indpred, i.indrelid), i.indkey::int2[],"
                " i.indoption::int2[] FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                " WHERE i.indrelid = %s::regclass", (table,)):
            keys = [f"{name_of[k]} DESC" if option & 1 else name_of[k] for k, option in zip(keys, options)]
            if oid in constraint_indexes:
                if not _is_primary(constraints, oid):
                    unique_constraints.add(tuple(keys))
            elif keys != [ROWID]:  # the port's own lookup index for retention's DELETE ... WHERE rowid = ?
                # SQLite's indexes end in the rowid implicitly; the port names it where the store walks in that order.
                indexes[name] = (tuple(keys[:-1] if keys[-1] == ROWID else keys), unique, predicate)
        tables[table] = {"columns": columns, "primary key": primary_key, "foreign keys": foreign_keys,
                         "indexes": indexes, "unique constraints": unique_constraints,
                         "checks": sorted(definition for (definition,) in conn.execute(
                             "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %s::regclass"
                             " AND contype = 'c'", (table,)))}
    for view in sorted(name for name, kind in relations.items() if kind == "v"):
        views[view] = {"columns": [name for (name,) in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 ORDER BY attnum", (view,))
            if name != ROWID], "body": conn.execute("SELECT pg_get_viewdef(%s::regclass)", (view,)).fetchone()[0]}
    for name, table, kind, columns, qualified in conn.execute(
            "SELECT tgname, tgrelid::regclass::text, tgtype, tgattr::int2[], tgqual IS NOT NULL FROM pg_trigger"
            " WHERE NOT tgisinternal"):
        event = next(label for bit, label in ((4, "INSERT"), (8, "DELETE"), (16, "UPDATE")) if kind & bit)
        timing = "BEFORE" if kind & 2 else "INSTEAD OF" if kind & 64 else "AFTER"
        assert kind & 1, f"trigger {name} fires per statement; schema.sql's fire per row"
        names = _column_names(conn, table, columns)
        triggers[name] = (table, timing, event, tuple(sorted(names)), qualified)
    return {"tables": tables, "views": views, "triggers": triggers}


# schema.sql's spellings that the port writes another way (schema.postgres.sql's header says why): SQLite's JSON
# functions are the switchboard_json_* functions; json_extract of a key is ->> on the text as json (a \u0000 escape
# read as U+FFFD); and a view's LEFT JOINed columns are scalar subqueries (Postgres locks no row of a view FOR
# UPDATE on the nullable side of an outer join).
DIALECT = (
    (re.compile(r"(?<![\w.])json_(valid|type|array_length)\("), r"switchboard_json_\1("),
    (re.compile(r"(?<![\w.])json_extract\(([\w.]+), '\$\.(\w+)'\)"),
     lambda m: f"(replace({m.group(1)}, '\\u0000', '\\ufffd')::json ->> '{m.group(2)}')"),
)


def in_postgres_dialect(sql: str) -> str:
    for pattern, replacement in DIALECT:
        sql = pattern.sub(replacement, sql)
    return " ".join(sql.split())


def _split_top_level(text: str) -> list[str]:
    """A select list's items: split at the commas outside parentheses and quotes."""
    items, depth, quoted, current = [], 0, False, ""
    for char in text:
        quoted = not quoted if char == "'" else quoted
        depth += (char == "(") - (char == ")") if not quoted else 0
        if char == "," and depth == 0 and not quoted:
            items.append(current.strip())
            current = ""
        else:
            current += char
    return [*items, current.strip()]


def view_in_postgres_dialect(body: str) -> str:
    """A schema.sql view as the port writes it: each column read through a LEFT JOIN is a scalar subquery over the
    joined table, on the join's condition."""
    body = in_postgres_dialect(body)
    found = re.fullmatch(r"SELECT (.*?) FROM (\w+ \w+)((?: LEFT JOIN \w+ \w+ ON [\w.]+ = [\w.]+)*)", body)
    assert found, f"the view's shape is not one this test reads: {body}"
    joins = re.findall(r"LEFT JOIN (\w+) (\w+) ON ([\w.]+ = [\w.]+)", found.group(3))
    items = []
    for item in _split_top_level(found.group(1)):
        for table, alias, condition in joins:
            if re.search(rf"(?<![\w.]){alias}\.", item):
                expression, name = item.rsplit(" AS ", 1)
                item = f"(SELECT {expression} FROM {table} {alias} WHERE {condition}) AS {name}"
        items.append(item)
    return f"SELECT {', '.join(items)} FROM {found.group(2)}"


def printed_by_postgres(conn: psycopg.Connection, sqlite_side: dict) -> dict:
    """schema.sql's CHECK expressions, index predicates and view bodies, in the port's dialect, as PostgreSQL
    prints them back: each made on an empty copy of its table's columns (or as a temporary view), and read from
    the catalog as the port's are."""
    for table, shape in sqlite_side["tables"].items():
        with conn.transaction(force_rollback=True):
            conn.execute(f"CREATE TEMPORARY TABLE parity_scratch (LIKE {table})")
            for expression in shape["checks"]:
                conn.execute(f"ALTER TABLE parity_scratch ADD CHECK ({in_postgres_dialect(expression)})")
            shape["checks"] = sorted(definition for (definition,) in conn.execute(
                "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = 'parity_scratch'::regclass"
                " AND contype = 'c'"))
            for name, (keys, unique, predicate) in shape["indexes"].items():
                if predicate is not None:
                    conn.execute(f"CREATE INDEX parity_{name} ON parity_scratch ({shape['columns'][0][0]})"
                                 f" WHERE {in_postgres_dialect(predicate)}")
                    predicate = conn.execute("SELECT pg_get_expr(indpred, indrelid) FROM pg_index"
                                             " WHERE indexrelid = %s::regclass", (f"parity_{name}",)).fetchone()[0]
                shape["indexes"][name] = (keys, unique, predicate)
    for view, shape in sqlite_side["views"].items():
        with conn.transaction(force_rollback=True):
            conn.execute(f"CREATE TEMPORARY VIEW parity_view AS {view_in_postgres_dialect(shape['body'])}")
            shape["body"] = conn.execute("SELECT pg_get_viewdef('parity_view'::regclass)").fetchone()[0]
    return sqlite_side


def _column_names(conn: psycopg.Connection, table: str, numbers: list[int]) -> list[str]:
    names = dict(conn.execute("SELECT attnum, attname FROM pg_attribute WHERE attrelid = %s::regclass",
                              (table,)).fetchall())
    return [names[n] for n in numbers]


def _is_primary(constraints: list, index_oid: int) -> bool:
    return any(kind == "p" and index == index_oid for kind, *_, index in constraints)


def differences(sqlite_side: dict, postgres_side: dict) -> list[str]:
    """What differs, one readable line each."""
    lines = []
    for part in ("tables", "views", "triggers"):
        left, right = sqlite_side[part], postgres_side[part]
        lines += [f"{part}: {name} only in schema.sql" for name in sorted(left.keys() - right.keys())]
        lines += [f"{part}: {name} only in schema.postgres.sql" for name in sorted(right.keys() - left.keys())]
        for name in sorted(left.keys() & right.keys()):
            if part != "tables":
                if left[name] != right[name]:
                    lines.append(f"{part}: {name}: schema.sql {left[name]} != schema.postgres.sql {right[name]}")
                continue
            for aspect, expected in left[name].items():
                got = right[name][aspect]
                if aspect == "indexes":
                    for index in sorted(expected.keys() | got.keys()):
                        if expected.get(index) != got.get(index):
                            lines.append(f"table {name}: index {index}: schema.sql {expected.get(index)}"
                                         f" != schema.postgres.sql {got.get(index)}")
                elif aspect == "columns" and expected != got:
                    lines += [f"table {name}: column {line}" for line in list_differences(expected, got)]
                elif aspect == "checks" and expected != got:
                    lines += [f"table {name}: {line}" for line in list_differences(expected, got)]
                elif expected != got:
                    lines.append(f"table {name}: {aspect}: schema.sql {expected} != schema.postgres.sql {got}")
    return lines


def list_differences(expected: list, got: list) -> list[str]:
    """Entries one list has and the other lacks; else where the order differs."""
    missing = [f"{entry} only in schema.sql" for entry in expected if entry not in got]
    extra = [f"{entry} only in schema.postgres.sql" for entry in got if entry not in expected]
    if missing or extra:
        return missing + extra
    return [f"order: schema.sql {[e[0] for e in expected]} != schema.postgres.sql {[e[0] for e in got]}"]


def test_the_postgres_schema_has_every_table_column_key_index_check_view_and_trigger_of_schema_sql(sqlite, postgres):
    sqlite_side, postgres_side = sqlite_structure(sqlite), postgres_structure(postgres)
    assert len(sqlite_side["tables"]) == 32 and len(sqlite_side["triggers"]) == 8, "the reading of schema.sql broke"
    assert sum(len(t["checks"]) for t in sqlite_side["tables"].values()) > 100, "the reading of CHECKs broke"
    sqlite_side = printed_by_postgres(postgres, sqlite_side)
    assert POSTGRES_ONLY <= postgres_side["tables"].keys(), "the tables several processes share are missing"
    postgres_side["tables"] = {name: table for name, table in postgres_side["tables"].items()
                               if name not in POSTGRES_ONLY}
    found = differences(sqlite_side, postgres_side)
    assert not found, "schema.postgres.sql differs from schema.sql:\n" + "\n".join(found)


def test_every_table_with_a_rowid_in_sqlite_has_one_in_postgres(sqlite, postgres):
    """The store orders ties and retention deletes by rowid: each table that has one in SQLite has the column."""
    without_rowid = {name for name, sql in sqlite.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'")
                     if re.search(r"WITHOUT\s+ROWID\s*$", sql.strip())}
    aliased = {"todo_history"}  # INTEGER PRIMARY KEY: its id is the rowid, an identity column here
    expected = set(sqlite_structure(sqlite)["tables"]) - without_rowid - aliased
    having = {table for (table,) in postgres.execute(
        "SELECT attrelid::regclass::text FROM pg_attribute WHERE attname = 'rowid' AND attidentity = 'd'"
        " AND attrelid IN (SELECT oid FROM pg_class WHERE relkind = 'r' AND relnamespace = current_schema()::regnamespace)")}
    assert having == expected
    assert postgres.execute("SELECT attidentity FROM pg_attribute WHERE attrelid = 'todo_history'::regclass"
                            " AND attname = 'id'").fetchone() == ("d",)


def catalog_text(conn: psycopg.Connection) -> dict:
    """Every definition the schema makes, as PostgreSQL prints it back, and how many rows each table holds."""
    relations = [name for (name,) in conn.execute(
        "SELECT relname FROM pg_class WHERE relnamespace = current_schema()::regnamespace ORDER BY relname")]
    return {
        "relations": relations,
        "constraints": conn.execute("SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)"
                                    " FROM pg_constraint WHERE connamespace = current_schema()::regnamespace"
                                    " ORDER BY 1, 2").fetchall(),
        "indexes": conn.execute("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema()"
                                " ORDER BY 1").fetchall(),
        "triggers": conn.execute("SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger WHERE NOT tgisinternal"
                                 " ORDER BY 1").fetchall(),
        "functions": conn.execute("SELECT proname, pg_get_functiondef(oid) FROM pg_proc"
                                  " WHERE pronamespace = current_schema()::regnamespace ORDER BY 1").fetchall(),
        "views": conn.execute("SELECT viewname, definition FROM pg_views WHERE schemaname = current_schema()"
                              " ORDER BY 1").fetchall(),
        "rows": {table: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                 for (table,) in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")},
    }


def test_applying_the_postgres_schema_again_changes_nothing(postgres):
    postgres.execute("INSERT INTO humans (id, name, token_hash, token_prefix, created_at)"
                     " VALUES ('hu_keep', 'keep', %s, 'sb_h', 1)", ("a" * 64,))
    before = catalog_text(postgres)
    postgres.execute(POSTGRES_SCHEMA.read_text())
    after = catalog_text(postgres)
    changed = [f"{part}: {entry} {'added' if entry in after[part] else 'gone'}" for part in before
               if part != "rows" for entry in set(before[part]) ^ set(after[part])]
    assert not changed, "applying schema.postgres.sql again changed the catalog:\n" + "\n".join(changed)
    assert after["rows"] == before["rows"]
    assert before["rows"]["humans"] == 1


# Documents each JSON check meets: well-formed and not, each kind, and the edges (escapes, depth, spacing).
JSON_DOCUMENTS = ["[]", "{}", "[1,2]", '{"a":1}', '"x"', "1", "null", "true", "", "nope", '{"a":}', "[1,]",
                  '"\\u0000"', "[" * 900 + "]" * 900, " [1] ", "{'a':1}", "NaN", "1e400", '"\\ud800"',
                  '{"a":1,"a":2}', '"\x01"', "0x10", ".5", "-0", "01", "[1] x", '"a\\qb"']


def test_the_json_checks_decide_as_sqlites_json_functions_do(sqlite, postgres):
    mismatches = []
    for document in JSON_DOCUMENTS:
        valid, kind, length = sqlite.execute(
            "SELECT json_valid(?1), CASE WHEN json_valid(?1) THEN json_type(?1) END,"
            " CASE WHEN json_valid(?1) THEN json_array_length(?1) END", (document,)).fetchone()
        expected = (bool(valid), kind if kind in ("array", "object") else None, length)
        got = postgres.execute("SELECT switchboard_json_valid(%(d)s),"
                               " CASE WHEN switchboard_json_type(%(d)s) IN ('array', 'object')"
                               " THEN switchboard_json_type(%(d)s) END,"
                               " CASE WHEN switchboard_json_valid(%(d)s) THEN switchboard_json_array_length(%(d)s) END",
                               {"d": document}).fetchone()
        if expected != got:
            mismatches.append(f"{document[:30]!r}: SQLite {expected}, PostgreSQL {got}")
    assert not mismatches, "\n".join(mismatches)


# -- the triggers: one story of todos, told to both engines -----------------------------------------------------

OPEN = "CASE WHEN t.state IN ('done', 'failed', 'cancelled') THEN 0 ELSE 1 END"
WAITING = ("CASE WHEN t.state IN ('quarantined', 'needs_input', 'blocked', 'review')"
           " OR (t.state = 'failed' AND t.dead_letter = 1) OR (t.state = 'pending' AND t.queue = 'hold') THEN 1 ELSE 0 END")
DAY_MS = 86_400_000


def todo(todo_id: str, endpoint: str, queue: str, state: str, subject: str | None, at: int, outcome: str | None = None):
    return ("INSERT INTO todos (id, endpoint_id, queue, state, outcome, title, source, subject_key, available_at,"
            " created_at, updated_at) VALUES (?, ?, ?, ?, ?, 'a todo', 'test', ?, ?, ?, ?)",
            (todo_id, endpoint, queue, state, outcome, subject, at, at, at))


STORY = [
    ("people", [
        ("INSERT INTO humans (id, name, token_hash, token_prefix, created_at) VALUES (?, ?, ?, 'sb_h', 1)",
         ("hu_a", "ann", "a" * 64)),
        ("INSERT INTO humans (id, name, token_hash, token_prefix, created_at) VALUES (?, ?, ?, 'sb_h', 1)",
         ("hu_b", "bob", "b" * 64)),
        *[("INSERT INTO endpoints (id, human_id, name, token_hash, token_prefix, queues, verbs, created_at)"
           " VALUES (?, ?, ?, ?, 'sb_e', '[\"work\"]', '[]', 1)", (endpoint, human, endpoint, char * 64))
          for endpoint, human, char in (("ep_a1", "hu_a", "c"), ("ep_a2", "hu_a", "d"), ("ep_b1", "hu_b", "e"))],
    ]),
    ("todos arrive", [
        todo("td_1", "ep_a1", "work", "pending", "s1", 60_000),
        todo("td_2", "ep_a1", "work", "pending", "s1", 61_000),
        todo("td_3", "ep_a1", "hold", "pending", "s2", 62_000),
        todo("td_4", "ep_a2", "work", "needs_input", "s1", 63_000),
        todo("td_5", "ep_a1", "quarantine", "quarantined", "s3", 64_000),
        todo("td_6", "ep_b1", "work", "pending", None, 65_000),
        todo("td_7", "ep_a1", "work", "done", "s2", 66_000, outcome="completed"),
        todo("td_8", "ep_a1", "work", "pending", "s4", 67_000),
    ]),
    ("a claim moves no subject count", [
        ("UPDATE todos SET state = 'claimed', lease_expires_at = ?, lease_token_hash = 'h', updated_at = ?"
         " WHERE id = 'td_1'", (200_000, 130_000)),
    ]),
    ("finishing and dead-lettering", [
        ("UPDATE todos SET state = 'done', outcome = 'completed', lease_expires_at = NULL, lease_token_hash = NULL,"
         " updated_at = ? WHERE id = 'td_1'", (140_000,)),
        ("UPDATE todos SET state = 'failed', dead_letter = 1, updated_at = ? WHERE id = 'td_2'", (150_000,)),
    ]),
    ("leaving the hold queue stops waiting", [
        ("UPDATE todos SET queue = 'work', updated_at = ? WHERE id = 'td_3'", (160_000,)),
    ]),
    ("released to a friend's lane, and moved within a human", [
        ("UPDATE todos SET endpoint_id = 'ep_b1', queue = 'work', state = 'pending', updated_at = ? WHERE id = 'td_5'",
         (170_000,)),
        ("UPDATE todos SET endpoint_id = 'ep_a1', updated_at = ? WHERE id = 'td_4'", (180_000,)),
    ]),
    ("an update that names the columns but changes nothing", [
        ("UPDATE todos SET state = state, queue = queue, endpoint_id = endpoint_id, updated_at = ?", (190_000,)),
    ]),
    ("one statement changing many todos", [
        ("UPDATE todos SET state = 'cancelled', updated_at = ? WHERE state IN ('pending', 'needs_input')"
         " AND endpoint_id = 'ep_a1' AND id <> 'td_8'", (200_000,)),
    ]),
    ("done a day later drops the queue's older minutes", [
        ("UPDATE todos SET state = 'done', outcome = 'completed', updated_at = ? WHERE id = 'td_8'", (2 * DAY_MS,)),
        ("UPDATE todos SET state = 'done', outcome = 'approved', updated_at = ? WHERE id = 'td_6'", (2 * DAY_MS + 1,)),
    ]),
    ("deletes", [
        ("DELETE FROM todos WHERE id IN ('td_3', 'td_4')", ()),
        ("DELETE FROM todos WHERE endpoint_id = 'ep_b1'", ()),
    ]),
]
KEPT = {"todo_counts": "SELECT endpoint_id, queue, state, n, changes FROM todo_counts ORDER BY 1, 2, 3",
        "subjects": "SELECT human_id, key, open_todos, waiting_todos, state, first_seen_at, last_activity_at"
                    " FROM subjects ORDER BY 1, 2",
        "todo_done_minutes": "SELECT endpoint_id, queue, minute, n FROM todo_done_minutes ORDER BY 1, 2, 3"}
RECOUNTS = {"todo_counts": ("SELECT endpoint_id, queue, state, n FROM todo_counts WHERE n > 0 ORDER BY 1, 2, 3",
                            "SELECT endpoint_id, queue, state, count(*) FROM todos GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"),
            "subjects": ("SELECT human_id, key, open_todos, waiting_todos FROM subjects"
                         " WHERE open_todos > 0 OR waiting_todos > 0 ORDER BY 1, 2",
                         f"SELECT e.human_id, t.subject_key, sum({OPEN}), sum({WAITING}) FROM todos t"
                         " JOIN endpoints e ON e.id = t.endpoint_id WHERE t.subject_key IS NOT NULL"
                         f" GROUP BY 1, 2 HAVING sum({OPEN}) > 0 OR sum({WAITING}) > 0 ORDER BY 1, 2")}


def run(conn, sql: str, args=()):
    """One statement, written with SQLite's `?` placeholders, on either engine."""
    if isinstance(conn, sqlite3.Connection):
        return conn.execute(sql, args)
    return conn.execute(sql.replace("?", "%s"), args)


def rows(conn, sql: str) -> list[tuple]:
    return [tuple(row) for row in run(conn, sql).fetchall()]


def test_the_triggers_keep_the_counts_as_sqlites_do_and_equal_to_counting_the_todos(sqlite, postgres):
    for step, statements in STORY:
        for conn in (sqlite, postgres):
            for sql, args in statements:
                run(conn, sql, args)
        for table, sql in KEPT.items():
            assert rows(postgres, sql) == rows(sqlite, sql), f"after {step!r}: {table} differs from SQLite's"
        for table, (kept, counted) in RECOUNTS.items():
            for conn in (sqlite, postgres):
                assert rows(conn, kept) == rows(conn, counted), f"after {step!r}: {table} drifted from the todos"
    assert rows(postgres, "SELECT count(*) FROM todos") == [(4,)]
    assert rows(postgres, KEPT["todo_done_minutes"]) == [("ep_a1", "work", 2 * DAY_MS // 60_000, 1),
                                                         ("ep_b1", "work", 2 * DAY_MS // 60_000, 1)]


def test_todo_rows_reads_the_event_content_type_and_the_rowid_as_sqlite_does(sqlite, postgres):
    """The view's own columns on both engines, for envelopes with and without a content type, and one with a
    \\u0000 escape (valid JSON, which jsonb would refuse)."""
    envelopes = {"ev_json": '{"content_type": "application/json", "kind": "push"}', "ev_none": '{"kind": "ping"}',
                 "ev_nul": '{"content_type": "text/plain", "title": "a\\u0000b"}'}
    statements = [*STORY[0][1]]
    for number, (event, envelope) in enumerate(envelopes.items()):
        statements.append(("INSERT INTO events (id, human_id, source, trust_mode, verified, envelope, disposition,"
                           " received_at) VALUES (?, 'hu_a', 'test', 'operator', 1, ?, 'routed', 1)", (event, envelope)))
        sql, args = todo(f"td_{number}", "ep_a1", "work", "pending", None, 1000 + number)
        statements.append((sql.replace("subject_key,", "subject_key, event_id,").replace("?, ?, ?, ?)", "?, ?, ?, ?, ?)"),
                           (*args[:6], event, *args[6:])))
    view = "SELECT id, todo_rowid, event_content_type, event_body FROM todo_rows ORDER BY created_at"
    for conn in (sqlite, postgres):
        for sql, args in statements:
            run(conn, sql, args)
    assert rows(postgres, view) == rows(sqlite, view) == [("td_0", 1, "application/json", None),
                                                          ("td_1", 2, None, None), ("td_2", 3, "text/plain", None)]
