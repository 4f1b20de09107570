"""Sign-in through the homelab's identity proxy (issue 37): `serve --auth-header NAME --trust-proxy ADDRESSES`
signs a Board visitor in as the human whose login the header names, only on requests from those proxies; from
any other address the header is ignored and the token sign-in works as before; a header naming no human gets a
refusal page. Sessions, CSRF and cookie flags are the Board's own.

First through Starlette's test client, whose peer address is set per client (a proxy's, a stranger's), red-team
style: every refused request leaves every table as it was. Then in a real Chromium against a real server, behind a
reverse proxy of ours that does what Authelia's forward-auth behind Caddy or nginx does."""

from __future__ import annotations

import http.server
import re
import threading
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, cli, snapshot
from starlette.testclient import TestClient
from test_board_browser import CHROMIUM, LAUNCH_ARGS, _no_browser

from switchboard.app import create_app
from switchboard.board.queries import BOARD_COOKIE
from switchboard.configuration import ApiError
from switchboard.store.principals import add_human

PROXY = ("10.0.0.2", 41000)
STRANGER = ("192.0.2.7", 41000)
HEADER = "Remote-User"


class Site:
    """One app behind a declared proxy (10.0.0.2) with the sign-in header, alice and bob tied to logins, and
    clients reaching it from the proxy and from elsewhere."""

    def __init__(self, db_path: str):
        self.db_path = db_path
        self.app = create_app(db_path, background=False, trust_proxy="10.0.0.0/30", auth_header=HEADER)
        self.proxy = TestClient(self.app, client=PROXY, follow_redirects=False)
        self.proxy.__enter__()
        self.alice = self.app.state.db.write_sync(add_human, "alice", "Alice@Example.com")
        self.bob = self.app.state.db.write_sync(add_human, "bob", "bob")
        self.carol = self.app.state.db.write_sync(add_human, "carol")

    def client(self, peer: tuple[str, int]) -> TestClient:
        """Another client on the same app (the app's lifespan is the proxy client's)."""
        return TestClient(self.app, client=peer, follow_redirects=False)

    def sessions(self) -> list[tuple]:
        return [tuple(r) for r in self.app.state.db.read_sync(lambda txn: txn.all(
            "SELECT human_id FROM board_sessions ORDER BY created_at, id"))]

    def close(self) -> None:
        self.proxy.__exit__(None, None, None)


@pytest.fixture
def site(db_path):
    made = Site(db_path)
    yield made
    made.close()


def as_user(login: str | bytes | None, **extra) -> dict:
    return {**({HEADER: login} if login is not None else {}), **extra}


