"""The two generation routes served without FastAPI's routing and
middleware, which cost more CPU per request than the request's own work.

``GatewayApp`` is the ASGI app uvicorn serves: ``POST /v1/completions`` and
``POST /v1/chat/completions`` go straight to their handler (with the bearer
check, errors and metrics of the other routes), and another method on their
paths is answered 405; everything else (other paths, the lifespan) goes to
the FastAPI app. A stream's events are handed to the server's ``send`` as
they come (``responses.EventStream``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from pagedkv.common.logging import get_logger
from pagedkv.gateway.errors import ApiError
from pagedkv.gateway.metrics import GatewayMetrics

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
        endpoint = ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            await self.fastapi(scope, receive, send)
        elif scope["method"] == "POST":
            await self._generate(scope, receive, send, endpoint)
        else:
            method = scope["method"]
            error = ApiError(405, f"{method} {scope['path']}: method not allowed (use POST)")
            response = error.response()
            response.headers["Allow"] = "POST"
            self.metrics.requests.labels("other", "405").inc()
            await response(scope, receive, send)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
        request = Request(scope, receive)
        try:
            response = await self.handler(request, endpoint)
        except Exception as exc:  # as the FastAPI app's handler of any error
            log.error("request failed", path=scope["path"], error=repr(exc))
            error = ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error")
            response, endpoint = error.response(), "other"
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        await response(scope, receive, send)  # a stream sends itself (responses.EventStream)
