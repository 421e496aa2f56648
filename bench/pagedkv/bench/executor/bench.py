"""``python -m pagedkv.bench.executor.bench``: the executor on a GPU with a ~1.1B
llama (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192,
vocab 32000) in bf16 with random (dummy) weights.

1. Correctness: logits of our paged forward (prefill, then decode steps)
   against Hugging Face's sdpa forward of the same weights over the whole
   sequences.
2. One decode step at batch 64 (``--batch``) x context 768 through
   ``Executor.step`` (in-process, with CUDA graphs and without), through a
   gRPC ``Step`` on 127.0.0.1, and through a gRPC ``StepStream`` with two
   steps in flight (as a scheduler drives it): wall time per step, the
   host's phases without graphs (validation and row updates, metadata, the
   model's launches, sampling, the wait for the tokens), the GPU time of
   the same work with the host out of the way (the GPU spins while the host
   enqueues), and that time by kernel (torch profiler).

Writes a JSON file and a markdown summary.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedkv.bench.executor.bench_grpc import time_grpc, time_stream
from pagedkv.bench.executor.bench_profile import kernel_times, profile_decode
from pagedkv.bench.shapes import LLAMA_SHAPES
from pagedkv.common.step_contract import DEFAULT_DECODE_WINDOW

LLAMA_1B = LLAMA_SHAPES["llama-1.1b"]
BATCH, CONTEXT, PREFILL_CHUNK = 64, 768, 8192
WINDOW = DEFAULT_DECODE_WINDOW  # the decode window measured beside single steps


def _model_dir(root: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(**LLAMA_1B, dtype="bfloat16").save_pretrained(root)
    return root


def _owner() -> Any:
    from pagedkv.v1 import common_pb2

    return common_pb2.Owner(owner_id="bench", epoch=1)


def _prefill(executor: Any, prompts: np.ndarray, step_id: int) -> int:
    """Registers a row per prompt with their prompts and blocks, and prefills them
    in chunks of at most PREFILL_CHUNK tokens; returns the next step id."""
    from pagedkv.v1 import common_pb2, executor_pb2

    owner = _owner()
    block_size = executor.runner.config.block_size
    blocks = -(-(CONTEXT + 64) // block_size)
    per_step = max(1, PREFILL_CHUNK // prompts.shape[1])
    for first in range(0, len(prompts), per_step):
        request = executor_pb2.StepRequest(owner=owner, step_id=step_id)
        step_id += 1
        for row in range(first, min(first + per_step, len(prompts))):
            request.new_requests.add(
                seq_id=f"r{row}",
                row=row,
                prompt_token_ids=prompts[row].tolist(),
                sampling=common_pb2.SamplingParams(temperature=0.0),
            )
            request.num_scheduled_tokens.append(prompts.shape[1])
            request.num_computed_tokens.append(0)
            request.continue_from_sampled.append(False)
            request.needs_sample.append(True)
            request.block_table_starts.append(0)
            request.new_block_counts.append(blocks)
            request.new_block_ids.extend(range(1 + row * blocks, 1 + (row + 1) * blocks))
        executor.step(request)
    return step_id


def decode_request(executor: Any, step_id: int, num_steps: int = 1) -> Any:
    """A decode step of every live row at CONTEXT (``num_steps`` > 1: a
    decode window of that many steps; the prefill left blocks for it)."""
    from pagedkv.v1 import executor_pb2

    rows = executor.runner.rows
    live = np.flatnonzero(rows.live)
    # Every timed step decodes at the same context: the rows' histories are
    # rewound to CONTEXT tokens (the next token overwrites the last one's KV).
    rows.set_num_tokens(live, CONTEXT)
    lengths = rows.num_tokens[live]
    return executor_pb2.StepRequest(
        owner=_owner(),
        step_id=step_id,
        rows=live.tolist(),
        num_scheduled_tokens=[1] * len(live),
        num_computed_tokens=lengths.tolist(),
        continue_from_sampled=[True] * len(live),
        needs_sample=[True] * len(live),
        block_table_starts=rows.num_blocks[0, live].tolist(),
        new_block_counts=[0] * len(live),
        num_decode_steps=num_steps if num_steps > 1 else 0,
    )


def check_logits(executor: Any, prompts: np.ndarray, num_decodes: int = 4) -> dict[str, Any]:
    """Our bf16 logits (a prefill, then greedy decodes) and HF's bf16 sdpa
    logits, each against HF sdpa in float32 on the same weights: ours should
    be as close to float32 as HF's own bf16 forward is."""
    import copy

    runner = executor.runner
    model = runner.model
    reference = copy.deepcopy(model).float()
    reference.set_attn_implementation("sdpa")
    rows = np.arange(len(prompts))
    tokens = torch.from_numpy(prompts).to(runner.device)
    block_size = runner.config.block_size
    blocks = -(-(prompts.shape[1] + num_decodes + 1) // block_size)
    runner.rows.fill_tables(1 + rows[:, None] * blocks + np.arange(blocks))
    errors = {"ours": 0.0, "hf_bf16": 0.0}
    agree = {"ours": 0, "hf_bf16": 0}
    total = 0
    for step in range(num_decodes + 1):
        seq_len = tokens.shape[1]
        computed = np.full(len(rows), 0 if step == 0 else seq_len - 1)
        scheduled = np.full(len(rows), seq_len if step == 0 else 1)
        runner.rows.write_tokens(
            np.repeat(rows, seq_len),
            np.tile(np.arange(seq_len), len(rows)),
            tokens.cpu().numpy().reshape(-1),
        )
        inputs = runner.forward_inputs.prepare(rows, computed, scheduled, np.ones(len(rows), bool))
        logits = {"ours": runner.logits(inputs)}
        with torch.inference_mode():
            model.set_attn_implementation("sdpa")
            hf = model(input_ids=tokens, use_cache=False, logits_to_keep=1).logits
            model.set_attn_implementation("pagedkv")
            logits["hf_bf16"] = hf[:, -1].float()
            exact = reference(input_ids=tokens, use_cache=False, logits_to_keep=1).logits[:, -1]
        for name, value in logits.items():
            assert value is not None
            errors[name] = max(errors[name], float((value - exact).abs().max()))
            agree[name] += int((value.argmax(-1) == exact.argmax(-1)).sum())
        total += len(rows)
        tokens = torch.cat([tokens, exact.argmax(-1, keepdim=True)], dim=1)
    del reference
    runner.rows.clear_tables()
    torch.cuda.empty_cache()
    return {
        "sequences": len(rows),
        "prompt_tokens": prompts.shape[1],
        "decode_steps": num_decodes,
        "max_abs_logit": float(exact.abs().max()),
        "ours_max_abs_diff_vs_fp32": errors["ours"],
        "hf_bf16_max_abs_diff_vs_fp32": errors["hf_bf16"],
        "ours_top1_agreement_vs_fp32": agree["ours"] / total,
        "hf_bf16_top1_agreement_vs_fp32": agree["hf_bf16"] / total,
    }


def time_decode(executor: Any, step_id: int, iters: int = 30) -> tuple[dict[str, Any], int]:
    """Phases of one decode step over every live row at CONTEXT, host and GPU."""
    from pagedkv.executor.step_plan import plan_message

    runner = executor.runner
    walls, device_us, host_us = [], [], []
    phases: dict[str, list[float]] = {
        k: [] for k in ("validate_apply", "metadata", "model_launch", "sampler_launch", "wait")
    }
    for _ in range(iters):
        request = decode_request(executor, step_id)
        step_id += 1
        start = time.perf_counter()
        response = executor.step(request)
        walls.append((time.perf_counter() - start) * 1e6)
        device_us.append(response.device_time_us)
        host_us.append(response.host_time_us)
    graphs, runner.graphs = runner.graphs, None  # the same steps without CUDA graphs
    eager_walls = []
    for _ in range(iters):
        request = decode_request(executor, step_id)
        step_id += 1
        start = time.perf_counter()
        executor.step(request)
        eager_walls.append((time.perf_counter() - start) * 1e6)
    for _ in range(iters):  # the eager work, phase by phase
        request = decode_request(executor, step_id)
        step_id += 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan = plan_message(request, runner.rows, runner.limits)
        runner.rows.apply(plan)
        t1 = time.perf_counter()
        inputs = runner.forward_inputs.prepare(
            plan.rows, plan.num_computed, plan.num_scheduled, plan.needs_sample
        )
        t2 = time.perf_counter()
        logits = runner.logits(inputs)
        t3 = time.perf_counter()
        host_rows = plan.rows[plan.needs_sample]
        params = runner.sampling_params.get(host_rows, inputs.sample_positions)
        result = runner._sample(logits, params)
        runner.rows.record_samples(host_rows, inputs.sampled_rows, result.token_ids)
        t4 = time.perf_counter()
        result.token_ids.tolist()
        t5 = time.perf_counter()
        for key, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            phases[key].append(value * 1e6)
    runner.graphs = graphs
    gpu: list[float] = []
    window_gpu: list[float] = []
    for num_steps, times in ((1, gpu), (WINDOW, window_gpu)):
        for _ in range(iters):  # GPU time with every launch queued before the GPU starts
            request = decode_request(executor, step_id, num_steps)
            step_id += 1
            torch.cuda.synchronize()
            torch.cuda._sleep(100_000_000)  # ~50 ms: longer than the host needs to enqueue
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            plan = plan_message(request, runner.rows, runner.limits)
            runner.rows.apply(plan)
            runner.run(plan)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) * 1000 / num_steps)
    median = statistics.median
    return {
        "batch": int(runner.rows.live.sum()),
        "context": CONTEXT,
        "cuda_graphs": graphs is not None,
        "step_wall_us": median(walls),
        "eager_step_wall_us": median(eager_walls),
        "step_host_time_us": median(host_us),
        "step_device_time_us": median(device_us),
        "gpu_only_us": median(gpu),
        "window_steps": WINDOW,
        "window_gpu_only_us_per_step": median(window_gpu),
        "eager_host_phases_us": {k: median(v) for k, v in phases.items()},
    }, step_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench.executor.bench")
    parser.add_argument("--output", default="executor-h200.json")
    parser.add_argument("--kernel-backend", default="triton")
    parser.add_argument("--fused-ops", default="on", choices=("on", "off"))
    parser.add_argument("--profile", action="store_true", help="print a profile of one step")
    parser.add_argument("--batch", type=int, default=BATCH, help="decoding rows (default 64)")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="the KV blocks' dtype (default auto: bf16, the model's), e.g. fp8_e4m3",
    )
    parser.add_argument(
        "--decode-constants",
        type=json.loads,
        default={},
        metavar="JSON",
        help="decode attention launch constants to run with (DECODE_* of "
        "pagedkv.kernels.decode_attention, as python -m pagedkv.bench.kernels.tune --best prints)",
    )
    args = parser.parse_args(argv)

    from pagedkv.bench.kernels.tune import apply_constants

    decode_constants = apply_constants(args.decode_constants)

    import transformers
    import triton

    from pagedkv.executor.engine import Executor
    from pagedkv.executor.model_runner import ModelRunner
    from pagedkv.executor.runner_config import RunnerConfig
    from pagedkv.v1 import executor_pb2

    with tempfile.TemporaryDirectory() as root:
        config = RunnerConfig(
            model=str(_model_dir(Path(root))),
            device="cuda",
            dtype="bfloat16",
            load_format="dummy",
            kernel_backend=args.kernel_backend,
            max_num_rows=args.batch,
            max_num_batched_tokens=PREFILL_CHUNK,
            fused_ops=args.fused_ops == "on",
            kv_cache_dtype=args.kv_cache_dtype,
        )
        start = time.perf_counter()
        runner = ModelRunner(config)
        runner.warm_up()
        load_s = time.perf_counter() - start
    executor = Executor(runner, "llama-1.1b-dummy")
    executor.reset(executor_pb2.ResetRequest(owner=_owner()))
    gen = np.random.default_rng(0)
    logits = check_logits(executor, gen.integers(0, 32000, size=(8, 512)))
    runner.rows.free_all()
    step_id = _prefill(executor, gen.integers(0, 32000, size=(args.batch, CONTEXT)), 1)
    if args.profile:
        step_id = profile_decode(executor, step_id, decode_request)
    decode, step_id = time_decode(executor, step_id)
    decode["gpu_time_by_name"], step_id = kernel_times(executor, step_id, decode_request)
    decode.update(time_grpc(executor, step_id, decode_request))
    stream, step_id = time_stream(executor, step_id + 30, decode_request, CONTEXT)
    decode.update(stream)
    results = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "model": {**LLAMA_1B, "dtype": "bfloat16", "weights": "dummy (random)"},
        "fused_ops": runner.fused is not None,
        "kernel_backend": args.kernel_backend,
        "decode_constants": decode_constants,
        "num_blocks": runner.limits.num_blocks,
        "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "bytes_per_block": runner.bytes_per_block,
        "load_and_warm_up_s": load_s,
        "logits_vs_hf_sdpa": logits,
        "decode_step": decode,
    }
    Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    phases = decode["eager_host_phases_us"]
    lines = [
        f"{results['gpu']}, torch {results['torch']}, triton {results['triton']}, "
        f"transformers {results['transformers']}; ~1.1B llama, bf16, dummy weights; "
        f"{args.kernel_backend} kernels; {runner.limits.num_blocks} KV blocks of "
        f"{results['kv_cache_dtype']}",
        "decode attention constants: "
        + ", ".join(f"{k.removeprefix('DECODE_')} {v}" for k, v in decode_constants.items()),
        f"logits vs HF sdpa in float32 ({logits['sequences']} x {logits['prompt_tokens']} "
        f"prefill + {logits['decode_steps']} decodes; max |logit| "
        f"{logits['max_abs_logit']:.3f}): ours (bf16) max |diff| "
        f"{logits['ours_max_abs_diff_vs_fp32']:.4f}, top-1 agreement "
        f"{100 * logits['ours_top1_agreement_vs_fp32']:.1f}%; HF sdpa in bf16 max |diff| "
        f"{logits['hf_bf16_max_abs_diff_vs_fp32']:.4f}, top-1 agreement "
        f"{100 * logits['hf_bf16_top1_agreement_vs_fp32']:.1f}%",
        f"decode step, batch {args.batch} x context {CONTEXT}:",
        f"  Executor.step wall {decode['step_wall_us']:.0f} us "
        f"(host {decode['step_host_time_us']:.0f}, "
        f"device events {decode['step_device_time_us']:.0f}; "
        f"CUDA graphs {'on' if decode['cuda_graphs'] else 'off'}); "
        f"without graphs {decode['eager_step_wall_us']:.0f} us",
        f"  gRPC Step on 127.0.0.1 wall {decode['grpc_step_wall_us']:.0f} us",
        f"  gRPC StepStream on 127.0.0.1, two steps in flight: "
        f"{decode['grpc_stream_step_us']:.0f} us a step "
        f"(device events {decode['grpc_stream_device_time_us']:.0f})",
        f"  GPU time with the host out of the way: {decode['gpu_only_us']:.0f} us; "
        f"per step of a window of {decode['window_steps']}: "
        f"{decode['window_gpu_only_us_per_step']:.0f} us",
        "  host phases without graphs (us): "
        + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()),
    ]
    named = decode["gpu_time_by_name"]
    if "error" in named:
        lines.append(f"  GPU time by kernel: not measured ({named['error']})")
    else:
        lines.append(
            f"  GPU time per decode step by kernel (torch profiler, {named['steps']} steps):"
        )
        lines += [
            f"    {k['us_per_step']:8.1f} us  {k['launches_per_step']:5.1f} x  {k['name']}"
            for k in named["kernels"]
        ]
    text = "\n".join(lines)
    print(text)
    Path(args.output).with_suffix(".md").write_text(
        "# Executor on the GPU (`python -m pagedkv.bench.executor.bench`)\n\n```\n"
        + text
        + "\n```\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
