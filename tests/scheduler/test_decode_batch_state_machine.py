"""DecodeBatch against per-request decoding: two block cores, one request stream.

A hypothesis state machine drives two ``KVCacheManager`` s of one
configuration with the same requests and the same sampled tokens. In the
reference world every decoding request is stepped alone
(``allocate_slots(request, 1)``, then its token); in the batched world the
decoding requests live in a ``DecodeBatch`` (``allocate()``, then
``append(sampled)``). Admission with prefix hits, chunked prefill, preemption
of the newest decoding request when a block is missing, finishing at
max_tokens, aborts and copy-on-write forks happen alike in both worlds.

After every rule both managers pass their audit and hold the same tables,
free queue (order included) and lookup stats; each request has the same tokens
(a batched one: those written into the request are a prefix, the rest wait in
the ring, at most ``pending_width``; the check does not ``sync``, which would
empty the ring after every rule: the ``sync`` rule, removal, preemption and
forks compare whole requests); the tables the executor builds from what
``allocate`` reports equal the manager's; both queue the same copy-on-write
copies. Once everything is freed the prefix-cache indexes are equal and probes
hit the same blocks.

Where the worlds differ by design, and how the stream keeps that harmless:

- The batched world enters blocks filled while decoding in the batch into the
  prefix cache when the request is freed, the reference world at allocation.
  So while requests run, the batched index is the reference one less blocks
  held by batched requests. Allocation stays alike only if no other request
  looks up, or fills, a block with such a hash meanwhile: the token sampled at
  the end of every prefill is unique (``FIRST_TOKEN`` + a counter), so every
  block filled while decoding names a prefix only this request (and its forks,
  which the batch steps per request, caching at allocation) has; prompts come
  from families and from freed requests, never from running ones.
- Within a step the batch hands out blocks in its own order: the rows that
  start a block (row order, all at once), then the forked rows; when the pool
  cannot give every starting row one, those rows and the forked ones in row
  order, up to the first miss. The reference steps its requests in that order
  (a scheduling choice: it must hand out the same blocks).
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

from pagedkv.common.ids import NULL_BLOCK_ID, BlockId, RequestId
from pagedkv.common.kv_cache_spec import KVCacheSpec
from pagedkv.scheduler.block_pool import KVCacheBlock
from pagedkv.scheduler.decode_batch import DecodeBatch, DecodeBatchAllocation
from pagedkv.scheduler.kv_cache_manager import Allocation, KVCacheManager
from pagedkv.scheduler.request import Request
from tests.scheduler.factories import FULL, HYBRID, SLIDING, layout_specs, max_request_len

VOCAB = 4  # prompt and later sampled tokens: different requests often share blocks
FIRST_TOKEN = 1000  # first sampled token of a prefill: FIRST_TOKEN + a counter, unique
NUM_FAMILIES = 3
MAX_LIVE = 8  # also the batch's capacity
MAX_HISTORY = 8

STEPS: Counter[str] = Counter()  # rules run, per machine class
SEEN: Counter[tuple[str, str]] = Counter()  # (machine class, event)

Tables = list[list[BlockId]]


@dataclass(frozen=True)
class Config:
    layout: str
    block_size: int
    window: int
    num_blocks: int
    enable_caching: bool
    pending_width: int

    @property
    def specs(self) -> list[KVCacheSpec]:
        return layout_specs(self.layout, self.block_size, self.window)

    @property
    def max_len(self) -> int:
        """Tokens a request may reach: it fits the pool alone."""
        return max_request_len(self.specs, self.num_blocks)


@dataclass
class World:
    """One block core, its requests and the executor's copy of their tables."""

    kv: KVCacheManager
    requests: dict[RequestId, Request] = field(default_factory=dict)
    tables: dict[RequestId, Tables] = field(default_factory=dict)

    def apply(self, request_id: RequestId, allocation: Allocation) -> None:
        """What the executor does with a table update: entries from start on."""
        for table, update in zip(self.tables[request_id], allocation.updates, strict=False):
            table[update.start :] = update.block_ids

    def free(self, request_id: RequestId) -> None:
        self.kv.free(self.requests[request_id])
        self.tables[request_id] = [[] for _ in self.kv.managers]


def block_ids(blocks: tuple[tuple[KVCacheBlock, ...], ...]) -> list[list[BlockId]]:
    return [[b.block_id for b in group] for group in blocks]


