"""The host tier's metadata in the block core: offload on eviction, host hits
loaded into fresh blocks in the same step, LRU eviction with pins, the
integrity audit and the step messages that carry the copies."""

from __future__ import annotations

from pagedkv.common.ids import BlockHash, BlockId
from pagedkv.scheduler.host_tier import HostCopy, HostHit, HostTier
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.step_message import StepPlan, encode_step
from pagedkv.v1 import common_pb2
from tests.scheduler.factories import BLOCK_SIZE, admit, full_spec, window_spec


def h(name: str) -> BlockHash:
    return BlockHash(name.encode())


def offload(tier: HostTier, block_id: int, name: str) -> None:
    """One cached GPU block's offload (``HostTier.offload_all`` of one)."""
    tier.offload_all(((BlockId(block_id), h(name)),))


def copy(block_id: int, host_id: int) -> HostCopy:
    return HostCopy(BlockId(block_id), host_id)


def tiered(num_blocks: int, num_host_blocks: int) -> KVCacheManager:
    return KVCacheManager(
        [full_spec()], num_blocks, model_id="test-model", num_host_blocks=num_host_blocks
    )


def run(kv: KVCacheManager, seq_id: str, tokens: range) -> tuple[int, tuple[list[HostCopy], ...]]:
    """Admits, 'computes' and frees a request in one step, then sends the
    step: its hit length and the step's (offloads, loads)."""
    request = kv.make_request(seq_id, tokens)
    hit = admit(kv, request)
    copies = kv.take_host_copies()
    kv.free(request)
    assert kv.check_integrity().ok, kv.check_integrity().errors
    return hit, copies


def test_an_evicted_prefix_is_offloaded_then_loaded_back_into_fresh_blocks() -> None:
    kv = tiered(num_blocks=5, num_host_blocks=8)  # 4 usable GPU blocks
    prompt = range(100, 113)  # 3 full blocks + 1 token
    assert run(kv, "a", prompt) == (0, ([], []))
    # Another request needs every GPU block: a's three cached blocks are evicted.
    hit, (offloads, loads) = run(kv, "b", range(200, 216))
    assert hit == 0 and not loads
    assert sorted(c.block_id for c in offloads) == [1, 2, 3]
    assert sorted(c.host_id for c in offloads) == [0, 1, 2]
    # a again: its three blocks are host hits, each loaded into a fresh block.
    request = kv.make_request("a2", prompt)
    computed = kv.get_computed_blocks(request)
    assert computed.num_tokens == 3 * BLOCK_SIZE
    # (The tail block was evicted, and offloaded, first: it is the host's
    # least recently used, so a prefix's head outlives its tail there too.)
    assert computed.blocks == ((),) and [h.host_id for h in computed.host] == [2, 1, 0]
    assert kv.allocate_slots(request, request.num_tokens - computed.num_tokens, computed)
    assert request.num_computed_tokens == 12
    table = kv.get_block_ids(request.seq_id)[0]
    offloads, loads = kv.take_host_copies()
    assert loads == [HostCopy(table[i], 2 - i) for i in range(3)]
    # b's blocks were evicted for them: offloaded first (the executor runs
    # offloads before loads), into host blocks no load reads.
    assert {c.host_id for c in offloads}.isdisjoint({0, 1, 2})
    assert kv.check_integrity().ok
    stats = kv.prefix_cache_stats
    assert stats.hits == 12 and stats.host_hits == 12
    # The loaded blocks are GPU hits from now on.
    kv.free(request)
    assert run(kv, "a3", prompt)[0] == 12
    assert kv.host is not None and kv.host.stats.num_loaded == 3


def test_a_hash_already_on_the_host_is_not_offloaded_again() -> None:
    kv = tiered(num_blocks=5, num_host_blocks=8)
    prompt = range(100, 113)
    run(kv, "a", prompt)
    run(kv, "b", range(200, 216))  # evicts a's blocks to the host
    run(kv, "a2", prompt)  # loads them back
    _, (offloads, _) = run(kv, "c", range(300, 316))  # evicts them again
    assert offloads == []  # their hashes are on the host already
    assert kv.host is not None
    assert kv.host.stats.num_offloaded == 3 + 4  # a's three, then b's four
    assert kv.host.stats.num_cached == 7


