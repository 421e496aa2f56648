"""The accuracy model's recipe (pagedkv.bench.accuracy): its corpus is
Python's own text, split the same way every time with no document in both
splits, and a short CPU run of the tiny shape learns from it (the held-out
loss falls well below a uniform guess) and saves a checkpoint that
transformers loads back to the same held-out loss. The fp8 KV evaluation
on that model reports every format and granularity, agrees with the
reference as closely as fp8 allows, leaves the model's attention as it was
afterwards, and ranks e5m2's coarser rounding below e4m3's on activations
with outlier channels."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.bench.accuracy import corpus as corpus_module
from pagedkv.bench.accuracy.corpus import SEPARATOR, load
from pagedkv.bench.accuracy.train import as_ids, held_out_loss, train
from pagedkv.executor.tiny_model import VOCAB_SIZE


@pytest.fixture(scope="module")
def small_corpus() -> corpus_module.Corpus:
    return load(max_bytes=300_000)


def test_the_corpus_is_split_by_document_the_same_way_every_time(
    small_corpus: corpus_module.Corpus,
) -> None:
    again = load(max_bytes=300_000)
    assert again == small_corpus
    docs = corpus_module.documents()[: small_corpus.num_documents]
    held = set(docs[19::20])
    assert held and small_corpus.held_out == b"".join(d + SEPARATOR for d in docs[19::20])
    train_docs = [d for i, d in enumerate(docs) if i % 20 != 19]
    assert small_corpus.train == b"".join(d + SEPARATOR for d in train_docs)
    assert len(small_corpus.train) >= 300_000
    assert small_corpus.describe()["sha256"] == small_corpus.sha256


@pytest.fixture(scope="module")
def trained(
    small_corpus: corpus_module.Corpus, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("accuracy") / "model"
    report = train(
        path,
        shape="tiny",
        steps=40,
        minutes=5,
        batch=8,
        seq_len=64,
        lr=3e-3,
        warmup=5,
        device="cpu",
        corpus=small_corpus,
        eval_windows=16,
    )
    return path, report


def test_a_short_cpu_run_learns_and_saves_a_model_that_loads_back(
    small_corpus: corpus_module.Corpus, trained: tuple[Path, dict[str, Any]]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp_path, report = trained
    held = report["held_out"]
    assert report["steps"] == 40 and report["tokens_seen"] == 40 * 8 * 64
    assert held["loss_before"] > math.log(VOCAB_SIZE) - 0.5  # an untrained guess
    assert held["loss_after"] < held["loss_before"] - 1.0  # it learned the bytes
    assert json.loads((tmp_path / "training.json").read_text()) == report
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    reloaded = held_out_loss(model, as_ids(small_corpus.held_out), 64, 16, torch.device("cpu"))
    assert reloaded == pytest.approx(held["loss_after"], abs=1e-3)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer("def f():").input_ids == list(b"def f():")


def test_the_command_offers_every_shape_and_the_recipes_defaults() -> None:
    import argparse

    from pagedkv.bench.accuracy.cli import add_arguments
    from pagedkv.bench.accuracy.train import SHAPES

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    shape = next(a for a in parser._actions if a.dest == "shape")
    assert set(shape.choices or ()) == set(SHAPES)
    args = parser.parse_args(["--out", "x"])
    assert (args.shape, args.minutes, args.batch, args.seq_len) == ("small", 5.0, 32, 1024)


def test_fp8_kv_on_the_trained_model_costs_what_fp8_allows(
    trained: tuple[Path, dict[str, Any]],
) -> None:
    from pagedkv.bench.accuracy.evaluate import (
        EMULATION,
        GRANULARITIES,
        INT8_GRANULARITIES,
        evaluate,
    )

    path, _ = trained
    report = evaluate(
        path,
        device="cpu",
        dtype="bfloat16",
        windows=4,
        window_len=64,
        prompts=2,
        prompt_len=32,
        continue_tokens=16,
        max_corpus_bytes=300_000,
    )
    rows = report["fp8"]
    parts = {"fp8_e4m3/executor/k-only", "fp8_e4m3/executor/v-only"}
    int8 = {f"int8/{granularity}" for granularity in INT8_GRANULARITIES}
    assert set(rows) == parts | int8 | {
        f"{name}/{granularity}"
        for name in ("fp8_e4m3", "fp8_e5m2")
        for granularity in GRANULARITIES
    }
    for name in parts:  # K or V alone in fp8: no outlier row, no larger a cost
        part = rows.pop(name)
        assert part["top1_agreement"] >= rows["fp8_e4m3/executor"]["top1_agreement"] - 0.05
    for name, row in rows.items():
        assert row["top1_agreement"] >= 0.9, name
        assert abs(row["perplexity_increase"]) < 0.05, name
        assert 0 <= row["greedy_equal_share"] <= 1, name
        assert 0 <= row["greedy_equal_prefix_mean"] <= 16, name
        errors = row["outlier_errors"]
        assert errors["bf16_relative_rms"] < errors["relative_rms"], name
    for granularity in ("per_tensor", "per_head"):
        e4m3 = rows[f"fp8_e4m3/{granularity}"]["outlier_errors"]["relative_rms"]
        assert rows[f"fp8_e5m2/{granularity}"]["outlier_errors"]["relative_rms"] > e4m3
    rotated = rows["fp8_e4m3/executor_rotated"]["outlier_errors"]["relative_rms"]
    assert rows["int8/per_token_rotated"]["outlier_errors"]["relative_rms"] < rotated
    assert EMULATION.dtype is None  # the reference attention again
    noise = report["reference_noise"]  # the float32 model against the bf16 one
    assert noise["top1_agreement"] >= 0.9 and abs(noise["perplexity_increase"]) < 0.05


def test_a_centered_store_rounds_a_channel_on_its_variation_not_its_offset() -> None:
    """``per_head_centered``: a channel on a large common offset comes back
    with the error of its small variation, and without it with the error
    of the offset."""
    import torch

    from pagedkv.bench.accuracy.evaluate import KVEmulation

    x = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(0))
    x[..., 3] += 50.0  # [batch, kv_heads, seq, head_size]: channel 3 of both heads
    errors = {}
    for granularity in ("per_head", "per_head_centered"):
        emulation = KVEmulation()
        emulation.configure(torch.float8_e4m3fn, granularity)
        emulation.calibrating = True
        emulation.store(0, 0, x)
        emulation.calibrating = False
        errors[granularity] = (emulation.store(0, 0, x) - x)[..., 3].abs().max().item()
    assert errors["per_head_centered"] < errors["per_head"] / 8


def outlier_keys_and_query() -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[batch, kv_heads, seq, head_size]`` and a query whose channels
    3 and 40 are 20 times the rest: the channels a query shares with its
    keys, where a score's rounding error sits."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 256, 64, generator=generator)
    query = torch.randn(1, 2, 8, 64, generator=generator)
    for x in (keys, query):
        x[..., [3, 40]] *= 20.0
    return keys, query


def score_error(query: torch.Tensor, keys: torch.Tensor, stored: torch.Tensor) -> float:
    """The scores' error RMS over their RMS, ``stored`` keys against ``keys``."""
    want = query @ keys.transpose(-1, -2)
    got = query @ stored.transpose(-1, -2)
    return float(((got - want).pow(2).mean() / want.pow(2).mean()).sqrt().item())


