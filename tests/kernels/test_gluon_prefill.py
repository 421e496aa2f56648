"""The Gluon prefill kernel (``prefill_gluon``, sm_90 only: Gluon has no
interpreter) against the torch oracle, through ``paged_attention`` with
``PREFILL_GLUON`` on. Its sm_90 build is checked on any machine
(sm90_compile.py)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels import dequant_blocks, paged_attention, prefill_gluon, reference
from tests.kernels.test_dequant_blocks import quantized_batch
from tests.kernels.test_reference import build_batch
from tests.kernels.test_triton_kernels import NAMES, tile_schedule

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not SM90, reason="the Gluon prefill runs on sm_90 only")


def _check(
    contexts: list[int],
    query_lens: list[int],
    dtype: torch.dtype,
    head_size: int,
    num_kv_heads: int = 2,
    block_size: int = 16,
    tiles: bool = False,
    stale: float = 0.0,
) -> None:
    """``stale``: what a sequence's last block holds past its end (a
    block's earlier owner may have left an inf or a NaN there)."""
    batch = build_batch(
        contexts, query_lens, num_q_heads=8, num_kv_heads=num_kv_heads, dtype=dtype,
        head_size=head_size, block_size=block_size,
    )  # fmt: skip
    args = [batch[name].cuda() for name in NAMES]  # type: ignore[union-attr]
    expected = reference.paged_attention(
        *[a.float() if a.is_floating_point() else a for a in args], scale=0.3
    )  # type: ignore[arg-type]
    if stale:
        _, key_cache, value_cache, block_table, seq_lens = args[:5]
        for seq, seq_len in enumerate(seq_lens.tolist()):
            if seq_len % block_size:
                last = int(block_table[seq, seq_len // block_size])
                key_cache[last, seq_len % block_size :] = stale
                value_cache[last, seq_len % block_size :] = stale
    kwargs: dict[str, object] = {"scale": 0.3}
    if tiles:
        kwargs["max_query_len"] = 2048
        kwargs["tiles"] = tile_schedule(query_lens, prefill_gluon.TILE_ROWS, extra=5).cuda()
    assert prefill_gluon.supported(args[0], args[1], None, None)
    out = paged_attention.paged_attention(*args, **kwargs)  # type: ignore[arg-type]
    tolerance = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.float(), expected.to(out.device), atol=tolerance, rtol=tolerance)


@pytest.fixture(autouse=True)
def _gluon_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged_attention, "PREFILL_GLUON", True)


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128])
def test_chunks_over_cached_context_and_decodes_match_the_oracle(
    dtype: torch.dtype, head_size: int
) -> None:
    # Chunks from scratch and over cached context (whole key tiles before
    # the diagonal, and parts of one), a chunk of exactly a tile, decode
    # entries (tiles of one row).
    _check([0, 300, 5, 200, 1000, 0], [150, 40, 1, 130, 300, 128], dtype, head_size)


@needs_sm90
@pytest.mark.parametrize("num_kv_heads", [1, 8])  # 8 and 1 query heads per KV head
@pytest.mark.parametrize("block_size", [16, 32])
def test_long_chunks_wrap_the_buffer_ring(num_kv_heads: int, block_size: int) -> None:
    _check([0, 700], [2048, 1500], torch.bfloat16, 128, num_kv_heads, block_size)


@needs_sm90
def test_a_tile_schedule_read_on_the_device_gives_the_same_output() -> None:
    _check([0, 300, 17, 0], [300, 40, 1, 129], torch.float16, 128, tiles=True)


@needs_sm90
@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("head_size", [64, 128])
def test_quantized_caches_are_widened_for_it(
    kind: str, head_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Over an fp8 or int8 cache the batch's blocks are widened to the
    # query's dtype (dequant_blocks) and this kernel computes it; with no
    # room for the buffer, or more of it than the new tokens pay for, the
    # Triton kernel reads the quantized cache.
    batch, kv = quantized_batch(kind, head_size)
    args = [batch[name].cuda() for name in NAMES]  # type: ignore[union-attr]
    on = {name: t.cuda() for name, t in kv.items()}
    query = args[0].to(torch.bfloat16)
    expected = reference.paged_attention(
        query.float(),
        reference.from_cache(batch["key_cache"], kv["k_scale"], torch.float32).cuda(),  # type: ignore[arg-type]
        reference.from_cache(batch["value_cache"], kv["v_scale"], torch.float32).cuda(),  # type: ignore[arg-type]
        *args[3:],
        scale=0.3,
    )
    widened = []
    real = dequant_blocks.dequantize_blocks
    monkeypatch.setattr(
        dequant_blocks, "dequantize_blocks", lambda *a: widened.append(a[-1]) or real(*a)
    )
    out = paged_attention.paged_attention(query, *args[1:], scale=0.3, **on)
    assert widened == [torch.bfloat16]
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    for limit in ("PREFILL_DEQUANT_MAX_BYTES", "PREFILL_DEQUANT_MAX_RATIO"):
        with monkeypatch.context() as patch:
            patch.setattr(paged_attention, limit, 0)
            out = paged_attention.paged_attention(query, *args[1:], scale=0.3, **on)
        assert widened == [torch.bfloat16]
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_it_covers_only_what_it_computes() -> None:
    query = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 2, 128, dtype=torch.bfloat16)
    assert not prefill_gluon.supported(query, cache, None, None)  # not on a GPU
    if SM90:
        query, cache = query.cuda(), cache.cuda()
        assert prefill_gluon.supported(query, cache, None, None)
        assert not prefill_gluon.supported(query, cache, 7, None)
        assert not prefill_gluon.supported(query, cache, None, 5.0)
        assert not prefill_gluon.supported(query, cache.to(torch.float8_e4m3fn), None, None)
        assert not prefill_gluon.supported(query[..., :80], cache[..., :80], None, None)


