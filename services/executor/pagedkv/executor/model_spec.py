"""What the executor reads off a Hugging Face config: attention layout, KV cache
groups, vocabulary and limits.

Layers are grouped by their attention kind (full, or a sliding window of a
given size); each group has its own block table per request, and all groups
share one block-id space. The groups' order is the order of the per-group
columns on the wire: full attention first, then windows from the smallest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.common.kv_cache_spec import KVCacheSpec
from pagedkv.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """One KV cache group: its spec and the model layers it holds."""

    spec: KVCacheSpec
    layer_indices: tuple[int, ...]

    def to_proto(self) -> common_pb2.KVCacheSpec:
        spec = self.spec
        message = common_pb2.KVCacheSpec(
            block_size=spec.block_size,
            layer_indices=self.layer_indices,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            dtype=spec.dtype,
            page_size_bytes=spec.page_size_bytes,
        )
        if spec.sliding_window is not None:
            message.sliding_window = spec.sliding_window
        return message


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The model facts the executor serves from (and reports in GetInfo)."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    layer_windows: tuple[int | None, ...]  # per layer: sliding window, or None
    softcap: float | None  # attention logit soft-cap, or None

    def kv_cache_groups(self, block_size: int, dtype: str) -> tuple[KVCacheGroup, ...]:
        """The layers grouped by window (full attention first)."""
        windows = sorted(set(self.layer_windows), key=lambda w: (w is not None, w or 0))
        return tuple(
            KVCacheGroup(
                spec=KVCacheSpec(
                    block_size=block_size,
                    num_layers=sum(1 for w in self.layer_windows if w == window),
                    num_kv_heads=self.num_kv_heads,
                    head_size=self.head_size,
                    dtype=dtype,
                    sliding_window=window,
                ),
                layer_indices=tuple(i for i, w in enumerate(self.layer_windows) if w == window),
            )
            for window in windows
        )


def _layer_windows(config: Any) -> tuple[int | None, ...]:
    num_layers = int(config.num_hidden_layers)
    window: int | None = getattr(config, "sliding_window", None)
    layer_types: list[str] | None = getattr(config, "layer_types", None)
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return (None,) * num_layers
    return (int(window),) * num_layers


def model_spec_from_config(config: Any, max_model_len: int | None = None) -> ModelSpec:
    """Reads a transformers ``PretrainedConfig`` (decoder-only, text).

    ``max_model_len`` caps the model's ``max_position_embeddings``; ValueError
    when larger.
    """
    num_q_heads = config.num_attention_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // num_q_heads
    eos = config.eos_token_id
    if eos is None:
        eos_ids: tuple[int, ...] = ()
    elif isinstance(eos, int):
        eos_ids = (eos,)
    else:
        eos_ids = tuple(eos)
    limit = int(config.max_position_embeddings)
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(f"max_model_len: {max_model_len} is beyond the model's {limit} positions")
    softcap = getattr(config, "attn_logit_softcapping", None)
    return ModelSpec(
        num_layers=config.num_hidden_layers,
        num_q_heads=num_q_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_q_heads,
        head_size=head_size,
        vocab_size=config.vocab_size,
        max_model_len=max_model_len or limit,
        eos_token_ids=eos_ids,
        layer_windows=_layer_windows(config),
        softcap=float(softcap) if softcap else None,
    )
