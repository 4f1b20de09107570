"""The REST surface and ingress (POST /hooks/{token}), and the OpenAPI document made from its routes."""

from __future__ import annotations

import functools
import hmac
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio.to_thread
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import (
    BaseModel,
)
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from switchboard.configuration import INGEST_BUFFER_BYTES, MAX_DELIVERY_BYTES, MAX_REQUEST_BYTES, VERSION, ApiError
from switchboard.engines import database_errors
from switchboard.envelope import lower_headers
from switchboard.flows import EvaluationShed, Flows
from switchboard.http.common import (
    BodyBudget,
    JsonResponse,
    error_response,
    gone_future,
    read_capped,
    sse_response,
)
from switchboard.http.streams import sse_frame
from switchboard.limits import TrustedProxies
from switchboard.models import (
    BulkAction,
    BulkAnswer,
    ClaimAnswer,
    ClaimNext,
    CompleteAnswer,
    ConnectionAnswer,
    ConnectionCreate,
    ConnectionListAnswer,
    ConnectionTestAnswer,
    DeliveryAnswer,
    DoorbellQuery,
    EndpointCreate,
    ErrorAnswer,
    EventListQuery,
    FriendRequest,
    HumanNote,
    NotifyCreate,
    OutputsAnswer,
    QueueAnswer,
    QueueLimits,
    QueueListAnswer,
    QueuePause,
    QueueResume,
    ReleaseQuarantine,
    ReplayMany,
    ReplayOne,
    RouteAdd,
    RuleSet,
    RulesTest,
    ScheduleAnswer,
    ScheduleCreate,
    ScheduleListAnswer,
    ScheduleUpdate,
    SubjectAnswer,
    SubjectListAnswer,
    SubjectListQuery,
    TodoAnswer,
    TodoListAnswer,
    TodoListQuery,
    TodoPush,
    TrustedActors,
    WebhookConnect,
    WebhookConnectionAnswer,
    WebhookCreate,
    WebhookSecret,
    WebhookUpdate,
    parse_model,
)
from switchboard.store.connections import (
    connect_webhook,
    disconnect_webhook,
    get_webhook_connection,
    list_connections,
    remove_connection,
)
from switchboard.store.deliveries import get_event, list_events
from switchboard.store.human_actions import push_todo
from switchboard.store.outbox import list_channels, outputs_held, remove_channel
from switchboard.store.principals import (
    Principal,
    friend_approve,
    friend_request,
    list_endpoints,
    list_friends,
    me,
    reissue_own_token,
    vend_endpoint,
)
from switchboard.store.queues import list_queues, pause_queue, resume_queue, set_queue_limits
from switchboard.store.rules import get_rules
from switchboard.store.schedules import create_schedule, delete_schedule, list_schedules, update_schedule
from switchboard.store.subjects import list_subjects, subject_answer
from switchboard.store.todos import get_todo, list_todos
from switchboard.store.transitions import claim_queues, revoke_endpoint
from switchboard.store.upkeep import AGENT_ACTIONS, HUMAN_ACTIONS
from switchboard.store.webhooks import (
    add_route,
    create_webhook,
    delete_webhook,
    get_webhook,
    list_routes,
    list_webhooks,
    remove_route,
    rotate_webhook,
    set_trusted_actors,
    set_webhook_secret,
    update_webhook,
)


@dataclass(frozen=True)
class ApiRoute:
    """One method on one path: the Api handler that answers it and the models that document it. The app mounts
    exactly these, and /api/v1/openapi.json is generated from them."""
    method: str
    path: str
    handler: str  # an Api method; "" when `store` answers the route
    summary: str
    body: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    answer: type[BaseModel] | None = None
    status: int = 200
    auth: Literal["token", "human", "endpoint", "none", "url", "metrics"] = "token"
    media: str = "application/json"
    store: Callable | None = None  # a store function that is the whole route: store(txn, principal, *path, body?)
    writes: bool = False
    flow: str = ""  # or a Flows method that is: flow(principal, *path, body?)


