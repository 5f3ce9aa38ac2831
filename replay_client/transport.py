"""HTTP plumbing of the client: JSON calls, errors from answers, and large answers read into one writable buffer."""

from __future__ import annotations

import functools
import http.client
import json
import ssl
import threading
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import numpy as np

from replay_format import ARROW_STREAM_MEDIA_TYPE
from replay_format.core import Backing


class ReplayError(Exception):
    """The service answered with an error; `status` and `detail` are its words."""

    def __init__(self, status: int, detail: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail
        self.body = body


class NotFoundError(ReplayError):
    """404: no such run, request or comparison."""


class StrictReadError(ReplayError):
    """A strict read met flagged or missing rows; `bad_rows` names the first ones."""

    @property
    def bad_rows(self) -> list[dict]:
        return (self.body or {}).get("bad_rows", [])


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
    raise cls(response.status_code, str(detail), body)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default TLS context (its CA bundle, or SSL_CERT_FILE / SSL_CERT_DIR), made once per process.

    httpx builds a new one for every client it makes, for plain-http URLs too, and building one reads the whole
    CA bundle (~55 ms here): a script or test that opens a client per call paid that every time.
    """
    return httpx.create_ssl_context()


class Transport:
    """One httpx client for small calls, plus a stdlib connection per thread for large answers."""

    def __init__(self, base_url: str, timeout: float, http: httpx.Client | None, token: str | None = None) -> None:
        self.own_http = http is None
        # the service's bearer token (REPLAY_TOKENS_FILE on its side), sent on every call
        self.auth = {"authorization": f"Bearer {token}"} if token else {}
        self.http = http or httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, verify=tls_context())
        self.http.headers.update(self.auth)
        self.timeout = timeout
        self._bulk = threading.local()  # per-thread stdlib connection for large bodies

    def close(self) -> None:
        """Close this thread's bulk connection and the httpx client (when this transport made it)."""
        conn = getattr(self._bulk, "conn", None)
        if conn is not None:
            conn.close()
        self.http.close()

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
            fake = httpx.Response(response.status, content=raw,
                                  headers={"content-type": response.getheader("content-type", "")})
            raise_for(fake)
            return bytearray(raw)
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