class DecodeBatchDifferentialMachine(RuleBasedStateMachine):
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
            pending_width=data.draw(st.integers(1, 5) | st.just(64), label="pending_width"),
        )
        self.cfg = cfg
        self.ref = World(
            KVCacheManager(cfg.specs, cfg.num_blocks, enable_caching=cfg.enable_caching)
        )
        self.bat = World(
            KVCacheManager(cfg.specs, cfg.num_blocks, enable_caching=cfg.enable_caching)
        )
        self.worlds = (self.ref, self.bat)
        self.batch = DecodeBatch(self.bat.kv, MAX_LIVE, cfg.pending_width)
        # Tokens come from a seeded generator: few hypothesis choices per step.
        self.rng = random.Random(data.draw(st.integers(0, 2**16), label="token_seed"))
        self.history = [
            [self.rng.randrange(VOCAB) for _ in range(cfg.max_len)] for _ in range(NUM_FAMILIES)
        ]
        self.waiting: list[RequestId] = []  # fresh and preempted requests, no blocks
        self.prefilling: RequestId | None = None
        # The reference's decoding requests, by order of (re)admission to decoding.
        self.added_at: dict[RequestId, int] = {}
        self.num_added = 0
        self.num_appends = 0
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
        request_id = self._new_id()
        for world in self.worlds:
            world.requests[request_id] = world.kv.make_request(
                request_id, tokens, max_tokens=max_tokens
            )
            world.tables[request_id] = [[] for _ in self.cfg.specs]
        self.waiting.append(request_id)

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

    @precondition(lambda self: len(self.batch) > 0)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        """A few decode steps of every decoding request."""
        self._count_step()
        for _ in range(data.draw(st.integers(1, 8), label="num_decode_steps")):
            if not len(self.batch):
                break
            self._decode_step()

    def _prefill_chunk(self, chunk: int) -> bool:
        """False when the first waiting request does not fit now (it waits)."""
        request_id = self.prefilling
        if request_id is None:
            request_id = self.waiting[0]
            hits = [w.kv.get_computed_blocks(w.requests[request_id]) for w in self.worlds]
            assert hits[0].num_tokens == hits[1].num_tokens
            assert block_ids(hits[0].blocks) == block_ids(hits[1].blocks)
            request = self.ref.requests[request_id]
            num_new = min(request.num_tokens - hits[0].num_tokens, chunk)
            allocations = [
                w.kv.allocate_slots(w.requests[request_id], num_new, hit)
                for w, hit in zip(self.worlds, hits, strict=True)
            ]
            assert (allocations[0] is None) == (allocations[1] is None)
            if allocations[0] is None:
                self._seen("admission_waits")
                return False
            if hits[0].num_tokens:
                self._seen("prefix_hit")
            self.waiting.pop(0)
            self.prefilling = request_id
        else:
            request = self.ref.requests[request_id]
            num_new = min(request.num_tokens - request.num_computed_tokens, chunk)
            while True:
                allocations = [
                    w.kv.allocate_slots(w.requests[request_id], num_new) for w in self.worlds
                ]
                assert (allocations[0] is None) == (allocations[1] is None)
                if allocations[0] is not None:
                    break
                assert len(self.batch), "a request alone always fits the pool"
                self._seen("preempted_for_prefill")
                self._preempt_newest()
        for world, allocation in zip(self.worlds, allocations, strict=True):
            assert allocation is not None
            world.apply(request_id, allocation)
            world.requests[request_id].num_computed_tokens += num_new
        self._compare_copy_ops()
        if request.num_computed_tokens < request.num_tokens:
            return True
        # Prefill done: the first sampled token, unique, then decoding (or done).
        self.prefilling = None
        token = self.next_first_token
        self.next_first_token += 1
        for world in self.worlds:
            world.requests[request_id].append_output_token_ids(token)
        if request.num_output_tokens >= (request.max_tokens or 0):
            self._seen("finished_at_prefill")
            self._finish(request_id)
        else:
            self._add_to_decoding(request_id)
        return True

    @precondition(lambda self: len(self.batch) > 0)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self._count_step()
        row = data.draw(st.integers(0, len(self.batch) - 1), label="aborted_row")
        (request,) = self.batch.remove([row])
        self._seen("aborted")
        self._finish(request.request_id)

    @precondition(lambda self: len(self.batch) > 0 and len(self.ref.requests) < MAX_LIVE)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """Takes a row out, forks it in both worlds, adds parent and child back."""
        self._count_step()
        row = data.draw(st.integers(0, len(self.batch) - 1), label="parent_row")
        parent_id = self.batch.requests[row].request_id
        room = self.cfg.max_len - self.ref.requests[parent_id].num_tokens
        if room < 1:
            return
        max_tokens = min(
            data.draw(st.integers(1, 3 * self.cfg.block_size), label="max_tokens"), room
        )
        (parent,) = self.batch.remove([row])
        assert parent is self.bat.requests[parent_id]
        self._check_same_progress(parent_id)
        child_id = self._new_id()
        for world in self.worlds:
            parent_request = world.requests[parent_id]
            child = world.kv.make_request(
                child_id, list(parent_request.token_ids), max_tokens=max_tokens
            )
            world.kv.fork(parent_request, child)
            world.requests[child_id] = child
            # A new request's whole table goes to the executor.
            world.tables[child_id] = [list(t) for t in world.kv.get_block_ids(child_id)]
        del self.added_at[parent_id]
        self._add_to_decoding(parent_id)
        self._add_to_decoding(child_id)
        self._seen("fork")

    @precondition(lambda self: len(self.batch) > 0)
    @rule(data=st.data())
    def sync(self, data: st.DataObject) -> None:
        """``sync`` of one row (or all): the request then equals the reference one."""
        self._count_step()
        n = len(self.batch)
        row = data.draw(st.integers(-1, n - 1), label="synced_row")
        for i in range(n) if row < 0 else [row]:
            if self.batch.num_tokens[i] > self.batch.requests[i].num_tokens:
                self._seen("synced_pending_tokens")
            request = self.batch.sync(i)
            assert request is self.batch.requests[i]
            self._check_same_progress(request.request_id)

    # Only now and then, so that state builds up in between.
    @precondition(lambda self: self.ref.requests and self.num_rules_since_quiescent >= 25)
    @rule()
    def finish_everything(self) -> None:
        self._count_step()
        self._finish_all_and_compare_caches()

    # -- the scheduler's moves -----------------------------------------------------------

    def _new_id(self) -> RequestId:
        self.next_id += 1
        return RequestId(f"r{self.next_id}")

    def _add_to_decoding(self, request_id: RequestId) -> None:
        self.batch.add(self.bat.requests[request_id])
        self.added_at[request_id] = self.num_added
        self.num_added += 1

    def _decode_step(self) -> None:
        while True:
            order = self._reference_order()
            result = self.batch.allocate()
            reference_ok = self._reference_allocate(order)
            assert result.ok == reference_ok, (result, order)
            self._apply_batched(result)
            self._compare_copy_ops()
            if result.ok:
                break
            self._seen("preempted_in_decode")
            self._preempt_newest()
        if not len(self.batch):
            return
        n = len(self.batch)
        row_ids = [r.request_id for r in self.batch.requests]
        assert sorted(row_ids) == sorted(self.added_at)
        tokens = {rid: self.rng.randrange(VOCAB) for rid in sorted(row_ids)}
        num_pending = [
            total - r.num_tokens
            for total, r in zip(
                self.batch.num_tokens[:n].tolist(), self.batch.requests, strict=True
            )
        ]
        done = self.batch.append([tokens[rid] for rid in row_ids])
        self.num_appends += 1
        for request_id in self.added_at:
            request = self.ref.requests[request_id]
            request.num_computed_tokens += 1
            request.append_output_token_ids(tokens[request_id])
        reference_done = sorted(
            rid
            for rid in self.added_at
            if self.ref.requests[rid].num_output_tokens >= (self.ref.requests[rid].max_tokens or 0)
        )
        assert sorted(row_ids[i] for i in done) == reference_done
        if self.num_appends % self.cfg.pending_width == 0:
            # The ring is full: every row's tokens went into its request.
            for request in self.batch.requests:
                assert request.num_tokens == self.ref.requests[request.request_id].num_tokens
            if self.cfg.pending_width > 1 and max(num_pending) > 0:
                self._seen("ring_flush")
                self._seen(f"ring_flush_w{self.cfg.pending_width}")
        finished = self.batch.remove(done)
        for request_id in sorted(r.request_id for r in finished):
            self._seen("finished_at_max_tokens")
            self._finish(request_id)

    def _reference_order(self) -> list[RequestId]:
        """The batch's rows in the order it hands out blocks (see the module docstring)."""
        rows = [r.request_id for r in self.batch.requests]
        kv = self.ref.kv
        if not kv.has_single_full_attention_group:
            return rows
        forked = {rid for rid in rows if kv.is_forked(rid)}
        starting = [
            rid
            for rid in rows
            if rid not in forked and kv.num_slots(rid) <= self.ref.requests[rid].num_computed_tokens
        ]
        if len(starting) <= kv.pool.get_num_free_blocks():
            return starting + [rid for rid in rows if rid in forked]
        self._seen("too_few_blocks_for_starting_rows")
        if any(kv.num_slots(rid) <= self.ref.requests[rid].num_computed_tokens for rid in forked):
            self._seen("too_few_blocks_with_forked_rows")
        return [rid for rid in rows if rid in forked or rid in starting]

    def _reference_allocate(self, order: list[RequestId]) -> bool:
        for request_id in order:
            allocation = self.ref.kv.allocate_slots(self.ref.requests[request_id], 1)
            if allocation is None:
                return False
            self.ref.apply(request_id, allocation)
        return True

    def _apply_batched(self, result: DecodeBatchAllocation) -> None:
        """The executor's side: appended entries, then per-request table updates."""
        appends = result.appends
        for request, start, block_id in zip(
            appends.requests, appends.starts, appends.block_ids, strict=True
        ):
            table = self.bat.tables[request.request_id][0]
            assert start == len(table), f"{request}: block appended at {start}, table {table}"
            table.append(block_id)
        if appends.requests:
            self._seen("columnar_appends")
        for request, allocation in result.updates:
            self.bat.apply(request.request_id, allocation)
            self._seen("per_request_updates")

    def _compare_copy_ops(self) -> None:
        ops = [w.kv.take_copy_ops() for w in self.worlds]
        assert ops[0] == ops[1]
        if ops[0]:
            self._seen("copy_on_write")

    def _preempt_newest(self) -> None:
        victim = self.batch.pop()
        newest = max(self.added_at, key=self.added_at.__getitem__)
        assert victim is self.bat.requests[newest], (victim, newest)
        del self.added_at[newest]
        self._check_same_progress(newest)
        for world in self.worlds:
            world.free(newest)
            world.requests[newest].num_computed_tokens = 0
        self.waiting.insert(0, newest)
        self._remember(newest)

    def _finish(self, request_id: RequestId) -> None:
        """Frees a request that is out of the batch (or never was in it)."""
        self.added_at.pop(request_id, None)
        self._check_same_progress(request_id)
        self._remember(request_id)
        for world in self.worlds:
            world.free(request_id)
            del world.requests[request_id], world.tables[request_id]
        if request_id in self.waiting:
            self.waiting.remove(request_id)
        if self.prefilling == request_id:
            self.prefilling = None

    def _remember(self, request_id: RequestId) -> None:
        """Keeps a freed request's tokens for later prompts (a chat's next turn)."""
        self.history = [*self.history[-MAX_HISTORY:], list(self.ref.requests[request_id].token_ids)]

    def _finish_all_and_compare_caches(self) -> None:
        """A quiescent point: nothing held, and both prefix caches alike."""
        self.batch.remove(range(len(self.batch)))
        for request_id in sorted(self.ref.requests):
            self._finish(request_id)
        for world in self.worlds:
            report = world.kv.check_integrity()
            assert report.ok, "\n".join(report.errors)
            assert report.num_used == 0
        indexes = [
            [{h: b.block_id for h, b in index.items()} for index in w.kv.pool.cached_blocks]
            for w in self.worlds
        ]
        assert indexes[0] == indexes[1]
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

    def _check_same_progress(self, request_id: RequestId) -> None:
        """A request out of the batch (or synced) is the same in both worlds."""
        ref, bat = self.ref.requests[request_id], self.bat.requests[request_id]
        assert bat.token_ids == ref.token_ids, (bat, ref)
        assert bat.num_computed_tokens == ref.num_computed_tokens, (bat, ref)

    @invariant()
    def worlds_agree(self) -> None:
        if not hasattr(self, "batch"):
            return
        for world in self.worlds:
            report = world.kv.check_integrity()
            assert report.ok, "\n".join(report.errors)
        free_queues = [[b.block_id for b in w.kv.pool.free_block_queue] for w in self.worlds]
        assert free_queues[0] == free_queues[1]
        assert self.ref.kv.prefix_cache_stats == self.bat.kv.prefix_cache_stats
        n = len(self.batch)
        rows = {r.request_id: i for i, r in enumerate(self.batch.requests)}
        assert rows.keys() == self.added_at.keys()
        num_tokens = self.batch.num_tokens[:n].tolist()
        held_by_batched: set[int] = set()
        for request_id, ref_request in self.ref.requests.items():
            tables = self.ref.kv.get_block_ids(request_id)
            assert self.bat.kv.get_block_ids(request_id) == tables, request_id
            for world in self.worlds:
                self._check_executor_tables(request_id, world.tables[request_id], tables)
            bat_request = self.bat.requests[request_id]
            if request_id not in rows:
                self._check_same_progress(request_id)
                continue
            held_by_batched.update(b for t in tables for b in t)
            if NULL_BLOCK_ID in held_by_batched:
                self._seen("window_released_blocks")
            i = rows[request_id]
            assert self.batch.requests[i] is bat_request
            assert num_tokens[i] == ref_request.num_tokens, (i, bat_request, ref_request)
            assert ref_request.num_computed_tokens == num_tokens[i] - 1
            num_synced = bat_request.num_tokens
            assert 0 <= num_tokens[i] - num_synced <= self.cfg.pending_width
            assert bat_request.token_ids == ref_request.token_ids[:num_synced]
        # The batched index is the reference one less blocks batched requests fill.
        for ref_index, bat_index in zip(
            self.ref.kv.pool.cached_blocks, self.bat.kv.pool.cached_blocks, strict=True
        ):
            for block_hash, block in bat_index.items():
                assert block_hash in ref_index and ref_index[block_hash].block_id == block.block_id
            for block_hash in ref_index.keys() - bat_index.keys():
                assert ref_index[block_hash].block_id in held_by_batched
                self._seen("batched_index_lags")

    @staticmethod
    def _check_executor_tables(
        request_id: RequestId, mirror: Tables, tables: tuple[list[BlockId], ...]
    ) -> None:
        """Equal wherever the manager still has a block (a window may have released some)."""
        for g, (mine, theirs) in enumerate(zip(mirror, tables, strict=True)):
            assert len(mine) == len(theirs), (request_id, g, mine, theirs)
            for j, block_id in enumerate(theirs):
                assert block_id == NULL_BLOCK_ID or mine[j] == block_id, (request_id, g, mine)

    def teardown(self) -> None:
        if hasattr(self, "batch"):
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

