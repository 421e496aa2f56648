"""``pagedkv bench swap``: swap versus recompute under memory pressure.

The memory benchmark's chat scenario (its requests, lengths, output fraction
and context, from ``pagedkv bench memory``'s defaults; random prompts,
greedy, ``ignore_eos``), all sent at once to a GPU pool of
``--pool-fraction`` of the blocks the requests need at their final lengths,
so that requests are preempted. The same requests run once per mode, each
on a fresh ``pagedkv serve`` (one executor, single decode steps), so that no
run finds another's cache: ``off`` (no host tier: a preempted request
recomputes what the GPU pool no longer holds), and with a host tier that
has room for every block, the scheduler's ``--host-loads`` ``never``
(recompute), ``always`` (load every host hit back) and ``auto`` (as the
executor's measured costs say). ``--repeat`` runs every mode again, in
turn; each mode's fastest run is reported. A few salted warm-up requests
run first; the server's counters are GetStats' after the batch less before
it. The tokens computed are those the batch's steps scheduled, from the
scheduler's step trace (``pagedkv.common.step_trace``): GetStats counts
each admission's lookup, not the tokens the steps compute. Numbers come
only from the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.bench.report_files import write_report
from pagedkv.bench.scheduler.machine import machine_info
from pagedkv.bench.scheduler.memory import cli as memory_cli
from pagedkv.bench.scheduler.memory.live import BLOCK_SIZE, tiny_model
from pagedkv.bench.scheduler.memory.scenarios import _prompt, blocks_for, chat_lengths
from pagedkv.bench.scheduler.serving import step_trace
from pagedkv.bench.scheduler.serving.load import server_stats, wait_ready
from pagedkv.bench.scheduler.serving.run import _versions
from pagedkv.bench.scheduler.serving.stack import ServeStack, model_dir
from pagedkv.bench.scheduler.swap_report import markdown, verdict
from pagedkv.client import AsyncClient
from pagedkv.common.logging import get_logger

MODES = ("off", "never", "always", "auto")  # off: no host tier; the rest: --host-loads
WARMUP = (4, 256, 16)  # warm-up requests: how many, prompt tokens, output tokens
MAX_NUM_BATCHED_TOKENS = 8192  # as the memory benchmark's server
DTYPE_BYTES = {"float16": 2, "bfloat16": 2}  # others (auto, float32): 4, an upper bound
COUNTERS = (
    "num_offloaded_blocks",
    "num_loaded_blocks",
    "host_loads_chosen",
    "host_recomputes_chosen",
    "prefix_cache_host_hits",
    "prefix_cache_hits",
    "prefix_cache_queries",
    "offload_copy_seconds",
    "load_copy_seconds",
)
COSTS = (
    "num_host_blocks",
    "prefill_seconds_per_token",
    "host_load_seconds",
    "host_load_seconds_per_block",
)
log = get_logger(__name__)


def chat_settings() -> dict[str, Any]:
    """The memory benchmark's chat scenario: its requests, context, mean
    length and output fraction."""
    parser = argparse.ArgumentParser()
    memory_cli.register(parser.add_subparsers(), "memory")
    args = parser.parse_args(["memory"])
    keys = ("chat_requests", "max_model_len", "chat_mean_len", "chat_output_fraction")
    return {k: getattr(args, k) for k in keys}


def chat_batch(num_requests: int, seed: int, chat: dict[str, Any]) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) of each request, drawn as the memory benchmark's chat draws them."""
    rng = random.Random(seed)
    lengths = chat_lengths(num_requests, chat["chat_mean_len"], chat["max_model_len"], seed)
    batch = []
    for total in lengths:
        output = max(1, round(total * chat["chat_output_fraction"]))
        batch.append((_prompt(rng, total - output), output))
    return batch


