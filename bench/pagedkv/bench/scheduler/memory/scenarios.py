"""The three memory scenarios, run through the live stack.

Each scenario sends its requests with the SDK (greedy or seeded sampling,
``ignore_eos``, so every sequence reaches its length) while a
``BlockSampler`` reads the blocks held, and returns the measured figures
beside the contiguous ones computed from the same requests. Prompts are
random tokens drawn per run, so no run finds another's prompt cached;
"without prefix caching" gives each request its own ``cache_salt``.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pagedkv.bench.scheduler.memory.live import BLOCK_SIZE, BlockSampler
from pagedkv.client import AsyncClient

VOCAB = 256  # the tiny model's byte tokens
SAMPLE_INTERVAL_S = 0.05


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


@dataclass
class Request:
    """One request of a run and what the client saw of it."""

    prompt: list[int]
    max_tokens: int
    n: int = 1
    beam_width: int = 0
    cache_salt: str = ""
    temperature: float = 0.0
    started: bool = False  # its first tokens came: its prompt's KV is held
    finished: bool = False
    num_output: int = 0  # tokens received over all its sequences

    @property
    def tokens_held(self) -> int:
        """Tokens whose KV it holds, as the client counts them: the prompt and
        every output token but the newest (its KV is written next step)."""
        if not self.started or self.finished:
            return 0
        return len(self.prompt) + max(self.num_output - self.n, 0)


async def _drive(client: AsyncClient, request: Request) -> None:
    stream = client.generate(
        token_ids=request.prompt,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        seed=0 if request.temperature else None,
        n=request.n,
        beam_width=request.beam_width,
        ignore_eos=True,
        cache_salt=request.cache_salt,
    )
    async for chunk in stream:
        got = sum(len(s.token_ids) for s in chunk.sequences)
        if got or chunk.beams:
            request.started = True
        request.num_output += got
        if chunk.is_final:
            request.finished = True


async def run_requests(
    client: AsyncClient, requests: list[Request], first_alone: bool = False
) -> dict[str, Any]:
    """Runs ``requests`` at once (with ``first_alone``, the first until its
    prompt is computed, then the rest) under a sampler; the samples."""

    def tokens() -> tuple[int, int]:
        live = [r for r in requests if r.started and not r.finished]
        return sum(r.tokens_held for r in live), len(live)

    sampler = BlockSampler(client, SAMPLE_INTERVAL_S, tokens)
    sampling = asyncio.create_task(sampler.run())
    tasks: list[Awaitable[None]] = []
    if first_alone:
        first = asyncio.create_task(_drive(client, requests[0]))
        while not requests[0].started:
            await asyncio.sleep(0.01)
        tasks.append(first)
        requests = requests[1:]
    await asyncio.gather(*tasks, *(_drive(client, r) for r in requests))
    await asyncio.sleep(2 * SAMPLE_INTERVAL_S)
    sampler.stop()
    await sampling
    samples = sampler.samples
    return {
        "peak_blocks_held": samples.peak_blocks(),
        "mean_blocks_held": round(samples.time_weighted_mean(samples.blocks_held), 1),
        "integrity_ok": sampler.integrity_ok,
        "samples": samples.as_dict(),
    }


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(length)]


def chat_lengths(num_requests: int, mean_len: int, max_len: int, seed: int) -> list[int]:
    """Total lengths (prompt + output) with a long right tail: lognormal,
    scaled to mean ``mean_len``, within [2 * BLOCK_SIZE, ``max_len``]."""
    rng = random.Random(seed)
    raw = [rng.lognormvariate(0.0, 0.8) for _ in range(num_requests)]
    scale = mean_len / (sum(raw) / len(raw))
    return [min(max(round(x * scale), 2 * BLOCK_SIZE), max_len) for x in raw]


async def chat(client: AsyncClient, config: Any, max_model_len: int) -> dict[str, Any]:
    """Scenario 1: varied lengths, all at once; held KV against its tokens,
    and the concurrency a budget of ``config.chat_budget_requests`` contiguous
    reservations admits."""
    rng = random.Random(config.seed)
    lengths = chat_lengths(config.chat_requests, config.chat_mean_len, max_model_len, config.seed)
    requests = []
    for total in lengths:
        output = max(1, round(total * config.chat_output_fraction))
        requests.append(Request(_prompt(rng, total - output), output))
    run = await run_requests(client, requests)
    s = run["samples"]
    # Used fraction over the samples where every running request has its
    # prompt computed (the client's count is then exact): not during prefill.
    used = held = 0.0
    for i in range(len(s["times_s"]) - 1):
        all_started = s["num_running"][i] == s["num_started"][i] and not s["num_waiting"][i]
        if s["blocks_held"][i] and all_started:
            dt = s["times_s"][i + 1] - s["times_s"][i]
            used += s["tokens_held"][i] * dt
            held += s["blocks_held"][i] * BLOCK_SIZE * dt
    used_fraction = used / held if held else 0.0
    budget_slots = config.chat_budget_requests * max_model_len
    mean_len = sum(lengths) / len(lengths)
    mean_blocks = sum(blocks_for(n) for n in lengths) / len(lengths)
    return {
        **run,
        "num_requests": len(lengths),
        "mean_len": round(mean_len, 1),
        "max_len": max(lengths),
        "used_fraction": round(used_fraction, 4),
        "waste_fraction": round(1 - used_fraction, 4),
        "trace_used_fraction": round(mean_len / (mean_blocks * BLOCK_SIZE), 4),
        "budget_slots": budget_slots,
        "contiguous_concurrency": budget_slots // max_model_len,
        "paged_concurrency_trace": round(budget_slots / (mean_blocks * BLOCK_SIZE), 1),
        "paged_concurrency_measured": round(budget_slots * used_fraction / mean_len, 1)
        if used_fraction
        else 0.0,
    }


async def shared_prompt(client: AsyncClient, config: Any, max_model_len: int) -> dict[str, Any]:
    """Scenario 2: one system prompt, ``config.shared_requests`` requests of
    user tokens and a response, with prefix caching and without."""
    rng = random.Random(config.seed + 1)
    n = config.shared_requests
    out: dict[str, Any] = {"num_requests": n}
    for label, salted in (("prefix_caching", False), ("no_prefix_caching", True)):
        system = _prompt(rng, config.system_len)
        requests = [
            Request(
                system + _prompt(rng, config.user_len),
                config.response_len,
                cache_salt=f"r{i}" if salted else "",
            )
            for i in range(n)
        ]
        out[label] = await run_requests(client, requests, first_alone=not salted)
    per_request = blocks_for(config.user_len + config.response_len)
    out["stated_formula_blocks"] = blocks_for(config.system_len) + n * per_request
    out["contiguous_blocks"] = n * blocks_for(max_model_len)
    out["saving_vs_contiguous"] = round(
        1 - out["prefix_caching"]["peak_blocks_held"] / out["contiguous_blocks"], 4
    )
    out["saving_vs_no_prefix_caching"] = round(
        1
        - out["prefix_caching"]["peak_blocks_held"] / out["no_prefix_caching"]["peak_blocks_held"],
        4,
    )
    return out


async def beams(client: AsyncClient, config: Any, max_model_len: int) -> dict[str, Any]:
    """Scenario 3: one prompt, ``config.width`` continuations: beam search,
    parallel sampling (n), and as many independent requests."""
    rng = random.Random(config.seed + 2)
    w, gen = config.width, config.beam_tokens
    runs: dict[str, Callable[[list[int]], list[Request]]] = {
        "beam_search": lambda p: [Request(p, gen, beam_width=w)],
        "parallel_sampling": lambda p: [Request(p, gen, n=w, temperature=1.0)],
        "independent": lambda p: [Request(p, gen, cache_salt=f"r{i}") for i in range(w)],
    }
    out: dict[str, Any] = {"width": w}
    for label, make in runs.items():
        out[label] = await run_requests(client, make(_prompt(rng, config.beam_prompt_len)))
    seq_blocks = blocks_for(config.beam_prompt_len + gen)
    out["stated_formula_blocks"] = blocks_for(config.beam_prompt_len) + w * blocks_for(gen)
    out["contiguous_copies_blocks"] = w * seq_blocks
    out["contiguous_reservation_blocks"] = w * blocks_for(max_model_len)
    for label in runs:
        out[f"saving_{label}_vs_copies"] = round(
            1 - out[label]["peak_blocks_held"] / out["contiguous_copies_blocks"], 4
        )
    assert math.isfinite(out["saving_beam_search_vs_copies"])
    return out
