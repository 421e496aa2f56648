"""Requests that do not decode get INVALID_ARGUMENT, on both kinds of server.

grpc decodes a request (or each message of a request stream) before the
servicer sees it. When the bytes are not the method's message (corrupt wire
format, a string that is not UTF-8), the sync server answers INTERNAL
"Exception deserializing request!" and grpc.aio UNKNOWN with Python's
exception class, and both log a traceback. The interceptors here rewrite each
method handler: its request deserializer returns an ``Undecodable`` value
instead of raising ``DecodeError``, and its behaviour ends the call with
INVALID_ARGUMENT "the request is not a valid pagedkv.v1.GenerateRequest
message" when it gets one, before the servicer runs (for a request stream:
when the servicer reaches that message, so the messages before it are served
and none after it is read). They apply to every method of the server, health
and reflection included.

A handler that reads its request stream with ``context.read()`` instead of
iterating it would get the ``Undecodable`` value itself; none of ours do. On
grpc.aio, a handler that is a plain function (run in grpc's thread pool) is
left as it is.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.message import DecodeError

_BEHAVIOURS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A request that did not decode; ``details`` is the status message."""

    details: str


@functools.cache
def undecodable_details(method: str) -> str:
    """The status message for ``method`` (``/package.Service/Method``), naming
    its request type where the default descriptor pool knows it."""
    try:
        name = descriptor_pool.Default().FindMethodByName(method.strip("/").replace("/", "."))
    except KeyError:
        return f"the request is not a valid message for {method}"
    return f"the request is not a valid {name.input_type.full_name} message"


def _tolerant(deserializer: Callable[[bytes], Any], details: str) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError:
            return Undecodable(details)

    return deserialize


def _behaviour_name(handler: Any) -> str:
    return next(name for name in _BEHAVIOURS if getattr(handler, name) is not None)


# -- the sync server ----------------------------------------------------------


def _checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    for request in requests:
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        yield request


def _sync_behaviour(behaviour: Callable[..., Any], request_streaming: bool) -> Callable[..., Any]:
    def checked(request: Any, context: grpc.ServicerContext) -> Any:
        if request_streaming:
            return behaviour(_checked(request, context), context)
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        return behaviour(request, context)

    return checked


class RequestDecodingInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """For ``grpc.server``: an undecodable request is INVALID_ARGUMENT."""

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        name = _behaviour_name(handler)
        behaviour = _sync_behaviour(getattr(handler, name), handler.request_streaming)
        deserializer = _tolerant(handler.request_deserializer, undecodable_details(details.method))
        return handler._replace(request_deserializer=deserializer, **{name: behaviour})


# -- grpc.aio -----------------------------------------------------------------


async def _async_checked(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        yield request


def _async_behaviour(
    behaviour: Callable[..., Any], request_streaming: bool
) -> Callable[..., Any] | None:
    """``behaviour`` behind the check, of the same kind (a coroutine function
    or an async generator function, which grpc.aio tells apart); None for a
    plain function."""

    async def checked(request: Any, context: Any) -> Any:
        if request_streaming:
            return _async_checked(request, context)
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        return request

    if inspect.isasyncgenfunction(behaviour):

        async def responses(request: Any, context: Any) -> AsyncIterator[Any]:
            inner = behaviour(await checked(request, context), context)
            # Closed with this generator, so that the servicer's cleanup runs
            # when the server stops pulling responses.
            async with contextlib.aclosing(inner):
                async for response in inner:
                    yield response

        return responses
    if inspect.iscoroutinefunction(behaviour):

        async def response(request: Any, context: Any) -> Any:
            result: Awaitable[Any] = behaviour(await checked(request, context), context)
            return await result

        return response
    return None


class AsyncRequestDecodingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """For ``grpc.aio.server``: an undecodable request is INVALID_ARGUMENT."""

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        name = _behaviour_name(handler)
        behaviour = _async_behaviour(getattr(handler, name), handler.request_streaming)
        if behaviour is None:
            return handler
        deserializer = _tolerant(handler.request_deserializer, undecodable_details(details.method))
        return handler._replace(request_deserializer=deserializer, **{name: behaviour})
