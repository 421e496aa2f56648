"""The block core's general allocation: slots for a request's next tokens in
every KV-cache group at once, all or nothing (``allocate_groups``).

``KVCacheManager.allocate_slots`` takes this path for any layout (several
groups, sliding windows, lookahead slots, forks' copy-on-write); the fast
paths of one full-attention group (single_group.py) have the same effects
and come here for what they do not handle. It first counts the blocks every
group needs against the free ones (and those that leaving a window would
release): when they do not fit, nothing changes. Otherwise every group takes
its prefix hits and releases what left its window before any group
allocates, so that no group's fresh blocks come from another group's hits.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from pagedkv.common.ids import BlockId
from pagedkv.scheduler.kv_cache_types import (
    NO_TABLE_CHANGE,
    Allocation,
    BlockCopy,
    ComputedBlocks,
    TableUpdate,
)
from pagedkv.scheduler.request import Request
from pagedkv.scheduler.single_type_kv_cache_manager import SingleTypeKVCacheManager

_block_id = attrgetter("block_id")


def allocate_groups(
    managers: Sequence[SingleTypeKVCacheManager],
    request: Request,
    num_new_tokens: int,
    computed: ComputedBlocks,
    num_lookahead_tokens: int,
    enable_caching: bool,
    copy_ops: list[BlockCopy],
) -> Allocation | None:
    """``allocate_slots`` across ``managers``, the groups over one pool:
    slots for tokens up to ``num_computed + num_new_tokens +
    num_lookahead_tokens``, from ``computed``'s hits (an empty hit, no
    tokens: none) first, then fresh blocks. None, with nothing changed, when
    the pool cannot hold them.

    Mutates, only when every group fits: each group's tables and cached-block
    counts, the pool's ref counts, free queue and prefix-cache index, the
    host tier's pins and queued loads (host hits, one full-attention group),
    ``request.num_computed_tokens`` (set on a hit), and ``copy_ops``, to
    which the copy-on-write copies of shared blocks about to be written are
    appended. Raises ValueError for negative counts, hits for a request
    that holds blocks, or more tokens than the request has."""
    if num_new_tokens < 0 or num_lookahead_tokens < 0:
        raise ValueError("num_new_tokens and num_lookahead_tokens must not be negative")
    seq_id = request.seq_id
    if not computed.num_tokens:
        num_computed = request.num_computed_tokens
    else:
        if request.num_computed_tokens or any(m.req_to_blocks.get(seq_id) for m in managers):
            raise ValueError(f"{seq_id}: prefix hits are for a request with no blocks")
        num_computed = computed.num_tokens
    num_tokens = num_computed + num_new_tokens
    # (With no new tokens the computed count may run ahead of the known
    # tokens: samples still in flight, async stepping.)
    if num_new_tokens and num_tokens > request.num_tokens:
        raise ValueError(
            f"{seq_id}: {num_tokens} tokens scheduled, the request has {request.num_tokens}"
        )
    num_slots = num_tokens + num_lookahead_tokens

    pool = managers[0].pool
    num_needed = 0
    for manager, hits in zip(managers, computed.blocks, strict=True):
        num_needed += manager.get_num_blocks_to_allocate(seq_id, num_computed, num_slots, hits)
        # Hits sitting in the free queue leave it when touched.
        num_needed += sum(1 for b in hits if not b.ref_cnt and not b.is_null)
    num_free = pool.get_num_free_blocks()
    if num_needed > num_free:
        num_free += sum(m.get_num_releasable_blocks(seq_id, num_computed) for m in managers)
        if num_needed > num_free:
            return None

    # First every group takes its hits and releases what left its window,
    # so that no group's fresh blocks come from another group's hits and
    # every released block is free before any group allocates.
    starts = [len(m.req_to_blocks.get(seq_id, ())) for m in managers]
    for manager, hits in zip(managers, computed.blocks, strict=True):
        if hits:
            pool.touch(hits)
            manager.save_new_computed_blocks(seq_id, hits)
        manager.remove_skipped_blocks(seq_id, num_computed)
    host_hits = computed.host
    host = pool.host
    if host_hits:  # one full-attention group: see host_tier.py
        assert host is not None
        host.pin(host_hits)
    copies: list[tuple[BlockId, BlockId]] = []
    updates: list[TableUpdate] = []
    write_index = num_computed // managers[0].block_size
    for manager, start in zip(managers, starts, strict=True):
        num_copies = len(copies)
        manager.allocate_new_blocks(seq_id, num_computed, num_slots, copies)
        if len(copies) > num_copies:
            start = min(start, write_index)
        if enable_caching:
            manager.cache_blocks(seq_id, request.block_hashes, num_tokens)
        blocks = manager.req_to_blocks[seq_id]
        updates.append(TableUpdate(start, tuple(map(_block_id, blocks[start:]))))
    if host_hits:
        assert host is not None
        first = len(computed.blocks[0])
        loaded = managers[0].req_to_blocks[seq_id][first : first + len(host_hits)]
        host.load(host_hits, [block.block_id for block in loaded])
    if computed.num_tokens:
        request.num_computed_tokens = num_computed
    copy_ops.extend(BlockCopy(src, dst) for src, dst in copies)
    if all(not u.block_ids for u in updates):
        return NO_TABLE_CHANGE
    return Allocation(tuple(updates))
