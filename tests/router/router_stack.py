"""A router process and the helpers the router's live tests share: prompts
with shared prefixes, Hugging Face references, and requests through the SDK
that report where they ran."""

from __future__ import annotations

import random
import re
import sys
import urllib.request
from pathlib import Path
from typing import NamedTuple

import torch

from pagedkv.client import AsyncClient, Completion
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.processes import ServedProcess

PREFIX_TOKENS = 64  # 4 blocks of the tiny model's 16


class RouterProcess(ServedProcess):
    """``pagedkv router --redis-url URL`` on a free port, metrics on another."""

    def __init__(self, redis_url: str, *extra: str, debug_json: bool = False) -> None:
        command = [sys.executable, "-m", "pagedkv.common.cli"]
        if debug_json:
            command += ["--log-format", "json", "--log-level", "debug"]
        command += ["router", "--redis-url", redis_url]
        command += ["--port", "0", "--metrics-port", "0", "--refresh-interval", "0.05", *extra]
        super().__init__(command, timeout=120)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        match = re.search(r"metrics on :(\d+)", self.ready_line)
        assert match is not None, self.ready_line
        self.metrics_port = int(match.group(1))

    def stats(self) -> scheduler_pb2.GetStatsResponse:
        response: scheduler_pb2.GetStatsResponse = self.stub.GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=30
        )
        return response

    def metric(self, name: str, labels: str = "") -> float:
        """A sample of the router's metrics (0 when absent)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        pattern = re.escape(name + (f"{{{labels}}}" if labels else "")) + r" (\S+)"
        match = re.search(r"^" + pattern + "$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    def sees(self, num_executors: int, num_blocks: int = 0) -> bool:
        """It follows ``num_executors`` executors, all leased, and indexes at
        least ``num_blocks`` cached blocks."""
        stats = self.stats()
        leased = [e for e in stats.cluster.executors if e.owner_id]
        return (
            stats.router.num_followed_executors == num_executors
            and len(leased) == num_executors
            and stats.router.num_indexed_blocks >= num_blocks
        )


def make_prefix(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(PREFIX_TOKENS)]


def with_suffix(prefix: list[int], seed: int) -> list[int]:
    rng = random.Random(seed)
    return prefix + [rng.randrange(256) for _ in range(rng.randrange(3, 12))]


class References:
    """Hugging Face greedy continuations, the model loaded once."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.model.generation_config.eos_token_id = None

    def __call__(self, prompt: list[int], num_tokens: int) -> list[int]:
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False
            )
        return list(out[0, len(prompt) :].tolist())


class Ran(NamedTuple):
    """A finished request: its tokens, where it was placed and what was cached."""

    token_ids: list[int]
    executor: str
    hint: str
    cached_tokens: int


async def generate(client: AsyncClient, prompt: list[int], max_tokens: int) -> Ran:
    chunks = [
        chunk
        async for chunk in client.generate(
            token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
        )
    ]
    placements = [c.placement for c in chunks if c.placement is not None]
    completion = Completion.from_chunks(chunks)
    usage = completion.usage
    first = placements[0] if placements else None
    return Ran(
        list(completion.token_ids[0]),
        first.executor if first else "",
        first.hint if first else "",
        usage.cached_prompt_tokens,
    )
