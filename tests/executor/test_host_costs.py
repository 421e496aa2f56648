"""How the executor splits a host-tier load's measured time into a fixed cost
and a cost per block (``host_costs.split_load_cost``)."""

from __future__ import annotations

import pytest

from pagedkv.executor.host_costs import split_load_cost


def test_the_larger_load_s_extra_time_is_the_blocks_cost() -> None:
    fixed, per_block = split_load_cost(one=1.0e-3, many=1.0e-3 + 9 * 2.0e-4, count=10)
    assert per_block == pytest.approx(2.0e-4)
    assert fixed == pytest.approx(0.8e-3)


def test_a_block_never_costs_nothing_when_noise_hides_its_cost() -> None:
    # The larger load measured no longer than the one-block load (a busy
    # host, small blocks): its whole time goes to its blocks.
    for many in (5.0e-4, 4.0e-4):
        fixed, per_block = split_load_cost(one=5.0e-4, many=many, count=11)
        assert per_block == pytest.approx(many / 11) and per_block > 0
        assert fixed == pytest.approx(5.0e-4 - many / 11)


def test_one_block_is_all_per_block() -> None:
    assert split_load_cost(one=3.0e-4, many=3.0e-4, count=1) == (0.0, 3.0e-4)
