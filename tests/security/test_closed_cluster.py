"""A closed cluster (issue 13, real processes): Redis with a password given
through a file, an executor serving mutual TLS, a scheduler and a router
serving TLS with bearer tokens. Outsiders get nowhere: no certificate or
another CA's certificate cannot reach the executor, a missing or wrong token
is UNAUTHENTICATED; health answers without a token; a rotated token file is
honoured; greedy output through the router and the scheduler equals Hugging
Face's; and no secret shows in any log or metric."""

from __future__ import annotations

import asyncio
import re
import secrets
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedkv.client import AsyncClient, Client, UnauthenticatedError
from pagedkv.common.bearer_tokens import bearer_metadata
from pagedkv.v1 import (
    common_pb2,
    executor_pb2,
    executor_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.cluster.cluster_stack import wait_until
from tests.router.router_stack import References, RouterProcess, make_prefix, with_suffix
from tests.security.conftest import ClosedCluster, Pki, Secrets, client_tls_args

MAX_TOKENS = 6


def get_info(channel: grpc.Channel) -> executor_pb2.GetInfoResponse:
    response: executor_pb2.GetInfoResponse = executor_pb2_grpc.ExecutorStub(channel).GetInfo(
        executor_pb2.GetInfoRequest(), timeout=10
    )
    return response


def test_only_a_certificate_of_the_cluster_ca_reaches_the_executor(
    closed_cluster: ClosedCluster, pki: Pki
) -> None:
    target = closed_cluster.executor.target
    refused = {
        "plaintext": grpc.insecure_channel(target),
        "no client certificate": pki.channel(target),
        "another CA's certificate": pki.channel(target, client=pki.intruder),
    }
    for what, channel in refused.items():
        with channel, pytest.raises(grpc.RpcError) as error:
            get_info(channel)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE, what
    with pki.channel(target, client=pki.client) as channel:
        assert get_info(channel).model_id


def calls(target: str, pki: Pki, metadata: tuple[tuple[str, str], ...]) -> list[grpc.StatusCode]:
    """The status of GetStats, Abort and Generate on ``target`` with ``metadata``."""
    codes = []
    with pki.channel(target, client=pki.client) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        request = scheduler_pb2.GenerateRequest(token_ids=scheduler_pb2.TokenIds(ids=[1, 2, 3]))
        request.sampling.max_tokens = 1
        for call in (
            lambda: stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=30, metadata=metadata),
            lambda: stub.Abort(scheduler_pb2.AbortRequest(request_id="x"), metadata=metadata),
            lambda: list(stub.Generate(request, timeout=30, metadata=metadata)),
        ):
            try:
                call()
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
    return codes


def test_a_missing_or_wrong_token_is_unauthenticated_and_the_right_one_works(
    closed_cluster: ClosedCluster, pki: Pki, cluster_secrets: Secrets
) -> None:
    unauthenticated = [grpc.StatusCode.UNAUTHENTICATED] * 3
    for process in (closed_cluster.scheduler, closed_cluster.router):
        target = process.target
        assert calls(target, pki, ()) == unauthenticated
        assert calls(target, pki, bearer_metadata("not-a-token")) == unauthenticated
        assert calls(target, pki, (("authorization", "Basic abc"),)) == unauthenticated
        good = bearer_metadata(cluster_secrets.client_token)
        assert calls(target, pki, good) == [grpc.StatusCode.OK] * 3
    # The router presents its own token to the scheduler, which takes it.
    scheduler = closed_cluster.scheduler.target
    assert calls(scheduler, pki, bearer_metadata(cluster_secrets.router_token))[0].name == "OK"
    # The SDK's error names no token.
    with (
        Client(closed_cluster.router.target, tls=pki.tls(client=pki.client), token="bad") as client,
        pytest.raises(UnauthenticatedError) as error,
    ):
        client.stats()
    assert "bad" not in str(error.value)


def test_health_answers_without_a_token_and_reflection_does_not(
    closed_cluster: ClosedCluster, pki: Pki
) -> None:
    for process in (closed_cluster.scheduler, closed_cluster.router):
        with pki.channel(process.target, client=pki.client) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            response = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            with pytest.raises(grpc.RpcError) as error:
                list(reflection.ServerReflectionInfo(iter([request]), timeout=10))
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_health_port_serves_plaintext_health_alone(closed_cluster: ClosedCluster) -> None:
    for name, port in closed_cluster.health_ports.items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            response = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert response.status == health_pb2.HealthCheckResponse.SERVING, name
            with pytest.raises(grpc.RpcError) as error:
                get_info(channel)  # no other service there
            assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED, name


def test_a_rotated_token_file_is_honoured(
    closed_cluster: ClosedCluster, pki: Pki, cluster_secrets: Secrets
) -> None:
    target = closed_cluster.router.target
    old, new = cluster_secrets.client_token, f"new-{secrets.token_hex(16)}"
    path = cluster_secrets.router_tokens
    original = path.read_text()
    try:
        path.write_text(f"{old}\n{new}\n")  # both during the switch
        assert calls(target, pki, bearer_metadata(new))[0] == grpc.StatusCode.OK
        path.write_text(f"{new}\n")  # the old one retired
        assert calls(target, pki, bearer_metadata(old))[0] == grpc.StatusCode.UNAUTHENTICATED
        assert calls(target, pki, bearer_metadata(new))[0] == grpc.StatusCode.OK
    finally:
        path.write_text(original)
    assert calls(target, pki, bearer_metadata(old))[0] == grpc.StatusCode.OK


