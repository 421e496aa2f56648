"""The router's calls to its schedulers.

``SchedulerChannels`` owns one grpc.aio channel per scheduler address,
opened on first use (TLS and the router's own token as configured) and kept
until ``close``; it fans Abort and GetStats out to a set of schedulers and
sums their answers. ``forwarded_metadata`` is what of a caller's metadata
goes on to a scheduler. Which schedulers to call is the service's decision
(service.py), not this module's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import grpc

from pagedkv.cluster.members import MemberRecord
from pagedkv.common.bearer_tokens import TokenFile, token_interceptors
from pagedkv.common.security import TlsConfig, open_aio_channel
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc

Metadata = tuple[tuple[str, str | bytes], ...]


class SchedulerChannels:
    """The channels to the schedulers, by address. ``tls``: towards the
    schedulers (None: plaintext); ``token``: presented on every call (None:
    the callers' forwarded); ``timeout_s``: of each Abort and GetStats."""

    def __init__(self, tls: TlsConfig | None, token: TokenFile | None, timeout_s: float) -> None:
        self.tls = tls
        self.token = token
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> scheduler_pb2_grpc.SchedulerStub:
        """A stub on ``address``'s channel (opened now if it is not yet)."""
        channel = self._channels.get(address)
        if channel is None:
            token = self.token
            channel = open_aio_channel(
                address,
                self.tls,
                interceptors=token_interceptors(token.first) if token else [],
            )
            self._channels[address] = channel
        return scheduler_pb2_grpc.SchedulerStub(channel)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    async def abort(self, addresses: Sequence[str], request_id: str, metadata: Metadata) -> bool:
        """Aborts ``request_id`` on every scheduler of ``addresses`` at once;
        whether one of them aborted it (a scheduler that fails counts as not)."""
        request = scheduler_pb2.AbortRequest(request_id=request_id)
        replies = await asyncio.gather(
            *(
                self.stub(a).Abort(request, timeout=self.timeout_s, metadata=metadata)
                for a in addresses
            ),
            return_exceptions=True,
        )
        return any(isinstance(r, scheduler_pb2.AbortResponse) and r.aborted for r in replies)

    async def summed_stats(
        self,
        members: Sequence[MemberRecord],
        metadata: Metadata,
        request: scheduler_pb2.GetStatsRequest,
    ) -> tuple[scheduler_pb2.GetStatsResponse, list[str]]:
        """The stats of ``members`` summed (their executors, counts and
        integrity), and the ids of the members that did not answer;
        ``request`` is sent to each as it came."""
        replies = await asyncio.gather(
            *(
                self.stub(m.address).GetStats(request, timeout=self.timeout_s, metadata=metadata)
                for m in members
            ),
            return_exceptions=True,
        )
        response = scheduler_pb2.GetStatsResponse()
        problems, unreachable = [], []
        for member, reply in zip(members, replies, strict=True):
            if not isinstance(reply, scheduler_pb2.GetStatsResponse):
                unreachable.append(member.member_id)
                continue
            response.executors.extend(reply.executors)
            response.num_running += reply.num_running
            response.num_waiting += reply.num_waiting
            response.num_preemptions += reply.num_preemptions
            response.num_internal_errors += reply.num_internal_errors
            if not reply.integrity.ok:
                problems.append(f"{member.member_id}: {reply.integrity.message}")
        response.integrity.ok = not problems
        response.integrity.message = "\n".join(problems)
        return response, unreachable


def forwarded_metadata(metadata: object) -> Metadata:
    """The caller's metadata to pass on (gRPC's own and pseudo headers dropped)."""
    items: list[tuple[str, str | bytes]] = []
    with contextlib.suppress(TypeError):
        for key, value in metadata or ():  # type: ignore[attr-defined]
            if key.startswith((":", "grpc-")) or key in ("user-agent", "content-type", "te"):
                continue
            items.append((key, value))
    return tuple(items)
