"""The executor bench's decode steps over gRPC on 127.0.0.1 (``Step`` one
at a time, ``StepStream`` with two in flight); steps come from the
``decode_request`` given (``pagedkv.bench.executor.bench``'s)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from pagedkv.bench.executor.bench_profile import DecodeRequest


def time_grpc(
    executor: Any, step_id: int, decode_request: DecodeRequest, iters: int = 30
) -> dict[str, Any]:
    """Decode steps through a gRPC ``Step`` on 127.0.0.1, one at a time:
    the median wall time of a call."""
    import grpc

    from pagedkv.executor.servicer import build_server
    from pagedkv.v1 import executor_pb2_grpc

    server, port = build_server(executor, "127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = executor_pb2_grpc.ExecutorStub(channel)
    walls = []
    for _ in range(iters):
        request = decode_request(executor, step_id)
        step_id += 1
        start = time.perf_counter()
        stub.Step(request)
        walls.append((time.perf_counter() - start) * 1e6)
    channel.close()
    server.stop(0).wait()
    return {"grpc_step_wall_us": statistics.median(walls)}


def time_stream(
    executor: Any, step_id: int, decode_request: DecodeRequest, context: int, iters: int = 30
) -> tuple[dict[str, Any], int]:
    """Decode steps through a gRPC StepStream on 127.0.0.1 with two steps in
    flight, as a scheduler sends them: the next request goes out when a
    response comes back. The contexts grow from ``context`` (the one the
    rows were prefilled to) by one a step."""
    import queue

    import grpc

    from pagedkv.executor.servicer import build_server
    from pagedkv.v1 import executor_pb2_grpc

    server, port = build_server(executor, "127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = executor_pb2_grpc.ExecutorStub(channel)
    requests = []
    first = decode_request(executor, step_id)  # rewinds the rows to CONTEXT
    for i in range(iters):
        request = type(first)()
        request.CopyFrom(first)
        request.step_id = step_id + i
        request.num_computed_tokens[:] = [context + i] * len(first.rows)
        requests.append(request)
    outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def feed() -> Any:
        while (request := outbox.get()) is not None:
            yield request

    outbox.put(requests[0])
    outbox.put(requests[1])
    device_us = []
    start = time.perf_counter()
    for received, response in enumerate(stub.StepStream(feed()), start=1):
        device_us.append(response.device_time_us)
        if received + 1 < iters:
            outbox.put(requests[received + 1])
        if received == iters:
            break
    wall = (time.perf_counter() - start) / iters * 1e6
    outbox.put(None)
    channel.close()
    server.stop(0).wait()
    return {
        "grpc_stream_step_us": wall,
        "grpc_stream_device_time_us": statistics.median(device_us),
    }, step_id + iters
