"""A replica's GetStats snapshot, typed: ``Stats`` and the views it holds
(executors, integrity, cluster, router), converted from the proto in this
file only.

Frozen dataclasses holding tuples, as ``pagedkv.client.types`` (the
results of Generate); ``None`` means "the server did not say".
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.v1 import scheduler_pb2


@dataclass(frozen=True, slots=True)
class ExecutorStats:
    """The scheduler's view of one executor."""

    address: str
    healthy: bool
    """The executor answered its last call or health check."""
    num_blocks: int
    """Blocks in the pool, the null block 0 included."""
    num_free_blocks: int
    """Free blocks plus cached ones with no holder (eviction candidates), out
    of ``num_usable_blocks``."""
    kv_cache_usage: float
    """Fraction of usable blocks in use, 0.0 to 1.0."""
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache since start."""
    prefix_cache_hits: int
    """Of those, tokens found."""
    incarnation_id: str
    epoch: int
    """This scheduler's fencing epoch on the executor; 0 if it holds no lease."""
    num_usable_blocks: int
    """Blocks that can hold KV: ``num_blocks - 1`` (the null block 0 never
    does). Servers older than the field leave it out; it is then computed."""
    suspect: bool
    """Healthy, but its step in flight has run far longer than its recent
    steps (it may be hung; it is marked down at the executor timeout)."""
    down_reason: str
    """Empty while healthy; otherwise why it was marked down, starting with
    the cause: "transport:", "timeout:" or "fenced:"."""
    num_recoveries: int
    """Times it came back after being marked down."""
    kv_cache_dtype: str = ""
    """Its KV blocks' dtype ("bfloat16", "float8_e4m3fn", ...; ``pagedkv
    executor --kv-cache-dtype``); empty from servers older than the field."""
    bytes_per_block: int = 0
    """Device bytes one block takes over every layer, K and V (0 likewise)."""
    peak_used_blocks: int = 0
    """The most blocks held at once (usable minus free) since the replica
    took the executor, or since a ``stats(reset_peak_used_blocks=True)``
    (0 likewise)."""

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Hits over queries; None before the first query."""
        if self.prefix_cache_queries == 0:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries


@dataclass(frozen=True, slots=True)
class IntegrityCheck:
    """The outcome of the scheduler's block-pool integrity check."""

    ok: bool
    message: str
    """Empty when ok; otherwise which pool and invariant failed."""


@dataclass(frozen=True, slots=True)
class ClusterExecutor:
    """A registered executor of the cluster, as Redis shows it."""

    address: str
    incarnation_id: str
    owner_id: str
    """The scheduler holding its lease; empty when none does."""
    epoch: int
    """The lease's fencing epoch; 0 when unleased."""


@dataclass(frozen=True, slots=True)
class ClusterView:
    """The cluster control plane as one replica sees it (``--redis-url``)."""

    degraded: bool
    """Redis cannot be reached: the replica serves what it holds, claims nothing."""
    detail: str
    scheduler_ids: tuple[str, ...]
    """The live scheduler replicas, this one included."""
    executors: tuple[ClusterExecutor, ...]


@dataclass(frozen=True, slots=True)
class RouterView:
    """A router's own state (``pagedkv router``)."""

    router_id: str
    policy: str
    unreachable_scheduler_ids: tuple[str, ...]
    """Live schedulers whose stats did not come."""
    num_indexed_blocks: int
    num_followed_executors: int
    kv_event_lag_seconds: float


@dataclass(frozen=True, slots=True)
class Stats:
    """A snapshot of one scheduler replica."""

    scheduler_id: str
    executors: tuple[ExecutorStats, ...]
    num_running: int
    num_waiting: int
    """Queued for admission, preempted requests included."""
    num_preemptions: int
    """Since start; a request preempted twice counts twice."""
    integrity: IntegrityCheck
    num_internal_errors: int
    """Errors in the scheduler's own code since start; each ended the
    requests it concerned with ``FinishReason.ERROR`` (the scheduler's log
    says more)."""
    draining: bool = False
    """The replica is stopping: it admits nothing new."""
    cluster: ClusterView | None = None
    """None without a Redis control plane."""
    router: RouterView | None = None
    """Set when the target is a router: its own state (the other fields are
    then summed over the cluster's schedulers)."""


# --- proto -> types: the only place that reads a GetStats response ----------


def stats_from_proto(msg: scheduler_pb2.GetStatsResponse) -> Stats:
    """A GetStats response as ``Stats``."""
    return Stats(
        scheduler_id=msg.scheduler_id,
        executors=tuple(
            ExecutorStats(
                address=ex.address,
                healthy=ex.healthy,
                num_blocks=ex.num_blocks,
                num_free_blocks=ex.num_free_blocks,
                kv_cache_usage=ex.kv_cache_usage,
                prefix_cache_queries=ex.prefix_cache_queries,
                prefix_cache_hits=ex.prefix_cache_hits,
                incarnation_id=ex.incarnation_id,
                epoch=ex.epoch,
                num_usable_blocks=ex.num_usable_blocks or max(ex.num_blocks - 1, 0),
                suspect=ex.suspect,
                down_reason=ex.down_reason,
                num_recoveries=ex.num_recoveries,
                kv_cache_dtype=ex.kv_cache_dtype,
                bytes_per_block=ex.bytes_per_block,
                peak_used_blocks=ex.peak_used_blocks,
            )
            for ex in msg.executors
        ),
        num_running=msg.num_running,
        num_waiting=msg.num_waiting,
        num_preemptions=msg.num_preemptions,
        integrity=IntegrityCheck(ok=msg.integrity.ok, message=msg.integrity.message),
        num_internal_errors=msg.num_internal_errors,
        draining=msg.draining,
        cluster=cluster_from_proto(msg.cluster) if msg.cluster.enabled else None,
        router=(
            RouterView(
                router_id=msg.router.router_id,
                policy=msg.router.policy,
                unreachable_scheduler_ids=tuple(msg.router.unreachable_scheduler_ids),
                num_indexed_blocks=msg.router.num_indexed_blocks,
                num_followed_executors=msg.router.num_followed_executors,
                kv_event_lag_seconds=msg.router.kv_event_lag_seconds,
            )
            if msg.HasField("router")
            else None
        ),
    )


def cluster_from_proto(msg: scheduler_pb2.ClusterState) -> ClusterView:
    """The cluster as the GetStats response shows it (Redis' view)."""
    return ClusterView(
        degraded=msg.degraded,
        detail=msg.detail,
        scheduler_ids=tuple(msg.scheduler_ids),
        executors=tuple(
            ClusterExecutor(e.address, e.incarnation_id, e.owner_id, e.epoch) for e in msg.executors
        ),
    )
