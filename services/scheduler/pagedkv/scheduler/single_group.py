"""The block core's fast paths for its common layout: one full-attention
KV-cache group (``KVCacheManager._single_full``).

``admit_single`` gives a request new to the group its prefix hits and fresh
blocks; ``decode_single`` gives each running request a slot for one more
token, most of them with a few attribute reads. Both have the same effects
as the general allocation across groups (``allocate_groups``,
group_allocation.py) and change only what it would: the group's tables and
cached-block counts, the pool's ref counts, free queue and prefix-cache
index, and ``request.num_computed_tokens`` on a hit, and the host tier's
queued loads (a hit there takes a fresh block, host_tier.py). A decode that
needs more (a shared block about to be written, or no free block) goes to
the general path through ``allocate_one_more``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

from pagedkv.common.ids import SeqId
from pagedkv.scheduler.kv_cache_types import (
    Allocation,
    ComputedBlocks,
    DecodeAllocation,
    TableUpdate,
)
from pagedkv.scheduler.request import Request
from pagedkv.scheduler.single_type_kv_cache_manager import SingleTypeKVCacheManager, cdiv

_block_id = attrgetter("block_id")


def admit_single(
    manager: SingleTypeKVCacheManager,
    request: Request,
    num_new_tokens: int,
    computed: ComputedBlocks | None,
    enable_caching: bool,
) -> Allocation | None:
    """``allocate_slots`` for a request new to the single group ``manager``:
    None (nothing changed) when the pool cannot hold its tokens."""
    if computed is not None and computed.num_tokens:
        if request.num_computed_tokens:
            raise ValueError(f"{request.seq_id}: prefix hits are for a request with no blocks")
        hits = computed.blocks[0]
        host_hits = computed.host
        num_computed = computed.num_tokens
    else:
        hits = host_hits = ()
        num_computed = request.num_computed_tokens
    num_tokens = num_computed + num_new_tokens
    if num_new_tokens < 0 or num_tokens > request.num_tokens:
        raise ValueError(
            f"{request.seq_id}: {num_tokens} tokens scheduled, the request has {request.num_tokens}"
        )
    num_new_blocks = cdiv(num_tokens, manager.block_size) - len(hits)
    num_evictable = sum(1 for block in hits if not block.ref_cnt)
    pool = manager.pool
    if num_new_blocks + num_evictable > pool.free_block_queue.num_free_blocks:
        return None
    pool.touch(hits)
    host = pool.host
    if host_hits:
        assert host is not None
        host.pin(host_hits)  # before the new blocks' evictions offload
    blocks = [*hits, *pool.get_new_blocks(num_new_blocks)]
    if host_hits:
        assert host is not None
        loaded = blocks[len(hits) : len(hits) + len(host_hits)]
        host.load(host_hits, [block.block_id for block in loaded])
    seq_id = request.seq_id
    manager.req_to_blocks[seq_id] = blocks
    manager.num_cached_blocks[seq_id] = len(hits)
    if enable_caching:
        manager.cache_blocks(seq_id, request.block_hashes, num_tokens)
    request.num_computed_tokens = num_computed
    return Allocation((TableUpdate(0, tuple(map(_block_id, blocks))),))


def decode_single(
    manager: SingleTypeKVCacheManager,
    requests: Sequence[Request],
    start: int,
    forked: set[SeqId],
    enable_caching: bool,
    allocate_one_more: Callable[[Request], Allocation | None],
) -> DecodeAllocation:
    """``KVCacheManager.allocate_decode_slots`` in the single group
    ``manager``: ``forked`` names the requests whose tables may share a
    block that is written next (copy-on-write); ``allocate_one_more`` is the
    general path, for the requests this one does not handle."""
    updates: list[tuple[int, Allocation]] = []
    tables = manager.req_to_blocks
    block_size = manager.block_size
    pool = manager.pool
    for i, request in enumerate(requests[start:] if start else requests, start):
        seq_id = request.seq_id
        blocks = tables[seq_id]
        num_computed = request.num_computed_tokens
        num_slots = len(blocks) * block_size
        if num_computed < num_slots and not (
            forked and seq_id in forked and blocks[num_computed // block_size].ref_cnt > 1
        ):
            # Room in its own last block: only a block that fills needs work.
            # (A block whose last token is not known yet, in async stepping,
            # is entered when the next one fills, or by free().)
            if enable_caching and not (num_computed + 1) % block_size:
                manager.cache_blocks(seq_id, request.block_hashes, num_computed + 1)
            continue
        if num_computed == num_slots and pool.free_block_queue.num_free_blocks:
            # The next token starts a new block: append one.
            block = pool.get_new_block()
            blocks.append(block)
            update = TableUpdate(len(blocks) - 1, (block.block_id,))
            updates.append((i, Allocation((update,))))
            if enable_caching and block_size == 1:
                manager.cache_blocks(seq_id, request.block_hashes, num_computed + 1)
            continue
        allocation = allocate_one_more(request)
        if allocation is None:
            return DecodeAllocation(i - start, updates)
        if allocation.updates:
            updates.append((i, allocation))
    return DecodeAllocation(len(requests) - start, updates)
