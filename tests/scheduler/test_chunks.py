"""A Generate stream's queue: the news of the steps since the stream's last
message leaves as one message made when the stream reads it, a message made
now (a hand-back's) holds the news marked before it, and a stream's pause
ends early for its last message."""

from __future__ import annotations

import asyncio
import time

from pagedkv.common.errors import ServiceError
from pagedkv.scheduler.sequence import Generation, Sequence, SequenceState
from pagedkv.v1 import common_pb2, scheduler_pb2
from tests.scheduler.stepping import live_scheduler

STOP = scheduler_pb2.FinishReason.FINISH_REASON_STOP
ERROR = scheduler_pb2.FinishReason.FINISH_REASON_ERROR


def generation(n: int = 1) -> Generation:
    """A generation of ``n`` sequences on a scheduler (not added to it)."""
    scheduler = live_scheduler(num_blocks=64)
    made = Generation(
        request_id="r",
        prompt_token_ids=[5, 6, 7],
        sampling=common_pb2.SamplingParams(temperature=0.0, n=n),
        max_tokens=8,
        n=n,
        priority=0,
        cache_salt="",
        eos_token_ids=frozenset(),
        stop_token_ids=frozenset({2}),
        key=1,
    )
    for index in range(n):
        request = scheduler.kv.make_request(made.new_seq_id(), [5, 6, 7], max_tokens=8)
        made.sequences.append(Sequence(made, index, request))
    return made


def sample(gen: Generation, index: int, *tokens: int, finish: int | None = None) -> None:
    """Tokens sampled for sequence ``index``, as the step outputs append them."""
    seq = gen.sequences[index]
    seq.state = SequenceState.RUNNING
    seq.request.token_ids.extend(tokens)
    seq.pending_token_ids.extend(tokens)
    if finish is not None:
        seq.finish(finish, tokens[-1] if finish == STOP else None)


def test_the_news_of_several_steps_leaves_as_one_message() -> None:
    async def run() -> scheduler_pb2.GenerateResponse:
        gen = generation(n=2)
        gen.placement = scheduler_pb2.Placement(executor="e0")
        sample(gen, 0, 1)
        sample(gen, 1, 7)
        gen.flush()
        sample(gen, 0, 2)
        gen.flush()
        sample(gen, 0, 3)
        sample(gen, 1, 8, 2, finish=STOP)
        gen.flush()
        assert gen.chunks.qsize() == 1  # one mark for news not read yet
        item = await gen.chunks.get()
        assert gen.chunks.empty()
        assert isinstance(item, scheduler_pb2.GenerateResponse)
        assert gen.take_response() is None  # nothing new since
        return item

    message = asyncio.run(run())
    assert [(o.index, list(o.token_ids)) for o in message.outputs] == [
        (0, [1, 2, 3]),
        (1, [7, 8, 2]),
    ]
    assert message.outputs[1].finish_reason == STOP
    assert message.outputs[1].stop_token_id == 2
    assert message.outputs[0].finish_reason == 0
    assert message.placement.executor == "e0"
    assert not message.HasField("usage")


def test_the_final_message_has_the_usage_and_the_error_follows_it() -> None:
    async def run() -> list[object]:
        gen = generation()
        sample(gen, 0, 1)
        gen.flush()
        sample(gen, 0, 4, 2, finish=STOP)
        gen.flush()
        assert gen.done
        gen.chunks.put_nowait(ServiceError("boom"))
        return [await gen.chunks.get(), await gen.chunks.get()]

    message, error = asyncio.run(run())
    assert isinstance(message, scheduler_pb2.GenerateResponse)
    assert list(message.outputs[0].token_ids) == [1, 4, 2]
    assert message.usage.completion_tokens == 3
    assert message.usage.prompt_tokens == 3
    assert isinstance(error, ServiceError)


def test_a_message_made_now_holds_the_news_before_it() -> None:
    """A hand-back: the news so far in a message that is not final, then the
    sequence finished with an error that no message reports."""
    gen = generation()
    sample(gen, 0, 1)
    gen.flush()
    sample(gen, 0, 3)
    gen.flush_now()
    gen.sequences[0].finish(ERROR, error_message="moved")
    gen.done = True
    assert gen.chunks.qsize() == 1
    message = gen.chunks.get_nowait()
    assert isinstance(message, scheduler_pb2.GenerateResponse)
    assert list(message.outputs[0].token_ids) == [1, 3]
    assert message.outputs[0].finish_reason == 0
    assert not message.HasField("usage")


def test_a_message_that_cannot_be_made_is_an_internal_error() -> None:
    class Broken:
        def push(self, tokens: list[int]) -> str:
            raise RuntimeError("no text")

    gen = generation()
    gen.sequences[0].detokenizer = Broken()  # type: ignore[assignment]
    sample(gen, 0, 1)
    gen.flush()
    error = gen.chunks.get_nowait()
    assert isinstance(error, ServiceError)


def test_a_pause_ends_when_the_final_news_is_marked() -> None:
    async def run() -> float:
        gen = generation()
        sample(gen, 0, 5, 2, finish=STOP)
        asyncio.get_running_loop().call_later(0.01, gen.flush)
        start = time.monotonic()
        await gen.chunks.pause(30.0)
        return time.monotonic() - start

    assert asyncio.run(run()) < 30.0


def test_a_pause_after_the_final_news_is_marked_does_not_wait() -> None:
    async def run() -> None:
        gen = generation()
        sample(gen, 0, 5, 2, finish=STOP)
        gen.flush()
        await asyncio.wait_for(gen.chunks.pause(30.0), timeout=5.0)

    asyncio.run(run())