def _action_routes() -> list[ApiRoute]:
    answers = {"claim": ClaimAnswer, "complete": CompleteAnswer, "absorb": None, "outputs": OutputsAnswer}
    summaries = {"claim": "claim this todo by id",
                 "complete": "complete (agent, with the lease token); with claim_next, claim the next todo in the"
                 " same transaction",
                 "outputs": "ask for forge outputs on the work order's issue while working (agent, with the lease"
                 " token; fenced like heartbeat)"}
    routes = [ApiRoute("POST", f"/api/v1/todos/{{todo_id}}/{name}", "",
                       summaries.get(name, f"{name} (agent, with the lease token)"), body=model,
                       answer=answers.get(name, TodoAnswer), auth="endpoint", store=fn, writes=True)
              for name, (model, fn) in AGENT_ACTIONS.items()]
    routes += [ApiRoute("POST", f"/api/v1/todos/{{todo_id}}/{name}", "", f"{name} (human)", body=model,
                        answer=TodoAnswer, auth="human", store=fn, writes=True)
               for name, (model, fn) in HUMAN_ACTIONS.items()]
    return routes


REST_ROUTES: list[ApiRoute] = [
    ApiRoute("POST", "/hooks/{token}", "ingest", "a producer's signed delivery (the URL is the webhook's)",
             answer=DeliveryAnswer, status=202, auth="url"),
    ApiRoute("GET", "/healthz", "healthz", "200 `ok <version>` (and when outputs are held, since when), or 503"
             " naming what died", auth="none", media="text/plain"),
    ApiRoute("GET", "/metrics", "metrics_text", "Prometheus text (bearer $SWITCHBOARD_METRICS_TOKEN when set)",
             auth="metrics", media="text/plain"),
    ApiRoute("GET", "/api/v1/openapi.json", "openapi", "this document", auth="none"),
    ApiRoute("GET", "/api/v1/me", "", "who the token belongs to, and its scope", store=me),
    ApiRoute("POST", "/api/v1/me/token", "", "a new human token for yourself, shown once: the old token and every"
             " Board session signed in with it end at once", auth="human", store=reissue_own_token, writes=True),
    ApiRoute("GET", "/api/v1/todos", "", "todos in any state, newest first (a human: across their endpoints),"
             " filtered by state, queue, endpoint, subject and title; paged by next_cursor", query=TodoListQuery,
             answer=TodoListAnswer, store=list_todos),
    ApiRoute("POST", "/api/v1/todos/bulk", "", "one human action on many todos (ids, or a filter; at most"
             " 10,000): a dry run unless dry_run is false", body=BulkAction, answer=BulkAnswer, auth="human",
             flow="bulk"),
    ApiRoute("POST", "/api/v1/todos/claim", "claim_next", "claim the best claimable todo, waiting up to"
             " wait_seconds for one", body=ClaimNext, answer=ClaimAnswer, auth="endpoint"),
    ApiRoute("GET", "/api/v1/doorbell", "doorbell_stream", "Server-Sent Events: `todo.ready` when this session is"
             " rung", query=DoorbellQuery, auth="endpoint", media="text/event-stream"),
    ApiRoute("GET", "/api/v1/todos/{todo_id}", "", "a todo with attempts, history, receipt and outputs",
             answer=TodoAnswer, store=get_todo),
    ApiRoute("GET", "/api/v1/subjects", "", "the human's subjects (what work is about), most recently active first",
             query=SubjectListQuery, answer=SubjectListAnswer, auth="human", store=list_subjects),
    ApiRoute("GET", "/api/v1/subjects/{key:path}", "", "one subject (its key URL-encoded): its todos in every queue"
             " and one timeline of deliveries, transitions, outputs and receipts, as the caller may see them",
             answer=SubjectAnswer, store=subject_answer),
    *_action_routes(),
    ApiRoute("POST", "/api/v1/todos/{todo_id}/release-quarantine", "", "release a held delivery: re-evaluate"
             " the rules, or send it to a queue", body=ReleaseQuarantine, answer=TodoAnswer, auth="human",
             flow="release_quarantined"),
    ApiRoute("GET", "/api/v1/endpoints", "endpoints", "the human's endpoints", auth="human"),
    ApiRoute("POST", "/api/v1/endpoints", "endpoints", "vend an endpoint; its token is shown once",
             body=EndpointCreate, status=201, auth="human"),
    ApiRoute("POST", "/api/v1/endpoints/{endpoint_id}/revoke", "revoke", "revoke an endpoint", body=HumanNote,
             auth="human"),
    ApiRoute("GET", "/api/v1/endpoints/{endpoint_id}/queues", "", "an endpoint's queues: pause, caps, in flight,"
             " pending", answer=QueueListAnswer, auth="human", store=list_queues),
    ApiRoute("POST", "/api/v1/endpoints/{endpoint_id}/queues/{queue}/pause", "", "pause a queue (until a time or"
             " for a duration, or until resumed): claims skip it, deliveries still land", body=QueuePause,
             answer=QueueAnswer, auth="human", store=pause_queue, writes=True),
    ApiRoute("POST", "/api/v1/endpoints/{endpoint_id}/queues/{queue}/resume", "", "resume a paused queue; it rings"
             " for what waited", body=QueueResume, answer=QueueAnswer, auth="human", store=resume_queue, writes=True),
    ApiRoute("PUT", "/api/v1/endpoints/{endpoint_id}/queues/{queue}/limits", "", "set or clear a queue's admission"
             " caps (null clears; 0 admits nothing)", body=QueueLimits, answer=QueueAnswer, auth="human",
             store=set_queue_limits, writes=True),
    ApiRoute("POST", "/api/v1/endpoints/{endpoint_id}/todos", "push", "write a todo for an endpoint (201, or 200"
             " with the live todo holding the same key)", body=TodoPush, answer=TodoAnswer, status=201,
             auth="human"),
    ApiRoute("GET", "/api/v1/endpoints/{endpoint_id}/schedules", "", "an endpoint's schedules: next and last run,"
             " the last todo", answer=ScheduleListAnswer, auth="human", store=list_schedules),
    ApiRoute("POST", "/api/v1/endpoints/{endpoint_id}/schedules", "", "make a schedule (cron in a time zone, or"
             " every N seconds): each due time makes one todo", body=ScheduleCreate, answer=ScheduleAnswer,
             status=201, auth="human", store=create_schedule, writes=True),
    ApiRoute("PATCH", "/api/v1/schedules/{schedule_id}", "", "change a schedule's fields (enabled false pauses it,"
             " true resumes it from now)", body=ScheduleUpdate, answer=ScheduleAnswer, auth="human",
             store=update_schedule, writes=True),
    ApiRoute("DELETE", "/api/v1/schedules/{schedule_id}", "", "remove a schedule (the todos it made stay)",
             answer=ScheduleAnswer, auth="human", store=delete_schedule, writes=True),
    ApiRoute("GET", "/api/v1/webhooks", "webhooks", "webhooks the token may see"),
    ApiRoute("POST", "/api/v1/webhooks", "webhooks", "make a webhook; its URL and secret are shown once",
             body=WebhookCreate, status=201),
    ApiRoute("GET", "/api/v1/webhooks/{webhook_id}", "", "one webhook", store=get_webhook),
    ApiRoute("PATCH", "/api/v1/webhooks/{webhook_id}", "", "rename a webhook (`name`, null clears it)",
             body=WebhookUpdate, auth="human", store=update_webhook, writes=True),
    ApiRoute("DELETE", "/api/v1/webhooks/{webhook_id}", "", "delete a webhook", store=delete_webhook,
             writes=True),
    ApiRoute("POST", "/api/v1/webhooks/{webhook_id}/rotate", "rotate", "a new URL and secret", body=HumanNote),
    ApiRoute("PUT", "/api/v1/webhooks/{webhook_id}/secret", "secret", "set the secret Stripe or Slack issued",
             body=WebhookSecret),
    ApiRoute("PUT", "/api/v1/webhooks/{webhook_id}/trusted-actors", "", "set the trust gate's list (github,"
             " gitea, cairn)", body=TrustedActors, store=set_trusted_actors, writes=True),
    ApiRoute("GET", "/api/v1/webhooks/{webhook_id}/connection", "", "the forge connection a webhook writes through,"
             " its mirror switch and output policy", answer=WebhookConnectionAnswer, store=get_webhook_connection),
    ApiRoute("PUT", "/api/v1/webhooks/{webhook_id}/connection", "", "write through a forge connection (the policy"
             " omitted: the default)", body=WebhookConnect, answer=WebhookConnectionAnswer, auth="human",
             store=connect_webhook, writes=True),
    ApiRoute("DELETE", "/api/v1/webhooks/{webhook_id}/connection", "", "stop writing through a forge connection",
             auth="human", store=disconnect_webhook, writes=True),
    ApiRoute("GET", "/api/v1/webhooks/{webhook_id}/routes", "", "a webhook's routes", store=list_routes),
    ApiRoute("POST", "/api/v1/webhooks/{webhook_id}/routes", "", "route deliveries to an endpoint",
             body=RouteAdd, status=201, store=add_route, writes=True),
    ApiRoute("DELETE", "/api/v1/webhooks/{webhook_id}/routes/{endpoint_id}", "", "remove a route",
             store=remove_route, writes=True),
    ApiRoute("GET", "/api/v1/webhooks/{webhook_id}/events", "", "a webhook's deliveries, newest first",
             query=EventListQuery, store=list_events),
    ApiRoute("GET", "/api/v1/webhooks/{webhook_id}/rules", "", "rules, default action and params",
             store=get_rules),
    ApiRoute("PUT", "/api/v1/webhooks/{webhook_id}/rules", "", "validate and save rules", body=RuleSet,
             flow="set_rules"),
    ApiRoute("POST", "/api/v1/webhooks/{webhook_id}/rules/test", "", "dry run: the decision for one"
             " payload or stored delivery", body=RulesTest, flow="dry_run"),
    ApiRoute("GET", "/api/v1/events/{event_id}", "", "one delivery with its envelope and trace",
             store=get_event),
    ApiRoute("POST", "/api/v1/events/{event_id}/replay", "", "evaluate a stored delivery under the current rules"
             " and act on it (once claims and earlier todos hold)", body=ReplayOne, auth="human", flow="replay_one"),
    ApiRoute("POST", "/api/v1/webhooks/{webhook_id}/replay", "", "the same in bulk; a dry run by default,"
             " answering what would change", body=ReplayMany, auth="human", flow="replay_webhook"),
    ApiRoute("GET", "/api/v1/notify", "", "the human's notification channels (no credentials)", auth="human",
             store=list_channels),
    ApiRoute("POST", "/api/v1/notify", "add_channel", "add a notification channel (a webhook channel's signing"
             " secret is shown once)", body=NotifyCreate, status=201, auth="human"),
    ApiRoute("DELETE", "/api/v1/notify/{channel_id}", "", "remove a notification channel", auth="human",
             store=remove_channel, writes=True),
    ApiRoute("POST", "/api/v1/notify/{channel_id}/test", "", "send one test message now", auth="human",
             flow="test_channel"),
    ApiRoute("GET", "/api/v1/connections", "", "the human's forge connections (no tokens)",
             answer=ConnectionListAnswer, auth="human", store=list_connections),
    ApiRoute("POST", "/api/v1/connections", "", "add a forge connection: the forge is asked who the token is (the"
             " token is write-only)", body=ConnectionCreate, answer=ConnectionAnswer, status=201, auth="human",
             flow="add_connection"),
    ApiRoute("DELETE", "/api/v1/connections/{connection_id}", "", "remove a forge connection (its unsent outputs"
             " fail)", answer=ConnectionAnswer, auth="human", store=remove_connection, writes=True),
    ApiRoute("POST", "/api/v1/connections/{connection_id}/test", "", "ask the forge again who the token is",
             answer=ConnectionTestAnswer, auth="human", flow="test_connection"),
    ApiRoute("GET", "/api/v1/friends", "", "the human's friend edges", auth="human", store=list_friends),
    ApiRoute("POST", "/api/v1/friends", "", "ask another human for a friend edge", body=FriendRequest,
             status=201, auth="human", store=friend_request, writes=True),
    ApiRoute("POST", "/api/v1/friends/{edge_id}/approve", "", "approve a friend edge", body=HumanNote,
             auth="human", store=friend_approve, writes=True),
]


