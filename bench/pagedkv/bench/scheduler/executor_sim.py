"""A simulated executor for the benchmarks that drive the real scheduler.

The block benchmark (``blocks.py``), the step profile (``steps.py``) and the
router's cluster simulation run the service's own ``ExecutorScheduler``:
``add`` a sequence, ``schedule()`` a step, ``process`` the executor's
answer. No executor is behind it; this module stands in for one:

- ``executor_info``: the GetInfo answer a scheduler is built from (a
  llama-like model; no weights anywhere), and ``simulated_scheduler`` the
  scheduler built from it;
- ``answers``: what an executor answers to a scheduled step (its copy-only
  messages first), a token for every entry that asks for a sample, in each
  step of a decode window;
- ``apply_answers``: the scheduler's side, as the service's step loop does
  it (``process``, whose first error is raised here);
- ``generation``: a Generate call with one sequence, as the service makes
  one, for ``ExecutorScheduler.add``.

Sampled tokens are a fixed function of the step and the row: any id will
do, since no generation here has a stop token.
"""

from __future__ import annotations

from pagedkv.common.step_contract import ONE_STEP
from pagedkv.common.text import IncrementalDetokenizer, TextTokenizer
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler, ScheduledStep
from pagedkv.scheduler.sequence import Generation, Sequence
from pagedkv.v1 import common_pb2, executor_pb2

BLOCK_SIZE = 16
VOCAB_SIZE = 32_000


def executor_info(
    num_blocks: int,
    max_num_rows: int,
    *,
    block_size: int = BLOCK_SIZE,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 8192,
    model_id: str = "bench",
) -> executor_pb2.GetInfoResponse:
    """A GetInfo answer for a 22-layer llama-like model (no executor behind it)."""
    return executor_pb2.GetInfoResponse(
        model_id=model_id,
        dtype="bfloat16",
        max_model_len=max_model_len,
        vocab_size=VOCAB_SIZE,
        eos_token_ids=[2],
        block_size=block_size,
        num_blocks=num_blocks,
        kv_cache_groups=[
            common_pb2.KVCacheSpec(
                block_size=block_size,
                layer_indices=list(range(22)),
                num_kv_heads=4,
                head_size=64,
                dtype="bfloat16",
            )
        ],
        max_num_rows=max_num_rows,
        max_num_batched_tokens=max_num_batched_tokens,
        max_logprobs=20,
    )


def simulated_scheduler(
    info: executor_pb2.GetInfoResponse, *, decode_window: int = ONE_STEP
) -> ExecutorScheduler:
    """The service's scheduler over an executor that ``info`` describes (as
    ``executor_info`` makes it), within the executor's own limits."""
    return ExecutorScheduler(
        "bench",
        info,
        common_pb2.Owner(owner_id="bench", epoch=1),
        max_num_seqs=info.max_num_rows,
        max_num_batched_tokens=info.max_num_batched_tokens,
        decode_window=decode_window,
    )


def sampled_rows(message: executor_pb2.StepRequest) -> list[int]:
    """The rows of a response's samples, in order: each entry that asks for
    a sample, once per step of a decode window."""
    rows = [r.row for r in message.new_requests] + list(message.rows)
    sampled = [row for row, needs in zip(rows, message.needs_sample, strict=True) if needs]
    return sampled * max(1, message.num_decode_steps)


def step_response(
    message: executor_pb2.StepRequest, tokens: list[int]
) -> executor_pb2.StepResponse:
    """An executor's answer to ``message`` sampling ``tokens`` (one per
    ``sampled_rows``), with no top logprobs."""
    rows = sampled_rows(message)
    return executor_pb2.StepResponse(
        step_id=message.step_id,
        sampled_rows=rows,
        sampled_token_ids=tokens,
        sampled_logprobs=[-1.0] * len(rows),
        num_top_logprobs=[0] * len(rows),
    )


def response_for(message: executor_pb2.StepRequest, token_id: int) -> executor_pb2.StepResponse:
    """What an executor answers: a token for every entry that asks for a
    sample, in each step of a window."""
    rows = sampled_rows(message)
    width = len(rows) // max(1, message.num_decode_steps)
    return step_response(
        message, [(token_id + k // width + row) % VOCAB_SIZE for k, row in enumerate(rows)]
    )


def answers(
    step: ScheduledStep, token_id: int
) -> list[tuple[ScheduledStep, executor_pb2.StepResponse]]:
    """The executor's answers to ``step``, in the order they come back: its
    copy-only messages (``ScheduledStep.before``) first, then the step."""
    early = [(ScheduledStep(message), response_for(message, token_id)) for message in step.before]
    return [*early, (step, response_for(step.request, token_id))]


def apply_answers(
    scheduler: ExecutorScheduler, replies: list[tuple[ScheduledStep, executor_pb2.StepResponse]]
) -> set[Generation]:
    """Applies the answers to one step (see ``answers``) as the service's step
    loop does; returns the generations with news. Raises the first error
    ``process`` reports (a bug of the scheduler's own code)."""
    touched: set[Generation] = set()
    for sent, response in replies:
        news, errors = scheduler.process(sent, response)
        if errors:
            raise errors[0][1]
        touched |= news
    return touched


def generation(
    scheduler: ExecutorScheduler,
    key: int,
    prompt: list[int],
    max_tokens: int,
    tokenizer: TextTokenizer | None = None,
    *,
    arrival: float | None = None,
    cache_salt: str | None = None,
) -> Generation:
    """A greedy Generate call with one sequence, ``key`` its serial number
    (unique in ``scheduler``), its request made by the scheduler's block
    core (its prompt hashed, under ``cache_salt`` if given). ``arrival``:
    when it came (the scheduler's order among equal priorities); default
    now."""
    gen = Generation(
        request_id=f"r{key}",
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(temperature=0.0),
        max_tokens=max_tokens,
        n=1,
        priority=0,
        cache_salt=cache_salt or "",
        eos_token_ids=frozenset(),
        stop_token_ids=frozenset(),
        key=key,
    )
    if arrival is not None:
        gen.arrival = arrival
    request = scheduler.kv.make_request(
        gen.new_seq_id(), prompt, cache_salt=cache_salt, max_tokens=max_tokens
    )
    detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
    gen.sequences.append(Sequence(gen, 0, request, detokenizer=detokenizer))
    return gen
