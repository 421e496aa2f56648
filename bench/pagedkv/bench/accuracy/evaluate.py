"""What fp8 KV blocks cost a model that has learned something, before any
kernel: K and V stored as ``pagedkv.kernels.fp8_kv`` defines it, emulated
inside transformers' attention.

Each layer's keys and values go through ``fp8_kv.round_trip`` (stored in
fp8 with scales calibrated on a first forward, then fixed) before the
model's own scaled-dot-product attention; the reference keeps them in the
model's dtype. Per format (e4m3, e5m2) and calibration (``GRANULARITIES``:
per tensor or per KV head on a window of the training split, or as the
executor calibrates, centered or not, stored as they are or in the
Hadamard basis; and e4m3 as the executor calibrates on K alone and on V
alone, which says which of the two costs what), on the held-out split of
the model's corpus (corpus.py):

- perplexity (teacher-forced next-byte loss) and its relative increase;
- top-1 agreement: positions whose argmax equals the reference's;
- greedy continuations of ``--continue-tokens`` from held-out prompts: the
  tokens equal to the reference's before the first difference, and the
  share of equal positions;
- the attention output's error on synthetic activations with outlier
  channels (``outlier_errors``: a few key and value channels 20x the rest),
  against attention over the unquantized K and V.

Beside the fp8 rows, ``int8/per_token`` and ``int8/per_token_rotated``
store K and V as int8 with a scale per token and KV head (its largest
magnitude over 127, the scale itself in float16), as they are or in the
Hadamard basis (``int8_round_trip``): what ``--kv-cache-dtype int8``
keeps (``int8/per_token``; its kernels store exactly ``int8_kv``'s
values), for comparison with fp8's three mantissa bits.

For scale, ``reference_noise`` gives the same measures for the model run in
float32 against the reference (the model's dtype, bf16 on the GPU): how far
two correct computations already disagree, with no fp8 anywhere.

    python -m pagedkv.bench.accuracy.evaluate --model DIR --output FILE.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pagedkv.bench.accuracy.corpus import load
from pagedkv.bench.accuracy.train import as_ids
from pagedkv.executor.kv_calibration import CALIBRATION_TOKENS, calibration_token_ids
from pagedkv.executor.kv_memory import CALIBRATION_HEADROOM, calibration_scales
from pagedkv.kernels import fp8_kv, int8_kv

ATTENTION_NAME = "pagedkv_kv_emulation"
# Scales calibrated on a training window (the format's range reached by its
# largest value), per tensor or per KV head; per KV head on K and V less
# their mean over the window (``per_head_centered``, see ``KVEmulation``);
# as the executor calibrates them (``executor``: per KV head, on its seeded
# random tokens, with its headroom; pagedkv.executor.kv_calibration); and
# centered as the executor would center (``executor_centered``: the means
# of its calibration tokens' rotated keys and values, the scales of what is
# left with its headroom). The ``_rotated`` rows store K and V rotated by
# the head size's Hadamard matrix (``KVEmulation``): per KV head on the
# training window, centered or not, and as an executor would (its random
# tokens; each head's largest vector norm, which bounds every rotated value,
# with its headroom: ``executor_rotated``).
GRANULARITIES = (
    "per_tensor",
    "per_head",
    "per_head_centered",
    "executor",
    "executor_centered",
    "per_head_rotated",
    "per_head_rotated_centered",
    "executor_rotated",
)
CENTERED = ("per_head_centered", "executor_centered", "per_head_rotated_centered")
ROTATED = ("per_head_rotated", "per_head_rotated_centered", "executor_rotated")
# int8 with a scale per token and KV head, computed as each token is stored
# (no calibration): as they are, or in the Hadamard basis.
INT8_GRANULARITIES = ("per_token", "per_token_rotated")


def int8_round_trip(x: torch.Tensor, rotate: bool = False) -> torch.Tensor:
    """``x`` ``[..., head_size]`` stored as an int8 cache stores it (one
    scale per vector, ``int8_kv``) and read back in ``x``'s dtype; with
    ``rotate``, stored in the Hadamard basis and read back in the model's."""
    values = x.float()
    rotation = fp8_kv.hadamard(x.shape[-1], x.device) if rotate else None
    if rotation is not None:
        values = values @ rotation
    stored = int8_kv.round_trip(values)
    if rotation is not None:
        stored = stored @ rotation
    return stored.to(x.dtype)


