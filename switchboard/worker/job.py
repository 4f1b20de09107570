"""What a job is to the worker (SPEC section 15): the claimed todo a runner works, the runner's interface, and the
outcomes a runner may return. The worker (switchboard.worker) owns everything around a job: the claim, the lease,
the heartbeats, timeouts, shutdown, parking and reporting; a runner (`--exec`'s, the triage runner) only works
the todo and says how it ended.

An outcome is what a child's outcome line says (`{"outcome": "complete", "result": …}`), validated strictly: a
field the outcome does not take, or of the wrong type, is an error, never a guess."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter


class ConfigError(Exception):
    """The worker cannot start as configured (a runner may say so too); the message says what to change."""


def read_secret_file(path: str, what: str, pattern: str = r"[\x21-\x7e]+",
                     shape: str = "one line of printable ASCII without spaces") -> str:
    """A token or key from a file no one but its owner may read, matching `pattern` (by default one line of
    printable ASCII without spaces: it goes into an HTTP header as it is). Messages name the file, never its
    content."""
    try:
        mode = os.stat(path).st_mode
        if mode & 0o077:
            raise ConfigError(f"the {what} file {path} is open to group or others (mode {mode & 0o777:04o}): run"
                              f" chmod 600 {path}")
        secret = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        secret = ""
    if not re.fullmatch(pattern, secret):
        raise ConfigError(f"the {what} file {path} holds no {what}: {shape}")
    return secret


class _OutcomeModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


Text = Annotated[str, StringConstraints(min_length=1)]


class Complete(_OutcomeModel):
    outcome: Literal["complete"] = "complete"
    result: Any = None
    summary: str | None = None


class Fail(_OutcomeModel):
    outcome: Literal["fail"] = "fail"
    error: Text
    retry: bool = True


class NeedsInput(_OutcomeModel):
    outcome: Literal["needs_input"] = "needs_input"
    question: Text


class Block(_OutcomeModel):
    outcome: Literal["block"] = "block"
    reason: Text


class Release(_OutcomeModel):
    outcome: Literal["release"] = "release"


class Park(_OutcomeModel):
    outcome: Literal["park"] = "park"
    retry_after: Annotated[float, Field(ge=0)] | None = None


Outcome = Annotated[Complete | Fail | NeedsInput | Block | Release | Park, Field(discriminator="outcome")]
OUTCOMES: TypeAdapter[Outcome] = TypeAdapter(Outcome)
OUTCOME_KINDS = ("complete", "fail", "needs_input", "block", "release", "park")


@dataclass
class Job:
    """A claimed todo while a runner works it. `note` is the runner's latest progress line: the next heartbeat
    sends it, and the Board's queues page shows it."""
    todo: dict
    worker: str
    note: str | None = None

    @property
    def id(self) -> str:
        return self.todo["id"]

    @property
    def queue(self) -> str:
        return self.todo["queue"]


class JobRunner(Protocol):
    """What works a todo. `run` returns the job's Outcome; when it is cancelled it must stop the work at once
    (and whatever it started) before re-raising. `quota_group` names the group a park applies to when
    `--quota-group` is not given."""
    quota_group: str

    async def run(self, job: Job) -> Outcome: ...
