"""Bytes that are not the method's message, sent to a real ``pagedkv serve``:
INVALID_ARGUMENT naming the message type (not grpc's UNKNOWN with Python's
exception class), and the scheduler serves on, health and reflection
included. The executor's side is in tests/executor/test_executor_api.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from pagedkv.v1 import scheduler_pb2
from tests.executor.test_generation import PROMPTS, hf_greedy, model_dirs
from tests.service.stack import Process, serve
from tests.service.test_stack import assert_nothing_held, collect, greedy_request

__all__ = ["model_dirs"]  # the session fixture, shared with the executor tests

GARBAGE = b"\xff\xff\xff"  # no protobuf message: a field number whose varint never ends


@pytest.fixture(scope="module")
def stack(model_dirs: dict[str, Path]) -> Iterator[Process]:
    with serve(model_dirs["llama"], num_blocks=32) as process:
        yield process


def assert_undecodable(error: grpc.RpcError, message_name: str) -> None:
    details = f"the request is not a valid {message_name} message"
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, details)


def test_an_undecodable_request_is_invalid_argument_and_the_scheduler_serves_on(
    stack: Process, model_dirs: dict[str, Path]
) -> None:
    channel = stack.channel
    assert channel is not None
    generate = channel.unary_stream("/pagedkv.v1.Scheduler/Generate")
    # A well-formed message whose string is not UTF-8 does not decode either.
    not_utf8 = greedy_request([], 4, request_id="zz").SerializeToString()
    not_utf8 = not_utf8.replace(b"zz", b"\xff\xff")
    for payload in (GARBAGE, not_utf8):
        with pytest.raises(grpc.RpcError) as error:
            list(generate(payload, timeout=60))
        assert_undecodable(error.value, "pagedkv.v1.GenerateRequest")
    for method, message_name in (
        ("/pagedkv.v1.Scheduler/Abort", "pagedkv.v1.AbortRequest"),
        ("/pagedkv.v1.Scheduler/GetStats", "pagedkv.v1.GetStatsRequest"),
        ("/grpc.health.v1.Health/Check", "grpc.health.v1.HealthCheckRequest"),
    ):
        with pytest.raises(grpc.RpcError) as error:
            channel.unary_unary(method)(GARBAGE, timeout=60)
        assert_undecodable(error.value, message_name)
    tokens, _ = collect(stack.stub, greedy_request(PROMPTS[0], 8))
    assert tokens[0] == hf_greedy(model_dirs["llama"], PROMPTS[0], 8)
    assert_nothing_held(stack.stub)


def test_health_and_reflection_answer_through_the_decoding_check(stack: Process) -> None:
    channel = stack.channel
    assert channel is not None
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pagedkv.v1.Scheduler"):
        response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=60)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    database = ProtoReflectionDescriptorDatabase(channel)
    service = DescriptorPool(database).FindServiceByName("pagedkv.v1.Scheduler")
    expected = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"]
    assert {m.name for m in service.methods} == {m.name for m in expected.methods}
