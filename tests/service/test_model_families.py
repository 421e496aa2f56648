"""Model families and block sizes through the whole stack: a scheduler
(``pagedkv scheduler``) over a real executor process, driven through the
Scheduler gRPC API; greedy output equals Hugging Face ``generate`` token
for token.

- qwen3 (query/key norms), phi3 (merged projections), gemma2 and gemma3 (a
  sliding-window layer and a full one: two KV cache groups; sandwich norms,
  GELU; gemma2's soft-caps, gemma3's query/key norms and two rotaries) on
  the fused decoder, and gemma2 on transformers' layers (``--fused-ops
  off``).
- Block sizes 8 and 32 (the executor's ``--block-size``; the scheduler
  takes it from the executor) with the Triton kernels, llama and gemma2.

Prompts are prefilled in chunks while others decode (``--max-num-batched-
tokens 16``), and the longest runs again over its cached prefix. The
Triton kernels run under the interpreter on the CPU (the block-size tests
take half a minute each: marked slow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.v1 import executor_pb2
from tests.executor.driver import ExecutorProcess
from tests.executor.test_generation import PROMPTS, hf_greedy, model_dirs
from tests.service.stack import Process
from tests.service.test_stack import assert_nothing_held, greedy_request

__all__ = ["model_dirs"]  # the session fixture, shared with the executor tests

NEW_TOKENS = 24
ARCHS = ("qwen3", "phi3", "gemma2", "gemma3")


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for arch in ARCHS:
        dirs[arch] = root / arch
        make_tiny_model(dirs[arch], arch, seed=7)
    return dirs


def generate_through_a_scheduler(
    executor: ExecutorProcess, model_dir: Path, block_size: int = 16
) -> None:
    """Every prompt at once, then the long one again, through a scheduler
    over ``executor``; each output is Hugging Face's. The second time the
    long prompt finds its full blocks in the prefix cache."""
    args = ["scheduler", "--executor", executor.target, "--port", "0", "--model", str(model_dir)]
    with Process([*args, "--max-num-batched-tokens", "16"]) as scheduler:
        for prompts in (PROMPTS, PROMPTS[2:]):
            calls = [
                scheduler.stub.Generate(greedy_request(p, NEW_TOKENS), timeout=600) for p in prompts
            ]
            for prompt, call in zip(prompts, calls, strict=True):
                chunks = list(call)
                tokens = [t for chunk in chunks for out in chunk.outputs for t in out.token_ids]
                assert tokens == hf_greedy(model_dir, prompt, NEW_TOKENS)
        cached = chunks[-1].usage.cached_prompt_tokens
        assert cached > 0 and cached % block_size == 0, cached
        assert_nothing_held(scheduler.stub)


@pytest.mark.parametrize(("arch", "fused"), [*((arch, True) for arch in ARCHS), ("gemma2", False)])
def test_greedy_output_of_each_family_equals_hugging_face(
    family_dirs: dict[str, Path], arch: str, fused: bool
) -> None:
    extra = () if fused else ("--fused-ops", "off")
    with ExecutorProcess(family_dirs[arch], extra_args=extra) as executor:
        assert ("fused ops" in executor.ready_line) == fused
        info = executor.stub.GetInfo(executor_pb2.GetInfoRequest())
        windows = [
            g.sliding_window if g.HasField("sliding_window") else None for g in info.kv_cache_groups
        ]
        assert windows == ([None, 24] if arch.startswith("gemma") else [None])
        generate_through_a_scheduler(executor, family_dirs[arch])


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [8, 32])
def test_greedy_output_at_other_block_sizes_equals_hugging_face(
    model_dirs: dict[str, Path], block_size: int
) -> None:
    extra = ("--block-size", str(block_size))
    with ExecutorProcess(model_dirs["llama"], backend="triton", extra_args=extra) as executor:
        assert f"blocks of {block_size} tokens" in executor.ready_line
        generate_through_a_scheduler(executor, model_dirs["llama"], block_size)


@pytest.mark.slow
def test_two_kv_groups_at_block_size_8_equal_hugging_face(family_dirs: dict[str, Path]) -> None:
    # gemma2's window of 24 is three blocks of 8: whole blocks leave the window.
    extra = ("--block-size", "8")
    with ExecutorProcess(family_dirs["gemma2"], backend="triton", extra_args=extra) as executor:
        generate_through_a_scheduler(executor, family_dirs["gemma2"], 8)
