"""How long one executor step takes: a cost model calibrated on the H200 results.

The inputs are measurements committed under ``tests/benchmarks/results``
(``H200Measurements``: each field names its file and key; ``RECORDED`` holds
them so that the installed command needs no repository, and a test checks
them against the files). ``StepCostModel.from_measurements`` derives::

    step_s = base_s
           + decode_context_tokens * context_token_s   (KV read by decodes)
           + prefill_tokens / prefill_tokens_per_s     (weights, MLP, projections)
           + prefill_pairs * attention_pair_s          (prefill attention)

- ``context_token_s``: the model's KV bytes per token (all layers) over the
  bandwidth the decode-attention kernel reached (``kernels-h200``, batch 128
  x context 8,192).
- ``base_s``: the executor's decode step over gRPC at batch 64 x context 768
  (``executor-h200``, CUDA graphs on), minus that step's context term: the
  fixed cost of a step (weights, launches, sampling, the RPC).
- ``prefill_tokens_per_s``: the end-to-end serve run (``serve-h200``, 64 x 512
  prompt tokens, one step in flight): its wall time minus its steps at the
  full-batch step cost, spent on the 32,768 prompt tokens.
- ``attention_pair_s``: a (query, key) pair's attention FLOPs for this model
  over the prefill kernel's rate (``kernels-h200``, 512 new over 4,096).

Only batch 64 was measured, so a step with fewer sequences is charged the
same base (pessimistic when lightly loaded); the simulation caps a batch at
that size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class H200Measurements:
    """The measured figures the model is derived from (source: file, key)."""

    # executor-h200.json: model.*
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    hidden_size: int
    kv_dtype_bytes: int  # model.dtype bfloat16
    num_blocks: int  # executor-h200.json: num_blocks (the KV pool the GPU held)
    # executor-h200.json: decode_step.{batch,context,grpc_step_wall_us}
    decode_batch: int
    decode_context: int
    decode_step_wall_us: float
    # serve-h200.json: settings.{requests,prompt_len,max_tokens}, num_steps,
    # output_tokens_per_s_one_step_in_flight, full_batch_steps.{rpc_us,scheduler_cpu_us}
    serve_requests: int
    serve_prompt_len: int
    serve_max_tokens: int
    serve_num_steps: int
    serve_output_tokens_per_s_one_in_flight: float
    serve_full_batch_rpc_us: float
    serve_full_batch_scheduler_cpu_us: float
    # kernels-h200.json: rows[decode, batch 128, context 8192].gbps
    decode_attention_gbps: float
    # kernels-h200.json: rows[prefill, batch 8, context 4096].tflops
    prefill_attention_tflops: float


RECORDED = H200Measurements(
    num_layers=16,
    num_attention_heads=32,
    num_kv_heads=8,
    hidden_size=2048,
    kv_dtype_bytes=2,
    num_blocks=250996,
    decode_batch=64,
    decode_context=768,
    decode_step_wall_us=4903.079000001753,
    serve_requests=64,
    serve_prompt_len=512,
    serve_max_tokens=256,
    serve_num_steps=260,
    serve_output_tokens_per_s_one_in_flight=9074.849964022205,
    serve_full_batch_rpc_us=4528.070999981537,
    serve_full_batch_scheduler_cpu_us=976.4680000046155,
    decode_attention_gbps=4389.030596915536,
    prefill_attention_tflops=369.21481058743035,
)


def load_measurements(results_dir: Path) -> H200Measurements:
    """Reads the measurements from the committed result files in ``results_dir``."""
    executor = json.loads((results_dir / "executor-h200.json").read_text())
    serve = json.loads((results_dir / "serve-h200.json").read_text())
    kernels = json.loads((results_dir / "kernels-h200.json").read_text())
    model, step = executor["model"], executor["decode_step"]
    if model["dtype"] != "bfloat16":
        raise ValueError(f"executor-h200: dtype {model['dtype']}, the model assumes bfloat16")

    def row(kind: str, batch: int, context: int) -> dict[str, float]:
        for r in kernels["rows"]:
            if (r["kind"], r["batch"], r["context"]) == (kind, batch, context):
                return dict(r)
        raise ValueError(f"kernels-h200: no {kind} row at batch {batch}, context {context}")

    full = serve["full_batch_steps"]
    return H200Measurements(
        num_layers=model["num_hidden_layers"],
        num_attention_heads=model["num_attention_heads"],
        num_kv_heads=model["num_key_value_heads"],
        hidden_size=model["hidden_size"],
        kv_dtype_bytes=2,
        num_blocks=executor["num_blocks"],
        decode_batch=step["batch"],
        decode_context=step["context"],
        decode_step_wall_us=step["grpc_step_wall_us"],
        serve_requests=serve["settings"]["requests"],
        serve_prompt_len=serve["settings"]["prompt_len"],
        serve_max_tokens=serve["settings"]["max_tokens"],
        serve_num_steps=serve["num_steps"],
        serve_output_tokens_per_s_one_in_flight=serve["output_tokens_per_s_one_step_in_flight"],
        serve_full_batch_rpc_us=full["rpc_us"],
        serve_full_batch_scheduler_cpu_us=full["scheduler_cpu_us"],
        decode_attention_gbps=row("decode", 128, 8192)["gbps"],
        prefill_attention_tflops=row("prefill", 8, 4096)["tflops"],
    )


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """Seconds per executor step (see the module docstring); immutable."""

    base_s: float
    context_token_s: float
    prefill_tokens_per_s: float
    attention_pair_s: float
    max_batch: int  # the batch the base was measured at

    @classmethod
    def from_measurements(cls, m: H200Measurements) -> StepCostModel:
        head_size = m.hidden_size // m.num_attention_heads
        kv_bytes_per_token = 2 * m.num_layers * m.num_kv_heads * head_size * m.kv_dtype_bytes
        context_token_s = kv_bytes_per_token / (m.decode_attention_gbps * 1e9)
        measured_step_s = m.decode_step_wall_us * 1e-6
        base_s = measured_step_s - m.decode_batch * m.decode_context * context_token_s
        output_tokens = m.serve_requests * m.serve_max_tokens
        serve_s = output_tokens / m.serve_output_tokens_per_s_one_in_flight
        step_s = (m.serve_full_batch_rpc_us + m.serve_full_batch_scheduler_cpu_us) * 1e-6
        prefill_s = serve_s - m.serve_num_steps * step_s
        if prefill_s <= 0:
            raise ValueError("serve-h200: no time is left for prefill after the steps")
        prefill_tokens_per_s = m.serve_requests * m.serve_prompt_len / prefill_s
        # QK^T and PV: 2 FLOPs per multiply-add, per head dimension, per query head.
        pair_flops = 4 * head_size * m.num_attention_heads * m.num_layers
        attention_pair_s = pair_flops / (m.prefill_attention_tflops * 1e12)
        return cls(base_s, context_token_s, prefill_tokens_per_s, attention_pair_s, m.decode_batch)

    def step_s(
        self, num_prefill_tokens: int, prefill_pairs: int, decode_context_tokens: int
    ) -> float:
        """One step: ``num_prefill_tokens`` prompt tokens (attending to
        ``prefill_pairs`` (query, key) pairs in all) and decodes reading
        ``decode_context_tokens`` tokens of KV in all."""
        return (
            self.base_s
            + decode_context_tokens * self.context_token_s
            + num_prefill_tokens / self.prefill_tokens_per_s
            + prefill_pairs * self.attention_pair_s
        )


def prefill_pairs(num_computed: int, num_new: int) -> int:
    """(query, key) pairs of a causal chunk: ``num_new`` tokens after
    ``num_computed`` cached or computed ones, each attending to itself and
    every earlier token."""
    return num_new * num_computed + num_new * (num_new + 1) // 2
