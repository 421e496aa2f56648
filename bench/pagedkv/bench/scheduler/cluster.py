"""``pagedkv bench cluster``: the Redis control plane on the CPU stack.

Starts a private ``redis-server``, three executors that register there and
measures two things:

1. **A failover timeline.** Two ``pagedkv scheduler --redis-url`` processes
   share the executors; an SDK client given both targets keeps a closed loop
   of requests going (prompts drawn from a few shared prefixes, so prefix-cache
   hits show). Mid-run one scheduler gets SIGKILL. Every request's end,
   prompt and cached prompt tokens are logged, and the schedulers' stats are
   polled for ownership: requests/s, prefix hit rate and executors per
   scheduler over time (a PNG), and the time from the kill to the survivor
   holding every executor.
2. **The scheduler's cost of Redis.** The same workload through an in-process
   scheduler over the same executors, with static ``--executor`` addresses
   and then as the only member of the cluster (leases, heartbeats, prefix
   mirror), alternated: CPU per step (building the step, applying the
   samples) and Redis commands per step (Redis's own count, everything
   included: member rounds, lease renewals, mirror flushes, executor
   heartbeats).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from pagedkv.bench.scheduler.machine import machine_info
from pagedkv.bench.scheduler.service import drain, step_summary
from pagedkv.cluster.connection import connect_sync
from pagedkv.scheduler.child_commands import executor_commands
from pagedkv.scheduler.children import ExecutorProcesses, PrivateRedis, model_dir
from pagedkv.scheduler.config import ClusterConfig, SchedulerConfig
from pagedkv.scheduler.service import SchedulerService
from pagedkv.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

NOTES = """How to read it: every process (the schedulers, the executors, Redis and
the load generator) shares the machine's cores, so the load is CPU-bound
throughout. Right after the kill the survivor runs alone on one executor
with the cores to itself and completes the short requests faster; resumed
streams finish early too (they had tokens already). Once it has adopted the
dead scheduler's executors, the three executors compete for the cores again.
The prefix hit rate holds across the kill because the adopted executors keep
their cached blocks (their block tags) and the survivor's own cache stays.
The CPU per step compares the same workload through the same executors with
and without the cluster member (median of the runs, alternated); the
difference is within the run-to-run noise. Redis commands are Redis's own
count over each run, everything included.
"""

PREFIX_LEN = 64
SUFFIX_LEN = 8
NUM_PREFIXES = 8


def _commands(redis: PrivateRedis) -> int:
    """Commands Redis has processed since it started (its own count)."""
    client = connect_sync(redis.url)
    try:
        return int(client.info("stats")["total_commands_processed"])
    finally:
        client.close()


def _start_scheduler(url: str, lease_ttl: float) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "pagedkv.common.cli", "--log-level", "warning"]
    command += ["scheduler", "--redis-url", url, "--port", "0", "--lease-ttl", str(lease_ttl)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if " ready on " in line:
            return process, line.split(" ready on ")[1].split()[0]
    raise RuntimeError("scheduler did not start")


def _prompt(rng: random.Random, prefixes: list[list[int]], vocab: int) -> list[int]:
    return rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(SUFFIX_LEN)]


async def _timeline(args: argparse.Namespace, url: str, vocab: int) -> dict[str, Any]:
    from pagedkv.client import AsyncClient

    procs = [_start_scheduler(url, args.lease_ttl) for _ in range(2)]
    targets = [address for _, address in procs]
    stubs = [scheduler_pb2_grpc.SchedulerStub(grpc.aio.insecure_channel(t)) for t in targets]

    async def owned(i: int) -> int:
        try:
            stats = await stubs[i].GetStats(scheduler_pb2.GetStatsRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return -1
        return sum(1 for e in stats.executors if e.healthy)

    while [await owned(0), await owned(1)].count(0) or await owned(0) + await owned(1) != 3:
        await asyncio.sleep(0.1)
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(vocab) for _ in range(PREFIX_LEN)] for _ in range(NUM_PREFIXES)]
    done: list[dict[str, Any]] = []
    errors: list[str] = []
    start = time.monotonic()
    stop_at = start + args.duration
    kill_at = start + args.kill_at
    client = AsyncClient(targets)

    async def worker(w: int) -> None:
        wrng = random.Random(args.seed * 1000 + w)
        while time.monotonic() < stop_at:
            prompt = _prompt(wrng, prefixes, vocab)
            usage = None
            try:
                async for chunk in client.generate(
                    token_ids=prompt, max_tokens=args.max_tokens, temperature=0, ignore_eos=True
                ):
                    usage = chunk.usage or usage
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            assert usage is not None
            done.append(
                {
                    "t": time.monotonic() - start,
                    "prompt_tokens": usage.prompt_tokens,
                    "cached_prompt_tokens": usage.cached_prompt_tokens,
                }
            )

    ownership: list[dict[str, float]] = []
    victim = 0  # the one holding more executors at the kill
    killed_at: float | None = None
    adopted_after: float | None = None

    async def watch() -> None:
        nonlocal victim, killed_at, adopted_after
        while time.monotonic() < stop_at:
            now = time.monotonic()
            if killed_at is None and now >= kill_at:
                counts = [await owned(0), await owned(1)]
                victim = 0 if counts[0] >= counts[1] else 1
                procs[victim][0].send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
            if killed_at is None:
                counts = [await owned(0), await owned(1)]
            else:
                counts = [0, 0]
                counts[1 - victim] = await owned(1 - victim)
            ownership.append({"t": time.monotonic() - start, "s0": counts[0], "s1": counts[1]})
            if killed_at is not None and adopted_after is None and counts[1 - victim] == 3:
                adopted_after = time.monotonic() - killed_at
            await asyncio.sleep(0.05 if killed_at is not None and adopted_after is None else 0.2)

    await asyncio.gather(watch(), *(worker(w) for w in range(args.concurrency)))
    resumes = client.num_resumes
    await client.close()
    for process, _ in procs:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process, _ in procs:
        process.wait()
    assert killed_at is not None
    return {
        "kill_at_s": killed_at - start,
        "adoption_s": adopted_after,
        "lease_ttl_s": args.lease_ttl,
        "requests": done,
        "ownership": ownership,
        "errors": errors,
        "sdk_resumes": resumes,
        "victim": victim,
    }


async def _cost(
    args: argparse.Namespace,
    addresses: list[str],
    cluster: ClusterConfig | None,
    redis: PrivateRedis,
) -> dict[str, Any]:
    config = SchedulerConfig(
        executors=() if cluster else tuple(addresses),
        max_num_seqs=args.requests,
        max_num_batched_tokens=4096,
        pipeline_depth=1,
        cluster=cluster,
    )
    service = SchedulerService(config)
    await service.start()
    while len(service.executors.schedulers) < len(addresses):
        await asyncio.sleep(0.05)
    vocab = service.executors.info.vocab_size
    rng = np.random.default_rng(args.seed)
    requests = [
        scheduler_pb2.GenerateRequest(
            request_id=f"cost-{i}",
            token_ids=scheduler_pb2.TokenIds(ids=rng.integers(0, vocab, 32).tolist()),
            sampling=common_pb2.SamplingParams(
                temperature=0.0, max_tokens=args.cost_tokens, ignore_eos=True
            ),
        )
        for i in range(args.requests)
    ]
    commands = _commands(redis)
    start, cpu = time.perf_counter(), time.process_time()
    generations = [service.submit(request) for request in requests]
    await asyncio.gather(*(drain(g) for g in generations))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    commands = _commands(redis) - commands - 1  # the INFO call itself
    timings = list(service.loops.step_timings)
    await service.stop()
    steps = [t for t in timings if t.num_entries > 0]
    summary = step_summary(steps, args.requests // len(addresses))
    summary["redis_commands"] = commands
    summary["redis_commands_per_step"] = commands / max(1, len(timings))
    summary["seconds"] = seconds
    # Everything the scheduler process spent (its gRPC threads, the member
    # rounds and the mirror flushes included), per step of any executor.
    summary["process_cpu_us_per_step"] = cpu * 1e6 / max(1, len(timings))
    return summary


def _plot(timeline: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    requests = timeline["requests"]
    end = max((r["t"] for r in requests), default=1.0)
    bins = np.arange(0.0, end + 1.0, 1.0)
    t = np.array([r["t"] for r in requests])
    per_s, _ = np.histogram(t, bins)
    prompt, _ = np.histogram(t, bins, weights=[r["prompt_tokens"] for r in requests])
    cached, _ = np.histogram(t, bins, weights=[r["cached_prompt_tokens"] for r in requests])
    hit = np.divide(cached, prompt, out=np.zeros(len(cached)), where=prompt > 0)
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    axes[0].step(bins[:-1], per_s, where="post")
    axes[0].set_ylabel("requests/s")
    axes[1].step(bins[:-1], hit, where="post", color="tab:green")
    axes[1].set_ylabel("prefix hit rate")
    axes[1].set_ylim(0, 1)
    own = timeline["ownership"]
    for key, label in (("s0", "scheduler 0"), ("s1", "scheduler 1")):
        axes[2].step(
            [o["t"] for o in own], [max(0, o[key]) for o in own], where="post", label=label
        )
    axes[2].set_ylabel("executors held")
    axes[2].set_xlabel("seconds")
    axes[2].legend()
    for ax in axes:
        ax.axvline(timeline["kill_at_s"], color="red", linestyle="--")
    axes[0].set_title(
        f"scheduler {timeline['victim']} SIGKILLed at the dashed line; lease TTL "
        f"{timeline['lease_ttl_s']:g} s; adopted after {_adoption(timeline)}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(args: argparse.Namespace) -> int:
    args.device, args.executors, args.max_num_seqs = "cpu", 3, args.requests
    args.max_num_batched_tokens = 4096
    args.kernel_backend, args.dtype, args.load_format = None, "auto", "auto"
    args.enforce_eager = False
    args.log_format = getattr(args, "log_format", "console")
    args.log_level = getattr(args, "log_level", "warning")
    with model_dir(args.model) as model:
        args.model = model
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("pagedkv bench cluster: redis-server is not on the PATH")
        redis = PrivateRedis(binary)
        commands = [[*c, "--redis-url", redis.url] for c in executor_commands(args, model)]
        executors = ExecutorProcesses(commands)
        try:
            vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
            timeline = asyncio.run(_timeline(args, redis.url, vocab))
            time.sleep(2 * args.lease_ttl)  # the survivor's leases released, or expired
            cluster = ClusterConfig(redis_url=redis.url, lease_ttl=args.lease_ttl)
            runs: dict[str, list[dict[str, Any]]] = {"static": [], "redis": []}
            for _ in range(args.repeat):
                runs["static"].append(asyncio.run(_cost(args, executors.addresses, None, redis)))
                runs["redis"].append(asyncio.run(_cost(args, executors.addresses, cluster, redis)))
                time.sleep(2 * args.lease_ttl)
        finally:
            executors.stop()
            redis.stop()
    report = _report(args, timeline, runs)
    print(report["summary"])
    if args.output:
        out = Path(args.output)
        out.write_text(json.dumps(report, indent=2) + "\n")
        _plot(timeline, out.with_suffix(".png"))
        out.with_suffix(".md").write_text(
            "# The cluster control plane on the CPU stack (`pagedkv bench cluster`)\n\n```\n"
            + report["summary"]
            + f"\n```\n\n![failover timeline]({out.with_suffix('.png').name})\n\n"
            + NOTES
            + "\nMachine: "
            + json.dumps(report["machine"])
            + "\n"
        )
    return 0


def _report(
    args: argparse.Namespace, timeline: dict[str, Any], runs: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    requests = timeline["requests"]
    kill = timeline["kill_at_s"]

    def hit_rate(rows: list[dict[str, Any]]) -> float:
        prompt = sum(r["prompt_tokens"] for r in rows)
        return sum(r["cached_prompt_tokens"] for r in rows) / prompt if prompt else 0.0

    before = [r for r in requests if r["t"] < kill]
    after = [r for r in requests if r["t"] >= kill + (timeline["adoption_s"] or 0) + 1]
    median = statistics.median
    static_cpu = median(r["scheduler_cpu_us"] for r in runs["static"])
    redis_cpu = median(r["scheduler_cpu_us"] for r in runs["redis"])
    static_all = median(r["process_cpu_us_per_step"] for r in runs["static"])
    redis_all = median(r["process_cpu_us_per_step"] for r in runs["redis"])
    lines = [
        f"failover: 2 schedulers, 3 CPU executors, {args.concurrency} concurrent SDK streams "
        f"({NUM_PREFIXES} shared {PREFIX_LEN}-token prefixes + {SUFFIX_LEN} random tokens, "
        f"{args.max_tokens} new tokens), lease TTL {args.lease_ttl:g} s",
        f"  kill at {kill:.1f} s; survivor holds every executor {_adoption(timeline)} after the "
        f"kill",
        f"  requests: {len(before)} before ({len(before) / kill:.1f}/s), "
        f"{len(requests) - len(before)} after; failed {len(timeline['errors'])}; "
        f"SDK resumes {timeline['sdk_resumes']}",
        f"  prefix hit rate: {hit_rate(before):.3f} before, {hit_rate(after):.3f} from 1 s after "
        f"adoption",
        f"redis cost: {args.requests} requests x (32 -> {args.cost_tokens}) over 3 executors, "
        f"one step in flight, median of {args.repeat} runs each",
        f"  scheduler CPU per step: {static_cpu:.0f} us without Redis, {redis_cpu:.0f} us as a "
        f"cluster member ({100 * (redis_cpu / static_cpu - 1):+.1f}%)",
        f"  scheduler process CPU per step (all its threads and tasks): {static_all:.0f} us "
        f"without Redis, {redis_all:.0f} us as a cluster member "
        f"({100 * (redis_all / static_all - 1):+.1f}%)",
        f"  Redis commands (all clients, the executors' heartbeats included): "
        f"{median(r['redis_commands_per_step'] for r in runs['redis']):.2f} per step, "
        f"{median(r['redis_commands'] / r['seconds'] for r in runs['redis']):.0f}/s as a member; "
        f"{median(r['redis_commands_per_step'] for r in runs['static']):.2f} per step, "
        f"{median(r['redis_commands'] / r['seconds'] for r in runs['static']):.0f}/s without",
    ]
    return {
        "machine": machine_info("cpu"),
        "settings": {
            k: getattr(args, k)
            for k in (
                "concurrency",
                "duration",
                "kill_at",
                "lease_ttl",
                "max_tokens",
                "requests",
                "cost_tokens",
                "repeat",
                "seed",
            )
        },
        "summary": "\n".join(lines),
        "timeline": {
            **{k: v for k, v in timeline.items() if k not in ("requests", "ownership")},
            "per_second": _per_second(requests),
            "ownership": [[round(o["t"], 2), o["s0"], o["s1"]] for o in timeline["ownership"]],
        },
        "cost": runs,
    }


def _adoption(timeline: dict[str, Any]) -> str:
    seconds = timeline["adoption_s"]
    return "(not within the run)" if seconds is None else f"{seconds:.2f} s"


def _per_second(requests: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Completed requests, prompt and cached prompt tokens per second of the run."""
    bins: dict[int, dict[str, float]] = {}
    for r in requests:
        row = bins.setdefault(int(r["t"]), {"requests": 0, "prompt": 0, "cached": 0})
        row["requests"] += 1
        row["prompt"] += r["prompt_tokens"]
        row["cached"] += r["cached_prompt_tokens"]
    return [{"second": k, **v} for k, v in sorted(bins.items())]
