"""Requests in their decode phase, stepped together as columns.

A decode step gives every running request one token. Done one request at a
time in Python, the bookkeeping of that step (a slot for the token, the
sampled token appended, the stop check) costs about a microsecond per request
on a small CPU, although a request needs block work only once per block.
``DecodeBatch`` keeps the per-request counters as numpy columns, finds the
requests whose next token starts a new block with one vector comparison, and
gives all of them their block in one ``KVCacheManager.append_blocks`` call.

Ownership: while a request is in the batch, the batch owns its progress. Its
newest sampled tokens wait in the batch, in a ring of the last
``pending_width`` steps (one contiguous write per step), and are written into
the ``Request`` in one piece: every ``pending_width`` steps for all rows, and
when a request leaves or takes the per-request path.
``request.num_computed_tokens`` is written before every ``KVCacheManager``
call that reads it and when the request leaves. Read a
request only after taking it out (``pop``, ``remove``) or after ``sync``.
Blocks a request fills while in the batch are hashed and entered into the
prefix cache when it is freed (``KVCacheManager.free``), not block by block.

Requests that took part in a fork (copy-on-write) and managers with
sliding-window groups (which release blocks as the window moves) take the
per-request path, ``KVCacheManager.allocate_decode_slots``, every step.

Rows are not kept in admission order (removal moves the last row into the
hole); ``pop`` takes the most recently added request.

Step protocol (synchronous scheduling), for requests whose tokens are all
computed but the last one (a sampled token not yet run):
``allocate()`` → the executor runs the step → ``append(sampled)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from pagedkv.common.ids import BlockId
from pagedkv.scheduler.kv_cache_manager import Allocation, KVCacheManager
from pagedkv.scheduler.request import Request

IntArray = npt.NDArray[np.int64]

_NO_LIMIT = 2**62


class BlockAppends(NamedTuple):
    """Requests whose tables each got one block appended, as parallel lists:
    ``block_ids[k]`` is now entry ``starts[k]`` of ``requests[k]``'s table."""

    requests: list[Request]
    starts: list[int]
    block_ids: list[BlockId]


_NO_APPENDS = BlockAppends([], [], [])


class DecodeBatchAllocation(NamedTuple):
    """What ``DecodeBatch.allocate`` did.

    ``ok``: every row got a slot. ``appends``: the rows that got a block
    appended (the common case). ``updates``: (request, Allocation) for rows
    that took the per-request path and whose tables changed.
    """

    ok: bool
    appends: BlockAppends
    updates: list[tuple[Request, Allocation]]


