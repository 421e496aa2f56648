"""The former copy of the scheduling loop, kept to compare (``bench blocks --compare-old``).

Before ``bench blocks`` drove the service's ``ExecutorScheduler``, it timed
this hand-written loop over the block core: decodes first (through
``KVCacheManager.allocate_decode_slots``), preempting the newest running
request on a miss (the service preempts the least important, newest one in
(priority, arrival, index) order), then prefill chunks, then admission with
a prefix-cache lookup, then the update after the (absent) forward. It
encodes no step message and applies no response. It is kept only so that
one report can set its figures beside the real policy's; nothing else runs
it, and it is not to be extended.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import deque

from pagedkv.bench.scheduler.trace import TraceConfig, build_trace
from pagedkv.bench.scheduler.trace_result import StepRecords, TraceResult, trace_result
from pagedkv.common.kv_cache_spec import KVCacheSpec
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.request import Request, RequestStatus


def legacy_run_trace(args: argparse.Namespace) -> TraceResult:
    """The trace through the former loop (see the module docstring), every
    request to completion."""
    config = TraceConfig(num_requests=args.num_requests, seed=args.seed)
    trace = build_trace(config)
    spec = KVCacheSpec(args.block_size, 16, 8, 128, "bfloat16")
    kv = KVCacheManager(
        [spec], args.num_blocks, enable_caching=not args.no_prefix_caching, model_id="bench"
    )

    t0 = time.perf_counter()
    requests = [
        kv.make_request(t.request_id, t.prompt_token_ids, max_tokens=t.num_output_tokens)
        for t in trace
    ]
    creation_s = time.perf_counter() - t0
    vocab_size = config.vocab_size

    max_running = args.max_running
    max_batched = args.max_num_batched_tokens
    allocate_slots = kv.allocate_slots
    allocate_decode_slots = kv.allocate_decode_slots
    get_computed_blocks = kv.get_computed_blocks
    free = kv.free
    pool = kv.pool
    num_usable = args.num_blocks - 1
    waiting: deque[Request] = deque(requests)
    decoding: list[Request] = []  # running, prompt done: one token per step; oldest first
    prefilling: list[Request] = []  # running, prompt partly computed (chunked prefill)
    records = StepRecords.empty()
    step_ns, num_running_per_step, usage_per_step = (
        records.step_ns,
        records.num_running,
        records.usage,
    )
    num_preemptions = 0
    num_finished = 0
    num_output_tokens = 0

    def preempt_newest() -> None:
        nonlocal num_preemptions
        victim = prefilling.pop() if prefilling else decoding.pop()
        free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        waiting.appendleft(victim)
        num_preemptions += 1

    def sample(request: Request) -> int:
        # Any id will do: the outputs are never shared.
        return request.num_tokens * 40503 % vocab_size

    gc.collect()
    gc.freeze()  # the trace's objects live all run long; keep them out of GC passes
    perf_counter_ns = time.perf_counter_ns
    while waiting or decoding or prefilling:
        start = perf_counter_ns()
        num_preempted = num_preemptions
        # 1. Running requests first: one token for each decoding request, in
        # order; on a miss the newest running request is preempted and the
        # slots go on from the request that missed ...
        num_allocated = 0
        while True:
            num_allocated += allocate_decode_slots(decoding, num_allocated).num_allocated
            if num_allocated == len(decoding):
                break
            preempt_newest()
        num_decoding = len(decoding)
        budget = max_batched - num_decoding
        # ... then the next chunk of each partly computed prompt.
        chunks: list[tuple[Request, int]] = []
        for request in prefilling:
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0 or allocate_slots(request, num_new) is None:
                break
            chunks.append((request, num_new))
            budget -= num_new
        # 2. Admission, with a prefix-cache lookup, unless this step preempted.
        num_running = num_decoding + len(prefilling)
        while (
            num_preempted == num_preemptions
            and waiting
            and budget > 0
            and num_running < max_running
        ):
            request = waiting[0]
            computed = get_computed_blocks(request)
            num_new = min(request.num_tokens - computed.num_tokens, budget)
            if allocate_slots(request, num_new, computed) is None:
                if not num_running:
                    raise RuntimeError(
                        f"{request.seq_id} needs more blocks than the pool has; raise --num-blocks"
                    )
                break
            waiting.popleft()
            request.status = RequestStatus.RUNNING
            prefilling.append(request)
            chunks.append((request, num_new))
            budget -= num_new
            num_running += 1
        # 3. After the forward: sampled tokens, finished requests, finished prompts.
        if num_decoding:
            num_done = 0
            for request in decoding:
                num_computed = request.num_computed_tokens + 1  # also its tokens, as sampled
                request.num_computed_tokens = num_computed
                request.append_output_token_ids(num_computed * 40503 % vocab_size)
                if num_computed + 1 - request.num_prompt_tokens == request.max_tokens:
                    request.status = RequestStatus.FINISHED_LENGTH
                    free(request)
                    num_done += 1
            if num_done:
                decoding[:] = [r for r in decoding if not r.status.is_finished]
            num_output_tokens += num_decoding
            num_finished += num_done
        for request, num_new in chunks:
            num_computed = request.num_computed_tokens + num_new
            request.num_computed_tokens = num_computed
            if num_computed == request.num_tokens:  # the prompt is done: first sample
                prefilling.remove(request)
                request.append_output_token_ids(sample(request))
                num_output_tokens += 1
                if request.num_output_tokens == request.max_tokens:
                    request.status = RequestStatus.FINISHED_LENGTH
                    free(request)
                    num_finished += 1
                else:
                    decoding.append(request)
        step_ns.append(perf_counter_ns() - start)
        num_running_per_step.append(num_running)
        usage_per_step.append(1.0 - pool.free_block_queue.num_free_blocks / num_usable)
    gc.unfreeze()

    return trace_result(
        records,
        kv,
        num_preemptions=num_preemptions,
        num_finished=num_finished,
        num_output_tokens=num_output_tokens,
        creation_s=creation_s,
        num_requests=len(requests),
    )