@needs_sm90
@pytest.mark.parametrize("tiling", [(32, 4, 2, 64), (64, 3, 1, 64), (128, 3, 0, 128)])
@pytest.mark.parametrize("tiles", [False, True])
def test_other_tilings_match_the_oracle(
    tiling: tuple[int, ...], tiles: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Programs of 64 rows (two a schedule tile), 32-key tiles, the other schedules.
    monkeypatch.setattr(prefill_gluon, "TILING", dict.fromkeys(prefill_gluon.TILING, tiling))
    _check([0, 300, 17, 0], [300, 40, 1, 129], torch.float16, 128, tiles=tiles)


@needs_sm90
@pytest.mark.parametrize(
    "tiling",
    [
        (64, 4, 3, 128),
        (64, 3, 4, 128),
        (128, 2, 3, 128),
        (64, 4, 5, 128),
        (128, 3, 5, 128),
        (64, 4, 6, 128),
        (64, 3, 7, 128),
        (128, 3, 6, 128),
        (64, 4, 8, 128),
    ],
)
@pytest.mark.parametrize("tiles", [False, True])
def test_warps_of_their_own_match_the_oracle(
    tiling: tuple[int, ...], tiles: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Schedules 3 to 8 (prefill_specialized): computing and copying
    # warpgroups, free or taking turns at the tensor cores, in persistent
    # programs (the second batch has more tiles than an H100 or H200 has
    # multiprocessors), copying by the Tensor Memory Accelerator or by
    # cp.async;
    # chunks whose second warpgroup has no rows (decode entries, 40 rows)
    # or fewer tiles.
    monkeypatch.setattr(prefill_gluon, "TILING", dict.fromkeys(prefill_gluon.TILING, tiling))
    _check([0, 300, 17, 0, 1000], [300, 40, 1, 129, 700], torch.float16, 128, tiles=tiles)
    _check([0, 700], [2048, 1500], torch.bfloat16, 64, num_kv_heads=1, tiles=tiles)
    _check([5, 300], [250, 41], torch.float16, 128, tiles=tiles, stale=float("nan"))


@needs_sm90
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize("tiling", [(64, 4, 6, 128), (128, 3, 6, 128), (64, 4, 8, 128)])
def test_pages_copied_by_the_tensor_memory_accelerator_match_the_oracle(
    block_size: int, tiling: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A copy a page (8 to 32 rows), or a tile's part of one (128); each
    # chunk's last tile by cp.async, its rows past the chunk's last key
    # zeroed, so that a NaN a block's earlier owner left past the
    # sequence's end stays out of the products.
    monkeypatch.setattr(prefill_gluon, "TILING", dict.fromkeys(prefill_gluon.TILING, tiling))
    _check([0, 300, 17, 0, 1000], [300, 40, 1, 129, 700], torch.float16, 128, 2, block_size)
    _check([0, 700], [2048, 1500], torch.bfloat16, 64, 1, block_size, tiles=True)
    _check([5, 300], [250, 41], torch.float16, 128, 2, block_size, stale=float("nan"))


def test_the_tensor_memory_accelerator_copies_pages_where_the_cache_allows() -> None:
    """Schedules 6 to 8 take the caches' descriptors where a block's rows
    of a KV head lie a row apart in a ``[num_blocks * block_size,
    num_kv_heads * head_size]`` view and start on a swizzle group;
    elsewhere the copier takes ``cp.async``."""
    cache = torch.zeros(10, 16, 2, 128, dtype=torch.bfloat16)
    descriptors = prefill_gluon._page_descriptors(cache, cache)
    assert descriptors is not None
    assert descriptors[0].shape == [160, 256]
    assert descriptors[0].block_shape == [16, 128]
    wide = torch.zeros(10, 128, 2, 64, dtype=torch.float16)  # a tile's part of a block
    assert prefill_gluon._page_descriptors(wide, wide)[0].block_shape == [  # type: ignore[index]
        prefill_gluon.TILING[64][0],
        64,
    ]
    assert prefill_gluon._page_descriptors(cache[:, :12], cache[:, :12]) is None  # not a row apart
    small = torch.zeros(10, 4, 2, 128, dtype=torch.bfloat16)  # 4 rows: half a swizzle group
    assert prefill_gluon._page_descriptors(small, small) is None
    heads_first = torch.zeros(10, 2, 16, 128, dtype=torch.bfloat16).transpose(1, 2)
    assert prefill_gluon._page_descriptors(heads_first, heads_first) is None
