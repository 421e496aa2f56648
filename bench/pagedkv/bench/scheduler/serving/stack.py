"""The model and the server the serving benchmark runs against.

``model_dir`` yields the model directory: ``--model``, or a preset made in a
temporary directory (a tiny random llama with ``make-tiny-model``; the llama
shapes as a ``config.json``, for ``--load-format dummy``, and a
``tokenizer.json`` of words for their whole vocabulary, so that text is made
for every token as a real model's would be: the gateway streams text).
``ServeStack`` is ``pagedkv serve`` as a child process (one executor);
``TimelineStack`` a profiled executor (``python -m pagedkv.executor.timeline``)
and a ``pagedkv scheduler`` over it. Both stop their children on ``stop``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pagedkv.bench.shapes import LLAMA_SHAPES
from pagedkv.scheduler import children
from pagedkv.scheduler.child_commands import executor_commands
from pagedkv.scheduler.children import SCHEDULER_READY, ChildProcesses, ExecutorProcesses

SERVE_READY = re.compile(r"pagedkv serve ready on ([\w.\-]+:\d+)")


@contextlib.contextmanager
def model_dir(args: argparse.Namespace) -> Iterator[str]:
    """``args.model``, or the preset's directory (removed on exit:
    ``config.json``, a ``tokenizer.json`` of the whole vocabulary and a
    ``tokenizer_config.json``); a llama preset sets ``args.load_format`` to
    dummy (it has no weights)."""
    if args.model is not None or args.preset == "tiny":
        with children.model_dir(args.model) as model:
            yield model
        return
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-") as root:
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "rms_norm_eps": 1e-5,
            **LLAMA_SHAPES[args.preset],
        }
        (Path(root) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        word_tokenizer(int(config["vocab_size"])).save(str(Path(root) / "tokenizer.json"))
        # What transformers' AutoTokenizer needs beside tokenizer.json (load
        # generators such as guidellm tokenize their prompts with it).
        tokenizer_config = {"tokenizer_class": "TokenizersBackend"}
        (Path(root) / "tokenizer_config.json").write_text(json.dumps(tokenizer_config) + "\n")
        args.load_format = "dummy"
        yield root


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level tokenizer of exactly ``vocab_size`` ids: the 256 bytes,
    then words of lowercase letters with a leading space (" a", " b", ...,
    " z", " aa", ...: bijective base 26 of the id, so all distinct). It only
    decodes as a real tokenizer does: it has no merges, so it encodes text
    byte by byte."""
    assert vocab_size >= 256
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    space = "\u0120"  # how the byte-level alphabet writes a space
    vocab = {char: i for i, char in enumerate(alphabet)}
    for token_id in range(len(alphabet), vocab_size):
        word, n = "", token_id - len(alphabet) + 1
        while n:
            n, digit = divmod(n - 1, 26)
            word = chr(ord("a") + digit) + word
        vocab[space + word] = token_id
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def model_shape(model: str) -> dict[str, Any]:
    """The model's ``config.json`` as a dict."""
    config: dict[str, Any] = json.loads((Path(model) / "config.json").read_text())
    return config


def server_args(args: argparse.Namespace) -> list[str]:
    options = ["--device", args.device, "--dtype", args.dtype, "--load-format", args.load_format]
    options += ["--max-num-seqs", str(args.max_num_seqs)]
    options += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    options += ["--decode-window", str(args.decode_window)]
    options += ["--pipeline-depth", str(args.pipeline_depth)]
    if args.kernel_backend:
        options += ["--kernel-backend", args.kernel_backend]
    if args.num_blocks is not None:
        options += ["--num-blocks", str(args.num_blocks)]
    if getattr(args, "host_kv_gib", None) is not None:
        options += ["--host-kv-gib", str(args.host_kv_gib)]
    if getattr(args, "kv_cache_dtype", None) is not None:
        options += ["--kv-cache-dtype", args.kv_cache_dtype]
    if getattr(args, "host_offload", None) is not None:
        options += ["--host-offload", args.host_offload]
    if getattr(args, "host_idle_offload_blocks", None) is not None:
        options += ["--host-idle-offload-blocks", str(args.host_idle_offload_blocks)]
    if args.enforce_eager:
        options.append("--enforce-eager")
    if getattr(args, "cuda_graphs", "all") != "all":
        options += ["--cuda-graphs", args.cuda_graphs]
    return options


def start_scheduler(args: argparse.Namespace, model: str, executor: str) -> ChildProcesses:
    """A ready ``pagedkv scheduler`` over the running ``executor`` with the
    benchmark's scheduler settings (``args.decode_window``,
    ``args.pipeline_depth``, the batch limits); it takes the executor over
    with the epoch after its current owner's."""
    command = [sys.executable, "-m", "pagedkv.common.cli", "--log-level", "warning"]
    command += ["scheduler", "--executor", executor, "--port", "0"]
    command += ["--model", model, "--max-num-seqs", str(args.max_num_seqs)]
    command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    command += ["--decode-window", str(args.decode_window)]
    command += ["--pipeline-depth", str(args.pipeline_depth)]
    scheduler = ChildProcesses([command], "scheduler", SCHEDULER_READY, ["1/1"])
    try:
        scheduler.wait_ready()
    except BaseException:
        scheduler.stop()
        raise
    return scheduler


class ServeStack:
    """``pagedkv serve --executors 1`` on a free port with ``options`` (more
    ``serve`` flags); ``target`` once ready. The serving and memory
    benchmarks both run on it."""

    def __init__(self, model: str, options: list[str]) -> None:
        command = [sys.executable, "-m", "pagedkv.common.cli", "--log-level", "warning", "serve"]
        command += ["--model", model, "--port", "0", "--executors", "1", *options]
        self.children = ChildProcesses([command], "server", SERVE_READY, ["pagedkv serve"])
        try:
            self.target = self.children.wait_ready()[0]
        except BaseException:
            self.children.stop()
            raise

    def stop(self) -> None:
        self.children.stop()


class TimelineStack:
    """A profiled executor writing to ``directory`` (see
    ``pagedkv.executor.timeline``) and a scheduler over it; ``target``."""

    def __init__(
        self, args: argparse.Namespace, model: str, directory: Path, skip: int, steps: int
    ) -> None:
        options = argparse.Namespace(**vars(args))
        options.executors, options.log_format, options.log_level = 1, "console", "warning"
        command = executor_commands(options, model)[0]
        at = command.index("pagedkv.executor")
        command[at : at + 1] = ["pagedkv.executor.timeline", "--timeline-dir", str(directory)]
        command[at + 3 : at + 3] = ["--skip-steps", str(skip), "--steps", str(steps)]
        self.executor = ExecutorProcesses([command])
        try:
            self.scheduler = start_scheduler(args, model, self.executor.addresses[0])
            self.target = self.scheduler.addresses[0]
        except BaseException:
            self.executor.stop()
            raise

    def stop(self) -> None:
        self.scheduler.stop()
        self.executor.stop()
