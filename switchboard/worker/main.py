"""`switchboard worker`'s command line (SPEC section 15): its flags (each defaulting to SWITCHBOARD_<FLAG>), the
token file, logging, and the choice of job kind (`--exec -- CMD …` or `--triage`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shlex
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from switchboard.worker.exec_runner import ExecRunner
from switchboard.worker.job import ConfigError, JobRunner, read_secret_file
from switchboard.worker.loop import Settings, Worker, iso, log
from switchboard.worker.park import QUOTA_GROUP_PATTERN, check_state_dir
from switchboard.worker.triage import add_triage_arguments, make_triage_runner

DEFAULT_SERVER = "http://127.0.0.1:8080"


# -- configuration: flags, environment, token file, logging ------------------------------------------------------

def _env(flag: str, default: Any) -> Any:
    """A flag's default from SWITCHBOARD_<FLAG> (argparse converts and checks it like a value on the command line)."""
    return os.environ.get("SWITCHBOARD_" + flag.upper().replace("-", "_"), default)


def _bounded_int(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number in {low}..{high}")
        return value
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds, 0 or more")
    return value


def _pattern(pattern: str, what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not re.fullmatch(pattern, text):
            raise argparse.ArgumentTypeError(f"not a {what}")
        return text
    return parse


def _server_url(text: str) -> str:
    """`--server`: an http(s) URL without a user name or password (a credential there would be logged with the
    URL; the token goes in --token-file). The message never repeats the value."""
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", text):
        raise argparse.ArgumentTypeError("not an http(s) URL")
    if "@" in text.split("/", 3)[2]:
        raise argparse.ArgumentTypeError("a URL with a user name or password is refused (it would be logged): give"
                                         " the server's address alone, and the token with --token-file")
    return text


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `switchboard worker` (SPEC section 15), each defaulting to SWITCHBOARD_<FLAG>. The job kind
    comes last: `--exec -- CMD [ARG …]` (or SWITCHBOARD_EXEC="CMD ARG …")."""
    parser.add_argument("--server", metavar="URL", default=_env("server", DEFAULT_SERVER), type=_server_url,
                        help=f"the Switchboard server (default {DEFAULT_SERVER})")
    parser.add_argument("--token-file", metavar="PATH", dest="token_file", default=_env("token-file", None),
                        help="a file holding the endpoint's token (sbk_…), readable by its owner only (required)")
    parser.add_argument("--queue", metavar="Q", dest="queues", action="append",
                        help="a queue to work, repeatable (SWITCHBOARD_QUEUE: comma-separated; default every queue"
                             " of the endpoint)")
    parser.add_argument("--name", metavar="NAME", default=_env("name", None),
                        type=_pattern(r"[^\x00-\x1f\x7f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]{1,128}",
                                      "name (one line of up to 128 characters, no control characters)"),
                        help="the claimant shown on the Board (default HOST-PID)")
    parser.add_argument("--concurrency", metavar="N", type=_bounded_int(1, 64), default=_env("concurrency", "1"),
                        help="jobs at a time, each under its own lease (1..64, default 1)")
    parser.add_argument("--once", action="store_true", default=_env("once", False),
                        help="handle at most one todo, waiting up to --wait for it, then exit")
    parser.add_argument("--wait", metavar="SECONDS", type=_seconds, default=_env("wait", "30"),
                        help="with --once: how long to wait for a todo (default 30 s)")
    parser.add_argument("--state-dir", metavar="DIR", dest="state_dir", default=_env("state-dir", None),
                        help="where quota parks are kept (default $XDG_STATE_HOME/switchboard or"
                             " ~/.local/state/switchboard)")
    parser.add_argument("--quota-group", metavar="NAME", dest="quota_group", default=_env("quota-group", None),
                        type=_pattern(QUOTA_GROUP_PATTERN, "quota group (letters, digits, . _ -)"),
                        help="workers on this host sharing a provider quota: a park stops them all (default: the"
                             " workers running the same command)")
    parser.add_argument("--lease", metavar="SECONDS", type=_bounded_int(1, 86400), default=_env("lease", None),
                        help="lease seconds asked for on each claim (default the endpoint's)")
    parser.add_argument("--timeout", metavar="SECONDS", type=_seconds, default=_env("timeout", None),
                        help="seconds a job may run before it is killed and failed with error 'timeout' (default"
                             " and 0: no limit)")
    parser.add_argument("--log-format", dest="log_format", choices=["plain", "json"],
                        default=_env("log-format", "plain"), help="plain lines (default) or one JSON object per line")
    job = parser.add_argument_group("job")
    job.add_argument("--exec", dest="exec", action="store_true",
                     help="run CMD per todo: the todo as JSON on stdin, the outcome from its last stdout line or"
                          " its exit status (0 complete, 75 park, else fail)")
    job.add_argument("--triage", action="store_true", default=_env("triage", False),
                     help="size issues with a model behind an OpenAI-compatible API and label them (the flags below)")
    job.add_argument("--exec-user", metavar="USER", dest="exec_user", default=_env("exec-user", None),
                     help="with --exec, the worker running as root: run each child as USER, in a directory USER owns,"
                          " so that it cannot read the worker's token (not used by --triage, which starts no child)")
    job.add_argument("command", nargs="*", metavar="CMD", help="after --exec --: the command and its arguments")
    add_triage_arguments(parser)


def _switch(flag: str, value: bool | str) -> bool:
    """A switch given on the command line, else SWITCHBOARD_<FLAG> as 1/true/yes/on or 0/false/no/off."""
    if isinstance(value, bool):
        return value
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"SWITCHBOARD_{flag.upper()} must be 1/true/yes/on or 0/false/no/off")


def read_token(path: str | None) -> str:
    """The endpoint token, from a file no one but its owner may read."""
    if not path:
        raise ConfigError("--token-file (or SWITCHBOARD_TOKEN_FILE) is required: a file holding the endpoint token")
    return read_secret_file(path, "token", r"sbk_[A-Za-z0-9_-]+", "an endpoint token, sbk_…")


def default_state_dir() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "switchboard"


def settings_from(args: argparse.Namespace, default_quota_group: str) -> Settings:
    token = read_token(args.token_file)
    once = _switch("once", args.once)
    queues = [q.strip() for q in args.queues or _env("queue", "").split(",") if q.strip()]
    state_dir = Path(args.state_dir) if args.state_dir else default_state_dir()
    check_state_dir(state_dir)  # last: a worker refused for another reason leaves nothing behind
    return Settings(server=args.server.rstrip("/"), token=token, queues=queues or None,
                    name=args.name or f"{socket.gethostname()}-{os.getpid()}", concurrency=args.concurrency,
                    once=once, wait=args.wait, state_dir=state_dir, quota_group=args.quota_group or default_quota_group,
                    lease=args.lease, timeout=args.timeout or None)


class JsonLines(logging.Formatter):
    """One JSON object per line, as the server writes them (time, level, logger, event), plus a job line's
    fields (todo, queue, outcome, seconds)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": iso(record.created), "level": record.levelname.lower(), "logger": record.name,
                "event": record.getMessage(), **getattr(record, "job", {})}
        if record.exc_info:
            line["error"] = type(record.exc_info[1]).__name__
        return json.dumps(line, ensure_ascii=False)


def configure_logging(log_format: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines() if log_format == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def run_jobs(args: argparse.Namespace, make_runner: Callable[[], JobRunner]) -> int:
    """Run the worker with the runner `make_runner` builds (a ConfigError from it refuses to start): the entry for
    every job kind. Exit status 0 after a shutdown, 1 when the server refused the worker, 2 when misconfigured."""
    configure_logging(args.log_format)
    try:
        runner = make_runner()
        settings = settings_from(args, runner.quota_group)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    return asyncio.run(Worker(settings, runner).run())


def exec_command(args: argparse.Namespace) -> list[str]:
    if args.command and not args.exec:
        raise ConfigError("the command needs --exec before it: --exec -- CMD [ARG …]")
    command = args.command or shlex.split(_env("exec", ""))
    if not command:
        raise ConfigError("give the job to run: --exec -- CMD [ARG …] (or SWITCHBOARD_EXEC)")
    return command


def run_worker(args: argparse.Namespace) -> int:
    """`switchboard worker … --exec -- CMD [ARG …]` or `switchboard worker … --triage`."""
    try:
        triage = _switch("triage", args.triage)
    except ConfigError as exc:
        configure_logging(args.log_format)
        log.error("%s", exc)
        return 2
    if triage:
        return run_jobs(args, lambda: triage_runner(args))
    return run_jobs(args, lambda: ExecRunner(exec_command(args), args.exec_user or None))


def triage_runner(args: argparse.Namespace) -> JobRunner:
    if args.exec or args.command:
        raise ConfigError("give one job kind: --exec -- CMD … or --triage, not both")
    return make_triage_runner(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="switchboard worker",
                                     description="Work an endpoint's queues: claim, run, heartbeat, report.")
    add_worker_arguments(parser)
    return run_worker(parser.parse_args(argv))

