"""``python -m pagedkv.bench.executor.host_tier``: what a prompt's first token
costs from each tier, on the executor (in-process ``Executor.step``, no
scheduler), and what offloads cost decode steps.

For a prompt of ``--prompt-len`` tokens (Llama-3-8B's shape by default,
dummy bf16 weights) each repetition times, as a step message would ask:

- *recompute*: a new request that prefills the whole prompt (in chunks of
  ``--chunk`` tokens, each a step) and samples its first token;
- *GPU hit*: the same prompt with its full blocks already in the pool
  (``num_computed_tokens`` = those blocks' tokens): only the last block's
  tokens are computed;
- *host hit*: those blocks offloaded to the host tier first (a step of
  offloads alone, timed on its own), then a request whose fresh blocks are
  loaded from the host in the same step message that computes the rest;
- *host hit, evicting*: the same, its message also offloading as many other
  blocks to other host blocks (what the evictions that made room for it
  would send).

Each is the wall time of ``Executor.step`` until its sampled token is on the
host, i.e. the executor's share of TTFT. Then decode steps of ``--batch``
rows with two in flight (as a scheduler's step stream runs them), alone and
each carrying ``--offload-blocks`` offloads of other blocks, give the cost
of offload traffic to the steps around it.

Writes a JSON file and a markdown summary. ``--profile DIR`` then runs one
GPU hit and one host hit under the torch profiler: their Chrome traces go to
DIR and, into the JSON, each stream's GPU time in those steps (when its
first and last work ran, how long it was busy), which shows whether a host
hit's copies overlap its forward.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedkv.bench.shapes import LLAMA_SHAPES

# A dry run's shape (``--device cpu``).
TINY: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1000,
    max_position_embeddings=1024,
)
SHAPES = {**LLAMA_SHAPES, "tiny": TINY}


def _owner() -> Any:
    from pagedkv.v1 import common_pb2

    return common_pb2.Owner(owner_id="bench", epoch=1)


class Bench:
    """Step messages for one executor; ``step`` times one."""

    def __init__(self, executor: Any, prompt: list[int], chunk: int) -> None:
        self.executor = executor
        self.prompt = prompt
        self.chunk = chunk
        self.block_size = executor.runner.config.block_size
        self.num_blocks = -(-len(prompt) // self.block_size)
        # Whole blocks within the first len - 1 tokens: what a hit may cover.
        self.num_hit_blocks = (len(prompt) - 1) // self.block_size
        self.step_id = 1
        self.last_tokens: list[int] = []
        self.first_tokens: list[int] = []  # each first_token's sampled token

    def _message(self) -> Any:
        from pagedkv.v1 import executor_pb2

        self.step_id += 1
        return executor_pb2.StepRequest(owner=_owner(), step_id=self.step_id)

    def step(self, message: Any) -> float:
        """Seconds from the call to the response (the samples on the host);
        the response's sampled tokens go to ``last_tokens``."""
        if self.executor.runner.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        response = self.executor.step(message)
        seconds = time.perf_counter() - start
        self.last_tokens = list(response.sampled_token_ids)
        return seconds

    def first_token(
        self,
        blocks: list[int],
        num_computed: int,
        loads: list[int],
        evicted: tuple[list[int], list[int]] = ([], []),
    ) -> float:
        """A new request in row 0 over ``blocks``, its first ``num_computed``
        tokens cached (``loads``: the host blocks the first of them come
        from, loaded in the first message, which also offloads ``evicted``:
        blocks and their host blocks, as evictions for room would); seconds
        to its first token."""
        from pagedkv.v1 import common_pb2

        seconds = 0.0
        computed = num_computed
        first = True
        while computed < len(self.prompt):
            message = self._message()
            count = min(self.chunk, len(self.prompt) - computed)
            last = computed + count == len(self.prompt)
            if first:
                message.new_requests.add(
                    seq_id="bench",
                    row=0,
                    prompt_token_ids=self.prompt,
                    sampling=common_pb2.SamplingParams(temperature=0.0),
                )
                message.block_table_starts.append(0)
                message.new_block_counts.append(len(blocks))
                message.new_block_ids.extend(blocks)
                message.load_host_block_ids.extend(loads)
                message.load_block_ids.extend(blocks[: len(loads)])
                message.offload_block_ids.extend(evicted[0])
                message.offload_host_block_ids.extend(evicted[1])
            else:
                message.rows.append(0)
                message.block_table_starts.append(len(blocks))
                message.new_block_counts.append(0)
            message.num_scheduled_tokens.append(count)
            message.num_computed_tokens.append(computed)
            message.continue_from_sampled.append(False)
            message.needs_sample.append(last)
            seconds += self.step(message)
            computed += count
            first = False
        self.first_tokens.append(self.last_tokens[0])
        self.free()
        return seconds

    def free(self) -> None:
        message = self._message()
        message.freed_rows.append(0)
        self.step(message)

    def offload(self, blocks: list[int], host_ids: list[int]) -> float:
        message = self._message()
        message.offload_block_ids.extend(blocks)
        message.offload_host_block_ids.extend(host_ids)
        return self.step(message)


