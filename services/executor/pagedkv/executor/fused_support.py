"""Which models the fused decoder stack (fused_model.py) can run.

``unsupported_reason`` says why a model cannot run there (another model type
or activation, a rotary whose angles depend on the sequence length or that
rotates part of each head, a layer of another shape); the runner then keeps
transformers' modules. The families and their variants (Gemma's norms,
query/key norms, the activations) are named here once; ``FusedDecoder``
reads a model's variant from them.
"""

from __future__ import annotations

from typing import Any

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
    activation_name = activation(config)
    if activation_name not in ACTIVATIONS:
        return f"activation {activation_name!r} is not one of {tuple(ACTIVATIONS)}"
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


def activation(config: Any) -> str | None:
    """The MLP's activation as the config names it (``hidden_activation``,
    else ``hidden_act``): a key of ``ACTIVATIONS`` for a supported model."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
