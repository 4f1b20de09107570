"""Closing the database while a read is under way on one of its connections (issue 43, part 5): closing a sqlite3
connection another thread is stepping a statement on crashes the interpreter, so a server stopped while a sweep
reads died of a segmentation fault instead of exiting. The read runs in a child process, so a crash shows as a
signal exit rather than taking the test process with it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

# A read paused inside its fetch by an SQL function of the test's: the first row's call waits until close has begun
# (close refuses a new read), then the fetch goes on to the other rows. Without the fix close never refuses: it frees
# the connection's functions at once and then waits for the paused step to let go of the connection, so the pause
# ends at a deadline instead, and the next row's call of the freed function crashes the child.
CLOSE_DURING_A_READ = textwrap.dedent("""
    import sqlite3, sys, threading, time
    from switchboard.database import Database

    db = Database(sys.argv[1])
    in_fetch, go_on = threading.Event(), threading.Event()
    got = {}

    def pause(n):
        if n == 1:
            in_fetch.set()
            go_on.wait()
        return n

    def rows(txn):
        txn.conn.create_function("pause", 1, pause)
        return [r[0] for r in txn.all("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 50)"
                                      " SELECT pause(i) FROM n")]

    def read():
        try:
            got["rows"] = db.read_sync(rows)
        except BaseException as exc:
            got["rows"] = repr(exc)

    reader = threading.Thread(target=read)
    reader.start()
    in_fetch.wait()
    closer = threading.Thread(target=db.close)
    closer.start()
    refused, deadline = None, time.monotonic() + 2
    while closer.is_alive() and refused is None and time.monotonic() < deadline:
        try:
            db.read_sync(lambda txn: txn.one("SELECT 1"))
        except sqlite3.ProgrammingError as exc:
            refused = str(exc)
        time.sleep(0.005)
    go_on.set()
    reader.join()
    closer.join()
    print("read:", got["rows"] == list(range(1, 51)) or got["rows"])
    print("refused:", refused)
""")


@pytest.mark.sqlite_only("closing sqlite3 connections")
@pytest.mark.parametrize("run", range(5))
def test_close_waits_for_a_read_under_way_and_refuses_new_ones(tmp_path, run):
    done = subprocess.run([sys.executable, "-c", CLOSE_DURING_A_READ, str(tmp_path / "switchboard.db")],
                          cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, f"exit {done.returncode} (a negative one is a signal)\n{done.stdout}{done.stderr}"
    assert done.stdout.splitlines() == ["read: True", "refused: the database is closed"], done.stdout + done.stderr
