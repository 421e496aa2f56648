"""``pagedkv bench memory``: one live stack, the scenarios in order, the report.

The executor's pool is sized so that no scenario is preempted (the widest
run, all at once, plus a margin): the figures are what the requests hold,
not what a full pool lets them hold. Numbers come only from the run.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedkv.bench.scheduler.machine import machine_info
from pagedkv.bench.scheduler.memory import report as reporting
from pagedkv.bench.scheduler.memory import scenarios
from pagedkv.bench.scheduler.memory.live import memory_stack, tiny_model
from pagedkv.bench.scheduler.serving.run import _versions
from pagedkv.client import AsyncClient
from pagedkv.common.logging import get_logger

SCENARIOS = {"chat": scenarios.chat, "shared": scenarios.shared_prompt, "beams": scenarios.beams}
SETTINGS = (
    "max_model_len",
    "chat_requests",
    "chat_mean_len",
    "chat_output_fraction",
    "chat_budget_requests",
    "shared_requests",
    "system_len",
    "user_len",
    "response_len",
    "width",
    "beam_prompt_len",
    "beam_tokens",
    "scenarios",
    "seed",
    "kv_cache_dtype",
)
log = get_logger(__name__)


def pool_blocks(args: argparse.Namespace) -> int:
    """Blocks for the largest run at once, plus a margin."""
    b = scenarios.blocks_for
    chat = args.chat_requests * b(args.max_model_len)
    shared = args.shared_requests * (b(args.system_len + args.user_len + args.response_len) + 1)
    beams = args.width * (b(args.beam_prompt_len + args.beam_tokens) + 1)
    return int(max(chat, shared, beams)) + 64


async def _scenarios(args: argparse.Namespace, target: str, names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with AsyncClient(target, timeout=1800) as client:
        for name in names:
            start = time.perf_counter()
            out[name] = await SCENARIOS[name](client, args, args.max_model_len)
            out[name]["seconds"] = round(time.perf_counter() - start, 1)
            log.info("scenario done", scenario=name, seconds=out[name]["seconds"])
        stats = await client.stats()
        executor = stats.executors[0]
        out["server"] = {
            "num_preemptions": stats.num_preemptions,
            "integrity_ok": stats.integrity.ok,
            "kv_cache_dtype": executor.kv_cache_dtype,
            "bytes_per_block": executor.bytes_per_block,
        }
    return out


def main(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios: {', '.join(sorted(unknown))}")
    settings = {k: getattr(args, k) for k in SETTINGS}
    settings["num_blocks"] = pool_blocks(args)
    with tempfile.TemporaryDirectory(prefix="pagedkv-memory-") as root:
        model = tiny_model(Path(root), args.max_model_len)
        stack = memory_stack(
            model, settings["num_blocks"], max_num_seqs=512, kv_cache_dtype=args.kv_cache_dtype
        )
        try:
            results = asyncio.run(_scenarios(args, stack.target, names))
        finally:
            stack.stop()
    report = {
        "machine": {**machine_info("cpu"), **_versions()},
        "settings": settings,
        "model": f"tiny random llama (make-tiny-model), max_model_len {args.max_model_len}",
        **results,
    }
    text = reporting.markdown(report)
    print(text)
    if args.output:
        path = Path(args.output)
        reporting.write(report, path)
    return 0 if report["server"]["integrity_ok"] and report["server"]["num_preemptions"] == 0 else 1
