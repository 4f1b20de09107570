"""Notifications, issue 25 item 7: a test message leaves the rate window alone (REST, the CLI and the Board's
button), a digest names the first few titles (escaped for each kind as a single message is), and a digest's
ntfy and Gotify priority is the highest of what it carries.

The app runs with its sender on a clock the test moves by hand (started at the real time), against receivers of
our own on loopback that record every request; moving the clock opens the next rate window."""

from __future__ import annotations

import html
import http.server
import json
import re
import threading
import time
from dataclasses import dataclass

import producers
import pytest
from conftest import ManualClock, cli
from helpers import count

from switchboard.app import create_app
from switchboard.configuration import UNSAFE_TEXT
from switchboard.notifier import NOTIFY_RATE_SECONDS

BASE = "https://switchboard.example"
WINDOW = NOTIFY_RATE_SECONDS + 1  # a clock move that opens the next rate window
UNSAFE = re.compile(f"[{UNSAFE_TEXT}]")
ORIGIN = {"Origin": "http://testserver"}
DIGEST_TITLES = 3  # titles a digest names
DIGEST_TITLE_CHARS = 80  # each cut to this length, as in a single message


# -- a receiver of our own ------------------------------------------------------------------------------

@dataclass
class Received:
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self):
        return json.loads(self.body)


