"""Distinct types for ids, so that a slot number never passes for a block id."""

from __future__ import annotations

from typing import NewType

BlockId = NewType("BlockId", int)
"""Index of a physical KV block in an executor's pool; 0 is the null block."""

BlockHash = NewType("BlockHash", bytes)
"""Stable 128-bit hash of a full block and its whole prefix (16 bytes)."""

RequestId = NewType("RequestId", str)
"""A client's request id (``GenerateRequest.request_id``): free text the
client picks, echoed on every response."""

SeqId = NewType("SeqId", str)
"""A sequence's id: the block core's and the executor's name for one output
sequence of a request (a request with n > 1 or beam search has several),
made by the scheduler ("<key>.<n>") and unique among the sequences it holds."""

NULL_BLOCK_ID = BlockId(0)
"""The null block: a placeholder in block tables, never handed out."""

MAX_EPOCH = 2**63 - 1
"""The largest fencing epoch an executor accepts (``Owner.epoch`` in
common.proto); a scheduler never hands out a larger one."""

MAX_REQUEST_ID_BYTES = 256
"""The longest client request id, in bytes of UTF-8 (``GenerateRequest``)."""
