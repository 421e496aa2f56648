"""The serving benchmark's markdown and plot, from its JSON report.

``markdown`` has a table per kind of run (one row per rate, one per fixed
batch and engine; with ``--gateway`` the HTTP runs beside the gRPC ones and
a table comparing them), the timeline when measured, and the settings and
machine;
``plot`` draws latency against request rate (TTFT, TPOT and ITL p50/p99) and
output throughput against concurrency (the rates at their measured mean
concurrency, each fixed batch and Hugging Face at its batch size).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pagedkv.bench.scheduler.serving.gateway import markdown_lines as gateway_lines
from pagedkv.bench.scheduler.serving.metrics import failure_note, ms_cell
from pagedkv.bench.scheduler.serving.probe import markdown_lines as probe_lines
from pagedkv.bench.scheduler.serving.sweep import markdown_lines as sweep_lines


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _ms(values: dict[str, float | None]) -> str:
    return ms_cell(values, ("p50", "p90", "p99"), 1)


def _rate_lines(report: Mapping[str, Any]) -> list[str]:
    settings = report["settings"]
    lines = [
        "",
        f"## Poisson arrivals ({settings['num_requests']} requests per rate, "
        f"ShareGPT-like mix; SLO: TTFT <= {settings['slo_ttft_ms']:g} ms and TPOT <= "
        f"{settings['slo_tpot_ms']:g} ms)",
        "",
        "| rate (req/s) | finished | failed | req/s | output tok/s | concurrency | "
        "TTFT p50/p90/p99 (ms) | TPOT p50/p90/p99 (ms) | ITL p50/p90/p99 (ms) | "
        "goodput (req/s) | within SLO |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for run in report["rates"]:
        runs = [(run["rate"], run["summary"])]
        if "http" in run:
            runs.append((f"{run['rate']} (HTTP)", run["http"]["summary"]))
        for label, s in runs:
            notes += failure_note(f"rate {label}", s)
            lines.append(
                f"| {label} | {s['num_ok']}/{s['num_requests']} | {s['num_failed']} | "
                f"{s['requests_per_s']:.2f} | {s['output_tokens_per_s']:.0f} | "
                f"{s['mean_concurrency']:.1f} | {_ms(s['ttft_ms'])} | {_ms(s['tpot_ms'])} | "
                f"{_ms(s['itl_ms'])} | {s['goodput_requests_per_s']:.2f} | "
                f"{100 * s['num_meeting_slo'] / s['num_requests']:.0f}% |"
            )
    return lines + (["", *notes] if notes else [])


def markdown(report: Mapping[str, Any]) -> str:
    settings = report["settings"]
    lines = [
        "# Serving benchmark (`pagedkv bench serve`)",
        "",
        f"Model: {settings['model']}; device {settings['device']}; {report['model_shape']}.",
    ]
    if report["rates"]:
        lines += _rate_lines(report)
    if report["fixed_batches"]:
        lines += [
            "",
            "## Fixed batch (all requests at once), same device",
            "",
            "| engine | requests x (prompt -> output) | finished | output tok/s | seconds | "
            "TTFT p50/p99 (ms) | TPOT p50/p99 (ms) |",
            "|---|---|---|---|---|---|---|",
        ]
        notes: list[str] = []
        for run in report["fixed_batches"]:
            shape = f"{run['batch']} x ({run['prompt_len']} -> {run['max_tokens']})"
            engines = [("pagedkv serve", "", run["pagedkv"])]
            if "http" in run:
                engines.append(("pagedkv gateway (HTTP)", " over HTTP", run["http"]))
            for engine, over, s in engines:
                notes += failure_note(f"fixed batch {shape}{over}", s)
                lines.append(
                    f"| {engine} | {shape} | {s['num_ok']}/{s['num_requests']} | "
                    f"{s['output_tokens_per_s']:.0f} | {s['seconds']:.2f} | "
                    f"{ms_cell(s['ttft_ms'], ('p50', 'p99'), 0)} | "
                    f"{ms_cell(s['tpot_ms'], ('p50', 'p99'), 2)} |"
                )
            hf = run.get("hf")
            if hf:
                lines.append(
                    f"| HF generate ({hf['mode']}) | {shape} | {run['batch']}/{run['batch']} | "
                    f"{hf['output_tokens_per_s']:.0f} | {hf['seconds']:.2f} | - | - |"
                )
        if notes:
            lines += ["", *notes]
        through_gateway = gateway_lines(report["fixed_batches"], settings.get("grpc_text", False))
        lines += ["", *through_gateway] if through_gateway else []
    if "gateway_probe" in report:
        lines += ["", *probe_lines(report["gateway_probe"])]
    timeline = report.get("timeline")
    if timeline and "error" in timeline:
        lines += ["", f"GPU timeline: not measured ({timeline['error']})."]
    elif timeline:
        lines += [
            "",
            "## GPU timeline of decode steps (torch profiler)",
            "",
            f"{timeline['profiled_decode_steps']} decode steps of the first fixed batch "
            f"(after {timeline['skipped_decode_steps']}): GPU idle "
            f"{100 * timeline['idle_fraction']:.1f}% of the window, of which between steps "
            f"{100 * timeline['between_steps_idle_fraction']:.1f}% (median gap "
            f"{timeline['median_gap_between_steps_us']:.0f} us; a step's GPU span "
            f"{timeline['median_step_gpu_span_us']:.0f} us). The profiler's host overhead "
            "makes these upper bounds.",
            *_launch_split(timeline),
        ]
        lines += _gpu_only_lines(timeline.get("gpu_only"))
        kernels = timeline.get("gpu_time_by_name")
        if kernels:
            lines += [
                "",
                "Where the GPU time went (the profiled window's GPU events by name):",
                "",
                "| kernel or copy | GPU us per decode step | launches per decode step |",
                "|---|---|---|",
            ]
            lines += [
                f"| `{k['name']}` | {k['us_per_step']:.1f} | {k['launches_per_step']:.1f} |"
                for k in kernels
            ]
    lines += _step_trace_lines(report.get("step_trace"))
    if "sweep" in report:
        lines += ["", *sweep_lines(report["sweep"])]
    lines += [
        "",
        "Settings: " + json.dumps(settings),
        "",
        "Machine: " + json.dumps(report["machine"]),
        "",
    ]
    return "\n".join(lines)


def _gpu_only_lines(gpu_only: Mapping[str, Any] | None) -> list[str]:
    """The idle time of the decode steps profiled with GPU activity only."""
    if not gpu_only:
        return []
    if "error" in gpu_only:
        return ["", f"Profiled with GPU activity only: not measured ({gpu_only['error']})."]
    return [
        "",
        f"Profiled with GPU activity only (no CPU ops, so without their host overhead), "
        f"{gpu_only['profiled_decode_steps']} decode steps just before those "
        f"(after {gpu_only['skipped_decode_steps']}): GPU idle "
        f"{100 * gpu_only['idle_fraction']:.1f}% of the window "
        f"({gpu_only['idle_us'] / gpu_only['profiled_decode_steps']:.0f} us per decode step "
        f"of {gpu_only['window_us'] / gpu_only['profiled_decode_steps']:.0f}), between and "
        "inside steps together.",
        *_launch_split(gpu_only),
    ]


def _launch_split(measures: Mapping[str, Any]) -> list[str]:
    """The idle time inside CUDA graph replays and between launches, where measured."""
    if "between_launches_idle_fraction" not in measures:
        return []
    inside = measures["inside_launches_idle_us"] / measures["window_us"]
    return [
        f"Of that idle time, {100 * inside:.1f}% of the window lies between the kernels "
        "of one CUDA graph replay (part of a decode step's GPU time) and "
        f"{100 * measures['between_launches_idle_fraction']:.1f}% between launches "
        "(the GPU waiting for the host: between a window's decode steps and between windows)."
    ]


def _step_trace_lines(trace: Mapping[str, Any] | None) -> list[str]:
    if not trace:
        return []
    b = trace["batch"]
    idle = trace["idle_ms"]
    what = (
        "Every step of the run"
        if b is None
        else f"The first fixed batch ({b['batch']} x ({b['prompt_len']} -> {b['max_tokens']}))"
    )
    lines = [
        "",
        "## Where the step time went (step trace)",
        "",
        f"{what}: "
        f"{trace['steps']} steps, {trace['decode_steps']} decode steps' worth "
        f"({trace['windows']} windows) in {trace['span_ms']:.1f} ms, "
        f"{trace['wall_per_decode_step_us']:.0f} us each; the device was busy "
        f"{100 * trace['device_busy_fraction']:.1f}% of it. Idle: "
        f"{idle['late_send']:.1f} ms before the scheduler sent the next step, "
        f"{idle['in_transit']:.1f} ms while it was in transit, "
        f"{idle['launching']:.1f} ms while the executor launched it. "
        f"CPU use: scheduler {trace['cpu_use']['scheduler']:.2f}, "
        f"executor {trace['cpu_use']['executor']:.2f} (CPU seconds per second).",
        "",
        "| stage | median (us) |",
        "|---|---|",
    ]
    lines += [f"| {name} | {value:.0f} |" for name, value in trace["median_us"].items()]
    kinds = trace.get("device_ms_by_kind")
    if kinds:
        copies = trace["host_copies"]
        lines += [
            "",
            "Device time by kind of step (prefill: it computed prompt tokens; +loads: it "
            f"loaded host-tier blocks; {copies['offloaded_blocks']} blocks offloaded and "
            f"{copies['loaded_blocks']} loaded in all):",
            "",
            "| kind | steps | tokens | device ms | blocks loaded |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {kind} | {row['steps']} | {row.get('tokens', '')} | {row['device_ms']:.1f} | "
            f"{row['loaded_blocks']} |"
            for kind, row in kinds.items()
        ]
    return lines


def _batch_panels(ttft: Any, tpot: Any, batches: list[dict[str, Any]]) -> None:
    """Without rates: TTFT p50/p99 and TPOT/ITL p50 of each fixed batch run,
    as bars per batch (gRPC, and HTTP beside it where it ran)."""
    labels = [f"{b['batch']} x ({b['prompt_len']} -> {b['max_tokens']})" for b in batches]
    engines = [("pagedkv", "gRPC")] + ([("http", "HTTP")] if "http" in batches[0] else [])
    width = 0.8 / len(engines)
    for j, (key, name) in enumerate(engines):
        x = [i + (j - (len(engines) - 1) / 2) * width for i in range(len(batches))]
        for ax, metric, quantiles in (
            (ttft, "ttft_ms", ("p99", "p50")),
            (tpot, "itl_ms", ("p50",)),
        ):
            for q in quantiles:
                values = [b[key][metric][q] or 0.0 for b in batches]
                hatch = "//" if q == "p99" else None
                ax.bar(x, values, width, color=f"C{j}", hatch=hatch, label=f"{name} {q}")
        tpot.plot(x, [b[key]["tpot_ms"]["p50"] or 0.0 for b in batches], "k_", markersize=14)
    for ax, title in ((ttft, "time to first token"), (tpot, "ITL p50 (bars), TPOT p50 (-)")):
        ax.set_xticks(range(len(batches)), labels, rotation=15)
        ax.set_xlabel("fixed batch, in run order")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()


def plot(report: Mapping[str, Any], path: Path) -> None:
    """Three panels: TTFT vs rate, TPOT and ITL vs rate (without rates: per
    fixed batch run), output tok/s vs concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["rates"]
    labels = [run["rate"] for run in runs]
    x = list(range(len(runs)))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    if not runs and report["fixed_batches"]:
        _batch_panels(axes[0], axes[1], report["fixed_batches"])
    for q, style in (("p50", "-o"), ("p99", "--o")) if runs else ():
        axes[0].plot(
            x, [r["summary"]["ttft_ms"][q] for r in runs], style, color="C0", label=f"TTFT {q}"
        )
        axes[1].plot(
            x, [r["summary"]["tpot_ms"][q] for r in runs], style, color="C1", label=f"TPOT {q}"
        )
        axes[1].plot(
            x, [r["summary"]["itl_ms"][q] for r in runs], style, color="C2", label=f"ITL {q}"
        )
    for ax, title in ((axes[0], "time to first token"), (axes[1], "time per output token")):
        if not runs:
            break
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend()
    concurrency = [r["summary"]["mean_concurrency"] for r in runs]
    throughput = [r["summary"]["output_tokens_per_s"] for r in runs]
    if runs:
        axes[2].plot(concurrency, throughput, "-o", label="pagedkv, Poisson rates")
    for c, t, label in zip(concurrency, throughput, labels, strict=True):
        axes[2].annotate(f"{label}/s", (c, t), textcoords="offset points", xytext=(4, -10))
    http = [r["http"]["summary"] for r in runs if "http" in r]
    if http:
        axes[2].plot(
            [s["mean_concurrency"] for s in http],
            [s["output_tokens_per_s"] for s in http],
            ":o",
            label="pagedkv gateway (HTTP), Poisson rates",
        )
    batches = report["fixed_batches"]
    if batches:
        axes[2].plot(
            [b["batch"] for b in batches],
            [b["pagedkv"]["output_tokens_per_s"] for b in batches],
            "s",
            markersize=9,
            label="pagedkv, fixed batch",
        )
        through = [b for b in batches if "http" in b]
        if through:
            axes[2].plot(
                [b["batch"] for b in through],
                [b["http"]["output_tokens_per_s"] for b in through],
                "D",
                markersize=8,
                label="pagedkv gateway (HTTP), fixed batch",
            )
        hf = [b for b in batches if b.get("hf")]
        if hf:
            axes[2].plot(
                [b["batch"] for b in hf],
                [b["hf"]["output_tokens_per_s"] for b in hf],
                "^",
                markersize=9,
                label="HF generate, fixed batch",
            )
    axes[2].set_xlabel("requests in flight (mean)")
    axes[2].set_ylabel("output tokens/s")
    axes[2].set_title("throughput vs concurrency")
    axes[2].legend()
    fig.suptitle(f"pagedkv bench serve: {report['settings']['model']} on {_device(report)}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _device(report: Mapping[str, Any]) -> str:
    return str(report["machine"].get("gpu") or report["settings"]["device"])
