"""The swap benchmark's verdict and markdown, from its JSON report.

``verdict`` says whether the cost model's choice (auto) reached the output
tokens/s of the better fixed policy (always load, or no tier at all),
within ``TOLERANCE``; ``markdown`` sets the modes side by side.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

TOLERANCE = 0.03  # auto "matches" the better of always and off within this fraction


def verdict(runs: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Whether auto's output tokens/s is at least the better of always's and
    off's, less ``TOLERANCE``; None unless all three ran. Beside it, the
    noise: the largest spread of one mode's wall times over its runs (None
    with one run each), and auto's tokens computed over the better one's."""
    if not {"auto", "always", "off"} <= runs.keys():
        return None
    best = max(("always", "off"), key=lambda m: runs[m]["output_tokens_per_s"])
    ratio = runs["auto"]["output_tokens_per_s"] / runs[best]["output_tokens_per_s"]
    times = [r["seconds_all"] for r in runs.values() if len(r["seconds_all"]) > 1]
    computed = runs["auto"]["tokens_computed"], runs[best]["tokens_computed"]
    return {
        "best_of_always_and_off": best,
        "auto_over_best": round(ratio, 4),
        "tolerance": TOLERANCE,
        "auto_matches_best": ratio >= 1 - TOLERANCE,
        "run_spread": round(max(max(t) / min(t) - 1 for t in times), 4) if times else None,
        "tokens_computed_auto_over_best": None
        if None in computed
        else round(computed[0] / computed[1], 4),
    }


def _num(key: str, fmt: str) -> Callable[[dict[str, Any]], str]:
    return lambda run: "-" if run.get(key) is None else fmt.format(run[key])


def _costs(run: dict[str, Any]) -> str:
    if not run["prefill_seconds_per_token"]:
        return "-"
    return (
        f"{run['prefill_seconds_per_token']:.2e}; {run['host_load_seconds']:.2e} + "
        f"{run['host_load_seconds_per_block']:.2e}"
    )


ROWS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("wall time of the batch (s)", _num("seconds", "{:,.2f}")),
    ("every run's wall time (s)", lambda r: ", ".join(f"{t:.2f}" for t in r["seconds_all"])),
    ("output tokens/s", _num("output_tokens_per_s", "{:,.1f}")),
    ("TTFT p50 (s)", _num("ttft_p50_s", "{:,.3f}")),
    ("requests finished with all their tokens", _num("num_finished", "{:,}")),
    ("outputs equal to off's (greedy)", _num("num_outputs_as_off", "{:,}")),
    ("preemptions", _num("num_preemptions", "{:,}")),
    (
        "host hits loaded / recomputed (admission lookups)",
        lambda r: f"{r['host_loads_chosen']:,} / {r['host_recomputes_chosen']:,}",
    ),
    (
        "blocks offloaded / loaded",
        lambda r: f"{r['num_offloaded_blocks']:,} / {r['num_loaded_blocks']:,}",
    ),
    (
        "executor's copy time, offloads / loads (s)",
        lambda r: f"{r['offload_copy_seconds']:.3f} / {r['load_copy_seconds']:.3f}",
    ),
    ("steps", _num("num_steps", "{:,}")),
    ("tokens computed (scheduled)", _num("tokens_computed", "{:,}")),
    ("tokens recomputed (beyond each token once)", _num("tokens_recomputed", "{:,}")),
    ("device busy (fraction of the batch's steps' span)", _num("device_busy_fraction", "{:.3f}")),
    (
        "device time of decode / prompt steps (s)",
        lambda r: (
            "-"
            if r.get("decode_device_s") is None
            else f"{r['decode_device_s']:.3f} / {r['prefill_device_s']:.3f}"
        ),
    ),
    ("a decode step's device time (us)", _num("decode_step_device_us", "{:,.1f}")),
    ("executor CPU to launch a step, median (us)", _num("executor_launch_cpu_us", "{:,.1f}")),
    ("host blocks", _num("num_host_blocks", "{:,}")),
    ("measured prefill s/token; load s + s/block", _costs),
)


def markdown(report: dict[str, Any]) -> str:
    s, runs = report["settings"], report["runs"]
    modes = list(runs)
    lines = [
        "# Swap versus recompute under memory pressure (`pagedkv bench swap`)",
        "",
        f"The memory benchmark's chat scenario: {s['num_requests']} requests (lognormal "
        f"lengths, mean {s['mean_len']:g}, longest {s['max_len']}, within {s['max_model_len']} "
        f"tokens; {s['chat_output_fraction']:g} of each length generated; random prompts, "
        "greedy, ignore_eos), all sent at once. They need "
        f"{s['blocks_needed']:,} blocks of {s['block_size']} tokens at their final lengths; the "
        f"GPU pool has {s['num_blocks'] - 1:,} ({s['pool_fraction']:g} of that, or the longest "
        "request's when more). Each mode on a fresh `pagedkv serve` (one executor, single "
        f"decode steps, max_num_seqs {s['max_num_seqs']}, {s['max_num_batched_tokens']:,} "
        f"batched tokens; {s['warmup']['requests']} salted warm-up requests first): off = no host "
        "tier (recompute); never, always, auto = `--host-loads` with a host tier of "
        f"{s['host_kv_gib']:g} GiB ({s['bytes_per_block']:,} bytes a block, room for every "
        f"block). Model: {s['preset']} on {s['device']}, dtype {s['dtype']}.",
        "",
        "| | " + " | ".join(modes) + " |",
        "|---|" + "---|" * len(modes),
    ]
    for label, cell in ROWS:
        lines.append(f"| {label} | " + " | ".join(cell(runs[m]) for m in modes) + " |")
    lines += [
        "",
        (
            f"Each mode ran {s['repeat']} times, in turn; the table shows its fastest run. "
            if s["repeat"] > 1
            else ""
        )
        + "Counters are GetStats' over the batch. Host hits loaded / recomputed count the "
        "admissions whose lookup found blocks in the host tier. "
        "Tokens computed are the tokens the batch's steps scheduled (the scheduler's step "
        "trace); recomputed ones are those beyond each prompt and output token once.",
        "",
    ]
    v = report["verdict"]
    if v is not None:
        answer = "yes" if v["auto_matches_best"] else "no"
        lines += [
            f"Does auto's throughput at least match the better of always and off "
            f"({v['best_of_always_and_off']}) within {100 * v['tolerance']:g}%? {answer}: auto "
            f"has {v['auto_over_best']:.3f}x its output tokens/s.",
        ]
        if v["run_spread"] is not None:
            lines.append(
                f"One mode's runs differed by up to {100 * v['run_spread']:.1f}% in wall time: "
                "a difference between modes below that is the machine's noise, not the policy's."
            )
        if v["tokens_computed_auto_over_best"] is not None:
            lines.append(
                f"Auto computed {v['tokens_computed_auto_over_best']:.3f}x the tokens of "
                f"{v['best_of_always_and_off']} (a measure no timing noise touches)."
            )
        lines.append("")
    lines += [f"Machine: {json.dumps(report['machine'])}", ""]
    return "\n".join(lines)
