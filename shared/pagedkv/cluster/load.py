"""Scheduler load reports: what each executor is running, published for routers.

Every scheduler member writes one ``LoadReport`` (JSON) under
``P:load:{member}`` with a short TTL: for each executor it holds, the
sequences running and waiting there and its free blocks. ``LoadPublisher``
writes it from a background task every ``interval_s`` when it changed (and at
least every ``refresh_s``, to keep the TTL), so the step loop never waits on
Redis; a dead scheduler's report expires with it. Routers read all reports
with one MGET (``read_loads``). A report is a hint that lags by up to
``interval_s``: routers add what they placed since.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import redis
import redis.asyncio

from pagedkv.cluster.keys import Keys
from pagedkv.common.logging import get_logger
from pagedkv.common.tasks import cancel_and_wait

log = get_logger("pagedkv.cluster.load")

DEFAULT_INTERVAL_S = 0.1
DEFAULT_TTL_MS = 3000


@dataclass(frozen=True, slots=True)
class ExecutorLoad:
    """One executor's load as its lease holder sees it."""

    address: str
    incarnation_id: str
    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences queued (preempted ones included)
    num_free_blocks: int  # free plus cached ones without a holder
    num_usable_blocks: int  # num_blocks - 1
    draining: bool = False  # admits nothing new

    @property
    def num_queued(self) -> int:
        """Running plus waiting sequences."""
        return self.num_running + self.num_waiting


@dataclass(frozen=True, slots=True)
class LoadReport:
    """A scheduler member's load: one entry per executor it holds."""

    member_id: str
    updated_ms: int  # the publisher's wall clock when it took the snapshot
    executors: tuple[ExecutorLoad, ...]

    def to_json(self) -> str:
        data = {
            "member_id": self.member_id,
            "updated_ms": self.updated_ms,
            "executors": [asdict(e) for e in self.executors],
        }
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, value: str | bytes) -> LoadReport:
        """ValueError when ``value`` is not a report."""
        try:
            data = json.loads(value)
            executors = tuple(ExecutorLoad(**e) for e in data["executors"])
            report = cls(str(data["member_id"]), int(data["updated_ms"]), executors)
        except (TypeError, KeyError, ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a load report: {exc}") from None
        return report


class LoadPublisher:
    """Publishes ``snapshot()`` as ``member_id``'s load report (see the module
    docstring). ``snapshot`` is called on the event loop, between steps; it
    must not await. Redis errors are logged once per outage and retried at
    the next interval."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        member_id: str,
        snapshot: Callable[[], Iterable[ExecutorLoad]],
        keys: Keys | None = None,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        refresh_s: float = 1.0,
        ttl_ms: int = DEFAULT_TTL_MS,
    ) -> None:
        self.client = client
        self.member_id = member_id
        self.snapshot = snapshot
        self.keys = keys or Keys()
        self.interval_s = interval_s
        self.refresh_s = refresh_s
        self.ttl_ms = ttl_ms
        self.num_publishes = 0
        self._last: tuple[ExecutorLoad, ...] | None = None
        self._last_at = 0.0
        self._failing = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        """Stops publishing and deletes the report (best effort)."""
        await cancel_and_wait([self._task])
        self._task = None
        with contextlib.suppress(redis.RedisError, OSError):
            await self.client.delete(self.keys.load(self.member_id))

    async def publish(self) -> bool:
        """Writes the report now if it changed or its TTL needs a refresh;
        True if it wrote. Redis errors propagate."""
        executors = tuple(sorted(self.snapshot(), key=lambda e: e.address))
        now = time.monotonic()
        if executors == self._last and now - self._last_at < self.refresh_s:
            return False
        report = LoadReport(self.member_id, int(time.time() * 1000), executors)
        await self.client.set(self.keys.load(self.member_id), report.to_json(), px=self.ttl_ms)
        self._last, self._last_at = executors, now
        self.num_publishes += 1
        return True

    async def _run(self) -> None:
        while True:
            try:
                await self.publish()
                if self._failing:
                    log.info("load reports written again", member_id=self.member_id)
                self._failing = False
            except (redis.RedisError, OSError) as exc:
                if not self._failing:
                    log.warning("cannot write the load report", error=str(exc))
                self._failing = True
                self._last = None
            await asyncio.sleep(self.interval_s)


async def read_loads(
    client: redis.asyncio.Redis, member_ids: Iterable[str], keys: Keys | None = None
) -> dict[str, LoadReport]:
    """The load reports of ``member_ids`` that exist (member id -> report);
    unreadable ones are logged and left out. Redis errors propagate."""
    keys = keys or Keys()
    members = list(member_ids)
    if not members:
        return {}
    values = await client.mget([keys.load(m) for m in members])
    reports: dict[str, LoadReport] = {}
    for member, value in zip(members, values, strict=True):
        if value is None:
            continue
        try:
            reports[member] = LoadReport.from_json(value)
        except ValueError as exc:
            log.warning("unreadable load report", member=member, error=str(exc))
    return reports
