"""`pip install .` gives a working program with no source tree beside it: the wheel carries the package's data
(schema.sql, the Board's templates and static files, the packs) and the `switchboard` console script, and the
installed copy, run from another directory, initialises a database, serves /healthz and renders the Board."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, free_port

# What deploy/Dockerfile.dockerignore lets through (its `!name` lines): all a build gets.
DOCKER_CONTEXT = [line[1:] for line in (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
                  if line.startswith("!")]
BOOT = ("import sys; sys.path.insert(0, sys.argv.pop(1)); import switchboard; "
        "assert switchboard.__file__.startswith(sys.path[0]), switchboard.__file__; "
        "from switchboard.cli.parser import main; sys.exit(main(sys.argv[1:]))")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel `pip install .` would install, unpacked into a directory of its own (no checkout on its path).
    It is built from a copy of just what the Docker context lets through, so the build leaves nothing in the
    checkout and needs nothing else."""
    source = tmp_path_factory.mktemp("source")
    for name in DOCKER_CONTEXT:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    wheels = tmp_path_factory.mktemp("wheels")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "--wheel-dir", str(wheels), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("switchboard_hooks-*.whl")
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def run_installed(site: Path, cwd: Path, *args: str, **kwargs) -> subprocess.Popen | subprocess.CompletedProcess:
    """The installed package's CLI, with -I so neither the checkout nor the current directory is on the path."""
    command = [sys.executable, "-I", "-c", BOOT, str(site), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
    if kwargs.pop("background", False):
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_the_wheel_carries_the_data_files_and_the_console_script(installed):
    package = installed / "switchboard"
    for data in ("schema.sql", "schema.postgres.sql", "packs/fleet.json", "packs/pool-review.json", "packs/README.md",
                 "board/templates/base.html", "board/templates/inbox.html", "board/static/board.css",
                 "board/static/board.js"):
        assert (package / data).is_file(), f"{data} is not in the wheel"
    (dist_info,) = installed.glob("switchboard_hooks-*.dist-info")
    entry_points = configparser.ConfigParser()
    entry_points.read(dist_info / "entry_points.txt")
    assert entry_points["console_scripts"]["switchboard"] == "switchboard.cli.entry:main"


def test_schema_and_packs_live_once_at_the_top_of_the_repository():
    """The design card's layout: schema.sql and packs/ beside switchboard.py, and no second copy in the package
    (the wheel gets theirs at build time)."""
    assert (ROOT / "schema.sql").is_file() and (ROOT / "packs" / "fleet.json").is_file()
    assert not (ROOT / "switchboard" / "schema.sql").exists() and not (ROOT / "switchboard" / "packs").exists()


def test_the_installed_copy_serves_from_another_directory(installed, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = run_installed(installed, elsewhere, "init", "--json")
    assert done.returncode == 0, done.stderr
    assert (elsewhere / "switchboard.db").is_file()
    shipped = run_installed(installed, elsewhere, "rules", "set", "wh_00", "--pack", "fleet", "--json")
    assert "not_found" in shipped.stderr, shipped.stdout + shipped.stderr  # the pack was read; the webhook is unknown
    port = free_port()
    server = run_installed(installed, elsewhere, "serve", "--port", str(port), background=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                health = httpx.get(f"{url}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                assert server.poll() is None, server.stderr.read().decode()
                assert time.monotonic() < deadline, "the installed copy did not start"
                time.sleep(0.05)
        assert health.status_code == 200 and health.text.startswith("ok ")
        login = httpx.get(f"{url}/board/login", timeout=5)
        assert login.status_code == 200 and "<form" in login.text
        assert httpx.get(f"{url}/board/static/board.css", timeout=5).status_code == 200
    finally:
        server.terminate()
        assert server.wait(timeout=30) == 0


def test_no_install_line_names_the_unrelated_switchboard_on_pypi():
    """`switchboard` on PyPI is someone else's project: the distribution has a name of its own, the test extra
    refers to itself by it, and no `pip install` in the docs, the deploy files or the code's messages asks for
    `switchboard` (a checkout's `.`, `.[postgres]` and the packages of the extra are what a reader can paste)."""
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "switchboard-hooks"
    assert "switchboard-hooks[postgres]" in project["optional-dependencies"]["test"]
    assert project["scripts"] == {"switchboard": "switchboard.cli.entry:main"}, "the command keeps its name"
    places = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "deploy").iterdir(),
              *(ROOT / "switchboard").rglob("*.py"), *(ROOT / "tests" / "bench").glob("*.py")]
    wrong = []
    for path in places:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for command in re.findall(r"pip install ([^`\n]*)", line.split(" # ", 1)[0]):
                if re.search(r"""(^|\s)["']?switchboard(\[[^\]]*\])?(==[^\s"']*)?["']?(\s|$)""", command):
                    wrong.append(f"{path.relative_to(ROOT)}:{number}: pip install {command}")
    assert not wrong, "\n".join(wrong)
