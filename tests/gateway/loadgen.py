"""guidellm, one of the field's load generators, against a pagedkv gateway:
the scenario it runs, and what its JSON report says.

The CI test (``test_load_generator.py``, a tiny model on the CPU) and the
GPU recipe (``tests/gpu/run-loadgen.sh``, which runs this module's ``main``)
drive guidellm the same way: a scenario file of one benchmark per
``Load`` (a concurrent profile: ``streams`` requests in flight until
``num_requests`` are done), synthetic prompts of exactly ``prompt_tokens``
tokens by the model's own tokenizer, ``output_tokens`` new tokens each, and
a JSON report. Nothing is downloaded (``HF_HUB_OFFLINE=1``: the tokenizer
is the model directory's).

What guidellm 0.8 sends: ``GET /v1/models`` and ``GET /health`` (which must
answer 2xx) before the run, then per request ``POST /v1/completions`` with
``model``, ``prompt`` (text), ``max_tokens``, ``ignore_eos: true``,
``stream: true`` and ``stream_options: {include_usage: true,
continuous_usage_stats: true}``; it reads the streamed ``choices[0].text``,
the ``usage`` of the last chunk that has one, and ``data: [DONE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import httpx

GUIDELLM_TIMEOUT_S = 1800.0  # a hung run fails instead of stalling CI


class Load(NamedTuple):
    """One benchmark: ``streams`` requests in flight until ``num_requests``
    are done, each ``prompt_tokens`` -> ``output_tokens``."""

    streams: int
    num_requests: int
    prompt_tokens: int
    output_tokens: int


class Benchmark(NamedTuple):
    """What guidellm's report says of one benchmark: request counts by
    outcome, every successful request's prompt and output tokens (the
    server's usage), the errored ones' errors, the benchmark's span (s) and
    latency percentiles."""

    streams: int
    num_successful: int
    num_errored: int
    num_incomplete: int
    prompt_tokens: list[int]
    output_tokens: list[int]
    errors: list[str]
    duration_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    tpot_ms: dict[str, float]

    @property
    def output_tokens_per_s(self) -> float:
        return sum(self.output_tokens) / self.duration_s


def served_model(url: str, timeout: float = 120.0) -> str:
    """Waits until the gateway at ``url`` answers ``GET /health`` with 200
    (as guidellm requires before it starts), then returns the first model
    id of ``GET /v1/models``: the name the requests give."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=10) as client:
        while True:
            try:
                if client.get("/health").status_code == 200:
                    models = client.get("/v1/models").raise_for_status().json()
                    return str(models["data"][0]["id"])
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway at {url} did not serve within {timeout:.0f} s")
            time.sleep(0.2)


def scenario(
    url: str,
    model: str,
    tokenizer: Path,
    loads: Sequence[Load],
    report: Path,
    max_seconds: float | None = None,
) -> dict[str, Any]:
    """guidellm's scenario file: one sub-benchmark per load (they share the
    data, so the prompt and output lengths must agree), the JSON report to
    ``report``; ``max_seconds`` ends each benchmark early (the requests
    still running count as incomplete). Only benchmark-wide statistics and per-request timings and
    token counts are kept, not the prompts and outputs (``sample_size: 0``)."""
    assert loads and len({(load.prompt_tokens, load.output_tokens) for load in loads}) == 1
    first = loads[0]
    constraints: list[dict[str, Any]] = [{"kind": "max_requests", "count": first.num_requests}]
    if max_seconds is not None:
        constraints.append({"kind": "max_duration", "seconds": max_seconds})
    return {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": url,
                "model": model,
                "request_format": "/v1/completions",
            },
            "profile": {"kind": "concurrent", "streams": first.streams},
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": first.prompt_tokens,
                    "output_tokens": first.output_tokens,
                }
            ],
            "tokenizer": {"kind": "hf_auto", "model": str(tokenizer)},
            "constraints": constraints,
            "metrics": {"kind": "generative", "sample_size": 0},
            "outputs": [{"kind": "json", "path": str(report)}],
        },
        "benchmarks": [
            {"profile.streams": load.streams, "constraints[0].count": load.num_requests}
            for load in loads
        ],
    }


