"""``pagedkv demo``: a short, visible workload through the SDK, for newcomers.

Without ``--target`` it first starts ``pagedkv serve`` as a child process (a
tiny random llama on the CPU unless ``--model`` is given) and stops it at the
end. Then, with one ``AsyncClient``:

1. chat requests, ``--concurrency`` at a time, that share one of two long
   system prompts and differ in their user question, so that after the first
   of each the prompts come mostly from the prefix cache;
2. one request with ``n=4`` samples, after a single-sample request of the
   same prompt, comparing the KV blocks each holds once its first token is out;
3. the final ``GetStats`` snapshot: per executor KV usage, blocks free and
   held, prefix-cache hits; preemptions and the block-pool integrity check.

Progress bars (tqdm, on stderr) advance per streamed chunk; the report goes to
stdout. Exit status 1 when a call fails or the integrity check does not hold.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from pagedkv.client.async_client import AsyncClient
from pagedkv.client.credentials import client_security
from pagedkv.client.errors import PagedkvError
from pagedkv.client.render import NULL_BLOCK_NOTE, executor_state, integrity, internal_errors, table
from pagedkv.client.stats import Stats
from pagedkv.client.types import Completion, GenerateChunk
from pagedkv.common.cli import installed

READY = re.compile(r"pagedkv serve ready on (\S+:\d+)")
STARTUP_TIMEOUT_S = 300.0

SYSTEM_PROMPTS = (
    "You are the pagedkv help desk. pagedkv keeps every request's attention keys and "
    "values in fixed-size blocks of one preallocated pool, maps each request's logical "
    "blocks to physical ones with a block table, and shares blocks by reference count. "
    "Answer in one short paragraph, plainly, and say so when you do not know.",
    "You are a tutor for people new to LLM serving. Explain continuous batching, prefix "
    "caching, preemption by recompute and copy-on-write with small concrete examples: a "
    "few requests, a few blocks of sixteen tokens, one step at a time. Keep every answer "
    "under five sentences and end it with one question that checks understanding.",
)
QUESTIONS = (
    "What is a block table?",
    "Why are blocks a fixed size?",
    "What happens when the pool is full?",
    "How does the prefix cache find a prompt?",
    "What does a reference count protect?",
    "Why recompute instead of swapping out?",
    "What is copy-on-write for?",
    "How many blocks does a 100-token prompt need?",
    "What is the null block?",
    "Which blocks are evicted first?",
    "How do executors and the scheduler split the work?",
    "What does the integrity check verify?",
)
SHARING_QUESTION = "Give four different one-line definitions of paged attention."


class ServeError(Exception):
    """The local ``pagedkv serve`` did not start."""


def chat_prompt(system: str, question: str) -> str:
    return f"{system}\n\nUser: {question}\nAssistant:"


@contextlib.contextmanager
def local_serve(executors: int, model: str | None) -> Iterator[str]:
    """Runs ``pagedkv serve --executors K --port 0`` and yields its address.

    The child's stderr (executor logs) goes to a temporary file whose tail is
    printed if it does not start; it is stopped with SIGTERM (SIGKILL after
    30 s) when the block exits.
    """
    command = [sys.executable, "-m", "pagedkv.common.cli", "serve", "--port", "0"]
    command += ["--executors", str(executors)]
    if model is not None:
        command += ["--model", model]
    what = model or "a tiny random llama"
    print(f"starting pagedkv serve: {executors} executor(s) on {what}, on the CPU ...", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
        found: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                match = READY.search(line)
                if match and not found:
                    found.append(match.group(1))
                    ready.set()
            ready.set()  # the process ended

        threading.Thread(target=read, daemon=True).start()
        try:
            ready.wait(STARTUP_TIMEOUT_S)
            if not found:
                log.seek(0)
                raise ServeError(f"pagedkv serve did not start:\n{log.read()[-3000:]}")
            print(f"ready on {found[0]} after {time.perf_counter() - start:.1f} s\n", flush=True)
            yield found[0]
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


class StreamBar:
    """A tqdm bar of generated tokens for concurrent streams.

    ``count`` advances it by one chunk's tokens and refreshes the postfix
    (streams running now, requests done); tqdm shows tokens/s itself.
    """

    def __init__(self, label: str, total_tokens: int, num_requests: int) -> None:
        self.bar: Any = tqdm(
            total=total_tokens, desc=label, unit="tok", dynamic_ncols=True, file=sys.stderr
        )
        self.num_requests = num_requests
        self.active = 0
        self.done = 0

    def count(self, chunk: GenerateChunk) -> None:
        self.bar.update(sum(len(seq.token_ids) for seq in chunk.sequences))
        self.bar.set_postfix_str(
            f"streams={self.active} done={self.done}/{self.num_requests}", refresh=False
        )

    def close(self) -> None:
        self.bar.set_postfix_str(f"done={self.done}/{self.num_requests}", refresh=False)
        self.bar.close()


async def stream(
    client: AsyncClient,
    bar: StreamBar,
    prompt: str,
    on_first_chunk: Callable[[], Awaitable[None]] | None = None,
    **kwargs: Any,
) -> Completion:
    """Streams one request to its end, counting every chunk on ``bar``;
    awaits ``on_first_chunk`` (if given) when the first chunk arrives."""
    chunks: list[GenerateChunk] = []
    bar.active += 1
    try:
        async with contextlib.aclosing(client.generate(prompt, **kwargs)) as chunk_stream:
            async for chunk in chunk_stream:
                if not chunks and on_first_chunk is not None:
                    await on_first_chunk()
                chunks.append(chunk)
                bar.count(chunk)
    finally:
        bar.active -= 1
    bar.done += 1
    return Completion.from_chunks(chunks)


def num_held_blocks(stats: Stats) -> int:
    """Blocks held by live requests, over the healthy executors (free blocks
    and cached blocks without a holder excluded; the null block is never
    usable)."""
    return sum(ex.num_usable_blocks - ex.num_free_blocks for ex in stats.executors if ex.healthy)


async def chat_phase(client: AsyncClient, args: argparse.Namespace) -> list[Completion]:
    """Phase 1: ``args.requests`` chat requests, ``args.concurrency`` at a time."""
    prompts = [
        chat_prompt(SYSTEM_PROMPTS[i % 2], QUESTIONS[(i // 2) % len(QUESTIONS)])
        for i in range(args.requests)
    ]
    print(
        f"[1/2] {args.requests} chat requests, {min(args.concurrency, args.requests)} at a time, "
        f"{args.max_tokens} tokens each:\n"
        f"      two system prompts of about {len(SYSTEM_PROMPTS[0])} characters, each "
        "followed by a different user question",
        flush=True,
    )
    bar = StreamBar("chat", args.requests * args.max_tokens, args.requests)
    gate = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> Completion:
        async with gate:
            return await stream(
                client,
                bar,
                prompts[i],
                max_tokens=args.max_tokens,
                temperature=0.8,
                seed=i,
                ignore_eos=True,
            )

    try:
        completions = await asyncio.gather(*(one(i) for i in range(args.requests)))
    finally:
        bar.close()
    prompt_tokens = sum(c.usage.prompt_tokens for c in completions)
    cached = sum(c.usage.cached_prompt_tokens for c in completions)
    print(
        f"      {cached:,} of {prompt_tokens:,} prompt tokens "
        f"({cached / max(prompt_tokens, 1):.0%}) were found in the prefix cache instead of "
        "being computed again\n",
        flush=True,
    )
    return list(completions)


async def sharing_phase(client: AsyncClient, args: argparse.Namespace) -> Completion:
    """Phase 2: blocks held by one sample, then by one request of ``n=4``
    samples of the same prompt, each measured after its first chunk."""
    n = 4
    prompt = chat_prompt(SYSTEM_PROMPTS[0], SHARING_QUESTION)
    print(
        f"[2/2] one request with n={n} samples of one prompt (temperature 0.8), after a "
        "1-sample request of it\n      to compare the KV blocks each holds",
        flush=True,
    )
    held: dict[int, int] = {}
    completion: Completion | None = None
    runs = ((1, 8, "1 sample, to compare"), (n, args.max_tokens, f"n={n} samples"))
    for num_seqs, max_tokens, label in runs:

        async def measure(num_seqs: int = num_seqs) -> None:
            held[num_seqs] = num_held_blocks(await client.stats())

        bar = StreamBar(label, num_seqs * max_tokens, 1)
        try:
            completion = await stream(
                client,
                bar,
                prompt,
                measure,
                n=num_seqs,
                max_tokens=max_tokens,
                temperature=0.8,
                seed=1,
                ignore_eos=True,
            )
        finally:
            bar.close()
    assert completion is not None
    usage = completion.usage
    print(
        f"      after the first token, 1 sample held {held[1]} blocks and {n} samples held "
        f"{held[n]}, not {n * held[1]}: the samples share the prompt's blocks "
        f"({usage.prompt_tokens} tokens, {usage.cached_prompt_tokens} from the prefix cache)",
        flush=True,
    )
    for i, text in enumerate(completion.texts):
        print(f"      sample {i}: {printable(text)[:60]}")
    print()
    return completion


def printable(text: str) -> str:
    """``text`` with control characters shown as "·" (a random model emits any byte)."""
    return "".join(c if c.isprintable() else "·" for c in text)


def stats_report(stats: Stats) -> str:
    """The final GetStats snapshot as a small table and a summary line."""
    header = (
        "EXECUTOR", "STATE", "KV USAGE", "FREE/USABLE BLOCKS", "HELD",
        "PREFIX CACHE HITS SINCE START",
    )  # fmt: skip
    rows = [
        (
            ex.address,
            executor_state(ex),
            f"{ex.kv_cache_usage:.1%}",
            f"{ex.num_free_blocks}/{ex.num_usable_blocks}",
            str(ex.num_usable_blocks - ex.num_free_blocks) if ex.healthy else "-",
            f"{ex.prefix_cache_hits:,}/{ex.prefix_cache_queries:,} tokens"
            + ("" if ex.prefix_cache_hit_rate is None else f" ({ex.prefix_cache_hit_rate:.1%})"),
        )
        for ex in stats.executors
    ]
    lines = [*table(header, rows, 2), NULL_BLOCK_NOTE]
    lines += [f"{ex.address} is down: {ex.down_reason}" for ex in stats.executors if ex.down_reason]
    held = num_held_blocks(stats)
    lines.append(
        f"running {stats.num_running}, waiting {stats.num_waiting}, preemptions "
        f"{stats.num_preemptions}, integrity {integrity(stats)}; {held} blocks held"
        + (" (every request finished and freed its blocks)" if held == 0 else "")
        + f"; {internal_errors(stats)}"
    )
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True)
class DemoResult:
    """What ``run_workload`` measured: the final stats, the chat completions
    in request order, and the tokens generated over both phases."""

    stats: Stats
    chats: tuple[Completion, ...]
    num_tokens: int
    seconds: float


async def run_workload(
    target: str, args: argparse.Namespace, security: dict[str, Any] | None = None
) -> DemoResult:
    """Both phases against ``target``, then the final stats; ``security``:
    the client's ``tls`` and ``token`` (``client_security``)."""
    start = time.perf_counter()
    async with AsyncClient(target, timeout=300, **(security or {})) as client:
        await client.stats()  # a target with no server fails here, before any progress bar
        chats = await chat_phase(client, args)
        shared = await sharing_phase(client, args)
        stats = await client.stats()
    num_tokens = sum(c.usage.completion_tokens for c in [*chats, shared])
    return DemoResult(stats, tuple(chats), num_tokens, time.perf_counter() - start)


