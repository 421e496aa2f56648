"""What ``pagedkv serve`` started, and how it is stopped: ``Stack`` holds the
executors, the child schedulers and routers, the private Redis and the
Reaper of the temporary directories; it stops the servers together on the
first signal and kills every child on a forced stop (lifetime.py has the
signals and the reaper themselves).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pagedkv.scheduler.children import ChildProcesses, ExecutorProcesses, PrivateRedis
from pagedkv.scheduler.lifetime import Reaper


class Stack:
    """What ``pagedkv serve`` started: the executors, the child schedulers
    and routers (``servers``), the private Redis, and the Reaper of its
    temporary directories."""

    def __init__(self) -> None:
        self.reaper = Reaper()
        self.stop_event = asyncio.Event()  # the scheduler here stops when set
        self.executors: ExecutorProcesses | None = None
        self.servers: list[ChildProcesses] = []
        self.redis: PrivateRedis | None = None

    def stopping(self) -> Callable[[], None]:
        """The first signal's clean stop while the scheduler here serves, as
        a signal handler's callback: ``stop`` set on the loop, and SIGTERM
        to the child schedulers and routers now, so that every scheduler
        drains at once rather than one after another."""
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            for servers in self.servers:
                servers.terminate()
            loop.call_soon_threadsafe(self.stop_event.set)

        return on_signal

    async def stop_servers(self) -> None:
        """Stops the child schedulers and routers together (each bounded)."""
        await asyncio.gather(*(asyncio.to_thread(s.stop) for s in self.servers))

    def kill(self) -> None:
        """SIGKILL to every child (a forced stop; the Reaper removes the
        temporary directories once this process is gone)."""
        for servers in self.servers:
            servers.kill()
        if self.executors is not None:
            self.executors.kill()
        if self.redis is not None:
            self.redis.kill()