class Recorder:
    """A threaded HTTP server on loopback that answers 200 and records every request."""

    def __init__(self):
        self.requests: list[Received] = []
        self.arrived = threading.Condition()
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with recorder.arrived:
                    recorder.requests.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()},
                                                      body))
                    recorder.arrived.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_for(self, n: int, timeout: float = 5.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        with self.arrived:
            while len(self.requests) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"expected {n} requests within {timeout} s, got {len(self.requests)}:"
                                         f" {[(r.path, r.body[:120]) for r in self.requests]}")
                self.arrived.wait(left)
            return list(self.requests)

    def on(self, path: str) -> list[Received]:
        with self.arrived:
            return [r for r in self.requests if r.path == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorder():
    made = Recorder()
    yield made
    made.close()


@pytest.fixture(autouse=True)
def loopback_receivers_allowed(monkeypatch):
    """The recorder listens on loopback: the app, and the CLI's `notify test`, read the allowance from here."""
    monkeypatch.setenv("SWITCHBOARD_NOTIFY_ALLOW_PRIVATE", "1")


# -- the app, with its sender running on a clock moved by hand --------------------------------------------

@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(time.time_ns() // 1_000_000)


@pytest.fixture
def app(db_path, clock):
    return create_app(db_path, clock=clock, background=True, ingest_rate=0, base_url=BASE)


def move_on(app, clock) -> None:
    """The next rate window opens; the sender looks again."""
    clock.advance(WINDOW)
    app.state.flows.notifier.wake()


def add_channel(client, human, kind: str, url: str, events: list[str], token: str | None = None) -> dict:
    body = {"kind": kind, "url": url, "events": events, **({"token": token} if token else {})}
    r = client.post("/api/v1/notify", headers=human.auth, json=body)
    assert r.status_code == 201, r.text
    return r.json()


def channel_of(client, human, channel_id: str) -> dict:
    return next(c for c in client.get("/api/v1/notify", headers=human.auth).json()["channels"]
                if c["id"] == channel_id)


def all_sent(db_path: str, *channel_ids: str) -> None:
    """Wait until every message of the channels is recorded as sent (a channel's window starts then)."""
    deadline = time.monotonic() + 5
    while any(count(db_path, "notify_outbox", "channel_id = ? AND sent_at IS NULL", (c,)) for c in channel_ids):
        assert time.monotonic() < deadline, "messages not recorded as sent"
        time.sleep(0.02)


class Work:
    """One human's work that needs them: a question, a dead letter, a held delivery, each with its title."""

    def __init__(self, world, human):
        self.world, self.human = world, human
        self.endpoint = world.endpoint(human, ["build", "triage"], name="worker")
        self.hook = None
        self.held_count = 0

    def _claimed(self, title: str) -> tuple[dict, str]:
        todo = self.world.push(self.human, self.endpoint, "build", title)
        r = self.world.client.post(f"/api/v1/todos/{todo['id']}/claim", headers=self.endpoint.auth, json={})
        assert r.status_code == 200, r.text
        return todo, r.json()["lease_token"]

    def needs_input(self, title: str) -> dict:
        todo, lease = self._claimed(title)
        r = self.world.act(self.endpoint, todo["id"], "needs-input", lease_token=lease, question="which?")
        assert r.status_code == 200 and r.json()["state"] == "needs_input", r.text
        return todo

    def dead_letter(self, title: str) -> dict:
        todo, lease = self._claimed(title)
        r = self.world.act(self.endpoint, todo["id"], "fail", lease_token=lease, error="broken", retry=False)
        assert r.status_code == 200 and r.json()["dead_letter"] is True, r.text
        return todo

    def held(self, title: str) -> dict:
        if self.hook is None:  # the trust gate holds every delivery of this webhook
            self.hook = self.world.webhook(self.human, self.endpoint, "github", trusted_actors=None)
        self.held_count += 1
        raw, headers = producers.github("issues.opened", self.hook["secret"], {
            "issue": {"number": self.held_count, "title": title}, "sender": {"login": "stranger"}})
        r = self.world.deliver(self.hook, raw, headers)
        assert r.status_code == 202 and r.json()["disposition"] == "quarantined", r.text
        todo = self.world.client.get(f"/api/v1/todos/{r.json()['todos'][0]['id']}", headers=self.human.auth)
        assert todo.status_code == 200, todo.text
        return todo.json()


# -- (a) a test message does not use up the rate window -----------------------------------------------------

def sent_by_rest(client, human, channel_id: str) -> dict:
    r = client.post(f"/api/v1/notify/{channel_id}/test", headers=human.auth, json={})
    assert r.status_code == 200, r.text
    return r.json()


def sent_by_cli(client, human, channel_id: str, db_path: str) -> dict:
    code, answer = cli(db_path, "notify", "test", channel_id)
    assert code == 0, answer
    return answer


def sent_by_board(client, human, channel_id: str) -> dict:
    signed_in = client.post("/board/login", data={"token": human.token}, headers=ORIGIN, follow_redirects=False)
    assert signed_in.status_code == 303, signed_in.text
    page = client.get("/board/notify")
    assert page.status_code == 200, page.text
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
    pressed = client.post(f"/board/notify/{channel_id}/test", data={"csrf": csrf}, headers=ORIGIN,
                          follow_redirects=False)
    assert pressed.status_code == 303, pressed.text
    return {"sent": True}


@pytest.mark.parametrize("how", ["rest", "cli", "board"])
def test_a_test_message_does_not_hold_back_the_next_alert(how, world, alice, client, clock, app, db_path, recorder):
    """Right after a channel's test (the clock not moved at all), a real alert goes out at once; the alert, not
    the test, starts the channel's rate window."""
    channel = add_channel(client, alice, "ntfy", recorder.url("/alerts"), ["needs_input"])
    sender = {"rest": sent_by_rest, "cli": lambda *a: sent_by_cli(*a, db_path), "board": sent_by_board}[how]
    assert sender(client, alice, channel["id"])["sent"] is True
    [tested] = recorder.wait_for(1)
    assert tested.headers["title"] == "Switchboard: Switchboard test message"
    after_test = channel_of(client, alice, channel["id"])["last_sent_at"]

    work = Work(world, alice)
    work.needs_input("right after the test")
    alert = recorder.wait_for(2, timeout=3)[1]  # no clock move: within the test's 30 s, yet not held back
    assert alert.headers["title"] == "Switchboard: A worker asks a question"
    assert "right after the test" in alert.body.decode()
    all_sent(db_path, channel["id"])
    assert after_test is None and channel_of(client, alice, channel["id"])["last_sent_at"] is not None, \
        "the channel's last_sent_at is its last alert's, never a test's"

    # The alert did start the window: the next one waits for it to end.
    work.needs_input("inside the window")
    time.sleep(0.3)
    assert len(recorder.requests) == 2, "a real alert still counts"
    move_on(app, clock)
    assert "inside the window" in recorder.wait_for(3)[2].body.decode()


# -- (b) a digest names the first few titles ------------------------------------------------------------

MARKUP = "<!here> [Ok](https://evil.example/p) *a* & <@1>"
TITLES = [MARKUP, "second\u202e task\u2066 with\ttabs", "long " + "title " * 40, "fourth task", "fifth task"]


def test_a_digest_names_the_first_titles_escaped_for_each_kind(world, alice, client, clock, app, db_path, recorder):
    """Five held deliveries inside the window: the digest names the first three (producer text, quoted as a single
    message quotes it, then escaped for Slack and Discord as a single message is) and says "and 2 more"."""
    kinds = {"ntfy": None, "gotify": "gotify-app-token", "slack": None, "discord": None}
    channels = {kind: add_channel(client, alice, kind, recorder.url(f"/{kind}"), ["held"], token)
                for kind, token in kinds.items()}
    work = Work(world, alice)
    work.held("the opener")  # sent at once; it opens each channel's window
    recorder.wait_for(4)
    all_sent(db_path, *(c["id"] for c in channels.values()))
    held = [work.held(title)["title"] for title in TITLES]
    time.sleep(0.2)
    assert len(recorder.requests) == 4, "held back by the window"
    move_on(app, clock)
    recorder.wait_for(8)
    digests = {kind: recorder.on(f"/{kind}/message" if kind == "gotify" else f"/{kind}")[1] for kind in kinds}

    # ntfy's body is the text as it is: the counts, the first three titles, each one clean line cut to 80
    # characters as in a single message, then "and 2 more"; never the titles beyond the first three.
    ntfy = digests["ntfy"]
    assert ntfy.headers["title"] == "Switchboard: 5 things need you"
    text = ntfy.body.decode()
    lines = text.split("\n")
    assert lines[0] == "5 held since the last message:"
    assert len(lines) == 1 + DIGEST_TITLES + 1 and lines[-1] == "and 2 more", lines
    named = lines[1:-1]
    assert all(line.startswith("• held: ") and line.endswith(" (queue quarantine)") for line in named), named
    titles = [line.removeprefix("• held: ").removesuffix(" (queue quarantine)") for line in named]
    assert len(held[0]) <= DIGEST_TITLE_CHARS and titles[0] == held[0] and titles[0].endswith(MARKUP), "plain text for ntfy: the producer's, unchanged"
    assert titles[1] == held[1] and titles[1].endswith("second task with tabs"), "no control or bidi character"
    assert len(held[2]) > DIGEST_TITLE_CHARS and titles[2] == held[2][:DIGEST_TITLE_CHARS - 1] + "…"
    assert not any(UNSAFE.search(line) for line in lines) and "fourth" not in text and "fifth" not in text
    assert ntfy.headers["click"] == f"{BASE}/board"

    # Gotify: the same text, as JSON.
    assert digests["gotify"].json()["message"] == text

    # Slack: the same text with its own escaping of &, < and >, so no <!here> and no <url|text>.
    slack = digests["slack"].json()["text"]
    assert "<" not in slack and ">" not in slack and "&lt;!here&gt;" in slack and "&lt;@1&gt;" in slack
    assert html.unescape(slack) == f"Switchboard: 5 things need you\n{text}\n{BASE}/board"

    # Discord: every ASCII punctuation character of the text backslash-escaped: no masked link, mention, header.
    discord = digests["discord"].json()
    assert discord["allowed_mentions"] == {"parse": []}
    head, *body, link = discord["content"].split("\n")
    assert head == "Switchboard: 5 things need you" and link == f"{BASE}/board"
    escaped = "\n".join(body)
    assert re.search(r"(?<!\\)[\[\]()*_~`|<>#:!@&]", escaped) is None, escaped
    assert "](" not in escaped and "https://evil" not in escaped
    assert re.sub(r"\\(.)", r"\1", escaped) == text, "read without its escapes, it says what ntfy got"


# -- (c) a digest's priority is the highest of what it carries ----------------------------------------------

def test_a_digest_with_a_dead_letter_goes_out_at_its_priority(world, alice, client, clock, app, db_path, recorder):
    ntfy = add_channel(client, alice, "ntfy", recorder.url("/ntfy"), ["held", "dead_letter"])
    gotify = add_channel(client, alice, "gotify", recorder.url("/gotify"), ["held", "dead_letter"], "gotify-token")
    work = Work(world, alice)
    work.held("the opener")
    recorder.wait_for(2)
    all_sent(db_path, ntfy["id"], gotify["id"])
    [opened] = recorder.on("/ntfy")
    assert (opened.headers["priority"], opened.headers["tags"]) == ("default", "pause_button")

    # Two held deliveries and then a dead letter: the dead letter raises the digest's priority, adds its tag, and
    # is named first though it came last.
    work.held("held one")
    work.held("held two")
    work.dead_letter("failed for good")
    move_on(app, clock)
    recorder.wait_for(4)
    all_sent(db_path, ntfy["id"], gotify["id"])
    digest = recorder.on("/ntfy")[1]
    assert digest.headers["title"] == "Switchboard: 3 things need you"
    assert digest.headers["priority"] == "high"
    assert digest.headers["tags"] == "inbox_tray,x"
    lines = digest.body.decode().split("\n")
    assert lines[0] == "1 dead letter, 2 held since the last message:", lines
    assert lines[1] == "• dead letter: failed for good (queue build)", lines
    assert "held one" in lines[2] and "held two" in lines[3] and len(lines) == 4
    assert recorder.on("/gotify/message")[1].json()["priority"] == 8
    assert recorder.on("/gotify/message")[0].json()["priority"] == 5, "a single held delivery: Gotify follows ntfy"

    # A digest of held deliveries alone stays at the default priority: the priority is what it carries.
    work.held("calm one")
    work.held("calm two")
    move_on(app, clock)
    recorder.wait_for(6)
    calm = recorder.on("/ntfy")[2]
    assert (calm.headers["priority"], calm.headers["tags"]) == ("default", "inbox_tray")
    assert calm.body.decode().startswith("2 held since the last message:\n")
    assert recorder.on("/gotify/message")[2].json()["priority"] == 5
