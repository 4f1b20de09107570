"""The Board's subjects (one page per work item across every queue) and forge connections: what they read, and
their pages and forms, over the same store functions and flows as REST."""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from switchboard.board.queries import BoardSession, with_choices
from switchboard.configuration import ApiError
from switchboard.database import Txn
from switchboard.models import ConnectionCreate, ForgeLogin, SubjectListQuery, WebhookConnect, parse_model
from switchboard.providers import PROVIDERS
from switchboard.store.connections import connect_webhook, disconnect_webhook, list_connections, remove_connection
from switchboard.store.principals import Principal
from switchboard.store.subjects import get_subject, list_subjects

SUBJECTS_PAGE = 25
FORGE_LOGIN = TypeAdapter(ForgeLogin)


def subject_path(key: str) -> str:
    """A subject's Board page, its key quoted (`#` would end the path; `/` may stay)."""
    return "/board/subjects/" + urllib.parse.quote(key, safe="/")


# -- what the pages read (transaction bodies, confined by the human's principal) ------------------------------

def board_subjects(txn: Txn, principal: Principal, query: SubjectListQuery) -> dict:
    return {**list_subjects(txn, principal, query), "query": query.model_dump(exclude_none=True)}


def board_subject(txn: Txn, principal: Principal, key: str) -> dict:
    """The subject as REST answers it, its open todos with the queues their actions may name, the webhook each
    came through, and the names of the endpoints on its timeline."""
    subject = get_subject(txn, principal, key)
    cache: dict = {}
    todos = []
    for todo in subject["todos"]:
        event = txn.one("SELECT webhook_id FROM events WHERE id = ?", (todo["event_id"],)) if todo["event_id"] else None
        trace = txn.one("SELECT traceparent FROM todos WHERE id = ?", (todo["id"],))["traceparent"]
        todos.append(with_choices(txn, principal, {**todo, "webhook_id": event["webhook_id"] if event else None,
                                                   "trace_id": trace.split("-")[1] if trace else None}, cache))
    by_id = {t["id"]: t for t in todos}
    for entry in subject["timeline"]:
        if "todo_id" in entry:
            entry["todo_title"] = by_id[entry["todo_id"]]["title"] if entry["todo_id"] in by_id else None
    return {"subject": {**subject, "todos": todos, "timeline": fold_own_output(subject["timeline"])},
            "path": subject_path(key)}


def fold_own_output(timeline: list[dict]) -> list[dict]:
    """The story with the deliveries of the server's own comments (an output's comment, each edit of the status
    comment: the forge sends each back, and the gate drops it as `own_output`) folded into one entry where the
    last of them stood, which lists each: they are noise beside the subject's own events, which stay as they
    were."""
    echoes = [entry for entry in timeline if entry["type"] == "delivery" and entry.get("stage") == "own_output"]
    if not echoes:
        return timeline
    folded = {"type": "own_output", "at": echoes[-1]["at"], "echoes": echoes,
              "text": "A delivery of the server's own comment, ignored" if len(echoes) == 1
              else f"{len(echoes)} deliveries of the server's own comments and their edits, ignored"}
    last, echo_ids = echoes[-1], {id(entry) for entry in echoes}
    return [folded if entry is last else entry for entry in timeline if entry is last or id(entry) not in echo_ids]


def board_connections(txn: Txn, principal: Principal) -> dict:
    return list_connections(txn, principal)


# -- the pages and forms ---------------------------------------------------------------------------------------

