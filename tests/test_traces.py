"""Traces (SPEC 17, issue 47): real processes and a real OTLP/HTTP receiver of ours.

`serve` runs with OTEL_EXPORTER_OTLP_ENDPOINT pointing at Receiver, a small HTTP server that decodes each
`ExportTraceServiceRequest` with the `opentelemetry-proto` package, as a collector (Jaeger, Tempo, SigNoz) would.
A signed GitHub delivery is worked by `switchboard worker --exec`, whose child reports the TRACEPARENT it was given;
the spans that arrive must make one trace with the parents, kinds and attributes the SPEC names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import producers
import pytest
from conftest import ROOT, LiveServer, cli
from forges import REPO as FORGE_REPO
from forges import RULES as FORGE_RULES
from forges import FakeForge
from helpers import hook_path
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from test_triage import MODEL, FakeModel, sized, triage_worker_command

from switchboard.tracing import start_tracing

BOT = "switchboard-bot"  # the login of the forge connection's token
FORGE_TOKEN = "ghp_" + "Tr4ce" * 8

KINDS = {Span.SPAN_KIND_SERVER: "server", Span.SPAN_KIND_INTERNAL: "internal", Span.SPAN_KIND_PRODUCER: "producer",
         Span.SPAN_KIND_CONSUMER: "consumer", Span.SPAN_KIND_CLIENT: "client"}
PRODUCER_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
SECRET_WORDS = "the payload's own words, never in a span"
# The child of `worker --exec`: it does nothing but say which TRACEPARENT it was handed.
CHILD = [sys.executable, "-c", "import json, os\n"
         "print(json.dumps({'outcome': 'complete', 'summary': 'done', 'result': {'traceparent':"
         " os.environ.get('TRACEPARENT')}}))\n"]


class Receiver(ThreadingHTTPServer):
    """OTLP/HTTP's traces endpoint (`POST /v1/traces`, protobuf): every span it is sent, decoded."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[dict] = []
        self.requests = 0
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        with self.lock:
            self.requests += 1
            for resource in request.resource_spans:
                service = {a.key: a.value.string_value for a in resource.resource.attributes}.get("service.name")
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        self.spans.append({
                            "name": span.name, "kind": KINDS[span.kind], "trace": span.trace_id.hex(),
                            "id": span.span_id.hex(), "parent": span.parent_span_id.hex() or None,
                            "service": service, "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "links": [(link.trace_id.hex(), link.span_id.hex(),
                                       {a.key: _value(a.value) for a in link.attributes}) for link in span.links]})

    def named(self, name: str) -> list[dict]:
        with self.lock:
            return [span for span in self.spans if span["name"] == name]

    def wait_for(self, *names: str, seconds: float = 20) -> dict[str, dict]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            found = {name: self.named(name) for name in names}
            if all(found.values()):
                return {name: spans[0] for name, spans in found.items()}
            time.sleep(0.05)
        raise AssertionError(f"spans {names} not all received; got {[s['name'] for s in self.spans]}")


def _value(value) -> object:
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - the standard library's name
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path == "/v1/traces" and self.headers.get("content-type") == "application/x-protobuf":
            self.server.take(body)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.shutdown()
    server.server_close()


def otel_environment(receiver: Receiver) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "50"}


def deploy(db_path: str, server: LiveServer, directory: Path, queue: str = "lane-s") -> dict:
    """A human, an endpoint draining `queue` (its token in a file) and a GitHub webhook routed to it."""
    code, human = cli(db_path, "human", "add", "alice")
    assert code == 0, human

    def call(method: str, path: str, **body) -> dict:
        answer = httpx.request(method, f"{server.url}/api/v1{path}", json=body, timeout=10,
                               headers={"Authorization": f"Bearer {human['token']}"})
        assert answer.status_code in (200, 201), answer.text
        return answer.json()

    endpoint = call("POST", "/endpoints", name="lane", queues=[queue], verbs=["drain"])
    hook = call("POST", "/webhooks", provider="github", queue=queue, endpoint_id=endpoint["id"],
                trusted_actors={"logins": ["Codertocat"], "match": "sender"})
    token_file = directory / "lane.token"
    token_file.write_text(endpoint["token"] + "\n")
    token_file.chmod(0o600)
    return {"endpoint": endpoint, "hook": hook, "token_file": token_file, "human": human}


