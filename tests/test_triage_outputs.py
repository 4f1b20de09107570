"""Triage without a forge token (SPEC section 16, issue 36: "Triage uses it"): real processes, end to end.

One `serve` for the module (`--notify-allow-private`: the forge is ours, on loopback), deployed as the README's lane
block does it: a router endpoint owning the GitHub webhook, one endpoint per lane routed from it, and the fleet pack.
No one names the triage bot: neither the webhook's trust list nor the pack's `trusted_agents`. The forge is the GitHub
of tests/forges.py (it records every request and sends the signed `issues` deliveries back to the webhook); the model
is test_triage's OpenAI-compatible API of our own. The triage worker runs as `switchboard worker --triage` with no
`--forge-token-file` and no forge address at all: the connection, made with the CLI (`connection add`, `webhook
connect`) as the README says, is the only holder of the token, and the server adds the label."""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import producers
import pytest
from conftest import ROOT, LiveServer, cli
from forges import REPO, FakeForge
from helpers import TLS, hook_path
from test_triage import MODEL, FakeModel, eventually, secret_file, sized, triage_worker_command

TOKEN = "ghp_" + "C0nnect10nT0ken" * 3
BOT = "acme-triage"  # the connection's login: trusted because the webhook names the connection, nowhere else
LANES = ["lane-s", "lane-m", "lane-l", "lane-vision", "triage"]
PARAMS = {"require_verified": True, "trusted_humans": ["Codertocat"], "trusted_agents": [],
          "repo_prefixes": ["acme/"]}
NUMBERS = itertools.count(500)


@dataclass
class Site:
    server: LiveServer
    db: str
    dir: Path
    human_token: str
    router: str
    endpoints: dict[str, str]  # lane queue -> its endpoint's id
    tokens: dict[str, str]  # lane queue -> its endpoint's token
    model: FakeModel

    def call(self, method: str, path: str, token: str | None = None, **body) -> dict:
        r = httpx.request(method, f"{self.server.url}/api/v1{path}", json=body or None, timeout=10, verify=TLS,
                          headers={"Authorization": f"Bearer {token or self.human_token}"})
        assert r.status_code in (200, 201), r.text
        return r.json()

    def todo(self, todo_id: str) -> dict:
        return self.call("GET", f"/todos/{todo_id}")

    def cli(self, *args: str) -> dict:
        """The operator's CLI as a reader runs it, on this server's database; it asks the forge from here, under the
        same allowance of internal addresses as the server."""
        env = {**os.environ, "SWITCHBOARD_NOTIFY_ALLOW_PRIVATE": "1"}
        done = subprocess.run([sys.executable, str(ROOT / "switchboard.py"), "--db", self.db, "--json", *args],
                              capture_output=True, text=True, timeout=60, env=env, cwd=self.dir)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout) if done.stdout.strip() else {}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    directory = tmp_path_factory.mktemp("triage-outputs")
    db = str(directory / "switchboard.db")
    code, human = cli(db, "human", "add", "alice")
    assert code == 0, human
    server = LiveServer(db, "--notify-allow-private")
    model = FakeModel()
    try:
        site = Site(server, db, directory, human["token"], "", {}, {}, model)
        site.router = site.call("POST", "/endpoints", name="router", queues=["hold"], verbs=["webhooks"])["id"]
        for queue in LANES:
            lane = site.call("POST", "/endpoints", name=queue, queues=[queue], verbs=["drain"])
            site.endpoints[queue], site.tokens[queue] = lane["id"], lane["token"]
        secret_file(directory / "triage.token", site.tokens["triage"])
        secret_file(directory / "forge.token", TOKEN)
        yield site
    finally:
        model.stop()
        server.stop()


@pytest.fixture
def github(site):
    """A GitHub of our own whose token is the connection's."""
    forge = FakeForge("github", TOKEN, BOT)
    yield forge
    forge.stop()


@pytest.fixture
def hook(site, github) -> dict:
    """A webhook of alice's for `github`, with the fleet pack, trusting only the human who opens issues; the forge
    sends its deliveries there."""
    hook = site.call("POST", "/webhooks", provider="github", queue="hold", endpoint_id=site.router,
                     trusted_actors={"logins": ["Codertocat"], "match": "sender"})
    for queue in LANES:
        site.call("POST", f"/webhooks/{hook['id']}/routes", endpoint_id=site.endpoints[queue])
    site.call("PUT", f"/webhooks/{hook['id']}/rules", **json.loads((ROOT / "packs" / "fleet.json").read_text()),
              params=PARAMS)
    github.hook = (site.server.url + hook_path(hook["url"]), hook["secret"])
    site.model.requests.clear()
    site.model.script = lambda request: sized("S", "a one-word fix in the README")
    return hook


def connect(site: Site, forge: FakeForge, hook: dict) -> dict:
    """The README's two lines: a connection holding the bot's token, and the webhook writing through it."""
    connection = site.cli("connection", "add", "--human", "alice", "--kind", "github", "--api", forge.api,
                          "--token-file", str(site.dir / "forge.token"), "--repos", "acme/")
    assert connection["login"] == BOT
    site.cli("webhook", "connect", hook["id"], connection["id"])
    return connection


