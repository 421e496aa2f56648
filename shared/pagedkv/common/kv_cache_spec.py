"""What one group of attention layers needs from the KV cache.

The executor derives the specs from the model and reports them in `GetInfo`;
the scheduler sizes its block accounting from them and never loads the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.v1 import executor_pb2

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}
# Bytes a dtype's blocks keep per token and KV head beside the values: an
# int8 block's float16 scale for each (pagedkv.kernels.int8_kv).
_TOKEN_SCALE_BYTES = {"int8": 2}


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """One KV-cache group: layers that share a block table.

    `dtype` is a string (e.g. "bfloat16") so that this module stays free of
    torch. `sliding_window` is the number of most recent tokens a query
    attends to (itself included), or None for full attention.
    """

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "num_kv_heads", "head_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be positive")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(
                f"KVCacheSpec.dtype {self.dtype!r} is not one of {sorted(_DTYPE_BYTES)}"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError("KVCacheSpec.sliding_window must be positive or None")

    @property
    def dtype_size(self) -> int:
        """Bytes per element."""
        return _DTYPE_BYTES[self.dtype]

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block takes in one layer, K and V together (an int8
        block's per-token scales included)."""
        per_token = self.head_size * self.dtype_size + _TOKEN_SCALE_BYTES.get(self.dtype, 0)
        return 2 * self.block_size * self.num_kv_heads * per_token

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id takes across all layers of this group."""
        return self.page_size_bytes * self.num_layers


def specs_from_info(info: executor_pb2.GetInfoResponse) -> list[KVCacheSpec]:
    """The executor's KV cache groups as block-core specs, in wire order."""
    return [
        KVCacheSpec(
            block_size=group.block_size,
            num_layers=len(group.layer_indices),
            num_kv_heads=group.num_kv_heads,
            head_size=group.head_size,
            dtype=group.dtype,
            sliding_window=group.sliding_window if group.HasField("sliding_window") else None,
        )
        for group in info.kv_cache_groups
    ]
