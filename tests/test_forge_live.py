"""The seed's loop end to end on real processes (issue 36's proof): one `serve`, the fleet pack on a GitHub and a
Gitea router webhook that write through forge connections, a GitHub and a Gitea of our own (tests/forges.py) that
send signed deliveries back to the server as the forges do, the triage step reported over REST with an `add_labels`
output (no forge token anywhere but the server), and a real `switchboard worker --exec` on the lane. The story shows
on one subject page, through the API and in a real Chromium; the connections' tokens are in no answer, page or log
line. The fleet pack's params name no bot: the label event routes because the connection's login sent it."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import urllib.parse
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, LiveServer, cli
from forges import FakeForge
from helpers import hook_path
from test_board_browser import LAUNCH_ARGS, _no_browser

GITHUB_TOKEN = "ghp_" + "L1veG1tHub" * 4
GITEA_TOKEN = "5ec7e7" * 6 + "abcd"
BOT = "lab-bot"
LANES = ["lane-s", "lane-m", "lane-l", "lane-vision", "triage"]
PARAMS = {"require_verified": True, "trusted_humans": ["Codertocat", "alice"], "trusted_agents": [],
          "repo_prefixes": ["acme/"]}
NUMBERS = itertools.count(300)
LANE_CHILD = [sys.executable, "-c", "import json, sys\n"
              "order = json.load(sys.stdin)['work_order']\n"
              "print(json.dumps({'outcome': 'complete', 'summary': 'fixed in ' + order['lane'],"
              " 'result': {'issue': order['subject']['repo'] + '#' + str(order['subject']['number'])}}))\n"]


def private_file(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text + "\n")
    return path


class Site:
    def __init__(self, directory: Path):
        self.dir = directory
        self.answers: list[str] = []
        db_path = str(directory / "switchboard.db")
        code, human = cli(db_path, "human", "add", "alice")
        assert code == 0, human
        self.human_token = human["token"]
        self.server = LiveServer(db_path, "--notify-allow", "127.0.0.1", "--ingest-rate", "0")
        self.http = httpx.Client(base_url=self.server.url, timeout=30,
                                 headers={"Authorization": f"Bearer {self.human_token}"})
        self.github = FakeForge("github", GITHUB_TOKEN, BOT)
        self.gitea = FakeForge("gitea", GITEA_TOKEN, BOT)
        router = self.call("POST", "/endpoints", name="router", queues=["hold"], verbs=["webhooks"])
        self.lanes: dict[str, dict] = {}
        for queue in LANES:
            self.lanes[queue] = self.call("POST", "/endpoints", name=queue, queues=[queue], verbs=["drain"])
        pack = json.loads((ROOT / "packs" / "fleet.json").read_text())
        for forge in (self.github, self.gitea):
            hook = self.call("POST", "/webhooks", provider=forge.kind, queue="hold", endpoint_id=router["id"],
                             trusted_actors={"logins": ["Codertocat", "alice"], "match": "sender"})
            for queue in LANES:
                self.call("POST", f"/webhooks/{hook['id']}/routes", endpoint_id=self.lanes[queue]["id"])
            self.call("PUT", f"/webhooks/{hook['id']}/rules", **pack, params=PARAMS)
            connection = self.call("POST", "/connections", kind=forge.kind, api_url=forge.api, token=forge.token,
                                   repos=["acme/"])
            self.call("PUT", f"/webhooks/{hook['id']}/connection", connection_id=connection["id"])
            forge.hook = (self.server.url + hook_path(hook["url"]), hook["secret"])

    def call(self, method: str, path: str, bearer: str | None = None, **body) -> dict:
        """A REST call as the human (or as `bearer`, an endpoint's token); every answer is kept."""
        headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
        answer = self.http.request(method, f"/api/v1{path}", json=body or None, headers=headers)
        assert answer.status_code in (200, 201), answer.text
        self.answers.append(answer.text)
        return answer.json()

    def open_issue(self, forge: FakeForge, number: int) -> dict:
        """An issue opened on the forge by a trusted human: its delivery's answer."""
        return self.next_delivery(forge, lambda: forge.open("acme/site", number), "the opened delivery")

    @staticmethod
    def next_delivery(forge: FakeForge, cause, what: str) -> dict:
        """Switchboard's answer to the next delivery the forge sends once `cause()` ran."""
        before = len(forge.sent)
        cause()
        return forge.wait_for(lambda: len(forge.sent) > before and forge.sent[before], what=what)

    def close(self) -> None:
        self.http.close()
        for forge in (self.github, self.gitea):
            forge.stop()
        self.server.stop()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    made = Site(tmp_path_factory.mktemp("forge-live"))
    try:
        yield made
    finally:
        made.close()


def triage_with_a_label(site: Site, todo_id: str, size: str) -> dict:
    """The triage step as a worker without a forge token reports it: claim, then complete with an add_labels
    output. The server adds the label."""
    token = site.lanes["triage"]["token"]
    claim = site.call("POST", f"/todos/{todo_id}/claim", bearer=token, claimant="triage-worker")
    return site.call("POST", f"/todos/{todo_id}/complete", bearer=token, lease_token=claim["lease_token"],
                     summary=f"sized {size}", result={"size": size},
                     outputs=[{"type": "add_labels", "labels": [f"size/{size}"]}])


def lane_worker(site: Site, queue: str, tmp_path: Path) -> subprocess.CompletedProcess:
    token_file = private_file(tmp_path / f"{queue}.token", site.lanes[queue]["token"])
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
    return subprocess.run([sys.executable, "-m", "switchboard.worker", "--server", site.server.url,
                           "--token-file", str(token_file), "--state-dir", str(tmp_path / "state"),
                           "--name", f"{queue}-worker", "--once", "--wait", "10", "--exec", "--", *LANE_CHILD],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=environment)


@pytest.mark.parametrize("kind", ["github", "gitea"])
def test_the_seeds_loop_from_opened_to_done_on_one_subject_page(site, tmp_path, kind):
    forge = site.github if kind == "github" else site.gitea
    number = next(NUMBERS)
    opened = site.open_issue(forge, number)
    assert opened["disposition"] == "routed" and [t["queue"] for t in opened["todos"]] == ["triage"]
    triage = opened["todos"][0]["id"]
    made: dict = {}
    # The server adds the label, once, on the issue the work order names; the forge's label event, sent by the
    # connection's login, routes to lane-s although the params trust no bot.
    labelled = site.next_delivery(forge, lambda: made.update(triage_with_a_label(site, triage, "S")), "the label event")
    assert made["state"] == "done" and made["outputs"][0]["type"] == "add_labels"
    assert forge.labels("acme/site", number) == ["size/S"]
    assert labelled["disposition"] == "routed" and [t["queue"] for t in labelled["todos"]] == ["lane-s"]
    posts = [r for r in forge.writes() if r["path"].endswith(f"/issues/{number}/labels")]
    assert len(posts) == 1 and posts[0]["json"] == {"labels": ["size/S"]}
    lane = labelled["todos"][0]["id"]
    worked = lane_worker(site, "lane-s", tmp_path)
    assert worked.returncode == 0, worked.stdout + worked.stderr

    key = f"{kind}:acme/site#{number}"
    subject = site.call("GET", f"/subjects/{urllib.parse.quote(key, safe='')}")
    assert (subject["state"], subject["labels"]) == ("done", ["size/S"])
    assert [(t["id"], t["queue"], t["state"]) for t in subject["todos"]] == [(triage, "triage", "done"),
                                                                            (lane, "lane-s", "done")]
    what = {"delivery": "kind", "output": "output_type", "transition": "queue"}
    steps = [(e["type"], e[what[e["type"]]], e.get("to") or e.get("state") or e.get("disposition"))
             for e in subject["timeline"]]
    assert steps == [("delivery", "issues", "routed"), ("transition", "triage", "pending"),
                     ("transition", "triage", "claimed"), ("transition", "triage", "done"),
                     ("output", "add_labels", "sent"), ("delivery", "issues", "routed"),
                     ("transition", "lane-s", "pending"), ("transition", "lane-s", "claimed"),
                     ("transition", "lane-s", "done")], steps
    labelled_delivery = subject["timeline"][5]
    assert labelled_delivery["sender"] == BOT and labelled_delivery["rule_id"] == "issue-size-s"
    assert site.call("GET", f"/todos/{lane}")["attempts"][0]["summary"] == "fixed in lane-s"


def test_the_board_shows_the_story_in_chromium_and_no_token_anywhere(site, tmp_path):
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        _no_browser("the playwright package is not installed (pip install -e '.[test]')")
    number = next(NUMBERS)
    opened = site.open_issue(site.github, number)
    labelled = site.next_delivery(site.github, lambda: triage_with_a_label(site, opened["todos"][0]["id"], "S"),
                                  "the label event")
    assert labelled["todos"][0]["queue"] == "lane-s"
    assert lane_worker(site, "lane-s", tmp_path).returncode == 0
    key = f"github:acme/site#{number}"
    with sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(
                executable_path="/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None, args=LAUNCH_ARGS)
        except Error as exc:
            _no_browser(f"no Chromium could be launched ({str(exc).splitlines()[0]})")
        page = browser.new_page()
        page.goto(f"{site.server.url}/board/login")
        page.fill("input[name=token]", site.human_token)
        page.click("button[type=submit]")
        page.goto(f"{site.server.url}/board/subjects")
        page.click(f"a[href='/board/subjects/{urllib.parse.quote(key)}']")
        story = page.locator("ol.story > li").all_inner_texts()
        assert len(story) == 9, story
        assert "issues.opened" in story[0] and "triage" in story[0]
        assert "add labels size/S" in story[4] and "sent" in story[4]
        assert "issues.labeled" in story[5] and BOT in story[5] and "lane-s" in story[8]
        assert page.locator(".labels .label").all_inner_texts() == ["size/S"]
        pages = [page.content()]
        for path in ("/board/connections", "/board/webhooks", "/board/subjects"):
            page.goto(f"{site.server.url}{path}")
            pages.append(page.content())
        browser.close()
    for token in (GITHUB_TOKEN, GITEA_TOKEN):
        assert not any(token in text for text in pages), "a page shows a token"
        assert not any(token in text for text in site.answers), "an answer carries a token"
        assert token not in site.server.logged(), "a log line carries a token"
