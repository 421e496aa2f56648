"""The client SDK and its commands, without the real scheduler.

Conversions are checked on hand-built protos. Streaming, errors, deadlines and
cancellation go over a real gRPC channel to ``ScriptedScheduler``, a small
in-test double of the Scheduler service whose behaviour is chosen by the
prompt text (``"fail:CODE"``, ``"midstream"``, ``"hang"``, ``"no-usage"``;
anything else streams "Hel" + "lo" per sequence, then the usage chunk).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import pytest

from pagedkv.client import (
    AlreadyExistsError,
    AsyncClient,
    Beam,
    CancelledError,
    Client,
    Completion,
    DeadlineExceededError,
    ExecutorStats,
    FinishReason,
    GenerateChunk,
    IncompleteStreamError,
    IntegrityCheck,
    InternalError,
    InvalidArgumentError,
    PagedkvError,
    ResourceExhaustedError,
    SequenceChunk,
    Stats,
    TokenLogprob,
    UnavailableError,
    Usage,
)
from pagedkv.client.options import generate_request
from pagedkv.client.stats import stats_from_proto
from pagedkv.client.types import chunk_from_proto
from pagedkv.common.cli import main
from pagedkv.common.ids import RequestId
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc

DETAILS = "sampling.top_p: must be in (0, 1]"

STATS = scheduler_pb2.GetStatsResponse(
    scheduler_id="sched-a",
    executors=[
        scheduler_pb2.ExecutorStats(
            address="10.0.0.1:7001",
            healthy=True,
            num_blocks=1025,
            num_free_blocks=768,
            kv_cache_usage=0.25,
            prefix_cache_queries=200,
            prefix_cache_hits=50,
            incarnation_id="inc-1",
            epoch=3,
            peak_used_blocks=300,
        ),
        scheduler_pb2.ExecutorStats(address="10.0.0.2:7001", healthy=False, num_blocks=9),
    ],
    num_running=4,
    num_waiting=2,
    num_preemptions=7,
    integrity=scheduler_pb2.IntegrityCheck(ok=True),
)


@dataclass
class ScriptedScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Records every request; acts as the prompt text says (see the module doc)."""

    requests: list[scheduler_pb2.GenerateRequest] = field(default_factory=list)
    stats_requests: list[scheduler_pb2.GetStatsRequest] = field(default_factory=list)
    stats_code: grpc.StatusCode | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    """Set when a "hang" call ends before its handler gives up (after 5 s): by
    its termination callback, which runs even when the server stops pulling
    the handler's responses once the client cancels."""

    def Generate(
        self, request: scheduler_pb2.GenerateRequest, context: Any
    ) -> Iterator[scheduler_pb2.GenerateResponse]:
        self.requests.append(request)
        rid = request.request_id or "sched-1"
        script = request.text
        if script.startswith("fail:"):
            context.abort(grpc.StatusCode[script.removeprefix("fail:")], DETAILS)
        n = max(request.sampling.n, 1)
        gave_up = threading.Event()
        if script == "hang":
            context.add_callback(lambda: gave_up.is_set() or self.cancelled.set())
        yield scheduler_pb2.GenerateResponse(
            request_id=rid,
            outputs=[
                scheduler_pb2.SequenceOutput(index=i, token_ids=[72, 101], text_delta="He")
                for i in range(n)
            ],
        )
        if script == "hang":
            deadline = time.monotonic() + 5
            while context.is_active() and time.monotonic() < deadline:
                time.sleep(0.01)
            if context.is_active():
                gave_up.set()
            return
        yield scheduler_pb2.GenerateResponse(
            request_id=rid,
            outputs=[
                scheduler_pb2.SequenceOutput(
                    index=i,
                    token_ids=[108, 108, 111],
                    text_delta="llo",
                    finish_reason=scheduler_pb2.FINISH_REASON_LENGTH,
                )
                for i in reversed(range(n))
            ],
        )
        if script == "midstream":
            context.abort(grpc.StatusCode.INTERNAL, "executor 10.0.0.1:7001 lost")
        if script == "no-usage":
            return
        yield scheduler_pb2.GenerateResponse(
            request_id=rid,
            usage=scheduler_pb2.Usage(
                prompt_tokens=3, cached_prompt_tokens=1, completion_tokens=5 * n
            ),
        )

    def Abort(
        self, request: scheduler_pb2.AbortRequest, context: Any
    ) -> scheduler_pb2.AbortResponse:
        return scheduler_pb2.AbortResponse(aborted=request.request_id == "live")

    def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: Any
    ) -> scheduler_pb2.GetStatsResponse:
        self.stats_requests.append(request)
        if self.stats_code is not None:
            context.abort(self.stats_code, "no executor reachable")
        return STATS


