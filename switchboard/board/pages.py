"""The human's pages (sign-in, inbox, queues, todos, deliveries, rules, endpoints), rendered from the
package's templates."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hmac
import json
import re
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

import markupsafe
from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Match, Mount, NoMatchFound, Route, get_route_path, request_response
from starlette.staticfiles import StaticFiles

from switchboard.board.forge_pages import ForgePages, subject_path
from switchboard.board.queries import (
    BOARD_BACK,
    BOARD_COOKIE,
    BOARD_DIR,
    BOARD_FORM_BYTES,
    BOARD_HEADERS,
    BOARD_JSON_CHARS,
    BOARD_MCP_IDLE_SECONDS,
    BOARD_TOUCH_MS,
    BOARD_UNSAFE,
    EVENT_DISPOSITIONS,
    FORM_TYPE,
    INBOX_GROUP_STATES,
    INBOX_GROUPS,
    INBOX_STATES,
    BoardRefusal,
    BoardSession,
    board_account,
    board_counts,
    board_deliveries,
    board_delivery,
    board_endpoints,
    board_inbox,
    board_live,
    board_login_holder,
    board_names,
    board_proxy_sign_in,
    board_queues,
    board_reissue_token,
    board_session,
    board_sign_in,
    board_sign_out,
    board_todo,
    board_todos,
    board_touch,
    board_webhook,
    board_webhooks,
    bulk_offer,
)
from switchboard.configuration import (
    BULK_MAX,
    KEEPALIVE_SECONDS,
    NOTIFY_EVENTS,
    NOTIFY_KINDS,
    TODO_STATES,
    ApiError,
    iso,
    log,
    to_ms,
)
from switchboard.crypto import token_hash
from switchboard.database import Database, Txn
from switchboard.doorbell import Session
from switchboard.flows import Changes, Flows
from switchboard.http.common import cut_to_depth, read_capped, sse_response
from switchboard.http.mcp import Mcp
from switchboard.http.rest import Api
from switchboard.http.streams import sse_frame
from switchboard.limits import TrustedProxies
from switchboard.models import (
    WAIT_STATES,
    BulkAction,
    EndpointCreate,
    NotifyCreate,
    QueueLimits,
    QueuePause,
    QueueResume,
    ReleaseQuarantine,
    ReplayMany,
    ReplayOne,
    RouteAdd,
    RuleSet,
    RulesTest,
    ScheduleUpdate,
    TodoListQuery,
    TrustedActors,
    WebhookUpdate,
    parse_model,
)
from switchboard.payload import refuse_constant
from switchboard.store.outbox import list_channels, remove_channel
from switchboard.store.principals import Principal, normal_login, vend_endpoint
from switchboard.store.queues import pause_queue, resume_queue, set_queue_limits
from switchboard.store.schedules import board_schedules, update_schedule
from switchboard.store.todos import Selection
from switchboard.store.transitions import revoke_endpoint
from switchboard.store.upkeep import HUMAN_ACTIONS
from switchboard.store.webhooks import add_route, remove_route, rotate_webhook, set_trusted_actors, update_webhook

if TYPE_CHECKING:
    import jinja2

# -- rendering helpers ---------------------------------------------------------------------------------------

def _board_text(value: Any) -> Any:
    """Jinja's finalize: every string reaches the page without bidirectional controls or lone surrogates (it
    is escaped after this)."""
    if isinstance(value, markupsafe.Markup):
        return value  # our own markup (a macro's output), whose text was finalized when it was made
    return BOARD_UNSAFE.sub("\ufffd", value) if isinstance(value, str) else ("" if value is None else value)


def pretty_json(value: Any) -> str:
    """A stored document as indented JSON text for a <pre> (escaped by the template like any text), cut at
    BOARD_JSON_CHARS so that a 5 MiB payload does not make a 10 MiB page (the API has all of it)."""
    try:
        text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False)
    except (RecursionError, ValueError):
        text = json.dumps(cut_to_depth(value), indent=2, ensure_ascii=False)
    if len(text) > BOARD_JSON_CHARS:
        text = f"{text[:BOARD_JSON_CHARS]}\n… {len(text) - BOARD_JSON_CHARS:,} more characters (the API has all of it)"
    return BOARD_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _as_ms(value: Any) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        return int(value)
    try:
        return to_ms(datetime.fromisoformat(str(value).replace("Z", "+00:00")))
    except ValueError:
        return None


def _ago(ms: int | None, now: int) -> str:
    if ms is None:
        return "never"
    seconds = (now - ms) / 1000
    future = seconds < 0
    seconds = abs(seconds)
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min"), (1, "s")):
        if seconds >= size or unit == "s":
            amount = f"{int(seconds // size)} {unit}"
            return f"in {amount}" if future else f"{amount} ago"
    return ""


def _cursor(text: str | None) -> tuple[int, str] | None:
    """A page cursor `<ms>.<id>`; anything else is the first page."""
    stamp, _, ident = (text or "").partition(".")
    if not re.fullmatch(r"[0-9]{1,15}", stamp) or not re.fullmatch(r"[a-z]{2}_[0-9a-f]{1,64}", ident):
        return None
    return int(stamp), ident


def _form_int(value: str) -> int | str:
    """A form field meant as a whole number: the number when it is plain ASCII digits, else the text itself,
    which the model then refuses as REST would (`²` and `٣` are digits to str.isdigit, not to int or JSON)."""
    value = value.strip()
    return int(value) if re.fullmatch(r"[0-9]{1,18}", value) else value


def _who(names: dict[str, str], actor: Any) -> str:
    """An actor (`human:hu_…`, `endpoint:ep_…`) or an id as its name, where the page knows it."""
    if not isinstance(actor, str):
        return "" if actor is None else str(actor)
    kind, _, ident = actor.partition(":")
    if ident and kind in ("human", "endpoint"):
        return names.get(ident, actor)
    return names.get(actor, actor)


def _release_notice(done: dict) -> str:
    """What a release did, in one line: "Trusted codertocat; the rules dropped it: rule drop-everything"."""
    evidence = ((done.get("history") or [{}])[-1].get("evidence") or {})
    trace = done.get("trace") or {}
    rule = trace.get("rule_name") or trace.get("rule_id")
    why = f": rule {rule}" if rule else f" ({trace['hold'] or trace.get('cause')})" if trace.get("hold") else ""
    disposition = evidence.get("disposition", "routed" if done["state"] == "pending" else None)
    trusted = ", ".join(evidence.get("trusted") or [])
    if disposition == "routed":
        what = f"released to {done['queue']}: {done['title']}"
    elif disposition == "quarantined":
        what = f"the rules hold it again{why}; it stays in your inbox"
    elif disposition == "repeat":
        what = f"the rules found it a repeat (its subject already went to that queue once){why}"
    else:
        what = f"the rules {disposition or 'closed'} it{why}"
    if trusted:
        return f"Trusted {trusted}; {what}"
    return what[0].upper() + what[1:] if disposition == "routed" else f"Released; {what}"


# How a doorbell session listens, as a queue's line names it (with its count: "1 waiting claim").
LISTENING = {"claim": ("waiting claim", "waiting claims"), "sse": ("doorbell stream", "doorbell streams"),
             "mcp": ("MCP stream", "MCP streams")}
BULK_DONE = {"retry": "Retried", "cancel": "Cancelled", "reroute": "Rerouted", "defer": "Deferred",
             "discard": "Discarded", "approve": "Approved"}
# A bulk form's filter fields (prefixed f_, beside the action's own `queue`, `reason` and `until`).
BULK_FILTER_FIELDS = ("endpoint", "queue", "state", "subject", "q")


def _bulk_body(form: dict[str, str]) -> tuple[BulkAction, dict[str, str]]:
    """The bulk form as the body POST /api/v1/todos/bulk takes (through its model), and the fields a
    confirmation repeats. `scope` is `selected` (the ticked `ids`) or `all` (the f_ filter fields)."""
    action = form.get("action", "").strip()
    # One form serves every action: its target queue goes only with a reroute, its time only with a deferral.
    wanted = ["action", "reason", "scope", *(["queue"] if action == "reroute" else []),
              *(["until"] if action == "defer" else [])]
    echo = {name: form[name].strip() for name in wanted if form.get(name, "").strip()}
    fields: dict[str, Any] = {k: v for k, v in echo.items() if k != "scope"}
    fields["dry_run"] = form.get("apply") != "yes"
    if echo.get("scope") == "all":
        fields["filter"] = {name: form[f"f_{name}"].strip() for name in BULK_FILTER_FIELDS
                            if form.get(f"f_{name}", "").strip()}
        echo.update({f"f_{name}": value for name, value in fields["filter"].items()})
    else:
        fields["ids"] = [i for i in form.get("ids", "").split(",") if i.strip()]
        if not fields["ids"]:
            raise ApiError("invalid_argument", "tick the todos to act on first (or choose all matching the filter)")
        echo["ids"] = ",".join(fields["ids"])
    return parse_model(BulkAction, json.dumps(fields)), echo


class BoardPage(Response):
    """HTML that cannot fail to encode (a lone surrogate becomes U+FFFD)."""
    media_type = "text/html"

    def render(self, content: Any) -> bytes:
        return content.encode("utf-8", "replace") if isinstance(content, str) else content


class _BoardHeaders:
    """ASGI middleware: the Board's security headers on every answer under /board, static files included."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in BOARD_HEADERS.items():
                    headers[name] = value
                if "cache-control" not in headers:
                    headers["Cache-Control"] = "no-store"
            await send(message)
        await self.app(scope, receive, send_with_headers)