def test_a_rotated_store_spreads_channels_a_query_shares_with_its_keys() -> None:
    """``per_head_rotated``: keys stored in the Hadamard basis and read back
    give scores against a query whose large channels are the keys' large
    channels with a fraction of the error of keys stored as they are; the
    matrix is orthonormal and its own inverse."""
    import pytest
    import torch

    from pagedkv.bench.accuracy.evaluate import KVEmulation
    from pagedkv.kernels.fp8_kv import hadamard

    rotation = hadamard(64)
    torch.testing.assert_close(rotation @ rotation, torch.eye(64), rtol=0, atol=1e-6)
    torch.testing.assert_close(rotation, rotation.T, rtol=0, atol=0)
    with pytest.raises(ValueError, match="power of two"):
        hadamard(48)
    keys, query = outlier_keys_and_query()
    errors = {}
    for granularity in ("per_head", "per_head_rotated", "executor_rotated"):
        emulation = KVEmulation()
        emulation.configure(torch.float8_e4m3fn, granularity)
        emulation.calibrating = True
        emulation.store(0, 0, keys)
        emulation.calibrating = False
        errors[granularity] = score_error(query, keys, emulation.store(0, 0, keys))
    assert errors["per_head_rotated"] < errors["per_head"] / 3
    assert errors["executor_rotated"] < errors["per_head"] / 3  # the norm bound costs no more


