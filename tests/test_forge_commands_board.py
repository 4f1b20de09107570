"""What a person sees on the Board of the forge steering the work (issue 44, SPEC 17).

In a real Chromium against a real `switchboard.py serve`, the seed's loop runs on a GitHub of ours
(tests/forges.py): an issue whose body holds a work item gated on review → triage sizes it → lane-s → the worker
asks → a commander answers with an `/answer` comment → the work completes into review → the commander's pull
request "Fixes #N" is opened and merged by the commander. The issue's subject page then tells it, in order: the
pull request that closes it in the header, and in the story the command, the answer on the forge with a link to
the comment, the link to the pull request, and the approval through the merge; the pull request's page says
which issue it closes.

Through Starlette's test client: the webhook page's Forge connection card shows the commanders and what closing
the issue does, and its form sets them; a login that is none is refused and changes nothing."""

from __future__ import annotations

import datetime
import html
import re
import time

import pytest
from conftest import World
from forges import REPO, FakeForge, Scene
from test_board_browser import DESKTOP, Site, sign_in
from test_board_browser import browser as browser  # noqa: PLC0414 - the module's Chromium, shared as a fixture
from test_board_release5 import ORIGIN, board_sign_in
from test_forge_commands import BOT, COMMANDER, TOKEN, commanded, comment, pull_request, reactions, subject, to_lane

from switchboard.app import create_app
from switchboard.board.forge_pages import subject_path

ISSUE, PULL = 12, 13


@pytest.fixture
def github():
    made = FakeForge("github", TOKEN, BOT)
    yield made
    made.stop()


@pytest.fixture
def site(db_path, browser):
    made = Site(db_path)
    yield made
    made.close()


def past(at: str) -> None:
    """Wait until the clock (the server's: the same machine's) has left the millisecond `at` (ISO-8601)."""
    until = datetime.datetime.fromisoformat(at).timestamp() + 0.001
    while time.time() < until:
        time.sleep(0.001)


def story_lines(page) -> list[str]:
    """The story's entries as a person reads them, oldest first, each on one line."""
    return [" ".join(line.split()) for line in page.locator("ol.story > li").all_inner_texts()]


def first(lines: list[str], *words: str) -> int:
    """The position of the first story entry that says all of `words`."""
    found = [n for n, line in enumerate(lines) if all(word in line for word in words)]
    assert found, f"no entry of the story says {words}: {lines}"
    return found[0]


def test_the_issues_page_tells_the_loop_steered_from_the_forge_in_order(browser, site, github):
    scene = commanded(World(site.http, None), site.alice, github, mirror=False)
    lane = to_lane(scene, ISSUE)
    lease = scene.claim(lane)
    assert scene.act(lane, "needs-input", lease_token=lease, question="Which README?").status_code == 200
    answered, comment_id = comment(scene, ISSUE, COMMANDER, "/answer the top-level one")
    assert answered["command"]["result"] == "acted", answered
    comment_url = f"{github.url}/{REPO}/issues/{ISSUE}#issuecomment-{comment_id}"
    github.wait_for(lambda: reactions(github, ISSUE, comment_id) == ["+1"], what="the +1 on the command")
    lease = scene.claim(lane)
    assert scene.act(lane, "complete", lease_token=lease, summary="fixed in PR 13").json()["state"] == "review"
    pull_request(scene, PULL, "opened", author=COMMANDER, sender=COMMANDER, body="Fixes #12")
    [link] = subject(scene, ISSUE)["links"]
    past(link["at"])  # the story sorts by the millisecond: the merge's approval must not share the link's
    pull_request(scene, PULL, "closed", author=COMMANDER, sender=COMMANDER, body="Fixes #12", merged_by=COMMANDER)
    assert (scene.todo(lane)["state"], scene.todo(lane)["outcome"]) == ("done", "approved")
    issue_key, pull_key = f"github:{REPO}#{ISSUE}", f"github:{REPO}#{PULL}"

    context = browser.new_context(viewport=DESKTOP, base_url=site.url)
    try:
        page = context.new_page()
        page.set_default_timeout(10_000)
        sign_in(page, site.alice)
        page.goto(subject_path(issue_key))
        header = page.locator("header.todo-head p.links")
        assert " ".join(header.inner_text().split()) == f"Closed by {pull_key}"
        assert header.locator("a").get_attribute("href") == subject_path(pull_key)

        lines = story_lines(page)
        command = first(lines, f"command /answer by {COMMANDER}: acted on {lane}")
        answer = first(lines, "lane-s: needs input → pending", f"on the forge by {COMMANDER} (comment)",
                       "answer: the top-level one")
        linked = first(lines, f"closed by {pull_key}")
        merged = first(lines, "lane-s: review → done (approved)", f"on the forge by {COMMANDER} (merged {pull_key})")
        assert command < answer < linked < merged, lines
        story = page.locator("ol.story > li")
        assert story.nth(answer).get_by_role("link", name="comment").get_attribute("href") == comment_url
        assert story.nth(command).locator(f'a[href="/board/todos/{lane}"]').count() == 1
        assert story.nth(linked).get_by_role("link", name=pull_key).get_attribute("href") == subject_path(pull_key)
        assert story.nth(merged).get_by_role("link", name=pull_key).get_attribute("href") == subject_path(pull_key)
        assert "note:" not in lines[merged], "the merge is said once"

        page.goto(subject_path(pull_key))
        header = page.locator("header.todo-head p.links")
        assert " ".join(header.inner_text().split()) == f"Closes {issue_key}"
        assert header.locator("a").get_attribute("href") == subject_path(issue_key)
        assert TOKEN not in page.content()
    finally:
        context.close()


