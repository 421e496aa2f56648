"""Block tags: which blocks of the KV pool hold the KV of a known prefix.

A tag ``block_id -> (block_hash, group_id)`` says: this block's KV equals the
KV of the prefix whose hash is ``block_hash``, as KV cache group ``group_id``
computed it. The scheduler that owns the executor sets and drops tags in its
steps (``tag_*`` and ``untag_block_ids`` in StepRequest); the executor only
keeps them, so that a scheduler that takes over the same incarnation can list
them (``ListCachedBlocks``) and rebuild its prefix-cache index, and cached
prompts stay hits across the takeover.

Invariant: a block is tagged only while its KV is what the tag says. The
executor keeps it with the engine's order of effects: a step's untags (and the
destinations of its copies) lose their tags before anything of the step
writes KV, and its tags are set only after its forward and sampling have
finished; a step refused by validation changes no tag.

The host tier's blocks carry tags too (``BlockTags.take_tags``): the engine keeps
them in a second ``BlockTags`` and lists them after the device's.

Single writer: the ``Executor`` engine, under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from pagedkv.common.ids import BlockHash, BlockId
from pagedkv.v1 import executor_pb2

LIST_CHUNK_SIZE = 8192
"""Most tags in one ListCachedBlocksResponse."""

MAX_BLOCK_HASH_BYTES = 64
"""The longest hash a tag may carry (pagedkv's scheduler sends 16 bytes)."""


class TagColumns(NamedTuple):
    """Tags as three columns of one length, oldest tag first."""

    block_ids: Sequence[BlockId]
    block_hashes: Sequence[BlockHash]
    group_ids: Sequence[int]


class BlockTags:
    """The tagged blocks, least recently tagged or released first.

    Tagging a block that is tagged already replaces its tag and moves it to the
    end; so does ``touch``, which the engine calls with the blocks of the rows
    a step frees, in the order a scheduler releases them; untagging a block
    that is not tagged does nothing.
    """

    def __init__(self) -> None:
        # Insertion-ordered: the order of the dict is the tag order.
        self._tags: dict[BlockId, tuple[BlockHash, int]] = {}

    def __len__(self) -> int:
        return len(self._tags)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._tags

    def tag(
        self,
        block_ids: Iterable[BlockId],
        block_hashes: Iterable[BlockHash],
        group_ids: Iterable[int],
    ) -> None:
        """Tags each block (at the end of the order), replacing an older tag."""
        tags = self._tags
        for block_id, block_hash, group_id in zip(block_ids, block_hashes, group_ids, strict=True):
            tags.pop(block_id, None)
            tags[block_id] = (block_hash, group_id)

    def touch(self, block_ids: Iterable[BlockId]) -> None:
        """Moves each tagged block to the end of the order, in turn (as a
        scheduler's free queue takes blocks released in that order); blocks
        without a tag are ignored."""
        tags = self._tags
        for block_id in block_ids:
            tag = tags.pop(block_id, None)
            if tag is not None:
                tags[block_id] = tag

    def take_tags(self, source: BlockTags, pairs: np.ndarray) -> None:
        """For each (source block, block) row of ``pairs`` (``[n, 2]``, an
        offload's block and host block), the block takes the source block's
        tag (at the end of the order), or loses its own when the source has
        none. One loop over the two dicts: a step that loads a host hit
        offloads hundreds of blocks before its copies start."""
        get, tags = source._tags.get, self._tags
        for source_id, block_id in pairs.tolist():
            tag = get(source_id)
            tags.pop(block_id, None)
            if tag is not None:
                tags[block_id] = tag

    def get(self, block_id: BlockId) -> tuple[BlockHash, int] | None:
        """The block's tag (hash, group), if it has one."""
        return self._tags.get(block_id)

    def untag(self, block_ids: Iterable[BlockId]) -> None:
        """Drops the blocks' tags; blocks without one are ignored."""
        tags = self._tags
        for block_id in block_ids:
            tags.pop(block_id, None)

    def clear(self) -> int:
        """Drops every tag; returns how many there were."""
        num_tags = len(self._tags)
        self._tags.clear()
        return num_tags

    def chunks(self, chunk_size: int = LIST_CHUNK_SIZE) -> list[TagColumns]:
        """A snapshot of every tag, oldest first, in chunks of at most
        ``chunk_size`` (none when nothing is tagged). The chunks do not follow
        later changes, so the caller takes them under the lock and may read
        them after releasing it."""
        assert chunk_size > 0
        items = list(self._tags.items())
        return [
            TagColumns(
                [block_id for block_id, _ in chunk],
                [block_hash for _, (block_hash, _) in chunk],
                [group_id for _, (_, group_id) in chunk],
            )
            for chunk in _split(items, chunk_size)
        ]

    def check_integrity(self, num_blocks: int, num_groups: int) -> None:
        """Asserts that every tag names a block in ``[1, num_blocks)``, a hash
        of 1 to ``MAX_BLOCK_HASH_BYTES`` bytes and a group below ``num_groups``."""
        for block_id, (block_hash, group_id) in self._tags.items():
            assert 0 < block_id < num_blocks, block_id
            assert 1 <= len(block_hash) <= MAX_BLOCK_HASH_BYTES, (block_id, block_hash)
            assert 0 <= group_id < num_groups, (block_id, group_id)


def listing(
    chunks: list[TagColumns], host_chunks: list[TagColumns]
) -> list[executor_pb2.ListCachedBlocksResponse]:
    """ListCachedBlocks' messages: the device's tags, then the host tier's."""
    return [
        executor_pb2.ListCachedBlocksResponse(
            block_ids=c.block_ids, block_hashes=c.block_hashes, group_ids=c.group_ids
        )
        for c in chunks
    ] + [
        executor_pb2.ListCachedBlocksResponse(
            host_block_ids=c.block_ids, host_block_hashes=c.block_hashes, host_group_ids=c.group_ids
        )
        for c in host_chunks
    ]


def _split(
    items: list[tuple[BlockId, tuple[BlockHash, int]]], size: int
) -> Iterator[list[tuple[BlockId, tuple[BlockHash, int]]]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
