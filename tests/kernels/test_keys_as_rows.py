"""Decode with the keys as the rows of both dots
(``decode_attention.DECODE_FP8_KEYS_AS_ROWS``, ``attend_rows``) over fp8
and int8 caches read as words: attention matches the oracle with a window,
a soft-cap, the block table read ahead or not, and in the fused rotary
decode (which writes the new token first). On a GPU the dots run on
``wgmma``; under TRITON_INTERPRET=1 on the interpreter's."""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels import decode_attention
from tests.kernels import test_fp8_cache_kernels as fp8_cases
from tests.kernels import test_int8_cache_kernels as int8_cases


@pytest.fixture(autouse=True)
def _keys_as_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_attention, "DECODE_FP8_WORDS", True)
    monkeypatch.setattr(decode_attention, "DECODE_INT8_WORDS", True)
    monkeypatch.setattr(decode_attention, "DECODE_FP8_KEYS_AS_ROWS", True)


@pytest.mark.parametrize("fp8", fp8_cases.FORMATS, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (7, None), (None, 5.0)])
@pytest.mark.parametrize("prefetch", [True, False], ids=["read-ahead", "plain"])
def test_decode_with_the_keys_as_rows_matches_the_oracle(
    fp8: torch.dtype,
    sliding_window: int | None,
    softcap: float | None,
    prefetch: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decode_attention, "DECODE_FP8_PREFETCH", prefetch)
    fp8_cases.check_attention(
        fp8_cases.DECODES, fp8, True, sliding_window, softcap, (fp8_cases.paged_attention,)
    )


def test_int8_decode_with_the_keys_as_rows_matches_the_oracle() -> None:
    int8_cases.check_attention(int8_cases.DECODES, 7, None, (int8_cases.paged_attention,))
    int8_cases.check_attention(int8_cases.DECODES, None, 5.0, (int8_cases.paged_attention,))


@pytest.mark.parametrize("fp8", fp8_cases.FORMATS, ids=lambda d: str(d).split(".")[-1])
def test_the_fused_rotary_decode_with_the_keys_as_rows_writes_and_reads(fp8: torch.dtype) -> None:
    fp8_cases.test_fused_rotary_decode_writes_and_reads_an_fp8_cache(fp8, True)
