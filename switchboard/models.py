"""Request bodies, rule documents, work items and answers as pydantic models (extra="forbid"): REST, MCP
and the OpenAPI document are all made from them.

Start-up: a model's validator is built when it is first used (defer_build), and annotations are plain Python (no
`from __future__ import annotations`, whose strings pydantic would compile one by one): for a hundred models the
two were half of every CLI command's start."""

import difflib
import re
import urllib.parse
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, Self
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    RootModel,
    StringConstraints,
    Tag,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from switchboard.configuration import (
    ALL_VERBS,
    BULK_MAX,
    NOTIFY_EVENTS,
    NOTIFY_KINDS,
    PARSE_PROBLEMS_SHOWN,
    QUEUE_PATTERN,
    RESERVED_QUEUES,
    TODO_STATES,
    UNSAFE_TEXT,
    VERB_PRESETS,
    ApiError,
    iso,
    to_ms,
)
from switchboard.providers import PROVIDERS

QueueName = Annotated[str, StringConstraints(pattern=QUEUE_PATTERN)]
# Text that reaches SQLite never holds NUL (SQLite's text functions stop at it); one-line text no control bytes.
ONE_LINE = rf"^[^{UNSAFE_TEXT}]*$"
MULTI_LINE = r"^[^\x00]*$"
TodoId = Annotated[str, StringConstraints(pattern=r"^td_[0-9a-f]{1,64}$")]
EndpointId = Annotated[str, StringConstraints(pattern=r"^ep_[0-9a-f]{1,64}$")]
ShortText = Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=MULTI_LINE)]
Note = Annotated[str, StringConstraints(max_length=4096, pattern=MULTI_LINE)]
Label = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=ONE_LINE)]
LeaseSeconds = Annotated[int, Field(ge=1, le=86400)]


class Body(BaseModel):
    """Every request body: unknown fields are refused and types are not coerced."""
    model_config = ConfigDict(extra="forbid", strict=True, defer_build=True)


class EndpointCreate(Body):
    name: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
    queues: Annotated[list[QueueName], Field(min_length=1, max_length=64)]
    verbs: Annotated[list[str], Field(min_length=1, max_length=64)] = ["drain"]
    default_lease_seconds: Annotated[int, Field(ge=60, le=86400)] | None = None
    webhook_max: Annotated[int, Field(ge=0, le=1000)] = 5

    @model_validator(mode="after")
    def _scope(self) -> Self:
        reserved = sorted(set(self.queues) & RESERVED_QUEUES)
        if reserved:
            raise ValueError(f"queue {reserved[0]!r} is reserved")
        unknown = [v for v in self.verbs if v not in VERB_PRESETS and v not in ALL_VERBS]
        if unknown:
            raise ValueError(f"unknown verb {unknown[0]!r}")
        return self

    def expanded_verbs(self) -> list[str]:
        verbs: list[str] = []
        for name in self.verbs:
            for verb in VERB_PRESETS.get(name, (name,)):
                if verb not in verbs:
                    verbs.append(verb)
        return verbs


class WorkItem(Body):
    """Structured work attached to an operator-authored todo."""
    schema_: Literal["switchboard.work_item.v1"] = Field(alias="schema")
    objective: Annotated[str, StringConstraints(min_length=1, max_length=8192, pattern=MULTI_LINE)]
    constraints: Annotated[list[ShortText], Field(max_length=64)] | None = None
    definition_of_done: Annotated[list[ShortText], Field(max_length=64)] | None = None
    validation_commands: Annotated[list[ShortText], Field(max_length=64)] | None = None
    approval_gates: Annotated[list[Literal["review"]], Field(max_length=4)] | None = None
    depends_on: Annotated[list[TodoId], Field(max_length=64)] | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=False, defer_build=True)


class TodoPush(Body):
    title: Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=ONE_LINE)]
    queue: QueueName
    payload: Any = None
    key: Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=ONE_LINE)] | None = None
    priority: Annotated[int, Field(ge=-1000, le=1000)] = 0
    work_item: WorkItem | None = None


# -- schedules ----------------------------------------------------------------------------------------

SCHEDULE_CATCH_UP = ("latest", "none", "all")


def _cron_expression(value: str) -> str:
    """Five fields, as cron(8) reads them (cronsim parses them; a sixth field, of seconds, is refused here)."""
    if len(value.split()) != 5:
        raise ValueError("give five fields (minute hour day-of-month month day-of-week)")
    try:
        CronSim(value, datetime.now(UTC))
    except CronSimError as exc:
        raise ValueError(str(exc).lower()) from None
    return " ".join(value.split())


def _schedule_payload(value: dict[str, Any] | None) -> dict[str, Any] | None:
    taken = sorted({"schedule_id", "due_at"} & set(value or {}))
    if taken:
        raise ValueError(f"{taken[0]} is the schedule's own field of each todo's payload")
    return value


def _time_zone(value: str) -> str:
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {value!r} (an IANA name, e.g. Europe/Berlin)") from None
    return value


CronExpression = Annotated[str, StringConstraints(min_length=9, max_length=256, pattern=ONE_LINE),
                           AfterValidator(_cron_expression)]
TimeZone = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_+/-]+$"),
                     AfterValidator(_time_zone)]