def test_the_least_recently_used_host_block_is_reused_first_but_never_a_pinned_one() -> None:
    tier = HostTier(2)
    offload(tier, 1, "h1")
    offload(tier, 2, "h2")
    tier.take_copies()
    hits = tier.find([h("h1")], 0, 1)
    assert hits == [HostHit(h("h1"), 0)]
    tier.pin(hits)
    offload(tier, 3, "h3")  # h1 is pinned: h2's block is taken
    tier.load(hits, [BlockId(4)])
    assert h("h1") in tier and h("h2") not in tier and h("h3") in tier
    offloads, loads = tier.take_copies()
    assert offloads == [copy(3, 1)] and loads == [copy(4, 0)]
    assert tier.check_integrity() == []
    tier.pin(tier.find([h("h1")], 0, 1))
    tier.pin(tier.find([h("h3")], 0, 1))
    offload(tier, 5, "h5")  # every host block pinned: dropped
    assert h("h5") not in tier
    assert tier.stats.num_evicted == 1


def test_a_full_tier_whose_oldest_blocks_are_pinned_offloads_into_the_next_oldest() -> None:
    tier = HostTier(6)
    tier.offload_all((BlockId(i), h(f"h{i}")) for i in range(1, 7))  # h1 oldest
    tier.take_copies()
    hits = tier.find([h("h1"), h("h2"), h("h3")], 0, 3)
    tier.pin(hits)  # the three oldest: an eviction must pass them
    tier.offload_all([(BlockId(4), h("h4")), (BlockId(7), h("h7")), (BlockId(8), h("h8"))])
    # h4 offloaded again only becomes the most recently used; h5 and h6 go.
    assert [h(f"h{i}") in tier for i in range(1, 9)] == [True] * 4 + [False] * 2 + [True] * 2
    tier.load(hits, [BlockId(11), BlockId(12), BlockId(13)])
    order = [block_hash for block_hash, _ in tier.cached()]
    assert order == [h("h4"), h("h7"), h("h8"), h("h1"), h("h2"), h("h3")]
    offloads, loads = tier.take_copies()
    assert offloads == [copy(7, 4), copy(8, 5)]
    assert loads == [copy(11, 0), copy(12, 1), copy(13, 2)]
    assert tier.stats.num_evicted == 2 and tier.check_integrity() == []


def test_a_block_cached_in_the_step_not_yet_sent_is_not_offloaded() -> None:
    kv = tiered(num_blocks=5, num_host_blocks=8)
    request = kv.make_request("a", range(100, 113))
    admit(kv, request)
    kv.free(request)  # preempted in the step that scheduled it: never computed
    other = kv.make_request("b", range(200, 216))
    admit(kv, other)
    offloads, _ = kv.take_host_copies()
    assert offloads == []
    assert kv.host is not None and kv.host.stats.num_cached == 0


def test_the_audit_finds_a_leaked_host_block() -> None:
    tier = HostTier(3)
    offload(tier, 1, "h1")
    tier._free.pop()  # a block neither free nor indexed
    assert any("leaked" in error for error in tier.check_integrity())


def test_the_audit_names_a_host_block_both_free_and_indexed_and_one_out_of_range() -> None:
    tier = HostTier(3)
    offload(tier, 1, "h1")
    assert tier.check_integrity() == []
    host_id = tier._index[h("h1")]
    tier._free.append(host_id)  # indexed and free at once
    errors = tier.check_integrity()
    assert any(f"host block {host_id}: free and hash" in error for error in errors)
    tier._free.remove(host_id)
    tier._free[0] = 7  # a free block beyond the tier
    assert any("out of range" in error for error in tier.check_integrity())


def test_without_one_full_attention_group_or_caching_there_is_no_tier() -> None:
    hybrid = KVCacheManager([full_spec(), window_spec(8)], 9, num_host_blocks=4)
    assert hybrid.host is None
    uncached = KVCacheManager([full_spec()], 9, enable_caching=False, num_host_blocks=4)
    assert uncached.host is None
    assert uncached.take_host_copies() == ([], [])


def test_reset_prefix_cache_forgets_the_host_tier_too() -> None:
    kv = tiered(num_blocks=5, num_host_blocks=8)
    run(kv, "a", range(100, 113))
    run(kv, "b", range(200, 216))
    assert kv.host is not None and kv.host.stats.num_cached
    assert kv.reset_prefix_cache()
    assert kv.host.stats.num_cached == 0 and kv.check_integrity().ok


def test_the_copies_go_in_the_first_message() -> None:
    owner = common_pb2.Owner()
    plan = StepPlan.start(7, [], [], [])
    plan.offloads = [copy(3, 0), copy(4, 1)]
    plan.loads = [copy(5, 1)]
    before, message = encode_step(owner, plan)
    assert before == ()
    assert list(message.offload_block_ids) == [3, 4]
    assert list(message.offload_host_block_ids) == [0, 1]
    assert list(message.load_host_block_ids) == [1]
    assert list(message.load_block_ids) == [5]


