"""No credential ever reaches the server's log (issue 26 item 4): a real `serve` process goes through a session
that makes every kind of secret there is — human and endpoint tokens, webhook URLs and secrets (made, rotated,
set by hand), lease tokens, a Board session, notification channels of every kind with their credentials in the
URL's path, query, user and password or in a token — sends to each channel (successes and failures), and then
the whole log, from start to exit, is searched for every one of them.

To cover a new kind of credential (a forge token, a model token): add a step to SESSION that makes it through
the real server and calls `session.secrets.add(kind, value)`, and add its kind to KINDS."""

from __future__ import annotations

import base64
import collections
import http.server
import re
import secrets
import threading
import time
import types
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import producers
import pytest
from conftest import LiveServer, cli, free_port
from helpers import hook_token, make_webhook, post_delivery

from switchboard.configuration import NOTIFY_EVENTS

# Every kind of credential the session must have made (and the log must hold none of).
KINDS = {"human_token", "endpoint_token", "webhook_url", "webhook_secret", "lease_token", "board_session",
         "board_csrf", "ntfy_token", "ntfy_topic", "ntfy_password", "ntfy_query_auth", "slack_url", "discord_url",
         "gotify_token", "gotify_url", "webhook_channel_url", "webhook_channel_secret"}


@dataclass
class Secrets:
    """Every credential the session made or was given, by kind, collected as they are made."""
    found: dict[str, list[str]] = field(default_factory=lambda: collections.defaultdict(list))

    def add(self, kind: str, *values: str) -> None:
        for value in values:
            assert isinstance(value, str) and len(value) >= 8, f"{kind}: {value!r} is too short to search for"
            self.found[kind].append(value)

    def in_text(self, text: str) -> list[str]:
        """Each secret that `text` holds, as it is or URL-encoded, named by its kind."""
        leaks = []
        for kind, values in self.found.items():
            for value in values:
                if any(form in text for form in {value, urllib.parse.quote(value, safe="")}):
                    leaks.append(f"{kind}: {value[:12]}…")
        return leaks


