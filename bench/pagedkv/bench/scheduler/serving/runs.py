"""The parts a serving benchmark is made of, shared by its runs (run.py)
and its sweep (sweep.py): the fixed batches' shapes, the ShareGPT-like
mix of the arguments, the warm-up, and the fixed batches run over gRPC and,
with a gateway, over HTTP right after."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any, NamedTuple

from pagedkv.bench.scheduler.serving.gateway import Gateway, comparison, timed_grpc, timed_http
from pagedkv.bench.scheduler.serving.http_load import run_load_http
from pagedkv.bench.scheduler.serving.load import run_load, wait_ready
from pagedkv.bench.scheduler.serving.metrics import Slo
from pagedkv.bench.scheduler.serving.stack import model_shape
from pagedkv.bench.scheduler.serving.workload import MixConfig, fixed_batch, sharegpt_like
from pagedkv.common.logging import get_logger

HTTP_SEED_OFFSET = 500
"""A fixed batch's HTTP run takes its prompts from its gRPC run's seed + this."""
log = get_logger(__name__)


class FixedBatch(NamedTuple):
    batch: int
    prompt_len: int
    max_tokens: int


def parse_fixed_batches(text: str) -> list[FixedBatch]:
    """``"64x512x256,8x16x8"`` -> two batches; ``""`` -> none."""
    batches = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        numbers = [int(n) for n in part.split("x")]
        if len(numbers) != 3 or min(numbers) < 1:
            raise ValueError(f"a fixed batch is NxPxO with positive numbers: {part!r}")
        batches.append(FixedBatch(*numbers))
    return batches


def mix_config(args: argparse.Namespace, model: str, num_requests: int) -> MixConfig:
    """The ShareGPT-like mix of ``args`` for ``model``, ``num_requests`` long."""
    shape = model_shape(model)
    return MixConfig(
        num_requests=num_requests,
        max_model_len=args.max_model_len or int(shape.get("max_position_embeddings", 2048)),
        vocab_size=int(shape["vocab_size"]),
        mean_prompt_len=args.mean_prompt_len,
        mean_output_len=args.mean_output_len,
        sigma=args.sigma,
        system_prompt_fraction=args.system_prompt_fraction,
        num_system_prompts=args.num_system_prompts,
        system_prompt_len=args.system_prompt_len,
        seed=args.seed,
    )


def warm_up(
    args: argparse.Namespace, target: str, mix: MixConfig, gateway: Gateway | None = None
) -> None:
    """Waits for ``target`` to serve, then runs ``args.warmup_requests``
    requests of the mix (their own seed) at once; then the same through
    ``gateway``."""
    asyncio.run(wait_ready(target))
    if args.warmup_requests:
        warm = MixConfig(**{**_fields(mix), "num_requests": args.warmup_requests, "seed": -1})
        part, arrivals = sharegpt_like(warm, "warmup"), [0.0] * warm.num_requests
        asyncio.run(run_load(target, part, arrivals))
        if gateway is not None:
            asyncio.run(run_load_http(gateway.base_url, gateway.model, part, arrivals))


def run_fixed_batches(
    target: str,
    batches: list[FixedBatch],
    vocab: int,
    slo: Slo,
    seed: int,
    gateway: Gateway | None = None,
    grpc_text: bool = False,
) -> tuple[list[dict[str, Any]], list[float]]:
    """Each batch sent at once (batch i's prompts from ``seed + i``; over
    gRPC with the outputs' text when ``grpc_text``): a row per batch, and
    the ``perf_counter`` before and after each gRPC run.
    Through ``gateway`` too, right after (prompts from ``seed + i +
    HTTP_SEED_OFFSET``): the row's ``http`` and ``gateway`` (comparison)."""
    rows, marks = [], []
    for i, b in enumerate(batches):
        part = fixed_batch(b.batch, b.prompt_len, b.max_tokens, vocab, seed=seed + i)
        marks.append(time.perf_counter())
        summary, _ = timed_grpc(target, part, [0.0] * len(part), slo, grpc_text)
        marks.append(time.perf_counter())
        log.info("fixed batch done", output_tokens_per_s=round(summary["output_tokens_per_s"]))
        row: dict[str, Any] = {**b._asdict(), "pagedkv": summary}
        if gateway is not None:
            part = fixed_batch(
                b.batch, b.prompt_len, b.max_tokens, vocab, seed=seed + i + HTTP_SEED_OFFSET
            )
            http, _ = timed_http(gateway, part, [0.0] * len(part), slo)
            log.info(
                "fixed batch done over HTTP", output_tokens_per_s=round(http["output_tokens_per_s"])
            )
            row["http"], row["gateway"] = http, comparison(summary, http)
        rows.append(row)
    return rows, marks


def _fields(config: MixConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in MixConfig.__dataclass_fields__}
