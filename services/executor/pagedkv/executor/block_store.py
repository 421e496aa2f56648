"""What the executor needs of a second KV tier below the device's pool.

A step's ``offload_block_ids`` / ``offload_host_block_ids`` copy device
blocks to a tier's blocks, and its ``load_host_block_ids`` /
``load_block_ids`` copy them back into device blocks, before anything else
of the step (executor.proto). A block there is what copy-on-write copies
for a block id: K and V of every layer of every KV cache group
(kv_memory.py). ``BlockStore`` is that tier's interface, so that a disk
tier or a transfer engine can stand in for the host memory of
``host_kv.HostKVPool``; ``move_blocks`` runs a step's copies through it.
Which tier block holds what is the scheduler's to know: a store keeps no
bookkeeping, and a block never offloaded holds undefined bytes.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np


class BlockStore(Protocol):
    """A second KV tier: ``num_blocks`` blocks, ids ``0 .. num_blocks - 1``
    (no null block), each the bytes of one device block id."""

    @property
    def num_blocks(self) -> int: ...

    def offload(self, block_ids: np.ndarray, host_ids: np.ndarray) -> None:
        """Copies device block ``block_ids[i]`` into store block
        ``host_ids[i]`` (int64 arrays of one length; ``host_ids`` distinct).
        Reads the device blocks after every earlier device write; later
        device work does not wait for it, except, for a store that reads
        them later, a write into one of those blocks (see
        ``before_writes``). Mutates only the store blocks."""
        ...

    def before_writes(self, block_ids: np.ndarray) -> None:
        """Call before enqueuing device work that writes into ``block_ids``:
        that work then waits for any offload still reading them."""
        ...

    def load(self, host_ids: np.ndarray, block_ids: np.ndarray) -> None:
        """Copies store block ``host_ids[i]`` into device block
        ``block_ids[i]`` (``block_ids`` distinct), after every earlier
        offload that writes those store blocks or reads those device blocks.
        The blocks' layers may land in turn: layer ``l`` of them is in place
        for device work enqueued after ``before_layer(l)``, every layer
        after ``finish_loads()``; until then no other device work may touch
        those blocks. Mutates only those device blocks."""
        ...

    def chunk_starts(self) -> tuple[int, ...]:
        """The first layers of the chunks a load lands in, in order, 0
        first: ``before_layer(s)`` for such an ``s`` lands the layers up to
        the next one."""
        ...

    def before_layer(self, layer: int) -> None:
        """Call before enqueuing device work that reads layer ``layer`` of
        blocks loaded since the last ``finish_loads`` (a forward's attention
        of that layer): that work then finds them in place."""
        ...

    def finish_loads(self) -> None:
        """Every load so far is in place for device work enqueued after
        this call."""
        ...

    def copy_seconds(self) -> tuple[float, float]:
        """Time spent copying so far, offloads then loads, in seconds, over
        the calls known finished (device time on a GPU)."""
        ...


class HostTierTooSmall(ValueError):
    """``host_kv_gib`` holds no block: a startup error."""


def num_host_blocks(gib: float, bytes_per_block: int) -> int:
    """Host blocks in ``gib`` GiB; HostTierTooSmall when ``gib`` > 0 holds none."""
    num_blocks = math.floor(gib * 2**30 / bytes_per_block)
    if gib > 0 and num_blocks < 1:
        raise HostTierTooSmall(
            f"host_kv_gib: {gib} GiB holds no KV block of {bytes_per_block} bytes"
        )
    return num_blocks


def move_blocks(
    store: BlockStore | None, offloads: np.ndarray, loads: np.ndarray, *written: np.ndarray
) -> None:
    """A step's host copies: every offload (``[n, 2]``: block, host block),
    then every load (``[m, 2]``: host block, block), so a load reads what
    the step's offloads left; ``written``: the other blocks the step writes
    into (its table updates' blocks, its copies' destinations), whose
    pending offloads its device work waits for. The loads land layer by
    layer as the step's forward reaches them (``BlockStore.before_layer``;
    the model runner finishes them). No store: the host columns are empty
    (validated)."""
    if store is None:
        return
    if len(offloads):
        store.offload(offloads[:, 0], offloads[:, 1])
    if len(loads):
        store.load(loads[:, 0], loads[:, 1])
    for blocks in written:
        if len(blocks):
            store.before_writes(blocks)
