"""Every multi-line shell example in README.md and docs/*.md, run as written in bash (`set -euo pipefail`) against
a real server (`python switchboard.py serve` on a free loopback port, a fresh database), so the docs cannot drift.

What the test prepares is what a reader has at hand, never a stand-in for a tool:

- a shell of its own: a private HOME (whose `.curlrc` says `fail-with-body`, so an HTTP error fails the block and
  shows the answer), TMPDIR inside the test's directory, `python`, `python3` and `switchboard` on PATH running
  this interpreter and this checkout's launcher, and a working directory that looks like the checkout (links to
  the launcher, the package, tests/ and deploy/), in which a block must leave no file behind;
- the variables a block names for the reader to fill in (`$SB`, `$HUMAN`, `$AGENT`, `$EP`, `$HOOK`, `$TODO`,
  `$EVENT`, `$URL`, `$SECRET`, `$CHANNEL`, ...), made on the server first, and the input files it names
  (`issue.json`, `event.json`, `fixed-rules.json`, ...);
- four rewrites of the text, each a place outside the test's reach: the docs' default address
  (`localhost:8080`) is the test server's, the system paths `/var/lib/switchboard` and `/srv/backups` live under
  the test's directory, GitHub's API (`https://api.github.com`, which the seed's loop block's forge connection
  asks who its token is) is a GitHub of our own (tests/forges.py), and a stream (`curl -N`, which runs until
  stopped) is stopped after a few seconds.

Blocks that need root, systemd, docker, a model or a forge are listed in SKIPPED with the reason, so that leaving
one out is a decision. A new multi-line block must be run here or listed there: the first test fails otherwise.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import producers
from conftest import ROOT, LiveServer, cli
from helpers import hook_path, system_tool

DOCS = ("README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))))
FENCE = re.compile(r"^([ \t]*)```([^\n`]*)\n(.*?)^\1```[ \t]*$", re.S | re.M)  # also indented, in a list
STREAM_SECONDS = 1
METRICS_TOKEN = "docs-metrics-token-0123456789"
STRIPE_SECRET = "whsec_" + "d0c5" * 8


@dataclass(frozen=True)
class Block:
    path: str
    line: int
    lang: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def commands(self) -> list[str]:
        """The block's commands: a line continued by `\\` or by an open quote joined to the next, comments and
        blank lines left out, a here-document kept with the command that reads it."""
        commands, current, quote, i, text = [], "", None, 0, self.text
        while i < len(text):
            c = text[i]
            if quote == "'":
                quote = None if c == "'" else quote
            elif c == "\\" and i + 1 < len(text):
                current += " " if text[i + 1] == "\n" else text[i:i + 2]
                i += 2
                continue
            elif quote == '"':
                quote = None if c == '"' else quote
            elif c in "'\"":
                quote = c
            elif c == "#" and (not current or current[-1] in " \t;"):
                i = text.find("\n", i) if "\n" in text[i:] else len(text)
                continue
            elif c == "\n":
                if current.strip():
                    marker = re.search(r"<<-?\s*['\"]?(\w+)", current)
                    if marker:  # the here-document's body, up to its end marker, belongs to this command
                        end = re.compile(rf"^{marker.group(1)}$", re.M).search(text, i + 1)
                        current += text[i:end.end()] if end else text[i:]
                        i = end.end() if end else len(text)
                    commands.append(current.strip())
                current = ""
                i += 1
                continue
            current += c
            i += 1
        if current.strip():
            commands.append(current.strip())
        return commands


def all_blocks() -> list[Block]:
    found = []
    for path in DOCS:
        text = (ROOT / path).read_text()
        for match in FENCE.finditer(text):
            indent, lang, body = match.groups()
            body = "".join(line[len(indent):] if line.startswith(indent) else line
                           for line in body.splitlines(keepends=True))
            found.append(Block(path, text.count("\n", 0, match.start()) + 1, lang.strip(), body))
    return found


def shell_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.lang == "sh"]


def multi_line_blocks() -> list[Block]:
    return [b for b in shell_blocks() if len(b.commands) > 1]


def block(path: str, needle: str) -> Block:
    """The one multi-line shell block of `path` that contains `needle`."""
    found = [b for b in multi_line_blocks() if b.path == path and needle in b.text]
    assert len(found) == 1, f"{path}: {len(found)} multi-line sh blocks contain {needle!r}: {found}"
    return found[0]


def any_block(path: str, needle: str) -> Block:
    """The one shell block (of any length) of `path` that contains `needle`."""
    found = [b for b in shell_blocks() if b.path == path and needle in b.text]
    assert len(found) == 1, f"{path}: {len(found)} sh blocks contain {needle!r}"
    return found[0]


# Left out, each with its reason. Keep this short: a block that can run here, runs.
SKIPPED = {
    ("README.md", "pip install -r requirements-lock.txt"):
        "installs packages and then runs the whole suite (this test included)",
    ("README.md", "python3 -m venv .venv"):
        "makes a virtual environment and installs the package; tests/test_packaging.py builds the wheel and runs it",
    ("README.md", "worker --triage --token-file \"$CREDS/triage.token\""):
        "workers run until stopped, against a model and agent scripts of your own; tests/test_triage.py and"
        " tests/test_worker.py drive these flags",
    ("docs/workers.md", "--exec -- ./agents/lane-s.sh"):
        "root, and workers that run until stopped, running agent scripts of your own; tests/test_worker.py drives"
        " these flags",
    ("docs/workers.md", "vllm serve"):
        "needs vLLM and a model; tests/test_triage.py runs the worker against a model of its own",
    ("docs/running.md", "sudo systemctl daemon-reload"): "root and systemd (installs the service)",
    ("docs/operations.md", "docker build"): "docker",
    ("docs/operations.md", "pip install 'switchboard-hooks[otel]'"):
        "installs packages and serves until stopped, against a collector of your own; tests/test_traces.py runs"
        " serve with the extra and an OTLP receiver of ours",
    ("docs/operations.md", "apt-get update && apt-get install"): "root and systemd (a fresh Debian box)",
    ("docs/operations.md", "systemd-run --quiet --pipe"): "systemd (the service's dynamic user)",
    ("docs/operations.md", "systemctl list-timers"): "systemd (the backup timer)",
    ("docs/operations.md", "chown prometheus:"): "root and the prometheus user (/etc/prometheus)",
    ("docs/operations.md", "promtool check rules"):
        "root, a Prometheus install and systemd; tests/test_deploy.py runs promtool on deploy/alerts.yml",
    ("docs/triage.md", "install -m 0600 /dev/null /etc/switchboard/triage-forge.token"): "root (/etc/switchboard)",
    ("docs/triage.md", "connection add --human alice --kind gitea"):
        "a Gitea that answers who the token is, and a webhook id to fill in; the README's seed's loop block runs the"
        " same two commands against a GitHub of our own (test_readme_top_to_bottom_on_one_server)",
    ("docs/triage.md", "systemctl daemon-reload && systemctl enable --now switchboard-worker@triage"):
        "root and systemd (the worker's unit)",
    ("docs/postgres.md", "createdb switchboard"):
        "root (/etc/switchboard) and a Postgres server at db.lan; tests/test_postgres.py serves on a cluster of its own",
    ("docs/postgres.md", "docker compose -f deploy/compose.postgres.yaml up"): "docker",
}


# ---------------------------------------------------------------------------------------------------------------
# The reader's shell


class Shell:
    """A shell like the reader's, inside the test's directory (see the module's docstring)."""

    def __init__(self, tmp: Path, reroot: dict[str, Path] | None = None, address: str | None = None,
                 apis: dict[str, str] | None = None):
        self.tmp = tmp
        self.home = tmp / "home"
        self.home.mkdir()
        (self.home / ".curlrc").write_text("fail-with-body\n")
        self.creds = self.home / ".config" / "switchboard"
        (tmp / "tmp").mkdir()
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        for name, command in (("python", sys.executable), ("python3", sys.executable),
                              ("switchboard", f"{sys.executable} {ROOT / 'switchboard.py'}")):
            (bin_dir / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')
            (bin_dir / name).chmod(0o755)
        self.checkout = tmp / "checkout"
        self.checkout.mkdir()
        for name in ("switchboard.py", "switchboard", "tests", "deploy"):
            (self.checkout / name).symlink_to(ROOT / name)
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("SWITCHBOARD_") and k not in ("XDG_CONFIG_HOME", "CURL_HOME", "PYTHONPATH")}
        self.env.update(HOME=str(self.home), TMPDIR=str(tmp / "tmp"), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        self.reroot = reroot or {}
        self.address = address
        self.apis = apis or {}  # a service's public API (https://api.github.com) -> a server of ours playing it
        system_tool("curl", "curl")

    def private_dir(self) -> Path:
        """The README's private directory for credentials, made as its lane block makes it."""
        self.creds.mkdir(parents=True, exist_ok=True)
        self.creds.chmod(0o700)
        return self.creds

    def rewrite(self, text: str) -> str:
        if self.address:
            text = text.replace("localhost:8080", self.address).replace("127.0.0.1:8080", self.address)
        for system_path, here in sorted(self.reroot.items(), key=lambda item: -len(item[0])):
            text = text.replace(system_path, str(here))
        for public, ours in self.apis.items():
            text = text.replace(public, ours)
        return text

    def run(self, blocks: list[Block], env: dict | None = None, files: dict | None = None,
            allowed: set[str] = frozenset()) -> subprocess.CompletedProcess:
        """Run `blocks` in order in one bash, as a reader pasting them into one terminal would."""
        preamble = (
            "set -euo pipefail\n"
            "umask 022\n"  # the reader's usual umask (this process's may be 077: the CLI run in-process sets it)
            # A stream (curl -N) runs until stopped: stop it after a few seconds, as the reader's Ctrl-C would.
            "curl() { case \" $* \" in *' -N '*) command curl --max-time %d \"$@\" || [ $? -eq 28 ];;"
            " *) command curl \"$@\";; esac; }\n" % STREAM_SECONDS)
        script = preamble + "".join(f"echo '### {b}' >&2\n{self.rewrite(b.text)}\n" for b in blocks)
        for name, content in (files or {}).items():
            target = self.checkout / name
            target.write_bytes(content if isinstance(content, bytes) else content.encode())
        before = self.files()
        try:
            done = subprocess.run(["bash", "-c", script], cwd=self.checkout, env={**self.env, **(env or {})},
                                  capture_output=True, text=True, timeout=120)
        finally:
            for name in files or {}:
                (self.checkout / name).unlink(missing_ok=True)
        which = ", ".join(str(b) for b in blocks)
        assert done.returncode == 0, (f"{which} failed (exit {done.returncode}):\n--- stderr\n{done.stderr[-4000:]}"
                                      f"\n--- stdout\n{done.stdout[-3000:]}")
        left = self.files() - before - set(files or {}) - set(allowed)
        assert not left, f"{which} left files in the checkout: {sorted(left)}"
        self.check_private()
        return done

    def files(self) -> set[str]:
        """What lies in the working checkout besides its links."""
        return {str(p.relative_to(self.checkout)) for p in self.checkout.rglob("*") if not p.is_symlink()}

    def check_private(self) -> None:
        """Credentials the docs write to the private directory stay private: the directory 0700, each file 0600."""
        if self.creds.exists():
            assert self.creds.stat().st_mode & 0o777 == 0o700
            for path in self.creds.iterdir():
                assert path.stat().st_mode & 0o777 == 0o600, path


def shape(value):
    """The keys of an answer, all the way down (a list by its first item): what a documented answer promises."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return None


def documented_answer(b: Block):
    """The answer a block shows in the comment after its last command (`# {...}` lines), parsed."""
    tail = re.search(r"((?:^# ?[{\[ ].*\n?)+)\Z", b.text, re.M)
    return json.loads("".join(line[2:] for line in tail.group(1).splitlines())) if tail else None


def last_json(output: str):
    """The last JSON object a block printed (curl prints an answer without a newline)."""
    for start in reversed([m.start() for m in re.finditer(r"\{", output)]):
        try:
            return json.loads(output[start:])
        except ValueError:
            continue
    raise AssertionError(f"no JSON answer at the end of: {output[-500:]}")


# ---------------------------------------------------------------------------------------------------------------
# What the blocks need on the server


class Scene:
    """alice, her endpoint `agent` (build, triage), and the webhooks and deliveries a block names, made on a
    live server through its API and the CLI."""

    def __init__(self, server: LiveServer, db: str):
        self.server, self.db = server, db
        _, alice = cli(db, "human", "add", "alice")
        self.human = alice["token"]
        self.http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {self.human}"}, timeout=30)
        agent = self.call("POST", "/api/v1/endpoints", json={
            "name": "agent", "queues": ["build", "triage"], "verbs": ["drain"], "webhook_max": 100})
        self.ep, self.agent = agent["id"], agent["token"]
        self.serial = 0

    def close(self) -> None:
        self.http.close()
        self.server.stop()

    def call(self, method: str, path: str, **kwargs) -> dict:
        answer = self.http.request(method, path, **kwargs)
        assert answer.status_code < 300, answer.text
        return answer.json()

    def env(self, **extra) -> dict:
        return {"SB": self.server.url, "HUMAN": self.human, "AGENT": self.agent, "EP": self.ep, **extra}

    def webhook(self, provider: str, queue: str = "build", **body) -> dict:
        return self.call("POST", "/api/v1/webhooks", json={
            "endpoint_id": self.ep, "provider": provider, "queue": queue, **body})

    def push(self, title: str) -> dict:
        return self.call("POST", f"/api/v1/endpoints/{self.ep}/todos", json={"title": title, "queue": "build"})

    def deliver(self, hook: dict, raw: bytes, headers: dict) -> dict:
        answer = httpx.post(self.server.url + hook_path(hook["url"]), content=raw, headers=headers, timeout=30)
        assert answer.status_code == 202, answer.text
        return answer.json()

    def issue(self, hook: dict, sender: str = "alice") -> dict:
        """A signed GitHub issue to `hook`, a new one each time (a repeated body would be a duplicate)."""
        self.serial += 1
        raw, headers = producers.github("issues.opened", hook["secret"], {
            "sender": {"login": sender}, "issue": {"number": 900 + self.serial, "title": f"doc issue {self.serial}"}})
        return self.deliver(hook, raw, headers)

    def held(self) -> tuple[str, dict]:
        """A delivery the trust gate holds (its sender is not trusted), and its webhook."""
        hook = self.webhook("github", trusted_actors={"logins": ["alice"], "match": "sender"})
        answer = self.issue(hook, sender=f"newcomer-{self.serial}")
        assert answer["disposition"] == "quarantined", answer
        return answer["todos"][0]["id"], hook


DROP_ALL = {"rules": [{"id": "quiet", "expr": "true", "action": {"drop": True}}]}
ROUTE_ISSUES = {"rules": [{"id": "issues", "expr": ".issue != null", "action": {"queue": "build"}}],
                "default_action": {"drop": True}}


@dataclass
class Prep:
    env: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)
    check: Callable[[subprocess.CompletedProcess], None] | None = None


def prep_service_routes(scene: Scene, shell: Shell) -> Prep:
    def check(done):
        assert done.stdout.startswith("ok "), done.stdout[:200]
        assert "switchboard_" in done.stdout and "\n/api/v1/todos/claim\n" in done.stdout
    return Prep(scene.env(METRICS_TOKEN=METRICS_TOKEN), check=check)


def prep_replay(scene: Scene, shell: Shell) -> Prep:
    hook = scene.webhook("github", trusted_actors={"allow_all": True})
    scene.call("PUT", f"/api/v1/webhooks/{hook['id']}/rules", json=DROP_ALL)
    event = scene.issue(hook)["event_id"]
    scene.call("PUT", f"/api/v1/webhooks/{hook['id']}/rules", json=ROUTE_ISSUES)

    def check(done):
        assert last_json(done.stdout)["after"]["disposition"] == "routed", done.stdout
    return Prep(scene.env(HOOK=hook["id"], EVENT=event), check=check)


def prep_github_delivery(scene: Scene, shell: Shell) -> Prep:
    hook = scene.webhook("github", trusted_actors={"logins": ["alice"], "match": "sender"})
    body = (producers.FIXTURES / "github" / "issues.opened.json").read_text()
    body = json.dumps(producers.deep_merge(json.loads(body), {"sender": {"login": "alice"}}))
    b = block("docs/api.md", "X-Hub-Signature-256: sha256=$SIG")

    def check(done):
        answer = last_json(done.stdout)
        assert shape(answer) == shape(documented_answer(b)), f"{b}: the documented answer differs: {answer}"
        assert answer["disposition"] == "routed" and answer["verified"] is True
    return Prep(scene.env(URL=hook["url"], SECRET=hook["secret"]), {"issue.json": body}, check)


def prep_stripe(scene: Scene, shell: Shell) -> Prep:
    hook = scene.webhook("stripe", secret=STRIPE_SECRET)
    event = {"id": "evt_docs_1", "type": "invoice.paid", "data": {"object": {"id": "in_1"}}}
    return Prep(scene.env(URL=hook["url"], SECRET=STRIPE_SECRET), {"event.json": json.dumps(event)}, routed)


def prep_slack(scene: Scene, shell: Shell) -> Prep:
    hook = scene.webhook("slack")
    secret = "8f742231b10e8888abcd99yyyzzz85a5"
    scene.call("PUT", f"/api/v1/webhooks/{hook['id']}/secret", json={"secret": secret})
    event = {"type": "event_callback", "event_id": "EvDocs1", "event": {"type": "app_mention", "text": "hi"}}
    return Prep(scene.env(URL=hook["url"], SECRET=secret), {"event.json": json.dumps(event)}, routed)


def prep_cairn(scene: Scene, shell: Shell) -> Prep:
    hook = scene.webhook("cairn", trusted_actors={"allow_all": True})
    raw, _ = producers.cairn(hook["secret"], patch={"event_id": "docs-artifact-1"})
    return Prep(scene.env(URL=hook["url"], SECRET=hook["secret"]), {"artifact.json": raw}, routed)


def shows_the_dry_run(output: str) -> None:
    """`rules test` with the fixture prints what the docs say: the pack drops the untrusted labeler's event, so the
    trust gate (after the rules) holds nothing."""
    assert re.search(r'^decision: \{.*"disposition": "dropped"', output, re.M), output[-2000:]
    assert re.search(r'^trace: \{"stage": "rule", .*"rule_id": "issue-untrusted".*"trust_gate": "untrusted_actor"',
                     output, re.M), output[-2000:]


def routed(done: subprocess.CompletedProcess) -> None:
    answer = last_json(done.stdout)
    assert answer["disposition"] == "routed" and answer["created"] == 1, answer


def prep_mcp_session(scene: Scene, shell: Shell) -> Prep:
    scene.push("claimed over MCP")
    scene.push("rung on the stream")  # the session's stream is rung at once for pending work

    def check(done):
        claimed, stream = done.stdout.split("event: message", 1)
        assert '"lease_token"' in claimed and "notifications/claude/channel" in stream, done.stdout[-1500:]
    return Prep(scene.env(), check=check)


def prep_mcp_sessionless(scene: Scene, shell: Shell) -> Prep:
    def check(done):
        assert '"resultType"' in done.stdout and "notifications/subscriptions/acknowledged" in done.stdout
    return Prep(scene.env(), check=check)


def prep_held(scene: Scene, shell: Shell) -> Prep:
    todo, hook = scene.held()

    def check(done):
        assert todo in done.stdout and "untrusted_actor" in done.stdout, done.stdout
    return Prep(scene.env(TODO=todo, HOOK=hook["id"]), check=check)


def prep_replay_fix(scene: Scene, shell: Shell) -> Prep:
    hook = scene.webhook("github", trusted_actors={"allow_all": True})
    scene.call("PUT", f"/api/v1/webhooks/{hook['id']}/rules", json=DROP_ALL)
    event = scene.issue(hook)["event_id"]

    def check(done):
        header = re.search(r"^FROM +TO +RULE_ID +COUNT$", done.stdout, re.M)
        assert header, f"the dry run's table of transitions is missing:\n{done.stdout}"
        shown = scene.call("GET", f"/api/v1/events/{event}")
        assert shown["replays"] and shown["replays"][-1]["after"]["disposition"] == "routed", shown["replays"]
    return Prep(scene.env(HOOK=hook["id"]), {"fixed-rules.json": json.dumps(ROUTE_ISSUES)}, check)


def prep_backups(scene: Scene, shell: Shell) -> Prep:
    backups = shell.reroot["/srv/backups"]
    if backups.exists():  # each block starts on a box without /srv/backups
        for path in backups.iterdir():
            path.unlink()
        backups.rmdir()

    def check(done):
        assert (backups.stat().st_mode & 0o777) == 0o700
        assert len(list(backups.glob("switchboard-*.db"))) >= 2
    return Prep({"SWITCHBOARD_DB": scene.db}, check=check)


# The blocks that run on one server with alice and her endpoint, each in a shell of its own, in this order.
def prep_queue_control(scene: Scene, shell: Shell) -> Prep:
    """The queue examples pause, cap, list, resume and clear `build`: it ends open and uncapped."""
    def check(done):
        build = next(q for q in scene.call("GET", f"/api/v1/endpoints/{scene.ep}/queues")["queues"]
                     if q["queue"] == "build")
        assert build["paused"] is None and build["limits"] == {"max_in_flight": None, "max_claims_per_window": None,
                                                              "max_in_flight_per_key": None,
                                                              "wait_limits": dict.fromkeys(
                                                                  ("pending", "needs_input", "review", "blocked"))}
        assert "quota" in done.stdout or "walls" in done.stdout, done.stdout[-500:]
    return Prep(scene.env(), check=check)


def prep_dead_letters(scene: Scene, shell: Shell) -> Prep:
    """Two dead letters on `build` for the bulk retry."""
    dead, agent = [], {"Authorization": f"Bearer {scene.agent}"}
    for n in range(2):
        todo = scene.push(f"a dead letter {n}")["id"]
        lease = httpx.post(f"{scene.server.url}/api/v1/todos/{todo}/claim", headers=agent, json={}).json()
        httpx.post(f"{scene.server.url}/api/v1/todos/{todo}/fail", headers=agent,
                   json={"lease_token": lease["lease_token"], "error": "the rules were wrong", "retry": False})
        dead.append(todo)

    def check(done):
        answer = last_json(done.stdout)
        assert answer["dry_run"] is False and answer["acted"] >= 2, answer
        assert {scene.call("GET", f"/api/v1/todos/{t}")["state"] for t in dead} == {"pending"}
    return Prep(scene.env(), check=check)


ON_THE_SERVER: list[tuple[str, str, Callable[[Scene, Shell], Prep]]] = [
    ("docs/api.md", "curl -s $SB/healthz", prep_service_routes),
    ("docs/api.md", "$SB/api/v1/webhooks/$HOOK/replay", prep_replay),
    ("docs/api.md", "queues/build/pause", prep_queue_control),
    ("docs/api.md", "$SB/api/v1/todos/bulk", prep_dead_letters),
    ("docs/running.md", "queue pause \"$EP\" build", prep_queue_control),
    ("docs/api.md", "X-Hub-Signature-256: sha256=$SIG", prep_github_delivery),
    ("docs/api.md", "Stripe-Signature: t=$T", prep_stripe),
    ("docs/api.md", "X-Slack-Signature: v0=$SIG", prep_slack),
    ("docs/api.md", "X-Cairn-Signature: sha256=$SIG", prep_cairn),
    ("docs/mcp.md", '"method":"initialize"', prep_mcp_session),
    ("docs/mcp.md", "subscriptions/listen", prep_mcp_sessionless),
    ("docs/cli.md", "todo list --state quarantined", prep_held),
    ("docs/cli.md", "events replay --webhook", prep_replay_fix),
    ("docs/cli.md", "backup --dir /srv/backups", prep_backups),
    ("docs/operations.md", "backup --dir /srv/backups", prep_backups),
]


def prep_pending(scene: Scene, shell: Shell) -> Prep:
    scene.push("waiting for a claim")
    return Prep(scene.env())


def prep_doorbell(scene: Scene, shell: Shell) -> Prep:
    scene.push("Ring \"me\"")
    shown = next(b for b in all_blocks() if b.path == "docs/api.md" and b.text.startswith("event: todo.ready"))

    def check(done):
        ring = next(line for line in done.stdout.splitlines() if line.startswith("data: "))
        documented = next(line for line in shown.text.splitlines() if line.startswith("data: "))
        assert "event: todo.ready" in done.stdout and done.stdout.startswith(": connected")
        assert json.loads(ring[6:]).keys() == json.loads(documented[6:]).keys(), ring
    return Prep(scene.env(), check=check)


def prep_release(scene: Scene, shell: Shell) -> Prep:
    todo, _ = scene.held()

    def check(done):
        assert last_json(done.stdout)["state"] == "pending", done.stdout[-500:]
    return Prep(scene.env(TODO=todo), check=check)


def prep_webhook_create(scene: Scene, shell: Shell) -> Prep:
    text = (ROOT / "docs/api.md").read_text()
    documented = json.loads(re.search(r"The answer is shown once:\n\n```json\n(.*?)```", text, re.S).group(1))

    def check(done):
        answer = last_json(done.stdout)
        assert answer.keys() == documented.keys(), f"api.md's webhook answer differs: {sorted(answer)}"
    return Prep(scene.env(), check=check)


def prep_generic(scene: Scene, shell: Shell) -> Prep:
    return Prep(scene.env(URL=scene.webhook("generic")["url"]), check=routed)


def prep_rules_test(scene: Scene, shell: Shell) -> Prep:
    hook = scene.webhook("github", trusted_actors={"logins": ["alice"], "match": "sender"})
    issue = (producers.FIXTURES / "github" / "issues.opened.json").read_text()

    def check(done):  # the fixture's sender is not alice: the trust gate holds it, as the page says
        answer = last_json(done.stdout)
        assert answer["trace"]["stage"] == "trust_gate" and answer["decision"]["disposition"] == "quarantined"
    return Prep(scene.env(HOOK=hook["id"]), {"issue.json": issue}, check)


# One-command blocks of the REST pages, run too (cheaply: curl). Not api.md's `POST /api/v1/notify`: its ntfy.sh
# channel would be sent this server's later held deliveries (test_notification_examples runs the same request).
SINGLE_ON_THE_SERVER: list[tuple[str, str, Callable[[Scene, Shell], Prep]]] = [
    ("docs/api.md", "todos?state=failed&limit=20", lambda scene, shell: Prep(scene.env())),
    ("docs/api.md", '"claimant": "gpu-box-1"', prep_pending),
    ("docs/api.md", "$SB/api/v1/doorbell?queue=build", prep_doorbell),
    ("docs/api.md", '"trust_actor": true, "note": "new maintainer"', prep_release),
    ("docs/api.md", '"default_lease_seconds": 600', lambda scene, shell: Prep(scene.env())),
    ("docs/api.md", '"key": "flaky-login"', lambda scene, shell: Prep(scene.env())),
    ("docs/api.md", '"trusted_actors": {"logins": ["alice"], "match": "sender"}}', prep_webhook_create),
    ("docs/api.md", "X-Delivery-Id: nightly-2026-11-30", prep_generic),
    ("docs/envelope-and-rules.md", "/rules/test", prep_rules_test),
]

# Blocks whose lines are alternatives ("one of these"): each line runs on its own, with its own held delivery.
ALTERNATIVES = [("docs/cli.md", "todo discard")]

# The README read top to bottom, in one terminal, against one server, with the pages it sends the reader to: the
# walk-through, the seed's loop (lanes, connection, the workers' token files), a dry run of the rules
# (webhooks.md), backup and restore (running.md).
README_TOP_TO_BOTTOM = [("README.md", "The operator makes a human"), ("README.md", "sb route add \"$HOOK\""),
                        ("docs/webhooks.md", "rules test \"$HOOK\""), ("docs/running.md", "STATE=/var/lib/switchboard")]

# cli.md's worked examples that continue one another on a throwaway database, in one terminal.
CLI_DEMO = [("docs/cli.md", "DEMO=$(mktemp -d)"), ("docs/cli.md", "--provider stripe")]

NOTIFICATIONS = [("docs/notifications.md", "# REST, as the human"), ("docs/notifications.md", "# CLI, as the operator")]

LOST_KEY = ("docs/operations.md", "UPDATE webhooks SET secret_sealed = NULL")


def test_every_multiline_shell_block_runs_here_or_is_skipped_with_a_reason():
    run = [*((p, n) for p, n, _ in ON_THE_SERVER), *ALTERNATIVES, *README_TOP_TO_BOTTOM, *CLI_DEMO, *NOTIFICATIONS,
           LOST_KEY]
    claimed = [block(*entry) for entry in run]
    skipped = [block(*entry) for entry in SKIPPED]
    assert len(set(claimed)) == len(claimed), "a block is run twice"
    assert not set(claimed) & set(skipped), "a skipped block is also run"
    missing = [str(b) for b in multi_line_blocks() if b not in claimed and b not in skipped]
    assert not missing, f"multi-line sh blocks neither run by this test nor listed in SKIPPED: {missing}"
    assert all(reason.strip() for reason in SKIPPED.values())


def test_every_shell_block_parses():
    """Single-command blocks too: bash reads each one without a syntax error."""
    for b in shell_blocks():
        done = subprocess.run(["bash", "-n"], input=b.text, capture_output=True, text=True)
        assert done.returncode == 0, f"{b}: {done.stderr}"


# Programs the docs run that this machine need not have: the skipped blocks' tools, one-line examples for the
# reader's own setup (Claude Code, vLLM), and tools a block names (jq, openssl) that its own test checks for.
NOT_NEEDED_HERE = {"sudo", "systemctl", "systemd-run", "docker", "promtool", "vllm", "claude", "apt-get", "jq",
                   "openssl"}


def test_sh_blocks_hold_commands_not_output(tmp_path):
    """Each command of an sh block starts with something bash can run (a program on PATH, a builtin, a keyword,
    an assignment, or a function the block defines): output shown for reading belongs in a text block."""
    shell = Shell(tmp_path)
    firsts: dict[str, list[str]] = {}
    for b in shell_blocks():
        defined = set(re.findall(r"^(\w[\w-]*)\(\)", b.text, re.M))
        for command in b.commands:
            if command.strip() == ")":
                continue  # the end of a subshell the block opened
            first = re.match(r"[(!\s]*([^\s;|&()]+)", command).group(1)
            if re.match(r"\w+=", first) or first in defined or command.startswith(f"{first}()") or "/" in first:
                continue  # an assignment (perhaps before a command), a function the block defines, a program's path
            firsts.setdefault(first, []).append(str(b))
    known = subprocess.run(["bash", "-c", 'for w in "$@"; do type -t -- "$w" > /dev/null && echo "$w"; done', "-",
                            *firsts], capture_output=True, text=True, env=shell.env).stdout.split()
    unknown = {w: where for w, where in firsts.items() if w not in known and w not in NOT_NEEDED_HERE}
    assert not unknown, f"sh blocks with a line that is no command (output? fence it as text): {unknown}"


def test_the_commands_of_a_block_are_counted_as_bash_would():
    b = Block("x.md", 1, "sh", "# a comment\ncurl -s $SB \\\n  -d '{\"a\":\n 1}'   # one command\n"
              "cat > f <<'EOF'\nx\n# not a comment\nEOF\necho done\n")
    assert b.commands == ["curl -s $SB    -d '{\"a\":\n 1}'", "cat > f <<'EOF'\nx\n# not a comment\nEOF", "echo done"]


def serve(tmp_path: Path, env: dict | None = None) -> tuple[LiveServer, str]:
    """`python switchboard.py serve` on a free loopback port, on a fresh database in `tmp_path/state`."""
    state = tmp_path / "state"
    state.mkdir()
    db = str(state / "switchboard.db")
    return LiveServer(db, env=env), db


def test_readme_top_to_bottom_on_one_server(tmp_path):
    """Walk-through, then the seed's loop block on the same database (alice exists by then: item 8 of issue 25),
    the rules' dry run, and the restore block, in one terminal. The block's forge connection asks a GitHub of our
    own (tests/forges.py) who the bot's token is, in the token file the README has the reader make first."""
    from forges import FakeForge
    server, db = serve(tmp_path)
    token = "github_pat_" + "T0pT0B0ttom" * 3
    github = FakeForge("github", token, "alice-triage")
    try:
        shell = Shell(tmp_path, reroot={"/var/lib/switchboard": tmp_path / "state", "/srv/backups": tmp_path / "backups"},
                      address=f"127.0.0.1:{server.port}", apis={"https://api.github.com": github.api})
        forge_token = shell.private_dir() / "forge.token"
        forge_token.write_text(token + "\n")
        forge_token.chmod(0o600)
        blocks = [block(*entry) for entry in README_TOP_TO_BOTTOM]
        done = shell.run(blocks, {"SWITCHBOARD_DB": db, "SWITCHBOARD_NOTIFY_ALLOW_PRIVATE": "1"})
    finally:
        github.stop()
        server.stop()
    assert [(r["method"], r["path"]) for r in github.requests] == [("GET", "/user")]
    assert "error" not in done.stderr.lower(), done.stderr
    assert re.search(r'"state": ?"done"', done.stdout)
    shows_the_dry_run(done.stdout)
    lane_s = json.loads((shell.creds / "lane-s.json").read_text())
    assert (shell.creds / "lane-s.token").read_text().strip() == lane_s["token"]
    triage = json.loads((shell.creds / "triage.json").read_text())
    assert (shell.creds / "triage.token").read_text().strip() == triage["token"]
    assert {"router.json", "github-hook.json", "params.json", "github-forge.json"} <= {
        p.name for p in shell.creds.iterdir()}
    assert (tmp_path / "state-restored" / "switchboard.key").exists()
    assert list((tmp_path / "backups").glob("switchboard-*.db")), "the backups went to the other disk"
    assert not list((tmp_path / "tmp").iterdir()), "the walk-through's scratch directory is removed"


def test_docs_examples_against_one_server(tmp_path):
    system_tool("openssl", "openssl")  # the ingress examples sign with it
    server, db = serve(tmp_path, {"SWITCHBOARD_METRICS_TOKEN": METRICS_TOKEN})
    scene = Scene(server, db)
    try:
        shell = Shell(tmp_path, reroot={"/srv/backups": tmp_path / "srv-backups"}, address=f"127.0.0.1:{server.port}")
        for path, needle, prepare in ON_THE_SERVER:
            prep = prepare(scene, shell)
            done = shell.run([block(path, needle)], {"SWITCHBOARD_DB": db, **prep.env}, prep.files)
            if prep.check:
                prep.check(done)
        for path, needle, prepare in SINGLE_ON_THE_SERVER:
            prep = prepare(scene, shell)
            done = shell.run([any_block(path, needle)], {"SWITCHBOARD_DB": db, **prep.env}, prep.files)
            if prep.check:
                prep.check(done)
        for path, needle in ALTERNATIVES:
            b = block(path, needle)
            for command in b.commands:
                todo, _ = scene.held()
                shell.run([Block(b.path, b.line, "sh", command)], {"SWITCHBOARD_DB": db, **scene.env(TODO=todo)})
                assert scene.call("GET", f"/api/v1/todos/{todo}")["state"] != "quarantined", command
    finally:
        scene.close()


def test_cli_worked_examples_on_a_throwaway_database(tmp_path):
    """No server: the CLI on a database of the example's own, in a private scratch directory."""
    shell = Shell(tmp_path)
    blocks = [block(*entry) for entry in CLI_DEMO]
    done = shell.run(blocks, {"STRIPE_SECRET": STRIPE_SECRET})
    # The listing the page shows after the first block is the one it prints.
    text = (ROOT / "docs/cli.md").read_text()
    shown = re.search(r"```text\n(ID .*?)```", text[text.index("DEMO=$(mktemp -d)"):], re.S).group(1).splitlines()
    printed = [line for line in done.stdout.splitlines() if line.startswith(("ID ", "td_"))]
    assert printed[0].split() == shown[0].split()
    assert printed[1].split()[1:4] == shown[1].split()[1:4] and printed[1].endswith("Nightly backup check")
    demo = [p for p in (tmp_path / "tmp").iterdir()]
    assert len(demo) == 1 and demo[0].stat().st_mode & 0o777 == 0o700
    for path in demo[0].glob("*.json"):
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert {"alice.json", "qwen.json", "stripe-hook.json"} <= {p.name for p in demo[0].iterdir()}


class Receiver(ThreadingHTTPServer):
    """A notification channel's receiver on loopback: it keeps what it is sent."""

    def __init__(self):
        self.received: list[bytes] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the standard library's name)
                receiver.received.append(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_notification_examples(tmp_path):
    """On a server of their own: the channels these blocks add are never sent anything but the tests they ask
    for, which go to a receiver on loopback that the operator allowed (SWITCHBOARD_NOTIFY_ALLOW)."""
    receiver = Receiver()
    allow = {"SWITCHBOARD_NOTIFY_ALLOW": f"127.0.0.1:{receiver.server_address[1]}"}
    server, db = serve(tmp_path, allow)
    scene = Scene(server, db)
    try:
        shell = Shell(tmp_path, address=f"127.0.0.1:{server.port}")
        target = f"http://127.0.0.1:{receiver.server_address[1]}/switchboard"
        for entry in NOTIFICATIONS:
            channel = scene.call("POST", "/api/v1/notify", json={"kind": "webhook", "url": target,
                                                                 "events": ["held"]})["id"]
            done = shell.run([block(*entry)], {"SWITCHBOARD_DB": db, "CREDS": str(shell.private_dir()), **allow,
                                               **scene.env(CHANNEL=channel)})
            assert channel in done.stdout
    finally:
        scene.close()
        receiver.shutdown()
    assert len(receiver.received) == 2, "each block's test message arrived"
    assert (shell.creds / "alice-channel.json").exists()


def test_lost_key_block_gives_the_webhooks_new_secrets(tmp_path):
    """operations.md's last resort, with the server stopped, on ./switchboard.db: the key file is gone."""
    shell = Shell(tmp_path)
    db = str(shell.checkout / "switchboard.db")
    cli(db, "human", "add", "alice")
    _, ep = cli(db, "endpoint", "vend", "--human", "alice", "--name", "owner", "--queues", "build")
    _, hook = cli(db, "webhook", "create", "--endpoint", ep["id"], "--provider", "github", "--queue", "build",
                  "--allow-all")
    _, stripe = cli(db, "webhook", "create", "--endpoint", ep["id"], "--provider", "stripe", "--queue",
                    "build", "--secret", STRIPE_SECRET)
    (shell.checkout / "switchboard.key").unlink()
    assert cli(db, "check")[0] == 1
    shell.run([block(*LOST_KEY)], {"HOOK": hook["id"], "STRIPE_HOOK": stripe["id"], "STRIPE_SECRET": STRIPE_SECRET},
              allowed={"switchboard.key", "switchboard.db-wal", "switchboard.db-shm"})
    assert (shell.checkout / "switchboard.key").exists()
    code, checked = cli(db, "check")
    assert code == 0, checked


def test_a_backup_into_a_missing_directory_says_so(tmp_path):
    """The docs' backup blocks, run on a box without /srv/backups, found SQLite's "unable to open database file"."""
    code, answer = cli(str(tmp_path / "switchboard.db"), "backup", str(tmp_path / "nowhere" / "b.db"))
    assert code == 1 and answer["error"] == "not_found" and "no directory" in answer["message"], answer
