"""The blocks a prefill batch reads from a quantized cache, widened into a
float buffer of the query's dtype, so that a kernel built for float caches
(the Gluon prefill, ``prefill_gluon``, whose tensor cores take 16-bit
operands) computes batches over fp8 and int8 caches too.

Prefill is bound by its matrix products, not by its bytes: over a float
cache the Gluon kernel ran 1.6x as fast as the Triton kernel over fp8
blocks (b = 8, 2,048 new tokens, head size 128 on an H100:
``kernels-h100.md`` against ``kernels-fp8-e4m3-unwidened-h100.md``), and
widening the blocks first reads each quantized byte once and writes two
(over fp8 blocks widened: ``kernels-fp8-e4m3-h100.md``, 634 us against
954). Sequence ``s``'s
page ``p`` lands at block ``s * pages + p`` of the buffer (``pages``:
``cdiv(max_seq_len, block_size)`` rounded up to ``PAGE_MULTIPLE``), so its
block table is that ``arange``;
pages past a sequence's length are left as they were (no kernel reads
them). A value is ``stored * scale`` rounded once to the query's dtype:
the fp8 scale of its KV head (``fp8_kv.dequantize``) or the int8 scale of
its token and KV head (``int8_kv.dequantize``). Oracle: those two
functions, gathered by the block table (``tests/kernels/test_dequant_blocks.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.kv_quant import ScaleArgs


@triton.jit
def _dequant_blocks_kernel(
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size], quantized
    value_cache_ptr,
    block_table_ptr,  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs]
    key_out_ptr,  # [num_seqs * pages, block_size, num_kv_heads, head_size], contiguous
    value_out_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_stride,  # over KV heads (0: one scale for the tensor)
    scale_stride_b,  # int8: over blocks and slots
    scale_stride_s,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    block_table_stride,
    pages,
    num_kv_heads,
    INT8: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    page = tl.program_id(1).to(tl.int64)
    if page * BLOCK_SIZE >= tl.load(seq_lens_ptr + seq):
        return
    block = tl.load(block_table_ptr + seq * block_table_stride + page).to(tl.int64)
    slots = tl.arange(0, BLOCK_SIZE).to(tl.int64)
    dims = tl.arange(0, HEAD)
    dest = (seq * pages + page) * BLOCK_SIZE * num_kv_heads * HEAD
    for kv_head in range(num_kv_heads):
        src = block * cache_stride_b + slots[:, None] * cache_stride_s + kv_head * cache_stride_h
        out = dest + (slots[:, None] * num_kv_heads + kv_head) * HEAD + dims[None, :]
        if INT8:  # a scale per token and KV head
            at = block * scale_stride_b + slots * scale_stride_s + kv_head * scale_stride
            k_scale = tl.load(k_scale_ptr + at).to(tl.float32)[:, None]
            v_scale = tl.load(v_scale_ptr + at).to(tl.float32)[:, None]
        else:  # a scale per KV head (or one for the tensor)
            k_scale = tl.load(k_scale_ptr + kv_head * scale_stride)
            v_scale = tl.load(v_scale_ptr + kv_head * scale_stride)
        key = tl.load(key_cache_ptr + src + dims[None, :]).to(tl.float32) * k_scale
        value = tl.load(value_cache_ptr + src + dims[None, :]).to(tl.float32) * v_scale
        tl.store(key_out_ptr + out, key.to(key_out_ptr.dtype.element_ty))
        tl.store(value_out_ptr + out, value.to(value_out_ptr.dtype.element_ty))


def buffer_bytes(
    num_seqs: int, max_seq_len: int, key_cache: torch.Tensor, dtype: torch.dtype
) -> int:
    """What ``dequantize_blocks``' K and V buffers take together."""
    _, block_size, num_kv_heads, head_size = key_cache.shape
    tokens = buffer_tokens(num_seqs, max_seq_len, block_size)
    return 2 * tokens * num_kv_heads * head_size * dtype.itemsize


