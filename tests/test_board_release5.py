"""What a person saw on the Board (issue 43, part 4), through Starlette's test client against the real app and, for
the layout, in a real Chromium against a real `switchboard.py serve`: a subject's story folds the server's own
comments (the forge sends each back, and the gate drops it) into one line that lists them; the queues page names
who works each queue and its table fits a 1366 px laptop; the todo list has each completion's summary; and a bulk
form offers only the actions its list's states allow, the fitting one first (none on a list of done work)."""

from __future__ import annotations

import html
import itertools
import re
import threading

import httpx
import producers
import pytest
from forges import REPO, FakeForge, Scene
from test_board_browser import Site, sign_in
from test_board_browser import browser as browser  # noqa: PLC0414 - the module's Chromium, shared as a fixture

from switchboard.app import create_app

ORIGIN = {"Origin": "http://testserver"}
TOKEN = "ghp_" + "Rel5T0ken0" * 4
BOT = "switchboard-bot"
LAPTOP = {"width": 1366, "height": 768}
EDITS = itertools.count(1)


@pytest.fixture
def app(db_path, clock):
    # A forge connection is made to tests/forges.py's server on a loopback address.
    return create_app(db_path, clock=clock, background=False, notify_allow_private=True)


@pytest.fixture
def github():
    forge = FakeForge("github", TOKEN, BOT)
    yield forge
    forge.stop()


def board_sign_in(client, human) -> None:
    answer = client.post("/board/login", data={"token": human.token}, headers=ORIGIN, follow_redirects=False)
    assert answer.status_code == 303, answer.text


def text(page: str) -> str:
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)))


def options(page: str, select_id: str) -> list[str]:
    """A select's option values, the selected one marked with a trailing `*`."""
    body = re.search(rf'<select id="{re.escape(select_id)}"[^>]*>(.*?)</select>', page, re.S).group(1)
    return [value + ("*" if selected else "") for value, selected in
            re.findall(r'<option value="([^"]*)"( selected)?>', body)]


def comment(scene: Scene, number: int, sender: str) -> dict:
    """A comment on the issue as the forge delivers it: the server's own (its connection's login) or someone's."""
    raw, headers = producers.github("issue_comment.created", "", {
        "action": "edited" if sender == BOT else "created", "issue": {"number": number},
        "repository": {"full_name": REPO}, "sender": {"login": sender},
        "comment": {"user": {"login": sender}, "body": f"status, edit {next(EDITS)}"}})
    return scene.deliver(raw, headers)


# -- a subject's story ---------------------------------------------------------------------------------------------

def test_the_servers_own_comments_fold_into_one_line_of_the_story_and_nothing_else_does(world, alice, github,
                                                                                       clock):
    scene = Scene(world, alice, github)
    todo_id = scene.open_issue(7)
    clock.ms += 1000
    echoes = [comment(scene, 7, BOT)["event_id"]]
    clock.ms += 1000
    lease = scene.claim(todo_id, claimant="qwen@gpu01")
    clock.ms += 1000
    echoes.append(comment(scene, 7, BOT)["event_id"])
    clock.ms += 1000
    someone = comment(scene, 7, "Codertocat")
    clock.ms += 1000
    assert scene.act(todo_id, "complete", lease_token=lease, summary="fixed the spelling").status_code == 200
    clock.ms += 1000
    echoes.append(comment(scene, 7, BOT)["event_id"])
    timeline = scene.call("GET", f"/subjects/github:{REPO}%237").json()["timeline"]
    assert sum(e.get("stage") == "own_output" for e in timeline) == 3, "REST's story keeps every delivery"

    board_sign_in(world.client, alice)
    page = world.client.get(f"/board/subjects/github:{REPO}%237").text
    story = re.search(r'<ol class="timeline story">(.*?)</ol>\s*</section>', page, re.S).group(1)
    lines = re.findall(r"<li class=\"tl-[a-z_]+\">.*?(?=<li class=\"tl-|\Z)", story, re.S)
    folded = [line for line in lines if line.startswith('<li class="tl-own_output">')]
    assert len(folded) == 1, "one line for the server's own comments"
    assert "3 deliveries of the server's own comments and their edits, ignored" in text(folded[0])
    assert [re.findall(r"/board/deliveries/(ev_\w+)", folded[0])] == [echoes], "each listed, oldest first"
    assert "own output" not in text(story)
    # Every other event keeps its own line, in order: the opening, the comment by someone else, the transitions.
    kinds = [re.search(r'class="tl-([a-z_]+)"', line).group(1) for line in lines]
    assert kinds == ["delivery", "transition", "transition", "delivery", "transition", "own_output"], kinds
    assert f"/board/deliveries/{someone['event_id']}" in lines[3] and "Codertocat" in lines[3]


