"""HTTP plumbing of the clients: a `Call` (calls.py) sent and its answer read, one transport per client kind.

`Transport` (ReplayClient's: an httpx client for small calls, a stdlib connection per thread for large answers) and
`AsyncTransport` (AsyncReplayClient's: httpx's async client, at most `max_in_flight` calls at once) send a call and
hand back its JSON, or a large answer read into one writable buffer; both retry 429 and 503 as `Retries` says, refuse
an answer larger than the memory this host has free (`AnswerTooLarge`) before reading it, and raise `ReplayError`
with the server's detail for any other error.
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import ssl
import threading
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import numpy as np

from replay_client.calls import Call
from replay_format import ARROW_STREAM_MEDIA_TYPE
from replay_format.core import Backing


class ReplayError(Exception):
    """The service answered with an error; `status` and `detail` are its words."""

    def __init__(self, status: int, detail: str, body: Any = None, retry_after: str | None = None) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail
        self.body = body
        self.retry_after = retry_after  # the answer's Retry-After header, where it had one


class NotFoundError(ReplayError):
    """404: no such run, request or comparison."""


class StrictReadError(ReplayError):
    """A strict read met flagged or missing rows; `bad_rows` names the first ones."""

    @property
    def bad_rows(self) -> list[dict]:
        return (self.body or {}).get("bad_rows", [])


class AnswerTooLarge(ReplayError):
    """An answer larger than this host's free memory (or the client's `max_answer_bytes`): refused before any of it
    is read."""


@dataclass(frozen=True)
class Retries:
    """How a client answers a 429 or 503: at most `attempts` tries more, each after the answer's `Retry-After` (capped
    at `max_wait_s`) or else `backoff_s * 2**n`; then the error is raised."""

    attempts: int = 3
    backoff_s: float = 0.5
    max_wait_s: float = 30.0

    STATUSES = frozenset({429, 503})

    def wait_s(self, tried: int, status: int, retry_after: str | None) -> float | None:
        """Seconds to wait before trying again after try number `tried` (0-based) answered `status`; None: raise."""
        if status not in self.STATUSES or tried >= self.attempts:
            return None
        return min(self.max_wait_s, _retry_after_s(retry_after) if retry_after else self.backoff_s * 2**tried)


DEFAULT_RETRIES = Retries()


def _retry_after_s(value: str) -> float:
    """`Retry-After` in seconds: a count, or an HTTP date (RFC 9110 10.2.3); 0 for one that cannot be read."""
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return 0.0


def memory_available() -> int | None:
    """Bytes this host can still give a process without swapping (`MemAvailable`), None where /proc does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_answer_size(size: int, status: int, limit: int | None) -> None:
    """AnswerTooLarge for an answer of `size` bytes past `limit` or the host's free memory."""
    free = memory_available()
    bound = min(x for x in (limit, free) if x is not None) if limit is not None or free is not None else None
    if bound is not None and size > bound:
        raise AnswerTooLarge(status, f"the answer is {size} bytes, more than "
                             + (f"max_answer_bytes={limit}" if bound == limit else f"the {free} bytes of free memory")
                             + ": ask for less at once (fewer sequences, a start and end, one pipeline stage)")


