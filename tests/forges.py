"""A GitHub and a Gitea of our own, for the forge connections' and outputs' tests: each speaks the part of the forge's
documented REST API that Switchboard uses, records every request, and sends the signed deliveries a real forge sends
when an issue is labelled or commented on.

GitHub (docs.github.com/rest): `GET /user`; `GET|POST /repos/{owner}/{repo}/issues/{number}/labels` (POST
`{"labels": [names]}` adds them and answers the issue's labels); `DELETE …/labels/{name}` (404 when the issue does
not carry it); `GET|POST /repos/{owner}/{repo}/issues/{number}/comments` (GET takes `since`, `per_page`, `page`;
POST `{"body"}` answers 201 with the comment); `PATCH /repos/{owner}/{repo}/issues/comments/{id}`;
`POST /repos/{owner}/{repo}/issues/comments/{id}/reactions` (`{"content"}`: 201 made, 200 already there). The credential
is `Authorization: Bearer TOKEN` (anything else: 401 Bad credentials). Gitea (its swagger, /api/v1): the same
paths under its prefix, `DELETE …/labels/{id}` by the label's id, `limit` for the page size, and `Authorization:
token TOKEN`.

`plan` answers the next requests before they are looked at: a status code (answered with GitHub's error shape), a
callable (its answer), "lose" (do the work, then close the connection without answering: a lost answer), or
"redirect:URL" (302 there). Deliveries go to `hook` (an ingest URL and its secret) from a thread of their own, or,
without one, wait in `outbox` for the test to post (`flush`)."""

from __future__ import annotations

import datetime
import itertools
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import httpx
import producers
from helpers import TLS

REPO = "acme/site"
# Rules for a webhook of one human's two lanes: an opened issue to triage, an issue labelled size/S to lane-s, each
# once, with a work order.
RULES = {"rules": [
    {"id": "sized-s", "expr": ".issue != null and any(.issue.labels[]?; . == \"size/S\")",
     "action": {"queue": "lane-s", "work_order": True, "once": True}},
    {"id": "triage", "expr": ".issue != null and .issue.action == \"opened\"",
     "action": {"queue": "triage", "work_order": True, "once": True}}],
    "default_action": {"drop": True}}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _any(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        request = {"method": self.command, "path": self.path, "at": time.monotonic(), "json": body,
                   "headers": {name.lower(): value for name, value in self.headers.items()}}
        forge: FakeForge = self.server  # type: ignore[assignment]
        with forge.lock:
            forge.requests.append(request)
            step = forge.plan.pop(0) if forge.plan else None
        if isinstance(step, str) and step.startswith("redirect:"):
            self._answer(302, {"Location": step.removeprefix("redirect:")}, {"message": "Moved"})
            return
        if isinstance(step, int):
            self._answer(step, {}, {"message": {401: "Bad credentials", 404: "Not Found", 422: "Validation Failed",
                                                500: "Internal Server Error", 502: "Bad Gateway"}.get(step, "error")})
            return
        if callable(step):
            self._answer(*step(request))
            return
        status, headers, answer = forge.answer(request)
        if step == "lose":
            self.close_connection = True
            return
        self._answer(status, headers, answer)

    def _answer(self, status: int, headers: dict, answer: object) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **headers}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

    def log_message(self, *args) -> None:
        pass


