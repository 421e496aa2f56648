"""Decode windows (``--decode-window``) against a real executor process: the
scheduler asks for several decode steps in one message when every running
sequence is a plain decode, and the outputs are Hugging Face's greedy tokens
however the windows fall (sequences of different lengths end inside them)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pagedkv.scheduler.executor_client import ExecutorClient
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler
from pagedkv.scheduler.sequence import Generation, Sequence
from pagedkv.v1 import common_pb2
from tests.executor.driver import ExecutorProcess
from tests.executor.test_generation import hf_greedy, model_dirs
from tests.service.test_executor_scheduler import run_in_flight

__all__ = ["model_dirs"]

PROMPTS = [list(b"a prompt of some length"), list(b"another, longer prompt of thirty"), [7, 3]]
MAX_TOKENS = [9, 23, 14]


def generation(scheduler: ExecutorScheduler, index: int) -> Generation:
    gen = Generation(
        request_id=f"w{index}",
        prompt_token_ids=PROMPTS[index],
        sampling=common_pb2.SamplingParams(temperature=0.0),
        max_tokens=MAX_TOKENS[index],
        n=1,
        priority=0,
        cache_salt="",
        eos_token_ids=frozenset(),
        stop_token_ids=frozenset(),
    )
    request = scheduler.kv.make_request(f"w{index}/0", PROMPTS[index])
    gen.sequences.append(Sequence(gen, 0, request))
    return gen


@pytest.mark.parametrize("depth", [2, 3])
def test_decode_windows_give_hugging_faces_tokens(model_dirs: dict[str, Path], depth: int) -> None:
    """Windows are pipelined like single steps: the next is sent while one
    is in flight, continuing from its last sample."""

    async def main(executor: ExecutorProcess) -> tuple[list[int], bool, list[list[int]], int]:
        client = ExecutorClient(executor.target, "test")
        info = await client.connect()
        scheduler = ExecutorScheduler(
            executor.target,
            info,
            client.owner,
            max_num_seqs=16,
            max_num_batched_tokens=512,
            decode_window=4,
        )
        gens = [generation(scheduler, i) for i in range(len(PROMPTS))]
        for gen in gens:
            scheduler.add(gen.sequences[0])
        sent = await run_in_flight(
            scheduler,
            client,
            lambda: all(gen.sequences[0].finished for gen in gens),
            depth=depth,
        )
        windows = [s.request.num_decode_steps for s in sent]
        pipelined = any(
            s.request.num_decode_steps > 1 and any(r.num_decode_steps > 1 for r in s.in_flight)
            for s in sent
        )
        report = scheduler.kv.check_integrity()
        assert report.ok, report.errors
        pool = scheduler.kv.pool
        held = pool.num_blocks - 1 - pool.get_num_free_blocks()
        await client.close()
        outputs = [
            list(gen.sequences[0].request.token_ids[len(p) :])
            for gen, p in zip(gens, PROMPTS, strict=True)
        ]
        return windows, pipelined, outputs, held

    with ExecutorProcess(model_dirs["llama"], num_blocks=64) as executor:
        windows, pipelined, outputs, held = asyncio.run(main(executor))
    assert 4 in windows  # some steps were windows of the longest size
    assert pipelined  # a window was sent while another was in flight
    assert held == 0
    for prompt, max_tokens, output in zip(PROMPTS, MAX_TOKENS, outputs, strict=True):
        assert output == hf_greedy(model_dirs["llama"], prompt, max_tokens)
