"""Hardening (the issue of that name): payload depth, slow and unknown bodies, the shared body budget, slowloris,
each owner's share of the evaluator, hostile rule texts, untrusted child answers, arbitrary bytes in signature
headers, reroute onto a live idempotency key, evaluator children dying with the server, a writer that outlives
its callers, vitals, file modes, the MCP Origin check and bidirectional marks in titles.

What is about the server runs against a real server: `python switchboard.py serve` (conftest's `live_server`),
or `PatchedServer` below, which runs the very same `switchboard.main(["serve", ...])` in a child process whose
module constants were changed first, so that deadlines of 10 s can be watched in 2 or 4."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import select
import signal
import socket
import stat
import threading
import time
import uuid
from pathlib import Path

import httpx
import producers
import pytest
import uvicorn
from conftest import ROOT, LiveServer, cli, free_port, snapshot
from helpers import TLS, connect_db
from starlette.testclient import TestClient

import switchboard.evaluator as evaluator_module
import switchboard.flows as flows_module
import switchboard.http.rest as http_rest_module
from switchboard.app import create_app
from switchboard.configuration import ApiError
from switchboard.crypto import SecretBox, sealed_sample
from switchboard.database import Database
from switchboard.engines import open_database
from switchboard.evaluator import EVALUATOR_CHILD, Evaluator, _read_reply
from switchboard.models import EndpointCreate, Rule, WebhookCreate
from switchboard.providers import VerificationFailed, verify_delivery
from switchboard.store.principals import OPERATOR, add_human, list_humans, vend_endpoint
from switchboard.store.rules import save_rules
from switchboard.store.webhooks import create_webhook

# -- helpers ---------------------------------------------------------------------------------------------

class Halt(BaseException):
    """A BaseException that is neither Exception nor one that stops the interpreter (SystemExit, KeyboardInterrupt):
    what a part that `except Exception` would not survive."""


@pytest.fixture
def router(world, alice):
    return world.endpoint(alice, ["triage", "build"], name="router", verbs=["all"])


FORGES = ("github", "gitea", "cairn")


def trust_all(provider: str) -> dict:
    """A forge or cairn webhook holds everything until told whom to trust; these tests trust everyone."""
    return {"trusted_actors": {"allow_all": True}} if provider in FORGES else {}


def make_hook(world, human, endpoint, provider="github", queue="triage", **extra) -> dict:
    r = world.client.post("/api/v1/webhooks", headers=human.auth,
                          json={"provider": provider, "queue": queue, "endpoint_id": endpoint.id,
                                **trust_all(provider), **extra})
    assert r.status_code == 201, r.text
    return r.json()


def post(world, hook, body: bytes, headers: dict) -> httpx.Response:
    return world.client.post(hook["url"].removeprefix("http://testserver"), content=body, headers=headers)


def github_headers(secret: str, raw: bytes, event: str = "issues", content_type: str = "application/json") -> dict:
    return {"X-GitHub-Event": event, "X-GitHub-Delivery": str(uuid.uuid4()), "Content-Type": content_type,
            "X-Hub-Signature-256": "sha256=" + producers.hex_hmac(secret, raw)}


def seed(db_path: str, human: str = "alice", provider: str = "generic", queues: tuple[str, ...] = ("triage",),
         rules: list[dict] | None = None) -> dict:
    """A human, an endpoint and a webhook written straight into the database file (before or while a server runs
    on it), through the store's own functions; `rules` are stored as given (no dry run)."""
    db = open_database(db_path)
    try:
        made = db.write_sync(add_human, human)
        endpoint = db.write_sync(vend_endpoint, made["id"],
                                 EndpointCreate(name=f"{human}-router", queues=list(queues), verbs=["all"]))
        box = SecretBox.for_database(db_path, db.read_sync(sealed_sample))
        hook = db.write_sync(create_webhook, OPERATOR, box,
                             WebhookCreate.model_validate({"provider": provider, "queue": queues[0],
                                                              "endpoint_id": endpoint["id"], **trust_all(provider)}),
                             "http://unused")
        if rules:
            db.write_sync(save_rules, OPERATOR, hook["id"], [Rule.model_validate(r) for r in rules], None,
                          None)
    finally:
        db.close()
    return {"human": made, "auth": {"Authorization": f"Bearer {made['token']}"}, "endpoint": endpoint,
            "hook": hook, "path": "/hooks/" + hook["url"].rsplit("/hooks/", 1)[1]}


