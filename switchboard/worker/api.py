"""The worker's side of the REST API: the calls it makes with its endpoint token, how it tells an answer worth
trying again from a refusal, and the pauses between tries. Also what every HTTP answer the worker reads goes
through (the server's, the model's, the forge's): a cap on its size after decompression, read a chunk at a time
so that memory stays flat whatever is sent, strict JSON, and no proxy for a loopback address."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import math
import random
import socket
import zlib
from urllib.parse import urlsplit

import httpx

RETRY_FIRST_SECONDS = 0.5  # pauses between tries while the server cannot be reached ...
RETRY_LONGEST_SECONDS = 30.0  # ... doubling up to this
SERVER_ANSWER_BYTES = 32 << 20  # a claim carries a delivery's payload (the server takes up to 5 MiB) as JSON
SERVER_CALL_SECONDS = 10.0  # a call other than a waiting claim, answer read whole, or it is tried again


class Unanswered(Exception):
    """The server could not be reached, was busy (429, 5xx) or gave no readable answer: worth trying again."""


class OddAnswer(Unanswered):
    """The server answered, but not as the API does (not JSON, not an object, a redirect, too large, fields
    missing or of the wrong kind): logged each time, and tried again like an outage."""


class Refused(Exception):
    """The server answered with an error: trying again would get the same answer."""

    def __init__(self, status: int, body: dict):
        self.status = status
        self.message = str(body.get("message") or body.get("error") or "")
        super().__init__(f"{status} {body.get('error', '')}: {self.message}")


class AnswerTooLarge(Exception):
    """An answer grew past its cap as it was read (after decompression)."""


class UnreadableAnswer(Exception):
    """An answer that is not what it claims to be: a garbled or unknown compression, or not JSON."""


def describe_size(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 and not size % (1 << 20) else f"{size >> 10} KiB"


async def read_capped(answer: httpx.Response, cap: int) -> bytes:
    """The body of a streamed answer, decompressed by us a bounded piece at a time (httpx's decoders inflate a
    whole chunk at once: 64 KiB of gzip can become 64 MiB): AnswerTooLarge past `cap` bytes, UnreadableAnswer for
    a compression that is garbled or not gzip/deflate."""
    encoding = answer.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        decoder = None
    elif encoding in ("gzip", "x-gzip"):
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
    elif encoding == "deflate":
        decoder = zlib.decompressobj()
    else:
        raise UnreadableAnswer(f"an answer in the {encoding[:40]!r} encoding")
    body = bytearray()
    try:
        async for chunk in answer.aiter_raw():
            if decoder is None:
                body += chunk
            else:
                while chunk and len(body) <= cap:
                    body += decoder.decompress(chunk, cap + 1 - len(body))
                    chunk = decoder.unconsumed_tail
            if len(body) > cap:
                raise AnswerTooLarge(f"an answer over {describe_size(cap)}")
        if decoder is not None:
            body += decoder.flush(cap + 1 - len(body))
    except zlib.error as exc:
        raise UnreadableAnswer(f"a garbled {encoding} answer ({exc})") from None
    if len(body) > cap:
        raise AnswerTooLarge(f"an answer over {describe_size(cap)}")
    return bytes(body)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("a number out of range")
    return value


def parse_json(data: bytes | str) -> object:
    """Strict JSON (no NaN or Infinity, no number out of range): ValueError otherwise, also for nesting too deep
    for the parser (which raises RecursionError)."""
    try:
        return json.loads(data, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("nested too deep") from None


@functools.lru_cache(maxsize=64)
def is_loopback(url: str) -> bool:
    """Whether the URL's host is this machine (127.0.0.0/8, ::1, localhost, or a name that resolves only there):
    such a request never goes through a proxy from HTTP_PROXY or ALL_PROXY, which would see its credential.
    Remembered per URL: ask at start-up (a name may need a DNS lookup), not in the event loop."""
    host = urlsplit(url).hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return bool(found) and all(ipaddress.ip_address(entry[4][0].split("%")[0]).is_loopback for entry in found)


def http_client(url: str, **options) -> httpx.AsyncClient:
    """An httpx client for the API at `url`: environment proxies only for a host that is not this machine."""
    return httpx.AsyncClient(trust_env=not is_loopback(url), follow_redirects=False, **options)


class ServerApi:
    """The REST calls the worker makes, with the endpoint token (only ever in the Authorization header)."""

    def __init__(self, server: str, token: str, connections: int):
        self.http = http_client(server, base_url=f"{server}/api/v1", headers={"Authorization": f"Bearer {token}"},
                                timeout=SERVER_CALL_SECONDS,
                                limits=httpx.Limits(max_connections=connections,
                                                    max_keepalive_connections=connections))

    async def post(self, path: str, body: dict, timeout: float = SERVER_CALL_SECONDS) -> dict:
        """POST and read the whole answer within `timeout` seconds: a JSON object, or Unanswered (unreachable,
        busy, too slow, too large, not JSON, not an object, a redirect) or Refused (a 4xx)."""
        try:
            request = json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
        except (ValueError, RecursionError) as exc:  # a result nested too deep, say: the same on every try
            raise Refused(400, {"error": "invalid_argument", "message": f"the request is not JSON: {exc}"}) from None
        try:
            async with asyncio.timeout(timeout):  # the whole call: httpx's timeouts are per read
                async with self.http.stream("POST", path, content=request, timeout=timeout,
                                            headers={"Content-Type": "application/json"}) as answer:
                    raw = await read_capped(answer, SERVER_ANSWER_BYTES)
        except TimeoutError:
            raise Unanswered(f"no whole answer within {timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise Unanswered(f"{type(exc).__name__}: {str(exc)[:200]}") from None
        except (AnswerTooLarge, UnreadableAnswer) as exc:
            raise OddAnswer(f"{path}: {exc}") from None
        try:
            content = parse_json(raw)
        except ValueError as exc:
            content = exc
        status = answer.status_code
        error = content.get("error", "") if isinstance(content, dict) else ""
        if status == 429 or status >= 500:
            raise Unanswered(f"{status} {str(error)[:100]}")
        if 400 <= status < 500:  # a refusal, even one whose body is not the API's (a proxy's page)
            raise Refused(status, content if isinstance(content, dict) else {})
        if isinstance(content, ValueError):
            raise OddAnswer(f"{path}: an answer that is not JSON ({str(content)[:200]})")
        if status != 200 and status != 201:
            raise OddAnswer(f"{path}: an unexpected {status} answer")
        if not isinstance(content, dict):
            raise OddAnswer(f"{path}: an answer that is a JSON {type(content).__name__}, not an object")
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
