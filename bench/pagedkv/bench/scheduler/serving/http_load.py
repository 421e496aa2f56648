"""The serving benchmark's requests over HTTP: the OpenAI completions API of
a gateway (``pagedkv gateway`` or ``pagedkv serve --http-port``).

The same open loop as ``load.run_load`` and the same ``RequestResult``s:
each request is ``POST /v1/completions`` with its prompt as token ids (so
its length is exact), greedy, ``ignore_eos`` and ``max_tokens``, streamed
(``stream``, ``stream_options.include_usage``) and read to ``data: [DONE]``.
One ``aiohttp.ClientSession`` per run, its pool as large as the run's
requests (one HTTP/1.1 connection per stream in flight, as the field's load
generators open them). aiohttp, not httpx: its C parser reads an event in
about a third of httpx's CPU time (37 against 115 us on two busy cores, 256
streams), and the client shares the gateway's machine.

An event's text may hold several tokens, and how many is not said: the
output tokens are the final usage chunk's ``completion_tokens``, spread
evenly over the events that carried text (the earliest take the
remainder), so TTFT is to the first event with text, TPOT is exact, and ITL
splits each gap between events evenly over that event's share of tokens.
An HTTP error status, an error event, a broken connection or a stream that
ends without usage is recorded as the request's error, never raised.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from pagedkv.bench.scheduler.serving.load import REQUEST_TIMEOUT_S, RequestResult
from pagedkv.bench.scheduler.serving.workload import BenchRequest

DATA = b"data:"
DONE = b"[DONE]"


class _Stream:
    """What one response's events said: the times of those with text, the
    usage, an error. ``feed`` takes the body as it arrives."""

    __slots__ = ("buffer", "done", "error", "event_times", "start", "usage")

    def __init__(self, start: float) -> None:
        self.start = start
        self.buffer = b""
        self.event_times: list[float] = []
        self.usage: dict[str, Any] | None = None
        self.error = ""
        self.done = False

    def feed(self, data: bytes) -> None:
        """Handles every whole line of ``data`` (after what was left of the
        last piece); the events of one piece arrived at the same time."""
        now = time.perf_counter() - self.start
        *lines, self.buffer = (self.buffer + data).split(b"\n")
        for line in lines:
            if not line.startswith(DATA):
                continue  # blank separators, comments, other fields
            payload = line[len(DATA) :].strip()
            if payload == DONE:
                self.done = True
                continue
            event = json.loads(payload)
            if "error" in event:
                self.error = self.error or _error_text(event)
                continue
            choices = event.get("choices") or ()
            if any(choice.get("text") for choice in choices):
                self.event_times.append(now)
            if event.get("usage"):
                self.usage = event["usage"]


def _error_text(body: Any) -> str:
    """The OpenAI error shape's message (with its type), else the body."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return f"{error.get('type') or 'error'}: {error.get('message')}"
    return str(body)[:500]


def spread(total: int, num_events: int) -> tuple[int, ...]:
    """``total`` tokens over ``num_events`` events, evenly, the earliest
    events taking the remainder: ``spread(10, 4) == (3, 3, 2, 2)``."""
    if num_events == 0:
        return ()
    base, extra = divmod(total, num_events)
    return tuple(base + (i < extra) for i in range(num_events))


async def _send(
    session: aiohttp.ClientSession,
    model: str,
    request: BenchRequest,
    scheduled: float,
    start: float,
) -> RequestResult:
    delay = start + scheduled - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    body = {
        "model": model,
        "prompt": list(request.prompt_token_ids),
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter() - start
    stream = _Stream(start)
    try:
        async with session.post("/v1/completions", json=body) as response:
            if response.status != 200:
                text = await response.read()
                try:
                    detail = _error_text(json.loads(text))
                except ValueError:
                    detail = text[:500].decode(errors="replace")
                stream.error = f"HTTP {response.status}: {detail}"
            else:
                async for data in response.content.iter_any():
                    stream.feed(data)
                stream.feed(b"\n")  # a last line without its newline
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: not JSON
        stream.error = stream.error or f"{type(exc).__name__}: {exc}"
    end = time.perf_counter() - start
    usage = stream.usage or {}
    if not stream.error and (stream.usage is None or not stream.done):
        stream.error = "the stream ended without usage and [DONE]"
    output = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    times = tuple(stream.event_times) if output else ()
    return RequestResult(
        request_id=request.request_id,
        prompt_tokens=len(request.prompt_token_ids),
        cached_prompt_tokens=int(details.get("cached_tokens") or 0),
        max_tokens=request.max_tokens,
        output_tokens=output,
        scheduled_s=scheduled,
        sent_s=sent,
        chunk_times_s=times,
        chunk_num_tokens=spread(output, len(times)),
        end_s=end,
        error=stream.error,
    )


async def run_load_http(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    start: float | None = None,
) -> tuple[list[RequestResult], float]:
    """Every request's result, in order, and the seconds from the start to
    the last end; ``model`` is the request's ``model`` field. ``start``: the
    ``perf_counter`` the arrival times count from (default: now), which
    processes share (it reads the system's monotonic clock)."""
    assert len(requests) == len(arrivals)
    connector = aiohttp.TCPConnector(limit=max(len(requests), 1))
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, connect=60.0)
    async with aiohttp.ClientSession(base_url, connector=connector, timeout=timeout) as session:
        start = time.perf_counter() if start is None else start
        results = await asyncio.gather(
            *(_send(session, model, r, t, start) for r, t in zip(requests, arrivals, strict=True))
        )
        seconds = time.perf_counter() - start
    return list(results), seconds


async def served_model(base_url: str, timeout: float = 60.0) -> str:
    """Waits until ``GET /health`` answers 200, then returns the first id
    of ``GET /v1/models`` (the name requests must give)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(base_url, timeout=aiohttp.ClientTimeout(total=10)) as session:
        while True:
            try:
                async with session.get("/health") as health:
                    ready = health.status == 200
                if ready:
                    async with session.get("/v1/models", raise_for_status=True) as response:
                        models = await response.json(content_type=None)
                    return str(models["data"][0]["id"])
            except (aiohttp.ClientConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway at {base_url} did not serve in {timeout:.0f} s")
            await asyncio.sleep(0.2)