def report(result: DemoResult, random_model: bool) -> None:
    """Prints the throughput, the stats table and the first chat completion."""
    print(
        f"{result.num_tokens:,} tokens generated in {result.seconds:.1f} s "
        f"({result.num_tokens / result.seconds:,.0f} tokens/s over all streams)\n"
    )
    print(stats_report(result.stats))
    sample = result.chats[0]
    print(f"one completion (request {sample.request_id}, {QUESTIONS[0]!r}):")
    print(f"  {printable(sample.text)}")
    if random_model:
        print("  (random weights: the tiny model emits arbitrary bytes)")


def run_demo(args: argparse.Namespace) -> int:
    """The ``pagedkv demo`` handler: 0 on success, 1 on a failed call, a
    server that did not start or a failed integrity check, 2 on bad arguments,
    130 on Ctrl-C (the local server is stopped in every case)."""
    for name in ("executors", "requests", "max_tokens", "concurrency"):
        if getattr(args, name) < 1:
            print(f"pagedkv demo: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    try:
        security = client_security(args)
    except ValueError as exc:
        print(f"pagedkv demo: {exc}", file=sys.stderr)
        return 2
    if not args.target and not installed("pagedkv.executor"):
        print(
            "pagedkv demo: without --target it starts pagedkv serve, whose executors are not "
            "installed here (pagedkv-executor); give --target HOST[:PORT]",
            file=sys.stderr,
        )
        return 2
    try:
        with contextlib.ExitStack() as stack:
            target = args.target or stack.enter_context(local_serve(args.executors, args.model))
            result = asyncio.run(run_workload(target, args, security))
            report(result, random_model=not (args.model or args.target))
            if not args.target:
                print("\nstopping pagedkv serve ...", flush=True)
    except (PagedkvError, ServeError) as exc:
        print(f"pagedkv demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pagedkv demo: interrupted", file=sys.stderr)
        return 130
    return 0 if result.stats.integrity.ok else 1