class DecodeBatch:
    """Up to ``capacity`` decoding requests of one ``KVCacheManager``."""

    def __init__(self, kv: KVCacheManager, capacity: int, pending_width: int = 64) -> None:
        self.kv = kv
        self.capacity = capacity
        self.block_size = kv.block_size
        self.pending_width = pending_width
        self.requests: list[Request] = []
        # Tokens known: the request's array plus the pending ones.
        self.num_tokens: IntArray = np.zeros(capacity, np.int64)
        # Tokens already written into the request's array.
        self.num_synced: IntArray = np.zeros(capacity, np.int64)
        # Tokens the request's block tables have slots for.
        self.num_slots: IntArray = np.zeros(capacity, np.int64)
        # Prompt + max_tokens: the request stops on reaching it.
        self.max_num_tokens: IntArray = np.zeros(capacity, np.int64)
        # Order of admission (for ``pop``).
        self.added_at: IntArray = np.zeros(capacity, np.int64)
        # Rows that take the per-request path (forked requests).
        self.per_request = np.zeros(capacity, np.bool_)
        # The tokens sampled in the last ``pending_width`` steps, by step
        # (ring) and row, as uint32 (the request's own storage type, so they
        # go over as bytes).
        self.history = np.zeros((pending_width, capacity), np.uint32)
        self._num_steps = 0
        self._columns = (
            self.num_tokens,
            self.num_synced,
            self.num_slots,
            self.max_num_tokens,
            self.added_at,
            self.per_request,
        )
        self._num_added = 0
        self._num_per_request = 0
        self._all_per_request = not kv.has_single_full_attention_group
        self._rows = np.arange(capacity)
        self._slots = np.arange(pending_width)

    def __len__(self) -> int:
        return len(self.requests)

    # -- membership --------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Adds a request whose tokens are all computed but the last one.

        Fork a request only while it is out of the batch.
        """
        i = len(self.requests)
        if i == self.capacity:
            raise ValueError(f"the decode batch is full ({self.capacity} requests)")
        num_tokens = request.num_tokens
        if request.num_computed_tokens != num_tokens - 1:
            raise ValueError(f"{request.request_id}: a decoding request has one token to compute")
        self.requests.append(request)
        self.num_tokens[i] = self.num_synced[i] = num_tokens
        self.num_slots[i] = self.kv.num_slots(request.request_id)
        max_tokens = request.max_tokens
        self.max_num_tokens[i] = (
            _NO_LIMIT if max_tokens is None else request.num_prompt_tokens + max_tokens
        )
        self.added_at[i] = self._num_added
        self._num_added += 1
        per_request = self.kv.is_forked(request.request_id)
        self.per_request[i] = per_request
        self._num_per_request += per_request

    def sync(self, i: int) -> Request:
        """Writes row ``i``'s pending tokens and computed count into its request."""
        return self._sync_rows(np.array([i]))[0]

    def _sync_rows(self, rows: IntArray) -> list[Request]:
        requests = self.requests
        num_tokens = self.num_tokens[rows]
        num_pending = (num_tokens - self.num_synced[rows]).tolist()
        width = self.pending_width
        history = b""
        if any(num_pending):
            # Each row's last ``width`` tokens, oldest first, row after row.
            oldest = self._num_steps % width
            steps = (self._slots + oldest) % width  # ring slots, oldest first
            history = self.history[steps[:, None], rows].T.tobytes()
        row_bytes = 4 * width
        synced = []
        end = 0
        for i, count, total in zip(rows.tolist(), num_pending, num_tokens.tolist(), strict=True):
            end += row_bytes
            request = requests[i]
            if count:
                request.extend_output_token_bytes(history[end - 4 * count : end])
            request.num_computed_tokens = total - 1
            synced.append(request)
        self.num_synced[rows] = num_tokens
        return synced

    def pop(self) -> Request:
        """Takes out the most recently added request (the one to preempt), synced."""
        n = len(self.requests)
        if not n:
            raise IndexError("pop from an empty decode batch")
        (request,) = self.remove([int(np.argmax(self.added_at[:n]))])
        return request

    def remove(self, rows: Iterable[int]) -> list[Request]:
        """Takes out the requests at ``rows``, synced, in the order given.

        The last rows move into the holes, so row numbers change.
        """
        given = list(rows)
        if not given:
            return []
        if len(set(given)) != len(given):
            raise ValueError(f"rows: {given} names a row twice")
        removed = dict(zip(given, self._sync_rows(np.array(given, np.int64)), strict=True))
        requests = self.requests
        for i in sorted(removed, reverse=True):
            last = len(requests) - 1
            self._num_per_request -= bool(self.per_request[i])
            if i != last:
                requests[i] = requests[last]
                for column in self._columns:
                    column[i] = column[last]
                self.history[:, i] = self.history[:, last]
            requests.pop()
        return [removed[i] for i in given]

    # -- stepping ----------------------------------------------------------------------

    def allocate(self) -> DecodeBatchAllocation:
        """Gives every row a slot for its next token.

        When a block could not be had (``ok`` is False), some rows were not
        served: preempt (e.g. ``pop``) and call again; rows that got their
        slot are not changed again. Table changes come back columnar for the
        rows that got a block appended, and as ``Allocation`` for rows that
        took the per-request path.
        """
        n = len(self.requests)
        if self._all_per_request:
            return self._allocate_per_request(self._rows[:n])
        needs_block = self.num_tokens[:n] > self.num_slots[:n]
        if self._num_per_request:
            needs_block &= ~self.per_request[:n]
        rows = np.flatnonzero(needs_block)
        appends = _NO_APPENDS
        if len(rows):
            requests = self.requests
            appending = [requests[i] for i in rows.tolist()]
            block_ids = self.kv.append_blocks(appending)
            if block_ids is None:  # short of blocks: request by request, up to the first miss
                return self._allocate_per_request(
                    np.flatnonzero(needs_block | self.per_request[:n])
                )
            starts = (self.num_slots[rows] // self.block_size).tolist()
            self.num_slots[rows] += self.block_size
            appends = BlockAppends(appending, starts, block_ids)
        if self._num_per_request:
            result = self._allocate_per_request(np.flatnonzero(self.per_request[:n]))
            return result._replace(appends=appends)
        return DecodeBatchAllocation(True, appends, [])

    def _allocate_per_request(self, rows: IntArray) -> DecodeBatchAllocation:
        if not len(rows):
            return DecodeBatchAllocation(True, _NO_APPENDS, [])
        synced = self._sync_rows(rows)
        result = self.kv.allocate_decode_slots(synced)
        updates = [(synced[j], allocation) for j, allocation in result.updates]
        if updates:
            changed = rows[[j for j, _ in result.updates]]
            num_slots = self.kv.num_slots
            self.num_slots[changed] = [num_slots(request.request_id) for request, _ in updates]
        return DecodeBatchAllocation(result.num_allocated == len(rows), _NO_APPENDS, updates)

    def append(self, sampled_token_ids: npt.ArrayLike) -> list[int]:
        """Appends one sampled token to every row; returns the rows that reached max_tokens."""
        n = len(self.requests)
        sampled = np.asarray(sampled_token_ids)
        if sampled.shape != (n,):
            raise ValueError(f"sampled_token_ids: {sampled.shape} for {n} rows")
        width = self.pending_width
        self.history[self._num_steps % width, :n] = sampled
        self._num_steps += 1
        num_tokens = self.num_tokens[:n]
        num_tokens += 1
        if not self._num_steps % width:  # the ring is full: the oldest slot is next
            self._sync_rows(self._rows[:n])
        done: list[int] = np.flatnonzero(num_tokens >= self.max_num_tokens[:n]).tolist()
        return done
