"""The host tier's metadata for one executor: which cached block hashes sit in
which host block, in LRU order, and the copies a step asks for.

The executor keeps ``num_host_blocks`` blocks of host memory beside its GPU
pool (``pagedkv executor --host-kv-gib``); the scheduler decides what they
hold, as it does for the GPU pool. The tier is inclusive: a cached block
evicted from the GPU (popped for reuse) whose hash the host lacks is copied
to a host block (an *offload*) then; with write-through (``HOST_OFFLOADS``),
a block entered into the GPU index is offloaded in the step after the one
that computes it too, unless its hash is there already
(``KVCacheManager.take_host_copies``).
A prefix lookup that runs out of GPU hits goes on in the host index; each
host hit becomes a fresh GPU block entered into the GPU index under its hash
and a *load* from the host block, both in the same step message, ahead of
the forward (kv_cache_manager.py and single_group.py make them), when the
executor's measured costs say loading them beats computing them
(``LoadCosts``, ``choose``).

A step's offloads run on the executor before its loads, and both before
anything else of the step: a GPU block evicted and refilled in one step is
copied out before it is overwritten, and a hash offloaded and hit again in
one step is loaded back whole. A host block that a load of the step not yet
sent reads is *pinned*: no offload of that step may take it. A block whose
hash entered the GPU index in the step not yet sent is not offloaded (its
tokens are computed by that step's forward, which runs after the offloads;
a request preempted in the step it was scheduled never computes them).

Host blocks have no null block: ids run from 0 to ``num_blocks - 1``. Only
one full-attention KV-cache group is served (``KVCacheManager`` turns the
tier off otherwise). Every change to the host index is logged as a
``CacheEvent`` (its block id a host block id, group 0) until
``take_events``: the Redis mirror publishes them for the routers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from pagedkv.common.ids import BlockHash, BlockId
from pagedkv.scheduler.cache_events import CacheEvent, CacheEventKind


class HostHit(NamedTuple):
    """A block of a prefix found in the host tier: its hash and host block."""

    block_hash: BlockHash
    host_id: int


class HostCopy(NamedTuple):
    """One block moved between the tiers: GPU block ``block_id``, host block ``host_id``."""

    block_id: BlockId
    host_id: int


class LoadCosts(NamedTuple):
    """The executor's measured costs (GetInfo), in seconds: a prefill token,
    a load's fixed cost, a loaded block's. All 0: not measured."""

    prefill_seconds_per_token: float = 0.0
    load_seconds: float = 0.0
    load_seconds_per_block: float = 0.0

    @property
    def known(self) -> bool:
        return self.prefill_seconds_per_token > 0

    def load_pays(self, num_blocks: int, block_size: int) -> bool:
        """Whether loading ``num_blocks`` host blocks costs less than
        computing their tokens (unknown costs: it does)."""
        if not self.known:
            return True
        load = self.load_seconds + num_blocks * self.load_seconds_per_block
        return load < num_blocks * block_size * self.prefill_seconds_per_token

    def loads_never_pay(self, block_size: int) -> bool:
        """Whether a block's load costs at least its tokens' prefill, however
        many blocks a hit has (then the tier is not worth keeping)."""
        return self.known and (
            self.load_seconds_per_block >= block_size * self.prefill_seconds_per_token
        )


UNMEASURED = LoadCosts()

# A step that loads a host hit makes a few hundred copies, hits and cache
# events per block run: the NamedTuples below are built by the tuple's own
# constructor (the same objects, without the generated ``__new__``'s call).
_new = tuple.__new__
_STORED, _REMOVED = CacheEventKind.STORED, CacheEventKind.REMOVED

# Which host hits an admitted request loads: "auto", as ``LoadCosts.load_pays``
# says; "always"; "never" (it recomputes them: the tier still writes through
# and counts its hits, for measuring what the loads buy).
HOST_LOADS = ("auto", "always", "never")
# When a cached block is offloaded: in the step after the one that computed
# it, or only when the GPU pool evicts it (``KVCacheManager.take_host_copies``).
HOST_OFFLOADS = ("write-through", "eviction")


class HostTierStats(NamedTuple):
    """The tier's size and the blocks its index holds; counters since start:
    blocks offloaded and loaded, host blocks evicted, the choices of
    admissions, and the executor's copy time (seconds, offloads and loads,
    as its last step response reported)."""

    num_blocks: int
    num_cached: int
    num_offloaded: int
    num_loaded: int
    num_evicted: int
    num_loads_chosen: int
    num_recomputes_chosen: int
    offload_seconds: float = 0.0
    load_seconds: float = 0.0


class HostTier:
    """``num_blocks`` host blocks: the hash index in LRU order and the step's copies."""

    __slots__ = (
        "_free",
        "_index",
        "_loads",
        "_num_evicted",
        "_num_loaded",
        "_num_loads_chosen",
        "_num_offloaded",
        "_num_recomputes_chosen",
        "_offloads",
        "_pinned",
        "copy_seconds",
        "costs",
        "events",
        "loads",
        "num_blocks",
    )

    def __init__(self, num_blocks: int, costs: LoadCosts = UNMEASURED, loads: str = "auto") -> None:
        if num_blocks < 1:
            raise ValueError("a host tier needs at least one block")
        if loads not in HOST_LOADS:
            raise ValueError(f"host_loads: one of {', '.join(HOST_LOADS)}, got {loads!r}")
        self.num_blocks = num_blocks
        self.costs = costs
        self.loads = loads
        # The executor's copy time so far, offloads then loads (StepResponse).
        self.copy_seconds = (0.0, 0.0)
        self._num_loads_chosen = 0
        self._num_recomputes_chosen = 0
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives host block 0 first
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._pinned: set[int] = set()
        self._offloads: list[HostCopy] = []
        self._loads: list[HostCopy] = []
        self._num_offloaded = 0
        self._num_loaded = 0
        self._num_evicted = 0
        self.events: list[CacheEvent] = []

    # -- lookups -------------------------------------------------------------------------

    def find(self, block_hashes: Sequence[BlockHash], start: int, end: int) -> list[HostHit]:
        """The run of ``block_hashes[start:end]`` from ``start`` on that the
        host index holds (empty at the first miss)."""
        get = self._index.get
        hits: list[HostHit] = []
        for block_hash in block_hashes[start:end]:
            host_id = get(block_hash)
            if host_id is None:
                break
            hits.append(_new(HostHit, (block_hash, host_id)))
        return hits

    def choose(self, hits: list[HostHit], block_size: int) -> list[HostHit]:
        """The host hits a request takes: all of them when loading them
        costs less than computing their tokens (``costs``), else none (the
        request recomputes them); ``loads`` "always" or "never" overrides
        the costs."""
        if not hits:
            return hits
        loads = self.loads
        load = loads == "always" or (
            loads == "auto" and self.costs.load_pays(len(hits), block_size)
        )
        return hits if load else []

    def count_choice(self, loaded: bool) -> None:
        """Counts an admitted request's choice for the host hits it found."""
        if loaded:
            self._num_loads_chosen += 1
        else:
            self._num_recomputes_chosen += 1

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def cached(self) -> list[tuple[BlockHash, int]]:
        """The index's (hash, host block) pairs, least recently used first."""
        return list(self._index.items())

    # -- the step's copies ---------------------------------------------------------------

    def pin(self, hits: Sequence[HostHit]) -> None:
        """Keeps the hits' host blocks from being overwritten by an offload of
        the step not yet sent (call before allocating their GPU blocks, which
        may evict and offload). Their hashes become the most recently used
        now, as ``load`` would make them, so a full tier's offloads find the
        least recently used unpinned block first instead of passing every
        pinned one."""
        move_to_end, pin = self._index.move_to_end, self._pinned.add
        for block_hash, host_id in hits:
            pin(host_id)
            move_to_end(block_hash)

    def load(self, hits: Sequence[HostHit], block_ids: Sequence[BlockId]) -> None:
        """Queues the copy of each (pinned) host hit into the GPU block of
        ``block_ids`` at its place; their hashes become the most recently
        used."""
        move_to_end, append = self._index.move_to_end, self._loads.append
        for (block_hash, host_id), block_id in zip(hits, block_ids, strict=True):
            move_to_end(block_hash)
            append(_new(HostCopy, (block_id, host_id)))
        self._num_loaded += len(hits)

    def offload_all(self, blocks: Iterable[tuple[BlockId, BlockHash]]) -> None:
        """Each cached GPU block's KV, in order, goes to a host block (written
        through once computed, or at its eviction), unless its hash is there
        already (then it only becomes the most recently used). Without a host
        block to take (every one pinned) it is dropped."""
        index, free, pinned = self._index, self._free, self._pinned
        offload, log = self._offloads.append, self.events.append
        move_to_end, popitem = index.move_to_end, index.popitem
        num_offloaded = num_evicted = 0
        for block_id, block_hash in blocks:
            if block_hash in index:
                move_to_end(block_hash)
                continue
            if free:
                host_id = free.pop()
            elif index:  # a full tier: its least recently used block, as ``_take``
                old_hash, host_id = popitem(last=False)
                if host_id in pinned:  # rare (see ``pin``): the long way
                    index[old_hash] = host_id
                    taken = self._take()
                    if taken is None:
                        continue
                    host_id = taken
                else:
                    num_evicted += 1
                    log(_new(CacheEvent, (_REMOVED, host_id, old_hash, 0)))
            else:
                continue
            index[block_hash] = host_id
            offload(_new(HostCopy, (block_id, host_id)))
            log(_new(CacheEvent, (_STORED, host_id, block_hash, 0)))
            num_offloaded += 1
        self._num_offloaded += num_offloaded
        self._num_evicted += num_evicted

    def _take(self) -> int | None:
        """A host block to write in place of a full tier's least recently
        used one that no load of the step reads (its hash leaves the index).
        Pinned hashes were moved to the most recently used end (``pin``), so
        the first one tried is nearly always taken; a pinned one met on the
        way goes back to that end, which keeps the unpinned ones' order."""
        index, pinned = self._index, self._pinned
        for _ in range(len(index)):
            block_hash, host_id = index.popitem(last=False)
            if host_id in pinned:
                index[block_hash] = host_id
                continue
            self._num_evicted += 1
            self.events.append(CacheEvent(CacheEventKind.REMOVED, BlockId(host_id), block_hash, 0))
            return host_id
        return None

    def take_copies(self) -> tuple[list[HostCopy], list[HostCopy]]:
        """Drains the step's offloads and loads (in the order they were made)
        and unpins: they go out in the message now being made."""
        offloads, loads = self._offloads, self._loads
        self._offloads, self._loads = [], []
        self._pinned.clear()
        return offloads, loads

    def adopt(self, cached: Iterable[CacheEvent]) -> int:
        """Enters the host blocks an executor taken over lists as tagged
        (oldest first; their KV is what the tag says) into an empty tier, in
        that order; entries out of range, of another group, or repeating a
        host block or a hash are skipped. Returns how many it adopted."""
        if self._index:
            raise ValueError("adopt: the host tier must hold nothing")
        taken: set[int] = set()
        for entry in cached:
            host_id, block_hash = entry.block_id, entry.block_hash
            if entry.group_id or not 0 <= host_id < self.num_blocks:
                continue
            if host_id in taken or block_hash in self._index:
                continue
            taken.add(host_id)
            self._index[block_hash] = host_id
            self.events.append(CacheEvent(CacheEventKind.STORED, host_id, block_hash, 0))
        self._free = [h for h in self._free if h not in taken]
        return len(taken)

    def clear(self) -> None:
        """Forgets every host block's contents (``reset_prefix_cache``)."""
        self.events.extend(
            CacheEvent(CacheEventKind.REMOVED, BlockId(host_id), block_hash, 0)
            for block_hash, host_id in self._index.items()
        )
        self._index.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._pinned.clear()
        self._offloads, self._loads = [], []

    def take_events(self) -> list[CacheEvent]:
        """Drains the changes to the host index logged since the last call, in order."""
        events, self.events = self.events, []
        return events

    # -- views and checks ----------------------------------------------------------------

    @property
    def stats(self) -> HostTierStats:
        return HostTierStats(
            num_blocks=self.num_blocks,
            num_cached=len(self._index),
            num_offloaded=self._num_offloaded,
            num_loaded=self._num_loaded,
            num_evicted=self._num_evicted,
            num_loads_chosen=self._num_loads_chosen,
            num_recomputes_chosen=self._num_recomputes_chosen,
            offload_seconds=self.copy_seconds[0],
            load_seconds=self.copy_seconds[1],
        )

    def check_integrity(self) -> list[str]:
        """Broken invariants: every host block is free or indexed, once; the
        queued copies name blocks in range; pins are host blocks a queued
        load reads."""
        errors: list[str] = []
        if not self._pinned <= {copy.host_id for copy in self._loads}:
            errors.append("a pinned host block that no queued load reads")
        # GetStats audits every call, and a tier may hold a million blocks:
        # the common case is checked in bulk, the culprits named only when
        # it fails.
        ids = list(self._free)
        ids.extend(self._index.values())
        if len(ids) == self.num_blocks == len(set(ids)) and (
            not ids or (min(ids) >= 0 and max(ids) < self.num_blocks)
        ):
            return errors
        places: dict[int, str] = {}
        for host_id in self._free:
            if places.setdefault(host_id, "free") != "free":
                errors.append(f"host block {host_id}: free twice")
        for block_hash, host_id in self._index.items():
            where = f"hash {block_hash.hex()[:8]}"
            if places.setdefault(host_id, where) != where:
                errors.append(f"host block {host_id}: {places[host_id]} and {where}")
        if len(places) != self.num_blocks or any(not 0 <= h < self.num_blocks for h in places):
            errors.append(
                f"host blocks: {len(places)} free or indexed of {self.num_blocks} "
                "(one leaked, doubled or out of range)"
            )
        return errors
