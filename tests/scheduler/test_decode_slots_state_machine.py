"""``allocate_decode_slots`` against per-request decoding: two block cores, one request stream.

A hypothesis state machine drives two ``KVCacheManager`` s of one
configuration with the same requests and the same sampled tokens. In the
reference world every decoding request is stepped alone
(``allocate_slots(request, 1)``, then its token); in the decode world the
decoding requests are stepped together, as the scheduler steps them:
``allocate_decode_slots(decoding, start)`` over the running requests in
order, preempting the newest decoding request on a miss and going on from
the request that missed. Admission with prefix hits, chunked prefill,
finishing at max_tokens, aborts and copy-on-write forks happen alike in both
worlds.

After every rule both managers pass their audit and hold the same tables,
free queue (order included), prefix-cache index and lookup stats; the tables
the executor builds from the reported updates equal the manager's; both queue
the same copy-on-write copies; a decode step misses at the same request in
both. Once everything is freed probes hit the same blocks.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedkv.common.ids import NULL_BLOCK_ID, BlockId, SeqId
from pagedkv.scheduler.kv_cache_block import KVCacheBlock
from pagedkv.scheduler.kv_cache_manager import Allocation, KVCacheManager
from pagedkv.scheduler.request import Request
from tests.scheduler.factories import FULL, HYBRID, SLIDING, Config

VOCAB = 4  # prompt and later sampled tokens: different requests often share blocks
FIRST_TOKEN = 1000  # first sampled token of a prefill: FIRST_TOKEN + a counter, unique
NUM_FAMILIES = 3
MAX_LIVE = 8
MAX_HISTORY = 8

STEPS: Counter[str] = Counter()  # rules run, per machine class
SEEN: Counter[tuple[str, str]] = Counter()  # (machine class, event)

Tables = list[list[BlockId]]


@dataclass
class World:
    """One block core, its requests and the executor's copy of their tables."""

    kv: KVCacheManager
    requests: dict[SeqId, Request] = field(default_factory=dict)
    tables: dict[SeqId, Tables] = field(default_factory=dict)

    def apply(self, seq_id: SeqId, allocation: Allocation) -> None:
        """What the executor does with a table update: entries from start on."""
        for table, update in zip(self.tables[seq_id], allocation.updates, strict=False):
            table[update.start :] = update.block_ids

    def free(self, seq_id: SeqId) -> None:
        self.kv.free(self.requests[seq_id])
        self.tables[seq_id] = [[] for _ in self.kv.managers]


def block_ids(blocks: tuple[tuple[KVCacheBlock, ...], ...]) -> list[list[BlockId]]:
    return [[b.block_id for b in group] for group in blocks]


