"""The Board in a real Chromium, against a real `switchboard.py serve`: a human signs in and does their half of
the loop (release a held delivery to a lane, approve a gated todo, answer a question, retry a dead letter, edit
rules with a dry run first), sees none of another human's work, cannot be driven by a form from elsewhere, and
producer text runs no script. The inbox updates live. One server and one browser serve the whole module.

Debian's /usr/bin/chromium is used when present, else a Playwright-managed Chromium. Without any browser the
module is skipped locally, and fails under CI (CI=true), so CI never skips it silently."""

from __future__ import annotations

import json
import os
import re
import threading
import uuid
from pathlib import Path

import httpx
import producers
import pytest
from conftest import ROOT, LiveServer, cli
from helpers import add_route, make_webhook, post_delivery

from switchboard.board.forge_pages import subject_path

CHROMIUM = "/usr/bin/chromium"
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run"]
DOCS = ROOT / "docs"
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}


def _no_browser(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"the Board's browser tests cannot run under CI: {why}")
    pytest.skip(f"{why}; Debian package `chromium`: apt-get install -y chromium")


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        _no_browser("the playwright package is not installed (pip install -e '.[test]')")
    with sync_playwright() as playwright:
        try:
            launched = playwright.chromium.launch(
                executable_path=CHROMIUM if Path(CHROMIUM).exists() else None, args=LAUNCH_ARGS)
        except Error as exc:
            _no_browser(f"no Chromium could be launched ({str(exc).splitlines()[0]})")
        yield launched
        launched.close()


class Principal:
    def __init__(self, token: str, id: str):
        self.token, self.id = token, id

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"}


