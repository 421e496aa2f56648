"""``pagedkv.bench.kernels.tune``'s decode settings: a switch timed at
several programs per multiprocessor sets a quantized cache's two per-SM
constants alike (its bytes' and its words'), and its grid does too."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

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