EverySeconds = Annotated[int, Field(ge=1, le=31_622_400)]
ScheduleName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=ONE_LINE)]
TodoTitle = Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=ONE_LINE)]
Priority = Annotated[int, Field(ge=-1000, le=1000)]
SchedulePayload = Annotated[dict[str, Any] | None, AfterValidator(_schedule_payload)]


class ScheduleWorkItem(WorkItem):
    """A schedule's work item: each due time's todo gets it; a recurring todo depends on no other todo."""
    depends_on: None = None


class ScheduleCreate(Body):
    """A schedule: exactly one of `cron` (five fields, in `timezone`) and `every_seconds`."""
    name: ScheduleName
    queue: QueueName
    title: TodoTitle
    cron: CronExpression | None = None
    every_seconds: EverySeconds | None = None
    timezone: TimeZone = "UTC"
    payload: SchedulePayload = None
    work_item: ScheduleWorkItem | None = None
    priority: Priority = 0
    catch_up: Literal[SCHEDULE_CATCH_UP] = "latest"
    enabled: bool = True

    @model_validator(mode="after")
    def _one_timing(self) -> Self:
        if (self.cron is None) == (self.every_seconds is None):
            raise ValueError("cron, every_seconds: give exactly one of them")
        return self


class ScheduleUpdate(Body):
    """A schedule's fields to change; `cron` replaces `every_seconds` and the other way round. `payload` and
    `work_item` null clear them."""
    name: ScheduleName | None = None
    queue: QueueName | None = None
    title: TodoTitle | None = None
    cron: CronExpression | None = None
    every_seconds: EverySeconds | None = None
    timezone: TimeZone | None = None
    payload: SchedulePayload = None
    work_item: ScheduleWorkItem | None = None
    priority: Priority | None = None
    catch_up: Literal[SCHEDULE_CATCH_UP] | None = None
    enabled: bool | None = None

    @model_validator(mode="after")
    def _one_timing(self) -> Self:
        if self.cron is not None and self.every_seconds is not None:
            raise ValueError("cron, every_seconds: give one of them, not both")
        for name in ("name", "queue", "title", "cron", "every_seconds", "timezone", "priority", "catch_up",
                     "enabled"):
            if name in self.model_fields_set and getattr(self, name) is None:
                raise ValueError(f"{name}: may not be null")
        return self


class ClaimNow(Body):
    """A claim that does not wait: `complete`'s `claim_next` (and the fields every claim_next takes)."""
    queue: QueueName | None = None
    queues: Annotated[list[QueueName], Field(min_length=1, max_length=64)] | None = None
    lease_seconds: LeaseSeconds | None = None
    claimant: Label | None = None

    @model_validator(mode="after")
    def _one_filter(self) -> Self:
        if self.queue is not None and self.queues is not None:
            raise ValueError("give queue or queues, not both")
        return self

    def queue_filter(self) -> list[str] | None:
        return [self.queue] if self.queue else self.queues


class ClaimNext(ClaimNow):
    """A claim that may wait (`wait_seconds`) for the first claimable todo, and may take up to `max_todos` in one
    transaction (then answered as `{"claims": [...]}`)."""
    wait_seconds: Annotated[float, Field(ge=0, le=60)] = 0
    max_todos: Annotated[int, Field(ge=1, le=32)] = 1


class ClaimById(Body):
    lease_seconds: LeaseSeconds | None = None
    claimant: Label | None = None


class Leased(Body):
    lease_token: Annotated[str, StringConstraints(min_length=1, max_length=128)]


# -- forge outputs: what a worker asks the server to write on the work order's issue -------------------------

def _forge_label(value: str) -> str:
    # A label goes into the forge's URL as a path segment: one of only dots would name the path above it.
    if value.strip(".") == "":
        raise ValueError(f"label {value!r} is only dots, which no forge URL can name")
    return value


ForgeLabel = Annotated[str, StringConstraints(min_length=1, max_length=100, pattern=ONE_LINE),
                       AfterValidator(_forge_label)]
ForgeLabels = Annotated[list[ForgeLabel], Field(min_length=1, max_length=10)]
MAX_OUTPUTS = 10
MAX_COMMENT_BYTES = 65536


class AddLabels(Body):
    type: Literal["add_labels"]
    labels: ForgeLabels


class RemoveLabels(Body):
    type: Literal["remove_labels"]
    labels: ForgeLabels


class CommentOutput(Body):
    type: Literal["comment"]
    body: Annotated[str, StringConstraints(min_length=1, max_length=MAX_COMMENT_BYTES, pattern=MULTI_LINE)]


Output = Annotated[AddLabels | RemoveLabels | CommentOutput, Field(discriminator="type")]
Outputs = Annotated[list[Output], Field(max_length=MAX_OUTPUTS)]


class PostOutputs(Leased):
    """Outputs on their own, while the worker holds the lease."""
    outputs: Annotated[list[Output], Field(min_length=1, max_length=MAX_OUTPUTS)]


class Heartbeat(Leased):
    note: Note | None = None
    lease_seconds: LeaseSeconds | None = None