class FakeForge(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, kind: str, token: str, login: str = "switchboard-bot"):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.kind, self.token, self.login = kind, token, login
        self.prefix = "/api/v1" if kind == "gitea" else ""
        self.scheme = "token" if kind == "gitea" else "Bearer"
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.plan: list = []
        self.issues: dict[tuple[str, int], dict] = {}
        self.label_ids: dict[str, int] = {}
        self.comment_ids = itertools.count(1000)
        self.hook: tuple[str, str] | None = None
        self.outbox: list[tuple[bytes, dict]] = []
        self.sent: list[dict] = []  # Switchboard's answers to the deliveries sent
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    @property
    def api(self) -> str:
        return self.url + self.prefix

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    # -- the forge's state ------------------------------------------------------------------------------------
    def issue(self, repo: str, number: int, title: str = "Spelling error in the README file",
              author: str = "Codertocat", labels: tuple[str, ...] = (), body: str = "") -> dict:
        made = self.issues.setdefault((repo, number), {"title": title, "author": author, "labels": list(labels),
                                                       "comments": [], "body": body})
        return made

    def open(self, repo: str, number: int, title: str = "Spelling error in the README file",
             author: str = "Codertocat") -> None:
        """An issue opened by `author`: the forge sends its `issues.opened` delivery."""
        self.issue(repo, number, title=title, author=author)
        self._deliver((repo, number), "issue", "opened")

    def comments(self, repo: str, number: int) -> list[dict]:
        return self.issues[(repo, number)]["comments"]

    def labels(self, repo: str, number: int) -> list[str]:
        return self.issues[(repo, number)]["labels"]

    def writes(self) -> list[dict]:
        """The requests that would change something (not the reads)."""
        return [r for r in self.requests if r["method"] != "GET"]

    def wait_for(self, check: Callable[[], object], seconds: float = 10, what: str = "the forge") -> object:
        deadline = time.monotonic() + seconds
        while True:
            found = check()
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {seconds} s: {what}; requests: "
                                     f"{[(r['method'], r['path']) for r in self.requests]}")
            time.sleep(0.02)

    # -- the API ---------------------------------------------------------------------------------------------
    def answer(self, request: dict) -> tuple[int, dict, object]:
        parts = urlsplit(request["path"])
        path, query = unquote(parts.path), parse_qs(parts.query)
        if not path.startswith(self.prefix):
            return 404, {}, {"message": "Not Found"}
        path = path[len(self.prefix):]
        if request["headers"].get("authorization") != f"{self.scheme} {self.token}":
            return 401, {}, {"message": "Bad credentials"}
        if (request["method"], path) == ("GET", "/user"):
            return 200, {}, {"login": self.login, "id": 7, "type": "User", **({"username": self.login}
                                                                                if self.kind == "gitea" else {})}
        found = re.fullmatch(r"/repos/([^/]+/[^/]+)/issues/comments/(\d+)/reactions", path)
        if found and request["method"] == "POST":
            return self._react(found[1], int(found[2]), request["json"])
        found = re.fullmatch(r"/repos/([^/]+/[^/]+)/issues/comments/(\d+)", path)
        if found and request["method"] == "PATCH":
            for issue_key, issue in self.issues.items():
                for comment in issue["comments"]:
                    if comment["id"] == int(found[2]) and issue_key[0] == found[1]:
                        comment["body"] = request["json"]["body"]
                        comment["edits"] += 1
                        self._deliver(issue_key, "comment", "edited", comment=comment)
                        return 200, {}, self._comment_view(comment)
            return 404, {}, {"message": "Not Found"}
        found = re.fullmatch(r"/repos/([^/]+/[^/]+)/issues/(\d+)/(labels|comments)(?:/(.+))?", path)
        if not found or (found[1], int(found[2])) not in self.issues:
            return 404, {}, {"message": "Not Found"}
        key, what, item = (found[1], int(found[2])), found[3], found[4]
        issue = self.issues[key]
        if what == "labels":
            return self._labels(request, key, issue, item)
        if request["method"] == "GET":
            since = query.get("since", [None])[0]
            size = int((query.get("per_page") or query.get("limit") or ["30"])[0])
            page = int(query.get("page", ["1"])[0])
            listed = [c for c in issue["comments"] if since is None or c["updated_at"] >= since]
            return 200, {}, [self._comment_view(c) for c in listed[(page - 1) * size:page * size]]
        if request["method"] == "POST" and isinstance(request["json"], dict) and request["json"].get("body"):
            stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            comment = {"id": next(self.comment_ids), "body": request["json"]["body"], "user": self.login,
                       "created_at": stamp, "updated_at": stamp, "edits": 0}
            issue["comments"].append(comment)
            self._deliver(key, "comment", "created", comment=comment)
            return 201, {}, self._comment_view(comment)
        return 422, {}, {"message": "Validation Failed"}

    def _react(self, repo: str, comment_id: int, body: object) -> tuple[int, dict, object]:
        """A reaction on a comment: 201 made, 200 when this user's reaction of that kind is there already."""
        content = body.get("content") if isinstance(body, dict) else None
        if content not in ("+1", "-1", "laugh", "confused", "heart", "hooray", "rocket", "eyes"):
            return 422, {}, {"message": "Validation Failed"}
        comment = next((c for (r, _), issue in self.issues.items() if r == repo for c in issue["comments"]
                        if c["id"] == comment_id), None)
        if comment is None:
            return 404, {}, {"message": "Not Found"}
        reactions = comment.setdefault("reactions", [])
        view = {"id": comment_id * 10 + len(reactions), "content": content, "user": {"login": self.login}}
        if any(r["content"] == content and r["user"]["login"] == self.login for r in reactions):
            return 200, {}, view
        reactions.append(view)
        return 201, {}, view

    def _labels(self, request: dict, key: tuple[str, int], issue: dict, item: str | None) -> tuple[int, dict, object]:
        if request["method"] == "GET":
            return 200, {}, self._label_views(issue)
        if request["method"] == "POST" and item is None:
            names = (request["json"] or {}).get("labels") if isinstance(request["json"], dict) else None
            if not isinstance(names, list) or not names:
                return 422, {}, {"message": "Validation Failed"}
            added = [name for name in names if name not in issue["labels"]]
            issue["labels"] += added
            for name in added:
                self._deliver(key, "labels", "labeled", label=name)
            return 200, {}, self._label_views(issue)
        if request["method"] == "DELETE" and item is not None:
            name = next((n for n, i in self.label_ids.items() if str(i) == item), None) if self.kind == "gitea" else item
            if name not in issue["labels"]:
                return 404, {}, {"message": "Label does not exist"}
            issue["labels"].remove(name)
            self._deliver(key, "labels", "unlabeled", label=name)
            return (204, {}, None) if self.kind == "gitea" else (200, {}, self._label_views(issue))
        return 404, {}, {"message": "Not Found"}

    def _label_views(self, issue: dict) -> list[dict]:
        return [{"id": self.label_ids.setdefault(name, len(self.label_ids) + 1), "name": name, "color": "ededed"}
                for name in issue["labels"]]

    def _comment_view(self, comment: dict) -> dict:
        return {"id": comment["id"], "body": comment["body"], "user": {"login": comment["user"]},
                "created_at": comment["created_at"], "updated_at": comment["updated_at"]}

    # -- deliveries back ---------------------------------------------------------------------------------------
    def _deliver(self, key: tuple[str, int], what: str, action: str, label: str | None = None,
                 comment: dict | None = None) -> None:
        repo, number = key
        issue = self.issues[key]
        owner = repo.split("/")[0]
        patch = {"issue": {"number": number, "title": issue["title"], "body": issue["body"],
                           "labels": [{"name": n} for n in issue["labels"]],
                           "user": {"login": issue["author"]}, "pull_request": None,
                           "html_url": f"{self.url}/{repo}/issues/{number}"},
                 "repository": {"full_name": repo, "name": repo.split("/")[1], "owner": {"login": owner}},
                 "sender": {"login": self.login}}
        if what == "issue":
            made = (producers.github(f"issues.{action}", "", patch) if self.kind == "github" else
                    producers.gitea(f"issues.{action}", "", {**patch, "number": number}, delivery=str(uuid.uuid4())))
        elif what == "comment":
            patch["comment"] = {"id": comment["id"], "body": comment["body"], "user": {"login": comment["user"]},
                                "html_url": f"{self.url}/{repo}/issues/{number}#issuecomment-{comment['id']}"}
            if self.kind == "github":
                made = producers.github("issue_comment.created", "", {**patch, "action": action})
            else:
                made = producers.gitea("issue_comment.created", "", {**patch, "action": action})
        elif self.kind == "github":
            made = producers.github(f"issues.{action}", "", {**patch, "label": {"name": label}})
        else:
            made = producers.gitea("issues.label_updated", "", {**patch, "number": number}, delivery=str(uuid.uuid4()))
        raw = made[0]
        self.outbox.append((raw, dict(made[1])))
        if self.hook is not None:
            threading.Thread(target=self.flush, args=(None,), daemon=True).start()

    def signed(self, raw: bytes, headers: dict, secret: str) -> dict:
        """The delivery's headers, signed with the webhook's secret as the forge signs them."""
        if self.kind == "github":
            return producers.github_headers(secret, raw, headers.get("X-GitHub-Delivery"), headers["X-GitHub-Event"])
        return {**headers, "X-Gitea-Signature": producers.hex_hmac(secret, raw)}

    def flush(self, post: Callable[[bytes, dict], object] | None) -> list:
        """Send the deliveries waiting: to the hook, or through `post(raw, headers)` (with the hook's secret)."""
        answers = []
        with self.lock:
            waiting, self.outbox[:] = list(self.outbox), []
        for raw, headers in waiting:
            if post is None:
                url, secret = self.hook
                answer = httpx.post(url, content=raw, headers=self.signed(raw, headers, secret), timeout=10,
                                    verify=TLS)
                self.sent.append(answer.json())
            else:
                answers.append(post(raw, headers))
        return answers