def run_guidellm(
    url: str,
    model: str,
    tokenizer: Path,
    loads: Sequence[Load],
    report: Path,
    *,
    worker_processes: int | None = None,
    max_seconds: float | None = None,
    capture: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Runs ``guidellm run`` on the scenario of ``loads`` (written beside
    ``report``) in this interpreter's environment, offline; its console
    output (progress lines and the result tables) is returned, not raised
    on: the caller checks ``returncode``; with ``capture`` false it goes to
    this process's instead, as it comes. ``worker_processes`` caps
    guidellm's client processes (default: guidellm's, 10)."""
    path = report.with_suffix(".scenario.json")
    spec = scenario(url, model, tokenizer, loads, report, max_seconds)
    path.write_text(json.dumps(spec, indent=2))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if worker_processes is not None:
        env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(worker_processes)
    command = [sys.executable, "-m", "guidellm", "run", "--scenario", str(path)]
    return subprocess.run(
        [*command, "--disable-console-interactive"],
        cwd=report.parent,
        env=env,
        capture_output=capture,
        text=True,
        timeout=GUIDELLM_TIMEOUT_S,
        check=False,
    )


def _percentiles(metric: dict[str, Any]) -> dict[str, float]:
    successful = metric["successful"]
    if not successful or not successful.get("percentiles"):
        return {}
    percentiles = successful["percentiles"]
    return {"p50": percentiles["p50"], "p90": percentiles["p90"], "p99": percentiles["p99"]}


def read_report(report: dict[str, Any]) -> list[Benchmark]:
    """The benchmarks of guidellm's JSON report (``json.load`` of the file),
    in the order they ran."""
    benchmarks = []
    for benchmark in report["benchmarks"]:
        totals = benchmark["metrics"]["request_totals"]
        successful = benchmark["requests"]["successful"]
        metrics = benchmark["metrics"]
        benchmarks.append(
            Benchmark(
                streams=int(benchmark["config"]["strategy"]["streams"]),
                num_successful=int(totals["successful"]),
                num_errored=int(totals["errored"]),
                num_incomplete=int(totals["incomplete"]),
                prompt_tokens=[int(r["input_metrics"]["text_tokens"]) for r in successful],
                output_tokens=[int(r["output_metrics"]["text_tokens"]) for r in successful],
                errors=[str(r["info"]["error"]) for r in benchmark["requests"]["errored"]],
                duration_s=float(benchmark["duration"]),
                ttft_ms=_percentiles(metrics["time_to_first_token_ms"]),
                itl_ms=_percentiles(metrics["inter_token_latency_ms"]),
                tpot_ms=_percentiles(metrics["time_per_output_token_ms"]),
            )
        )
    return benchmarks


def bench_serve_options(argv: Sequence[str]) -> argparse.Namespace:
    """``pagedkv bench serve``'s options read from ``argv`` (``--preset``,
    ``--device``, ``--dtype``, ``--decode-window``, ...): the server this
    module starts runs with the serving benchmark's settings and defaults."""
    from pagedkv.bench.scheduler.serving.cli import register

    parser = argparse.ArgumentParser(prog="python -m tests.gateway.loadgen")
    register(parser.add_subparsers(), "serve")
    return parser.parse_args(["serve", *argv])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def run_against_serve(
    bench: argparse.Namespace, loads: Sequence[Load], report: Path, max_seconds: float
) -> int:
    """Starts ``pagedkv serve MODEL --http-port PORT`` with ``bench``'s
    model (a preset's directory: ``config.json``, and a ``tokenizer.json`` of
    the whole vocabulary with the ``tokenizer_config.json`` that guidellm's
    ``AutoTokenizer`` needs) and server settings, runs
    guidellm's ``loads`` against it into ``report`` and stops it; guidellm's
    exit status. Its console output goes to this process's as it comes."""
    from pagedkv.bench.scheduler.serving import stack

    with stack.model_dir(bench) as model:
        port = _free_port()
        server = stack.ServeStack(model, [*stack.server_args(bench), "--http-port", str(port)])
        try:
            url = f"http://127.0.0.1:{port}"
            name = served_model(url)
            run = run_guidellm(
                url, name, Path(model), loads, report, max_seconds=max_seconds, capture=False
            )
        finally:
            server.stop()
    return run.returncode


def _guidellm() -> str:
    import importlib.metadata as metadata

    return metadata.version("guidellm")


def _fixed_batch_rates(results: Path, name: str) -> dict[int, float]:
    """Output tok/s of the committed ``pagedkv bench serve`` fixed batches
    (gRPC) of device ``name``, by batch size: what guidellm's numbers stand
    beside."""
    rates: dict[int, float] = {}
    for file in (f"serve-bench-{name}.json", f"serve-bench-256-{name}.json"):
        path = results / file
        if path.exists():
            for batch in json.loads(path.read_text()).get("fixed_batches", []):
                rates[int(batch["batch"])] = float(batch["pagedkv"]["output_tokens_per_s"])
    return rates


