"""A block-core request hashes its full blocks incrementally and checks its
token ids."""

from __future__ import annotations

from array import array

import pytest

from pagedkv.common.block_hash import hash_full_blocks, root_hash
from pagedkv.scheduler.request import Request


def test_request_hashes_only_blocks_that_became_full() -> None:
    request = Request("r", range(6), block_size=4, root_hash=root_hash("m", 4))
    assert len(request.block_hashes) == 1
    request.append_output_token_ids(6)
    assert len(request.block_hashes) == 1
    request.append_output_token_ids(7)
    assert len(request.block_hashes) == 2
    assert request.block_hashes == hash_full_blocks(
        root_hash("m", 4), array("I", range(8)), 4, 0, 2
    )
    request.extend_output_token_ids([8, 9, 10, 11, 12])
    assert len(request.block_hashes) == 3


def test_request_rejects_an_empty_prompt_and_out_of_range_ids() -> None:
    root = root_hash("m", 4)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("r", [], block_size=4, root_hash=root)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("r", [-1], block_size=4, root_hash=root)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("r", [2**32], block_size=4, root_hash=root)
