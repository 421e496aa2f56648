"""A decoder layer's weights as the fused stack (fused_model.py) reads them.

``FusedLayer.from_module`` takes one transformers layer's weights: its
norms (Gemma's as ``1 + weight`` in float32, ``norm_weight``), the merged
Q/K/V and gate/up projections, qwen3's and Gemma3's per-head query and key
norms, and the layer's rotary table. The merged Q/K/V and gate/up weights
are single tensors, and the modules' own weights become views into them, so
the model keeps working unfused and memory does not grow (Phi3's
projections are merged already: its ``qkv_proj`` and ``gate_up_proj`` are
read as they are). ``rotary_table`` holds the model's rotary module's
cosines and sines for every position below ``max_model_len``, computed
once, in the model's dtype as transformers rounds them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def norm_weight(module: Any, gemma: bool) -> tuple[torch.Tensor, float]:
    """An RMSNorm module's weight as the kernels take it, and its epsilon.

    Gemma's norms multiply by ``1 + weight`` in float32: a new float32 tensor."""
    eps: float = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
    weight = module.weight.data
    return (1.0 + weight.float() if gemma else weight), float(eps)


def _merge(linears: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``linears`` stacked by output; theirs become views."""
    if len(linears) == 1:  # merged already
        only = linears[0]
        return only.weight.data, None if only.bias is None else only.bias.data
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
    pre_mlp_norm: torch.Tensor  # [hidden]
    attn_out_norm: torch.Tensor | None  # [hidden]: Gemma's norm of the attention's output
    mlp_out_norm: torch.Tensor | None  # [hidden]: and of the MLP's
    eps: float
    qkv_weight: torch.Tensor  # [(Hq + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D]: qwen3's and Gemma3's RMSNorm of each query head
    k_norm: torch.Tensor | None  # [D]: and of each key head
    head_norm_eps: float
    cos_sin: torch.Tensor  # [max_model_len, D]: this layer's rotary table
    o_proj: nn.Module
    gate_up_weight: torch.Tensor  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down_proj: nn.Module
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    scale: float

    @classmethod
    def from_module(
        cls,
        index: int,
        layer: Any,
        num_q_heads: int,
        num_kv_heads: int,
        gemma: bool,
        cos_sin: torch.Tensor,
    ) -> FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "qkv_proj"):
            qkv = [attn.qkv_proj]
        else:
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = (
            [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
        )
        qkv_weight, qkv_bias = _merge(qkv)
        gate_up_weight, gate_up_bias = _merge(gate_up)
        head_size = len(qkv_weight) // (num_q_heads + 2 * num_kv_heads)
        input_norm, eps = norm_weight(layer.input_layernorm, gemma)
        post_attention_norm, _ = norm_weight(layer.post_attention_layernorm, gemma)
        if gemma:  # the post-attention norm is the attention output's
            attn_out_norm: torch.Tensor | None = post_attention_norm
            pre_mlp_norm, _ = norm_weight(layer.pre_feedforward_layernorm, gemma)
            mlp_out_norm: torch.Tensor | None = norm_weight(
                layer.post_feedforward_layernorm, gemma
            )[0]
        else:
            attn_out_norm, pre_mlp_norm, mlp_out_norm = None, post_attention_norm, None
        q_norm = k_norm = None
        head_norm_eps = 0.0
        if getattr(attn, "q_norm", None) is not None:
            q_norm, head_norm_eps = norm_weight(attn.q_norm, gemma)
            k_norm, _ = norm_weight(attn.k_norm, gemma)
        return cls(
            index=index,
            input_norm=input_norm,
            pre_mlp_norm=pre_mlp_norm,
            attn_out_norm=attn_out_norm,
            mlp_out_norm=mlp_out_norm,
            eps=eps,
            qkv_weight=qkv_weight,
            qkv_bias=qkv_bias,
            q_norm=q_norm,
            k_norm=k_norm,
            head_norm_eps=head_norm_eps,
            cos_sin=cos_sin,
            o_proj=attn.o_proj,
            gate_up_weight=gate_up_weight,
            gate_up_bias=gate_up_bias,
            down_proj=mlp.down_proj,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            scale=float(attn.scaling),
        )


def rotary_table(
    rotary_emb: Any, max_position: int, like: torch.Tensor, layer_type: str | None = None
) -> torch.Tensor:
    """``[max_position, head_size]``: per position the cosines of each rotated
    pair's angle, then the sines, from the model's rotary module (in ``like``'s
    dtype and device, as transformers computes them per forward); with
    ``layer_type``, that type's rotary where the module has one per type
    (Gemma3)."""
    positions = torch.arange(max_position, device=like.device)[None]
    per_type = "layer_type" in inspect.signature(rotary_emb.forward).parameters
    kwargs = {"layer_type": layer_type} if per_type else {}
    with torch.inference_mode():
        cos, sin = rotary_emb(like.new_empty(0), positions, **kwargs)
    half = cos.shape[-1] // 2
    cos, sin = cos[0], sin[0]
    if not (
        torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
    ):
        raise ValueError("fused ops: the rotary does not pair dims d and d + head_size / 2")
    return torch.cat([cos[:, :half], sin[:, :half]], dim=-1).contiguous()