class Complete(Leased):
    result: Any = None
    summary: Annotated[str, StringConstraints(pattern=MULTI_LINE)] | None = None
    artifact: Annotated[str, StringConstraints(max_length=2048)] | None = None
    outputs: Outputs | None = None
    # Claim the endpoint's next todo in the same transaction (needs the claim_next verb); answered as `next`.
    claim_next: ClaimNow | None = None

    @model_validator(mode="after")
    def _artifact(self) -> Self:
        if self.artifact is not None and not re.match(r"^(https://[^\s/]+\S*|mcp://\S+)$", self.artifact):
            raise ValueError("artifact must be an https URL or an mcp:// handle")
        return self


class Fail(Leased):
    error: ShortText
    retry: bool = True
    retry_in_seconds: Annotated[int, Field(ge=0, le=86400)] | None = None
    outputs: Outputs | None = None


class Release(Leased):
    note: Note | None = None


class NeedsInput(Leased):
    question: ShortText
    outputs: Outputs | None = None


class Block(Leased):
    reason: ShortText
    outputs: Outputs | None = None


class HumanNote(Body):
    note: Note | None = None


class RequestChanges(Body):
    note: ShortText


class Answer(Body):
    answer: Annotated[str, StringConstraints(min_length=1, max_length=16384, pattern=MULTI_LINE)]


class Defer(Body):
    reason: ShortText
    until: datetime | None = None

    @model_validator(mode="after")
    def _representable(self) -> Self:
        if self.until is not None:
            try:
                iso(to_ms(self.until))
            except (OverflowError, ValueError):
                raise ValueError("until is outside the years 1..9999 in UTC") from None
        return self


class Cancel(Body):
    reason: ShortText


class Reroute(Body):
    queue: QueueName


# One or more states, comma-separated (`done,failed`).
StateList = Annotated[str, StringConstraints(pattern=r"^[a-z_]{1,16}(,[a-z_]{1,16}){0,15}$"),
                      Field(description="one or more states, comma-separated")]
SubjectKey = Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=ONE_LINE)]
TitleSearch = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=ONE_LINE)]
# Where the next page starts: the last todo's `created_at` (ms) and id, as `next_cursor` gave them.
TodoCursor = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,15}\.td_[0-9a-f]{1,64}$")]


def listed_states(text: str | None) -> tuple[str, ...] | None:
    """`pending,failed` as the states it names; an unknown one is refused naming the states there are."""
    if text is None:
        return None
    states = tuple(dict.fromkeys(text.split(",")))
    unknown = [state for state in states if state not in TODO_STATES]
    if unknown:
        raise ValueError(f"unknown state {unknown[0]!r} (the states are {', '.join(TODO_STATES)})")
    return states


class TodoListQuery(BaseModel):
    """`state` takes several states, comma-separated; `subject` is a subject key; `q` matches in the title (any
    case); `cursor` is the `next_cursor` of the page before."""
    model_config = ConfigDict(extra="forbid", defer_build=True)
    queue: QueueName | None = None
    state: StateList | None = None
    endpoint: EndpointId | None = None
    subject: SubjectKey | None = None
    q: TitleSearch | None = None
    cursor: TodoCursor | None = None
    limit: Annotated[int, Field(ge=1, le=200)] = 50

    @model_validator(mode="after")
    def _states(self) -> Self:
        listed_states(self.state)
        return self

    @property
    def states(self) -> tuple[str, ...] | None:
        return listed_states(self.state)

    @property
    def after(self) -> tuple[int, str] | None:
        if self.cursor is None:
            return None
        stamp, _, todo_id = self.cursor.partition(".")
        return int(stamp), todo_id


class TodoFilter(Body):
    """Which todos a bulk action takes: the todo list's filters, and `since` (created at or after)."""
    endpoint: EndpointId | None = None
    queue: QueueName | None = None
    state: StateList | None = None
    subject: SubjectKey | None = None
    q: TitleSearch | None = None
    since: datetime | None = None

    @model_validator(mode="after")
    def _states(self) -> Self:
        listed_states(self.state)
        if self.since is not None:
            _check_representable(self.since, "since")
        return self

    @property
    def states(self) -> tuple[str, ...] | None:
        return listed_states(self.state)


BULK_ACTIONS = ("retry", "cancel", "reroute", "defer", "discard", "approve")


class BulkAction(Body):
    """One human action on many todos: `ids`, or every todo a `filter` matches (at most BULK_MAX a call). A dry
    run (the default) changes nothing and says what would happen. `reason` is the cancel or defer reason (the
    note of the others), `queue` the reroute's target, `until` when a deferral ends."""
    action: Literal[BULK_ACTIONS]  # type: ignore[valid-type]
    ids: Annotated[list[TodoId], Field(min_length=1, max_length=BULK_MAX)] | None = None
    filter: TodoFilter | None = None
    reason: ShortText | None = None
    queue: QueueName | None = None
    until: datetime | None = None
    dry_run: bool = True

    @model_validator(mode="after")
    def _fits_action(self) -> Self:
        if (self.ids is None) == (self.filter is None):
            raise ValueError("give ids or filter (one of them)")
        if self.action in ("cancel", "defer") and self.reason is None:
            raise ValueError(f"reason: {self.action} needs a reason")
        if (self.action == "reroute") != (self.queue is not None):
            raise ValueError("queue: the reroute's target queue, given with reroute only")
        if self.until is not None:
            if self.action != "defer":
                raise ValueError("until: given with defer only")
            _check_representable(self.until, "until")
        return self


