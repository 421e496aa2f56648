"""A decode window's samples, applied sequence by sequence, end every
sequence where the same samples applied one step at a time do: at its first
stop token, else at its length limit, with the same finish reason and stop
token; and every block comes back."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.bench.scheduler.executor_sim import sampled_rows, step_response
from pagedkv.v1 import common_pb2, executor_pb2, scheduler_pb2
from tests.scheduler.stepping import add_generation, live_scheduler, run_to_end

EOS, STOP = 7, 9


class RowStreams:
    """An executor stand-in: each row's samples come from its sequence's own
    token stream (by sequence id), in order, whatever steps they come in."""

    def __init__(self, streams: dict[str, list[int]]) -> None:
        self.streams = streams
        self.seq_of: dict[int, str] = {}
        self.next: dict[int, int] = {}

    def respond(self, message: executor_pb2.StepRequest) -> executor_pb2.StepResponse:
        for new in message.new_requests:
            self.seq_of[new.row] = new.seq_id
            self.next[new.row] = 0
        tokens = []
        for row in sampled_rows(message):
            stream = self.streams[self.seq_of[row]]
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
    scheduler = live_scheduler(512, max_num_batched_tokens=8192, decode_window=decode_window)
    generations, by_seq = [], {}
    for key, request_id in enumerate(sorted(streams)):
        sampling = common_pb2.SamplingParams(temperature=0.0)
        if request_id in logprobs:
            sampling.logprobs = 0
        prompt = [3 + key] * 20
        gen = add_generation(
            scheduler,
            request_id,
            prompt,
            max_tokens[request_id],
            key=key + 1,
            sampling=sampling,
            eos_token_ids={EOS},
            stop_token_ids={STOP},
        )
        generations.append(gen)
        by_seq[gen.sequences[0].seq_id] = streams[request_id]
    sent = run_to_end(scheduler, generations, RowStreams(by_seq).respond, depth=2)
    num_windows = sum(step.request.num_decode_steps > 1 for step in sent)
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