class Site:
    """The live server, an HTTP client for it, and the principals the tests share."""

    def __init__(self, db_path: str):
        assert cli(db_path, "init")[0] == 0
        # (--notify-allow-private: the screenshots' forge connection is to tests/forges.py's server, on loopback.)
        self.server = LiveServer(db_path, "--ingest-rate", "0", "--notify-allow-private")
        self.url = self.server.url
        self.http = httpx.Client(base_url=self.url, timeout=30)
        self.alice = self.human("alice")
        self.router = self.endpoint(self.alice, "router", ["triage"])
        self.lane = self.endpoint(self.alice, "lane-s-worker", ["lane-s"])

    def human(self, name: str) -> Principal:
        code, made = cli(self.server.db_path, "human", "add", name)
        assert code == 0, made
        return Principal(made["token"], made["id"])

    def endpoint(self, human: Principal, name: str, queues: list[str]) -> Principal:
        made = self.http.post("/api/v1/endpoints", headers=human.auth, json={"name": name, "queues": queues,
                                                                             "verbs": ["all"]})
        assert made.status_code == 201, made.text
        return Principal(made.json()["token"], made.json()["id"])

    def todo(self, human: Principal, todo_id: str) -> dict:
        return self.http.get(f"/api/v1/todos/{todo_id}", headers=human.auth).json()

    def push(self, human: Principal, endpoint: Principal, title: str, **extra) -> dict:
        made = self.http.post(f"/api/v1/endpoints/{endpoint.id}/todos", headers=human.auth,
                              json={"title": title, "queue": "lane-s", **extra})
        assert made.status_code == 201, made.text
        return made.json()

    def claim(self, endpoint: Principal, todo_id: str) -> dict:
        """Claim by id (other tests' todos may be pending on the same queue)."""
        return self.claim_as(endpoint, todo_id, "w1")

    def claim_as(self, endpoint: Principal, todo_id: str, claimant: str) -> dict:
        claim = self.http.post(f"/api/v1/todos/{todo_id}/claim", headers=endpoint.auth, json={"claimant": claimant})
        assert claim.status_code == 200, claim.text
        return claim.json()

    def act(self, endpoint: Principal, todo_id: str, verb: str, **body) -> dict:
        answer = self.http.post(f"/api/v1/todos/{todo_id}/{verb}", headers=endpoint.auth, json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def cairn_hook(self, human: Principal | None = None, router: Principal | None = None,
                   lane: Principal | None = None, **extra) -> dict:
        """A cairn webhook owned by the router endpoint (queue triage), routed on to the lane worker."""
        human, router, lane = human or self.alice, router or self.router, lane or self.lane
        hook = make_webhook(self.http, human, router.id, "cairn", "triage", **extra)
        assert add_route(self.http, human.auth, hook["id"], lane.id).status_code == 201
        return hook

    def deliver_cairn(self, hook: dict, data: dict | None = None) -> dict:
        raw, headers = producers.cairn(hook["secret"], {"event_id": str(uuid.uuid4()), **({"data": data} if data else {})})
        outcome = post_delivery(self.http, hook, raw, headers)
        assert outcome.status_code == 202, outcome.text
        return outcome.json()

    def close(self) -> None:
        self.http.close()
        self.server.stop()


@pytest.fixture(scope="module")
def site(tmp_path_factory, browser):
    made = Site(str(tmp_path_factory.mktemp("board") / "switchboard.db"))
    yield made
    made.close()


@pytest.fixture
def page(browser, site):
    context = browser.new_context(viewport=DESKTOP, base_url=site.url)
    opened = context.new_page()
    opened.set_default_timeout(10_000)
    dialogs: list[str] = []
    opened.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    opened.dialogs = dialogs
    yield opened
    context.close()


def sign_in(page, human: Principal) -> None:
    page.goto("/board")
    assert "/board/login" in page.url
    page.get_by_label("Human token").fill(human.token)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url("**/board")


def item(page, todo_id: str):
    """The inbox card of one todo."""
    return page.locator("li.item").filter(has=page.locator(f'a[href="/board/todos/{todo_id}"]'))


def test_a_held_delivery_is_released_to_a_lane_whose_worker_then_claims_it(page, site):
    hook = site.cairn_hook(trusted_actors={"allow_all": True})
    rules = site.http.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=site.alice.auth, json={
        "rules": [{"id": "hold-all", "name": "hold everything", "expr": "true", "action": {"quarantine": True}}]})
    assert rules.status_code == 200, rules.text
    held = site.deliver_cairn(hook, {"title": "Prune snapshots on nas01"})["todos"][0]["id"]
    sign_in(page, site.alice)
    card = item(page, held)
    assert "rule hold everything" in card.inner_text() and "stage rule" in card.inner_text()
    card.get_by_label("Release to").select_option("lane-s")
    card.get_by_role("button", name="Release", exact=True).click()
    page.wait_for_url("**/board")
    assert "Released to lane-s: Prune snapshots on nas01" in page.locator(".notice").inner_text()
    claim = site.http.post("/api/v1/todos/claim", headers=site.lane.auth, json={"queue": "lane-s"}).json()
    assert claim["todo"]["id"] == held and claim["todo"]["work_order"] is None
    history = site.todo(site.alice, held)["history"]
    assert history[-2]["actor"] == f"human:{site.alice.id}" and history[-2]["to"] == "pending"


def test_a_gated_todo_is_approved(page, site):
    todo = site.push(site.alice, site.lane, "Ship the fix", work_item={
        "schema": "switchboard.work_item.v1", "objective": "o", "approval_gates": ["review"]})
    claim = site.claim(site.lane, todo["id"])
    site.act(site.lane, todo["id"], "complete", lease_token=claim["lease_token"], summary="patched and tested")
    sign_in(page, site.alice)
    card = item(page, todo["id"])
    assert "patched and tested" in card.inner_text()
    card.get_by_role("button", name="Approve").click()
    page.wait_for_url("**/board")
    done = site.todo(site.alice, todo["id"])
    assert done["state"] == "done" and done["outcome"] == "approved"
    assert done["history"][-1]["actor"] == f"human:{site.alice.id}"


def test_a_question_is_answered_and_the_worker_sees_the_answer(page, site):
    todo = site.push(site.alice, site.lane, "Clean the disk")
    claim = site.claim(site.lane, todo["id"])
    site.act(site.lane, todo["id"], "needs-input", lease_token=claim["lease_token"], question="Which disk, sda or sdb?")
    sign_in(page, site.alice)
    card = item(page, todo["id"])
    assert "Which disk, sda or sdb?" in card.inner_text()
    card.get_by_label("Your answer").fill("sdb, never sda")
    card.get_by_role("button", name="Answer").click()
    page.wait_for_url("**/board")
    again = site.claim(site.lane, todo["id"])
    assert again["todo"]["answer"] == "sdb, never sda"
    site.act(site.lane, todo["id"], "complete", lease_token=again["lease_token"], summary="done")