DURATION = r"^([0-9]{1,6}[dhms]){1,4}$"
_DURATION_UNITS = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1000}


def duration_ms(text: str) -> int:
    """`1h30m` as milliseconds."""
    return sum(int(amount) * _DURATION_UNITS[unit] for amount, unit in re.findall(r"([0-9]+)([dhms])", text))


def _check_representable(moment: datetime, name: str) -> None:
    try:
        iso(to_ms(moment))
    except (OverflowError, ValueError):
        raise ValueError(f"{name} is outside the years 1..9999 in UTC") from None


QueueReason = Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=ONE_LINE)]


_MOMENT = TypeAdapter(datetime)
PauseUntil = Annotated[str, StringConstraints(min_length=1, max_length=64), Field(
    description="an ISO-8601 time (`2026-05-01T18:00:00Z`), or a duration from now: a number and d, h, m or s,"
                " up to four of them (`90m`, `2h`, `1d12h`)")]


class QueuePause(Body):
    """Pause one queue of one endpoint: claims skip it and it rings no one, until `until` (a moment, or a duration
    from now) or until resumed."""
    until: PauseUntil | None = None
    reason: QueueReason | None = None

    @model_validator(mode="after")
    def _until(self) -> Self:
        if self.until is not None and not re.match(DURATION, self.until):
            try:
                moment = _MOMENT.validate_python(self.until)
            except ValidationError:
                raise ValueError("until: give an ISO-8601 time (2026-05-01T18:00:00Z) or a duration (90m, 2h,"
                                 " 1d12h)") from None
            _check_representable(moment, "until")
        return self

    def until_ms(self, now: int) -> int | None:
        """The moment the pause ends (ms), or None."""
        if self.until is None:
            return None
        if re.match(DURATION, self.until):
            # Up to four terms of 999999d each reach past the year 9999 from any day: refused by the field's name.
            until = now + duration_ms(self.until)
            try:
                iso(until)
            except (OverflowError, ValueError):
                raise ApiError("invalid_argument", f"until: {self.until} from now is past the year 9999 in UTC"
                                                   ) from None
            return until
        return to_ms(_MOMENT.validate_python(self.until))


class QueueResume(Body):
    """Resume a paused queue (no fields)."""


class ClaimWindow(Body):
    count: Annotated[int, Field(ge=0, le=1_000_000)]
    window_seconds: Annotated[int, Field(ge=1, le=31 * 86_400)]


WAIT_LIMIT_MAX_SECONDS = 365 * 86_400  # a year: longer than any holiday, short of the year 9999
WAIT_STATES = ("pending", "needs_input", "review", "blocked")


class WaitLimit(Body):
    """How long a todo may sit in one state of the queue, and what then happens to it (`queue`: reroute's target)."""
    after_seconds: Annotated[int, Field(ge=1, le=WAIT_LIMIT_MAX_SECONDS)]
    then: Literal["remind", "cancel", "defer", "reroute"]
    queue: QueueName | None = None


class WaitLimits(Body):
    """A queue's wait limits by state: a state left out keeps its limit, null clears it."""
    pending: WaitLimit | None = None
    needs_input: WaitLimit | None = None
    review: WaitLimit | None = None
    blocked: WaitLimit | None = None


class KeyLimit(Body):
    """At most `max` claimed todos of the queue share a subject key (`subject`) or a repository (`repo`)."""
    key: Literal["subject", "repo"]
    max: Annotated[int, Field(ge=1, le=100_000)]


class QueueLimits(Body):
    """Admission caps of one queue: at most `max_in_flight` claimed at once, at most `count` claims in each window
    of `window_seconds`, at most `max_in_flight_per_key.max` claimed per subject key or repository. A field left
    out keeps its cap; null clears it; 0 admits no claim (paused)."""
    max_in_flight: Annotated[int, Field(ge=0, le=100_000)] | None = None
    max_claims_per_window: ClaimWindow | None = None
    wait_limits: WaitLimits | None = None
    max_in_flight_per_key: KeyLimit | None = None


PrintableSecret = Annotated[str, StringConstraints(min_length=16, max_length=512, pattern=r"^[\x20-\x7e]+$")]


def _actor_name(value: str) -> str:
    if not 1 <= len(value.encode("utf-8", "surrogatepass")) <= 128:
        raise ValueError("a trusted actor is 1 to 128 bytes")
    return value


ActorName = Annotated[str, StringConstraints(pattern=ONE_LINE), AfterValidator(_actor_name)]


class TrustLogins(Body):
    """github, gitea: trusted logins, checked against the sender, the author, or both."""
    logins: Annotated[list[ActorName], Field(max_length=256)]
    match: Literal["sender", "author", "both"] = "sender"


class TrustActorIds(Body):
    """cairn: trusted actor ids."""
    actor_ids: Annotated[list[ActorName], Field(max_length=256)]


class TrustAll(Body):
    """Every actor: the gate lets everything through to the rules."""
    allow_all: Literal[True]


class TrustedActors(RootModel[TrustLogins | TrustActorIds | TrustAll]):
    """The trust gate's list for one webhook: one of the three shapes."""


class TrustedActorsArgs(Body):
    """The MCP tool's arguments (a tool's input is an object): the list under `trusted_actors`."""
    trusted_actors: TrustLogins | TrustActorIds | TrustAll