class Scene:
    """A human, one endpoint for both lanes, a webhook with the rules above writing through a connection to `forge`."""

    def __init__(self, world, human, forge: FakeForge, provider: str | None = None, **connect):
        self.world, self.client, self.human, self.forge = world, world.client, human, forge
        self.endpoint = world.endpoint(human, ["triage", "lane-s"], verbs=["all"])
        self.provider = provider or forge.kind
        self.hook = world.webhook(human, self.endpoint, self.provider, "triage")
        assert self.call("PUT", f"/webhooks/{self.hook['id']}/rules", **RULES).status_code == 200
        made = self.call("POST", "/connections", kind=forge.kind, api_url=forge.api, token=forge.token,
                         repos=["acme/"])
        assert made.status_code == 201, made.text
        self.connection = made.json()
        connected = self.call("PUT", f"/webhooks/{self.hook['id']}/connection",
                              connection_id=self.connection["id"], **connect)
        assert connected.status_code == 200, connected.text

    def call(self, method: str, path: str, **body):
        return self.client.request(method, f"/api/v1{path}", headers=self.human.auth, json=body or None)

    def deliver(self, raw: bytes, headers: dict) -> dict:
        if self.provider == "github":
            headers = producers.github_headers(self.hook["secret"], raw, headers.get("X-GitHub-Delivery"),
                                               headers["X-GitHub-Event"])
        else:
            headers = {**headers, "X-Gitea-Signature": producers.hex_hmac(self.hook["secret"], raw)}
        answer = self.world.deliver(self.hook, raw, headers)
        assert answer.status_code == 202, answer.text
        return answer.json()

    def open_issue(self, number: int, author: str = "Codertocat") -> str:
        """The issue on the forge and its `issues.opened` delivery; the triage todo's id."""
        self.forge.issue(REPO, number, title="Spelling error", author=author)
        patch = {"issue": {"number": number, "title": "Spelling error", "labels": [], "user": {"login": author},
                           "pull_request": None, "html_url": f"{self.forge.url}/{REPO}/issues/{number}"},
                 "repository": {"full_name": REPO}, "sender": {"login": author}}
        if self.forge.kind == "github":
            raw, headers = producers.github("issues.opened", "", patch)
        else:
            raw, headers = producers.gitea("issues.opened", "", {**patch, "number": number})
        opened = self.deliver(raw, headers)
        assert opened["disposition"] == "routed", opened
        return opened["todos"][0]["id"]

    def flush(self) -> list[dict]:
        """The forge's deliveries (labels, comments) posted to the webhook: Switchboard's answers."""
        return [self.deliver(raw, headers) for raw, headers in self.forge.flush(lambda raw, headers: (raw, headers))]

    def claim(self, todo_id: str, claimant: str = "lane-worker") -> str:
        claimed = self.client.post(f"/api/v1/todos/{todo_id}/claim", headers=self.endpoint.auth,
                                   json={"claimant": claimant})
        assert claimed.status_code == 200, claimed.text
        return claimed.json()["lease_token"]

    def act(self, todo_id: str, verb: str, **body):
        return self.client.post(f"/api/v1/todos/{todo_id}/{verb}", headers=self.endpoint.auth, json=body)

    def todo(self, todo_id: str) -> dict:
        return self.call("GET", f"/todos/{todo_id}").json()

    def wake(self) -> None:
        self.world.client.app.state.flows.forge.wake()

    def tried(self, todo_id: str, attempts: int) -> dict:
        """The todo's first output once its `attempts`-th try is recorded (the sender looks again only then): the
        try is counted before its request, and its send is over once the sender is no longer busy with the issue."""
        sender = self.world.client.app.state.flows.forge

        def check():
            output = self.todo(todo_id)["outputs"][0]
            busy = f"output:{self.forge.kind}:{output['target']}" in sender.busy
            return output["attempts"] >= attempts and not busy and self.todo(todo_id)["outputs"][0]
        return self.forge.wait_for(check, what=f"try {attempts} of {todo_id}'s output")

    def settled(self, todo_id: str, states=("sent", "failed")) -> list[dict]:
        """The todo's outputs once none is pending."""
        def check():
            outputs = self.todo(todo_id)["outputs"]
            return outputs if outputs and all(o["state"] in states for o in outputs) else None
        return self.forge.wait_for(check, what=f"the outputs of {todo_id}")
