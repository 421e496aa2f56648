"""The two generation routes served without FastAPI's routing and
middleware, which cost more CPU per request than the request's own work.

``GatewayApp`` is the ASGI app uvicorn serves: ``POST /v1/completions`` and
``POST /v1/chat/completions`` go straight to their handler (the same one
FastAPI's routes call, with the same bearer check, errors and metrics);
everything else (other methods and paths, the lifespan) goes to the
FastAPI app. A stream's events are handed to the server's ``send`` as they
come, the last one (``data: [DONE]``) together with the end of the body;
a client that goes away cancels the stream (its gRPC calls with it), as
Starlette's own streaming does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pagedkv.common.logging import get_logger
from pagedkv.gateway.errors import ApiError
from pagedkv.gateway.metrics import GatewayMetrics
from pagedkv.gateway.responses import DONE

log = get_logger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Handler = Callable[[Request, str], Awaitable[Response]]

ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
"""The fast path's paths and their endpoints' metric labels."""


class GatewayApp:
    """The served ASGI app (see the module docstring). ``handler`` answers
    a generation request of an endpoint; ``fastapi`` serves the rest."""

    def __init__(self, fastapi: FastAPI, handler: Handler, metrics: GatewayMetrics) -> None:
        self.fastapi = fastapi
        self.handler = handler
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = ROUTES.get(scope["path"])
            if endpoint is not None:
                await self._generate(scope, receive, send, endpoint)
                return
        await self.fastapi(scope, receive, send)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
        request = Request(scope, receive)
        try:
            response = await self.handler(request, endpoint)
        except Exception as exc:  # as the FastAPI app's handler of any error
            log.error("request failed", path=scope["path"], error=repr(exc))
            error = ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error")
            response, endpoint = error.response(), "other"
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        if isinstance(response, StreamingResponse):
            await _stream(response, receive, send)
        else:
            await response(scope, receive, send)


async def _stream(response: StreamingResponse, receive: Receive, send: Send) -> None:
    """Sends ``response``'s events until they end or the client goes."""
    body = asyncio.ensure_future(_send_body(response, send))
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((body, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not body.done():
            body.cancel()
            await asyncio.gather(body, return_exceptions=True)
    if not body.cancelled():
        body.result()  # its error, if any


async def _send_body(response: StreamingResponse, send: Send) -> None:
    status, headers = response.status_code, response.raw_headers
    await send({"type": "http.response.start", "status": status, "headers": headers})
    last = b""
    async for chunk in response.body_iterator:
        if last:
            await send({"type": "http.response.body", "body": last, "more_body": True})
            last = b""
        assert isinstance(chunk, bytes)  # the events of ``responses.Exchange``
        if chunk == DONE:
            last = chunk  # sent with the body's end
            continue
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": last, "more_body": False})


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
