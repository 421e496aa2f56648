"""Random scheduling of the block core, checked against a shadow KV memory.

A hypothesis state machine drives ``KVCacheManager`` the way the scheduler
does: admission with prefix hits and chunked prefill, batched steps (every
allocation first, then the copy-on-write copies, then the forward), decode
with lookahead slots, forks, preemption under pressure and finishing, over
small pools so that blocks are evicted and reused all the time.

The executor's KV memory is modelled as ``(block_id, offset) -> (position,
token)``: each step writes its tokens through the block tables the executor
built from the ``Allocation`` updates. After every rule the machine checks the
pool's own audit, that nothing anyone relies on was overwritten (indexed
blocks hold the tokens their hash names, running requests' tables hold their
own tokens) and that prefix hits are exactly as long as the index allows.

With a host tier (one full-attention group), the machine applies each step's
offloads and loads to a shadow host memory before the step's copies and
forward, as the executor does, checks that every host block the tier
indexes holds the tokens its hash names, and now and then hands the
executor to a new block core that adopts both tiers' tagged blocks.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

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

from pagedkv.common.ids import NULL_BLOCK_ID, BlockHash, BlockId, SeqId
from pagedkv.common.kv_cache_spec import KVCacheSpec
from pagedkv.scheduler.cache_events import CacheEvent, CacheEventKind
from pagedkv.scheduler.kv_cache_manager import ComputedBlocks, KVCacheManager
from pagedkv.scheduler.request import Request, RequestStatus
from pagedkv.scheduler.single_type_kv_cache_manager import cdiv
from tests.scheduler.factories import FULL, HYBRID, SLIDING, Config

VOCAB = 4  # few token ids: different prompts often share blocks
NUM_FAMILIES = 3  # fresh prompts start with a prefix of one of these
MAX_LIVE = 8
MAX_HISTORY = 8  # past requests' tokens, for follow-up prompts
GARBAGE = -1  # what a lookahead (draft) slot holds until its token is computed

STEPS: Counter[str] = Counter()  # rules run, per machine class
SEEN: Counter[tuple[str, str]] = Counter()  # (machine class, event): what a run exercised


@dataclass
class Live:
    """The scheduler's record of a request, with the executor's copy of its tables."""

    request: Request
    cache_salt: str | None
    max_tokens: int
    tables: list[list[BlockId]]
    num_hashes_seen: int = 0


@dataclass
class Scheduled:
    """One request's share of a step: tokens ``start .. start + num_new`` (+ drafts)."""

    live: Live
    start: int
    num_new: int
    num_lookahead: int
    hit: ComputedBlocks | None = None


class Snapshot(NamedTuple):
    """Everything a refused allocation must leave as it was."""

    free_queue: list[int]
    blocks: list[tuple[int, BlockHash | None, int]]  # ref_cnt, hash, group per block
    cached: list[dict[BlockHash, int]]  # per group: hash -> block id
    tables: list[dict[SeqId, list[int]]]  # per group: request -> block ids
    num_cached: list[dict[SeqId, int]]
    host: list[tuple[BlockHash, int]]  # the host tier's index, least recently used first


@dataclass
class Shadow:
    """The executor's KV memory: what each slot of each block holds."""

    slots: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    host: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)

    def copy_block(self, src: int, dst: int, block_size: int) -> None:
        _copy(self.slots, src, self.slots, dst, block_size)

    def offload(self, block_id: int, host_id: int, block_size: int) -> None:
        _copy(self.slots, block_id, self.host, host_id, block_size)

    def load(self, host_id: int, block_id: int, block_size: int) -> None:
        _copy(self.host, host_id, self.slots, block_id, block_size)

    def check_block(
        self, block_id: int, j: int, tokens: Sequence[int], block_size: int, who: str
    ) -> None:
        """Block ``block_id`` holds logical block ``j`` of ``tokens``, slot by slot."""
        for offset in range(block_size):
            pos = j * block_size + offset
            got = self.slots.get((block_id, offset))
            assert got == (pos, tokens[pos]), f"{who}: block {block_id} at {pos} holds {got}"


