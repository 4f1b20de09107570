"""A Board page being left stays out of the way of the navigation that leaves it. Behind a sign-in proxy that now
names someone else, that navigation's own request ends the page's session; the page's live stream then says
`signed-out`, and a page that went to the login form on it cancelled the navigation the visitor made (Chromium:
net::ERR_ABORTED), whenever the answer came later than the stream's word (a loaded machine)."""

from __future__ import annotations

import threading

from conftest import LiveServer, cli
from test_proxy_sign_in import HEADER, IdentityProxy, chromium  # noqa: F401 - chromium is a fixture


class HoldingProxy(IdentityProxy):
    """The identity proxy, holding its answer to one path until `release` is set: the answer arrives after the
    server acted on the request, as a slow network or a loaded proxy delivers it. A live stream the server ended
    is held open too (until `release`), so that only the page ends it: the browser then reports the stream
    failed exactly when the page closed it, never because the server's end came first."""

    def __init__(self, upstream: str, held: str):
        super().__init__(upstream)
        self.held = held
        self.release = threading.Event()

    def forward(self, handler) -> None:
        if handler.path == self.held:
            send_response = handler.send_response

            def held_back(*args) -> None:
                self.release.wait(15)
                send_response(*args)

            handler.send_response = held_back
        super().forward(handler)
        if handler.path == "/board/events":
            self.release.wait(15)


def test_a_page_signed_out_by_the_navigation_leaving_it_lets_that_navigation_finish(chromium, db_path):  # noqa: F811
    assert cli(db_path, "init")[0] == 0
    cli(db_path, "human", "add", "alice", "--login", "alice@example.com")
    cli(db_path, "human", "add", "bob", "--login", "bob@example.com")
    server = LiveServer(db_path, "--trust-proxy", "127.0.0.2", "--auth-header", HEADER)
    proxy = HoldingProxy(server.url, "/board/queues")
    try:
        proxy.identity = "alice@example.com"
        context = chromium.new_context()
        page = context.new_page()
        with page.expect_response(lambda answer: answer.url.endswith("/board/events")):
            page.goto(proxy.url + "/board/endpoints")
        assert page.locator("a.who").inner_text() == "alice"
        # The old page closes its stream once its session ended (the server's word `signed-out`); only then does
        # the held answer go out.
        page.on("requestfailed", lambda request: request.url.endswith("/board/events") and proxy.release.set())
        proxy.identity = "bob@example.com"
        answer = page.goto(proxy.url + "/board/queues")
        assert proxy.release.is_set(), "the old page's stream never ended"
        assert answer.status == 200 and page.url == proxy.url + "/board/queues"
        assert page.locator("a.who").inner_text() == "bob"
        context.close()
    finally:
        proxy.release.set()
        proxy.close()
        server.stop()
