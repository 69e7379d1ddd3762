"""Limits on what a request may take as it arrives: its size and its time.

- Size (RequestLimitsMiddleware, an ASGI middleware in front of the routes): a body over `max_bytes` is a 413 at
  once, refused on its Content-Length before any of it is read, or, sent in chunks without one, as soon as the bytes
  received pass the limit. The connection is closed after the answer, so that the rest of the body is never read.
- Time: the whole body must arrive within `timeout` seconds of the headers (the same middleware): a client that
  sends part of it and stalls gets a 408 and its connection closed. The headers must arrive within `timeout` of
  the connection's start or of the previous response (HeadersTimeoutProtocol, uvicorn's HTTP/1.1 protocol with that
  added): a connection that never completes them is closed. uvicorn has neither (its keep-alive timeout ends idle
  connections only), so a client sending a few bytes now and then could hold a connection for ever (slowloris).
The routes never see a refused body: what they answered is dropped for the refusal.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from a4.server.errors import APIError

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # some 1M tokens of prompt text, far more than a context holds
DEFAULT_REQUEST_TIMEOUT = 30.0  # seconds, for the headers and then for the body


def too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than the server's limit of {max_bytes} bytes",
                    code="request_too_large", headers={"Connection": "close"})  # fmt: skip


class RequestLimitsMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await too_large(self.max_bytes).response()(scope, receive, send)
            return
        deadline = time.monotonic() + self.timeout
        received, body_done, refusal = 0, False, None

        async def guarded_receive() -> Message:
            nonlocal received, body_done, refusal
            if body_done or refusal is not None:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                refusal = APIError(408, f"the request body did not arrive within {self.timeout:g} s",
                                   code="request_timeout", headers={"Connection": "close"})  # fmt: skip
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_bytes:
                    refusal = too_large(self.max_bytes)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if refusal is None:
                await send(message)

        await self.app(scope, guarded_receive, guarded_send)
        if refusal is not None:
            await refusal.response()(scope, receive, send)


class HeadersTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol (h11), which also closes a connection whose next request's headers are not all in
    within `headers_timeout` seconds (`with_headers_timeout` sets it)."""

    headers_timeout = DEFAULT_REQUEST_TIMEOUT

    @classmethod
    def with_headers_timeout(cls, seconds: float) -> type[HeadersTimeoutProtocol]:
        return type(cls.__name__, (cls,), {"headers_timeout": seconds})

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._expect_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._expect_request()

    def _expect_request(self) -> None:
        # uvicorn starts a new cycle once a request's headers are complete.
        self.loop.call_later(self.headers_timeout, self._close_if_no_request_since, self.cycle)

    def _close_if_no_request_since(self, cycle) -> None:
        if self.cycle is cycle and not self.transport.is_closing():
            self.transport.close()
