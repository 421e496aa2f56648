"""``pagedkv bench serve``: the runs, in order, and the report.

1. ``pagedkv serve`` (one executor; or ``--target``); warm-up requests.
2. For each rate: ``--num-requests`` requests of the mix at Poisson times
   (each rate gets its own slice of one mix, so no rate finds another's
   whole prompts cached; the system prompts are shared by all).
3. Each fixed batch, all requests at once.
4. The server stops; Hugging Face ``generate`` on each fixed batch, in a
   child process (``python -m pagedkv.bench.executor.bench_hf``: the scheduler side
   imports no torch) on the same device.
5. With ``--timeline-steps``: a fresh stack with a profiled executor runs the
   first fixed batch; its idle measures join the report.
With ``--step-trace`` the server's processes trace their steps
(``pagedkv.common.step_trace``) and the report says where the first fixed
batch's step time went (``step_trace.analyze``).
With ``--gateway`` a ``pagedkv gateway`` process is started in front of the
scheduler (gateway.py), and each rate and each fixed batch runs again
through it over HTTP right after its gRPC run, on requests of its own (a
fixed batch's from another seed, so none comes from the prefix cache); the
warm-up runs both ways first.
With ``--sweep`` none of the above runs: the fixed batches run under each
scheduler setting on one executor instead (sweep.py), with the same report
writer. Every request must finish with exactly its ``max_tokens`` tokens;
the report counts those that did not. Numbers come only from the run itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata as metadata
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedkv.bench.report_files import write_report
from pagedkv.bench.scheduler.machine import machine_info
from pagedkv.bench.scheduler.serving import report as reporting
from pagedkv.bench.scheduler.serving import step_trace, sweep
from pagedkv.bench.scheduler.serving.gateway import Gateway, timed_grpc, timed_http
from pagedkv.bench.scheduler.serving.load import run_load, server_stats, wait_ready
from pagedkv.bench.scheduler.serving.metrics import Slo, request_rows
from pagedkv.bench.scheduler.serving.probe import run_probe
from pagedkv.bench.scheduler.serving.runs import (
    FixedBatch,
    mix_config,
    parse_fixed_batches,
    run_fixed_batches,
    warm_up,
)
from pagedkv.bench.scheduler.serving.stack import (
    ServeStack,
    TimelineStack,
    model_dir,
    model_shape,
    server_args,
)
from pagedkv.bench.scheduler.serving.workload import (
    fixed_batch,
    parse_rates,
    poisson_arrivals,
    sharegpt_like,
)
from pagedkv.common.logging import get_logger
from pagedkv.common.step_contract import default_pipeline_depth

PACKAGES = ("pagedkv-scheduler", "pagedkv-executor", "pagedkv-common")
GATEWAY_PACKAGES = ("pagedkv-gateway", "fastapi", "starlette", "uvicorn", "pydantic", "aiohttp")
TIMELINE_WAIT_S = 60.0
log = get_logger(__name__)


def _serve_runs(
    args: argparse.Namespace,
    target: str,
    model: str,
    batches: list[FixedBatch],
    gateway: Gateway | None,
) -> dict[str, Any]:
    rates = parse_rates(args.rates)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    ways = 2 if gateway is not None else 1
    mix = mix_config(args, model, args.num_requests * len(rates) * ways)
    requests = sharegpt_like(mix)
    warm_up(args, target, mix, gateway)
    out: dict[str, Any] = {"rates": [], "fixed_batches": []}
    for i, rate in enumerate(rates):
        at = i * ways * args.num_requests
        part = requests[at : at + args.num_requests]
        arrivals = poisson_arrivals(len(part), rate, seed=args.seed + i)
        summary, results = timed_grpc(target, part, arrivals, slo, args.grpc_text)
        log.info("rate done", rate=rate, output_tokens_per_s=round(summary["output_tokens_per_s"]))
        label = reporting.rate_label(rate)
        row = {"rate": label, "summary": summary, "requests": request_rows(results)}
        if gateway is not None:  # the next slice of the mix, at the same times
            part = requests[at + args.num_requests : at + 2 * args.num_requests]
            summary, results = timed_http(gateway, part, arrivals, slo)
            log.info(
                "rate done over HTTP",
                rate=rate,
                output_tokens_per_s=round(summary["output_tokens_per_s"]),
            )
            row["http"] = {"summary": summary, "requests": request_rows(results)}
        out["rates"].append(row)
    if gateway is not None and args.gateway_probe:
        out["gateway_probe"] = run_probe(
            target,
            gateway.base_url,
            gateway.model,
            args.gateway_probe,
            mix.vocab_size,
            args.seed + 2000,
        )
        log.info("gateway probe done", ttft_p50_added_ms=out["gateway_probe"]["ttft_p50_added_ms"])
    out["fixed_batches"], out["fixed_batch_marks"] = run_fixed_batches(
        target, batches, mix.vocab_size, slo, args.seed + 1000, gateway, args.grpc_text
    )
    stats = asyncio.run(server_stats(target))
    out["server"] = {
        "num_preemptions": stats.num_preemptions,
        "integrity_ok": stats.integrity.ok,
        "prefix_cache_hits": sum(e.prefix_cache_hits for e in stats.executors),
        "prefix_cache_queries": sum(e.prefix_cache_queries for e in stats.executors),
    }
    if any(e.num_host_blocks for e in stats.executors):  # the host tier's totals
        out["server"]["host_tier"] = {
            name: sum(getattr(e, name) for e in stats.executors)
            for name in (
                "prefix_cache_host_hits",
                "num_offloaded_blocks",
                "num_loaded_blocks",
                "offloaded_bytes",
                "loaded_bytes",
                "offload_copy_seconds",
                "load_copy_seconds",
                "host_loads_chosen",
                "host_recomputes_chosen",
            )
        }
    return out


def hf_baseline(args: argparse.Namespace, model: str, batch: FixedBatch) -> dict[str, Any]:
    """Hugging Face ``generate`` on ``batch`` in a child process."""
    command = [sys.executable, "-m", "pagedkv.bench.executor.bench_hf", "--model", model]
    command += ["--device", args.device, "--dtype", args.dtype, "--load-format", args.load_format]
    command += ["--batch", str(batch.batch), "--prompt-len", str(batch.prompt_len)]
    command += ["--max-tokens", str(batch.max_tokens), "--repeat", str(args.hf_repeat)]
    command += ["--seed", str(args.seed)]
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def timeline(args: argparse.Namespace, model: str, batch: FixedBatch) -> dict[str, Any]:
    """The profiled stack on ``batch``; the executor's idle measures."""
    with tempfile.TemporaryDirectory(prefix="pagedkv-timeline-") as root:
        stack = TimelineStack(args, model, Path(root), args.timeline_skip, args.timeline_steps)
        try:
            vocab = int(model_shape(model)["vocab_size"])
            part = fixed_batch(batch.batch, batch.prompt_len, batch.max_tokens, vocab, args.seed)
            asyncio.run(wait_ready(stack.target))
            asyncio.run(run_load(stack.target, part, [0.0] * len(part)))
            found = Path(root) / "timeline.json"
            deadline = time.monotonic() + TIMELINE_WAIT_S
            while not found.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            if not found.exists():
                raise RuntimeError(
                    f"no timeline: the batch ran fewer than {args.timeline_skip} + "
                    f"2 x {args.timeline_steps} decode steps"
                )
            measures: dict[str, Any] = json.loads(found.read_text())
        finally:
            stack.stop()
    return {**measures, "batch": batch._asdict()}


