"""What the Board said that was not so (issue 35 item 20), through Starlette's test client against the real app: a
done todo showed a stale `Last error` and "Attempts 2 of 5" while its timeline showed 3 claims; held cards in the
hold lane did not say why they were held; every page asked for a /favicon.ico that is not there; and the
installed command's help said `usage: switchboard.py`. (The queues page that said "No worker session is
connected" while a worker ran a job is tests/test_board.py's test_queues_show_counts_running_work…; the icon
in a real Chromium is tests/test_proxy_sign_in.py's.)"""

from __future__ import annotations

import re
import subprocess
import sys

import producers
import pytest
from conftest import ROOT

ORIGIN = {"Origin": "http://testserver"}


def sign_in(client, human) -> None:
    answer = client.post("/board/login", data={"token": human.token}, headers=ORIGIN, follow_redirects=False)
    assert answer.status_code == 303, answer.text


def facts(page: str) -> dict[str, str]:
    """The todo page's facts, as text: {"Attempts": "2 of 5 · 3 claims in all; …", …}."""
    block = re.search(r'<dl class="facts">(.*?)</dl>', page, re.S).group(1)
    pairs = re.findall(r"<dt>(.*?)</dt><dd[^>]*>(.*?)</dd>", block, re.S)
    return {name: " ".join(re.sub(r"<[^>]+>", "", value).split()) for name, value in pairs}


@pytest.fixture
def worker(world, alice):
    return world.endpoint(alice, ["build"], name="builder")


def claim_and(world, worker, todo_id: str, action: str, **body) -> None:
    claim = world.claim(worker, queue="build")
    assert claim["todo"]["id"] == todo_id, claim
    answer = world.act(worker, todo_id, action, lease_token=claim["lease_token"], **body)
    assert answer.status_code == 200, answer.text


# -- attempts and errors, as the timeline has them --------------------------------------------------------------

def test_a_done_todo_after_a_retry_says_what_its_timeline_says(client, world, alice, worker):
    todo = world.push(alice, worker, "build", "flaky")["id"]
    claim_and(world, worker, todo, "fail", error="disk full", retry=False)  # a dead letter after one claim
    sign_in(client, alice)
    dead = facts(client.get(f"/board/todos/{todo}").text)
    assert dead["Last error"] == "disk full" and dead["Attempts"] == "1 of 5", "a dead letter's error is current"
    assert world.act(alice, todo, "retry", note="space freed").status_code == 200
    claim_and(world, worker, todo, "fail", error="network down", retry_in_seconds=0)
    waiting = facts(client.get(f"/board/todos/{todo}").text)
    assert waiting["Last error"] == "network down", "waiting for the retry of a failed attempt: current"
    claim_and(world, worker, todo, "complete", result={"ok": True})

    page = client.get(f"/board/todos/{todo}").text
    shown = facts(page)
    assert "Last error" not in shown, "done: the error is an earlier attempt's, not the todo's"
    assert shown["Earlier error"] == "attempt 2: network down"
    claims_on_the_timeline = len(re.findall(r"attempt \d+ claimed", page))
    assert claims_on_the_timeline == 3
    assert shown["Attempts"].startswith("2 of 5 · 3 claims in all; the count started again at the retry ")
    api = world.client.get(f"/api/v1/todos/{todo}", headers=alice.auth).json()
    assert (api["attempt"], len(api["attempts"]), api["last_error"]) == (2, 3, "network down"), \
        "the API's fields are what they always were; the page reads them truly"


def test_a_release_is_counted_on_the_timeline_and_not_against_the_budget(client, world, alice, worker):
    todo = world.push(alice, worker, "build", "handed back")["id"]
    claim_and(world, worker, todo, "release")
    claim_and(world, worker, todo, "complete")
    plain = world.push(alice, worker, "build", "simple")["id"]
    claim_and(world, worker, plain, "complete")
    sign_in(client, alice)
    shown = facts(client.get(f"/board/todos/{todo}").text)
    assert shown["Attempts"] == "1 of 5 · 2 claims in all; 1 released, which do not count"
    assert "Last error" not in shown and "Earlier error" not in shown
    assert facts(client.get(f"/board/todos/{plain}").text)["Attempts"] == "1 of 5", "one claim: nothing to explain"


