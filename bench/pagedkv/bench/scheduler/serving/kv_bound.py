"""What smaller KV blocks can buy a fixed batch, at most, from a measured run.

A fixed batch of the serving benchmark (``pagedkv bench serve
--fixed-batch BxPxN``) ends ``N - 1`` decode steps after its last request's
first token. Those steps read the model's weights and every sequence's K
and V; cache bytes smaller by ``ratio`` shrink only the second part, and the
prompt steps before (the layers' matmuls, which the cache's dtype does not
change) stay as they are. So, from the run with the model's dtype:

- ``last_first_token_s``: the run's seconds less ``N - 1`` steps of its
  median inter-token latency (the decode-only step; the prompt steps are the
  slow tail of that distribution);
- ``weight_gb`` and ``kv_gb``: what a decode step reads, the weights (all
  but the embedding table, whose rows it gathers) and the batch's K and V
  at the steps' mean context, ``P + N / 2``;
- the output tokens/s that a cache of ``ratio`` times the bytes would give
  with every decode step at the copy ceiling, at the measured run's share
  of it, and with no K and V read at all.

``python -m pagedkv.bench.scheduler.serving.kv_bound --serve RUN.json
--kernels KERNELS.json`` (the copy ceiling from ``pagedkv bench kernels``'s
report on the same GPU kind) writes the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pagedkv.bench.report_files import write_report
from pagedkv.bench.shapes import LLAMA_SHAPES


def weight_bytes(shape: dict[str, Any], dtype_bytes: int = 2) -> int:
    """Bytes of the weights a decode step reads: every layer's projections
    and norms, the final norm and the output projection (untied); not the
    embedding table."""
    hidden = shape["hidden_size"]
    head = hidden // shape["num_attention_heads"]
    q = shape["num_attention_heads"] * head
    kv = shape["num_key_value_heads"] * head
    layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * shape["intermediate_size"]
    layer += 2 * hidden  # the two norms
    params = shape["num_hidden_layers"] * layer + hidden + shape["vocab_size"] * hidden
    return int(params * dtype_bytes)


def kv_bytes_per_token(shape: dict[str, Any], dtype_bytes: float) -> float:
    """K and V bytes a token holds, over all layers."""
    head = shape["hidden_size"] // shape["num_attention_heads"]
    return float(2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head * dtype_bytes)


def bound(serve: dict[str, Any], copy_gbps: float, ratio: float = 0.5) -> list[dict[str, Any]]:
    """One row per fixed batch of ``serve`` (a run with the model's dtype:
    2-byte K and V): what it measured, and what a cache of ``ratio`` times
    its bytes could give at most."""
    preset = serve["settings"]["model"].removeprefix("preset ")
    shape = LLAMA_SHAPES[preset]
    weights = weight_bytes(shape)
    ceiling = copy_gbps * 1e9
    rows = []
    for batch in serve["fixed_batches"]:
        run = batch["pagedkv"]
        size, prompt, output = batch["batch"], batch["prompt_len"], batch["max_tokens"]
        step_s = run["itl_ms"]["p50"] / 1e3
        steps = output - 1
        last_first_token_s = run["seconds"] - steps * step_s
        tokens = size * (prompt + output / 2)
        kv = tokens * kv_bytes_per_token(shape, 2)
        share = (weights + kv) / step_s / ceiling

        step_seconds = {
            "at_ceiling": (weights + ratio * kv) / ceiling,
            "at_share": (weights + ratio * kv) / ceiling / share,
            "no_kv": weights / ceiling,
        }
        measured = run["output_tokens_per_s"]
        bounds = {
            name: size * output / (last_first_token_s + steps * seconds)
            for name, seconds in step_seconds.items()
        }
        rows.append(
            {
                "batch": f"{size} x ({prompt} -> {output})",
                "output_tokens_per_s": measured,
                "decode_step_ms": step_s * 1e3,
                "last_first_token_s": last_first_token_s,
                "weight_gb": weights / 1e9,
                "kv_gb": kv / 1e9,
                "share_of_ceiling": share,
                **bounds,
                **{f"ratio_{name}": value / measured for name, value in bounds.items()},
            }
        )
    return rows


def markdown(report: dict[str, Any]) -> str:
    ratio = report["ratio"]
    lines = [
        f"# What K and V at {ratio:g}x the bytes can buy a fixed batch, at most",
        "",
        f"From `{report['serve']}` (K and V in the model's dtype) and the copy ceiling of "
        f"`{report['kernels']}` ({report['copy_gbps']:,.0f} GB/s); "
        "`pagedkv.bench.scheduler.serving.kv_bound`.",
        "",
        "| batch | measured tok/s | decode step | last first token | weights + K/V a step "
        "| share of the ceiling | at the ceiling | at the measured share | no K/V read |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['batch']} | {r['output_tokens_per_s']:.0f} | {r['decode_step_ms']:.2f} ms "
            f"| {r['last_first_token_s']:.2f} s | {r['weight_gb']:.1f} + {r['kv_gb']:.1f} GB "
            f"| {r['share_of_ceiling']:.0%} | {r['at_ceiling']:.0f} ({r['ratio_at_ceiling']:.2f}x) "
            f"| {r['at_share']:.0f} ({r['ratio_at_share']:.2f}x) "
            f"| {r['no_kv']:.0f} ({r['ratio_no_kv']:.2f}x) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", required=True, help="a serving run's JSON, fixed batches")
    parser.add_argument("--kernels", required=True, help="pagedkv bench kernels' JSON")
    parser.add_argument("--ratio", type=float, default=0.5, help="the cache's bytes, relative")
    parser.add_argument("--output", help="JSON path (and .md beside it)")
    args = parser.parse_args(argv)
    serve = json.loads(Path(args.serve).read_text())
    copy_gbps = json.loads(Path(args.kernels).read_text())["copy_ceiling_gbps"]
    report = {
        "serve": Path(args.serve).name,
        "kernels": Path(args.kernels).name,
        "copy_gbps": copy_gbps,
        "ratio": args.ratio,
        "rows": bound(serve, copy_gbps, args.ratio),
    }
    write_report(args.output, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