@dataclass(frozen=True)
class Served:
    servicer: ScriptedScheduler
    target: str


@pytest.fixture
def served() -> Iterator[Served]:
    servicer = ScriptedScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield Served(servicer, f"127.0.0.1:{port}")
    server.stop(grace=None)


def _closed_port_target() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


# --- requests: argument checks and field presence ----------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "prompt: exactly one"),
        ({"prompt": "hi", "token_ids": [1]}, "prompt: exactly one"),
        ({"prompt": "hi", "top_k": -1}, "top_k"),
        ({"token_ids": [5, -1]}, r"token_ids\[1\]"),
        ({"prompt": "hi", "stop_token_ids": [2**32]}, r"stop_token_ids\[0\]"),
        ({"prompt": "hi", "seed": -3}, "seed"),
    ],
)
def test_bad_arguments_raise_value_error_before_any_call(
    served: Served, kwargs: dict[str, Any], message: str
) -> None:
    with Client(served.target) as client:
        with pytest.raises(ValueError, match=message):
            client.generate(**kwargs)  # raises at the call, not at the first next()
        with pytest.raises(ValueError, match=message):
            client.generate_text(**kwargs)

    async def run_async() -> None:
        async with AsyncClient(served.target) as aclient:
            with pytest.raises(ValueError, match=message):
                aclient.generate(**kwargs)

    asyncio.run(run_async())
    assert served.servicer.requests == []


def test_unset_sampling_fields_stay_unset_and_zero_values_are_sent(served: Served) -> None:
    with Client(served.target) as client:
        client.generate_text("hi")
        client.generate_text(
            token_ids=[0, 7],
            max_tokens=4,
            temperature=0.0,
            top_p=0.5,
            top_k=3,
            seed=0,
            n=2,
            stop_token_ids=[13],
            ignore_eos=True,
            logprobs=0,
            cache_salt="tenant-a",
            priority=-1,
            request_id="r-1",
        )
    bare, full = served.servicer.requests
    assert bare.WhichOneof("prompt") == "text"
    assert bare.text == "hi"
    optional = ("max_tokens", "temperature", "top_p", "seed", "logprobs")
    assert [bare.sampling.HasField(f) for f in optional] == [False] * 5
    assert full.WhichOneof("prompt") == "token_ids"
    assert list(full.token_ids.ids) == [0, 7]
    assert [full.sampling.HasField(f) for f in optional] == [True] * 5
    assert (full.sampling.temperature, full.sampling.seed, full.sampling.logprobs) == (0, 0, 0)
    assert (full.sampling.top_k, full.sampling.n, list(full.sampling.stop_token_ids)) == (
        3,
        2,
        [13],
    )
    assert full.sampling.ignore_eos
    assert (full.cache_salt, full.priority, full.request_id) == ("tenant-a", -1, "r-1")


def test_stop_strings_and_min_tokens_go_into_the_sampling_params() -> None:
    request = generate_request(
        "hi", stop=["\n\n", "###"], include_stop_str_in_output=True, min_tokens=3
    )
    assert list(request.sampling.stop) == ["\n\n", "###"]
    assert request.sampling.include_stop_str_in_output
    assert request.sampling.min_tokens == 3
    assert list(generate_request("hi", stop="END").sampling.stop) == ["END"]  # one string
    with pytest.raises(ValueError, match="min_tokens"):
        generate_request("hi", min_tokens=-1)


def test_an_empty_token_id_list_still_sets_the_prompt() -> None:
    request = generate_request(token_ids=[])
    assert request.WhichOneof("prompt") == "token_ids"
    assert list(request.token_ids.ids) == []


# --- responses: proto -> types ------------------------------------------------


