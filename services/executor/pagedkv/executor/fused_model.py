"""The decoder stack of Llama-shaped models on fused kernels.

transformers' Llama, Qwen2 and Mistral layers launch some twenty small
kernels per layer besides their matmuls (the RMSNorm's casts, power, mean,
rsqrt and products, the rotary's halves, negation and concatenations, the
residual adds, SiLU and its product). ``FusedDecoder`` runs the same layers
with the same weights as four fused kernels and four matmuls per layer:

- ``rms_norm`` / ``add_rms_norm``: the residual add fused with the next
  RMSNorm, the residual carried from layer to layer (the first layer's input
  norm has no add, the final norm adds the last layer's MLP output);
- one matmul for Q, K and V, then ``rotary_and_cache``: Q rotated in place,
  K rotated straight into the paged cache, V copied there; paged attention;
  the output projection. A batch of one-token decodes (every CUDA graph's)
  takes ``rotary_decode_attention`` instead: the flash-decoding kernel
  rotates Q and writes K and V itself, one launch for the two;
- one matmul for gate and up, then ``silu_mul``, then the down projection.

The merged Q/K/V and gate/up weights are single tensors, and the modules'
own weights become views into them, so the model keeps working unfused and
memory does not grow. ``cos_sin`` holds the model's rotary module's cosines
and sines for every position below ``max_model_len``, computed once, in the
model's dtype as transformers rounds them. The LM head runs at the sampled
tokens only, whose final norm is the only one computed.

``unsupported_reason`` says why a model cannot run here (another model type
or activation, a rotary whose angles depend on the sequence length, a layer
of another shape); the runner then keeps transformers' modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.executor.attention import AttentionMetadata
from pagedkv.kernels.backend import KernelBackend

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
# transformers recomputes these rotaries' frequencies from the sequence length.
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")
LAYER_MODULES = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def unsupported_reason(model: Any) -> str | None:
    """Why ``model`` (a transformers causal LM) cannot run fused; None if it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} is not silu"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in LENGTH_DEPENDENT_ROPE_TYPES:
        return f"rope_type {rope_type!r} depends on the sequence length"
    base = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(base, name):
            return f"the model has no model.{name}"
    for layer in base.layers:  # type: ignore[union-attr]
        for name in LAYER_MODULES:
            try:
                layer.get_submodule(name)
            except AttributeError:
                return f"a layer has no {name}"
        if hasattr(layer.self_attn, "q_norm") or hasattr(layer.self_attn, "k_norm"):
            return "the attention normalises queries and keys"
    return None


def _merge(linears: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``linears`` stacked by output; theirs become views."""
    weight = torch.cat([lin.weight.data for lin in linears])
    has_bias = [lin.bias is not None for lin in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("merged projections must all have a bias or none")
    bias = torch.cat([lin.bias.data for lin in linears]) if all(has_bias) else None
    start = 0
    for lin in linears:
        end = start + lin.out_features
        lin.weight.data = weight[start:end]
        if bias is not None:
            lin.bias.data = bias[start:end]
        start = end
    return weight, bias


@dataclass(frozen=True, slots=True)
class FusedLayer:
    """One decoder layer's weights as the fused forward reads them."""

    index: int
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    eps: float
    qkv_weight: torch.Tensor  # [(Hq + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: nn.Module
    gate_up_weight: torch.Tensor  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down_proj: nn.Module
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    scale: float

    @classmethod
    def from_module(cls, index: int, layer: Any, num_q_heads: int, num_kv_heads: int) -> FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_weight, qkv_bias = _merge([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up_weight, gate_up_bias = _merge([mlp.gate_proj, mlp.up_proj])
        head_size = attn.q_proj.out_features // num_q_heads
        return cls(
            index=index,
            input_norm=layer.input_layernorm.weight.data,
            post_norm=layer.post_attention_layernorm.weight.data,
            eps=float(layer.input_layernorm.variance_epsilon),
            qkv_weight=qkv_weight,
            qkv_bias=qkv_bias,
            o_proj=attn.o_proj,
            gate_up_weight=gate_up_weight,
            gate_up_bias=gate_up_bias,
            down_proj=mlp.down_proj,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            scale=float(attn.scaling),
        )


class FusedDecoder:
    """A transformers Llama-shaped causal LM's forward on ``backend``'s fused ops."""

    def __init__(self, model: Any, backend: KernelBackend, max_model_len: int) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"fused ops: {reason}")
        config = model.config
        base = model.model
        self.backend = backend
        self.embed_tokens = base.embed_tokens
        self.lm_head = model.lm_head
        self.final_norm = base.norm.weight.data
        self.final_eps = float(base.norm.variance_epsilon)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.layers = [
            FusedLayer.from_module(i, layer, config.num_attention_heads, num_kv_heads)
            for i, layer in enumerate(base.layers)
        ]
        self.cos_sin = rotary_table(base.rotary_emb, max_model_len, self.final_norm)

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
                normed, residual = ops.add_rms_norm(attended, residual, layer.post_norm, layer.eps)
                gate_up = F.linear(normed, layer.gate_up_weight, layer.gate_up_bias)
                hidden = layer.down_proj(ops.silu_mul(gate_up))
            assert residual is not None
            if sample_index is not None:
                hidden, residual = hidden[sample_index], residual[sample_index]
            normed, _ = ops.add_rms_norm(hidden, residual, self.final_norm, self.final_eps)
            logits: torch.Tensor = self.lm_head(normed)
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
        group = meta.layer_groups[layer.index]
        key_cache, value_cache = meta.key_caches[layer.index], meta.value_caches[layer.index]
        slot_mapping = meta.slot_mappings[group]
        if meta.max_query_len == 1 and num_tokens == len(meta.seq_lens):  # decodes only
            out = self.backend.rotary_decode_attention(
                query,
                key,
                value,
                self.cos_sin,
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
            )
            result: torch.Tensor = layer.o_proj(out.reshape(num_tokens, -1))
            return result
        self.backend.rotary_and_cache(
            query, key, value, self.cos_sin, positions, key_cache, value_cache, slot_mapping
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
        )
        attended: torch.Tensor = layer.o_proj(out.reshape(num_tokens, -1))
        return attended


def rotary_table(rotary_emb: Any, max_position: int, like: torch.Tensor) -> torch.Tensor:
    """``[max_position, head_size]``: per position the cosines of each rotated
    pair's angle, then the sines, from the model's rotary module (in ``like``'s
    dtype and device, as transformers computes them per forward)."""
    positions = torch.arange(max_position, device=like.device)[None]
    with torch.inference_mode():
        cos, sin = rotary_emb(like.new_empty(0), positions)
    half = cos.shape[-1] // 2
    cos, sin = cos[0], sin[0]
    if not (
        torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
    ):
        raise ValueError("fused ops: the rotary does not pair dims d and d + head_size / 2")
    return torch.cat([cos[:, :half], sin[:, :half]], dim=-1).contiguous()