class ForgePages:
    """The subjects' and connections' pages, and the forms that connect a webhook to a forge, for the Board
    (`board`: its rendering, notices and page data)."""

    def __init__(self, board: Any):
        self.board = board

    def routes(self, page: Any, act: Any) -> list[Route]:
        return [
            Route("/subjects", page(self.subjects)),
            Route("/subjects/{key:path}", page(self.subject)),
            Route("/connections", page(self.connections)),
            Route("/connections/add", act(self.add_connection), methods=["POST"]),
            Route("/connections/{connection_id}/test", act(self.test_connection), methods=["POST"]),
            Route("/connections/{connection_id}/remove", act(self.remove_connection), methods=["POST"]),
            Route("/webhooks/{webhook_id}/connection", act(self.connect_webhook), methods=["POST"]),
            Route("/webhooks/{webhook_id}/disconnect", act(self.disconnect_webhook), methods=["POST"]),
        ]

    async def subjects(self, request: Request, session: BoardSession) -> Response:
        params = {k: v.strip() for k, v in request.query_params.items()
                  if k in ("q", "state", "provider", "cursor") and v.strip()}
        query = parse_model(SubjectListQuery, {**params, "limit": SUBJECTS_PAGE})
        data = await self.board.page_data(session, board_subjects, query)
        return self.board.render(request, "subjects.html", session, providers=PROVIDERS,
                                 states=("open", "waiting", "done"), **data)

    async def subject(self, request: Request, session: BoardSession) -> Response:
        data = await self.board.page_data(session, board_subject, request.path_params["key"])
        return self.board.render(request, "subject.html", session, **data)

    async def connections(self, request: Request, session: BoardSession) -> Response:
        data = await self.board.page_data(session, board_connections)
        return self.board.render(request, "connections.html", session, **data)

    async def add_connection(self, request: Request, session: BoardSession, form: dict) -> Response:
        """The forge is asked who the token is before anything is stored; the token is never shown again."""
        body = parse_model(ConnectionCreate, json.dumps({
            "kind": form.get("kind", ""), "api_url": form.get("api_url", "").strip(), "token": form.get("token", "").strip(),
            "repos": [r.strip() for r in form.get("repos", "").replace("\n", ",").split(",") if r.strip()]}))
        made = await self.board.flows.add_connection(session.principal, body)
        self.board.notice(session, f"Connection {made['id']} added: the forge says the token is {made['login']}'s.")
        return RedirectResponse("/board/connections", status_code=303)

    async def test_connection(self, request: Request, session: BoardSession, form: dict) -> Response:
        result = await self.board.flows.test_connection(session.principal, request.path_params["connection_id"])
        if result["ok"]:
            self.board.notice(session, f"The forge still says the token is {result['login']}'s.")
        else:
            self.board.notice(session, f"Test failed: {result['error']}", "error")
        return RedirectResponse("/board/connections", status_code=303)

    async def remove_connection(self, request: Request, session: BoardSession, form: dict) -> Response:
        done = await self.board.db.write(remove_connection, session.principal, request.path_params["connection_id"])
        self.board.notice(session, f"Connection {done['id']} removed; {len(done['webhooks'])} webhook(s) no longer"
                                   f" write to the forge.")
        return RedirectResponse("/board/connections", status_code=303)

    async def connect_webhook(self, request: Request, session: BoardSession, form: dict) -> Response:
        """Through the model PUT /api/v1/webhooks/{id}/connection takes; a blank policy is the default."""
        webhook_id = request.path_params["webhook_id"]
        fields: dict[str, Any] = {"connection_id": form.get("connection_id", "").strip(),
                                  "mirror": form.get("mirror") == "on"}
        logins = [n.strip() for n in form.get("commanders", "").split(",") if n.strip()]
        for login in logins:  # said in a person's words here, where REST's answer names the field's pattern
            try:
                FORGE_LOGIN.validate_python(login)
            except ValidationError:
                raise ApiError("invalid_argument", f"commanders: “{login}” is not a forge login (letters, digits,"
                                                   " '-', '.' and '_', at most 100; commas between logins)") from None
        fields["commands"] = {"logins": logins, "on_close": form.get("on_close") or "cancel"}
        if form.get("policy", "").strip():
            try:
                fields["policy"] = json.loads(form["policy"])
            except ValueError as exc:
                raise ApiError("invalid_argument", f"policy: not JSON ({exc})") from None
        made = await self.board.db.write(connect_webhook, session.principal, webhook_id,
                                         parse_model(WebhookConnect, json.dumps(fields)))
        self.board.notice(session, f"Outputs of this webhook's todos now go through {made['login']}"
                                   f"{' (with a status comment on each issue)' if made['mirror'] else ''}.")
        return RedirectResponse(f"/board/webhooks/{webhook_id}#forge", status_code=303)

    async def disconnect_webhook(self, request: Request, session: BoardSession, form: dict) -> Response:
        webhook_id = request.path_params["webhook_id"]
        await self.board.db.write(disconnect_webhook, session.principal, webhook_id)
        self.board.notice(session, "This webhook no longer writes to a forge.")
        return RedirectResponse(f"/board/webhooks/{webhook_id}#forge", status_code=303)
