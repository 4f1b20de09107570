"""Writing to the forge: the outputs outbox's sender and the status comments, over GitHub's and Gitea's REST APIs
through each connection (its host pinned, no redirects, internal addresses refused as notification channels'
are), and the "who am I" a new connection asks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from prometheus_client import Counter

from switchboard.configuration import UNSAFE_TEXT, VERSION, ApiError, iso, log
from switchboard.crypto import SecretBox
from switchboard.database import Database
from switchboard.notifier import Addresses, host_and_port, outbound_client, resolve
from switchboard.store.connections import own_connection, record_connection_test
from switchboard.store.forge_outbox import (
    SEND_DEADLINE_MS,
    STATUS_MARKER,
    ForgeJob,
    SendOutcome,
    backoff_ms,
    begin_output,
    begin_reaction,
    begin_status,
    due_forge_work,
    output_marker,
    record_output,
    record_reaction,
    record_status,
)
from switchboard.store.principals import Principal
from switchboard.store.transitions import span_record
from switchboard.tracing import parse_traceparent

if TYPE_CHECKING:
    import httpx

# One request's whole deadline (resolving, connecting, sending, reading the answer), and the most of an answer
# read (a page of 100 comments fits).
FORGE_TIMEOUT_SECONDS = 10.0
FORGE_MAX_RESPONSE_BYTES = 4 << 20
# Sends in flight at once; one per subject (outputs reach an issue in order) and per status comment.
FORGE_MAX_SENDS = 16
# A lost answer's retry looks for the output's marker among the issue's comments since just before the output
# was accepted; a status comment's marker among the first COMMENT_PAGES pages of 100.
COMMENT_PAGES = 10
MARKER_SINCE_SLACK_MS = 120_000
# What a send to (or a new connection at) an internal address is told: the same whatever the port, as for channels.
REFUSED_FORGE = ("refused: the forge's host is a loopback, link-local or unspecified address, which this server does"
                 " not send to")
REFUSED_CONNECTION = (f"api_url: {REFUSED_FORGE} (unless the server's operator allows it: serve"
                      f" --notify-allow-private, or --notify-allow ADDRESS[:PORT])")
# A rate limit's reset further off than this is waited for this long, then asked again.
RATE_LIMIT_WAIT_CAP_MS = 3_600_000
# A login as GitHub (letters, digits, hyphens; an app's `name[bot]`) and Gitea (also `.` and `_`) make them.
LOGIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}(?:\[bot\])?")


def escaped(text: str, limit: int = 200) -> str:
    """The forge's words as a log line or an answer may carry them: control and bidirectional characters written
    as escapes (a newline forges no line, an escape code reaches no terminal), cut to `limit`."""
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return re.sub(f"[{UNSAFE_TEXT}]", lambda found: ascii(found[0])[1:-1], text)


def path_segment(value: str) -> str:
    """A name (a label, an owner, a repository, an id the forge gave) as one segment of a forge URL's path: every
    character but the unreserved ones percent-encoded, so `/`, `?`, `#` and `%` stay inside it. A name of only dots
    (or none) would be a dot segment, which names the path above it: refused."""
    if value.strip(".") == "":
        raise ForgeError(f"{value!r} cannot be named in a forge URL (it is only dots)")
    return urllib.parse.quote(value, safe="")


class ForgeError(Exception):
    """A request that did not do what it was for. `transient`: tried again later (at `retry_at`, when the forge said
    when); else failed for good with the forge's own words."""

    def __init__(self, message: str, transient: bool = False, retry_at: int | None = None):
        super().__init__(message)
        self.message, self.transient, self.retry_at = message[:500], transient, retry_at


@dataclass
class ForgeAnswer:
    status: int
    headers: dict[str, str]
    data: Any


