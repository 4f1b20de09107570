"""The README's curl walk-through, run as written against a real server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT


def walkthrough() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## From an empty database to a completed todo", 1)[1]
    return re.search(r"```sh\n(.*?)```", section, re.S).group(1)


def test_readme_walkthrough_ends_with_a_completed_todo(live_server, db_path, tmp_path):
    server = live_server()
    script = walkthrough().replace("localhost:8080", f"127.0.0.1:{server.port}").replace("/tmp/", f"{tmp_path}/")
    env = {**os.environ, "SWITCHBOARD_DB": db_path,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # curl prints each answer without a newline; the last one is the GET of the todo.
    final = json.loads(done.stdout[done.stdout.rindex('{"id"'):])
    assert final["state"] == "done" and final["outcome"] == "completed"
    assert final["result"] == {"fixed": True}
    assert [h["to"] for h in final["history"]] == ["pending", "claimed", "done"]
    assert final["attempts"][0]["heartbeats"] == 1


def test_readme_worker_loop_completes_pushed_work(live_server, db_path, tmp_path):
    server = live_server()
    section = (ROOT / "README.md").read_text().split("**A minimal worker loop**", 1)[1]
    (tmp_path / "worker.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    from conftest import cli_inproc
    _, human = cli_inproc(db_path, "human", "add", "alice")
    _, endpoint = cli_inproc(db_path, "endpoint", "vend", "--human", "alice", "--name", "w", "--queues", "build")
    env = {**os.environ, "SWITCHBOARD_URL": server.url, "SWITCHBOARD_TOKEN": endpoint["token"]}
    worker = subprocess.Popen([sys.executable, str(tmp_path / "worker.py")], env=env)
    try:
        import httpx
        todo = httpx.post(f"{server.url}/api/v1/endpoints/{endpoint['id']}/todos",
                          headers={"Authorization": f"Bearer {human['token']}"},
                          json={"title": "paste me", "queue": "build", "payload": {"n": 7}}).json()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            shown = httpx.get(f"{server.url}/api/v1/todos/{todo['id']}",
                              headers={"Authorization": f"Bearer {human['token']}"}).json()
            if shown["state"] == "done":
                break
            time.sleep(0.1)
        assert shown["state"] == "done" and shown["result"] == {"echo": {"n": 7}}
    finally:
        worker.kill()
        worker.wait()
