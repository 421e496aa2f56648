"""``pagedkv bench serve --gateway``: the HTTP client's reading of server-sent
events, the gateway's CPU measure, the presets' tokenizer, and a reduced run
through a real ``pagedkv gateway`` in front of a real ``pagedkv serve``."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import pytest

from pagedkv.bench.scheduler.serving.cli import register
from pagedkv.bench.scheduler.serving.gateway import cpu_seconds
from pagedkv.bench.scheduler.serving.http_load import _Stream, spread
from pagedkv.bench.scheduler.serving.run import main
from pagedkv.bench.scheduler.serving.stack import model_dir, word_tokenizer


def _event(text: str | None = None, usage: dict[str, int] | None = None) -> bytes:
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": None}]
    body: dict[str, object] = {"id": "cmpl-1", "object": "text_completion", "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


BODY = (
    b": a comment\n\n"
    + _event(" a b")
    + _event("")  # no text yet: not a token-bearing event
    + _event(" c")
    + _event(usage={"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7})
    + b"data: [DONE]\n\n"
)


def test_events_are_read_whole_however_the_body_is_cut() -> None:
    for size in (1, 7, len(BODY)):
        stream = _Stream(start=time.perf_counter())
        for at in range(0, len(BODY), size):
            stream.feed(BODY[at : at + size])
        assert len(stream.event_times) == 2, size
        assert stream.usage == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
        assert stream.done and stream.error == "" and stream.buffer == b""


def test_an_error_event_is_the_requests_error() -> None:
    stream = _Stream(start=time.perf_counter())
    error = {"error": {"message": "the scheduler is stopping", "type": "service_unavailable"}}
    stream.feed(_event(" a") + b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
    assert stream.error == "service_unavailable: the scheduler is stopping"
    assert stream.usage is None and stream.done


def test_the_usage_tokens_are_spread_over_the_events_the_earliest_taking_the_remainder() -> None:
    assert spread(10, 4) == (3, 3, 2, 2)
    assert spread(8, 8) == (1,) * 8
    assert spread(5, 0) == ()
    assert sum(spread(256, 37)) == 256


def test_cpu_seconds_count_this_process_work() -> None:
    before = cpu_seconds(os.getpid())
    busy_until = time.process_time() + 0.1
    while time.process_time() < busy_until:
        pass
    assert cpu_seconds(os.getpid()) > before


def test_the_presets_tokenizer_has_the_whole_vocabulary_and_decodes_words() -> None:
    tokenizer = word_tokenizer(32000)
    vocab = tokenizer.get_vocab()
    assert tokenizer.get_vocab_size() == len(vocab) == 32000
    assert sorted(vocab.values()) == list(range(32000))
    assert tokenizer.decode([256, 257, 256 + 26]) == " a b aa"
    assert all(tokenizer.id_to_token(i) is not None for i in (0, 255, 31999))


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(), "serve")
    return parser.parse_args(["serve", *argv])


def test_a_presets_directory_loads_with_transformers_auto_tokenizer() -> None:
    # Load generators (guidellm) tokenize their prompts with AutoTokenizer.
    from transformers import AutoTokenizer

    args = _args(["--preset", "llama-1.1b"])
    with model_dir(args) as model:
        tokenizer = AutoTokenizer.from_pretrained(model)
        assert tokenizer.decode([256, 257, 256 + 26]) == " a b aa"
        assert len(tokenizer) == 32000
    assert args.load_format == "dummy"


def test_a_sweep_is_refused_with_the_gateway(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_args(["--sweep", "1:2", "--gateway"])) == 2
    assert "--sweep runs over gRPC only" in capsys.readouterr().err


@pytest.mark.slow
def test_a_reduced_run_through_the_gateway_compares_it_with_grpc(tmp_path: Path) -> None:
    from pagedkv.executor.tiny_model import MAX_POSITION_EMBEDDINGS, make_tiny_model

    model = tmp_path / "model"
    make_tiny_model(model, "llama", seed=7)
    output = tmp_path / "serve-gateway-cpu.json"
    too_long = MAX_POSITION_EMBEDDINGS + 8  # the second batch is refused both ways
    argv = ["--model", str(model), "--gateway", "--http-clients", "2", "--gateway-probe", "3"]
    argv += ["--rates", "inf", "--num-requests", "3"]
    argv += ["--mean-prompt-len", "20", "--mean-output-len", "6", "--system-prompt-len", "16"]
    argv += ["--warmup-requests", "2", "--fixed-batch", f"3x12x5,2x{too_long}x3", "--no-hf"]
    argv += ["--num-blocks", "128", "--decode-window", "1", "--grpc-text", "--output", str(output)]
    assert main(_args(argv)) == 1  # the refused batch
    report = json.loads(output.read_text())
    assert report["settings"]["gateway"] is True and report["settings"]["grpc_text"] is True
    assert {"pagedkv-gateway", "aiohttp"} <= set(report["machine"])
    (rate,) = report["rates"]
    for summary in (rate["summary"], rate["http"]["summary"]):
        assert summary["num_ok"] == summary["num_requests"] == 3
    # The HTTP run's requests, dealt out to two client processes, come back in order.
    assert [r["id"] for r in rate["http"]["requests"]] == ["mix-3", "mix-4", "mix-5"]
    assert [r["output"] for r in rate["http"]["requests"]] == [
        r["max_tokens"] for r in rate["http"]["requests"]
    ]
    done, refused = report["fixed_batches"]
    for summary in (done["pagedkv"], done["http"]):
        assert summary["num_ok"] == 3 and summary["errors"] == []
        assert summary["output_tokens"] == 15 and summary["num_wrong_token_counts"] == 0
        assert 1 <= summary["num_chunks"] <= 15
        assert summary["ttft_ms"]["p50"] is not None and summary["client_cpu_s"] >= 0
    assert done["http"]["gateway_cpu_s"] >= 0 and done["http"]["client_processes"] == 2
    assert set(done["gateway"]) == {
        "output_tokens_per_s_ratio",
        "ttft_p50_delta_ms",
        "ttft_p99_delta_ms",
        "itl_p50_delta_ms",
        "gateway_cpu_s_per_1000_tokens",
    }
    assert done["gateway"]["output_tokens_per_s_ratio"] > 0
    assert refused["pagedkv"]["num_failed"] == refused["http"]["num_failed"] == 2
    assert refused["http"]["first_error"].startswith("HTTP 400: ")
    probe = report["gateway_probe"]
    assert probe["grpc"]["num_ok"] == probe["http"]["num_ok"] == 3
    assert probe["ttft_p50_added_ms"] is not None and probe["latency_p50_added_ms"] is not None
    text = output.with_suffix(".md").read_text()
    assert "## One request at a time: what the gateway adds" in text
    assert "| pagedkv gateway (HTTP) | 3 x (12 -> 5) | 3/3 |" in text
    assert "## Through the gateway (HTTP) against gRPC, same stack" in text
    assert "over gRPC (with the outputs' text)" in text
    assert f"- fixed batch 2 x ({too_long} -> 3) over HTTP: 2 of 2 requests failed" in text
    assert output.with_suffix(".png").stat().st_size > 0