def _message(data: Any, status: int) -> str:
    """The forge's own words for a refusal: GitHub's and Gitea's `message` (with GitHub's validation errors)."""
    text = f"HTTP {status}"
    if isinstance(data, dict) and isinstance(data.get("message"), str):
        text += f": {escaped(data['message'], 300)}"
        errors = data.get("errors")
        if isinstance(errors, list) and errors:
            text += f" ({json.dumps(errors)[:200]})"
    return text


class ForgeApi:
    """One connection's REST API: GitHub's (`https://api.github.com`, or a GitHub Enterprise `…/api/v3`) or Gitea's
    (`https://gitea.example/api/v1`), whose paths agree for everything used here. Every request goes to the API
    URL's host at an address just resolved and allowed, with no redirect followed, so the token reaches nobody
    else."""

    def __init__(self, client: httpx.AsyncClient, addresses: Addresses, kind: str, api_url: str, token: str,
                 now_ms: Callable[[], int]):
        self.client, self.addresses, self.kind = client, addresses, kind
        self.api_url, self.token, self.now_ms = api_url.rstrip("/"), token, now_ms

    def _headers(self) -> dict[str, str]:
        headers = {"User-Agent": f"switchboard/{VERSION}", "Accept": "application/json"}
        if self.kind == "github":
            headers.update({"Authorization": f"Bearer {self.token}", "Accept": "application/vnd.github+json",
                            "X-GitHub-Api-Version": "2022-11-28"})
        else:
            headers["Authorization"] = f"token {self.token}"
        return headers

    def scrub(self, text: str) -> str:
        return text.replace(self.token, "…") if self.token else text

    async def call(self, method: str, path: str, body: Any = None, params: dict | None = None,
                   allow: tuple[int, ...] = ()) -> ForgeAnswer:
        """One request; a 2xx answer (or one of `allow`), else ForgeError: a redirect, 401, 403, 404, 422 and other
        4xx fail for good; 5xx, a rate limit and a network error are transient (a rate limit until its reset)."""
        try:
            with anyio.fail_after(FORGE_TIMEOUT_SECONDS):
                answer = await self._request(method, path, body, params)
        except TimeoutError:
            raise ForgeError(f"no complete answer within {FORGE_TIMEOUT_SECONDS:g} s", transient=True) from None
        except ForgeError:
            raise
        except Exception as exc:  # noqa: BLE001 - httpx's and the resolver's errors: the network, tried again
            raise ForgeError(self.scrub(f"{type(exc).__name__}: {exc}"), transient=True) from None
        status = answer.status
        if 200 <= status < 300 or status in allow:
            return answer
        if 300 <= status < 400:
            raise ForgeError(f"HTTP {status}: the forge answered with a redirect, which is not followed (is the"
                             f" connection's API URL right?)")
        limited = status == 429 or (status == 403 and (answer.headers.get("x-ratelimit-remaining") == "0"
                                                      or "retry-after" in answer.headers))
        if limited:
            raise ForgeError(self.scrub(_message(answer.data, status)) + " (rate limited)", transient=True,
                             retry_at=self._reset_at(answer.headers))
        if status >= 500:
            raise ForgeError(self.scrub(_message(answer.data, status)), transient=True)
        raise ForgeError(self.scrub(_message(answer.data, status)))

    def _reset_at(self, headers: dict[str, str]) -> int | None:
        """When the forge says to come back: Retry-After (seconds), else X-RateLimit-Reset (a Unix time); None
        when it names no moment in the future (`Retry-After: 0`, a reset already past by this box's clock), which
        waits the backoff instead."""
        now = self.now_ms()
        for name, to_ms in (("retry-after", lambda v: now + int(float(v) * 1000)),
                            ("x-ratelimit-reset", lambda v: int(float(v) * 1000))):
            with contextlib.suppress(KeyError, ValueError, OverflowError):
                reset = to_ms(headers[name])
                return min(reset, now + RATE_LIMIT_WAIT_CAP_MS) if reset > now else None
        return None

    async def _request(self, method: str, path: str, body: Any, params: dict | None) -> ForgeAnswer:
        import httpx  # with the first output: a box that writes nothing to a forge never loads it

        url = httpx.URL(self.api_url + path, params=params)
        host, port = host_and_port(url)
        addresses = await resolve(host, port)
        if not addresses:
            raise OSError("cannot resolve the host: no address")
        if not all(self.addresses.permits(address, port) for address in addresses):
            raise ForgeError(REFUSED_FORGE)
        headers = {**self._headers(), "Host": url.netloc.decode("ascii")}
        content = None
        if body is not None:
            content = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        extensions = {"sni_hostname": host} if url.scheme == "https" else {}
        failure: Exception | None = None
        for address in addresses:
            try:
                async with self.client.stream(method, url.copy_with(host=str(address)), headers=headers,
                                              content=content, extensions=extensions) as answer:
                    raw = b""
                    async for chunk in answer.aiter_raw():
                        raw += chunk
                        if len(raw) > FORGE_MAX_RESPONSE_BYTES:
                            raise ForgeError(f"the forge's answer is over {FORGE_MAX_RESPONSE_BYTES} bytes")
                    try:
                        data = json.loads(raw) if raw.strip() else None
                    except ValueError:
                        data = None
                    return ForgeAnswer(answer.status_code, {k.lower(): v for k, v in answer.headers.items()}, data)
            except httpx.ConnectError as exc:
                failure = exc
        raise failure  # type: ignore[misc] - addresses is not empty

    # -- what is done with it --------------------------------------------------------------------------------
    @staticmethod
    def issue_path(repo: str, number: int) -> str:
        owner, name = repo.split("/", 1)
        return f"/repos/{path_segment(owner)}/{path_segment(name)}/issues/{int(number)}"

    async def whoami(self) -> str:
        """The login the token belongs to (`GET /user`, the same on both forges), checked to be one: it is stored,
        trusted, compared and logged."""
        answer = await self.call("GET", "/user")
        login = (answer.data.get("login") or answer.data.get("username")) if isinstance(answer.data, dict) else None
        if not isinstance(login, str) or not login.strip():
            raise ForgeError("the forge's /user answer names no login")
        if not LOGIN.fullmatch(login):
            raise ForgeError(f"the forge's /user answer names '{escaped(login, 60)}' ({len(login)} characters),"
                             f" which is not a login (letters, digits, '-', '.', '_'; at most 100)")
        return login

    async def issue_labels(self, repo: str, number: int) -> list[dict]:
        answer = await self.call("GET", f"{self.issue_path(repo, number)}/labels", params={"per_page": 100,
                                                                                            "limit": 100})
        return [label for label in answer.data or [] if isinstance(label, dict) and isinstance(label.get("name"), str)]

    async def add_labels(self, repo: str, number: int, labels: list[str]) -> None:
        await self.call("POST", f"{self.issue_path(repo, number)}/labels", {"labels": labels})

    async def remove_labels(self, repo: str, number: int, labels: list[str]) -> None:
        """Each label off the issue; one it does not carry (any more) is off already."""
        if self.kind == "gitea":  # Gitea removes a label by its id
            present = {label["name"].lower(): label.get("id") for label in await self.issue_labels(repo, number)}
            for name in labels:
                if name.lower() in present:
                    await self.call("DELETE", f"{self.issue_path(repo, number)}/labels/"
                                              f"{path_segment(str(present[name.lower()]))}")
            return
        for name in labels:
            gone = await self.call("DELETE", f"{self.issue_path(repo, number)}/labels/{path_segment(name)}",
                                   allow=(404,))
            if gone.status == 404 and any(label["name"].lower() == name.lower()
                                          for label in await self.issue_labels(repo, number)):
                raise ForgeError(self.scrub(_message(gone.data, 404)))

    async def find_comment(self, repo: str, number: int, marker: str, login: str,
                           since_ms: int | None = None) -> str | None:
        """The id of the connection's own comment on the issue that carries `marker`, or None."""
        params: dict[str, Any] = {"per_page": 100, "limit": 100}
        if since_ms is not None:
            params["since"] = iso(since_ms)[:19] + "Z"
        for page in range(1, COMMENT_PAGES + 1):
            answer = await self.call("GET", f"{self.issue_path(repo, number)}/comments", params={**params, "page": page})
            comments = answer.data if isinstance(answer.data, list) else []
            for comment in comments:
                author = ((comment.get("user") or {}).get("login") or "") if isinstance(comment, dict) else ""
                if author.lower() == login.lower() and marker in str(comment.get("body") or ""):
                    return str(comment.get("id"))
            if len(comments) < 100:
                return None
        return None

    async def create_comment(self, repo: str, number: int, body: str) -> str:
        answer = await self.call("POST", f"{self.issue_path(repo, number)}/comments", {"body": body})
        return str((answer.data or {}).get("id")) if isinstance(answer.data, dict) else ""

    async def add_reaction(self, repo: str, comment_id: str, content: str) -> None:
        """A reaction on an issue comment (the same path on both forges). The forge keeps one reaction of a kind per
        user: sending it again, after an answer that was lost, adds nothing."""
        owner, name = repo.split("/", 1)
        await self.call("POST", f"/repos/{path_segment(owner)}/{path_segment(name)}/issues/comments/"
                                f"{path_segment(comment_id)}/reactions", {"content": content})

    async def edit_comment(self, repo: str, comment_id: str, body: str) -> bool:
        """Edit a comment in place; False when it is gone (a human deleted it)."""
        owner, name = repo.split("/", 1)
        answer = await self.call("PATCH", f"/repos/{path_segment(owner)}/{path_segment(name)}/issues/comments/"
                                          f"{path_segment(comment_id)}", {"body": body}, allow=(404,))
        return answer.status != 404


