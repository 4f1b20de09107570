"""Notifications to humans: channels (ntfy, Gotify, Slack, Discord, a Standard-Webhooks-signed `webhook`), the
events that fill the outbox, and the sender that empties it, against real HTTP receivers on loopback.

The app runs with its background loops on (the notifier must run) on a clock the test moves by hand, started at
the real time so that signature timestamps are current; moving it opens the next rate window or brings a retry
due, and `wake` makes the sender look again at once."""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.server
import json
import re
import signal
import threading
import time
import types
import uuid
from dataclasses import dataclass

import httpx
import producers
import pytest
from conftest import ManualClock, cli, free_port
from helpers import count, make_webhook, post_delivery, query
from starlette.testclient import TestClient

import switchboard.notifier as notifier_module
from switchboard.app import create_app
from switchboard.configuration import BACKOFF_BASE_SECONDS, UNSAFE_TEXT
from switchboard.evaluator import VERIFICATION_ALERT_COUNT
from switchboard.notifier import NOTIFY_RATE_SECONDS, compose, shape_request
from switchboard.store.outbox import Outgoing

try:  # the reference implementation of Standard Webhooks, when installed (test extras)
    import standardwebhooks
except ImportError:  # pragma: no cover - the signature is verified by hand as well
    standardwebhooks = None

BASE = "https://switchboard.example"
TIMEOUT = 1.5  # NOTIFY_TIMEOUT_SECONDS for these tests (10 s in production)
WINDOW = NOTIFY_RATE_SECONDS + 1  # a clock move that opens the next rate window
UNSAFE = re.compile(f"[{UNSAFE_TEXT}]")


# -- receivers ---------------------------------------------------------------------------------------

@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    at: float  # time.monotonic()

    def json(self):
        return json.loads(self.body)

    @property
    def message_id(self) -> str:
        return self.headers["x-switchboard-message-id"]

    def text(self) -> str:
        """Everything the receiver was told: headers and body, for searching."""
        return json.dumps(self.headers) + "\n" + self.body.decode("utf-8", "replace")


