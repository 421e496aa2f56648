"""Quantized tiles read as 32-bit words (``decode_attention.DECODE_FP8_WORDS``
and ``DECODE_INT8_WORDS``, ``tiles.load_words``): every byte widens to the
float16 ``tiles.widen`` gives it, in its own place, and decode over fp8
and int8 caches read this way matches the oracle and, on a GPU, the byte
reads bit for bit. Under
TRITON_INTERPRET=1 the words are widened by Triton's ops (``WORDS_OPS``),
on a GPU in inline PTX (``WORDS_PTX``)."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from pagedkv.kernels import decode_attention, fp8_kv, paged_attention, tiles
from tests.kernels.test_fp8_cache_kernels import check_attention
from tests.kernels.test_int8_cache_kernels import DECODES, NAMES, Int8Cache
from tests.kernels.test_int8_cache_kernels import check_attention as check_int8_attention
from tests.kernels.test_reference import build_batch
from tests.kernels.test_triton_kernels import DEVICE

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
FORMATS = list(fp8_kv.KV_CACHE_DTYPES.values())
WORDS = tiles.WORDS_OPS if INTERPRETED else tiles.WORDS_PTX


@triton.jit
def _words_kernel(in_ptr, out_ptr, WORDS: tl.constexpr):
    # 64 words of 4 bytes: [16, 4] words widened to [16, 4, 2, 2] values,
    # stored where byte j of word w sits (4 w + j of its row).
    rows = tl.arange(0, 16)[:, None] * 4 + tl.arange(0, 4)[None, :]
    packed = tl.load(in_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + rows)
    values = tiles.widen_words(packed, in_ptr.dtype.element_ty, WORDS)
    at = rows[:, :, None, None] * 4 + tl.arange(0, 2)[:, None] * 2 + tl.arange(0, 2)[None, :]
    tl.store(out_ptr + at, values)


@pytest.mark.parametrize("dtype", [*FORMATS, torch.int8], ids=lambda d: str(d).split(".")[-1])
def test_words_widen_every_byte_to_its_value_in_its_place(dtype: torch.dtype) -> None:
    byte_values = torch.randperm(256, generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    cache = byte_values.view(dtype).to(DEVICE)
    if dtype != torch.int8:  # NaNs (e4m3's 0x7f and 0xff, e5m2's) never reach a cache
        finite = torch.isfinite(cache.float())
        cache = torch.where(finite, cache.float(), 0.0).to(dtype)
    out = torch.empty(256, dtype=torch.float16, device=DEVICE)
    _words_kernel[(1,)](cache, out, WORDS=WORDS)
    assert torch.equal(out.cpu(), cache.cpu().to(torch.float16))


@pytest.mark.parametrize("fp8", FORMATS, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (7, None), (None, 5.0)])
@pytest.mark.parametrize("prefetch", [True, False], ids=["read-ahead", "plain"])
def test_decode_reading_fp8_words_matches_the_oracle(
    fp8: torch.dtype,
    sliding_window: int | None,
    softcap: float | None,
    prefetch: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decode_attention, "DECODE_FP8_WORDS", True)
    monkeypatch.setattr(decode_attention, "DECODE_FP8_PREFETCH", prefetch)
    check_attention(DECODES, fp8, True, sliding_window, softcap, (paged_attention,))


@pytest.mark.parametrize("prefetch", [True, False], ids=["read-ahead", "plain"])
def test_decode_reading_int8_words_matches_the_oracle(
    prefetch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode_attention, "DECODE_INT8_WORDS", True)
    monkeypatch.setattr(decode_attention, "DECODE_FP8_PREFETCH", prefetch)
    check_int8_attention(DECODES, 7, None, (paged_attention,))
    check_int8_attention(DECODES, None, 5.0, (paged_attention,))


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs no PTX")
@pytest.mark.parametrize("dtype", [*FORMATS, torch.int8], ids=lambda d: str(d).split(".")[-1])
def test_word_reads_attend_bit_for_bit_as_byte_reads_do(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both reads give every value exactly, so decode's outputs must not
    # differ by a bit (int8's K tiles are read as words too).
    batch = build_batch(*DECODES, num_q_heads=4, num_kv_heads=2, dtype=torch.float16)
    keys, values = batch["key_cache"], batch["value_cache"]
    assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)
    if dtype == torch.int8:
        cache = Int8Cache.holding(keys.to(DEVICE), values.to(DEVICE), DEVICE)
        caches, scales = cache.caches, cache.scales
    else:
        scale = torch.full((1,), 1 / 64, device=DEVICE)
        caches = [fp8_kv.quantize(t.to(DEVICE), scale, dtype) for t in (keys, values)]
        scales = {"k_scale": scale, "v_scale": scale}
    on = [batch[name].to(DEVICE) for name in NAMES]  # type: ignore[union-attr]
    outputs = []
    for words in (False, True):
        monkeypatch.setattr(decode_attention, "DECODE_FP8_WORDS", words)
        monkeypatch.setattr(decode_attention, "DECODE_INT8_WORDS", words)
        outputs.append(
            paged_attention.paged_attention(on[0], *caches, *on[1:], scale=0.125, **scales)
        )
    assert torch.equal(*outputs)
