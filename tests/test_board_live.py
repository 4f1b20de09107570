"""The Board's live view pushes on change (issue 26: about 2,000 open streams cost 45% of a core in polling), and
each webhook card's failed signature checks are an exact count of the last day (issue 25, item 6).

The streams are tested against a real server with 200 of them open, each on its own connection: idle, the
server spends (almost) no CPU on them, measured from /proc/PID/stat; a change, made over REST or by another
process (the CLI, writing the file directly), reaches every one of them at once; signing out ends that
session's stream; SIGTERM ends them all. `tests/bench/bench_board_streams.py` measures the same with 2,000."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx
import producers
from conftest import LiveServer, cli

from switchboard.board.queries import BOARD_COOKIE

STREAMS = 200
IDLE_SECONDS = 3.0
# The server's CPU over IDLE_SECONDS with STREAMS idle streams open, a generous bound: polling every 2 s spent
# 0.25 to 0.28 s here (a tenth of a core); waiting on the change signal spends 0 to 0.01 s.
IDLE_CPU_BOUND = 0.1
# From a change's commit to every stream's new `counts` frame: the probe looks once a second.
PROMPT_SECONDS = 5.0


def cpu_seconds(pid: int) -> float:
    """user + system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Stream:
    """One `GET /board/events` on its own connection, read as it arrives: each frame's event and arrival."""

    def __init__(self, port: int, cookie: str):
        self.port, self.cookie = port, cookie
        self.frames: list[tuple[str, float]] = []
        self.ended = False
        self.changed = asyncio.Event()
        self.writer: asyncio.StreamWriter | None = None

    def events(self, name: str) -> int:
        return sum(1 for event, _ in self.frames if event == name)

    async def run(self) -> None:
        reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writer.write(f"GET /board/events HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
                          f"Cookie: {BOARD_COOKIE}={self.cookie}\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head, head
        buffer = b""
        try:
            while True:
                size = int((await reader.readline()).strip() or b"0", 16)  # chunked, as uvicorn streams
                if size == 0:
                    return
                buffer += (await reader.readexactly(size + 2))[:-2]
                while b"\n\n" in buffer:
                    frame, buffer = buffer.split(b"\n\n", 1)
                    event = frame.split(b"\n")[0].decode()
                    self.frames.append((event.removeprefix("event: "), time.monotonic()))
                    self.changed.set()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            self.ended = True
            self.changed.set()

    async def until(self, condition, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while not condition(self):
                self.changed.clear()
                await self.changed.wait()


async def all_until(streams: list[Stream], condition, timeout: float) -> float:
    """Wait until every stream meets `condition`; the seconds it took."""
    start = time.monotonic()
    await asyncio.gather(*(s.until(condition, timeout) for s in streams))
    return time.monotonic() - start


def sign_in(server: LiveServer, token: str) -> httpx.Client:
    http = httpx.Client(base_url=server.url, headers={"Origin": server.url})
    assert http.post("/board/login", data={"token": token}).status_code == 303
    return http


def test_open_streams_cost_nothing_while_idle_and_hear_every_change_at_once(db_path):
    cli(db_path, "init")
    _, alice = cli(db_path, "human", "add", "alice")
    _, lane = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "lane", "--queues", "lane")
    server = LiveServer(db_path)
    first, second = sign_in(server, alice["token"]), sign_in(server, alice["token"])
    try:
        async def scene() -> None:
            streams = [Stream(server.port, first.cookies[BOARD_COOKIE]) for _ in range(STREAMS - 1)]
            other = Stream(server.port, second.cookies[BOARD_COOKIE])  # another session of the same human
            everyone = [*streams, other]
            tasks = [asyncio.create_task(s.run()) for s in everyone]
            try:
                await all_until(everyone, lambda s: s.events("counts") == 1, 30)

                # Idle: nothing is read or sent, so the server spends next to nothing however many are open.
                await asyncio.sleep(1.0)
                before = cpu_seconds(server.proc.pid)
                await asyncio.sleep(IDLE_SECONDS)
                spent = cpu_seconds(server.proc.pid) - before
                assert spent < IDLE_CPU_BOUND, f"{STREAMS} idle streams cost {spent:.2f} s of CPU in {IDLE_SECONDS} s"
                assert all(s.events("counts") == 1 for s in everyone), "nothing changed, so nothing was sent"

                # A change over REST reaches every stream promptly (all of them, both sessions).
                pushed = httpx.post(f"{server.url}/api/v1/endpoints/{lane['id']}/todos", json={
                    "title": "over REST", "queue": "lane"}, headers={"Authorization": f"Bearer {alice['token']}"})
                assert pushed.status_code == 201, pushed.text
                took = await all_until(everyone, lambda s: s.events("counts") == 2, 30)
                assert took < PROMPT_SECONDS, f"the change took {took:.1f} s to reach every stream"

                # … and so does one another process commits to the file (the CLI writes it directly).
                code, _ = await asyncio.to_thread(cli, db_path, "todo", "push", lane["id"], "--queue", "lane",
                                                  "--title", "from the CLI")
                assert code == 0
                took = await all_until(everyone, lambda s: s.events("counts") == 3, 30)
                assert took < PROMPT_SECONDS, f"the CLI's change took {took:.1f} s to reach every stream"

                # Signing out ends that session's stream (and only it).
                page = await asyncio.to_thread(second.get, "/board/endpoints")
                csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
                assert (await asyncio.to_thread(second.post, "/board/logout", data={"csrf": csrf})).status_code == 303
                await other.until(lambda s: s.ended, PROMPT_SECONDS)
                assert other.frames[-1][0] == "signed-out"
                assert not any(s.ended for s in streams)

                # SIGTERM ends every open stream, and the server exits at once.
                stopping = time.monotonic()
                server.proc.send_signal(signal.SIGTERM)
                await all_until(streams, lambda s: s.ended, 10)
                assert await asyncio.to_thread(server.proc.wait, 10) == 0
                assert time.monotonic() - stopping < 5.0
            finally:
                for s in everyone:
                    if s.writer is not None:
                        s.writer.close()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(scene())
    finally:
        first.close()
        second.close()
        server.stop()
    assert "Traceback" not in server.log_path.read_text(errors="replace")


# -- failed signature checks: an exact count of the last day ---------------------------------------------------

ORIGIN = {"Origin": "http://testserver"}


def failed_checks(client, human, webhook_id: str) -> tuple[str, str]:
    """What the webhook's card and its page say of its failed signature checks (signed in afresh: the clock
    moves by days here, and a session ends after 12 idle hours)."""
    assert client.post("/board/login", data={"token": human.token}, headers=ORIGIN,
                       follow_redirects=False).status_code == 303
    cards = re.findall(r'<li class="card webhook-card">(.*?)</li>', client.get("/board/webhooks").text, re.S)
    [card] = [c for c in cards if f"/board/webhooks/{webhook_id}\"" in c]
    shown = re.search(r'<dd class="failed-checks"[^>]*>(.*?)</dd>', card, re.S).group(1)
    page = client.get(f"/board/webhooks/{webhook_id}").text
    on_page = re.search(r"failed signature checks in the last day: (.*?) · <a", page, re.S).group(1)
    plain = re.compile(r"<[^>]+>")
    return plain.sub("", shown).strip(), plain.sub("", on_page).strip()


def test_failed_signature_checks_are_an_exact_count_of_the_last_day(client, world, alice, clock):
    router = world.endpoint(alice, ["triage"], name="router")
    hook = world.webhook(alice, router, "github", name="home lab")
    quiet = world.webhook(alice, router, "github", name="office")

    def refused(times: int) -> None:
        for _ in range(times):
            raw, headers = producers.github("issues.opened", "a wrong secret of sixteen+")
            assert world.deliver(hook, raw, headers).status_code == 401

    refused(7)
    assert failed_checks(client, alice, hook["id"]) == (
        "7 in the last day (counted since the server started, 0 s ago)",
        "7 (counted since the server started, 0 s ago)"), "every failure counts, not the last five"
    assert failed_checks(client, alice, quiet["id"])[0].startswith("none in the last day")
    clock.advance(12 * 3600)
    refused(3)
    clock.advance(12 * 3600 - 61)  # a minute before the first seven are a day old
    assert failed_checks(client, alice, hook["id"]) == (
        "10 in the last day (counted since the server started, 23 h ago)",
        "10 (counted since the server started, 23 h ago)")
    clock.advance(61)  # a day after the first seven: the server has counted for a whole day, and says no more
    assert failed_checks(client, alice, hook["id"]) == ("3 in the last day", "3")
    clock.advance(12 * 3600)
    assert failed_checks(client, alice, hook["id"]) == ("none in the last day", "0")
    assert failed_checks(client, alice, quiet["id"]) == ("none in the last day", "0")