def http_request(method: str, path: str, headers: list[tuple[bytes | str, bytes | str]] = (), body: bytes = b"",
                 content_length: int | None = None, close: bool = True) -> bytes:
    """An HTTP/1.1 request as bytes, header values exactly as given (any byte at all)."""
    def raw(value: bytes | str) -> bytes:
        return value if isinstance(value, bytes) else value.encode()
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1"]
    if close:
        lines.append(b"Connection: close")
    lines += [raw(name) + b": " + raw(value) for name, value in headers]
    lines.append(b"Content-Length: " + str(len(body) if content_length is None else content_length).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def read_response(sock: socket.socket, timeout: float = 10.0) -> tuple[int, bytes, bytes]:
    """(status, head, body) of one response; the body as far as Content-Length says."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), f"no HTTP answer: {data[:200]!r}"
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    while length and len(body) < int(length.group(1)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split(b" ", 2)[1]), head, body


def raw_exchange(port: int, request: bytes, timeout: float = 10.0) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        status, _, body = read_response(sock, timeout)
        return status, body


def readable(socks, timeout: float) -> list[socket.socket]:
    """The sockets with something to read (or closed), by poll: hundreds of descriptors are no problem."""
    poller = select.poll()
    by_fd = {sock.fileno(): sock for sock in socks}
    for fd in by_fd:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return [by_fd[fd] for fd, _ in poller.poll(int(timeout * 1000))]


def closed_by_peer(sock: socket.socket) -> bool:
    """After select said readable: whether the server closed the connection (EOF or reset)."""
    try:
        return sock.recv(4096) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


class PatchedServer(LiveServer):
    """`serve` as `python switchboard.py serve` runs it (the CLI's main), in a child process, after `patch`
    (Python code) changed some constants or functions in the modules that read them."""

    def __init__(self, db_path: str, patch: str, *, wait: bool = True, env: dict | None = None):
        code = (f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom switchboard.cli.parser import main\n{patch}\n"
                f"sys.exit(main(sys.argv[1:]))\n")
        super().__init__(db_path, program=("-c", code), env=env, wait=wait)


@pytest.fixture
def patched_server(tmp_path):
    servers: list[PatchedServer] = []

    def start(patch: str, **kwargs) -> PatchedServer:
        server = PatchedServer(str(tmp_path / "switchboard.db"), patch, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


QUICK_HEADER_SECONDS = 4.0
QUICK_BODY_SECONDS = 2.0


@pytest.fixture(scope="module")
def quick_server(tmp_path_factory):
    """One served process for the socket-level tests, with the header deadline at 4 s and the body deadline at
    2 s (10 s each in production), so that both can be watched expiring."""
    db_path = str(tmp_path_factory.mktemp("quick") / "switchboard.db")
    server = PatchedServer(db_path, "import switchboard.server, switchboard.http.common\n"
                                    f"switchboard.server.HEADER_SECONDS = {QUICK_HEADER_SECONDS}\n"
                                    f"switchboard.http.common.BODY_SECONDS = {QUICK_BODY_SECONDS}\n")
    yield server
    server.stop()


class InProcessServer:
    """uvicorn serving an app of this process on a loopback port, so that a test can look inside the app while
    real sockets talk to it."""

    def __init__(self, app):
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None,
                                                   access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "in-process server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


# -- 1. depth ----------------------------------------------------------------------------------------------

def nested_github_body(containers: int, innermost: str = "0") -> bytes:
    """An issues delivery whose JSON nests `containers` containers deep: the object, then arrays."""
    arrays = containers - 1
    return b'{"action":"opened","x":' + b"[" * arrays + innermost.encode() + b"]" * arrays + b"}"


def test_a_970_deep_delivery_is_kept_with_payload_null_and_its_todo_reads(world, alice, router):
    hook = make_hook(world, alice, router)
    raw = nested_github_body(971)
    r = post(world, hook, raw, github_headers(hook["secret"], raw))
    assert r.status_code == 202, r.text
    answer = r.json()
    assert answer["payload_error"] == "too_deep" and answer["verified"] is True and answer["created"] == 1
    event = world.client.get(f"/api/v1/events/{answer['event_id']}", headers=alice.auth)
    assert event.status_code == 200 and event.json()["trace"]["payload_error"] == "too_deep"
    assert event.json()["envelope"]["payload"] is None
    todo_id = answer["todos"][0]["id"]
    got = world.client.get(f"/api/v1/todos/{todo_id}", headers=alice.auth)
    assert got.status_code == 200 and got.json()["payload"] is None
    listed = world.client.get("/api/v1/todos", headers=router.auth)
    assert listed.status_code == 200 and [t["id"] for t in listed.json()["todos"]] == [todo_id]
    claimed = world.client.post("/api/v1/todos/claim", headers=router.auth, json={})
    assert claimed.status_code == 200, claimed.text
    assert claimed.json()["todo"]["id"] == todo_id and claimed.json()["lease_token"]
    assert claimed.json()["todo"]["payload"] is None


@pytest.mark.parametrize("innermost", ["0", '{"k":1}', ""], ids=["scalar", "object", "empty"])
def test_the_depth_boundary_is_128_containers(world, alice, router, innermost):
    """Containers nested 128 deep are kept; 129 deep is too_deep, whatever the innermost container holds."""
    hook = make_hook(world, alice, router)
    extra = 1 if innermost.startswith("{") else 0  # an innermost object is one more container
    kept = nested_github_body(128 - extra, innermost)
    r = post(world, hook, kept, github_headers(hook["secret"], kept))
    assert r.status_code == 202 and "payload_error" not in r.json(), r.text
    todo = world.client.get(f"/api/v1/todos/{r.json()['todos'][0]['id']}", headers=alice.auth).json()
    assert todo["payload"] == json.loads(kept)
    deep = nested_github_body(129 - extra, innermost)
    r = post(world, hook, deep, github_headers(hook["secret"], deep))
    assert r.status_code == 202, r.text
    assert r.json().get("payload_error") == "too_deep", f"129 containers deep (innermost {innermost!r}) is kept"
    todo = world.client.get(f"/api/v1/todos/{r.json()['todos'][0]['id']}", headers=alice.auth).json()
    assert todo["payload"] is None


def test_a_stored_payload_5000_deep_still_reads_lists_and_claims(world, alice, router, db_path):
    todo = world.push(alice, router, "build", title="old row", payload={"fine": True})
    conn = connect_db(db_path)
    try:
        # An old SQLite database may hold what today's CHECK (json_valid, at most 1,000 deep there) would refuse;
        # Postgres's check takes 5,000 deep as it is.
        if not db_path.startswith("postgresql://"):
            conn.execute("PRAGMA ignore_check_constraints = ON")
        conn.execute("UPDATE todos SET payload = ? WHERE id = ?", ("[" * 5000 + "]" * 5000, todo["id"]))
        conn.commit()
    finally:
        conn.close()
    got = world.client.get(f"/api/v1/todos/{todo['id']}", headers=alice.auth)
    assert got.status_code == 200 and got.json()["payload"] is None
    assert world.client.get("/api/v1/todos", headers=alice.auth).status_code == 200
    listed = world.client.get("/api/v1/todos", headers=router.auth)
    assert listed.status_code == 200 and listed.json()["todos"][0]["payload"] is None
    claimed = world.client.post("/api/v1/todos/claim", headers=router.auth, json={"queue": "build"})
    assert claimed.status_code == 200, claimed.text
    assert claimed.json()["todo"]["id"] == todo["id"] and claimed.json()["lease_token"]


# -- 2. slow and unknown bodies ---------------------------------------------------------------------------

def test_an_unknown_url_is_answered_404_before_its_body(quick_server):
    request = http_request("POST", "/hooks/" + "x" * 22, [("Content-Type", "application/json")],
                           body=b"{" + b" " * 999, content_length=5_000_000)
    # A server that read the body first would answer 408 at the body deadline (the body never completes).
    status, body = raw_exchange(quick_server.port, request, timeout=QUICK_BODY_SECONDS + 8)
    assert status == 404, body
    assert json.loads(body)["error"] == "not_found"


def test_a_body_that_stops_or_trickles_is_408_at_the_body_deadline(quick_server):
    made = seed(quick_server.db_path, "slowpoke")
    for trickle in (False, True):
        with socket.create_connection(("127.0.0.1", quick_server.port), timeout=15) as sock:
            sock.sendall(http_request("POST", made["path"], [("X-Delivery-Id", f"slow-{trickle}")],
                                      body=b'{"a": ', content_length=1000))
            started = time.monotonic()
            # Trickling keeps bytes coming: the deadline is for the whole body, not for a quiet spell.
            while trickle and not readable([sock], 0.3):
                if time.monotonic() - started > QUICK_BODY_SECONDS + 5:
                    break
                sock.sendall(b" ")
            status, head, body = read_response(sock, timeout=QUICK_BODY_SECONDS + 5)
            elapsed = time.monotonic() - started
            assert status == 408, (trickle, body)
            assert b"connection: close" in head.lower()
            assert elapsed < QUICK_BODY_SECONDS + 4, f"408 only after {elapsed:.1f} s"
            assert readable([sock], 3) and closed_by_peer(sock), "the connection is closed"
    # Nothing was recorded for the two refused bodies.
    conn = connect_db(quick_server.db_path)
    assert conn.execute("SELECT count(*) FROM events WHERE webhook_id = ?", (made["hook"]["id"],)).fetchone()[0] == 0


def test_bodies_in_flight_share_one_budget(db_path, monkeypatch):
    monkeypatch.setattr(http_rest_module, "INGEST_BUFFER_BYTES", 100_000)
    app = create_app(db_path, background=False)
    server = InProcessServer(app)
    budget = app.state.api.ingest_buffer
    sockets: list[socket.socket] = []
    try:
        assert budget.limit == 100_000
        made = seed(db_path, "alice")

        def opened(delivery: str, length: int, first: bytes) -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            sockets.append(sock)
            sock.sendall(http_request("POST", made["path"], [("X-Delivery-Id", delivery)], first,
                                      content_length=length))
            return sock

        def wait_held(predicate, why: str) -> None:
            deadline = time.monotonic() + 10
            while not predicate(budget.held):
                assert time.monotonic() < deadline, f"{why}: held {budget.held}"
                time.sleep(0.01)

        body = b'"' + b"x" * 79_998 + b'"'
        first = opened("first", len(body), body[:60_000])
        wait_held(lambda held: held >= 60_000, "the first body's bytes are held")
        second = opened("second", len(body), body)
        status, _, answer = read_response(second)
        assert status == 503 and "in flight" in json.loads(answer)["message"], answer
        first.sendall(body[60_000:])
        status, _, answer = read_response(first)
        assert status == 202 and json.loads(answer)["disposition"] == "routed", answer
        wait_held(lambda held: held == 0, "everything is given back")
        # A client that leaves halfway gives its bytes back too.
        opened("gone", len(body), body[:50_000])
        wait_held(lambda held: held >= 50_000, "the leaving body's bytes are held")
        sockets.pop().close()
        wait_held(lambda held: held == 0, "a body whose client left is given back")
        # And with the budget free again, a large body is accepted.
        again = opened("again", len(body), body)
        assert read_response(again)[0] == 202
        assert budget.held == 0
    finally:
        for sock in sockets:
            sock.close()
        server.stop()


# -- 3. slowloris ------------------------------------------------------------------------------------------

def test_half_sent_requests_hold_nothing_and_are_closed_at_the_header_deadline(quick_server):
    socks: list[socket.socket] = []
    trickler: socket.socket | None = None
    try:
        started = time.monotonic()
        for n in range(299):
            sock = socket.create_connection(("127.0.0.1", quick_server.port), timeout=5)
            socks.append(sock)
            if n % 3:  # a partial request line or partial headers; every third sends nothing at all
                sock.sendall(b"POST /hooks/slow HTTP/1.1\r\nHost: x\r\nX-Trickle: " if n % 3 == 1 else b"GET /heal")
        trickler = socket.create_connection(("127.0.0.1", quick_server.port), timeout=5)
        trickler.sendall(b"GET /healthz HTTP/1.1\r\n")
        socks.append(trickler)
        health = httpx.get(f"{quick_server.url}/healthz", timeout=QUICK_HEADER_SECONDS - 1)
        assert health.status_code == 200 and health.text.startswith("ok")
        assert not readable(socks, 0), "all 300 were still open while /healthz answered"
        open_ = set(socks)
        deadline = started + QUICK_HEADER_SECONDS + 3
        # One header byte every 0.3 s: each byte is activity, but the header block never completes.
        next_byte = time.monotonic()
        while open_ and time.monotonic() < deadline:
            if trickler in open_ and time.monotonic() >= next_byte:
                with contextlib.suppress(OSError):
                    trickler.sendall(b"X")
                next_byte = time.monotonic() + 0.3
            for sock in readable(open_, 0.1):
                if closed_by_peer(sock):
                    open_.discard(sock)
        assert not open_, f"{len(open_)} of 300 stalled connections still open after {QUICK_HEADER_SECONDS + 3} s"
        assert httpx.get(f"{quick_server.url}/healthz", timeout=5).status_code == 200
    finally:
        for sock in socks:
            sock.close()


# -- 4. fairness -------------------------------------------------------------------------------------------

LOOP_FOREVER = "last(range(1e15)) > 0"


def test_an_owner_whose_rules_loop_does_not_starve_another(patched_server, tmp_path):
    db_path = str(tmp_path / "switchboard.db")
    a = seed(db_path, "alice", "github")
    b = seed(db_path, "bob", "github")
    # A child that overruns is killed after 0.4 s instead of 2 s, so twenty of them pass in seconds.
    server = patched_server("import switchboard.app\n"
                            "_Evaluator = switchboard.app.Evaluator\n"
                            "class Evaluator(_Evaluator):\n"
                            "    def __init__(self, *args, **kwargs):\n"
                            "        kwargs.setdefault('kill_after', 0.4)\n"
                            "        super().__init__(*args, **kwargs)\n"
                            "switchboard.app.Evaluator = Evaluator\n")
    # The looping rule is saved before any delivery exists: a save dry-runs the rules over stored deliveries.
    for who, expr in ((a, LOOP_FOREVER), (b, ".issue != null")):
        saved = httpx.put(f"{server.url}/api/v1/webhooks/{who['hook']['id']}/rules", headers=who["auth"], timeout=30,
                          json={"rules": [{"id": "rule", "expr": expr, "action": {"queue": "triage"}}]})
        assert saved.status_code == 200, saved.text

    def deliver(client: httpx.Client, who: dict, n: int) -> httpx.Response:
        raw, headers = producers.github("issues.opened", who["hook"]["secret"], {"issue": {"body": f"n{n}"}})
        return client.post(server.url + who["path"], content=raw, headers=headers)

    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=64)) as client, \
            concurrent.futures.ThreadPoolExecutor(20) as pool:
        a_calls = [pool.submit(deliver, client, a, n) for n in range(20)]
        time.sleep(0.5)  # alice's flood is in: her rules loop, and the rest of hers wait their turn
        b_answers, health = [], []
        for n in range(5):
            b_answers.append(deliver(client, b, n))
            health.append(client.get(server.url + "/healthz", timeout=10).status_code)
        a_pending_while_b_ran = sum(not call.done() for call in a_calls)
        a_answers = [call.result() for call in a_calls]
    for answer in b_answers:
        assert answer.status_code == 202 and answer.json()["disposition"] == "routed", answer.text
    assert health == [200] * 5
    assert a_pending_while_b_ran > 0, "alice's deliveries were all answered before bob's: nothing was tested"
    statuses = sorted({r.status_code for r in a_answers})
    assert set(statuses) <= {202, 503}, statuses
    held = [r.json() for r in a_answers if r.status_code == 202]
    assert all(o["disposition"] == "quarantined" and o["held"] for o in held), held
    assert held, "at least one of alice's deliveries was evaluated (and held)"
    trace = httpx.get(f"{server.url}/api/v1/events/{held[0]['event_id']}", headers=a["auth"]).json()["trace"]
    assert trace["stage"] == "fault" and trace["cause"] == "timeout"


# -- 5. hostile rule texts ---------------------------------------------------------------------------------

def put_rules(world, human, hook, rules: list[dict]) -> httpx.Response:
    return world.client.put(f"/api/v1/webhooks/{hook['id']}/rules", headers=human.auth, json={"rules": rules})


@pytest.mark.parametrize("expr, named", [
    ("false # \\", "backslash"),
    ("false # \\\r\n| true", "backslash"),
    ("false # a comment that runs on \\\n| true", "backslash"),
    ('"x" | now', "now"),
    # A quote inside a comment is not a string: `now` below is code, and jq runs it.
    ('true # "\n| now > 0 # "', "now"),
    ('"\\(now)" | length > 0', "now"),
    ('"a\\("b\\(now)c")d" | length > 0', "now"),
    ('"\\($__loc__)" | length > 0', "$__loc__"),
    ('$__loc__ | .line > 0', "$__loc__"),
    ('"\\($ENV.HOME)" | length > 0', "$ENV"),
    ('"\\(input_filename)" | length > 0', "input_filename"),
    ('"\\(env)" | length > 0', "env"),
])
def test_hostile_rule_texts_are_refused_naming_the_problem(world, alice, router, expr, named):
    hook = make_hook(world, alice, router)
    before = world.client.get(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth).json()
    r = put_rules(world, alice, hook, [{"id": "a", "expr": "false", "action": {"drop": True}},
                                       {"id": "b", "expr": expr, "action": {"queue": "build"}}])
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["error"] == "invalid_argument"
    assert "rules[1] (id 'b')" in body["message"] and named in body["message"], body["message"]
    assert world.client.get(f"/api/v1/webhooks/{hook['id']}/rules", headers=alice.auth).json() == before


def test_rules_with_comments_work_and_decide(world, alice, router):
    hook = make_hook(world, alice, router)
    rules = [
        {"id": "never", "expr": 'false # mentions now, $ENV and "quotes" ) ( only in a comment',
         "action": {"drop": True}},
        {"id": "hash", "expr": '.issue.title == "#not a comment" # a # inside a string is text',
         "action": {"drop": True}},
        {"id": "spelling", "expr": ".issue.title # the title\n| test(\"Spelling\") # and a note\n",
         "action": {"queue": "build"}},
    ]
    saved = put_rules(world, alice, hook, rules)
    assert saved.status_code == 200, saved.text
    raw, headers = producers.github("issues.opened", hook["secret"])
    routed = post(world, hook, raw, headers).json()
    assert routed["disposition"] == "routed" and routed["todos"][0]["queue"] == "build"
    event = world.client.get(f"/api/v1/events/{routed['event_id']}", headers=alice.auth).json()
    assert event["trace"]["rule_id"] == "spelling"
    raw, headers = producers.github("issues.opened", hook["secret"], {"issue": {"title": "#not a comment"}})
    assert post(world, hook, raw, headers).json()["disposition"] == "dropped"
    raw, headers = producers.github("issues.opened", hook["secret"], {"issue": {"title": "other"}})
    fallback = post(world, hook, raw, headers).json()
    assert fallback["disposition"] == "routed" and fallback["todos"][0]["queue"] == "triage"


# -- 6. untrusted child answers ----------------------------------------------------------------------------

DEEP = [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]


def _very_deep(depth: int = 5000):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _answer_id(answer) -> str:
    try:
        return json.dumps(answer)[:60]
    except RecursionError:
        return "5000-deep:" + next(iter(answer))


@pytest.mark.parametrize("answer", [
    {}, {"result": None}, {"result": [1, 2]}, {"result": "match"}, {"result": 0},
    {"result": {"match": 1}}, {"result": {"match": -1}}, {"result": {"match": True}}, {"result": {"match": False}},
    {"result": {"match": 0.0}}, {"result": {"match": "0"}}, {"result": {"match": None}},
    {"result": {"fault": 5}}, {"result": {"fault": True, "detail": "x"}},
    {"result": {"none": False}}, {"result": {"none": True, "extra": 1}},
    {"fault": "rm -rf /"}, {"fault": ["budget_exhausted"]}, {"fault": "error", "detail": DEEP},
    {"fault": "error", "detail": _very_deep()}, {"result": {"fault": 0, "detail": _very_deep()}},
    {"fault": "budget_exhausted", "detail": "line one\nline two " + "x" * 1000},
    {"detail": {"nested": {"object": [1, 2, 3]}}},
], ids=lambda a: _answer_id(a))
def test_read_reply_turns_any_shape_into_an_answer(answer):
    read = _read_reply(answer, 1)
    assert isinstance(read, dict)
    if "match" in read:
        raise AssertionError(f"{answer!r} was read as a match: {read}")
    if read.get("none"):
        raise AssertionError(f"{answer!r} was read as no match: {read}")
    assert read["fault"] in ("error", "budget_exhausted")
    assert read["rule_index"] is None or read["rule_index"] == 0
    assert isinstance(read["detail"], str) and "\n" not in read["detail"] and len(read["detail"]) <= 300


def test_read_reply_keeps_well_formed_answers():
    assert _read_reply({"result": {"match": 1}}, 2) == {"match": 1}
    assert _read_reply({"result": {"none": True}}, 2) == {"none": True}
    assert _read_reply({"result": {"fault": 1, "detail": "boom"}}, 2) == {
        "fault": "error", "rule_index": 1, "detail": "boom"}
    assert _read_reply({"fault": "budget_exhausted", "detail": "memory"}, 2) == {
        "fault": "budget_exhausted", "rule_index": None, "detail": "memory"}


GARBAGE_CHILD = r'''
import json, sys
sys.stdout.write('{"ready": true}\n')
sys.stdout.flush()
for line in sys.stdin.buffer:
    request = json.loads(line)
    sys.stdin.buffer.read(request.get("doc_bytes", 0))
    sys.stdout.write(GARBAGE + "\n")
    sys.stdout.flush()
'''


@pytest.mark.parametrize("garbage", [
    "not json", "[1, 2]", '"a string"', "null", '{"result": {"match": 7}}', '{"result": {"match": true}}',
    '{"result": [0]}', '{"fault": {"x": 1}}', "[" * 5000 + "]" * 5000, '{"result": ' + "[" * 5000 + "]" * 5000 + "}",
], ids=["not-json", "list", "string", "null", "index-out-of-range", "bool-index", "list-result", "object-fault",
        "5000-deep-list", "5000-deep-result"])
def test_a_child_answering_garbage_holds_the_delivery_or_is_503_never_500(world, alice, router, app, monkeypatch,
                                                                          garbage):
    hook = make_hook(world, alice, router, provider="generic")
    saved = put_rules(world, alice, hook, [{"id": "all", "expr": "true", "action": {"queue": "build"}}])
    assert saved.status_code == 200, saved.text
    app.state.evaluator.close()  # from now on every evaluation starts a fresh child
    original = EVALUATOR_CHILD
    monkeypatch.setattr(evaluator_module, "EVALUATOR_CHILD", GARBAGE_CHILD.replace("GARBAGE", repr(garbage)))
    for n in range(2):
        r = post(world, hook, b'{"n": %d}' % n, {"X-Delivery-Id": f"garbage-{n}"})
        assert r.status_code in (202, 503), r.text
        if r.status_code == 202:
            answer = r.json()
            assert answer["disposition"] == "quarantined" and answer["held"] is True, answer
            todo = world.client.get(f"/api/v1/todos/{answer['todos'][0]['id']}", headers=alice.auth).json()
            assert todo["state"] == "quarantined" and todo["state_reason"] == "rule_fault"
    # The owner's share of the evaluator was given back: with an honest child, the next delivery is evaluated.
    monkeypatch.setattr(evaluator_module, "EVALUATOR_CHILD", original)
    r = post(world, hook, b'{"n": "honest"}', {"X-Delivery-Id": "honest"})
    assert r.status_code == 202 and r.json()["disposition"] == "routed", r.text
    assert r.json()["todos"][0]["queue"] == "build"


# -- 7. any bytes in signature headers ---------------------------------------------------------------------

ARABIC_DIGITS = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")
FULLWIDTH_DIGITS = str.maketrans("0123456789", "０１２３４５６７８９")


def test_arbitrary_bytes_in_every_signature_header_are_401(quick_server):
    made = {provider: seed(quick_server.db_path, f"sig-{provider}", provider) for provider in ("github", "gitea", "cairn")}
    owner = seed(quick_server.db_path, "sig-supplied", "generic")
    for provider, secret in (("stripe", "whsec_" + "ab" * 16), ("slack", "s" * 32)):
        r = httpx.post(f"{quick_server.url}/api/v1/webhooks", headers=owner["auth"], json={
            "provider": provider, "queue": "triage", "endpoint_id": owner["endpoint"]["id"], "secret": secret})
        assert r.status_code == 201, r.text
        made[provider] = {"path": "/hooks/" + r.json()["url"].rsplit("/hooks/", 1)[1]}
    now = str(int(time.time())).encode()
    arabic = "١٢٣".encode()
    arabic_now = str(int(time.time())).translate(ARABIC_DIGITS).encode()
    hex64 = b"ab" * 32
    cases = {
        "github": [("X-Hub-Signature-256", b"sha256=" + b"\xe9" * 64), ("X-Hub-Signature-256", b"sha256=" + arabic),
                   ("X-Hub-Signature-256", b"sha256=\xff\xfe" + hex64[4:]), ("X-Hub-Signature-256", b"\x80")],
        "gitea": [("X-Gitea-Signature", b"\xe9" * 64), ("X-Gitea-Signature", arabic),
                  ("X-Hub-Signature-256", b"sha256=" + b"\xe9" * 64)],
        "cairn": [("X-Cairn-Signature", b"sha256=" + b"\xe9" * 64), ("X-Cairn-Signature", b"sha256=" + arabic)],
        "stripe": [("Stripe-Signature", b"t=1,v1=\xe9\xe9"), ("Stripe-Signature", b"t=" + now + b",v1=" + arabic),
                   ("Stripe-Signature", b"t=" + now + b",v1=" + b"\xe9" * 64),
                   ("Stripe-Signature", b"t=" + arabic_now + b",v1=" + hex64),
                   ("Stripe-Signature", b"t=\xe9,v1=" + hex64)],
        "slack": [("X-Slack-Signature", b"v0=\xe9\xe9"), ("X-Slack-Signature", b"v0=" + arabic),
                  ("X-Slack-Request-Timestamp", arabic_now), ("X-Slack-Request-Timestamp", b"\xe9\xff")],
    }
    body = json.dumps({"id": "evt_1", "type": "x", "event_id": "e1", "created_at": "2026-01-01T00:00:00Z"}).encode()
    for provider, variants in cases.items():
        for name, value in variants:
            headers = [("Content-Type", "application/json"), (name, value)]
            if provider == "slack":
                other = ("X-Slack-Signature", b"v0=" + hex64) if name != "X-Slack-Signature" else (
                    "X-Slack-Request-Timestamp", now)
                headers.append(other)
            status, answer = raw_exchange(quick_server.port, http_request("POST", made[provider]["path"], headers, body))
            assert status == 401, (provider, name, value, answer)
            assert json.loads(answer)["error"] == "unauthenticated"
    assert httpx.get(f"{quick_server.url}/healthz").status_code == 200


@pytest.mark.parametrize("digits", [ARABIC_DIGITS, FULLWIDTH_DIGITS], ids=["arabic-indic", "fullwidth"])
def test_unicode_digits_in_a_signed_timestamp_are_malformed(digits):
    """Even signed correctly over the very text sent, a timestamp in other digits is not a timestamp."""
    secret, body = b"whsec_" + b"ab" * 16, b'{"id": "evt_1"}'
    now_ms = int(time.time()) * 1000
    stamp = str(now_ms // 1000).translate(digits)
    stripe_sig = producers.hex_hmac(secret.decode(), stamp.encode() + b"." + body)
    with pytest.raises(VerificationFailed, match="malformed_timestamp"):
        verify_delivery("stripe", secret, {"stripe-signature": f"t={stamp},v1={stripe_sig}"}, body, now_ms)
    slack_sig = producers.hex_hmac(secret.decode(), b"v0:" + stamp.encode() + b":" + body)
    with pytest.raises(VerificationFailed, match="malformed_timestamp"):
        verify_delivery("slack", secret, {"x-slack-signature": f"v0={slack_sig}",
                                             "x-slack-request-timestamp": stamp}, body, now_ms)
    # The same, in ASCII digits, verifies: the refusal above is about the digits alone.
    ascii_stamp = str(now_ms // 1000)
    good = producers.hex_hmac(secret.decode(), ascii_stamp.encode() + b"." + body)
    assert verify_delivery("stripe", secret, {"stripe-signature": f"t={ascii_stamp},v1={good}"}, body, now_ms)


# -- 8. reroute onto a live idempotency key ----------------------------------------------------------------

def test_reroute_onto_an_endpoint_holding_the_same_live_key_is_409(world, alice, db_path):
    here = world.endpoint(alice, ["a"], name="here")
    there = world.endpoint(alice, ["b"], name="there")
    moving = world.push(alice, here, "a", title="one", key="same-key")
    holder = world.push(alice, there, "b", title="two", key="same-key")
    before = snapshot(db_path)
    r = world.act(alice, moving["id"], "reroute", queue="b")
    assert r.status_code == 409, r.text
    assert r.json()["error"] == "conflict" and holder["id"] in r.json()["message"]
    assert snapshot(db_path) == before, "a refused reroute changes nothing"
    # Once the holder is finished, the key is free and the reroute goes through.
    assert world.act(alice, holder["id"], "cancel", reason="done elsewhere").status_code == 200
    moved = world.act(alice, moving["id"], "reroute", queue="b")
    assert moved.status_code == 200 and moved.json()["endpoint_id"] == there.id


# -- 9. evaluator children die with the server -------------------------------------------------------------

def _proc_stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # fields from the state on (field 3)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _is_evaluator(pid: int) -> bool:
    args = _cmdline(pid)
    return "-I" in args and "-c" in args and any("import jq" in a for a in args)


def evaluator_children(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _proc_stat(int(entry))
            if fields and int(fields[1]) == parent and _is_evaluator(int(entry)):
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    fields = _proc_stat(pid)
    return fields is not None and fields[0] not in ("Z", "X") and _is_evaluator(pid)


def _cpu_ticks(pid: int) -> int:
    fields = _proc_stat(pid) or ["", "0"] + ["0"] * 20
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_evaluator_children_die_with_the_server(live_server, db_path, sig):
    made = seed(db_path, "alice", rules=[{"id": "loop", "expr": LOOP_FOREVER, "action": {"queue": "triage"}}])
    server = live_server()
    children: list[int] = []
    try:
        r = httpx.post(server.url + made["path"], content=b"{}", headers={"X-Delivery-Id": "loop-1"}, timeout=30)
        assert r.status_code == 202 and r.json()["disposition"] == "quarantined", r.text
        children = evaluator_children(server.proc.pid)
        assert children, "the server has an evaluator child"
        before = {pid: _cpu_ticks(pid) for pid in children}
        time.sleep(0.2)
        assert any(_cpu_ticks(pid) > ticks for pid, ticks in before.items()), "a child is still busy in the loop"
        server.proc.send_signal(sig)
        server.proc.wait(timeout=20)
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in children if _alive(pid)]
        assert not left, f"evaluator children {left} outlived the server ({signal.Signals(sig).name}) by 5 s"
    finally:
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# -- 10. the writer outlives cancelled callers and odd exceptions --------------------------------------------

def in_thread(fn, *args) -> concurrent.futures.Future:
    """`fn(*args)` on a daemon thread: a writer that never answers fails the test instead of hanging it."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the test as is
            future.set_exception(exc)
    threading.Thread(target=target, daemon=True).start()
    return future


def test_the_writer_skips_cancelled_jobs_and_survives_base_exceptions(tmp_path):
    db = Database(str(tmp_path / "writer.db"))
    gate, running = threading.Event(), threading.Event()

    def blocker(txn):
        running.set()
        assert gate.wait(10)
        return "blocked"

    def halt(txn):
        add_human(txn, "halted")
        raise Halt("not an Exception")

    try:
        blocked = in_thread(db.write_sync, blocker)
        assert running.wait(10)

        async def submit_then_cancel() -> list:
            tasks = [asyncio.ensure_future(db.write(add_human, f"gone{n}")) for n in range(5)]
            await asyncio.sleep(0)  # each task has queued its job and waits for the writer
            assert db._jobs.qsize() == 5
            for task in tasks:
                task.cancel()
            return await asyncio.gather(*tasks, return_exceptions=True)

        outcomes = asyncio.run(submit_then_cancel())
        assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
        halting = in_thread(db.write_sync, halt)
        neighbour = in_thread(db.write_sync, add_human, "neighbour")
        deadline = time.monotonic() + 10
        while db._jobs.qsize() < 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        assert blocked.result(10) == "blocked"
        with pytest.raises(Halt):
            halting.result(10)
        assert neighbour.result(10)["name"] == "neighbour", "a batch-mate of the halting job commits"
        assert db.alive(), "the writer survived"
        assert in_thread(db.write_sync, add_human, "after").result(10)["name"] == "after"
        names = [h["name"] for h in db.read_sync(list_humans)["humans"]]
        assert names == ["neighbour", "after"], "cancelled jobs never ran; the halting one rolled back"
    finally:
        gate.set()
        db.close()


def test_a_failing_job_loses_only_its_own_writes_and_its_batch_mates_commit(tmp_path):
    """Jobs that share a transaction: one failing after it wrote loses only its own writes (the batch runs again,
    each job in a savepoint). Its batch-mates commit what they wrote (a later one sees an earlier one's row, and
    never the failed one's), and each caller gets its own answer; a failing job alone in its batch rolls the
    whole transaction back. A batch where nothing fails runs once, without savepoints."""
    db = Database(str(tmp_path / "writer.db"))
    gate, running = threading.Event(), threading.Event()

    def blocker(txn):
        running.set()
        assert gate.wait(10)

    def write_then_fail(txn):
        add_human(txn, "doomed")
        raise ApiError("conflict", "this job fails after writing")

    def queued(n: int) -> None:
        deadline = time.monotonic() + 10
        while db._jobs.qsize() < n and time.monotonic() < deadline:
            time.sleep(0.005)
        assert db._jobs.qsize() == n

    try:
        blocked = in_thread(db.write_sync, blocker)
        assert running.wait(10)
        first = in_thread(db.write_sync, add_human, "first")
        queued(1)
        failing = in_thread(db.write_sync, write_then_fail)
        queued(2)
        same_name = in_thread(db.write_sync, add_human, "first")
        queued(3)
        doomed_again = in_thread(db.write_sync, add_human, "doomed")
        queued(4)
        last = in_thread(db.write_sync, add_human, "last")
        queued(5)
        gate.set()
        assert blocked.result(10) is None
        assert first.result(10)["name"] == "first"
        with pytest.raises(ApiError) as failed:
            failing.result(10)
        assert failed.value.code == "conflict" and "fails after writing" in failed.value.message
        with pytest.raises(ApiError) as taken:
            same_name.result(10)
        assert taken.value.code == "conflict", "a batch-mate sees the row an earlier job of its batch wrote"
        assert doomed_again.result(10)["name"] == "doomed", "no batch-mate sees the failed job's writes"
        assert last.result(10)["name"] == "last"
        assert [h["name"] for h in db.read_sync(list_humans)["humans"]] == ["first", "doomed", "last"]

        with pytest.raises(ApiError):
            db.write_sync(write_then_fail)  # alone in its batch: the whole transaction rolls back
        assert [h["name"] for h in db.read_sync(list_humans)["humans"]] == ["first", "doomed", "last"]

        statements: list[str] = []
        db._writer.set_trace_callback(statements.append)
        gate.clear()
        running.clear()
        blocked = in_thread(db.write_sync, blocker)
        assert running.wait(10)
        mates = [in_thread(db.write_sync, add_human, name) for name in ("second", "third")]
        queued(2)
        gate.set()
        assert [m.result(10)["name"] for m in mates] == ["second", "third"]
        assert not [s for s in statements if s.startswith("SAVEPOINT")], "a batch where nothing fails"
        assert db.alive()
    finally:
        gate.set()
        db.close()


def test_a_writer_that_stops_says_why(tmp_path):
    db = Database(str(tmp_path / "writer.db"))
    told: list[str] = []
    db.on_fatal = told.append
    try:
        def broken() -> None:
            raise Halt("the loop itself broke")
        db._next_batch = broken  # read by the loop for its next batch, after the job below
        db.write_sync(add_human, "last")
        db._thread.join(10)
        assert not db.alive()
        assert told and "the writer stopped" in told[0] and "Halt" in told[0] and db.failure == told[0]
    finally:
        db.close()


# -- 11. vitals --------------------------------------------------------------------------------------------

def _halting_tick(txn, *args, **kwargs):
    raise Halt("the scheduler broke")


def test_a_dead_scheduler_makes_healthz_503(db_path, monkeypatch):
    monkeypatch.setattr(flows_module, "scheduler_tick", _halting_tick)
    app = create_app(db_path, background=True)
    client = TestClient(app, raise_server_exceptions=False)
    client.__enter__()
    try:
        deadline = time.monotonic() + 10
        while (r := client.get("/healthz")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.status_code == 503 and "scheduler" in r.text, r.text
        assert app.state.db.alive(), "the writer lives on; the scheduler is what died"
    finally:
        with contextlib.suppress(Halt):  # whether shutdown stays clean is the next test's question
            client.__exit__(None, None, None)
        app.state.evaluator.close()
        app.state.db.close()


@pytest.mark.sqlite_only("SQLite's writer thread")
def test_shutdown_after_the_scheduler_died_still_closes_everything(db_path, monkeypatch):
    monkeypatch.setattr(flows_module, "scheduler_tick", _halting_tick)
    app = create_app(db_path, background=True)
    raised: BaseException | None = None
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            deadline = time.monotonic() + 10
            while client.get("/healthz").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
    except Halt as exc:
        raised = exc
    writer_alive = app.state.db._thread.is_alive()
    app.state.evaluator.close()
    app.state.db.close()
    assert raised is None, f"the lifespan's shutdown raised the scheduler's {raised!r}"
    assert not writer_alive, "shutdown closed the database"


@pytest.mark.sqlite_only("SQLite's writer thread")
def test_a_dead_writer_makes_healthz_503(world, app):
    def broken() -> None:
        raise Halt("the loop itself broke")
    app.state.db._next_batch = broken
    world.human("last")  # its batch runs; the loop then breaks
    app.state.db._thread.join(10)
    r = world.client.get("/healthz")
    assert r.status_code == 503 and "the writer stopped" in r.text, r.text


@pytest.mark.sqlite_only("SQLite's WAL checkpointer")
def test_a_dead_checkpointer_makes_healthz_503(world, app):
    class BreaksOnLook(threading.Event):
        def is_set(self) -> bool:
            raise Halt("the checkpointer broke")

    app.state.db._closing = BreaksOnLook()  # looked at once a commit wakes the checkpointer
    world.human("wakes-it")
    app.state.db._checkpointer.join(10)
    assert not app.state.db.alive()
    r = world.client.get("/healthz")
    assert r.status_code == 503 and "the checkpointer stopped" in r.text, r.text
    assert world.human("still-written").name == "still-written", "the writer lives on"


def test_the_served_process_exits_1_when_the_scheduler_dies(patched_server, tmp_path):
    trigger = tmp_path / "break-the-scheduler"
    server = patched_server("import os\n"
                            "class Halt(BaseException):\n"
                            "    pass\n"
                            "import switchboard.flows\n"
                            "_tick = switchboard.flows.scheduler_tick\n"
                            "def tick(txn, *args, **kwargs):\n"
                            f"    if os.path.exists({str(trigger)!r}):\n"
                            "        raise Halt('the scheduler broke')\n"
                            "    return _tick(txn, *args, **kwargs)\n"
                            "switchboard.flows.scheduler_tick = tick\n")
    assert httpx.get(server.url + "/healthz").status_code == 200
    trigger.touch()
    seed(str(tmp_path / "switchboard.db"), "bob")  # another connection commits: the scheduler ticks within a second
    assert server.proc.wait(timeout=15) == 1
    assert "exiting: the scheduler stopped" in server.logged()


def test_the_served_process_exits_1_when_no_evaluator_child_can_start(patched_server, tmp_path):
    made = seed(str(tmp_path / "switchboard.db"), rules=[{"id": "all", "expr": "true", "action": {"queue": "triage"}}])
    server = patched_server("import switchboard.evaluator\n"
                            "switchboard.evaluator.EVALUATOR_CHILD = 'import sys; sys.exit(3)'\n")
    statuses = []
    for n in range(Evaluator.DEAD_AFTER_FAILED_STARTS):
        try:
            statuses.append(httpx.post(server.url + made["path"], content=b"{}", headers={"X-Delivery-Id": f"d{n}"},
                                       timeout=30).status_code)
        except httpx.HTTPError:
            statuses.append("gone")
    assert set(statuses) <= {503, "gone"} and statuses[0] == 503, statuses
    assert server.proc.wait(timeout=15) == 1
    assert "exiting: the evaluator pool cannot start a child" in server.logged()


# -- 12. file modes ----------------------------------------------------------------------------------------

def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _next_second() -> None:
    time.sleep(1.02 - (time.time() % 1))


@pytest.mark.sqlite_only("the database file, its WAL and key file on disk")
def test_files_are_the_owners_alone(live_server, db_path, tmp_path, monkeypatch):
    monkeypatch.delenv("SWITCHBOARD_SECRET_KEY", raising=False)
    assert not Path(db_path).exists()
    server = live_server()
    folder = Path(db_path).parent
    for name in ("switchboard.db", "switchboard.db-wal", "switchboard.db-shm", "switchboard.key"):
        assert (folder / name).exists(), name
        assert _mode(folder / name) == 0o600, f"{name} is {oct(_mode(folder / name))}"
    assert httpx.get(server.url + "/healthz").status_code == 200
    out = tmp_path / "one.db"
    assert cli(db_path, "backup", str(out))[0] == 0
    assert _mode(out) == 0o600
    dated = tmp_path / "dated"
    runs = []
    for n in range(3):
        if n:
            _next_second()  # dated names are to the second
        code, answer = cli(db_path, "backup", "--dir", str(dated), "--keep", "2")
        assert code == 0, answer
        runs.append(answer)
        if n == 0:
            assert _mode(dated) == 0o700
            (dated / "notes.txt").write_text("not a backup")
            (dated / "switchboard-20200101T000000Z.db").write_bytes(b"an old one")
    kept = sorted(p.name for p in dated.iterdir() if p.name.startswith("switchboard-"))
    assert kept == sorted(Path(r["backup"]).name for r in runs[1:]), kept
    assert [Path(p).name for p in runs[1]["removed"]] == ["switchboard-20200101T000000Z.db"]
    assert [Path(p).name for p in runs[2]["removed"]] == [Path(runs[0]["backup"]).name]
    assert (dated / "notes.txt").exists(), "only dated backups are pruned"
    for name in kept:
        assert _mode(dated / name) == 0o600, name


# -- 13. MCP Origin ----------------------------------------------------------------------------------------

INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}


def test_mcp_origins(live_server, db_path, monkeypatch):
    made = seed(db_path, "alice")
    monkeypatch.setenv("SWITCHBOARD_ALLOWED_ORIGINS", "https://board.example.com, https://ops.example.org/")
    server = live_server()
    headers = {"Accept": "application/json, text/event-stream",
               "Authorization": f"Bearer {made['endpoint']['token']}"}

    def initialize(**extra) -> httpx.Response:
        return httpx.post(server.url + "/mcp", json=INIT, headers={**headers, **extra}, timeout=10, verify=TLS)

    # DNS rebinding: the page's own host name resolves to 127.0.0.1, so Host and Origin agree.
    for origin, host in (("http://evil.example", "evil.example"), (f"http://evil.example:{server.port}",
                                                                   f"evil.example:{server.port}"),
                         ("http://localhost.evil.example", "localhost.evil.example"), ("null", None),
                         (f"http://localhost:{server.port}/x", None), ("https://board.example.com.evil", None)):
        r = initialize(Origin=origin, **({"Host": host} if host else {}))
        assert r.status_code == 403, (origin, host, r.text)
    for origin in (f"http://localhost:{server.port}", f"http://127.0.0.1:{server.port}", "https://board.example.com",
                   "https://board.example.com/", "https://ops.example.org"):
        r = initialize(Origin=origin)
        assert r.status_code == 200 and r.headers["mcp-session-id"], (origin, r.text)
    assert initialize().status_code == 200, "no Origin (not a browser) is allowed"


# -- 14. bidirectional marks -------------------------------------------------------------------------------

BIDI = "\u202e\u2066\u200f\u200e\u202a\u202b\u202c\u202d\u2067\u2068\u2069\u061c"


def test_bidirectional_marks_never_reach_a_title(world, alice, router):
    hook = make_hook(world, alice, router)
    title = "fix " + "".join(f"{ch}{n}" for n, ch in enumerate(BIDI))
    raw, headers = producers.github("issues.opened", hook["secret"], {"issue": {"title": title}})
    r = post(world, hook, raw, headers)
    assert r.status_code == 202, r.text
    todo = world.client.get(f"/api/v1/todos/{r.json()['todos'][0]['id']}", headers=alice.auth).json()
    assert not set(todo["title"]) & set(BIDI), ascii(todo["title"])
    assert todo["title"] == "Codertocat/Hello-World#1: fix " + " ".join(str(n) for n in range(len(BIDI)))
    for ch in BIDI:
        pushed = world.client.post(f"/api/v1/endpoints/{router.id}/todos", headers=alice.auth,
                                   json={"title": f"evil{ch}title", "queue": "build"})
        assert pushed.status_code == 400 and pushed.json()["error"] == "invalid_argument", (ascii(ch), pushed.text)