def test_a_dead_letter_is_retried(page, site):
    todo = site.push(site.alice, site.lane, "Flaky job")
    claim = site.claim(site.lane, todo["id"])
    site.act(site.lane, todo["id"], "fail", lease_token=claim["lease_token"], error="disk full", retry=False)
    sign_in(page, site.alice)
    page.goto(f"/board/todos/{todo['id']}")
    assert "disk full" in page.inner_text("main")
    page.get_by_role("button", name="Retry").click()
    page.wait_for_url(f"**/board/todos/{todo['id']}")
    assert page.locator(".notice").inner_text().startswith("Retrying")
    again = site.todo(site.alice, todo["id"])
    assert again["state"] == "pending" and again["attempt"] == 0 and not again["dead_letter"]


def test_a_rule_edit_is_dry_run_then_saved(page, site):
    hook = site.cairn_hook(trusted_actors={"allow_all": True})
    site.deliver_cairn(hook)
    sign_in(page, site.alice)
    page.goto(f"/board/webhooks/{hook['id']}")
    candidate = {"rules": [{"id": "handoffs", "name": "handoffs to lane-s",
                            "expr": '.artifact.tags | index("handoff") != null', "action": {"queue": "lane-s"}}],
                 "default_action": None, "params": {}}
    page.get_by_label("Rules, default action and params (JSON)").fill(json.dumps(candidate, indent=2))
    page.get_by_label("a stored delivery").check()
    page.get_by_role("button", name="Dry run").click()
    result = page.locator("#dry-result")
    assert "routed" in result.inner_text() and "lane-s" in result.inner_text() and "handoffs" in result.inner_text()
    assert site.http.get(f"/api/v1/webhooks/{hook['id']}/rules", headers=site.alice.auth).json()["rules"] == []
    broken = dict(candidate, rules=[dict(candidate["rules"][0], expr="input_filename")])
    page.get_by_label("Rules, default action and params (JSON)").fill(json.dumps(broken))
    page.get_by_role("button", name="Save rules").click()
    assert "rules[0] (id 'handoffs')" in page.locator("#rules-error").inner_text()
    page.get_by_label("Rules, default action and params (JSON)").fill(json.dumps(candidate))
    page.get_by_role("button", name="Save rules").click()
    page.wait_for_url(f"**/board/webhooks/{hook['id']}#rules")
    assert "Rules saved." in page.locator(".notice").inner_text()
    saved = site.http.get(f"/api/v1/webhooks/{hook['id']}/rules", headers=site.alice.auth).json()
    assert saved["rules"][0]["id"] == "handoffs"
    assert site.deliver_cairn(hook)["todos"][0]["queue"] == "lane-s"


def test_a_second_human_sees_none_of_the_first_ones_work(page, site):
    mine = site.push(site.alice, site.lane, "Alice's private errand")
    bob = site.human("bob")
    site.endpoint(bob, "bobs", ["lane-s"])
    sign_in(page, bob)
    for path in ("/board", "/board/queues", "/board/webhooks", "/board/endpoints"):
        page.goto(path)
        text = page.inner_text("body")
        assert "private errand" not in text and site.lane.id not in text and site.router.id not in text, path
    answer = page.goto(f"/board/todos/{mine['id']}")
    assert answer.status == 404 and "private errand" not in page.inner_text("body")


def test_forms_without_the_token_or_from_another_origin_are_refused_and_change_nothing(page, site):
    todo = site.push(site.alice, site.lane, "Keep me")
    sign_in(page, site.alice)
    target = f"{site.url}/board/todos/{todo['id']}/cancel"
    no_token = page.request.post(target, form={"reason": "forged"}, headers={"Origin": site.url})
    assert no_token.status == 403
    token = page.locator('input[name="csrf"]').first.get_attribute("value")
    elsewhere = page.request.post(target, form={"reason": "forged", "csrf": token},
                                  headers={"Origin": "http://evil.example"})
    assert elsewhere.status == 403
    # A page of another site that submits a form here: the Strict cookie stays home, and the form has no token.
    page.set_content(f'<form method="post" action="{target}"><input name="reason" value="forged"></form>')
    with page.expect_navigation():
        page.evaluate("document.forms[0].submit()")
    assert "Refused" in page.inner_text("body")
    kept = site.todo(site.alice, todo["id"])
    assert kept["state"] == "pending" and len(kept["history"]) == 1


