"""The fused decoder-layer kernels against transformers' modules, on a GPU.

Per layer of a Llama-shaped model, at decode-sized batches: the residual add
with the next RMSNorm (``add_rms_norm`` against ``residual + x`` and
``LlamaRMSNorm``), the rotary with the KV cache write (``rotary_and_cache``
against the rotary module's cos/sin, ``apply_rotary_pos_emb`` and
``reshape_and_cache``) and the MLP's activation (``silu_mul`` against
``silu(gate) * up``). Times are GPU time (``bench.time_us``, the L2 left warm
as between the kernels of one forward), medians in µs; ``layer_*`` adds the
three with the norm counted twice, as a layer runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedkv.bench.kernels.bench import time_us
from pagedkv.kernels import cache_ops, norm_act, rotary

# (name, hidden, intermediate, q heads, kv heads, head size, layers)
SHAPES = (
    ("llama-1.1b", 2048, 8192, 32, 8, 64, 16),
    ("llama-3-8b", 4096, 14336, 32, 8, 128, 32),
)
NUM_TOKENS = (1, 64, 256)
DTYPE = torch.bfloat16


def _pair(ours: Callable[[], object], theirs: Callable[[], object]) -> tuple[float, float]:
    return time_us(ours, iters=50, flush=None), time_us(theirs, iters=50, flush=None)


def measure_shape(
    name: str,
    hidden: int,
    intermediate: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    num_layers: int,
    num_tokens: int,
) -> dict[str, Any]:
    """One row: fused and transformers' µs per op and per layer."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).to(DTYPE)

    x, residual = randn(num_tokens, hidden), randn(num_tokens, hidden)
    norm = LlamaRMSNorm(hidden, eps=1e-5).to("cuda", DTYPE)
    norm_us = _pair(
        lambda: norm_act.add_rms_norm(x, residual, norm.weight, 1e-5),
        lambda: norm(residual + x),
    )

    gate_up = randn(num_tokens, 2 * intermediate)
    gate, up = randn(num_tokens, intermediate), randn(num_tokens, intermediate)
    silu_us = _pair(lambda: norm_act.silu_mul(gate_up), lambda: torch.nn.functional.silu(gate) * up)

    config = LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=num_q_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_size,
        max_position_embeddings=8192,
    )
    rotary_emb = LlamaRotaryEmbedding(config).to("cuda")
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda", generator=gen)
    with torch.inference_mode():
        cos, sin = rotary_emb(x, torch.arange(8192, device="cuda")[None])
    half = head_size // 2
    cos_sin = torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).contiguous()
    qkv = randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_size)
    query, key, value = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    num_blocks = 1 + num_tokens
    key_cache = torch.zeros(num_blocks, 16, num_kv_heads, head_size, device="cuda", dtype=DTYPE)
    value_cache = torch.zeros_like(key_cache)
    slots = 16 * (1 + torch.arange(num_tokens, device="cuda"))

    def theirs_rotary() -> None:
        # As transformers' attention layer does it, [1, heads, T, D], then our cache write.
        with torch.inference_mode():
            c, s = rotary_emb(x, positions[None])
        q4 = qkv[None, :, :num_q_heads].transpose(1, 2)
        k4 = qkv[None, :, num_q_heads : num_q_heads + num_kv_heads].transpose(1, 2)
        q_rot, k_rot = apply_rotary_pos_emb(q4, k4, c, s)
        cache_ops.reshape_and_cache(k_rot[0].transpose(0, 1), value, key_cache, value_cache, slots)
        q_rot.transpose(1, 2).contiguous()  # transformers' attention reads it so

    rotary_us = _pair(
        lambda: rotary.rotary_and_cache(
            query, key, value, cos_sin, positions, key_cache, value_cache, slots
        ),
        theirs_rotary,
    )
    ours_layer = 2 * norm_us[0] + silu_us[0] + rotary_us[0]
    theirs_layer = 2 * norm_us[1] + silu_us[1] + rotary_us[1]
    return {
        "shape": name,
        "num_tokens": num_tokens,
        "add_rms_norm_us": norm_us[0],
        "add_rms_norm_hf_us": norm_us[1],
        "silu_mul_us": silu_us[0],
        "silu_mul_hf_us": silu_us[1],
        "rotary_and_cache_us": rotary_us[0],
        "rotary_and_cache_hf_us": rotary_us[1],
        "layer_us": ours_layer,
        "layer_hf_us": theirs_layer,
        "model_saving_us": (theirs_layer - ours_layer) * num_layers,
    }


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Every shape and batch (``quick``: the small shape, one and 64 tokens)."""
    shapes = SHAPES[:1] if quick else SHAPES
    counts = NUM_TOKENS[:2] if quick else NUM_TOKENS
    return [measure_shape(*shape, n) for shape in shapes for n in counts]


def summary(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["fused layer ops vs transformers' modules (GPU µs, L2 warm): ours / theirs"]
    for row in rows:
        lines.append(
            f"{row['shape']:11} T={row['num_tokens']:<4}"
            f" add+norm {row['add_rms_norm_us']:5.1f}/{row['add_rms_norm_hf_us']:5.1f}"
            f"  rotary+cache {row['rotary_and_cache_us']:5.1f}/{row['rotary_and_cache_hf_us']:5.1f}"
            f"  silu*up {row['silu_mul_us']:5.1f}/{row['silu_mul_hf_us']:5.1f}"
            f"  layer {row['layer_us']:5.1f}/{row['layer_hf_us']:5.1f}"
            f"  model -{row['model_saving_us']:.0f} us"
        )
    return lines
