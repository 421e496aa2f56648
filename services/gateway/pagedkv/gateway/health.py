"""Whether any target serves: ``GET /health``'s answer.

Each target's ``grpc.health.v1`` service is asked (service "", as
Kubernetes' probes ask a scheduler or router) over a channel of its own,
with the gateway's TLS; the health service needs no token. The answer is
kept for ``CACHE_S`` so that frequent probes do not multiply calls, and
concurrent probes share one round of checks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.common.security import TlsConfig, open_aio_channel

CACHE_S = 1.0
CHECK_TIMEOUT_S = 1.0


class TargetHealth:
    """The targets' health, checked at most once per ``CACHE_S``.

    Owns its channels (``close``). Create it inside the event loop."""

    def __init__(self, targets: Sequence[str], tls: TlsConfig | None) -> None:
        self.targets = tuple(targets)
        self._channels = [open_aio_channel(t, tls) for t in self.targets]
        self._stubs = [health_pb2_grpc.HealthStub(c) for c in self._channels]
        self._checked_at = -CACHE_S
        self._serving: tuple[str, ...] = ()
        self._round: asyncio.Task[tuple[str, ...]] | None = None

    async def _check(self, index: int) -> bool:
        try:
            response = await self._stubs[index].Check(
                health_pb2.HealthCheckRequest(service=""), timeout=CHECK_TIMEOUT_S
            )
        except grpc.RpcError:
            return False
        return bool(response.status == health_pb2.HealthCheckResponse.SERVING)

    async def _check_all(self) -> tuple[str, ...]:
        results = await asyncio.gather(*(self._check(i) for i in range(len(self.targets))))
        return tuple(t for t, ok in zip(self.targets, results, strict=True) if ok)

    async def serving(self) -> tuple[str, ...]:
        """The targets that answered SERVING (at most ``CACHE_S`` old)."""
        if time.monotonic() - self._checked_at < CACHE_S:
            return self._serving
        if self._round is None or self._round.done():
            self._round = asyncio.ensure_future(self._check_all())
        round_ = self._round
        serving = await asyncio.shield(round_)
        if self._round is round_:
            self._serving, self._checked_at = serving, time.monotonic()
        return serving

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