def _copy(
    source: dict[tuple[int, int], tuple[int, int]],
    src: int,
    target: dict[tuple[int, int], tuple[int, int]],
    dst: int,
    block_size: int,
) -> None:
    for offset in range(block_size):
        value = source.get((src, offset))
        if value is None:
            target.pop((dst, offset), None)
        else:
            target[(dst, offset)] = value


class BlockCoreMachine(RuleBasedStateMachine):
    layouts: tuple[str, ...] = (FULL, SLIDING, HYBRID)
    host_tier = False  # one full-attention group with host blocks

    def _seen(self, event: str) -> None:
        SEEN[(type(self).__name__, event)] += 1

    # -- setup ---------------------------------------------------------------------

    @initialize(data=st.data())
    def configure(self, data: st.DataObject) -> None:
        cfg = Config(
            layout=data.draw(st.sampled_from(self.layouts), label="layout"),
            block_size=data.draw(st.sampled_from([2, 4, 16]), label="block_size"),
            window=data.draw(st.integers(1, 20), label="window"),
            num_blocks=data.draw(st.integers(6, 10) | st.integers(6, 40), label="num_blocks"),
            enable_caching=self.host_tier or data.draw(st.booleans(), label="enable_caching"),
        )
        self.cfg = cfg
        num_host_blocks = (
            data.draw(st.integers(1, 4) | st.integers(1, 24), label="num_host_blocks")
            if self.host_tier
            else 0
        )
        self.kv = KVCacheManager(
            cfg.specs,
            cfg.num_blocks,
            enable_caching=cfg.enable_caching,
            model_id="m",
            num_host_blocks=num_host_blocks,
            host_write_through=self.host_tier and data.draw(st.booleans(), label="write_through"),
        )
        # Token ids come from a seeded generator so that hypothesis's choices
        # stay few per step and every run gets its full number of steps.
        self.rng = random.Random(data.draw(st.integers(0, 2**16), label="token_seed"))
        self.history = [
            [self.rng.randrange(VOCAB) for _ in range(cfg.max_len)] for _ in range(NUM_FAMILIES)
        ]
        self.shadow = Shadow()
        self.prefixes: dict[BlockHash, tuple[str, tuple[int, ...]]] = {}
        self.live: dict[SeqId, Live] = {}
        self.waiting: list[SeqId] = []
        self.running: list[SeqId] = []
        self.copies: list[tuple[int, int]] = []  # queued for this step's forward
        self.next_id = 0

    def _new_request(self, tokens: list[int], cache_salt: str | None, max_tokens: int) -> Live:
        request = self.kv.make_request(f"r{self.next_id}", tokens, cache_salt=cache_salt)
        self.next_id += 1
        live = Live(request, cache_salt, max_tokens, [[] for _ in self.cfg.specs])
        self.live[request.seq_id] = live
        self._record_hashes(live)
        return live

    def _record_hashes(self, live: Live) -> None:
        """Remembers the token prefix each of the request's block hashes stands for."""
        request, bs = live.request, self.cfg.block_size
        for j in range(live.num_hashes_seen, len(request.block_hashes)):
            prefix = (live.cache_salt or "", tuple(request.token_ids[: (j + 1) * bs]))
            known = self.prefixes.setdefault(request.block_hashes[j], prefix)
            assert known == prefix, f"two token prefixes share the hash of block {j}"
        live.num_hashes_seen = len(request.block_hashes)

    # -- rules ---------------------------------------------------------------------

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        """A prompt made of a prefix of a family or of a past request, then new tokens."""
        STEPS[type(self).__name__] += 1
        # Index 0 is the latest request: hypothesis favours small integers.
        base = self.history[-1 - data.draw(st.integers(0, len(self.history) - 1), label="base")]
        num_shared = data.draw(st.just(len(base)) | st.integers(0, len(base)), label="num_shared")
        num_new = data.draw(st.integers(0, 2 * self.cfg.block_size), label="num_new_tokens")
        tokens = base[:num_shared] + [self.rng.randrange(VOCAB) for _ in range(num_new)]
        tokens = tokens[: self.cfg.max_len - 1] or [0]
        salt = data.draw(st.sampled_from([None, None, None, "", "salt"]), label="cache_salt")
        max_tokens = data.draw(st.integers(1, 3 * self.cfg.block_size), label="max_tokens")
        self.waiting.append(self._new_request(tokens, salt, max_tokens).request.seq_id)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """The first waiting request (preempted ones go first) alone in a step."""
        STEPS[type(self).__name__] += 1
        self._step(data, [], self.waiting[:1])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def schedule_step(self, data: st.DataObject) -> None:
        """Some running requests, then maybe the first waiting one, in one batch."""
        STEPS[type(self).__name__] += 1
        chosen = data.draw(
            st.lists(st.sampled_from(self.running), min_size=1, max_size=4, unique=True),
            label="running",
        )
        admit = self.waiting[:1] if data.draw(st.booleans(), label="admit_too") else []
        self._step(data, [r for r in self.running if r in chosen], admit)

    @precondition(lambda self: self.running and len(self.live) < MAX_LIVE)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        STEPS[type(self).__name__] += 1
        parent_live = self.live[data.draw(st.sampled_from(self.running), label="parent")]
        parent = parent_live.request
        max_tokens = data.draw(st.integers(1, 3 * self.cfg.block_size), label="max_tokens")
        child_live = self._new_request(list(parent.token_ids), parent_live.cache_salt, max_tokens)
        child = child_live.request
        self.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        self.running.append(child.seq_id)
        self._seen("fork")
        assert child.num_computed_tokens == parent.num_computed_tokens
        # A new request's whole table goes to the executor; later only diffs.
        child_live.tables = [list(t) for t in self.kv.get_block_ids(child.seq_id)]
        num_shared = cdiv(parent.num_computed_tokens, self.cfg.block_size)
        parent_tables = self.kv.get_block_ids(parent.seq_id)
        for child_table, parent_table in zip(child_live.tables, parent_tables, strict=True):
            assert child_table == parent_table[:num_shared]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """A running request stops, or a waiting one is aborted."""
        STEPS[type(self).__name__] += 1
        seq_id = data.draw(st.sampled_from(sorted(self.live)), label="finished")
        self._finish(self.live[seq_id], RequestStatus.FINISHED_ABORTED)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        STEPS[type(self).__name__] += 1
        self._preempt(self.live[data.draw(st.sampled_from(self.running), label="preempted")])

    @precondition(lambda self: self.host_tier)
    @rule(data=st.data())
    def take_over(self, data: st.DataObject) -> None:
        """Another scheduler takes the executor over with its cache: every
        request ends (handed back), and a new block core adopts what the
        executor's tags say, the device's blocks and the host tier's
        (oldest first), over the same KV memory."""
        STEPS[type(self).__name__] += 1
        if data.draw(st.integers(0, 7), label="take_over") != 0:
            return
        for live in list(self.live.values()):
            self._finish(live, RequestStatus.FINISHED_ABORTED)
        old = self.kv
        assert old.host is not None
        kind = CacheEventKind.STORED
        tagged = [
            CacheEvent(kind, block.block_id, block_hash, 0)
            for block_hash, block in old.pool.cached_blocks[0].items()
        ]
        on_host = [CacheEvent(kind, BlockId(h), bh, 0) for bh, h in old.host.cached()]
        self.kv = KVCacheManager(
            self.cfg.specs, self.cfg.num_blocks, model_id="m", num_host_blocks=old.host.num_blocks
        )
        assert self.kv.pool.adopt_cached_blocks(tagged) == len(tagged)
        assert self.kv.host is not None and self.kv.host.adopt(on_host) == len(on_host)
        self.kv.take_host_copies()  # the takeover's first step: nothing to copy
        self._seen("taken_over")

    @precondition(lambda self: self.host_tier)
    @rule(data=st.data())
    def offload_ahead(self, data: st.DataObject) -> None:
        """An idle executor's step (``ExecutorScheduler.idle_step``): the
        cached blocks among the pool's next ones go to the host ahead of
        their eviction. Between two steps here every cached block's tokens
        are written, as on an executor with no step in flight."""
        STEPS[type(self).__name__] += 1
        depth = data.draw(st.integers(0, self.cfg.num_blocks), label="offload_ahead")
        queued = self.kv.offload_ahead(depth)
        offloads, loads = self.kv.take_host_copies()
        assert not loads and len(offloads) >= queued
        for copy in offloads:
            self.shadow.offload(copy.block_id, copy.host_id, self.cfg.block_size)
        if queued:
            self._seen("offloaded_ahead")

    @rule(data=st.data())
    def reset_prefix_cache(self, data: st.DataObject) -> None:
        """Refused, changing nothing, while any block is held."""
        STEPS[type(self).__name__] += 1
        if data.draw(st.integers(0, 3), label="reset") != 0:
            return
        held = self.kv.pool.get_num_free_blocks() != self.cfg.num_blocks - 1
        before = self._snapshot()
        assert self.kv.reset_prefix_cache() is not held
        if held:
            assert self._snapshot() == before
        else:
            assert self.kv.pool.num_cached_blocks == 0

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_everything(self, data: st.DataObject) -> None:
        STEPS[type(self).__name__] += 1
        if data.draw(st.integers(0, 5), label="finish_everything") == 0:
            self._finish_all_and_check_empty()

    # -- the scheduler's moves --------------------------------------------------------

    def _step(self, data: st.DataObject, running: list[SeqId], waiting: list[SeqId]) -> None:
        """Allocates for a batch, then runs its forward on the shadow memory."""
        bs = self.cfg.block_size
        batch: list[Scheduled] = []
        for seq_id in running:
            if seq_id not in self.running:
                continue  # preempted earlier in this step
            live = self.live[seq_id]
            request = live.request
            start = request.num_computed_tokens
            chunk = data.draw(st.integers(1, 3 * bs), label="chunk")
            num_new = min(request.num_tokens - start, chunk)
            num_lookahead = 0
            if start == request.num_tokens - 1:
                room = self.cfg.max_len - request.num_tokens
                num_lookahead = data.draw(st.integers(0, min(2, room)), label="lookahead")
            allocated = self._allocate(live, num_new, None, num_lookahead)
            while not allocated:  # like vLLM: preempt the last running request, or itself
                scheduled = {s.live.request.seq_id for s in batch}
                victims = [r for r in self.running if r not in scheduled and r != seq_id]
                self._seen("preempted_to_fit")
                if not victims:  # the scheduler preempts the request itself
                    self._preempt(live)
                    break
                self._preempt(self.live[victims[-1]])
                allocated = self._allocate(live, num_new, None, num_lookahead)
            if allocated:
                batch.append(Scheduled(live, start, num_new, num_lookahead))
        for seq_id in waiting:
            live = self.live[seq_id]
            request = live.request
            expected = self._longest_possible_hit(request)
            hit = self.kv.get_computed_blocks(request)
            assert hit.num_tokens == expected, f"{request}: hit {hit.num_tokens}, could {expected}"
            chunk = data.draw(st.integers(1, 3 * bs), label="chunk")
            num_new = min(request.num_tokens - hit.num_tokens, chunk)
            if not self._allocate(live, num_new, hit, 0):
                continue  # stays waiting
            if hit.num_tokens:
                self._seen("prefix_hit")
            assert request.num_computed_tokens == hit.num_tokens
            self.waiting.remove(seq_id)
            self.running.append(seq_id)
            request.status = RequestStatus.RUNNING
            batch.append(Scheduled(live, hit.num_tokens, num_new, 0, hit))

        # The message: the host tier's offloads, then its loads, then the
        # copy-on-write copies, then every scheduled token.
        offloads, loads = self.kv.take_host_copies()
        for copy in offloads:
            self.shadow.offload(copy.block_id, copy.host_id, bs)
            self._seen("offloaded")
        for copy in loads:
            self.shadow.load(copy.host_id, copy.block_id, bs)
        for src, dst in self.copies:
            self.shadow.copy_block(src, dst, bs)
        self.copies = []
        for s in batch:
            self._write(s)
        for s in batch:
            for blocks in s.hit.blocks if s.hit is not None else ():
                for j, block in enumerate(blocks):
                    if not block.is_null:
                        self.shadow.check_block(
                            block.block_id, j, s.live.request.token_ids, bs, "hit"
                        )
            if s.hit is not None and s.hit.host:
                self._seen("host_hit")
                first = len(s.hit.blocks[0])
                for j in range(first, first + len(s.hit.host)):
                    block_id = s.live.tables[0][j]
                    self.shadow.check_block(block_id, j, s.live.request.token_ids, bs, "host hit")
        for s in batch:
            self._advance(s)

    def _allocate(
        self, live: Live, num_new: int, hit: ComputedBlocks | None, num_lookahead: int
    ) -> bool:
        """``allocate_slots``; a refusal must leave every structure as it was."""
        request = live.request
        before = self._snapshot()
        num_computed = request.num_computed_tokens
        allocation = self.kv.allocate_slots(request, num_new, hit, num_lookahead)
        copies = self.kv.take_copy_ops()
        if allocation is None:
            self._seen("refused")
            assert not copies
            assert request.num_computed_tokens == num_computed
            assert self._snapshot() == before, "a refused allocation changed the block core"
            return False
        if copies:
            self._seen("copy_on_write")
        if any(
            set(b) - set(a) for b, a in zip(before.cached, self.kv.pool.cached_blocks, strict=True)
        ):
            self._seen("evicted")
        self.copies += [(c.src, c.dst) for c in copies]
        for table, update in zip(live.tables, allocation.updates, strict=False):
            table[update.start :] = update.block_ids
        # The executor's tables must agree wherever the request still has a block.
        actual = self.kv.get_block_ids(request.seq_id)
        for g, (mirror, table) in enumerate(zip(live.tables, actual, strict=True)):
            assert len(mirror) == len(table), (g, mirror, table)
            for j, block_id in enumerate(table):
                assert block_id == NULL_BLOCK_ID or mirror[j] == block_id, (g, j, mirror, table)
            num_released = table.count(NULL_BLOCK_ID) - before.tables[g].get(
                request.seq_id, []
            ).count(NULL_BLOCK_ID)
            if hit is None and num_released:
                self._seen("window_release")
        return True

    def _write(self, s: Scheduled) -> None:
        """The forward writes the scheduled tokens (and draft garbage) through the tables."""
        request, bs = s.live.request, self.cfg.block_size
        end = s.start + s.num_new
        for table in s.live.tables:
            for pos in range(s.start, end + s.num_lookahead):
                block_id = table[pos // bs]
                assert block_id != NULL_BLOCK_ID, f"{request}: no block for position {pos}"
                token = request.token_ids[pos] if pos < end else GARBAGE
                self.shadow.slots[(block_id, pos % bs)] = (pos, token)

    def _advance(self, s: Scheduled) -> None:
        request = s.live.request
        request.num_computed_tokens = s.start + s.num_new
        if request.num_computed_tokens < request.num_tokens:
            return  # prefill goes on
        # One sampled token, sometimes with accepted draft tokens after it.
        num_sampled = min(self.rng.choice((1, 1, 1, 2, 3)), self.cfg.max_len - request.num_tokens)
        sampled = [self.rng.randrange(VOCAB) for _ in range(num_sampled)]
        if num_sampled == 1:
            request.append_output_token_ids(sampled[0])
        else:
            request.extend_output_token_ids(sampled)
        self._record_hashes(s.live)
        if request.num_output_tokens >= s.live.max_tokens or request.num_tokens >= self.cfg.max_len:
            self._finish(s.live, RequestStatus.FINISHED_LENGTH)

    def _preempt(self, live: Live) -> None:
        request = live.request
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        live.tables = [[] for _ in live.tables]
        self.running.remove(request.seq_id)
        self.waiting.insert(0, request.seq_id)
        self._remember(request)

    def _finish(self, live: Live, status: RequestStatus) -> None:
        request = live.request
        self.kv.free(request)
        request.status = status
        del self.live[request.seq_id]
        for queue in (self.running, self.waiting):
            if request.seq_id in queue:
                queue.remove(request.seq_id)
        self._remember(request)

    def _remember(self, request: Request) -> None:
        """Keeps the tokens for follow-up prompts (a chat's next turn)."""
        self.history = [*self.history[-MAX_HISTORY:], list(request.token_ids)]

    def _finish_all_and_check_empty(self) -> None:
        for live in list(self.live.values()):
            self._finish(live, RequestStatus.FINISHED_ABORTED)
        report = self.kv.check_integrity()
        assert report.ok, "\n".join(report.errors)
        assert report.num_used == 0
        assert self.kv.pool.get_num_free_blocks() == self.cfg.num_blocks - 1

    # -- oracles and checks -------------------------------------------------------------

    def _longest_possible_hit(self, request: Request) -> int:
        """Tokens of the longest prefix that every group can take from the index.

        Full attention needs every block of the prefix indexed; a sliding
        window only the blocks holding the ``window - 1`` keys before its end.
        The last token is always recomputed.
        """
        if not self.cfg.enable_caching:
            return 0
        bs, hashes = self.cfg.block_size, request.block_hashes
        host = self.kv.host
        if host is not None:  # the GPU's run from the start, then the host's
            candidates = hashes[: (request.num_tokens - 1) // bs]
            index = self.kv.pool.cached_blocks[0]
            num_hit = 0
            while num_hit < len(candidates) and candidates[num_hit] in index:
                num_hit += 1
            while num_hit < len(candidates) and candidates[num_hit] in host:
                num_hit += 1
            return num_hit * bs
        for num_blocks in range(min((request.num_tokens - 1) // bs, len(hashes)), 0, -1):
            if all(
                hashes[j] in self.kv.pool.cached_blocks[g]
                for g, group_spec in enumerate(self.cfg.specs)
                for j in range(self._first_needed_block(group_spec, num_blocks), num_blocks)
            ):
                return num_blocks * bs
        return 0

    @staticmethod
    def _first_needed_block(group_spec: KVCacheSpec, num_blocks: int) -> int:
        if group_spec.sliding_window is None:
            return 0
        return max(0, num_blocks - cdiv(group_spec.sliding_window - 1, group_spec.block_size))

    def _snapshot(self) -> Snapshot:
        pool = self.kv.pool
        return Snapshot(
            [b.block_id for b in pool.free_block_queue],
            [(b.ref_cnt, b.block_hash, b.group_id) for b in pool.blocks],
            [{h: b.block_id for h, b in index.items()} for index in pool.cached_blocks],
            [
                {r: [b.block_id for b in blocks] for r, blocks in m.req_to_blocks.items()}
                for m in self.kv.managers
            ],
            [dict(m.num_cached_blocks) for m in self.kv.managers],
            self.kv.host.cached() if self.kv.host is not None else [],
        )

    @invariant()
    def pool_is_consistent(self) -> None:
        report = self.kv.check_integrity()
        assert report.ok, "\n".join(report.errors)
        assert report.num_free + report.num_used == self.cfg.num_blocks - 1
        if not self.cfg.enable_caching:
            assert report.num_cached == 0
        # A held block has one meaning: one group's logical block j in every table.
        places: dict[int, set[tuple[int, int]]] = {}
        for seq_id in self.live:
            for g, table in enumerate(self.kv.get_block_ids(seq_id)):
                for j, block_id in enumerate(table):
                    if block_id != NULL_BLOCK_ID:
                        places.setdefault(block_id, set()).add((g, j))
        assert report.num_used == len(places), "a block is held by no live request"
        shared = {b: p for b, p in places.items() if len(p) > 1}
        assert not shared, f"blocks in several places (group, index): {shared}"

    @invariant()
    def indexed_blocks_hold_the_tokens_of_their_hash(self) -> None:
        bs = self.cfg.block_size
        for g, index in enumerate(self.kv.pool.cached_blocks):
            for block_hash, block in index.items():
                _, prefix = self.prefixes[block_hash]
                j = len(prefix) // bs - 1
                self.shadow.check_block(block.block_id, j, prefix, bs, f"group {g} index")

    @invariant()
    def host_blocks_hold_the_tokens_of_their_hash(self) -> None:
        host, bs = self.kv.host, self.cfg.block_size
        for block_hash, host_id in host.cached() if host is not None else ():
            _, prefix = self.prefixes[block_hash]
            j = len(prefix) // bs - 1
            for offset in range(bs):
                pos = j * bs + offset
                got = self.shadow.host.get((host_id, offset))
                assert got == (pos, prefix[pos]), f"host block {host_id} at {pos} holds {got}"

    @invariant()
    def requests_hold_their_own_tokens(self) -> None:
        bs = self.cfg.block_size
        for seq_id in self.waiting:
            assert self.live[seq_id].request.num_computed_tokens == 0
            assert not any(self.kv.get_block_ids(seq_id))
        for seq_id in self.running:
            request = self.live[seq_id].request
            num_computed = request.num_computed_tokens
            assert 0 < num_computed < request.num_tokens, request
            tables = self.kv.get_block_ids(seq_id)
            for group_spec, table in zip(self.cfg.specs, tables, strict=True):
                assert len(table) >= cdiv(num_computed, bs), (request, table)
                window = group_spec.sliding_window
                # The last computed token read the `window` keys up to itself.
                first_read = 0 if window is None else max(0, num_computed - window)
                for pos in range(num_computed):
                    block_id = table[pos // bs]
                    if block_id == NULL_BLOCK_ID:
                        assert pos < first_read, f"{request}: key {pos} in the window was dropped"
                        continue
                    got = self.shadow.slots.get((block_id, pos % bs))
                    assert got == (pos, request.token_ids[pos]), (
                        f"{request}: block {block_id} at {pos} holds {got}"
                    )

    def teardown(self) -> None:
        if hasattr(self, "kv"):
            self._finish_all_and_check_empty()


# No shrinking: a failing run reports its whole (unshrunk) step list at once
# instead of spending minutes. To shrink a failure locally, add Phase.shrink.
SETTINGS = settings(
    max_examples=100,
    stateful_step_count=200,  # hypothesis ends a run early once it made ~6,500 choices
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.parametrize(
    "layout",
    [FULL, SLIDING, HYBRID],
)
def test_block_core_invariants_hold_under_random_scheduling(layout: str) -> None:
    machine = type(f"BlockCore_{layout}", (BlockCoreMachine,), {"layouts": (layout,)})
    # Two groups have the most ways to go wrong: twice the runs.
    num_runs = 2 * SETTINGS.max_examples if layout == HYBRID else SETTINGS.max_examples
    run_state_machine_as_test(machine, settings=settings(SETTINGS, max_examples=num_runs))
    name = machine.__name__
    # Each layout runs >= 5,000 steps: over 10,000 per CI run in all.
    assert STEPS[name] >= 5_000, STEPS[name]
    exercised = {event for (m, event), n in SEEN.items() if m == name and n}
    wanted = {"prefix_hit", "copy_on_write", "refused", "preempted_to_fit", "evicted", "fork"}
    if layout != FULL:
        wanted.add("window_release")
    assert wanted <= exercised, f"never exercised: {wanted - exercised}"


def test_block_core_invariants_hold_with_a_host_tier() -> None:
    """One full-attention group with a host tier: evictions offload, misses
    on the GPU hit the host, and every host block holds its hash's tokens."""
    machine = type(
        "BlockCore_host_tier", (BlockCoreMachine,), {"layouts": (FULL,), "host_tier": True}
    )
    run_state_machine_as_test(
        machine, settings=settings(SETTINGS, max_examples=2 * SETTINGS.max_examples)
    )
    name = machine.__name__
    assert STEPS[name] >= 5_000, STEPS[name]
    exercised = {event for (m, event), n in SEEN.items() if m == name and n}
    wanted = {"prefix_hit", "host_hit", "offloaded", "evicted", "preempted_to_fit", "fork"}
    wanted |= {"taken_over", "offloaded_ahead"}
    assert wanted <= exercised, f"never exercised: {wanted - exercised}"
