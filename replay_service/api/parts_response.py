"""A response whose body is already built, in parts (views of arrays), sent as they are.

Starlette's StreamingResponse (under uvicorn's ASGI spec 2.3) runs each answer in an anyio task
group with a second task listening for a disconnect, and goes through an async generator per
part; for a body that is already in memory neither is needed. Here: the start message, then one
body message per part, the Content-Length known up front (a disconnect mid-body is uvicorn's to
drop: its `send` ignores body messages once the client is gone).
"""

from __future__ import annotations

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class PartsResponse(Response):
    """`parts` (bytes or memoryviews, written in order, never joined) as one body of their total length."""

    def __init__(self, parts: list[bytes | memoryview], media_type: str, headers: dict[str, str] | None = None,
                 status_code: int = 200, background: BackgroundTask | None = None) -> None:
        self.parts = parts
        size = sum(memoryview(p).nbytes for p in parts)
        super().__init__(None, status_code, {**(headers or {}), "Content-Length": str(size)}, media_type, background)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = len(self.parts) - 1
        if last < 0:
            await send({"type": "http.response.body", "body": b""})
        for i, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < last})
        if self.background is not None:
            await self.background()
