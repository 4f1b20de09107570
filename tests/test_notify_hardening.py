"""Notifications under abuse (issue 26): one human's channels cannot stall the server, a trickling receiver is
cut off at one overall deadline (and shutdown does not wait for it), channels cannot reach the box itself,
producer Markdown reaches no receiver as markup, and an ntfy URL cannot carry two credentials.

The receivers are small servers of the test's own on loopback: one that records requests, one that accepts
connections and never answers, one that answers a byte at a time; and the server is the real one, in process
or as `serve` in a child process with some constants made smaller (PatchedServer)."""

from __future__ import annotations

import base64
import collections
import contextlib
import datetime
import http.server
import ipaddress
import json
import re
import secrets
import selectors
import signal
import socket
import sqlite3
import ssl
import threading
import time
import types
from pathlib import Path

import httpx
import producers
import pytest
from conftest import ROOT, LiveServer, World, cli, free_port
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from helpers import make_webhook, post_delivery, query
from starlette.testclient import TestClient

from switchboard.app import create_app
from switchboard.configuration import NOTIFY_MAX_CHANNELS
from switchboard.crypto import SecretBox
from switchboard.notifier import (
    COMMAND_ALLOWANCE,
    REFUSED_ADDRESS,
    REFUSED_CHANNEL,
    Addresses,
    compose,
    internal,
    shape_request,
)
from switchboard.store.outbox import Outgoing

# -- small receivers of our own ---------------------------------------------------------------------------


class Recorder:
    """A threaded HTTP server on loopback that answers 200 and records each request's path and headers."""

    def __init__(self):
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.arrived = threading.Condition()
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with recorder.arrived:
                    recorder.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                    recorder.arrived.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def wait_for(self, n: int, timeout: float) -> list[tuple[str, dict[str, str]]]:
        deadline = time.monotonic() + timeout
        with self.arrived:
            while len(self.requests) < n:
                assert self.arrived.wait(max(0.0, deadline - time.monotonic())), f"{self.requests} after {timeout} s"
            return list(self.requests)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class BlackHole:
    """Accepts every connection, reads what comes and never answers: a receiver that hangs. Counts the
    connections open at once, overall and by the first segment of the request's path (the test puts the
    human's name there)."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.owner: dict[socket.socket, str | None] = {}
        self.by_human: collections.Counter = collections.Counter()
        self.most_by_human: collections.Counter = collections.Counter()
        self.most_open = 0
        self.accepted = 0
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _run(self) -> None:
        while not self.stopping:
            for key, _ in self.selector.select(0.05):
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    self._read(key.fileobj)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, OSError):
                return
            conn.setblocking(False)
            self.selector.register(conn, selectors.EVENT_READ)
            self.owner[conn] = None
            self.accepted += 1
            self.most_open = max(self.most_open, len(self.owner))

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            human = self.owner.pop(conn, None)
            if human:
                self.by_human[human] -= 1
            self.selector.unregister(conn)
            conn.close()
            return
        found = re.match(rb"[A-Z]+ /([^/ ]+)/", data)
        if self.owner.get(conn) is None and found:
            human = found.group(1).decode()
            self.owner[conn] = human
            self.by_human[human] += 1
            self.most_by_human[human] = max(self.most_by_human[human], self.by_human[human])

    def close(self) -> None:
        self.stopping = True
        self.thread.join()
        for conn in list(self.owner):
            conn.close()
        self.listener.close()


class Trickler:
    """Reads a request, then answers one byte every `every` seconds and never finishes the headers (for at most
    `limit` seconds): each byte restarts an HTTP client's read timeout."""

    def __init__(self, every: float = 0.5, limit: float = 30.0):
        self.every, self.limit = every, limit
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.listener.getsockname()[1]
        self.connected = 0
        self.open = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with self.lock:
            self.connected += 1
            self.open += 1
        try:
            conn.settimeout(5)
            conn.recv(65536)
            stop = time.monotonic() + self.limit
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 1000:
                if time.monotonic() > stop:
                    break
                conn.sendall(bytes([byte]))
                time.sleep(self.every)
        except OSError:
            pass
        finally:
            conn.close()
            with self.lock:
                self.open -= 1

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def recorder():
    made = Recorder()
    yield made
    made.close()


