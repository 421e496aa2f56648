"""Runs a Hugging Face decoder model (loaded on our attention by
model_loading.py), owns its KV memory and rows, and runs one packed forward
plus sampling per step.

All scheduled tokens of all entries go through one forward as a batch of one
sequence of ``num_tokens`` tokens, with their position ids; the attention
layers get the step's ``AttentionMetadata`` as a keyword argument, and the LM
head runs only at the last token of each entry that needs a sample
(``logits_to_keep``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from pagedkv.executor import attention, entry_order
from pagedkv.executor.block_store import BlockStore, num_host_blocks
from pagedkv.executor.cuda_graphs import DecodeGraphs, graph_batch_sizes
from pagedkv.executor.forward_inputs import ForwardInputs, InputBuilder
from pagedkv.executor.host_costs import HostCosts, measure_host_costs
from pagedkv.executor.host_kv import HostKVPool
from pagedkv.executor.kv_calibration import (
    CALIBRATION_TOKENS,
    calibrate_kv,
    checkpoint_kv_scales,
)
from pagedkv.executor.kv_memory import KVMemory, bytes_per_block
from pagedkv.executor.kv_rotation import fold_value_rotation, resolve_rotation
from pagedkv.executor.mixed_graphs import MixedGraphs, graph_token_sizes
from pagedkv.executor.model_loading import fused_decoder, load_model
from pagedkv.executor.model_spec import KVCacheGroup, ModelSpec
from pagedkv.executor.row_sampling import RowSamplingParams
from pagedkv.executor.rows import Rows, to_device
from pagedkv.executor.runner_config import RunnerConfig, kv_cache_dtype
from pagedkv.executor.sampler import SamplerOutput, SamplingParamsBatch, sample
from pagedkv.executor.step_types import Limits, StepPlan
from pagedkv.executor.warm_up import WarmUpReport, run_warm_up
from pagedkv.kernels.backend import get_backend
from pagedkv.kernels.fp8_kv import KV_CACHE_DTYPES, hadamard

# CPU fallback when --num-blocks is not given (no device memory to measure).
DEFAULT_CPU_NUM_BLOCKS = 2048


def graph_logits_bytes(config: RunnerConfig, vocab_size: int, dtype: torch.dtype) -> int:
    """Device bytes of the logits every captured CUDA graph keeps as its
    output, ``[rows, vocab_size]`` in the model's ``dtype`` each: a decode
    graph's rows are its batch size, a mixed graph's the entries it
    samples. They are allocated when the graphs are captured, after the KV
    memory, and live as long as the graphs: the KV memory's sizing leaves
    room for them."""
    rows = sum(graph_batch_sizes(min(config.max_num_rows, config.max_num_batched_tokens)))
    if config.mixed_graphs:
        tokens = graph_token_sizes(config.max_num_batched_tokens)
        rows += sum(min(config.max_num_rows, t) for t in tokens)
    return rows * vocab_size * dtype.itemsize


class ModelRunner:
    """The model, its KV memory and the rows of one executor."""

    def __init__(self, config: RunnerConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.backend = get_backend(config.kernel_backend)
        loaded = load_model(
            config.model, config.dtype, config.load_format, config.max_model_len, self.device
        )
        self.spec: ModelSpec = loaded.spec
        self.dtype = loaded.dtype
        self.model = loaded.model
        self.model_dir = loaded.model_dir
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        stored = None  # an fp8 memory's scales as the checkpoint stores them
        if self.kv_dtype in KV_CACHE_DTYPES.values() and config.load_format != "dummy":
            stored = checkpoint_kv_scales(
                self.model_dir, self.spec.num_layers, self.spec.num_kv_heads
            )
        # Rotated K and V (kv_rotation.py): the value and output projections
        # take the rotation before the fused stack reads them.
        self.kv_rotation: torch.Tensor | None = None
        head_size = self.spec.head_size
        if resolve_rotation(
            config.kv_cache_rotation,
            config.kv_cache_dtype,
            self.model,
            head_size,
            stored is not None,
        ):
            fold_value_rotation(self.model, head_size)
            self.kv_rotation = hadamard(head_size, self.device)
            stored = None  # taken on values as they are: calibrate on rotated ones
        self.fused = (
            fused_decoder(self.model, self.backend, self.spec.max_model_len)
            if config.fused_ops
            else None
        )
        if self.fused is not None:
            self.fused.rotate_kv = self.kv_rotation is not None
        dtype_name = str(self.kv_dtype).removeprefix("torch.")
        self.groups: tuple[KVCacheGroup, ...] = self.spec.kv_cache_groups(
            config.block_size, dtype_name
        )
        self.bytes_per_block = bytes_per_block(self.groups)
        self.max_blocks_per_row = -(-self.spec.max_model_len // config.block_size)
        self.rows = Rows(
            len(self.groups),
            config.max_num_rows,
            self.max_blocks_per_row,
            self.spec.max_model_len,
            self.device,
        )
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.graphs: DecodeGraphs | None = None  # captured by warm_up
        self.mixed_graphs: MixedGraphs | None = None  # likewise
        self.sampling_params = RowSamplingParams(self.rows, self.device)
        self.host_kv: BlockStore | None = None  # after the pool, which a measurement may size
        num_blocks = config.num_blocks or self._measure_num_blocks()
        self._attach_kv(num_blocks)
        num_host = num_host_blocks(config.host_kv_gib, self.bytes_per_block)
        if num_host:
            self.host_kv = HostKVPool(self.kv, num_host, self.backend)
        self.host_costs: HostCosts | None = None  # measured by warm_up
        self.limits = Limits(
            num_blocks=num_blocks,
            block_size=config.block_size,
            vocab_size=self.spec.vocab_size,
            max_model_len=self.spec.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_logprobs=config.max_logprobs,
            group_windowed=tuple(g.spec.sliding_window is not None for g in self.groups),
            eos_token_ids=self.spec.eos_token_ids,
            num_host_blocks=num_host,
        )
        calibrate_kv(self, config.block_size, stored)  # an fp8 memory's scales

    # -- sizing ---------------------------------------------------------------

    def _measure_num_blocks(self) -> int:
        """Blocks that fit in ``gpu_memory_utilization`` of the device after a
        forward at the largest step (run on a small scratch KV memory)."""
        if self.device.type != "cuda":
            return DEFAULT_CPU_NUM_BLOCKS
        tokens = self.config.max_num_batched_tokens
        seq_len = min(tokens, self.spec.max_model_len)
        num_seqs = -(-tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.config.block_size)
        scratch_blocks = 1 + num_seqs * blocks_per_seq
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        if self.widens_prefill_blocks:  # held from now on, so inside the peak
            from pagedkv.kernels import dequant_blocks, paged_attention

            dequant_blocks.reserve(self.device, paged_attention.PREFILL_DEQUANT_MAX_BYTES)
        self._attach_kv(scratch_blocks)
        scratch_bytes = self.kv.num_bytes
        self.warm_up(scratch_blocks, profile=True)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch_bytes
        del self.kv, self.forward_inputs
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.config.gpu_memory_utilization - others - peak
        if self.uses_cuda_graphs:  # captured after the KV memory, kept while it lives
            budget -= graph_logits_bytes(self.config, self.spec.vocab_size, self.dtype)
        num_blocks = int(budget // self.bytes_per_block)
        if num_blocks < 2:
            raise ValueError(
                "gpu_memory_utilization: no room for the KV cache "
                f"(peak {peak / 2**30:.1f} GiB, others {others / 2**30:.1f} GiB)"
            )
        return num_blocks

    @property
    def widens_prefill_blocks(self) -> bool:
        """Whether prefills over this executor's fp8 or int8 blocks widen
        them for the Gluon kernel (Triton kernels on an sm_90 GPU;
        ``paged_attention.PREFILL_DEQUANTIZE``)."""
        if self.kv_dtype.itemsize != 1 or self.backend.name != "triton":
            return False
        from pagedkv.kernels import paged_attention, prefill_gluon  # the backend imported them

        return (
            paged_attention.PREFILL_GLUON
            and paged_attention.PREFILL_DEQUANTIZE
            and prefill_gluon.runs_on(self.device)
        )

    @property
    def splits_decodes(self) -> bool:
        """Whether attention takes the decodes of a step whose decodes come
        first in a launch of their own (``forward_inputs``, ``DecodeSplit``)."""
        return self.forward_inputs.splits_decodes

    def _attach_kv(self, num_blocks: int) -> None:
        """Allocates the KV memory of ``num_blocks`` blocks and the builder
        of forward inputs over it (the two always go together)."""
        self.kv = KVMemory(self.groups, num_blocks, self.kv_dtype, self.device, self.kv_rotation)
        self.forward_inputs = InputBuilder(
            self.rows, self.kv, self.groups, self.backend, self.config.block_size, self.spec.softcap
        )

    def warm_up(
        self, num_blocks: int | None = None, profile: bool = False, full: bool | None = None
    ) -> WarmUpReport:
        """Runs, over scratch rows, every kernel variant a step can reach
        (warm_up.py: a forward of each power-of-two length up to the largest
        step, the largest step, each sampler path, a block copy), then
        captures the decode graphs; logs what it ran and how long it took.
        ``full`` defaults to whether the device is CUDA, where kernels are
        built per shape; elsewhere (the CPU, Triton's interpreter) nothing
        is, and only the log line is written. When profiling (sizing the KV
        memory) only the largest step runs, to reach peak activations.
        Leaves rows, samples, the generator and the KV contents that matter
        (none: no block is tagged yet) as they were."""
        if full is None:
            full = self.device.type == "cuda"
        report = run_warm_up(self, num_blocks or self.limits.num_blocks, profile, full)
        if not profile:  # what a host hit costs against recomputing it (host_costs.py)
            self.host_costs = measure_host_costs(self, num_blocks or self.limits.num_blocks)
        return report

    def capture_graphs(self) -> None:
        """Captures the decode graphs (``uses_cuda_graphs``), once the
        warm-up has built every kernel they launch."""
        if self.uses_cuda_graphs:
            config = self.config
            self.graphs = DecodeGraphs(
                self, min(config.max_num_rows, config.max_num_batched_tokens)
            )
            if config.mixed_graphs:  # in segments where a host tier's loads land
                starts = (0,) if self.host_kv is None else self.host_kv.chunk_starts()
                self.mixed_graphs = MixedGraphs(
                    self, config.max_num_batched_tokens, config.max_num_rows, starts=starts
                )

    @property
    def calibration_tokens(self) -> int:
        """Tokens of the forward that calibrates an fp8 KV memory."""
        limit = min(self.config.max_num_batched_tokens, self.spec.max_model_len)
        return min(CALIBRATION_TOKENS, limit)

    @property
    def uses_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs once warmed up: asked for, on CUDA,
        with the Triton kernels (the torch ones wait for the host)."""
        return (
            self.config.cuda_graphs and self.device.type == "cuda" and self.backend.name == "triton"
        )

    # -- a step ---------------------------------------------------------------

    def copy_blocks(self, copies: np.ndarray) -> None:
        if len(copies):
            self._finish_loads()  # a copy may read a block just loaded
            self.kv.copy_blocks(self.backend, to_device(copies, self.device))

    def run(self, plan: StepPlan) -> SamplerOutput | None:
        """Copies, then the forward and sampling of the plan's entries (rows
        already updated). Returns None when no entry needs a sample. The
        host tier's loads of the step land layer by layer as an eager
        forward reaches them (a mixed-step graph's segment by segment), and
        whole before a copy or a decode graph's replay; all have landed when
        it returns."""
        try:
            self.copy_blocks(plan.copies)
            if not len(plan.rows):
                return None
            if plan.num_steps > 1:
                return self.decode_window(plan.rows, plan.num_computed, plan.num_steps)
            return self.forward(plan.rows, plan.num_computed, plan.num_scheduled, plan.needs_sample)
        finally:
            self._finish_loads()

    def _finish_loads(self) -> None:
        if self.host_kv is not None:
            self.host_kv.finish_loads()

    def decode_window(
        self, rows: np.ndarray, num_computed: np.ndarray, num_steps: int
    ) -> SamplerOutput:
        """``num_steps`` one-token decodes of ``rows`` back to back, each
        step's samples appended on the device as the next step's tokens (no
        wait for the host between them); the samples of every step, step
        after step."""
        ones = np.ones(len(rows), dtype=np.int64)
        sample_all = np.ones(len(rows), dtype=bool)
        graphs = self.graphs
        if graphs is not None and not graphs.fits(ones, sample_all):
            graphs = None
        results = []
        for j in range(num_steps):
            if j and graphs is not None:  # the same graph, its inputs advanced on the device
                logits, device_rows = graphs.run_next(len(rows))
                result = self._sample_and_record(
                    rows, device_rows, logits, num_computed + j + 1, sample_all
                )
            else:
                if j:
                    self.rows.append_samples(rows, num_computed + j)
                maybe = self.forward(rows, num_computed + j, ones, sample_all)
                assert maybe is not None  # every entry samples
                result = maybe
            results.append(result)
        return SamplerOutput(*(torch.cat(column) for column in zip(*results, strict=True)))

    def forward(
        self,
        rows: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        needs_sample: np.ndarray,
        calibrate: bool = False,
    ) -> SamplerOutput | None:
        """``forward_in_order`` with the one-token entries first, where
        attention takes a batch's leading decodes in a launch of their own
        (entry_order.py); the samples in the entries' order."""
        order = entry_order.decodes_first(num_scheduled) if self.splits_decodes else None
        if order is None:
            return self.forward_in_order(rows, num_computed, num_scheduled, needs_sample, calibrate)
        needs_sample = needs_sample[order]
        output = self.forward_in_order(
            rows[order], num_computed[order], num_scheduled[order], needs_sample, calibrate
        )
        return None if output is None else entry_order.in_step_order(output, order, needs_sample)

    def forward_in_order(
        self,
        rows: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        needs_sample: np.ndarray,
        calibrate: bool = False,
    ) -> SamplerOutput | None:
        """One packed forward over ``rows`` (tokens ``[c, c + s)`` of each,
        already in the rows' histories) and sampling where asked; the samples
        become the rows' last samples (on the device). Decodes replay a
        captured decode graph when there is one, other steps of up to 1,024
        tokens a mixed-step graph (mixed_graphs.py). ``calibrate``: eager,
        each layer setting its fp8 scales first (kv_calibration.py)."""
        if calibrate:
            inputs = self.forward_inputs.prepare(rows, num_computed, num_scheduled, needs_sample)
            meta = replace(inputs.metadata, calibrate=self.kv.calibrate)
            maybe_logits = self._model_logits(replace(inputs, metadata=meta))
            if maybe_logits is None:
                return None
            logits, sampled_rows = maybe_logits, inputs.sampled_rows
            sample_positions = inputs.sample_positions
        elif self.graphs is not None and self.graphs.fits(num_scheduled, needs_sample):
            self._finish_loads()  # a graph has no layer hook
            logits, sampled_rows = self.graphs.run(rows, num_computed)
            sample_positions = num_computed + 1
        elif self.mixed_graphs is not None and self.mixed_graphs.fits(num_scheduled):
            before_layer = None if self.host_kv is None else self.host_kv.before_layer
            logits, sampled_rows, sample_positions = self.mixed_graphs.run(
                rows, num_computed, num_scheduled, needs_sample, before_layer
            )
            if not len(sample_positions):
                return None
        else:
            inputs = self.forward_inputs.prepare(rows, num_computed, num_scheduled, needs_sample)
            if self.host_kv is not None:
                meta = replace(inputs.metadata, before_layer=self.host_kv.before_layer)
                inputs = replace(inputs, metadata=meta)
            maybe_logits = self._model_logits(inputs)
            if maybe_logits is None:
                return None
            logits, sampled_rows = maybe_logits, inputs.sampled_rows
            sample_positions = inputs.sample_positions
        return self._sample_and_record(rows, sampled_rows, logits, sample_positions, needs_sample)

    def _sample_and_record(
        self,
        rows: np.ndarray,
        sampled_rows: torch.Tensor,
        logits: torch.Tensor,
        sample_positions: np.ndarray,
        needs_sample: np.ndarray,
    ) -> SamplerOutput:
        """Samples the logits of ``rows[needs_sample]`` (``sampled_rows`` on
        the device), whose samples become those rows' last samples."""
        host_rows = rows[needs_sample]
        params = self.sampling_params.get(host_rows, sample_positions)
        result = self._sample(logits, params)
        self.rows.record_samples(host_rows, sampled_rows, result.token_ids)
        return result

    def _sample(self, logits: torch.Tensor, params: SamplingParamsBatch) -> SamplerOutput:
        """Samples ``logits`` (the model's dtype): an all-greedy batch without
        top logprobs in the backend's one pass over them, else the sampler on
        a float32 copy."""
        if params.all_greedy and not params.max_num_logprobs and not params.num_banned:
            token_ids, logprobs = self.backend.greedy_sample(logits)
            empty = (len(token_ids), 0)
            return SamplerOutput(
                token_ids,
                logprobs,
                torch.empty(empty, dtype=torch.int64, device=logits.device),
                torch.empty(empty, dtype=torch.float32, device=logits.device),
            )
        return sample(logits.float(), params, self.generator)

    def logits(self, inputs: ForwardInputs) -> torch.Tensor | None:
        """Runs the model; float32 logits ``[num_samples, vocab_size]`` at the
        sampled positions, or None when no entry needs a sample."""
        logits = self._model_logits(inputs)
        return None if logits is None else logits.float()

    def _model_logits(self, inputs: ForwardInputs) -> torch.Tensor | None:
        """As ``logits``, in the model's dtype."""
        logits = self.run_model(
            inputs.input_ids, inputs.positions, inputs.metadata, inputs.sample_index
        )
        if not len(inputs.sample_positions):
            return None
        return logits

    def run_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: attention.AttentionMetadata,
        sample_index: torch.Tensor | None,
    ) -> torch.Tensor:
        """The packed forward of ``input_ids`` at ``positions`` (K/V written
        into the caches); logits ``[num_samples, vocab_size]`` in the model's
        dtype at ``sample_index`` (None: every token). The fused decoder
        stack when the model has one, else transformers' modules."""
        if self.fused is not None:
            return self.fused(input_ids, positions, meta, sample_index)
        with torch.inference_mode():
            output = self.model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=0 if sample_index is None else sample_index,
                pagedkv_metadata=meta,
            )
        logits: torch.Tensor = output.logits[0]
        return logits
