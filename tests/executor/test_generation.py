"""A real executor process against Hugging Face ``generate`` (greedy, same
weights), token for token: tiny llama (GQA), qwen2 (qkv bias, tied
embeddings) and mistral (a sliding window shorter than the sequences), with
both kernel backends, several prompts of mixed lengths in one batch, prompts
split over several steps, and prefill and decode in the same step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedkv.executor.tiny_model import make_tiny_model
from tests.executor.driver import Driver, ExecutorProcess

NEW_TOKENS = 32
PROMPTS = [
    list(b"Hello, paged world!"),  # 19 tokens
    list(b"KV"),
    list(b"The quick brown fox jumps over the lazy dog; again and again."),  # 61
]
ARCHS = ("llama", "qwen2", "mistral")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for arch in ARCHS:
        dirs[arch] = root / arch
        make_tiny_model(dirs[arch], arch, seed=7)
    return dirs


_REFERENCE: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def hf_greedy(model_dir: Path, prompt: list[int], num_tokens: int) -> list[int]:
    """Hugging Face greedy continuation (eos does not stop it)."""
    key = (str(model_dir), tuple(prompt), num_tokens)
    if key not in _REFERENCE:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        model.generation_config.eos_token_id = None
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False)
        _REFERENCE[key] = out[0, len(prompt) :].tolist()
    return _REFERENCE[key]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_hugging_face(
    model_dirs: dict[str, Path], arch: str, backend: str
) -> None:
    with ExecutorProcess(model_dirs[arch], backend=backend) as executor:
        assert "fused ops" in executor.ready_line
        driver = Driver(executor.stub)
        seqs = [driver.add(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)]
        outputs = driver.run(seqs, chunk_size=16)
        # The long prompt took 4 steps of prefill while the others decoded.
        mixed = driver.responses[1]
        assert 0 < len(mixed.sampled_rows) < len(seqs)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output == hf_greedy(model_dirs[arch], prompt, NEW_TOKENS)


def test_transformers_modules_match_hugging_face_with_fused_ops_off(
    model_dirs: dict[str, Path],
) -> None:
    """--fused-ops off runs transformers' own layers around our attention."""
    extra = ("--fused-ops", "off")
    with ExecutorProcess(model_dirs["llama"], extra_args=extra) as executor:
        assert "fused ops" not in executor.ready_line
        driver = Driver(executor.stub)
        seqs = [driver.add(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)]
        outputs = driver.run(seqs, chunk_size=16)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output == hf_greedy(model_dirs["llama"], prompt, NEW_TOKENS)


def test_explicit_tokens_match_continuing_from_samples(model_dirs: dict[str, Path]) -> None:
    """Sending each sampled token back (no async stepping) gives the same text."""
    with ExecutorProcess(model_dirs["llama"]) as executor:
        driver = Driver(executor.stub)
        seqs = [driver.add(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)]
        outputs = driver.run(seqs, chunk_size=None, continue_from_sampled=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output == hf_greedy(model_dirs["llama"], prompt, NEW_TOKENS)