# layout -> (runs, rules that must have run). About 30 s in all on 2 cores.
RUNS = {FULL: (200, 10_000), SLIDING: (40, 3_000), HYBRID: (60, 3_000)}


@pytest.mark.parametrize("layout", [FULL, SLIDING, HYBRID])
def test_batched_decoding_hands_out_the_blocks_of_per_request_decoding(layout: str) -> None:
    machine = type(
        f"DecodeBatch_{layout}", (DecodeBatchDifferentialMachine,), {"layouts": (layout,)}
    )
    num_runs, min_steps = RUNS[layout]
    run_state_machine_as_test(machine, settings=settings(SETTINGS, max_examples=num_runs))
    name = machine.__name__
    assert STEPS[name] >= min_steps, STEPS[name]
    exercised = {event for (m, event), n in SEEN.items() if m == name and n}
    wanted = {
        "prefix_hit",
        "preempted_in_decode",
        "finished_at_max_tokens",
        "aborted",
        "fork",
        "copy_on_write",
        "per_request_updates",
        "quiescent_point",
        "probe_hits_sampled_tokens",
    }
    if layout == FULL:  # the columnar path
        wanted |= {
            "columnar_appends",
            "ring_flush",
            "synced_pending_tokens",
            "too_few_blocks_for_starting_rows",
            "too_few_blocks_with_forked_rows",
            "batched_index_lags",
        }
    else:
        wanted.add("window_released_blocks")
    assert wanted <= exercised, f"never exercised: {wanted - exercised}"