def time_first_tokens(bench: Bench, repeat: int) -> dict[str, Any]:
    """Median seconds per tier over ``repeat`` rounds (a warm-up round first)."""
    n, hits = bench.num_blocks, bench.num_hit_blocks
    gpu_blocks = list(range(1, 1 + n))
    fresh = list(range(1 + n, 1 + 2 * n))
    host_ids = list(range(hits))
    keys = ("recompute", "gpu_hit", "offload", "host_hit", "host_hit_evicting")
    times: dict[str, list[float]] = {key: [] for key in keys}
    # The prompt's blocks again, to other host blocks: the evictions that
    # made room for a host hit, offloaded in its message.
    evicted = (gpu_blocks[:hits], list(range(hits, 2 * hits)))
    for round_ in range(repeat + 1):
        recompute = bench.first_token(gpu_blocks, 0, [])
        gpu_hit = bench.first_token(gpu_blocks, hits * bench.block_size, [])
        offload = bench.offload(gpu_blocks[:hits], host_ids)
        host_hit = bench.first_token(fresh, hits * bench.block_size, host_ids)
        evicting = bench.first_token(fresh, hits * bench.block_size, host_ids, evicted)
        if round_:
            for key, value in zip(
                keys, (recompute, gpu_hit, offload, host_hit, evicting), strict=True
            ):
                times[key].append(value)
    medians = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    return {
        # Greedy: the three ways to the first token should sample the same one.
        "first_tokens": bench.first_tokens,
        "same_first_token": len(set(bench.first_tokens)) == 1,
        "ms": medians,
        "runs_ms": {key: [v * 1e3 for v in values] for key, values in times.items()},
        "host_hit_over_recompute": medians["host_hit"] / medians["recompute"],
        "host_hit_over_gpu_hit": medians["host_hit"] / medians["gpu_hit"],
    }