# A webhook's name, for the human telling two of the same provider and queue apart ("github → hold" twice).
WebhookName = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=ONE_LINE)]


class WebhookCreate(Body):
    provider: Literal[PROVIDERS]
    queue: QueueName
    secret: PrintableSecret | None = None
    endpoint_id: EndpointId | None = None
    trusted_actors: TrustLogins | TrustActorIds | TrustAll | None = None
    name: WebhookName | None = None


class WebhookUpdate(Body):
    """What a webhook's human may change in place: its name (null clears it)."""
    name: WebhookName | None


class WebhookSecret(Body):
    secret: PrintableSecret


class RouteAdd(Body):
    endpoint_id: EndpointId


class FriendRequest(Body):
    human: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=ONE_LINE)]


class QueueAction(Body):
    queue: QueueName
    endpoints: Annotated[list[EndpointId], Field(min_length=1, max_length=64)] | None = None
    exclusive: bool = False
    once: bool = False
    work_order: bool = False


class DropAction(Body):
    drop: Literal[True]


class QuarantineAction(Body):
    quarantine: Literal[True]


def _action_kind(value: Any) -> str:
    if isinstance(value, dict):
        return "drop" if "drop" in value else "quarantine" if "quarantine" in value else "queue"
    return "drop" if isinstance(value, DropAction) else "quarantine" if isinstance(value, QuarantineAction) else "queue"


RuleAction = Annotated[Annotated[QueueAction, Tag("queue")] | Annotated[DropAction, Tag("drop")]
                       | Annotated[QuarantineAction, Tag("quarantine")], Discriminator(_action_kind)]


class Rule(Body):
    id: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    name: Label | None = None
    expr: str
    action: RuleAction


class RuleSet(Body):
    """A webhook's routing: `set` replaces rules and default, and params only when the field is present."""
    rules: list[Rule] = []
    default_action: RuleAction | None = None
    params: dict[str, Any] | None = None


class RulesTest(Body):
    """A dry run: a payload (with headers) or a stored event, optionally against candidate rules."""
    payload: Any = None
    headers: dict[str, Annotated[str, StringConstraints(max_length=8192, pattern=ONE_LINE)]] | None = None
    event_id: Annotated[str, StringConstraints(pattern=r"^ev_[0-9a-f]{1,64}$")] | None = None
    rules: list[Rule] | None = None
    default_action: RuleAction | None = None
    params: dict[str, Any] | None = None
    verified: bool | None = None

    @model_validator(mode="after")
    def _one_document(self) -> Self:
        if (self.event_id is None) == ("payload" not in self.model_fields_set):
            raise ValueError("give payload (with optional headers) or event_id")
        return self


class ReleaseQuarantine(Body):
    """`queue` sends the held delivery there; `trust_actor` first adds its actor to the webhook's trusted
    actors (for deliveries held by the trust gate)."""
    queue: QueueName | None = None
    note: Note | None = None
    trust_actor: bool = False


HttpUrl = Annotated[str, StringConstraints(max_length=2048, pattern=r"^https?://[^\s/?#]+[^\s]*$")]


class NotifyCreate(Body):
    """A notification channel: where (`url`), with what credential (`token`: ntfy access token, Gotify app
    token), and for which events."""
    kind: Literal[NOTIFY_KINDS]
    url: HttpUrl
    token: Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=ONE_LINE)] | None = None
    events: Annotated[list[Literal[NOTIFY_EVENTS]], Field(min_length=1, max_length=len(NOTIFY_EVENTS))]

    @model_validator(mode="after")
    def _token_fits_kind(self) -> Self:
        try:
            parts = urllib.parse.urlsplit(self.url)
            parts.port  # noqa: B018 - raises on a port that is not a number or out of range
        except ValueError:
            raise ValueError("url: not a valid http(s) URL") from None
        if not parts.hostname:
            raise ValueError("url: names no host")
        if self.kind == "gotify" and self.token is None:
            raise ValueError("a gotify channel needs its app token")
        if self.kind in ("slack", "discord", "webhook") and self.token is not None:
            raise ValueError(f"a {self.kind} channel takes no token (its URL is the credential, or the secret is"
                             " made for you)")
        if self.kind == "ntfy" and self.token is not None and (parts.username is not None or parts.password is not None):
            raise ValueError("an ntfy URL with a user and password takes no token (the one would replace the other):"
                             " give one or the other")
        return self


# -- forge connections and their use by webhooks --------------------------------------------------------------

ConnectionId = Annotated[str, StringConstraints(pattern=r"^fc_[0-9a-f]{1,64}$")]
# An owner (`acme/`) or a repository (`acme/site`) a connection may write to.
RepoScope = Annotated[str, StringConstraints(max_length=200, pattern=r"^[A-Za-z0-9_.-]+/([A-Za-z0-9_.-]+)?$")]
LabelGlob = Annotated[str, StringConstraints(min_length=1, max_length=100, pattern=ONE_LINE)]