@pytest.fixture(autouse=True)
def no_allowance_from_the_environment(monkeypatch):
    """Whether internal addresses are allowed is each test's to say."""
    monkeypatch.delenv("SWITCHBOARD_NOTIFY_ALLOW_PRIVATE", raising=False)
    monkeypatch.delenv("SWITCHBOARD_NOTIFY_ALLOW", raising=False)


def add_channel(client, human, kind: str, url: str, token: str | None = None) -> httpx.Response:
    body = {"kind": kind, "url": url, "events": ["needs_input"], **({"token": token} if token else {})}
    return client.post("/api/v1/notify", headers=human.auth, json=body)


def send_test(client, human, channel_id: str) -> dict:
    r = client.post(f"/api/v1/notify/{channel_id}/test", headers=human.auth, json={})
    assert r.status_code == 200, r.text
    return r.json()


class PatchedServer(LiveServer):
    """`serve` in a child process, after `patch` (Python) changed some constants."""

    def __init__(self, db_path: str, patch: str, *flags: str, env: dict | None = None):
        code = (f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom switchboard.cli.parser import main\n{patch}\n"
                f"sys.exit(main(sys.argv[1:]))\n")
        super().__init__(db_path, *flags, program=("-c", code), env=env)


# -- 1. one human's fan-out stalls nobody ------------------------------------------------------------------

def test_a_human_has_at_most_twenty_channels(client, world, alice, db_path):
    for number in range(NOTIFY_MAX_CHANNELS):
        assert add_channel(client, alice, "ntfy", f"https://ntfy.example/topic-{number}").status_code == 201
    refused = add_channel(client, alice, "ntfy", "https://ntfy.example/one-too-many")
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"] == "conflict" and "remove one" in refused.json()["message"]
    assert set(refused.json()) == {"error", "message"}
    assert query(db_path, "SELECT count(*) FROM notify_channels")[0][0] == NOTIFY_MAX_CHANNELS
    # The operator's CLI is held to the same number; another human is not affected.
    code, answer = cli(db_path, "notify", "add", "--human", "alice", "--kind", "ntfy", "--url",
                       "https://ntfy.example/from-the-cli", "--events", "held")
    assert code == 1 and answer["error"] == "conflict", answer
    assert add_channel(client, world.human("bob"), "ntfy", "https://ntfy.example/bobs").status_code == 201
    # Removing one makes room for one.
    first = client.get("/api/v1/notify", headers=alice.auth).json()["channels"][0]
    assert client.delete(f"/api/v1/notify/{first['id']}", headers=alice.auth).status_code == 200
    assert add_channel(client, alice, "ntfy", "https://ntfy.example/again").status_code == 201
    assert add_channel(client, alice, "ntfy", "https://ntfy.example/and-again").status_code == 409


def load_hanging_channels(db_path: str, hole: BlackHole, humans: dict[str, int]) -> None:
    """Channels written straight into the database (as a database from before the per-human limit could hold
    them), each with one message due now, all pointing at the black hole: humans maps a name to a count."""
    box = SecretBox.for_database(db_path)
    conn = sqlite3.connect(db_path)
    now = int(time.time() * 1000)
    data = json.dumps({"todo_id": "td_0000", "queue": "triage", "state": "quarantined", "title": "held work"})
    for name, many in humans.items():
        human_id = conn.execute("SELECT id FROM humans WHERE name = ?", (name,)).fetchone()[0]
        for number in range(many):
            channel_id = f"nc_{secrets.token_hex(10)}"
            conn.execute("INSERT INTO notify_channels (id, human_id, kind, url_sealed, url_shown, events, created_at)"
                         " VALUES (?, ?, 'ntfy', ?, 'http://127.0.0.1/…', '[\"held\"]', ?)",
                         (channel_id, human_id, box.seal(hole.url(f"/{name}/{number}"), channel_id), now))
            conn.execute("INSERT INTO notify_outbox (id, channel_id, event, data, created_at, next_at)"
                         " VALUES (?, ?, 'held', ?, ?, ?)", (f"nm_{secrets.token_hex(10)}", channel_id, data, now, now))
    conn.commit()
    conn.close()