def open_issue(site: Site, forge: FakeForge, number: int) -> str:
    """An issue Codertocat opens on the forge, and its signed `issues.opened` delivery; the triage todo's id."""
    forge.issue(REPO, number, title="Spelling error in the README file", author="Codertocat")
    raw, _ = producers.github("issues.opened", "", {
        "issue": {"number": number, "title": "Spelling error in the README file", "labels": [],
                  "user": {"login": "Codertocat"}, "pull_request": None, "state": "open",
                  "html_url": f"{forge.url}/{REPO}/issues/{number}"},
        "repository": {"full_name": REPO, "name": "site", "owner": {"login": "acme"}},
        "sender": {"login": "Codertocat"}})
    url, secret = forge.hook
    signature = "sha256=" + hmac.new(secret.encode(), raw, hashlib.sha256).hexdigest()
    answer = httpx.post(url, content=raw, timeout=10, headers={
        "X-GitHub-Event": "issues", "X-GitHub-Delivery": f"opened-{number}", "X-Hub-Signature-256": signature,
        "Content-Type": "application/json"})
    assert answer.status_code == 202 and answer.json()["disposition"] == "routed", answer.text
    [todo] = answer.json()["todos"]
    assert todo["queue"] == "triage"
    return todo["id"]


def run_triage_once(site: Site, tmp_path: Path) -> str:
    """`switchboard worker --triage --once` without a forge token or a forge address; its log once it exited 0."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
    log = tmp_path / f"triage-{next(NUMBERS)}.log"
    with open(log, "wb") as out:
        worker = subprocess.run(triage_worker_command([
            "--server", site.server.url, "--token-file", str(site.dir / "triage.token"), "--queue", "triage",
            "--state-dir", str(tmp_path / "state"), "--name", "triage-worker", "--once", "--wait", "20",
            "--llm-url", f"{site.model.url}/v1", "--llm-model", MODEL]), stdout=out, stderr=subprocess.STDOUT,
            cwd=ROOT, env=environment, timeout=60)
    text = log.read_text(errors="replace")
    assert worker.returncode == 0, text
    assert "Traceback" not in text and TOKEN not in text
    return text


def label_posts(forge: FakeForge) -> list[dict]:
    return [r for r in forge.requests if r["method"] == "POST" and r["path"].endswith("/labels")]


def lane_todos(site: Site, number: int) -> list[dict]:
    key = f"github:{REPO}#{number}"
    return [t for t in site.call("GET", "/todos?limit=200")["todos"]
            if t["subject_key"] == key and t["queue"] != "triage"]


def test_the_server_adds_the_label_once_on_the_work_orders_issue_and_the_worker_holds_no_token(site, github, hook,
                                                                                             tmp_path):
    connect(site, github, hook)
    number = next(NUMBERS)
    github.issue(REPO, number + 1, title="Another issue", author="Codertocat")  # on the forge, never named
    todo_id = open_issue(site, github, number)

    logged = run_triage_once(site, tmp_path)
    assert f"{REPO}#{number} sized S; asking the server to label it size/S" in logged

    todo = site.todo(todo_id)
    assert todo["state"] == "done"
    assert todo["result"] == {"size": "S", "reason": "a one-word fix in the README", "label": "size/S",
                              "model": MODEL, "labelled": True}
    assert todo["attempts"][0]["summary"] == "sized S: labelled size/S"
    # The label's own event, sent by the connection's login, routes the issue on: nobody named the bot.
    [lane] = eventually(lambda: lane_todos(site, number), 20, "the lane todo")
    assert lane["queue"] == "lane-s"
    [output] = eventually(lambda: [o for o in site.todo(todo_id)["outputs"] if o["state"] == "sent"], 20,
                          "the output sent")
    assert (output["type"], output["labels"], output["target"]) == ("add_labels", ["size/S"], f"{REPO}#{number}")

    # Exactly one forge write, by the server with the connection's token, on the issue the work order names.
    assert github.labels(REPO, number) == ["size/S"] and github.labels(REPO, number + 1) == []
    [post] = label_posts(github)
    assert post["path"] == f"/repos/{REPO}/issues/{number}/labels" and post["json"] == {"labels": ["size/S"]}
    assert post["headers"]["authorization"] == f"Bearer {TOKEN}"
    assert post["headers"]["user-agent"].startswith("switchboard/")  # the server's sender, not the worker
    assert [(r["method"], r["path"]) for r in github.writes()] == [("POST", post["path"])]

    # Nothing the worker got or sent carries the token: not the todo as its endpoint reads it, nor its request to
    # the model. And once sent, the output is not sent again.
    as_worker = httpx.get(f"{site.server.url}/api/v1/todos/{todo_id}", timeout=10,
                          headers={"Authorization": f"Bearer {site.tokens['triage']}"})
    assert as_worker.status_code == 200 and TOKEN not in as_worker.text
    assert site.model.requests and all(TOKEN not in json.dumps(r) for r in site.model.requests)
    assert len(label_posts(github)) == 1


def test_without_a_connection_the_todo_fails_for_good_saying_how_to_connect_the_webhook(site, github, hook,
                                                                                         tmp_path):
    number = next(NUMBERS)
    todo_id = open_issue(site, github, number)

    logged = run_triage_once(site, tmp_path)
    todo = site.todo(todo_id)
    assert todo["state"] == "failed" and len(todo["attempts"]) == 1  # not retried: it would be refused again
    error = todo["last_error"]
    assert todo["attempts"][0]["summary"] == error
    assert error.startswith("the server refused the outputs: outputs[0]: the work order's webhook"
                            f" {hook['id']} has no forge connection")
    assert f"switchboard webhook connect {hook['id']} CONNECTION" in error
    assert "has no forge connection" in logged
    assert github.requests == []  # nothing reached the forge, from the worker or the server

    # Connected, and the dead letter retried: the same worker labels it, once.
    connect(site, github, hook)
    site.cli("todo", "retry", todo_id)
    run_triage_once(site, tmp_path)
    assert site.todo(todo_id)["state"] == "done"
    github.wait_for(lambda: github.labels(REPO, number) == ["size/S"], what="the label")
    eventually(lambda: lane_todos(site, number), 20, "the lane todo")
    assert len(label_posts(github)) == 1
