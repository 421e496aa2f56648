"""Where the executor bench's decode step spends its time: each kernel's GPU
time under the torch profiler (recorded in the bench's results), and, with
``--profile``, a printed profile of one step and of the host's launch.
Steps come from the ``decode_request`` given (``pagedkv.bench.executor.bench``'s)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DecodeRequest = Callable[[Any, int], Any]
"""Builds a decode StepRequest of every live row (``bench.decode_request``)."""


def kernel_times(
    executor: Any, step_id: int, decode_request: DecodeRequest, steps: int = 10
) -> tuple[dict[str, Any], int]:
    """Each kernel's (and copy's) GPU time per decode step at CONTEXT, the
    most first, over ``steps`` steps under the torch profiler (GPU activity
    only: the kernels' own durations); a failure is recorded, not raised."""
    from torch.profiler import ProfilerActivity, profile

    from pagedkv.executor.gpu_idle import gpu_time_by_name
    from pagedkv.executor.step_plan import plan_message

    runner = executor.runner
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                plan = plan_message(decode_request(executor, step_id), runner.rows, runner.limits)
                step_id += 1
                runner.rows.apply(plan)
                runner.run(plan)
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as folder:
            trace = Path(folder) / "trace.json"
            prof.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text())["traceEvents"]
        kernels = [k._asdict() for k in gpu_time_by_name(events, steps, top=20)]
        return {"steps": steps, "kernels": kernels}, step_id
    except Exception as exc:  # the measure fails, never the bench
        return {"steps": steps, "error": f"{type(exc).__name__}: {exc}"}, step_id


def profile_decode(executor: Any, step_id: int, decode_request: DecodeRequest) -> int:
    """Prints where one decode step waits for the device and where its time
    goes (torch profiler), for reading; nothing is recorded."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    request = decode_request(executor, step_id)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        executor.step(request)
        torch.cuda.set_sync_debug_mode(0)
    print(f"synchronizing calls in one step: {len(caught)}")
    for warning in caught[:5]:
        print("  ", warning.message, warning.filename, warning.lineno)
    request = decode_request(executor, step_id + 1)
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False
    ) as prof:
        executor.step(request)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return _profile_launch(executor, step_id + 2, decode_request)


def _profile_launch(
    executor: Any, step_id: int, decode_request: DecodeRequest, iters: int = 50
) -> int:
    """Prints where ``Executor.launch`` spends its host time (cProfile over
    ``iters`` decode steps, each completed before the next)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for i in range(iters):
        request = decode_request(executor, step_id + i)
        profiler.enable()
        launched = executor.launch(request)
        profiler.disable()
        executor.complete(launched)
    stats = pstats.Stats(profiler)
    print(f"Executor.launch, {iters} decode steps (cProfile; times are totals):")
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)
    return step_id + iters
