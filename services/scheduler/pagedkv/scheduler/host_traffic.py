"""What moves between one executor's GPU pool and its host tier each step
(``HostTraffic``): cached blocks written through to the host the step
after the one that computed them, blocks offloaded ahead of their
eviction, and the tier's queued copies, taken once per step sent. The
pool evicts into the tier itself (``BlockPool._evict_all``); the tier's
index and its copies are host_tier.py's."""

from __future__ import annotations

from itertools import islice

from pagedkv.scheduler.block_pool import BlockPool
from pagedkv.scheduler.host_tier import HostCopy, HostTier
from pagedkv.scheduler.kv_cache_block import KVCacheBlock


class HostTraffic:
    """``pool``'s traffic to ``host`` (None: no tier); ``write_through``:
    cached blocks go to the tier in the step after the one that computed
    them, else only when evicted."""

    def __init__(self, pool: BlockPool, host: HostTier | None, write_through: bool) -> None:
        self.pool = pool
        self.host = host
        self.write_through = write_through
        self._written_through: list[KVCacheBlock] = []  # entered for the step last sent

    def take_copies(self) -> tuple[list[HostCopy], list[HostCopy]]:
        """The host tier's offloads and loads for the step being sent (none
        without a tier); counts a step sent (host_tier.py). With write-through,
        the blocks the step before it entered into the index, computed by
        then, are written through to the host first, unless their hash is
        there already or they have been reused since; without, a cached block
        goes to the host only when evicted (``BlockPool._evict_all``)."""
        pool = self.pool
        pool.step += 1
        host = self.host
        if host is None:
            return [], []
        if self.write_through:
            previous = pool.step - 2  # the step count while the step before was made
            host.offload_all(
                (block.block_id, block.block_hash)
                for block in self._written_through
                if block.block_hash is not None and block.cached_step == previous
            )
            self._written_through, pool.fresh = pool.fresh, []
        else:
            pool.fresh.clear()
        return host.take_copies()

    def offload_ahead(self, num_blocks: int) -> int:
        """Queues the offload to the host tier of the cached blocks among the
        next ``num_blocks`` the pool hands out (the free queue's head) whose
        hash the tier lacks, ahead of their eviction, which then finds them
        there and sends no copy. Only for a step sent while no other is in
        flight or being made, when every cached block's tokens are computed
        (``ExecutorScheduler.idle_step``). Returns how many it queued."""
        host = self.host
        if host is None or num_blocks <= 0:
            return 0
        ahead = [
            (block.block_id, block.block_hash)
            for block in islice(self.pool.free_block_queue, num_blocks)
            if block.block_hash is not None and block.block_hash not in host
        ]
        if ahead:
            host.offload_all(ahead)
        return len(ahead)
