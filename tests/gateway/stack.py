"""Real processes for the gateway tests: ``pagedkv serve --http-port`` (the
embedded stack with its gateway), or ``pagedkv gateway`` in front of a
given target, on 127.0.0.1; and the tiny models they serve."""

from __future__ import annotations

import re
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pagedkv.client import Client
from tests.processes import ServedProcess

GATEWAY_READY = re.compile(r"gateway ready on ([\d.]+):(\d+)")


class Gateway(ServedProcess):
    """``pagedkv gateway`` in front of ``target``; ``url`` is its base URL."""

    def __init__(self, target: str, model: Path | str, extra: tuple[str, ...] = ()) -> None:
        command = [sys.executable, "-m", "pagedkv.common.cli", "gateway", "--target", target]
        super().__init__([*command, "--model", str(model), "--port", "0", *extra])
        self.url = f"http://{self.target}"


class ServeWithGateway(ServedProcess):
    """``pagedkv serve MODEL --http-port PORT``: ``target`` is the scheduler
    (its ready line comes first), ``url`` the gateway's base URL."""

    def __init__(self, model: Path, *, num_blocks: int = 256, extra: tuple[str, ...] = ()) -> None:
        self.http_port = free_port()
        command = [sys.executable, "-m", "pagedkv.common.cli", "serve", str(model)]
        command += ["--num-blocks", str(num_blocks), "--port", "0"]
        super().__init__([*command, "--http-port", str(self.http_port), *extra])
        self.url = f"http://127.0.0.1:{self.http_port}"
        wait_until(lambda: GATEWAY_READY.search("".join(self.lines)) is not None, 120)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(condition: Callable[[], bool], timeout: float, what: str = "condition") -> None:
    """Polls ``condition`` until it holds; AssertionError after ``timeout``
    (a generous bound for a slow machine, not a measurement)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(0.05)


def nothing_held(target: str) -> bool:
    """Whether the scheduler at ``target`` runs nothing and holds no block
    (every block free or cached with no holder), its pools intact."""
    with Client(target, timeout=30) as client:
        stats = client.stats()
    assert stats.integrity.ok, stats.integrity.message
    busy = stats.num_running or stats.num_waiting
    held = any(e.num_free_blocks != e.num_usable_blocks for e in stats.executors)
    return not busy and not held
