"""A generation request as the block core sees it: tokens, progress, hashes."""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterable

from pagedkv.common.ids import BlockHash, RequestId
from pagedkv.scheduler.block_hash import TOKEN_TYPECODE, hash_full_blocks

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

    Token ids are stored as a uint32 ``array`` (prompt then outputs). The
    request hashes its blocks incrementally: every time a block becomes full
    (at construction for the prompt, then in ``append_output_token_ids``) its
    hash is appended to ``block_hashes``, chained from ``root_hash`` (see
    ``block_hash.root_hash``: the model id, block size and cache salt).

    ``num_computed_tokens`` counts tokens whose KV exists in the cache; the
    scheduler advances it, ``KVCacheManager.allocate_slots`` sets it on a
    prefix-cache hit, and it drops to 0 on preemption.
    """

    __slots__ = (
        "_token_ids",
        "block_hashes",
        "block_size",
        "max_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "priority",
        "request_id",
        "root_hash",
        "status",
    )

    def __init__(
        self,
        request_id: str,
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
        self.request_id = RequestId(request_id)
        self._token_ids = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0
        self.block_size = block_size
        self.root_hash = root_hash
        self.max_tokens = max_tokens
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.block_hashes: list[BlockHash] = hash_full_blocks(
            root_hash, token_ids, block_size, 0, len(token_ids) // block_size
        )

    @property
    def token_ids(self) -> array[int]:
        """All token ids (prompt then outputs). Read it; do not mutate it."""
        return self._token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids) - self.num_prompt_tokens

    def append_output_token_ids(self, token_id: int) -> None:
        """Appends one sampled token; hashes the block it completes, if any."""
        token_ids = self._token_ids
        token_ids.append(token_id)
        if not len(token_ids) % self.block_size:
            self._hash_new_full_blocks()

    def extend_output_token_ids(self, token_ids: Iterable[int]) -> None:
        """Appends several sampled tokens; hashes the blocks they complete."""
        self._token_ids.extend(token_ids)
        self._hash_new_full_blocks()

    def _hash_new_full_blocks(self) -> None:
        start = len(self.block_hashes)
        end = len(self._token_ids) // self.block_size
        if end > start:
            parent = self.block_hashes[-1] if start else self.root_hash
            self.block_hashes += hash_full_blocks(
                parent, self._token_ids, self.block_size, start, end
            )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )
