"""The router's prefix index: which executors hold which cached block hashes.

``PrefixIndex`` maps a block hash to the executor incarnations whose prefix
cache holds it (KV cache group 0, the one every model has), kept from the KV
events the schedulers publish (see ``follower``). It is approximate by
design: it lags the schedulers by the event delay, and a stale entry only
costs a routing miss (the scheduler that gets the request looks its own
cache up again).

``prompt_block_hashes`` hashes a prompt's full blocks exactly as the
schedulers do (same root: model id, block size, cache salt), so a lookup
compares the same 16-byte values the schedulers cache under.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from pagedkv.common.ids import BlockHash
from pagedkv.scheduler.block_hash import TOKEN_TYPECODE, hash_full_blocks, root_hash


def prompt_block_hashes(
    token_ids: Sequence[int], model_id: str, block_size: int, cache_salt: str = ""
) -> list[BlockHash]:
    """The hashes of the full blocks of ``token_ids``, as a scheduler of
    ``model_id`` with ``block_size`` computes them."""
    tokens = array(TOKEN_TYPECODE, token_ids)
    num_full = len(tokens) // block_size
    root = root_hash(model_id, block_size, cache_salt or None)
    return hash_full_blocks(root, tokens, block_size, 0, num_full)


class PrefixIndex:
    """Block hash -> holders (executor incarnation ids), and each holder's hashes.

    Only this class's methods change it. ``add``/``remove`` apply stored /
    removed events; ``clear`` drops one holder (a ``cleared`` event, an
    ended incarnation, or before a reload from the mirror).
    """

    __slots__ = ("_by_hash", "_by_holder")

    def __init__(self) -> None:
        self._by_hash: dict[bytes, set[str]] = {}
        self._by_holder: dict[str, set[bytes]] = {}

    def add(self, holder: str, hashes: Iterable[bytes]) -> None:
        held = self._by_holder.setdefault(holder, set())
        by_hash = self._by_hash
        for block_hash in hashes:
            if block_hash in held:
                continue
            held.add(block_hash)
            holders = by_hash.get(block_hash)
            if holders is None:
                by_hash[block_hash] = {holder}
            else:
                holders.add(holder)

    def remove(self, holder: str, hashes: Iterable[bytes]) -> None:
        held = self._by_holder.get(holder)
        if held is None:
            return
        by_hash = self._by_hash
        for block_hash in hashes:
            if block_hash not in held:
                continue
            held.discard(block_hash)
            holders = by_hash[block_hash]
            holders.discard(holder)
            if not holders:
                del by_hash[block_hash]

    def clear(self, holder: str) -> None:
        """Forgets everything ``holder`` held (it stays unknown until added to)."""
        held = self._by_holder.pop(holder, None)
        by_hash = self._by_hash
        for block_hash in held or ():
            holders = by_hash[block_hash]
            holders.discard(holder)
            if not holders:
                del by_hash[block_hash]

    def replace(self, holder: str, hashes: Iterable[bytes]) -> None:
        """``holder`` holds exactly ``hashes`` (a reload from the mirror)."""
        self.clear(holder)
        self._by_holder[holder] = set()
        self.add(holder, hashes)

    def match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """For each holder of ``hashes[0]``: how many leading blocks of
        ``hashes`` it holds (a prefix cache only ever hits a prefix)."""
        if not hashes:
            return {}
        first = self._by_hash.get(hashes[0])
        if not first:
            return {}
        depth = dict.fromkeys(first, 1)
        alive = set(first)
        by_hash = self._by_hash
        for position, block_hash in enumerate(hashes[1:], start=2):
            holders = by_hash.get(block_hash)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for holder in alive:
                depth[holder] = position
        return depth

    def holders(self) -> list[str]:
        return list(self._by_holder)

    def num_blocks(self, holder: str | None = None) -> int:
        """Hashes ``holder`` holds, or all holders' summed."""
        if holder is not None:
            return len(self._by_holder.get(holder, ()))
        return sum(len(held) for held in self._by_holder.values())

    def check_integrity(self) -> list[str]:
        """The two maps agree; the problems found (empty when they do)."""
        problems = []
        for holder, held in self._by_holder.items():
            for block_hash in held:
                if holder not in self._by_hash.get(block_hash, ()):
                    problems.append(f"{holder} holds {block_hash.hex()} but is not listed")
        for block_hash, holders in self._by_hash.items():
            if not holders:
                problems.append(f"{block_hash.hex()} has no holder")
            for holder in holders:
                if block_hash not in self._by_holder.get(holder, ()):
                    problems.append(f"{block_hash.hex()} lists {holder}, which does not hold it")
        return problems