def test_chunk_from_proto_converts_every_field() -> None:
    msg = scheduler_pb2.GenerateResponse(
        request_id="r-9",
        outputs=[
            scheduler_pb2.SequenceOutput(
                index=1,
                token_ids=[5, 0],
                text_delta="ab",
                logprobs=[
                    scheduler_pb2.TokenLogprobs(
                        logprob=-0.5, top_token_ids=[5, 6], top_logprobs=[-0.5, -1.5]
                    ),
                    scheduler_pb2.TokenLogprobs(logprob=-0.25),
                ],
                finish_reason=scheduler_pb2.FINISH_REASON_STOP,
                stop_token_id=0,
            ),
            scheduler_pb2.SequenceOutput(
                index=0,
                finish_reason=scheduler_pb2.FINISH_REASON_ERROR,
                error_message="executor lost",
            ),
            scheduler_pb2.SequenceOutput(index=2, token_ids=[9], text_delta=""),
            scheduler_pb2.SequenceOutput(
                index=3, finish_reason=scheduler_pb2.FINISH_REASON_STOP, stop_string="\n\n"
            ),
        ],
        beams=[
            scheduler_pb2.BeamOutput(
                token_ids=[1, 2],
                text="xy",
                cumulative_logprob=-1.25,
                finish_reason=scheduler_pb2.FINISH_REASON_EOS,
            )
        ],
        usage=scheduler_pb2.Usage(prompt_tokens=0, cached_prompt_tokens=0, completion_tokens=0),
    )
    assert chunk_from_proto(msg) == GenerateChunk(
        request_id=RequestId("r-9"),
        sequences=(
            SequenceChunk(
                index=1,
                token_ids=(5, 0),
                text="ab",
                logprobs=(
                    TokenLogprob(logprob=-0.5, top_token_ids=(5, 6), top_logprobs=(-0.5, -1.5)),
                    TokenLogprob(logprob=-0.25, top_token_ids=(), top_logprobs=()),
                ),
                finish_reason=FinishReason.STOP,
                stop_token_id=0,  # set to 0 is not unset
                error_message=None,
            ),
            SequenceChunk(0, (), "", (), FinishReason.ERROR, None, "executor lost"),
            SequenceChunk(2, (9,), "", (), None, None, None),
            SequenceChunk(3, (), "", (), FinishReason.STOP, None, None, stop_string="\n\n"),
        ),
        beams=(Beam((1, 2), "xy", -1.25, FinishReason.EOS),),
        usage=Usage(0, 0, 0),  # an all-zero usage still marks the final chunk
    )


def test_a_chunk_without_usage_is_not_final_and_unknown_reasons_read_as_error() -> None:
    newer_server_reason = cast("scheduler_pb2.FinishReason", 99)  # unknown to this SDK
    output = scheduler_pb2.SequenceOutput(index=0, finish_reason=newer_server_reason)
    msg = scheduler_pb2.GenerateResponse(request_id="r", outputs=[output])
    chunk = chunk_from_proto(msg)
    assert chunk.usage is None and not chunk.is_final
    assert chunk.sequences[0].finish_reason is FinishReason.ERROR


def test_completion_joins_deltas_per_index_in_stream_order() -> None:
    def seq(
        index: int, ids: tuple[int, ...], text: str, reason: FinishReason | None = None
    ) -> SequenceChunk:
        return SequenceChunk(index, ids, text, (), reason, None, None)

    rid = RequestId("r")
    stopped = SequenceChunk(1, (5,), "", (), FinishReason.STOP, None, None, stop_string="!")
    completion = Completion.from_chunks(
        [
            GenerateChunk(rid, (seq(1, (4,), "b"), seq(0, (1,), "a")), (), None),
            GenerateChunk(rid, (seq(0, (2, 3), "a2", FinishReason.EOS),), (), None),
            GenerateChunk(rid, (stopped,), (), None),
            GenerateChunk(rid, (seq(1, (), "", FinishReason.LENGTH),), (), Usage(2, 0, 4)),
        ]
    )
    assert completion == Completion(
        request_id=rid,
        texts=("aa2", "b"),
        token_ids=((1, 2, 3), (4, 5)),
        logprobs=((), ()),
        finish_reasons=(FinishReason.EOS, FinishReason.LENGTH),
        usage=Usage(2, 0, 4),
        beams=(),
        stop_strings=(None, "!"),
    )
    assert completion.text == "aa2"
    with pytest.raises(ValueError, match="final chunk"):
        Completion.from_chunks([GenerateChunk(rid, (seq(0, (1,), "a"),), (), None)])