def forge_span(output: dict, state: str, started: int, ended: int) -> list[dict]:
    """The `forge {type}` span (CLIENT) of one try of an output, under the attempt that asked for it."""
    context = parse_traceparent(output["traceparent"])
    if context is None:
        return []
    attributes = {"messaging.system": "switchboard", "messaging.message.id": output["todo_id"],
                  "switchboard.subject_key": output["subject_key"], "switchboard.output_id": output["id"],
                  "switchboard.outcome": state}
    return [span_record(f"forge {output['type']}", "client", *context, output["attempt_span_id"], started, ended,
                        attributes)]


class ForgeSender:
    """The outputs outbox's sender loop (and the status comments'). `wake()` may be called from any thread (the
    writer calls it after a commit that queued an output or made a status comment due); the loop also wakes when
    the next retry or edit falls due, and when a send ends. One bad round is logged and the loop goes on."""

    def __init__(self, db: Database, box: SecretBox, addresses: Addresses, outputs: Counter | None = None,
                 statuses: Counter | None = None):
        self.db, self.box, self.addresses = db, box, addresses
        self.outputs, self.statuses = outputs, statuses
        self.busy: set[str] = set()
        self.tasks: set[asyncio.Task] = set()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._client_made: asyncio.Lock | None = None
        self.tracing: Callable[[list[dict]], None] | None = None  # the span exporter's emit (app), if any

    def wake(self) -> None:
        if self._loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is stopping
                self._loop.call_soon_threadsafe(self._wake.set)

    async def client(self) -> httpx.AsyncClient:
        self._client_made = self._client_made or asyncio.Lock()
        async with self._client_made:
            if self._client is None:
                self._client = await outbound_client()
            return self._client

    def api(self, client: httpx.AsyncClient, connection: dict) -> ForgeApi:
        token = self.box.open(connection["token_sealed"], connection["id"]).decode()
        return ForgeApi(client, self.addresses, connection["kind"], connection["api_url"], token, self.db.clock.now_ms)

    async def run(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        while True:
            self._wake.clear()
            next_due = None
            try:
                room = FORGE_MAX_SENDS - len(self.tasks)
                if room > 0:
                    jobs, next_due = await self.db.read(due_forge_work, frozenset(self.busy), room)
                    client = await self.client() if jobs else None
                    for job in jobs:
                        self._start(client, job)
            except Exception:  # noqa: BLE001 - the loop must outlive one bad round; the cause is logged
                log.exception("forge sender round failed")
                next_due = None
            wait = 60.0 if next_due is None else max(0.05, (next_due - self.db.clock.now_ms()) / 1000)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):  # not wait_for: see Notifier.run
                    await self._wake.wait()

    def _start(self, client: httpx.AsyncClient, job: ForgeJob) -> None:
        self.busy.add(job.key)
        task = asyncio.create_task(self.deliver(client, job))
        self.tasks.add(task)

        def done(finished: asyncio.Task) -> None:
            self.tasks.discard(finished)
            self.busy.discard(job.key)
            self.wake()

        task.add_done_callback(done)

    async def deliver(self, client: httpx.AsyncClient, job: ForgeJob) -> None:
        """Send one job and record how it went. Its attempt is recorded before the first request (begin_output,
        begin_status), so a send whose answer is lost (a crash, a cut connection, a new leader) is known to have
        been tried; one another sender began first is left to it."""
        if job.what == "reaction":
            attempt = job.reaction["attempts"] + 1
            if not await self.db.write(begin_reaction, job.reaction["event_id"], job.reaction["attempts"]):
                return
            outcome = await self._send(client, job, attempt)
            state = await self.db.write(record_reaction, job.reaction["event_id"], attempt, outcome)
            if self.outputs is not None and state != "pending":
                self.outputs.labels("reaction", state).inc()
            if not outcome.ok:
                log.warning("reaction on comment %s of %s: %s%s", job.reaction["comment_id"], job.repo, outcome.error,
                            "; tried again later" if state == "pending" else "")
            return
        if job.what == "output":
            attempt = job.output["attempts"] + 1
            if not await self.db.write(begin_output, job.output["id"], job.output["attempts"]):
                return
            started = self.db.clock.now_ms()
            outcome = await self._send(client, job, attempt)
            state = await self.db.write(record_output, job.output["id"], attempt, outcome)
            if self.tracing is not None:
                self.tracing(forge_span(job.output, state, started, self.db.clock.now_ms()))
            if self.outputs is not None and state != "pending":
                self.outputs.labels(job.output["type"], state).inc()
            if not outcome.ok:
                log.warning("forge output %s (%s) to %s#%d: %s%s", job.output["id"], job.output["type"], job.repo,
                            job.number, outcome.error, "; tried again later" if state == "pending" else "")
            return
        if not await self.db.write(begin_status, job.connection["id"], job.status["subject_key"],
                                   job.status["due_at"]):
            return
        outcome = await self._send(client, job, job.status["attempts"] + 1)
        await self.db.write(record_status, job.connection["id"], job.status["subject_key"], job.status["version"],
                            outcome)
        if self.statuses is not None:
            self.statuses.labels("written" if outcome.ok else "failed").inc()
        if not outcome.ok:
            log.warning("status comment on %s#%d: %s", job.repo, job.number, outcome.error)

    async def _send(self, client: httpx.AsyncClient, job: ForgeJob, attempt: int) -> SendOutcome:
        """The send's requests, within SEND_DEADLINE_MS in all (its lease outlasts them). A transient failure is
        tried again after the documented backoff, or at the forge's reset when that is later."""
        try:
            api = self.api(client, job.connection)
            with anyio.fail_after(SEND_DEADLINE_MS / 1000):
                if job.what == "reaction":
                    await api.add_reaction(job.repo, job.reaction["comment_id"], job.reaction["content"])
                    return SendOutcome(True)
                if job.what == "output":
                    return SendOutcome(True, forge_id=await self._send_output(api, job))
                return SendOutcome(True, forge_id=await self._send_status(api, job))
        except TimeoutError:
            error = ForgeError(f"the send did not end within {SEND_DEADLINE_MS // 1000} s", transient=True)
        except ForgeError as failure:
            error = failure
        except Exception as exc:  # noqa: BLE001 - a send that broke is a failed output, never a dead loop
            log.exception("forge send %s failed", job.key)
            return SendOutcome(False, f"{type(exc).__name__}: the send broke")
        if not error.transient:
            return SendOutcome(False, error.message)
        return SendOutcome(False, error.message, max(error.retry_at or 0, self.db.clock.now_ms() + backoff_ms(attempt)))

    async def _send_output(self, api: ForgeApi, job: ForgeJob) -> str | None:
        output = job.output
        if output["type"] == "add_labels":
            await api.add_labels(job.repo, job.number, json.loads(output["labels"]))
            return None
        if output["type"] == "remove_labels":
            await api.remove_labels(job.repo, job.number, json.loads(output["labels"]))
            return None
        marker = output_marker(output["id"])
        if output["attempts"]:  # an earlier try may have posted it and its answer been lost: at most once
            found = await api.find_comment(job.repo, job.number, marker, job.connection["login"],
                                           output["created_at"] - MARKER_SINCE_SLACK_MS)
            if found is not None:
                return found
        return await api.create_comment(job.repo, job.number, f"{output['body']}\n\n{marker}")

    async def _send_status(self, api: ForgeApi, job: ForgeJob) -> str:
        """Edit the issue's status comment in place; the first time (or when a human deleted it), find it by its
        marker, else post it."""
        text, comment_id = job.status["text"], job.status["comment_id"]
        if comment_id is None:
            comment_id = await api.find_comment(job.repo, job.number, STATUS_MARKER, job.connection["login"])
        if comment_id is not None and await api.edit_comment(job.repo, comment_id, text):
            return comment_id
        return await api.create_comment(job.repo, job.number, text)

    async def whoami(self, kind: str, api_url: str, token: str) -> str:
        """Who the forge says `token` is (a new connection, a test): the login, or ForgeError. Outside the loop (the
        CLI) a client is made for this one question."""
        if self._loop is not None:
            return await ForgeApi(await self.client(), self.addresses, kind, api_url, token,
                                  self.db.clock.now_ms).whoami()
        async with await outbound_client() as client:
            return await ForgeApi(client, self.addresses, kind, api_url, token, self.db.clock.now_ms).whoami()

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None