class ConnectionCreate(Body):
    """A forge connection: the forge's API (`https://api.github.com`, `https://gitea.lab/api/v1`), a token for it
    (write-only), and the owners or repositories it may write to."""
    kind: Literal["github", "gitea"]
    api_url: HttpUrl
    token: Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=r"^[\x21-\x7e]+$")]
    repos: Annotated[list[RepoScope], Field(min_length=1, max_length=64)]

    @model_validator(mode="after")
    def _url(self) -> Self:
        try:
            parts = urllib.parse.urlsplit(self.api_url)
            parts.port  # noqa: B018 - raises on a port that is not a number or out of range
        except ValueError:
            raise ValueError("api_url: not a valid http(s) URL") from None
        if not parts.hostname or parts.username is not None or parts.password is not None:
            raise ValueError("api_url: names no host, or carries a user and password (the token is the credential)")
        if parts.query or parts.fragment:
            raise ValueError("api_url: the API's base URL takes no query or fragment")
        return self


class LabelPolicy(Body):
    """Labels a worker may add (or remove): each must match one of `allow` (globs: `size/*`), at most `max` labels
    per todo."""
    allow: Annotated[list[LabelGlob], Field(min_length=1, max_length=64)]
    max: Annotated[int, Field(ge=1, le=100)]


class CommentPolicy(Body):
    """Comments a worker may post: at most `max` per todo, each at most `max_bytes` of UTF-8."""
    max: Annotated[int, Field(ge=1, le=100)]
    max_bytes: Annotated[int, Field(ge=1, le=MAX_COMMENT_BYTES)]


class OutputPolicy(Body):
    """Which outputs a webhook's workers may ask for; a kind left out is not allowed."""
    add_labels: LabelPolicy | None = None
    remove_labels: LabelPolicy | None = None
    comment: CommentPolicy | None = None


DEFAULT_OUTPUT_POLICY = {"add_labels": {"allow": ["size/*"], "max": 3}, "comment": {"max": 3, "max_bytes": 8192}}


# A forge login as GitHub and Gitea spell them (letters, digits, '-', '.', '_'; at most 100).
ForgeLogin = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")]


class ForgeCommands(Body):
    """Who may steer the work from the forge's issue (commands in comments, closing, merging the pull request),
    and what a commander's close does. Nobody until the human names them."""
    logins: Annotated[list[ForgeLogin], Field(max_length=64)] = []
    on_close: Literal["cancel", "keep"] = "cancel"


class WebhookConnect(Body):
    """The connection a webhook writes through, whether it keeps a status comment on each issue, its policy
    (omitted: DEFAULT_OUTPUT_POLICY) and its commanders (omitted: nobody)."""
    connection_id: ConnectionId
    mirror: bool = False
    policy: OutputPolicy | None = None
    commands: ForgeCommands | None = None


class SubjectListQuery(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    q: Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=ONE_LINE)] | None = None
    state: Literal["open", "waiting", "done"] | None = None
    provider: Literal[PROVIDERS] | None = None
    limit: Annotated[int, Field(ge=1, le=200)] = 50
    cursor: Annotated[str, StringConstraints(min_length=1, max_length=8192, pattern=r"^[A-Za-z0-9_-]+$")] | None = None


class ReplayOne(Body):
    dry_run: bool = False


class ReplayMany(Body):
    """Which stored deliveries to evaluate again; a dry run (the default) only reports what would change."""
    disposition: Literal["routed", "dropped", "repeat", "quarantined", "ping"] | None = None
    kind: Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=ONE_LINE)] | None = None
    since: datetime | None = None
    until: datetime | None = None
    limit: Annotated[int, Field(ge=1, le=1000)] = 200
    dry_run: bool = True


