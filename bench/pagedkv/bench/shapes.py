"""The llama shapes the benchmarks build with dummy weights: the executor
benchmark's ~1.1B llama, and Llama-3-8B's shape (``config.json`` fields)."""

from __future__ import annotations

from typing import Any

LLAMA_SHAPES: dict[str, dict[str, Any]] = {
    "llama-1.1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=32000,
        max_position_embeddings=2048,
    ),
    "llama-8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
}
