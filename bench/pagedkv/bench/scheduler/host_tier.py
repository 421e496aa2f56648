"""``pagedkv bench host-tier``: prefix hits with and without a host tier, on a
trace whose distinct prefixes need several times the GPU pool.

The trace is a chat service's: ``--num-prefixes`` long system prompts (or
documents) of ``--prefix-len`` tokens, each request one of them (uniformly
drawn: no small hot set that the GPU pool alone could keep) followed by a
unique question and a short answer. The distinct prefixes need
``--pool-ratio`` times the usable GPU blocks.

Each configuration runs the whole trace through the service's own
``ExecutorScheduler`` answered by a simulated executor (``executor_sim``), as
``pagedkv bench blocks`` does: once with the GPU pool alone, once with a host
tier of ``--host-blocks`` blocks. Reported per run: the prefix hit rate
(cached prompt tokens over prompt tokens, at each request's first
admission), the prefill tokens computed (recomputation after preemption
included), the host tier's offloads and loads, and the steps taken. No time
is measured: what the tier saves in a real server (a PCIe copy instead of a
prefill) is measured on the GPU (``pagedkv bench serve`` with
``--host-kv-gib``).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from pagedkv.bench.scheduler.executor_sim import (
    answers,
    apply_answers,
    executor_info,
    generation,
    simulated_scheduler,
)

VOCAB_SIZE = 32_000


@dataclass(frozen=True, slots=True)
class HostTierRun:
    """One configuration's run of the trace."""

    host_blocks: int
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    prefix_hit_rate: float
    prefill_tokens: int
    offloaded_blocks: int
    loaded_blocks: int
    preemptions: int
    steps: int


def build_trace(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt, output tokens) per request: a prefix, a unique question."""
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(VOCAB_SIZE) for _ in range(args.prefix_len)]
        for _ in range(args.num_prefixes)
    ]
    trace = []
    for _ in range(args.num_requests):
        question = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(16, 128))]
        trace.append((rng.choice(prefixes) + question, rng.randint(16, 64)))
    return trace


def run(
    args: argparse.Namespace, trace: list[tuple[list[int], int]], host_blocks: int
) -> HostTierRun:
    """The trace through ``ExecutorScheduler`` with ``host_blocks`` host blocks."""
    info = executor_info(
        args.num_blocks,
        args.max_running,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    info.num_host_blocks = host_blocks
    scheduler = simulated_scheduler(info)
    generations = [
        generation(scheduler, key, prompt, num_output, arrival=float(key))
        for key, (prompt, num_output) in enumerate(trace, 1)
    ]
    for gen in generations:
        scheduler.add(gen.sequences[0])
    scheduled_tokens = steps = 0
    while scheduler.running or scheduler.waiting:
        step = scheduler.schedule()
        if step is None:
            raise RuntimeError("nothing could be scheduled with requests waiting")
        for message in (*step.before, step.request):
            scheduled_tokens += sum(message.num_scheduled_tokens) * max(1, message.num_decode_steps)
        apply_answers(scheduler, answers(step, steps))
        steps += 1
    prompt_tokens = sum(len(prompt) for prompt, _ in trace)
    cached = sum(gen.num_cached_prompt_tokens for gen in generations)
    decode_tokens = sum(gen.sequences[0].request.num_output_tokens - 1 for gen in generations)
    kv = scheduler.kv
    host = kv.host.stats if kv.host is not None else None
    report = kv.check_integrity()
    if not report.ok:
        raise RuntimeError("; ".join(report.errors))
    return HostTierRun(
        host_blocks=host_blocks,
        requests=len(trace),
        prompt_tokens=prompt_tokens,
        cached_prompt_tokens=cached,
        prefix_hit_rate=cached / prompt_tokens,
        prefill_tokens=scheduled_tokens - decode_tokens,
        offloaded_blocks=host.num_offloaded if host is not None else 0,
        loaded_blocks=host.num_loaded if host is not None else 0,
        preemptions=scheduler.num_preemptions,
        steps=steps,
    )


def main(args: argparse.Namespace) -> int:
    trace = build_trace(args)
    runs = [run(args, trace, 0), run(args, trace, args.host_blocks)]
    usable = args.num_blocks - 1
    prefix_blocks = args.num_prefixes * (args.prefix_len // args.block_size)
    gpu, tiered = runs
    report = {
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "pagedkv-scheduler": version("pagedkv-scheduler"),
        },
        "settings": {k: v for k, v in vars(args).items() if k != "handler"},
        "prefix_blocks_over_gpu_blocks": prefix_blocks / usable,
        "runs": [asdict(r) for r in runs],
        "hit_rate_ratio": tiered.prefix_hit_rate / max(gpu.prefix_hit_rate, 1e-9),
        "prefill_ratio": tiered.prefill_tokens / max(gpu.prefill_tokens, 1),
    }
    text = markdown(report)
    print(text)
    if args.output:
        path = Path(args.output)
        path.write_text(json.dumps(report, indent=1) + "\n")
        path.with_suffix(".md").write_text(text)
    return 0


def markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    gpu, tiered = report["runs"]
    rows = [
        ("host blocks", "host_blocks", "{:,}"),
        ("prefix hit rate (cached / prompt tokens)", "prefix_hit_rate", "{:.3f}"),
        ("prefill tokens computed", "prefill_tokens", "{:,}"),
        ("blocks offloaded to / loaded from the host", None, ""),
        ("preemptions", "preemptions", "{:,}"),
        ("steps", "steps", "{:,}"),
    ]
    lines = [
        "# Host tier: prefix hits on a trace larger than the GPU pool (`pagedkv bench host-tier`)",
        "",
        f"Trace: {settings['num_requests']} requests, each one of {settings['num_prefixes']} "
        f"prefixes of {settings['prefix_len']} tokens (uniform) then a unique question of 16-128 "
        f"tokens; answers of 16-64 tokens. GPU pool: {settings['num_blocks']} blocks of "
        f"{settings['block_size']} tokens, at most {settings['max_running']} running; the "
        f"distinct prefixes need {report['prefix_blocks_over_gpu_blocks']:.1f}x its usable "
        "blocks. The service's ExecutorScheduler, answered by a simulated executor.",
        "",
        "| | GPU pool only | with the host tier |",
        "|---|---|---|",
    ]
    for label, key, fmt in rows:
        if key is None:
            cells = [f"{r['offloaded_blocks']:,} / {r['loaded_blocks']:,}" for r in (gpu, tiered)]
        else:
            cells = [fmt.format(r[key]) for r in (gpu, tiered)]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    lines += [
        "",
        f"Hit rate with the tier / without: {report['hit_rate_ratio']:.2f}x; prefill tokens "
        f"computed: {report['prefill_ratio']:.2f}x.",
        "",
        f"Machine: {json.dumps(report['machine'])}",
        "",
    ]
    return "\n".join(lines)
