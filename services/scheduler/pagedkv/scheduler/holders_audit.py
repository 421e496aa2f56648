"""The holder half of the block core's integrity audit: what the tables of
every KV-cache group say about the pool's blocks (``KVCacheManager.
check_integrity`` adds it to the pool's own audit and the host tier's)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pagedkv.scheduler.block_pool import BlockPool
from pagedkv.scheduler.single_type_kv_cache_manager import SingleTypeKVCacheManager


def audit_holders(
    managers: Sequence[SingleTypeKVCacheManager], pool: BlockPool, num_used: int | None = None
) -> list[str]:
    """Broken invariants: a block held at two (group, index) places (a
    block holds one logical block's KV), a request's cached-block count
    past its table, a ref count that differs from the tables holding the
    block. ``num_used``: the pool's blocks with a ref count (its audit's
    count), when known: if the held blocks are that many and each one's
    ref count is its holders', every other block's is 0, and the walk over
    the whole pool is skipped."""
    errors: list[str] = []
    places: dict[int, tuple[int, int]] = {}
    holders: Counter[int] = Counter()
    for manager in managers:
        for seq_id, blocks in manager.req_to_blocks.items():
            for index, block in enumerate(blocks):
                if not block.is_null:
                    holders[block.block_id] += 1
                    place = (manager.group_id, index)
                    if places.setdefault(block.block_id, place) != place:
                        errors.append(
                            f"block {block.block_id}: held at (group, index) "
                            f"{places[block.block_id]} and {place}"
                        )
            num_cached = manager.num_cached_blocks.get(seq_id)
            if num_cached is None or num_cached > len(blocks):
                errors.append(f"{seq_id}: cached-block count {num_cached} of {len(blocks)}")
    blocks = pool.blocks
    if len(holders) == num_used and all(blocks[b].ref_cnt == n for b, n in holders.items()):
        return errors
    for block in blocks[1:]:
        if block.ref_cnt != holders.get(block.block_id, 0):
            errors.append(
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                f"{holders.get(block.block_id, 0)} holders"
            )
    return errors
