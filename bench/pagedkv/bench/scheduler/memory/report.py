"""The memory benchmark's markdown and plots, from its JSON report.

``markdown`` sets each scenario's measured figures beside the stated ones
and says where and why they differ; ``write`` saves the JSON, the markdown
and two plots: blocks held over time per scenario, and paged against
contiguous blocks as bars.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

STATED = {
    "chat": "contiguous 20 requests, paged about 58 (2.9x); about 97% of reserved KV used",
    "shared": "contiguous 409,600 slots (25,600 blocks); 64 + 100 x 48 = 4,864 blocks; ~81% saved",
    "beams": "4 full copies (576 blocks); 128 + 4 x 16 = 192 blocks; about 67% saved",
}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _chat(c: Mapping[str, Any]) -> list[str]:
    ratio = c["paged_concurrency_measured"] / c["contiguous_concurrency"]
    return [
        f"## 1. Chat with varied lengths ({c['num_requests']} requests at once, mean length "
        f"{c['mean_len']:g}, longest {c['max_len']})",
        "",
        f"Stated: {STATED['chat']}.",
        "",
        "| figure | measured | from the trace (ideal) |",
        "|---|---|---|",
        f"| held KV holding tokens | {_pct(c['used_fraction'])} | "
        f"{_pct(c['trace_used_fraction'])} |",
        f"| internal fragmentation (waste; goal <= 4%) | {_pct(c['waste_fraction'])} | "
        f"{_pct(1 - c['trace_used_fraction'])} |",
        f"| requests a budget of {c['budget_slots']:,} slots admits, paged | "
        f"{c['paged_concurrency_measured']:g} | {c['paged_concurrency_trace']:g} |",
        f"| same budget, contiguous (max_model_len each) | {c['contiguous_concurrency']} | "
        f"{c['contiguous_concurrency']} |",
        f"| paged / contiguous | {ratio:.2f}x | - |",
        "",
        f"Blocks held: peak {c['peak_blocks_held']:,}, time-weighted mean "
        f"{c['mean_blocks_held']:,}. The fraction used is the client's count of tokens whose "
        "KV is held (prompt plus output but the newest token) over the blocks held, "
        "time-weighted over the samples where every running request has its prompt computed. "
        "Paged wastes only the unfilled tail of each request's last block (8 slots on "
        "average, under 1% at these lengths); the stated 97% and about 58 requests are a "
        "rounder estimate of the same effect. The paged concurrency is the budget over the "
        "measured slots per request at its final length.",
    ]


def _shared(s: Mapping[str, Any]) -> list[str]:
    cached, plain = s["prefix_caching"], s["no_prefix_caching"]
    return [
        f"## 2. Shared system prompt ({s['num_requests']} requests)",
        "",
        f"Stated: {STATED['shared']}.",
        "",
        "| KV held | peak blocks | mean blocks | saving vs contiguous |",
        "|---|---|---|---|",
        f"| paged, prefix caching | {cached['peak_blocks_held']:,} | "
        f"{cached['mean_blocks_held']:,} | {_pct(s['saving_vs_contiguous'])} |",
        f"| paged, no prefix caching | {plain['peak_blocks_held']:,} | "
        f"{plain['mean_blocks_held']:,} | "
        f"{_pct(1 - plain['peak_blocks_held'] / s['contiguous_blocks'])} |",
        f"| stated formula (system + n x (user + response)) | {s['stated_formula_blocks']:,} | - | "
        f"{_pct(1 - s['stated_formula_blocks'] / s['contiguous_blocks'])} |",
        f"| contiguous (max_model_len each) | {s['contiguous_blocks']:,} | - | - |",
        "",
        "The stated figure is for 100 requests; the formula row applies it to the "
        f"{s['num_requests']} run here (the saving depends on n only through the system "
        "prompt's share). "
        f"Prefix caching saves {_pct(s['saving_vs_no_prefix_caching'])} of the blocks held "
        "without it. The first request runs alone until its prompt is computed, so the others "
        "find the system prompt cached; without prefix caching each request has its own "
        "cache salt. The peak can fall a little short of the formula: the first request, "
        "started earlier, ends (and frees its own blocks) before the last ones reach their "
        "full length.",
    ]


def _beams(b: Mapping[str, Any]) -> list[str]:
    copies = b["contiguous_copies_blocks"]
    formula = b["stated_formula_blocks"]
    beam = b["beam_search"]["peak_blocks_held"]
    sampled = b["parallel_sampling"]["peak_blocks_held"]
    rows = [
        f"## 3. Beam search and parallel sampling (width {b['width']})",
        "",
        f"Stated: {STATED['beams']}.",
        "",
        "| run | peak blocks | mean blocks | saving vs 4 contiguous copies |",
        "|---|---|---|---|",
    ]
    for label, name in (
        ("beam_search", f"beam search, width {b['width']}"),
        ("parallel_sampling", f"parallel sampling, n = {b['width']}"),
        ("independent", f"{b['width']} independent requests"),
    ):
        run = b[label]
        rows.append(
            f"| {name} | {run['peak_blocks_held']:,} | {run['mean_blocks_held']:,} | "
            f"{_pct(b[f'saving_{label}_vs_copies'])} |"
        )
    rows += [
        f"| stated formula (prompt + width x generated) | {b['stated_formula_blocks']:,} | - | "
        f"{_pct(1 - b['stated_formula_blocks'] / copies)} |",
        f"| contiguous: {b['width']} copies of the sequence | {copies:,} | - | - |",
        f"| contiguous: {b['width']} x max_model_len | {b['contiguous_reservation_blocks']:,} "
        "| - | - |",
        "",
        f"Beam search: {beam - formula:+,} blocks against the formula, which counts "
        "width x generated blocks apart. The beams kept descend from common ancestors and "
        "share the blocks of the tokens they agree on; a pruned beam's blocks are freed "
        "when it is dropped, and a forked beam copies only its partial last block "
        "(copy-on-write). Below the formula when the beams agree on their early tokens; "
        "above it while one step's forks hold their copies.",
        "",
        f"Parallel sampling: {sampled - formula:+,} blocks against the formula. The "
        f"{b['width'] - 1} forked samples each recompute the last prompt token to draw their "
        "own first token, which copies the prompt's last block (copy-on-write): one block "
        "each beyond the formula, which counts the prompt once.",
        "",
        "Independent requests share nothing (each has its own cache salt): each holds a "
        "full copy, as a contiguous system would.",
    ]
    return rows


def markdown(report: Mapping[str, Any]) -> str:
    settings = report["settings"]
    lines = [
        "# KV memory: paged against contiguous (`pagedkv bench memory`)",
        "",
        f"Live stack: `pagedkv serve` on one CPU executor, {report['model']}, 16-token blocks, "
        f"a pool of {settings['num_blocks']:,} blocks (no run is preempted). Blocks held "
        "are read from GetStats every 50 ms while each run goes on (usable minus free blocks; "
        "cached blocks no request holds count as free); the time-weighted mean is over those "
        "reads, the peak is the pool's own (each read takes the most blocks held since the "
        "previous one and starts that count over).",
        "",
    ]
    if "chat" in report:
        lines += [*_chat(report["chat"]), ""]
    if "shared" in report:
        lines += [*_shared(report["shared"]), ""]
    if "beams" in report:
        lines += [*_beams(report["beams"]), ""]
    server = report["server"]
    shown = {k: v for k, v in settings.items() if k != "num_blocks"}
    if "kv_cache_dtype" in server:
        lines += [
            f"Blocks of {server['kv_cache_dtype']}, {server['bytes_per_block']:,} bytes each "
            "over every layer, K and V (the executor's `--kv-cache-dtype`).",
            "",
        ]
    lines += [
        f"Preemptions: {server['num_preemptions']}; block-pool integrity: "
        f"{'ok' if server['integrity_ok'] else 'FAILED'}.",
        "",
        "Settings: " + ", ".join(f"{k} {v}" for k, v in shown.items()) + ".",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in report["machine"].items()) + ".",
        "",
    ]
    return "\n".join(lines)


def _runs(report: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, Any]]]:
    runs: list[tuple[str, str, Mapping[str, Any]]] = []
    if "chat" in report:
        runs.append(("1. chat", "paged", report["chat"]))
    if "shared" in report:
        runs.append(("2. shared prompt", "prefix caching", report["shared"]["prefix_caching"]))
        runs.append(
            ("2. shared prompt", "no prefix caching", report["shared"]["no_prefix_caching"])
        )
    if "beams" in report:
        for key in ("beam_search", "parallel_sampling", "independent"):
            runs.append(("3. beams", key.replace("_", " "), report["beams"][key]))
    return runs


def plot(report: Mapping[str, Any], path: Path) -> None:
    """Blocks held over time, one panel per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _runs(report)
    panels = list(dict.fromkeys(name for name, _, _ in runs))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for name, label, run in runs:
            if name == panel:
                s = run["samples"]
                ax.plot(s["times_s"], s["blocks_held"], label=label)
        ax.set_title(panel)
        ax.set_xlabel("seconds")
        ax.set_ylabel("blocks held")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def bars(report: Mapping[str, Any], path: Path) -> None:
    """Peak blocks held, paged against contiguous, per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: list[tuple[str, dict[str, int]]] = []
    if "chat" in report:
        c = report["chat"]
        groups.append(
            (
                "1. chat: requests a budget admits",
                {
                    "contiguous": c["contiguous_concurrency"],
                    "paged": round(c["paged_concurrency_measured"]),
                },
            )
        )
    if "shared" in report:
        s = report["shared"]
        groups.append(
            (
                "2. shared prompt: peak blocks",
                {
                    "contiguous": s["contiguous_blocks"],
                    "no prefix caching": s["no_prefix_caching"]["peak_blocks_held"],
                    "prefix caching": s["prefix_caching"]["peak_blocks_held"],
                },
            )
        )
    if "beams" in report:
        b = report["beams"]
        groups.append(
            (
                "3. beams: peak blocks",
                {
                    "contiguous copies": b["contiguous_copies_blocks"],
                    "independent": b["independent"]["peak_blocks_held"],
                    "n sampling": b["parallel_sampling"]["peak_blocks_held"],
                    "beam search": b["beam_search"]["peak_blocks_held"],
                },
            )
        )
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (title, values) in zip(axes[0], groups, strict=True):
        ax.bar(list(values), list(values.values()), color="tab:blue")
        for i, v in enumerate(values.values()):
            ax.annotate(f"{v:,}", (i, v), ha="center", va="bottom")
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(report: Mapping[str, Any], path: Path) -> None:
    """``path`` (JSON), and beside it .md, .png (blocks over time) and
    -bars.png."""
    path.write_text(json.dumps(report, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(report))
    plot(report, path.with_suffix(".png"))
    bars(report, path.with_name(path.stem + "-bars.png"))
