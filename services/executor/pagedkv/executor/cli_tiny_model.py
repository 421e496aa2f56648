"""Registers ``pagedkv make-tiny-model`` (imports nothing heavy until it runs)."""

from __future__ import annotations

import argparse
import os
from typing import Any

# Kept in step with tiny_model.ARCHS, which this module must not import.
_ARCHS = ("llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3")
_CHAT_TEMPLATES = ("llama3", "qwen2", "none")  # tiny_model.CHAT_TEMPLATE_NAMES


def register(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="write a random tiny model and a byte-level tokenizer (nothing downloaded)",
        description=(
            "Writes a random tiny Hugging Face model (float32 safetensors) and a byte-level "
            "tokenizer into DIR, loadable with AutoModelForCausalLM and AutoTokenizer."
        ),
    )
    parser.add_argument("dir", metavar="DIR", help="output directory (created if missing)")
    parser.add_argument("--arch", required=True, choices=_ARCHS)
    parser.add_argument(
        "--seed", type=int, default=0, help="torch seed of the weights (default: 0)"
    )
    parser.add_argument("--num-layers", type=int, default=2, help="decoder layers (default: 2)")
    parser.add_argument(
        "--chat-template",
        choices=_CHAT_TEMPLATES,
        default="llama3",
        help="the chat template written into tokenizer_config.json: Llama-3-style or "
        "Qwen2-style (markers as plain text), or none (the model then refuses chat requests)",
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported
    from transformers.utils import logging as hf_logging

    from pagedkv.executor.tiny_model import make_tiny_model

    hf_logging.disable_progress_bar()
    make_tiny_model(
        args.dir,
        args.arch,
        seed=args.seed,
        num_layers=args.num_layers,
        chat_template=args.chat_template,
    )
    print(
        f"wrote a tiny {args.arch} model ({args.num_layers} layers, seed {args.seed}) "
        f"and a byte-level tokenizer ({args.chat_template} chat template) to {args.dir}"
    )
    return 0