def test_a_router_without_a_token_of_its_own_passes_the_callers_on(
    closed_cluster: ClosedCluster, pki: Pki, cluster_secrets: Secrets
) -> None:
    # No token file at all, plaintext towards clients, TLS towards the
    # scheduler: GetStats, Abort and Generate reach the scheduler with the
    # caller's token, and a call without one is refused by the scheduler.
    url = closed_cluster.redis.url
    password = ("--redis-password-file", str(cluster_secrets.redis_password_file))
    with RouterProcess(url, *password, *client_tls_args("scheduler-", pki)) as router:
        metadata = bearer_metadata(cluster_secrets.client_token)

        def answered() -> bool:
            stats = router.stub.GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=30, metadata=metadata
            )
            return bool(stats.executors) and not stats.router.unreachable_scheduler_ids

        wait_until(answered, what="the scheduler answers the router's GetStats")
        aborted = router.stub.Abort(
            scheduler_pb2.AbortRequest(request_id="none"), timeout=30, metadata=metadata
        )
        assert not aborted.aborted
        request = scheduler_pb2.GenerateRequest(
            token_ids=scheduler_pb2.TokenIds(ids=list(range(20))),
            sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0),
        )
        chunks = list(router.stub.Generate(request, timeout=60, metadata=metadata))
        assert sum(len(o.token_ids) for c in chunks for o in c.outputs) == 2
        stats = router.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=30)
        assert not stats.executors and stats.router.unreachable_scheduler_ids
        with pytest.raises(grpc.RpcError) as refused:
            list(router.stub.Generate(request, timeout=60))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_router_with_a_token_of_its_own_presents_it_on_every_call(
    closed_cluster: ClosedCluster, pki: Pki, cluster_secrets: Secrets, tmp_path: Path
) -> None:
    # Issue 26: the caller's token opens this router but not the scheduler;
    # the router's own opens the scheduler. GetStats, Generate (a stream)
    # and Abort through the router all reach the scheduler, so every call
    # the router makes carries its own token, never the caller's.
    caller_token = f"caller-{secrets.token_hex(16)}"
    tokens = tmp_path / "router-tokens"
    tokens.write_text(f"{caller_token}\n")
    url = closed_cluster.redis.url
    password = ("--redis-password-file", str(cluster_secrets.redis_password_file))
    with RouterProcess(
        url,
        *password,
        "--auth-token-file",
        str(tokens),
        *client_tls_args("scheduler-", pki),
        "--scheduler-token-file",
        str(cluster_secrets.router_token_file),
    ) as router:
        metadata = bearer_metadata(caller_token)
        assert calls(closed_cluster.scheduler.target, pki, metadata) == (
            [grpc.StatusCode.UNAUTHENTICATED] * 3
        )

        def answered() -> bool:
            stats = router.stub.GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=30, metadata=metadata
            )
            return bool(stats.executors) and not stats.router.unreachable_scheduler_ids

        wait_until(answered, what="the scheduler answers the router's GetStats")
        request = scheduler_pb2.GenerateRequest(
            request_id="long",
            token_ids=scheduler_pb2.TokenIds(ids=list(range(20))),
            sampling=common_pb2.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
        )
        stream = router.stub.Generate(request, timeout=120, metadata=metadata)
        assert next(stream).request_id == "long"
        aborted = router.stub.Abort(
            scheduler_pb2.AbortRequest(request_id="long"), timeout=30, metadata=metadata
        )
        assert aborted.aborted
        final = list(stream)[-1]
        assert final.outputs[-1].finish_reason == scheduler_pb2.FINISH_REASON_ABORT


def test_greedy_output_through_the_closed_cluster_equals_hugging_face(
    closed_cluster: ClosedCluster, pki: Pki, cluster_secrets: Secrets, hf: References
) -> None:
    prefix = make_prefix(13)
    prompts = [with_suffix(prefix, seed) for seed in range(3)]
    tls = pki.tls(client=pki.client)
    token = cluster_secrets.client_token

    async def run(target: str) -> list[list[int]]:
        async with AsyncClient(target, timeout=120, tls=tls, token=token) as client:
            completions = await asyncio.gather(
                *(
                    client.generate_text(
                        token_ids=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
                    )
                    for p in prompts
                )
            )
        return [list(c.token_ids[0]) for c in completions]

    expected = [hf(p, MAX_TOKENS) for p in prompts]
    assert asyncio.run(run(closed_cluster.router.target)) == expected
    with Client(closed_cluster.scheduler.target, timeout=120, tls=tls, token=token) as client:
        completion = client.generate_text(
            token_ids=prompts[0], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
        )
    assert list(completion.token_ids[0]) == expected[0]


def test_no_secret_in_logs_or_metrics(
    closed_cluster: ClosedCluster, pki: Pki, cluster_secrets: Secrets
) -> None:
    # Refused calls and served ones have both been logged by now.
    calls(closed_cluster.router.target, pki, bearer_metadata("wrong-token-value"))
    calls(closed_cluster.router.target, pki, bearer_metadata(cluster_secrets.client_token))
    wait_until(lambda: "call refused" in closed_cluster.router.stderr(), what="a refusal logged")
    key_body = pki.server.key.read_text().splitlines()[1]
    forbidden = [
        cluster_secrets.client_token,
        cluster_secrets.router_token,
        cluster_secrets.redis_password,
        "wrong-token-value",
        key_body,
    ]
    metrics_port = int(re.findall(r"metrics on :(\d+)", closed_cluster.router.ready_line)[0])
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    texts = {"router metrics": metrics}
    for process in closed_cluster.processes():
        texts[type(process).__name__] = process.stderr() + process.ready_line
    for where, text in texts.items():
        for secret in forbidden:
            assert secret not in text, f"a secret in {where}"