def deliver(server: LiveServer, hook: dict, number: int, headers: dict | None = None) -> dict:
    raw, signed = producers.github("issues.opened", hook["secret"], {
        "issue": {"number": number, "title": "A title " + "x" * 300, "body": SECRET_WORDS}})
    answer = httpx.post(server.url + hook_path(hook["url"]), content=raw, headers={**signed, **(headers or {})},
                        timeout=10)
    assert answer.status_code == 202, answer.text
    return answer.json()


def run_worker(server: LiveServer, site: dict, directory: Path) -> str:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SWITCHBOARD_", "OTEL_"))}
    done = subprocess.run([sys.executable, "-m", "switchboard.worker", "--server", server.url, "--token-file",
                           str(site["token_file"]), "--state-dir", str(directory / "state"), "--name", "lane-worker",
                           "--once", "--wait", "10", "--exec", "--", *CHILD],
                          cwd=ROOT, env=environment, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_a_delivery_worked_by_worker_exec_is_one_trace(db_path, tmp_path, receiver):
    server = LiveServer(db_path, env=otel_environment(receiver))
    try:
        site = deploy(db_path, server, tmp_path)
        delivered = deliver(server, site["hook"], 7, {"traceparent": PRODUCER_TRACEPARENT})
        [made] = delivered["todos"]
        output = run_worker(server, site, tmp_path)
        todo = httpx.get(f"{server.url}/api/v1/todos/{made['id']}", timeout=10,
                         headers={"Authorization": f"Bearer {site['human']['token']}"}).json()
        assert todo["state"] == "done", output
        spans = receiver.wait_for("ingest github", "route", "send lane-s", "process lane-s")
    finally:
        server.stop()
    ingest, route, send, process = (spans[n] for n in ("ingest github", "route", "send lane-s", "process lane-s"))

    # One trace, each span under the one before it, of the kinds the messaging conventions give.
    assert {span["trace"] for span in spans.values()} == {ingest["trace"]}
    assert ingest["parent"] is None and route["parent"] == ingest["id"]
    assert send["parent"] == route["id"] and process["parent"] == send["id"]
    assert [s["kind"] for s in (ingest, route, send, process)] == ["server", "internal", "producer", "consumer"]
    assert {span["service"] for span in spans.values()} == {"switchboard"}
    # The producer's traceparent is a link on the ingest span, never its parent nor its trace.
    producer_trace, producer_span = PRODUCER_TRACEPARENT.split("-")[1:3]
    assert ingest["trace"] != producer_trace
    assert ingest["links"] == [(producer_trace, producer_span, {"switchboard.link": "producer"})]
    # The process span runs from the claim to the completion, and the child got it as its TRACEPARENT.
    attempt = todo["attempts"][0]
    assert todo["result"] == {"traceparent": f"00-{process['trace']}-{process['id']}-01"}
    assert process["start"] <= process["end"] and process["start"] >= send["start"]
    assert attempt["outcome"] == "completed"

    assert send["attributes"] == {
        "messaging.system": "switchboard", "messaging.destination.name": "lane-s", "messaging.message.id": made["id"],
        "switchboard.endpoint_id": site["endpoint"]["id"], "switchboard.subject_key": "github:Codertocat/Hello-World#7",
        "switchboard.title": todo["title"][:200]}
    assert process["attributes"] == {
        "messaging.system": "switchboard", "messaging.destination.name": "lane-s", "messaging.message.id": made["id"],
        "switchboard.endpoint_id": site["endpoint"]["id"], "switchboard.subject_key": "github:Codertocat/Hello-World#7",
        "switchboard.attempt": 1, "switchboard.outcome": "completed"}
    assert ingest["attributes"]["switchboard.outcome"] == "routed"
    assert ingest["attributes"]["switchboard.event_id"] == delivered["event_id"]

    # No span holds the payload, a token or a secret; the title only cut to 200 characters.
    everything = json.dumps(receiver.spans)
    for secret in (SECRET_WORDS, site["hook"]["secret"], hook_path(site["hook"]["url"]).rsplit("/", 1)[-1],
                   site["endpoint"]["token"], site["human"]["token"]):
        assert secret not in everything
    assert len(send["attributes"]["switchboard.title"]) == 200


def test_without_an_endpoint_nothing_is_sent_and_no_exporter_thread_runs(db_path, tmp_path, receiver):
    """`serve --otel` with the extra but no endpoint exports nothing while a delivery is taken and worked; and the
    exporter's start, given no endpoint, starts no thread of the SDK's batch processor."""
    assert start_tracing({}, required=True) is None and start_tracing({}) is None
    server = LiveServer(db_path, "--otel", env={"OTEL_BSP_SCHEDULE_DELAY": "50"})
    try:
        site = deploy(db_path, server, tmp_path)
        deliver(server, site["hook"], 8)
        run_worker(server, site, tmp_path)
    finally:
        server.stop()
    assert receiver.requests == 0
    assert "no traces are exported" in server.log_path.read_text()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("OtelBatch")]


