"""SIGTERM on an executor drains it: health turns NOT_SERVING, its owner
admits nothing new there (a hint naming it is answered as draining and the
request runs elsewhere), the requests running on it finish there, and the
executor stops as soon as none is live, long before its drain timeout. Real
processes: two CPU executors under one scheduler."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.v1 import scheduler_pb2
from tests.executor.driver import ExecutorProcess
from tests.executor.test_generation import hf_greedy, model_dirs
from tests.service.stack import Process
from tests.service.test_hardening import PROMPT, tokens_of, wait_for
from tests.service.test_stack import assert_nothing_held, greedy_request

__all__ = ["model_dirs"]

LONG = 400  # tokens: the request still runs when SIGTERM comes
DRAIN_TIMEOUT = 300.0  # far longer than the requests take: stopping early shows


def test_a_terminated_executor_finishes_its_requests_then_stops(model_dirs) -> None:
    model: Path = model_dirs["llama"]
    long_expected = hf_greedy(model, PROMPT, LONG)
    short_expected = hf_greedy(model, PROMPT, 16)
    drain = ("--drain-timeout", str(DRAIN_TIMEOUT))
    executors = ("--executor", "{first}", "--executor", "{second}")
    with (
        ExecutorProcess(model, num_blocks=128, extra_args=drain) as first,
        ExecutorProcess(model, num_blocks=128) as second,
        Process(
            [
                *("scheduler", "--port", "0", "--model", str(model)),
                *(a.format(first=first.target, second=second.target) for a in executors),
            ]
        ) as scheduler,
    ):
        stub = scheduler.stub
        requests = [
            greedy_request(PROMPT, LONG, request_id=f"long-{i}", preferred_executor=first.target)
            for i in range(2)
        ]
        calls = [stub.Generate(request, timeout=300) for request in requests]
        heads = [next(call) for call in calls]
        assert all(h.placement.executor == first.target for h in heads)
        results: dict[int, list[scheduler_pb2.GenerateResponse]] = {}

        def finish(i: int) -> None:
            results[i] = [heads[i], *calls[i]]

        threads = [threading.Thread(target=finish, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        first.process.send_signal(signal.SIGTERM)

        health = health_pb2_grpc.HealthStub(first.channel)
        deadline = time.monotonic() + 60
        while True:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # Nothing new goes to the draining executor, even when asked for.
        wait_for(stub, lambda s: any(e.draining for e in s.executors))
        hinted = greedy_request(PROMPT, 16, preferred_executor=first.target)
        chunks = list(stub.Generate(hinted, timeout=120))
        tokens = tokens_of(chunks)
        assert chunks[0].placement.executor == second.target
        assert chunks[0].placement.hint == scheduler_pb2.PLACEMENT_HINT_DRAINING
        assert tokens == {0: short_expected}

        for thread in threads:
            thread.join(timeout=300)
        for i in range(2):
            assert tokens_of(results[i]) == {0: long_expected}
            assert results[i][-1].outputs[-1].finish_reason == scheduler_pb2.FINISH_REASON_LENGTH
        # Its rows are done: it stops now, not at its drain timeout.
        assert first.process.wait(timeout=DRAIN_TIMEOUT / 2) == 0
        assert "executor draining" in first.stderr()

        # The scheduler took the two requests' tokens from the stopping
        # executor (nothing moved or recomputed) and serves on with the other.
        stats = wait_for(
            stub,
            lambda s: (
                [e.healthy for e in sorted(s.executors, key=lambda e: e.address)]
                == [e == second.target for e in sorted((first.target, second.target))]
            ),
        )
        assert stats.num_preemptions == 0
        assert tokens_of(list(stub.Generate(greedy_request(PROMPT, 16), timeout=120))) == {
            0: short_expected
        }
        assert_nothing_held(stub)
