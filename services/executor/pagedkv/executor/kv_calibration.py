"""The scales of an fp8 KV memory: from the checkpoint when it stores
them, else from the executor's first forward.

A checkpoint quantized for an fp8 KV cache stores each attention layer's
scales as ``model.layers.N.self_attn.k_scale`` and ``v_scale`` (a value is
stored as ``x / scale``, as here), one per tensor or per KV head:
``checkpoint_kv_scales`` reads them from its safetensors files, and the
memory takes them as they are.

Before it serves, an executor whose KV memory holds fp8 runs one eager
forward of ``CALIBRATION_TOKENS`` token ids (at most its largest step and
its model's length) drawn uniformly from the vocabulary with a fixed seed,
and every attention layer sets its K and V scales from that forward's K
and V (``KVMemory.calibrate``) before caching them. The tokens are the same
for every executor of a model, so executors of one model and configuration
store the same bytes for the same K/V: blocks could move between them as
they are. The scales never change after: a block written under one scale
is never read under another.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from pagedkv.executor.kv_memory import KVMemory
from pagedkv.executor.model_spec import ModelSpec
from pagedkv.executor.rows import Rows
from pagedkv.executor.sampler import SamplerOutput

CALIBRATION_TOKENS = 512
CALIBRATION_SEED = 0


class CalibratingRunner(Protocol):
    """What the calibration needs of the model runner."""

    kv: KVMemory
    rows: Rows
    spec: ModelSpec
    generator: torch.Generator
    max_blocks_per_row: int

    @property
    def calibration_tokens(self) -> int: ...

    def forward(
        self,
        rows: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        needs_sample: np.ndarray,
        calibrate: bool = False,
    ) -> SamplerOutput | None: ...


_SCALE_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.([kv])_scale$")


def checkpoint_kv_scales(
    model_dir: Path, num_layers: int, num_kv_heads: int
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Each layer's K and V scales (float32 ``[1]`` or ``[num_kv_heads]``)
    as the checkpoint in ``model_dir`` stores them, or None when it stores
    none. ValueError (naming ``kv_cache_dtype``) when it stores some layers'
    and not others', or a scale that is not positive and finite or not of
    one of those shapes."""
    from safetensors import safe_open

    found: dict[tuple[int, str], torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                match = _SCALE_KEY.search(key)
                if match:
                    found[int(match[1]), match[2]] = tensors.get_tensor(key).float().reshape(-1)
    if not found:
        return None
    scales = []
    for layer in range(num_layers):
        pair = []
        for kind in "kv":
            scale = found.get((layer, kind))
            name = f"layers.{layer}.self_attn.{kind}_scale"
            if scale is None:
                raise ValueError(f"kv_cache_dtype: the checkpoint stores K/V scales but not {name}")
            if len(scale) not in (1, num_kv_heads) or not bool(
                (scale > 0).all() and scale.isfinite().all()
            ):
                raise ValueError(
                    f"kv_cache_dtype: the checkpoint's {name} is not 1 or {num_kv_heads} positive "
                    "finite values"
                )
            pair.append(scale)
        scales.append((pair[0], pair[1]))
    return scales


def calibration_token_ids(vocab_size: int, count: int) -> torch.Tensor:
    """The calibration forward's ``count`` token ids (int64, on the CPU)."""
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    return torch.randint(0, vocab_size, (count,), generator=generator)


def calibrate_kv(
    runner: CalibratingRunner,
    block_size: int,
    stored: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> None:
    """Sets the scales of ``runner``'s fp8 KV memory (nothing for a float
    one): the checkpoint's (``stored``) when given, else from one forward
    over a scratch row whose table holds blocks 1, 2, ... (block 1 again
    past the memory's end), freed after, the sampling generator's state
    restored."""
    kv = runner.kv
    if kv.calibrated:
        return
    if stored is not None:
        kv.set_scales(stored)
        return
    count = runner.calibration_tokens
    tokens = calibration_token_ids(runner.spec.vocab_size, count).numpy()
    needed = -(-count // block_size)
    table = np.ones((1, runner.max_blocks_per_row), dtype=np.int64)
    if needed < kv.num_blocks:
        table[0, :needed] = np.arange(1, needed + 1)
    state = runner.generator.get_state()
    runner.rows.fill_tables(table)
    runner.rows.write_tokens(np.zeros(count, np.int64), np.arange(count), tokens)
    runner.forward(
        np.zeros(1, np.int64),
        np.zeros(1, np.int64),
        np.full(1, count),
        np.zeros(1, dtype=bool),
        calibrate=True,
    )
    runner.rows.free([0])
    runner.rows.clear_tables()
    runner.generator.set_state(state)
    kv.calibrated = True