class Receiver:
    """A threaded HTTP server on loopback that records every request. `plan` says how to answer each request in
    turn: a status code, or "hang" (read the request, never answer); after the plan, `then`."""

    def __init__(self, plan: list | None = None, then: int | str = 200, port: int = 0):
        self.plan = list(plan or [])
        self.then = then
        self.requests: list[Received] = []
        self.released = threading.Event()
        self.changed = threading.Condition()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _any(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with receiver.changed:
                    answer = receiver.plan.pop(0) if receiver.plan else receiver.then
                    receiver.requests.append(Received(self.command, self.path,
                                                      {k.lower(): v for k, v in self.headers.items()}, body,
                                                      time.monotonic()))
                    receiver.changed.notify_all()
                if answer == "hang":
                    receiver.released.wait(60)
                    return
                self.send_response(answer)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            do_POST = do_PUT = do_GET = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_for(self, n: int, timeout: float = 10.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        with self.changed:
            while len(self.requests) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"expected {n} requests, got {len(self.requests)}: "
                                         f"{[(r.path, r.body[:200]) for r in self.requests]}")
                self.changed.wait(left)
            return list(self.requests)

    def on(self, path: str) -> list[Received]:
        return [r for r in self.requests if r.path == path]

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(autouse=True)
def loopback_receivers_allowed(monkeypatch):
    """The receivers here listen on loopback, which a server refuses to notify unless its operator allows it:
    these tests' apps, live servers and CLI processes all read the allowance from the environment."""
    monkeypatch.setenv("SWITCHBOARD_NOTIFY_ALLOW_PRIVATE", "1")


@pytest.fixture
def receivers():
    made: list[Receiver] = []

    def make(*args, **kwargs) -> Receiver:
        receiver = Receiver(*args, **kwargs)
        made.append(receiver)
        return receiver

    yield make
    for receiver in made:
        receiver.close()


# -- the app, with its sender running ----------------------------------------------------------------

@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(time.time_ns() // 1_000_000)


@pytest.fixture
def app(db_path, clock, monkeypatch):
    monkeypatch.setattr(notifier_module, "NOTIFY_TIMEOUT_SECONDS", TIMEOUT)
    return create_app(db_path, clock=clock, background=True, ingest_rate=0, base_url=BASE)


def wake(app) -> None:
    app.state.flows.notifier.wake()


def move_on(app, clock, seconds: float = WINDOW) -> None:
    """Move the clock (a new rate window, or a retry due) and let the sender look again."""
    clock.advance(seconds)
    wake(app)


def eventually(check, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def add_channel(client, human, kind: str, url: str, events: list[str], token: str | None = None) -> dict:
    body = {"kind": kind, "url": url, "events": events, **({"token": token} if token else {})}
    r = client.post("/api/v1/notify", headers=human.auth, json=body)
    assert r.status_code == 201, r.text
    return r.json()


def outbox(db_path: str, channel_id: str) -> list[dict]:
    rows = query(db_path, "SELECT id, event, attempts, next_at, sent_at, gave_up_at, digest_id, created_at"
                          " FROM notify_outbox WHERE channel_id = ? ORDER BY created_at, id", (channel_id,))
    keys = ("id", "event", "attempts", "next_at", "sent_at", "gave_up_at", "digest_id", "created_at")
    return [dict(zip(keys, r)) for r in rows]


def all_sent(db_path: str, channel_id: str) -> None:
    """Wait until the sender has recorded every message of the channel as sent (its window starts then)."""
    eventually(lambda: count(db_path, "notify_outbox", "channel_id = ? AND sent_at IS NULL", (channel_id,)) == 0,
               what=f"channel {channel_id}'s messages recorded as sent")


def channels_of(client, human) -> dict[str, dict]:
    r = client.get("/api/v1/notify", headers=human.auth)
    assert r.status_code == 200, r.text
    return {c["id"]: c for c in r.json()["channels"]}


def verify_standard_webhook(secret: str, received: Received) -> dict:
    """The Standard Webhooks check, by hand: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}"> with the key
    the base64 after `whsec_`; and with the reference library when it is installed."""
    assert secret.startswith("whsec_")
    key = base64.b64decode(secret.removeprefix("whsec_"))
    assert len(key) >= 24
    h = received.headers
    signed = f"{h['webhook-id']}.{h['webhook-timestamp']}.".encode() + received.body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    given = [part.split(",", 1) for part in h["webhook-signature"].split(" ")]
    assert ["v1", expected] in given, (h["webhook-signature"], expected)
    assert abs(int(h["webhook-timestamp"]) - time.time()) < 300
    if standardwebhooks is not None:
        assert standardwebhooks.Webhook(secret).verify(received.body, received.headers) == received.json()
        with pytest.raises(standardwebhooks.webhooks.WebhookVerificationError):
            standardwebhooks.Webhook(secret).verify(received.body + b" ", received.headers)
    return received.json()


# -- work that needs its human -----------------------------------------------------------------------

PAYLOAD_SENTINEL = "PAYLOAD-SENTINEL-7f3a"


class Work:
    """A human with one worker endpoint on `build`, and the steps that make a todo need the human."""

    def __init__(self, world, human):
        self.world = world
        self.human = human
        self.endpoint = world.endpoint(human, ["build", "triage"], name="worker")
        self.lease_tokens: list[str] = []

    def claimed(self, title: str, **extra) -> tuple[dict, str]:
        todo = self.world.push(self.human, self.endpoint, "build", title, payload={"secret": PAYLOAD_SENTINEL},
                               **extra)
        r = self.world.client.post(f"/api/v1/todos/{todo['id']}/claim", headers=self.endpoint.auth, json={})
        assert r.status_code == 200, r.text
        lease = r.json()["lease_token"]
        self.lease_tokens.append(lease)
        return todo, lease

    def needs_input(self, title: str = "needs an answer") -> dict:
        todo, lease = self.claimed(title)
        r = self.world.act(self.endpoint, todo["id"], "needs-input", lease_token=lease, question="which branch?")
        assert r.status_code == 200 and r.json()["state"] == "needs_input", r.text
        return todo

    def review(self, title: str = "gated work") -> dict:
        todo, lease = self.claimed(title, work_item={"schema": "switchboard.work_item.v1", "objective": "o",
                                                     "approval_gates": ["review"]})
        r = self.world.act(self.endpoint, todo["id"], "complete", lease_token=lease, summary="done, please look",
                           result={"secret": PAYLOAD_SENTINEL})
        assert r.status_code == 200 and r.json()["state"] == "review", r.text
        return todo

    def dead_letter(self, title: str = "doomed work") -> dict:
        todo, lease = self.claimed(title)
        r = self.world.act(self.endpoint, todo["id"], "fail", lease_token=lease, error="broken", retry=False)
        assert r.status_code == 200 and r.json()["state"] == "failed" and r.json()["dead_letter"] is True, r.text
        return todo


def held_delivery(world, hook: dict, number: int, title: str = "an outsider's issue") -> dict:
    raw, headers = producers.github("issues.opened", hook["secret"], {
        "issue": {"number": number, "title": title, "body": PAYLOAD_SENTINEL}, "sender": {"login": "stranger"}})
    r = world.deliver(hook, raw, headers)
    assert r.status_code == 202 and r.json()["disposition"] == "quarantined", r.text
    return r.json()


def assert_clean(received: list[Received], forbidden: list[str], allowed_header: dict[str, str] | None = None):
    """No request carries any of `forbidden` in its body or headers, except a channel's own credential in the
    one header its receiver's documentation puts it (`allowed_header`: header name -> value)."""
    for request in received:
        headers = {k: v for k, v in request.headers.items()
                   if not (allowed_header and k in allowed_header and v == allowed_header[k])}
        text = json.dumps(headers) + request.body.decode("utf-8", "replace")
        for secret in forbidden:
            assert secret not in text, f"{secret!r} leaked to {request.path}: {text[:500]}"


# -- 1. each kind's request, as its documentation describes it -----------------------------------------

def test_each_kind_is_shaped_as_its_public_documentation_says(world, alice, client, receivers):
    rx = receivers()
    ntfy_token, gotify_token = "tk_ntfy0secret0token0abcdef", "AgotifyAppToken.x"
    made = {
        "ntfy": add_channel(client, alice, "ntfy", rx.url("/alerts-7c1"), ["needs_input"], ntfy_token),
        "ntfy-open": add_channel(client, alice, "ntfy", rx.url("/open-topic"), ["needs_input"]),
        "gotify": add_channel(client, alice, "gotify", rx.url("/gotify"), ["needs_input"], gotify_token),
        "slack": add_channel(client, alice, "slack", rx.url("/services/T0001/B0002/slackpath"), ["needs_input"]),
        "discord": add_channel(client, alice, "discord", rx.url("/api/webhooks/123/discordpath"), ["needs_input"]),
        "webhook": add_channel(client, alice, "webhook", rx.url("/recv/hookpath"), ["needs_input"]),
    }
    secret = made["webhook"]["secret"]
    assert secret.startswith("whsec_") and len(base64.b64decode(secret.removeprefix("whsec_"))) == 32
    shown = f"http://127.0.0.1:{rx.port}/…"
    for name, channel in made.items():
        assert channel["id"].startswith("nc_") and channel["url"] == shown, channel
        assert "token" not in channel and ("secret" in channel) == (name == "webhook"), channel
    # The list never shows a secret, a token, or a URL's path (for Slack, Discord and ntfy it is the credential).
    listing = client.get("/api/v1/notify", headers=alice.auth)
    assert listing.status_code == 200 and {c["id"] for c in listing.json()["channels"]} == {
        c["id"] for c in made.values()}
    for hidden in (secret, secret.removeprefix("whsec_"), ntfy_token, gotify_token, "alerts-7c1", "open-topic",
                   "slackpath", "discordpath", "hookpath", "/gotify"):
        assert hidden not in listing.text
    assert all(c["url"] == shown for c in listing.json()["channels"])

    work = Work(world, alice)
    todo = work.needs_input("Deploy <prod> & tell @everyone")
    rx.wait_for(6)
    time.sleep(0.3)
    assert len(rx.requests) == 6, "one message per channel"
    assert all(r.method == "POST" for r in rx.requests)
    ids = [r.message_id for r in rx.requests]
    assert all(re.fullmatch(r"nm_[0-9a-f]+", i) for i in ids) and len(set(ids)) == 6
    link = f"{BASE}/board/todos/{todo['id']}"

    # ntfy: POST to the topic URL, the body is the message, Title/Tags/Priority/Click headers, bearer token.
    [ntfy] = rx.on("/alerts-7c1")
    assert ntfy.headers["title"] == "Switchboard: A worker asks a question"
    assert ntfy.headers["tags"] == "question" and ntfy.headers["priority"] == "high"
    assert ntfy.headers["click"] == link and ntfy.headers["authorization"] == f"Bearer {ntfy_token}"
    assert ntfy.headers["content-type"].startswith("text/plain")
    text = ntfy.body.decode()
    assert "Deploy <prod> & tell @everyone" in text and todo["id"] in text and "queue build" in text
    [plain] = rx.on("/open-topic")
    assert "authorization" not in plain.headers and plain.body == ntfy.body

    # Gotify: POST <server>/message, X-Gotify-Key, JSON title/message/priority/extras click URL.
    [gotify] = rx.on("/gotify/message")
    assert gotify.headers["x-gotify-key"] == gotify_token and "authorization" not in gotify.headers
    assert gotify.headers["content-type"] == "application/json"
    body = gotify.json()
    assert body["title"] == "Switchboard: A worker asks a question" and body["message"] == text
    assert isinstance(body["priority"], int) and 0 <= body["priority"] <= 10
    assert body["extras"] == {"client::notification": {"click": {"url": link}}}

    # Slack incoming webhook: {"text"} with &, < and > escaped as the docs say.
    [slack] = rx.on("/services/T0001/B0002/slackpath")
    body = slack.json()
    assert set(body) == {"text"}
    assert "Deploy &lt;prod&gt; &amp; tell @everyone" in body["text"] and "<prod>" not in body["text"]
    assert not re.search(r"&(?!amp;|lt;|gt;)", body["text"]), "every & is an escape"

    # Discord webhook: {"content"}, and no mention in producer text may ping anyone.
    [discord] = rx.on("/api/webhooks/123/discordpath")
    body = discord.json()
    assert body["allowed_mentions"] == {"parse": []} and "@everyone" in body["content"]
    assert len(body["content"]) <= 2000 and set(body) == {"content", "allowed_mentions"}

    # The generic webhook, signed the Standard Webhooks way.
    [signed] = rx.on("/recv/hookpath")
    assert signed.headers["webhook-id"] == signed.message_id
    body = verify_standard_webhook(secret, signed)
    assert body["type"] == "needs_input" and re.fullmatch(r"\d{4}-\d\d-\d\dT.*Z", body["timestamp"])
    assert body["data"] == {"todo_id": todo["id"], "queue": "build", "state": "needs_input",
                            "title": "Deploy <prod> & tell @everyone", "board_url": link}
    # A signature under another key does not verify (the check above is not vacuous).
    forged = Received(signed.method, signed.path, {**signed.headers, "webhook-signature": "v1," + base64.b64encode(
        hmac.new(b"x" * 32, signed.body, hashlib.sha256).digest()).decode()}, signed.body, signed.at)
    with pytest.raises(AssertionError):
        verify_standard_webhook(secret, forged)

    # Nothing sent names the payload, a lease, a principal's token, or another channel's credential.
    assert_clean([ntfy], [PAYLOAD_SENTINEL, *work.lease_tokens, alice.token, work.endpoint.token, gotify_token,
                          secret.removeprefix("whsec_")], {"authorization": f"Bearer {ntfy_token}"})
    assert_clean([gotify], [PAYLOAD_SENTINEL, *work.lease_tokens, alice.token, work.endpoint.token, ntfy_token,
                            secret.removeprefix("whsec_")], {"x-gotify-key": gotify_token})
    assert_clean([plain, slack, discord, signed], [PAYLOAD_SENTINEL, *work.lease_tokens, alice.token,
                                                   work.endpoint.token, ntfy_token, gotify_token,
                                                   secret.removeprefix("whsec_")])


def test_a_message_keeps_its_id_across_retries(world, alice, client, clock, app, db_path, receivers):
    rx = receivers([500, 500], then=200)
    channel = add_channel(client, alice, "webhook", rx.url("/flaky"), ["needs_input"])
    Work(world, alice).needs_input()
    first = rx.wait_for(1)[0]
    [row] = eventually(lambda: [r for r in outbox(db_path, channel["id"]) if r["attempts"] == 1], what="a failure")
    assert row["sent_at"] is None and row["gave_up_at"] is None and row["next_at"] > clock.ms
    assert channels_of(client, alice)[channel["id"]]["last_error"] == "HTTP 500"
    move_on(app, clock, BACKOFF_BASE_SECONDS + 1)
    second = rx.wait_for(2)[1]
    eventually(lambda: outbox(db_path, channel["id"])[0]["attempts"] == 2, what="a second failure")
    move_on(app, clock, 2 * BACKOFF_BASE_SECONDS + 1)
    third = rx.wait_for(3)[2]
    eventually(lambda: outbox(db_path, channel["id"])[0]["sent_at"] is not None, what="the message sent")
    assert first.message_id == second.message_id == third.message_id == row["id"]
    assert first.headers["webhook-id"] == second.headers["webhook-id"] == third.headers["webhook-id"] == row["id"]
    for attempt in (first, second, third):
        verify_standard_webhook(channel["secret"], attempt)
    assert first.json()["data"] == third.json()["data"]
    time.sleep(0.2)
    assert len(rx.requests) == 3, "a sent message is not sent again"


# -- 2. the events, and what a message may carry -------------------------------------------------------

def test_each_channel_gets_only_the_events_it_picked(world, alice, client, clock, app, db_path, receivers):
    rx = receivers()
    asks = add_channel(client, alice, "webhook", rx.url("/asks"), ["needs_input"])
    reviews = add_channel(client, alice, "webhook", rx.url("/reviews"), ["review", "dead_letter"])
    alarms = add_channel(client, alice, "webhook", rx.url("/alarms"), ["held", "verification_failures"])
    bob = world.human("bob")
    bobs = add_channel(client, bob, "webhook", rx.url("/bob"), ["needs_input", "review", "dead_letter", "held"])
    work = Work(world, alice)

    asked = work.needs_input("question time")
    rx.wait_for(1)
    all_sent(db_path, asks["id"])
    move_on(app, clock)
    reviewed = work.review("look at this")
    rx.wait_for(2)
    all_sent(db_path, reviews["id"])
    move_on(app, clock)
    failed = work.dead_letter("failed for good")
    rx.wait_for(3)
    time.sleep(0.3)

    got = {path: [(r.json()["type"], r.json()["data"]["todo_id"]) for r in rx.on(path)]
           for path in ("/asks", "/reviews", "/alarms", "/bob")}
    assert got == {"/asks": [("needs_input", asked["id"])],
                   "/reviews": [("review", reviewed["id"]), ("dead_letter", failed["id"])],
                   "/alarms": [], "/bob": []}
    assert [r["event"] for r in outbox(db_path, asks["id"])] == ["needs_input"]
    assert [r["event"] for r in outbox(db_path, reviews["id"])] == ["review", "dead_letter"]
    assert outbox(db_path, alarms["id"]) == [] and outbox(db_path, bobs["id"]) == []
    for request, channel in ((rx.on("/asks")[0], asks), *((r, reviews) for r in rx.on("/reviews"))):
        body = verify_standard_webhook(channel["secret"], request)
        assert set(body["data"]) == {"todo_id", "queue", "state", "title", "board_url"}
    secrets = [c["secret"].removeprefix("whsec_") for c in (asks, reviews, alarms, bobs)]
    assert_clean(rx.requests, [PAYLOAD_SENTINEL, *work.lease_tokens, alice.token, bob.token, work.endpoint.token,
                               *secrets, "which branch?", "done, please look"])


def test_a_held_delivery_tells_its_human_and_quotes_the_title_cleanly(world, alice, client, receivers):
    rx = receivers()
    ntfy = add_channel(client, alice, "ntfy", rx.url("/held-topic"), ["held"])
    signed = add_channel(client, alice, "webhook", rx.url("/held-json"), ["held"])
    add_channel(client, alice, "webhook", rx.url("/not-held"), ["needs_input", "review", "dead_letter"])
    owner = world.endpoint(alice, ["triage"], name="router")
    hook = world.webhook(alice, owner, "github", trusted_actors=None)  # the trust gate holds every delivery
    nasty = "\x1b[31mURGENT\x1b[0m \u202eevil\u202c\ttab\r\nnewline " + "long " * 60
    held = held_delivery(world, hook, 4242, nasty)
    rx.wait_for(2)
    time.sleep(0.3)
    assert rx.on("/not-held") == [] and len(rx.requests) == 2
    [note] = rx.on("/held-topic")
    [message] = rx.on("/held-json")
    body = verify_standard_webhook(signed["secret"], message)
    assert body["type"] == "held" and body["data"]["todo_id"] == held["todos"][0]["id"]
    assert body["data"]["queue"] == "quarantine" and body["data"]["state"] == "quarantined"
    title = body["data"]["title"]
    assert not UNSAFE.search(title) and "  " not in title
    assert len(title) <= 80 and title.endswith("…") and "URGENT" in title and "evil" in title
    assert note.headers["title"] == "Switchboard: A delivery is held" and note.headers["tags"] == "pause_button"
    text = note.body.decode()
    assert not UNSAFE.search(text) and "URGENT" in text and held["todos"][0]["id"] in text
    assert len(text) < 250, "the quoted title is short"
    assert_clean(rx.requests, [PAYLOAD_SENTINEL, hook["secret"], hook["url"].rsplit("/", 1)[1], alice.token,
                               owner.token, signed["secret"].removeprefix("whsec_")])
    assert ntfy["id"] != signed["id"]


def test_quoted_producer_text_is_one_short_clean_line_for_every_kind():
    """compose() quotes what a producer wrote (a title) as data whatever reaches it: no control or bidi
    character, one line, at most 80 characters, for every kind of receiver."""
    title = "\u202eevil\u2066 \x00nul\x07bell\x1b[2J\nsecond line\u061c " + "x" * 300
    row = {"id": "nm_01", "event": "needs_input", "attempts": 0,
           "data": json.dumps({"todo_id": "td_01", "queue": "build", "state": "needs_input", "title": title})}
    message = Outgoing("nm_01", {"id": "nc_01", "kind": "ntfy"}, [row])
    composed = compose(message, BASE)
    assert not UNSAFE.search(composed.text) and not UNSAFE.search(composed.data["title"])
    assert len(composed.data["title"]) <= 80 and composed.data["title"].startswith("evil")
    for kind, token in (("ntfy", "t"), ("gotify", "t"), ("slack", None), ("discord", None),
                        ("webhook", "whsec_" + base64.b64encode(b"k" * 32).decode())):
        _, headers, body = shape_request(kind, "http://127.0.0.1:9/x", token, composed, int(time.time()))
        if kind == "ntfy":
            shown = [body.decode()]
        else:
            doc = json.loads(body)
            shown = {"gotify": lambda: [doc["title"], doc["message"]], "slack": lambda: doc["text"].split("\n"),
                     "discord": lambda: doc["content"].split("\n"), "webhook": lambda: [doc["data"]["title"]]}[kind]()
        # Line breaks are the shape's own (title, text, link); no line carries a control or bidi character.
        assert all(not UNSAFE.search(line) for line in shown), (kind, shown)
        assert any("evil" in line and "second line" in line for line in shown), (kind, shown)
        assert "x" * 100 not in body.decode()
        assert all(not UNSAFE.search(v) for v in headers.values())


def test_five_bad_signatures_send_one_message_naming_the_webhook(world, alice, client, db_path, receivers):
    rx = receivers()
    channel = add_channel(client, alice, "webhook", rx.url("/alarm"), ["verification_failures"])
    owner = world.endpoint(alice, ["triage"], name="router")
    hook = world.webhook(alice, owner, "github", trusted_actors={"allow_all": True})
    other = world.webhook(alice, owner, "github", trusted_actors={"allow_all": True})
    raw, headers = producers.github("issues.opened", "not-the-secret")
    for _ in range(VERIFICATION_ALERT_COUNT - 1):  # four on another webhook: under the threshold
        assert world.deliver(other, raw, headers).status_code == 401
    for _ in range(VERIFICATION_ALERT_COUNT + 2):
        assert world.deliver(hook, raw, {**headers, "X-GitHub-Delivery": str(uuid.uuid4())}).status_code == 401
    [message] = rx.wait_for(1)
    time.sleep(0.3)
    assert len(rx.requests) == 1
    rows = outbox(db_path, channel["id"])
    assert [r["event"] for r in rows] == ["verification_failures"], "one message, not one per failure"
    body = verify_standard_webhook(channel["secret"], message)
    assert body["type"] == "verification_failures"
    assert body["data"]["webhook_id"] == hook["id"] and body["data"]["provider"] == "github"
    assert body["data"]["failures"] == VERIFICATION_ALERT_COUNT and body["data"]["reason"]
    assert other["id"] not in message.text()
    assert_clean(rx.requests, [hook["secret"], other["secret"], hook["url"].rsplit("/", 1)[1], "not-the-secret",
                               headers["X-Hub-Signature-256"].split("=", 1)[1]])
    # A good delivery still goes through: the alert refuses nothing.
    good = producers.github("issues.opened", hook["secret"])
    assert world.deliver(hook, *good).json()["disposition"] == "routed"


# -- 3. nothing is lost --------------------------------------------------------------------------------

def test_a_message_queued_before_a_crash_is_sent_after_restart_with_the_same_id(db_path, live_server, receivers):
    rx = receivers(["hang"], then=200)  # the first attempt never gets an answer: the server dies first
    assert cli(db_path, "init")[0] == 0
    _, human = cli(db_path, "human", "add", "alice")
    code, channel = cli(db_path, "notify", "add", "--human", "alice", "--kind", "ntfy",
                        "--url", rx.url("/crash-topic"), "--events", "held")
    assert code == 0, channel
    auth = {"Authorization": f"Bearer {human['token']}"}
    server = live_server("--ingest-rate", "0", "--base-url", BASE)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/api/v1/endpoints", headers=auth, json={"name": "router", "queues": ["triage"]})
        assert r.status_code == 201, r.text

        hook = make_webhook(http, types.SimpleNamespace(auth=auth), r.json()["id"], "github",
                            trusted_actors=None)  # the trust gate holds every delivery
        raw, headers = producers.github("issues.opened", hook["secret"], {"sender": {"login": "stranger"}})
        outcome = post_delivery(http, hook, raw, headers).json()
    assert outcome["disposition"] == "quarantined"
    first = rx.wait_for(1)[0]  # in flight: queued, committed, not sent
    [row] = outbox(db_path, channel["id"])
    assert row["sent_at"] is None and row["attempts"] == 0 and row["id"] == first.message_id
    server.proc.kill()  # SIGKILL
    server.proc.wait()
    assert server.proc.returncode == -signal.SIGKILL
    [row] = outbox(db_path, channel["id"])
    assert row["sent_at"] is None, "the message is still in the outbox"

    live_server("--ingest-rate", "0", "--base-url", BASE)
    second = rx.wait_for(2, timeout=20)[1]
    assert second.message_id == first.message_id == row["id"]
    assert second.body == first.body and second.headers["title"] == "Switchboard: A delivery is held"
    assert outcome["todos"][0]["id"] in second.body.decode()
    eventually(lambda: outbox(db_path, channel["id"])[0]["sent_at"] is not None, what="the message marked sent")
    time.sleep(0.3)
    assert len(rx.requests) == 2


# -- 4. no storms --------------------------------------------------------------------------------------

def test_five_hundred_held_deliveries_make_one_message_and_one_digest(world, alice, client, clock, app, db_path,
                                                                      receivers):
    rx = receivers()
    channel = add_channel(client, alice, "webhook", rx.url("/storm"), ["held"])
    owner = world.endpoint(alice, ["triage"], name="router")
    hook = world.webhook(alice, owner, "github", trusted_actors=None)
    first_held = held_delivery(world, hook, 1)
    [first] = rx.wait_for(1)
    assert verify_standard_webhook(channel["secret"], first)["type"] == "held"
    for number in range(2, 501):
        held_delivery(world, hook, number)
    assert count(db_path, "todos", "state = 'quarantined'") == 500
    time.sleep(0.3)
    assert len(rx.requests) == 1, "the rest wait for the rate window"
    assert count(db_path, "notify_outbox", "channel_id = ? AND sent_at IS NULL", (channel["id"],)) == 499

    move_on(app, clock)  # the 30 s window ends
    digest = rx.wait_for(2)[1]
    body = verify_standard_webhook(channel["secret"], digest)
    assert body["type"] == "digest" and body["data"] == {"counts": {"held": 499}}
    assert digest.message_id != first.message_id and digest.headers["webhook-id"] == digest.message_id
    assert first.json()["data"]["todo_id"] == first_held["todos"][0]["id"]
    eventually(lambda: count(db_path, "notify_outbox", "channel_id = ? AND sent_at IS NULL",
                             (channel["id"],)) == 0, what="every row sent")
    assert count(db_path, "notify_outbox", "channel_id = ? AND digest_id = ?", (channel["id"],
                                                                                digest.message_id)) == 499
    move_on(app, clock)
    time.sleep(0.5)
    assert len(rx.requests) == 2, "at most two messages, never 500"


def test_a_failing_receiver_is_not_hammered_during_a_storm(world, alice, client, clock, app, db_path, receivers):
    """A receiver that answers 500 while deliveries keep coming: the failed message waits for its backoff (and
    the rest for the rate window), keeps its id when retried, and nothing is given up in a burst."""
    rx = receivers(then=500)
    channel = add_channel(client, alice, "webhook", rx.url("/down"), ["held"])
    owner = world.endpoint(alice, ["triage"], name="router")
    hook = world.webhook(alice, owner, "github", trusted_actors=None)
    held_delivery(world, hook, 1)
    [failed] = rx.wait_for(1)
    eventually(lambda: outbox(db_path, channel["id"])[0]["attempts"] == 1, what="the first failure recorded")
    for number in range(2, 52):
        held_delivery(world, hook, number)
    time.sleep(0.5)
    assert len(rx.requests) == 1, (
        f"{len(rx.requests)} requests reached a failing receiver before its backoff or the rate window ended"
        f" ({len({r.message_id for r in rx.requests})} message ids)")
    assert count(db_path, "notify_outbox", "channel_id = ? AND gave_up_at IS NOT NULL", (channel["id"],)) == 0

    rx.then = 200  # the receiver is back
    move_on(app, clock, BACKOFF_BASE_SECONDS + 1)  # the retry falls due
    retried = rx.wait_for(2)[1]
    assert retried.message_id == failed.message_id, "a retried message keeps its id"
    assert verify_standard_webhook(channel["secret"], retried)["type"] == "held"
    eventually(lambda: next(r for r in outbox(db_path, channel["id"]) if r["id"] == failed.message_id)["sent_at"]
               is not None, what="the retry recorded")
    move_on(app, clock)  # the rate window after that success ends: the rest, as one digest
    digest = rx.wait_for(3)[2]
    assert verify_standard_webhook(channel["secret"], digest)["data"] == {"counts": {"held": 50}}
    all_sent(db_path, channel["id"])
    assert len(rx.requests) == 3


def test_a_test_message_is_sent_by_the_test_alone(world, alice, client, db_path, receivers):
    """The test message waits in the outbox while the test request sends it; the sender loop, woken meanwhile
    by other work, must not send it a second time (nor make the test request fail)."""
    rx = receivers(["hang"], then=200)
    other = receivers()
    channel = add_channel(client, alice, "ntfy", rx.url("/tested"), ["held"])
    add_channel(client, alice, "ntfy", other.url("/busy"), ["needs_input"])
    answers: list = []
    tester = threading.Thread(target=lambda: answers.append(
        client.post(f"/api/v1/notify/{channel['id']}/test", headers=alice.auth, json={})))
    tester.start()
    rx.wait_for(1)
    Work(world, alice).needs_input()  # a commit that wakes the sender while the test is in flight
    other.wait_for(1)
    tester.join(TIMEOUT + 10)
    assert not tester.is_alive()
    [answer] = answers
    assert answer.status_code == 200, answer.text
    assert answer.json()["sent"] is False and "Timeout" in answer.json()["error"]
    time.sleep(0.3)
    assert [r.message_id for r in rx.requests] == [answer.json()["id"]], "the test message was sent twice"
    [row] = outbox(db_path, channel["id"])
    assert row["event"] == "test" and row["sent_at"] is None and row["gave_up_at"] is not None


def test_a_held_back_message_goes_out_when_the_window_ends(tmp_path, monkeypatch, receivers):
    """On the real clock, with no further commit to wake it: the sender wakes itself when the window ends."""
    monkeypatch.setattr(notifier_module, "NOTIFY_RATE_SECONDS", 1.5)
    rx = receivers()
    app = create_app(str(tmp_path / "window.db"), background=True, ingest_rate=0)
    with TestClient(app) as client:
        from conftest import World
        world = World(client, app.state.db)
        alice = world.human("alice")
        add_channel(client, alice, "ntfy", rx.url("/window"), ["needs_input"])
        work = Work(world, alice)
        work.needs_input("one")
        first = rx.wait_for(1)[0]
        work.needs_input("two")
        work.needs_input("three")
        queued = time.monotonic()
        second = rx.wait_for(2, timeout=5)[1]
    assert first.headers["title"] == "Switchboard: A worker asks a question"
    assert second.at - first.at >= 1.4, "the second message waited for the window"
    assert second.at - queued < 3, "and went out when it ended, with no commit to wake the sender"
    assert second.headers["title"] == "Switchboard: 2 things need you" and second.headers["tags"] == "inbox_tray"
    assert "2 needs input" in second.body.decode()


# -- 5. a hanging receiver -----------------------------------------------------------------------------

def test_a_hanging_receiver_delays_no_other_channel_and_fails_with_backoff(world, alice, client, clock, app,
                                                                           db_path, receivers):
    stuck = receivers(then="hang")
    fine = receivers()
    hanging = add_channel(client, alice, "gotify", stuck.url("/gotify"), ["needs_input"], "gotify-app-token")
    prompt = add_channel(client, alice, "ntfy", fine.url("/prompt"), ["needs_input"])
    work = Work(world, alice)
    started = time.monotonic()
    work.needs_input()
    [arrived] = fine.wait_for(1, timeout=TIMEOUT)
    assert arrived.at - started < TIMEOUT - 0.5, "the other channel's message did not wait for the hanging one"
    stuck.wait_for(1)

    failed = eventually(lambda: channels_of(client, alice)[hanging["id"]]["last_error"], TIMEOUT + 8,
                        "the hanging channel's failure")
    assert time.monotonic() - started >= TIMEOUT - 0.1
    assert "Timeout" in failed
    listed = channels_of(client, alice)
    assert listed[hanging["id"]]["failures"] == 1 and listed[hanging["id"]]["last_error_at"] is not None
    assert listed[prompt["id"]]["last_error"] is None and listed[prompt["id"]]["last_sent_at"] is not None
    metrics = client.get("/metrics").text
    assert 'switchboard_notify_failures_total{kind="gotify"} 1.0' in metrics
    assert 'switchboard_notify_sent_total{kind="ntfy"} 1.0' in metrics
    [row] = outbox(db_path, hanging["id"])
    assert row["attempts"] == 1 and row["sent_at"] is None and row["gave_up_at"] is None
    assert row["next_at"] == clock.ms + BACKOFF_BASE_SECONDS * 1000

    first_retry_at = row["next_at"]
    move_on(app, clock, BACKOFF_BASE_SECONDS + 1)
    stuck.wait_for(2)
    [row] = eventually(lambda: [r for r in outbox(db_path, hanging["id"]) if r["attempts"] == 2], TIMEOUT + 8,
                       "the second failure")
    assert row["next_at"] == clock.ms + 2 * BACKOFF_BASE_SECONDS * 1000 > first_retry_at
    assert stuck.requests[0].message_id == stuck.requests[1].message_id == row["id"]
    assert channels_of(client, alice)[hanging["id"]]["failures"] == 2
    assert 'switchboard_notify_failures_total{kind="gotify"} 2.0' in client.get("/metrics").text
    assert len(fine.requests) == 1


# -- 6. validation, ownership, the test message, the CLI -----------------------------------------------

BAD_CHANNELS = {
    "file": {"kind": "ntfy", "url": "file:///etc/passwd", "events": ["held"]},
    "ftp": {"kind": "ntfy", "url": "ftp://ntfy.example/topic", "events": ["held"]},
    "no-scheme": {"kind": "ntfy", "url": "ntfy.example/topic", "events": ["held"]},
    "javascript": {"kind": "ntfy", "url": "javascript:alert(1)", "events": ["held"]},
    "no-host": {"kind": "ntfy", "url": "http://", "events": ["held"]},
    "unknown-kind": {"kind": "pagerduty", "url": "https://ntfy.example/topic", "events": ["held"]},
    "unknown-event": {"kind": "ntfy", "url": "https://ntfy.example/topic", "events": ["created"]},
    "empty-events": {"kind": "ntfy", "url": "https://ntfy.example/topic", "events": []},
    "no-events": {"kind": "ntfy", "url": "https://ntfy.example/topic"},
    "gotify-without-token": {"kind": "gotify", "url": "https://gotify.example", "events": ["held"]},
    "slack-with-token": {"kind": "slack", "url": "https://hooks.slack.example/services/x", "events": ["held"],
                         "token": "t"},
    "discord-with-token": {"kind": "discord", "url": "https://discord.example/api/webhooks/1/x", "events": ["held"],
                           "token": "t"},
    "webhook-with-token": {"kind": "webhook", "url": "https://receiver.example/x", "events": ["held"],
                           "token": "whsec_AAAA"},
}


def refusals(client, human, bodies: dict[str, dict]) -> dict[str, tuple[int, str]]:
    """The bodies POST /api/v1/notify did not refuse with 400 invalid_argument, with the answer it gave."""
    answers = {name: client.post("/api/v1/notify", headers=human.auth, json=body) for name, body in bodies.items()}
    return {name: (r.status_code, r.text) for name, r in answers.items()
            if r.status_code != 400 or r.json().get("error") != "invalid_argument"}


def test_a_bad_channel_is_refused(client, alice, db_path):
    assert refusals(client, alice, BAD_CHANNELS) == {}
    assert count(db_path, "notify_channels") == 0
    good = client.post("/api/v1/notify", headers=alice.auth, json={**BAD_CHANNELS["ftp"], "url": "https://n.example/t"})
    assert good.status_code == 201, "the same body with an https URL is accepted"


def test_a_malformed_http_url_is_refused_not_a_server_error(client, alice, db_path):
    urls = {"port-out-of-range": "http://127.0.0.1:99999/topic", "broken-ipv6": "http://[::1/topic",
            "port-not-a-number": "http://ntfy.example:abc/t", "no-host": "http://user:pass@/topic"}
    assert refusals(client, alice, {name: {"kind": "ntfy", "url": url, "events": ["held"]}
                                    for name, url in urls.items()}) == {}
    assert count(db_path, "notify_channels") == 0


def test_channels_belong_to_their_human(world, alice, client, db_path, receivers):
    rx = receivers()
    ok = add_channel(client, alice, "ntfy", "https://ntfy.example/topic", ["held"], token="tk_x")
    assert ok["url"] == "https://ntfy.example/…"
    live = add_channel(client, alice, "ntfy", rx.url("/test-topic"), ["held"])
    dead = add_channel(client, alice, "slack", f"http://127.0.0.1:{free_port()}/services/x", ["held"])
    bob = world.human("bob")
    endpoint = world.endpoint(alice, ["build"])
    # Another human sees none of them and can touch none of them.
    assert channels_of(client, bob) == {}
    assert client.delete(f"/api/v1/notify/{live['id']}", headers=bob.auth).status_code == 404
    assert client.post(f"/api/v1/notify/{live['id']}/test", headers=bob.auth, json={}).status_code == 404
    # An endpoint token is not a human.
    assert client.get("/api/v1/notify", headers=endpoint.auth).status_code == 403
    assert client.post("/api/v1/notify", headers=endpoint.auth, json={
        "kind": "ntfy", "url": "https://ntfy.example/t", "events": ["held"]}).status_code == 403
    assert client.delete(f"/api/v1/notify/{live['id']}", headers=endpoint.auth).status_code == 403
    assert client.post(f"/api/v1/notify/{live['id']}/test", headers=endpoint.auth, json={}).status_code == 403
    assert client.get("/api/v1/notify").status_code == 401
    assert count(db_path, "notify_channels") == 3 and rx.requests == []

    # The test message: sent now, answered with how it went.
    r = client.post(f"/api/v1/notify/{live['id']}/test", headers=alice.auth, json={})
    assert r.status_code == 200 and r.json()["sent"] is True and r.json()["error"] is None, r.text
    [test] = rx.wait_for(1)
    assert test.headers["title"] == "Switchboard: Switchboard test message" and test.message_id == r.json()["id"]
    r = client.post(f"/api/v1/notify/{dead['id']}/test", headers=alice.auth, json={})
    assert r.status_code == 200 and r.json()["sent"] is False and r.json()["error"], r.text
    assert channels_of(client, alice)[dead["id"]]["last_error"] == r.json()["error"]
    assert [row["gave_up_at"] is not None for row in outbox(db_path, dead["id"])] == [True], \
        "a failed test message is not retried"

    # DELETE removes (and its outbox with it); a second DELETE finds nothing.
    r = client.delete(f"/api/v1/notify/{live['id']}", headers=alice.auth)
    assert r.status_code == 200 and r.json()["removed"] is True
    assert set(channels_of(client, alice)) == {ok["id"], dead["id"]}
    assert client.delete(f"/api/v1/notify/{live['id']}", headers=alice.auth).status_code == 404
    assert outbox(db_path, live["id"]) == []


def test_notify_through_the_cli(db_path, receivers):
    rx = receivers()
    assert cli(db_path, "human", "add", "alice")[0] == 0
    code, made = cli(db_path, "notify", "add", "--human", "alice", "--kind", "ntfy", "--url", rx.url("/cli-topic"),
                     "--events", "held", "--token", "tk_cli_token")
    assert code == 0 and made["id"].startswith("nc_") and made["events"] == ["held"], made
    assert made["url"] == f"http://127.0.0.1:{rx.port}/…" and "tk_cli_token" not in json.dumps(made)
    code, signed = cli(db_path, "notify", "add", "--human", "alice", "--kind", "webhook", "--url",
                       rx.url("/cli-hook"), "--events", "held,review")
    assert code == 0 and signed["secret"].startswith("whsec_") and signed["events"] == ["held", "review"]
    code, listed = cli(db_path, "notify", "list")
    assert code == 0 and {c["id"] for c in listed["channels"]} == {made["id"], signed["id"]}
    text = json.dumps(listed)
    assert "tk_cli_token" not in text and signed["secret"] not in text and "cli-topic" not in text
    code, tested = cli(db_path, "notify", "test", made["id"])
    assert code == 0 and tested["sent"] is True and tested["channel_id"] == made["id"], tested
    [request] = rx.wait_for(1)
    assert request.path == "/cli-topic" and request.headers["authorization"] == "Bearer tk_cli_token"
    assert request.message_id == tested["id"] and request.headers["title"] == "Switchboard: Switchboard test message"
    code, removed = cli(db_path, "notify", "remove", made["id"])
    assert code == 0 and removed["removed"] is True
    assert query(db_path, "SELECT id FROM notify_channels") == [(signed["id"],)]
    code, refused = cli(db_path, "notify", "add", "--human", "alice", "--kind", "ntfy", "--url", "file:///etc/x",
                        "--events", "held")
    assert code == 1 and refused["error"] == "invalid_argument"
