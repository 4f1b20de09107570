"""The worker's side of the REST API: the calls it makes with its endpoint token, how it tells an answer worth
trying again from a refusal, and the pauses between tries. Also what every HTTP answer the worker reads goes
through (the server's, the model's, the forge's): a cap on its size after decompression, read a chunk at a time
so that memory stays flat whatever is sent, strict JSON, and no proxy for a loopback address.

The calls to the server go over DirectHttp (HTTP/1.1 on kept-alive asyncio streams, TLS with httpx's own trust
settings) whenever no proxy can apply to the server's URL: a loopback server, or no proxy variable in the
environment. An httpx request costs the worker about 1.9 ms of CPU on this project's bench machine, the same call
on a kept-alive stream a fifth of that, and a job makes one or two. With a proxy variable set, httpx carries the
calls as before (its proxy rules, NO_PROXY, SOCKS)."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import math
import random
import socket
import ssl
import urllib.request
import zlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx

RETRY_FIRST_SECONDS = 0.5  # pauses between tries while the server cannot be reached ...
RETRY_LONGEST_SECONDS = 30.0  # ... doubling up to this
SERVER_ANSWER_BYTES = 32 << 20  # a claim carries a delivery's payload (the server takes up to 5 MiB) as JSON
SERVER_CALL_SECONDS = 10.0  # a call other than a waiting claim, answer read whole, or it is tried again
ANSWER_HEAD_BYTES = 64 << 10  # a server answer's status line and headers
BODY_PIECE_BYTES = 64 << 10  # a body is read (and inflated) this much at a time


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
    return await inflate_capped(answer.aiter_raw(), answer.headers.get("content-encoding", ""), cap)


async def inflate_capped(pieces: AsyncIterator[bytes], content_encoding: str, cap: int) -> bytes:
    """A body read from `pieces` in its Content-Encoding, as read_capped says."""
    encoding = content_encoding.strip().lower()
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
        async for chunk in pieces:
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


def proxy_may_apply(url: str) -> bool:
    """Whether httpx, trusting the environment, could send a request for `url` through a proxy: the URL is not
    this machine's and a proxy variable (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY, either case) is set."""
    return not is_loopback(url) and any(urllib.request.getproxies().get(scheme) for scheme in ("http", "https", "all"))


class BrokenAnswer(Exception):
    """The connection failed, or what came back is not HTTP/1.1."""


class Unheard(BrokenAnswer):
    """The connection ended before a byte of the answer came back."""


