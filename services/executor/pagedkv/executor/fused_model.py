"""The decoder stack of Llama-shaped models on fused kernels.

transformers' Llama, Qwen2, Qwen3, Mistral, Phi3, Gemma2 and Gemma3 layers
launch some twenty small kernels per layer besides their matmuls (the
RMSNorm's casts, power, mean, rsqrt and products, the rotary's halves,
negation and concatenations, the residual adds, the activation and its
product). ``FusedDecoder`` runs the same layers with the same weights as
four fused kernels and four matmuls per layer (Llama's shape):

- ``rms_norm`` / ``add_rms_norm``: the residual add fused with the next
  RMSNorm, the residual carried from layer to layer (the first layer's input
  norm has no add, the final norm adds the last layer's MLP output);
- one matmul for Q, K and V (Qwen3 and Gemma3: then each head of Q and of K
  through ``rms_norm``, two more launches, on copies of Q and K), then
  ``rotary_and_cache``: Q rotated in place, K rotated straight into the
  paged cache, V copied there; paged attention; the output projection. A
  batch of one-token decodes (every CUDA graph's) takes
  ``rotary_decode_attention`` instead: the flash-decoding kernel rotates Q
  and writes K and V itself, one launch for the two;
- one matmul for gate and up, then ``silu_mul`` (Gemma: ``gelu_tanh_mul``),
  then the down projection.

Gemma2 and Gemma3 also norm each sublayer's output before the residual add
(two more ``rms_norm`` launches per layer); their norms multiply by ``1 +
weight``, held as a float32 tensor (in bf16 the normalised row is rounded
once more than in transformers' Gemma norm, as Llama's norm rounds it);
Gemma2 soft-caps the final logits; Gemma3 rotates its sliding-window and
full layers with rotaries of different bases, a ``cos_sin`` table each.

Each layer's weights, the merged projections and the rotary tables are
``FusedLayer``'s (fused_layer.py). The LM head runs at the sampled tokens
only, whose final norm is the only one computed. ``unsupported_reason``
(fused_support.py) says why a model cannot run here; the runner then keeps
transformers' modules.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagedkv.executor.attention import AttentionMetadata
from pagedkv.executor.fused_layer import FusedLayer, norm_weight, rotary_table
from pagedkv.executor.fused_support import (
    ACTIVATIONS,
    GEMMA_MODEL_TYPES,
    activation,
    unsupported_reason,
)
from pagedkv.kernels.backend import KernelBackend


class FusedDecoder:
    """A transformers Llama-shaped causal LM's forward on ``backend``'s fused ops."""

    def __init__(self, model: Any, backend: KernelBackend, max_model_len: int) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"fused ops: {reason}")
        config = model.config
        base = model.model
        gemma = config.model_type in GEMMA_MODEL_TYPES
        self.backend = backend
        # K and V stored in the Hadamard basis (kv_rotation.py): the cache
        # write (and a one-launch decode's) rotates the query and key.
        self.rotate_kv = False
        self.act_mul = getattr(backend, ACTIVATIONS[activation(config)])  # type: ignore[index]
        self.embed_tokens = base.embed_tokens  # Gemma's scales the embedding itself
        self.lm_head = model.lm_head
        self.final_norm, self.final_eps = norm_weight(base.norm, gemma)
        self.final_softcap: float | None = getattr(config, "final_logit_softcapping", None)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        like = base.norm.weight.data
        layer_types = getattr(config, "layer_types", None) or [None] * len(base.layers)
        tables = {
            kind: rotary_table(base.rotary_emb, max_model_len, like, kind)
            for kind in set(layer_types)
        }
        self.layers = [
            FusedLayer.from_module(
                i, layer, config.num_attention_heads, num_kv_heads, gemma, tables[layer_types[i]]
            )
            for i, layer in enumerate(base.layers)
        ]

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
        sample_index: torch.Tensor | None,  # [num_samples]; None: every token
    ) -> torch.Tensor:  # [num_samples, vocab] logits, in the model's dtype
        """The packed forward: K/V written into the caches, logits at ``sample_index``."""
        ops = self.backend
        with torch.inference_mode():
            hidden = self.embed_tokens(input_ids)
            residual: torch.Tensor | None = None
            for layer in self.layers:
                if residual is None:
                    residual = hidden
                    normed = ops.rms_norm(hidden, layer.input_norm, layer.eps)
                else:
                    normed, residual = ops.add_rms_norm(
                        hidden, residual, layer.input_norm, layer.eps
                    )
                attended = self._attention(layer, normed, positions, meta)
                if layer.attn_out_norm is not None:
                    attended = ops.rms_norm(attended, layer.attn_out_norm, layer.eps)
                normed, residual = ops.add_rms_norm(
                    attended, residual, layer.pre_mlp_norm, layer.eps
                )
                gate_up = F.linear(normed, layer.gate_up_weight, layer.gate_up_bias)
                hidden = layer.down_proj(self.act_mul(gate_up))
                if layer.mlp_out_norm is not None:
                    hidden = ops.rms_norm(hidden, layer.mlp_out_norm, layer.eps)
            assert residual is not None
            if sample_index is not None:
                hidden, residual = hidden[sample_index], residual[sample_index]
            normed, _ = ops.add_rms_norm(hidden, residual, self.final_norm, self.final_eps)
            logits: torch.Tensor = self.lm_head(normed)
            if self.final_softcap is not None:  # as transformers' Gemma2 does it
                logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _attention(
        self,
        layer: FusedLayer,
        normed: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = len(normed)
        qkv = F.linear(normed, layer.qkv_weight, layer.qkv_bias)
        heads = qkv.view(num_tokens, -1, layer.head_size)
        sizes = [layer.num_q_heads, layer.num_kv_heads, layer.num_kv_heads]
        query, key, value = torch.split(heads, sizes, dim=1)
        if layer.q_norm is not None and layer.k_norm is not None:
            query = self._head_norm(query, layer.q_norm, layer.head_norm_eps)
            key = self._head_norm(key, layer.k_norm, layer.head_norm_eps)
        group = meta.layer_groups[layer.index]
        if meta.before_layer is not None:
            meta.before_layer(layer.index)
        key_cache, value_cache = meta.key_caches[layer.index], meta.value_caches[layer.index]
        slot_mapping = meta.slot_mappings[group]
        if meta.calibrate is not None:
            meta.calibrate(layer.index, key, value)
        scales = meta.scales(layer.index)
        one_launch = meta.max_query_len == 1 and num_tokens == len(meta.seq_lens)
        if meta.tiles is None and one_launch:
            out = self.backend.rotary_decode_attention(
                query,
                key,
                value,
                layer.cos_sin,
                positions,
                key_cache,
                value_cache,
                slot_mapping,
                meta.block_tables[group],
                meta.seq_lens,
                layer.scale,
                sliding_window=meta.group_windows[group],
                softcap=meta.softcap,
                max_seq_len=meta.max_seq_len,
                rotate=self.rotate_kv,
                **scales,
            )
            result: torch.Tensor = layer.o_proj(out.reshape(num_tokens, -1))
            return result
        self.backend.rotary_and_cache(
            query,
            key,
            value,
            layer.cos_sin,
            positions,
            key_cache,
            value_cache,
            slot_mapping,
            k_scale=scales.get("k_scale"),
            v_scale=scales.get("v_scale"),
            rotate=self.rotate_kv,
        )
        out = self.backend.paged_attention(
            query,
            key_cache,
            value_cache,
            meta.block_tables[group],
            meta.seq_lens,
            meta.query_start_loc,
            layer.scale,
            sliding_window=meta.group_windows[group],
            softcap=meta.softcap,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            tiles=meta.tiles,
            k_scale=scales.get("k_scale"),
            v_scale=scales.get("v_scale"),
            split=meta.split(group),
        )
        attended: torch.Tensor = layer.o_proj(out.reshape(num_tokens, -1))
        return attended

    def _head_norm(self, heads: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``heads`` ``[num_tokens, num_heads, D]`` (a view) normalised per head, a new tensor."""
        num_tokens, num_heads, head_size = heads.shape
        flat = heads.reshape(num_tokens * num_heads, head_size)
        return self.backend.rms_norm(flat, weight, eps).view(num_tokens, num_heads, head_size)
