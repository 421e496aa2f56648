"""A decode window's samples, applied sequence by sequence, end every
sequence where the same samples applied one step at a time do: at its first
stop token, else at its length limit, with the same finish reason and stop
token; and every block comes back."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.scheduler.bench.steps import executor_info, sampled_rows, step_response
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler, ScheduledStep
from pagedkv.scheduler.sequence import Generation, Sequence
from pagedkv.v1 import common_pb2, executor_pb2, scheduler_pb2

EOS, STOP = 7, 9


class RowStreams:
    """An executor stand-in: each row's samples come from its request's own
    token stream, in order, whatever steps they come in."""

    def __init__(self, streams: dict[str, list[int]]) -> None:
        self.streams = streams
        self.request_of: dict[int, str] = {}
        self.next: dict[int, int] = {}

    def respond(self, message: executor_pb2.StepRequest) -> executor_pb2.StepResponse:
        for new in message.new_requests:
            self.request_of[new.row] = new.request_id
            self.next[new.row] = 0
        tokens = []
        for row in sampled_rows(message):
            stream = self.streams[self.request_of[row]]
            tokens.append(stream[self.next[row] % len(stream)])
            self.next[row] += 1
        return step_response(message, tokens)


def run(
    decode_window: int,
    streams: dict[str, list[int]],
    max_tokens: dict[str, int],
    logprobs: set[str],
) -> dict[str, tuple[list[int], int, int | None] | int]:
    """Every request to its end, two steps in flight; each one's output tokens
    and finish reason, and the number of windows sent."""
    scheduler = ExecutorScheduler(
        "test",
        executor_info(num_blocks=512, max_num_rows=16),
        common_pb2.Owner(owner_id="test", epoch=1),
        max_num_seqs=16,
        max_num_batched_tokens=8192,
        decode_window=decode_window,
    )
    generations = []
    for key, request_id in enumerate(sorted(streams)):
        sampling = common_pb2.SamplingParams(temperature=0.0)
        if request_id in logprobs:
            sampling.logprobs = 0
        gen = Generation(
            request_id=request_id,
            prompt_token_ids=[3 + key] * 20,
            sampling=sampling,
            max_tokens=max_tokens[request_id],
            n=1,
            priority=0,
            cache_salt="",
            eos_token_ids=frozenset({EOS}),
            stop_token_ids=frozenset({STOP}),
            key=key + 1,
        )
        request = scheduler.kv.make_request(
            request_id, gen.prompt_token_ids, max_tokens=gen.max_tokens
        )
        gen.sequences.append(Sequence(gen, 0, request))
        generations.append(gen)
        scheduler.add(gen.sequences[0])
    executor = RowStreams(streams)
    inflight: deque[tuple[ScheduledStep, executor_pb2.StepResponse]] = deque()
    num_windows = 0
    while True:
        step = scheduler.schedule()
        if step is not None:
            assert not step.before
            num_windows += step.request.num_decode_steps > 1
            inflight.append((step, executor.respond(step.request)))
        if not inflight:
            break
        if step is None or len(inflight) >= 2:
            sent, answer = inflight.popleft()
            _, errors = scheduler.process(sent, answer)
            assert not errors
    assert all(s.finished for g in generations for s in g.sequences)
    assert decode_window > 1 or not num_windows
    assert scheduler.kv.check_integrity().ok
    assert scheduler.kv.pool.get_num_free_blocks() == 511  # all but the null block
    outputs: dict[str, tuple[list[int], int, int | None] | int] = {"windows": num_windows}
    for gen in generations:
        seq = gen.sequences[0]
        outputs[gen.request_id] = (
            list(seq.request.token_ids[20:]),
            seq.finish_reason,
            seq.stop_token_id,
        )
    return outputs


tokens = st.lists(st.sampled_from([11, 12, 13, EOS, STOP]), min_size=1, max_size=12)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    streams=st.lists(tokens, min_size=1, max_size=6),
    lengths=st.lists(st.integers(1, 14), min_size=6, max_size=6),
    window=st.sampled_from([2, 4, 8]),
    logprobs=st.integers(0, 63),
)
def test_windows_end_each_sequence_where_single_steps_do(
    streams: list[list[int]], lengths: list[int], window: int, logprobs: int
) -> None:
    named = {f"r{i}": stream for i, stream in enumerate(streams)}
    max_tokens = {name: lengths[i] for i, name in enumerate(named)}
    with_logprobs = {name for i, name in enumerate(named) if logprobs >> i & 1}
    windowed = run(window, named, max_tokens, with_logprobs)
    single = run(1, named, max_tokens, with_logprobs)
    assert {**windowed, "windows": 0} == single


def test_a_window_ends_a_sequence_at_its_stop_token_or_its_length() -> None:
    streams = {"stops": [11, 12, STOP, 13], "eos": [EOS], "long": [11]}
    outputs = run(8, streams, {"stops": 10, "eos": 10, "long": 10}, set())
    assert outputs.pop("windows") >= 1
    assert outputs == {
        "stops": ([11, 12, STOP], scheduler_pb2.FinishReason.FINISH_REASON_STOP, STOP),
        "eos": ([EOS], scheduler_pb2.FinishReason.FINISH_REASON_EOS, None),
        "long": ([11] * 10, scheduler_pb2.FinishReason.FINISH_REASON_LENGTH, None),
    }
