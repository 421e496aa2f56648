"""The live scheduler's CPU cost per decode step, without an executor.

Drives the service's own step code, ``ExecutorScheduler.schedule()`` then
``process()`` and the generations' ``flush()`` (what ``SchedulerService``'s
step loop runs per step), with a synthetic ``StepResponse`` built from each
step message (one token sampled per entry that asks for one; a round of
samples per step of a decode window; ``executor_sim``), two steps in flight
as in the service.
Reports microseconds of scheduler CPU per running request per decode step
(the median step once every request decodes, divided by its decode steps;
the best step too, the one least disturbed by a loaded machine).

    python -m pagedkv.bench.scheduler.steps --requests 64 256 [--decode-window 8]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

from pagedkv.bench.scheduler.executor_sim import (
    BLOCK_SIZE,
    VOCAB_SIZE,
    answers,
    executor_info,
    generation,
    simulated_scheduler,
)
from pagedkv.common.text import TextTokenizer
from pagedkv.scheduler.executor_scheduler import ScheduledStep
from pagedkv.v1 import executor_pb2


def measure(
    num_requests: int,
    *,
    prompt_len: int,
    num_steps: int,
    tokenizer: TextTokenizer | None,
    decode_window: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """Scheduler CPU per running request per decode step, ``num_requests``
    running, ``num_steps`` step messages (windows of up to ``decode_window``)."""
    rng = random.Random(seed)
    max_tokens = num_steps * decode_window + 16
    blocks_each = -(-(prompt_len + max_tokens + 2) // BLOCK_SIZE) + 1
    scheduler = simulated_scheduler(
        executor_info(num_requests * blocks_each + 1, max(num_requests, 16)),
        decode_window=decode_window,
    )
    generations = []
    for key in range(num_requests):
        prompt = [rng.randrange(3, VOCAB_SIZE) for _ in range(prompt_len)]
        gen = generation(scheduler, key + 1, prompt, max_tokens, tokenizer)
        generations.append(gen)
        scheduler.add(gen.sequences[0])
    inflight: deque[tuple[ScheduledStep, executor_pb2.StepResponse]] = deque()
    clock = time.perf_counter
    step_s: list[float] = []
    gc.collect()
    for i in range(num_steps):
        t0 = clock()
        step = scheduler.schedule()
        t1 = clock()
        if step is None:
            raise RuntimeError("nothing scheduled: the requests finished early")
        inflight.extend(answers(step, i))
        busy = t1 - t0
        while len(inflight) >= 2:
            sent, answer = inflight.popleft()
            t2 = clock()
            touched, errors = scheduler.process(sent, answer)
            if errors:
                raise errors[0][1]
            for gen in touched:
                gen.flush()
            busy += clock() - t2
        for gen in generations:  # the Generate streams read their chunks (not timed)
            while not gen.chunks.empty():
                gen.chunks.get_nowait()
        decoding = all(num == 1 for num in step.num_scheduled)
        if decoding and len(step.num_scheduled) == num_requests:
            step_s.append(busy / max(1, step.request.num_decode_steps))
    if not step_s:
        raise RuntimeError("no step had every request decoding")
    report = scheduler.kv.check_integrity()
    assert report.ok, report.errors
    median = statistics.median(step_s)
    return {
        "num_requests": num_requests,
        "num_steps_measured": len(step_s),
        "us_per_step_median": median * 1e6,
        "us_per_request_per_step": median / num_requests * 1e6,
        "best_us_per_request_per_step": min(step_s) / num_requests * 1e6,
        "text": tokenizer is not None,
        "decode_window": decode_window,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tokenizer", type=Path, help="a model dir with tokenizer.json")
    parser.add_argument("--decode-window", type=int, default=1, help="as the scheduler's")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    tokenizer = TextTokenizer.from_model_dir(args.tokenizer) if args.tokenizer else None
    if not args.json:
        print(
            f"machine: {platform.platform()}, python {platform.python_version()}, "
            f"{os.cpu_count()} CPUs"
        )
    for num_requests in args.requests:
        result = measure(
            num_requests,
            prompt_len=args.prompt_len,
            num_steps=args.steps,
            tokenizer=tokenizer,
            decode_window=args.decode_window,
        )
        text = "on" if result["text"] else "off"
        if args.json:
            print(json.dumps(result))
        else:
            print(
                f"{num_requests} running: {result['us_per_request_per_step']:.2f} us per request "
                f"per decode step, median ({result['us_per_step_median']:.0f} us per decode "
                f"step; best {result['best_us_per_request_per_step']:.2f} us per request; "
                f"text {text}; decode window {args.decode_window})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