def test_stats_from_proto_converts_executors_and_hit_rate() -> None:
    stats = stats_from_proto(STATS)
    assert stats == Stats(
        scheduler_id="sched-a",
        executors=(
            # num_usable_blocks unset (a server older than the field): num_blocks - 1
            ExecutorStats(
                "10.0.0.1:7001",
                True,
                1025,
                768,
                0.25,
                200,
                50,
                "inc-1",
                3,
                1024,
                False,
                "",
                0,
                peak_used_blocks=300,
            ),
            ExecutorStats("10.0.0.2:7001", False, 9, 0, 0.0, 0, 0, "", 0, 8, False, "", 0),
        ),
        num_running=4,
        num_waiting=2,
        num_preemptions=7,
        integrity=IntegrityCheck(ok=True, message=""),
        num_internal_errors=0,
    )
    assert [ex.prefix_cache_hit_rate for ex in stats.executors] == [0.25, None]


# --- over a real channel: streaming, errors, cancellation ---------------------


def test_generate_streams_chunks_as_sent_and_generate_text_accumulates(served: Served) -> None:
    with Client(served.target, timeout=10) as client:
        chunks = list(client.generate("hi", max_tokens=5))
        completion = client.generate_text("hi", n=2, request_id="mine")
        assert client.abort("live") is True
        assert client.abort("gone") is False
        assert client.stats() == stats_from_proto(STATS)
        assert client.stats(reset_peak_used_blocks=True).executors[0].peak_used_blocks == 300
    assert [r.reset_peak_used_blocks for r in served.servicer.stats_requests] == [False, True]
    sent = served.servicer.requests[0].request_id  # the SDK's own: a uuid4 hex
    assert len(sent) == 32 and int(sent, 16) >= 0
    assert [c.request_id for c in chunks] == [sent] * 3
    assert [[s.text for s in c.sequences] for c in chunks] == [["He"], ["llo"], []]
    assert [c.is_final for c in chunks] == [False, False, True]
    assert completion.request_id == "mine"
    assert completion.texts == ("Hello", "Hello")
    assert completion.token_ids == ((72, 101, 108, 108, 111),) * 2
    assert completion.finish_reasons == (FinishReason.LENGTH,) * 2
    assert completion.usage == Usage(3, 1, 10)


ERRORS = [
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhaustedError),
    (grpc.StatusCode.UNAVAILABLE, UnavailableError),
    (grpc.StatusCode.ALREADY_EXISTS, AlreadyExistsError),
    (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceededError),
    (grpc.StatusCode.CANCELLED, CancelledError),
    (grpc.StatusCode.INTERNAL, InternalError),
    (grpc.StatusCode.DATA_LOSS, PagedkvError),
]


@pytest.mark.parametrize(("code", "error"), ERRORS)
def test_each_status_code_raises_its_error_class(
    served: Served, code: grpc.StatusCode, error: type[PagedkvError]
) -> None:
    with Client(served.target) as client:
        stream = client.generate(f"fail:{code.name}")
        with pytest.raises(error) as raised:
            next(stream)
    assert type(raised.value) is error
    assert (raised.value.code, raised.value.details) == (code, DETAILS)
    assert str(raised.value) == f"{code.name}: {DETAILS}"


def test_an_error_mid_stream_comes_after_the_chunks_already_sent(served: Served) -> None:
    received: list[GenerateChunk] = []
    with Client(served.target) as client, pytest.raises(InternalError, match="lost"):
        for chunk in client.generate("midstream"):
            received.append(chunk)
    assert len(received) == 2


def test_a_stream_ending_without_usage_raises_incomplete(served: Served) -> None:
    with Client(served.target) as client, pytest.raises(IncompleteStreamError):
        client.generate_text("no-usage")


def test_unreachable_target_and_passed_deadline_raise_typed_errors(served: Served) -> None:
    with Client(_closed_port_target()) as client, pytest.raises(UnavailableError):
        client.stats()
    served.servicer.stats_code = grpc.StatusCode.UNAVAILABLE
    with Client(served.target) as client:
        with pytest.raises(UnavailableError, match="no executor reachable"):
            client.stats()
        with pytest.raises(DeadlineExceededError):
            client.generate_text("hang", timeout=0.3)


def test_closing_the_stream_early_cancels_the_call(served: Served) -> None:
    with Client(served.target) as client:
        stream = client.generate("hang")
        assert next(stream).sequences[0].text == "He"
        stream.close()
        assert served.servicer.cancelled.wait(10)