MCP_ROUTES = [ApiRoute(method, "/mcp", "handle", f"MCP Streamable HTTP (JSON-RPC 2.0): {what}", auth="endpoint")
              for method, what in (("POST", "initialize, tools/list, tools/call, and the sessionless protocol"),
                                   ("GET", "the session's notification stream (doorbell rings)"),
                                   ("DELETE", "end the session"))]


def _schema_ref(model: type[BaseModel], schemas: dict) -> dict:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


AUTH_NOTES = {"token": "an endpoint token (sbk_…) or a human token (sbh_…)", "human": "a human token (sbh_…)",
              "endpoint": "an endpoint token (sbk_…)", "none": "no credential", "url": "the URL is the credential;"
              " signed providers also send their signature header", "metrics": "the metrics token, when set"}


def documented_path(path: str) -> str:
    """A route's path as OpenAPI writes it: `{key:path}` (a parameter that may hold `/`) is `{key}`."""
    return re.sub(r"{(\w+):\w+}", r"{\1}", path)


def _operation(route: ApiRoute, schemas: dict) -> dict:
    parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                  for name in re.findall(r"{(\w+)(?::\w+)?}", route.path)]
    if route.query is not None:
        query = route.query.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(query.pop("$defs", {}))
        parameters += [{"name": name, "in": "query", "required": name in query.get("required", ()), "schema": prop}
                       for name, prop in query["properties"].items()]
    answer = ({"schema": _schema_ref(route.answer, schemas)} if route.answer else
              {"schema": {"type": "string"} if route.media != "application/json" else {"type": "object"}})
    operation = {
        "operationId": f"{route.method.lower()}_"
                       f"{re.sub(r'[^a-z0-9]+', '_', documented_path(route.path).lower()).strip('_')}",
        "summary": route.summary, "description": f"Credential: {AUTH_NOTES[route.auth]}.",
        "parameters": parameters,
        "responses": {str(route.status): {"description": "success", "content": {route.media: answer}},
                      "4XX": {"description": "the error body", "content": {"application/json": {
                          "schema": _schema_ref(ErrorAnswer, schemas)}}}},
    }
    if route.auth not in ("none", "url"):
        operation["security"] = [{"bearer": []}]
    if route.body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": _schema_ref(route.body, schemas)}}}
    return operation


