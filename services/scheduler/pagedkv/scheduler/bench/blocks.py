"""``pagedkv bench blocks``: the block core's cost on a ShareGPT-like trace.

The measured loop is the scheduler's bookkeeping for one step: running
requests first (one decode token each, through
``KVCacheManager.allocate_decode_slots`` as the service's scheduler calls it,
or their next prefill chunk), with preemption of the newest running request
when a block cannot be had, then admission from the waiting queue with a
prefix-cache lookup, then the update after the (absent) forward:
computed-token counts, the sampled token, finishing and freeing. Requests are
made (and their prompts hashed) before the loop, as on arrival; that cost is
reported on its own.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import timeit
from collections import deque
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from pagedkv.common.block_hash import hash_full_blocks, root_hash
from pagedkv.common.kv_cache_spec import KVCacheSpec
from pagedkv.scheduler.bench.trace import TraceConfig, build_trace
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.request import Request, RequestStatus

# Targets from the issue, on 2-core machines.
TARGET_NS_PER_RUNNING_REQUEST = 1000.0
TARGET_LOOKUP_US = 10.0
TARGET_HASH_US = 40.0


@dataclass(frozen=True, slots=True)
class TraceResult:
    num_steps: int
    total_s: float
    us_per_step_mean: float
    us_per_step_median: float
    us_per_step_p99: float
    ns_per_running_request_per_step: float
    mean_running: float
    prefix_hit_rate: float
    prefix_hit_tokens: int
    prefix_query_tokens: int
    block_utilisation_mean: float
    block_utilisation_peak: float
    num_preemptions: int
    num_finished: int
    num_output_tokens: int
    leaked_blocks: int
    integrity_ok: bool
    request_creation_us_mean: float


def run_trace(args: argparse.Namespace) -> TraceResult:
    """Builds the trace and runs every request to completion through the block core."""
    config = TraceConfig(num_requests=args.num_requests, seed=args.seed)
    trace = build_trace(config)
    spec = KVCacheSpec(args.block_size, 16, 8, 128, "bfloat16")
    kv = KVCacheManager(
        [spec], args.num_blocks, enable_caching=not args.no_prefix_caching, model_id="bench"
    )

    t0 = time.perf_counter()
    requests = [
        kv.make_request(t.request_id, t.prompt_token_ids, max_tokens=t.num_output_tokens)
        for t in trace
    ]
    creation_s = time.perf_counter() - t0
    vocab_size = config.vocab_size

    max_running = args.max_running
    max_batched = args.max_num_batched_tokens
    allocate_slots = kv.allocate_slots
    allocate_decode_slots = kv.allocate_decode_slots
    get_computed_blocks = kv.get_computed_blocks
    free = kv.free
    pool = kv.pool
    num_usable = args.num_blocks - 1
    waiting: deque[Request] = deque(requests)
    decoding: list[Request] = []  # running, prompt done: one token per step; oldest first
    prefilling: list[Request] = []  # running, prompt partly computed (chunked prefill)
    step_ns: list[int] = []
    num_running_per_step: list[int] = []
    usage_per_step: list[float] = []
    num_preemptions = 0
    num_finished = 0
    num_output_tokens = 0

    def preempt_newest() -> None:
        nonlocal num_preemptions
        victim = prefilling.pop() if prefilling else decoding.pop()
        free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        waiting.appendleft(victim)
        num_preemptions += 1

    def sample(request: Request) -> int:
        # Any id will do: the outputs are never shared.
        return request.num_tokens * 40503 % vocab_size

    gc.collect()
    gc.freeze()  # the trace's objects live all run long; keep them out of GC passes
    perf_counter_ns = time.perf_counter_ns
    while waiting or decoding or prefilling:
        start = perf_counter_ns()
        num_preempted = num_preemptions
        # 1. Running requests first: one token for each decoding request, in
        # order; on a miss the newest running request is preempted and the
        # slots go on from the request that missed ...
        num_allocated = 0
        while True:
            num_allocated += allocate_decode_slots(decoding, num_allocated).num_allocated
            if num_allocated == len(decoding):
                break
            preempt_newest()
        num_decoding = len(decoding)
        budget = max_batched - num_decoding
        # ... then the next chunk of each partly computed prompt.
        chunks: list[tuple[Request, int]] = []
        for request in prefilling:
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0 or allocate_slots(request, num_new) is None:
                break
            chunks.append((request, num_new))
            budget -= num_new
        # 2. Admission, with a prefix-cache lookup, unless this step preempted.
        num_running = num_decoding + len(prefilling)
        while (
            num_preempted == num_preemptions
            and waiting
            and budget > 0
            and num_running < max_running
        ):
            request = waiting[0]
            computed = get_computed_blocks(request)
            num_new = min(request.num_tokens - computed.num_tokens, budget)
            if allocate_slots(request, num_new, computed) is None:
                if not num_running:
                    raise RuntimeError(
                        f"{request.seq_id} needs more blocks than the pool has; raise --num-blocks"
                    )
                break
            waiting.popleft()
            request.status = RequestStatus.RUNNING
            prefilling.append(request)
            chunks.append((request, num_new))
            budget -= num_new
            num_running += 1
        # 3. After the forward: sampled tokens, finished requests, finished prompts.
        if num_decoding:
            num_done = 0
            for request in decoding:
                num_computed = request.num_computed_tokens + 1  # also its tokens, as sampled
                request.num_computed_tokens = num_computed
                request.append_output_token_ids(num_computed * 40503 % vocab_size)
                if num_computed + 1 - request.num_prompt_tokens == request.max_tokens:
                    request.status = RequestStatus.FINISHED_LENGTH
                    free(request)
                    num_done += 1
            if num_done:
                decoding[:] = [r for r in decoding if not r.status.is_finished]
            num_output_tokens += num_decoding
            num_finished += num_done
        for request, num_new in chunks:
            num_computed = request.num_computed_tokens + num_new
            request.num_computed_tokens = num_computed
            if num_computed == request.num_tokens:  # the prompt is done: first sample
                prefilling.remove(request)
                request.append_output_token_ids(sample(request))
                num_output_tokens += 1
                if request.num_output_tokens == request.max_tokens:
                    request.status = RequestStatus.FINISHED_LENGTH
                    free(request)
                    num_finished += 1
                else:
                    decoding.append(request)
        step_ns.append(perf_counter_ns() - start)
        num_running_per_step.append(num_running)
        usage_per_step.append(1.0 - pool.free_block_queue.num_free_blocks / num_usable)
    gc.unfreeze()

    report = kv.check_integrity()
    stats = kv.prefix_cache_stats
    total_ns = sum(step_ns)
    step_us = sorted(ns / 1000 for ns in step_ns)
    return TraceResult(
        num_steps=len(step_ns),
        total_s=total_ns / 1e9,
        us_per_step_mean=total_ns / len(step_ns) / 1000,
        us_per_step_median=statistics.median(step_us),
        us_per_step_p99=step_us[min(len(step_us) - 1, int(0.99 * len(step_us)))],
        ns_per_running_request_per_step=total_ns / sum(num_running_per_step),
        mean_running=statistics.fmean(num_running_per_step),
        prefix_hit_rate=stats.hit_rate,
        prefix_hit_tokens=stats.hits,
        prefix_query_tokens=stats.queries,
        block_utilisation_mean=statistics.fmean(usage_per_step),
        block_utilisation_peak=max(usage_per_step),
        num_preemptions=num_preemptions,
        num_finished=num_finished,
        num_output_tokens=num_output_tokens,
        leaked_blocks=num_usable - pool.get_num_free_blocks(),
        integrity_ok=report.ok,
        request_creation_us_mean=creation_s / len(requests) * 1e6,
    )


def _best_us(fn: Any, number: int, repeat: int = 7) -> float:
    """Best over ``repeat`` runs of the mean time of ``number`` calls, in µs.

    The best run is the one least disturbed by the rest of the machine.
    """
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def measure_hash_2048(block_size: int) -> float:
    """µs to hash the 2,048 tokens of a request's storage (128 blocks of 16)."""
    request = Request("h", range(2048), block_size=block_size, root_hash=root_hash("bench", 16))
    tokens, root = request.token_ids, request.root_hash
    num_blocks = 2048 // block_size
    return _best_us(lambda: hash_full_blocks(root, tokens, block_size, 0, num_blocks), 2000)


