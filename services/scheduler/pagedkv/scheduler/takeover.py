"""Taking an executor over: the Reset and what it yields (``take_over``,
``TakenOver``, handed between the executors' registry, the service and the
cluster member), who owns an executor now, and whether a probed one may be
taken back. Nothing here changes the scheduler's state."""

from __future__ import annotations

from typing import NamedTuple

from pagedkv.common.ids import MAX_EPOCH
from pagedkv.scheduler.cache_events import CacheEvent
from pagedkv.scheduler.executor_client import PROBE_TIMEOUT_S, ExecutorClient, ExecutorDown
from pagedkv.v1 import executor_pb2


class TakenOver(NamedTuple):
    """An executor just taken over: its GetInfo and its tagged blocks, on
    the device and in its host tier."""

    info: executor_pb2.GetInfoResponse
    cached: list[CacheEvent]
    host_cached: tuple[CacheEvent, ...] = ()


async def take_over(
    client: ExecutorClient,
    info: executor_pb2.GetInfoResponse | None = None,
    *,
    epoch: int | None = None,
    cold: bool = False,
) -> TakenOver:
    """Takes the executor over (Reset: its rows are freed, its KV kept; at
    ``epoch``, or its own plus one) and reads its tagged blocks, so the
    prefix cache survives the takeover; ``cold`` drops the tags instead (the
    scheduler's own accounting was in doubt). Raises ExecutorDown."""
    info = await client.connect(info, epoch=epoch, drop_cached_blocks=cold)
    if cold:
        return TakenOver(info, [])
    cached, host_cached = await client.list_cached_blocks()
    return TakenOver(info, cached, tuple(host_cached))


def owned_by(info: executor_pb2.GetInfoResponse) -> str:
    """Who owns the executor, for a reason it is down or refused."""
    return f"owned by {info.owner.owner_id!r} at epoch {info.owner.epoch}"


async def owner_if_fenced(client: ExecutorClient) -> str | None:
    """The executor's owner when it is not ``client``'s owner any more
    (None: it still is, or it does not answer)."""
    try:
        info = await client.get_info(timeout=min(PROBE_TIMEOUT_S, client.timeout))
    except ExecutorDown:
        return None
    if client.owned_by_us(info):
        return None
    return owned_by(info)


def not_adoptable(info: executor_pb2.GetInfoResponse, model_id: str, owner_id: str) -> str | None:
    """Why a probed executor cannot be taken back by ``owner_id``, which
    serves ``model_id`` (None: it can)."""
    if info.model_id != model_id:
        return f"it serves {info.model_id!r}, not {model_id!r}"
    owner = info.owner.owner_id
    if owner and owner != owner_id:
        return owned_by(info)
    if info.owner.epoch >= MAX_EPOCH:
        return f"its epoch {info.owner.epoch} is the maximum; restart it"
    if info.draining:
        return "it is stopping"
    return None
