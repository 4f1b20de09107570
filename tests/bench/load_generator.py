"""An HTTP load generator that is not the bottleneck: one process of its own, asyncio (on uvloop when installed) over
raw keep-alive sockets, every request built before the clock starts. The standard library only (and uvloop), so it
starts fast and its CPU is its own work. bench_peer_webhook.py runs it:

    python tests/bench/load_generator.py SPEC.json

SPEC: {"host", "port", "path", "deliveries": a JSON file of [{"headers": {…}, "body": "…"}], "mode": "burst" or
"paced", "senders" (burst: that many closed loops, each sending its next delivery once the last is answered),
"rate" (paced: one delivery every 1/rate s on a fixed schedule, whatever the answers do), "kill_pid", "kill_at",
"result": the file it writes its findings to}.

With `kill_pid`, it sends SIGKILL to that process right after the `kill_at`th answer and prints `KILLED <time>`;
a delivery that gets no answer (the connection refused, reset or closed) is sent again, the same bytes, every
RESEND_PAUSE_S until it is answered or RESEND_FOR_S passed. Its findings, written as JSON at the end: per delivery the
wall-clock time (`time.time()`) its request was first and last written and its answer parsed, the status, the
answer's body and how many times it was sent; its own CPU seconds and wall time from the first send.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

RESEND_PAUSE_S = 0.1
RESEND_FOR_S = 60.0
PACED_CONNECTIONS = 4  # opened before the clock; a paced send finding none free opens another


class Unanswered(Exception):
    """The connection failed or closed before a whole answer came."""


class Unreadable(Exception):
    """An answer this load generator does not read (a bug of the benchmark, not the tool's fault)."""


class Connection:
    """One keep-alive HTTP/1.1 connection; answers must carry Content-Length (both tools' small answers do)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def drop(self) -> None:
        if self.writer is not None:
            self.writer.transport.abort()
        self.reader = self.writer = None

    async def exchange(self, request: bytes, on_sent) -> tuple[int, bytes]:
        """Write one request (calling `on_sent` just before) and read its answer: (status, body)."""
        try:
            if self.writer is None:
                await self.open()
            on_sent()
            self.writer.write(request)
            status_line = await self.reader.readline()
            if not status_line.endswith(b"\n"):
                raise Unanswered("the connection closed")
            status, length, close = int(status_line.split()[1]), 0, False
            while True:
                line = await self.reader.readline()
                if not line.endswith(b"\n"):
                    raise Unanswered("the connection closed in the headers")
                if line in (b"\r\n", b"\n"):
                    break
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"connection" and value.strip().lower() == b"close":
                    close = True
                elif name == b"transfer-encoding":
                    raise Unreadable("a chunked answer: this load generator reads Content-Length answers only")
            body = await self.reader.readexactly(length) if length else b""
        # RuntimeError: uvloop's write on a transport the peer closed (a killed server)
        except (OSError, RuntimeError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
            self.drop()
            raise Unanswered(f"{type(exc).__name__}: {exc}") from None
        if close:
            self.drop()
        return status, body


def build_request(host: str, port: int, path: str, delivery: dict) -> bytes:
    body = delivery["body"].encode()
    head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in delivery["headers"].items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def generate_load(spec: dict) -> dict:
    deliveries = json.loads(Path(spec["deliveries"]).read_text())
    requests = [build_request(spec["host"], spec["port"], spec["path"], d) for d in deliveries]
    n = len(requests)
    first_sent: list[float | None] = [None] * n
    last_sent: list[float | None] = [None] * n
    answered: list[float | None] = [None] * n
    status: list[int | None] = [None] * n
    body: list[str | None] = [None] * n
    sends = [0] * n
    answers = 0
    killed_at = None
    errors: list[str] = []

    async def deliver(i: int, conn: Connection) -> None:
        nonlocal answers, killed_at
        give_up = None

        def sent() -> None:
            now = time.time()
            if first_sent[i] is None:
                first_sent[i] = now
            last_sent[i] = now
            sends[i] += 1

        while True:
            try:
                code, data = await conn.exchange(requests[i], sent)
            except Unanswered as exc:
                give_up = give_up or time.monotonic() + RESEND_FOR_S
                if time.monotonic() > give_up:
                    errors.append(f"delivery {i}: no answer in {RESEND_FOR_S:.0f} s: {exc}")
                    return
                await asyncio.sleep(RESEND_PAUSE_S)
                continue
            answered[i], status[i], body[i] = time.time(), code, data.decode(errors="replace")
            answers += 1
            if spec.get("kill_pid") and answers == spec["kill_at"]:
                os.kill(spec["kill_pid"], signal.SIGKILL)
                killed_at = time.time()
                print(f"KILLED {killed_at}", flush=True)
            return

    if spec["mode"] == "burst":
        conns = [Connection(spec["host"], spec["port"]) for _ in range(spec["senders"])]
        await asyncio.gather(*(c.open() for c in conns))
        cpu0, wall0 = time.process_time(), time.monotonic()
        next_index = iter(range(n))

        async def sender(conn: Connection) -> None:
            for i in next_index:
                await deliver(i, conn)

        await asyncio.gather(*(sender(c) for c in conns))
    else:
        free = [Connection(spec["host"], spec["port"]) for _ in range(PACED_CONNECTIONS)]
        await asyncio.gather(*(c.open() for c in free))
        cpu0, wall0 = time.process_time(), time.monotonic()

        async def paced(i: int) -> None:
            conn = free.pop() if free else Connection(spec["host"], spec["port"])
            try:
                await deliver(i, conn)
            finally:
                free.append(conn)

        start = time.monotonic() + 0.05
        tasks = []
        for i in range(n):
            await asyncio.sleep(max(0.0, start + i / spec["rate"] - time.monotonic()))
            tasks.append(asyncio.create_task(paced(i)))
        await asyncio.gather(*tasks)
    return {"first_sent": first_sent, "last_sent": last_sent, "answered": answered, "status": status, "body": body,
            "sends": sends, "killed_at": killed_at, "errors": errors[:20], "cpu_s": time.process_time() - cpu0,
            "wall_s": time.monotonic() - wall0}


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(generate_load(spec))
    else:
        result = uvloop.run(generate_load(spec))
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
