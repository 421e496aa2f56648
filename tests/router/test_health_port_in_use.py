"""A router whose health port cannot be had stops its main server before the
ListenError reaches the command: nothing is left serving behind the error."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pagedkv.common.ports import ListenError, check_free
from pagedkv.common.server_security import ServerSecurity
from pagedkv.router.service import RouterConfig, RouterService
from pagedkv.router.servicer import start_server
from tests.redis_server import free_port


def test_a_health_port_in_use_leaves_the_main_port_free() -> None:
    port = free_port()
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        health_port = held.getsockname()[1]

        async def main() -> None:
            service = RouterService(RouterConfig(redis_url="redis://127.0.0.1:1/0"))
            try:
                with pytest.raises(ListenError, match=f"--health-port {health_port}"):
                    await start_server(
                        service, f"127.0.0.1:{port}", ServerSecurity(health_port=health_port)
                    )
                check_free("--port", "127.0.0.1", port)  # the main server let it go
            finally:
                await service.redis.aclose()

        asyncio.run(main())
