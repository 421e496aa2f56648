"""Block hashes: stable bytes, chained, keyed by model, block size and salt."""

from __future__ import annotations

import struct
import subprocess
import sys
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st
from xxhash import xxh3_128_digest

from pagedkv.common.block_hash import hash_full_blocks, root_hash, root_key

# The first block hash of tokens 0..15 under model "m", block size 16, no salt.
# Fixed bytes: a change here breaks every cache index mirrored across processes.
EXPECTED_FIRST = "5c1f311245f16a067f8fd432acc3884c"


def test_hash_is_the_same_in_another_interpreter() -> None:
    code = (
        "from array import array\n"
        "from pagedkv.common.block_hash import hash_full_blocks, root_hash\n"
        "print(hash_full_blocks(root_hash('m', 16), array('I', range(32)), 16, 0, 2)[1].hex())\n"
    )
    env_hashes = set()
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        )
        env_hashes.add(out.stdout.strip())
    here = hash_full_blocks(root_hash("m", 16), array("I", range(32)), 16, 0, 2)[1].hex()
    assert env_hashes == {here}


def test_hash_is_128_bits_and_follows_the_documented_encoding() -> None:
    (first,) = hash_full_blocks(root_hash("m", 16), array("I", range(16)), 16, 0, 1)
    root = xxh3_128_digest(
        b"pagedkv/block-hash/v1\x00"
        + struct.pack("<I", 1)
        + b"m"
        + struct.pack("<I", 16)
        + struct.pack("<I", 0)
    )
    assert first == xxh3_128_digest(root + struct.pack("<16I", *range(16)))
    assert first.hex() == EXPECTED_FIRST


def test_hash_chains_over_the_whole_prefix() -> None:
    root = root_hash("m", 4)
    a = hash_full_blocks(root, array("I", [1, 2, 3, 4, 5, 6, 7, 8]), 4, 0, 2)
    b = hash_full_blocks(root, array("I", [9, 2, 3, 4, 5, 6, 7, 8]), 4, 0, 2)
    assert a[1] != b[1]  # same second block, different first block


def test_incremental_hashing_equals_hashing_all_at_once() -> None:
    root = root_hash("m", 4)
    tokens = array("I", range(12))
    whole = hash_full_blocks(root, tokens, 4, 0, 3)
    first = hash_full_blocks(root, tokens, 4, 0, 1)
    rest = hash_full_blocks(first[-1], tokens, 4, 1, 3)
    assert whole == first + rest


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("m", 4, None), ("n", 4, None)),
        (("m", 4, None), ("m", 8, None)),
        (("m", 4, None), ("m", 4, "tenant-a")),
        (("m", 4, "tenant-a"), ("m", 4, "tenant-b")),
        # Concatenated, these would read alike: the lengths keep them apart.
        (("ab", 4, "c"), ("a", 4, "bc")),
        (("ms", 4, None), ("m", 4, "s")),
        (("m\x01\x00\x00\x00s", 4, None), ("m", 4, "s")),
    ],
)
def test_root_is_keyed_by_model_block_size_and_salt(
    a: tuple[str, int, str | None], b: tuple[str, int, str | None]
) -> None:
    assert root_hash(*a) != root_hash(*b)


def test_empty_salt_is_no_salt() -> None:
    assert root_hash("m", 4, "") == root_hash("m", 4, None)


_keys = st.tuples(st.text(max_size=6), st.integers(1, 2**32 - 1), st.text(max_size=6))


@given(_keys, _keys)
def test_different_keys_never_give_the_same_root_bytes(
    a: tuple[str, int, str], b: tuple[str, int, str]
) -> None:
    assert (root_key(*a) == root_key(*b)) == (a == b)


def test_different_salts_never_share_a_block() -> None:
    tokens = array("I", range(32))
    seen: dict[bytes, str | None] = {}
    for salt in (None, "a", "ab", "b", "\x00"):
        for block_hash in hash_full_blocks(root_hash("m", 4, salt), tokens, 4, 0, 8):
            assert seen.setdefault(block_hash, salt) == salt
    assert len(seen) == 5 * 8
