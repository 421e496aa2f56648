"""Stable, chained 128-bit block hashes for the prefix cache.

A full block's hash is ``xxh3_128(parent_hash || token_bytes || extra_keys)``,
where ``token_bytes`` are the block's token ids as little-endian uint32 and the
first block's parent is a root hash keyed by the model id, the block size and
an optional cache salt. The same tokens give the same 16 bytes in every
process, replica and run (never Python's salted ``hash()``), so hashes can be
mirrored across processes and compared there.

Tokens of one block have a fixed byte length (the block size is in the root),
so ``extra_keys`` (e.g. adapter or media ids) appended after them cannot be
confused with tokens.
"""

from __future__ import annotations

import sys
from array import array
from typing import cast

from xxhash import xxh3_128_digest

from pagedkv.common.ids import BlockHash

TOKEN_TYPECODE = "I"
"""array typecode of stored token ids: unsigned 32-bit."""

if array(TOKEN_TYPECODE).itemsize != 4:  # pragma: no cover - every supported platform
    raise ImportError("pagedkv needs a 4-byte array('I')")

_LITTLE_ENDIAN = sys.byteorder == "little"
_ROOT_DOMAIN = b"pagedkv/block-hash/v1\x00"


def root_hash(model_id: str, block_size: int, cache_salt: str | None = None) -> BlockHash:
    """The parent hash of a request's first block.

    Requests share cached blocks only when their model id, block size and cache
    salt are all equal; an empty salt is the same as no salt.
    """
    model = model_id.encode()
    salt = (cache_salt or "").encode()
    data = b"".join(
        (
            _ROOT_DOMAIN,
            len(model).to_bytes(4, "little"),
            model,
            block_size.to_bytes(4, "little"),
            len(salt).to_bytes(4, "little"),
            salt,
        )
    )
    return BlockHash(xxh3_128_digest(data))


def token_bytes(token_ids: array[int]) -> bytes:
    """The token ids as little-endian uint32 bytes."""
    if _LITTLE_ENDIAN:
        return token_ids.tobytes()
    swapped = array(TOKEN_TYPECODE, token_ids)  # pragma: no cover - big-endian hosts
    swapped.byteswap()  # pragma: no cover
    return swapped.tobytes()  # pragma: no cover


def hash_block_tokens(
    parent: BlockHash, block_token_bytes: bytes, extra_keys: bytes = b""
) -> BlockHash:
    """The hash of one full block given its parent's hash."""
    return BlockHash(xxh3_128_digest(parent + block_token_bytes + extra_keys))


def hash_full_blocks(
    parent: BlockHash, token_ids: array[int], block_size: int, start_block: int, end_block: int
) -> list[BlockHash]:
    """Hashes of blocks ``start_block .. end_block - 1`` of ``token_ids``.

    ``parent`` is the hash of block ``start_block - 1`` (the root for block 0).
    Every block in the range must be full. This is the incremental step: a
    request calls it only for blocks that became full since its last call.
    """
    data = token_bytes(token_ids)
    step = 4 * block_size
    hashes: list[bytes] = []
    append = hashes.append
    digest = xxh3_128_digest
    last: bytes = parent
    for offset in range(start_block * step, end_block * step, step):
        last = digest(last + data[offset : offset + step])
        append(last)
    return cast("list[BlockHash]", hashes)