@functools.cache
def openapi_document() -> dict:
    """OpenAPI 3.1, generated from the route tables and the very models the handlers validate with (once per
    process, when first asked for: the tables never change, and generating it takes longer than the rest of a
    server's start-up)."""
    schemas: dict = {}
    paths: dict = {}
    for route in REST_ROUTES + MCP_ROUTES:
        paths.setdefault(documented_path(route.path), {})[route.method.lower()] = _operation(route, schemas)
    return {"openapi": "3.1.0",
            "info": {"title": "Switchboard", "version": VERSION,
                     "description": "Signed webhooks in, durable leased work for AI agents out. MCP is at /mcp."},
            "paths": paths,
            "components": {"schemas": dict(sorted(schemas.items())),
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}


class Api:
    """The REST surface. Handlers authenticate, validate the body against its model, and run one store
    function as one transaction; everything they answer comes from the store's views."""

    def __init__(self, flows: Flows, base_url: str | None, allowed_origins: frozenset[str],
                 proxies: TrustedProxies | None = None):
        self.flows = flows
        self.db = flows.db
        self.base_url = base_url
        self.allowed_origins = allowed_origins
        self.proxies = proxies or TrustedProxies()
        self.ingest_buffer = BodyBudget(INGEST_BUFFER_BYTES)

    async def principal(self, request: Request, *, remembered: bool = False) -> Principal:
        """Who the bearer token names. `remembered`: the route runs a transaction for every answer it gives, which
        re-checks a principal the process remembered (Flows.principal); any other route looks the token up."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError("unauthenticated", "send Authorization: Bearer <token>")
        principal = await self.flows.principal(token.strip(), remembered=remembered)
        if principal is None:
            raise ApiError("unauthenticated", "unknown or revoked token")
        return principal

    async def body(self, request: Request, model: type[BaseModel]) -> Any:
        return parse_model(model, await read_capped(request, MAX_REQUEST_BYTES))

    # -- routes ----------------------------------------------------------------------------------
    async def healthz(self, request: Request) -> Response:
        """200 `ok <version>` (saying so when outputs are held), or 503 naming what died (the process is then on its
        way out)."""
        dead = list(self.flows.vitals.deaths) + ([self.db.failure or "the writer stopped"] if not self.db.alive() else [])
        if dead:
            return PlainTextResponse(f"unavailable: {dead[0]}", status_code=503)
        try:
            hold = await self.db.read(outputs_held)
        except (ApiError, *database_errors()):
            return PlainTextResponse("unavailable: the database cannot be read", status_code=503)
        if hold is not None:  # alive, but a restored copy: it says so wherever the operator looks
            return PlainTextResponse(f"ok {VERSION}; outputs held since {hold['since']}: nothing goes out until"
                                     " `switchboard outputs resume`")
        return PlainTextResponse(f"ok {VERSION}")

    async def claim_next(self, request: Request) -> Response:
        principal = await self.principal(request, remembered=True)
        principal.require_verb("claim_next")
        body = await self.body(request, ClaimNext)
        return JsonResponse(await self.flows.claim(principal, body, gone_future(request, body)))

    async def doorbell_stream(self, request: Request) -> Response:
        """GET /api/v1/doorbell: Server-Sent Events, `todo.ready` for each ring this session is chosen for."""
        principal = await self.principal(request)
        principal.require_verb("claim_next")
        query = parse_model(DoorbellQuery, dict(request.query_params))
        queues = claim_queues(principal, [query.queue] if query.queue else None)
        frames = await self.flows.ring_frames(principal, queues, lambda ring: sse_frame(ring, "todo.ready"),
                                              [": connected\n\n"])
        return sse_response(frames)

    async def endpoints(self, request: Request) -> Response:
        principal = await self.principal(request)
        principal.require_human("managing endpoints")
        if request.method == "GET":
            return JsonResponse(await self.db.read(list_endpoints, principal))
        body = await self.body(request, EndpointCreate)
        return JsonResponse(await self.db.write(vend_endpoint, principal.human_id, body), status_code=201)

    async def revoke(self, request: Request) -> Response:
        principal = await self.principal(request)
        principal.require_human("revoking endpoints")
        await self.body(request, HumanNote)
        return JsonResponse(await self.db.write(revoke_endpoint, principal, request.path_params["endpoint_id"]))

    async def push(self, request: Request) -> Response:
        principal = await self.principal(request)
        principal.require_human("pushing todos")
        body = await self.body(request, TodoPush)
        todo = await self.db.write(push_todo, principal, request.path_params["endpoint_id"], body)
        return JsonResponse(todo, status_code=201 if todo["created"] else 200)

    # -- ingress ---------------------------------------------------------------------------------
    async def ingest(self, request: Request) -> Response:
        """POST /hooks/{token}. The URL is looked up before a byte of the body is read: an unknown URL costs
        nothing, and the body is read under a deadline and the shared buffer budget."""
        source = self.client_address(request)
        webhook = await self.flows.open_webhook(request.path_params["token"], source)
        body = await read_capped(request, MAX_DELIVERY_BYTES, self.ingest_buffer)
        try:
            status, answer = await self.flows.accept_delivery(webhook, lower_headers(request.headers.raw), body,
                                                              source)
        except EvaluationShed as shed:
            return error_response(shed, {"Retry-After": str(shed.retry_after)})
        return JsonResponse(answer, status_code=status)

    def client_address(self, request: Request) -> str:
        """The address a request comes from: its peer, or behind a proxy named by --trust-proxy ADDRESSES, the
        client that proxy says it forwards for."""
        return self.proxies.client_address(request.client.host if request.client else None,
                                           request.headers.getlist("x-forwarded-for"))

    async def metrics_text(self, request: Request) -> Response:
        expected = os.environ.get("SWITCHBOARD_METRICS_TOKEN")
        if expected:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
                raise ApiError("unauthenticated", "send Authorization: Bearer <metrics token>")
        return Response(await anyio.to_thread.run_sync(self.flows.metrics.render), media_type=CONTENT_TYPE_LATEST)

    # -- webhooks, routes, events, friends -------------------------------------------------------
    def ingest_base(self, request: Request) -> str:
        """Where producers reach this server: --base-url, else the address this request came in on."""
        return self.base_url or str(request.base_url)

    async def webhooks(self, request: Request) -> Response:
        principal = await self.principal(request)
        if request.method == "GET":
            return JsonResponse(await self.db.read(list_webhooks, principal))
        body = await self.body(request, WebhookCreate)
        made = await self.db.write(create_webhook, principal, self.flows.box, body, self.ingest_base(request))
        return JsonResponse(made, status_code=201)

    async def rotate(self, request: Request) -> Response:
        principal = await self.principal(request)
        await self.body(request, HumanNote)
        return JsonResponse(await self.db.write(rotate_webhook, principal, self.flows.box, request.path_params["webhook_id"],
                                                self.ingest_base(request)))

    async def secret(self, request: Request) -> Response:
        principal = await self.principal(request)
        body = await self.body(request, WebhookSecret)
        return JsonResponse(await self.db.write(set_webhook_secret, principal, self.flows.box,
                                                request.path_params["webhook_id"], body))

    async def run_store(self, request: Request, route: ApiRoute) -> Response:
        """A route that is one store function in one transaction, or one flow, called with the principal, the
        path's parameters in order, then the validated body or query."""
        principal = await self.principal(request, remembered=route.store is not None)
        # The token's kind first: the wrong kind is 403 whatever the body holds (it is not read).
        if route.auth == "human":
            principal.require_human(f"{route.method} {documented_path(route.path)}")
        elif route.auth == "endpoint" and principal.kind != "endpoint":
            raise ApiError("forbidden", f"{route.method} {documented_path(route.path)} needs an endpoint token")
        args = list(request.path_params.values())
        if route.body is not None:
            args.append(await self.body(request, route.body))
        if route.query is not None:
            args.append(parse_model(route.query, dict(request.query_params)))
        if route.flow:
            return JsonResponse(await getattr(self.flows, route.flow)(principal, *args), status_code=route.status)
        run = self.db.write if route.writes else self.db.read
        return JsonResponse(await run(route.store, principal, *args), status_code=route.status)

    def route_table(self) -> list[Route]:
        return [Route(r.path, functools.partial(self.run_store, route=r) if r.store or r.flow else
                      getattr(self, r.handler), methods=[r.method]) for r in REST_ROUTES]

    async def add_channel(self, request: Request) -> Response:
        principal = await self.principal(request)
        body = await self.body(request, NotifyCreate)
        return JsonResponse(await self.flows.add_channel(principal, body), status_code=201)

    async def openapi(self, request: Request) -> Response:
        return JsonResponse(openapi_document())
