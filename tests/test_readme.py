"""The README's curl walk-through, run as written against a real server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT


def walkthrough() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## From an empty database to a completed todo", 1)[1]
    return re.search(r"```sh\n(.*?)```", section, re.S).group(1)


def test_readme_walkthrough_ends_with_a_completed_todo(live_server, db_path, tmp_path):
    server = live_server()
    script = walkthrough().replace("localhost:8080", f"127.0.0.1:{server.port}").replace("/tmp/", f"{tmp_path}/")
    env = {**os.environ, "SWITCHBOARD_DB": db_path,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # curl prints each answer without a newline; the last one is the GET of the todo.
    final = json.loads(done.stdout[done.stdout.rindex('{"id"'):])
    assert final["state"] == "done" and final["outcome"] == "completed"
    assert final["result"] == {"fixed": True}
    assert [h["to"] for h in final["history"]] == ["pending", "claimed", "done"]
    assert final["attempts"][0]["heartbeats"] == 1


def test_readme_worker_loop_completes_pushed_work(live_server, db_path, tmp_path):
    server = live_server()
    section = (ROOT / "README.md").read_text().split("**A minimal worker loop**", 1)[1]
    (tmp_path / "worker.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    from conftest import cli_inproc
    _, human = cli_inproc(db_path, "human", "add", "alice")
    _, endpoint = cli_inproc(db_path, "endpoint", "vend", "--human", "alice", "--name", "w", "--queues", "build")
    env = {**os.environ, "SWITCHBOARD_URL": server.url, "SWITCHBOARD_TOKEN": endpoint["token"]}
    worker = subprocess.Popen([sys.executable, str(tmp_path / "worker.py")], env=env)
    try:
        import httpx
        todo = httpx.post(f"{server.url}/api/v1/endpoints/{endpoint['id']}/todos",
                          headers={"Authorization": f"Bearer {human['token']}"},
                          json={"title": "paste me", "queue": "build", "payload": {"n": 7}}).json()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            shown = httpx.get(f"{server.url}/api/v1/todos/{todo['id']}",
                              headers={"Authorization": f"Bearer {human['token']}"}).json()
            if shown["state"] == "done":
                break
            time.sleep(0.1)
        assert shown["state"] == "done" and shown["result"] == {"echo": {"n": 7}}
    finally:
        worker.kill()
        worker.wait()


def readme_block(heading: str, containing: str = "") -> str:
    """The first sh block after `heading` that contains `containing`."""
    section = (ROOT / "README.md").read_text().split(heading, 1)[1]
    return next(found for found in re.findall(r"```sh\n(.*?)```", section, re.S) if containing in found)


def run_block(script: str, env: dict, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env={**os.environ, **env, "PATH": path},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def test_readme_lane_block_keeps_credentials_private_and_routes_a_signed_issue(live_server, db_path, tmp_path):
    """The lane copy-paste block, run as written against a real server and a GitHub of our own (for the real one's
    address): its credentials land 0600 in a 0700 directory outside the checkout, the webhook writes through the
    connection holding the bot's token, and a signed GitHub issue of alice's labelled size/S by the connection's
    login reaches lane-s, though neither the webhook's trust list nor the pack's params name that login."""
    import hashlib
    import hmac

    import httpx
    import producers
    from forges import FakeForge
    server = live_server()
    home = tmp_path / "home"
    creds = home / ".config" / "switchboard"
    creds.mkdir(parents=True, mode=0o700)
    token = "github_pat_" + "LaneBl0ck" * 4
    (creds / "forge.token").write_text(token + "\n")  # the reader's step before the block
    (creds / "forge.token").chmod(0o600)
    github = FakeForge("github", token, "alice-triage")
    try:
        run_block(readme_block("### Lane topology, copy-paste", "sb route add").replace("https://api.github.com", github.api),
                  {"SWITCHBOARD_DB": db_path, "HOME": str(home), "XDG_CONFIG_HOME": "",
                   "SWITCHBOARD_NOTIFY_ALLOW_PRIVATE": "1"})
    finally:
        github.stop()
    assert [(r["method"], r["path"]) for r in github.requests] == [("GET", "/user")]
    assert (creds.stat().st_mode & 0o777) == 0o700
    files = sorted(p.name for p in creds.iterdir())
    assert {"alice.json", "router.json", "lane-s.json", "github-hook.json", "params.json",
            "github-forge.json"} <= set(files)
    for name in files:
        assert (creds / name).stat().st_mode & 0o777 == 0o600, name
    assert token not in (creds / "github-forge.json").read_text()
    assert not list(ROOT.glob("lane-*.json")) and not (ROOT / "github-hook.json").exists()
    hook = json.loads((creds / "github-hook.json").read_text())
    alice = json.loads((creds / "alice.json").read_text())
    shown = httpx.get(f"{server.url}/api/v1/webhooks/{hook['id']}", headers={"Authorization": f"Bearer {alice['token']}"})
    assert shown.json()["trusted_actors"] == {"logins": ["alice", "alice-agent"], "match": "sender"}
    assert shown.json()["connection"]["login"] == "alice-triage"
    assert json.loads((creds / "params.json").read_text())["trusted_agents"] == ["alice-agent"]
    lane_s = json.loads((creds / "lane-s.json").read_text())
    raw = json.dumps(producers.deep_merge(json.loads((ROOT / "tests/fixtures/github/issues.labeled.json").read_text()), {
        "issue": {"user": {"login": "alice"}, "labels": [{"name": "size/S"}], "state": "open"},
        "label": {"name": "size/S"}, "sender": {"login": "alice-triage"},
        "repository": {"full_name": "homelab/tools"}})).encode()
    signature = "sha256=" + hmac.new(hook["secret"].encode(), raw, hashlib.sha256).hexdigest()
    path = "/hooks/" + hook["url"].rsplit("/hooks/", 1)[1]
    answer = httpx.post(server.url + path, content=raw, headers={
        "X-GitHub-Event": "issues", "X-GitHub-Delivery": "lane-block-1", "X-Hub-Signature-256": signature,
        "Content-Type": "application/json"})
    assert answer.status_code == 202 and answer.json()["disposition"] == "routed", answer.text
    claim = httpx.post(server.url + "/api/v1/todos/claim", headers={"Authorization": f"Bearer {lane_s['token']}"},
                       json={"queue": "lane-s"}).json()
    assert claim["todo"]["work_order"]["lane"] == "lane-s"


@pytest.mark.sqlite_only("the README's file backup and restore")
def test_readme_restore_block_brings_back_a_working_webhook(live_server, db_path, tmp_path):
    """Backup while serving, restore into a new directory with the key, check, serve: a signed delivery to the
    same ingest URL verifies."""
    import httpx
    import producers
    live_server()  # the block backs up while the server runs
    from conftest import cli_inproc
    _, human = cli_inproc(db_path, "human", "add", "alice")
    _, endpoint = cli_inproc(db_path, "endpoint", "vend", "--human", "alice", "--name", "w", "--queues", "triage")
    _, hook = cli_inproc(db_path, "webhook", "create", "--endpoint", endpoint["id"], "--provider", "github",
                         "--queue", "triage", "--allow-all")
    state = Path(db_path).parent
    script = readme_block("### Backup and restore")
    script = script.replace("STATE=/var/lib/switchboard BACKUPS=/var/lib/switchboard/backups",
                            f"STATE={state} BACKUPS={tmp_path}/backups")
    script = script.replace("NEW=/var/lib/switchboard-restored", f"NEW={tmp_path}/restored")
    run_block(script, {})
    from conftest import LiveServer
    again = LiveServer(str(tmp_path / "restored" / "switchboard.db"))
    try:
        raw, headers = producers.github("issues.opened", hook["secret"])
        path = "/hooks/" + hook["url"].rsplit("/hooks/", 1)[1]
        answer = httpx.post(again.url + path, content=raw, headers=headers)
        assert answer.status_code == 202 and answer.json()["verified"] is True, answer.text
    finally:
        again.stop()
