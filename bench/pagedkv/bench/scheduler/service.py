"""``pagedkv bench scheduler``: the scheduler service over real executor processes, end to end.

Starts K executors (``python -m pagedkv.executor``) and a ``SchedulerService``
in this process, submits every request at once (random token prompts,
``ignore_eos``), streams them to the end, and reports output tokens per
second and, over the steps that ran every request together, the scheduler's
CPU time per step (building the message, applying the samples) and the RPC
overhead per step (the scheduler's wait minus the executor's own time).
Writes a JSON file and a markdown summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.bench.scheduler.machine import machine_info
from pagedkv.scheduler.child_commands import executor_commands
from pagedkv.scheduler.children import ExecutorProcesses, model_dir
from pagedkv.scheduler.config import SchedulerConfig
from pagedkv.scheduler.service import SchedulerService
from pagedkv.scheduler.step_loop import StepTiming
from pagedkv.v1 import common_pb2, scheduler_pb2


async def drain(generation: Any) -> int:
    while True:
        chunk = await generation.chunks.get()
        if isinstance(chunk, BaseException):
            raise chunk
        if chunk.HasField("usage"):
            return int(chunk.usage.completion_tokens)


async def _run(args: argparse.Namespace, addresses: list[str], depth: int) -> dict[str, Any]:
    config = SchedulerConfig(
        pipeline_depth=depth,
        executors=tuple(addresses),
        max_num_seqs=args.requests,
        max_num_batched_tokens=args.max_num_batched_tokens,
        executor_timeout=args.executor_timeout,
        model_dir=args.model,
    )
    service = SchedulerService(config)
    await service.start()
    vocab = service.executors.info.vocab_size
    rng = np.random.default_rng(args.seed)
    requests = [
        scheduler_pb2.GenerateRequest(
            request_id=f"bench-{i}",
            token_ids=scheduler_pb2.TokenIds(ids=rng.integers(0, vocab, args.prompt_len).tolist()),
            sampling=common_pb2.SamplingParams(
                temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True
            ),
        )
        for i in range(args.requests)
    ]
    cpu_start, start = time.process_time(), time.perf_counter()
    generations = [service.submit(request) for request in requests]
    tokens = await asyncio.gather(*(drain(g) for g in generations))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    timings = list(service.loops.step_timings)
    await service.stop()
    full = [t for t in timings if t.num_entries == args.requests]
    return {
        "output_tokens": int(sum(tokens)),
        "seconds": elapsed,
        "output_tokens_per_s": sum(tokens) / elapsed,
        "scheduler_process_cpu_s": cpu,
        "num_steps": len(timings),
        "full_batch_steps": step_summary(full, args.requests),
    }


def step_summary(steps: list[StepTiming], running: int) -> dict[str, Any]:
    if not steps:
        return {"steps": 0}
    median = statistics.median

    def us(values: list[float]) -> float:
        return median(values) * 1e6

    schedule = us([t.schedule_s for t in steps])
    process = us([t.process_s for t in steps])
    return {
        "steps": len(steps),
        "running_requests": running,
        "schedule_us": schedule,
        "process_us": process,
        "scheduler_cpu_us": schedule + process,
        "scheduler_cpu_ns_per_running_request": (schedule + process) * 1e3 / running,
        "rpc_us": us([t.rpc_s for t in steps]),
        "executor_host_us": us([t.executor_host_s for t in steps]),
        "rpc_overhead_us": us([t.rpc_s - t.executor_host_s for t in steps]),
    }


def main(args: argparse.Namespace) -> int:
    args.max_num_seqs = args.requests
    with model_dir(args.model) as model:
        args.model = model
        executors = ExecutorProcesses(executor_commands(args, model))
        try:
            # Per-step costs with one step in flight (the RPC wait is then the
            # step's alone); throughput with async stepping.
            steps = asyncio.run(_run(args, executors.addresses, 1))
            result = asyncio.run(_run(args, executors.addresses, 2))
        finally:
            executors.stop()
    result["full_batch_steps"] = steps["full_batch_steps"]
    result["output_tokens_per_s_one_step_in_flight"] = steps["output_tokens_per_s"]
    settings = {
        k: getattr(args, k)
        for k in (
            "device",
            "executors",
            "requests",
            "prompt_len",
            "max_tokens",
            "load_format",
            "enforce_eager",
        )
    }
    report = {"machine": machine_info(args.device), "settings": settings, **result}
    full = result["full_batch_steps"]
    lines = [
        f"{args.requests} requests x ({args.prompt_len} prompt -> {args.max_tokens} new tokens), "
        f"{args.executors} executor(s) on {args.device}",
        f"output: {result['output_tokens']} tokens in {result['seconds']:.2f} s = "
        f"{result['output_tokens_per_s']:.0f} tok/s with async stepping (2 steps in flight; "
        f"{result['output_tokens_per_s_one_step_in_flight']:.0f} tok/s with 1)",
    ]
    if full.get("steps"):
        lines.append(
            f"one step in flight, steps with all {args.requests} running ({full['steps']}): "
            f"scheduler CPU "
            f"{full['scheduler_cpu_us']:.0f} us/step (build {full['schedule_us']:.0f}, apply "
            f"{full['process_us']:.0f}; {full['scheduler_cpu_ns_per_running_request']:.0f} ns "
            f"per running request), RPC overhead {full['rpc_overhead_us']:.0f} us/step "
            f"(wait {full['rpc_us']:.0f}, executor {full['executor_host_us']:.0f})"
        )
    text = "\n".join(lines)
    print(text)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
        Path(args.output).with_suffix(".md").write_text(
            "# Scheduler service end to end (`pagedkv bench scheduler`)\n\n```\n"
            + text
            + "\n```\n\nMachine: "
            + json.dumps(report["machine"])
            + "\n"
        )
    return 0
