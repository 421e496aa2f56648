"""A forward's one-token entries first, and its samples back in the step's order.

A step message lists its new requests before its other entries
(``StepRequest.new_requests``, then ``rows``), so a step that admits a
request beside running decodes reaches the executor with the prompt's
chunk first. Attention takes only a batch's leading decodes in a launch
of their own (the flash-decoding kernel: ``DecodeSplit`` eagerly,
``TiledDecodes`` in a mixed-step graph); packed behind a chunk, each
decode takes a prefill tile with one live row and walks its whole
context in one program. ``leading_decodes`` counts those a batch has,
``decodes_first`` is the stable order that moves them all ahead, and
``in_step_order`` puts the samples of a forward run in that order back in
the step's.
"""

from __future__ import annotations

import numpy as np

from pagedkv.executor.rows import to_device
from pagedkv.executor.sampler import SamplerOutput


def leading_decodes(num_scheduled: np.ndarray) -> int:
    """How many entries at the start of a step compute one token each."""
    others = np.flatnonzero(num_scheduled != 1)
    return int(others[0]) if len(others) else len(num_scheduled)


def decodes_first(num_scheduled: np.ndarray) -> np.ndarray | None:
    """The entries' order with the one-token ones first, each part in its
    own order; None where they lead already (or are all or none)."""
    ones = num_scheduled == 1
    if not ones[leading_decodes(num_scheduled) :].any():
        return None
    return np.concatenate([np.flatnonzero(ones), np.flatnonzero(~ones)])


def in_step_order(
    output: SamplerOutput, order: np.ndarray, needs_sample: np.ndarray
) -> SamplerOutput:
    """``output``, the samples of a forward over the entries in ``order``
    (``needs_sample`` in that order too), in the step's entry order."""
    back = np.argsort(order[needs_sample], kind="stable")
    if (back == np.arange(len(back))).all():
        return output
    index = to_device(back, output.token_ids.device)  # the host does not wait
    return SamplerOutput(*(column.index_select(0, index) for column in output))
