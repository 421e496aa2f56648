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

from pagedkv.common.block_hash import TOKEN_TYPECODE, hash_full_blocks, root_hash
from pagedkv.common.ids import BlockHash


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

    Holders are numbered (a freed number is reused), and each hash maps to
    the bit mask of its holders, so ``match`` walks a prompt with integer
    ANDs however many executors hold it. Only this class's methods change
    it. ``add``/``remove`` apply stored / removed events; ``clear`` drops one
    holder (a ``cleared`` event, an ended incarnation, or before a reload
    from the mirror).
    """

    __slots__ = ("_bit", "_by_hash", "_by_holder", "_free_bits", "_holder_of_bit")

    def __init__(self) -> None:
        self._by_hash: dict[bytes, int] = {}  # hash -> mask of holder bits
        self._by_holder: dict[str, set[bytes]] = {}
        self._bit: dict[str, int] = {}  # holder -> its bit (a power of two)
        self._holder_of_bit: dict[int, str] = {}
        self._free_bits: list[int] = []

    def _bit_of(self, holder: str) -> int:
        bit = self._bit.get(holder)
        if bit is None:
            bit = self._free_bits.pop() if self._free_bits else 1 << len(self._bit)
            self._bit[holder] = bit
            self._holder_of_bit[bit] = holder
            self._by_holder[holder] = set()
        return bit

    def add(self, holder: str, hashes: Iterable[bytes]) -> None:
        bit = self._bit_of(holder)
        held = self._by_holder[holder]
        by_hash = self._by_hash
        for block_hash in hashes:
            if block_hash not in held:
                held.add(block_hash)
                by_hash[block_hash] = by_hash.get(block_hash, 0) | bit

    def remove(self, holder: str, hashes: Iterable[bytes]) -> None:
        held = self._by_holder.get(holder)
        if held is None:
            return
        keep = ~self._bit[holder]
        by_hash = self._by_hash
        for block_hash in hashes:
            if block_hash in held:
                held.discard(block_hash)
                mask = by_hash[block_hash] & keep
                if mask:
                    by_hash[block_hash] = mask
                else:
                    del by_hash[block_hash]

    def clear(self, holder: str) -> None:
        """Forgets everything ``holder`` held and frees its number."""
        held = self._by_holder.get(holder)
        if held is None:
            return
        self.remove(holder, list(held))
        del self._by_holder[holder]
        bit = self._bit.pop(holder)
        del self._holder_of_bit[bit]
        self._free_bits.append(bit)

    def replace(self, holder: str, hashes: Iterable[bytes]) -> None:
        """``holder`` holds exactly ``hashes`` (a reload from the mirror)."""
        self.clear(holder)
        self.add(holder, hashes)

    def match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """For each holder of ``hashes[0]``: how many leading blocks of
        ``hashes`` it holds (a prefix cache only ever hits a prefix)."""
        by_hash = self._by_hash
        alive = by_hash.get(hashes[0], 0) if hashes else 0
        depth: dict[str, int] = {}
        for position, block_hash in enumerate(hashes[1:], start=1):
            if not alive:
                break
            still = alive & by_hash.get(block_hash, 0)
            if still != alive:
                self._record(alive & ~still, position, depth)
                alive = still
        self._record(alive, len(hashes), depth)
        return depth

    def _record(self, mask: int, num_blocks: int, depth: dict[str, int]) -> None:
        holder_of_bit = self._holder_of_bit
        while mask:
            bit = mask & -mask
            depth[holder_of_bit[bit]] = num_blocks
            mask ^= bit

    def holders(self) -> list[str]:
        return list(self._by_holder)

    def num_blocks(self, holder: str | None = None) -> int:
        """Hashes ``holder`` holds, or all holders' summed."""
        if holder is not None:
            return len(self._by_holder.get(holder, ()))
        return sum(len(held) for held in self._by_holder.values())

    def check_integrity(self) -> list[str]:
        """The maps agree; the problems found (empty when they do)."""
        problems = []
        for holder, held in self._by_holder.items():
            bit = self._bit.get(holder)
            if bit is None or self._holder_of_bit.get(bit) != holder:
                problems.append(f"{holder} has no bit of its own")
                continue
            for block_hash in held:
                if not self._by_hash.get(block_hash, 0) & bit:
                    problems.append(f"{holder} holds {block_hash.hex()} but is not listed")
        for block_hash, mask in self._by_hash.items():
            if not mask:
                problems.append(f"{block_hash.hex()} has no holder")
            while mask:
                bit = mask & -mask
                mask ^= bit
                owner = self._holder_of_bit.get(bit)
                if owner is None or block_hash not in self._by_holder[owner]:
                    problems.append(f"{block_hash.hex()} lists bit {bit}, which does not hold it")
        return problems
