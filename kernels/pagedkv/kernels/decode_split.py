"""A mixed batch's leading decodes, for attention in two launches.

A step that computes a prompt's chunk beside decodes packs both into one
batch. The prefill kernels compute each decode of such a batch with a tile
of prefill rows, one of them live, in one program that walks its whole
context; over an fp8 or int8 cache, widening the blocks for the Gluon
kernel would also fill the buffer with every decode's context. With the
decodes first in the batch and a ``DecodeSplit`` describing the rest,
``paged_attention`` instead launches the flash-decoding kernel over the
decodes (their contexts spread over many programs) and the prefill path
over the other entries alone, whose widening then holds only their own
context.

A CUDA graph's mixed batch (``paged_attention``'s ``tiles``) has a fixed
launch whatever its decodes: ``TiledDecodes`` gives the flash-decoding
launch over the batch's first ``num_slots`` tokens, sized for any context,
each slot's length read on the device (a slot past the leading decodes
reads one token: its row is a prompt's, which the tiles compute after, or
padding), and the schedule leaves the decodes' tiles out.

The split's index tensors are the other entries' own (the executor packs
them 16-byte aligned with the step's other index vectors, forward_inputs.py),
not views into the batch's: a view at another offset would change the
kernels' pointer specializations from step to step. The decodes read the
batch's tensors from their start, which keeps theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DecodeSplit:
    """The first ``num_decodes`` entries of a batch are one-token decodes
    (their sequences at most ``decode_max_seq_len`` tokens); the rest, a
    batch of their own, are described by the fields below."""

    num_decodes: int
    decode_max_seq_len: int
    block_table: torch.Tensor  # [num_rest, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_rest] int32
    query_start_loc: torch.Tensor  # [num_rest + 1] int32, from 0
    max_query_len: int
    max_seq_len: int


@dataclass(frozen=True, slots=True)
class TiledDecodes:
    """A tiled batch's (``paged_attention``'s ``tiles``) leading decodes:
    tokens ``[0, num_slots)`` take the flash-decoding launch, slot ``i``
    attending over ``seq_lens[i]`` tokens of the batch's entry ``i`` (its
    token is the entry's only one for the leading decodes; the other slots
    hold 1, and their rows are written again by the schedule's tiles or
    are padding). The schedule holds no tile of the leading decodes."""

    num_slots: int
    seq_lens: torch.Tensor  # [num_slots] int32
    max_seq_len: int  # an upper bound of seq_lens: sizes the launch
