"""``pagedkv bench serve --gateway --gateway-probe N``: the latency the
gateway adds to one request, with nothing else in flight.

Under a burst (a fixed batch sent at once) the TTFT a client sees is mostly
queueing: every request waits for the prefills before its own, and the
gateway's share is hidden in the order requests reach the scheduler. The
probe measures the gateway's own cost instead: ``N`` requests of one shape,
one at a time, alternating gRPC and HTTP (so both ways meet the same server
state and drift), each on its own random prompt (no prefix-cache hit), over
one gRPC channel and one HTTP connection opened before the first (no
connection setup timed). The TTFT p50 it adds is the HTTP p50 less the gRPC
p50; the request latencies (to the stream's end) likewise.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import grpc

from pagedkv.bench.scheduler.serving import http_load, load
from pagedkv.bench.scheduler.serving.load import REQUEST_TIMEOUT_S, RequestResult
from pagedkv.bench.scheduler.serving.workload import BenchRequest, fixed_batch
from pagedkv.v1 import scheduler_pb2_grpc

# The probe's requests: a short prompt and a few tokens, so that each takes
# a few steps and the gateway's per-request and per-event work dominate
# what differs between the two ways.
PROBE_PROMPT_LEN = 128
PROBE_MAX_TOKENS = 16


async def _alternate(
    target: str, base_url: str, model: str, pairs: Sequence[tuple[BenchRequest, BenchRequest]]
) -> tuple[list[RequestResult], list[RequestResult]]:
    grpc_results: list[RequestResult] = []
    http_results: list[RequestResult] = []
    connector = aiohttp.TCPConnector(limit=1)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, connect=60.0)
    async with (
        grpc.aio.insecure_channel(target) as channel,
        aiohttp.ClientSession(base_url, connector=connector, timeout=timeout) as session,
    ):
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        await channel.channel_ready()
        async with session.get("/health") as health:  # opens the one connection
            await health.read()
        for over_grpc, over_http in pairs:
            start = time.perf_counter()
            grpc_results.append(await load._send(stub, over_grpc, 0.0, start, True))
            start = time.perf_counter()
            http_results.append(await http_load._send(session, model, over_http, 0.0, start))
    return grpc_results, http_results


def _ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return 1000 * values[0]
    return 1000 * statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def _way(results: list[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    latency = [r.latency_s for r in ok]
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "first_error": next((r.error for r in results if r.error), ""),
        "ttft_ms": {"p50": _ms(ttft, 50), "p90": _ms(ttft, 90)},
        "latency_ms": {"p50": _ms(latency, 50), "p90": _ms(latency, 90)},
    }


def _added(http: dict[str, float | None], grpc_: dict[str, float | None]) -> float | None:
    a, b = http["p50"], grpc_["p50"]
    return None if a is None or b is None else a - b


def run_probe(
    target: str, base_url: str, model: str, num_requests: int, vocab_size: int, seed: int
) -> dict[str, Any]:
    """``num_requests`` requests each way, alternating (the gRPC ones ask
    for text, as the gateway does): each way's TTFT and latency p50/p90 and
    what HTTP adds to the p50s."""
    shape = (num_requests, PROBE_PROMPT_LEN, PROBE_MAX_TOKENS, vocab_size)
    over_grpc = fixed_batch(*shape, seed=seed)
    over_http = fixed_batch(*shape, seed=seed + 1)
    grpc_results, http_results = asyncio.run(
        _alternate(target, base_url, model, list(zip(over_grpc, over_http, strict=True)))
    )
    grpc_way, http_way = _way(grpc_results), _way(http_results)
    return {
        "prompt_len": PROBE_PROMPT_LEN,
        "max_tokens": PROBE_MAX_TOKENS,
        "grpc": grpc_way,
        "http": http_way,
        "ttft_p50_added_ms": _added(http_way["ttft_ms"], grpc_way["ttft_ms"]),
        "latency_p50_added_ms": _added(http_way["latency_ms"], grpc_way["latency_ms"]),
    }


def markdown_lines(probe: dict[str, Any]) -> list[str]:
    """The probe's table."""
    g, h = probe["grpc"], probe["http"]

    def signed(value: float | None) -> str:
        return "-" if value is None else f"{value:+.2f}"

    return [
        "## One request at a time: what the gateway adds",
        "",
        f"{g['num_requests']} requests each way, one at a time, alternating gRPC (with the "
        "outputs' text) and HTTP (`POST /v1/completions`, streamed), each "
        f"{probe['prompt_len']} -> {probe['max_tokens']} tokens on a prompt of its own, over "
        "one gRPC channel and one HTTP connection opened first.",
        "",
        "| way | ok | TTFT p50 / p90 (ms) | latency p50 / p90 (ms) |",
        "|---|---|---|---|",
        f"| gRPC | {g['num_ok']}/{g['num_requests']} | {_pair(g, 'ttft_ms')} | "
        f"{_pair(g, 'latency_ms')} |",
        f"| HTTP | {h['num_ok']}/{h['num_requests']} | {_pair(h, 'ttft_ms')} | "
        f"{_pair(h, 'latency_ms')} |",
        "",
        f"TTFT p50 added by the gateway: {signed(probe['ttft_p50_added_ms'])} ms; "
        f"latency p50 added: {signed(probe['latency_p50_added_ms'])} ms.",
    ]


def _pair(way: dict[str, Any], key: str) -> str:
    a, b = way[key]["p50"], way[key]["p90"]
    return f"{'-' if a is None else f'{a:.2f}'} / {'-' if b is None else f'{b:.2f}'}"
