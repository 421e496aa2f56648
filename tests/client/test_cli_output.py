"""What ``pagedkv generate`` and ``pagedkv stats`` write, over a real channel to
a scripted Scheduler: a model's control bytes never reach a terminal raw, and
targets without a port mean the scheduler's default port."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import re
import sys
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from pagedkv.client import AsyncClient, Client
from pagedkv.client.stats import stats_from_proto
from pagedkv.common.cli import DEFAULT_SCHEDULER_PORT, main, target_with_port
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc

RAW = "red \x1b[31mtext\x1b[0m\r\x07bell\ttab\nline \x85 end"
"""What the scripted model says: ANSI escapes, a carriage return, a bell, a C1
control, and the tab and newline a terminal should still get."""

ESCAPED = "red \\x1b[31mtext\\x1b[0m\\x0d\\x07bell\ttab\nline \\x85 end"


class RawBytesScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Streams ``RAW`` in two deltas to every sequence of every request."""

    def Generate(
        self, request: scheduler_pb2.GenerateRequest, context: Any
    ) -> Iterator[scheduler_pb2.GenerateResponse]:
        n = max(request.sampling.n, 1)
        half = len(RAW) // 2
        for delta, reason in ((RAW[:half], None), (RAW[half:], scheduler_pb2.FINISH_REASON_LENGTH)):
            yield scheduler_pb2.GenerateResponse(
                request_id="r-1",
                outputs=[
                    scheduler_pb2.SequenceOutput(
                        index=i, token_ids=[1], text_delta=delta, finish_reason=reason
                    )
                    for i in range(n)
                ],
            )
        yield scheduler_pb2.GenerateResponse(
            request_id="r-1",
            usage=scheduler_pb2.Usage(prompt_tokens=1, completion_tokens=2 * n),
        )


class Terminal(io.StringIO):
    """A stdout that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def target() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(RawBytesScheduler(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def _generate(target: str, *extra: str) -> list[str]:
    return ["generate", "--target", target, "--prompt", "hi", "--max-tokens", "2", *extra]


def test_on_a_terminal_control_bytes_are_escaped_but_newline_and_tab_kept(
    target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(_generate(target)) == 0
    assert terminal.getvalue() == ESCAPED + "\n"

    terminal.seek(0)
    terminal.truncate()
    assert main(_generate(target, "--n", "2")) == 0
    assert terminal.getvalue() == (
        f"--- sequence 0 (length) ---\n{ESCAPED}\n--- sequence 1 (length) ---\n{ESCAPED}\n"
    )


def test_piped_output_and_json_carry_the_model_text_unchanged(
    target: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(_generate(target)) == 0
    assert capsys.readouterr().out == RAW + "\n"

    monkeypatch.setattr(sys, "stdout", Terminal())
    assert main(_generate(target, "--json")) == 0
    lines = sys.stdout.getvalue().splitlines()
    assert "".join(json.loads(line)["sequences"][0]["text"] for line in lines[:2]) == RAW


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("localhost", f"localhost:{DEFAULT_SCHEDULER_PORT}"),
        ("10.0.0.5", f"10.0.0.5:{DEFAULT_SCHEDULER_PORT}"),
        ("[::1]", f"[::1]:{DEFAULT_SCHEDULER_PORT}"),
        ("localhost:7000", "localhost:7000"),
        ("[::1]:7000", "[::1]:7000"),
        ("dns:///scheduler.local:7000", "dns:///scheduler.local:7000"),
        ("unix:/run/pagedkv.sock", "unix:/run/pagedkv.sock"),
    ],
)
def test_a_target_without_a_port_gets_the_scheduler_default_port(given: str, meant: str) -> None:
    assert target_with_port(given) == meant


def test_clients_and_commands_take_a_host_alone(
    target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with Client("localhost") as client:
        assert client.target == f"localhost:{DEFAULT_SCHEDULER_PORT}"

    async def async_target() -> str:
        async with AsyncClient("localhost") as aclient:
            return aclient.target

    assert asyncio.run(async_target()) == f"localhost:{DEFAULT_SCHEDULER_PORT}"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"HOST[:PORT] (default port: {DEFAULT_SCHEDULER_PORT}," in help_text


def test_serve_and_scheduler_listen_on_the_default_scheduler_port() -> None:
    from pagedkv.common.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).port == DEFAULT_SCHEDULER_PORT
    assert parser.parse_args(["scheduler", "--executor", "h:1"]).port == DEFAULT_SCHEDULER_PORT


# --- pagedkv stats ------------------------------------------------------------------


def _stats(**fields: Any) -> scheduler_pb2.GetStatsResponse:
    """Two executors: one healthy but suspect and fully free, one down after
    a recovery; ``fields`` override the response's own fields."""
    return scheduler_pb2.GetStatsResponse(
        scheduler_id="sched-b",
        executors=[
            scheduler_pb2.ExecutorStats(
                address="127.0.0.1:7001",
                healthy=True,
                num_blocks=2048,
                num_usable_blocks=2047,
                num_free_blocks=2047,
                suspect=True,
            ),
            scheduler_pb2.ExecutorStats(
                address="127.0.0.1:7002",
                healthy=False,
                num_blocks=64,
                num_usable_blocks=63,
                num_free_blocks=0,
                down_reason="timeout: step 12 took longer than 120 s",
                num_recoveries=1,
            ),
        ],
        integrity=scheduler_pb2.IntegrityCheck(ok=True),
        **fields,
    )


class StatsScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, response: scheduler_pb2.GetStatsResponse) -> None:
        self.response = response

    def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: Any
    ) -> scheduler_pb2.GetStatsResponse:
        return self.response


@pytest.fixture
def stats_target() -> Iterator[tuple[StatsScheduler, str]]:
    servicer = StatsScheduler(_stats(num_internal_errors=3))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_stats_reads_usable_blocks_suspects_down_reasons_and_internal_errors() -> None:
    stats = stats_from_proto(_stats(num_internal_errors=3))
    suspect, down = stats.executors
    assert (suspect.num_blocks, suspect.num_usable_blocks, suspect.num_free_blocks) == (
        2048,
        2047,
        2047,
    )
    assert suspect.suspect and suspect.healthy and suspect.down_reason == ""
    assert not down.healthy and down.down_reason.startswith("timeout:")
    assert (down.num_recoveries, stats.num_internal_errors) == (1, 3)


def test_stats_command_shows_usable_capacity_states_and_why_an_executor_is_down(
    stats_target: tuple[StatsScheduler, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, target = stats_target
    assert main(["stats", "--target", target]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "scheduler sched-b",
        "EXECUTOR        STATE    FREE/USABLE BLOCKS  KV USAGE  PREFIX HIT RATE  RECOVERIES",
        "127.0.0.1:7001  suspect           2047/2047      0.0%                -           0",
        "127.0.0.1:7002  DOWN                   0/63      0.0%                -           1",
        "usable blocks: all but the null block 0 of each pool, which holds no KV",
        "suspect: healthy, but its step in flight has run far longer than its recent steps",
        "127.0.0.1:7002 is down: timeout: step 12 took longer than 120 s",
        "running 0, waiting 0, preemptions 0, internal errors 3 (see the scheduler's log), "
        "integrity ok",
    ]
    assert main(["stats", "--target", target, "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["num_internal_errors"] == 3
    assert [ex["num_usable_blocks"] for ex in obj["executors"]] == [2047, 63]
    assert [ex["down_reason"] for ex in obj["executors"]] == [
        "",
        "timeout: step 12 took longer than 120 s",
    ]


def test_an_older_server_without_usable_blocks_gets_num_blocks_minus_one(
    stats_target: tuple[StatsScheduler, str], capsys: pytest.CaptureFixture[str]
) -> None:
    servicer, target = stats_target
    older = _stats()
    for ex in older.executors:
        ex.ClearField("num_usable_blocks")
    servicer.response = older
    with Client(target) as client:
        stats = client.stats()
    assert [ex.num_usable_blocks for ex in stats.executors] == [2047, 63]


def test_demo_report_counts_held_blocks_out_of_the_usable_ones() -> None:
    from pagedkv.client.demo import stats_report

    response = _stats(num_internal_errors=0)
    response.executors[0].num_free_blocks = 2040
    lines = stats_report(stats_from_proto(response)).splitlines()
    assert [line.split("  ")[0] for line in lines[:3]] == [
        "EXECUTOR",
        "127.0.0.1:7001",
        "127.0.0.1:7002",
    ]
    assert [line.split() for line in lines[1:3]] == [
        ["127.0.0.1:7001", "suspect", "0.0%", "2040/2047", "7", "0/0", "tokens"],
        ["127.0.0.1:7002", "DOWN", "0.0%", "0/63", "-", "0/0", "tokens"],
    ]
    assert lines[3:] == [
        "usable blocks: all but the null block 0 of each pool, which holds no KV",
        "127.0.0.1:7002 is down: timeout: step 12 took longer than 120 s",
        "running 0, waiting 0, preemptions 0, integrity ok; 7 blocks held; internal errors 0",
    ]


class DemoScheduler(RawBytesScheduler, StatsScheduler):
    """Streams ``RAW`` and answers GetStats, for the demo's phases."""


def test_the_demo_labels_its_comparison_request_and_its_n4_request(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pagedkv.client.demo import sharing_phase

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = DemoScheduler(_stats())
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    async def run() -> None:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            await sharing_phase(client, argparse.Namespace(max_tokens=2))

    try:
        asyncio.run(run())
    finally:
        server.stop(grace=None)
    out, err = capsys.readouterr()
    assert "after a 1-sample request of it\n      to compare the KV blocks each holds" in out
    bars = [line.split(":")[0] for line in re.split(r"[\r\n]+", err) if line.strip()]
    assert set(bars) == {"1 sample, to compare", "n=4 samples"}


def test_stats_command_shows_the_cluster_and_a_draining_replica(
    stats_target: tuple[StatsScheduler, str], capsys: pytest.CaptureFixture[str]
) -> None:
    servicer, target = stats_target
    servicer.response = _stats(
        draining=True,
        cluster=scheduler_pb2.ClusterState(
            enabled=True,
            degraded=True,
            detail="redis at redis://127.0.0.1:6390/0 unreachable",
            scheduler_ids=["sched-a", "sched-b"],
            executors=[
                scheduler_pb2.ClusterExecutor(
                    address="127.0.0.1:7001",
                    incarnation_id="0123456789abcdef",
                    owner_id="sched-b",
                    epoch=4,
                ),
                scheduler_pb2.ClusterExecutor(address="127.0.0.1:7003", incarnation_id="fe"),
            ],
        ),
    )
    assert main(["stats", "--target", target]) == 0
    assert capsys.readouterr().out.splitlines()[-5:] == [
        "running 0, waiting 0, preemptions 0, internal errors 0, integrity ok, "
        "DRAINING (admits nothing)",
        "cluster DEGRADED: redis at redis://127.0.0.1:6390/0 unreachable; "
        "schedulers: sched-a, sched-b",
        "REGISTERED EXECUTOR  LEASED BY  EPOCH   INCARNATION",
        "127.0.0.1:7001       sched-b        4  0123456789ab",
        "127.0.0.1:7003       -              -            fe",
    ]
    assert main(["stats", "--target", target, "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["draining"] and obj["cluster"]["scheduler_ids"] == ["sched-a", "sched-b"]
    assert obj["cluster"]["executors"][0]["owner_id"] == "sched-b"
