"""The README's curl walk-through, run as written against a real server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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
