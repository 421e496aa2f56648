"""A decode step's inputs in one launch against the oracle, both backends; on
the GPU when there is one, else under TRITON_INTERPRET=1 on the CPU."""

from __future__ import annotations

import torch

from pagedkv.kernels import decode_inputs, reference, torch_backend
from tests.kernels.test_triton_kernels import DEVICE


def test_decode_inputs_match_the_oracle_with_padding_and_two_groups() -> None:
    gen = torch.Generator().manual_seed(3)
    max_rows, max_len, block_size, max_columns = 5, 40, 4, 10
    token_ids = torch.randint(0, 1000, (max_rows, max_len), generator=gen)
    tables = torch.randint(1, 50, (2, max_rows, max_columns), generator=gen).to(torch.int32)
    rows = torch.tensor([3, 0, 4, 0, 0])
    raw = torch.tensor([17, 0, 35, -1, -1])  # two padding entries
    want = reference.decode_inputs(rows, raw, token_ids, tables, 9, block_size)
    for module in (decode_inputs, torch_backend):
        got = module.decode_inputs(
            rows.to(DEVICE), raw.to(DEVICE), token_ids.to(DEVICE), tables.to(DEVICE), 9, block_size
        )
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g.cpu(), w)
    input_ids, positions, seq_lens, gathered, slots = want
    assert positions.tolist() == [17, 0, 35, 0, 0] and seq_lens.tolist() == [18, 1, 36, 1, 1]
    assert input_ids[0] == token_ids[3, 17] and gathered.shape == (2, 5, 9)
    assert slots[1, 0] == tables[1, 3, 17 // block_size] * block_size + 17 % block_size
    assert slots[:, 3:].eq(-1).all()
