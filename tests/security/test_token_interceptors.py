"""``token_interceptors`` present the channel's token on calls of every kind
(issue 26: one interceptor object declared for unary and streaming calls was
filed by grpc.aio under unary calls alone, so streaming calls went out with
the caller's token), replacing the token a call carried."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from pagedkv.common.bearer_tokens import AUTHORIZATION, bearer_metadata, token_interceptors

KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def _recording_server(seen: dict[str, list[str]]) -> grpc.aio.Server:
    """A server of four raw-bytes methods, one per kind (``/t.T/<kind>``),
    recording each call's ``authorization`` values under its kind."""

    def record(kind: str, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
        metadata = context.invocation_metadata() or ()
        seen[kind] = [str(v) for k, v in metadata if k == AUTHORIZATION]

    async def unary_unary(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        record("unary_unary", context)
        return request

    async def unary_stream(
        request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        record("unary_stream", context)
        yield request

    async def stream_unary(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        record("stream_unary", context)
        return b"".join([r async for r in requests])

    async def stream_stream(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        record("stream_stream", context)
        async for request in requests:
            yield request

    handlers = {
        "unary_unary": grpc.unary_unary_rpc_method_handler(unary_unary),
        "unary_stream": grpc.unary_stream_rpc_method_handler(unary_stream),
        "stream_unary": grpc.stream_unary_rpc_method_handler(stream_unary),
        "stream_stream": grpc.stream_stream_rpc_method_handler(stream_stream),
    }
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
    return server


async def _call_every_kind(
    channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]
) -> None:
    async def one() -> AsyncIterator[bytes]:
        yield b"x"

    await channel.unary_unary("/t.T/unary_unary")(b"x", metadata=metadata, timeout=10)
    async for _ in channel.unary_stream("/t.T/unary_stream")(b"x", metadata=metadata, timeout=10):
        pass
    await channel.stream_unary("/t.T/stream_unary")(one(), metadata=metadata, timeout=10)
    async for _ in channel.stream_stream("/t.T/stream_stream")(
        one(), metadata=metadata, timeout=10
    ):
        pass


def test_every_kind_of_call_carries_the_channel_s_token_and_never_the_caller_s() -> None:
    async def run() -> dict[str, list[str]]:
        seen: dict[str, list[str]] = {}
        server = _recording_server(seen)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            interceptors = token_interceptors(lambda: "own-token")
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", interceptors=interceptors
            ) as channel:
                await _call_every_kind(channel, bearer_metadata("caller-token"))
        finally:
            await server.stop(None)
        return seen

    seen = asyncio.run(run())
    assert seen == {kind: ["Bearer own-token"] for kind in KINDS}


def test_the_token_is_asked_for_on_every_call() -> None:
    # A rotated token file is picked up by the next call, of any kind.
    async def run() -> dict[str, list[str]]:
        seen: dict[str, list[str]] = {}
        server = _recording_server(seen)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        tokens = iter(f"token-{i}" for i in range(len(KINDS)))
        try:
            interceptors = token_interceptors(lambda: next(tokens))
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", interceptors=interceptors
            ) as channel:
                await _call_every_kind(channel, ())
        finally:
            await server.stop(None)
        return seen

    seen = asyncio.run(run())
    assert seen == {kind: [f"Bearer token-{i}"] for i, kind in enumerate(KINDS)}