class _BoardEntry(BaseRoute):
    """`/` (303 to the Board) and `/board` itself (the inbox). HTML pages, not API routes: not a `Route`, so
    the OpenAPI document (which covers every API route) does not list them."""

    def __init__(self, inbox: Callable) -> None:
        self.inbox = _BoardHeaders(request_response(inbox))

    def matches(self, scope: dict) -> tuple[Match, dict]:
        if scope["type"] == "http" and get_route_path(scope) in ("/", "/board"):
            return Match.FULL, {}
        return Match.NONE, {}

    def url_path_for(self, name: str, /, **path_params: Any) -> Any:
        raise NoMatchFound(name, path_params)

    async def handle(self, scope: dict, receive: Callable, send: Callable) -> None:
        if get_route_path(scope) == "/":
            await RedirectResponse("/board", status_code=303)(scope, receive, send)
        else:
            await self.inbox(scope, receive, send)


# -- the live view -----------------------------------------------------------------------------------------

_SIGNED_OUT = object()  # what a stream is told when its session ended
_CLOSED = object()  # … and when the server is shutting down


class _Listener:
    """One open stream: the latest state it was told and has not sent, and what it sent last."""

    def __init__(self, session: BoardSession):
        self.session = session
        self.sent: dict | None = None
        self.state: Any = None
        self.woken = asyncio.Event()

    def tell(self, state: Any) -> None:
        if state != self.sent:
            self.state = state
            self.woken.set()

    async def next(self, timeout: float) -> Any:
        """The next state to send, or None when `timeout` seconds passed without one."""
        try:
            async with asyncio.timeout(timeout):
                await self.woken.wait()
        except TimeoutError:
            return None
        self.woken.clear()
        state, self.state = self.state, None
        return state


class LiveViews:
    """Every open Board stream, by human, and the one task that reads for all of them: each human's counts and
    open sessions, in one read transaction, when a stream opens, when the database changed (`Changes`, told by
    the scheduler's data_version probe, so at most once a second), and when an open stream's session comes to
    its end. Each stream is told only what differs from what it sent. In between nothing is read: N idle
    streams cost N sleeping coroutines and a keep-alive each every KEEPALIVE_SECONDS. (Without the background
    loop, as in tests that drive the scheduler by hand, a stream gets its first counts and keep-alives.)"""

    def __init__(self, db: Database, changes: Changes):
        self.db = db
        self.changes = changes
        self.humans: dict[str, dict[_Listener, None]] = {}
        self.principals: dict[str, Principal] = {}
        self.ends: dict[str, int] = {}  # session key -> when it ends (ms), as last read
        self.closed = False
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def join(self, session: BoardSession) -> _Listener:
        listener = _Listener(session)
        if self.closed:
            listener.tell(_CLOSED)
            return listener
        self.humans.setdefault(session.principal.id, {})[listener] = None
        self.principals[session.principal.id] = session.principal
        if self._task is None or self._task.done():
            self._stop()
            self._wake = asyncio.Event()
            self.changes.subscribe(self._wake.set)
            self._task = asyncio.create_task(self._run())
        self._wake.set()  # the new stream's first counts
        return listener

    def leave(self, listener: _Listener) -> None:
        human_id = listener.session.principal.id
        mine = self.humans.get(human_id, {})
        mine.pop(listener, None)
        if not mine:
            self.humans.pop(human_id, None)
            self.principals.pop(human_id, None)
        if not self.humans and self._task is not None:
            self._stop()

    def close(self) -> None:
        """At shutdown: every stream ends (the doorbell's close_all calls this)."""
        self.closed = True
        for listeners in list(self.humans.values()):
            for listener in list(listeners):
                listener.tell(_CLOSED)
        self._stop()

    def _stop(self) -> None:
        if self._wake is not None:
            self.changes.unsubscribe(self._wake.set)
        if self._task is not None:
            self._task.cancel()
        self._task = self._wake = None

    def _next_end(self) -> float | None:
        """Seconds until the first open stream's session ends (then it is read again), or None."""
        keys = {listener.session.key for listeners in self.humans.values() for listener in listeners}
        ends = [self.ends[key] for key in keys if key in self.ends]
        return max(0.05, (min(ends) - self.db.clock.now_ms()) / 1000) if ends else None

    async def _run(self) -> None:
        wake = self._wake
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._next_end()):
                    await wake.wait()
            wake.clear()
            try:
                read = await self.db.read(board_live, list(self.principals.values()))
            except Exception:  # noqa: BLE001 - one bad read must not end every stream; the cause is logged
                log.exception("the Board's live view could not read")
                await asyncio.sleep(1.0)
                wake.set()
                continue
            self.ends = {key: end for _, sessions in read.values() for key, end in sessions.items()}
            for human_id, (live, sessions) in read.items():
                for listener in list(self.humans.get(human_id, {})):
                    listener.tell(live if listener.session.key in sessions else _SIGNED_OUT)


