"""Prometheus metrics of the scheduler: queues, KV cache, prefix cache, latencies.

``SchedulerMetrics`` owns its metrics in a private ``CollectorRegistry``
(never prometheus_client's global one), so a process, or a test, can hold
several schedulers' metrics side by side. The scheduler records into it as it
steps; ``render`` gives the text exposition and ``serve`` an HTTP endpoint
for Prometheus to scrape.

Metric names (``_total`` on counters as exposed):

* gauges: ``pagedkv_kv_cache_usage{executor}`` (fraction of KV blocks in use),
  ``pagedkv_kv_cache_blocks{executor,dtype}`` and
  ``pagedkv_kv_cache_block_bytes{executor,dtype}`` (the executor's blocks,
  their dtype, and the device bytes of one over every layer),
  ``pagedkv_num_running_requests``, ``pagedkv_num_waiting_requests``;
* counters: ``pagedkv_prefix_cache_queries_total{executor}`` and
  ``pagedkv_prefix_cache_hits_total{executor}`` (both in tokens),
  ``pagedkv_preemptions_total``, ``pagedkv_requests_finished_total{finish_reason}``,
  ``pagedkv_prompt_tokens_total``, ``pagedkv_generation_tokens_total``,
  ``pagedkv_internal_errors_total``, ``pagedkv_executors_down_total{executor,cause}``,
  ``pagedkv_executor_recoveries_total{executor}``,
  ``pagedkv_placement_hints_total{outcome}`` (honoured, not_held, draining);
* histograms (seconds): ``pagedkv_step_seconds{executor}``,
  ``pagedkv_time_to_first_token_seconds``, ``pagedkv_inter_token_latency_seconds``,
  ``pagedkv_event_loop_lag_seconds`` (how late the event loop woke a task
  that asked to wake every 0.1 s: ``pagedkv.common.loop_lag``);
* with a cluster (``watch_cluster``), read at scrape time:
  ``pagedkv_cluster_degraded`` (1 while Redis cannot be reached),
  ``pagedkv_cluster_leases_held``, and counters
  ``pagedkv_cluster_rounds_total``, ``pagedkv_cluster_redis_errors_total``,
  ``pagedkv_prefix_mirror_flushes_total``, ``pagedkv_prefix_mirror_redis_ops_total``,
  ``pagedkv_prefix_mirror_errors_total``, ``pagedkv_prefix_mirror_resyncs_total``;
* with a host tier, its own (host_metrics.py).

Counters and histograms also expose prometheus_client's ``_created``
samples (unless the process disabled them; the inter-token latency, a
``BulkHistogram`` of our own that takes many equal gaps in one call, always
does).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from threading import Thread
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedkv.common.loop_lag import LAG_BUCKETS
from pagedkv.common.ports import listening
from pagedkv.scheduler.histogram import BulkHistogram
from pagedkv.scheduler.host_metrics import HostTierMetrics
from pagedkv.v1 import scheduler_pb2

STEP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Edges of one scheduler step (schedule, executor forward, sampling): a
decode step takes milliseconds to tens of them, a long prefill chunk up to
seconds."""

TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""Edges from arrival to the first output token: queueing plus prefill, up to
tens of seconds under load."""

INTER_TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Edges between consecutive output tokens of one request: about a decode
step, longer when prefills share the step or the request was preempted."""


class MirrorCounts(Protocol):
    @property
    def num_flushes(self) -> int: ...
    @property
    def num_ops(self) -> int: ...
    @property
    def num_errors(self) -> int: ...
    @property
    def num_resyncs(self) -> int: ...


class ClusterSource(Protocol):
    """What the cluster metrics read (``ClusterMember``)."""

    @property
    def degraded(self) -> str | None: ...
    @property
    def held(self) -> Sized: ...
    @property
    def num_rounds(self) -> int: ...
    @property
    def num_redis_errors(self) -> int: ...
    @property
    def mirror(self) -> MirrorCounts: ...


class _ClusterCollector(Collector):
    """Reads the cluster member's state at each scrape (plain attribute reads)."""

    def __init__(self, source: ClusterSource) -> None:
        self.source = source

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        source, mirror = self.source, self.source.mirror
        yield GaugeMetricFamily(
            "pagedkv_cluster_degraded",
            "1 while Redis cannot be reached (serving what is held, claiming nothing).",
            value=float(source.degraded is not None),
        )
        yield GaugeMetricFamily(
            "pagedkv_cluster_leases_held",
            "Executor leases this scheduler holds.",
            value=len(source.held),
        )
        counters = (
            ("pagedkv_cluster_rounds", "Member rounds run (heartbeat, renewals, claims).",
             source.num_rounds),
            ("pagedkv_cluster_redis_errors", "Member rounds that failed on Redis.",
             source.num_redis_errors),
            ("pagedkv_prefix_mirror_flushes", "Prefix-mirror pipelines written.",
             mirror.num_flushes),
            ("pagedkv_prefix_mirror_redis_ops", "Redis commands the prefix mirror sent.",
             mirror.num_ops),
            ("pagedkv_prefix_mirror_errors", "Prefix-mirror flushes that failed.",
             mirror.num_errors),
            ("pagedkv_prefix_mirror_resyncs", "Full prefix-mirror snapshots written.",
             mirror.num_resyncs),
        )  # fmt: skip
        for name, documentation, value in counters:
            yield CounterMetricFamily(name, documentation, value=value)