def test_a_single_echo_is_said_plainly_and_a_story_without_any_is_untouched(world, alice, github):
    scene = Scene(world, alice, github)
    scene.open_issue(8)
    board_sign_in(world.client, alice)
    before = world.client.get(f"/board/subjects/github:{REPO}%238").text
    assert "tl-own_output" not in before
    comment(scene, 8, BOT)
    page = text(world.client.get(f"/board/subjects/github:{REPO}%238").text)
    assert "A delivery of the server's own comment, ignored" in page and "own output" not in page


# -- the todo list and the bulk forms ---------------------------------------------------------------------------

def finish(world, human, endpoint, title: str, summary: str | None, queue: str = "inbox") -> str:
    todo = world.push(human, endpoint, queue, title)
    lease = world.claim(endpoint, queue=queue)["lease_token"]
    body = {"lease_token": lease, **({"summary": summary} if summary is not None else {})}
    assert world.act(endpoint, todo["id"], "complete", **body).status_code == 200
    return todo["id"]


def test_the_done_list_has_each_completions_summary_cut_to_one_line(world, alice):
    worker = world.endpoint(alice, ["inbox"], verbs=["all"])
    long = ("Re-pointed the fourteen dashboards to the new Prometheus data source after the upgrade changed its UID;"
            " every panel renders again, and the alert rules were left as they were.\nNothing else changed.")
    finish(world, alice, worker, "Fix the dashboards", long)
    finish(world, alice, worker, "Prune old snapshots", "Pruned 212 snapshots older than 90 days (41 GiB freed).")
    finish(world, alice, worker, "Quiet job", None)
    board_sign_in(world.client, alice)
    page = world.client.get("/board/todos?state=done").text
    assert '<th scope="col" class="summary">Summary</th>' in page
    rows = {text(re.search(r'<a href="/board/todos/td_\w+">([^<]+)</a>', row).group(1)): row
            for row in re.findall(r"<tr>.*?</tr>", page.split("<tbody>")[1], re.S)}
    summaries = {title: re.search(r'<td data-label="Summary"[^>]*>(.*?)</td>', row, re.S).group(1)
                 for title, row in rows.items()}
    assert text(summaries["Prune old snapshots"]).strip() == "Pruned 212 snapshots older than 90 days (41 GiB freed)."
    cell = summaries["Fix the dashboards"]
    shown = text(cell).strip()
    assert shown.endswith("…") and len(shown) <= 140 and shown.startswith("Re-pointed the fourteen dashboards")
    assert long.startswith(shown[:-1]) and long[len(shown) - 1] == " ", "cut between words"
    assert f'title="{html.escape(" ".join(long.split()), quote=True)}"' in cell, "the whole summary on hover"
    assert text(summaries["Quiet job"]).strip() == "—"


def test_a_bulk_form_offers_only_what_its_lists_states_allow_the_fitting_action_first(world, alice):
    worker = world.endpoint(alice, ["inbox"], verbs=["all"])
    finish(world, alice, worker, "Finished work", "done")
    failed = world.push(alice, worker, "inbox", "Broken job")
    lease = world.claim(worker, queue="inbox")["lease_token"]
    assert world.act(worker, failed["id"], "fail", lease_token=lease, error="boom", retry=False).status_code == 200
    world.push(alice, worker, "inbox", "Waiting job")
    board_sign_in(world.client, alice)

    done = world.client.get("/board/todos?state=done").text
    assert 'id="bulk-list"' not in done and 'class="pick"' not in done, "no action applies to done work"
    assert "No bulk action applies: done and cancelled work is finished." in text(done)
    assert options(world.client.get("/board/todos?state=failed").text, "bulk-list-a") == [
        "retry*", "cancel", "reroute"]
    assert options(world.client.get("/board/todos?state=pending").text, "bulk-list-a") == [
        "cancel*", "reroute", "defer"]
    assert options(world.client.get("/board/todos?state=done&state=failed").text, "bulk-list-a")[0] == "retry*"
    everything = world.client.get("/board/todos").text
    assert options(everything, "bulk-list-a") == ["retry*", "approve", "discard", "cancel", "reroute", "defer"]
    assert everything.count('class="pick"') == 3
    inbox = world.client.get("/board").text
    assert options(inbox, "bulk-dead-a") == ["retry*", "cancel", "reroute"]
    dead = re.search(r'<form [^>]*id="bulk-dead".*?</form>', inbox, re.S).group(0)
    assert 'name="queue"' in dead and 'name="until"' not in dead, "a deferral's time only where defer is offered"


# -- the queues page: who works each queue ------------------------------------------------------------------------