# -- held cards say why --------------------------------------------------------------------------------------

def test_held_cards_in_the_hold_lane_name_the_rule_and_its_reason(client, world, alice):
    router = world.endpoint(alice, ["hold", "triage"], name="router")
    hook = world.webhook(alice, router, "github", queue="triage")
    saved = world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth, json={"rules": [
        {"id": "issue-hold", "name": "size/XL, HUMAN, several or unknown size labels",
         "expr": '.issue.labels | index("size/XL") != null', "action": {"queue": "hold"}}],
        "default_action": {"queue": "hold"}})
    assert saved.status_code == 200, saved.text
    by_rule = world.deliver(hook, *producers.github("issues.opened", hook["secret"], {
        "issue": {"number": 1, "labels": [{"name": "size/XL"}]}})).json()["todos"][0]["id"]
    by_default = world.deliver(hook, *producers.github("issues.opened", hook["secret"], {
        "issue": {"number": 2}})).json()["todos"][0]["id"]
    pushed = world.push(alice, router, "hold", "a human pushed this")["id"]
    sign_in(client, alice)
    inbox = client.get("/board/inbox/held").text

    def why(todo_id: str, page: str = inbox) -> str:
        card = re.search(rf'/board/todos/{todo_id}".*?<p class="why hold-why">(.*?)</p>', page, re.S).group(1)
        return " ".join(re.sub(r"<[^>]+>", "", card).split())

    assert why(by_rule) == "Held for you: rule issue-hold: size/XL, HUMAN, several or unknown size labels"
    assert why(by_default) == "Held for you: the webhook's default action (no rule matched)"
    assert why(pushed) == "Held for you: pushed to hold"
    page = client.get(f"/board/todos/{by_rule}").text
    assert re.search(r'<p class="why hold-why">Held for you: rule <strong>issue-hold</strong>: size/XL', page)
    sent = client.post(f"/board/todos/{by_rule}/reroute", data={
        "queue": "triage", "csrf": re.search(r'name="csrf" value="([^"]+)"', page).group(1)}, headers=ORIGIN,
        follow_redirects=False)
    assert sent.status_code == 303
    assert "hold-why" not in client.get(f"/board/todos/{by_rule}").text, "out of the hold lane: no hold reason"


# -- the icon -------------------------------------------------------------------------------------------------

def test_every_page_declares_the_boards_own_icon(client, world, alice):
    signed_out = client.get("/board/login").text
    sign_in(client, alice)
    for page in (signed_out, client.get("/board").text, client.get("/board/account").text,
                 client.get("/board/no-such-page").text):
        assert '<link rel="icon" href="/board/static/favicon.svg" type="image/svg+xml">' in page
    icon = client.get("/board/static/favicon.svg")
    assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")
    assert icon.text.startswith("<svg") and "<script" not in icon.text


# -- the program's name in its help ----------------------------------------------------------------------------

PIP_SCRIPT = """# -*- coding: utf-8 -*-
import re
import sys
from switchboard.cli.parser import main
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit(main())
"""


def test_the_help_names_the_program_as_it_was_started(tmp_path):
    """pip writes the `switchboard` command as this script (its console-script template), named switchboard."""
    installed = tmp_path / "bin" / "switchboard"
    installed.parent.mkdir()
    installed.write_text(PIP_SCRIPT)
    for command, program in (([sys.executable, str(installed)], "switchboard"),
                             ([sys.executable, str(ROOT / "switchboard.py")], "switchboard.py"),
                             ([sys.executable, "-m", "switchboard"], "python -m switchboard")):
        done = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert done.returncode == 0 and done.stdout.startswith(f"usage: {program} [-h]"), done.stdout[:200]
        assert f"`{program} COMMAND --help` tells more" in " ".join(done.stdout.split())
    missing = subprocess.run([sys.executable, str(installed), "human", "list", "--db", str(tmp_path / "none.db")],
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert missing.returncode == 1 and "run `switchboard init` there first" in missing.stderr, missing.stderr
