"""Greedy sampling in one pass over the logits: each row's argmax (ties to
the lowest id) and its log-probability under the row's softmax.

``torch`` takes a float32 copy of the logits, a log-sum-exp (two
reductions and an elementwise pass), a max and the subtraction: six to
eight kernels that each read the ``[num_rows, vocab_size]`` logits. Here
one program per row reads its logits once, in the model's dtype, keeping
an online maximum, its first index and the sum of exponentials rescaled to
that maximum (all float32); the chosen token's log-probability is then
``-log(sum)``. Oracle: ``pagedkv.kernels.reference.greedy_sample``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.checks import FLOAT_DTYPES

# The vocabulary slice a program reads at once (power of two), and its warps.
GREEDY_BLOCK = 8192
GREEDY_WARPS = 8


@triton.jit
def _greedy_kernel(
    logits_ptr,  # [num_rows, vocab_size]
    token_ids_ptr,  # int64 [num_rows]
    logprobs_ptr,  # float32 [num_rows]
    logits_stride,
    vocab_size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * logits_stride
    offsets = tl.arange(0, BLOCK).to(tl.int64)
    best = tl.full((), float("-inf"), dtype=tl.float32)
    best_id = tl.zeros((), dtype=tl.int64)
    total = tl.zeros((), dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK):
        ids = start + offsets
        x = tl.load(base + ids, mask=ids < vocab_size, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, 0)
        block_id = start + tl.argmax(x, 0).to(tl.int64)  # the first of its maxima
        new_best = tl.maximum(best, block_max)
        # Rescale the sum to the new maximum (no logit yet: nothing to rescale).
        scale = tl.where(best == float("-inf"), 0.0, tl.exp(best - new_best))
        terms = tl.where(x == float("-inf"), 0.0, tl.exp(x - new_best))
        total = total * scale + tl.sum(terms, 0)
        best_id = tl.where(block_max > best, block_id, best_id)  # earlier ids win ties
        best = new_best
    tl.store(token_ids_ptr + row, best_id)
    tl.store(logprobs_ptr + row, -tl.log(total))


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax of ``logits`` (``[num_rows, vocab_size]``, a float
    dtype, the last dim contiguous; ties to the lowest id) as int64, and its
    float32 log-probability under the row's softmax."""
    if logits.ndim != 2 or logits.dtype not in FLOAT_DTYPES or logits.stride(1) != 1:
        raise ValueError(
            f"logits: expected a float [N, vocab_size] with a contiguous last dim, "
            f"got {logits.dtype} {list(logits.shape)}"
        )
    num_rows, vocab_size = logits.shape
    if vocab_size == 0:
        raise ValueError("logits: the vocabulary is empty")
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows:
        block = min(GREEDY_BLOCK, max(128, triton.next_power_of_2(vocab_size)))
        _greedy_kernel[(num_rows,)](
            logits,
            token_ids,
            logprobs,
            logits.stride(0),
            vocab_size,
            BLOCK=block,
            num_warps=GREEDY_WARPS,
        )
    return token_ids, logprobs
