"""The scheduler's view of one executor's KV cache: who holds which blocks.

``KVCacheManager`` drives one ``SingleTypeKVCacheManager`` per KV-cache group
over a shared ``BlockPool``: prefix-cache lookups consistent across groups,
all-or-nothing allocation, freeing, copy-on-write forks, stats and the
integrity audit. It never touches KV data: the executor applies the table
updates and copy ops it produces.

The result types live in ``kv_cache_types`` and are re-exported here. The
prefix-cache lookup across groups is ``PrefixLookup`` (prefix_lookup.py);
the general allocation across groups is ``allocate_groups``
(group_allocation.py), and the fast paths of the common layout, one
full-attention group, are in single_group.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.common.block_hash import root_hash
from pagedkv.common.ids import BlockId, SeqId
from pagedkv.common.kv_cache_spec import KVCacheSpec
from pagedkv.scheduler.block_pool import BlockPool, IntegrityReport
from pagedkv.scheduler.group_allocation import allocate_groups
from pagedkv.scheduler.holders_audit import audit_holders
from pagedkv.scheduler.host_tier import UNMEASURED, HostCopy, HostTier, LoadCosts
from pagedkv.scheduler.host_traffic import HostTraffic
from pagedkv.scheduler.kv_cache_types import (
    NO_TABLE_CHANGE,
    Allocation,
    BlockCopy,
    ComputedBlocks,
    DecodeAllocation,
    PrefixCacheStats,
    TableUpdate,
)
from pagedkv.scheduler.prefix_lookup import PrefixLookup
from pagedkv.scheduler.request import Request
from pagedkv.scheduler.single_group import admit_single, decode_single
from pagedkv.scheduler.single_type_kv_cache_manager import SingleTypeKVCacheManager, make_manager

__all__ = [
    "NO_TABLE_CHANGE",
    "Allocation",
    "BlockCopy",
    "ComputedBlocks",
    "DecodeAllocation",
    "KVCacheManager",
    "PrefixCacheStats",
    "TableUpdate",
]


class KVCacheManager:
    """Block accounting for one executor: every group's tables over one pool.

    All groups must share one block size. ``model_id`` keys the root of every
    block hash (see ``root_hash``), so that only requests of this model share
    cached blocks.

    Contract with the scheduler: call ``get_computed_blocks`` for a request
    with no blocks yet, then ``allocate_slots`` with the result before anything
    else allocates; ``allocate_slots`` returns None (and changes nothing) when
    the pool cannot hold the tokens. The scheduler advances
    ``request.num_computed_tokens`` itself once a step's tokens are computed.
    """

    def __init__(
        self,
        kv_cache_specs: Sequence[KVCacheSpec],
        num_blocks: int,
        *,
        enable_caching: bool = True,
        model_id: str = "",
        record_events: bool = False,
        num_host_blocks: int = 0,
        host_costs: LoadCosts = UNMEASURED,
        host_loads: str = "auto",
        host_write_through: bool = True,
    ) -> None:
        """``num_host_blocks``: the executor's host tier (host_tier.py), used
        with prefix caching on and one full-attention group, unless its
        measured ``host_costs`` say a load never costs less than a
        recompute (and ``host_loads`` is not "always"); else unused.
        ``host_loads``: which host hits a request loads (``HOST_LOADS``);
        ``host_write_through``: cached blocks go to the tier in the step
        after the one that computed them, else only when evicted."""
        if not kv_cache_specs:
            raise ValueError("kv_cache_specs: at least one KV-cache group is needed")
        block_sizes = {spec.block_size for spec in kv_cache_specs}
        if len(block_sizes) != 1:
            raise ValueError(f"kv_cache_specs: groups must share one block size, got {block_sizes}")
        self.block_size = block_sizes.pop()
        self.model_id = model_id
        self.enable_caching = enable_caching
        self.pool = BlockPool(
            num_blocks, enable_caching, num_groups=len(kv_cache_specs), record_events=record_events
        )
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            make_manager(spec, self.pool, group_id) for group_id, spec in enumerate(kv_cache_specs)
        )
        self._copy_ops: list[BlockCopy] = []
        # Requests that took part in a fork: only their tables can hold a
        # shared block that is written next (copy-on-write).
        self._forked: set[SeqId] = set()
        self._lookup = PrefixLookup(self.managers, self.block_size, enable_caching)
        self._empty_hit = self._lookup.empty_hit
        # The decode hot path: one full-attention group.
        only = self.managers[0]
        self._single_full: SingleTypeKVCacheManager | None = (
            only if len(self.managers) == 1 and type(only) is SingleTypeKVCacheManager else None
        )
        self.host: HostTier | None = None
        if (
            num_host_blocks
            and enable_caching
            and self._single_full is not None
            and (host_loads == "always" or not host_costs.loads_never_pay(self.block_size))
        ):
            tier = HostTier(num_host_blocks, host_costs, host_loads)
            self.host = self.pool.host = self._lookup.host = tier
        self._traffic = HostTraffic(self.pool, self.host, host_write_through)

    # -- requests ----------------------------------------------------------------------

    def make_request(
        self,
        seq_id: str,
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        max_tokens: int | None = None,
        priority: int = 0,
    ) -> Request:
        """A ``Request`` whose block hashes are keyed for this manager's cache."""
        return Request(
            seq_id,
            prompt_token_ids,
            block_size=self.block_size,
            root_hash=root_hash(self.model_id, self.block_size, cache_salt),
            max_tokens=max_tokens,
            priority=priority,
        )

    # -- prefix cache ------------------------------------------------------------------

    def get_computed_blocks(self, request: Request, *, count: bool = True) -> ComputedBlocks:
        """The longest cached prefix of ``request`` that every group can use.

        Only whole blocks within the first ``num_tokens - 1`` tokens count: a
        full hit still recomputes the last token, whose logits are needed.
        Takes no reference (``allocate_slots`` does). Counts one lookup in the
        prefix-cache stats unless ``count`` is False (a placement probe).
        """
        return self._lookup.find(request, count=count)

    def count_lookup(self, request: Request, computed: ComputedBlocks) -> None:
        """Counts in the prefix-cache stats a lookup made with ``count=False``
        (``get_computed_blocks``), once its request is admitted."""
        self._lookup.count(request, computed)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._lookup.stats

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block, the host tier's too; refused (False)
        while any block is held."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.host is not None:
            self.host.clear()
        return True

    # -- allocation --------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> Allocation | None:
        """Gives ``request`` slots for its next ``num_new_tokens`` tokens.

        Mutates, only when every group fits: the request's tables (prefix hits
        from ``computed`` first, then fresh blocks for tokens up to
        ``num_computed + num_new_tokens + num_lookahead_tokens``), the pool's
        ref counts and free queue, the prefix-cache index (blocks these tokens
        fill are entered), ``request.num_computed_tokens`` (set to
        ``computed.num_tokens`` on a hit) and the copy-op queue (copy-on-write
        of a shared block about to be written). Blocks that fell out of a
        sliding window go back to the pool.

        Returns None when the blocks cannot be had; then nothing has changed.
        """
        fast = self._single_full
        if fast is not None and not num_lookahead_tokens:
            blocks = fast.req_to_blocks.get(request.seq_id)
            if blocks is None:
                return admit_single(fast, request, num_new_tokens, computed, self.enable_caching)
            if computed is None:
                # Decode hot path: the request's last block has room and is its own.
                num_computed = request.num_computed_tokens
                num_tokens = num_computed + num_new_tokens
                block_size = self.block_size
                if (
                    num_computed < num_tokens <= len(blocks) * block_size
                    and blocks[num_computed // block_size].ref_cnt == 1
                ):
                    if (
                        self.enable_caching
                        and num_tokens // block_size > fast.num_cached_blocks[request.seq_id]
                    ):
                        fast.cache_blocks(request.seq_id, request.block_hashes, num_tokens)
                    return NO_TABLE_CHANGE
        return self._allocate_slots(request, num_new_tokens, computed, num_lookahead_tokens)

    def _allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: ComputedBlocks | None,
        num_lookahead_tokens: int,
    ) -> Allocation | None:
        """The general path, for any layout (``allocate_groups``)."""
        if computed is None or not computed.num_tokens:
            computed = self._empty_hit
        return allocate_groups(
            self.managers,
            request,
            num_new_tokens,
            computed,
            num_lookahead_tokens,
            self.enable_caching,
            self._copy_ops,
        )

    def allocate_decode_slots(
        self, requests: Sequence[Request], start: int = 0
    ) -> DecodeAllocation:
        """Gives each of ``requests[start:]`` a slot for one more token, in order.

        The decode path, the one that the scheduler's steps and the block
        benchmark both run: for each request, slots up to
        ``num_computed_tokens + 1`` (the next token may still be on the
        executor, not yet appended: async stepping). Same effects as
        ``allocate_slots`` per request; stops at the first request that cannot
        get a block (``num_allocated`` says where) so that the caller can
        preempt and call again from there. Requests whose last block has room
        and is their own cost a few attribute reads (``decode_single``).
        """
        fast = self._single_full
        if fast is None:
            updates: list[tuple[int, Allocation]] = []
            for i in range(start, len(requests)):
                allocation = self._allocate_one_more(requests[i])
                if allocation is None:
                    return DecodeAllocation(i - start, updates)
                if allocation.updates:
                    updates.append((i, allocation))
            return DecodeAllocation(len(requests) - start, updates)
        return decode_single(
            fast, requests, start, self._forked, self.enable_caching, self._allocate_one_more
        )

    def covers(self, request: Request, num_tokens: int) -> bool:
        """Whether ``request``'s own blocks already hold slots for
        ``num_tokens`` tokens, so that ``allocate_slots`` for them would
        change nothing: known only for one full-attention group and a request
        that shares no block by a fork (otherwise False: ask
        ``allocate_slots``). A decode window's entries mostly fit."""
        fast = self._single_full
        if fast is None or request.seq_id in self._forked:
            return False
        return len(fast.req_to_blocks[request.seq_id]) * self.block_size >= num_tokens

    def _allocate_one_more(self, request: Request) -> Allocation | None:
        num_new = 1 if request.num_tokens > request.num_computed_tokens else 0
        return self._allocate_slots(request, num_new, None, 1 - num_new)

    def take_copy_ops(self) -> list[BlockCopy]:
        """Drains the copy-on-write copies queued since the last call, in order."""
        ops, self._copy_ops = self._copy_ops, []
        return ops

    def take_host_copies(self) -> tuple[list[HostCopy], list[HostCopy]]:
        """The host tier's offloads and loads for the step being sent (none
        without a tier); counts a step sent (``HostTraffic.take_copies``)."""
        return self._traffic.take_copies()

    def offload_ahead(self, num_blocks: int) -> int:
        """Queues the offload of the cached blocks the pool hands out next,
        ahead of their eviction (``HostTraffic.offload_ahead``). Returns how
        many it queued."""
        return self._traffic.offload_ahead(num_blocks)

    # -- ending and sharing ------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Returns all of the request's blocks to the pool, tail block first.

        Every full block of computed tokens (up to
        ``request.num_computed_tokens``) is first entered into the
        prefix-cache index if it is not there yet (a decode's block whose last
        token was still on the executor when its slot was given waits until
        here, see ``allocate_decode_slots``), and stays there until
        reused, so a preempted request re-admitted later, or a next turn that
        repeats the conversation, hits them. Freeing a request with no blocks
        is a no-op.
        """
        seq_id = request.seq_id
        num_full = request.num_computed_tokens // self.block_size
        for manager in self.managers:
            if self.enable_caching and num_full > manager.num_cached_blocks.get(seq_id, num_full):
                manager.cache_blocks(seq_id, request.block_hashes, num_full * self.block_size)
            manager.free(seq_id)
        self._forked.discard(seq_id)

    def fork(self, parent: Request, child: Request) -> None:
        """Makes ``child`` share every block of ``parent`` that holds computed tokens.

        ``child`` is new to this manager and starts with the parent's tokens.
        Nothing is copied now: whichever of the two next writes into a shared,
        partly filled block gets a fresh block and a queued ``BlockCopy``.
        """
        num_computed = parent.num_computed_tokens
        if (
            child.num_tokens < num_computed
            or child.token_ids[:num_computed] != (parent.token_ids[:num_computed])
        ):
            raise ValueError(f"{child.seq_id}: a fork must start with the parent's tokens")
        for manager in self.managers:
            manager.fork(parent.seq_id, child.seq_id, num_computed)
        child.num_computed_tokens = num_computed
        self._forked.add(parent.seq_id)
        self._forked.add(child.seq_id)

    # -- views and checks --------------------------------------------------------------

    def get_block_ids(self, seq_id: SeqId) -> tuple[list[BlockId], ...]:
        """The request's block table in every group (null placeholders are 0)."""
        return tuple([b.block_id for b in m.req_to_blocks.get(seq_id, ())] for m in self.managers)

    def num_blocks_held(self, seq_id: SeqId) -> int:
        """Real (non-null) blocks in the request's tables, shared ones included."""
        return sum(
            1 for m in self.managers for b in m.req_to_blocks.get(seq_id, ()) if not b.is_null
        )

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return self.pool.usage

    def check_integrity(self) -> IntegrityReport:
        """The pool's audit, the holders' (holders_audit.py: each ref_cnt
        equals its tables) and the host tier's."""
        report = self.pool.check_integrity()
        num_used = None if report.errors else report.num_used
        errors = [*report.errors, *audit_holders(self.managers, self.pool, num_used)]
        if self.host is not None:
            errors.extend(self.host.check_integrity())
        return report._replace(errors=tuple(errors))
