"""The whole stack as real processes on 127.0.0.1: ``pagedkv serve`` (or
``pagedkv scheduler`` over separately started executors) driven through the
Scheduler gRPC API, against Hugging Face ``generate``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from pagedkv.v1 import common_pb2, scheduler_pb2
from tests.executor.driver import ExecutorProcess
from tests.executor.test_generation import PROMPTS, hf_greedy, model_dirs
from tests.service.stack import Process, serve

__all__ = ["model_dirs"]  # the session fixture, shared with the executor tests

FinishReason = scheduler_pb2.FinishReason


def greedy_request(
    prompt: list[int], max_tokens: int, **kwargs: object
) -> scheduler_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return scheduler_pb2.GenerateRequest(
        token_ids=scheduler_pb2.TokenIds(ids=prompt), sampling=sampling, **kwargs
    )


def collect(stub, request) -> tuple[dict[int, list[int]], list[scheduler_pb2.GenerateResponse]]:
    """Every chunk of a Generate stream, and the tokens per sequence index."""
    chunks = list(stub.Generate(request, timeout=600))
    tokens: dict[int, list[int]] = {}
    for chunk in chunks:
        for output in chunk.outputs:
            tokens.setdefault(output.index, []).extend(output.token_ids)
    return tokens, chunks


def assert_nothing_held(stub) -> scheduler_pb2.GetStatsResponse:
    stats = stub.GetStats(scheduler_pb2.GetStatsRequest())
    assert stats.integrity.ok, stats.integrity.message
    assert stats.num_running == stats.num_waiting == 0
    for executor in stats.executors:
        if executor.healthy:
            assert executor.num_free_blocks == executor.num_blocks - 1
            assert executor.kv_cache_usage == 0.0
    return stats


@pytest.fixture(scope="module")
def stack(model_dirs: dict[str, Path]):
    extra = ("--metrics-port", "0")
    with serve(
        model_dirs["llama"], executors=2, num_blocks=48, extra=extra, log_format="json"
    ) as process:
        yield process


def test_asked_for_json_logs_the_stack_writes_only_json_lines(stack) -> None:
    # ``pagedkv --log-format json serve`` passes the format to its executors:
    # every stderr line of the scheduler and both executors is a JSON object.
    collect(stack.stub, greedy_request(PROMPTS[0], 4))
    records = [json.loads(line) for line in stack.stderr().splitlines() if line.strip()]
    executors = [r for r in records if r.get("event") == "executor serving"]
    assert len(executors) == 2
    assert any(r.get("component", "").startswith("pagedkv.scheduler") for r in records)


def test_greedy_output_through_the_stack_equals_hugging_face(stack, model_dirs) -> None:
    for prompt in PROMPTS:
        tokens, chunks = collect(stack.stub, greedy_request(prompt, 24))
        assert tokens[0] == hf_greedy(model_dirs["llama"], prompt, 24)
        final = chunks[-1]
        assert final.usage.prompt_tokens == len(prompt)
        assert final.usage.completion_tokens == 24
        assert final.outputs[-1].finish_reason == FinishReason.FINISH_REASON_LENGTH
    assert_nothing_held(stack.stub)


def test_a_placement_hint_is_honoured_when_held_and_said_when_not(stack, model_dirs) -> None:
    """A request naming one of the scheduler's executors runs there (the
    first chunk says so); one naming an unknown executor is placed by the
    scheduler, and the first chunk says the hint was not held."""
    prompt = PROMPTS[0]
    expected = hf_greedy(model_dirs["llama"], prompt, 6)
    addresses = [e.address for e in stack.stub.GetStats(scheduler_pb2.GetStatsRequest()).executors]
    for address in addresses:
        tokens, chunks = collect(stack.stub, greedy_request(prompt, 6, preferred_executor=address))
        assert tokens[0] == expected
        assert chunks[0].placement.executor == address
        assert chunks[0].placement.hint == scheduler_pb2.PLACEMENT_HINT_HONOURED
        assert not any(c.HasField("placement") for c in chunks[1:])
    tokens, chunks = collect(
        stack.stub, greedy_request(prompt, 6, preferred_executor="127.0.0.1:1")
    )
    assert tokens[0] == expected
    assert chunks[0].placement.executor in addresses
    assert chunks[0].placement.hint == scheduler_pb2.PLACEMENT_HINT_NOT_HELD
    tokens, chunks = collect(stack.stub, greedy_request(prompt, 6))
    assert chunks[0].placement.hint == scheduler_pb2.PLACEMENT_HINT_NONE
    assert_nothing_held(stack.stub)


def test_the_peak_of_blocks_held_outlives_the_request_until_a_reset(stack) -> None:
    """A request too short for any poll to see still leaves its blocks in
    the executor's peak; a GetStats asking for the reset reads it and starts
    it over from what is held now (nothing)."""
    reset = scheduler_pb2.GetStatsRequest(reset_peak_used_blocks=True)
    first, second = (e.address for e in stack.stub.GetStats(reset).executors)
    prompt = PROMPTS[0]
    collect(stack.stub, greedy_request(prompt, 8, preferred_executor=first))
    peaks = {e.address: e.peak_used_blocks for e in stack.stub.GetStats(reset).executors}
    assert peaks[first] >= -(-(len(prompt) + 7) // 16) and peaks[second] == 0
    after = assert_nothing_held(stack.stub)
    assert [e.peak_used_blocks for e in after.executors] == [0, 0]


def test_many_concurrent_streams_survive_preemption(stack, model_dirs) -> None:
    """64 streams on two pools of 47 usable blocks: they cannot all fit, so
    running sequences are preempted and recomputed; outputs stay exact."""
    prompts = [
        list(f"request {i}: ".encode()) + PROMPTS[i % 3][: 5 + 7 * (i % 6)] for i in range(64)
    ]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = collect(stack.stub, greedy_request(prompts[i], 20))[0][0]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    for i, prompt in enumerate(prompts):
        assert results[i] == hf_greedy(model_dirs["llama"], prompt, 20), i
    stats = assert_nothing_held(stack.stub)
    assert stats.num_preemptions > 0


def test_parallel_samples_share_the_prompt(stack) -> None:
    request = greedy_request(PROMPTS[2], 8)
    request.sampling.n = 4
    tokens, chunks = collect(stack.stub, request)
    assert sorted(tokens) == [0, 1, 2, 3]
    # Greedy: all four samples are the same continuation.
    assert all(tokens[i] == tokens[0] for i in range(4))
    assert chunks[-1].usage.completion_tokens == 32
    assert_nothing_held(stack.stub)


def reference_beam_search(
    model_dir: Path, prompt: list[int], width: int, max_tokens: int
) -> list[tuple[float, list[int]]]:
    """Beam search by full Hugging Face forwards, with the service's rule:
    every beam's top 2 x width tokens, the best width (beam, token) pairs
    survive (ties: earlier beam, lower token id)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    beams: list[tuple[float, list[int]]] = [(0.0, [])]
    for _ in range(max_tokens):
        scored = []
        for order, (score, output) in enumerate(beams):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
            top = torch.log_softmax(logits, -1).topk(2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                scored.append((score + logprob, order, token, output))
        scored.sort(key=lambda item: (-item[0], item[1], item[2]))
        beams = [(score, [*output, token]) for score, _, token, output in scored[:width]]
    return sorted(beams, key=lambda beam: -beam[0])


def test_beam_search_matches_a_reference_search(stack, model_dirs) -> None:
    request = greedy_request(PROMPTS[0], 6)
    request.sampling.beam_width = 3
    _, chunks = collect(stack.stub, request)
    final = chunks[-1]
    assert all(not chunk.outputs for chunk in chunks)
    scores = [beam.cumulative_logprob for beam in final.beams]
    assert scores == sorted(scores, reverse=True)
    expected = reference_beam_search(model_dirs["llama"], PROMPTS[0], 3, 6)
    assert [list(beam.token_ids) for beam in final.beams] == [out for _, out in expected]
    for beam, (score, _) in zip(final.beams, expected, strict=True):
        assert beam.cumulative_logprob == pytest.approx(score, abs=1e-3)
        assert beam.finish_reason == FinishReason.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == 18
    assert_nothing_held(stack.stub)


def test_abort_and_cancel_free_everything(stack) -> None:
    stub = stack.stub
    call = stub.Generate(greedy_request(PROMPTS[0], 500, request_id="long"), timeout=600)
    first = next(call)
    assert first.request_id == "long"
    assert stub.Abort(scheduler_pb2.AbortRequest(request_id="long")).aborted
    rest = list(call)
    assert rest[-1].outputs[-1].finish_reason == FinishReason.FINISH_REASON_ABORT
    assert not stub.Abort(scheduler_pb2.AbortRequest(request_id="long")).aborted
    assert_nothing_held(stub)

    call = stub.Generate(greedy_request(PROMPTS[1], 500), timeout=600)
    next(call)
    call.cancel()  # the client goes away
    for _ in range(200):
        stats = stub.GetStats(scheduler_pb2.GetStatsRequest())
        if stats.num_running == 0:
            break
        threading.Event().wait(0.05)
    assert_nothing_held(stub)


@pytest.mark.parametrize(
    ("mutate", "code", "field"),
    [
        (lambda r: r.ClearField("token_ids"), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (lambda r: r.token_ids.ClearField("ids"), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (
            lambda r: r.token_ids.ids.append(10_000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt.token_ids.ids[3]",
        ),
        (
            lambda r: setattr(r.sampling, "max_tokens", 5000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.max_tokens",
        ),
        (
            lambda r: setattr(r.sampling, "max_tokens", 0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.max_tokens",
        ),
        (
            lambda r: setattr(r.sampling, "temperature", -1.0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.temperature",
        ),
        (
            lambda r: setattr(r.sampling, "top_p", 1.5),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.top_p",
        ),
        (
            lambda r: setattr(r, "preferred_executor", "x" * 300),
            grpc.StatusCode.INVALID_ARGUMENT,
            "preferred_executor",
        ),
        (
            lambda r: setattr(r.sampling, "top_p", 0.0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.top_p",
        ),
        (
            lambda r: setattr(r.sampling, "top_k", 100_000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.top_k",
        ),
        (lambda r: setattr(r.sampling, "n", 1000), grpc.StatusCode.INVALID_ARGUMENT, "sampling.n"),
        (
            lambda r: (setattr(r.sampling, "n", 2), setattr(r.sampling, "beam_width", 2)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.n",
        ),
        (
            lambda r: setattr(r.sampling, "logprobs", 1000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.logprobs",
        ),
        (
            lambda r: r.sampling.stop_token_ids.append(99_999),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.stop_token_ids[0]",
        ),
        (lambda r: r.token_ids.ids.extend([1] * 900), grpc.StatusCode.RESOURCE_EXHAUSTED, "prompt"),
    ],
)
def test_bad_requests_get_their_code(stack, mutate, code, field) -> None:
    request = greedy_request([1, 2, 3], 4)
    mutate(request)
    with pytest.raises(grpc.RpcError) as info:
        list(stack.stub.Generate(request, timeout=60))
    assert info.value.code() == code
    assert info.value.details().startswith(field), info.value.details()


def test_duplicate_request_id_is_refused(stack) -> None:
    call = stack.stub.Generate(greedy_request(PROMPTS[0], 300, request_id="twin"), timeout=600)
    next(call)
    with pytest.raises(grpc.RpcError) as info:
        list(stack.stub.Generate(greedy_request([1, 2], 2, request_id="twin"), timeout=60))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert info.value.details().startswith("request_id")
    call.cancel()


def test_grpcurl_lists_the_services_and_generates(stack) -> None:
    grpcurl = str(Path(sys.executable).parent / "grpcurl")
    listed = subprocess.run(
        [grpcurl, "-plaintext", stack.target, "list"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert "pagedkv.v1.Scheduler" in listed
    assert "grpc.health.v1.Health" in listed
    body = json.dumps(
        {"tokenIds": {"ids": [72, 105]}, "sampling": {"maxTokens": 3, "temperature": 0}}
    )
    out = subprocess.run(
        [grpcurl, "-plaintext", "-d", body, stack.target, "pagedkv.v1.Scheduler/Generate"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    decoder, chunks, position = json.JSONDecoder(), [], 0
    while out[position:].strip():
        chunk, position = decoder.raw_decode(out, out.index("{", position))
        chunks.append(chunk)
    assert chunks[-1]["usage"]["completion_tokens"] == 3, out


def test_an_executor_killed_mid_run_hands_its_requests_over(model_dirs) -> None:
    model = model_dirs["llama"]
    with (
        ExecutorProcess(model, num_blocks=64) as first,
        ExecutorProcess(model, num_blocks=64) as second,
    ):
        args = ["scheduler", "--executor", first.target, "--executor", second.target, "--port", "0"]
        with Process([*args, "--model", str(model)]) as scheduler:
            calls = [
                scheduler.stub.Generate(greedy_request(p, 40), timeout=600)
                for p in (PROMPTS * 3)[:6]
            ]
            firsts = [next(call) for call in calls]
            first.process.send_signal(signal.SIGKILL)
            for prompt, head, call in zip((PROMPTS * 3)[:6], firsts, calls, strict=True):
                tokens = list(head.outputs[0].token_ids)
                for chunk in call:
                    for output in chunk.outputs:
                        tokens.extend(output.token_ids)
                assert tokens == hf_greedy(model, prompt, 40)
            stats = assert_nothing_held(scheduler.stub)
            assert [e.healthy for e in stats.executors].count(True) == 1


def wait_until_idle(stub) -> None:
    for _ in range(400):
        if stub.GetStats(scheduler_pb2.GetStatsRequest()).num_running == 0:
            return
        threading.Event().wait(0.05)


def test_a_passed_deadline_frees_everything(stack) -> None:
    # The request runs to the pool's bound (about 690 tokens), which takes
    # several times the deadline on these CPU executors.
    with pytest.raises(grpc.RpcError) as info:
        list(stack.stub.Generate(greedy_request(PROMPTS[2], 900), timeout=0.2))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until_idle(stack.stub)
    assert_nothing_held(stack.stub)


def test_losing_the_last_executor_ends_requests_with_unavailable(model_dirs) -> None:
    model = model_dirs["llama"]
    with ExecutorProcess(model, num_blocks=64) as only:
        args = ["scheduler", "--executor", only.target, "--port", "0", "--model", str(model)]
        with Process(args) as scheduler:
            call = scheduler.stub.Generate(greedy_request(PROMPTS[0], 400), timeout=600)
            next(call)
            only.process.send_signal(signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as info:
                list(scheduler.stub.Generate(greedy_request([1, 2], 2), timeout=60))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            stats = scheduler.stub.GetStats(scheduler_pb2.GetStatsRequest())
            assert [e.healthy for e in stats.executors] == [False]


def test_metrics_are_served_for_prometheus(stack) -> None:
    import re
    import urllib.request

    collect(stack.stub, greedy_request(PROMPTS[1], 4))
    port = re.search(r"metrics on :(\d+)", stack.ready_line)
    assert port is not None, stack.ready_line
    body = urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics").read().decode()
    for name in (
        "pagedkv_kv_cache_usage",
        "pagedkv_num_running_requests",
        "pagedkv_prefix_cache_hits_total",
        "pagedkv_time_to_first_token_seconds_bucket",
        "pagedkv_inter_token_latency_seconds_bucket",
        "pagedkv_step_seconds_bucket",
        "pagedkv_preemptions_total",
    ):
        assert name in body, name
    # The executor's blocks, set once when it was taken over (float32 on the CPU).
    assert re.search(r'pagedkv_kv_cache_blocks\{dtype="float32",executor="[^"]+"\} \d', body)
