"""What an executor runs before it says ready, so that no request meets a
kernel built on first use.

Triton compiles a kernel once per specialization: per value of each
``constexpr`` and per class of each integer argument (equal to 1, divisible
by 16, other) and pointer argument (16-byte aligned or not). A compile takes
50 to 1,000 ms on the H200, and a request whose step meets one waits for it,
with every request queued behind it. What a step can reach, and how:

- the forward inputs make the integer and pointer classes the same for
  every eager step (forward_inputs.py: block tables gathered at their full
  width, index vectors packed 16-byte aligned), so those are one variant;
- the slot mapping's ``BLOCK`` is the longest query's length rounded up to a
  power of two (at most 1024), and paged attention takes small tiles up to
  16 query tokens and large ones past that: ``warm_up_steps`` runs a
  one-entry forward of every power of two up to the largest step, then the
  largest step itself (which also grows the allocator to its peak);
- an eager decode step (``--enforce-eager``, or one-token entries that do
  not all sample) launches the flash-decoding kernel with as many splits
  of the context as ``split_count`` gives for its entries and their longest
  context, and the split count is specialized (1, a multiple of 16, other)
  and sizes the merge (the next power of two): ``decode_steps`` runs a
  one-entry decode at the shortest context of each such variant, up to the
  most splits a step can have (one entry at the model's length);
- over an fp8 or int8 cache on an sm_90 GPU, a prefill widens the blocks
  it reads for the Gluon kernel unless its buffer would be too large for
  its new tokens (a chunk beside decodes of long contexts), when the Triton
  kernel reads the quantized blocks; the warm-up's prefills have no
  context beside them, so each one the Gluon kernel takes widens, and
  ``run_warm_up`` runs them again with the widening off
  (``unwidened_steps``) to build the Triton kernel's variants too;
- an eager step whose decodes come before a prompt launches the
  flash-decoding kernel over the decodes alone
  (``DecodeSplit``), without the rotary embedding a fused model's decode
  steps fold into it: ``split_steps`` runs each of ``decode_steps``' decodes
  before a two-token prompt;
- the decode graphs (cuda_graphs.py) are captured after these, one per batch
  size, so a decode step launches nothing new;
- the sampler's paths (greedy with top logprobs, temperature, top-k, top-p,
  seeded and unseeded noise) run once on random logits (``SAMPLER_PATHS``),
  loading their library kernels; block copies run once.

``KernelCompiles`` counts Triton's compiles while warming up, and after that
logs each one as a warning naming the kernel: a variant that serving still
reaches shows in the log instead of only as a slow request.
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from pagedkv.common.logging import get_logger
from pagedkv.executor.cuda_graphs import DecodeGraphs
from pagedkv.executor.model_spec import ModelSpec
from pagedkv.executor.rows import Rows
from pagedkv.executor.runner_config import QUANTIZED_KV_DTYPES
from pagedkv.executor.sampler import SamplerOutput, SamplingParamsBatch, sample


class WarmUpLimits(Protocol):
    """The runner's settings the warm-up sizes its steps by."""

    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def max_num_rows(self) -> int: ...
    @property
    def max_logprobs(self) -> int: ...
    @property
    def kv_cache_dtype(self) -> str: ...


class WarmUpRunner(Protocol):
    """What the warm-up needs of the model runner (``ModelRunner``)."""

    @property
    def config(self) -> WarmUpLimits: ...
    @property
    def spec(self) -> ModelSpec: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def rows(self) -> Rows: ...
    @property
    def max_blocks_per_row(self) -> int: ...
    @property
    def generator(self) -> torch.Generator: ...
    @property
    def graphs(self) -> DecodeGraphs | None: ...
    @property
    def widens_prefill_blocks(self) -> bool: ...
    @property
    def splits_decodes(self) -> bool: ...
    def forward(
        self,
        rows: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        needs_sample: np.ndarray,
    ) -> SamplerOutput | None: ...
    def copy_blocks(self, copies: np.ndarray) -> None: ...
    def capture_graphs(self) -> None: ...


log = get_logger(__name__)

SLOT_MAPPING_MAX_BLOCK = 1024
"""The slot mapping's largest ``BLOCK`` (kernels/slot_mapping.py)."""


class WarmUpStep(NamedTuple):
    """One scratch forward: ``num_seqs`` entries of ``num_scheduled`` new
    tokens each, after ``num_computed`` tokens of context; with a
    ``decode_context`` (not -1), after a one-token decode at that context."""

    num_seqs: int
    num_computed: int
    num_scheduled: int
    decode_context: int = -1


class SamplerPath(NamedTuple):
    """One sampler path: every row's params alike."""

    name: str
    temperature: float
    top_k: int
    top_p: float
    seeded: bool
    num_logprobs: int


SAMPLER_PATHS = (
    SamplerPath("greedy, top logprobs", 0.0, 0, 1.0, False, 5),
    SamplerPath("temperature", 0.8, 0, 1.0, False, 0),
    SamplerPath("top-k", 0.8, 20, 1.0, False, 0),
    SamplerPath("top-p", 0.8, 0, 0.9, False, 0),
    SamplerPath("top-k and top-p, seeded", 0.8, 20, 0.9, True, 0),
)


