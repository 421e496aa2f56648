"""Factories for block-core tests: specs, managers and requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.common.kv_cache_spec import KVCacheSpec
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.request import Request

BLOCK_SIZE = 4

# KV-cache group layouts the state machines draw from.
FULL = "full_attention"
SLIDING = "sliding_window"
HYBRID = "full_and_sliding_window"


def full_spec(block_size: int = BLOCK_SIZE) -> KVCacheSpec:
    return KVCacheSpec(block_size, num_layers=2, num_kv_heads=2, head_size=8, dtype="float16")


def window_spec(window: int, block_size: int = BLOCK_SIZE) -> KVCacheSpec:
    return KVCacheSpec(
        block_size,
        num_layers=2,
        num_kv_heads=2,
        head_size=8,
        dtype="float16",
        sliding_window=window,
    )


def layout_specs(layout: str, block_size: int, window: int) -> list[KVCacheSpec]:
    """The groups of a layout: full attention, a sliding window, or both (full first)."""
    full, sliding = full_spec(block_size), window_spec(window, block_size)
    return {FULL: [full], SLIDING: [sliding], HYBRID: [full, sliding]}[layout]


def max_request_len(specs: Sequence[KVCacheSpec], num_blocks: int) -> int:
    """Tokens a request may reach so that it fits the pool alone."""
    return (num_blocks - 1) // len(specs) * specs[0].block_size


@dataclass(frozen=True)
class Config:
    """A state machine's block core: layout, sizes and prefix caching."""

    layout: str
    block_size: int
    window: int
    num_blocks: int
    enable_caching: bool

    @property
    def specs(self) -> list[KVCacheSpec]:
        return layout_specs(self.layout, self.block_size, self.window)

    @property
    def max_len(self) -> int:
        """Tokens (lookahead slots included) a request may reach: it fits the pool alone."""
        return max_request_len(self.specs, self.num_blocks)


def manager(
    num_blocks: int,
    specs: Sequence[KVCacheSpec] | None = None,
    *,
    enable_caching: bool = True,
) -> KVCacheManager:
    return KVCacheManager(
        specs or [full_spec()], num_blocks, enable_caching=enable_caching, model_id="test-model"
    )


def admit(kv: KVCacheManager, request: Request, num_new_tokens: int | None = None) -> int:
    """Prefix lookup + allocation + 'running' the tokens. Returns the hit length."""
    computed = kv.get_computed_blocks(request)
    num_new = request.num_tokens - computed.num_tokens if num_new_tokens is None else num_new_tokens
    assert kv.allocate_slots(request, num_new, computed) is not None
    hit = computed.num_tokens
    request.num_computed_tokens = hit + num_new
    return hit


def decode(kv: KVCacheManager, request: Request, token_id: int) -> None:
    """One decode step: the pending token is computed, a new one is sampled."""
    assert kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    request.append_output_token_ids(token_id)


def free_ids(kv: KVCacheManager) -> list[int]:
    """Free queue as block ids, head (next reused) first."""
    return [b.block_id for b in kv.pool.free_block_queue]
