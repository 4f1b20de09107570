"""A failing CLI command says so on stderr, with --json as one JSON object there, and exits non-zero: stdout holds
answers only, so a script's `--json > FILE` never saves an error as an answer (issue 43). A command's refusal of an
internal address names what allows it for that command (its environment), never serve's flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, cli_program

from switchboard.notifier import COMMAND_ALLOWANCE


def run(db_path: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "switchboard.py"), *args, "--db", db_path], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def test_an_error_with_json_goes_to_stderr_as_one_object_and_stdout_stays_empty(db_path, tmp_path):
    assert cli_program(db_path, "human", "add", "alice")[0] == 0
    out = tmp_path / "lane.json"
    done = run(db_path, "endpoint", "vend", "--human", "nobody", "--name", "lane", "--queues", "lane-s", "--json",
               "--out", str(out))
    assert done.returncode == 1 and done.stdout == "", done
    assert json.loads(done.stderr) == {"error": "not_found", "message": "no human 'nobody'"}
    assert not out.exists()
    # Without --json, the same error in words, on stderr too.
    done = run(db_path, "endpoint", "vend", "--human", "nobody", "--name", "lane", "--queues", "lane-s")
    assert done.returncode == 1 and done.stdout == "" and done.stderr == "error: not_found: no human 'nobody'\n"
    # A usage error: exit 2, nothing on stdout.
    done = run(db_path, "endpoint", "vend", "--human", "alice", "--json")
    assert done.returncode == 2 and done.stdout == "" and "required" in done.stderr
    # No database there: the same.
    done = run(str(tmp_path / "none.db"), "human", "list", "--json")
    assert done.returncode == 1 and done.stdout == "" and json.loads(done.stderr)["error"] == "not_found"


def test_a_script_that_saves_an_answer_saves_nothing_when_the_command_fails(db_path, tmp_path):
    """The README's pattern: `--json > FILE && chmod 600 FILE`, then the next line reads FILE's id."""
    saved = tmp_path / "ep.json"
    script = (f'"{sys.executable}" "{ROOT / "switchboard.py"}" endpoint vend --human nobody --name x --queues q'
              f' --db "{db_path}" --json > "{saved}" && echo saved')
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "saved" not in done.stdout
    assert saved.read_text() == "" and json.loads(done.stderr)["error"] == "not_found"


@pytest.mark.parametrize("command", [
    ("notify", "add", "--human", "alice", "--kind", "ntfy", "--url", "http://127.0.0.1:9/topic", "--events", "held"),
    ("connection", "add", "--human", "alice", "--kind", "github", "--api", "http://127.0.0.1:9", "--token-file",
     "TOKEN", "--repos", "acme/"),
], ids=["notify add", "connection add"])
def test_a_commands_refusal_names_its_environment_not_serves_flags(db_path, tmp_path, command):
    assert cli_program(db_path, "human", "add", "alice")[0] == 0
    token = tmp_path / "forge.token"
    token.write_text("ghp_" + "x" * 36)
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_NOTIFY_ALLOW")}
    done = subprocess.run([sys.executable, str(ROOT / "switchboard.py"), *[str(token) if a == "TOKEN" else a
                                                                           for a in command],
                           "--db", db_path, "--json"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1 and done.stdout == "", done
    error = json.loads(done.stderr)
    assert error["error"] == "invalid_argument" and COMMAND_ALLOWANCE in error["message"], error
    assert "serve --" not in error["message"] and "--notify-allow" not in error["message"], error
    assert "SWITCHBOARD_NOTIFY_ALLOW_PRIVATE=1" in error["message"]