async def token_login(sender: ForgeSender, kind: str, api_url: str, token: str) -> str:
    """Who the forge says a new connection's token is. Its API's host is checked first as notification channels'
    are (internal addresses refused unless the operator allows them); a token the forge refuses, or an API that does
    not answer, is 400 with the forge's words."""
    try:
        await sender.addresses.vet(api_url)
    except ApiError:
        raise ApiError("invalid_argument", REFUSED_CONNECTION) from None
    try:
        return await sender.whoami(kind, api_url, token)
    except ForgeError as error:
        raise ApiError("invalid_argument", f"the forge at {api_url} did not say who the token is:"
                                           f" {error.message}") from None


async def test_connection(sender: ForgeSender, principal: Principal, connection_id: str) -> dict:
    """Ask the forge again who a connection's token is: whether it still works, as whom."""
    row = await sender.db.read(own_connection, principal, connection_id)
    token = sender.box.open(row["token_sealed"], row["id"]).decode()
    try:
        login, error = await sender.whoami(row["kind"], row["api_url"], token), None
    except ForgeError as failure:
        login, error = None, failure.message
    if login is not None and login.lower() != row["login"].lower():
        error = f"the token is now {login}'s, not {row['login']}'s: add the connection again"
    await sender.db.write(record_connection_test, row["id"], error)
    return {"id": row["id"], "ok": error is None, "login": login, "error": error}
