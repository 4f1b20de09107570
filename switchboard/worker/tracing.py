"""The worker's own spans (SPEC 17). A worker is a client like any third party's, so it traces the way any job
would: through the OpenTelemetry SDK's ordinary tracer, under the claim's `traceparent` (the attempt's `process`
span). Only with the `otel` extra installed and an OTLP endpoint set (OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; the other OTEL_* variables as the SDK reads them); otherwise nothing of the SDK
is imported and `span` is an empty context. The provider flushes what it holds when the process exits."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from collections.abc import Iterator

log = logging.getLogger("switchboard.worker")

# A W3C traceparent of version 00 (the server's answer is checked before it is used anywhere).
TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
DEFAULT_SERVICE = "switchboard-worker"


def valid_traceparent(text: object) -> str | None:
    return text if isinstance(text, str) and TRACEPARENT.fullmatch(text) else None


@functools.cache
def _tracer():
    """The SDK's tracer exporting over OTLP/HTTP, made once; None without an endpoint or the extra."""
    if not (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("an OTLP endpoint is set but the `otel` extra is not installed: this worker exports no spans")
        return None
    provider = TracerProvider(resource=Resource.create(
        {SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider.get_tracer("switchboard.worker")


@contextlib.contextmanager
def span(name: str, traceparent: str | None, attributes: dict) -> Iterator[None]:
    """A CLIENT span named `name` under `traceparent` for the block (nothing when it cannot be exported)."""
    tracer = _tracer() if valid_traceparent(traceparent) else None
    if tracer is None:
        yield
        return
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    with tracer.start_as_current_span(name, context=parent, kind=SpanKind.CLIENT, attributes=attributes):
        yield
