"""How the worker reaches its server (issue 39): HTTP/1.1 on kept-alive connections of its own when no proxy can
apply, with TLS trusted as httpx trusts it, and httpx through the proxy the environment names otherwise. Servers
of ours play the REST API's claim and complete on real sockets, recording each request and the connection it came
on; the workers are real processes (tests/test_worker.py's)."""

from __future__ import annotations

import json
import socket
import socketserver
import ssl
import subprocess
import threading

import pytest
import test_worker
from test_worker import SHELL_COMPLETE
from test_worker_attacks import a_todo

site, lane, workers = test_worker.site, test_worker.lane, test_worker.workers

NOT_LOOPBACK = next((address for address in subprocess.run(["hostname", "-I"], capture_output=True, text=True)
                     .stdout.split() if "." in address and not address.startswith("127.")), None)
needs_address = pytest.mark.skipif(NOT_LOOPBACK is None, reason="no IPv4 address other than loopback")


class ApiPlayer(socketserver.ThreadingTCPServer):
    """Claims answered from `claims` (then empty), any other call with `{}`; every answer framed as `framing`
    says: "length" (Content-Length), "chunked", "close" (no length, the connection closed after it) or
    "garbled" (a chunk size that is not hex). With
    `drop_idle`, the connection is closed after each answer without a word, as a keep-alive timeout does."""
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: str, claims: list[dict], framing: str = "length", drop_idle: bool = False,
                 tls: ssl.SSLContext | None = None):
        self.claims, self.framing, self.drop_idle, self.tls = list(claims), framing, drop_idle, tls
        self.requests: list[tuple[int, str, dict]] = []  # (connection number, path, body)
        self.connections = 0
        self.lock = threading.Lock()
        super().__init__((address, 0), ApiHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"

    def answer(self, path: str) -> bytes:
        if path.endswith("/todos/claim"):
            return json.dumps(self.claims.pop(0) if self.claims else {"empty": True}).encode()
        return b"{}"

    def calls(self, suffix: str) -> list[tuple[int, str, dict]]:
        return [r for r in self.requests if r[1].endswith(suffix)]


class ApiHandler(socketserver.StreamRequestHandler):
    def setup(self) -> None:
        if self.server.tls is not None:
            self.request = self.server.tls.wrap_socket(self.request, server_side=True)
        super().setup()
        with self.server.lock:
            self.server.connections += 1
            self.number = self.server.connections

    def handle(self) -> None:
        while True:
            request_line = self.rfile.readline()
            if not request_line:
                return
            headers = {}
            while (line := self.rfile.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            body = json.loads(self.rfile.read(int(headers.get("content-length", 0))) or b"{}")
            path = request_line.split()[1].decode()
            with self.server.lock:
                self.server.requests.append((self.number, path, body))
                data = self.server.answer(path)
            framing = self.server.framing
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            if framing == "length":
                self.wfile.write(head + b"Content-Length: %d\r\n\r\n" % len(data) + data)
            elif framing == "garbled":
                self.wfile.write(head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + data)
                return
            elif framing == "chunked":
                middle = len(data) // 2
                chunks = b"".join(b"%x;note=1\r\n%s\r\n" % (len(part), part) for part in (data[:middle], data[middle:])
                                  if part)
                self.wfile.write(head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\nX-Trailer: 1\r\n\r\n")
            else:
                self.wfile.write(head + b"\r\n" + data)
                return
            self.wfile.flush()
            if self.server.drop_idle:
                return


@pytest.fixture
def players():
    started: list[ApiPlayer] = []

    def start(*args, **options) -> ApiPlayer:
        started.append(ApiPlayer(*args, **options))
        return started[-1]
    yield start
    for player in started:
        player.shutdown()
        player.server_close()


def todos(count: int) -> list[dict]:
    return [{"todo": a_todo(f"td_{n:04x}", 30), "lease_token": f"lt_{n}"} for n in range(count)]


@pytest.mark.parametrize("framing, drop_idle", [("length", False), ("chunked", False), ("close", False),
                                                ("length", True)])
def test_answers_of_every_framing_are_read_and_connections_kept_only_while_they_last(lane, workers, players,
                                                                                     framing, drop_idle):
    """Each todo is completed under its own lease, with the next claimed in the same call, whatever the framing;
    a kept-alive connection carries the calls that follow, and one the server dropped while idle is replaced
    without a word in the log."""
    player = players("127.0.0.1", todos(3), framing=framing, drop_idle=drop_idle)
    worker = workers(lane, "--server", f"http://{player.address}", "--name", "w1", command=SHELL_COMPLETE)
    test_worker.eventually(lambda: len(player.calls("/complete")) == 3 and player.calls("/todos/claim")[1:], 20,
                           "three completions and a claim after them")
    assert worker.stop() == 0
    completes = player.calls("/complete")
    assert [(path, body["lease_token"]) for _, path, body in completes] == [
        (f"/api/v1/todos/td_{n:04x}/complete", f"lt_{n}") for n in range(3)]
    assert all(body["claim_next"] == {"claimant": "w1"} for _, _, body in completes)
    connections = {number for number, _, _ in player.requests}
    if framing in ("length", "chunked") and not drop_idle:
        assert len(connections) == 1, f"one kept-alive connection carried every call: {player.requests}"
    else:
        assert len(connections) == len(player.requests), "a connection the server ends is never used again"
    assert "unreachable" not in worker.output() and "oddly" not in worker.output(), worker.output()


@needs_address
def test_a_tls_server_is_verified_with_the_trust_httpx_would_use(lane, workers, players, tmp_path):
    """SSL_CERT_FILE names the server's certificate: the worker trusts it (as httpx trusting the environment
    does for a server that is not this machine), and without it the same worker reaches nothing."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=api",
                    "-addext", f"subjectAltName=IP:{NOT_LOOPBACK}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    player = players(NOT_LOOPBACK, todos(1), tls=tls)
    untrusting = workers(lane, "--server", f"https://{player.address}", command=SHELL_COMPLETE)
    untrusting.logged("CERTIFICATE_VERIFY_FAILED", seconds=20)
    assert untrusting.stop() == 0 and player.requests == []
    trusting = workers(lane, "--server", f"https://{player.address}", "--once", "--wait", "10",
                       command=SHELL_COMPLETE, env={"SSL_CERT_FILE": str(cert)})
    assert trusting.proc.wait(timeout=30) == 0, trusting.output()
    [(_, path, body)] = player.calls("/complete")
    assert path == "/api/v1/todos/td_0000/complete" and body["lease_token"] == "lt_0"


@needs_address
def test_a_server_behind_the_environments_proxy_is_reached_through_it(lane, workers, players):
    """With HTTP_PROXY set and a server that is not this machine, the calls go through the proxy (httpx carries
    them, NO_PROXY and all), as they did before the worker had a client of its own."""
    proxy = players("127.0.0.1", todos(1))
    unreachable = f"http://{NOT_LOOPBACK}:9"  # nothing listens there: only the proxy can answer
    worker = workers(lane, "--server", unreachable, "--once", "--wait", "10", command=SHELL_COMPLETE,
                     env={"HTTP_PROXY": f"http://{proxy.address}", "NO_PROXY": ""})
    assert worker.proc.wait(timeout=30) == 0, worker.output()
    assert [path for _, path, _ in proxy.requests] == [f"{unreachable}/api/v1/todos/claim",
                                                       f"{unreachable}/api/v1/todos/td_0000/complete"]


def test_garbled_framing_is_a_broken_answer_tried_again_never_a_traceback(lane, workers, players):
    """A chunked answer whose chunk size is not hex: the server counts as unreachable (logged once), the claim is
    tried again with backoff, on a new connection each time."""
    player = players("127.0.0.1", todos(1), framing="garbled")
    worker = workers(lane, "--server", f"http://{player.address}", command=SHELL_COMPLETE)
    worker.logged("unreachable (BrokenAnswer: a chunked answer with a garbled chunk size)")
    test_worker.eventually(lambda: len(player.requests) >= 2, 10, "the claim tried again")
    assert worker.stop() == 0
    assert "Traceback" not in worker.output() and worker.output().count("unreachable") == 1
    assert len({number for number, _, _ in player.requests}) == len(player.requests)


def test_nothing_listening_is_unreachable_not_a_traceback(lane, workers):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    worker = workers(lane, "--server", f"http://127.0.0.1:{port}", command=SHELL_COMPLETE)
    worker.logged("unreachable (BrokenAnswer: ConnectionRefusedError")
    assert worker.stop() == 0 and "Traceback" not in worker.output()