# One buffer a device, kept across calls and grown when a batch needs more:
# a buffer allocated for each call, its size changing from step to step,
# made the allocator free cached memory and allocate again where the KV
# memory leaves it little room.
_BUFFERS: dict[torch.device, torch.Tensor] = {}


def reserve(device: torch.device | str, num_bytes: int) -> torch.Tensor:
    """The device's buffer (bytes), of ``num_bytes`` at least. An executor
    reserves ``paged_attention.PREFILL_DEQUANT_MAX_BYTES`` before it
    measures its peak memory, so the buffer never competes with the KV
    blocks (model_runner.py)."""
    if str(device) == "cuda":  # "cuda:0", as a tensor there names it
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    buffer = _BUFFERS.get(device)
    if buffer is None or buffer.numel() < num_bytes:
        _BUFFERS.pop(device, None)  # its memory is free for the new one
        buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        _BUFFERS[device] = buffer
    return buffer


_TABLES: dict[torch.device, torch.Tensor] = {}


def _table(device: torch.device, num_blocks: int) -> torch.Tensor:
    """``arange(num_blocks)`` (int32) on ``device``: a view of one kept a
    device and grown when needed, not a launch a layer (every layer of a
    step reads the same table)."""
    table = _TABLES.get(device)
    if table is None or len(table) < num_blocks:
        table = torch.arange(max(num_blocks, 1024), dtype=torch.int32, device=device)
        _TABLES[device] = table
    return table[:num_blocks]


def buffer_tokens(num_seqs: int, max_seq_len: int, block_size: int) -> int:
    """The token slots ``dequantize_blocks``' buffer holds."""
    return num_seqs * _pages(max_seq_len, block_size) * block_size


# A sequence's pages in the buffer, and so the new block table's row
# stride, are a multiple of this: Triton builds a kernel again for an
# integer argument that turns divisible by 16 (or 1), and the Gluon
# prefill takes seconds to build, so a stride that followed the longest
# sequence from step to step could build it again while serving (the
# executor's own tables keep one width). Found with the sm_90 build on the CPU
# (compile_only): tables 31 and 33 wide shared a build, 32 and 48 another,
# 1 a third.
PAGE_MULTIPLE = 16


def _pages(max_seq_len: int, block_size: int) -> int:
    """Pages a sequence has in the buffer: the longest one's, rounded up to
    a multiple of ``PAGE_MULTIPLE``."""
    pages = max(1, -(-max_seq_len // block_size))
    return -(-pages // PAGE_MULTIPLE) * PAGE_MULTIPLE


def dequantize_blocks(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scales: ScaleArgs,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The K and V blocks of every sequence's first ``seq_lens`` tokens,
    widened to ``dtype`` (checked by ``paged_attention``: a quantized cache
    and its ``scales``), and the block table that reads them. The K and V
    blocks are views of the device's buffer (``reserve``): the next call on
    the device writes over them."""
    num_seqs = len(seq_lens)
    _, block_size, num_kv_heads, head_size = key_cache.shape
    pages = _pages(max_seq_len, block_size)
    shape = (num_seqs * pages, block_size, num_kv_heads, head_size)
    size = buffer_bytes(num_seqs, max_seq_len, key_cache, dtype)
    buffer = reserve(key_cache.device, size)
    key_out = buffer[: size // 2].view(dtype).view(shape)
    value_out = buffer[size // 2 : size].view(dtype).view(shape)
    table = _table(key_cache.device, num_seqs * pages)
    if num_seqs:
        _dequant_blocks_kernel[(num_seqs, pages)](
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            key_out,
            value_out,
            scales.k_scale,
            scales.v_scale,
            scales.stride,
            scales.stride_b,
            scales.stride_s,
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            block_table.stride(0),
            pages,
            num_kv_heads,
            INT8=scales.int8,
            BLOCK_SIZE=block_size,
            HEAD=head_size,
        )
    return key_out, value_out, table.view(num_seqs, pages)
