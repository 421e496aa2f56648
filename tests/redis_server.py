"""A private ``redis-server`` for tests: no persistence, a free port on
127.0.0.1, its own temporary directory. ``kill()`` and ``restart()`` simulate
outages; a restarted server is empty (``--save '' --appendonly no``), like a
Redis that lost its data."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """Starts ``redis-server`` on a free port and waits for PING. ``url`` stays
    the same across ``restart()``. A context manager: closing kills the server
    and removes its directory. ``password``: the server requires it
    (``--requirepass``; ``url`` does not carry it)."""

    def __init__(self, timeout: float = 30.0, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (`make redis` installs it)")
        self.binary = binary
        self.timeout = timeout
        self.password = password
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = Path(tempfile.mkdtemp(prefix="pagedkv-redis-"))
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        """Starts the server (empty) and returns once it answers PING."""
        assert self.process is None, "already running"
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.dir)]
        if self.password is not None:
            command += ["--requirepass", self.password]
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + self.timeout
        client = redis.Redis(
            port=self.port, password=self.password, socket_timeout=1, socket_connect_timeout=1
        )
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"redis-server on port {self.port} did not start"
                        ) from None
                    time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILLs the server (its data is lost)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def restart(self) -> None:
        """Kills the server and starts an empty one on the same port."""
        self.kill()
        self.start()

    def client(self) -> redis.Redis:
        """A plain synchronous client, for assertions."""
        return redis.Redis(port=self.port, password=self.password, socket_timeout=5)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
