"""Checks a step's host tier columns (``offload_block_ids`` /
``offload_host_block_ids``, ``load_host_block_ids`` / ``load_block_ids``)
and turns them into the plan's ``offloads`` and ``loads`` (host_kv.py runs
them, before anything else of the step).

The rules (executor.proto): each pair of columns has one length; block ids
are in ``[1, num_blocks)``, host block ids in ``[0, num_host_blocks)``; the
destinations of each pair are distinct (a source may repeat); an executor
without a host tier refuses any host block id. Errors name the field and
index at fault, as the rest of step_plan.py's checks do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from pagedkv.common.errors import InvalidArgument
from pagedkv.common.ids import NULL_BLOCK_ID
from pagedkv.executor.step_entries import first
from pagedkv.executor.step_types import NO_PAIRS, Limits
from pagedkv.v1 import executor_pb2


class Transfers(NamedTuple):
    """A step's host copies, each int64 ``[n, 2]``."""

    offloads: np.ndarray  # (block, host block)
    loads: np.ndarray  # (host block, block)


NO_HOST_COPIES = Transfers(NO_PAIRS, NO_PAIRS)


def has_transfers(step: executor_pb2.StepRequest) -> bool:
    """Whether any host tier column of ``step`` holds a value."""
    return bool(
        step.offload_block_ids
        or step.offload_host_block_ids
        or step.load_host_block_ids
        or step.load_block_ids
    )


def plan_transfers(step: executor_pb2.StepRequest, limits: Limits) -> Transfers:
    """Checks the host tier columns of ``step`` (see the module docstring)."""
    if not has_transfers(step):
        return NO_HOST_COPIES
    for name in ("offload_host_block_ids", "load_host_block_ids"):
        if getattr(step, name) and not limits.num_host_blocks:
            raise InvalidArgument(f"{name}: the executor has no host tier (num_host_blocks 0)")
    offloads = pair_columns(
        ("offload_block_ids", step.offload_block_ids),
        ("offload_host_block_ids", step.offload_host_block_ids),
    )
    loads = pair_columns(
        ("load_host_block_ids", step.load_host_block_ids),
        ("load_block_ids", step.load_block_ids),
    )
    check_block_ids("offload_block_ids", offloads[:, 0], limits)
    _check_host_ids("offload_host_block_ids", offloads[:, 1], limits)
    _check_distinct("offload_host_block_ids", offloads[:, 1])
    _check_host_ids("load_host_block_ids", loads[:, 0], limits)
    check_block_ids("load_block_ids", loads[:, 1], limits)
    _check_distinct("load_block_ids", loads[:, 1])
    return Transfers(offloads, loads)


def pair_columns(src: tuple[str, Sequence[int]], dst: tuple[str, Sequence[int]]) -> np.ndarray:
    """Two (name, ids) columns of one length as int64 ``[n, 2]`` (src, dst);
    InvalidArgument naming the second when the lengths differ. Copies
    (step_plan.py) and the host columns share it."""
    (src_name, src_ids), (dst_name, dst_ids) = src, dst
    if len(src_ids) != len(dst_ids):
        raise InvalidArgument(f"{dst_name}: {len(dst_ids)} ids for {len(src_ids)} {src_name}")
    if not len(src_ids):
        return NO_PAIRS
    return np.stack(
        [np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)], axis=1
    )


def check_block_ids(name: str, block_ids: np.ndarray, limits: Limits) -> None:
    """InvalidArgument naming the first id that is the null block or past the pool."""
    bad = (block_ids == NULL_BLOCK_ID) | (block_ids >= limits.num_blocks)
    if bad.any():
        i = first(bad)
        raise InvalidArgument(
            f"{name}[{i}]: block {block_ids[i]} is the null block or >= num_blocks "
            f"{limits.num_blocks}"
        )


def _check_host_ids(name: str, host_ids: np.ndarray, limits: Limits) -> None:
    bad = host_ids >= limits.num_host_blocks
    if bad.any():
        i = first(bad)
        raise InvalidArgument(
            f"{name}[{i}]: host block {host_ids[i]} >= num_host_blocks {limits.num_host_blocks}"
        )


def _check_distinct(name: str, ids: np.ndarray) -> None:
    """InvalidArgument naming the first id of ``ids`` that repeats an earlier one."""
    values = ids.tolist()
    if len(set(values)) == len(values):
        return
    seen: dict[int, int] = {}
    for i, value in enumerate(values):
        if value in seen:
            raise InvalidArgument(f"{name}[{i}]: {value} repeats {name}[{seen[value]}]")
        seen[value] = i