def measure_lookup_2048(block_size: int) -> float:
    """µs for ``get_computed_blocks`` of a 2,048-token request, first 1,024 cached."""
    spec = KVCacheSpec(block_size, 16, 8, 128, "bfloat16")
    kv = KVCacheManager([spec], 1024, model_id="bench")
    warm = kv.make_request("warm", range(1024))
    kv.allocate_slots(warm, 1024, kv.get_computed_blocks(warm))
    kv.free(warm)
    request = kv.make_request("probe", [*range(1024), *range(5000, 6024)])
    assert kv.get_computed_blocks(request).num_tokens == 1024
    return _best_us(lambda: kv.get_computed_blocks(request), 20_000)


def _machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "system": platform.platform(),
        "python": sys.version.split()[0],
        "xxhash": version("xxhash"),
        "numpy": version("numpy"),
        "pagedkv_scheduler": version("pagedkv-scheduler"),
    }


def calibration_ns() -> float:
    """ns per iteration of a fixed pure-Python loop: how fast the machine is now.

    Shared 2-core machines change speed from minute to minute; this figure,
    taken before each trace run, tells a slow run from a slow machine.
    """

    def loop() -> int:
        total = 0
        for i in range(100_000):
            total += i & 7
        return total

    return min(timeit.repeat(loop, number=1, repeat=5)) / 100_000 * 1e9


