"""What every HTTP surface shares: JSON answers, error bodies, capped bodies and Server-Sent Events."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from switchboard.configuration import BODY_SECONDS, MAX_PAYLOAD_DEPTH, ApiError
from switchboard.limits import RateLimited
from switchboard.models import ClaimNext


class JsonResponse(JSONResponse):
    """JSON as Starlette writes it, except that a string holding a lone surrogate (which producer JSON may
    carry as an escape) is written escaped instead of failing to encode."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode()
        except RecursionError:
            return json.dumps(cut_to_depth(content), allow_nan=False, separators=(",", ":")).encode()


def cut_to_depth(value: Any, depth: int = 0) -> Any:
    """A value cut off below MAX_PAYLOAD_DEPTH levels, so no stored document can fail an answer."""
    if depth >= MAX_PAYLOAD_DEPTH:
        return "«nested too deep to show»"
    if isinstance(value, dict):
        return {k: cut_to_depth(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [cut_to_depth(v, depth + 1) for v in value]
    return value


def error_response(error: ApiError, headers: dict | None = None) -> JSONResponse:
    if isinstance(error, SlowBody):
        headers = {**(headers or {}), "Connection": "close"}
    if error.status == 429:
        # Every 429 says when to come back (a producer that retries then does, instead of at once).
        wait = error.retry_after if isinstance(error, RateLimited) else 1
        headers = {**(headers or {}), "Retry-After": str(wait)}
    return JsonResponse(error.body(), status_code=error.status, headers=headers)


class SlowBody(ApiError):
    """The body did not arrive within BODY_SECONDS: 408, and the connection is closed."""

    def __init__(self) -> None:
        super().__init__("invalid_argument", f"request body not received within {BODY_SECONDS:g} s")

    @property
    def status(self) -> int:
        return 408


class BodyBudget:
    """Bytes of request bodies held in memory at once, across requests: a flood of large, slow or never-ending
    bodies is refused (503, retry later) instead of pinning memory."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> None:
        if self.held + size > self.limit:
            raise ApiError("unavailable", "too many request bodies in flight; retry later")
        self.held += size

    def give_back(self, size: int) -> None:
        self.held -= size


async def read_capped(request: Request, cap: int, budget: BodyBudget | None = None) -> bytes:
    """Read a request body as a stream within BODY_SECONDS, refusing it as soon as it passes `cap` bytes or
    the shared `budget`."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > cap):
        raise ApiError("too_large" if declared.isdigit() else "invalid_argument",
                       f"request body is over {cap} bytes" if declared.isdigit() else "bad Content-Length")
    chunks, total = [], 0
    try:
        async with asyncio.timeout(BODY_SECONDS):
            async for chunk in request.stream():
                if budget is not None:
                    budget.take(len(chunk))
                total += len(chunk)
                chunks.append(chunk)
                if total > cap:
                    raise ApiError("too_large", f"request body is over {cap} bytes")
    except TimeoutError:
        raise SlowBody() from None
    finally:
        if budget is not None:
            budget.give_back(sum(len(c) for c in chunks))
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def gone_future(request: Request, body: ClaimNext) -> asyncio.Future | None:
    """For a claim that may wait: a future that resolves when the asker disconnects."""
    return asyncio.ensure_future(_disconnected(request)) if body.wait_seconds else None


async def ending_with(frames: AsyncIterator[str], ended: Callable[[], None]) -> AsyncIterator[str]:
    try:
        async for frame in frames:
            yield frame
    finally:
        ended()


def sse_response(frames: AsyncIterator[str], headers: dict | None = None) -> StreamingResponse:
    return StreamingResponse(frames, media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                              **(headers or {})})
