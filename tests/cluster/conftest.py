"""A private redis-server per test module (``redis_server``), and ``run`` for
the asyncio code (each test runs its coroutine on a fresh event loop)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from tests.redis_server import RedisServer

T = TypeVar("T")


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The module's server, flushed before the test (and restarted if a
    previous test left it down)."""
    if redis_server.process is None:
        redis_server.start()
    redis_server.client().flushall()
    return redis_server.url


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Polls ``condition`` until it holds; AssertionError past a generous deadline."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        time.sleep(0.02)