def machine(device: str, gateway: bool = False) -> dict[str, Any]:
    """The machine (its GPU on ``cuda``) and the versions a report records:
    pagedkv's parts, torch and the rest, and with ``gateway`` its HTTP stack."""
    return {**machine_info(device), **_versions(gateway)}


def _versions(gateway: bool = False) -> dict[str, str]:
    versions = {}
    for name in PACKAGES + (GATEWAY_PACKAGES if gateway else ()):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def _settings(args: argparse.Namespace, model: str) -> dict[str, Any]:
    keys = [
        "device",
        "dtype",
        "load_format",
        "kernel_backend",
        "num_blocks",
        "kv_cache_dtype",
        "host_kv_gib",
        "host_offload",
        "host_idle_offload_blocks",
        "max_num_seqs",
        "max_num_batched_tokens",
        "decode_window",
        "pipeline_depth",
        "max_model_len",
        "enforce_eager",
        "cuda_graphs",
        "rates",
        "num_requests",
        "mean_prompt_len",
        "mean_output_len",
        "sigma",
        "system_prompt_fraction",
        "num_system_prompts",
        "system_prompt_len",
        "warmup_requests",
        "slo_ttft_ms",
        "slo_tpot_ms",
        "fixed_batch",
        "hf_repeat",
        "timeline_steps",
        "timeline_skip",
        "step_trace",
        "sweep",
        "gateway",
        "http_clients",
        "gateway_probe",
        "grpc_text",
        "seed",
        "target",
    ]
    if args.sweep:  # what a sweep does not use, or sets per setting
        unused = (
            "decode_window",
            "pipeline_depth",
            "rates",
            "num_requests",
            "hf_repeat",
            "gateway",
            "http_clients",
            "gateway_probe",
            "grpc_text",
        )
        keys = [k for k in keys if k not in unused and not k.startswith(("timeline", "step_"))]
    name = args.model if args.model is not None else f"preset {args.preset}"
    return {"model": name, **{k: getattr(args, k) for k in keys}}


