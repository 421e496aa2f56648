"""Requests in their decode phase, stepped together as columns.

A decode step gives every running request one token. Done one request at a
time in Python, the bookkeeping of that step (a slot for the token, the
sampled token appended, the stop check) costs about a microsecond per request
on a small CPU, although a request needs block work only once per block.
``DecodeBatch`` keeps the per-request counters as numpy columns, finds the
requests whose next token starts a new block with one vector comparison, and
gives all of them their block in one ``KVCacheManager.append_blocks`` call.

Ownership: while a request is in the batch, the batch owns its progress. Its
newest sampled tokens wait in the batch (up to ``pending_width`` of them) and
are written into the ``Request`` in one piece when that many have gathered or
when it leaves; ``request.num_computed_tokens`` is written before every
``KVCacheManager`` call that reads it and when the request leaves. Read a
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

import numpy as np
import numpy.typing as npt

from pagedkv.scheduler.kv_cache_manager import Allocation, KVCacheManager, TableUpdate
from pagedkv.scheduler.request import Request

IntArray = npt.NDArray[np.int64]

_NO_LIMIT = 2**62


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
        # Sampled tokens not yet written into the request, as uint32 (the
        # request's own storage type, so they go over as bytes).
        self.pending = np.zeros((capacity, pending_width), np.uint32)
        self._columns = (
            self.num_tokens,
            self.num_synced,
            self.num_slots,
            self.max_num_tokens,
            self.added_at,
            self.per_request,
            self.pending,
        )
        self._num_added = 0
        self._num_per_request = 0
        self._all_per_request = not kv.has_single_full_attention_group
        self._rows = np.arange(capacity)

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
        pending = self.pending[rows].tobytes()
        row_bytes = 4 * self.pending_width
        synced = []
        offset = 0
        for i, count, total in zip(rows.tolist(), num_pending, num_tokens.tolist(), strict=True):
            request = requests[i]
            if count:
                request.extend_output_token_bytes(pending[offset : offset + 4 * count])
            request.num_computed_tokens = total - 1
            synced.append(request)
            offset += row_bytes
        self.num_synced[rows] = num_tokens
        return synced

    def pop(self) -> Request:
        """Takes out the most recently added request (the one to preempt), synced."""
        n = len(self.requests)
        (request,) = self.remove([int(np.argmax(self.added_at[:n]))])
        return request

    def remove(self, rows: Iterable[int]) -> list[Request]:
        """Takes out the requests at ``rows``, synced, in the order given.

        The last rows move into the holes, so row numbers change.
        """
        rows = sorted(rows, reverse=True)
        if not rows:
            return []
        removed = dict(zip(rows, self._sync_rows(np.array(rows, np.int64)), strict=True))
        requests = self.requests
        for i in rows:
            last = len(requests) - 1
            self._num_per_request -= bool(self.per_request[i])
            if i != last:
                requests[i] = requests[last]
                for column in self._columns:
                    column[i] = column[last]
            requests.pop()
        return [removed[i] for i in rows]

    # -- stepping ----------------------------------------------------------------------

    def allocate(self) -> tuple[bool, list[tuple[Request, Allocation]]]:
        """Gives every row a slot for its next token.

        Returns (whether every row got one; (request, Allocation) for the
        requests whose tables changed). When a block could not be had, some
        rows were not served: preempt (e.g. ``pop``) and call again; rows that
        got their slot are not changed again.
        """
        n = len(self.requests)
        if self._all_per_request:
            return self._allocate_per_request(self._rows[:n])
        needs_block = self.num_tokens[:n] > self.num_slots[:n]
        if self._num_per_request:
            needs_block &= ~self.per_request[:n]
        rows = np.flatnonzero(needs_block)
        updates: list[tuple[Request, Allocation]] = []
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
            updates = [
                (request, Allocation((TableUpdate(start, (block_id,)),)))
                for request, start, block_id in zip(appending, starts, block_ids, strict=True)
            ]
        if self._num_per_request:
            ok, more = self._allocate_per_request(np.flatnonzero(self.per_request[:n]))
            return ok, updates + more
        return True, updates

    def _allocate_per_request(
        self, rows: IntArray
    ) -> tuple[bool, list[tuple[Request, Allocation]]]:
        if not len(rows):
            return True, []
        synced = self._sync_rows(rows)
        result = self.kv.allocate_decode_slots(synced)
        updates = [(synced[j], allocation) for j, allocation in result.updates]
        if updates:
            changed = rows[[j for j, _ in result.updates]]
            num_slots = self.kv.num_slots
            self.num_slots[changed] = [num_slots(request.request_id) for request, _ in updates]
        return result.num_allocated == len(rows), updates

    def append(self, sampled_token_ids: npt.ArrayLike) -> list[int]:
        """Appends one sampled token to every row; returns the rows that reached max_tokens."""
        n = len(self.requests)
        sampled = np.asarray(sampled_token_ids)
        if sampled.shape != (n,):
            raise ValueError(f"sampled_token_ids: {sampled.shape} for {n} rows")
        num_tokens = self.num_tokens[:n]
        num_pending = num_tokens - self.num_synced[:n]
        self.pending[self._rows[:n], num_pending] = sampled
        num_tokens += 1
        full = np.flatnonzero(num_pending == self.pending_width - 1)
        if len(full):
            self._sync_rows(full)
        done: list[int] = np.flatnonzero(num_tokens >= self.max_num_tokens[:n]).tolist()
        return done
