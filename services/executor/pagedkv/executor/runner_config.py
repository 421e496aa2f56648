"""How to load and size one executor (``RunnerConfig``, checked as it is
made), and the KV memory's dtype that its ``kv_cache_dtype`` names; the
``ModelRunner`` (model_runner.py) is built from it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedkv.executor.kv_rotation import ROTATIONS
from pagedkv.executor.model_loading import DTYPES
from pagedkv.kernels import fp8_kv, int8_kv

# The quantized formats ``--kv-cache-dtype`` names beside the model's dtype.
QUANTIZED_KV_DTYPES: dict[str, torch.dtype] = {
    **fp8_kv.KV_CACHE_DTYPES,
    **int8_kv.KV_CACHE_DTYPES,
}


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """How to load and size one executor."""

    model: str
    device: str = "cpu"
    dtype: str = "auto"  # auto: the checkpoint's dtype (float32 on the CPU for halves)
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kernel_backend: str = "triton"
    load_format: str = "auto"  # auto | dummy (random weights)
    max_num_rows: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_logprobs: int = 20
    seed: int = 0
    cuda_graphs: bool = True  # replay decode steps from CUDA graphs (CUDA, Triton kernels)
    mixed_graphs: bool = True  # and steps that compute prompts, up to 1,024 tokens
    fused_ops: bool = True  # the fused decoder stack, for the model types it supports
    host_kv_gib: float = 0.0  # the host tier's size (host_kv.py); 0: none
    # The KV memory's dtype: auto (the model's), the model's by name,
    # fp8_e4m3 / fp8_e5m2 with scales calibrated at start (kv_calibration.py),
    # or int8 with a scale per token written with it (kv_memory.py).
    kv_cache_dtype: str = "auto"
    # K and V stored in the Hadamard basis (kv_rotation.py): auto (for fp8
    # blocks, when the model allows it and its checkpoint stores no scales),
    # none or hadamard.
    kv_cache_rotation: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: {self.block_size} is not a positive power of two")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks: {self.num_blocks} < 2 (block 0 is the null block)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization: must be in (0, 1]")
        if not 0 <= self.host_kv_gib < math.inf:
            raise ValueError(f"host_kv_gib: {self.host_kv_gib} is not a size >= 0")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format: {self.load_format!r} is not auto or dummy")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not auto or one of {sorted(DTYPES)}")
        kv_names = ("auto", *DTYPES, *QUANTIZED_KV_DTYPES)
        if self.kv_cache_dtype not in kv_names:
            raise ValueError(
                f"kv_cache_dtype: {self.kv_cache_dtype!r} is not one of {', '.join(kv_names)}"
            )
        if self.kv_cache_rotation not in ROTATIONS:
            raise ValueError(
                f"kv_cache_rotation: {self.kv_cache_rotation!r} is not one of "
                f"{', '.join(ROTATIONS)}"
            )
        for name in ("max_num_rows", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV memory's dtype for ``--kv-cache-dtype`` ``name``: a float cache
    holds the model's dtype (the kernels read it as the query's), fp8 and
    int8 any."""
    if name in QUANTIZED_KV_DTYPES:
        return QUANTIZED_KV_DTYPES[name]
    if name != "auto" and DTYPES[name] != model_dtype:
        model = str(model_dtype).removeprefix("torch.")
        raise ValueError(
            f"kv_cache_dtype: {name} differs from the model's dtype {model} "
            "(a float cache holds the model's dtype; fp8_e4m3, fp8_e5m2 or int8 compress it)"
        )
    return model_dtype