def test_thousands_of_hanging_channels_stall_no_other_tenant(tmp_path, recorder):
    """1,500 channels of one human (a database from before the limit) and 3 humans at the limit, every one with a
    message due and a receiver that never answers: the sender has at most 8 sends in flight (NOTIFY_MAX_SENDS,
    made 8 here, and the send deadline 1 s), at most 4 per human, and another tenant's ingest, /healthz and own
    notification go through."""
    db_path = str(tmp_path / "switchboard.db")
    assert cli(db_path, "init")[0] == 0
    tokens = {name: cli(db_path, "human", "add", name)[1]["token"] for name in ("alice", "carol", "dave",
                                                                                     "erin", "bob")}
    hole, server = BlackHole(), None
    try:
        load_hanging_channels(db_path, hole, {"alice": 1500, "carol": 20, "dave": 20, "erin": 20})
        server = PatchedServer(db_path, "import switchboard.notifier as n\nn.NOTIFY_MAX_SENDS = 8\n"
                                        "n.NOTIFY_TIMEOUT_SECONDS = 1.0\n", "--notify-allow-private",
                               "--ingest-rate", "0")
        bob = types.SimpleNamespace(auth={"Authorization": f"Bearer {tokens['bob']}"})
        with httpx.Client(base_url=server.url, timeout=5) as http:
            # Bob sets up while every slot is taken: each request answers.
            endpoint = http.post("/api/v1/endpoints", headers=bob.auth, json={"name": "w", "queues": ["build",
                                                                                                    "triage"]})
            assert endpoint.status_code == 201, endpoint.text
            endpoint = endpoint.json()
            channel = http.post("/api/v1/notify", headers=bob.auth, json={
                "kind": "ntfy", "url": recorder.url("/bob"), "events": ["needs_input"]})
            assert channel.status_code == 201, channel.text
            hook = make_webhook(http, bob, endpoint["id"], "github", queue="triage")
            for _ in range(4):
                assert http.get("/healthz").status_code == 200
                assert post_delivery(http, hook, *producers.github("issues.opened", hook["secret"])).status_code == 202
                time.sleep(0.1)
            # Bob's own notification goes out within a send deadline or two, ahead of the 1,500 waiting.
            todo = http.post(f"/api/v1/endpoints/{endpoint['id']}/todos", headers=bob.auth,
                             json={"title": "a question", "queue": "build"}).json()
            worker = {"Authorization": f"Bearer {endpoint['token']}"}
            lease = http.post(f"/api/v1/todos/{todo['id']}/claim", headers=worker, json={}).json()["lease_token"]
            asked = http.post(f"/api/v1/todos/{todo['id']}/needs-input", headers=worker,
                              json={"lease_token": lease, "question": "which branch?"})
            assert asked.status_code == 200, asked.text
            [(path, _)] = recorder.wait_for(1, timeout=8)
            assert path == "/bob"
            assert http.get("/healthz").status_code == 200
        assert hole.accepted >= 8, "the hanging receivers were being tried"
        assert hole.most_open <= 8, f"{hole.most_open} sends in flight at once"
        assert max(hole.most_by_human.values()) <= 4, dict(hole.most_by_human)
        server.stop()
        assert server.proc.returncode == 0
    finally:
        if server is not None:
            server.stop()
        hole.close()


# -- 5. one deadline per send --------------------------------------------------------------------------------

