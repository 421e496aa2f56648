"""Stop strings (``sampling.stop``) on a real ``pagedkv serve`` stack (one
CPU executor, the tiny llama, decode windows of 8 as by default): a request
with stop strings gets the text and tokens of the same request without them,
cut where the first stop string ends, for one sequence (in decode windows:
the samples after the stop are dropped) and for each of n = 2; every block
comes back; invalid stop strings are refused naming the field.

The tiny model's tokenizer maps byte ``b`` to token ``b`` (0..255), so its
multi-byte characters span tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest

from pagedkv.client import Client
from pagedkv.common.cli import main
from pagedkv.v1 import common_pb2, scheduler_pb2
from tests.executor.test_generation import model_dirs
from tests.service.stack import Process, serve
from tests.service.test_stack import assert_nothing_held, collect

__all__ = ["model_dirs"]  # the session fixture, shared with the executor tests

FinishReason = scheduler_pb2.FinishReason
PROMPT = "Stop here, or there"
NUM_TOKENS = 48
STOP = FinishReason.FINISH_REASON_STOP


@pytest.fixture(scope="module")
def stack(model_dirs: dict[str, Path]):
    with serve(model_dirs["llama"], executors=1, num_blocks=128) as process:
        yield process


def request(**sampling: object) -> scheduler_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, **sampling)  # type: ignore[arg-type]
    return scheduler_pb2.GenerateRequest(text=PROMPT, sampling=params)


def outputs(
    chunks: list[scheduler_pb2.GenerateResponse],
) -> dict[int, tuple[list[int], str, scheduler_pb2.SequenceOutput]]:
    """Each sequence's tokens, text and finishing output."""
    joined: dict[int, tuple[list[int], str, scheduler_pb2.SequenceOutput]] = {}
    for chunk in chunks:
        for output in chunk.outputs:
            tokens, text, _ = joined.get(output.index, ([], "", output))
            joined[output.index] = (
                tokens + list(output.token_ids),
                text + output.text_delta,
                output,
            )
    return joined


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, int, str] | None:
    """(end, start, stop) of the stop string that ends first in ``text``."""
    found = [(i + len(s), i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(found, default=None)


def text_upto(tokens: list[int], num_chars: int) -> int:
    """How many of ``tokens`` make the text's first ``num_chars`` characters
    whole: up to the token that completes the last of them."""
    for k in range(len(tokens) + 1):
        text = bytes(t for t in tokens[:k] if t < 256).decode(errors="replace")
        if len(text.rstrip("\ufffd")) >= num_chars:
            return k
    raise AssertionError("the text is shorter")


def stop_in(text: str, length: int, after: int) -> str:
    """The first substring of ``text`` of ``length`` characters, none of them
    U+FFFD (the random model writes invalid UTF-8), from character ``after`` on."""
    for start in range(after, len(text) - length + 1):
        stop = text[start : start + length]
        if "\ufffd" not in stop:
            return stop
    raise AssertionError(f"no clean substring in {text!r}")


def assert_cut_at_stop(
    stack: Process, sampling: dict[str, object], stops: list[str], include: bool
) -> None:
    plain = outputs(collect(stack.stub, request(**sampling))[1])
    stopped = outputs(
        collect(stack.stub, request(**sampling, stop=stops, include_stop_str_in_output=include))[1]
    )
    assert stopped.keys() == plain.keys()
    for index, (tokens, text, _) in plain.items():
        got_tokens, got_text, last = stopped[index]
        match = first_stop(text, stops)
        if match is None:
            assert (got_tokens, got_text) == (tokens, text)
            assert last.finish_reason == FinishReason.FINISH_REASON_LENGTH
            continue
        end, start, stop = match
        assert got_text == text[: end if include else start]
        assert got_tokens == tokens[: text_upto(tokens, end)]
        assert (last.finish_reason, last.stop_string) == (STOP, stop)
        assert not last.HasField("stop_token_id")
    assert_nothing_held(stack.stub)


def test_a_stop_string_cuts_the_text_and_drops_the_window_after_it(stack: Process) -> None:
    _, text, _ = outputs(collect(stack.stub, request(temperature=0.0))[1])[0]
    assert_cut_at_stop(stack, {"temperature": 0.0}, [stop_in(text, 3, 9)], include=False)
    assert_cut_at_stop(stack, {"temperature": 0.0}, [stop_in(text, 3, 9)], include=True)


def test_the_stop_string_that_ends_first_wins(stack: Process) -> None:
    _, text, _ = outputs(collect(stack.stub, request(temperature=0.0))[1])[0]
    # One a prefix of the other, and one that starts earlier but ends later.
    long = stop_in(text, 4, 12)
    start = text.find(long)
    stops = [long, long[:2], text[start - 1 : start + 5]]
    assert_cut_at_stop(stack, {"temperature": 0.0}, stops, include=False)


def test_each_of_n_sequences_stops_at_its_own_stop_string(stack: Process) -> None:
    sampling = {"temperature": 1.0, "seed": 5, "n": 2}
    plain = outputs(collect(stack.stub, request(**sampling))[1])
    stops = [stop_in(plain[0][1], 2, 6), stop_in(plain[1][1], 2, 20)]
    assert_cut_at_stop(stack, sampling, stops, include=False)


def test_a_stop_string_never_reached_gives_the_whole_text(stack: Process) -> None:
    assert_cut_at_stop(stack, {"temperature": 0.0}, ["\u2603never\u2603"], include=False)


def test_the_sdk_passes_stop_strings(stack: Process) -> None:
    _, text, _ = outputs(collect(stack.stub, request(temperature=0.0))[1])[0]
    stop = stop_in(text, 2, 10)
    with Client(stack.target) as client:
        completion = client.generate_text(
            PROMPT, max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, stop=stop
        )
    assert completion.text == text[: text.find(stop)]
    assert completion.finish_reasons == ("stop",)
    assert completion.stop_strings == (stop,)


def test_a_resumed_stream_delivers_the_text_the_broken_one_held_back(stack: Process) -> None:
    tokens, text, _ = outputs(collect(stack.stub, request(temperature=0.0))[1])[0]
    stop = stop_in(text, 3, 12)
    start = text.find(stop)
    # The broken stream had delivered the tokens up to the stop string's first
    # character, and of their text all but what may still become the stop.
    k = text_upto(tokens, start + 1)
    whole = text[: start + 1]
    held = next(whole[i:] for i in range(len(whole) + 1) if stop.startswith(whole[i:]))
    resumed = request(temperature=0.0, stop=[stop])
    resumed.resumed_token_ids.extend(tokens[:k])
    (got_tokens, got_text, last), *_ = outputs(collect(stack.stub, resumed)[1]).values()
    assert got_text == text[len(whole) - len(held) : start]
    assert got_tokens == tokens[k : text_upto(tokens, start + len(stop))]
    assert (last.finish_reason, last.stop_string) == (STOP, stop)
    assert_nothing_held(stack.stub)


def test_the_generate_command_passes_stop_strings(
    stack: Process, capsys: pytest.CaptureFixture[str]
) -> None:
    _, text, _ = outputs(collect(stack.stub, request(temperature=0.0))[1])[0]
    stop = stop_in(text, 2, 10)
    args = ["generate", "--target", stack.target, "--prompt", PROMPT, "--json"]
    args += ["--max-tokens", str(NUM_TOKENS), "--temperature", "0", "--ignore-eos"]
    assert main([*args, "--stop", "\u2603", "--stop", stop, "--include-stop-str-in-output"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    sequences = [seq for line in lines for seq in line["sequences"]]
    assert "".join(seq["text"] for seq in sequences) == text[: text.find(stop) + len(stop)]
    assert (sequences[-1]["finish_reason"], sequences[-1]["stop_string"]) == ("stop", stop)


@pytest.mark.parametrize(
    ("sampling", "skip_text", "field"),
    [
        ({"stop": ["x"] * 17}, False, "sampling.stop: 17 stop strings > 16"),
        ({"stop": ["x", ""]}, False, "sampling.stop[1]: empty"),
        ({"stop": ["x" * 257]}, False, "sampling.stop[0]: 257 characters > 256"),
        ({"stop": ["x"], "beam_width": 2}, False, "sampling.stop: not supported with beam"),
        ({"stop": ["x"]}, True, "sampling.stop: not supported with skip_text"),
    ],
)
def test_invalid_stop_strings_are_refused_naming_the_field(
    stack: Process, sampling: dict[str, object], skip_text: bool, field: str
) -> None:
    message = request(**sampling)
    message.skip_text = skip_text
    with pytest.raises(grpc.RpcError) as raised:
        collect(stack.stub, message)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in raised.value.details()
