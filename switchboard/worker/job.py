"""What a job is to the worker (SPEC section 15): the claimed todo a runner works, the runner's interface, and the
outcomes a runner may return. The worker (switchboard.worker) owns everything around a job: the claim, the lease,
the heartbeats, timeouts, shutdown, parking and reporting; a runner (`--exec`'s, the triage runner) only works
the todo and says how it ended.

An outcome is what a child's outcome file or line says (`{"outcome": "complete", "result": …}`), validated strictly: a
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


class Misconfigured(ConfigError):
    """Raised by a runner's `run` when the job showed that the worker is configured wrong for what it talks to
    (a flag must change): the worker hands the todo back (its attempt refunded, `note` saying why), claims nothing
    more, and exits 2 so that its supervisor shows the message."""


# Credentials of the shapes the worker may meet (its own endpoint token, forge and model tokens), struck out of any
# text it logs or reports, whatever quoted them.
CREDENTIAL_SHAPES = re.compile(
    r"\b(?:sb[a-z]_[A-Za-z0-9_-]{16,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_-]{20,}"
    r"|sk-[A-Za-z0-9_-]{16,}|xox[abpr]-[A-Za-z0-9-]{10,})")


def scrub(text: str, secrets: list[str] | tuple[str, ...] = ()) -> str:
    """`text` without the given secrets nor anything of a credential's shape (each becomes `[redacted]`), and
    without NUL (the API refuses it). Scrub before cutting: a cut may leave a part no longer matched."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "[redacted]")
    return CREDENTIAL_SHAPES.sub("[redacted]", text).replace("\x00", "\ufffd")


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


class AddLabels(_OutcomeModel):
    """An output asking the server to add labels to the work order's issue (SPEC section 16)."""
    type: Literal["add_labels"] = "add_labels"
    labels: tuple[Text, ...]


class CompleteWithOutputs(Complete):
    """A runner's complete that asks the server to write on the work order's issue through the webhook's forge
    connection (the triage runner's, without a forge token of its own). Not an outcome a child may write: `--exec`'s
    outcomes are OUTCOMES."""
    outputs: tuple[AddLabels, ...]


def refused_outputs_error(message: str, todo: dict) -> str:
    """The todo's error when the server refused a report's outputs (`message`, naming `outputs[i]`): the same
    outputs would be refused again until a human changes the webhook, so the error says what to change, naming
    the webhook of the todo's work order."""
    error = f"the server refused the outputs: {message}"
    if "has no forge connection" in message:
        order = todo.get("work_order")
        webhook = order.get("webhook_id") if isinstance(order, dict) else None
        if not (isinstance(webhook, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,100}", webhook)):
            webhook = "WEBHOOK"
        error += (f"; connect the webhook to a forge connection (switchboard connection add …, then switchboard"
                  f" webhook connect {webhook} CONNECTION) and retry the todo")
    return error


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
    retry_after: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None


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
    traceparent: str | None = None  # the claim's: the attempt's `process` span (W3C), the job's spans go under it

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
