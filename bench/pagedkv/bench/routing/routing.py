"""``pagedkv bench routing``: the routing policies side by side on one local cluster shape.

For each policy, a fresh ``pagedkv serve --redis`` cluster (so every policy
starts with cold, equal caches) of CPU executors on a tiny random llama,
schedulers over them and one router with that policy; the same seeded trace
(shared prefixes, unique suffixes, mixed lengths: ``trace.py``) goes through
the router at a fixed concurrency. Reported per policy: prefill tokens
computed (prompt minus cached, summed over requests), the prefix hit rate,
client-side TTFT p50/p99, output tokens/s and requests/s, the spread over
executors (placements and the executors' prefix-cache counters) and the
router's decisions and hint outcomes; JSON, markdown and a PNG with
``--output``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata as metadata
import json
from pathlib import Path
from typing import Any

from pagedkv.bench.routing.load import RequestRecord, router_stats, run_trace
from pagedkv.bench.routing.local_cluster import ClusterShape, LocalCluster, router_metrics
from pagedkv.bench.routing.report import GOAL_RATIO, goal, plot, summarize, table
from pagedkv.bench.routing.trace import TraceConfig, TraceRequest, generate, prefix_weights
from pagedkv.bench.scheduler.machine import machine_info
from pagedkv.router.scoring import RoutingWeights
from pagedkv.scheduler.children import model_dir

PACKAGES = ("pagedkv-router", "pagedkv-scheduler", "pagedkv-executor", "pagedkv-client")

NOTES = """How to read it: every process (Redis, the executors, the schedulers, the
router and the load generator) shares the machine's few cores, so the
cluster is CPU-bound and the times are this machine's, not a GPU's. Each
policy gets a fresh cluster, so all start with cold caches and see the same
requests in the same order (a closed loop at a fixed concurrency; their
timing differs with the policy). The floor is what a single shared cache
would compute: every suffix, and each prefix used once.