def test_int8_with_a_scale_per_token_rounds_finer_than_e4m3_in_the_rotated_basis() -> None:
    """``int8_round_trip``: one scale per vector, 255 levels; a rotated
    vector's values are alike in size, so its scores against a query
    keep a fraction of e4m3's error (three mantissa bits), and a zero
    vector comes back as zeros."""
    import torch

    from pagedkv.bench.accuracy.evaluate import KVEmulation, int8_round_trip

    keys, query = outlier_keys_and_query()

    def error(stored: torch.Tensor) -> float:
        return score_error(query, keys, stored)

    e4m3 = KVEmulation()
    e4m3.configure(torch.float8_e4m3fn, "executor_rotated")
    e4m3.calibrating = True
    e4m3.store(0, 0, keys)
    e4m3.calibrating = False
    int8 = KVEmulation()
    int8.configure(torch.int8, "per_token_rotated")
    assert error(int8.store(0, 0, keys)) < error(e4m3.store(0, 0, keys)) / 3
    assert error(int8_round_trip(keys)) < error(e4m3.store(0, 0, keys))
    zeros = torch.zeros(1, 1, 4, 64)
    assert torch.equal(int8_round_trip(zeros, rotate=True), zeros)


def test_the_int8_rows_emulate_what_the_int8_cache_kernels_store() -> None:
    """The accuracy bench's ``int8/per_token`` round trip reads back, value
    for value, what the executor's cache write stores and its kernels read
    (the torch backend's write and the oracle's read; the Triton ones are
    checked against the same oracle in tests/kernels)."""
    from pagedkv.bench.accuracy.evaluate import int8_round_trip
    from pagedkv.kernels import int8_kv, reference, torch_backend

    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(12, 2, 64, generator=gen).to(torch.bfloat16)
    keys[3, 1, 5] = 90.0  # one vector with an outlier channel
    _, cache, scales = int8_kv.block_storage(2, 8, 2, 64)
    _, values, value_scales = int8_kv.block_storage(2, 8, 2, 64)
    slots = torch.arange(12)
    torch_backend.reshape_and_cache(
        keys, keys, cache, values, slots, k_scale=scales, v_scale=value_scales
    )
    stored = cache.reshape(-1, 2, 64)[:12]
    read = reference.from_cache(stored, scales.reshape(-1, 2)[:12], torch.bfloat16)
    assert torch.equal(read, int8_round_trip(keys))


def test_the_served_path_measures_each_kv_dtype_against_the_models_own_blocks(
    trained: tuple[Path, dict[str, Any]],
) -> None:
    """``served``: the executor's own runners (cache writes, scales,
    attention) over the trained model, each KV dtype against blocks in the
    model's dtype; int8 keeps at least as many top-1 tokens as e4m3."""
    from pagedkv.bench.accuracy.served import evaluate_served

    path, _ = trained
    report = evaluate_served(
        path,
        windows=4,
        window_len=64,
        prompts=2,
        prompt_len=32,
        continue_tokens=8,
        max_corpus_bytes=300_000,
    )
    rows = report["kv"]
    assert set(rows) == {"int8", "fp8_e4m3"}
    for name, row in rows.items():
        assert row["top1_agreement"] >= 0.9, name
        assert abs(row["perplexity_increase"]) < 0.05, name
        assert 0 <= row["greedy_equal_prefix_mean"] <= 8, name
        assert row["bytes_per_block"] < report["reference"]["bytes_per_block"], name
    assert rows["int8"]["kv_cache_dtype"] == "int8"
    assert rows["int8"]["top1_agreement"] >= rows["fp8_e4m3"]["top1_agreement"]
