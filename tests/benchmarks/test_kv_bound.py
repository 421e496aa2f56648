"""``pagedkv.bench.scheduler.serving.kv_bound``: the bytes a decode step reads
against a transformers model of the same shape, and the bound computed from
committed runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedkv.bench.scheduler.serving import kv_bound
from pagedkv.bench.shapes import LLAMA_SHAPES

RESULTS = Path(__file__).parent / "results"


@pytest.mark.parametrize("preset", sorted(LLAMA_SHAPES))
def test_the_weights_a_step_reads_are_the_models_but_its_embedding_table(preset: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA_SHAPES[preset], tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel()
    assert kv_bound.weight_bytes(LLAMA_SHAPES[preset]) == 2 * (params - embedding)
    # K and V of one token: 2 x layers x KV heads x head size values.
    head = config.hidden_size // config.num_attention_heads
    values = 2 * config.num_hidden_layers * config.num_key_value_heads * head
    assert kv_bound.kv_bytes_per_token(LLAMA_SHAPES[preset], 1) == values


def test_the_bound_from_the_committed_8b_run(tmp_path: Path) -> None:
    serve = RESULTS / "serve-kv-auto-8b-h200.json"
    output = tmp_path / "bound.json"
    kernels = RESULTS / "kernels-h200.json"
    assert (
        kv_bound.main(["--serve", str(serve), "--kernels", str(kernels), "--output", str(output)])
        == 0
    )
    (row,) = json.loads(output.read_text())["rows"]
    run = json.loads(serve.read_text())["fixed_batches"][0]["pagedkv"]
    # The last first token, from the decode steps, is the run's TTFT p99
    # (of 16 requests, about the last).
    assert row["last_first_token_s"] == pytest.approx(run["ttft_ms"]["p99"] / 1e3, rel=0.02)
    assert 0 < row["share_of_ceiling"] <= 1
    assert 1 < row["ratio_at_share"] <= row["ratio_at_ceiling"] < row["ratio_no_kv"]
    assert output.with_suffix(".md").read_text().startswith("# What K and V at 0.5x")