class DirectHttp:
    """POSTs to one origin over HTTP/1.1 on kept-alive connections of asyncio streams, for a server no proxy
    stands in front of. Answers are read as read_capped does (a cap after decompression, a piece at a time). A
    connection is kept for the next call when the answer was read whole and the server did not say `close`; one
    the server closed while it was idle is dropped, and a call that finds it closed before any answer came is
    sent again once on a new connection (the server read none of it)."""

    def __init__(self, url: str, headers: dict[str, str], connections: int):
        parts = urlsplit(url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.https else 80)
        # The same trust as httpx's client for this URL: certifi's roots, SSL_CERT_FILE and SSL_CERT_DIR.
        self.tls = httpx.create_ssl_context(trust_env=not is_loopback(url)) if self.https else None
        self.prefix = parts.path.rstrip("/")
        authority = parts.netloc.rsplit("@", 1)[-1]
        self.fixed = "".join(f"{name}: {value}\r\n" for name, value in
                             {"Host": authority, **headers}.items())
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.keep = connections

    async def post(self, path: str, body: bytes, cap: int) -> tuple[int, bytes]:
        request = (f"POST {self.prefix}{path} HTTP/1.1\r\n{self.fixed}Content-Length: {len(body)}\r\n\r\n"
                   ).encode("latin-1") + body
        while True:
            connection, reused = self._idle_connection(), True
            if connection is None:
                connection, reused = await self._connect(), False
            reader, writer = connection
            try:
                writer.write(request)
                answer = await self._answer(reader, cap)
            except Unheard:
                writer.close()
                if reused:  # the server had closed it, idle, as the call went out
                    continue
                raise
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                writer.close()
                raise BrokenAnswer(f"the connection ended before the answer did ({type(exc).__name__})") from None
            except BaseException:
                writer.close()
                raise
            status, kept, data = answer
            if kept and len(self.idle) < self.keep:
                self.idle.append(connection)
            else:
                writer.close()
            return status, data

    def _idle_connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        while self.idle:
            reader, writer = self.idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return None

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.tls,
                                                           limit=ANSWER_HEAD_BYTES)
        except (OSError, ssl.SSLError) as exc:
            raise BrokenAnswer(f"{type(exc).__name__}: {str(exc)[:200]}") from None
        writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    async def _answer(self, reader: asyncio.StreamReader, cap: int) -> tuple[int, bool, bytes]:
        """One answer: its status, whether the connection may carry another call, its body."""
        first = True
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.LimitOverrunError:
                raise BrokenAnswer(f"an answer's head over {ANSWER_HEAD_BYTES >> 10} KiB") from None
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                if first and not getattr(exc, "partial", b""):
                    raise Unheard(f"the connection ended without an answer ({type(exc).__name__})") from None
                raise
            first = False
            lines = head.decode("latin-1").split("\r\n")
            version, _, rest = lines[0].partition(" ")
            code = rest[:3]
            if version not in ("HTTP/1.1", "HTTP/1.0") or not code.isdigit():
                raise BrokenAnswer("an answer that is not HTTP/1.1")
            status = int(code)
            if not 100 <= status < 200:
                break  # an interim answer (103 Early Hints) comes before the real one
        fields: dict[str, str] = {}
        for line in lines[1:-2]:
            name, colon, value = line.partition(":")
            if not colon:
                raise BrokenAnswer("an answer header without a colon")
            name = name.strip().lower()
            fields[name] = f"{fields[name]}, {value.strip()}" if name in fields else value.strip()
        kept = version == "HTTP/1.1" and "close" not in fields.get("connection", "").lower()
        if status in (204, 304):
            return status, kept, b""
        if "chunked" in fields.get("transfer-encoding", "").lower():
            pieces = self._chunks(reader)
        elif "content-length" in fields:
            length = fields["content-length"]
            if not length.isdigit():
                raise BrokenAnswer("an answer whose Content-Length is not a number")
            pieces = self._pieces(reader, int(length))
        else:
            pieces, kept = self._pieces(reader, None), False
        return status, kept, await inflate_capped(pieces, fields.get("content-encoding", ""), cap)

    @staticmethod
    async def _pieces(reader: asyncio.StreamReader, length: int | None) -> AsyncIterator[bytes]:
        """`length` bytes (None: until the connection ends), BODY_PIECE_BYTES at a time."""
        while length is None or length > 0:
            piece = (await reader.read(BODY_PIECE_BYTES) if length is None else
                     await reader.readexactly(min(length, BODY_PIECE_BYTES)))
            if not piece:
                return
            if length is not None:
                length -= len(piece)
            yield piece

    @staticmethod
    async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        """A chunked body's data, BODY_PIECE_BYTES at a time at most; its trailer is read and dropped."""
        while True:
            size_line = (await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                raise BrokenAnswer("a chunked answer with a garbled chunk size") from None
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                return
            while size > 0:
                piece = await reader.readexactly(min(size, BODY_PIECE_BYTES))
                size -= len(piece)
                yield piece
            if await reader.readexactly(2) != b"\r\n":
                raise BrokenAnswer("a chunked answer with a garbled chunk end")

    async def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


class ServerApi:
    """The REST calls the worker makes, with the endpoint token (only ever in the Authorization header): over
    DirectHttp, or httpx when a proxy may apply."""

    def __init__(self, server: str, token: str, connections: int):
        headers = {"Authorization": f"Bearer {token}", "User-Agent": "switchboard-worker",
                   "Content-Type": "application/json"}
        self.direct = None if proxy_may_apply(server) else DirectHttp(f"{server}/api/v1", headers, connections)
        self.http = None if self.direct is not None else http_client(
            server, base_url=f"{server}/api/v1", headers=headers, timeout=SERVER_CALL_SECONDS,
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))

    async def _send(self, path: str, request: bytes, timeout: float) -> tuple[int, bytes]:
        if self.direct is not None:
            return await self.direct.post(path, request, SERVER_ANSWER_BYTES)
        async with self.http.stream("POST", path, content=request, timeout=timeout) as answer:
            return answer.status_code, await read_capped(answer, SERVER_ANSWER_BYTES)

    async def post(self, path: str, body: dict, timeout: float = SERVER_CALL_SECONDS) -> dict:
        """POST and read the whole answer within `timeout` seconds: a JSON object, or Unanswered (unreachable,
        busy, too slow, too large, not JSON, not an object, a redirect) or Refused (a 4xx)."""
        try:
            request = json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
        except (ValueError, RecursionError) as exc:  # a result nested too deep, say: the same on every try
            raise Refused(400, {"error": "invalid_argument", "message": f"the request is not JSON: {exc}"}) from None
        try:
            async with asyncio.timeout(timeout):  # the whole call: httpx's timeouts are per read
                status, raw = await self._send(path, request, timeout)
        except TimeoutError:
            raise Unanswered(f"no whole answer within {timeout:g} s") from None
        except (httpx.HTTPError, BrokenAnswer) as exc:
            raise Unanswered(f"{type(exc).__name__}: {str(exc)[:200]}") from None
        except (AnswerTooLarge, UnreadableAnswer) as exc:
            raise OddAnswer(f"{path}: {exc}") from None
        try:
            content = parse_json(raw)
        except ValueError as exc:
            content = exc
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
        if self.direct is not None:
            await self.direct.close()
        else:
            await self.http.aclose()


class Backoff:
    """Pauses between tries: RETRY_FIRST_SECONDS doubling to RETRY_LONGEST_SECONDS, each up to a quarter longer at
    random, so workers that lost the server together do not come back in step."""

    def __init__(self) -> None:
        self.pause = RETRY_FIRST_SECONDS

    def next(self) -> float:
        pause, self.pause = self.pause, min(self.pause * 2, RETRY_LONGEST_SECONDS)
        return pause * (1 + random.random() / 4)