class DoorbellQuery(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    queue: QueueName | None = None


class EventListQuery(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    disposition: Literal["routed", "dropped", "repeat", "quarantined", "ping"] | None = None
    limit: Annotated[int, Field(ge=1, le=200)] = 50


# -- answers: what the API says back, documented in /api/v1/openapi.json and checked against real answers ----

class AnswerModel(BaseModel):
    """An answer's shape; extra fields are refused, so the document and the code cannot drift apart."""
    model_config = ConfigDict(extra="forbid", defer_build=True)


Instant = Annotated[str | None, Field(description="ISO-8601 UTC, milliseconds, e.g. 2026-11-30T21:12:36.488Z")]


class ErrorAnswer(AnswerModel):
    error: Literal["invalid_argument", "unauthenticated", "forbidden", "not_found", "conflict", "too_large",
                   "rate_limited", "unavailable", "internal"]
    message: str


class RingsAnswer(AnswerModel):
    count: int
    last_at: Instant
    acked_at: Instant


class AttemptAnswer(AnswerModel):
    seq: int
    claimant: str
    claimed_at: Instant
    lease_expires_at: Instant
    heartbeats: int
    ended_at: Instant
    outcome: str | None
    summary: str | None
    artifact: str | None


class HistoryAnswer(AnswerModel):
    at: Instant
    actor: str
    from_: str | None = Field(alias="from")
    to: str
    evidence: Any


class OutputAnswer(AnswerModel):
    """A forge output: what it asks for, and how its send went (`error` is the forge's or the network's last
    word: a pending output is being retried)."""
    id: str
    todo_id: str
    type: Literal["add_labels", "remove_labels", "comment"]
    labels: list[str] | None = None
    body: str | None = None
    target: str
    state: Literal["pending", "sent", "failed"]
    error: str | None
    attempts: int
    created_at: Instant
    sent_at: Instant


class OutputsAnswer(AnswerModel):
    outputs: list[OutputAnswer]


class TodoFields(AnswerModel):
    """What every answer about a todo says of it, without its documents (payload, work_order, work_item, trace,
    result)."""
    id: str
    endpoint_id: str
    queue: str
    state: Literal[TODO_STATES]
    outcome: Literal["completed", "approved", "absorbed", "discarded"] | None
    title: str
    source: str
    kind: str | None
    subject_key: str | None
    priority: int
    attempt: int
    max_attempts: int
    dead_letter: bool
    lease_expires_at: Instant
    available_at: Instant
    created_at: Instant
    updated_at: Instant
    last_error: str | None
    key: str | None
    state_reason: str | None
    answer: str | None
    deferred_until: Instant
    event_id: str | None
    rings: RingsAnswer


class TodoAnswer(TodoFields):
    """A todo. `get_todo` adds attempts, history, depends_on, receipt and outputs; an operator push adds created;
    a report with outputs adds the outputs it made."""
    payload: Any
    work_order: dict | None
    work_item: dict | None
    trace: dict | None
    result: Any
    created: bool | None = None
    attempts: list[AttemptAnswer] | None = None
    history: list[HistoryAnswer] | None = None
    depends_on: list[str] | None = None
    receipt: dict | None = None
    outputs: list[OutputAnswer] | None = None


class TodoListAnswer(AnswerModel):
    """A page, newest first; `next_cursor` (null on the last page) is the next page's `cursor`. A page searched by
    title may hold fewer than `limit` todos and still name a next page: each page reads a bounded stretch."""
    todos: list[TodoAnswer]
    next_cursor: str | None


class AdmissionAnswer(AnswerModel):
    """Why a queue the claim named admitted nothing: paused (until its `until`, null: until resumed), at its
    max_in_flight (until a claim ends: null), its claims per window (until the window turns), or its
    max_in_flight_per_key (every claimable todo's subject key or repository is at its cap: until a claim ends)."""
    queue: str
    reason: Literal["paused", "max_in_flight", "max_claims_per_window", "max_in_flight_per_key"]
    until: Instant


class ClaimAnswer(AnswerModel):
    """A claim: the todo, its lease token (send it with every later verb), and what earlier attempts said; or
    `{"empty": true}` when nothing was claimable, with `admission` naming the queues a pause or a cap kept shut.
    A claim with `max_todos` above 1 that took any answers `claims`: one such answer per todo, each its own
    attempt and lease token."""
    todo: TodoAnswer | None = None
    lease_token: str | None = None
    prior_attempts: list[AttemptAnswer] | None = None
    # The attempt's `process` span as a W3C traceparent (its todo's trace): a job that traces itself joins it.
    traceparent: str | None = None
    empty: bool | None = None
    admission: list[AdmissionAnswer] | None = None
    claims: list["ClaimAnswer"] | None = None


class CompleteAnswer(TodoAnswer):
    """The completed todo; with `claim_next` asked, `next` is that claim's answer (`{"empty": true}` when nothing
    was claimable)."""
    next: ClaimAnswer | None = None


class PauseAnswer(AnswerModel):
    until: Instant
    reason: str | None
    by: str
    at: Instant


class WindowAnswer(AnswerModel):
    count: int
    window_seconds: int


class WaitLimitAnswer(AnswerModel):
    after_seconds: int
    then: str
    queue: str | None


class WaitLimitsAnswer(AnswerModel):
    pending: WaitLimitAnswer | None
    needs_input: WaitLimitAnswer | None
    review: WaitLimitAnswer | None
    blocked: WaitLimitAnswer | None


class KeyLimitAnswer(AnswerModel):
    key: Literal["subject", "repo"]
    max: int


class LimitsAnswer(AnswerModel):
    max_in_flight: int | None
    max_claims_per_window: WindowAnswer | None
    max_in_flight_per_key: KeyLimitAnswer | None
    wait_limits: WaitLimitsAnswer


class QueueAnswer(AnswerModel):
    """One queue of one endpoint: its pause, its caps and how full they are (`claims_in_window`: null without a
    window cap; `window_ends_at`: when the current window turns), and how much waits."""
    queue: str
    paused: PauseAnswer | None
    limits: LimitsAnswer
    in_flight: int
    claims_in_window: int | None
    window_ends_at: Instant
    pending: int


class QueueListAnswer(AnswerModel):
    queues: list[QueueAnswer]


class BulkAnswer(AnswerModel):
    """What a bulk action did (or, in a dry run, would do): `matched` todos, `acted` on, `skipped` by the state
    that did not allow the action (`not_found` for an id the caller cannot see); `truncated` when the filter
    matched more than the cap (this call took the newest)."""
    dry_run: bool
    action: str
    matched: int
    acted: int
    skipped: dict[str, int]
    truncated: bool


class MintedTodo(AnswerModel):
    id: str
    endpoint_id: str
    queue: str
    created: bool


class DeliveryAnswer(AnswerModel):
    """What a producer hears back (202)."""
    event_id: str
    disposition: Literal["routed", "dropped", "repeat", "quarantined", "ping"]
    verified: bool
    todos: list[MintedTodo]
    created: int
    duplicate: bool | None = None
    repeat: bool | None = None
    dropped: bool | None = None
    held: bool | None = None
    ping: bool | None = None
    payload_error: Literal["empty", "not_json", "too_deep", "bad_form", "form_without_payload"] | None = None


class SubjectLine(AnswerModel):
    key: str
    title: str | None
    url: str | None
    provider: str | None
    repo: str | None
    number: int | None
    state: Literal["open", "waiting", "done"]
    last_activity_at: Instant
    open_todos: int
    queues: list[str]


class SubjectListAnswer(AnswerModel):
    subjects: list[SubjectLine]
    next_cursor: str | None


class TimelineEntry(BaseModel):
    """One step of a subject's story: `type` is delivery (event_id, kind, action, sender, disposition, rule_id),
    transition (todo_id, from, to, actor), output (output_id, todo_id, output_type, state), receipt, or link (key,
    kind: a pull request that closes this issue, or the issue this pull request closes). A forge command's delivery
    has `command` (verb, todo_ids, result) and `reaction` (content, state: its acknowledgement on the comment)."""
    model_config = ConfigDict(extra="allow", defer_build=True)
    at: Instant
    type: Literal["delivery", "transition", "output", "receipt", "link"]


class SubjectLink(AnswerModel):
    """`closes`: this pull request says it closes the issue `key`; `closed_by`: the pull request `key` says it
    closes this issue."""
    key: str
    kind: Literal["closes", "closed_by"]
    at: Instant


class SubjectTodo(TodoFields):
    """A todo as a subject names it: a list's fields but its documents; `link` fetches it whole."""
    link: str = Field(description="/api/v1/todos/{id}: the todo whole")


class SubjectAnswer(AnswerModel):
    key: str
    title: str | None
    url: str | None
    provider: str | None
    repo: str | None
    number: int | None
    labels: list[str]
    state: Literal["open", "waiting", "done"]
    todos: list[SubjectTodo]
    links: list[SubjectLink]
    timeline: list[TimelineEntry]


class WebhookConnectionAnswer(AnswerModel):
    webhook_id: str
    connection_id: str
    kind: Literal["github", "gitea"]
    login: str
    mirror: bool
    policy: dict
    commands: dict
    connected_at: Instant


class ConnectionAnswer(AnswerModel):
    """A forge connection; its token is never shown."""
    id: str
    kind: Literal["github", "gitea"]
    api_url: str
    login: str
    repos: list[str]
    created_at: Instant
    last_used_at: Instant
    last_error: str | None = None
    webhooks: list[str] | None = None
    removed: bool | None = None


class ScheduleAnswer(AnswerModel):
    """A schedule: `next_run_at` the next due time (null while disabled), `last_run_at` the due time of the last
    todo it made, `last_todo_id` that todo. A DELETE's answer adds `removed`."""
    id: str
    endpoint_id: str
    name: str
    queue: str
    title: str
    cron: str | None
    every_seconds: int | None
    timezone: str
    catch_up: Literal[SCHEDULE_CATCH_UP]
    enabled: bool
    next_run_at: Instant
    last_run_at: Instant
    last_todo_id: str | None
    created_at: Instant
    removed: bool | None = None


class ScheduleListAnswer(AnswerModel):
    schedules: list[ScheduleAnswer]


class ConnectionListAnswer(AnswerModel):
    connections: list[ConnectionAnswer]


class ConnectionTestAnswer(AnswerModel):
    id: str
    ok: bool
    login: str | None
    error: str | None


def build_validators() -> None:
    """Build every model's validator now, before a server's threads use them: pydantic's build on first use is not
    thread-safe (two threads may meet one half-built). A one-shot command keeps the lazy start."""
    for value in list(globals().values()):
        if isinstance(value, type) and issubclass(value, BaseModel) and value.__module__ == __name__ \
                and not value.__pydantic_complete__:
            value.model_rebuild()


def parse_model(model: type[BaseModel], raw: bytes | str | dict) -> Any:
    """Validate a body against its model; any failure is one-line 400 invalid_argument naming every wrong field,
    unknown fields first (they are the likelier typo), whichever order pydantic reports them in."""
    try:
        if isinstance(raw, dict):
            return model.model_validate(raw)
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        errors = exc.errors()
        unknown = [e for e in errors if e.get("type") == "extra_forbidden" and len(e.get("loc", ())) == 1]
        problems = [f"unknown field {e['loc'][0]}{_did_you_mean(str(e['loc'][0]), model)}" for e in unknown]
        for error in errors:
            if error not in unknown:
                where = ".".join(str(part) for part in error.get("loc", ())) or "body"
                problems.append(f"{where}: {error.get('msg', 'invalid').removeprefix('Value error, ')}")
        raise ApiError("invalid_argument", "; ".join(problems[:PARSE_PROBLEMS_SHOWN])) from None


def _did_you_mean(name: str, model: type[BaseModel]) -> str:
    """`, did you mean endpoint_id?` when a field of the model is close to the unknown one, else the fields."""
    fields = [info.alias or field_name for field_name, info in model.model_fields.items()]
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6) or [f for f in fields if f.startswith(name)]
    if close:
        return f", did you mean {close[0]}?"
    return f" (the fields are {', '.join(fields)})" if fields else ""
