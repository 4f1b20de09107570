"""The server's log: one line per delivery and per state change, written by the log writer's thread in batches,
every line out by the time the server stops, and a failing stream or a bad record never ends the writer."""

from __future__ import annotations

import io
import json
import logging
import queue
import re
import threading
import time

import httpx
from conftest import cli

from switchboard.server import LogWriter


class RecordingStream(io.StringIO):
    """A stream that counts its writes and refuses the first `failures` of them, as a full disk would."""

    def __init__(self, failures: int = 0):
        super().__init__()
        self.writes = 0
        self.failures = failures

    def write(self, text: str) -> int:
        self.writes += 1
        if self.failures:
            self.failures -= 1
            raise OSError(28, "No space left on device")
        return super().write(text)


def started_writer(stream: RecordingStream) -> tuple[LogWriter, queue.SimpleQueue]:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    records: queue.SimpleQueue = queue.SimpleQueue()
    writer = LogWriter(records, handler)
    writer.start()
    return writer, records


def record(message: str, *args) -> logging.LogRecord:
    return logging.LogRecord("switchboard", logging.INFO, __file__, 1, message, args, None)


def test_lines_from_many_threads_are_written_whole_in_batches_and_all_by_stop():
    stream = RecordingStream()
    writer, records = started_writer(stream)

    def produce(thread: int) -> None:
        for i in range(250):
            records.put(record("thread %d line %d", thread, i))

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.stop()

    lines = stream.getvalue().splitlines()
    assert len(lines) == 1000 and all(re.fullmatch(r"INFO thread \d line \d+", line) for line in lines)
    for t in range(4):  # each thread's lines in the order it logged them
        assert [int(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(f"INFO thread {t} ")] == \
            list(range(250))
    assert stream.writes < 100, f"{stream.writes} writes for 1000 lines: not batched"
    assert not writer.thread.is_alive()


def test_a_refused_write_or_a_bad_record_loses_only_its_own_lines(capsys):
    stream = RecordingStream(failures=1)
    writer, records = started_writer(stream)
    records.put(record("lost with the refused write"))
    deadline = time.monotonic() + 10
    while stream.writes == 0 and time.monotonic() < deadline:  # until the first batch has met the full disk
        time.sleep(0.01)
    assert stream.writes == 1
    records.put(record("%d is not a number", "x"))  # cannot be formatted: logging's handleError reports it
    records.put(record("written after both"))
    writer.stop()
    assert stream.getvalue() == "INFO written after both\n"
    assert "is not a number" in capsys.readouterr().err


def test_serve_logs_one_json_line_per_state_change_and_none_holds_a_token(db_path, live_server):
    _, human = cli(db_path, "human", "add", "alice")
    _, endpoint = cli(db_path, "endpoint", "vend", "--human", "alice", "--name", "worker", "--queues", "inbox")
    server = live_server("--log-format", "json")
    with httpx.Client(base_url=server.url, timeout=10) as http:
        pushed = http.post(f"/api/v1/endpoints/{endpoint['id']}/todos", json={"title": "t", "queue": "inbox"},
                           headers={"Authorization": f"Bearer {human['token']}"})
        assert pushed.status_code == 201, pushed.text
        worker = {"Authorization": f"Bearer {endpoint['token']}"}
        claimed = http.post("/api/v1/todos/claim", json={"queue": "inbox"}, headers=worker).json()
        done = http.post(f"/api/v1/todos/{claimed['todo']['id']}/complete",
                         json={"lease_token": claimed["lease_token"]}, headers=worker)
        assert done.status_code == 200 and done.json()["state"] == "done", done.text
    server.stop()

    text = server.log_path.read_text()
    entries = [json.loads(line) for line in text.splitlines()]
    assert all(set(e) == {"time", "level", "logger", "event"} for e in entries), entries
    todo_id = claimed["todo"]["id"]
    changes = [e["event"] for e in entries if e["event"].startswith(f"todo {todo_id} ")]
    assert changes == [f"todo {todo_id} created on {endpoint['id']} by human:{human['id']}",
                       f"todo {todo_id} pending -> claimed by endpoint:{endpoint['id']}",
                       f"todo {todo_id} claimed -> done by endpoint:{endpoint['id']}"]
    for secret in (human["token"], endpoint["token"], claimed["lease_token"]):
        assert secret not in text
