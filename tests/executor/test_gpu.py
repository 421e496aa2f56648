"""The executor as its own process on a CUDA device (marked ``gpu``): greedy
output equals Hugging Face ``generate`` on the same device and weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.executor.driver import Driver, ExecutorProcess
from tests.executor.test_fused_model import make_runner, step_logits
from tests.executor.test_generation import NEW_TOKENS, PROMPTS, model_dirs
from tests.service.test_model_families import family_dirs

__all__ = ["family_dirs", "model_dirs"]  # the session fixtures, shared with the CPU tests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def hf_greedy_cuda(model_dir: Path, prompt: list[int], num_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).cuda().eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device="cuda"), max_new_tokens=num_tokens, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("backend", "eager", "fused"),
    [
        ("triton", False, True),
        ("triton", True, True),
        ("torch", False, True),
        ("triton", False, False),
    ],
)
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_executor_process_on_cuda_matches_hugging_face(
    model_dirs: dict[str, Path],
    family_dirs: dict[str, Path],
    arch: str,
    backend: str,
    eager: bool,
    fused: bool,
) -> None:
    # With the Triton kernels decode steps and the mixed steps of prompt
    # chunks beside decodes replay CUDA graphs unless --enforce-eager; the
    # torch kernels always run eagerly. Fused ops are on
    # by default (docs/executor.md, "Model families"); gemma2 has two KV
    # cache groups and soft-caps.
    model_dir = {**model_dirs, **family_dirs}[arch]
    extra = ("--enforce-eager",) if eager else ()
    extra += () if fused else ("--fused-ops", "off")
    with ExecutorProcess(model_dir, backend=backend, device="cuda", extra_args=extra) as executor:
        driver = Driver(executor.stub)
        assert driver.info.device.startswith("cuda")
        seqs = [driver.add(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)]
        outputs = driver.run(seqs, chunk_size=16)
        graphs = "decode graphs captured" in executor.stderr()
        mixed = "mixed-step graphs captured" in executor.stderr()
        assert ("fused ops" in executor.ready_line) == fused
    assert graphs == mixed == (backend == "triton" and not eager)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output == hf_greedy_cuda(model_dir, prompt, NEW_TOKENS)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3"])
def test_bf16_fused_logits_are_as_close_to_float32_as_transformers_modules_on_cuda(
    model_dirs: dict[str, Path], family_dirs: dict[str, Path], arch: str
) -> None:
    """In bf16 the fused stack rounds differently from transformers' modules
    (fewer intermediate roundings), so the two differ by bf16 noise (a
    logit here and there by 0.1 or more). What matters is that the fused
    stack is no further from the float32 result than transformers' modules
    are, on the whole: the mean error, as the largest of a few hundred
    logits swings either way by 2x between two equally good bf16 stacks."""
    model_dir = {**model_dirs, **family_dirs}[arch]
    exact = make_runner(model_dir, "triton", False, device="cuda", dtype="float32")
    fused = make_runner(model_dir, "triton", True, device="cuda", dtype="bfloat16")
    unfused = make_runner(model_dir, "triton", False, device="cuda", dtype="bfloat16")
    for want, got, theirs in zip(
        step_logits(exact), step_logits(fused), step_logits(unfused), strict=True
    ):
        ours_error = (got.float() - want).abs().mean().item()
        their_error = (theirs.float() - want).abs().mean().item()
        assert ours_error <= 1.5 * their_error + 1e-3, (ours_error, their_error)


def test_runner_without_num_blocks_measures_its_pool_on_cuda(model_dirs: dict[str, Path]) -> None:
    """Without num_blocks the runner sizes its KV pool from a profiling
    forward on scratch memory, then serves steps on the pool it sized."""
    from pagedkv.executor.model_runner import ModelRunner
    from pagedkv.executor.runner_config import RunnerConfig

    config = RunnerConfig(
        model=str(model_dirs["llama"]),
        device="cuda",
        max_num_rows=2,
        max_num_batched_tokens=64,
        gpu_memory_utilization=0.5,
    )
    runner = ModelRunner(config)
    assert runner.limits.num_blocks > 2
    assert runner.forward_inputs.kv is runner.kv
    assert runner.kv.num_bytes == runner.limits.num_blocks * runner.bytes_per_block
    # The graphs captured after the pool keep their logits: the sizing left
    # room for exactly those bytes.
    from pagedkv.executor.model_runner import graph_logits_bytes

    runner.warm_up()
    assert runner.graphs is not None and runner.mixed_graphs is not None
    outputs = [*runner.graphs.logits.values()]
    outputs += [g.logits for g in runner.mixed_graphs.graphs if g.logits is not None]
    kept = sum(t.numel() * t.element_size() for t in outputs)
    assert kept == graph_logits_bytes(config, runner.spec.vocab_size, runner.dtype)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_decode_windows_on_cuda_graphs_give_the_tokens_of_single_steps(
    model_dirs: dict[str, Path], sampling: str
) -> None:
    """A window replays one decode graph after another, each step's samples
    fed to the next on the device; the tokens are those of single steps,
    and of eager steps."""
    from pagedkv.executor.engine import Executor
    from pagedkv.executor.model_runner import ModelRunner
    from pagedkv.executor.runner_config import RunnerConfig
    from pagedkv.v1 import common_pb2
    from tests.executor.test_launch_order import window_tokens

    params = (
        common_pb2.SamplingParams(temperature=0.0)
        if sampling == "greedy"
        else common_pb2.SamplingParams(temperature=1.0, seed=7)
    )
    outputs = []
    for eager in (False, True):
        config = RunnerConfig(
            model=str(model_dirs["llama"]),
            device="cuda",
            kernel_backend="triton",
            num_blocks=64,
            max_num_rows=4,
            cuda_graphs=not eager,
        )
        runner = ModelRunner(config)
        runner.warm_up()
        assert (runner.graphs is not None) == (not eager)
        executor = Executor(runner, "tiny")
        one_by_one = window_tokens(executor, params, [1] * 12)
        assert window_tokens(executor, params, [4, 1, 3, 4]) == one_by_one
        assert window_tokens(executor, params, [12]) == one_by_one
        outputs.append(one_by_one)
    assert outputs[0] == outputs[1]
