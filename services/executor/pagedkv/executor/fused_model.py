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
weight``, held here as a float32 tensor (in bf16 the normalised row is
rounded once more than in transformers' Gemma norm, as Llama's norm rounds
it); Gemma2 soft-caps the final logits; Gemma3 rotates its sliding-window
and full layers with rotaries of different bases, a ``cos_sin`` table each.

The merged Q/K/V and gate/up weights are single tensors, and the modules'
own weights become views into them, so the model keeps working unfused and
memory does not grow (Phi3's projections are merged already: its
``qkv_proj`` and ``gate_up_proj`` are read as they are). ``cos_sin`` holds
the model's rotary module's cosines and sines for every position below
``max_model_len``, computed once, in the model's dtype as transformers
rounds them. The LM head runs at the sampled tokens only, whose final norm
is the only one computed.

``unsupported_reason`` says why a model cannot run here (another model type
or activation, a rotary whose angles depend on the sequence length or that
rotates part of each head, a layer of another shape); the runner then keeps
transformers' modules.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.executor.attention import AttentionMetadata
from pagedkv.kernels.backend import KernelBackend

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text")
# Norms of 1 + weight, each sublayer's output normed too (the "sandwich").
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
SANDWICH_MODULES = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
QK_NORM_MODEL_TYPES = ("qwen3", "gemma3_text")
# The activation (config.hidden_activation, else hidden_act) -> the backend's op.
ACTIVATIONS = {"silu": "silu_mul", "gelu_pytorch_tanh": "gelu_tanh_mul"}
# transformers recomputes these rotaries' frequencies from the sequence length.
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")
LAYER_MODULES = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.o_proj",
    "mlp.down_proj",
)
# Each layer has one of each pair: separate projections, or phi3's merged one.
QKV_MODULES = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.qkv_proj",),
)
GATE_UP_MODULES = (("mlp.gate_proj", "mlp.up_proj"), ("mlp.gate_up_proj",))


def _has(layer: Any, name: str) -> bool:
    try:
        layer.get_submodule(name)
    except AttributeError:
        return False
    return True


def unsupported_reason(model: Any) -> str | None:
    """Why ``model`` (a transformers causal LM) cannot run fused; None if it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    activation = _activation(config)
    if activation not in ACTIVATIONS:
        return f"activation {activation!r} is not one of {tuple(ACTIVATIONS)}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    # Gemma3 has one rotary per layer type.
    ropes = (
        list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    )
    for params in ropes:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type in LENGTH_DEPENDENT_ROPE_TYPES:
            return f"rope_type {rope_type!r} depends on the sequence length"
        partial = params.get(
            "partial_rotary_factor", getattr(config, "partial_rotary_factor", None)
        )
        if partial is not None and float(partial) != 1.0:
            return f"partial_rotary_factor {partial} rotates part of each head"
    base = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(base, name):
            return f"the model has no model.{name}"
    for layer in base.layers:  # type: ignore[union-attr]
        sandwich = SANDWICH_MODULES if model_type in GEMMA_MODEL_TYPES else ()
        for name in (*LAYER_MODULES, *sandwich):
            if not _has(layer, name):
                return f"a layer has no {name}"
        for choices in (QKV_MODULES, GATE_UP_MODULES):
            if not any(all(_has(layer, name) for name in names) for names in choices):
                return f"a layer has no {' or '.join('+'.join(n) for n in choices)}"
        norms = [getattr(layer.self_attn, name, None) is not None for name in ("q_norm", "k_norm")]
        if any(norms) and not (model_type in QK_NORM_MODEL_TYPES and all(norms)):
            return f"the attention normalises queries or keys, not as {QK_NORM_MODEL_TYPES} do"
    return None


def _activation(config: Any) -> str | None:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


def _norm(module: Any, gemma: bool) -> tuple[torch.Tensor, float]:
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
        input_norm, eps = _norm(layer.input_layernorm, gemma)
        post_attention_norm, _ = _norm(layer.post_attention_layernorm, gemma)
        if gemma:  # the post-attention norm is the attention output's
            attn_out_norm: torch.Tensor | None = post_attention_norm
            pre_mlp_norm, _ = _norm(layer.pre_feedforward_layernorm, gemma)
            mlp_out_norm: torch.Tensor | None = _norm(layer.post_feedforward_layernorm, gemma)[0]
        else:
            attn_out_norm, pre_mlp_norm, mlp_out_norm = None, post_attention_norm, None
        q_norm = k_norm = None
        head_norm_eps = 0.0
        if getattr(attn, "q_norm", None) is not None:
            q_norm, head_norm_eps = _norm(attn.q_norm, gemma)
            k_norm, _ = _norm(attn.k_norm, gemma)
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
        self.act_mul = getattr(backend, ACTIVATIONS[_activation(config)])  # type: ignore[index]
        self.embed_tokens = base.embed_tokens  # Gemma's scales the embedding itself
        self.lm_head = model.lm_head
        self.final_norm, self.final_eps = _norm(base.norm, gemma)
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
            **scales,
        )
        attended: torch.Tensor = layer.o_proj(out.reshape(num_tokens, -1))
        return attended

    def _head_norm(self, heads: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``heads`` ``[num_tokens, num_heads, D]`` (a view) normalised per head, a new tensor."""
        num_tokens, num_heads, head_size = heads.shape
        flat = heads.reshape(num_tokens * num_heads, head_size)
        return self.backend.rms_norm(flat, weight, eps).view(num_tokens, num_heads, head_size)


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
