"""``pagedkv.bench.kernels.tune``'s decode settings: a switch timed at
several programs per multiprocessor sets a quantized cache's two per-SM
constants alike (its bytes' and its words'), and its grid does too; the
prefill tiles are timed with every combination of the prefill switches."""

from __future__ import annotations

import pytest

from pagedkv.bench.kernels import tune

PER_SM = ("DECODE_FP8_PROGRAMS_PER_SM", "DECODE_WORDS_PROGRAMS_PER_SM")


def test_a_switch_is_timed_off_then_on_at_each_programs_per_sm() -> None:
    settings = tune.decode_settings(True, True, "DECODE_FP8_WORDS", (3, 4))
    assert [(s["DECODE_FP8_WORDS"], s[PER_SM[0]]) for s in settings] == [
        (False, 3),
        (False, 4),
        (True, 3),
        (True, 4),
    ]
    assert all(s[PER_SM[0]] == s[PER_SM[1]] for s in settings)
    float_cache = tune.decode_settings(True, False, "DECODE_PREFETCH", (4,))
    assert float_cache == [
        {"DECODE_PREFETCH": False, "DECODE_PROGRAMS_PER_SM": 4},
        {"DECODE_PREFETCH": True, "DECODE_PROGRAMS_PER_SM": 4},
    ]
    assert tune.decode_settings(True, True, "DECODE_FP8_WORDS") == [
        {"DECODE_FP8_WORDS": False},
        {"DECODE_FP8_WORDS": True},
    ]


def test_the_quantized_grid_sets_both_programs_per_sm() -> None:
    grid = tune.decode_settings(True, True)
    assert grid and all(s[PER_SM[0]] == s[PER_SM[1]] for s in grid)


def test_prefill_tiles_are_timed_with_each_switch_combination() -> None:
    tiles = ((128, 64, 8, 3), (64, 64, 4, 3))
    settings = tune.prefill_settings(tiles, ("PREFILL_PREFETCH", "PREFILL_FUSED_SCALE"))
    assert [tuple(s.values()) for s in settings] == [
        (tile, prefetch, fused)
        for tile in tiles
        for prefetch in (False, True)
        for fused in (False, True)
    ]
    quantized = tune.prefill_settings(tiles[:1], (), "PREFILL_QUANTIZED_TILE")
    assert quantized == [{"PREFILL_QUANTIZED_TILE": tiles[0]}]
    with pytest.raises(ValueError, match="PREFILL_TILE"):
        tune.prefill_settings(tiles, ("PREFILL_TILE",))  # not a boolean
    with pytest.raises(ValueError, match="DECODE_PREFETCH"):
        tune.prefill_settings(tiles, ("DECODE_PREFETCH",))
