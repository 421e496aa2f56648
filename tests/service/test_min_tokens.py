"""``sampling.min_tokens`` on a real ``pagedkv serve`` stack (one CPU
executor, the tiny llama, decode windows of 8 as by default): the executor
keeps a sequence's stop tokens out of its first min_tokens samples, as
Hugging Face's ``min_new_tokens`` keeps its EOS tokens out (the greedy
outputs are equal), for one sequence and for each of n = 2; stop strings are
not looked for before min_tokens outputs either; invalid values are refused
naming the field."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from pagedkv.client import Client, FinishReason
from pagedkv.v1 import common_pb2, scheduler_pb2
from tests.executor.test_generation import hf_greedy, model_dirs
from tests.service.stack import Process, serve
from tests.service.test_stack import assert_nothing_held, collect
from tests.service.test_stop_strings import stop_in, text_upto

__all__ = ["model_dirs"]  # the session fixture, shared with the executor tests

PROMPT = list(b"At least this many tokens")
NUM_TOKENS = 40


@pytest.fixture(scope="module")
def stack(model_dirs: dict[str, Path]):
    with serve(model_dirs["llama"], executors=1, num_blocks=128) as process:
        yield process


def hf_min_new_tokens(model_dir: Path, stop: int, min_tokens: int) -> list[int]:
    """Hugging Face greedy output that ends at ``stop`` (included), which
    ``min_new_tokens`` keeps out of its first ``min_tokens`` tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=NUM_TOKENS,
            min_new_tokens=min_tokens,
            do_sample=False,
            eos_token_id=[stop],
            pad_token_id=0,
        )
    return list(out[0, len(PROMPT) :].tolist())


def request(**sampling: object) -> scheduler_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(
        temperature=0.0,
        max_tokens=NUM_TOKENS,
        ignore_eos=True,
        **sampling,  # type: ignore[arg-type]
    )
    return scheduler_pb2.GenerateRequest(
        token_ids=scheduler_pb2.TokenIds(ids=PROMPT), sampling=params
    )


def test_stop_tokens_are_kept_out_of_the_first_min_tokens(
    stack: Process, model_dirs: dict[str, Path]
) -> None:
    greedy = hf_greedy(model_dirs["llama"], PROMPT, NUM_TOKENS)
    # A token greedy output first gives at index i: stopping at it ends there.
    i = next(i for i in range(2, NUM_TOKENS) if greedy[i] not in greedy[:i])
    stop, min_tokens = greedy[i], i + 4
    tokens, _ = collect(stack.stub, request(stop_token_ids=[stop]))
    assert tokens[0] == greedy[: i + 1]
    for n in (1, 2):
        tokens, chunks = collect(
            stack.stub, request(stop_token_ids=[stop], min_tokens=min_tokens, n=n)
        )
        expected = hf_min_new_tokens(model_dirs["llama"], stop, min_tokens)
        assert expected[:i] == greedy[:i] and stop not in expected[:min_tokens]
        assert tokens == dict.fromkeys(range(n), expected)
        reason = FinishReason.STOP if expected[-1] == stop else FinishReason.LENGTH
        finishes = [o.finish_reason for c in chunks for o in c.outputs if o.finish_reason]
        assert finishes == [getattr(scheduler_pb2, f"FINISH_REASON_{reason.name}")] * n
    assert_nothing_held(stack.stub)


def test_stop_strings_are_not_looked_for_before_min_tokens(stack: Process) -> None:
    tokens, chunks = collect(stack.stub, request())
    text = "".join(o.text_delta for c in chunks for o in c.outputs)
    stop = stop_in(text, 1, 4)
    # The first match is completed by token k: with min_tokens k + 1 it is
    # not one; the first match completed by a later token is.
    starts = [p for p in range(len(text)) if text.startswith(stop, p)]
    counts = [text_upto(tokens[0], p + len(stop)) for p in starts]
    min_tokens = counts[0] + 1
    later = next((p for p, k in zip(starts, counts, strict=True) if k >= min_tokens), None)
    with Client(stack.target) as client:
        completion = client.generate_text(
            token_ids=PROMPT,
            max_tokens=NUM_TOKENS,
            temperature=0.0,
            ignore_eos=True,
            stop=[stop],
            min_tokens=min_tokens,
        )
    if later is None:
        assert (completion.text, completion.stop_strings) == (text, (None,))
    else:
        assert (completion.text, completion.stop_strings) == (text[:later], (stop,))
    assert_nothing_held(stack.stub)


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"min_tokens": NUM_TOKENS + 1}, f"sampling.min_tokens: {NUM_TOKENS + 1} > max_tokens"),
        ({"min_tokens": 2, "beam_width": 2}, "sampling.min_tokens: not supported with beam"),
    ],
)
def test_invalid_min_tokens_are_refused_naming_the_field(
    stack: Process, sampling: dict[str, object], field: str
) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        collect(stack.stub, request(**sampling))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in raised.value.details()