def test_the_queues_page_shows_running_work_and_who_is_connected(page, site):
    todo = site.push(site.alice, site.lane, "Long build")
    claim = site.claim(site.lane, todo["id"])
    site.act(site.lane, todo["id"], "heartbeat", lease_token=claim["lease_token"], note="step 3 of 5")
    connected = threading.Event()

    def listen() -> None:  # a worker's doorbell stream, open until the server stops
        with httpx.Client(base_url=site.url, timeout=None) as client, client.stream(
                "GET", "/api/v1/doorbell", headers=site.lane.auth, params={"queue": "lane-s"}) as stream:
            for _ in stream.iter_lines():
                connected.set()

    threading.Thread(target=listen, daemon=True).start()
    assert connected.wait(10)
    hello = site.http.post("/mcp", headers={**site.lane.auth, "Accept": "application/json, text/event-stream"},
                           json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                               "protocolVersion": "2025-06-18", "capabilities": {},
                               "clientInfo": {"name": "board-test", "version": "1"}}})
    assert hello.status_code == 200, hello.text
    sign_in(page, site.alice)
    page.goto("/board/queues")
    lane = page.locator("section.endpoint").filter(has_text="lane-s-worker")
    text = lane.inner_text()
    assert "sse · queues lane-s · listening since" in text and "mcp, no stream open · last request" in text
    running = page.locator("table.list tr").filter(has_text="Long build").inner_text()
    assert "w1" in running and "step 3 of 5" in running
    site.act(site.lane, todo["id"], "complete", lease_token=claim["lease_token"], summary="built")


def test_producer_text_renders_as_text_and_runs_no_script(page, site):
    evil = "<img src=x onerror=alert(1)></script><script>alert(2)</script>"
    hook = site.cairn_hook(trusted_actors={"actor_ids": []})
    outcome = site.deliver_cairn(hook, {"title": evil, "share_type": evil, "tags": [evil]})
    held = outcome["todos"][0]["id"]
    sign_in(page, site.alice)
    for path in ("/board", f"/board/todos/{held}", f"/board/deliveries/{outcome['event_id']}",
                 f"/board/webhooks/{hook['id']}/deliveries"):
        page.goto(path)
        page.wait_for_load_state("load")
        assert page.locator("img").count() == 0, path
        assert page.locator("script:not([src])").count() == 0, path
        if path != f"/board/webhooks/{hook['id']}/deliveries":
            assert evil in page.inner_text("main"), path
    page.goto(f"/board/todos/{held}")
    page.wait_for_timeout(300)
    assert page.dialogs == []


def test_the_inbox_updates_live_without_a_reload(page, site):
    from playwright.sync_api import expect
    sign_in(page, site.alice)
    badge = page.locator('.groups [data-count="review"]')
    before = int(badge.inner_text())
    page.evaluate("window.__same_page = true")
    todo = site.push(site.alice, site.lane, "Arrives while watching", work_item={
        "schema": "switchboard.work_item.v1", "objective": "o", "approval_gates": ["review"]})
    claim = site.claim(site.lane, todo["id"])
    site.act(site.lane, todo["id"], "complete", lease_token=claim["lease_token"], summary="live")
    expect(badge).to_have_text(str(before + 1), timeout=8000)
    item(page, todo["id"]).wait_for(timeout=8000)
    assert page.evaluate("window.__same_page") is True, "updated in place, not reloaded"


