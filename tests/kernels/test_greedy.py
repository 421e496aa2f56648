"""The one-pass greedy sampler against its oracle (argmax, ties to the
lowest id, and max - logsumexp in float32), both backends; on the GPU when
there is one, else under TRITON_INTERPRET=1 on the CPU."""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels import greedy, reference, torch_backend
from tests.kernels.test_triton_kernels import DEVICE


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab_size", [1, 300, 1024])
def test_greedy_sample_matches_the_oracle(
    dtype: torch.dtype, vocab_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Blocks of 256: a 300-token vocabulary takes a whole block and a masked one.
    monkeypatch.setattr(greedy, "GREEDY_BLOCK", 256)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, vocab_size, generator=gen) * 4).to(dtype)
    want_ids, want_logprobs = reference.greedy_sample(logits)
    for sample in (greedy.greedy_sample, torch_backend.greedy_sample):
        ids, logprobs = sample(logits.to(DEVICE))
        assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
        assert ids.cpu().tolist() == want_ids.tolist()
        torch.testing.assert_close(logprobs.cpu(), want_logprobs, atol=1e-5, rtol=1e-5)


def test_ties_go_to_the_lowest_id_within_and_across_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(greedy, "GREEDY_BLOCK", 16)
    logits = torch.zeros(3, 40)
    logits[0, [3, 7]] = 2.0  # one block
    logits[1, [5, 20, 37]] = 2.0  # three blocks: the first wins
    logits[2, [33, 18]] = 2.0  # the later block's tie loses to the earlier one's
    ids, logprobs = greedy.greedy_sample(logits.to(DEVICE))
    assert ids.cpu().tolist() == [3, 5, 18]
    torch.testing.assert_close(logprobs.cpu(), reference.greedy_sample(logits)[1])


def test_a_row_view_with_a_stride_and_bad_inputs() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    rows = logits.to(DEVICE)[::2]  # every other row: a row stride of 128
    ids, _ = greedy.greedy_sample(rows)
    assert ids.cpu().tolist() == logits[::2].argmax(-1).tolist()
    with pytest.raises(ValueError, match="logits"):
        greedy.greedy_sample(torch.zeros(4, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="empty"):
        greedy.greedy_sample(torch.zeros(4, 0))
    empty_ids, empty_logprobs = greedy.greedy_sample(torch.zeros(0, 8).to(DEVICE))
    assert empty_ids.shape == empty_logprobs.shape == (0,)
