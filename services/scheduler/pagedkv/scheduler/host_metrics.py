"""Prometheus metrics of the host tier (host_tier.py), per executor.

* gauges: ``pagedkv_host_kv_blocks{executor}`` (the tier's blocks) and
  ``pagedkv_host_kv_cached_blocks{executor}`` (those holding a cached block);
* counters: ``pagedkv_prefix_cache_host_hits_total{executor}`` (prompt tokens
  found in the host tier, part of ``pagedkv_prefix_cache_hits_total``),
  ``pagedkv_host_kv_offloaded_blocks_total{executor}``,
  ``pagedkv_host_kv_loaded_blocks_total{executor}``, the bytes they moved
  (``pagedkv_host_kv_offloaded_bytes_total``, ``..._loaded_bytes_total``)
  and the executor's time copying them,
  ``pagedkv_host_kv_copy_seconds_total{executor, direction}`` (direction
  ``offload`` or ``load``).

``SchedulerMetrics`` holds one ``HostTierMetrics`` in its registry; the step
loop gives it each executor's running totals after a step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pagedkv.scheduler.host_tier import HostTierStats


class HostTierMetrics:
    """The host tier's metrics in ``registry``; ``set`` takes running totals."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["executor"]
        self._blocks = Gauge(
            "pagedkv_host_kv_blocks", "Blocks of the executor's host tier.", labels,
            registry=registry,
        )  # fmt: skip
        self._cached = Gauge(
            "pagedkv_host_kv_cached_blocks", "Host-tier blocks holding a cached block.", labels,
            registry=registry,
        )  # fmt: skip
        self._hits = Counter(
            "pagedkv_prefix_cache_host_hits",
            "Prompt tokens found in the host tier (part of the prefix-cache hits).",
            labels,
            registry=registry,
        )
        self._offloaded = Counter(
            "pagedkv_host_kv_offloaded_blocks",
            "Blocks copied to the host tier as they left the GPU's cache.",
            labels,
            registry=registry,
        )
        self._loaded = Counter(
            "pagedkv_host_kv_loaded_blocks",
            "Blocks copied back from the host tier for a prefix hit.",
            labels,
            registry=registry,
        )
        self._offloaded_bytes = Counter(
            "pagedkv_host_kv_offloaded_bytes", "Bytes copied to the host tier.", labels,
            registry=registry,
        )  # fmt: skip
        self._loaded_bytes = Counter(
            "pagedkv_host_kv_loaded_bytes", "Bytes copied back from the host tier.", labels,
            registry=registry,
        )  # fmt: skip
        self._copy_seconds = Counter(
            "pagedkv_host_kv_copy_seconds",
            "The executor's time copying blocks to (offload) and from (load) the host tier.",
            ["executor", "direction"],
            registry=registry,
        )
        self._last: dict[str, tuple[float, ...]] = {}

    def set(
        self, executor: str, stats: HostTierStats, host_hits: int, bytes_per_block: int
    ) -> None:
        """Sets ``executor``'s gauges and advances its counters to the running
        totals given (``host_hits`` from its prefix-cache stats). Totals
        smaller than the last ones mean a new tier (the executor taken over
        again): they count in full."""
        offloaded, loaded = stats.num_offloaded, stats.num_loaded
        totals = (
            host_hits,
            offloaded,
            loaded,
            offloaded * bytes_per_block,
            loaded * bytes_per_block,
            stats.offload_seconds,
            stats.load_seconds,
        )
        last = self._last.get(executor, (0,) * len(totals))
        if any(now < before for now, before in zip(totals, last, strict=True)):
            last = (0,) * len(totals)
        self._last[executor] = totals
        self._blocks.labels(executor).set(stats.num_blocks)
        self._cached.labels(executor).set(stats.num_cached)
        children = (
            self._hits.labels(executor),
            self._offloaded.labels(executor),
            self._loaded.labels(executor),
            self._offloaded_bytes.labels(executor),
            self._loaded_bytes.labels(executor),
            self._copy_seconds.labels(executor, "offload"),
            self._copy_seconds.labels(executor, "load"),
        )
        for child, now, before in zip(children, totals, last, strict=True):
            if now > before:
                child.inc(now - before)
