"""A Hugging Face decoder model loaded onto our attention.

``load_model`` resolves the model (a directory, or a cached hub id's
snapshot), reads its config into a ``ModelSpec``, picks the dtype, and loads
the weights (or random ones, ``load_format`` "dummy") with our attention
registered as its implementation, on the device, in eval mode.
``fused_decoder`` is the fused decoder stack for the model types it
supports. What runs the model, and owns its KV memory and rows, is
model_runner.py. transformers is imported when a model is loaded, not with
this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from pagedkv.common.logging import get_logger
from pagedkv.common.model_source import resolve_model
from pagedkv.executor import attention
from pagedkv.executor.fused_model import FusedDecoder
from pagedkv.executor.fused_support import unsupported_reason
from pagedkv.executor.model_spec import ModelSpec, model_spec_from_config
from pagedkv.kernels.backend import KernelBackend

log = get_logger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class LoadedModel(NamedTuple):
    """A model on its device, in eval mode, with its spec, dtype and the
    directory it came from."""

    spec: ModelSpec
    dtype: torch.dtype
    model: Any  # transformers' model for causal LM
    model_dir: Path


def load_model(
    source: str,
    dtype: str,
    load_format: str,
    max_model_len: int | None,
    device: torch.device,
) -> LoadedModel:
    """The model of ``source`` in ``dtype`` ("auto": the checkpoint's,
    float32 on the CPU for halves), its weights read (``load_format``
    "auto") or random ("dummy"); ``max_model_len`` bounds the spec's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = resolve_model(source)  # a directory, or a cached hub id's snapshot
    hf_config = AutoConfig.from_pretrained(model_dir)
    spec = model_spec_from_config(hf_config, max_model_len)
    torch_dtype = _resolve_dtype(dtype, hf_config, device)
    attention.register()
    kwargs = {"dtype": torch_dtype, "attn_implementation": attention.ATTENTION_NAME}
    if load_format == "dummy":
        with device:
            model = AutoModelForCausalLM.from_config(hf_config, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    return LoadedModel(spec, torch_dtype, model.to(device).eval(), model_dir)


def _resolve_dtype(name: str, hf_config: object, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    dtype = getattr(hf_config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype, torch.float32)
    if device.type == "cpu" and dtype != torch.float32:
        return torch.float32
    assert isinstance(dtype, torch.dtype)
    return dtype


def fused_decoder(model: Any, backend: KernelBackend, max_model_len: int) -> FusedDecoder | None:
    """The fused decoder stack of ``model``, or None (with the reason logged)
    for a model it does not support: transformers' modules then run."""
    reason = unsupported_reason(model)
    if reason is None:
        try:
            return FusedDecoder(model, backend, max_model_len)
        except ValueError as exc:
            reason = str(exc)
    log.info("fused ops off: transformers' modules run", reason=reason)
    return None