def main(args: argparse.Namespace) -> int:
    calibrations = []
    runs = []
    for _ in range(args.repeat):
        calibrations.append(calibration_ns())
        runs.append(run_trace(args))
    trace = min(runs, key=lambda run: run.ns_per_running_request_per_step)
    hash_us = measure_hash_2048(args.block_size)
    lookup_us = measure_lookup_2048(args.block_size)
    results = {
        "benchmark": "blocks",
        "machine": _machine(),
        "config": {
            "num_requests": args.num_requests,
            "num_blocks": args.num_blocks,
            "block_size": args.block_size,
            "max_running": args.max_running,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "prefix_caching": not args.no_prefix_caching,
            "seed": args.seed,
            "repeat": args.repeat,
            "trace": asdict(TraceConfig(num_requests=args.num_requests, seed=args.seed)),
        },
        "trace": asdict(trace),
        "trace_runs_ns_per_running_request_per_step": [
            run.ns_per_running_request_per_step for run in runs
        ],
        "trace_runs_calibration_ns_per_loop_iteration": calibrations,
        "hash_2048_tokens_us": hash_us,
        "lookup_2048_tokens_1024_cached_us": lookup_us,
        "targets": {
            "ns_per_running_request_per_step": TARGET_NS_PER_RUNNING_REQUEST,
            "lookup_us": TARGET_LOOKUP_US,
            "hash_2048_tokens_us": TARGET_HASH_US,
        },
    }
    rows = table_rows(results)
    print(format_table(rows))
    if args.output:
        output = Path(args.output)
        output.write_text(json.dumps(results, indent=2) + "\n")
        output.with_suffix(".md").write_text(format_markdown(results, rows))
        print(f"results written to {output} and {output.with_suffix('.md')}")
    clean = all(run.leaked_blocks == 0 and run.integrity_ok for run in runs)
    return 0 if clean else 1


def table_rows(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    t = results["trace"]
    rows = [
        ("steps", f"{t['num_steps']}", ""),
        (
            "runs: ns per running request per step",
            " / ".join(f"{ns:.0f}" for ns in results["trace_runs_ns_per_running_request_per_step"]),
            "best shown below",
        ),
        (
            "runs: machine speed, ns per loop iteration",
            " / ".join(
                f"{ns:.1f}" for ns in results["trace_runs_calibration_ns_per_loop_iteration"]
            ),
            "lower is faster",
        ),
        (
            "µs per step (mean / median / p99)",
            f"{t['us_per_step_mean']:.1f} / {t['us_per_step_median']:.1f}"
            f" / {t['us_per_step_p99']:.1f}",
            "",
        ),
        (
            "ns per running request per step",
            f"{t['ns_per_running_request_per_step']:.0f}",
            f"≤ {TARGET_NS_PER_RUNNING_REQUEST:.0f}",
        ),
        ("mean running requests", f"{t['mean_running']:.1f}", ""),
        ("prefix hit rate (tokens)", f"{t['prefix_hit_rate']:.1%}", ""),
        (
            "block utilisation (mean / peak)",
            f"{t['block_utilisation_mean']:.1%} / {t['block_utilisation_peak']:.1%}",
            "",
        ),
        ("preemptions", f"{t['num_preemptions']}", ""),
        ("finished requests", f"{t['num_finished']}", ""),
        ("leaked blocks at the end", f"{t['leaked_blocks']}", "0"),
        ("integrity check", "ok" if t["integrity_ok"] else "FAILED", "ok"),
        ("request creation incl. prompt hashing (µs)", f"{t['request_creation_us_mean']:.1f}", ""),
        (
            "hash 2,048 tokens (µs)",
            f"{results['hash_2048_tokens_us']:.1f}",
            f"≤ {TARGET_HASH_US:.0f}",
        ),
        (
            "lookup 2,048 tokens, 1,024 cached (µs)",
            f"{results['lookup_2048_tokens_1024_cached_us']:.2f}",
            f"≤ {TARGET_LOOKUP_US:.0f}",
        ),
    ]
    return rows


def format_table(rows: list[tuple[str, str, str]]) -> str:
    """The rows as an aligned plain-text table."""
    width = max(len(r[0]) for r in rows)
    value_width = max(len(r[1]) for r in rows)
    lines = [f"{'metric':<{width}}  {'value':>{value_width}}  target"]
    lines.append("-" * (width + value_width + 10))
    lines += [f"{name:<{width}}  {value:>{value_width}}  {target}" for name, value, target in rows]
    return "\n".join(lines)


def format_markdown(results: dict[str, Any], rows: list[tuple[str, str, str]]) -> str:
    """A short report: the machine, the configuration and the table."""
    machine = results["machine"]
    lines = [
        "# Block-core benchmark (`pagedkv bench blocks`)",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['system']}; "
        f"Python {machine['python']}, xxhash {machine['xxhash']}, numpy {machine['numpy']}.",
        "",
        "Trace: {num_requests} requests, {num_blocks} blocks of {block_size} tokens, up to "
        "{max_running} running, {max_num_batched_tokens} tokens per step, prefix caching "
        "{prefix_caching}; best of the trace runs listed.".format(**results["config"]),
        "",
        "| metric | value | target |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {value} | {target} |" for name, value, target in rows]
    return "\n".join(lines) + "\n"