def test_async_client_streams_maps_errors_and_cancels(served: Served) -> None:
    async def run() -> None:
        async with AsyncClient(served.target, timeout=10) as client:
            chunks = [chunk async for chunk in client.generate("hi")]
            assert [[s.text for s in c.sequences] for c in chunks] == [["He"], ["llo"], []]
            completion = await client.generate_text(token_ids=[1, 2], n=3)
            assert completion.texts == ("Hello",) * 3
            assert await client.abort("live") is True
            assert (await client.stats()).scheduler_id == "sched-a"
            await client.stats(reset_peak_used_blocks=True)
            assert served.servicer.stats_requests[-1].reset_peak_used_blocks

            received = []
            with pytest.raises(InternalError, match="lost"):
                async for chunk in client.generate("midstream"):
                    received.append(chunk)
            assert len(received) == 2
            with pytest.raises(ResourceExhaustedError):
                await client.generate_text("fail:RESOURCE_EXHAUSTED")

            async with contextlib.aclosing(client.generate("hang")) as stream:
                async for _ in stream:
                    break
            assert await asyncio.to_thread(served.servicer.cancelled.wait, 3)
            served.servicer.cancelled.clear()
            async for _ in client.generate("hang"):  # closed by the loop once collected
                break
            gc.collect()  # the dropped stream may sit in a reference cycle with its call
            assert await asyncio.to_thread(served.servicer.cancelled.wait, 3)

    asyncio.run(run())


# --- the commands ---------------------------------------------------------------


def test_generate_command_streams_text_and_prints_usage(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", "--target", served.target, "--prompt", "hi", "--max-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert out == "Hello\n"
    assert "prompt 3 tokens (1 cached), completion 5 tokens, finish length" in err

    argv = ["generate", "--target", served.target, "--token-ids", "1,2", "--max-tokens", "5"]
    assert main([*argv, "--n", "2"]) == 0
    out, _ = capsys.readouterr()
    assert out == "--- sequence 0 (length) ---\nHello\n--- sequence 1 (length) ---\nHello\n"


def test_generate_command_json_prints_one_object_per_chunk(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--target", served.target, "--prompt", "hi", "--max-tokens", "5"]
    assert main([*argv, "--n", "2", "--temperature", "0", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3
    assert lines[0]["sequences"][1] == {
        "index": 1,
        "token_ids": [72, 101],
        "text": "He",
        "finish_reason": None,
    }
    assert [s["finish_reason"] for s in lines[1]["sequences"]] == ["length", "length"]
    assert "usage" not in lines[1]
    assert lines[2]["usage"] == {
        "prompt_tokens": 3,
        "cached_prompt_tokens": 1,
        "completion_tokens": 10,
    }
    assert served.servicer.requests[-1].sampling.HasField("temperature")


def test_commands_print_the_status_code_and_exit_1_on_errors(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--target", served.target, "--max-tokens", "5"]
    assert main([*argv, "--prompt", "fail:INVALID_ARGUMENT"]) == 1
    assert capsys.readouterr().err == f"pagedkv: INVALID_ARGUMENT: {DETAILS}\n"

    assert main([*argv, "--prompt", "midstream"]) == 1
    out, err = capsys.readouterr()
    assert (out, err) == ("Hello\n", "pagedkv: INTERNAL: executor 10.0.0.1:7001 lost\n")

    assert main([*argv, "--prompt", "hi", "--top-k", "-1"]) == 2
    assert "top_k" in capsys.readouterr().err

    served.servicer.stats_code = grpc.StatusCode.UNAVAILABLE
    assert main(["stats", "--target", served.target]) == 1
    assert capsys.readouterr().err == "pagedkv: UNAVAILABLE: no executor reachable\n"


def test_stats_command_prints_a_table_or_json(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["stats", "--target", served.target]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "scheduler sched-a",
        "EXECUTOR       STATE    FREE/USABLE BLOCKS  KV USAGE  PREFIX HIT RATE  RECOVERIES",
        "10.0.0.1:7001  healthy            768/1024     25.0%            25.0%           0",
        "10.0.0.2:7001  DOWN                    0/8      0.0%                -           0",
        "usable blocks: all but the null block 0 of each pool, which holds no KV",
        "running 4, waiting 2, preemptions 7, internal errors 0, integrity ok",
    ]
    assert main(["stats", "--target", served.target, "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["num_preemptions"] == 7
    assert obj["integrity"] == {"ok": True, "message": ""}
    assert [ex["prefix_cache_hit_rate"] for ex in obj["executors"]] == [0.25, None]
