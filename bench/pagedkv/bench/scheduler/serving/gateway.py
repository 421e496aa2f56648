"""``pagedkv bench serve --gateway``: the same runs through the HTTP gateway.

``Gateway`` is ``pagedkv gateway`` as a child process in front of the
benchmark's scheduler (one process, on a free port of 127.0.0.1), and the
CPU time it used (``/proc/<pid>/stat``: user + system, every thread).
``timed_http`` runs one load through it (from ``Gateway.num_clients``
processes) and adds to the run's summary the gateway's and the client's CPU
seconds; ``timed_grpc`` adds the client's to a gRPC run's. ``comparison``
puts a fixed batch's two runs side by side as the issue's numbers: HTTP
output tokens/s over gRPC's, the TTFT p50 and p99 the gateway adds, and its
CPU per 1,000 streamed tokens.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.bench.scheduler.serving.http_clients import run_load_http_processes
from pagedkv.bench.scheduler.serving.http_load import served_model
from pagedkv.bench.scheduler.serving.load import RequestResult, run_load
from pagedkv.bench.scheduler.serving.metrics import Slo, summarize
from pagedkv.bench.scheduler.serving.workload import BenchRequest
from pagedkv.scheduler.children import ChildProcesses

GATEWAY_READY = re.compile(r"gateway ready on ([\w.\-]+:\d+)")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads
    (fields 14 and 15 of ``/proc/<pid>/stat``, after the command's
    parenthesis, which may hold spaces)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Gateway:
    """``pagedkv gateway --target TARGET --model MODEL`` on 127.0.0.1, ready
    and serving once constructed: ``base_url``, ``model`` (the name
    ``/v1/models`` gives, which requests name), ``pid``; ``num_clients``:
    the processes the benchmark's HTTP load is sent from. ``stop`` ends it."""

    def __init__(self, target: str, model: str, num_clients: int = 1) -> None:
        self.num_clients = num_clients
        command = [sys.executable, "-m", "pagedkv.common.cli", "--log-level", "warning"]
        command += ["gateway", "--target", target, "--model", model]
        command += ["--host", "127.0.0.1", "--port", str(_free_port())]
        self.children = ChildProcesses([command], "gateway", GATEWAY_READY, ["gateway"])
        try:
            address = self.children.wait_ready()[0]
            self.base_url = f"http://{address}"
            self.model = asyncio.run(served_model(self.base_url))
        except BaseException:
            self.children.stop()
            raise
        self.pid = self.children.processes[0].pid

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def stop(self) -> None:
        self.children.stop()


Load = Callable[[], tuple[list[RequestResult], float, float]]


def _timed(
    load: Load, slo: Slo, gateway: Gateway | None, num_clients: int = 1
) -> tuple[dict[str, Any], list[Any]]:
    """``load``'s summary with the client's CPU seconds (``load`` says them;
    ``client_cpu_per_s`` is per client process) and, through ``gateway``,
    the gateway's; and its results."""
    gateway_before = gateway.cpu_seconds() if gateway is not None else 0.0
    results, seconds, client = load()
    summary = summarize(results, seconds, slo)
    tokens = max(summary["output_tokens"], 1)
    summary["client_processes"] = num_clients
    summary["client_cpu_s"] = client
    summary["client_cpu_per_s"] = client / seconds / num_clients
    if gateway is not None:
        used = gateway.cpu_seconds() - gateway_before
        summary["gateway_cpu_s"] = used
        summary["gateway_cpu_per_s"] = used / seconds
        summary["gateway_cpu_s_per_1000_tokens"] = 1000 * used / tokens
    return summary, results


def timed_grpc(
    target: str,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    slo: Slo,
    text: bool = False,
) -> tuple[dict[str, Any], list[Any]]:
    """A gRPC run's summary (with the client's CPU) and its results; with
    ``text`` the scheduler makes the outputs' text, as for the gateway."""

    def load() -> tuple[list[RequestResult], float, float]:
        cpu = time.process_time()
        results, seconds = asyncio.run(run_load(target, requests, arrivals, text))
        return results, seconds, time.process_time() - cpu

    return _timed(load, slo, None)


