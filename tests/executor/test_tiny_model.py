"""`pagedkv make-tiny-model`: random tiny models with a byte-level tokenizer.

The CLI runs once per arch as a subprocess (all at once); the other tests
read what it wrote, or call `make_tiny_model` in-process to compare seeds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is first imported

from pagedkv.executor.tiny_model import (
    ARCHS,
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    GEMMA_SLIDING_WINDOW,
    MISTRAL_SLIDING_WINDOW,
    NUM_TOKENIZER_TOKENS,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    make_tiny_model,
)

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
TEXTS = (
    "Hello, world!",
    "  leading spaces, tabs\tand\nnewlines\r\n",
    "café naïve Straße — “quotes” …",
    "日本語のテキスト, 한국어, עברית, русский",
    "emoji 😀🚀 family 👨‍👩‍👧 flag 🇩🇪 skin 👍🏽",
    "\x00\x01\x7f control <bo s> <eos",
)
MODEL_TYPES = {"gemma3": "gemma3_text"}  # arch -> config.model_type, where they differ
NON_NFC_TEXT = "cafe\u0301 A\u030a \ufb01"  # decomposed é, Å and the ﬁ ligature


@dataclass(frozen=True)
class Made:
    cli: dict[str, Path]  # arch -> what `pagedkv make-tiny-model --seed 0` wrote
    in_process: dict[tuple[str, int], Path]  # (arch, seed) -> what make_tiny_model wrote


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Made:
    """The CLI once per arch (in parallel) and, meanwhile, seeds 0 and 1 in-process.

    Importing transformers dominates the runtime, so the in-process work
    overlaps the subprocesses.
    """
    pagedkv = Path(sys.executable).parent / "pagedkv"
    root = tmp_path_factory.mktemp("tiny")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = {
        arch: subprocess.Popen(
            [str(pagedkv), "make-tiny-model", str(root / arch), "--arch", arch, "--seed", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for arch in ARCHS
    }
    in_process = {
        (arch, seed): root / f"in-process-{arch}-{seed}" for arch in ARCHS for seed in (0, 1)
    }
    for (arch, seed), path in in_process.items():
        make_tiny_model(path, arch, seed=seed)
    outputs = {arch: proc.communicate(timeout=300) for arch, proc in procs.items()}
    for arch, (stdout, stderr) in outputs.items():
        assert procs[arch].returncode == 0, stderr
        lines = stdout.splitlines()
        assert len(lines) == 1 and arch in lines[0] and str(root / arch) in lines[0], stdout
    return Made(cli={arch: root / arch for arch in ARCHS}, in_process=in_process)


@pytest.fixture(scope="module")
def model_dirs(made: Made) -> dict[str, Path]:
    return made.cli


@pytest.fixture(scope="module")
def models(model_dirs: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    return {arch: AutoModelForCausalLM.from_pretrained(d).eval() for arch, d in model_dirs.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_cli_writes_model_and_tokenizer_files(model_dirs: dict[str, Path], arch: str) -> None:
    assert sorted(p.name for p in model_dirs[arch].iterdir()) == sorted(FILES)


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_gives_byte_identical_weights(made: Made, arch: str) -> None:
    cli = (made.cli[arch] / "model.safetensors").read_bytes()
    assert (made.in_process[arch, 0] / "model.safetensors").read_bytes() == cli


@pytest.mark.parametrize("arch", ARCHS)
def test_different_seed_gives_different_weights(made: Made, arch: str) -> None:
    cli = (made.cli[arch] / "model.safetensors").read_bytes()
    assert (made.in_process[arch, 1] / "model.safetensors").read_bytes() != cli


@pytest.mark.parametrize("arch", ARCHS)
def test_config_is_tiny_gqa_float32_with_the_tokenizer_ids(
    model_dirs: dict[str, Path], arch: str
) -> None:
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(model_dirs[arch])
    assert config.model_type == MODEL_TYPES.get(arch, arch)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (64, 128, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.hidden_size // config.num_attention_heads == 16
    assert getattr(config, "head_dim", 16) == 16
    assert config.vocab_size == VOCAB_SIZE >= NUM_TOKENIZER_TOKENS
    assert config.max_position_embeddings == 1024
    assert config.initializer_range == 0.2
    assert config.dtype == "float32" or str(config.dtype) == "torch.float32"
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (256, 257, 258)
    generation = GenerationConfig.from_pretrained(model_dirs[arch])
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (
        256,
        257,
        258,
    )
    assert config.tie_word_embeddings == (arch == "qwen2")
    if arch == "mistral":
        assert config.sliding_window == MISTRAL_SLIDING_WINDOW == 24
    if arch == "qwen2":
        assert not config.use_sliding_window
        assert config.layer_types == ["full_attention"] * 2
    if arch in ("gemma2", "gemma3"):  # two KV cache groups
        assert config.layer_types == ["sliding_attention", "full_attention"]
        assert config.sliding_window == GEMMA_SLIDING_WINDOW == 24


@pytest.mark.parametrize("arch", ARCHS)
def test_model_has_gqa_projections_and_qwen2_bias_and_tying(
    models: dict[str, Any], arch: str
) -> None:
    import torch

    model = models[arch]
    attn = model.model.layers[0].self_attn
    if arch == "phi3":  # one fused projection: Q, then K, then V
        assert attn.qkv_proj.out_features == (4 + 2 * 2) * 16
        assert attn.qkv_proj.bias is None
    else:
        assert (attn.q_proj.out_features, attn.k_proj.out_features) == (4 * 16, 2 * 16)
        assert (attn.q_proj.bias is not None) == (arch == "qwen2")
        assert (attn.k_proj.bias is not None) == (arch == "qwen2")
    assert hasattr(attn, "q_norm") == (arch in ("qwen3", "gemma3"))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (arch == "qwen2")
    assert model.model.embed_tokens.weight.shape == (VOCAB_SIZE, 64)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_produces_many_distinct_tokens(models: dict[str, Any], arch: str) -> None:
    import torch

    prompt = torch.tensor([list(b"Hello, world")])
    with torch.no_grad():
        out = models[arch].generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    generated = out[0, prompt.shape[1] :].tolist()
    assert len(generated) == 40
    assert len(set(generated)) >= 10, generated


def test_mistral_sliding_window_takes_effect_from_position_24(models: dict[str, Any]) -> None:
    """One seed gives llama and mistral the same weights, so only the window differs."""
    import torch

    ids = torch.arange(40).unsqueeze(0)
    with torch.no_grad():
        llama = models["llama"](ids).logits[0]
        mistral = models["mistral"](ids).logits[0]
    differs = (llama - mistral).abs().amax(dim=-1) > 1e-5
    assert differs.nonzero().flatten().tolist() == list(range(MISTRAL_SLIDING_WINDOW, 40))


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_maps_each_byte_to_its_id_and_round_trips(
    model_dirs: dict[str, Path], arch: str
) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(model_dirs[arch] / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(model_dirs[arch])
    for text in (*TEXTS, "".join(map(chr, range(128)))):
        ids = list(text.encode("utf-8"))
        assert raw.encode(text).ids == ids
        assert auto(text)["input_ids"] == ids
        assert raw.decode(ids) == text
        assert auto.decode(ids) == text


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_special_tokens(model_dirs: dict[str, Path], arch: str) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(model_dirs[arch] / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(model_dirs[arch])
    assert raw.get_vocab_size() == len(auto) == NUM_TOKENIZER_TOKENS
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
        PAD_TOKEN_ID,
    )
    assert auto.unk_token is None
    assert [raw.token_to_id(t) for t in ("<bos>", "<eos>", "<pad>")] == [256, 257, 258]
    ids = [BOS_TOKEN_ID, *b"hi", EOS_TOKEN_ID, PAD_TOKEN_ID]
    assert auto.decode(ids, skip_special_tokens=True) == raw.decode(ids) == "hi"
    assert auto.decode(ids) == "<bos>hi<eos><pad>"
    assert raw.encode("a<eos>").ids == auto("a<eos>")["input_ids"] == [97, EOS_TOKEN_ID]


@pytest.mark.parametrize("arch", ARCHS)
def test_text_not_in_nfc_round_trips_except_through_qwen2_auto_tokenizer(
    model_dirs: dict[str, Path], arch: str
) -> None:
    """transformers forces `Qwen2Tokenizer` on qwen2, which adds an NFC normalizer."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(model_dirs[arch] / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(model_dirs[arch])
    assert raw.decode(raw.encode(NON_NFC_TEXT).ids) == NON_NFC_TEXT
    expected = unicodedata.normalize("NFC", NON_NFC_TEXT) if arch == "qwen2" else NON_NFC_TEXT
    assert auto.decode(auto(NON_NFC_TEXT)["input_ids"]) == expected
