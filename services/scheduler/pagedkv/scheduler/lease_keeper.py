"""A cluster member's lease renewals and member heartbeat, from a thread of
their own, so that a busy event loop cannot delay them.

The member round (``cluster.py``) runs on the event loop with the rest of
the scheduler. If a renewal waited for the loop, one callback that held it
past the lease TTL would hand the scheduler's executors to other members
though nothing failed. ``LeaseKeeper`` renews from a daemon thread with its
own synchronous Redis connection, every ``beat`` seconds, whatever the loop
is doing; only a stopped process (SIGSTOP, a crash) stops renewing.

A loop that does not run at all is another matter: a hung scheduler would
keep its executors for ever. Each beat asks the loop to note that it ran
(``call_soon_threadsafe``); once it has not for ``max_loop_stall`` seconds,
the keeper stops renewing (one warning) and the leases expire, until the
loop runs again.

The keeper only writes Redis. What a renewal means for the member (the lease
valid for longer, or lost) is handed to the loop (``on_renewed``), which
alone changes the member's state.

A release races a renewal: the renew script writes back a lease whose key is
gone (Redis restarted empty), so a renewal sent just after the loop deleted
the lease would revive it for a TTL, and no other member could claim the
executor meanwhile. The loop therefore takes a lease out of ``held`` first,
then awaits ``settled`` (the beat in progress, if any, ends) before it
releases it: no later beat sees that lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import redis

from pagedkv.cluster.keys import Keys
from pagedkv.cluster.leases import Lease, LeaseRenewer, RenewResult
from pagedkv.cluster.members import MemberRecord, heartbeat_sync
from pagedkv.common.logging import get_logger

log = get_logger(__name__)


class Renewal(NamedTuple):
    """One lease's renewal: its answer, and when it was sent (monotonic)."""

    address: str
    lease: Lease
    sent: float
    result: RenewResult


class LeaseKeeper:
    """Beats from a daemon thread: the member record, then every lease in
    ``held`` (read, never written, here). ``on_renewed`` gets each beat's
    renewals on the loop; ``on_error`` a Redis error instead."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        member: Callable[[], MemberRecord],
        held: Mapping[str, Lease],
        ttl_ms: int,
        beat: float,
        max_loop_stall: float,
        on_renewed: Callable[[list[Renewal]], None],
        on_error: Callable[[Exception], None],
    ) -> None:
        self.client = client
        self.keys = keys
        self.member = member
        self.held = held
        self.ttl_ms = ttl_ms
        self.beat = beat
        self.max_loop_stall = max_loop_stall
        self.on_renewed = on_renewed
        self.on_error = on_error
        self.renewer = LeaseRenewer(client, keys)
        self.num_beats = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_seen = time.monotonic()
        self._stalled = False
        self._beating = threading.Lock()  # held while a beat writes Redis
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedkv-leases", daemon=True)

    def start(self) -> None:
        """Starts beating (the first beat at once); call on the loop."""
        self._loop = asyncio.get_running_loop()
        self._loop_seen = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        """Stops the thread (after the beat in progress, if any)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.client.close()

    async def settled(self) -> None:
        """Returns once no beat is writing Redis: a lease taken out of
        ``held`` before this call is not renewed after it returns (release
        it then). Waits off the loop when a beat is in progress."""
        if self._beating.acquire(blocking=False):
            self._beating.release()
            return
        await asyncio.to_thread(self._wait_beat)

    def _wait_beat(self) -> None:
        with self._beating:
            pass

    def _run(self) -> None:
        while True:
            with self._beating:
                self._beat()
            if self._stop.wait(self.beat):
                return

    def _saw_loop(self) -> None:
        self._loop_seen = time.monotonic()

    def _beat(self) -> None:
        loop = self._loop
        assert loop is not None
        stalled_for = time.monotonic() - self._loop_seen
        try:
            loop.call_soon_threadsafe(self._saw_loop)
        except RuntimeError:  # the loop is closed: the process is ending
            return
        if stalled_for > self.max_loop_stall:
            if not self._stalled:
                self._stalled = True
                log.warning(
                    "event loop stalled; leases left to expire until it runs",
                    stalled_s=round(stalled_for, 1),
                )
            return
        if self._stalled:
            self._stalled = False
            log.info("event loop running again; leases renewed")
        try:
            heartbeat_sync(self.client, self.keys, self.member(), self.ttl_ms)
            renewals = []
            for address, lease in dict(self.held).items():
                if self.held.get(address) is not lease:
                    continue  # released or re-acquired meanwhile
                sent = time.monotonic()
                renewals.append(
                    Renewal(address, lease, sent, self.renewer.renew(lease, self.ttl_ms))
                )
        except (redis.RedisError, OSError) as exc:
            self._post(self.on_error, exc)
            return
        self.num_beats += 1
        self._post(self.on_renewed, renewals)

    def _post(self, callback: Callable[[Any], None], value: object) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed
            self._loop.call_soon_threadsafe(callback, value)
