"""Trains a small llama on the corpus (corpus.py) and saves it for the
executor: the model an accuracy measurement of a lossy KV cache runs on.

The tokenizer is the tiny models' byte-level one (one token per byte,
``pagedkv make-tiny-model``), so the model needs no tokenizer training and
loads like any other checkpoint (``pagedkv executor --model DIR``). The
``small`` shape has the 8B shape's head size (128) and grouped queries
(8 query heads over 4 KV heads), 8 layers of width 1,024: about 95M
parameters, a few minutes on one H200 at bf16. ``tiny`` is the CPU tests'.

Training: random windows of ``seq_len`` bytes of the training split,
AdamW (betas 0.9, 0.95, weight decay 0.1), the learning rate warmed up
linearly then cosine-decayed to a tenth over the steps or the minutes,
whichever ends the run, gradients clipped at 1; bf16
autocast on CUDA. It stops after ``steps`` steps or ``minutes``, whichever
comes first. Reported (``training.json`` beside the weights): the corpus,
the shape, the steps, tokens seen, the loss curve, the held-out loss and
its perplexity per byte, the time and the machine.

    python -m pagedkv.bench.accuracy.train --out DIR [--shape small] [--minutes 5]
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

from pagedkv.bench.accuracy.cli import add_arguments
from pagedkv.bench.accuracy.corpus import Corpus, load

SHAPES: dict[str, dict[str, int]] = {
    "small": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
    },
    "cpu": {  # about 3.5M parameters: tens of minutes on a CPU learn something
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
}
MAX_POSITION_EMBEDDINGS = 4096


def llama_config(shape: str) -> Any:
    from transformers import LlamaConfig

    from pagedkv.executor.tiny_model import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, VOCAB_SIZE

    fields: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        **SHAPES[shape],
    }
    return LlamaConfig(**fields)


def _windows(
    data: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """``[batch, seq_len + 1]`` random windows of ``data`` (byte ids)."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=generator)
    return torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])


def as_ids(raw: bytes) -> torch.Tensor:
    """Bytes as token ids (the byte-level tokenizer's: id = byte value)."""
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


def _learning_rate(step: int, progress: float, peak: float, warmup: int) -> float:
    """Warmed up linearly over ``warmup`` steps, then cosine-decayed to a
    tenth of ``peak`` as ``progress`` (the share of the run done) goes to 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def held_out_loss(
    model: Any, data: torch.Tensor, seq_len: int, num_windows: int, device: torch.device
) -> float:
    """Mean next-byte loss (nats) over ``num_windows`` consecutive windows
    of ``data`` from its start (the same windows every time)."""
    model.eval()
    stride = seq_len + 1
    count = min(num_windows, (len(data) - 1) // stride)
    if count < 1:
        raise ValueError("the held-out split is shorter than one window")
    total = 0.0
    for i in range(count):
        window = data[i * stride : (i + 1) * stride].to(device).unsqueeze(0)
        with _autocast(device):
            logits = model(window[:, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(logits[0], window[0, 1:]).item()
    model.train()
    return total / count


def _autocast(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train(
    out: Path,
    *,
    shape: str = "small",
    steps: int = 20_000,
    minutes: float = 5.0,
    batch: int = 32,
    seq_len: int = 1024,
    lr: float = 1e-3,
    warmup: int = 200,
    device: str = "cuda",
    seed: int = 0,
    corpus: Corpus | None = None,
    eval_windows: int = 64,
    log_every: int = 50,
) -> dict[str, Any]:
    """Trains, saves the model (float32 weights, the byte-level tokenizer,
    ``training.json``) into ``out`` and returns the report."""
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from pagedkv.executor.tiny_model import (
        BOS_TOKEN,
        EOS_TOKEN,
        PAD_TOKEN,
        byte_level_tokenizer,
    )

    began = time.perf_counter()
    corpus = corpus if corpus is not None else load()
    data, held_out = as_ids(corpus.train), as_ids(corpus.held_out)
    where = torch.device(device)
    torch.manual_seed(seed)
    config = llama_config(shape)
    model: Any = LlamaForCausalLM(config)
    model = model.to(where)
    num_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(seed)
    initial = held_out_loss(model, held_out, seq_len, eval_windows, where)
    losses: list[list[float]] = []  # [step, loss]
    trained = time.perf_counter()
    step = 0
    while step < steps:
        # The share done: of the steps, or of the minutes when those end it first.
        elapsed = (time.perf_counter() - trained) / (minutes * 60)
        if elapsed >= 1:
            break
        progress = max((step - warmup) / max(1, steps - warmup), elapsed)
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, progress, lr, warmup)
        window = _windows(data, batch, seq_len, generator).to(where, non_blocking=True)
        with _autocast(where):
            logits = model(window[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1)
        )
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % log_every == 0:
            losses.append([step, round(loss.item(), 4)])
        step += 1
    if where.type == "cuda":
        torch.cuda.synchronize(where)
    train_seconds = time.perf_counter() - trained
    final = held_out_loss(model, held_out, seq_len, eval_windows, where)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).save_pretrained(out)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_tokenizer(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    tokenizer.save_pretrained(out, save_jinja_files=False)
    report = {
        "corpus": corpus.describe(),
        "shape": shape,
        "config": SHAPES[shape],
        "parameters": num_params,
        "steps": step,
        "batch": batch,
        "seq_len": seq_len,
        "tokens_seen": step * batch * seq_len,
        "peak_lr": lr,
        "warmup": warmup,
        "train_seconds": round(train_seconds, 1),
        "loss_curve": losses,
        "held_out": {
            "windows": eval_windows,
            "loss_before": round(initial, 4),
            "loss_after": round(final, 4),
            "perplexity_per_byte": round(math.exp(final), 3),
        },
        "seconds": round(time.perf_counter() - began, 1),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(where) if where.type == "cuda" else "cpu",
        },
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def run(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    report = train(
        args.out,
        shape=args.shape,
        steps=args.steps,
        minutes=args.minutes,
        batch=args.batch,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup=args.warmup,
        device=device,
        seed=args.seed,
        corpus=load(max_bytes=args.max_corpus_bytes),
    )
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    held = report["held_out"]
    print(
        f"trained {report['parameters']:,} parameters for {report['steps']:,} steps "
        f"({report['train_seconds']} s): held-out loss {held['loss_before']} -> "
        f"{held['loss_after']} nats/byte"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
