"""Copy-on-write copies of one step, split into phases the executor can apply
each at once (destinations distinct, none a source)."""

from __future__ import annotations

from pagedkv.common.ids import BlockId
from pagedkv.scheduler.executor_scheduler import copy_phases
from pagedkv.scheduler.kv_cache_types import BlockCopy


def copies(*pairs: tuple[int, int]) -> list[BlockCopy]:
    return [BlockCopy(BlockId(src), BlockId(dst)) for src, dst in pairs]


def test_independent_copies_stay_in_one_phase() -> None:
    ops = copies((11, 4), (11, 1), (8, 9))
    assert copy_phases(ops) == [ops]


def test_no_copies_is_one_empty_phase() -> None:
    assert copy_phases([]) == [[]]


def test_a_source_later_handed_out_as_a_destination_starts_a_phase() -> None:
    # Block 8 is copied from, freed by a preemption, then given out again as
    # the destination of another copy in the same step.
    ops = copies((11, 4), (8, 9), (11, 1), (11, 8))
    assert copy_phases(ops) == [ops[:3], ops[3:]]


def test_a_destination_that_repeats_or_is_then_copied_from_starts_a_phase() -> None:
    assert copy_phases(copies((1, 3), (2, 3))) == [copies((1, 3)), copies((2, 3))]
    assert copy_phases(copies((1, 3), (3, 5), (6, 7))) == [copies((1, 3)), copies((3, 5), (6, 7))]