def csrf_of(page: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', page).group(1)


# -- from the declared proxy ------------------------------------------------------------------------------------

def test_the_header_from_the_declared_proxy_signs_in_with_the_boards_own_session(site):
    first = site.proxy.get("/board", headers=as_user("alice@example.COM"))
    assert first.status_code == 200, first.text
    assert re.search(r'<a class="who"[^>]*>alice</a>', first.text), "signed in as alice, her login's case aside"
    cookie = first.headers["set-cookie"]
    assert cookie.startswith(f"{BOARD_COOKIE}=sbs_") and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert "Path=/board" in cookie and "Secure" not in cookie
    assert site.sessions() == [(site.alice["id"],)]
    again = site.proxy.get("/board/queues", headers=as_user("alice@example.com"))
    assert again.status_code == 200 and "set-cookie" not in again.headers, "the session is kept, not remade"
    assert site.sessions() == [(site.alice["id"],)]
    # Its forms carry the session's CSRF token as any other session's; without it nothing runs.
    token = csrf_of(site.proxy.get("/board/endpoints", headers=as_user("alice@example.com")).text)
    before = snapshot(site.db_path)
    for form, origin in (({"name": "w", "queues": "build"}, "http://testserver"),
                         ({"name": "w", "queues": "build", "csrf": token}, "https://evil.example"),
                         ({"name": "w", "queues": "build", "csrf": "x" * 43}, "http://testserver")):
        refused = site.proxy.post("/board/endpoints/vend", data=form, headers=as_user("alice@example.com",
                                                                                       Origin=origin))
        assert refused.status_code == 403, refused.text
    assert snapshot(site.db_path) == before
    vended = site.proxy.post("/board/endpoints/vend", data={"name": "w", "queues": "build", "csrf": token},
                             headers=as_user("alice@example.com", Origin="http://testserver"))
    assert vended.status_code == 303
    endpoints = site.proxy.get("/api/v1/endpoints", headers={"Authorization": f"Bearer {site.alice['token']}"})
    assert [e["name"] for e in endpoints.json()["endpoints"]] == ["w"]


def test_the_proxy_says_who_is_at_the_keyboard_now(site):
    site.proxy.get("/board", headers=as_user("alice@example.com"))
    switched = site.proxy.get("/board", headers=as_user("bob"))
    assert switched.status_code == 200 and re.search(r'<a class="who"[^>]*>bob</a>', switched.text)
    assert switched.headers["set-cookie"].startswith(f"{BOARD_COOKIE}=sbs_")
    assert site.sessions() == [(site.bob["id"],)], "alice's session in this browser ended"
    # No header from the proxy (a path it does not guard): the cookie is what counts.
    assert site.proxy.get("/board/queues").status_code == 200
    site.proxy.cookies.clear()
    assert site.proxy.get("/board/queues").headers["location"].startswith("/board/login")


def test_a_header_naming_no_human_is_refused_with_a_page_that_says_so(site):
    before = snapshot(site.db_path)
    for login, why in (("mallory", "no human of this server has that login"),
                       ("carol", "no human of this server has that login"),  # carol has no login at all
                       ("two words", "is not a login"), ("x" * 255, "is not a login"),
                       ("é".encode(), "is not a login"), ("alice\x7f", "is not a login")):
        for path in ("/board", "/board/queues", "/board/login", "/board/todos/td_00"):
            answer = site.proxy.get(path, headers=as_user(login))
            assert answer.status_code == 403, (login, path, answer.status_code)
            assert "<h1>Not signed in</h1>" in answer.text and why in answer.text, answer.text
            assert "set-cookie" not in answer.headers
        if why.startswith("no human"):
            assert f"switchboard human set-login NAME {login}" in site.proxy.get("/board", headers=as_user(login)).text
        posted = site.proxy.post("/board/endpoints/vend", data={"name": "w", "queues": "build"},
                                 headers=as_user(login, Origin="http://testserver"))
        assert posted.status_code == 403 and "Not signed in" in posted.text
        assert site.proxy.get("/board/events", headers=as_user(login)).status_code == 401
    assert snapshot(site.db_path) == before


def test_the_header_sent_twice_is_refused_and_the_api_ignores_it(site):
    twice = site.proxy.get("/board", headers=[(HEADER, "mallory"), (HEADER, "alice@example.com")])
    assert twice.status_code == 403 and "more than once" in twice.text and site.sessions() == []
    for path in ("/api/v1/me", "/api/v1/todos", "/api/v1/endpoints"):
        answer = site.proxy.get(path, headers=as_user("alice@example.com"))
        assert answer.status_code == 401 and answer.json()["error"] == "unauthenticated", "the API wants a token"
    assert site.proxy.post("/api/v1/me/token", headers=as_user("alice@example.com")).status_code == 401


def test_the_cookie_is_secure_behind_the_named_proxys_https_only(site):
    behind_tls = site.proxy.get("/board", headers=as_user("bob", **{"X-Forwarded-Proto": "https"}))
    assert "; Secure" in behind_tls.headers["set-cookie"]
    stranger = site.client(STRANGER)
    signed = stranger.post("/board/login", data={"token": site.bob["token"]},
                           headers={"Origin": "http://testserver", "X-Forwarded-Proto": "https"})
    assert signed.status_code == 303 and "Secure" not in signed.headers["set-cookie"], \
        "X-Forwarded-Proto from an address that is not a named proxy does not count"


# -- from any other address -------------------------------------------------------------------------------------

def test_from_any_other_address_the_header_is_ignored_and_the_token_works(site):
    stranger = site.client(STRANGER)
    before = snapshot(site.db_path)
    for headers in (as_user("alice@example.com"), as_user("alice@example.com", **{"X-Forwarded-For": "10.0.0.2"}),
                    as_user("mallory")):
        answer = stranger.get("/board", headers=headers)
        assert answer.status_code == 303 and answer.headers["location"] == "/board/login?next=/board", answer.text
        assert stranger.get("/board/login", headers=headers).status_code == 200, "the token form, not a refusal"
        assert stranger.get("/board/events", headers=headers).status_code == 401
    assert snapshot(site.db_path) == before
    signed = stranger.post("/board/login", data={"token": site.carol["token"]}, headers={"Origin": "http://testserver"})
    assert signed.status_code == 303
    page = stranger.get("/board/queues", headers=as_user("alice@example.com"))
    assert page.status_code == 200 and re.search(r'<a class="who"[^>]*>carol</a>', page.text), \
        "the header does not move a token session either"


def test_without_auth_header_the_proxy_header_is_nobody(db_path):
    app = create_app(db_path, background=False, trust_proxy="10.0.0.2")
    with TestClient(app, client=PROXY, follow_redirects=False) as proxy:
        app.state.db.write_sync(add_human, "alice", "alice")
        assert proxy.get("/board", headers=as_user("alice")).headers["location"].startswith("/board/login")


def test_auth_header_needs_named_proxies_and_a_header_name(db_path, tmp_path):
    for options, why in (({"auth_header": HEADER}, "--trust-proxy ADDRESSES"),
                         ({"auth_header": HEADER, "trust_proxy": True}, "--trust-proxy ADDRESSES"),
                         ({"auth_header": "Remote User", "trust_proxy": "127.0.0.1"}, "not a header name"),
                         ({"auth_header": "Remote-User:", "trust_proxy": "127.0.0.1"}, "not a header name")):
        with pytest.raises(ApiError, match=re.escape(why)):
            create_app(str(tmp_path / "refused.db"), background=False, **options)
    for flags, why in ((("--auth-header", HEADER), "--auth-header needs --trust-proxy ADDRESSES"),
                       (("--auth-header", HEADER, "--trust-proxy"), "--auth-header needs --trust-proxy ADDRESSES"),
                       (("--trust-proxy", "proxy.lan"), "'proxy.lan' is not an address or a network")):
        code, answer = cli(db_path, "serve", "--port", "1", *flags)
        assert code == 1 and answer["error"] == "invalid_argument" and why in answer["message"], answer


# -- in Chromium, behind a reverse proxy of ours ----------------------------------------------------------------

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade"}


class IdentityProxy:
    """A reverse proxy in front of the server, as Authelia's forward-auth behind Caddy or nginx is: it reaches the
    server from 127.0.0.2 (the address `--trust-proxy` names), drops any Remote-User the browser sent and sets its
    own (`identity`, whom its own sign-in decided; none when None), appends the browser's address to
    X-Forwarded-For, and streams each answer back (the Board's live stream included)."""

    def __init__(self, upstream: str):
        self.identity: str | None = None
        self.upstream = httpx.Client(base_url=upstream, timeout=60, follow_redirects=False,
                                     transport=httpx.HTTPTransport(local_address="127.0.0.2"))
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                proxy.forward(self)

            do_POST = do_HEAD = do_GET

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def forward(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        body = handler.rfile.read(int(handler.headers.get("content-length") or 0))
        headers = [(k, v) for k, v in handler.headers.items() if k.lower() not in HOP_BY_HOP | {HEADER.lower()}]
        forwarded = ", ".join(filter(None, [handler.headers.get("x-forwarded-for"), handler.client_address[0]]))
        headers = [(k, v) for k, v in headers if k.lower() != "x-forwarded-for"] + [("X-Forwarded-For", forwarded)]
        if self.identity is not None:
            headers.append((HEADER, self.identity))
        with self.upstream.stream(handler.command, handler.path, headers=headers, content=body) as answer:
            handler.send_response(answer.status_code)
            for name, value in answer.headers.multi_items():
                if name.lower() not in HOP_BY_HOP | {"content-length"}:
                    handler.send_header(name, value)
            handler.end_headers()
            try:
                for chunk in answer.iter_raw():
                    handler.wfile.write(chunk)
                    handler.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.upstream.close()


@pytest.fixture(scope="module")
def chromium():
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        _no_browser("the playwright package is not installed (pip install -e '.[test]')")
    with sync_playwright() as playwright:
        try:
            launched = playwright.chromium.launch(
                executable_path=CHROMIUM if Path(CHROMIUM).exists() else None, args=LAUNCH_ARGS)
        except Error as exc:
            _no_browser(f"no Chromium could be launched ({str(exc).splitlines()[0]})")
        yield launched
        launched.close()


def test_chromium_signs_in_through_the_proxy_is_ignored_around_it_and_refused_for_a_stranger(chromium, db_path):
    assert cli(db_path, "init")[0] == 0
    _, alice = cli(db_path, "human", "add", "alice", "--login", "alice@example.com")
    cli(db_path, "human", "add", "bob", "--login", "bob@example.com")
    server = LiveServer(db_path, "--trust-proxy", "127.0.0.2", "--auth-header", HEADER)
    proxy = IdentityProxy(server.url)
    try:
        # Through the proxy, signed in there as alice: the Board opens on her inbox, with no token pasted.
        proxy.identity = "alice@example.com"
        context = chromium.new_context()
        page = context.new_page()
        asked: list[str] = []
        failed: list[tuple[str, int]] = []
        page.on("request", lambda request: asked.append(request.url))
        page.on("response", lambda response: failed.append((response.url, response.status))
                if response.status >= 400 else None)
        page.goto(proxy.url + "/board")
        assert page.url == proxy.url + "/board" and page.locator("a.who").inner_text() == "alice"
        # A form through the proxy: the session's CSRF token and the proxy's Origin pass the Board's checks.
        page.goto(proxy.url + "/board/endpoints")
        page.fill("#ep-name", "lane-s-worker")
        page.fill("#ep-queues", "lane-s")
        page.click("form[action='/board/endpoints/vend'] button[type=submit]")
        page.wait_for_url(proxy.url + "/board/endpoints")
        assert "Endpoint lane-s-worker vended" in page.locator("main").inner_text()
        # The proxy now says bob is at the keyboard: the Board follows it, whatever the cookie held.
        proxy.identity = "bob@example.com"
        page.goto(proxy.url + "/board/queues")
        assert page.locator("a.who").inner_text() == "bob"
        assert not [url for url in asked if url.endswith("/favicon.ico")], "no page asks for a missing icon"
        assert any(url.endswith("/board/static/favicon.svg") for url in asked)
        assert failed == [], failed
        context.close()

        # Straight to the server (not through the proxy), with the header forged: ignored; the token works.
        direct = chromium.new_context(extra_http_headers={HEADER: "alice@example.com"})
        page = direct.new_page()
        page.goto(server.url + "/board")
        assert page.url == server.url + "/board/login?next=/board"
        page.fill("#token", alice["token"])
        page.click("form button[type=submit]")
        page.wait_for_url(server.url + "/board")
        assert page.locator("a.who").inner_text() == "alice"
        direct.close()

        # Through the proxy as someone no human is: a refusal page that says why.
        proxy.identity = "mallory@example.com"
        stranger = chromium.new_context()
        page = stranger.new_page()
        answer = page.goto(proxy.url + "/board")
        assert answer.status == 403
        assert page.locator("h1").inner_text() == "Not signed in"
        assert "no human of this server has that login" in page.locator("main").inner_text()
        assert stranger.cookies() == [], "no session for nobody"
        stranger.close()
        assert "names no human's login" in server.logged() and "mallory" not in server.logged()
    finally:
        proxy.close()
        server.stop()