def time_decodes_with_offloads(
    bench: Bench, batch: int, context: int, offload_blocks: int, iters: int, depth: int = 2
) -> dict[str, Any]:
    """Decode steps of ``batch`` rows from ``context`` tokens on, alone and
    with ``offload_blocks`` offloads of other blocks in each step's message,
    ``depth`` in flight as a step stream runs them (each launched before the
    previous ones complete): milliseconds per step over ``iters`` steps, for
    each setting in turn (alone, with offloads, alone again)."""
    from pagedkv.v1 import common_pb2

    executor = bench.executor
    settings = ("alone", "with_offloads", "alone_2")
    per_row = -(-(context + len(settings) * iters + 16) // bench.block_size)
    base = 1 + 2 * bench.num_blocks
    rng = np.random.default_rng(1)
    message = bench._message()
    for row in range(batch):
        message.new_requests.add(
            seq_id=f"d{row}",
            row=row,
            prompt_token_ids=rng.integers(0, 1000, size=context).tolist(),
            sampling=common_pb2.SamplingParams(temperature=0.0),
        )
        message.num_scheduled_tokens.append(context)
        message.num_computed_tokens.append(0)
        message.continue_from_sampled.append(False)
        message.needs_sample.append(True)
        message.block_table_starts.append(0)
        message.new_block_counts.append(per_row)
        message.new_block_ids.extend(range(base + row * per_row, base + (row + 1) * per_row))
    bench.step(message)
    sources = list(range(1, 1 + offload_blocks))  # the prompt's blocks: any will do
    num_computed = context
    result: dict[str, Any] = {}
    for label in settings:
        in_flight: list[Any] = []
        if executor.runner.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            step = bench._message()
            step.rows.extend(range(batch))
            step.num_scheduled_tokens.extend([1] * batch)
            step.num_computed_tokens.extend([num_computed] * batch)
            step.continue_from_sampled.extend([True] * batch)
            step.needs_sample.extend([True] * batch)
            step.block_table_starts.extend([per_row] * batch)
            step.new_block_counts.extend([0] * batch)
            if label == "with_offloads":
                step.offload_block_ids.extend(sources)
                step.offload_host_block_ids.extend(range(len(sources)))
            in_flight.append(executor.launch(step))
            num_computed += 1
            if len(in_flight) >= depth:
                executor.complete(in_flight.pop(0))
        for launched in in_flight:
            executor.complete(launched)
        result[f"{label}_ms"] = (time.perf_counter() - start) / iters * 1e3
    alone = (result["alone_ms"] + result["alone_2_ms"]) / 2
    result["slowdown"] = result["with_offloads_ms"] / alone - 1
    result.update(batch=batch, context=context, offload_blocks=offload_blocks, depth=depth)
    return result


def stream_spans(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Each stream's GPU work in a Chrome trace's ``events``: its first
    start and last end (ms from the first GPU work), its busy ms, its
    number of events, its busy intervals (gaps under 0.1 ms closed) and
    the busiest names."""
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return {}
    origin = min(float(e["ts"]) for e in gpu)
    spans: dict[str, list[tuple[float, float]]] = {}
    names: dict[str, dict[str, float]] = {}
    for event in gpu:
        key = str(event.get("args", {}).get("stream", event.get("tid")))
        start = (float(event["ts"]) - origin) / 1e3
        duration = float(event.get("dur", 0.0)) / 1e3
        spans.setdefault(key, []).append((start, start + duration))
        by_name = names.setdefault(key, {})
        name = str(event.get("name", ""))[:60]
        by_name[name] = by_name.get(name, 0.0) + duration
    streams: dict[str, Any] = {}
    for key, intervals in spans.items():
        intervals.sort()
        merged: list[list[float]] = []
        for start, end in intervals:
            if merged and start - merged[-1][1] < 0.1:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        top = sorted(names[key].items(), key=lambda item: -item[1])[:8]
        streams[key] = {
            "first_ms": round(intervals[0][0], 3),
            "last_ms": round(max(end for _, end in intervals), 3),
            "busy_ms": round(sum(end - start for start, end in intervals), 3),
            "events": len(intervals),
            "busy_intervals_ms": [[round(a, 3), round(b, 3)] for a, b in merged[:40]],
            "names": {name: round(ms, 3) for name, ms in top},
        }
    return streams


def profile_hits(bench: Bench, directory: Path) -> dict[str, Any]:
    """One GPU hit and one host hit (after its offload) under the torch
    profiler: each one's stream spans (``stream_spans``); traces to
    ``directory``."""
    from torch.profiler import ProfilerActivity, profile

    n, hits = bench.num_blocks, bench.num_hit_blocks
    gpu_blocks = list(range(1, 1 + n))
    fresh = list(range(1 + n, 1 + 2 * n))
    host_ids = list(range(hits))
    directory.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if bench.executor.runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    result: dict[str, Any] = {}
    bench.first_token(gpu_blocks, 0, [])
    for label in ("gpu_hit", "host_hit"):
        if label == "host_hit":
            bench.offload(gpu_blocks[:hits], host_ids)
            if bench.executor.runner.device.type == "cuda":
                torch.cuda.synchronize()
        blocks, loads = (gpu_blocks, []) if label == "gpu_hit" else (fresh, host_ids)
        with profile(activities=activities) as prof:
            ms = bench.first_token(blocks, hits * bench.block_size, loads) * 1e3
        path = directory / f"{label}.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
        result[label] = {"step_ms": round(ms, 3), "streams": stream_spans(events)}
    return result


def markdown(results: dict[str, Any]) -> str:
    first, decode = results["first_token"], results["decode"]
    ms = first["ms"]
    mib = results["bytes_per_block"] / 2**20
    return "\n".join(
        [
            "# Host tier on the executor (`python -m pagedkv.bench.executor.host_tier`)",
            "",
            f"Model: {results['preset']} shape, dummy weights; {results['gpu']}; "
            f"blocks of {results['block_size']} tokens, {mib:.2f} MiB each "
            f"(every layer's K and V); host tier {results['num_host_blocks']:,} blocks "
            f"in {results.get('load_chunks', 1)} chunk(s) of layers; CUDA graphs: "
            f"{results.get('cuda_graphs', 'all')}.",
            "",
            f"## First token of a {results['prompt_len']:,}-token prompt "
            f"(median of {results['repeat']}; `Executor.step` until the token is on the host)",
            "",
            "| from | ms | x recompute |",
            "|---|---|---|",
            f"| recompute (prefill, chunks of {results['chunk']:,}) | "
            f"{ms['recompute']:.2f} | 1.00 |",
            f"| GPU hit | {ms['gpu_hit']:.2f} | {ms['gpu_hit'] / ms['recompute']:.2f} |",
            f"| host hit (loads in the same message) | {ms['host_hit']:.2f} | "
            f"{first['host_hit_over_recompute']:.2f} |",
            f"| host hit whose message also offloads {results['hit_blocks']} evicted blocks | "
            f"{ms['host_hit_evicting']:.2f} | {ms['host_hit_evicting'] / ms['recompute']:.2f} |",
            "",
            f"Host hit / GPU hit: {first['host_hit_over_gpu_hit']:.2f}x. Every run sampled "
            f"the same first token (greedy): {first['same_first_token']}. The offload of the "
            f"prompt's {results['hit_blocks']} blocks, a step of its own: {ms['offload']:.2f} ms.",
            "",
            f"## Decode steps carrying offloads ({decode['batch']} rows from "
            f"{decode['context']:,} tokens on, {decode['offload_blocks']} offloads per step, "
            f"{decode['depth']} steps in flight)",
            "",
            f"Alone {decode['alone_ms']:.3f} / {decode['alone_2_ms']:.3f} ms, with offloads "
            f"{decode['with_offloads_ms']:.3f} ms: {100 * decode['slowdown']:+.1f}%.",
            "",
            f"Versions: torch {results['torch']}, triton {results['triton']}, "
            f"transformers {results['transformers']}, python {results['python']}.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench.executor.host_tier")
    parser.add_argument("--preset", default="llama-8b", choices=sorted(SHAPES))
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=8192, help="prefill tokens per step")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--host-kv-gib", type=float, default=4.0)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=32, help="decode rows")
    parser.add_argument("--context", type=int, default=1024, help="decode rows' context")
    parser.add_argument("--offload-blocks", type=int, default=16, help="per decode step")
    parser.add_argument("--iters", type=int, default=100, help="decode steps per setting")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run (use --preset tiny)")
    parser.add_argument("--output", default="host-tier-executor-h200.json")
    parser.add_argument(
        "--cuda-graphs",
        default="all",
        choices=("all", "decode", "none"),
        help="steps replayed from CUDA graphs: all, decodes only, or none",
    )
    parser.add_argument("--load-chunks", type=int, default=0, help="host pool chunks (0: default)")
    parser.add_argument("--profile", default="", help="a folder: profile one GPU and one host hit")
    args = parser.parse_args(argv)

    import transformers
    import triton
    from transformers import LlamaConfig

    from pagedkv.executor.engine import Executor
    from pagedkv.executor.model_runner import ModelRunner
    from pagedkv.executor.runner_config import RunnerConfig
    from pagedkv.v1 import executor_pb2

    with tempfile.TemporaryDirectory() as root:
        shape = dict(SHAPES[args.preset])
        longest = max(args.prompt_len, args.context + 3 * args.iters + 16)
        shape["max_position_embeddings"] = max(shape["max_position_embeddings"], longest)
        LlamaConfig(**shape, dtype="bfloat16").save_pretrained(root)
        runner = ModelRunner(
            RunnerConfig(
                model=root,
                device=args.device,
                dtype="bfloat16" if args.device == "cuda" else "float32",
                kernel_backend="triton" if args.device == "cuda" else "torch",
                load_format="dummy",
                num_blocks=args.num_blocks,
                max_num_rows=max(args.batch, 1),
                max_num_batched_tokens=max(args.chunk, args.batch * args.context),
                host_kv_gib=args.host_kv_gib,
                cuda_graphs=args.cuda_graphs != "none",
                mixed_graphs=args.cuda_graphs == "all",
            )
        )
        if args.load_chunks and runner.host_kv is not None:
            from pagedkv.executor.host_kv import HostKVPool

            runner.host_kv = HostKVPool(
                runner.kv, runner.host_kv.num_blocks, runner.backend, chunks=args.load_chunks
            )
        runner.warm_up()
    executor = Executor(runner, f"{args.preset}-dummy")
    executor.reset(executor_pb2.ResetRequest(owner=_owner()))
    prompt = np.random.default_rng(0).integers(0, 1000, size=args.prompt_len).tolist()
    bench = Bench(executor, prompt, args.chunk)
    first = time_first_tokens(bench, args.repeat)
    profiled = profile_hits(bench, Path(args.profile)) if args.profile else None
    decode = time_decodes_with_offloads(
        bench, args.batch, args.context, args.offload_blocks, args.iters
    )
    results = {
        "preset": args.preset,
        "cuda_graphs": args.cuda_graphs,
        "load_chunks": getattr(runner.host_kv, "num_chunks", 0),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "prompt_len": args.prompt_len,
        "chunk": args.chunk,
        "repeat": args.repeat,
        "block_size": bench.block_size,
        "bytes_per_block": runner.bytes_per_block,
        "num_host_blocks": runner.limits.num_host_blocks,
        "hit_blocks": bench.num_hit_blocks,
        "first_token": first,
        "decode": decode,
    }
    if profiled is not None:
        results["profile"] = profiled
    path = Path(args.output)
    path.write_text(json.dumps(results, indent=2) + "\n")
    text = markdown(results)
    path.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
