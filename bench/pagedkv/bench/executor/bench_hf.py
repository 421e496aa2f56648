"""``python -m pagedkv.bench.executor.bench_hf``: Hugging Face ``generate`` on a
fixed batch, the baseline of ``pagedkv bench serve``.

N random prompts of P tokens, all of one length (no padding), each to
generate exactly O tokens greedily (``min_new_tokens`` = O, so EOS does not
end one early), in one ``generate`` call. On CUDA with a static cache, which
transformers compiles (``torch.compile`` of the decoding forward) on its own;
on the CPU a plain eager run with the default dynamic cache, so the code path
runs where there is no GPU. One untimed call first (compilation, warm-up),
then ``--repeat`` timed calls; the median is reported. Prints one JSON object
on stdout (``--output``: to a file).

The weights: those of ``--model``, or with ``--load-format dummy`` random
ones of its config (the same shapes as the executor's dummy weights).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _model(model_dir: str, device: str, dtype: str, load_format: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(model_dir)
    kwargs: dict[str, Any] = {"attn_implementation": "sdpa"}
    if dtype != "auto":
        kwargs["dtype"] = getattr(torch, dtype)
    elif device == "cpu":
        kwargs["dtype"] = torch.float32
    else:
        kwargs["dtype"] = getattr(config, "dtype", None) or torch.bfloat16
    if load_format == "dummy":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    return model.to(device).eval()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The timed ``generate`` calls' results (see the module docstring)."""
    torch.manual_seed(args.seed)
    model = _model(args.model, args.device, args.dtype, args.load_format)
    cuda = torch.device(args.device).type == "cuda"
    vocab = model.config.vocab_size
    input_ids = torch.randint(0, vocab, (args.batch, args.prompt_len), device=args.device)
    kwargs: dict[str, Any] = {
        "attention_mask": torch.ones_like(input_ids),
        "max_new_tokens": args.max_tokens,
        "min_new_tokens": args.max_tokens,
        "do_sample": False,
        "pad_token_id": model.config.pad_token_id or 0,
    }
    if cuda:
        kwargs["cache_implementation"] = "static"

    def generate() -> tuple[float, int]:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, int(out.shape[1] - args.prompt_len)

    warm_up_s, _ = generate()
    runs = [generate() for _ in range(args.repeat)]
    seconds = statistics.median(s for s, _ in runs)
    new_tokens = {n for _, n in runs}
    assert new_tokens == {args.max_tokens}, new_tokens
    return {
        "engine": "hf-generate",
        "mode": "static cache + torch.compile" if cuda else "eager, dynamic cache",
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "dtype": str(model.dtype).removeprefix("torch."),
        "load_format": args.load_format,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "output_tokens": args.batch * args.max_tokens,
        "first_call_s": warm_up_s,
        "runs_s": [s for s, _ in runs],
        "seconds": seconds,
        "output_tokens_per_s": args.batch * args.max_tokens / seconds,
    }


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench.executor.bench_hf")
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=2, help="timed calls (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="write the JSON here instead of stdout")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    text = json.dumps(run(args), indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