class WarmUpReport(NamedTuple):
    """What ``ModelRunner.warm_up`` ran and what it took."""

    seconds: float
    steps: tuple[WarmUpStep, ...]
    sampler_paths: tuple[str, ...]
    graph_batch_sizes: tuple[int, ...]
    num_compiles: int  # Triton compiles during the warm-up (0 without Triton)


def warm_up_steps(
    max_num_batched_tokens: int, max_model_len: int, max_num_rows: int
) -> tuple[WarmUpStep, ...]:
    """The scratch forwards that reach every eager-step variant: one entry of
    each power-of-two length up to the largest step's (a decode first), then
    the largest step, as many entries of the longest length as its tokens
    need (the shape the KV memory was sized after)."""
    longest = min(max_num_batched_tokens, max_model_len)
    steps = []
    length = 1
    while length < longest:
        steps.append(WarmUpStep(1, 0, length))
        length *= 2
    num_seqs = min(-(-max_num_batched_tokens // longest), max_num_rows)
    steps.append(WarmUpStep(num_seqs, 0, longest))
    return tuple(steps)


def decode_steps(
    max_model_len: int,
    num_kv_heads: int,
    num_sms: int,
    quantized: bool = False,
    words: bool = False,
) -> tuple[WarmUpStep, ...]:
    """One-entry decodes, one per variant of the flash-decoding launch an
    eager decode step can reach: the split count's class (1, a multiple of
    16, other) with the merge's width (its next power of two), each at the
    shortest context that gives it. One entry at the model's length has the
    most splits any step has (more entries share the GPU's programs).
    ``quantized``: the launch constants of an fp8 or int8 cache (``words``:
    one whose V tiles decode reads as words, ``decode_attention.reads_words``)."""
    # Imported here, as the backends import their kernel modules: the
    # Triton interpreter must be chosen before any kernel is defined.
    from pagedkv.kernels.decode_attention import launch_constants, split_count

    (block_n, _, _), per_sm = launch_constants(quantized, words)
    most = split_count(num_kv_heads, max_model_len, block_n, num_sms, per_sm)
    steps, seen = [], set()
    for num_splits in range(1, most + 1):
        variant = (num_splits == 1, num_splits % 16 == 0, 1 << (num_splits - 1).bit_length())
        if variant not in seen:
            seen.add(variant)
            steps.append(WarmUpStep(1, block_n * (num_splits - 1), 1))
    return tuple(steps)


def unwidened_steps(steps: tuple[WarmUpStep, ...]) -> tuple[WarmUpStep, ...]:
    """The steps of ``steps`` that compute prompts (more than one new
    token): run again with the widening off, they build the Triton prefill
    over the quantized cache that a step takes when its widening would be
    too large (``paged_attention``'s ``PREFILL_DEQUANT_MAX_*``)."""
    return tuple(step for step in steps if step.num_scheduled > 1)


def split_steps(decodes: tuple[WarmUpStep, ...]) -> tuple[WarmUpStep, ...]:
    """For each of ``decodes`` (``decode_steps``), that decode before a
    two-token prompt: such a step's attention launches the
    flash-decoding kernel over the decode alone, without the
    one-launch decode's rotary embedding (``DecodeSplit``), a variant the
    eager decode steps of a fused model never reach."""
    return tuple(WarmUpStep(1, 0, 2, decode_context=step.num_computed) for step in decodes)


def slot_mapping_blocks(steps: tuple[WarmUpStep, ...]) -> set[int]:
    """The slot mapping's ``BLOCK`` of each step (its longest query, rounded
    up to a power of two, at most ``SLOT_MAPPING_MAX_BLOCK``)."""
    return {
        min(SLOT_MAPPING_MAX_BLOCK, 1 << max(step.num_scheduled - 1, 0).bit_length())
        for step in steps
    }


def run_warm_up(runner: WarmUpRunner, num_blocks: int, profile: bool, full: bool) -> WarmUpReport:
    """``ModelRunner.warm_up``: the steps (only the largest when profiling,
    none unless ``full``), the sampler paths and a block copy (``full``, not
    profiling), then the graphs' capture (not profiling); logs the report
    (not profiling) and from then on each compile."""
    compiles = KernelCompiles.install() if full else KernelCompiles()
    start, compiled_before = time.perf_counter(), compiles.count
    config = runner.config
    from pagedkv.kernels.decode_attention import reads_words, sm_count  # see decode_steps

    spec = runner.spec
    quantized = config.kv_cache_dtype in QUANTIZED_KV_DTYPES
    words = quantized and reads_words(config.kv_cache_dtype == "int8", spec.head_size)
    decodes = decode_steps(
        spec.max_model_len, spec.num_kv_heads, sm_count(runner.device), quantized, words
    )
    steps = decodes + warm_up_steps(
        config.max_num_batched_tokens, spec.max_model_len, config.max_num_rows
    )
    if profile:
        steps = steps[-1:]
    elif not full:
        steps = ()
    ran = run_forwards(runner, steps, num_blocks)
    paths: tuple[str, ...] = ()
    if full and not profile and runner.widens_prefill_blocks:
        from pagedkv.kernels import paged_attention

        with paged_attention.widening(False):
            ran += run_forwards(runner, unwidened_steps(steps), num_blocks)
    if full and not profile and runner.splits_decodes and config.max_num_rows > 1:
        ran += run_forwards(runner, split_steps(decodes), num_blocks)
    if full and not profile:
        paths = _run_sampler_paths(runner)
        runner.copy_blocks(np.array([[1, 1]], dtype=np.int64))
    if not profile:
        runner.capture_graphs()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    graphs = runner.graphs
    report = WarmUpReport(
        seconds=time.perf_counter() - start,
        steps=ran,
        sampler_paths=paths,
        graph_batch_sizes=tuple(graphs.sizes) if graphs is not None else (),
        num_compiles=compiles.count - compiled_before,
    )
    if not profile:
        log.info(
            "executor warmed up",
            seconds=round(report.seconds, 2),
            forwards=len(report.steps),
            longest_step=max((s.num_seqs * s.num_scheduled for s in ran), default=0),
            sampler_paths=len(report.sampler_paths),
            graph_batch_sizes=len(report.graph_batch_sizes),
            kernel_compiles=report.num_compiles if compiles.available else None,
        )
        compiles.start_serving()
    return report


def run_forwards(
    runner: WarmUpRunner, steps: tuple[WarmUpStep, ...], num_blocks: int
) -> tuple[WarmUpStep, ...]:
    """Runs ``steps`` over scratch rows whose every table column is block 1
    (their K/V writes land there; what they read is never used), the rows
    freed and the generator's state restored after; returns those run
    (none without a block 1)."""
    if num_blocks < 2:
        return ()
    ran = []
    state = runner.generator.get_state()
    for step in steps:  # warm_up_steps keeps each within max_num_rows
        decode = step.decode_context >= 0
        num_computed = [step.decode_context] * decode + [step.num_computed] * step.num_seqs
        num_scheduled = [1] * decode + [step.num_scheduled] * step.num_seqs
        rows = np.arange(len(num_computed), dtype=np.int64)
        runner.rows.fill_tables(np.ones((len(rows), runner.max_blocks_per_row), np.int64))
        runner.forward(
            rows, np.array(num_computed), np.array(num_scheduled), np.ones(len(rows), dtype=bool)
        )
        runner.rows.free(rows.tolist())  # the scratch rows' samples
        ran.append(step)
    runner.generator.set_state(state)
    runner.rows.clear_tables()
    return tuple(ran)


def _run_sampler_paths(runner: WarmUpRunner) -> tuple[str, ...]:
    """Runs each of ``SAMPLER_PATHS`` on random logits (two rows, drawn
    from the runner's generator), the generator's state restored after."""
    state = runner.generator.get_state()
    logits = torch.randn(
        (2, runner.spec.vocab_size),
        dtype=torch.float32,
        device=runner.device,
        generator=runner.generator,
    )
    for path in SAMPLER_PATHS:
        params = SamplingParamsBatch.build(
            temperature=[path.temperature] * 2,
            top_k=[path.top_k] * 2,
            top_p=[path.top_p] * 2,
            seeds=[1 if path.seeded else None] * 2,
            positions=[1, 2],
            max_num_logprobs=min(path.num_logprobs, runner.config.max_logprobs),
            device=runner.device,
        )
        sample(logits, params, runner.generator)
    runner.generator.set_state(state)
    return tuple(path.name for path in SAMPLER_PATHS)


class KernelCompiles:
    """Counts Triton's kernel compiles in this process (through its
    post-compile hook, chained after any hook already set); once
    ``serving`` is set, each compile is also logged as a warning. Without
    Triton (or with its interpreter) nothing is counted."""

    _installed: KernelCompiles | None = None
    _install_lock = threading.Lock()

    def __init__(self) -> None:
        self.count = 0
        self.serving = False
        self.available = False  # the hook is in: Triton compiles kernels here
        self._count_at_ready = 0

    def start_serving(self) -> None:
        """From now on each compile is also logged as a warning."""
        self._count_at_ready = self.count
        self.serving = True

    @classmethod
    def install(cls) -> KernelCompiles:
        """The process's one counter, its hook installed on first call."""
        with cls._install_lock:
            if cls._installed is None:
                counter = cls()
                counter._hook()
                cls._installed = counter
            return cls._installed

    def _hook(self) -> None:
        try:
            from triton import knobs
        except ImportError:
            return
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_post_compile_hook"):
            return
        previous = runtime.jit_post_compile_hook

        def on_compile(**kwargs: Any) -> Any:
            self.count += 1
            if self.serving:
                fn = kwargs.get("fn")
                log.warning(
                    "kernel compiled while serving",
                    kernel=getattr(fn, "name", str(fn)),
                    compiles_since_ready=self.count - self._count_at_ready,
                )
            return previous(**kwargs) if previous is not None else None

        runtime.jit_post_compile_hook = on_compile
        self.available = True
