"""``pagedkv bench cluster-sim``: the runs, their results and the goals.

Each policy runs the same trace through the same cluster; the policies in
``--failure-policies`` run it once more with a scheduler failing at
``--fail-at``. Runs are independent, so they go to ``--jobs`` processes.
The exit status is 1 when a run ends with a request unfinished, a block
leaked, a pool or the index failing its integrity check, or the index not
following the pools.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from pagedkv.bench.cluster_sim.cluster import ClusterConfig, FailurePlan, RunResult, run_cluster
from pagedkv.bench.cluster_sim.cost_model import RECORDED, StepCostModel
from pagedkv.bench.cluster_sim.report import format_table, goals, write_markdown, write_plot
from pagedkv.bench.cluster_sim.trace import TraceConfig
from pagedkv.router.scoring import RoutingWeights, make_policy

QUICK_EXECUTORS, QUICK_SCHEDULERS, QUICK_DURATION_S = 8, 2, 10.0


@dataclass(frozen=True, slots=True)
class RunSpec:
    policy: str
    weights: RoutingWeights
    failure: FailurePlan | None


def run_spec(
    spec: RunSpec, config: ClusterConfig, trace: TraceConfig, cost: StepCostModel
) -> RunResult:
    """One run (a process pool's task: module-level, arguments picklable)."""
    return run_cluster(config, trace, make_policy(spec.policy, spec.weights), cost, spec.failure)


def configs(args: argparse.Namespace) -> tuple[ClusterConfig, TraceConfig]:
    executors, schedulers, duration = args.executors, args.schedulers, args.duration
    if args.quick:
        executors, schedulers, duration = QUICK_EXECUTORS, QUICK_SCHEDULERS, QUICK_DURATION_S
    config = ClusterConfig(
        num_executors=executors,
        num_schedulers=schedulers,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        flush_interval_s=args.flush_interval,
        index_lag_s=args.index_lag,
        report_interval_s=args.report_interval,
        lease_ttl_s=args.lease_ttl,
    )
    trace = TraceConfig(
        rate=args.rate_per_executor * executors,
        duration_s=duration,
        num_prefixes=args.num_prefixes,
        min_prefix_len=args.min_prefix_len,
        max_prefix_len=args.max_prefix_len,
        zipf_s=args.zipf,
        mean_suffix_len=args.mean_suffix_len,
        mean_output_len=args.mean_output_len,
        seed=args.seed,
    )
    return config, trace


def weights_of(args: argparse.Namespace) -> RoutingWeights:
    defaults = RoutingWeights()
    return replace(
        defaults,
        prefix=defaults.prefix if args.weight_prefix is None else args.weight_prefix,
        load=defaults.load if args.weight_load is None else args.weight_load,
        kv_usage=defaults.kv_usage if args.weight_kv is None else args.weight_kv,
        load_bound=defaults.load_bound if args.load_bound is None else args.load_bound,
        load_slack=defaults.load_slack if args.load_slack is None else args.load_slack,
    )


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "system": platform.platform(),
        "python": platform.python_version(),
    }
    for name in ("numpy", "xxhash", "pagedkv-scheduler", "pagedkv-router"):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            info[name] = None
    return info


def result_dict(spec: RunSpec, result: RunResult) -> dict[str, Any]:
    return {
        "policy": spec.policy,
        "failure": spec.failure is not None,
        "summary": asdict(result.summary),
        "failure_summary": None if result.failure is None else asdict(result.failure),
        "checks": {
            "integrity_errors": result.integrity_errors[:20],
            "leaked_blocks": result.leaked_blocks,
            "index_mismatches": result.index_mismatches,
            "unfinished": result.summary.num_requests - result.summary.num_finished,
        },
        "cpu_s": round(result.cpu_s, 2),
        "series": result.series,
    }


def main(args: argparse.Namespace) -> int:
    config, trace = configs(args)
    cost = StepCostModel.from_measurements(RECORDED)
    weights = weights_of(args)
    fail_at = trace.duration_s / 2 if args.fail_at is None else args.fail_at
    specs = [RunSpec(p, weights, None) for p in args.policies.split(",") if p]
    if not args.no_failure:
        specs += [
            RunSpec(p, weights, FailurePlan(fail_at)) for p in args.failure_policies.split(",") if p
        ]
    jobs = max(1, min(len(specs), args.jobs or os.cpu_count() or 1))
    if jobs == 1:
        results = [run_spec(spec, config, trace, cost) for spec in specs]
    else:
        with ProcessPoolExecutor(jobs) as pool:
            futures = [pool.submit(run_spec, spec, config, trace, cost) for spec in specs]
            results = [future.result() for future in futures]
    data: dict[str, Any] = {
        "benchmark": "cluster-sim",
        "machine": machine(),
        "cluster": asdict(config),
        "trace": asdict(trace),
        "weights": asdict(weights),
        "cost_model": asdict(cost),
        "measurements": asdict(RECORDED),
        "runs": [result_dict(spec, result) for spec, result in zip(specs, results, strict=True)],
    }
    data["goals"] = goals(data)
    print(format_table(data))
    if args.output:
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(_finite(data), indent=1, allow_nan=False) + "\n")
        write_markdown(data, output.with_suffix(".md"), output.with_suffix(".png").name)
        write_plot(data, output.with_suffix(".png"))
        print(f"results written to {output} (and .md, .png beside it)")
    clean = all(
        not any(run["checks"][k] for k in ("integrity_errors", "leaked_blocks", "unfinished"))
        and not run["checks"]["index_mismatches"]
        for run in data["runs"]
    )
    return 0 if clean else 1


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
