"""Webhook names from the command line (issue 25, item 6: webhooks that differ only by id): `webhook create
--name`, `webhook rename ID NAME` (or `--clear`), and a NAME column in `webhook list`, through the same model and
store function as REST's PATCH /api/v1/webhooks/{id}. The real CLI in a child process, on a real database."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT, cli


def people(db_path: str, *args: str) -> str:
    """What the CLI prints for people (no --json)."""
    done = subprocess.run([sys.executable, str(ROOT / "switchboard.py"), *args, "--db", db_path],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_webhooks_are_named_when_made_renamed_and_listed_by_name(db_path):
    cli(db_path, "human", "add", "alice")
    _, router = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "router", "--queues", "hold",
                    "--verbs", "webhooks")
    make = ("webhook", "create", "--endpoint", router["id"], "--provider", "github", "--queue", "hold", "--allow-all")
    code, lab = cli(db_path, *make, "--name", "home lab")
    assert code == 0 and set(lab) == {"id", "url", "secret", "provider", "queue"}, lab  # the shape SPEC 9 names
    code, office = cli(db_path, *make)
    assert code == 0
    assert [w["name"] for w in cli(db_path, "webhook", "list")[1]["webhooks"]] == ["home lab", None]

    code, renamed = cli(db_path, "webhook", "rename", office["id"], "office (nas01)")
    assert code == 0 and renamed["name"] == "office (nas01)" and renamed["id"] == office["id"]
    table = people(db_path, "webhook", "list").splitlines()
    assert table[0].split()[:3] == ["ID", "NAME", "PROVIDER"]
    rows = {line.split()[0]: line for line in table[1:]}
    assert " home lab " in rows[lab["id"]] and " office (nas01) " in rows[office["id"]]

    code, cleared = cli(db_path, "webhook", "rename", lab["id"], "--clear")
    assert code == 0 and cleared["name"] is None
    assert [w["name"] for w in cli(db_path, "webhook", "list")[1]["webhooks"]] == [None, "office (nas01)"]

    # Refused as REST refuses it, changing nothing; NAME or --clear, one of them.
    code, long = cli(db_path, "webhook", "rename", office["id"], "x" * 65)
    assert code == 1 and long["error"] == "invalid_argument" and long["message"].startswith("name:"), long
    code, two_lines = cli(db_path, *make, "--name", "two\nlines")
    assert code == 1 and two_lines["error"] == "invalid_argument"
    assert cli(db_path, "webhook", "rename", "wh_0123456789abcdef", "x")[1]["error"] == "not_found"
    for args in ((), ("x", "--clear")):
        assert cli(db_path, "webhook", "rename", office["id"], *args)[0] == 2
    assert [w["name"] for w in cli(db_path, "webhook", "list")[1]["webhooks"]] == [None, "office (nas01)"]
