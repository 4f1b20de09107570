"""The operator's forge commands (SPEC 16): `connection add|list|test|remove` against a GitHub of our own, and
`webhook connect|disconnect`, through the real CLI (a child process each), with --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, cli
from forges import FakeForge

TOKEN = "ghp_" + "C0mmandL1ne" * 4


@pytest.fixture
def github():
    forge = FakeForge("github", TOKEN, "ops-bot")
    yield forge
    forge.stop()


@pytest.fixture
def setup(db_path, tmp_path, monkeypatch):
    """A human with an endpoint and a GitHub webhook; the CLI may reach loopback forges (as `serve
    --notify-allow-private` would let the server)."""
    monkeypatch.setenv("SWITCHBOARD_NOTIFY_ALLOW_PRIVATE", "1")
    assert cli(db_path, "human", "add", "alice")[0] == 0
    endpoint = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "lanes", "--queues", "triage")[1]
    hook = cli(db_path, "webhook", "create", "--endpoint", endpoint["id"], "--provider", "github",
               "--queue", "triage", "--allow-all")[1]
    token_file = tmp_path / "forge.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    return {"hook": hook, "endpoint": endpoint["id"], "token_file": str(token_file)}


def test_connection_add_list_test_and_remove(db_path, github, setup, tmp_path):
    code, made = cli(db_path, "connection", "add", "--human", "alice", "--kind", "github", "--api", github.api,
                     "--token-file", setup["token_file"], "--repos", "acme/,Codertocat/Hello-World")
    assert code == 0, made
    assert made["login"] == "ops-bot" and made["repos"] == ["acme/", "Codertocat/Hello-World"]
    assert github.requests[0]["headers"]["authorization"] == f"Bearer {TOKEN}"
    code, listed = cli(db_path, "connection", "list")
    assert code == 0 and [c["id"] for c in listed["connections"]] == [made["id"]]
    people = subprocess.run([sys.executable, str(ROOT / "switchboard.py"), "connection", "list", "--db", db_path],
                            capture_output=True, text=True, timeout=60)
    assert "ops-bot" in people.stdout and TOKEN not in people.stdout + people.stderr
    assert cli(db_path, "connection", "test", made["id"]) == (0, {"id": made["id"], "ok": True, "login": "ops-bot",
                                                                  "error": None})
    github.token = "ghp_rotated"  # the forge no longer knows the stored token
    code, failed = cli(db_path, "connection", "test", made["id"])
    assert code == 1 and "HTTP 401: Bad credentials" in failed["message"]

    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"comment": {"max": 2, "max_bytes": 500}}))
    code, connected = cli(db_path, "webhook", "connect", setup["hook"]["id"], made["id"], "--mirror", "--policy",
                          str(policy))
    assert code == 0, connected
    assert (connected["login"], connected["mirror"], connected["policy"]) == (
        "ops-bot", True, {"comment": {"max": 2, "max_bytes": 500}})
    code, hooks = cli(db_path, "webhook", "list")
    assert hooks["webhooks"][0]["connection"] == {"id": made["id"], "kind": "github", "login": "ops-bot",
                                                  "mirror": True, "commands": {"logins": [], "on_close": "cancel"}}
    assert cli(db_path, "webhook", "disconnect", setup["hook"]["id"])[1] == {"webhook_id": setup["hook"]["id"],
                                                                          "disconnected": True}
    code, removed = cli(db_path, "connection", "remove", made["id"])
    assert code == 0 and removed["removed"] is True
    assert cli(db_path, "connection", "list")[1] == {"connections": []}


def test_a_token_file_others_may_read_a_refused_token_and_a_bad_policy_change_nothing(db_path, github, setup,
                                                                                      tmp_path):
    readable = tmp_path / "readable.token"
    readable.write_text(TOKEN)
    os.chmod(readable, 0o644)
    code, refused = cli(db_path, "connection", "add", "--human", "alice", "--kind", "github", "--api", github.api,
                        "--token-file", str(readable), "--repos", "acme/")
    assert code == 1 and refused["message"].endswith("others may read it; chmod 600 it first")
    assert github.requests == []
    wrong = tmp_path / "wrong.token"
    wrong.write_text("ghp_unknown")
    wrong.chmod(0o600)
    code, refused = cli(db_path, "connection", "add", "--human", "alice", "--kind", "github", "--api", github.api,
                        "--token-file", str(wrong), "--repos", "acme/")
    assert code == 1 and "did not say who the token is: HTTP 401" in refused["message"]
    assert cli(db_path, "connection", "list")[1] == {"connections": []}
    code, made = cli(db_path, "connection", "add", "--human", "alice", "--kind", "github", "--api", github.api,
                     "--token-file", setup["token_file"], "--repos", "acme/")
    bad = tmp_path / "bad-policy.json"
    bad.write_text(json.dumps({"comment": {"max": 0, "max_bytes": 10}, "close_issue": True}))
    code, refused = cli(db_path, "webhook", "connect", setup["hook"]["id"], made["id"], "--policy", str(bad))
    assert code == 1 and refused["error"] == "invalid_argument" and "close_issue" in refused["message"]
    gitea_hook = cli(db_path, "webhook", "create", "--endpoint", setup["endpoint"], "--provider", "gitea",
                     "--queue", "triage", "--allow-all")[1]
    code, refused = cli(db_path, "webhook", "connect", gitea_hook["id"], made["id"])
    assert code == 1 and refused["message"] == ("connection_id: a gitea webhook cannot write through a github"
                                                " connection")
