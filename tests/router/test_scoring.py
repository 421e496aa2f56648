"""Routing policies: the kv policy prefers cached prefixes until load
outweighs them or an executor would pass the load bound; ties rotate; the
baselines ignore the cache."""

from __future__ import annotations

from collections import Counter

import pytest

from pagedkv.router.scoring import (
    Candidate,
    KVAwarePolicy,
    LeastLoadedPolicy,
    RoundRobinPolicy,
    RoutingWeights,
    make_policy,
)


def candidate(name: str, queued: float = 0.0, usage: float = 0.0) -> Candidate:
    return Candidate(f"{name}:1", name, f"s-{name}", queued, usage)


def test_kv_prefers_the_executor_holding_the_longest_prefix() -> None:
    policy = KVAwarePolicy()
    ranked = policy.rank([candidate("a"), candidate("b"), candidate("c")], {"b": 4, "c": 2}, 8)
    assert [c.candidate.incarnation_id for c in ranked] == ["b", "c", "a"]
    assert [c.cached_blocks for c in ranked] == [4, 2, 0]
    assert ranked[0].score == pytest.approx(0.5)


def test_kv_gives_a_hot_prefix_up_when_its_holder_is_far_above_the_mean() -> None:
    policy = KVAwarePolicy(RoutingWeights(prefix=1.0, load=2.0, kv_usage=0.0))
    # Mean queued 4: the holder loses once it runs more than (4 + 1) / 2
    # above the least loaded.
    near = [candidate("hot", 5), candidate("cold", 4), candidate("x", 3), candidate("y", 4)]
    assert policy.rank(near, {"hot": 8}, 8)[0].candidate.incarnation_id == "hot"
    far = [candidate("hot", 8), candidate("cold", 2), candidate("x", 3), candidate("y", 3)]
    assert policy.rank(far, {"hot": 8}, 8)[0].candidate.incarnation_id == "cold"


def test_kv_ranks_an_executor_over_the_load_bound_last_whatever_it_caches() -> None:
    policy = KVAwarePolicy(RoutingWeights(load_bound=1.5, load_slack=0.0))
    # 12 queued over 4 executors: with this request the mean is 13 / 4, the
    # bound ceil(1.5 * 13 / 4) = 5, so the holder at 4 may take it.
    under = [candidate("hot", 4), candidate("a", 3), candidate("b", 3), candidate("c", 2)]
    ranked = policy.rank(under, {"hot": 8}, 8)
    assert ranked[0].candidate.incarnation_id == "hot"
    assert not any(c.over_bound for c in ranked)
    # At 5 it would pass the bound: the least loaded executor without the
    # prefix goes first, the holder last.
    over = [candidate("hot", 5), candidate("a", 3), candidate("b", 2), candidate("c", 2)]
    ranked = policy.rank(over, {"hot": 8}, 8)
    assert [c.candidate.incarnation_id for c in ranked][-1] == "hot"
    assert ranked[-1].over_bound
    assert ranked[0].candidate.incarnation_id in ("b", "c")


def test_the_load_slack_keeps_a_prefix_together_at_small_loads() -> None:
    # 3 queued over 3 executors: with this request the mean is 4 / 3; 1.5 x
    # the mean is 2, the mean plus the slack of 4 makes the bound 6, so the
    # holder at 3 takes the request.
    policy = KVAwarePolicy()  # bound 1.5, slack 4
    loads = {"hot": 3.0, "a": 0.0, "b": 0.0}
    ranked = policy.rank([candidate(n, q) for n, q in loads.items()], {"hot": 4}, 4)
    assert ranked[0].candidate.incarnation_id == "hot"
    # Without the slack, 1.5 x the mean alone sends it elsewhere.
    tight = KVAwarePolicy(RoutingWeights(load_slack=0.0))
    ranked = tight.rank([candidate(n, q) for n, q in loads.items()], {"hot": 4}, 4)
    assert ranked[-1].candidate.incarnation_id == "hot"
    # At 7 (mean 8 / 3, bound ceil(20 / 3) = 7) the holder would pass it.
    loads = {"hot": 7.0, "a": 0.0, "b": 0.0}
    ranked = policy.rank([candidate(n, q) for n, q in loads.items()], {"hot": 4}, 4)
    assert ranked[-1].candidate.incarnation_id == "hot"


def test_kv_weighs_kv_usage() -> None:
    policy = KVAwarePolicy(RoutingWeights(prefix=1.0, load=0.0, kv_usage=0.5))
    ranked = policy.rank([candidate("full", usage=0.9), candidate("empty", usage=0.1)], {}, 4)
    assert ranked[0].candidate.incarnation_id == "empty"


def test_ties_rotate_so_identical_requests_spread() -> None:
    policy = KVAwarePolicy()
    candidates = [candidate(n) for n in "abcd"]
    firsts = Counter(policy.rank(candidates, {}, 0)[0].candidate.incarnation_id for _ in range(8))
    assert firsts == {"a": 2, "b": 2, "c": 2, "d": 2}


def test_round_robin_and_least_loaded_ignore_the_cache() -> None:
    candidates = [candidate("a", 3), candidate("b", 1), candidate("c", 2)]
    rr = RoundRobinPolicy()
    firsts = [rr.rank(candidates, {"a": 9}, 9)[0].candidate.incarnation_id for _ in range(3)]
    assert firsts == ["a", "b", "c"]
    ll = LeastLoadedPolicy()
    ranked = ll.rank(candidates, {"a": 9}, 9)
    assert [c.candidate.incarnation_id for c in ranked] == ["b", "c", "a"]
    assert ranked[2].cached_blocks == 9


def test_policies_by_name_and_bad_values_name_the_field() -> None:
    assert isinstance(make_policy("kv"), KVAwarePolicy)
    assert isinstance(make_policy("round-robin"), RoundRobinPolicy)
    assert isinstance(make_policy("least-loaded"), LeastLoadedPolicy)
    with pytest.raises(ValueError, match="policy: 'random'"):
        make_policy("random")
    with pytest.raises(ValueError, match="weight load"):
        RoutingWeights(load=-1.0)
    with pytest.raises(ValueError, match="load bound"):
        RoutingWeights(load_bound=0.9)
    with pytest.raises(ValueError, match="load slack"):
        RoutingWeights(load_slack=-1.0)
    assert make_policy("kv").rank([], {}, 3) == []


def test_kv_counts_a_host_tier_hit_between_a_gpu_hit_and_a_miss() -> None:
    policy = KVAwarePolicy()  # a host block is worth 0.89 of a GPU one
    ranked = policy.rank(
        [candidate("miss"), candidate("host"), candidate("gpu")],
        {"gpu": 8, "host": 2},
        8,
        {"host": 6},
    )
    assert [c.candidate.incarnation_id for c in ranked] == ["gpu", "host", "miss"]
    assert ranked[1].cached_blocks == 2  # GPU blocks, as the hint reports them
    assert ranked[1].score == pytest.approx((2 + 0.89 * 6) / 8)
    no_host = KVAwarePolicy(RoutingWeights(host=0.0))
    assert no_host.rank([candidate("host")], {"host": 2}, 8, {"host": 6})[0].score == 0.25
    with pytest.raises(ValueError, match="weight host"):
        RoutingWeights(host=1.5)
