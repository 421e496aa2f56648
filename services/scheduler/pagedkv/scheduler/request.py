"""A generation request as the block core sees it: tokens, progress, hashes."""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterable

from pagedkv.common.block_hash import (
    TOKEN_TYPECODE,
    hash_block_tokens,
    hash_full_blocks,
    token_bytes,
)
from pagedkv.common.ids import BlockHash, SeqId

_MAX_TOKEN_ID = 2**32 - 1


class RequestStatus(enum.IntEnum):
    """Where a request is in its life."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class Request:
    """Token ids, computed-token count and block hashes of one sequence.

    ``seq_id`` names the sequence (a ``SeqId``: its id in the block core and
    on the executor); the client's request id is its generation's
    (``Generation.request_id``), never the block core's.

    ``token_ids``: every token id, prompt then outputs, as a uint32 ``array``;
    append-only (sampled tokens are appended, nothing in it changes). The
    request hashes each full block once, incrementally, chained from
    ``root_hash`` (see ``pagedkv.common.block_hash.root_hash``: the model id,
    block size and cache salt): the prompt's full blocks at construction (on
    arrival, off the scheduling path), output blocks when ``block_hashes`` is
    next read after they filled (appending a token costs no hashing).

    ``num_prompt_tokens`` is where the outputs start. The tokens after it
    count toward ``max_tokens``; a request made from a prompt plus tokens a
    broken stream already delivered (``resumed_token_ids``) has it set back to
    the prompt's length by its maker, so those count as outputs (as a beam
    fork's inherited tokens do).

    ``num_computed_tokens`` counts tokens whose KV exists in the cache; the
    scheduler advances it, ``KVCacheManager.allocate_slots`` sets it on a
    prefix-cache hit, and it drops to 0 on preemption.
    """

    __slots__ = (
        "_block_hashes",
        "block_size",
        "max_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "priority",
        "root_hash",
        "seq_id",
        "status",
        "token_ids",
    )

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: Iterable[int],
        *,
        block_size: int,
        root_hash: BlockHash,
        max_tokens: int | None = None,
        priority: int = 0,
    ) -> None:
        try:
            token_ids = array(TOKEN_TYPECODE, prompt_token_ids)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"prompt_token_ids: every id must be in [0, {_MAX_TOKEN_ID}]") from exc
        if not token_ids:
            raise ValueError("prompt_token_ids: the prompt is empty")
        self.seq_id = SeqId(seq_id)
        self.token_ids = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0
        self.block_size = block_size
        self.root_hash = root_hash
        self.max_tokens = max_tokens
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self._block_hashes: list[BlockHash] = hash_full_blocks(
            root_hash, token_ids, block_size, 0, len(token_ids) // block_size
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def block_hashes(self) -> list[BlockHash]:
        """Hashes of every full block, in order; blocks filled since the last
        read are hashed now. Read it; do not mutate it."""
        hashes = self._block_hashes
        if len(self.token_ids) // self.block_size > len(hashes):
            self._hash_new_full_blocks()
        return hashes

    def append_output_token_ids(self, token_id: int) -> None:
        """Appends one sampled token."""
        self.token_ids.append(token_id)

    def extend_output_token_ids(self, token_ids: Iterable[int]) -> None:
        """Appends several sampled tokens."""
        self.token_ids.extend(token_ids)

    def extend_output_token_bytes(self, data: bytes) -> None:
        """Appends sampled tokens given as native uint32 bytes."""
        self.token_ids.frombytes(data)

    def _hash_new_full_blocks(self) -> None:
        hashes = self._block_hashes
        start = len(hashes)
        end = len(self.token_ids) // self.block_size
        if end == start + 1:  # the common case, without the general loop
            block_size = self.block_size
            data = token_bytes(self.token_ids[start * block_size : end * block_size])
            hashes.append(hash_block_tokens(hashes[-1] if start else self.root_hash, data))
        else:
            parent = hashes[-1] if start else self.root_hash
            hashes += hash_full_blocks(parent, self.token_ids, self.block_size, start, end)

    def __repr__(self) -> str:
        return (
            f"Request({self.seq_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )
