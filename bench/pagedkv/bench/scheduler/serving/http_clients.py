"""HTTP load sent from several client processes at once (``--http-clients``).

One asyncio process reads every stream's events; at tens of thousands of
tokens a second its CPU can come near a core and its own delays would
count as the gateway's. ``run_load_http_processes`` deals the requests out
round-robin to N spawned processes (each its own ``run_load_http``, its own
connections), starts them together once all are ready (the same
``perf_counter`` start: the system's monotonic clock), and puts their
results back in the requests' order, with the CPU seconds the client
used: each process's from the start to its last end (its start-up,
imports included, is not the client's load).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import time
from collections.abc import Sequence
from multiprocessing.queues import Queue
from typing import Any

from pagedkv.bench.scheduler.serving.http_load import run_load_http
from pagedkv.bench.scheduler.serving.load import REQUEST_TIMEOUT_S, RequestResult
from pagedkv.bench.scheduler.serving.workload import BenchRequest

START_DELAY_S = 0.05
"""From the last process ready to the shared start."""
READY_TIMEOUT_S = 120.0


def _client(
    index: int,
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    arrivals: list[float],
    ready: Queue[int],
    go: Queue[float],
    done: Queue[tuple[int, list[RequestResult], float]],
) -> None:
    """A client process: says it is ready, waits for the start, sends its
    requests, hands back their results and the CPU seconds they took."""
    ready.put(index)
    start = go.get()
    cpu = time.process_time()
    results, _ = asyncio.run(run_load_http(base_url, model, requests, arrivals, start))
    done.put((index, results, time.process_time() - cpu))


def run_load_http_processes(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    num_processes: int,
) -> tuple[list[RequestResult], float, float]:
    """``run_load_http`` from ``num_processes`` processes: every request's
    result, in order, the seconds from the shared start to the last end,
    and the client's CPU seconds. RuntimeError when a process ends without
    its results."""
    if num_processes <= 1:
        cpu = time.process_time()
        results, seconds = asyncio.run(run_load_http(base_url, model, requests, arrivals))
        return results, seconds, time.process_time() - cpu
    context = multiprocessing.get_context("spawn")
    ready: Queue[int] = context.Queue()
    go: Queue[float] = context.Queue()
    done: Queue[tuple[int, list[RequestResult], float]] = context.Queue()
    deals = [list(range(i, len(requests), num_processes)) for i in range(num_processes)]
    deals = [deal for deal in deals if deal]
    processes = []
    for i, deal in enumerate(deals):
        args: tuple[Any, ...] = (i, base_url, model, [requests[j] for j in deal])
        args += ([arrivals[j] for j in deal], ready, go, done)
        processes.append(context.Process(target=_client, args=args, daemon=True))
    for process in processes:
        process.start()
    found: dict[int, list[RequestResult]] = {}
    cpu_s = 0.0
    try:
        for _ in processes:
            ready.get(timeout=READY_TIMEOUT_S)
        start = time.perf_counter() + START_DELAY_S
        for _ in processes:
            go.put(start)
        deadline = start + REQUEST_TIMEOUT_S
        while len(found) < len(processes):
            try:
                index, results, cpu = done.get(timeout=1.0)
                found[index] = results
                cpu_s += cpu
            except queue.Empty:
                if time.perf_counter() > deadline or any(
                    p.exitcode is not None and i not in found for i, p in enumerate(processes)
                ):
                    raise RuntimeError("an HTTP client process ended without its results") from None
    finally:
        for process in processes:
            process.join(timeout=10.0)
            if process.is_alive():
                process.kill()
                process.join()
    ordered: list[RequestResult | None] = [None] * len(requests)
    for i, deal in enumerate(deals):
        for j, result in zip(deal, found[i], strict=True):
            ordered[j] = result
    results = [r for r in ordered if r is not None]
    assert len(results) == len(requests)
    return results, max((r.end_s for r in results), default=0.0), cpu_s
