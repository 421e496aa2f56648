"""The prefix-cache lookup across KV-cache groups, and its counters.

``PrefixLookup`` finds the longest cached prefix of a request that every
group can use: each group's own longest hit (``find_longest_cache_hit``:
full attention needs every block from the start, a sliding window only the
blocks in its window), shrunk until the groups agree; with a host tier (one
full-attention group) the run goes on in the host index where the GPU's
ends. It takes no reference
and changes no table (``KVCacheManager.allocate_slots`` takes the hits); it
owns the lookup counters of the prefix-cache stats, which ``find`` advances
(or, for a lookup made uncounted, ``count`` once its request is admitted).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.scheduler.host_tier import HostTier
from pagedkv.scheduler.kv_cache_types import ComputedBlocks, PrefixCacheStats
from pagedkv.scheduler.request import Request
from pagedkv.scheduler.single_type_kv_cache_manager import SingleTypeKVCacheManager


class PrefixLookup:
    """Prefix-cache lookups over the groups of one ``KVCacheManager``."""

    __slots__ = (
        "_managers",
        "_num_hits",
        "_num_host_hits",
        "_num_queries",
        "_num_requests",
        "block_size",
        "empty_hit",
        "enable_caching",
        "host",
    )

    def __init__(
        self,
        managers: Sequence[SingleTypeKVCacheManager],
        block_size: int,
        enable_caching: bool,
    ) -> None:
        self._managers = tuple(managers)
        self.block_size = block_size
        self.enable_caching = enable_caching
        # The hit of no block (what a lookup finds with caching off).
        self.empty_hit = ComputedBlocks(tuple(() for _ in self._managers), 0)
        self._num_requests = 0
        self._num_queries = 0
        self._num_hits = 0
        self._num_host_hits = 0
        self.host: HostTier | None = None  # set by the manager (one full-attention group)

    def find(self, request: Request, *, count: bool = True) -> ComputedBlocks:
        """The longest cached prefix of ``request`` that every group can use.

        Only whole blocks within the first ``num_tokens - 1`` tokens count: a
        full hit still recomputes the last token, whose logits are needed.
        Takes no reference. Counts one lookup in the stats unless ``count``
        is False (a placement probe).
        """
        if not self.enable_caching:
            return self.empty_hit
        max_length = request.num_tokens - 1
        hashes = request.block_hashes
        managers = self._managers
        if len(managers) == 1:
            hits = managers[0].find_longest_cache_hit(hashes, max_length)
            num_tokens = len(hits) * self.block_size
            host = self.host
            if host is None:
                result = ComputedBlocks((tuple(hits),), num_tokens)
            else:
                found = host.find(hashes, len(hits), max_length // self.block_size)
                on_host = host.choose(found, self.block_size)
                num_tokens += len(on_host) * self.block_size
                declined = bool(found) and not on_host
                result = ComputedBlocks((tuple(hits),), num_tokens, tuple(on_host), declined)
        else:
            # Shrink the candidate length until every group accepts it.
            length = max_length
            while True:
                per_group = [m.find_longest_cache_hit(hashes, length) for m in managers]
                agreed = min(len(h) for h in per_group) * self.block_size
                if all(len(h) * self.block_size == agreed for h in per_group):
                    break
                length = agreed
            num_tokens = agreed
            result = ComputedBlocks(tuple(tuple(h) for h in per_group), num_tokens)
        if count:
            self.count(request, result)
        return result

    def count(self, request: Request, computed: ComputedBlocks) -> None:
        """Counts a lookup of ``request`` that found ``computed`` in the
        stats (and, with a host tier, its choice for the host hits)."""
        self._num_requests += 1
        self._num_queries += request.num_tokens
        self._num_hits += computed.num_tokens
        if computed.host or computed.host_declined:
            assert self.host is not None
            self._num_host_hits += len(computed.host) * self.block_size
            self.host.count_choice(bool(computed.host))

    @property
    def stats(self) -> PrefixCacheStats:
        """Lookups counted since start: requests, tokens asked, tokens hit."""
        return PrefixCacheStats(
            self._num_requests, self._num_queries, self._num_hits, self._num_host_hits
        )