def main(args: argparse.Namespace) -> int:
    if args.pipeline_depth is None:  # the scheduler's default for the window, recorded
        args.pipeline_depth = default_pipeline_depth(args.decode_window)
    batches = parse_fixed_batches(args.fixed_batch)
    parse_rates(args.rates)  # refuse bad rates before anything starts
    if args.sweep:
        sweep.parse_settings(args.sweep)
        if args.gateway:
            print(
                "pagedkv bench serve: --sweep runs over gRPC only, not with --gateway",
                file=sys.stderr,
            )
            return 2
    with model_dir(args) as model, tempfile.TemporaryDirectory(prefix="pagedkv-trace-") as traces:
        if args.sweep:
            swept = sweep.run_sweep(args, model, batches)
            return _write(args, model, {"rates": [], "fixed_batches": [], "sweep": swept})
        with step_trace.tracing(traces if args.step_trace and not args.target else None):
            stack = None if args.target else ServeStack(model, server_args(args))
        gateway = None
        try:
            target = args.target or stack.target  # type: ignore[union-attr]
            gateway = Gateway(target, model, args.http_clients) if args.gateway else None
            report: dict[str, Any] = _serve_runs(args, target, model, batches, gateway)
        finally:
            if gateway is not None:
                gateway.stop()
            if stack is not None:
                stack.stop()
        marks = report.pop("fixed_batch_marks")
        if args.step_trace and stack is not None:
            # The first fixed batch; without one, every step of the run
            # (the rate runs, their warm-up requests included).
            since, until = marks if batches else (0.0, math.inf)
            report["step_trace"] = {
                **step_trace.analyze(Path(traces), since, until),
                "batch": batches[0]._asdict() if batches else None,
            }
        if not args.no_hf:
            for run, batch in zip(report["fixed_batches"], batches, strict=True):
                run["hf"] = hf_baseline(args, model, batch)
        if args.timeline_steps and batches:
            report["timeline"] = timeline(args, model, batches[0])
        return _write(args, model, report)


def _write(args: argparse.Namespace, model: str, report: dict[str, Any]) -> int:
    """Prints the report's markdown and, with ``--output``, writes its JSON,
    markdown and plot; 0 when every request ended with its tokens."""
    shape = model_shape(model)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    described = ", ".join(f"{k} {shape[k]}" for k in (*keys, "vocab_size") if k in shape)
    report = {
        "machine": machine(args.device, args.gateway),
        "settings": _settings(args, model),
        "model_shape": described,
        **report,
    }
    path = write_report(args.output, report, reporting.markdown(report))
    if path is not None and "sweep" not in report:
        reporting.plot(report, path.with_suffix(".png"))
    return 0 if _all_ok(report) else 1


def _all_ok(report: dict[str, Any]) -> bool:
    runs = [r["summary"] for r in report["rates"]] + [b["pagedkv"] for b in report["fixed_batches"]]
    runs += [r["http"]["summary"] for r in report["rates"] if "http" in r]
    runs += [b["http"] for b in report["fixed_batches"] if "http" in b]
    if "gateway_probe" in report:
        runs += [report["gateway_probe"]["grpc"], report["gateway_probe"]["http"]]
    for run in report.get("sweep", {}).get("runs", []):
        runs += [b["pagedkv"] for b in run["fixed_batches"]]
    return all(s["num_ok"] == s["num_requests"] for s in runs)