class SchedulerMetrics:
    """The scheduler's metrics in a registry of their own.

    Recording methods only update this object's metrics. ``count_*`` and
    ``add_*`` take increments; ``set_prefix_cache`` and ``set_preemptions``
    take a source's running totals and count their growth (use one style per
    metric: both add to the same counter). Call from one thread (the
    ``set_*`` totals are remembered unlocked). Arguments come from the
    scheduler itself, so out-of-range values are asserted, not reported to a
    caller.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        """The registry holding exactly this object's metrics."""
        self._servers: list[tuple[WSGIServer, Thread]] = []
        self._last_prefix_totals: dict[str, tuple[int, int]] = {}
        self._last_preemptions = 0
        r = self.registry
        self._kv_cache_usage = Gauge(
            "pagedkv_kv_cache_usage",
            "Fraction of the executor's KV cache blocks in use (0..1).",
            ["executor"],
            registry=r,
        )
        self._kv_cache_blocks = Gauge(
            "pagedkv_kv_cache_blocks",
            "The executor's KV cache blocks (the null block included), by their dtype.",
            ["executor", "dtype"],
            registry=r,
        )
        self._kv_cache_block_bytes = Gauge(
            "pagedkv_kv_cache_block_bytes",
            "Device bytes of one of the executor's KV blocks over every layer, K and V.",
            ["executor", "dtype"],
            registry=r,
        )
        self._placement_hints = Counter(
            "pagedkv_placement_hints",
            "Requests that named an executor (a router's hint), by outcome "
            "(honoured, not_held, draining).",
            ["outcome"],
            registry=r,
        )
        self._num_running = Gauge(
            "pagedkv_num_running_requests", "Requests running (holding KV blocks).", registry=r
        )
        self._num_waiting = Gauge(
            "pagedkv_num_waiting_requests",
            "Requests waiting to be scheduled, preempted ones included.",
            registry=r,
        )
        self._prefix_queries = Counter(
            "pagedkv_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            ["executor"],
            registry=r,
        )
        self._prefix_hits = Counter(
            "pagedkv_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (their KV reused).",
            ["executor"],
            registry=r,
        )
        self._preemptions = Counter(
            "pagedkv_preemptions", "Requests preempted (KV blocks freed).", registry=r
        )
        self._finished = Counter(
            "pagedkv_requests_finished",
            "Requests finished, by reason (stop, length, abort, error).",
            ["finish_reason"],
            registry=r,
        )
        self._prompt_tokens = Counter(
            "pagedkv_prompt_tokens", "Prompt tokens of admitted requests.", registry=r
        )
        self._generation_tokens = Counter(
            "pagedkv_generation_tokens", "Output tokens generated.", registry=r
        )
        self._step_seconds = Histogram(
            "pagedkv_step_seconds",
            "Duration of one scheduler step on an executor.",
            ["executor"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self._time_to_first_token = Histogram(
            "pagedkv_time_to_first_token_seconds",
            "Time from a request's arrival to its first output token.",
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS,
            registry=r,
        )
        self._internal_errors = Counter(
            "pagedkv_internal_errors",
            "Errors in the scheduler's own code (each failed the requests it concerned).",
            registry=r,
        )
        self._executors_down = Counter(
            "pagedkv_executors_down",
            "Executors marked down, by cause (transport, timeout, fenced).",
            ["executor", "cause"],
            registry=r,
        )
        self._executor_recoveries = Counter(
            "pagedkv_executor_recoveries",
            "Executors taken back after being marked down.",
            ["executor"],
            registry=r,
        )
        self._event_loop_lag = Histogram(
            "pagedkv_event_loop_lag_seconds",
            "How late the event loop ran a task due every 0.1 s.",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.host_tier = HostTierMetrics(r)
        # Observed per generation per step, k at once from a decode window.
        self._inter_token_latency = BulkHistogram(
            "pagedkv_inter_token_latency_seconds",
            "Time between consecutive output tokens of a request.",
            INTER_TOKEN_LATENCY_BUCKETS,
            r,
        )

    # --- gauges ------------------------------------------------------------------

    def set_queue_sizes(self, running: int, waiting: int) -> None:
        """Set the numbers of running and waiting requests."""
        assert running >= 0 and waiting >= 0, (running, waiting)
        self._num_running.set(running)
        self._num_waiting.set(waiting)

    def set_kv_usage(self, executor: str, fraction: float) -> None:
        """Set the fraction (0..1) of ``executor``'s KV blocks in use."""
        assert 0.0 <= fraction <= 1.0, fraction
        self._kv_cache_usage.labels(executor).set(fraction)

    def set_kv_blocks(self, executor: str, dtype: str, num_blocks: int, block_bytes: int) -> None:
        """Set ``executor``'s KV blocks: their count, dtype and bytes each."""
        self._kv_cache_blocks.labels(executor, dtype).set(num_blocks)
        self._kv_cache_block_bytes.labels(executor, dtype).set(block_bytes)

    # --- counters ----------------------------------------------------------------

    def add_prefix_cache(self, executor: str, queries: int, hits: int) -> None:
        """Count ``queries`` prompt tokens looked up on ``executor``, ``hits`` of them found."""
        assert 0 <= hits <= queries, (queries, hits)
        self._prefix_queries.labels(executor).inc(queries)
        self._prefix_hits.labels(executor).inc(hits)

    def set_prefix_cache(self, executor: str, queries: int, hits: int) -> None:
        """Advance ``executor``'s prefix-cache counters to the source's running totals.

        For a source that keeps its own totals (``KVCacheManager.prefix_cache_stats``):
        counts the growth since the totals last given for ``executor``. Totals
        smaller than those mean the source restarted (a new KV cache manager):
        they count in full, and the exposed counters keep growing.
        """
        assert 0 <= hits <= queries, (queries, hits)
        last_queries, last_hits = self._last_prefix_totals.get(executor, (0, 0))
        if queries < last_queries or hits < last_hits:
            last_queries, last_hits = 0, 0
        self._last_prefix_totals[executor] = (queries, hits)
        self.add_prefix_cache(executor, queries - last_queries, hits - last_hits)

    def count_preemption(self, num: int = 1) -> None:
        """Count ``num`` preempted requests."""
        assert num >= 0, num
        self._preemptions.inc(num)

    def set_preemptions(self, total: int) -> None:
        """Advance the preemption counter to the source's running ``total``.

        Counts the growth since the total last given; a smaller total means
        the source restarted and counts in full.
        """
        assert total >= 0, total
        last = self._last_preemptions if total >= self._last_preemptions else 0
        self._last_preemptions = total
        self.count_preemption(total - last)

    def count_finished(self, reason: str) -> None:
        """Count one finished request under ``reason`` (stop, length, abort, error)."""
        self._finished.labels(reason).inc()

    def count_internal_error(self) -> None:
        """Count one error in the scheduler's own code."""
        self._internal_errors.inc()

    def count_executor_down(self, executor: str, cause: str) -> None:
        """Count an executor marked down for ``cause``."""
        self._executors_down.labels(executor=executor, cause=cause).inc()

    def count_recovery(self, executor: str) -> None:
        """Count an executor taken back after it was down."""
        self._executor_recoveries.labels(executor=executor).inc()

    def count_placement_hint(self, hint: int) -> None:
        """Count a request's placement hint outcome (nothing for requests
        without a hint)."""
        if hint != scheduler_pb2.PLACEMENT_HINT_NONE:
            name = scheduler_pb2.PlacementHint.Name(hint)
            self._placement_hints.labels(name.removeprefix("PLACEMENT_HINT_").lower()).inc()

    def count_tokens(self, prompt: int, generated: int) -> None:
        """Count ``prompt`` admitted prompt tokens and ``generated`` output tokens."""
        assert prompt >= 0 and generated >= 0, (prompt, generated)
        self._prompt_tokens.inc(prompt)
        self._generation_tokens.inc(generated)

    # --- histograms --------------------------------------------------------------

    def observe_step(self, executor: str, seconds: float) -> None:
        """Record one step of ``executor`` that took ``seconds``."""
        self._step_seconds.labels(executor).observe(seconds)

    def observe_first_token(self, seconds: float) -> None:
        """Record a request's time from arrival to its first output token."""
        self._time_to_first_token.observe(seconds)

    def observe_inter_token(self, seconds: float, count: int = 1, requests: int = 1) -> None:
        """Record the time between two consecutive output tokens of a
        request; ``count`` tokens that came together after ``seconds`` (a
        decode window's) are ``count`` gaps of ``seconds / count``; the same
        for each of ``requests`` requests."""
        self._inter_token_latency.observe(seconds / count, count * requests)

    def observe_loop_lag(self, seconds: float) -> None:
        """Record how late the event loop ran a task that was due."""
        self._event_loop_lag.observe(seconds)

    def watch_cluster(self, source: ClusterSource) -> None:
        """Exposes the cluster member's state (read at each scrape)."""
        self.registry.register(_ClusterCollector(source))

    # --- exposition --------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text exposition (format 0.0.4) of this registry."""
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve this registry over HTTP on ``host:port`` in a daemon thread.

        Port 0 picks a free port. Returns the port bound (prometheus_client
        >= 0.17 returns its server, which knows it). Scrape ``/metrics``.
        The server runs until
        ``close`` or the process ends; ListenError (``--metrics-port``) if
        the port cannot be had.
        """
        with listening("--metrics-port", host, port):
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._servers.append((server, thread))
        return int(server.server_port)

    def close(self) -> None:
        """Stop every server ``serve`` started and release their ports."""
        while self._servers:
            server, thread = self._servers.pop()
            server.shutdown()
            server.server_close()
            thread.join()
