"""Traces (SPEC 17): the span records Switchboard keeps, exported over OTLP/HTTP when the `otel` extra is installed
and an endpoint is set, and nothing at all otherwise.

Ids are always minted (W3C trace and span ids from `secrets`, below) and kept in the store: a todo's
`traceparent` is its `send` span, an attempt's `span_id` its `process` span, so the trace holds together across
processes and restarts whether anybody collects it or not. What is exported is built from records, plain dicts
of ids, times (ms) and strings (switchboard.store.transitions.span_record), written by the layer that knows the
outcome and handed over only after the transaction committed (Txn.spans, Database.on_spans), so a rolled-back
transaction exports nothing.

The records become spans as the SDK's own ReadableSpan, each with the ids the store holds and its real start and
end, given straight to the BatchSpanProcessor. Not through a Tracer: a Tracer mints its own ids and clocks a
span from `start_span` to `end` in one process, while an attempt's `process` span starts at a claim in one request
and ends at the complete (or at lease expiry) in another, perhaps in another process; a custom IdGenerator would
need its ids smuggled in through shared state per call. A finished ReadableSpan is what a processor receives
anyway, so the exporter sees exactly what a Tracer would have given it, with our ids.

Without the extra or without `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) nothing
of the SDK is imported, no exporter or thread starts, no record is built (Txn.spans stays None), and the hot paths
pay for two random ids per todo and one per claim."""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping

from switchboard.configuration import log

EXTRA = "otel"
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
DEFAULT_SERVICE = "switchboard"


def new_trace_id() -> str:
    """A W3C trace id: 16 random bytes as 32 hex digits (all zeros is invalid, and 2**-128 likely)."""
    return secrets.token_hex(16)


def new_span_id() -> str:
    """A W3C span (parent) id: 8 random bytes as 16 hex digits."""
    return secrets.token_hex(8)


def traceparent(trace: str, span: str) -> str:
    """The W3C `traceparent` of a span: version 00, sampled (flag 01)."""
    return f"00-{trace}-{span}-01"


def parse_traceparent(text: str | None) -> tuple[str, str] | None:
    """(trace id, span id) of a version-00 `traceparent`, or None when it is not one (anything a producer sent)."""
    parts = text.strip().split("-") if isinstance(text, str) else []
    if (len(parts) != 4 or parts[0] != "00" or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2
            or not all(c in "0123456789abcdef" for c in "".join(parts))
            or parts[1] == "0" * 32 or parts[2] == "0" * 16):
        return None
    return parts[1], parts[2]


class ExtraMissing(Exception):
    """The OpenTelemetry SDK or its OTLP/HTTP exporter is not installed."""

    def __init__(self, missing: str):
        super().__init__(f"traces need the `{EXTRA}` extra ({missing} is not installed): pip install"
                         f" 'switchboard-hooks[{EXTRA}]'")


def endpoint_set(env: Mapping[str, str]) -> bool:
    return any(env.get(name) for name in ENDPOINT_VARIABLES)


class Tracing:
    """The process's span exporter: records in, OTLP/HTTP out (batched, on the SDK's own thread)."""

    def __init__(self, processor, resource, scope):  # the SDK's types, imported only when the extra is there
        self.processor = processor
        self.resource = resource
        self.scope = scope

    def emit(self, records: list[dict]) -> None:
        """Hand finished spans to the batch processor (an enqueue; it exports them on its own thread). Never
        raises: a trace that cannot be exported costs the work nothing."""
        try:
            for record in records:
                self.processor.on_end(self._span(record))
        except Exception:  # noqa: BLE001 - tracing must never break the work it describes
            log.warning("spans not exported", exc_info=True)

    def _span(self, record: dict):
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags

        def context(trace_id: str, span_id: str, remote: bool = False) -> SpanContext:
            return SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=remote,
                               trace_flags=TraceFlags(TraceFlags.SAMPLED))

        parent = record["parent_id"]
        return ReadableSpan(
            record["name"], context(record["trace_id"], record["span_id"]),
            parent=context(record["trace_id"], parent) if parent else None, resource=self.resource,
            attributes=record["attributes"], kind=SpanKind[record["kind"].upper()],
            links=[Link(context(trace_id, span_id, True), attributes) for trace_id, span_id, attributes in
                   record["links"]],
            start_time=record["start_ms"] * 1_000_000, end_time=max(record["end_ms"], record["start_ms"]) * 1_000_000,
            instrumentation_scope=self.scope)

    def shutdown(self) -> None:
        """Export what is queued, then stop the thread."""
        self.processor.shutdown()


def start_tracing(env: Mapping[str, str] | None = None, *, required: bool = False) -> Tracing | None:
    """The exporter, when an OTLP endpoint is set and the extra is installed; else None. `required` (`serve
    --otel`): a missing extra raises ExtraMissing instead of being logged."""
    env = os.environ if env is None else env
    if not required and not endpoint_set(env):
        return None  # the SDK's import alone costs a server's start about 45 ms of CPU
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    except ImportError as missing:
        if required:
            raise ExtraMissing(missing.name or "opentelemetry") from None
        if endpoint_set(env):
            log.warning("an OTLP endpoint is set but the `%s` extra is not installed: no traces are exported", EXTRA)
        return None
    if not endpoint_set(env):
        if required:
            log.warning("--otel: no OTEL_EXPORTER_OTLP_ENDPOINT is set, so no traces are exported")
        return None
    # The standard OTEL_* variables configure the exporter (endpoint, headers, timeout, compression) and the
    # resource (OTEL_RESOURCE_ATTRIBUTES); the service is `switchboard` unless OTEL_SERVICE_NAME names another.
    resource = Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE})
    scope = InstrumentationScope("switchboard")
    return Tracing(BatchSpanProcessor(OTLPSpanExporter()), resource, scope)
