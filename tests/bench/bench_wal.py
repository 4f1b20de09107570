"""The WAL's size under a long run of deliveries with a reader open (the soak behind tests/test_operations.py's
test_wal_stays_bounded_over_deliveries_with_a_reader_open, which sends 1,500).

    python tests/bench/bench_wal.py [--deliveries N]      (default 20,000: about 500 MB through the WAL)

One app on a new SQLite file, `--ingest-rate 0`, one generic webhook into `inbox`; one sender posts 1 KB deliveries
straight into the app (ASGI, on the app's loop) while a dashboard-like reader keeps its own connection and counts
todos. Every 100 deliveries the WAL's size is taken. Exit 1 if it ever passed WRITER_CHECKPOINT_BYTES + 1 MiB, or
if an explicit TRUNCATE checkpoint at the end leaves it non-empty.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import httpx  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from switchboard.app import create_app  # noqa: E402
from switchboard.configuration import WRITER_CHECKPOINT_BYTES  # noqa: E402
from switchboard.limits import RateLimiter  # noqa: E402
from switchboard.store.principals import add_human  # noqa: E402


def bench_wal(deliveries: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        db_path = os.path.join(tmp, "switchboard.db")
        app = create_app(db_path, background=False)
        app.state.flows.limiter = RateLimiter(0, 1)
        with TestClient(app) as client:
            human = app.state.db.write_sync(add_human, "alice")
            auth = {"Authorization": f"Bearer {human['token']}"}
            endpoint = client.post("/api/v1/endpoints", headers=auth,
                                   json={"name": "worker", "queues": ["inbox"], "verbs": ["all"]}).json()
            hook = client.post("/api/v1/webhooks", headers=auth, json={
                "provider": "generic", "queue": "inbox", "endpoint_id": endpoint["id"]}).json()
            path = hook["url"].removeprefix("http://testserver")
            wal, body, stop, reads = db_path + "-wal", b'{"job": "' + b"x" * 1000 + b'"}', threading.Event(), []

            def reader() -> None:
                conn = sqlite3.connect(db_path)
                try:
                    while not stop.is_set():
                        reads.append(conn.execute("SELECT count(*) FROM todos").fetchone()[0])
                        stop.wait(0.001)
                finally:
                    conn.close()

            async def deliver_all() -> int:
                largest = 0
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as http:
                    for n in range(deliveries):
                        r = await http.post(path, content=body, headers={"X-Delivery-Id": f"d{n}"})
                        assert r.status_code == 202, r.text
                        if n % 100 == 99:
                            largest = max(largest, os.path.getsize(wal))
                return largest

            thread = threading.Thread(target=reader)
            thread.start()
            started = time.perf_counter()
            try:
                largest = client.portal.call(deliver_all)
            finally:
                stop.set()
                thread.join()
            seconds = time.perf_counter() - started
            busy, _, _ = app.state.db.checkpoint()
            emptied = busy == 0 and os.path.getsize(wal) == 0
        bound = WRITER_CHECKPOINT_BYTES + (1 << 20)
        return {"deliveries": deliveries, "seconds": round(seconds, 1), "largest_wal_bytes": largest,
                "bound_bytes": bound, "reads": len(reads), "within_bound": largest <= bound,
                "emptied_by_truncate": emptied, "ok": largest <= bound and emptied}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deliveries", type=int, default=20_000)
    result = bench_wal(parser.parse_args().deliveries)
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["ok"] else 1)