# -- the pages ---------------------------------------------------------------------------------------------

class ProxySignInRefused(BoardRefusal):
    """A declared proxy named someone the Board cannot sign in (no human has that login, or the header is not a
    login): a refusal page that says so, and nothing runs."""


class Board:
    """The human's pages over the same flows as REST. `proxies`: the reverse proxies the operator declared
    (`--trust-proxy`): their X-Forwarded-Proto `https` makes the session cookie Secure. `auth_header`: the
    header (lower-case) by which a proxy named in `--trust-proxy ADDRESSES` signs a visitor in as the human with
    that login; from any other address it is ignored."""

    def __init__(self, flows: Flows, api: Api, mcp: Mcp, proxies: TrustedProxies | None = None,
                 auth_header: str | None = None):
        self.flows = flows
        self.db = flows.db
        self.api = api
        self.mcp = mcp
        self.proxies = proxies or TrustedProxies()
        self.auth_header = auth_header
        # One-shot notices for the next page a session sees (post-redirect-get): kept in memory, popped on read.
        self.notices: dict[str, list[dict]] = {}
        # The open streams. At shutdown the doorbell's close_all ends them, as it ends the workers' streams: a
        # session of its own that no ring can reach (it covers no queue of no endpoint).
        self.live = LiveViews(self.db, flows.changes)
        flows.doorbell.attach(Session("board:live", frozenset(), "stream", lambda ring: None, self.live.close,
                                      via="board"))
        self.forge_pages = ForgePages(self)

    @functools.cached_property
    def templates(self) -> jinja2.Environment:
        """The template engine, made for the first page shown: a box only agents use never loads jinja2."""
        import jinja2
        templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(BOARD_DIR / "templates"), autoescape=True, finalize=_board_text,
            trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined)
        templates.filters["json"] = pretty_json
        templates.filters["iso"] = lambda value: iso(_as_ms(value)) or ""
        templates.globals["inbox_groups"] = INBOX_GROUPS
        templates.globals["inbox_states"] = INBOX_STATES
        templates.globals["inbox_group_states"] = INBOX_GROUP_STATES
        templates.globals["bulk_offer"] = bulk_offer
        templates.globals["bulk_max"] = BULK_MAX
        templates.globals["subject_path"] = subject_path
        return templates

    def routes(self) -> list[BaseRoute]:
        """The Board's routes; none when its files (board/ beside this module) are not installed."""
        if not (BOARD_DIR / "templates").is_dir() or not (BOARD_DIR / "static").is_dir():
            log.warning("the Board is off: its files are not in %s", BOARD_DIR)
            return []
        page, act = self._page, self._action
        board = [
            Route("/", page(self.inbox)),
            Route("/login", self.login, methods=["GET", "POST"]),
            Route("/logout", act(self.logout), methods=["POST"]),
            Route("/inbox/{group}", page(self.inbox)),
            Route("/events", self.events),
            Route("/queues", page(self.queues)),
            Route("/todos", page(self.todos)),
            Route("/todos/bulk", act(self.bulk), methods=["POST"]),
            Route("/todos/{todo_id}", page(self.todo)),
            Route("/todos/{todo_id}/{action}", act(self.todo_action), methods=["POST"]),
            Route("/webhooks", page(self.webhooks)),
            Route("/webhooks/{webhook_id}", page(self.webhook)),
            Route("/webhooks/{webhook_id}/deliveries", page(self.deliveries)),
            Route("/webhooks/{webhook_id}/rules", act(self.rules), methods=["POST"]),
            Route("/webhooks/{webhook_id}/rotate", act(self.rotate), methods=["POST"]),
            Route("/webhooks/{webhook_id}/name", act(self.rename), methods=["POST"]),
            Route("/webhooks/{webhook_id}/trusted-actors", act(self.trusted_actors), methods=["POST"]),
            Route("/webhooks/{webhook_id}/routes", act(self.add_route), methods=["POST"]),
            Route("/webhooks/{webhook_id}/routes/{endpoint_id}/remove", act(self.remove_route), methods=["POST"]),
            Route("/deliveries/{event_id}", page(self.delivery)),
            Route("/deliveries/{event_id}/replay", act(self.replay_delivery), methods=["POST"]),
            Route("/webhooks/{webhook_id}/replay", act(self.replay_webhook), methods=["POST"]),
            Route("/notify", page(self.notify)),
            Route("/notify/add", act(self.add_channel), methods=["POST"]),
            Route("/notify/{channel_id}/test", act(self.test_channel), methods=["POST"]),
            Route("/notify/{channel_id}/remove", act(self.remove_channel), methods=["POST"]),
            Route("/endpoints", page(self.endpoints)),
            Route("/endpoints/vend", act(self.vend), methods=["POST"]),
            Route("/endpoints/{endpoint_id}/revoke", page(self.revoke_confirm)),
            Route("/endpoints/{endpoint_id}/revoke", act(self.revoke), methods=["POST"]),
            Route("/account", page(self.account)),
            Route("/account/token", act(self.new_token), methods=["POST"]),
            Route("/endpoints/{endpoint_id}/queues/{queue}/pause", act(self.queue_pause), methods=["POST"]),
            Route("/endpoints/{endpoint_id}/queues/{queue}/resume", act(self.queue_resume), methods=["POST"]),
            Route("/endpoints/{endpoint_id}/queues/{queue}/limits", act(self.queue_limits), methods=["POST"]),
            Route("/schedules", page(self.schedules)),
            Route("/schedules/{schedule_id}/pause", act(self.schedule_switch), methods=["POST"]),
            Route("/schedules/{schedule_id}/resume", act(self.schedule_switch), methods=["POST"]),
            Route("/endpoints/{endpoint_id}/queues/{queue}/waits", act(self.queue_wait_limits), methods=["POST"]),
            *self.forge_pages.routes(page, act),
            Mount("/static", app=StaticFiles(directory=BOARD_DIR / "static")),
            Route("/{rest:path}", page(self.not_found), methods=["GET", "POST"]),
        ]
        return [_BoardEntry(self._page(self.inbox)),
                Mount("/board", routes=board, middleware=[Middleware(_BoardHeaders)])]

    # -- sessions, forms and answers --------------------------------------------------------------------
    def secure(self, request: Request) -> bool:
        forwarded = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
        return request.url.scheme == "https" or (
            forwarded == "https" and self.proxies.forwarded_proto_counts(request.client.host if request.client else None))

    def _origins(self, request: Request) -> set[str]:
        scheme = "https" if self.secure(request) else request.url.scheme
        mine = {f"{scheme}://{request.headers.get('host', '')}".lower()}
        if self.api.base_url:
            parts = urllib.parse.urlsplit(self.api.base_url)
            mine.add(f"{parts.scheme}://{parts.netloc}".lower())
        return mine

    def _same_origin(self, request: Request) -> bool:
        """A state-changing form must come from a page of this server: its Origin (or, where a browser sends
        none, its Referer's origin) is this request's own scheme://host or the configured base URL."""
        origin = request.headers.get("origin")
        if origin is None or origin == "null":
            referer = urllib.parse.urlsplit(request.headers.get("referer", ""))
            origin = f"{referer.scheme}://{referer.netloc}" if referer.scheme and referer.netloc else None
        return origin is not None and origin.rstrip("/").lower() in self._origins(request)

    async def _session(self, request: Request) -> BoardSession | None:
        """The browser's session, from its cookie; or, on a request from a declared proxy carrying the sign-in
        header, the session of the human that header names (opened when the cookie holds none of theirs: the
        answer then sets the new cookie, see `_answer`). Raises ProxySignInRefused when the header names no one."""
        token = request.cookies.get(BOARD_COOKIE)
        session = await self.db.read(board_session, token_hash(token)) if token and len(token) <= 128 else None
        login = self._proxy_login(request)
        if login is not None and (session is None or session.login != login):
            human_id = await self.db.read(board_login_holder, login)
            if human_id is None:
                log.warning("board sign-in refused: the %s header from proxy %s names no human's login",
                            self.auth_header, request.client.host if request.client else "?")
                raise ProxySignInRefused(f"Your sign-in proxy says you are {login}, and no human of this server has"
                                         f" that login. The operator ties one to it with `switchboard human"
                                         f" set-login NAME {login}`.")
            opened = await self.db.write(board_proxy_sign_in, human_id, session.key if session else None)
            request.state.board_cookie = opened
            session = await self.db.read(board_session, token_hash(opened))
        if session is not None and self.db.clock.now_ms() - session.last_seen_at >= BOARD_TOUCH_MS:
            await self.db.write(board_touch, session.key)
        return session

    def _proxy_login(self, request: Request) -> str | None:
        """The login the sign-in header names, on a request from a proxy named by --trust-proxy ADDRESSES; None
        when there is no header sign-in (not configured, another address, or no header: then the cookie, or the
        token sign-in, is what counts)."""
        if self.auth_header is None or not self.proxies.declared(request.client.host if request.client else None):
            return None
        values = request.headers.getlist(self.auth_header)
        if not values:
            return None
        if len(values) > 1:
            raise ProxySignInRefused(f"Your sign-in proxy sent {self.auth_header} more than once: it must set the"
                                     f" header, replacing any the browser sent.")
        try:
            return normal_login(values[0].strip())
        except ApiError:
            raise ProxySignInRefused(f"Your sign-in proxy sent a {self.auth_header} that is not a login (1 to 254"
                                     " printable ASCII characters, without spaces).") from None

    def _answer(self, request: Request, response: Response) -> Response:
        """A response, with the session cookie of a sign-in made while answering it (by the proxy's header, or a
        new token)."""
        opened = getattr(request.state, "board_cookie", None)
        if opened is not None:
            response.set_cookie(BOARD_COOKIE, opened, path="/board", httponly=True, samesite="strict",
                                secure=self.secure(request))
        return response

    def _refused(self, request: Request, refusal: BoardRefusal) -> Response:
        if isinstance(refusal, ProxySignInRefused):
            return self.render(request, "error.html", None, 403, title="Not signed in", message=str(refusal))
        log.warning("board form refused: %s %s", request.method, request.url.path)
        return self.render(request, "error.html", None, 403, title="Refused", message=str(refusal))

    async def _form(self, request: Request) -> dict[str, str]:
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != FORM_TYPE:
            raise ApiError("invalid_argument", "send the form as application/x-www-form-urlencoded")
        raw = await read_capped(request, BOARD_FORM_BYTES)
        try:
            pairs = urllib.parse.parse_qsl(raw.decode("utf-8"), keep_blank_values=True, max_num_fields=200)
        except (UnicodeDecodeError, ValueError):
            raise ApiError("invalid_argument", "the form is not valid UTF-8 form data") from None
        form: dict[str, str] = {}
        for name, value in pairs:
            if name == "ids" and name in form:  # the todos ticked for a bulk action: every one, comma-joined
                form[name] += f",{value}"
            form.setdefault(name, value.replace("\r\n", "\n"))
        return form

    def notice(self, session: BoardSession, text: str, kind: str = "ok", **extra: Any) -> None:
        notes = self.notices.setdefault(session.key, [])
        notes.append({"kind": kind, "text": text, **extra})
        del notes[:-5]
        if len(self.notices) > 10_000:
            self.notices.pop(next(iter(self.notices)))

    def render(self, request: Request, template: str, session: BoardSession | None, status: int = 200,
               **context: Any) -> Response:
        notices = self.notices.pop(session.key, []) if session else []
        names = context.pop("names", None) or {}
        html = self.templates.get_template(template).render(
            request_path=request.url.path, session=session, notices=notices, now=self.db.clock.now_ms(),
            ago=lambda value: _ago(_as_ms(value), self.db.clock.now_ms()), who=lambda actor: _who(names, actor),
            **context)
        return BoardPage(html, status_code=status)

    def back(self, form: dict[str, str], default: str) -> RedirectResponse:
        target = form.get("back", "")
        return RedirectResponse(target if BOARD_BACK.match(target) and "//" not in target else default,
                                status_code=303)

    async def page_data(self, session: BoardSession, fn: Callable, *args: Any) -> dict:
        """A page's data and the navigation's counts, read in one transaction."""
        def both(txn: Txn) -> dict:
            return {"names": board_names(txn, session.principal), **fn(txn, session.principal, *args),
                    "live": board_counts(txn, session.principal)}
        return await self.db.read(both)

    def _page(self, handler: Callable) -> Callable:
        """A GET page: a session (else to the sign-in form), then the handler; an ApiError is an HTML answer."""
        async def endpoint(request: Request) -> Response:
            try:
                session = await self._session(request)
            except BoardRefusal as refusal:
                return self._refused(request, refusal)
            if session is None:
                if request.method != "GET":
                    return self.render(request, "error.html", None, 403, title="Signed out",
                                       message="Your session has ended: sign in again.")
                target = urllib.parse.quote(request.url.path + (f"?{request.url.query}" if request.url.query else ""))
                return RedirectResponse(f"/board/login?next={target}", status_code=303)
            try:
                return self._answer(request, await handler(request, session))
            except ApiError as error:
                return self._answer(request, await self._error_page(request, session, error))
        return endpoint

    def _action(self, handler: Callable) -> Callable:
        """A state-changing form: a session, the same origin and the session's CSRF token, or 403 and nothing
        runs; then the handler, whose ApiError goes back to the page it came from as a notice."""
        async def endpoint(request: Request) -> Response:
            session = None
            try:
                session = await self._session(request)
                if session is None:
                    raise BoardRefusal("Your session has ended: sign in again.")
                if not self._same_origin(request):
                    raise BoardRefusal("This form did not come from this server's own pages (Origin check).")
                if request.headers.get("content-type", "").split(";")[0].strip().lower() != FORM_TYPE:
                    raise BoardRefusal("This is not a form of the Board (CSRF check).")
                form = await self._form(request)
                if not hmac.compare_digest(form.get("csrf", "").encode(), session.csrf.encode()):
                    raise BoardRefusal("This form is missing its session token (CSRF check). Reload the page.")
            except BoardRefusal as refusal:
                return self._answer(request, self._refused(request, refusal))
            except ApiError as error:
                return self._answer(request, await self._error_page(request, session, error))
            try:
                return self._answer(request, await handler(request, session, form))
            except ApiError as error:
                # Refused (bad input, a conflict, an id that is not the human's): a 4xx page saying why, with the
                # way back to the page the form was on. Nothing changed.
                return self._answer(request, await self._error_page(request, session, error,
                                                                    self._came_from(request, form)))
        return endpoint

    def _came_from(self, request: Request, form: dict) -> str:
        """The Board page a form was posted from: its `back` field, else the Referer's path on this server."""
        target = form.get("back", "")
        if not (BOARD_BACK.match(target) and "//" not in target):
            referer = urllib.parse.urlsplit(request.headers.get("referer", ""))
            target = referer.path + (f"?{referer.query}" if referer.query else "")
            if f"{referer.scheme}://{referer.netloc}".lower() not in self._origins(request):
                target = ""
        return target if BOARD_BACK.match(target) and "//" not in target else "/board"

    async def _error_page(self, request: Request, session: BoardSession | None, error: ApiError,
                          back: str | None = None) -> Response:
        titles = {404: "Not found", 403: "Not allowed", 409: "Conflict", 400: "Not accepted", 413: "Too large",
                  429: "Too many requests", 503: "Unavailable"}
        live = await self.db.read(board_counts, session.principal) if session else None
        return self.render(request, "error.html", session, error.status, title=titles.get(error.status, "Error"),
                           message=error.message, live=live, back=back)

    async def not_found(self, request: Request, session: BoardSession) -> Response:
        raise ApiError("not_found", f"there is no Board page at {request.url.path}")

    # -- sign in and out ----------------------------------------------------------------------------------
    async def login(self, request: Request) -> Response:
        target = request.query_params.get("next", "")
        target = target if BOARD_BACK.match(target) and "//" not in target else "/board"
        if request.method == "GET":
            try:
                if await self._session(request) is not None:
                    return self._answer(request, RedirectResponse(target, status_code=303))
            except BoardRefusal as refusal:
                return self._refused(request, refusal)
            return self.render(request, "login.html", None, next=target, error=None)
        if not self._same_origin(request):
            return self.render(request, "error.html", None, 403, title="Refused",
                               message="This form did not come from this server's own pages (Origin check).")
        form = await self._form(request)
        session = await self.db.write(board_sign_in, form.get("token", "").strip())
        if session is None:
            return self.render(request, "login.html", None, 401, next=target,
                               error="That is not a human token of this server (they start with sbh_).")
        request.state.board_cookie = session
        return self._answer(request, RedirectResponse(target, status_code=303))

    async def logout(self, request: Request, session: BoardSession, form: dict) -> Response:
        await self.db.write(board_sign_out, session.key)
        self.notices.pop(session.key, None)
        answer = RedirectResponse("/board/login", status_code=303)
        answer.delete_cookie(BOARD_COOKIE, path="/board", httponly=True, samesite="strict",
                             secure=self.secure(request))
        return answer

    # -- live counts --------------------------------------------------------------------------------------
    async def events(self, request: Request) -> Response:
        """GET /board/events: Server-Sent Events for the signed-in human: `counts` at once, then whenever they
        changed; board.js then refreshes the page's lists. The stream waits on the live view (`LiveViews`), which
        reads only after the database changed, so an idle stream costs a keep-alive every KEEPALIVE_SECONDS. A
        stream does not keep its session alive, and ends (`signed-out`) when the session does."""
        try:
            session = await self._session(request)
        except BoardRefusal:
            session = None
        if session is None:
            return PlainTextResponse("sign in first", status_code=401)

        async def frames() -> AsyncIterator[str]:
            yield "retry: 5000\n\n"
            listener = self.live.join(session)
            try:
                while True:
                    state = await listener.next(KEEPALIVE_SECONDS)
                    if state is None:
                        yield ": keepalive\n\n"
                    elif state is _CLOSED:
                        return
                    elif state is _SIGNED_OUT:
                        yield sse_frame({}, "signed-out")
                        return
                    elif state != listener.sent:  # (it may have changed back before this stream woke)
                        listener.sent = state
                        yield sse_frame(state, "counts")
            finally:
                self.live.leave(listener)

        return self._answer(request, sse_response(frames()))

    # -- pages --------------------------------------------------------------------------------------------
    async def inbox(self, request: Request, session: BoardSession) -> Response:
        group = request.path_params.get("group")
        if group is not None and group not in INBOX_GROUPS:
            raise ApiError("not_found", f"no inbox group {group}")
        data = await self.page_data(session, board_inbox, group, _cursor(request.query_params.get("after")))
        return self.render(request, "inbox.html", session, group=group, **data)

    async def queues(self, request: Request, session: BoardSession) -> Response:
        data = await self.page_data(session, board_queues, _cursor(request.query_params.get("after")))
        monotonic_now, wall_now = time.monotonic(), time.time()
        for endpoint in data["endpoints"]:
            endpoint["sessions"] = [{**s, "since": int(s["since"] * 1000)}
                                    for s in self.flows.doorbell.sessions_of(endpoint["id"])]
            # Each queue's line names who listens for it now (a session for no queue in particular takes any).
            for name, queue in endpoint["queues"].items():
                listening = collections.Counter(s["via"] for s in endpoint["sessions"]
                                                if s["queues"] is None or name in s["queues"])
                queue["listening"] = [(LISTENING.get(via, (via, via)), n) for via, n in sorted(listening.items())]
            # MCP sessions without an open stream (those with one are doorbell sessions, listed above), while
            # they were used in the last BOARD_MCP_IDLE_SECONDS: a client never has to say it left.
            endpoint["sessions"] += [
                {"via": "mcp, no stream open", "queues": None, "last_request": True,
                 "since": int((wall_now - (monotonic_now - m.last_seen)) * 1000)}
                for m in list(self.mcp.sessions.values()) if m.endpoint_id == endpoint["id"] and m.stream is None
                and monotonic_now - m.last_seen < BOARD_MCP_IDLE_SECONDS]
        return self.render(request, "queues.html", session, **data)

    async def todo(self, request: Request, session: BoardSession) -> Response:
        data = await self.page_data(session, board_todo, request.path_params["todo_id"])
        return self.render(request, "todo.html", session, **data)

    async def todos(self, request: Request, session: BoardSession) -> Response:
        """Every todo in any state, newest first, filtered by state, endpoint, queue, subject and title, through
        the model GET /api/v1/todos takes; a page at a time."""
        query = request.query_params
        fields = {name: query[name].strip() for name in ("endpoint", "queue", "subject", "q")
                  if query.get(name, "").strip()}
        states = [state for state in query.getlist("state") if state]
        if states:
            fields["state"] = ",".join(states)
        selection = Selection.of(parse_model(TodoListQuery, fields))
        data = await self.page_data(session, board_todos, selection, _cursor(query.get("after")))
        here = urllib.parse.urlencode([*((k, v) for k, v in fields.items() if k != "state"),
                                       *(("state", state) for state in states)], quote_via=urllib.parse.quote)
        return self.render(request, "todos.html", session, filters=fields, picked=set(states), states=TODO_STATES,
                           here=here, **data)

    def failed_checks(self, webhook_id: str) -> dict:
        """A webhook's failed signature checks in the last day, exact to the minute. They are refused with 401
        and never stored: the server counts them in memory, so when it started less than a day ago, `since` says
        when (its count covers only that long)."""
        checks, now = self.flows.failed_checks, self.db.clock.now_ms()
        young = now - checks.started_at < checks.WINDOW_MS
        return {"count": checks.count(webhook_id, now), "since": checks.started_at if young else None}

    async def webhooks(self, request: Request, session: BoardSession) -> Response:
        data = await self.page_data(session, board_webhooks)
        for webhook in data["webhooks"]:
            webhook["failed_checks"] = self.failed_checks(webhook["id"])
        return self.render(request, "webhooks.html", session, **data)

    async def webhook(self, request: Request, session: BoardSession, *, status: int = 200,
                      editor: str | None = None, dry: dict | None = None, form: dict | None = None) -> Response:
        webhook_id = request.path_params["webhook_id"]
        data = await self.page_data(session, board_webhook, webhook_id)
        data["webhook"]["failed_checks"] = self.failed_checks(webhook_id)
        rules = data["rules"]
        document = {"rules": rules["rules"], "default_action": rules["default_action"], "params": rules["params"]}
        return self.render(request, "webhook.html", session, status, editor=editor or pretty_json(document),
                           dry=dry or {}, form=form or {}, shed=self.flows.shed.get(webhook_id), **data)

    async def deliveries(self, request: Request, session: BoardSession) -> Response:
        query = request.query_params
        disposition = query.get("disposition") if query.get("disposition") in EVENT_DISPOSITIONS else None
        kind = (query.get("kind") or "").strip()[:128] or None
        data = await self.page_data(session, board_deliveries, request.path_params["webhook_id"], disposition, kind,
                                    _cursor(query.get("before")))
        return self.render(request, "deliveries.html", session, disposition=disposition, kind=kind,
                           dispositions=EVENT_DISPOSITIONS, **data)

    async def delivery(self, request: Request, session: BoardSession) -> Response:
        data = await self.page_data(session, board_delivery, request.path_params["event_id"])
        return self.render(request, "delivery.html", session, **data)

    async def endpoints(self, request: Request, session: BoardSession) -> Response:
        data = await self.page_data(session, board_endpoints)
        return self.render(request, "endpoints.html", session, base=self.api.ingest_base(request).rstrip("/"),
                           **data)

    async def notify(self, request: Request, session: BoardSession) -> Response:
        data = await self.page_data(session, list_channels)
        return self.render(request, "notify.html", session, kinds=NOTIFY_KINDS, events=NOTIFY_EVENTS, **data)

    async def schedules(self, request: Request, session: BoardSession) -> Response:
        data = await self.page_data(session, board_schedules)
        return self.render(request, "schedules.html", session, **data)

    async def account(self, request: Request, session: BoardSession) -> Response:
        data = await self.page_data(session, board_account)
        return self.render(request, "account.html", session, proxy_sign_in=self.auth_header is not None, **data)

    async def revoke_confirm(self, request: Request, session: BoardSession) -> Response:
        data = await self.page_data(session, board_endpoints)
        endpoint_id = request.path_params["endpoint_id"]
        endpoint = next((e for e in data["endpoints"] if e["id"] == endpoint_id), None)
        if endpoint is None:
            raise ApiError("not_found", f"no endpoint {endpoint_id}")
        return self.render(request, "revoke.html", session, endpoint=endpoint, live=data["live"])

    # -- actions ------------------------------------------------------------------------------------------
    async def todo_action(self, request: Request, session: BoardSession, form: dict) -> Response:
        """One human action on a todo, through the very function REST runs for it."""
        todo_id, action = request.path_params["todo_id"], request.path_params["action"]
        principal = session.principal
        # The form's fields as the JSON body REST would get (blank ones left out), through the same model.
        fields = {k: v for k, v in form.items() if k not in ("csrf", "back", "trust_actor") and v.strip()}
        if action == "release":
            body = parse_model(ReleaseQuarantine, json.dumps({**fields, "trust_actor": form.get("trust_actor") == "1"}))
            done = await self.flows.release_quarantined(principal, todo_id, body)
            self.notice(session, _release_notice(done), todo_id=done["id"])
            return self.back(form, f"/board/todos/{todo_id}")
        if action not in HUMAN_ACTIONS:
            raise ApiError("not_found", f"no action {action}")
        model, fn = HUMAN_ACTIONS[action]
        done = await self.db.write(fn, principal, todo_id, parse_model(model, json.dumps(fields)))
        verb = {"approve": "Approved", "request-changes": "Sent back for changes", "answer": "Answered",
                "retry": "Retrying", "reroute": "Rerouted", "cancel": "Cancelled", "discard": "Discarded",
                "resume": "Resumed", "undefer": "Undeferred", "defer": "Deferred"}[action]
        where = f" to {done['queue']}" if action == "reroute" and done["state"] == "pending" else ""
        self.notice(session, f"{verb}{where}: {done['title']}", todo_id=done["id"])
        return self.back(form, f"/board/todos/{todo_id}")

    async def rules(self, request: Request, session: BoardSession, form: dict) -> Response:
        """Save (or, with do=dry-run, only try) the candidate rules. A refusal is shown next to the editor with
        the candidate kept; a save answers 303."""
        webhook_id = request.path_params["webhook_id"]
        editor = form.get("rules", "")
        try:
            document = json.loads(editor, parse_constant=refuse_constant)
            if not isinstance(document, dict):
                raise ApiError("invalid_argument", "the rules document is a JSON object: {\"rules\": [...], ...}")
        except (ValueError, RecursionError) as exc:
            error = ApiError("invalid_argument", f"not JSON: {exc}")
            return await self.webhook(request, session, status=400, editor=editor, form=form,
                                      dry={"error": error.message})
        except ApiError as error:
            return await self.webhook(request, session, status=400, editor=editor, form=form,
                                      dry={"error": error.message})
        try:
            if form.get("do") == "dry-run":
                result = await self.flows.dry_run(session.principal, webhook_id, parse_model(
                    RulesTest, json.dumps({**document, **self._test_subject(form)})))
                return await self.webhook(request, session, editor=editor, form=form, dry={"result": result})
            await self.flows.set_rules(session.principal, webhook_id, parse_model(RuleSet, json.dumps(document)))
        except ApiError as error:
            if error.status == 404:
                raise
            return await self.webhook(request, session, status=400, editor=editor, form=form,
                                      dry={"error": error.message})
        self.notice(session, "Rules saved.")
        return RedirectResponse(f"/board/webhooks/{webhook_id}#rules", status_code=303)

    @staticmethod
    def _test_subject(form: dict) -> dict:
        """The dry run's document: a stored delivery, or a pasted payload with `Name: value` header lines."""
        if form.get("source", "event") == "event":
            if not form.get("event_id"):
                raise ApiError("invalid_argument", "choose a stored delivery, or paste a payload")
            return {"event_id": form["event_id"]}
        try:
            payload = json.loads(form.get("payload") or "null", parse_constant=refuse_constant)
        except (ValueError, RecursionError) as exc:
            raise ApiError("invalid_argument", f"payload: not JSON: {exc}") from None
        headers = {}
        for line in (form.get("headers") or "").splitlines():
            name, colon, value = line.partition(":")
            if line.strip() and not colon:
                raise ApiError("invalid_argument", f"headers: {line.strip()!r} is not `Name: value`")
            if name.strip():
                headers[name.strip()] = value.strip()
        return {"payload": payload, "headers": headers}

    async def rotate(self, request: Request, session: BoardSession, form: dict) -> Response:
        webhook_id = request.path_params["webhook_id"]
        made = await self.db.write(rotate_webhook, session.principal, self.flows.box, webhook_id,
                                   self.api.ingest_base(request))
        self.notice(session, "Rotated: the old URL stopped working. Copy the new URL (and secret) now; they are"
                             " not shown again.", "secret", url=made["url"], secret=made["secret"])
        return RedirectResponse(f"/board/webhooks/{webhook_id}", status_code=303)

    async def trusted_actors(self, request: Request, session: BoardSession, form: dict) -> Response:
        webhook_id = request.path_params["webhook_id"]
        names = [n.strip() for n in re.split(r"[\n,]", form.get("names", "")) if n.strip()]
        if form.get("mode") == "allow_all":
            document: dict = {"allow_all": True}
        elif form.get("kind") == "actor_ids":
            document = {"actor_ids": names}
        else:
            document = {"logins": names, "match": form.get("match") or "sender"}
        await self.db.write(set_trusted_actors, session.principal, webhook_id,
                            parse_model(TrustedActors, json.dumps(document)))
        self.notice(session, "Trusted actors saved.")
        return RedirectResponse(f"/board/webhooks/{webhook_id}#trust", status_code=303)

    async def add_route(self, request: Request, session: BoardSession, form: dict) -> Response:
        webhook_id = request.path_params["webhook_id"]
        body = parse_model(RouteAdd, json.dumps({"endpoint_id": form.get("endpoint_id", "").strip()}))
        await self.db.write(add_route, session.principal, webhook_id, body)
        names = await self.db.read(board_names, session.principal)
        self.notice(session, f"Deliveries now also go to {names.get(body.endpoint_id, body.endpoint_id)}.")
        return RedirectResponse(f"/board/webhooks/{webhook_id}#routes", status_code=303)

    async def remove_route(self, request: Request, session: BoardSession, form: dict) -> Response:
        webhook_id, endpoint_id = request.path_params["webhook_id"], request.path_params["endpoint_id"]
        await self.db.write(remove_route, session.principal, webhook_id, endpoint_id)
        names = await self.db.read(board_names, session.principal)
        self.notice(session, f"Route to {names.get(endpoint_id, endpoint_id)} removed.")
        return RedirectResponse(f"/board/webhooks/{webhook_id}#routes", status_code=303)

    async def rename(self, request: Request, session: BoardSession, form: dict) -> Response:
        """Name a webhook (a blank name clears it), through the model PATCH /api/v1/webhooks/{id} takes."""
        webhook_id = request.path_params["webhook_id"]
        body = parse_model(WebhookUpdate, json.dumps({"name": form.get("name", "").strip() or None}))
        await self.db.write(update_webhook, session.principal, webhook_id, body)
        self.notice(session, f"Named {body.name}." if body.name else "Name cleared.")
        return self.back(form, f"/board/webhooks/{webhook_id}")

    async def vend(self, request: Request, session: BoardSession, form: dict) -> Response:
        lease = form.get("default_lease_seconds", "").strip()
        spec = {"name": form.get("name", "").strip(), "queues": re.split(r"[\s,]+", form.get("queues", "").strip()),
                "verbs": [form.get("verbs") or "drain"]}
        if lease:
            spec["default_lease_seconds"] = _form_int(lease)
        made = await self.db.write(vend_endpoint, session.principal.human_id,
                                   parse_model(EndpointCreate, json.dumps(spec)))
        base = (self.api.base_url or str(request.base_url)).rstrip("/")
        self.notice(session, f"Endpoint {made['name']} vended. Copy its token now; it is not shown again.", "token",
                    token=made["token"], endpoint_id=made["id"], base=base, queues=made["queues"])
        return RedirectResponse("/board/endpoints", status_code=303)

    async def replay_delivery(self, request: Request, session: BoardSession, form: dict) -> Response:
        """Evaluate a stored delivery under the current rules: a dry run, or (with apply) act on it."""
        event_id = request.path_params["event_id"]
        result = await self.flows.replay_one(session.principal, event_id, ReplayOne(dry_run=form.get("apply") != "yes"))
        before, after = result["before"]["disposition"], result["after"]
        where = f" to {after['queue']}" if after["queue"] else ""
        if result["dry_run"]:
            self.notice(session, f"Checked, nothing changed: under the current rules this delivery (now {before})"
                                 f" would be {after['disposition']}{where} and would create {len(result['todos'])}"
                                 f" todo(s). Press Replay this delivery to act on it.")
        else:
            self.notice(session, f"Replayed under the current rules: was {before}, is now {after['disposition']}"
                                 f"{where} (created {len(result['todos'])} todo(s)).")
        return RedirectResponse(f"/board/deliveries/{event_id}", status_code=303)

    async def replay_webhook(self, request: Request, session: BoardSession, form: dict) -> Response:
        """Replay a webhook's stored deliveries in bulk: a dry run by default, answered with the transitions."""
        webhook_id = request.path_params["webhook_id"]
        fields = {k: form[k].strip() for k in ("disposition", "kind", "since", "until") if form.get(k, "").strip()}
        if form.get("limit", "").strip():
            fields["limit"] = _form_int(form["limit"])
        body = parse_model(ReplayMany, json.dumps({**fields, "dry_run": form.get("apply") != "yes"}))
        summary = await self.flows.replay_webhook(session.principal, webhook_id, body)
        moves = "; ".join(f"{t['count']} {t['from']} → {t['to']}" + (f" (rule {t['rule_id']})" if t["rule_id"] else "")
                          for t in summary["transitions"]) or "nothing matched"
        if summary["dry_run"]:
            self.notice(session, f"Checked {summary['matched']} deliveries, nothing changed: {summary['changed']}"
                                 f" would change under the current rules. {moves}. Press Replay these deliveries"
                                 f" to act on them.")
        else:
            self.notice(session, f"Replayed {summary['matched']} deliveries under the current rules:"
                                 f" {summary['changed']} changed, {summary['created']} todo(s) created. {moves}.")
        return RedirectResponse(f"/board/webhooks/{webhook_id}#replay", status_code=303)

    async def add_channel(self, request: Request, session: BoardSession, form: dict) -> Response:
        body = parse_model(NotifyCreate, json.dumps({
            "kind": form.get("kind", ""), "url": form.get("url", "").strip(),
            "events": [event for event in NOTIFY_EVENTS if form.get(f"ev_{event}") == "on"],
            **({"token": form["token"].strip()} if form.get("token", "").strip() else {})}))
        made = await self.flows.add_channel(session.principal, body)
        if made.get("secret"):
            self.notice(session, "Channel added. Copy its signing secret now; it is not shown again.", "secret",
                        url=made["url"], secret=made["secret"])
        else:
            self.notice(session, f"Channel added ({made['kind']}). Send a test to check it.")
        return RedirectResponse("/board/notify", status_code=303)

    async def test_channel(self, request: Request, session: BoardSession, form: dict) -> Response:
        result = await self.flows.test_channel(session.principal, request.path_params["channel_id"])
        self.notice(session, "Test message sent." if result["sent"] else f"Test failed: {result['error']}",
                    "ok" if result["sent"] else "error")
        return RedirectResponse("/board/notify", status_code=303)

    async def remove_channel(self, request: Request, session: BoardSession, form: dict) -> Response:
        await self.db.write(remove_channel, session.principal, request.path_params["channel_id"])
        self.notice(session, "Channel removed.")
        return RedirectResponse("/board/notify", status_code=303)

    async def new_token(self, request: Request, session: BoardSession, form: dict) -> Response:
        """POST /api/v1/me/token from the account page: a new human token, shown once; the old token and every
        session signed in with it end, and this browser is signed in afresh (the notice belongs to that session)."""
        if form.get("confirm") != "yes":
            raise ApiError("invalid_argument", "tick the box first: the current token stops working at once")
        made, opened = await self.db.write(board_reissue_token, session.principal)
        self.notices.pop(session.key, None)
        request.state.board_cookie = opened
        fresh = await self.db.read(board_session, token_hash(opened))
        ended = made["sessions_ended"] - 1
        self.notice(fresh, "Your new token. Copy it now; it is not shown again. The old one stopped working"
                           f"{f', and {ended} other Board session(s) ended' if ended > 0 else ''}.", "human_token",
                    token=made["token"])
        return RedirectResponse("/board/account", status_code=303)
    async def bulk(self, request: Request, session: BoardSession, form: dict) -> Response:
        """A bulk action from any todo list: first a confirmation page with the dry run's count (nothing changes),
        then, with apply=yes, the action, through the very flow POST /api/v1/todos/bulk runs."""
        body, echo = _bulk_body(form)
        result = await self.flows.bulk(session.principal, body)
        back = self._came_from(request, form)
        if body.dry_run:
            data = await self.page_data(session, lambda txn, principal: {})
            return self.render(request, "bulk.html", session, result=result, echo=echo, back=back, **data)
        skipped = ", ".join(f"{n} {state.replace('_', ' ')}" for state, n in result["skipped"].items())
        self.notice(session, f"{BULK_DONE[body.action]} {result['acted']} of {result['matched']} todos"
                             f"{'; skipped ' + skipped if skipped else ''}"
                             f"{'; the filter matched more: run it again for the rest' if result['truncated'] else ''}.")
        return RedirectResponse(back, status_code=303)

    async def queue_pause(self, request: Request, session: BoardSession, form: dict) -> Response:
        endpoint_id, queue = request.path_params["endpoint_id"], request.path_params["queue"]
        duration, until = form.get("for", "").strip(), form.get("until", "").strip()
        if duration and until:
            raise ApiError("invalid_argument", "give how long (for) or until when, not both")
        fields = {k: v for k, v in (("until", duration or until), ("reason", form.get("reason", "").strip())) if v}
        done = await self.db.write(pause_queue, session.principal, endpoint_id, queue,
                                   parse_model(QueuePause, json.dumps(fields)))
        until_text = f" until {done['paused']['until']}" if done["paused"]["until"] else " until you resume it"
        self.notice(session, f"Paused {queue}{until_text}: claims skip it, deliveries still land in it.")
        return self.back(form, "/board/queues")

    async def queue_resume(self, request: Request, session: BoardSession, form: dict) -> Response:
        endpoint_id, queue = request.path_params["endpoint_id"], request.path_params["queue"]
        done = await self.db.write(resume_queue, session.principal, endpoint_id, queue, QueueResume())
        self.notice(session, f"Resumed {queue}: {done['pending']} pending todo(s) can be claimed.")
        return self.back(form, "/board/queues")

    async def queue_limits(self, request: Request, session: BoardSession, form: dict) -> Response:
        """The caps form shows the caps in force; a blank field clears its cap (both window fields go together)."""
        endpoint_id, queue = request.path_params["endpoint_id"], request.path_params["queue"]
        most, count, window = (form.get(name, "").strip() for name in ("max_in_flight", "max_claims", "window_seconds"))
        if bool(count) != bool(window):
            raise ApiError("invalid_argument", "give both the claims and the window's seconds, or neither")
        fields = {"max_in_flight": _form_int(most) if most else None,
                  "max_claims_per_window": {"count": _form_int(count), "window_seconds": _form_int(window)}
                  if count else None}
        if form.get("clear") == "yes":
            fields = {"max_in_flight": None, "max_claims_per_window": None}
        await self.db.write(set_queue_limits, session.principal, endpoint_id, queue,
                            parse_model(QueueLimits, json.dumps(fields)))
        self.notice(session, f"Caps of {queue} saved.")
        return self.back(form, "/board/queues")

    async def schedule_switch(self, request: Request, session: BoardSession, form: dict) -> Response:
        """Pause (enabled false) or resume (enabled true, from now) a schedule, as PATCH /api/v1/schedules/{id}."""
        resume = request.url.path.endswith("/resume")
        done = await self.db.write(update_schedule, session.principal, request.path_params["schedule_id"],
                                   ScheduleUpdate(enabled=resume))
        self.notice(session, f"Resumed {done['name']}: next due {done['next_run_at']}." if resume else
                    f"Paused {done['name']}: it makes no todos until you resume it.")
        return self.back(form, "/board/schedules")

    async def queue_wait_limits(self, request: Request, session: BoardSession, form: dict) -> Response:
        """The wait limits form sets all four states at once: a state whose seconds are blank has no limit."""
        endpoint_id, queue = request.path_params["endpoint_id"], request.path_params["queue"]
        limits: dict[str, dict | None] = {}
        for state in WAIT_STATES:
            seconds, then, target = (form.get(f"{state}_{name}", "").strip() for name in ("seconds", "then", "queue"))
            limits[state] = {"after_seconds": _form_int(seconds), "then": then or "remind",
                             **({"queue": target} if target else {})} if seconds else None
        await self.db.write(set_queue_limits, session.principal, endpoint_id, queue,
                            parse_model(QueueLimits, json.dumps({"wait_limits": limits})))
        self.notice(session, f"Wait limits of {queue} saved.")
        return self.back(form, "/board/queues")

    async def revoke(self, request: Request, session: BoardSession, form: dict) -> Response:
        if form.get("confirm") != "yes":
            raise ApiError("invalid_argument", "confirm the revocation first")
        done = await self.db.write(revoke_endpoint, session.principal, request.path_params["endpoint_id"])
        self.notice(session, f"Endpoint {done['name']} revoked; its token no longer works.")
        return RedirectResponse("/board/endpoints", status_code=303)