def test_a_trickling_receiver_is_cut_off_at_the_deadline_and_shutdown_does_not_wait(tmp_path):
    """httpx's timeouts restart with every byte; the send's own deadline (1 s here, NOTIFY_TIMEOUT_SECONDS) does
    not: the test answers with a timeout, the channel keeps it as its last error, and SIGTERM with such tests in
    flight ends the server within a few seconds (the unit gives it 45)."""
    db_path = str(tmp_path / "switchboard.db")
    assert cli(db_path, "init")[0] == 0
    alice = types.SimpleNamespace(auth={"Authorization": f"Bearer {cli(db_path, 'human', 'add', 'alice')[1]['token']}"})
    slow = Trickler(every=0.25)
    server = PatchedServer(db_path, "import switchboard.notifier as n\nn.NOTIFY_TIMEOUT_SECONDS = 1.0\n",
                           env={"SWITCHBOARD_NOTIFY_ALLOW_PRIVATE": "yes"})
    try:
        with httpx.Client(base_url=server.url, timeout=20) as http:
            channels = []
            for number in range(3):
                made = add_channel(http, alice, "ntfy", slow.url(f"/slow-{number}"))
                assert made.status_code == 201, made.text
                channels.append(made.json()["id"])
            started = time.monotonic()
            answer = send_test(http, alice, channels[0])
            took = time.monotonic() - started
            assert answer["sent"] is False and answer["error"].startswith("Timeout"), answer
            assert 0.9 <= took < 5, f"the test took {took:.1f} s"
            listed = {c["id"]: c for c in http.get("/api/v1/notify", headers=alice.auth).json()["channels"]}
            assert listed[channels[0]]["last_error"] == answer["error"] and listed[channels[0]]["failures"] == 1

            # Two tests in flight, then SIGTERM: they end at their deadline, are recorded, and the server exits.
            answers: list = []
            testers = [threading.Thread(target=lambda c=c: answers.append(send_test(http, alice, c)))
                       for c in channels[1:]]
            for tester in testers:
                tester.start()
            deadline = time.monotonic() + 5
            while slow.connected < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert slow.connected == 3
            stopping = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(timeout=15)
            stopped = time.monotonic() - stopping
            for tester in testers:
                tester.join(5)
        assert server.proc.returncode == 0 and stopped < 10, f"SIGTERM took {stopped:.1f} s (the unit gives 45 s)"
        assert [a["sent"] for a in answers] == [False, False] and all("Timeout" in a["error"] for a in answers)
        assert sorted(query(db_path, "SELECT failures FROM notify_channels")) == [(1,), (1,), (1,)]
        deadline = time.monotonic() + 3
        while slow.open and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slow.open == 0, "the sockets to the receiver were closed"
    finally:
        server.stop()
        slow.close()


# -- 6. channels cannot reach the box itself ---------------------------------------------------------------

@pytest.fixture
def strict_app(db_path):
    """The app as `serve` runs it without --notify-allow-private (and with no allowance in the environment)."""
    return create_app(db_path)


def test_internal_addresses_are_refused_alike_whatever_listens_there(strict_app, db_path, recorder):
    closed = free_port()
    urls = [recorder.url("/open"), f"http://127.0.0.1:{closed}/closed", recorder.url("/named", "localhost"),
            f"http://[::1]:{recorder.port}/v6", "http://169.254.169.254/latest/meta-data/",
            f"http://0.0.0.0:{recorder.port}/unspecified", f"http://[::]:{recorder.port}/v6-unspecified",
            f"http://[::ffff:127.0.0.1]:{recorder.port}/mapped", f"http://2130706433:{recorder.port}/decimal",
            f"http://127.1:{recorder.port}/short", f"http://[fe80::1]:{recorder.port}/link-local"]
    # Refused when the channel is added (a name after resolving it), with one coarse answer.
    with TestClient(strict_app) as client:
        alice = World(client, strict_app.state.db).human("alice")
        for url in urls:
            made = add_channel(client, alice, "webhook", url)
            assert made.status_code == 400, (url, made.text)
            assert made.json() == {"error": "invalid_argument", "message": REFUSED_CHANNEL}, url
        assert client.get("/api/v1/notify", headers=alice.auth).json() == {"channels": []}
    # … and again when sending: channels added while the operator allowed it, sent once the allowance is gone.
    with TestClient(create_app(db_path, notify_allow_private=True)) as client:
        ids = {url: add_channel(client, alice, "webhook", url).json()["id"] for url in urls}
    with TestClient(create_app(db_path)) as client:
        answers = {url: send_test(client, alice, channel_id) for url, channel_id in ids.items()}
        assert {url: (a["sent"], a["error"]) for url, a in answers.items()} == {
            url: (False, REFUSED_ADDRESS) for url in urls}, "one coarse answer, whether a port is open or closed"
        assert recorder.requests == []
        listed = client.get("/api/v1/notify", headers=alice.auth).json()["channels"]
        assert {c["last_error"] for c in listed} == {REFUSED_ADDRESS}
    # LAN and public addresses are no business of the check.
    for address in ("10.0.0.7", "172.16.4.2", "192.168.1.20", "100.64.0.1", "8.8.8.8", "2001:db8::1", "fd00::5"):
        assert Addresses().permits(ipaddress.ip_address(address), 80), address
    for address in ("127.0.0.1", "127.8.9.10", "::1", "169.254.169.254", "fe80::1", "0.0.0.0", "0.1.2.3", "::",
                    "::ffff:127.0.0.1", "::ffff:169.254.169.254"):
        assert internal(ipaddress.ip_address(address)), address