def bytes_per_block(config: dict[str, Any], dtype: str) -> int:
    """K and V of one block in every layer (``dtype`` auto counts 4 bytes)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
    return int(per_token) * BLOCK_SIZE * DTYPE_BYTES.get(dtype, 4)


@contextmanager
def benchmark_model(args: argparse.Namespace, max_model_len: int) -> Iterator[tuple[str, str]]:
    """The model directory and its load format: the memory benchmark's tiny
    llama, or a llama preset with dummy weights and ``max_model_len``
    positions (the weights do not depend on them)."""
    if args.preset == "tiny":
        with tempfile.TemporaryDirectory(prefix="pagedkv-swap-") as root:
            yield tiny_model(Path(root), max_model_len), "auto"
        return
    preset = argparse.Namespace(model=None, preset=args.preset, load_format="auto")
    with model_dir(preset) as model:
        path = Path(model) / "config.json"
        config = json.loads(path.read_text())
        config["max_position_embeddings"] = max_model_len
        path.write_text(json.dumps(config, indent=2) + "\n")
        yield model, preset.load_format


@dataclass
class Outcome:
    """What the client saw of one request."""

    token_ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    finish_reason: str | None = None


async def _send(
    client: AsyncClient, prompt: list[int], max_tokens: int, start: float, salt: str = ""
) -> Outcome:
    outcome = Outcome()
    stream = client.generate(
        token_ids=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        skip_text=True,
        cache_salt=salt,
    )
    async for chunk in stream:
        for seq in chunk.sequences:
            if seq.token_ids and outcome.ttft_s is None:
                outcome.ttft_s = time.perf_counter() - start
            outcome.token_ids.extend(seq.token_ids)
            if seq.finish_reason is not None:
                outcome.finish_reason = seq.finish_reason.value
    return outcome


async def _batch(
    target: str, batch: list[tuple[list[int], int]], seed: int
) -> tuple[list[Outcome], float, float, Any, Any]:
    """Warm-up, then ``batch`` all at once: outcomes, its start (perf_counter)
    and seconds, and GetStats before and after it."""
    await wait_ready(target)
    rng = random.Random(seed + 1)
    num, prompt_len, output_len = WARMUP
    async with AsyncClient(target, timeout=3600) as client:
        warm = [_prompt(rng, prompt_len) for _ in range(num)]
        now = time.perf_counter()
        await asyncio.gather(*(_send(client, p, output_len, now, "warm-up") for p in warm))
        before = await server_stats(target)
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(_send(client, p, m, start) for p, m in batch))
        seconds = time.perf_counter() - start
        after = await server_stats(target)
    return list(outcomes), start, seconds, before, after


def _step_costs(folder: Path, since: float) -> dict[str, Any]:
    """Where the batch's steps spent their time (``step_trace.analyze``):
    the device's busy fraction, its seconds in decode steps and in steps
    that computed prompt tokens, and the medians of a decode step's device
    time and of the executor's CPU to launch a step (what a tier adds per
    step shows there). Empty without the traces."""
    try:
        steps = step_trace.analyze(folder, since)
    except (FileNotFoundError, ValueError):
        return {}
    kinds: dict[str, dict[str, float]] = steps["device_ms_by_kind"]

    def seconds(prefix: str) -> float:
        ms = sum(v["device_ms"] for k, v in kinds.items() if k.startswith(prefix))
        return round(ms / 1e3, 3)

    decode = kinds.get("decode")
    return {
        "device_busy_fraction": steps["device_busy_fraction"],
        "decode_device_s": seconds("decode"),
        "prefill_device_s": seconds("prefill"),
        "decode_step_device_us": round(decode["device_ms"] / decode["steps"] * 1e3, 1)
        if decode and decode["steps"]
        else None,
        "executor_launch_cpu_us": steps["median_us"]["executor_launch_cpu"],
    }


def _traced_steps(folder: Path, since: float) -> tuple[int | None, int | None]:
    """The scheduler's steps begun after ``since`` and the tokens they
    scheduled (None, None without its trace)."""
    try:
        records = step_trace.records(folder, "scheduler")
    except FileNotFoundError:
        return None, None
    steps = [r for r in records if r["scheduling"] >= since]
    return len(steps), int(sum(r["tokens"] for r in steps))


@dataclass(frozen=True)
class Pool:
    """The requests and the pools they run on: ``num_blocks`` GPU blocks (the
    null block too), a host tier of ``host_kv_gib`` GiB."""

    batch: list[tuple[list[int], int]]
    blocks_needed: int  # at the requests' final lengths, without preemption
    num_blocks: int
    bytes_per_block: int
    host_kv_gib: float

    @classmethod
    def sized(
        cls,
        batch: list[tuple[list[int], int]],
        fraction: float,
        block_bytes: int,
        host_kv_gib: float | None,
    ) -> Pool:
        """A GPU pool of ``fraction`` of the blocks ``batch`` needs, but at
        least the longest request's and the block its next token may take;
        a host tier with room for every block (``host_kv_gib`` overrides)."""
        needed = sum(blocks_for(len(p) + m) for p, m in batch)
        longest = max(blocks_for(len(p) + m) + 1 for p, m in batch)
        usable = max(math.ceil(fraction * needed), longest)
        host_blocks = needed + WARMUP[0] * blocks_for(WARMUP[1] + WARMUP[2])
        host_gib = math.ceil(host_blocks * block_bytes / 2**20) / 1024  # whole MiB
        return cls(batch, needed, usable + 1, block_bytes, host_kv_gib or host_gib)


def run_mode(
    args: argparse.Namespace, mode: str, model: str, load_format: str, pool: Pool
) -> tuple[dict[str, Any], list[Outcome]]:
    """One mode on a fresh ``pagedkv serve``: its measures and the outcomes."""
    batch = pool.batch
    options = ["--device", args.device, "--dtype", args.dtype, "--load-format", load_format]
    options += ["--num-blocks", str(pool.num_blocks), "--max-num-seqs", str(len(batch))]
    options += ["--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--decode-window", "1"]
    options += ["--executor-timeout", "600"]
    if mode != "off":
        options += ["--host-kv-gib", str(pool.host_kv_gib), "--host-loads", mode]
    with tempfile.TemporaryDirectory(prefix="pagedkv-swap-trace-") as traces:
        with step_trace.tracing(traces):
            stack = ServeStack(model, options)
        try:
            outcomes, start, seconds, before, after = asyncio.run(
                _batch(stack.target, batch, args.seed)
            )
        finally:
            stack.stop()
        num_steps, computed = _traced_steps(Path(traces), start)
        costs = _step_costs(Path(traces), start)
    old, new = before.executors[0], after.executors[0]
    num_output = sum(len(o.token_ids) for o in outcomes)
    least = sum(len(p) + m - 1 for p, m in batch)  # each token's KV (or logits) once
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    result: dict[str, Any] = {
        "seconds": round(seconds, 2),
        "output_tokens": num_output,
        "output_tokens_per_s": round(num_output / seconds, 1),
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "num_finished": sum(
            o.finish_reason == "length" and len(o.token_ids) == m
            for o, (_, m) in zip(outcomes, batch, strict=True)
        ),
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        **{k: getattr(new, k) - getattr(old, k) for k in COUNTERS},
        **{k: getattr(new, k) for k in COSTS},
        "num_steps": num_steps,
        "tokens_computed": computed,
        "tokens_recomputed": None if computed is None else computed - least,
        "integrity_ok": after.integrity.ok,
        **costs,
    }
    log.info("mode done", mode=mode, seconds=result["seconds"])
    return result, outcomes


def run_rounds(
    args: argparse.Namespace, modes: list[str], model: str, load_format: str, pool: Pool
) -> dict[str, dict[str, Any]]:
    """``args.repeat`` rounds of every mode (round r starts at mode r, so
    that none always runs first); each mode's fastest run, with every run's
    seconds and, when off ran, how many of its outputs equal off's."""
    fastest: dict[str, tuple[dict[str, Any], list[Outcome]]] = {}
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for r in range(args.repeat):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            result, outcomes = run_mode(args, mode, model, load_format, pool)
            seconds[mode].append(result["seconds"])
            if mode not in fastest or result["seconds"] < fastest[mode][0]["seconds"]:
                fastest[mode] = result, outcomes
    runs = {mode: {**fastest[mode][0], "seconds_all": seconds[mode]} for mode in modes}
    if "off" in fastest:
        off = fastest["off"][1]
        for mode in modes:
            same = zip(fastest[mode][1], off, strict=True)
            runs[mode]["num_outputs_as_off"] = sum(a.token_ids == b.token_ids for a, b in same)
    return runs


