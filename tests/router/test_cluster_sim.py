"""The cluster simulation on a small cluster: the policies' behaviour and the block core's state."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.bench.cluster_sim.cluster import ClusterConfig, FailurePlan, RunResult, run_cluster
from pagedkv.bench.cluster_sim.cost_model import RECORDED, StepCostModel, load_measurements
from pagedkv.bench.cluster_sim.trace import TraceConfig, generate
from pagedkv.router.scoring import make_policy

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
CONFIG = ClusterConfig(num_executors=8, num_schedulers=2, num_blocks=2048, window_s=1.5)
TRACE = TraceConfig(rate=8 * 30.0, duration_s=6.0, num_prefixes=16, seed=1)
COST = StepCostModel.from_measurements(RECORDED)


@pytest.fixture(scope="module")
def runs() -> dict[str, RunResult]:
    results = {p: run_cluster(CONFIG, TRACE, make_policy(p), COST) for p in ("kv", "round-robin")}
    results["kv+failure"] = run_cluster(CONFIG, TRACE, make_policy("kv"), COST, FailurePlan(1.5))
    return results


def test_recorded_measurements_are_the_committed_results() -> None:
    assert load_measurements(RESULTS) == RECORDED


def test_step_cost_reproduces_the_measured_decode_step() -> None:
    step_s = COST.step_s(0, 0, RECORDED.decode_batch * RECORDED.decode_context)
    assert step_s == pytest.approx(RECORDED.decode_step_wall_us * 1e-6)
    assert COST.base_s > 0 and COST.prefill_tokens_per_s > 0


def test_the_trace_is_the_same_for_the_same_seed() -> None:
    first = [(r.arrival_s, r.prompt_token_ids) for r in generate(TRACE)]
    assert first == [(r.arrival_s, r.prompt_token_ids) for r in generate(TRACE)]
    assert len(first) > 0.8 * TRACE.rate * TRACE.duration_s


def test_the_kv_policy_computes_fewer_prefill_tokens_than_round_robin(
    runs: dict[str, RunResult],
) -> None:
    kv, rr = runs["kv"].summary, runs["round-robin"].summary
    assert kv.num_prompt_tokens == rr.num_prompt_tokens
    assert kv.num_prefill_tokens < rr.num_prefill_tokens
    assert kv.hit_rate > rr.hit_rate


def test_every_request_finishes_and_every_pool_ends_clean(runs: dict[str, RunResult]) -> None:
    for name, run in runs.items():
        assert run.summary.num_finished == run.summary.num_requests, name
        assert run.integrity_errors == [], name
        assert run.leaked_blocks == 0, name
        assert run.index_mismatches == 0, name


def test_adopted_executors_keep_their_cache(runs: dict[str, RunResult]) -> None:
    failure = runs["kv+failure"].failure
    assert failure is not None
    assert failure.adopted_at_s == pytest.approx(1.5 + CONFIG.lease_ttl_s)
    assert failure.adopted_cached_blocks > 0
    assert failure.num_resumed_jobs > 0
    assert failure.hit_rate_after >= 0.9 * failure.hit_rate_before
    assert (
        failure.adopted_executors_hit_rate_after >= 0.9 * failure.adopted_executors_hit_rate_before
    )