def test_the_operator_may_allow_internal_addresses_all_or_some(db_path, tmp_path, recorder):
    other = Recorder()
    try:
        # Some: one address and port; another port on the same address stays refused.
        app = create_app(db_path, notify_allow=f"127.0.0.1:{recorder.port}")
        with TestClient(app) as client:
            alice = World(client, app.state.db).human("alice")
            allowed = add_channel(client, alice, "ntfy", recorder.url("/allowed")).json()
            refused = add_channel(client, alice, "ntfy", other.url("/other-port"))
            assert send_test(client, alice, allowed["id"])["sent"] is True
            assert refused.status_code == 400 and refused.json()["message"] == REFUSED_CHANNEL
        # All: a name is resolved, checked and connected to at the address checked, asking for its own name.
        app = create_app(str(tmp_path / "open.db"), notify_allow_private=True)
        with TestClient(app) as client:
            alice = World(client, app.state.db).human("alice")
            named = add_channel(client, alice, "ntfy", recorder.url("/by-name", "localhost")).json()
            answer = send_test(client, alice, named["id"])
            assert answer["sent"] is True, answer
            assert other.requests == []
        [(path, headers)] = [r for r in recorder.requests if r[0] == "/by-name"]
        assert headers["host"] == f"localhost:{recorder.port}"
    finally:
        other.close()
    with pytest.raises(Exception, match="notify-allow"):
        create_app(str(tmp_path / "bad.db"), background=False, notify_allow="127.0.0.1:http")


def test_a_channel_to_an_internal_address_is_refused_from_the_board_and_the_cli_too(strict_app, db_path,
                                                                                    monkeypatch):
    with TestClient(strict_app) as client:
        world = World(client, strict_app.state.db)
        alice = world.human("alice")
        origin = {"Origin": "http://testserver"}
        assert client.post("/board/login", data={"token": alice.token}, headers=origin).status_code == 200
        csrf = re.search(r'name="csrf" value="([^"]+)"', client.get("/board/notify").text).group(1)
        form = {"csrf": csrf, "kind": "webhook", "url": "http://localhost:9/hook", "ev_held": "on"}
        refused = client.post("/board/notify/add", data=form, headers=origin, follow_redirects=False)
        assert refused.status_code == 400 and "loopback, link-local or unspecified" in refused.text
        # What is not internal, or does not resolve now (each send checks again), is added; an endpoint is
        # refused for what it is, before any name is looked up.
        for url in ("http://192.0.2.10/topic", "http://ntfy.invalid/topic"):
            assert add_channel(client, alice, "ntfy", url).status_code == 201, url
        lane = world.endpoint(alice, ["lane"])
        assert add_channel(client, lane, "ntfy", "http://127.0.0.1:9/x").status_code == 403
        assert [c["url"] for c in client.get("/api/v1/notify", headers=alice.auth).json()["channels"]] == [
            "http://192.0.2.10/…", "http://ntfy.invalid/…"]
    add = ("notify", "add", "--human", "alice", "--kind", "ntfy", "--url", "http://[::1]:9/topic", "--events", "held")
    # A command's allowance is its environment's, not serve's flags: its refusal names the variables.
    assert cli(db_path, *add) == (1, {"error": "invalid_argument",
                                             "message": f"url: {REFUSED_ADDRESS} ({COMMAND_ALLOWANCE})"})
    monkeypatch.setenv("SWITCHBOARD_NOTIFY_ALLOW_PRIVATE", "1")  # the operator allows it, as serve's flag does
    code, made = cli(db_path, *add)
    assert code == 0 and made["url"] == "http://[::1]:9/…"


