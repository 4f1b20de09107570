"""The Board's live view at scale: server CPU with thousands of open `GET /board/events` streams, idle and
after one change.

Run by hand (never collected by pytest):

    python tests/bench/bench_board_streams.py [--streams 2000] [--humans 20] [--idle 30]
                                              [--program PATH/switchboard.py] [--label after]

One `serve` child process (this checkout's switchboard.py, or `--program` another checkout's, e.g. the release
before, unpacked with `git archive HEAD | tar -x -C /tmp/before`) on a free loopback port. Set-up through the CLI
in this process: `--humans` humans, each with an endpoint on queue `lane`, each signed in to the Board once
(one session cookie per human). Then `--streams` streams are opened, spread evenly over the humans, each on its
own connection from plain asyncio sockets (the client does nothing while nothing arrives), and each is waited
for until its first `counts` frame.

Measured, after a 2 s settle:

  idle      the server's CPU time (user + system, /proc/PID/stat) over `--idle` seconds in which nothing
            changes, as cores (CPU seconds per wall second), with the frames the streams received meanwhile
            (keep-alive comments, and `counts` frames, which should be none);
  change    one todo pushed over REST for the first human: the time from the push's 201 until every one of that
            human's streams has a new `counts` frame (the median and the last), whether any other human's stream
            got a frame (it should not: their counts did not change), and the server's CPU for the 3 s around it.

Prints one JSON object and writes it to tests/bench/results-board-streams-LABEL.json (git-ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_store import ROOT, ChildServer, cli, machine_facts  # noqa: E402

QUEUE = "lane"
COOKIE = "switchboard_board"


class Server(ChildServer):
    """`serve` from `program` (a switchboard.py), raw streams need no rate limit."""

    def command(self, db_path: str, program: str) -> list[str]:
        return [program, "serve", "--db", db_path, "--port", str(self.port)]

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Stream:
    """One open `GET /board/events` on its own connection: the frames it received, with the time each came."""

    def __init__(self, human: int):
        self.human = human
        self.counts: list[float] = []  # when each `counts` frame arrived
        self.keepalives = 0
        self.first = asyncio.get_running_loop().create_future()
        self.writer: asyncio.StreamWriter | None = None

    async def run(self, port: int, cookie: str) -> None:
        reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        self.writer.write(f"GET /board/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: text/event-stream\r\n"
                          f"Cookie: {COOKIE}={cookie}\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"the stream was refused: {head[:200]!r}")
        chunked = b"transfer-encoding: chunked" in head.lower()
        buffer = b""
        while True:
            if chunked:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    return
                data = await reader.readexactly(size + 2)
                buffer += data[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    return
                buffer += data
            while b"\n\n" in buffer:
                frame, buffer = buffer.split(b"\n\n", 1)
                if frame.startswith(b"event: counts"):
                    self.counts.append(time.perf_counter())
                    if not self.first.done():
                        self.first.set_result(None)
                elif frame.startswith(b": keepalive"):
                    self.keepalives += 1

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def measure(server: Server, cookies: list[str], human_auth: dict, endpoint_id: str, streams_n: int,
                  idle: float) -> dict:
    streams = [Stream(i % len(cookies)) for i in range(streams_n)]
    tasks = []
    opened_at = time.perf_counter()
    for start in range(0, streams_n, 100):  # 100 at a time: the listen backlog is not the subject
        batch = streams[start:start + 100]
        tasks += [asyncio.create_task(s.run(server.port, cookies[s.human])) for s in batch]
        await asyncio.wait_for(asyncio.gather(*(s.first for s in batch)), 120)
    opened = time.perf_counter() - opened_at
    await asyncio.sleep(2.0)
    before = {id(s): (len(s.counts), s.keepalives) for s in streams}
    cpu0, wall0 = server.cpu_seconds(), time.perf_counter()
    await asyncio.sleep(idle)
    cpu1, wall1 = server.cpu_seconds(), time.perf_counter()
    idle_counts = sum(len(s.counts) - before[id(s)][0] for s in streams)
    idle_keepalives = sum(s.keepalives - before[id(s)][1] for s in streams)

    mine = [s for s in streams if s.human == 0]
    others = [s for s in streams if s.human != 0]
    seen = {id(s): len(s.counts) for s in streams}
    cpu2, wall2 = server.cpu_seconds(), time.perf_counter()
    async with httpx.AsyncClient(base_url=server.url, headers=human_auth, timeout=30) as client:
        answer = await client.post(f"/api/v1/endpoints/{endpoint_id}/todos", json={"title": "a change",
                                                                                  "queue": QUEUE})
        pushed = time.perf_counter()
        answer.raise_for_status()
    deadline = pushed + 30
    while time.perf_counter() < deadline and any(len(s.counts) == seen[id(s)] for s in mine):
        await asyncio.sleep(0.01)
    arrived = [s.counts[seen[id(s)]] - pushed for s in mine if len(s.counts) > seen[id(s)]]
    await asyncio.sleep(max(0.0, wall2 + 3.0 - time.perf_counter()))
    cpu3, wall3 = server.cpu_seconds(), time.perf_counter()
    others_told = sum(1 for s in others if len(s.counts) > seen[id(s)])

    for s in streams:
        s.close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "streams": streams_n, "humans": len(cookies), "open_seconds": round(opened, 2),
        "idle": {"seconds": round(wall1 - wall0, 2), "cpu_seconds": round(cpu1 - cpu0, 3),
                 "cores": round((cpu1 - cpu0) / (wall1 - wall0), 4), "counts_frames": idle_counts,
                 "keepalive_frames": idle_keepalives},
        "change": {"streams_of_that_human": len(mine), "reached": len(arrived),
                   "median_ms": round(statistics.median(arrived) * 1000, 1) if arrived else None,
                   "last_ms": round(max(arrived) * 1000, 1) if arrived else None,
                   "other_streams_told": others_told,
                   "cpu_seconds_3s": round(cpu3 - cpu2, 3), "cores": round((cpu3 - cpu2) / (wall3 - wall2), 4)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--humans", type=int, default=20)
    parser.add_argument("--idle", type=float, default=30.0,
                        help="seconds of idle measured (longer than KEEPALIVE_SECONDS: every keep-alive counts)")
    parser.add_argument("--program", default=str(ROOT / "switchboard.py"), help="the switchboard.py to serve")
    parser.add_argument("--label", default="after", help="names the results file")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="sb-bench-streams-")
    db_path = os.path.join(tmp, "switchboard.db")
    cli(db_path, "init")
    humans = []
    for i in range(args.humans):
        human = cli(db_path, "human", "add", f"h{i}")
        endpoint = cli(db_path, "endpoint", "vend", "--human", f"h{i}", "--name", "lane", "--queues", QUEUE)
        humans.append((human, endpoint))
    with Server(db_path, args.program) as server:
        cookies = []
        for human, _ in humans:
            signed = httpx.post(f"{server.url}/board/login", data={"token": human["token"]},
                                headers={"Origin": server.url}, follow_redirects=False)
            assert signed.status_code == 303, signed.text
            cookies.append(signed.cookies[COOKIE])
        result = asyncio.run(measure(server, cookies, {"Authorization": f"Bearer {humans[0][0]['token']}"},
                                     humans[0][1]["id"], args.streams, args.idle))
        problems = [line for line in server.log_path.read_text(errors="replace").splitlines()
                    if "Traceback" in line or " ERROR " in line]
    result = {"label": args.label, "program": args.program, **result, "log_problems": problems[:5],
              "machine": machine_facts()}
    print(json.dumps(result, indent=2))
    HERE.joinpath(f"results-board-streams-{args.label}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