def test_blocks_are_written_through_in_the_step_after_the_one_that_filled_them() -> None:
    kv = tiered(num_blocks=9, num_host_blocks=8)
    request = kv.make_request("a", range(100, 113))  # three full blocks
    admit(kv, request)
    assert kv.take_host_copies() == ([], [])  # their step is being sent: not computed yet
    offloads, loads = kv.take_host_copies()  # the next step: they are
    assert sorted(c.block_id for c in offloads) == kv.get_block_ids(request.seq_id)[0][:3]
    assert not loads
    kv.free(request)
    # Evicted later (b takes every block), they need no copy: the host has
    # their hashes. (b's own blocks go in the step after b's.)
    assert run(kv, "b", range(200, 232)) == (0, ([], []))
    assert kv.host is not None and kv.host.stats.num_offloaded == 3
    assert kv.check_integrity().ok


def test_without_write_through_a_block_goes_to_the_host_when_evicted() -> None:
    kv = KVCacheManager([full_spec()], 9, model_id="m", num_host_blocks=8, host_write_through=False)
    request = kv.make_request("a", range(100, 113))  # three full blocks
    admit(kv, request)
    assert kv.take_host_copies() == ([], [])
    assert kv.take_host_copies() == ([], [])  # computed by now, still not copied
    blocks = kv.get_block_ids(request.seq_id)[0][:3]
    kv.free(request)
    _, (offloads, loads) = run(kv, "b", range(200, 232))  # b takes every block: a's go
    assert sorted(c.block_id for c in offloads) == sorted(blocks) and not loads
    hit, (_, loads) = run(kv, "a2", range(100, 113))
    assert hit == 12 and len(loads) == 3  # back from the host
    assert kv.check_integrity().ok


def test_every_change_to_the_host_index_is_an_event() -> None:
    tier = HostTier(2)
    offload(tier, 1, "h1")
    offload(tier, 2, "h2")
    offload(tier, 3, "h3")  # takes h1's host block 0
    tier.take_copies()
    tier.clear()
    events = [(e.kind.name, e.block_id, e.block_hash) for e in tier.take_events()]
    assert events == [
        ("STORED", 0, h("h1")),
        ("STORED", 1, h("h2")),
        ("REMOVED", 0, h("h1")),
        ("STORED", 0, h("h3")),
        ("REMOVED", 1, h("h2")),
        ("REMOVED", 0, h("h3")),
    ]
    assert tier.take_events() == []


def test_a_takeover_adopts_the_listed_host_blocks() -> None:
    from pagedkv.scheduler.cache_events import CacheEvent, CacheEventKind

    stored = CacheEventKind.STORED
    tier = HostTier(4)
    listed = [
        CacheEvent(stored, BlockId(2), h("h2"), 0),
        CacheEvent(stored, BlockId(0), h("h0"), 0),
        CacheEvent(stored, BlockId(7), h("h7"), 0),  # out of range
        CacheEvent(stored, BlockId(1), h("h1"), 1),  # another group
        CacheEvent(stored, BlockId(0), h("hx"), 0),  # host block 0 again
    ]
    assert tier.adopt(listed) == 2
    assert tier.cached() == [(h("h2"), 2), (h("h0"), 0)]
    assert tier.check_integrity() == []
    assert [e.block_id for e in tier.take_events()] == [2, 0]
    offload(tier, 5, "h5")  # the lowest free host block: 1 (0 and 2 adopted)
    offloads, _ = tier.take_copies()
    assert offloads == [copy(5, 1)]


def test_the_measured_costs_choose_load_or_recompute_per_request() -> None:
    from pagedkv.scheduler.host_tier import LoadCosts

    # A load: 1 ms fixed + 0.1 ms a block; a token's prefill 0.01 ms, so a
    # block of 4 tokens computes in 0.04 ms: a load never pays, and the
    # tier is not kept.
    assert LoadCosts(1e-5, 1e-3, 1e-4).loads_never_pay(BLOCK_SIZE)
    slow = KVCacheManager(
        [full_spec()], 5, model_id="m", num_host_blocks=8, host_costs=LoadCosts(1e-5, 1e-3, 1e-4)
    )
    assert slow.host is None
    # 0.01 ms a block and 1 ms fixed against 0.04 ms a block computed: a
    # hit of 3 blocks is recomputed (1.03 ms > 0.12 ms), one of 40 loaded.
    costs = LoadCosts(1e-5, 1e-3, 1e-5)
    assert not costs.load_pays(3, BLOCK_SIZE) and costs.load_pays(40, BLOCK_SIZE)
    kv = KVCacheManager(
        [full_spec()], 5, model_id="test-model", num_host_blocks=8, host_costs=costs
    )
    prompt = range(100, 113)
    run(kv, "a", prompt)
    run(kv, "b", range(200, 216))  # a's three blocks go to the host
    request = kv.make_request("a2", prompt)
    computed = kv.get_computed_blocks(request)
    assert computed.num_tokens == 0 and computed.host == ()  # recomputed
    assert kv.host is not None and kv.host.stats.num_recomputes_chosen == 1
    assert LoadCosts().load_pays(1, BLOCK_SIZE)  # unmeasured: always load


