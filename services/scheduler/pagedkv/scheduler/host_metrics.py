"""Prometheus metrics of the host tier (host_tier.py), per executor.

* gauges: ``pagedkv_host_kv_blocks{executor}`` (the tier's blocks) and
  ``pagedkv_host_kv_cached_blocks{executor}`` (those holding a cached block);
* counters: ``pagedkv_prefix_cache_host_hits_total{executor}`` (prompt tokens
  found in the host tier, part of ``pagedkv_prefix_cache_hits_total``),
  ``pagedkv_host_kv_offloaded_blocks_total{executor}`` and
  ``pagedkv_host_kv_loaded_blocks_total{executor}``.

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
        self._last: dict[str, tuple[int, int, int]] = {}

    def set(self, executor: str, stats: HostTierStats, host_hits: int) -> None:
        """Sets ``executor``'s gauges and advances its counters to the running
        totals given (``host_hits`` from its prefix-cache stats). Totals
        smaller than the last ones mean a new tier (the executor taken over
        again): they count in full."""
        totals = (host_hits, stats.num_offloaded, stats.num_loaded)
        last = self._last.get(executor, (0, 0, 0))
        if any(now < before for now, before in zip(totals, last, strict=True)):
            last = (0, 0, 0)
        self._last[executor] = totals
        self._blocks.labels(executor).set(stats.num_blocks)
        self._cached.labels(executor).set(stats.num_cached)
        for counter, now, before in zip(
            (self._hits, self._offloaded, self._loaded), totals, last, strict=True
        ):
            if now > before:
                counter.labels(executor).inc(now - before)
