"""The scheduler's Prometheus metrics: exact samples, HTTP exposition, isolation."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.scheduler.host_tier import HostTierStats
from pagedkv.scheduler.metrics import SchedulerMetrics

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(metrics: SchedulerMetrics) -> Samples:
    """Every sample of ``render()`` but the ``_created`` timestamps, by name and labels."""
    out: Samples = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                out[sample.name, frozenset(sample.labels.items())] = sample.value
    return out


def value(metrics: SchedulerMetrics, name: str, **labels: str) -> float:
    return samples(metrics)[name, frozenset(labels.items())]


@pytest.fixture
def metrics() -> Iterator[SchedulerMetrics]:
    m = SchedulerMetrics()
    yield m
    m.close()


def test_fresh_metrics_expose_zeros_for_unlabelled_series(metrics: SchedulerMetrics) -> None:
    got = samples(metrics)
    assert got[("pagedkv_num_running_requests", frozenset())] == 0
    assert got[("pagedkv_preemptions_total", frozenset())] == 0
    assert got[("pagedkv_time_to_first_token_seconds_count", frozenset())] == 0
    assert not any(name == "pagedkv_kv_cache_usage" for name, _ in got)


def test_gauges_hold_the_last_value_set(metrics: SchedulerMetrics) -> None:
    metrics.set_queue_sizes(running=3, waiting=7)
    metrics.set_queue_sizes(running=4, waiting=2)
    metrics.set_kv_usage("e0", 0.25)
    metrics.set_kv_usage("e1", 1.0)
    metrics.set_kv_usage("e0", 0.5)
    assert value(metrics, "pagedkv_num_running_requests") == 4
    assert value(metrics, "pagedkv_num_waiting_requests") == 2
    assert value(metrics, "pagedkv_kv_cache_usage", executor="e0") == 0.5
    assert value(metrics, "pagedkv_kv_cache_usage", executor="e1") == 1.0
    metrics.set_kv_blocks("e0", "float8_e4m3fn", 2048, 65536)
    assert value(metrics, "pagedkv_kv_cache_blocks", executor="e0", dtype="float8_e4m3fn") == 2048
    labels = {"executor": "e0", "dtype": "float8_e4m3fn"}
    assert value(metrics, "pagedkv_kv_cache_block_bytes", **labels) == 65536


def test_counters_add_up_per_label(metrics: SchedulerMetrics) -> None:
    metrics.add_prefix_cache("e0", queries=64, hits=48)
    metrics.add_prefix_cache("e0", queries=16, hits=0)
    metrics.add_prefix_cache("e1", queries=32, hits=32)
    metrics.count_preemption()
    metrics.count_preemption(2)
    for reason in ("stop", "stop", "length"):
        metrics.count_finished(reason)
    metrics.count_tokens(prompt=100, generated=1)
    metrics.count_tokens(prompt=0, generated=9)
    assert value(metrics, "pagedkv_prefix_cache_queries_total", executor="e0") == 80
    assert value(metrics, "pagedkv_prefix_cache_hits_total", executor="e0") == 48
    assert value(metrics, "pagedkv_prefix_cache_queries_total", executor="e1") == 32
    assert value(metrics, "pagedkv_prefix_cache_hits_total", executor="e1") == 32
    assert value(metrics, "pagedkv_preemptions_total") == 3
    assert value(metrics, "pagedkv_requests_finished_total", finish_reason="stop") == 2
    assert value(metrics, "pagedkv_requests_finished_total", finish_reason="length") == 1
    assert value(metrics, "pagedkv_prompt_tokens_total") == 100
    assert value(metrics, "pagedkv_generation_tokens_total") == 10


def test_histograms_bucket_each_observation(metrics: SchedulerMetrics) -> None:
    for seconds in (0.004, 0.012, 0.012, 3.0):
        metrics.observe_step("e0", seconds)
    metrics.observe_first_token(0.3)
    metrics.observe_first_token(30.0)
    metrics.observe_inter_token(0.02)
    step = {"executor": "e0"}
    assert value(metrics, "pagedkv_step_seconds_count", **step) == 4
    assert value(metrics, "pagedkv_step_seconds_sum", **step) == pytest.approx(3.028)
    assert value(metrics, "pagedkv_step_seconds_bucket", le="0.001", **step) == 0
    assert value(metrics, "pagedkv_step_seconds_bucket", le="0.005", **step) == 1
    assert value(metrics, "pagedkv_step_seconds_bucket", le="0.015", **step) == 3
    assert value(metrics, "pagedkv_step_seconds_bucket", le="2.5", **step) == 3
    assert value(metrics, "pagedkv_step_seconds_bucket", le="5.0", **step) == 4
    assert value(metrics, "pagedkv_step_seconds_bucket", le="+Inf", **step) == 4
    ttft = "pagedkv_time_to_first_token_seconds"
    assert value(metrics, f"{ttft}_bucket", le="0.25") == 0
    assert value(metrics, f"{ttft}_bucket", le="0.5") == 1
    assert value(metrics, f"{ttft}_bucket", le="20.0") == 1
    assert value(metrics, f"{ttft}_bucket", le="40.0") == 2
    assert value(metrics, f"{ttft}_sum") == pytest.approx(30.3)
    itl = "pagedkv_inter_token_latency_seconds"
    assert value(metrics, f"{itl}_bucket", le="0.015") == 0
    assert value(metrics, f"{itl}_bucket", le="0.02") == 1
    assert value(metrics, f"{itl}_count") == 1


def test_tokens_that_came_together_are_as_many_gaps(metrics: SchedulerMetrics) -> None:
    metrics.observe_inter_token(0.08, count=8)  # a decode window's 8 tokens after 80 ms
    itl = "pagedkv_inter_token_latency_seconds"
    assert value(metrics, f"{itl}_count") == 8
    assert value(metrics, f"{itl}_sum") == pytest.approx(0.08)
    assert value(metrics, f"{itl}_bucket", le="0.01") == 8


def test_out_of_range_values_are_internal_errors(metrics: SchedulerMetrics) -> None:
    with pytest.raises(AssertionError):
        metrics.set_kv_usage("e0", 1.5)
    with pytest.raises(AssertionError):
        metrics.add_prefix_cache("e0", queries=4, hits=5)


def test_two_instances_keep_separate_metrics() -> None:
    a, b = SchedulerMetrics(), SchedulerMetrics()
    a.count_preemption()
    a.set_queue_sizes(running=1, waiting=0)
    assert value(a, "pagedkv_preemptions_total") == 1
    assert value(b, "pagedkv_preemptions_total") == 0
    assert value(b, "pagedkv_num_running_requests") == 0
    assert a.registry is not b.registry


def test_serve_on_port_zero_exposes_metrics_over_http(metrics: SchedulerMetrics) -> None:
    metrics.set_kv_usage("e0", 0.75)
    metrics.count_finished("abort")
    port = metrics.serve(0, host="127.0.0.1")
    assert port > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        body = response.read().decode()
    names = {f.name for f in text_string_to_metric_families(body)}
    assert {
        "pagedkv_kv_cache_usage",
        "pagedkv_num_running_requests",
        "pagedkv_num_waiting_requests",
        "pagedkv_prefix_cache_queries",
        "pagedkv_prefix_cache_hits",
        "pagedkv_preemptions",
        "pagedkv_requests_finished",
        "pagedkv_prompt_tokens",
        "pagedkv_generation_tokens",
        "pagedkv_step_seconds",
        "pagedkv_time_to_first_token_seconds",
        "pagedkv_inter_token_latency_seconds",
    } <= names
    assert 'pagedkv_kv_cache_usage{executor="e0"} 0.75' in body
    assert 'pagedkv_requests_finished_total{finish_reason="abort"} 1.0' in body


def test_two_servers_get_different_ports_and_close_releases_them() -> None:
    a, b = SchedulerMetrics(), SchedulerMetrics()
    try:
        a.count_preemption()
        port_a, port_b = a.serve(0, host="127.0.0.1"), b.serve(0, host="127.0.0.1")
        assert port_a != port_b
        with urllib.request.urlopen(f"http://127.0.0.1:{port_b}/metrics", timeout=5) as response:
            assert "pagedkv_preemptions_total 0.0" in response.read().decode()
    finally:
        a.close()
        b.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port_a}/metrics", timeout=5)


def test_running_totals_count_their_growth_and_survive_a_source_restart(
    metrics: SchedulerMetrics,
) -> None:
    metrics.set_prefix_cache("e0", queries=10, hits=4)
    metrics.set_prefix_cache("e0", queries=30, hits=4)
    metrics.set_prefix_cache("e1", queries=5, hits=5)
    metrics.set_prefix_cache("e0", queries=8, hits=2)  # e0's KV cache manager was replaced
    metrics.set_preemptions(2)
    metrics.set_preemptions(2)
    metrics.set_preemptions(5)
    assert value(metrics, "pagedkv_prefix_cache_queries_total", executor="e0") == 38
    assert value(metrics, "pagedkv_prefix_cache_hits_total", executor="e0") == 6
    assert value(metrics, "pagedkv_prefix_cache_queries_total", executor="e1") == 5
    assert value(metrics, "pagedkv_preemptions_total") == 5


@dataclass
class _Mirror:
    num_flushes: int = 0
    num_ops: int = 0
    num_errors: int = 0
    num_resyncs: int = 0


@dataclass
class _Member:
    """The state a cluster member exposes (``ClusterMember``'s attributes)."""

    degraded: str | None = None
    held: dict[str, object] = field(default_factory=dict)
    num_rounds: int = 0
    num_redis_errors: int = 0
    mirror: _Mirror = field(default_factory=_Mirror)


def test_cluster_metrics_are_read_from_the_member_at_each_scrape(
    metrics: SchedulerMetrics,
) -> None:
    member = _Member()
    metrics.watch_cluster(member)
    assert samples(metrics)[("pagedkv_cluster_degraded", frozenset())] == 0.0
    member.degraded = "redis unreachable"
    member.held = {"a:1": object(), "b:2": object()}
    member.num_rounds, member.num_redis_errors = 7, 2
    member.mirror.num_flushes, member.mirror.num_ops = 3, 12
    got = samples(metrics)
    assert got[("pagedkv_cluster_degraded", frozenset())] == 1.0
    assert got[("pagedkv_cluster_leases_held", frozenset())] == 2.0
    assert got[("pagedkv_cluster_rounds_total", frozenset())] == 7.0
    assert got[("pagedkv_cluster_redis_errors_total", frozenset())] == 2.0
    assert got[("pagedkv_prefix_mirror_flushes_total", frozenset())] == 3.0
    assert got[("pagedkv_prefix_mirror_redis_ops_total", frozenset())] == 12.0


def test_the_host_tier_counts_its_totals_growth_and_sets_its_gauges(
    metrics: SchedulerMetrics,
) -> None:
    stats = HostTierStats(
        num_blocks=64,
        num_cached=10,
        num_offloaded=12,
        num_loaded=3,
        num_evicted=2,
        num_loads_chosen=3,
        num_recomputes_chosen=0,
        offload_seconds=0.5,
        load_seconds=0.25,
    )
    per_block = 4096
    metrics.host_tier.set("e0", stats, 48, per_block)
    later = stats._replace(num_cached=11, num_offloaded=13, offload_seconds=0.75)
    metrics.host_tier.set("e0", later, 64, per_block)
    assert value(metrics, "pagedkv_host_kv_blocks", executor="e0") == 64
    assert value(metrics, "pagedkv_host_kv_cached_blocks", executor="e0") == 11
    assert value(metrics, "pagedkv_prefix_cache_host_hits_total", executor="e0") == 64
    assert value(metrics, "pagedkv_host_kv_offloaded_blocks_total", executor="e0") == 13
    assert value(metrics, "pagedkv_host_kv_loaded_blocks_total", executor="e0") == 3
    assert value(metrics, "pagedkv_host_kv_offloaded_bytes_total", executor="e0") == 13 * per_block
    assert value(metrics, "pagedkv_host_kv_loaded_bytes_total", executor="e0") == 3 * per_block
    copy = "pagedkv_host_kv_copy_seconds_total"
    assert value(metrics, copy, executor="e0", direction="offload") == 0.75
    assert value(metrics, copy, executor="e0", direction="load") == 0.25
    # A new tier (the executor taken over again) starts from zero: counted in full.
    fresh = stats._replace(num_offloaded=1, num_loaded=1, offload_seconds=0.0, load_seconds=0.0)
    metrics.host_tier.set("e0", fresh, 16, per_block)
    assert value(metrics, "pagedkv_host_kv_offloaded_blocks_total", executor="e0") == 14
    assert value(metrics, "pagedkv_prefix_cache_host_hits_total", executor="e0") == 80