class DecodeSlotsDifferentialMachine(RuleBasedStateMachine):
    layouts: tuple[str, ...] = (FULL,)

    def _seen(self, event: str) -> None:
        SEEN[(type(self).__name__, event)] += 1

    def _count_step(self) -> None:
        STEPS[type(self).__name__] += 1
        self.num_rules_since_quiescent += 1

    # -- setup -------------------------------------------------------------------------

    @initialize(data=st.data())
    def configure(self, data: st.DataObject) -> None:
        cfg = Config(
            layout=data.draw(st.sampled_from(self.layouts), label="layout"),
            block_size=data.draw(st.sampled_from([1, 2, 4, 16]), label="block_size"),
            window=data.draw(st.integers(1, 20), label="window"),
            num_blocks=data.draw(st.integers(8, 16) | st.integers(8, 40), label="num_blocks"),
            enable_caching=data.draw(st.booleans(), label="enable_caching"),
        )
        self.cfg = cfg
        self.ref = World(
            KVCacheManager(cfg.specs, cfg.num_blocks, enable_caching=cfg.enable_caching)
        )
        self.dec = World(
            KVCacheManager(cfg.specs, cfg.num_blocks, enable_caching=cfg.enable_caching)
        )
        self.worlds = (self.ref, self.dec)
        # Tokens come from a seeded generator: few hypothesis choices per step.
        self.rng = random.Random(data.draw(st.integers(0, 2**16), label="token_seed"))
        self.history = [
            [self.rng.randrange(VOCAB) for _ in range(cfg.max_len)] for _ in range(NUM_FAMILIES)
        ]
        self.waiting: list[SeqId] = []  # fresh and preempted requests, no blocks
        self.prefilling: SeqId | None = None
        # Decoding requests, oldest first (the scheduler's running order).
        self.decoding: list[SeqId] = []
        self.next_id = 0
        self.next_first_token = FIRST_TOKEN
        self.num_rules_since_quiescent = 0

    # -- rules -------------------------------------------------------------------------

    @precondition(lambda self: len(self.ref.requests) < MAX_LIVE)
    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        """A prefix of a family or of a freed request's tokens, then new tokens."""
        self._count_step()
        bs = self.cfg.block_size
        base = self.history[-1 - data.draw(st.integers(0, len(self.history) - 1), label="base")]
        num_shared = data.draw(st.integers(0, len(base)), label="num_shared")
        num_new = data.draw(st.integers(0, 2 * bs), label="num_new_tokens")
        tokens = base[:num_shared] + [self.rng.randrange(VOCAB) for _ in range(num_new)]
        # At most half the pool: several requests decode at once and run short of blocks.
        tokens = tokens[: self.cfg.max_len // 2] or [0]
        max_tokens = min(
            data.draw(st.integers(1, 4 * bs), label="max_tokens"), self.cfg.max_len - len(tokens)
        )
        seq_id = self._new_id()
        for world in self.worlds:
            world.requests[seq_id] = world.kv.make_request(seq_id, tokens, max_tokens=max_tokens)
            world.tables[seq_id] = [[] for _ in self.cfg.specs]
        self.waiting.append(seq_id)

    @precondition(lambda self: self.waiting or self.prefilling is not None)
    @rule(data=st.data())
    def prefill(self, data: st.DataObject) -> None:
        """Prefills, chunk by chunk, the prefilling request, then waiting ones that fit."""
        self._count_step()
        for _ in range(data.draw(st.integers(1, 4), label="num_prefills")):
            chunk = data.draw(st.integers(1, 3 * self.cfg.block_size), label="chunk")
            while self._prefill_chunk(chunk) and self.prefilling is not None:
                chunk = data.draw(st.integers(1, 3 * self.cfg.block_size), label="chunk")
            if self.prefilling is not None or not self.waiting:
                break

    @precondition(lambda self: self.decoding)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        """A few decode steps of every decoding request."""
        self._count_step()
        for _ in range(data.draw(st.integers(1, 8), label="num_decode_steps")):
            if not self.decoding:
                break
            self._decode_step()

    def _prefill_chunk(self, chunk: int) -> bool:
        """False when the first waiting request does not fit now (it waits)."""
        seq_id = self.prefilling
        if seq_id is None:
            seq_id = self.waiting[0]
            hits = [w.kv.get_computed_blocks(w.requests[seq_id]) for w in self.worlds]
            assert hits[0].num_tokens == hits[1].num_tokens
            assert block_ids(hits[0].blocks) == block_ids(hits[1].blocks)
            request = self.ref.requests[seq_id]
            num_new = min(request.num_tokens - hits[0].num_tokens, chunk)
            allocations = [
                w.kv.allocate_slots(w.requests[seq_id], num_new, hit)
                for w, hit in zip(self.worlds, hits, strict=True)
            ]
            assert (allocations[0] is None) == (allocations[1] is None)
            if allocations[0] is None:
                self._seen("admission_waits")
                return False
            if hits[0].num_tokens:
                self._seen("prefix_hit")
            self.waiting.pop(0)
            self.prefilling = seq_id
        else:
            request = self.ref.requests[seq_id]
            num_new = min(request.num_tokens - request.num_computed_tokens, chunk)
            while True:
                allocations = [
                    w.kv.allocate_slots(w.requests[seq_id], num_new) for w in self.worlds
                ]
                assert (allocations[0] is None) == (allocations[1] is None)
                if allocations[0] is not None:
                    break
                assert self.decoding, "a request alone always fits the pool"
                self._seen("preempted_for_prefill")
                self._preempt_newest()
        for world, allocation in zip(self.worlds, allocations, strict=True):
            assert allocation is not None
            world.apply(seq_id, allocation)
            world.requests[seq_id].num_computed_tokens += num_new
        self._compare_copy_ops()
        if request.num_computed_tokens < request.num_tokens:
            return True
        # Prefill done: the first sampled token, unique, then decoding (or done).
        self.prefilling = None
        token = self.next_first_token
        self.next_first_token += 1
        for world in self.worlds:
            world.requests[seq_id].append_output_token_ids(token)
        if request.num_output_tokens >= (request.max_tokens or 0):
            self._seen("finished_at_prefill")
            self._finish(seq_id)
        else:
            self.decoding.append(seq_id)
        return True

    @precondition(lambda self: self.decoding)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self._count_step()
        i = data.draw(st.integers(0, len(self.decoding) - 1), label="aborted_index")
        self._seen("aborted")
        self._finish(self.decoding[i])

    @precondition(lambda self: self.decoding and len(self.ref.requests) < MAX_LIVE)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """Forks a decoding request in both worlds; parent and child become the newest."""
        self._count_step()
        i = data.draw(st.integers(0, len(self.decoding) - 1), label="parent_index")
        parent_id = self.decoding[i]
        room = self.cfg.max_len - self.ref.requests[parent_id].num_tokens
        if room < 1:
            return
        max_tokens = min(
            data.draw(st.integers(1, 3 * self.cfg.block_size), label="max_tokens"), room
        )
        child_id = self._new_id()
        for world in self.worlds:
            parent = world.requests[parent_id]
            child = world.kv.make_request(child_id, list(parent.token_ids), max_tokens=max_tokens)
            world.kv.fork(parent, child)
            world.requests[child_id] = child
            # A new request's whole table goes to the executor.
            world.tables[child_id] = [list(t) for t in world.kv.get_block_ids(child_id)]
        del self.decoding[i]
        self.decoding += [parent_id, child_id]
        self._seen("fork")

    # Only now and then, so that state builds up in between.
    @precondition(lambda self: self.ref.requests and self.num_rules_since_quiescent >= 25)
    @rule()
    def finish_everything(self) -> None:
        self._count_step()
        self._finish_all_and_compare_caches()

    # -- the scheduler's moves -----------------------------------------------------------

    def _new_id(self) -> SeqId:
        self.next_id += 1
        return SeqId(f"r{self.next_id}")

    def _decode_step(self) -> None:
        """Slots for every decoding request (preempting on a miss), then its token."""
        start = 0
        while True:
            requests = [self.dec.requests[rid] for rid in self.decoding]
            result = self.dec.kv.allocate_decode_slots(requests, start)
            for i, allocation in result.updates:
                assert i >= start
                self.dec.apply(self.decoding[i], allocation)
                self._seen("table_updates")
            end = start
            for seq_id in self.decoding[start:]:
                allocation = self.ref.kv.allocate_slots(self.ref.requests[seq_id], 1)
                if allocation is None:
                    break
                self.ref.apply(seq_id, allocation)
                end += 1
            assert result.num_allocated == end - start, (result, end, start)
            self._compare_copy_ops()
            if end == len(self.decoding):
                break
            self._seen("preempted_in_decode")
            if end < len(self.decoding) - 1:
                self._seen("miss_before_the_newest")
            self._preempt_newest()
            start = end
        tokens = {rid: self.rng.randrange(VOCAB) for rid in self.decoding}
        done = []
        for seq_id in self.decoding:
            for world in self.worlds:
                request = world.requests[seq_id]
                request.num_computed_tokens += 1
                request.append_output_token_ids(tokens[seq_id])
            request = self.ref.requests[seq_id]
            if request.num_output_tokens >= (request.max_tokens or 0):
                done.append(seq_id)
        for seq_id in done:
            self._seen("finished_at_max_tokens")
            self._finish(seq_id)

    def _compare_copy_ops(self) -> None:
        ops = [w.kv.take_copy_ops() for w in self.worlds]
        assert ops[0] == ops[1]
        if ops[0]:
            self._seen("copy_on_write")

    def _preempt_newest(self) -> None:
        newest = self.decoding.pop()
        for world in self.worlds:
            world.free(newest)
            world.requests[newest].num_computed_tokens = 0
        self.waiting.insert(0, newest)
        self._remember(newest)

    def _finish(self, seq_id: SeqId) -> None:
        self._remember(seq_id)
        for world in self.worlds:
            world.free(seq_id)
            del world.requests[seq_id], world.tables[seq_id]
        if seq_id in self.decoding:
            self.decoding.remove(seq_id)
        if seq_id in self.waiting:
            self.waiting.remove(seq_id)
        if self.prefilling == seq_id:
            self.prefilling = None

    def _remember(self, seq_id: SeqId) -> None:
        """Keeps a freed request's tokens for later prompts (a chat's next turn)."""
        self.history = [*self.history[-MAX_HISTORY:], list(self.ref.requests[seq_id].token_ids)]

    def _finish_all_and_compare_caches(self) -> None:
        """A quiescent point: nothing held, and both prefix caches alike."""
        for seq_id in sorted(self.ref.requests):
            self._finish(seq_id)
        for world in self.worlds:
            report = world.kv.check_integrity()
            assert report.ok, "\n".join(report.errors)
            assert report.num_used == 0
        self._compare_indexes()
        for tokens in self.history[-4:]:
            probes = [w.kv.make_request("probe", tokens) for w in self.worlds]
            hits = [w.kv.get_computed_blocks(p) for w, p in zip(self.worlds, probes, strict=True)]
            assert hits[0].num_tokens == hits[1].num_tokens
            assert block_ids(hits[0].blocks) == block_ids(hits[1].blocks)
            if any(t >= FIRST_TOKEN for t in tokens[: hits[0].num_tokens]):
                self._seen("probe_hits_sampled_tokens")
        self._seen("quiescent_point")
        self.num_rules_since_quiescent = 0

    # -- checks --------------------------------------------------------------------------

    def _compare_indexes(self) -> None:
        indexes = [
            [{h: b.block_id for h, b in index.items()} for index in w.kv.pool.cached_blocks]
            for w in self.worlds
        ]
        assert indexes[0] == indexes[1]

    @invariant()
    def worlds_agree(self) -> None:
        if not hasattr(self, "dec"):
            return
        for world in self.worlds:
            report = world.kv.check_integrity()
            assert report.ok, "\n".join(report.errors)
        free_queues = [[b.block_id for b in w.kv.pool.free_block_queue] for w in self.worlds]
        assert free_queues[0] == free_queues[1]
        assert self.ref.kv.prefix_cache_stats == self.dec.kv.prefix_cache_stats
        self._compare_indexes()
        for seq_id, ref_request in self.ref.requests.items():
            dec_request = self.dec.requests[seq_id]
            assert dec_request.token_ids == ref_request.token_ids, seq_id
            assert dec_request.num_computed_tokens == ref_request.num_computed_tokens, seq_id
            tables = self.ref.kv.get_block_ids(seq_id)
            assert self.dec.kv.get_block_ids(seq_id) == tables, seq_id
            if any(NULL_BLOCK_ID in t for t in tables):
                self._seen("window_released_blocks")
            for world in self.worlds:
                self._check_executor_tables(seq_id, world.tables[seq_id], tables)

    @staticmethod
    def _check_executor_tables(
        seq_id: SeqId, mirror: Tables, tables: tuple[list[BlockId], ...]
    ) -> None:
        """Equal wherever the manager still has a block (a window may have released some)."""
        for g, (mine, theirs) in enumerate(zip(mirror, tables, strict=True)):
            assert len(mine) == len(theirs), (seq_id, g, mine, theirs)
            for j, block_id in enumerate(theirs):
                assert block_id == NULL_BLOCK_ID or mine[j] == block_id, (seq_id, g, mine)

    def teardown(self) -> None:
        if hasattr(self, "dec"):
            self._finish_all_and_compare_caches()


# No shrinking: a failing run reports its whole (unshrunk) step list at once.
# To shrink a failure locally, add Phase.shrink.
SETTINGS = settings(
    max_examples=60,
    stateful_step_count=100,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

# layout -> (runs, rules that must have run).
RUNS = {FULL: (200, 10_000), SLIDING: (40, 3_000), HYBRID: (60, 3_000)}


@pytest.mark.parametrize("layout", [FULL, SLIDING, HYBRID])
def test_decode_slots_hand_out_the_blocks_of_per_request_decoding(layout: str) -> None:
    machine = type(
        f"DecodeSlots_{layout}", (DecodeSlotsDifferentialMachine,), {"layouts": (layout,)}
    )
    num_runs, min_steps = RUNS[layout]
    run_state_machine_as_test(machine, settings=settings(SETTINGS, max_examples=num_runs))
    name = machine.__name__
    assert STEPS[name] >= min_steps, STEPS[name]
    exercised = {event for (m, event), n in SEEN.items() if m == name and n}
    wanted = {
        "prefix_hit",
        "preempted_in_decode",
        "miss_before_the_newest",
        "finished_at_max_tokens",
        "aborted",
        "fork",
        "copy_on_write",
        "table_updates",
        "quiescent_point",
        "probe_hits_sampled_tokens",
    }
    if layout != FULL:
        wanted.add("window_released_blocks")
    assert wanted <= exercised, f"never exercised: {wanted - exercised}"
