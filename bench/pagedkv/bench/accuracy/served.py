"""What quantized KV blocks cost a trained model as the executor serves it:
the same measures as evaluate.py, with nothing emulated. Each
``--kv-cache-dtype`` gets a ``ModelRunner`` of its own over the model (its
cache writes, scales, rotation and attention kernels as an executor runs
them); the reference is a runner whose blocks hold the model's dtype.

- Teacher-forced: each held-out window is one prompt step of a row (its
  K and V written to the blocks, then read back by the prefill's
  attention), with the logits of every position: perplexity, its increase
  over the reference's, and top-1 agreement with the reference.
- Greedy continuations: each held-out prompt in one step, then one decode
  step a token, as an executor runs them; the tokens equal to the
  reference's before the first difference, and the share of equal
  positions.

    python -m pagedkv.bench.accuracy.served --model DIR --output FILE.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedkv.bench.accuracy.corpus import load
from pagedkv.bench.accuracy.evaluate import agreement, held_windows

if TYPE_CHECKING:
    from pagedkv.executor.model_runner import ModelRunner

BLOCK_SIZE = 16


def _runner(model_dir: Path, device: str, dtype: str, kv: str, max_len: int) -> ModelRunner:
    """One row over enough blocks for ``max_len`` tokens, its table set."""
    from pagedkv.executor.model_runner import ModelRunner
    from pagedkv.executor.runner_config import RunnerConfig

    blocks = -(-max_len // BLOCK_SIZE)
    runner = ModelRunner(
        RunnerConfig(
            model=str(model_dir),
            device=device,
            dtype=dtype,
            kv_cache_dtype=kv,
            kernel_backend="triton" if device == "cuda" else "torch",
            block_size=BLOCK_SIZE,
            num_blocks=1 + blocks,
            max_num_rows=1,
            max_num_batched_tokens=max_len,
            max_model_len=max_len,
            cuda_graphs=False,
        )
    )
    runner.rows.fill_tables(1 + np.arange(blocks).reshape(1, blocks))
    return runner


def _step(runner: ModelRunner, tokens: torch.Tensor, start: int, every: bool) -> torch.Tensor:
    """Row 0 computes ``tokens`` at positions ``start ..``; float32 logits
    of every one (``every``) or of the last."""
    row = np.zeros(len(tokens), dtype=np.int64)
    positions = np.arange(start, start + len(tokens))
    runner.rows.write_tokens(row, positions, tokens.numpy())
    inputs = runner.forward_inputs.prepare(
        np.array([0]), np.array([start]), np.array([len(tokens)]), np.array([True])
    )
    with torch.inference_mode():
        if every:
            logits = runner.run_model(inputs.input_ids, inputs.positions, inputs.metadata, None)
        else:
            last = runner.logits(inputs)
            assert last is not None  # the row samples
            logits = last
    return logits.float().cpu()


def _teacher_forced(runner: ModelRunner, windows: torch.Tensor) -> dict[str, Any]:
    losses, argmaxes = [], []
    for window in windows:
        logits = _step(runner, window[:-1], 0, every=True)
        losses.append(torch.nn.functional.cross_entropy(logits, window[1:]).item())
        argmaxes.append(logits.argmax(-1))
    return {"losses": losses, "argmax": torch.stack(argmaxes)}


def _greedy(runner: ModelRunner, prompts: torch.Tensor, new: int) -> torch.Tensor:
    out = []
    for prompt in prompts:
        tokens = [int(_step(runner, prompt, 0, every=False)[-1].argmax())]
        for i in range(new - 1):
            next_token = torch.tensor(tokens[-1:])
            tokens.append(int(_step(runner, next_token, len(prompt) + i, every=False)[-1].argmax()))
        out.append(tokens)
    return torch.tensor(out)


def evaluate_served(
    model_dir: Path,
    *,
    kv_dtypes: tuple[str, ...] = ("int8", "fp8_e4m3"),
    device: str = "cpu",
    dtype: str = "bfloat16",
    windows: int = 64,
    window_len: int = 512,
    prompts: int = 4,
    prompt_len: int = 256,
    continue_tokens: int = 128,
    max_corpus_bytes: int | None = None,
) -> dict[str, Any]:
    """The report: the reference's perplexity and each KV dtype's
    agreement with it (``evaluate.agreement``'s fields), and whether its
    runner rotated the blocks."""
    start = time.perf_counter()
    corpus = load(max_bytes=max_corpus_bytes)
    held = held_windows(corpus.held_out, window_len + 1, windows)
    starts = held_windows(corpus.held_out, prompt_len, prompts)
    max_len = max(window_len, prompt_len + continue_tokens)
    reference = _runner(model_dir, device, dtype, "auto", max_len)
    ref = _teacher_forced(reference, held)
    ref_loss = sum(ref["losses"]) / len(ref["losses"])
    ref_greedy = _greedy(reference, starts, continue_tokens)
    rows: dict[str, Any] = {}
    for kv in kv_dtypes:
        runner = _runner(model_dir, device, dtype, kv, max_len)
        run = _teacher_forced(runner, held)
        greedy = _greedy(runner, starts, continue_tokens)
        row = agreement(run, ref, ref_loss, greedy, ref_greedy)
        row["kv_cache_dtype"] = str(runner.kv_dtype).removeprefix("torch.")
        row["rotated"] = runner.kv_rotation is not None
        row["bytes_per_block"] = runner.bytes_per_block
        rows[kv] = row
    return {
        "model": model_dir.name,
        "dtype": dtype,
        "device": device,
        "kernel_backend": "triton" if device == "cuda" else "torch",
        "corpus": corpus.describe(),
        "held_out_windows": len(held),
        "window_len": window_len,
        "prompts": len(starts),
        "prompt_len": prompt_len,
        "continue_tokens": continue_tokens,
        "reference": {
            "perplexity": round(math.exp(ref_loss), 4),
            "bytes_per_block": reference.bytes_per_block,
        },
        "kv": rows,
        "seconds": round(time.perf_counter() - start, 1),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name(0)
            if device == "cuda"
            else platform.machine(),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench.accuracy.served")
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--kv", default="int8,fp8_e4m3", help="--kv-cache-dtype values, commas")
    parser.add_argument("--device", default=None, help="default: cuda when there is one")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--window-len", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--continue-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    report = evaluate_served(
        args.model,
        kv_dtypes=tuple(args.kv.split(",")),
        device=device,
        dtype=args.dtype,
        windows=args.windows,
        window_len=args.window_len,
        prompts=args.prompts,
        prompt_len=args.prompt_len,
        continue_tokens=args.continue_tokens,
    )
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    for kv, row in report["kv"].items():
        print(
            f"{kv}: top-1 {row['top1_agreement']:.4f}, perplexity "
            f"{row['perplexity_increase']:+.5f}, greedy equal {row['greedy_equal_share']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