def raise_for(response: httpx.Response) -> None:
    """Nothing for a 2xx answer, else the `ReplayError` subclass that fits it, with the server's `detail`."""
    if response.is_success:
        return
    try:
        body = response.json()
        detail = body.get("detail", response.text) if isinstance(body, dict) else response.text
    except ValueError:
        body, detail = None, response.text
    cls: type[ReplayError] = NotFoundError if response.status_code == 404 else ReplayError
    if response.status_code == 409 and isinstance(body, dict) and "bad_rows" in body:
        cls = StrictReadError
    raise cls(response.status_code, str(detail), body, response.headers.get("retry-after"))


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default TLS context (its CA bundle, or SSL_CERT_FILE / SSL_CERT_DIR), made once per process.

    httpx builds a new one for every client it makes, for plain-http URLs too, and building one reads the whole
    CA bundle (~55 ms here): a script or test that opens a client per call paid that every time.
    """
    return httpx.create_ssl_context()


class Transport:
    """ReplayClient's: one httpx client for small calls, plus a stdlib connection per thread for large answers."""

    def __init__(self, base_url: str, timeout: float, http: httpx.Client | None, token: str | None = None,
                 retries: Retries = DEFAULT_RETRIES, max_answer_bytes: int | None = None) -> None:
        self.own_http = http is None
        # the service's bearer token (REPLAY_TOKENS_FILE on its side), sent on every call
        self.auth = {"authorization": f"Bearer {token}"} if token else {}
        self.http = http or httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, verify=tls_context())
        self.http.headers.update(self.auth)
        self.timeout = timeout
        self.retries = retries
        self.max_answer_bytes = max_answer_bytes
        self._bulk = threading.local()  # per-thread stdlib connection for large bodies

    def close(self) -> None:
        """Close this thread's bulk connection and the httpx client (when this transport made it)."""
        conn = getattr(self._bulk, "conn", None)
        if conn is not None:
            conn.close()
        self.http.close()

    def send(self, call: Call) -> Any:
        """The answer of `call`: its JSON, or (`bulk`) its body in one writable buffer; retried as `retries` says."""
        tried = 0
        while True:
            try:
                return self._send_once(call)
            except ReplayError as exc:
                wait = self.retries.wait_s(tried, exc.status, exc.retry_after)
                if wait is None:
                    raise
            time.sleep(wait)
            tried += 1

    def _send_once(self, call: Call) -> Any:
        if call.bulk:
            return self.fetch_bulk(call.method, call.url, call.json, call.params, call.accept)
        return self.json(call.method, call.url, params=call.params, json=call.json, content=call.content,
                         headers=call.headers)

    def json(self, method: str, url: str, **kw) -> Any:
        """A call whose answer is JSON."""
        response = self.http.request(method, url, **kw)
        raise_for(response)
        return response.json()

    def fetch_bulk(self, method: str, url: str, doc: dict | None = None, params: dict | None = None,
                   accept: str = ARROW_STREAM_MEDIA_TYPE) -> Backing:
        """A large answer read straight into one writable buffer: POST a JSON `doc`, or GET with `params`.

        The stdlib connection `readinto`s the body in a few large reads, where httpx's
        stream hands it over in 64 KiB chunks (a Python iteration each, and a copy): ~1.4x
        faster for a 200 MB training batch, ~2x for a 1.5 MB route. Falls back to httpx
        for a caller-supplied client.
        """
        if not self.own_http:
            if doc is not None:
                return self.fetch_stream(method, url, json=doc, params=params, headers={"accept": accept})
            return self.fetch_stream(method, url, params=params, headers={"accept": accept})
        base = self.http.base_url
        conn = getattr(self._bulk, "conn", None)
        if conn is None:
            if base.scheme == "https":  # verified as the httpx client verifies (the same CA bundle)
                conn = http.client.HTTPSConnection(base.host, base.port, timeout=self.timeout, context=tls_context())
            else:
                conn = http.client.HTTPConnection(base.host, base.port, timeout=self.timeout)
            self._bulk.conn = conn
        # ids are URL-safe (ID_RULE); one that is not is escaped as httpx would, for the service to refuse
        path = base.raw_path.decode().rstrip("/") + quote(url, safe="/:@+=")
        if params:
            path += "?" + urlencode(params)
        headers = {"accept": accept, **self.auth}
        payload = None
        if doc is not None:
            payload = json.dumps(doc).encode()
            headers["content-type"] = "application/json"
        try:
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
        except (http.client.HTTPException, OSError):
            conn.close()  # a stale keep-alive connection: one fresh try
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
        size = response.getheader("content-length")
        if response.status >= 300 or size is None:
            raw = response.read()
            fake = httpx.Response(response.status, content=raw, headers=dict(response.getheaders()))
            raise_for(fake)
            return bytearray(raw)
        try:
            check_answer_size(int(size), response.status, self.max_answer_bytes)
        except AnswerTooLarge:
            conn.close()  # the body is never read: this connection cannot carry another request
            raise
        body = np.empty(int(size), np.uint8)  # not bytearray(n): its zero-fill costs more than the read
        view = memoryview(body)  # type: ignore[arg-type]  # numpy arrays are buffers; the stubs omit it
        filled = 0
        while filled < len(body):
            got = response.readinto(view[filled:])
            if not got:
                conn.close()
                raise ReplayError(response.status, f"answer cut short at {filled} of {len(body)} bytes")
            filled += got
        return body

    def fetch_stream(self, method: str, url: str, **kw) -> bytearray:
        """The whole body in one writable buffer (sized from Content-Length when given)."""
        with self.http.stream(method, url, **kw) as response:
            if not response.is_success:
                response.read()
                raise_for(response)
            size = int(response.headers.get("content-length", 0))
            if size:
                check_answer_size(size, response.status_code, self.max_answer_bytes)
                body = bytearray(size)
                view = memoryview(body)
                filled = 0
                for chunk in response.iter_raw():
                    view[filled : filled + len(chunk)] = chunk
                    filled += len(chunk)
                return body if filled == size else body[:filled]
            grown = bytearray()
            for chunk in response.iter_raw():
                grown += chunk
            return grown


