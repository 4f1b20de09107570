"""The README as a front door: its curl walk-through, the seed's loop block and the blocks it sends the reader to
run as written against a real server; it stays short, names its sections, and every relative link in it and in
docs/ leads to a file and heading that exist."""

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
    script = walkthrough()
    assert "localhost:8080" not in script.replace("SB=${SB:-http://localhost:8080}", ""), "the host is $SB's alone"
    env = {**os.environ, "SWITCHBOARD_DB": db_path, "SB": server.url,
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
    section = (ROOT / "docs" / "workers.md").read_text().split("**A minimal worker loop**", 1)[1]
    (tmp_path / "worker.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    from conftest import cli
    _, human = cli(db_path, "human", "add", "alice")
    _, endpoint = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "w", "--queues", "build")
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


def readme_block(heading: str, containing: str = "", page: str = "README.md") -> str:
    """The first sh block of `page` after `heading` that contains `containing`."""
    section = (ROOT / page).read_text().split(heading, 1)[1]
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
        run_block(readme_block("## The seed's loop, copy-paste", "sb route add").replace("https://api.github.com", github.api),
                  {"SWITCHBOARD_DB": db_path, "HOME": str(home), "XDG_CONFIG_HOME": "",
                   "SWITCHBOARD_NOTIFY_ALLOW_PRIVATE": "1"})
    finally:
        github.stop()
    assert [(r["method"], r["path"]) for r in github.requests] == [("GET", "/user")]
    assert (creds.stat().st_mode & 0o777) == 0o700
    files = sorted(p.name for p in creds.iterdir())
    assert {"alice.json", "router.json", "lane-s.json", "github-hook.json", "params.json",
            "github-forge.json", "triage.token", "lane-s.token"} <= set(files)
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
    assert (creds / "lane-s.token").read_text().strip() == lane_s["token"], "the lane worker's token file"


@pytest.mark.sqlite_only("running.md's file backup and restore")
def test_readme_restore_block_brings_back_a_working_webhook(live_server, db_path, tmp_path):
    """Backup while serving, restore into a new directory with the key, check, serve: a signed delivery to the
    same ingest URL verifies."""
    import httpx
    import producers
    live_server()  # the block backs up while the server runs
    from conftest import cli
    _, human = cli(db_path, "human", "add", "alice")
    _, endpoint = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "w", "--queues", "triage")
    _, hook = cli(db_path, "webhook", "create", "--endpoint", endpoint["id"], "--provider", "github",
                  "--queue", "triage", "--allow-all")
    state = Path(db_path).parent
    script = readme_block("## Backup and restore", page="docs/running.md")
    script = script.replace("STATE=/var/lib/switchboard BACKUPS=/srv/backups",
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


README_SECTIONS = ["Install", "Serve", "From an empty database to a completed todo (curl)",
                   "The seed's loop, copy-paste", "Where to read on"]


def test_the_readme_is_a_front_door():
    """What it is, install, serve, the walk-through, the seed's loop, where to read on: within 400 lines (the
    1,649-line README took a newcomer 34 minutes before the first command). Everything else lives in docs/."""
    text = (ROOT / "README.md").read_text()
    assert text.count("\n") <= 400, f"README.md has {text.count(chr(10))} lines"
    outside_code = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    assert re.findall(r"^## (.+)$", outside_code, re.M) == README_SECTIONS
    assert not re.search(r"^### ", outside_code, re.M)
    # The test command is exactly what CI runs.
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in text, ci
    # The table of where to read on names every page of docs/ that is not a reference page (which docs/README.md
    # lists): a page moved out of the README is never orphaned.
    table = text.split("## Where to read on", 1)[1]
    reference = (ROOT / "docs" / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in table or f"({page.name})" in reference, f"nothing leads to docs/{page.name}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[`*_]", lambda m: "" if m.group() != "_" else "_", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file (a repeated one numbered as GitHub numbers it), code left out."""
    found: set[str] = set()
    text = re.sub(r"^([ \t]*)```.*?^\1```", "", path.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6} (.+?)#*\s*$", text, re.M):
        base, n = slug(heading), 0
        while (anchor := base if n == 0 else f"{base}-{n}") in found:
            n += 1
        found.add(anchor)
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    """The relative targets of the Markdown links and images in a file, outside code, with their line."""
    text = path.read_text()
    text = re.sub(r"^([ \t]*)```.*?^\1```", lambda m: "\n" * m.group().count("\n"), text, flags=re.S | re.M)
    text = re.sub(r"`[^`]*`", lambda m: "\n" * m.group().count("\n"), text)
    links = []
    for match in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)\)", text):
        target = match.group(1)
        if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not ours to check
            links.append((text.count("\n", 0, match.start()) + 1, target))
    return links


def test_every_relative_link_leads_to_a_file_and_a_heading_that_exist():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "packs" / "README.md"]
    broken = []
    for page in pages:
        for line, target in relative_links(page):
            file_part, _, anchor = target.partition("#")
            linked = (page.parent / file_part).resolve() if file_part else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}:{line}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}:{line}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


def test_the_link_check_knows_githubs_anchors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Ingress: `POST /hooks/{token}`\n\n## The seed's loop, copy-paste\n\n## Notes\n\n"
                    "### Notes\n\n```sh\n# not a heading\n```\n[a](#title) [b](other.md#x) `[c](nowhere.md)`\n")
    assert anchors(page) == {"title", "ingress-post-hookstoken", "the-seeds-loop-copy-paste", "notes", "notes-1"}
    assert relative_links(page) == [(14, "#title"), (14, "other.md#x")]
