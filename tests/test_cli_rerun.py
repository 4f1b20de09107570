"""The lane block runs again safely and fails loudly (issue 43): its creating commands take --if-missing (what the
first run made is answered, not made twice), files are written only on success, and an error stops the block on
stderr with nothing saved as if it were an answer."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import httpx
from conftest import ROOT, cli
from forges import FakeForge


def readme_block(heading: str, containing: str) -> str:
    """The first sh block of the README after `heading` that contains `containing`."""
    section = (ROOT / "README.md").read_text().split(heading, 1)[1]
    return next(found for found in re.findall(r"```sh\n(.*?)```", section, re.S) if containing in found)


# The README's lane block, as a person pastes it.
LANE_BLOCK = readme_block("## The seed's loop, copy-paste", "sb route add")


def run(script: str, env: dict) -> tuple[int, str, str]:
    import subprocess

    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env={**os.environ, **env, "PATH": path},
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr


def test_the_lane_block_run_twice_makes_one_of_each_and_keeps_its_files(live_server, db_path, tmp_path):
    server = live_server()
    home = tmp_path / "home"
    creds = home / ".config" / "switchboard"
    creds.mkdir(parents=True, mode=0o700)
    token = "github_pat_" + "ReRunBl0ck" * 4
    (creds / "forge.token").write_text(token + "\n")
    (creds / "forge.token").chmod(0o600)
    github = FakeForge("github", token, "alice-triage")
    env = {"SWITCHBOARD_DB": db_path, "HOME": str(home), "XDG_CONFIG_HOME": "",
           "SWITCHBOARD_NOTIFY_ALLOW_PRIVATE": "1"}
    block = LANE_BLOCK.replace("https://api.github.com", github.api)
    try:
        first = run(block, env)
        assert first[0] == 0 and "lanes ready: webhook wh_" in first[1], first
        files = {p.name: p.read_text() for p in creds.iterdir()}
        second = run(block, env)
        assert second[0] == 0 and second[1] == first[1], second  # the same webhook
    finally:
        github.stop()
    # The forge was asked who the token is once: the second run made no connection.
    assert [(r["method"], r["path"]) for r in github.requests] == [("GET", "/user")]
    # The tokens and the secret are kept; the connection's answer (no token) is written again, for the same one.
    after = {p.name: p.read_text() for p in creds.iterdir()}
    assert json.loads(after.pop("github-forge.json"))["id"] == json.loads(files["github-forge.json"])["id"]
    assert after == {name: text for name, text in files.items() if name != "github-forge.json"}
    alice = json.loads(files["alice.json"])
    auth = {"Authorization": f"Bearer {alice['token']}"}
    endpoints = httpx.get(f"{server.url}/api/v1/endpoints", headers=auth).json()["endpoints"]
    assert sorted(e["name"] for e in endpoints) == sorted(["router", "lane-s", "lane-m", "lane-l", "lane-vision",
                                                           "triage"])
    [hook] = httpx.get(f"{server.url}/api/v1/webhooks", headers=auth).json()["webhooks"]
    assert hook["id"] == json.loads(files["github-hook.json"])["id"] and hook["name"] == "github"
    assert len(httpx.get(f"{server.url}/api/v1/webhooks/{hook['id']}/routes", headers=auth).json()["routes"]) == 5
    [connection] = httpx.get(f"{server.url}/api/v1/connections", headers=auth).json()["connections"]
    assert connection["id"] == json.loads(files["github-forge.json"])["id"] and token not in files["github-forge.json"]
    assert connection["webhooks"] == [hook["id"]]
    # The endpoints' tokens from the first run still work.
    lane_s = json.loads(files["lane-s.json"])
    assert httpx.get(f"{server.url}/api/v1/todos", headers={"Authorization": f"Bearer {lane_s['token']}"}
                     ).status_code == 200


def test_a_lost_credentials_file_stops_the_block_loudly_and_writes_nothing(live_server, db_path, tmp_path):
    live_server()
    home = tmp_path / "home"
    creds = home / ".config" / "switchboard"
    creds.mkdir(parents=True, mode=0o700)
    token = "github_pat_" + "L0stF1le00" * 4
    (creds / "forge.token").write_text(token + "\n")
    (creds / "forge.token").chmod(0o600)
    github = FakeForge("github", token, "alice-triage")
    env = {"SWITCHBOARD_DB": db_path, "HOME": str(home), "XDG_CONFIG_HOME": ""}
    block = LANE_BLOCK.replace("https://api.github.com", github.api)
    try:
        assert run(block, {**env, "SWITCHBOARD_NOTIFY_ALLOW_PRIVATE": "1"})[0] == 0
        (creds / "router.json").unlink()  # the router's token was shown once, to that file
        (creds / "github-forge.json").unlink()
        code, out, err = run(block, env)
    finally:
        github.stop()
    # The router's vend fails (its token cannot be shown again), on stderr; the block stops there: no later
    # command ran, no file was written, it never said it was ready.
    assert "lanes ready" not in out, (code, out, err)
    assert "endpoint 'router' exists" in err and "router.json does not hold it" in err, err
    assert not (creds / "router.json").exists() and not (creds / "github-forge.json").exists()
    assert [(r["method"], r["path"]) for r in github.requests] == [("GET", "/user")]


def test_if_missing_refuses_what_differs_from_what_exists(db_path, tmp_path):
    assert cli(db_path, "human", "add", "alice")[0] == 0
    out = str(tmp_path / "lane.json")
    code, made = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "lane", "--queues", "lane-s",
                     "--if-missing", "--out", out)
    assert code == 0 and made["token"].startswith("sbk_") and "existing" not in made
    code, again = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "lane", "--queues", "lane-s",
                      "--if-missing", "--out", out)
    assert code == 0 and again == {"id": made["id"], "name": "lane", "queues": ["lane-s"], "verbs": made["verbs"],
                                   "existing": True}
    code, other = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "lane", "--queues", "lane-m",
                      "--if-missing", "--out", out)
    assert code == 1 and other["error"] == "conflict" and "another queues" in other["message"], other
    code, hook = cli(db_path, "webhook", "create", "--endpoint", made["id"], "--provider", "github", "--queue",
                     "lane-s", "--if-missing")
    assert code == 1 and "--if-missing needs --name" in hook["message"], hook
    hook_out = str(tmp_path / "hook.json")
    args = ("webhook", "create", "--endpoint", made["id"], "--name", "gh", "--provider", "github", "--queue",
            "lane-s", "--if-missing", "--out", hook_out)
    code, hook = cli(db_path, *args)
    assert code == 0 and hook["secret"].startswith("whsec_")
    code, again = cli(db_path, *args, "--trust", "alice")
    assert code == 0 and again["existing"] is True and again["id"] == hook["id"], again
    assert cli(db_path, "webhook", "list")[1]["webhooks"][0]["trusted_actors"]["logins"] == ["alice"]
    code, gitea = cli(db_path, "webhook", "create", "--endpoint", made["id"], "--name", "gh", "--provider", "gitea",
                      "--queue", "lane-s", "--if-missing")
    assert code == 1 and gitea["error"] == "conflict" and "give another --name" in gitea["message"], gitea
    assert len(cli(db_path, "webhook", "list")[1]["webhooks"]) == 1
