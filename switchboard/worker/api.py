"""The worker's side of the REST API: the calls it makes with its endpoint token, how it tells an answer worth
trying again from a refusal, and the pauses between tries."""

from __future__ import annotations

import random

import httpx

RETRY_FIRST_SECONDS = 0.5  # pauses between tries while the server cannot be reached ...
RETRY_LONGEST_SECONDS = 30.0  # ... doubling up to this


class Unanswered(Exception):
    """The server could not be reached, was busy (429, 5xx) or gave no readable answer: worth trying again."""


class Refused(Exception):
    """The server answered with an error: trying again would get the same answer."""

    def __init__(self, status: int, body: dict):
        self.status = status
        self.message = str(body.get("message") or body.get("error") or "")
        super().__init__(f"{status} {body.get('error', '')}: {self.message}")


class ServerApi:
    """The REST calls the worker makes, with the endpoint token (only ever in the Authorization header)."""

    def __init__(self, server: str, token: str, connections: int):
        self.http = httpx.AsyncClient(base_url=f"{server}/api/v1", headers={"Authorization": f"Bearer {token}"},
                                      timeout=10, limits=httpx.Limits(max_connections=connections,
                                                                      max_keepalive_connections=connections))

    async def post(self, path: str, body: dict, timeout: httpx.Timeout | float = 10) -> dict:
        try:
            answer = await self.http.post(path, json=body, timeout=timeout)
            content = answer.json()
        except (httpx.TransportError, ValueError) as exc:
            raise Unanswered(f"{type(exc).__name__}: {exc}") from None
        if answer.status_code == 429 or answer.status_code >= 500:
            raise Unanswered(f"{answer.status_code} {content.get('error', '') if isinstance(content, dict) else ''}")
        if answer.status_code >= 400:
            raise Refused(answer.status_code, content if isinstance(content, dict) else {})
        return content

    async def close(self) -> None:
        await self.http.aclose()


class Backoff:
    """Pauses between tries: RETRY_FIRST_SECONDS doubling to RETRY_LONGEST_SECONDS, each up to a quarter longer at
    random, so workers that lost the server together do not come back in step."""

    def __init__(self) -> None:
        self.pause = RETRY_FIRST_SECONDS

    def next(self) -> float:
        pause, self.pause = self.pause, min(self.pause * 2, RETRY_LONGEST_SECONDS)
        return pause * (1 + random.random() / 4)