class KVEmulation:
    """The attention function's state: the format (None: the model's
    dtype; ``torch.int8``: ``int8_round_trip``, a granularity of
    ``INT8_GRANULARITIES``), the granularity and each layer's K and V
    scales.

    ``per_head_centered`` stores K and V less a center, each channel's mean
    over the calibration (per layer, K or V, KV head), and adds it back on
    reading. A cache could store the same bytes and skip the adding back:
    a key's center shifts every score of a query by the same amount, which
    the softmax ignores, and a value's adds the same vector to every output
    row (the weights sum to 1), once per row. What it would buy: a channel
    whose values sit on a large common offset is rounded on its small
    variation instead of on the offset.

    The ``_rotated`` granularities store each head's K and V times the
    orthonormal Hadamard matrix ``H`` of the head size and read them back
    times ``H`` (its own inverse). A cache could store the same bytes and
    never rotate back: scores are unchanged with the query rotated too
    (``qH . kH = q . k``), and the output of rotated values is the output
    times ``H``, which the output projection's weights can absorb. What it
    would buy: fp8 rounds each value relative to its own magnitude, so a
    few large channels that a query and its keys share carry most of a
    score's rounding error; the rotation spreads every channel over all of
    them."""

    def __init__(self) -> None:
        self.dtype: torch.dtype | None = None
        self.granularity = "per_tensor"
        self.kinds: tuple[int, ...] = (0, 1)
        self.calibrating = False
        self.scales: dict[tuple[int, int], torch.Tensor] = {}
        self.centers: dict[tuple[int, int], torch.Tensor] = {}  # [kv_heads, head_size]

    def configure(
        self, dtype: torch.dtype | None, granularity: str = "per_tensor", kinds: str = "kv"
    ) -> None:
        """The format (None: none), the calibration, and which of K and V
        (``kinds``: "kv", "k" or "v") are stored in it."""
        self.dtype, self.granularity, self.scales, self.centers = dtype, granularity, {}, {}
        self.kinds = {"k": (0,), "v": (1,), "kv": (0, 1)}[kinds]

    def store(self, layer: int, kind: int, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[batch, kv_heads, seq, head_size]`` as the cache would
        give it back."""
        if self.dtype is None or kind not in self.kinds:
            return x
        if self.dtype == torch.int8:  # a scale per token and KV head: nothing to calibrate
            return int8_round_trip(x, self.granularity == "per_token_rotated")
        tokens = x.transpose(1, 2)  # [batch, seq, kv_heads, head_size]
        slot = (layer, kind)
        if self.granularity in ROTATED:  # stored in a rotated basis, read back in the model's
            rotation = fp8_kv.hadamard(x.shape[-1], x.device)
            stored = self._store(slot, tokens.float() @ rotation)  # as a kernel, in float32
            return (stored.float() @ rotation).to(x.dtype).transpose(1, 2)
        return self._store(slot, tokens).transpose(1, 2)

    def _store(self, slot: tuple[int, int], tokens: torch.Tensor) -> torch.Tensor:
        kind, dtype = slot[1], self.dtype
        assert dtype is not None  # store returns earlier without a format
        if self.calibrating:
            if self.granularity == "executor":  # K's over rotation pairs, V's own
                scale = calibration_scales(tokens, tokens, dtype)[kind]
            elif self.granularity == "executor_rotated":
                norms = tokens.float().norm(dim=-1, keepdim=True)  # each rotated value's bound
                scale = fp8_kv.calibrated_scale(norms, dtype, True, CALIBRATION_HEADROOM)
            elif self.granularity in CENTERED:
                if slot not in self.centers:  # the first calibration forward's mean
                    self.centers[slot] = tokens.float().flatten(0, -3).mean(dim=0)
                centered = tokens.float() - self.centers[slot]
                headroom = CALIBRATION_HEADROOM if self.granularity == "executor_centered" else 1.0
                scale = fp8_kv.calibrated_scale(centered, dtype, True, headroom)
            else:
                per_head = self.granularity != "per_tensor"
                scale = fp8_kv.calibrated_scale(tokens, dtype, per_head)
            held = self.scales.get(slot)
            self.scales[slot] = scale if held is None else torch.maximum(held, scale)
        center = self.centers.get(slot)
        if center is not None:
            stored = fp8_kv.round_trip(tokens.float() - center, self.scales[slot], dtype)
            return (stored + center).to(tokens.dtype)
        return fp8_kv.round_trip(tokens, self.scales[slot], dtype)

    def attention(
        self,
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layer = module.layer_idx
        key, value = self.store(layer, 0, key), self.store(layer, 1, value)
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out, None


EMULATION = KVEmulation()


def _register(model: Any) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, EMULATION.attention)
    model.set_attn_implementation(ATTENTION_NAME)


def held_windows(data: bytes, length: int, count: int) -> torch.Tensor:
    """``[count, length]``: the first ``count`` consecutive windows of ``data``."""
    ids = as_ids(data)
    count = min(count, len(ids) // length)
    if count < 1:
        raise ValueError("the held-out split is shorter than one window")
    return ids[: count * length].view(count, length)


@torch.no_grad()
def _teacher_forced(model: Any, windows: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """Per window: the loss and the argmax of every position."""
    losses, argmaxes = [], []
    for window in windows:
        ids = window.to(device).unsqueeze(0)
        logits = model(ids[:, :-1]).logits.float()[0]
        losses.append(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item())
        argmaxes.append(logits.argmax(-1).cpu())
    return {"losses": losses, "argmax": torch.stack(argmaxes)}


@torch.no_grad()
def _greedy(model: Any, prompts: torch.Tensor, new: int, device: torch.device) -> torch.Tensor:
    out: torch.Tensor = model.generate(
        prompts.to(device), max_new_tokens=new, min_new_tokens=new, do_sample=False
    )
    return out[:, prompts.shape[1] :].cpu()


def agreement(
    run: dict[str, Any],
    reference: dict[str, Any],
    ref_loss: float,
    greedy: torch.Tensor,
    reference_greedy: torch.Tensor,
) -> dict[str, Any]:
    """Perplexity, its increase, top-1 and greedy agreement of ``run``
    against the reference."""
    loss = sum(run["losses"]) / len(run["losses"])
    same = greedy == reference_greedy
    differs = (~same).int()
    # Tokens before the first difference (all of them when none differs).
    everything = torch.full_like(differs[:, 0], same.shape[1])
    first = torch.where(differs.any(dim=1), differs.argmax(dim=1), everything)
    return {
        "perplexity": round(math.exp(loss), 4),
        "perplexity_increase": round(math.exp(loss - ref_loss) - 1, 5),
        "top1_agreement": round((run["argmax"] == reference["argmax"]).float().mean().item(), 5),
        "greedy_equal_prefix_mean": round(first.float().mean().item(), 2),
        "greedy_equal_share": round(same.float().mean().item(), 5),
    }


@torch.no_grad()
def outlier_errors(
    dtype: torch.dtype,
    granularity: str,
    *,
    seq: int = 1024,
    kv_heads: int = 4,
    group: int = 2,
    head_size: int = 128,
    factor: float = 20.0,
    seed: int = 0,
) -> dict[str, float]:
    """Attention over K and V stored in ``dtype`` (``torch.int8``: as
    ``int8_round_trip`` stores them) against over K and V in
    bf16 (the oracle's cache), for random activations whose channels 3, 40
    and 77 of every head (K and V) are ``factor`` times the rest (stored in
    the Hadamard basis for the ``_rotated`` granularities); the attention
    itself in float32. The output's largest absolute error, its
    error's RMS over the output's RMS, and the same RMS ratio for bf16
    against float32 K and V (what bf16 itself costs, for scale)."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, kv_heads * group, seq, head_size, generator=generator)
    exact = [torch.randn(1, seq, kv_heads, head_size, generator=generator) for _ in range(2)]
    for x in exact:
        x[..., [3, 40, 77]] *= factor
    cached = [x.to(torch.bfloat16) for x in exact]
    per_head = granularity != "per_tensor"
    if dtype == torch.int8:
        rotate = granularity == "per_token_rotated"
        stored = [int8_round_trip(x.float(), rotate) for x in cached]
    elif granularity in ROTATED:  # stored in the Hadamard basis, read back in the model's
        rotation = fp8_kv.hadamard(head_size)
        stored = []
        for x in cached:
            rotated = x.float() @ rotation
            scale = fp8_kv.calibrated_scale(rotated, dtype, per_head)
            stored.append(fp8_kv.round_trip(rotated, scale, dtype) @ rotation)
    else:
        scales = [fp8_kv.calibrated_scale(x, dtype, per_head) for x in cached]
        stored = [fp8_kv.round_trip(x, s, dtype) for x, s in zip(cached, scales, strict=True)]

    def attend(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k = k.float().transpose(1, 2).repeat_interleave(group, dim=1)
        v = v.float().transpose(1, 2).repeat_interleave(group, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(query, k, v, is_causal=True)

    def relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
        return round(((got - want).pow(2).mean() / want.pow(2).mean()).sqrt().item(), 5)

    want, got = attend(*cached), attend(*stored)
    return {
        "max_abs": round((got - want).abs().max().item(), 5),
        "relative_rms": relative_rms(got, want),
        "bf16_relative_rms": relative_rms(want, attend(*exact)),
    }


def evaluate(
    model_dir: Path,
    *,
    device: str = "cuda",
    dtype: str = "bfloat16",
    windows: int = 64,
    window_len: int = 1024,
    prompts: int = 8,
    prompt_len: int = 512,
    continue_tokens: int = 256,
    max_corpus_bytes: int | None = None,
) -> dict[str, Any]:
    """The report (see the module's docstring) for the model in ``model_dir``."""
    from transformers import AutoModelForCausalLM

    began = time.perf_counter()
    where = torch.device(device)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model = model.to(where).eval()
    _register(model)
    corpus = load(max_bytes=max_corpus_bytes)
    held = held_windows(corpus.held_out, window_len + 1, windows)
    starts = held_windows(corpus.held_out, prompt_len, prompts)
    calibration = held_windows(corpus.train, window_len, 1).to(where)
    count = min(CALIBRATION_TOKENS, int(model.config.max_position_embeddings))
    executor_calibration = calibration_token_ids(model.config.vocab_size, count)[None].to(where)

    EMULATION.configure(None)
    reference = _teacher_forced(model, held, where)
    reference_greedy = _greedy(model, starts, continue_tokens, where)
    ref_loss = sum(reference["losses"]) / len(reference["losses"])
    results: dict[str, Any] = {}
    # Each format with each calibration, then e4m3 as the executor calibrates
    # it on K alone and on V alone: which of the two costs what.
    runs = [
        (name, fp8, granularity, "kv")
        for name, fp8 in fp8_kv.KV_CACHE_DTYPES.items()
        for granularity in GRANULARITIES
    ]
    e4m3 = fp8_kv.KV_CACHE_DTYPES["fp8_e4m3"]
    runs += [("fp8_e4m3", e4m3, "executor", kinds) for kinds in ("k", "v")]
    runs += [("int8", torch.int8, granularity, "kv") for granularity in INT8_GRANULARITIES]
    for name, fp8, granularity, kinds in runs:
        EMULATION.configure(fp8, granularity, kinds)
        if fp8 != torch.int8:  # int8's scales are each token's own: nothing to calibrate
            EMULATION.calibrating = True
            with torch.no_grad():  # the first forward: the scales
                executor_like = granularity.startswith("executor")
                model(executor_calibration if executor_like else calibration)
            EMULATION.calibrating = False
        run = _teacher_forced(model, held, where)
        greedy = _greedy(model, starts, continue_tokens, where)
        row = agreement(run, reference, ref_loss, greedy, reference_greedy)
        if kinds != "kv":
            results[f"{name}/{granularity}/{kinds}-only"] = row
            continue
        row["outlier_errors"] = outlier_errors(fp8, granularity)
        results[f"{name}/{granularity}"] = row
    EMULATION.configure(None)
    noise = None
    if dtype != "float32":
        del model
        exact: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        exact = exact.to(where).eval()
        _register(exact)
        run = _teacher_forced(exact, held, where)
        noise = agreement(
            run,
            reference,
            ref_loss,
            _greedy(exact, starts, continue_tokens, where),
            reference_greedy,
        )
    return {
        "model": str(model_dir.name),
        "dtype": dtype,
        "device": torch.cuda.get_device_name(where) if where.type == "cuda" else "cpu",
        "corpus": corpus.describe(),
        "held_out_windows": len(held),
        "window_len": window_len,
        "prompts": len(starts),
        "prompt_len": prompt_len,
        "continue_tokens": continue_tokens,
        "reference": {"perplexity": round(math.exp(ref_loss), 4)},
        "reference_noise": noise,
        "fp8": results,
        "seconds": round(time.perf_counter() - began, 1),
        "machine": {"python": platform.python_version(), "torch": torch.__version__},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--device", default=None, help="default: cuda when there is one")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, else float32")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--window-len", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--continue-tokens", type=int, default=256)
    parser.add_argument("--max-corpus-bytes", type=int, default=None)
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    report = evaluate(
        args.model,
        device=device,
        dtype=args.dtype or ("bfloat16" if device == "cuda" else "float32"),
        windows=args.windows,
        window_len=args.window_len,
        prompts=args.prompts,
        prompt_len=args.prompt_len,
        continue_tokens=args.continue_tokens,
        max_corpus_bytes=args.max_corpus_bytes,
    )
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    rows = dict(report["fp8"])
    if report["reference_noise"] is not None:
        rows["float32 model (no fp8)"] = report["reference_noise"]
    for name, row in rows.items():
        print(
            f"{name}: perplexity +{row['perplexity_increase']:.3%}, top-1 "
            f"{row['top1_agreement']:.4f}, greedy equal {row['greedy_equal_share']:.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