def test_trusting_names_the_login_and_the_banner_says_what_the_rules_then_did(page, site):
    """Issue 25 (1, 2) and 26: the button names whom it trusts, the Release list offers the webhook's own queues
    with the rules deciding unless the human picks one, and after a trusted release that the rules drop, the
    actor is trusted all the same and the banner says so."""
    hook = make_webhook(site.http, site.alice, site.router.id, "github", "triage",
                        trusted_actors={"logins": ["alice"]})
    assert add_route(site.http, site.alice.auth, hook["id"], site.lane.id).status_code == 201
    # The trust gate runs after the rules and holds only what they would not drop: these drop trusted actors' work.
    rules = {"rules": [{"id": "drop-trusted", "expr": ".actor.trusted == true", "action": {"drop": True}}]}
    assert site.http.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=site.alice.auth, json=rules).status_code == 200
    raw, headers = producers.github("issues.opened", hook["secret"])
    held = post_delivery(site.http, hook, raw, headers).json()["todos"][0]["id"]
    sign_in(page, site.alice)
    card = item(page, held)
    release_to = card.get_by_label("Release to")
    assert release_to.input_value() == "" and release_to.locator("option:checked").inner_text().startswith(
        "the rules decide")
    assert release_to.locator("option").evaluate_all("options => options.map(o => o.value)") == [
        "", "lane-s", "triage"], "only the queues this webhook's targets take"
    card.get_by_role("button", name="Trust Codertocat and release").click()
    page.wait_for_url("**/board")
    assert page.locator(".notice").inner_text().startswith(
        "Trusted Codertocat; the rules dropped it: rule drop-trusted")
    trusted = site.http.get(f"/api/v1/webhooks/{hook['id']}", headers=site.alice.auth).json()["trusted_actors"]
    assert trusted["logins"] == ["alice", "Codertocat"]
    assert site.todo(site.alice, held)["state"] == "done"


def test_on_a_phone_the_queues_and_deliveries_tables_cut_nothing_off(browser, site):
    """Issue 25 (5) at 390 px: the page never scrolls sideways; the queues' counts scroll inside their box with
    the queue column staying in view, every column reachable; each delivery is a card with every field in view."""
    wide = site.endpoint(site.alice, "many-lanes", ["alpha-lane", "beta-lane", "gamma-lane"])
    hook = make_webhook(site.http, site.alice, wide.id, "github", "alpha-lane")
    for event in ("issues.opened", "pull_request.opened"):
        assert post_delivery(site.http, hook, *producers.github(event, hook["secret"])).status_code == 202
    context = browser.new_context(viewport=PHONE, base_url=site.url)
    phone = context.new_page()
    try:
        sign_in(phone, site.alice)
        phone.goto("/board/queues")
        assert phone.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
        box = phone.locator("section.endpoint").filter(has_text="many-lanes").locator(".table-wrap:has(table.counts)")
        assert box.evaluate("el => el.scrollWidth > el.clientWidth"), "10 columns do not fit 390 px: they scroll"
        box.evaluate("el => { el.scrollLeft = el.scrollWidth; }")
        edge = box.bounding_box()
        for cell in box.locator("tr > :first-child").all():
            shown = cell.bounding_box()
            assert shown["x"] >= edge["x"] - 1 and shown["width"] > 30, "the queue column stays in view"
            assert cell.inner_text() in ("QUEUE", "alpha-lane", "beta-lane", "gamma-lane")
        last = box.locator("thead th").last.bounding_box()
        assert last["x"] + last["width"] <= edge["x"] + edge["width"] + 1, "the last column can be reached"
        phone.goto(f"/board/webhooks/{hook['id']}/deliveries")
        assert phone.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
        rows = phone.locator("table.deliveries tbody tr")
        assert rows.count() == 2
        for row in rows.all():
            for cell in row.locator("th, td").all():
                shown = cell.bounding_box()
                assert shown is not None and shown["width"] > 0, cell.inner_text()
                assert shown["x"] >= 0 and shown["x"] + shown["width"] <= PHONE["width"], cell.inner_text()
        texts = "\n".join(rows.all_inner_texts())
        assert "pull_request.opened · Codertocat/Hello-World#2 · Update the README with new information." in texts
        assert "issues.opened · Codertocat/Hello-World#1 · Spelling error in the README file" in texts
    finally:
        context.close()