# -- the Forge connection card ----------------------------------------------------------------------------------

@pytest.fixture
def app(db_path, clock):
    # The connection is made to tests/forges.py's server, on a loopback address.
    return create_app(db_path, clock=clock, background=False, notify_allow_private=True)


def said(page: str) -> str:
    """A page's words as a person reads them: its tags gone, its white space one space."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", page)).split())


def csrf(page: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', page).group(1)


def forge_card(page: str) -> str:
    return re.search(r'<section class="card" id="forge".*?</section>', page, re.S).group(0)


def commanders(card: str) -> str:
    """What the card says of the commanders."""
    return said(re.search(r"<dt>Commanders</dt><dd>(.*?)</dd>", card, re.S).group(1))


def test_the_connection_card_shows_and_sets_the_commanders_and_what_closing_does(world, alice, github):
    scene = Scene(world, alice, github)
    client, hook = world.client, scene.hook
    board_sign_in(client, alice)
    page = client.get(f"/board/webhooks/{hook['id']}").text
    card = forge_card(page)
    assert commanders(card) == "nobody: comments on the forge are ordinary comments"
    assert re.search(r'<input id="fc-commanders" name="commanders"[^>]* value="">', card), card
    assert '<option value="cancel">cancel its open todos</option><option value="keep">' in card

    saved = client.post(f"/board/webhooks/{hook['id']}/connection", headers=ORIGIN, follow_redirects=False, data={
        "csrf": csrf(page), "connection_id": scene.connection["id"], "mirror": "on",
        "commanders": " alice-gh, bob-gh ", "on_close": "keep"})
    assert saved.status_code == 303, saved.text
    shown = client.get(f"/api/v1/webhooks/{hook['id']}/connection", headers=alice.auth).json()
    assert shown["commands"] == {"logins": ["alice-gh", "bob-gh"], "on_close": "keep"}, shown
    card = forge_card(client.get(f"/board/webhooks/{hook['id']}").text)
    assert commanders(card) == ("alice-gh, bob-gh: their /answer, /approve, /changes, /retry, /resume, /cancel, /defer"
                                " and /undefer comments, merges and reviews steer this webhook's todos; closing an"
                                " issue keeps its todos")
    assert 'value="alice-gh, bob-gh"' in card and '<option value="keep" selected>' in card

    refused = client.post(f"/board/webhooks/{hook['id']}/connection", headers=ORIGIN, follow_redirects=False, data={
        "csrf": csrf(page), "connection_id": scene.connection["id"], "mirror": "on",
        "commanders": "alice-gh, no spaces", "on_close": "cancel"})
    assert refused.status_code == 400, refused.text
    assert ("Not accepted commanders: “no spaces” is not a forge login (letters, digits, '-', '.' and '_', at most"
            " 100; commas between logins) Nothing was changed." in said(refused.text)), said(refused.text)
    assert client.get(f"/api/v1/webhooks/{hook['id']}/connection", headers=alice.auth).json() == shown