def _p50_p99(percentiles: dict[str, float]) -> str:
    if not percentiles:
        return "-"
    return f"{percentiles['p50']:.1f} / {percentiles['p99']:.1f}"


def markdown(
    benchmarks: Sequence[Benchmark],
    loads: Sequence[Load],
    settings: str,
    grpc_rates: dict[int, float],
) -> str:
    """The report's summary table, one row per benchmark."""
    lines = [
        "# guidellm against `pagedkv serve --http-port`",
        "",
        f"Server: {settings}. guidellm's concurrent profile over `/v1/completions`, streamed;",
        "synthetic prompts of the model's tokenizer; output tok/s is the benchmark's output",
        "tokens over its span. `bench serve` is `pagedkv bench serve`'s fixed batch of `streams`",
        "requests (gRPC, all sent at once; the committed results), where there is one.",
        "",
        "| streams | requests x (prompt -> output) | ok / errored / incomplete | output tok/s "
        "| bench serve output tok/s | TTFT p50/p99 (ms) | ITL p50/p99 (ms) | TPOT p50/p99 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for benchmark, load in zip(benchmarks, loads, strict=True):
        grpc = grpc_rates.get(load.streams)
        cells = [
            str(benchmark.streams),
            f"{load.num_requests} x ({load.prompt_tokens} -> {load.output_tokens})",
            f"{benchmark.num_successful} / {benchmark.num_errored} / {benchmark.num_incomplete}",
            f"{benchmark.output_tokens_per_s:.0f}",
            "-" if grpc is None else f"{grpc:.0f}",
            *(_p50_p99(m) for m in (benchmark.ttft_ms, benchmark.itl_ms, benchmark.tpot_ms)),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    errors = sorted({error for benchmark in benchmarks for error in benchmark.errors})
    if errors:
        lines += ["", "Errors (distinct):", "", *(f"- {error[:300]}" for error in errors[:5])]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """This module's options and, from the rest, ``pagedkv bench serve``'s."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.gateway.loadgen",
        allow_abbrev=False,  # --device is bench serve's, not an abbreviation of --device-name
        description="guidellm against `pagedkv serve --http-port` on a serving-benchmark "
        "preset; the options it does not know are `pagedkv bench serve`'s (--preset, "
        "--device, --dtype, --decode-window, --pipeline-depth, ...)",
    )
    parser.add_argument("--streams", default="64,256", help="concurrent streams per benchmark")
    parser.add_argument("--waves", type=int, default=2, help="requests per stream")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument(
        "--output",
        type=Path,
        required=True,
        help="guidellm's JSON report, without its per-request records (a .md summary beside)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=90.0,
        help="a benchmark ends after this long (its unfinished requests count as incomplete)",
    )
    parser.add_argument("--device-name", default="h200", help="of the bench serve results")
    args, rest = parser.parse_known_args(argv)
    return args, bench_serve_options(rest)


def main(argv: Sequence[str] | None = None) -> int:
    args, bench = parse_args(argv)
    loads = [
        Load(streams, streams * args.waves, args.prompt_tokens, args.output_tokens)
        for streams in (int(s) for s in args.streams.split(","))
    ]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pagedkv-loadgen-") as tmp:
        raw = Path(tmp) / "guidellm.json"
        status = run_against_serve(bench, loads, raw, args.max_seconds)
        if status != 0:
            return status
        report = json.loads(raw.read_text())
    from pagedkv.bench.scheduler.serving.run import machine

    benchmarks = read_report(report)
    for benchmark in report["benchmarks"]:
        del benchmark["requests"]
    report["pagedkv_machine"] = {**machine(bench.device, gateway=True), "guidellm": _guidellm()}
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    settings = (
        f"preset {bench.preset}, device {bench.device}, dtype {bench.dtype}, "
        f"--decode-window {bench.decode_window} --pipeline-depth {bench.pipeline_depth}, "
        "one executor"
    )
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    summary = markdown(benchmarks, loads, settings, _fixed_batch_rates(results, args.device_name))
    summary += f"\nMachine: {json.dumps(report['pagedkv_machine'])}\n"
    args.output.with_suffix(".md").write_text(summary)
    print(summary)
    ok = all(b.num_errored == 0 and b.num_incomplete == 0 for b in benchmarks)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