def _subject_story(site: Site, casey: Principal, router: Principal, forge) -> str:
    """An issue on a GitHub webhook that writes through a forge connection: opened, claimed, commented on, done,
    with the forge sending back the server's own status comment edits between. Its subject key."""
    hook = make_webhook(site.http, casey, router.id, "github", "triage", name="homelab/infra issues")
    assert site.http.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=casey.auth, json={
        "rules": [{"id": "new-issues", "name": "a new issue goes to triage", "expr": '.issue.action == "opened"',
                   "action": {"queue": "triage", "once": True}}], "default_action": {"drop": True}}).status_code == 200
    connection = site.http.post("/api/v1/connections", headers=casey.auth, json={
        "kind": "github", "api_url": forge.api, "token": forge.token, "repos": ["homelab/"]})
    assert connection.status_code == 201, connection.text
    assert site.http.put(f"/api/v1/webhooks/{hook['id']}/connection", headers=casey.auth,
                         json={"connection_id": connection.json()["id"]}).status_code == 200
    edits = iter(range(1, 100))

    def deliver(event: str, sender: str, **patch) -> dict:
        raw, headers = producers.github(event, hook["secret"], {
            "issue": {"number": 12, "title": "Loki drops every log line from the edge router",
                      "html_url": "https://github.com/homelab/infra/issues/12", "user": {"login": "casey-dev"},
                      "labels": [{"name": "bug"}, {"name": "size/S"}]},
            "repository": {"full_name": "homelab/infra", "name": "infra", "owner": {"login": "homelab"}},
            "sender": {"login": sender}, **patch})
        answer = post_delivery(site.http, hook, raw, headers)
        assert answer.status_code == 202, answer.text
        return answer.json()

    def status_edit() -> None:  # what GitHub sends when the server edits its status comment
        deliver("issue_comment.created", forge.login, action="edited",
                comment={"user": {"login": forge.login}, "body": f"Switchboard status, edit {next(edits)}"})

    todo_id = deliver("issues.opened", "casey-dev")["todos"][0]["id"]
    status_edit()
    lease = site.claim_as(router, todo_id, "qwen2.5-coder@gpu01")["lease_token"]
    status_edit()
    deliver("issue_comment.created", "casey-dev", comment={
        "user": {"login": "casey-dev"}, "body": "The switches' logs arrive fine; only the router's are missing."})
    site.act(router, todo_id, "heartbeat", lease_token=lease, note="Promtail rejects the router's syslog lines")
    site.act(router, todo_id, "complete", lease_token=lease, summary="The router sends RFC 3164 syslog, which"
             " Promtail's RFC 5424 listener rejected; added an rfc3164 listener on 1514 and pointed the router at it."
             " Its logs reach Loki again.")
    status_edit()
    return "github:homelab/infra#12"


def _queues_at_work(site: Site, casey: Principal) -> tuple[Principal, threading.Thread]:
    """A GPU box's endpoint with three queues: work pending, a job running, one finished, and a worker between
    jobs waiting on a claim (the thread ends when work comes for it)."""
    gpu = site.endpoint(casey, "gpu01", ["lane-s", "lane-m", "lane-l"])
    for title, queue in (("Rotate the restic keys on nas01", "lane-s"), ("Prune docker images on build01", "lane-m"),
                         ("Bump Home Assistant to 2026.12", "lane-m"), ("Summarise last night's backup logs", "lane-l")):
        site.push(casey, gpu, title, queue=queue)
    running = site.http.post("/api/v1/todos/claim", headers=gpu.auth, json={"queue": "lane-m",
                                                                          "claimant": "qwen2.5-coder@gpu01"}).json()
    site.act(gpu, running["todo"]["id"], "heartbeat", lease_token=running["lease_token"], note="3 of 7 images pruned")
    finished = site.http.post("/api/v1/todos/claim", headers=gpu.auth, json={"queue": "lane-l",
                                                                           "claimant": "claude@laptop"}).json()
    site.act(gpu, finished["todo"]["id"], "complete", lease_token=finished["lease_token"],
             summary="3 of 4 jobs fine; nas02 skipped: its disk is full.")
    waiting = threading.Thread(target=lambda: httpx.post(f"{site.url}/api/v1/todos/claim", headers=gpu.auth, json={
        "queue": "lane-l", "wait_seconds": 30, "claimant": "claude@laptop"}, timeout=40))
    waiting.start()
    return gpu, waiting