def timed_http(
    gateway: Gateway, requests: Sequence[BenchRequest], arrivals: Sequence[float], slo: Slo
) -> tuple[dict[str, Any], list[Any]]:
    """An HTTP run's summary (with the client's and the gateway's CPU) and
    its results."""
    return _timed(
        lambda: run_load_http_processes(
            gateway.base_url, gateway.model, requests, arrivals, gateway.num_clients
        ),
        slo,
        gateway,
        gateway.num_clients,
    )


def _delta(http: dict[str, float | None], grpc: dict[str, float | None], q: str) -> float | None:
    a, b = http[q], grpc[q]
    return None if a is None or b is None else a - b


def comparison(grpc: dict[str, Any], http: dict[str, Any]) -> dict[str, Any]:
    """A fixed batch through the gateway against over gRPC: tokens/s ratio,
    the TTFT and ITL it adds (ms), its CPU per 1,000 streamed tokens."""
    return {
        "output_tokens_per_s_ratio": http["output_tokens_per_s"] / grpc["output_tokens_per_s"]
        if grpc["output_tokens_per_s"]
        else None,
        "ttft_p50_delta_ms": _delta(http["ttft_ms"], grpc["ttft_ms"], "p50"),
        "ttft_p99_delta_ms": _delta(http["ttft_ms"], grpc["ttft_ms"], "p99"),
        "itl_p50_delta_ms": _delta(http["itl_ms"], grpc["itl_ms"], "p50"),
        "gateway_cpu_s_per_1000_tokens": http["gateway_cpu_s_per_1000_tokens"],
    }


def markdown_lines(batches: Sequence[dict[str, Any]], grpc_text: bool) -> list[str]:
    """The fixed batches that ran both ways: a row each (``grpc_text``:
    whether the gRPC runs asked for text)."""
    rows = [b for b in batches if "http" in b]
    if not rows:
        return []
    asked = "with the outputs' text" if grpc_text else "token ids only, no text"
    lines = [
        "## Through the gateway (HTTP) against gRPC, same stack",
        "",
        f"Each fixed batch over gRPC ({asked}), then on prompts of its own through one "
        "`pagedkv gateway` process (`POST /v1/completions`, streamed). Tokens per event: output "
        "tokens over the chunks (gRPC) or events (HTTP) that carried them. CPU: the "
        "gateway's and the benchmark client's CPU seconds per second of the run, the "
        "client's per process (near 1.0 it would be the bottleneck: `--http-clients`).",
        "",
        "| requests x (prompt -> output) | output tok/s gRPC / HTTP | HTTP / gRPC | "
        "TTFT p50 gRPC / HTTP (ms) | TTFT p50 added (ms) | TTFT p99 added (ms) | "
        "ITL p50 gRPC / HTTP (ms) | tokens per event gRPC / HTTP | gateway CPU s per "
        "1,000 tokens | CPU per s: gateway, client gRPC / HTTP (per process) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in rows:
        g, h, c = b["pagedkv"], b["http"], b["gateway"]
        ratio = c["output_tokens_per_s_ratio"]
        lines.append(
            f"| {b['batch']} x ({b['prompt_len']} -> {b['max_tokens']}) | "
            f"{g['output_tokens_per_s']:.0f} / {h['output_tokens_per_s']:.0f} | "
            f"{'-' if ratio is None else f'{100 * ratio:.1f}%'} | "
            f"{_ms(g['ttft_ms']['p50'])} / {_ms(h['ttft_ms']['p50'])} | "
            f"{_ms(c['ttft_p50_delta_ms'], signed=True)} | "
            f"{_ms(c['ttft_p99_delta_ms'], signed=True)} | "
            f"{_ms(g['itl_ms']['p50'], 2)} / {_ms(h['itl_ms']['p50'], 2)} | "
            f"{_per_chunk(g)} / {_per_chunk(h)} | "
            f"{c['gateway_cpu_s_per_1000_tokens']:.3f} | "
            f"{h['gateway_cpu_per_s']:.2f}, {g['client_cpu_per_s']:.2f} / "
            f"{h['client_cpu_per_s']:.2f} |"
        )
    return lines


def _ms(value: float | None, digits: int = 1, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _per_chunk(summary: dict[str, Any]) -> str:
    chunks = summary["num_chunks"]
    return f"{summary['output_tokens'] / chunks:.1f}" if chunks else "-"
