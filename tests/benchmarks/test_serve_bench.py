"""``pagedkv bench serve``: the workload, the metrics, the GPU idle measure on
a synthetic trace, and a reduced run against a real ``pagedkv serve``."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from pagedkv.bench.scheduler.serving.cli import register
from pagedkv.bench.scheduler.serving.load import RequestResult
from pagedkv.bench.scheduler.serving.metrics import Slo, itl_s, summarize, tpot_s
from pagedkv.bench.scheduler.serving.report import markdown, plot
from pagedkv.bench.scheduler.serving.run import main
from pagedkv.bench.scheduler.serving.runs import parse_fixed_batches
from pagedkv.bench.scheduler.serving.step_trace import analyze as analyze_trace
from pagedkv.bench.scheduler.serving.sweep import Setting, best_setting, parse_settings
from pagedkv.bench.scheduler.serving.workload import (
    MixConfig,
    fixed_batch,
    parse_rates,
    poisson_arrivals,
    sharegpt_like,
)
from pagedkv.common.step_trace import StepTrace
from pagedkv.executor.gpu_idle import STEP_ANNOTATION, gpu_busy, gpu_idle, gpu_time_by_name
from pagedkv.executor.launched import TRACE_FIELDS as EXECUTOR_FIELDS
from pagedkv.scheduler.step_loop import TRACE_FIELDS as SCHEDULER_FIELDS


def test_the_mix_is_seeded_fits_the_context_and_shares_system_prompts() -> None:
    config = MixConfig(num_requests=200, max_model_len=128, vocab_size=100, seed=3)
    mix = sharegpt_like(config)
    assert mix == sharegpt_like(config)
    assert mix != sharegpt_like(MixConfig(num_requests=200, max_model_len=128, vocab_size=100))
    assert all(len(r.prompt_token_ids) + r.max_tokens <= 128 for r in mix)
    assert all(r.max_tokens >= 1 and r.prompt_token_ids for r in mix)
    heads = [r.prompt_token_ids[:64] for r in mix if len(r.prompt_token_ids) >= 64]
    assert len(heads) - len(set(heads)) > 10  # system prompts repeat


def test_poisson_arrivals_have_the_rate_and_inf_sends_all_at_once() -> None:
    times = poisson_arrivals(4000, 8.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert 7.5 < len(times) / times[-1] < 8.5
    assert poisson_arrivals(5, math.inf) == [0.0] * 5
    assert parse_rates("2, 4,inf") == [2.0, 4.0, math.inf]
    with pytest.raises(ValueError):
        parse_rates("0,2")


def test_fixed_batches_parse_and_have_their_shape() -> None:
    assert [tuple(b) for b in parse_fixed_batches("64x512x256, 2x3x4")] == [
        (64, 512, 256),
        (2, 3, 4),
    ]
    assert parse_fixed_batches("") == []
    with pytest.raises(ValueError):
        parse_fixed_batches("64x512")
    batch = fixed_batch(3, 7, 5, vocab_size=50)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in batch] == [(7, 5)] * 3


def _result(times: tuple[float, ...], counts: tuple[int, ...], max_tokens: int) -> RequestResult:
    return RequestResult("r", 10, 0, max_tokens, sum(counts), 0.0, 1.0, times, counts, 2.0, "")


def test_ttft_tpot_itl_and_goodput_of_known_requests() -> None:
    # Sent at 1.0: first token at 1.1, then chunks of 1 and 2 tokens.
    fast = _result((1.1, 1.2, 1.4), (1, 1, 2), 4)
    slow = _result((1.9, 2.0), (1, 1), 2)
    short = _result((1.2,), (1,), 2)  # one token of the two asked for
    assert tpot_s(fast) == pytest.approx(0.3 / 3)
    assert itl_s(fast) == pytest.approx([0.1, 0.1, 0.1])
    summary = summarize([fast, slow, short], 2.0, Slo(ttft_ms=500, tpot_ms=150))
    assert summary["num_ok"] == 2 and summary["num_wrong_token_counts"] == 1
    assert summary["ttft_ms"]["p50"] == pytest.approx(500.0)  # of 100 and 900
    assert summary["num_meeting_slo"] == 1  # slow misses TTFT, short is wrong
    assert summary["goodput_requests_per_s"] == pytest.approx(0.5)
    assert summary["output_tokens"] == 7


def _failed(sent: float, error: str) -> RequestResult:
    return RequestResult("f", 10, 0, 4, 0, 0.0, sent, (), (), sent + 0.1, error)


def test_failed_requests_are_counted_with_the_first_ones_error() -> None:
    ok = _result((1.1, 1.2), (1, 1), 2)
    late = _failed(1.5, "UNAVAILABLE: gone")
    early = _failed(0.5, "INVALID_ARGUMENT: prompt_token_ids: too long")
    summary = summarize([ok, late, early], 2.0, Slo(ttft_ms=500, tpot_ms=150))
    assert (summary["num_ok"], summary["num_failed"]) == (1, 2)
    assert summary["first_error"] == "INVALID_ARGUMENT: prompt_token_ids: too long"
    none = summarize([late, early], 2.0, Slo(ttft_ms=500, tpot_ms=150))
    assert none["num_ok"] == 0 and none["ttft_ms"]["p50"] is None
    assert none["output_tokens_per_s"] == 0.0
    clean = summarize([ok], 2.0, Slo(ttft_ms=500, tpot_ms=150))
    assert clean["num_failed"] == 0 and clean["first_error"] is None


def test_the_report_of_runs_without_a_finished_request_says_why(tmp_path: Path) -> None:
    slo = Slo(ttft_ms=500, tpot_ms=150)
    error = "INVALID_ARGUMENT: prompt_token_ids: too long"
    half = summarize([_result((1.1, 1.2), (1, 1), 2), _failed(1.0, error)], 2.0, slo)
    nothing = summarize([_failed(0.0, error), _failed(0.1, error)], 1.0, slo)
    report = {
        "settings": {
            "model": "m", "device": "cpu", "num_requests": 2, "slo_ttft_ms": 500,
            "slo_tpot_ms": 150,
        },
        "machine": {},
        "model_shape": "tiny",
        "rates": [{"rate": "inf", "summary": half, "requests": []}],
        "fixed_batches": [{"batch": 2, "prompt_len": 2000, "max_tokens": 3, "pagedkv": nothing}],
    }  # fmt: skip
    text = markdown(report)
    assert "| inf | 1/2 | 1 |" in text
    assert "| pagedkv serve | 2 x (2000 -> 3) | 0/2 | 0 | 1.00 | - / - | - / - |" in text
    assert f"- rate inf: 1 of 2 requests failed (first error: {error})" in text
    assert f"- fixed batch 2 x (2000 -> 3): 2 of 2 requests failed (first error: {error})" in text
    plot(report, tmp_path / "report.png")
    assert (tmp_path / "report.png").stat().st_size > 0


def _span(cat: str, ts: float, dur: float, **args: object) -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": "x", "ts": ts, "dur": dur, "args": args}


def test_gpu_idle_splits_idle_time_between_and_inside_steps() -> None:
    events = []
    # Two steps: CPU ranges [0, 100] and [150, 250]; each launches two kernels.
    for step, base in enumerate((0.0, 150.0)):
        events.append(
            {"ph": "X", "cat": "user_annotation", "name": STEP_ANNOTATION, "ts": base, "dur": 100}
        )
        for k in range(2):
            correlation = 10 * step + k
            events.append(_span("cuda_runtime", base + 5 + k, 1, correlation=correlation))
            # kernels: [base+10, base+40] and [base+50, base+80] (a 10 us gap inside)
            events.append(_span("kernel", base + 10 + 40 * k, 30, correlation=correlation))
    events.append(_span("kernel", 500, 10, correlation=99))  # launched outside any step
    idle = gpu_idle(events)
    assert idle.num_steps == 2 and idle.num_gpu_events == 4
    assert idle.window_us == pytest.approx(220.0)  # 10 .. 230
    assert idle.busy_us == pytest.approx(120.0)
    assert idle.between_steps_idle_us == pytest.approx(80.0)  # 80 .. 160
    assert idle.idle_fraction == pytest.approx(100 / 220)
    assert idle.between_steps_idle_fraction == pytest.approx(80 / 220)
    assert idle.median_step_gpu_span_us == pytest.approx(70.0)
    # Every kernel is its own launch: no idle inside a launch.
    assert idle.inside_launches_idle_us == 0.0
    assert idle.between_launches_idle_fraction == pytest.approx(idle.idle_fraction)


def test_idle_inside_a_graph_replay_is_told_from_idle_between_launches() -> None:
    # One step [0, 100]: a graph replay (correlation 1) of two kernels with a
    # 5 us gap between them, then a sampling kernel (2) 20 us later.
    events = [
        {"ph": "X", "cat": "user_annotation", "name": STEP_ANNOTATION, "ts": 0.0, "dur": 100},
        _span("cuda_runtime", 1, 1, correlation=1),
        _span("cuda_runtime", 2, 1, correlation=2),
        _span("kernel", 10, 10, correlation=1),  # 10 .. 20
        _span("kernel", 25, 10, correlation=1),  # 25 .. 35
        _span("kernel", 55, 5, correlation=2),  # 55 .. 60
    ]
    for idle in (gpu_idle(events), gpu_busy(events)):
        assert idle.window_us == pytest.approx(50.0)  # 10 .. 60
        assert idle.idle_us == pytest.approx(25.0)
        assert idle.inside_launches_idle_us == pytest.approx(5.0)
        assert idle.between_launches_idle_fraction == pytest.approx(20 / 50)


def _write_trace(folder: Path, role: str, fields: tuple[str, ...], records: list[tuple]) -> None:
    trace = StepTrace(folder / f"{role}-1.json", role, fields)
    for record in records:
        trace.add(*record)
    trace.write()


def test_gpu_time_by_name_ranks_kernels_by_their_time_per_decode_step() -> None:
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 30},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 40, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "norm", "ts": 100, "dur": 4},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 110, "dur": 2},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 9},
    ]
    ranked = gpu_time_by_name(events, num_decode_steps=2, top=2)
    assert [tuple(k) for k in ranked] == [("gemm", 40.0, 1.0), ("norm", 2.0, 0.5)]


def test_gpu_time_by_name_counts_only_the_work_of_profiled_steps_when_told() -> None:
    events = [
        {"ph": "X", "cat": "user_annotation", "name": STEP_ANNOTATION, "ts": 0.0, "dur": 50},
        _span("cuda_runtime", 5, 1, correlation=1),
        _span("cuda_runtime", 80, 1, correlation=2),  # after the step: not counted
        {**_span("kernel", 10, 30, correlation=1), "name": "gemm"},
        {**_span("kernel", 90, 30, correlation=2), "name": "gemm"},
    ]
    ranked = gpu_time_by_name(events, num_decode_steps=1, step_name=STEP_ANNOTATION)
    assert [tuple(k) for k in ranked] == [("gemm", 30.0, 1.0)]
    assert [tuple(k) for k in gpu_time_by_name(events, 1)] == [("gemm", 60.0, 2.0)]


def test_a_step_trace_splits_device_idle_time_by_its_cause(tmp_path: Path) -> None:
    # Three steps; times in ms. The device runs [10, 20], [21, 31] and [40, 50]:
    # step 2 was read at 20 and launched by 21 (1 ms launching); step 3 was
    # sent at 33 (2 ms late), read at 36 (3 ms in transit) and started at 40
    # (4 ms launching).
    ms = 1e-3
    scheduler = [  # step_id, entries, tokens, num_steps, scheduling .. processed, cpu
        (1, 4, 4, 1, 1 * ms, 2 * ms, 3 * ms, 22 * ms, 23 * ms, 0.0),
        (2, 4, 4, 1, 4 * ms, 5 * ms, 6 * ms, 32 * ms, 33 * ms, 5 * ms),
        (3, 4, 20, 1, 32 * ms, 32.5 * ms, 33 * ms, 52 * ms, 53 * ms, 13 * ms),  # prompt tokens
        (4, 4, 4, 1, 60 * ms, 61 * ms, 62 * ms, 70 * ms, 71 * ms, 15 * ms),  # after `until`
    ]
    executor = [  # step_id, rows, num_steps, received, planned, applied, ran, launched,
        # launch CPU, done, completed, device span, cpu, host blocks offloaded, loaded
        (
            1,
            4,
            1,
            4 * ms,
            5 * ms,
            6 * ms,
            8 * ms,
            9 * ms,
            2 * ms,
            20 * ms,
            21 * ms,
            10 * ms,
            20 * ms,
            0.0,
            0,
            0,
        ),
        (
            2,
            4,
            1,
            7 * ms,
            7.5 * ms,
            8 * ms,
            20 * ms,
            20.5 * ms,
            4 * ms,
            31 * ms,
            31.5 * ms,
            21 * ms,
            31 * ms,
            10 * ms,
            0,
            0,
        ),
        (
            3,
            4,
            1,
            36 * ms,
            37 * ms,
            37.5 * ms,
            38 * ms,
            39 * ms,
            3 * ms,
            50 * ms,
            51 * ms,
            40 * ms,
            50 * ms,
            20 * ms,
            2,
            5,
        ),
    ]
    _write_trace(tmp_path, "scheduler", SCHEDULER_FIELDS, scheduler)
    _write_trace(tmp_path, "executor", EXECUTOR_FIELDS, executor)
    trace = analyze_trace(tmp_path, since=0.0, until=40 * ms)
    assert (trace["steps"], trace["decode_steps"], trace["windows"]) == (3, 3, 0)
    assert trace["span_ms"] == pytest.approx(40.0)
    assert trace["device_busy_fraction"] == pytest.approx(30 / 40)
    assert trace["idle_ms"] == pytest.approx(
        {"late_send": 2.0, "in_transit": 3.0, "launching": 5.0}
    )
    median = trace["median_us"]
    assert median["executor_launch"] == pytest.approx(5000.0)  # of 5, 13.5, 3
    assert median["executor_plan"] == pytest.approx(1000.0)  # of 1, 0.5, 1
    assert median["executor_apply"] == pytest.approx(500.0)  # of 1, 0.5, 0.5
    assert median["executor_run"] == pytest.approx(2000.0)  # of 2, 12, 0.5
    assert median["executor_launch_cpu"] == pytest.approx(3000.0)  # of 2, 4, 3
    assert trace["cpu_use"]["executor"] == pytest.approx(20 / 30, abs=1e-3)  # completed 21 .. 51
    assert trace["device_ms_by_kind"] == {
        "decode": {"steps": 2, "tokens": 8, "device_ms": pytest.approx(20.0), "loaded_blocks": 0},
        "prefill+loads": {
            "steps": 1,
            "tokens": 20,
            "device_ms": pytest.approx(10.0),
            "loaded_blocks": 5,
        },
    }
    assert trace["host_copies"] == {"offloaded_blocks": 2, "loaded_blocks": 5}


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(), "serve")
    return parser.parse_args(["serve", *argv])


@pytest.mark.slow
def test_a_reduced_run_against_pagedkv_serve_finishes_every_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pagedkv.executor.tiny_model import make_tiny_model

    model = tmp_path / "model"
    make_tiny_model(model, "llama", seed=7)
    output = tmp_path / "serve-bench-cpu.json"
    argv = ["--model", str(model), "--rates", "8,inf", "--num-requests", "4"]
    argv += ["--mean-prompt-len", "20", "--mean-output-len", "6", "--system-prompt-len", "16"]
    argv += ["--warmup-requests", "1", "--fixed-batch", "3x12x5", "--num-blocks", "128"]
    argv += ["--hf-repeat", "1", "--step-trace", "--decode-window", "1", "--output", str(output)]
    assert main(_args(argv)) == 0
    report = json.loads(output.read_text())
    assert output.with_suffix(".md").read_text().startswith("# Serving benchmark")
    assert output.with_suffix(".png").stat().st_size > 0
    assert {"machine", "settings", "rates", "fixed_batches", "server"} <= set(report)
    assert [run["rate"] for run in report["rates"]] == ["8", "inf"]
    for run in report["rates"]:
        summary = run["summary"]
        assert summary["num_ok"] == summary["num_requests"] == 4
        assert summary["errors"] == [] and summary["num_wrong_token_counts"] == 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert set(summary[key]) == {"p50", "p90", "p99", "mean"}
        assert summary["output_tokens"] == sum(r["max_tokens"] for r in run["requests"])
        assert all(r["output"] == r["max_tokens"] for r in run["requests"])
    (batch,) = report["fixed_batches"]
    assert (batch["batch"], batch["prompt_len"], batch["max_tokens"]) == (3, 12, 5)
    assert batch["pagedkv"]["output_tokens"] == 15 and batch["pagedkv"]["num_ok"] == 3
    assert batch["hf"]["output_tokens"] == 15 and batch["hf"]["mode"] == "eager, dynamic cache"
    assert report["server"]["integrity_ok"]
    # The traced fixed batch: its 5 tokens take a prefill step and 4 decode steps.
    trace = report["step_trace"]
    assert trace["steps"] == trace["decode_steps"] >= 5 and trace["windows"] == 0
    assert 0 < trace["device_busy_fraction"] <= 1
    idle_ms = sum(trace["idle_ms"].values())
    assert idle_ms == pytest.approx((1 - trace["device_busy_fraction"]) * trace["span_ms"], abs=0.1)
    assert trace["cpu_use"]["scheduler"] > 0 and trace["cpu_use"]["executor"] > 0
    out = capsys.readouterr().out
    assert "Fixed batch" in out and "Where the step time went" in out


def test_a_run_whose_requests_are_refused_reports_them_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pagedkv.executor.tiny_model import MAX_POSITION_EMBEDDINGS, make_tiny_model

    model = tmp_path / "model"
    make_tiny_model(model, "llama", seed=7)
    output = tmp_path / "serve-bench-refused.json"
    # The mix is made for a longer context than the model's: some of its
    # requests do not fit and are refused. The fixed batch's prompts are
    # longer than the model: none of them finishes.
    too_long = MAX_POSITION_EMBEDDINGS + 8
    argv = ["--model", str(model), "--rates", "inf", "--num-requests", "4", "--seed", "3"]
    argv += ["--max-model-len", str(4 * MAX_POSITION_EMBEDDINGS), "--sigma", "0.6"]
    argv += ["--mean-prompt-len", str(MAX_POSITION_EMBEDDINGS), "--mean-output-len", "3"]
    argv += ["--system-prompt-fraction", "0", "--warmup-requests", "0", "--no-hf"]
    argv += ["--fixed-batch", f"2x{too_long}x3", "--num-blocks", "256", "--decode-window", "1"]
    argv += ["--output", str(output)]
    assert main(_args(argv)) == 1
    report = json.loads(output.read_text())
    (run,) = report["rates"]
    summary = run["summary"]
    refused = [
        r for r in run["requests"] if r["prompt"] + r["max_tokens"] > MAX_POSITION_EMBEDDINGS
    ]
    assert 0 < len(refused) < 4  # the seed's mix has both kinds
    assert summary["num_failed"] == len(refused) == 4 - summary["num_ok"]
    first = min(refused, key=lambda r: r["sent_s"])
    assert summary["first_error"] == first["error"]
    assert summary["first_error"].startswith("INVALID_ARGUMENT: ")
    assert f"max_model_len {MAX_POSITION_EMBEDDINGS}" in summary["first_error"]
    (batch,) = report["fixed_batches"]
    s = batch["pagedkv"]
    assert (s["num_ok"], s["num_failed"], s["output_tokens"]) == (0, 2, 0)
    assert s["first_error"].startswith("INVALID_ARGUMENT: prompt")
    assert s["ttft_ms"]["p50"] is None
    text = output.with_suffix(".md").read_text()
    assert (
        f"- rate inf: {len(refused)} of 4 requests failed (first error: {first['error']})" in text
    )
    assert f"- fixed batch 2 x ({too_long} -> 3): 2 of 2 requests failed" in text
    assert text in capsys.readouterr().out


def test_an_executor_shared_by_schedulers_in_turn_has_each_step_matched_to_its_own_record(
    tmp_path: Path,
) -> None:
    # Two schedulers stepped the executor in turn, both numbering from 1: the
    # second one's steps 1 and 2 (sent at 100 and 110 ms) must not match the
    # first one's records of steps 1 and 2 (read at 4 and 7 ms).
    ms = 1e-3
    scheduler = [
        (1, 4, 4, 1, 100 * ms, 101 * ms, 102 * ms, 108 * ms, 109 * ms, 0.0),
        (2, 4, 32, 8, 103 * ms, 104 * ms, 105 * ms, 140 * ms, 141 * ms, 1 * ms),
    ]
    executor = [  # the launch's phases all at its start, no launch CPU
        (*row[:4], row[3], row[3], row[3], row[4], 0.0, *row[5:], 0, 0)
        for row in (
            (1, 4, 1, 4 * ms, 9 * ms, 20 * ms, 21 * ms, 10 * ms, 20 * ms, 0.0),
            (2, 4, 1, 7 * ms, 20.5 * ms, 31 * ms, 31.5 * ms, 21 * ms, 31 * ms, 10 * ms),
            (1, 4, 1, 102.5 * ms, 103 * ms, 107 * ms, 107.5 * ms, 103 * ms, 107 * ms, 11 * ms),
            (2, 4, 8, 105.5 * ms, 106 * ms, 139 * ms, 139.5 * ms, 107 * ms, 139 * ms, 40 * ms),
        )
    ]
    _write_trace(tmp_path, "scheduler", SCHEDULER_FIELDS, scheduler)
    _write_trace(tmp_path, "executor", EXECUTOR_FIELDS, executor)
    trace = analyze_trace(tmp_path, since=90 * ms)
    assert (trace["steps"], trace["decode_steps"], trace["windows"]) == (2, 9, 1)
    assert trace["span_ms"] == pytest.approx(36.0)  # device from 103 to 139
    assert trace["device_busy_fraction"] == pytest.approx(1.0)


def test_sweep_settings_parse_and_bad_ones_name_the_option() -> None:
    assert parse_settings("1:2, 8:3") == [Setting(1, 2), Setting(8, 3)]
    for bad in ("8", "8:0", "a:2", ""):
        with pytest.raises(ValueError, match="sweep"):
            parse_settings(bad)


@pytest.mark.slow
def test_a_sweep_runs_every_setting_on_one_executor_and_finishes_every_request(
    tmp_path: Path,
) -> None:
    from pagedkv.executor.tiny_model import make_tiny_model

    model = tmp_path / "model"
    make_tiny_model(model, "llama", seed=7)
    output = tmp_path / "sweep-cpu.json"
    argv = ["--model", str(model), "--sweep", "1:2,4:3", "--fixed-batch", "3x12x9,2x8x5"]
    argv += ["--warmup-requests", "1", "--mean-prompt-len", "20", "--mean-output-len", "6"]
    argv += ["--system-prompt-len", "16", "--num-blocks", "128", "--output", str(output)]
    assert main(_args(argv)) == 0
    report = json.loads(output.read_text())
    assert report["rates"] == [] and report["fixed_batches"] == []
    assert report["sweep"]["settings"] == ["1:2", "4:3"]
    runs = report["sweep"]["runs"]
    assert [run["setting"] for run in runs] == [
        {"decode_window": 1, "pipeline_depth": 2},
        {"decode_window": 4, "pipeline_depth": 3},
    ]
    for run in runs:
        assert [(b["batch"], b["max_tokens"]) for b in run["fixed_batches"]] == [(3, 9), (2, 5)]
        for b in run["fixed_batches"]:
            assert b["pagedkv"]["num_ok"] == b["batch"]
            assert b["pagedkv"]["output_tokens"] == b["batch"] * b["max_tokens"]
            assert 0 < b["step_trace"]["device_busy_fraction"] <= 1
    # Each batch's trace holds its own steps: 9 tokens are a prefill and 8
    # decodes, in windows under the second setting.
    plain, windowed = (run["fixed_batches"][0]["step_trace"] for run in runs)
    assert plain["windows"] == 0 and plain["steps"] == plain["decode_steps"] >= 9
    assert windowed["windows"] >= 1 and windowed["steps"] < windowed["decode_steps"]
    assert "Scheduler settings on one executor" in output.with_suffix(".md").read_text()
    assert not output.with_suffix(".png").exists()


def test_the_timeline_counts_a_decode_window_as_its_steps(tmp_path: Path) -> None:
    from pagedkv.executor.timeline import StepProfiler
    from pagedkv.v1 import executor_pb2

    profiler = StepProfiler(tmp_path, skip=20, steps=16)
    prefill = executor_pb2.StepRequest(num_scheduled_tokens=[5, 7])
    window = executor_pb2.StepRequest(num_scheduled_tokens=[1, 1], num_decode_steps=8)
    assert not profiler.around(prefill)
    # Windows of 8: steps 1-8, 9-16 and 17-24 are skipped (the third one is
    # not whole after the 20 skipped), 25-32 and 33-40 profiled.
    assert [profiler.around(window) for _ in range(3)] == [False] * 3
    # Two phases of 16 steps: GPU activity only (steps 25-40), then CPU too (41-56).
    for _ in range(3):
        assert profiler.around(window)
        profiler.after()
        assert not (tmp_path / "timeline.json").exists()
    assert profiler.around(window)
    profiler.after()
    measures = json.loads((tmp_path / "timeline.json").read_text())
    assert (measures["skipped_decode_steps"], measures["profiled_decode_steps"]) == (40, 16)
    gpu_only = measures["gpu_only"]
    assert (gpu_only["skipped_decode_steps"], gpu_only["profiled_decode_steps"]) == (24, 16)
    assert not profiler.around(window)  # done


def test_gpu_busy_measures_the_whole_window_of_gpu_events() -> None:
    events = [
        _span("kernel", 10, 30),
        _span("kernel", 30, 20),  # overlaps the first: busy 10 .. 50
        _span("gpu_memcpy", 60, 10),
        _span("cuda_runtime", 0, 100),  # not GPU work
        {"ph": "i", "cat": "kernel", "ts": 200},  # not a span
    ]
    busy = gpu_busy(events)
    assert busy.num_gpu_events == 3 and busy.inside_launches_idle_us == 0.0
    assert busy.window_us == pytest.approx(60.0)  # 10 .. 70
    assert busy.busy_us == pytest.approx(50.0)
    assert busy.idle_fraction == pytest.approx(10 / 60)
    with pytest.raises(AssertionError, match="no GPU event"):
        gpu_busy([_span("cuda_runtime", 0, 1)])


def test_the_best_sweep_setting_comes_closest_to_every_target() -> None:
    def run(window: int, depth: int, tok_64: float, tok_256: float) -> dict[str, object]:
        return {
            "setting": {"decode_window": window, "pipeline_depth": depth},
            "fixed_batches": [
                {"batch": 64, "pagedkv": {"output_tokens_per_s": tok_64}},
                {"batch": 256, "pagedkv": {"output_tokens_per_s": tok_256}},
            ],
        }

    # 8:2 is fastest at 64 but worst at 256 against its target; 16:2 is the best
    # at its worse batch (0.9 of 40,000 against 0.8 of 25,000 for 8:3).
    sweep = {"runs": [run(8, 2, 30000, 20000), run(8, 3, 20000, 39000), run(16, 2, 24000, 36000)]}
    assert best_setting(sweep, {64: 25000, 256: 40000}) == Setting(16, 2)
    assert best_setting(sweep, {64: 25000}) == Setting(8, 2)
    with pytest.raises(ValueError, match="no batch"):
        best_setting(sweep, {8: 1000})


def test_bad_rates_batches_and_settings_are_refused_naming_the_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for option, value in (("--rates", "0,2"), ("--fixed-batch", "8x2"), ("--sweep", "8")):
        with pytest.raises(SystemExit) as stopped:
            _args([option, value])
        assert stopped.value.code == 2
        assert f"argument {option}: " in capsys.readouterr().err
    assert _args(["--sweep", "1:2,8:3"]).sweep == "1:2,8:3"