def test_host_loads_always_or_never_overrides_the_measured_costs() -> None:
    from pagedkv.scheduler.host_tier import LoadCosts

    # Costs under which a load never pays: "auto" keeps no tier, "always"
    # keeps one and loads every hit.
    never_pays = LoadCosts(1e-5, 1e-3, 1e-4)
    prompt = range(100, 113)
    for loads, tier, want_host in (("auto", False, 0), ("always", True, 3), ("never", True, 0)):
        costs = never_pays if loads != "never" else LoadCosts(1e-5, 0.0, 1e-7)
        kv = KVCacheManager(
            [full_spec()],
            5,
            model_id="m",
            num_host_blocks=8,
            host_costs=costs,
            host_loads=loads,
        )
        assert (kv.host is not None) == tier, loads
        if kv.host is None:
            continue
        run(kv, "a", prompt)
        run(kv, "b", range(200, 216))  # a's three blocks go to the host
        computed = kv.get_computed_blocks(kv.make_request("a2", prompt))
        assert len(computed.host) == want_host, loads
        stats = kv.host.stats
        assert (stats.num_loads_chosen, stats.num_recomputes_chosen) == (
            (1, 0) if want_host else (0, 1)
        )


def test_an_unknown_host_loads_setting_is_refused_naming_it() -> None:
    import pytest

    with pytest.raises(ValueError, match="host_loads"):
        HostTier(4, loads="sometimes")


def test_the_cli_s_host_loads_reaches_the_config_and_a_bad_one_is_refused() -> None:
    import pytest

    from pagedkv.common.cli import build_parser
    from pagedkv.scheduler.server import config_from_args

    parser = build_parser()
    args = parser.parse_args(["scheduler", "--executor", "127.0.0.1:1"])
    assert config_from_args(args, ["127.0.0.1:1"]).host_loads == "auto"
    for command in ("scheduler", "serve"):
        model = [] if command == "scheduler" else ["--model", "m"]
        argv = [command, "--executor", "127.0.0.1:1", *model, "--host-loads", "never"]
        if command == "serve":
            argv.remove("--executor")
            argv.remove("127.0.0.1:1")
        assert parser.parse_args(argv).host_loads == "never"
    with pytest.raises(SystemExit):
        parser.parse_args(["scheduler", "--executor", "127.0.0.1:1", "--host-loads", "maybe"])


def test_a_request_that_waits_for_blocks_counts_one_lookup_once_admitted() -> None:
    """The scheduler looks a waiting request up every step; the prefix-cache
    stats count it once, when it is admitted."""
    from pagedkv.v1 import executor_pb2
    from tests.scheduler.stepping import add_generation, live_scheduler, run_to_end

    def respond(message: executor_pb2.StepRequest) -> executor_pb2.StepResponse:
        rows = [r.row for r in message.new_requests] + list(message.rows)
        sampled = [row for row, needs in zip(rows, message.needs_sample, strict=True) if needs]
        return executor_pb2.StepResponse(
            step_id=message.step_id,
            sampled_rows=sampled,
            sampled_token_ids=[7] * len(sampled),
            sampled_logprobs=[-0.1] * len(sampled),
            num_top_logprobs=[0] * len(sampled),
        )

    scheduler = live_scheduler(10, 4, max_num_batched_tokens=512)  # 9 usable blocks
    prompt = list(range(10, 10 + 16 * 6))  # 6 blocks each: one request at a time
    first = add_generation(scheduler, "first", prompt, 8, key=1)
    second = add_generation(scheduler, "second", [t + 200 for t in prompt], 8, key=2)
    sent = run_to_end(scheduler, [first, second], respond, depth=1)
    assert len(sent) > 4  # the second waited while the first decoded
    stats = scheduler.kv.prefix_cache_stats
    assert (stats.requests, stats.queries) == (2, 2 * len(prompt))