class AsyncTransport:
    """AsyncReplayClient's: httpx's async client, at most `max_in_flight` calls at once (more wait their turn)."""

    def __init__(self, base_url: str, timeout: float, http: httpx.AsyncClient | None, token: str | None,
                 max_in_flight: int, retries: Retries = DEFAULT_RETRIES, max_answer_bytes: int | None = None) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.own_http = http is None
        self.http = http or httpx.AsyncClient(
            base_url=base_url.rstrip("/"), timeout=timeout, verify=tls_context(),
            limits=httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight))
        if token:
            self.http.headers["authorization"] = f"Bearer {token}"
        self.retries = retries
        self.max_answer_bytes = max_answer_bytes
        self.slots = asyncio.Semaphore(max_in_flight)

    async def aclose(self) -> None:
        """Close the connections (of the httpx client this transport made)."""
        if self.own_http:
            await self.http.aclose()

    async def send(self, call: Call) -> Any:
        """The answer of `call`, as `Transport.send`; waits for a free slot first, and holds it while retrying."""
        async with self.slots:
            tried = 0
            while True:
                try:
                    return await self._send_once(call)
                except ReplayError as exc:
                    wait = self.retries.wait_s(tried, exc.status, exc.retry_after)
                    if wait is None:
                        raise
                await asyncio.sleep(wait)
                tried += 1

    async def _send_once(self, call: Call) -> Any:
        headers = {**(call.headers or {}), **({"accept": call.accept} if call.bulk else {})}
        request = self.http.build_request(call.method, call.url, params=call.params, json=call.json,
                                          content=call.content, headers=headers)
        response = await self.http.send(request, stream=call.bulk)
        if not call.bulk:
            raise_for(response)
            return response.json()
        try:
            if not response.is_success:
                await response.aread()
                raise_for(response)
            size = int(response.headers.get("content-length", 0))
            if not size:
                return bytearray(await response.aread())
            check_answer_size(size, response.status_code, self.max_answer_bytes)
            body = np.empty(size, np.uint8)
            view = memoryview(body)  # type: ignore[arg-type]  # numpy arrays are buffers; the stubs omit it
            filled = 0
            async for chunk in response.aiter_raw():
                view[filled : filled + len(chunk)] = chunk
                filled += len(chunk)
            if filled != size:
                raise ReplayError(response.status_code, f"answer cut short at {filled} of {size} bytes")
            return body
        finally:
            await response.aclose()