class Receiver:
    """A threaded HTTP server on loopback answering each POST 200, or 500 when its path has `/fail/` in it."""

    def __init__(self):
        self.paths: list[str] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.paths.append(self.path)
                self.send_response(500 if "/fail/" in self.path else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Session:
    db_path: str
    http: httpx.Client
    server: LiveServer
    receiver: Receiver
    secrets: Secrets
    human: types.SimpleNamespace
    endpoint: dict = field(default_factory=dict)
    channels: list[str] = field(default_factory=list)
    todo_id: str = ""
    lease: str = ""
    board_channel_path: str = ""


def secret_part() -> str:
    return secrets.token_hex(12)


# -- the session's steps, in order -----------------------------------------------------------------------------

def principals(session: Session) -> None:
    r = session.http.post("/api/v1/endpoints", headers=session.human.auth, json={"name": "worker",
                                                                               "queues": ["triage", "build"]})
    assert r.status_code == 201, r.text
    session.endpoint = r.json()
    session.secrets.add("endpoint_token", session.endpoint["token"])


def webhooks_and_deliveries(session: Session) -> None:
    http, add = session.http, session.secrets.add
    hook = make_webhook(http, session.human, session.endpoint["id"], "github", queue="triage")
    add("webhook_url", hook["url"], hook_token(hook["url"]))
    add("webhook_secret", hook["secret"])
    assert post_delivery(http, hook, *producers.github("issues.opened", hook["secret"])).status_code == 202
    forged = producers.github("issues.opened", "not-the-secret")
    assert post_delivery(http, hook, *forged).status_code == 401
    rotated = http.post(f"/api/v1/webhooks/{hook['id']}/rotate", headers=session.human.auth, json={})
    assert rotated.status_code == 200, rotated.text
    add("webhook_url", rotated.json()["url"], hook_token(rotated.json()["url"]))
    add("webhook_secret", rotated.json()["secret"])
    assert post_delivery(http, hook, *producers.github("issues.opened", hook["secret"])).status_code == 404
    given = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    stripe = make_webhook(http, session.human, session.endpoint["id"], "stripe", queue="triage", secret=given)
    add("webhook_url", stripe["url"], hook_token(stripe["url"]))
    add("webhook_secret", given)
    event = {"id": "evt_1", "type": "charge.succeeded", "data": {"object": {"id": "ch_1"}}}
    assert post_delivery(http, stripe, *producers.stripe(given, event)).status_code == 202
    assert post_delivery(http, stripe, *producers.stripe("whsec_wrong0wrong0wrong", event)).status_code == 401
    replaced = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    r = http.put(f"/api/v1/webhooks/{stripe['id']}/secret", headers=session.human.auth, json={"secret": replaced})
    assert r.status_code == 200, r.text
    add("webhook_secret", replaced)


def leases(session: Session) -> None:
    http, worker = session.http, {"Authorization": f"Bearer {session.endpoint['token']}"}
    todo = http.post(f"/api/v1/endpoints/{session.endpoint['id']}/todos", headers=session.human.auth,
                     json={"title": "needs a human", "queue": "build"}).json()
    claimed = http.post(f"/api/v1/todos/{todo['id']}/claim", headers=worker, json={})
    assert claimed.status_code == 200, claimed.text
    lease = claimed.json()["lease_token"]
    session.secrets.add("lease_token", lease)
    assert http.post(f"/api/v1/todos/{todo['id']}/heartbeat", headers=worker,
                     json={"lease_token": lease}).status_code == 200
    assert http.post(f"/api/v1/todos/{todo['id']}/heartbeat", headers=worker,
                     json={"lease_token": "wrong-" + lease}).status_code in (400, 403, 409)
    session.todo_id, session.lease = todo["id"], lease


def board(session: Session) -> None:
    http, origin = session.http, {"Origin": session.server.url}
    signed_in = http.post("/board/login", data={"token": session.human.token}, headers=origin)
    assert signed_in.status_code == 303, signed_in.text
    session.secrets.add("board_session", http.cookies["switchboard_board"])
    page = http.get("/board/notify")
    assert page.status_code == 200, page.text
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
    session.secrets.add("board_csrf", csrf)
    path = f"/api/webhooks/{secret_part()}/{secret_part()}"
    added = http.post("/board/notify/add", headers=origin, data={
        "csrf": csrf, "kind": "discord", "url": session.receiver.base + path, "ev_needs_input": "on"})
    assert added.status_code == 303, added.text
    session.secrets.add("discord_url", session.receiver.base + path, path.rsplit("/", 1)[1])
    session.board_channel_path = path
    assert http.post("/board/login", data={"token": "sbh_" + "0" * 40}, headers=origin).status_code in (303, 401)


def channels_and_sends(session: Session) -> None:
    http, add, base = session.http, session.secrets.add, session.receiver.base
    closed = f"http://127.0.0.1:{free_port()}"

    def channel(kind: str, url: str, token: str | None = None) -> dict:
        body = {"kind": kind, "url": url, "events": list(NOTIFY_EVENTS), **({"token": token} if token else {})}
        r = http.post("/api/v1/notify", headers=session.human.auth, json=body)
        assert r.status_code == 201, r.text
        session.channels.append(r.json()["id"])
        return r.json()

    topic, token = secret_part(), "tk_" + secret_part()
    channel("ntfy", f"{base}/{topic}", token)
    add("ntfy_topic", topic)
    add("ntfy_token", token)
    user, password = "user" + secret_part()[:6], secret_part()
    channel("ntfy", f"http://{user}:{password}@{base.removeprefix('http://')}/{secret_part()}")
    add("ntfy_password", password)
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    channel("ntfy", f"{base}/fail/{secret_part()}?auth={auth}")
    add("ntfy_query_auth", auth)
    for kind, path in (("slack", f"/services/T{secret_part()}/B{secret_part()}/{secret_part()}"),
                       ("slack", f"/fail/services/{secret_part()}"), ("discord", f"/api/webhooks/1/{secret_part()}")):
        for url in (base + path, closed + path):
            channel(kind, url)
            add(f"{kind}_url", url, path.rsplit("/", 1)[1])
    gotify_token, gotify_path = "A" + secret_part(), f"/{secret_part()}"
    channel("gotify", base + gotify_path, gotify_token)
    add("gotify_token", gotify_token)
    add("gotify_url", base + gotify_path, gotify_path[1:])
    for url in (f"{base}/hooks/{secret_part()}", f"{closed}/hooks/{secret_part()}"):
        made = channel("webhook", url)
        add("webhook_channel_url", url, url.rsplit("/", 1)[1])
        add("webhook_channel_secret", made["secret"], made["secret"].removeprefix("whsec_"))

    answers = [http.post(f"/api/v1/notify/{c}/test", headers=session.human.auth, json={})
               for c in session.channels]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    outcomes = collections.Counter(a.json()["sent"] for a in answers)
    assert outcomes[True] >= 5 and outcomes[False] >= 5, outcomes  # failures log a line each
    # A todo that needs its human: the sender loop tells every channel not sent to in the last 30 s, the one the
    # Board added among them.
    worker = {"Authorization": f"Bearer {session.endpoint['token']}"}
    asked = http.post(f"/api/v1/todos/{session.todo_id}/needs-input", headers=worker,
                      json={"lease_token": session.lease, "question": "which branch?"})
    assert asked.status_code == 200, asked.text
    deadline = time.monotonic() + 10
    while session.board_channel_path not in session.receiver.paths:
        assert time.monotonic() < deadline, "the sender loop's message to the Board's channel"
        time.sleep(0.05)


SESSION: list[Callable[[Session], None]] = [principals, webhooks_and_deliveries, leases, board, channels_and_sends]


@pytest.fixture
def receiver():
    made = Receiver()
    yield made
    made.close()


def test_no_secret_of_any_kind_reaches_the_server_log(db_path, receiver):
    found = Secrets()
    assert cli(db_path, "init")[0] == 0
    code, alice = cli(db_path, "human", "add", "alice")
    assert code == 0
    found.add("human_token", alice["token"])
    server = LiveServer(db_path, "--notify-allow-private", "--ingest-rate", "0")
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            session = Session(db_path, http, server, receiver, found, types.SimpleNamespace(
                token=alice["token"], auth={"Authorization": f"Bearer {alice['token']}"}))
            for step in SESSION:
                step(session)
    finally:
        server.stop()
    assert server.proc.returncode == 0
    assert set(found.found) == KINDS, f"kinds made: {sorted(found.found)}; expected {sorted(KINDS)}"
    log = server.log_path.read_text(errors="replace")
    # The log is not empty of what was done: deliveries, refusals, failed sends are all there...
    for line in ("delivery ev_", "delivery refused", "notification channel nc_", "failed: HTTP 500",
                 "failed: ConnectError"):
        assert line in log, f"expected a line with {line!r} in the log"
    # ...and holds none of the credentials.
    assert found.in_text(log) == [], "\n".join(found.in_text(log))