def main(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown or not modes:
        raise SystemExit(f"--modes: some of {', '.join(MODES)}, got {args.modes!r}")
    if args.repeat < 1:
        raise SystemExit(f"--repeat: at least 1, got {args.repeat}")
    chat = chat_settings()
    if args.output_fraction is not None:
        if not 0 < args.output_fraction < 1:
            raise SystemExit(f"--output-fraction: between 0 and 1, got {args.output_fraction}")
        chat["chat_output_fraction"] = args.output_fraction
    batch = chat_batch(args.num_requests or chat["chat_requests"], args.seed, chat)
    with benchmark_model(args, chat["max_model_len"]) as (model, load_format):
        config = json.loads((Path(model) / "config.json").read_text())
        block_bytes = bytes_per_block(config, args.dtype)
        pool = Pool.sized(batch, args.pool_fraction, block_bytes, args.host_kv_gib)
        runs = run_rounds(args, modes, model, load_format, pool)
    lengths = [len(p) + m for p, m in batch]
    report = {
        "machine": {**machine_info(args.device), **_versions()},
        "settings": {
            **{k: getattr(args, k) for k in ("device", "dtype", "preset", "seed", "repeat")},
            "pool_fraction": args.pool_fraction,
            **{k: v for k, v in chat.items() if k != "chat_requests"},
            "num_requests": len(batch),
            "mean_len": round(sum(lengths) / len(lengths), 1),
            "max_len": max(lengths),
            "blocks_needed": pool.blocks_needed,
            "num_blocks": pool.num_blocks,
            "host_kv_gib": pool.host_kv_gib,
            "bytes_per_block": pool.bytes_per_block,
            "block_size": BLOCK_SIZE,
            "decode_window": 1,
            "max_num_seqs": len(batch),
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "warmup": dict(zip(("requests", "prompt_len", "output_len"), WARMUP, strict=True)),
        },
        "runs": runs,
        "verdict": verdict(runs),
    }
    write_report(args.output, report, markdown(report))
    complete = all(r["num_finished"] == len(batch) and r["integrity_ok"] for r in runs.values())
    return 0 if complete else 1