Round-robin and least-loaded ignore the cache: every executor computes each
prefix the first time it gets a request for it, so their prefill cost over
the floor is about (executors - 1) x prefixes x prefix length, paid while
the caches warm up. The kv policy sends a prefix back to an executor that
holds it (or was just sent it: placements in flight count as cached), and
copies it elsewhere only when that executor would pass the load bound (1.5
times the mean queued, or the mean plus 4 at loads as small as these), so a
hot prefix ends up on a second executor only now and then ("executors per
prefix"). Once every executor has cached every prefix, all policies hit
equally; the gap is a warm-up cost, so it shrinks relative to the total as a
trace gets longer. Keeping a prefix's requests together also means some
executors run more of them than others ("requests per executor"); TTFT and
throughput here say little about that, as every executor shares the same
cores and the times move from run to run with what else the machine does.

KV size: with the default 1024 blocks every executor holds all the prefixes
at once (a prefix is prefix_len / 16 blocks) plus its running requests.
With fewer blocks than all the prefixes need (`--num-blocks 384`, say: 16
prefixes need 512), round-robin and least-loaded keep evicting and
recomputing prefixes for the whole run, while kv needs only its share of
the prefixes per executor: their cost grows and kv's barely moves, so the
gap widens. With fewer blocks than even kv's share, every policy would
recompute (and preempt), and the gap would close again.
"""


def trace_config(args: argparse.Namespace, vocab_size: int) -> TraceConfig:
    return TraceConfig(
        vocab_size=vocab_size,
        num_requests=args.num_requests,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        min_suffix_len=args.min_suffix_len,
        max_suffix_len=args.max_suffix_len,
        output_lens=tuple(int(n) for n in args.output_lens.split(",")),
        zipf=args.zipf,
        seed=args.seed,
    )


def run_policy(
    shape: ClusterShape, policy: str, requests: list[TraceRequest], concurrency: int
) -> tuple[dict[str, Any], list[RequestRecord]]:
    """One fresh cluster with ``policy``, the trace through its router, and
    the summary; the cluster is stopped before it returns."""
    cluster = LocalCluster(shape, policy)
    try:
        asyncio.run(cluster.wait_following(shape.num_executors))
        records, seconds = asyncio.run(run_trace(cluster.router, requests, concurrency))
        stats = asyncio.run(router_stats(cluster.router))
        counters = router_metrics(cluster.metrics_port)
    finally:
        cluster.stop()
    return summarize(records, seconds, stats, counters), records


def _floor(config: TraceConfig, requests: list[TraceRequest]) -> int:
    """Prefill tokens with one shared cache: each used prefix once, every suffix."""
    used = {r.prefix_index for r in requests}
    return len(used) * config.prefix_len + sum(r.suffix_len for r in requests)


def _versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def main(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    with model_dir(args.model) as model:
        vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        config = trace_config(args, vocab_size)
        requests = generate(config)
        shape = ClusterShape(
            model=model,
            num_executors=args.executors,
            num_schedulers=args.schedulers,
            num_blocks=args.num_blocks,
            max_num_seqs=args.max_num_seqs,
            router_weights=args.weights,
        )
        results: dict[str, dict[str, Any]] = {}
        records: dict[str, list[RequestRecord]] = {}
        for policy in policies:
            results[policy], records[policy] = run_policy(shape, policy, requests, args.concurrency)
            print(
                f"{policy}: {results[policy]['prefill_tokens']:,} prefill tokens, "
                f"{results[policy]['num_finished']}/{len(requests)} finished",
                flush=True,
            )
    report = {
        "machine": {**machine_info("cpu"), **_versions()},
        "parameters": {
            "policies": policies,
            "cluster": {
                "executors": shape.num_executors,
                "schedulers": shape.num_schedulers,
                "routers": 1,
                "num_blocks": shape.num_blocks,
                "max_num_seqs": shape.max_num_seqs,
                "max_num_batched_tokens": shape.max_num_batched_tokens,
                "router_weights": shape.router_weights or _default_weights(),
                "model": "tiny random llama" if args.model is None else args.model,
            },
            "trace": {
                **{k: getattr(config, k) for k in config.__dataclass_fields__},
                "prefix_weights": [round(w, 4) for w in prefix_weights(config)],
            },
            "concurrency": args.concurrency,
        },
        "prompt_tokens": sum(len(r.token_ids) for r in requests),
        "floor_prefill_tokens": _floor(config, requests),
        "goal": goal(results, _floor(config, requests)),
        "results": results,
    }
    text = markdown(report)
    print(text)
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        plot(results, records, out.with_suffix(".png"))
        text = text.replace("<PLOT>", out.with_suffix(".png").name)
        out.with_suffix(".md").write_text(text)
    finished = all(r["num_finished"] == r["num_requests"] for r in results.values())
    return 0 if finished else 1


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown; ``<PLOT>`` stands for the PNG's file name."""
    params = report["parameters"]
    cluster, trace = params["cluster"], params["trace"]
    popularity = "uniform" if trace["zipf"] == 0 else f"Zipf {trace['zipf']:g}"
    lines = [
        "# Routing policies on a local CPU cluster (`pagedkv bench routing`)",
        "",
        f"Cluster per policy: 1 router, {cluster['schedulers']} schedulers, "
        f"{cluster['executors']} CPU executors ({cluster['model']}, {cluster['num_blocks']} "
        f"KV blocks of 16 tokens each, max {cluster['max_num_seqs']} sequences), a private "
        "Redis; started fresh for each policy; kv weights (prefix, load, KV usage): "
        f"{cluster['router_weights']}.",
        f"Trace: {trace['num_requests']} requests, {params['concurrency']} at a time (closed "
        f"loop); {trace['num_prefixes']} shared prefixes of {trace['prefix_len']} tokens, "
        f"{popularity} popularity; a unique suffix of {trace['min_suffix_len']}-"
        f"{trace['max_suffix_len']} tokens (log-uniform); max_tokens one of "
        f"{', '.join(str(n) for n in trace['output_lens'])} (greedy, EOS ignored); seed "
        f"{trace['seed']}.",
        f"Prompt tokens: {report['prompt_tokens']:,}; floor (each prefix computed once, every "
        f"suffix): {report['floor_prefill_tokens']:,} prefill tokens.",
        "",
        table(report["results"]),
        "",
    ]
    outcome = report["goal"]
    if outcome is not None:
        verdict = "met" if outcome["met"] else "not met"
        lines.append(
            f"Goal: kv computes at most {GOAL_RATIO:g} x round-robin's prefill tokens. "
            f"kv / round-robin = {outcome['ratio']:.2f}: **{verdict}**. (The floor is "
            f"{outcome['floor_ratio']:.2f} x round-robin: no placement can do better.)"
        )
        lines.append("")
    lines += [
        "Requests and distinct prefixes per executor are in executor address order; "
        "router decisions are the router's counters, placement hints what the first "
        "chunks said.",
        "",
        "![prefill tokens, TTFT, hit rate](<PLOT>)",
        "",
        NOTES,
        "Machine: " + json.dumps(report["machine"]),
        "",
    ]
    return "\n".join(lines)


def _default_weights() -> str:
    w = RoutingWeights()
    return (
        f"defaults ({w.prefix:g},{w.load:g},{w.kv_usage:g}), load bound {w.load_bound:g} x mean, "
        f"slack {w.load_slack:g}"
    )
