"""Stable, chained 128-bit block hashes for the prefix cache.

Shared code because two services compute them: the scheduler caches blocks
under these hashes, and the router hashes a prompt the same way to find the
executors that cache its prefix.

A full block's hash is ``xxh3_128(parent_hash || token_bytes)``, where
``token_bytes`` are the block's token ids as little-endian uint32 and the
first block's parent is a root hash keyed by the model id, the block size and
an optional cache salt. The same tokens give the same 16 bytes in every
process, replica and run (never Python's salted ``hash()``), so hashes can be
mirrored across processes and compared there.

Every key is in the root, each field length-prefixed after a versioned
domain string (``root_key``), so two different key lists never give the same
bytes. A key of the whole request (a LoRA adapter's id, say) belongs there
as one more such field. Tokens of one block have a fixed byte length (the
block size is in the root); a key that differs from block to block (an
image's, at its positions) would need a typed field after them and a new
domain version: nothing needs one yet, so there is none.
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


def root_key(model_id: str, block_size: int, cache_salt: str | None = None) -> bytes:
    """The bytes the root hash is taken of: the domain, then the model id
    (uint32 little-endian byte length, UTF-8), the block size (uint32) and
    the cache salt (length, UTF-8). Different keys give different bytes; an
    empty salt is the same as no salt."""
    model = model_id.encode()
    salt = (cache_salt or "").encode()
    return b"".join(
        (
            _ROOT_DOMAIN,
            len(model).to_bytes(4, "little"),
            model,
            block_size.to_bytes(4, "little"),
            len(salt).to_bytes(4, "little"),
            salt,
        )
    )


def root_hash(model_id: str, block_size: int, cache_salt: str | None = None) -> BlockHash:
    """The parent hash of a request's first block.

    Requests share cached blocks only when their model id, block size and cache
    salt are all equal; an empty salt is the same as no salt.
    """
    return BlockHash(xxh3_128_digest(root_key(model_id, block_size, cache_salt)))


def token_bytes(token_ids: array[int]) -> bytes:
    """The token ids as little-endian uint32 bytes."""
    if _LITTLE_ENDIAN:
        return token_ids.tobytes()
    swapped = array(TOKEN_TYPECODE, token_ids)  # pragma: no cover - big-endian hosts
    swapped.byteswap()  # pragma: no cover
    return swapped.tobytes()  # pragma: no cover


def hash_block_tokens(parent: BlockHash, block_token_bytes: bytes) -> BlockHash:
    """The hash of one full block given its parent's hash."""
    return BlockHash(xxh3_128_digest(parent + block_token_bytes))


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