def test_each_queue_names_who_holds_its_work_and_who_finished_some_lately(world, alice, clock):
    worker = world.endpoint(alice, ["lane-s", "lane-m", "lane-l", "lane-xl"], name="gpu01", verbs=["all"])
    old = world.push(alice, worker, "lane-l", "long ago")
    lease = world.claim(worker, queue="lane-l", claimant="retired-bot")["lease_token"]
    assert world.act(worker, old["id"], "complete", lease_token=lease).status_code == 200
    clock.ms += 16 * 60_000  # past the 15 minutes a finished claimant is named for
    for queue in ("lane-s", "lane-m", "lane-m"):
        world.push(alice, worker, queue, f"work on {queue}")
    world.claim(worker, queue="lane-m", claimant="qwen-coder@gpu01")
    world.claim(worker, queue="lane-m", claimant="qwen-coder@gpu01")
    recent = world.push(alice, worker, "lane-l", "just now")
    lease = world.claim(worker, queue="lane-l", claimant="claude@laptop")["lease_token"]
    assert world.act(worker, recent["id"], "complete", lease_token=lease).status_code == 200
    board_sign_in(world.client, alice)
    page = world.client.get("/board/queues").text
    section = re.search(r'<section class="card endpoint".*?</section>', page, re.S).group(0)
    counts = re.search(r'<table class="counts.*?</table>', section, re.S).group(0)
    assert '<th scope="col" class="workers">Workers</th>' in counts
    workers = {row_queue: text(cell).strip() for row_queue, cell in re.findall(
        r'<th scope="row">([^<]+)</th><td class="workers">(.*?)</td>', counts, re.S)}
    assert workers["lane-m"] == "qwen-coder@gpu01 working 2 jobs"
    assert re.fullmatch(r"claude@laptop, seen \d+ s ago", workers["lane-l"]), workers["lane-l"]
    assert workers["lane-s"] == workers["lane-xl"] == "none", "a queue without work has its line too"
    assert sorted(workers) == ["lane-l", "lane-m", "lane-s", "lane-xl"]


# -- the queues page at a laptop's width, in Chromium ----------------------------------------------------------------

@pytest.fixture(scope="module")
def site(tmp_path_factory, browser):
    made = Site(str(tmp_path_factory.mktemp("board") / "switchboard.db"))
    yield made
    made.close()


def test_at_1366_px_the_queues_tables_fit_their_boxes_and_name_the_workers(browser, site):
    """Issue 43: the counts table overflowed its box on a 1366 px laptop, and named no worker."""
    worker = site.endpoint(site.alice, "gpu01", ["lane-s", "lane-m", "lane-l"])
    for queue in ("lane-s", "lane-m", "lane-m"):
        site.push(site.alice, worker, f"Rotate the keys on {queue}", queue=queue)
    working = site.http.post("/api/v1/todos/claim", headers=worker.auth, json={
        "queue": "lane-m", "claimant": "qwen2.5-coder-32b@gpu01.lab.example"})
    assert working.status_code == 200 and working.json()["todo"], working.text
    waited: list[httpx.Response] = []

    def wait_for_work() -> None:  # a worker between jobs: a waiting claim, which carries no name to the doorbell
        with httpx.Client(base_url=site.url, timeout=30) as client:
            waited.append(client.post("/api/v1/todos/claim", headers=worker.auth, json={
                "queue": "lane-l", "wait_seconds": 20, "claimant": "claude@laptop"}))

    waiting = threading.Thread(target=wait_for_work)
    waiting.start()
    context = browser.new_context(viewport=LAPTOP, base_url=site.url)
    try:
        laptop = context.new_page()
        sign_in(laptop, site.alice)
        laptop.goto("/board/queues")
        gpu_box = laptop.locator("section.endpoint").filter(has=laptop.locator("h2", has_text=re.compile("^gpu01 ")))
        row = gpu_box.locator("table.counts tr").filter(has_text="lane-l")
        for _ in range(50):  # the waiting claim is a session once the server took it
            if "1 waiting claim" in row.inner_text():
                break
            laptop.wait_for_timeout(100)
            laptop.reload()
        wraps = laptop.locator(".table-wrap").evaluate_all(
            "boxes => boxes.map(b => [b.querySelector('table').className, b.scrollWidth, b.clientWidth])")
        assert wraps and all(scroll <= width for _, scroll, width in wraps), wraps
        assert laptop.evaluate("document.documentElement.scrollWidth") <= LAPTOP["width"]
        counts = gpu_box.locator("table.counts")
        assert "1 waiting claim" in counts.locator("tr").filter(has_text="lane-l").inner_text()
        assert "qwen2.5-coder-32b@gpu01.lab.example working 1 job" in " ".join(
            counts.locator("tr").filter(has_text="lane-m").inner_text().split())
    finally:
        context.close()
        site.push(site.alice, worker, "Work for the waiting claim", queue="lane-l")
        waiting.join(30)
    assert waited and waited[0].status_code == 200 and waited[0].json()["todo"]["title"] == "Work for the waiting claim"
