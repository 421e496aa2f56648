"""Time to first token of one long prompt from each tier, end to end.

``python -m pagedkv.bench.scheduler.host_ttft`` starts ``pagedkv serve`` (one
executor, a host tier of ``--host-kv-gib``, a GPU pool holding one prompt
and a few blocks more) and, per round, sends a fresh random prompt of
``--prompt-len`` tokens asking for one token, three times over the gRPC
API, timing each request from its send to its first token:

1. **recompute**: the prompt is new, every token is computed;
2. **GPU hit**: the same prompt again, its blocks still cached on the GPU
   (only the last, partial block is computed);
3. after two filler prompts of the same length have taken the GPU pool in
   turn (evicting the prompt's blocks, already written through to the
   host),
   **host hit**: the same prompt once more, its blocks loaded back from
   the host in the same step message that computes the rest.

Each request's usage (``cached_prompt_tokens``) and the executor's
``GetStats`` (host hits, blocks loaded) are checked, so a round whose hits
were not what it claims is reported as such. The server's processes trace
their steps (``pagedkv.common.step_trace``), and the report splits each
tier's first token into the path to the scheduler, the scheduler's step,
the executor's and the way back (``where_ms``). The first round warms the
paths up and is not counted; the report gives every counted round and the
medians, with the ratios host/recompute and host/GPU hit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from pagedkv.bench.report_files import write_report
from pagedkv.bench.scheduler.serving import step_trace
from pagedkv.bench.scheduler.serving.load import server_stats, wait_ready
from pagedkv.bench.scheduler.serving.run import machine
from pagedkv.bench.scheduler.serving.stack import ServeStack, model_dir
from pagedkv.bench.scheduler.serving.step_trace import records as step_trace_records
from pagedkv.bench.shapes import LLAMA_SHAPES
from pagedkv.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

BLOCK_SIZE = 16
TIERS = ("recompute", "gpu_hit", "host_hit")


def _prompt(rng: random.Random, length: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, vocab_size) for _ in range(length))


async def _first_token(
    stub: scheduler_pb2_grpc.SchedulerStub, request_id: str, prompt: tuple[int, ...]
) -> dict[str, Any]:
    """One request for one token: its TTFT (ms), cached prompt tokens, and
    when it was sent and its token came (``time.perf_counter()``, the clock
    of the step traces)."""
    message = scheduler_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=scheduler_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        skip_text=True,
    )
    sent = time.perf_counter()
    first, cached = None, None
    async for chunk in stub.Generate(message, timeout=600):
        if first is None and any(output.token_ids for output in chunk.outputs):
            first = time.perf_counter()
        if chunk.HasField("usage"):
            cached = chunk.usage.cached_prompt_tokens
    if first is None or cached is None:
        raise RuntimeError(f"{request_id}: the stream ended without a token and usage")
    return {"ttft_ms": round((first - sent) * 1e3, 2), "cached": cached, "at": (sent, first)}


async def _round(
    target: str, index: int, prompt: tuple[int, ...], fillers: list[tuple[int, ...]]
) -> dict[str, Any]:
    """The three first tokens of one prompt (see the module's docstring)."""
    row: dict[str, Any] = {"round": index}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        row["recompute"] = await _first_token(stub, f"r{index}-recompute", prompt)
        row["gpu_hit"] = await _first_token(stub, f"r{index}-gpu", prompt)
        for i, filler in enumerate(fillers):
            await _first_token(stub, f"r{index}-filler-{i}", filler)
        before = (await server_stats(target)).executors[0]
        row["host_hit"] = await _first_token(stub, f"r{index}-host", prompt)
        after = (await server_stats(target)).executors[0]
    host = row["host_hit"]
    host["host_hit_tokens"] = after.prefix_cache_host_hits - before.prefix_cache_host_hits
    host["loaded_blocks"] = after.num_loaded_blocks - before.num_loaded_blocks
    return row


def _where(rounds: list[dict[str, Any]], traces: Path) -> dict[str, dict[str, float]]:
    """Per tier, the medians (ms) of where its first token's time went, from
    the step traces: from the send to the scheduler's scheduling the step
    that computes the prompt (``to_scheduler``: the RPC, admission, waking
    the step loop), scheduling and sending it, the executor's receipt to
    its answer (``executor``), and from there to the token at the client
    (``back``: the answer, its processing, the stream). Each round's tier
    gets that step's offloads and loads (``step_copies``)."""
    steps = step_trace_records(traces, "scheduler")
    answered = {int(r["step_id"]): r for r in step_trace_records(traces, "executor")}
    parts: dict[str, dict[str, list[float]]] = {}
    for row in rounds:
        for tier in TIERS:
            sent, first = row[tier].pop("at")
            step = next(
                (r for r in steps if sent <= r["scheduling"] <= first and r["tokens"] > 0), None
            )
            executor = answered.get(int(step["step_id"])) if step is not None else None
            if step is None or executor is None:
                continue
            # The blocks that step copied to the host and back (the executor's trace).
            row[tier]["step_copies"] = [int(executor.get(k, 0)) for k in ("offloads", "loads")]
            spans = parts.setdefault(tier, {})
            for name, start, end in (
                ("to_scheduler", sent, step["scheduling"]),
                ("schedule_and_send", step["scheduling"], step["sent"]),
                ("to_executor", step["sent"], executor["received"]),
                ("executor", executor["received"], executor["completed"]),
                ("back", executor["completed"], first),
            ):
                spans.setdefault(name, []).append((end - start) * 1e3)
    return {
        tier: {name: round(statistics.median(v), 2) for name, v in spans.items()}
        for tier, spans in parts.items()
    }


def _summary(rounds: list[dict[str, Any]], prompt_len: int) -> dict[str, Any]:
    full = (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last token is always computed
    medians = {t: statistics.median(r[t]["ttft_ms"] for r in rounds) for t in TIERS}
    return {
        "median_ttft_ms": {t: round(v, 2) for t, v in medians.items()},
        "host_over_recompute": round(medians["host_hit"] / medians["recompute"], 3),
        "host_over_gpu_hit": round(medians["host_hit"] / medians["gpu_hit"], 3),
        # Whether every counted round hit as claimed.
        "hits_as_claimed": all(
            r["recompute"]["cached"] == 0
            and r["gpu_hit"]["cached"] == full
            and r["host_hit"]["cached"] == full
            and r["host_hit"]["host_hit_tokens"] == full
            for r in rounds
        ),
    }


async def _run(target: str, args: argparse.Namespace, vocab_size: int) -> list[dict[str, Any]]:
    await wait_ready(target, timeout=600)
    rng = random.Random(args.seed)
    rounds = []
    for index in range(args.rounds + 1):
        prompt = _prompt(rng, args.prompt_len, vocab_size)
        fillers = [_prompt(rng, args.prompt_len, vocab_size) for _ in range(2)]
        rounds.append(await _round(target, index, prompt, fillers))
        print(json.dumps({t: rounds[-1][t]["ttft_ms"] for t in TIERS}), file=sys.stderr)
    return rounds[1:]  # the first warms up


def markdown(report: dict[str, Any]) -> str:
    s, settings = report["summary"], report["settings"]
    lines = [
        "# First token from each tier, end to end (`pagedkv.bench.scheduler.host_ttft`)",
        "",
        f"Model: {settings['model']}; a {settings['prompt_len']}-token prompt, one output "
        f"token, over `pagedkv serve`'s gRPC API; GPU pool {settings['num_blocks']} blocks, "
        f"host tier {settings['host_kv_gib']} GiB; CUDA graphs: "
        f"{settings.get('cuda_graphs', 'decode')} steps; offloads ahead of eviction while "
        f"idle: {_idle(settings.get('host_idle_offload_blocks', 0))}; {settings['rounds']} rounds "
        "after one warm-up round.",
        "",
        "| tier | TTFT median (ms) |",
        "|---|---|",
    ]
    lines += [f"| {t} | {s['median_ttft_ms'][t]:.2f} |" for t in TIERS]
    lines += [
        "",
        f"Host hit / recompute: **{s['host_over_recompute']:.3f}x**; host hit / GPU hit: "
        f"**{s['host_over_gpu_hit']:.3f}x**. Every round hit as claimed (usage and the "
        f"executor's host hits): {'yes' if s['hits_as_claimed'] else 'no'}.",
        "",
        "| round | recompute (ms) | GPU hit (ms) | host hit (ms) | blocks loaded | host hit's "
        "step: offloads, loads |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['round']} | {r['recompute']['ttft_ms']:.2f} | {r['gpu_hit']['ttft_ms']:.2f} | "
        f"{r['host_hit']['ttft_ms']:.2f} | {r['host_hit']['loaded_blocks']} | "
        f"{', '.join(map(str, r['host_hit'].get('step_copies', ())))} |"
        for r in report["rounds"]
    ]
    where = report.get("where_ms") or {}
    if where:
        names = list(next(iter(where.values())))
        lines += [
            "",
            "Where each first token's time went (medians, ms, from the step traces): the "
            "send to the scheduler's scheduling the step that computes the prompt (the RPC, "
            "admission, the step loop waking), scheduling and sending it, its transit, the "
            "executor's receipt to its answer, and back to the client (the answer, its "
            "processing, the stream).",
            "",
            "| tier | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        lines += [
            f"| {tier} | " + " | ".join(f"{where[tier].get(n, 0):.2f}" for n in names) + " |"
            for tier in TIERS
            if tier in where
        ]
    lines += ["", f"Settings: {json.dumps(settings)}", ""]
    lines.append(f"Machine: {json.dumps(report['machine'])}")
    return "\n".join(lines) + "\n"


def _idle(blocks: int) -> str:
    return f"{blocks} blocks deep" if blocks else "off"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", choices=("tiny", *LLAMA_SHAPES))
    parser.add_argument("--model", help="model directory (default: the preset)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--host-kv-gib", type=float, default=4.0)
    parser.add_argument(
        "--cuda-graphs",
        default="all",
        choices=("all", "decode"),
        help="the executor's steps replayed from CUDA graphs (pagedkv serve's --cuda-graphs)",
    )
    parser.add_argument(
        "--host-idle-offload-blocks",
        type=int,
        default=0,
        help="the scheduler's --host-idle-offload-blocks (default 0: offloads only at "
        "eviction, in the host hit's step)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="PATH.json (and PATH.md)")
    args = parser.parse_args(argv)
    args.load_format = "auto"
    # One prompt and its output token, and a few blocks to spare: two filler
    # prompts in turn then evict every cached block of the prompt (least
    # recently used first).
    num_blocks = -(-(args.prompt_len + 1) // BLOCK_SIZE) + 3
    with model_dir(args) as model:
        config = json.loads((Path(model) / "config.json").read_text())
        vocab_size = int(config["vocab_size"])
        options = ["--device", args.device, "--dtype", args.dtype]
        options += ["--load-format", args.load_format, "--num-blocks", str(num_blocks)]
        options += ["--host-kv-gib", str(args.host_kv_gib)]
        options += ["--max-model-len", str(args.prompt_len + 16)]
        options += ["--max-num-batched-tokens", str(max(8192, args.prompt_len))]
        options += ["--cuda-graphs", args.cuda_graphs]
        options += ["--host-idle-offload-blocks", str(args.host_idle_offload_blocks)]
        with tempfile.TemporaryDirectory(prefix="pagedkv-trace-") as traces:
            with step_trace.tracing(traces):
                stack = ServeStack(model, options)
            try:
                rounds = asyncio.run(_run(stack.target, args, vocab_size))
            finally:
                stack.stop()  # the processes write their traces as they exit
            where = _where(rounds, Path(traces))
    settings = {
        "model": args.model or f"preset {args.preset}",
        "device": args.device,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "num_blocks": num_blocks,
        "host_kv_gib": args.host_kv_gib,
        "cuda_graphs": args.cuda_graphs,
        "host_idle_offload_blocks": args.host_idle_offload_blocks,
        "rounds": args.rounds,
        "seed": args.seed,
    }
    summary = _summary(rounds, args.prompt_len)
    report = {
        "machine": machine(args.device),
        "settings": settings,
        "summary": summary,
        "where_ms": where,
        "rounds": rounds,
    }
    write_report(args.output, report, markdown(report))
    return 0 if summary["hits_as_claimed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