def self_signed(directory: Path) -> ssl.SSLContext:
    """A TLS server context with a throwaway certificate (no client trusts it)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    (directory / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(directory / "cert.pem", directory / "key.pem")
    return context


def test_https_to_a_checked_address_still_names_and_verifies_the_host(db_path, tmp_path):
    """Connecting to the address checked, not the name, must not lose TLS: the handshake carries the URL's host
    name (SNI), and the certificate is verified (a self-signed one fails)."""
    context = self_signed(tmp_path)
    seen: list[str | None] = []
    context.sni_callback = lambda sock, name, ctx: seen.append(name)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve_once():
        conn, _ = listener.accept()
        with contextlib.suppress(ssl.SSLError, OSError):
            context.wrap_socket(conn, server_side=True).recv(1)
        conn.close()

    threading.Thread(target=serve_once, daemon=True).start()
    app = create_app(db_path, notify_allow_private=True)
    try:
        with TestClient(app) as client:
            alice = World(client, app.state.db).human("alice")
            made = add_channel(client, alice, "ntfy", f"https://localhost:{port}/tls").json()
            answer = send_test(client, alice, made["id"])
        assert answer["sent"] is False and "CERTIFICATE_VERIFY_FAILED" in answer["error"], answer
        assert seen == ["localhost"]
    finally:
        listener.close()


# -- 7. producer Markdown is text everywhere ------------------------------------------------------------------

DISGUISED = "[Approve here](https://evil.example/p) **now** # Head <@123> ||x|| `c` ~~s~~ _i_ > q <https://evil.example|ok>"


def shaped(kind: str, title: str = DISGUISED) -> tuple[dict[str, str], str]:
    row = {"id": "nm_01", "event": "review", "attempts": 0,
           "data": json.dumps({"todo_id": "td_01", "queue": "build", "state": "review", "title": title})}
    composed = compose(Outgoing("nm_01", {"id": "nc_01", "kind": kind}, [row]), "https://sb.example")
    token = "whsec_" + base64.b64encode(b"k" * 32).decode() if kind == "webhook" else "t"
    _, headers, body = shape_request(kind, "https://receiver.example/x", token, composed, int(time.time()))
    return headers, body.decode()


def unescaped_markup(text: str) -> list[str]:
    """The Markdown punctuation in `text` that no backslash escapes."""
    found, escaped = [], False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char in "[]()*_~`|<>#:!":
            found.append(char)
    return found


def test_a_disguised_link_reaches_discord_as_text():
    _, body = shaped("discord")
    content = json.loads(body)["content"]
    title, text, link = content.split("\n")
    assert link == "https://sb.example/board/todos/td_01", "our own link stays a link, on its own line"
    assert unescaped_markup(text) == [], text
    assert "](" not in text and "https://evil.example" not in text, "neither a masked link nor an autolink"
    # Read back without its escapes, the line says what the producer wrote.
    assert re.sub(r"\\(.)", r"\1", text).startswith(DISGUISED[:70])


def test_slack_ntfy_and_gotify_get_no_markup_from_producer_text():
    _, body = shaped("slack")
    text = json.loads(body)["text"]
    assert "<" not in text and ">" not in text, "no <url|text> link, no <@mention>"
    assert "&lt;https://evil.example|ok&gt;" in text or "&lt;@123&gt;" in text
    headers, body = shaped("ntfy")
    assert not {name.lower() for name in headers} & {"markdown", "x-markdown", "actions", "x-actions"}
    assert headers["Content-Type"].startswith("text/plain") and "Approve here" not in json.dumps(headers)
    _, body = shaped("gotify")
    assert "client::display" not in json.loads(body)["extras"], "Gotify shows plain text unless told markdown"


# -- an ntfy URL carries one credential ------------------------------------------------------------------------

def test_an_ntfy_url_with_a_user_and_a_token_is_refused(client, alice, db_path):
    both = add_channel(client, alice, "ntfy", "https://bob:hunter2@ntfy.example/topic", token="tk_abc")
    assert both.status_code == 400 and both.json()["error"] == "invalid_argument", both.text
    assert "give one or the other" in both.json()["message"] and "hunter2" not in both.text
    assert query(db_path, "SELECT count(*) FROM notify_channels")[0][0] == 0
    assert add_channel(client, alice, "ntfy", "https://bob:hunter2@ntfy.example/topic").status_code == 201
    assert add_channel(client, alice, "ntfy", "https://ntfy.example/topic", token="tk_abc").status_code == 201


def test_an_ntfy_url_with_a_user_sends_basic_auth(db_path, recorder):
    app = create_app(db_path, notify_allow_private=True)
    with TestClient(app) as client:
        alice = World(client, app.state.db).human("alice")
        made = add_channel(client, alice, "ntfy", f"http://bob:hunter2@127.0.0.1:{recorder.port}/topic").json()
        assert send_test(client, alice, made["id"])["sent"] is True
    [(path, headers)] = recorder.requests
    assert headers["authorization"] == "Basic " + base64.b64encode(b"bob:hunter2").decode()

