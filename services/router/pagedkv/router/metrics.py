"""Prometheus metrics of the router, in a registry of its own.

Names (``_total`` on counters as exposed):

* counters: ``pagedkv_router_requests_total{policy}`` (requests routed),
  ``pagedkv_router_decisions_total{kind}`` (``cache_hit``: the chosen
  executor holds part of the prompt; ``cache_miss``: no executor does;
  ``load_over_cache``: another executor held more of it but load won;
  ``no_candidate``: no executor could be scored, a scheduler placed it),
  ``pagedkv_router_prompt_blocks_total`` and
  ``pagedkv_router_cached_blocks_total`` (full prompt blocks, and those the
  index showed cached on the chosen executor),
  ``pagedkv_router_placement_hints_total{outcome}`` (what the schedulers said
  of the hints: honoured, not_held, draining), ``pagedkv_router_retries_total``
  (calls moved to another scheduler before any chunk),
  ``pagedkv_router_index_reloads_total{reason}`` (new, gap, restarted),
  ``pagedkv_router_redis_errors_total``;
* histograms: ``pagedkv_router_kv_event_lag_seconds`` (the age of each KV
  event when the router applied it: its clock minus Redis' at XADD),
  ``pagedkv_router_event_loop_lag_seconds`` (how late the event loop woke a
  task that asked to wake every 0.1 s: ``pagedkv.common.loop_lag``);
* read at scrape time: ``pagedkv_router_indexed_blocks``,
  ``pagedkv_router_followed_executors``, ``pagedkv_router_open_streams``,
  ``pagedkv_router_degraded`` (1 while Redis cannot be read).
"""

from __future__ import annotations

from collections.abc import Iterator
from threading import Thread
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedkv.common.loop_lag import LAG_BUCKETS
from pagedkv.common.ports import listening

_LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RouterSource(Protocol):
    """What the scrape-time gauges read (the router service)."""

    @property
    def num_indexed_blocks(self) -> int: ...
    @property
    def num_followed_executors(self) -> int: ...
    @property
    def num_open_streams(self) -> int: ...
    @property
    def degraded(self) -> str | None: ...


class _RouterCollector(Collector):
    def __init__(self, source: RouterSource) -> None:
        self.source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        source = self.source
        gauges = (
            ("pagedkv_router_indexed_blocks", "Block hashes in the prefix index, all executors.",
             source.num_indexed_blocks),
            ("pagedkv_router_followed_executors", "Executor incarnations whose KV events are "
             "followed.", source.num_followed_executors),
            ("pagedkv_router_open_streams", "Generate streams the router is forwarding.",
             source.num_open_streams),
            ("pagedkv_router_degraded", "1 while Redis cannot be read.",
             float(source.degraded is not None)),
        )  # fmt: skip
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)


class RouterMetrics:
    """The router's metrics; ``count_*`` take increments."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self._requests = Counter(
            "pagedkv_router_requests", "Requests routed, by policy.", ["policy"], registry=r
        )
        self._decisions = Counter(
            "pagedkv_router_decisions",
            "Routing decisions by kind (cache_hit, cache_miss, load_over_cache, no_candidate).",
            ["kind"],
            registry=r,
        )
        self._prompt_blocks = Counter(
            "pagedkv_router_prompt_blocks", "Full prompt blocks of routed requests.", registry=r
        )
        self._cached_blocks = Counter(
            "pagedkv_router_cached_blocks",
            "Of those, blocks the index showed cached on the chosen executor.",
            registry=r,
        )
        self._hints = Counter(
            "pagedkv_router_placement_hints",
            "Placement hints by the scheduler's answer (honoured, not_held, draining).",
            ["outcome"],
            registry=r,
        )
        self._retries = Counter(
            "pagedkv_router_retries",
            "Calls moved to another scheduler before any chunk was forwarded.",
            registry=r,
        )
        self._reloads = Counter(
            "pagedkv_router_index_reloads",
            "Prefix-index reloads from a mirror, by reason (new, gap, restarted).",
            ["reason"],
            registry=r,
        )
        self._redis_errors = Counter(
            "pagedkv_router_redis_errors", "Failed reads of Redis.", registry=r
        )
        self._lag = Histogram(
            "pagedkv_router_kv_event_lag_seconds",
            "Age of each KV event when the router applied it.",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self._event_loop_lag = Histogram(
            "pagedkv_router_event_loop_lag_seconds",
            "How late the event loop ran a task due every 0.1 s.",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self._servers: list[tuple[WSGIServer, Thread]] = []

    def watch(self, source: RouterSource) -> None:
        self.registry.register(_RouterCollector(source))

    def count_request(self, policy: str) -> None:
        self._requests.labels(policy).inc()

    def count_decision(self, kind: str, prompt_blocks: int, cached_blocks: int) -> None:
        self._decisions.labels(kind).inc()
        self._prompt_blocks.inc(prompt_blocks)
        self._cached_blocks.inc(cached_blocks)

    def count_hint(self, outcome: str) -> None:
        self._hints.labels(outcome).inc()

    def count_retry(self) -> None:
        self._retries.inc()

    def count_reload(self, reason: str) -> None:
        self._reloads.labels(reason).inc()

    def count_redis_error(self) -> None:
        self._redis_errors.inc()

    def observe_lag(self, seconds: float) -> None:
        self._lag.observe(seconds)

    def observe_loop_lag(self, seconds: float) -> None:
        self._event_loop_lag.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serves ``/metrics`` on ``host:port`` (0: any free port) in a daemon
        thread; returns the port bound. ListenError (``--metrics-port``) if the
        port cannot be had."""
        with listening("--metrics-port", host, port):
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._servers.append((server, thread))
        return int(server.server_port)

    def close(self) -> None:
        while self._servers:
            server, thread = self._servers.pop()
            server.shutdown()
            server.server_close()
            thread.join()