# A sitecustomize that makes the `otel` extra missing for real: `opentelemetry.sdk` and the OTLP exporter cannot be
# imported in that interpreter (the API, a dependency of others, stays importable).
BLOCKER = textwrap.dedent("""
    import importlib.abc, sys

    class Missing(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Missing())
""")


def test_serve_otel_without_the_extra_exits_1_naming_it(db_path, tmp_path, receiver):
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "sitecustomize.py").write_text(BLOCKER)
    environment = {**os.environ, **otel_environment(receiver),
                   "PYTHONPATH": os.pathsep.join([str(blocked), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "switchboard.py"), "serve", "--db", db_path, "--port", "0",
                           "--otel"], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "`otel` extra" in done.stdout + done.stderr
    assert receiver.requests == 0


def test_the_todo_page_draws_its_life_on_a_time_axis_with_its_trace(world, alice, client, clock):
    """Export or not, the Board's todo page draws the wait, the attempt and its end from the store, and names the
    trace the claim handed the worker; the subject page names each todo's trace too."""
    endpoint = world.endpoint(alice, ["lane-s"])
    pushed = world.push(alice, endpoint, "lane-s", "a job")
    clock.advance(2)
    claim = world.claim(endpoint)
    trace_id = claim["traceparent"].split("-")[1]
    clock.advance(3)
    done = client.post(f"/api/v1/todos/{pushed['id']}/complete", headers=endpoint.auth,
                       json={"lease_token": claim["lease_token"], "summary": "done"})
    assert done.status_code == 200, done.text
    answer = client.post("/board/login", data={"token": alice.token}, headers={"Origin": "http://testserver"},
                         follow_redirects=False)
    assert answer.status_code == 303, answer.text
    page = client.get(f"/board/todos/{pushed['id']}").text
    assert f'<code id="trace-id">{trace_id}</code>' in page
    assert '<svg class="time-axis"' in page
    assert "pending: 2.0 s" in page and "claimed: 3.0 s" in page
    assert "attempt 1: completed after 3.0 s, 0 heartbeats" in page


# -- the seed's loop: triage, the server's label write, its echo, the lane ------------------------------------------

def test_the_seeds_loop_is_one_trace_from_the_issue_to_the_lane_workers_child(db_path, tmp_path, receiver):
    """An issue opened on a forge of ours is triaged by `worker --triage` (a model of ours sizes it S), which
    completes with an `add_labels` output; the server writes the label through the webhook's connection, the forge
    sends the label event back, the rules route it to lane-s, and `worker --exec` works it. One trace: `ingest
    github` → `route` → `send triage` → `process triage` (with the model call `chat MODEL` under it) → `forge
    add_labels` → the label event's `ingest github` (under the write and linked to it) → `route` → `send lane-s` →
    `process lane-s`, whose span the child got as TRACEPARENT."""
    forge = FakeForge("github", FORGE_TOKEN, BOT)
    model = FakeModel()
    model.script = lambda request: sized("S")
    server = LiveServer(db_path, "--notify-allow-private", env=otel_environment(receiver))
    try:
        code, human = cli(db_path, "human", "add", "alice")
        assert code == 0, human

        def call(method: str, path: str, **body) -> dict:
            answer = httpx.request(method, f"{server.url}/api/v1{path}", json=body, timeout=10,
                                   headers={"Authorization": f"Bearer {human['token']}"})
            assert answer.status_code in (200, 201), answer.text
            return answer.json()

        triage = call("POST", "/endpoints", name="triage", queues=["triage"], verbs=["all"])
        lane = call("POST", "/endpoints", name="lane", queues=["lane-s"], verbs=["drain"])
        hook = call("POST", "/webhooks", provider="github", queue="triage", endpoint_id=triage["id"],
                    trusted_actors={"allow_all": True})
        call("POST", f"/webhooks/{hook['id']}/routes", endpoint_id=lane["id"])
        call("PUT", f"/webhooks/{hook['id']}/rules", **FORGE_RULES)
        connection = call("POST", "/connections", kind="github", api_url=forge.api, token=FORGE_TOKEN,
                          repos=["acme/"])
        call("PUT", f"/webhooks/{hook['id']}/connection", connection_id=connection["id"])
        forge.hook = (server.url + hook_path(hook["url"]), hook["secret"])
        files = {}
        for name, text in (("triage", triage["token"]), ("lane", lane["token"]), ("llm", "sk-" + "k" * 20)):
            files[name] = tmp_path / f"{name}.secret"
            files[name].write_text(text + "\n")
            files[name].chmod(0o600)

        forge.open(FORGE_REPO, 41)
        opened = forge.wait_for(lambda: forge.sent[:1], what="the issue's delivery")[0]
        environment = {**{k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")},
                       **otel_environment(receiver)}
        triaged = subprocess.run(triage_worker_command([
            "--server", server.url, "--token-file", str(files["triage"]), "--state-dir", str(tmp_path / "state"),
            "--name", "triage-worker", "--llm-url", f"{model.url}/v1", "--llm-model", MODEL, "--llm-key-file",
            str(files["llm"]), "--once", "--wait", "10"]), cwd=ROOT, env=environment, capture_output=True,
            text=True, timeout=60)
        assert triaged.returncode == 0, triaged.stdout + triaged.stderr
        labelled = forge.wait_for(lambda: next((a for a in forge.sent if any(
            t["queue"] == "lane-s" for t in a.get("todos", []))), None), what="the label event routed to lane-s")
        site = {"token_file": files["lane"]}
        run_worker(server, site, tmp_path)
        [lane_todo] = labelled["todos"]
        worked = call("GET", f"/todos/{lane_todo['id']}")
        assert worked["state"] == "done"
        spans = receiver.wait_for("send triage", "process triage", f"chat {MODEL}", "forge add_labels",
                                  "send lane-s", "process lane-s")
        with httpx.Client(base_url=server.url, timeout=10) as board:
            signed_in = board.post("/board/login", data={"token": human["token"]}, headers={"Origin": server.url})
            assert signed_in.status_code == 303, signed_in.text
            subject_page = board.get(f"/board/subjects/github:{FORGE_REPO}%2341").text
        ingests = {s["attributes"].get("switchboard.event_id"): s for s in receiver.named("ingest github")}
        receiver.wait_for("route")
    finally:
        server.stop()
        forge.stop()
        model.stop()
    first, echo = ingests[opened["event_id"]], ingests[labelled["event_id"]]
    routes = {s["parent"]: s for s in receiver.named("route")}
    chain = [first, routes[first["id"]], spans["send triage"], spans["process triage"], spans["forge add_labels"],
             echo, routes[echo["id"]], spans["send lane-s"], spans["process lane-s"]]
    assert [s["name"] for s in chain] == ["ingest github", "route", "send triage", "process triage",
                                          "forge add_labels", "ingest github", "route", "send lane-s",
                                          "process lane-s"]
    assert [s["kind"] for s in chain] == ["server", "internal", "producer", "consumer", "client", "server",
                                          "internal", "producer", "consumer"]
    assert {s["trace"] for s in chain} == {first["trace"]} and first["parent"] is None
    assert [s["parent"] for s in chain[1:]] == [s["id"] for s in chain[:-1]]
    assert echo["links"] == [(first["trace"], spans["forge add_labels"]["id"], {"switchboard.link": "forge_write"})]
    # The triage worker's model call is a span of its own under its attempt's, from the worker's own exporter.
    chat = spans[f"chat {MODEL}"]
    assert (chat["trace"], chat["parent"], chat["kind"]) == (first["trace"], spans["process triage"]["id"], "client")
    assert chat["service"] == "switchboard-worker"
    # The lane worker's child was handed the process span.
    process = spans["process lane-s"]
    assert worked["result"] == {"traceparent": f"00-{process['trace']}-{process['id']}-01"}
    assert spans["forge add_labels"]["attributes"]["switchboard.outcome"] == "sent"
    # The subject page names the trace of each of its todos: here, the one trace of both.
    assert subject_page.count(f'<code class="trace-id">{first["trace"]}</code>') == 2
    everything = json.dumps(receiver.spans)
    for secret in (FORGE_TOKEN, hook["secret"], triage["token"], lane["token"], human["token"], "sk-" + "k" * 20):
        assert secret not in everything


def test_a_notification_about_a_todo_is_a_span_under_its_send_span(db_path, tmp_path, receiver):
    """The human's channel is told a todo needs input: `notify webhook` (CLIENT), in the todo's trace, under its
    `send` span, after the attempt's `process` span ended `needs_input`. Producer text stays out of it."""
    server = LiveServer(db_path, "--notify-allow-private", env=otel_environment(receiver))
    try:
        site = deploy(db_path, server, tmp_path)
        auth = {"Authorization": f"Bearer {site['human']['token']}"}
        channel = httpx.post(f"{server.url}/api/v1/notify", headers=auth, timeout=10, json={
            "kind": "webhook", "url": f"{receiver.url}/channel", "events": ["needs_input"]})
        assert channel.status_code == 201, channel.text
        [made] = deliver(server, site["hook"], 9)["todos"]
        lane = {"Authorization": f"Bearer {site['endpoint']['token']}"}
        claim = httpx.post(f"{server.url}/api/v1/todos/claim", headers=lane, json={}, timeout=10).json()
        asked = httpx.post(f"{server.url}/api/v1/todos/{made['id']}/needs-input", headers=lane, timeout=10,
                           json={"lease_token": claim["lease_token"], "question": "which branch?"})
        assert asked.status_code == 200, asked.text
        spans = receiver.wait_for("send lane-s", "process lane-s", "notify webhook")
    finally:
        server.stop()
    send, process, notify = spans["send lane-s"], spans["process lane-s"], spans["notify webhook"]
    assert claim["traceparent"] == f"00-{process['trace']}-{process['id']}-01"
    assert process["attributes"]["switchboard.outcome"] == "needs_input"
    assert (notify["trace"], notify["parent"], notify["kind"]) == (send["trace"], send["id"], "client")
    assert notify["attributes"]["messaging.message.id"] == made["id"]
    assert notify["attributes"]["switchboard.outcome"] == "sent"
    assert "which branch?" not in json.dumps(receiver.spans) and SECRET_WORDS not in json.dumps(receiver.spans)


def test_each_attempt_is_its_own_process_span_and_a_lapsed_lease_ends_one(db_path, tmp_path, receiver):
    """A lease that lapses ends its attempt's span (`lease_expired`, from the claim to the reaping); the next claim
    is a new span under the same `send` span, and the claim's traceparent names it."""
    server = LiveServer(db_path, env=otel_environment(receiver))
    try:
        site = deploy(db_path, server, tmp_path)
        [made] = deliver(server, site["hook"], 10)["todos"]
        lane = {"Authorization": f"Bearer {site['endpoint']['token']}"}
        first = httpx.post(f"{server.url}/api/v1/todos/claim", headers=lane, json={"lease_seconds": 1},
                           timeout=10).json()
        expired = receiver.wait_for("process lane-s")["process lane-s"]
        second = httpx.post(f"{server.url}/api/v1/todos/claim", headers=lane, json={}, timeout=10).json()
        done = httpx.post(f"{server.url}/api/v1/todos/{made['id']}/complete", headers=lane, timeout=10,
                          json={"lease_token": second["lease_token"]})
        assert done.status_code == 200, done.text
        deadline = time.monotonic() + 20
        while len(receiver.named("process lane-s")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        send = receiver.wait_for("send lane-s")["send lane-s"]
    finally:
        server.stop()
    ended = {s["attributes"]["switchboard.attempt"]: s for s in receiver.named("process lane-s")}
    assert sorted(ended) == [1, 2]
    assert ended[1] == expired and expired["attributes"]["switchboard.outcome"] == "lease_expired"
    assert ended[2]["attributes"]["switchboard.outcome"] == "completed"
    assert {s["parent"] for s in ended.values()} == {send["id"]} and {s["trace"] for s in ended.values()} == {
        send["trace"]}
    assert [first["traceparent"], second["traceparent"]] == [f"00-{s['trace']}-{s['id']}-01"
                                                             for s in (ended[1], ended[2])]
    assert expired["end"] - expired["start"] >= 1_000_000_000  # from the claim to at least the lease's end


def test_the_store_never_imports_the_sdk():
    """The store keeps ids and strings; only switchboard.tracing (and the worker's own) touch OpenTelemetry."""
    package = ROOT / "switchboard"
    touching = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                      if "opentelemetry" in path.read_text())
    assert touching == ["tracing.py", "worker/tracing.py"]