def test_screenshots_of_the_boards_pages(browser, site, tmp_path):
    """docs/board-*.png, desktop (1280 wide) and phone (390 wide), for people to look at: a human of their own
    with one of each kind of waiting work, an issue's story, and workers on their queues. Taken into a temporary
    directory, so that a test run leaves the clone as it was; SWITCHBOARD_UPDATE_SCREENSHOTS=1 writes them to
    docs/."""
    from forges import FakeForge
    shots = DOCS if os.environ.get("SWITCHBOARD_UPDATE_SCREENSHOTS") == "1" else tmp_path
    casey = site.human("casey")
    router, lane = site.endpoint(casey, "router", ["triage"]), site.endpoint(casey, "lane-s", ["lane-s"])
    hook = site.cairn_hook(casey, router, lane, trusted_actors={"actor_ids": []})
    site.deliver_cairn(hook, {"title": "Handoff: rotate the backup keys on nas01", "actor_id": "night-agent"})
    todo = site.push(casey, lane, "Upgrade Grafana to 12.x on mon01", payload={
        "host": "mon01", "from": "11.4.2", "to": "12.0.1", "notes": ["back up dashboards first", "then restart"]},
        work_item={"schema": "switchboard.work_item.v1", "objective": "Upgrade Grafana on mon01 without losing"
                   " dashboards", "definition_of_done": ["12.0.1 running", "all dashboards load"],
                   "approval_gates": ["review"]})
    claim = site.claim(lane, todo["id"])
    site.act(lane, todo["id"], "heartbeat", lease_token=claim["lease_token"], note="dashboards exported")
    site.act(lane, todo["id"], "complete", lease_token=claim["lease_token"],
             summary="Upgraded to 12.0.1; 14 dashboards re-imported, alerts green.")
    asks = site.push(casey, lane, "Free space on the backup volume")
    claim = site.claim(lane, asks["id"])
    site.act(lane, asks["id"], "needs-input", lease_token=claim["lease_token"],
             question="Delete snapshots older than 90 days, or only those older than 180?")
    dead = site.push(casey, lane, "Renew the TLS certificate for git.lab")
    claim = site.claim(lane, dead["id"])
    site.act(lane, dead["id"], "fail", lease_token=claim["lease_token"], retry=False,
             error="ACME challenge failed: DNS record _acme-challenge.git.lab not found")
    rules = {"rules": [
        {"id": "xl-hold", "name": "extra-large work waits for a human",
         "expr": '.artifact.tags | index("size:xl") != null', "action": {"quarantine": True}},
        {"id": "handoffs", "name": "handoffs go to lane-s", "expr": '.artifact.tags | index("handoff") != null',
         "action": {"queue": "lane-s", "once": True, "work_order": True}}],
        "default_action": {"queue": "triage"}}
    assert site.http.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=casey.auth, json=rules).status_code == 200
    forge = FakeForge("github", "ghp_" + "Scr33nsh0t" * 4, "switchboard-bot")
    try:
        subject = _subject_story(site, casey, router, forge)
    finally:
        forge.stop()
    gpu, waiting = _queues_at_work(site, casey)
    try:
        shots.mkdir(exist_ok=True)
        for name, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
            context = browser.new_context(viewport=viewport, base_url=site.url, device_scale_factor=1)
            shot = context.new_page()
            sign_in(shot, casey)
            shot.screenshot(path=str(shots / f"board-inbox-{name}.png"), full_page=True)
            shot.goto(f"/board/todos/{todo['id']}")
            shot.screenshot(path=str(shots / f"board-todo-{name}.png"), full_page=True)
            shot.goto(f"/board/webhooks/{hook['id']}")
            shot.get_by_role("button", name="Dry run").click()
            shot.locator("#dry-result").wait_for()
            shot.locator("#rules").screenshot(path=str(shots / f"board-rules-{name}.png"))
            shot.goto(subject_path(subject))
            shot.locator("details.echoes summary").click()
            shot.screenshot(path=str(shots / f"board-subject-{name}.png"), full_page=True)
            shot.goto("/board/queues")
            gpu_box = shot.locator("section.endpoint").filter(has=shot.locator("h2", has_text=re.compile("^gpu01 ")))
            gpu_box.locator("tr").filter(has_text="1 waiting claim").wait_for()
            gpu_box.screenshot(path=str(shots / f"board-queues-{name}.png"))
            context.close()
    finally:
        site.push(casey, gpu, "Check the UPS battery", queue="lane-l")  # the waiting claim's work: it ends
        waiting.join(40)
    for name in ("inbox", "todo", "rules", "subject", "queues"):
        for size in ("desktop", "phone"):
            assert (shots / f"board-{name}-{size}.png").stat().st_size > 5_000
