"""A validated Generate call made into a ``Generation`` and the executor it
goes to. Neither changes the service's state: ``SchedulerService.submit``
records the generation and queues its first sequence on the chosen
executor."""

from __future__ import annotations

from collections.abc import Mapping

from pagedkv.common.errors import InvalidArgument, ResourceExhausted
from pagedkv.common.logging import get_logger
from pagedkv.common.text import IncrementalDetokenizer, TextTokenizer
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler
from pagedkv.scheduler.request import Request
from pagedkv.scheduler.sequence import Generation, Sequence
from pagedkv.scheduler.stop_strings import StopMatcher
from pagedkv.scheduler.validation import resumed_token_ids, validate_sampling
from pagedkv.v1 import executor_pb2, scheduler_pb2

log = get_logger(__name__)


def new_generation(
    request_id: str,
    prompt: list[int],
    request: scheduler_pb2.GenerateRequest,
    info: executor_pb2.GetInfoResponse,
    tokenizer: TextTokenizer | None,
    schedulers: Mapping[str, ExecutorScheduler],
    key: int,
) -> Generation:
    """The generation of a call whose prompt is ``prompt``, its sequences'
    block-core requests made (``schedulers`` not empty: every executor serves
    ``info``'s model); ``tokenizer`` None makes no text. Raises the service
    errors of invalid sampling (naming the field) and ``ResourceExhausted``
    when no executor's pool could ever hold the prompt.

    A resumed call (``resumed_token_ids``) gets one sequence whose token
    history is the prompt plus the resumed tokens, counted as outputs
    (max_tokens, usage); its detokenizer has skipped their text.

    With stop strings, each sequence's detokenizer is owned by its stop
    matcher (see stop_strings.py), which needs a tokenizer.
    """
    sampling = request.sampling
    valid = validate_sampling(sampling, len(prompt), info)
    if sampling.stop and tokenizer is None:
        why = "skip_text" if request.skip_text else "a model without a tokenizer"
        raise InvalidArgument(f"sampling.stop: not supported with {why}")
    resumed = resumed_token_ids(request, valid, len(prompt), info)
    n, max_tokens = valid.n, valid.max_tokens
    generation = Generation(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=sampling,
        max_tokens=max_tokens,
        n=n,
        priority=request.priority,
        cache_salt=request.cache_salt,
        eos_token_ids=frozenset() if sampling.ignore_eos else frozenset(info.eos_token_ids),
        stop_token_ids=frozenset(sampling.stop_token_ids),
        beam=valid.beam,
        tokenizer=tokenizer,
        key=key,
    )
    kv = next(iter(schedulers.values())).kv  # every executor serves one model
    for index in range(n):
        seq_request = kv.make_request(
            generation.new_seq_id(),
            prompt + resumed,
            cache_salt=request.cache_salt or None,
            max_tokens=max_tokens,
            priority=request.priority,
        )
        seq_request.num_prompt_tokens = len(prompt)  # the resumed tokens are outputs
        generation.sequences.append(_sequence(generation, index, seq_request, resumed))
    history = len(prompt) + len(resumed)
    needed = -(-(history + 1) // info.block_size) + n
    usable = max(s.info.num_blocks - 1 for s in schedulers.values())
    if needed > usable:
        raise ResourceExhausted(
            f"prompt: {history} tokens need {needed} blocks; executors have at most {usable}"
        )
    return generation


def _sequence(generation: Generation, index: int, request: Request, resumed: list[int]) -> Sequence:
    """Sequence ``index`` with its text maker (none without a tokenizer),
    past the ``resumed`` tokens' text."""
    tokenizer = generation.tokenizer
    if tokenizer is None:
        return Sequence(generation, index, request)
    detokenizer = IncrementalDetokenizer(tokenizer)
    sampling = generation.sampling
    if not sampling.stop:
        detokenizer.skip(resumed)
        return Sequence(generation, index, request, detokenizer=detokenizer)
    matcher = StopMatcher(detokenizer, sampling.stop, sampling.include_stop_str_in_output)
    matcher.skip(resumed)
    return Sequence(generation, index, request, stop_matcher=matcher)


def place(
    schedulers: Mapping[str, ExecutorScheduler], generation: Generation, preferred: str
) -> tuple[str, scheduler_pb2.PlacementHint]:
    """The executor for a new generation and what became of the ``preferred``
    executor (a router's hint): honoured when this replica holds it, healthy
    and not draining; otherwise the longest cached prefix, then the most free
    blocks (among those not draining, when any is not)."""
    Hint = scheduler_pb2.PlacementHint
    open_ = [a for a, s in schedulers.items() if not s.draining]
    if preferred:
        if preferred in open_:
            return preferred, Hint.PLACEMENT_HINT_HONOURED
        draining = preferred in schedulers
        hint = Hint.PLACEMENT_HINT_DRAINING if draining else Hint.PLACEMENT_HINT_NOT_HELD
        log.info(
            "placement hint not honoured",
            request_id=generation.request_id,
            preferred_executor=preferred,
            why="draining" if draining else "not held",
        )
    else:
        hint = Hint.PLACEMENT_HINT_NONE
    request = generation.sequences[0].request

    def score(address: str) -> tuple[int, int]:
        kv = schedulers[address].kv
        hit = kv.get_computed_blocks(request, count=False).num_tokens
        return hit, kv.pool.get_num_free_blocks()

    return max(open_ or schedulers, key=score), hint
