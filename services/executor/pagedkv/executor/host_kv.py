"""The host tier: KV blocks in host memory, below the device's pool.

A step's ``offload_block_ids`` / ``offload_host_block_ids`` copy device
blocks to host blocks, and its ``load_host_block_ids`` / ``load_block_ids``
copy host blocks back into device blocks, before anything else of the step
(executor.proto). A block here is what copy-on-write copies for a block id:
K and V of every layer of every KV cache group (kv_memory.py).

``BlockStore`` is what the executor needs of such a tier, so that a disk
tier or a transfer engine can stand in for ``HostKVPool`` later. Which host
block holds what is the scheduler's to know: a store keeps no bookkeeping,
and a host block never offloaded holds undefined bytes.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple, Protocol

import numpy as np
import torch

from pagedkv.executor.kv_memory import KVMemory
from pagedkv.executor.rows import to_device
from pagedkv.kernels.backend import KernelBackend


class BlockStore(Protocol):
    """A second KV tier: ``num_blocks`` blocks, ids ``0 .. num_blocks - 1``
    (no null block), each the bytes of one device block id."""

    @property
    def num_blocks(self) -> int: ...

    def offload(self, block_ids: np.ndarray, host_ids: np.ndarray) -> None:
        """Copies device block ``block_ids[i]`` into store block
        ``host_ids[i]`` (int64 arrays of one length; ``host_ids`` distinct).
        Reads the device blocks after every earlier device write; later
        device work does not wait for it, except, for a store that reads
        them later, a write into one of those blocks (see
        ``before_writes``). Mutates only the store blocks."""
        ...

    def before_writes(self, block_ids: np.ndarray) -> None:
        """Call before enqueuing device work that writes into ``block_ids``:
        that work then waits for any offload still reading them."""
        ...

    def load(self, host_ids: np.ndarray, block_ids: np.ndarray) -> None:
        """Copies store block ``host_ids[i]`` into device block
        ``block_ids[i]`` (``block_ids`` distinct), after every earlier
        offload that writes those store blocks or reads those device blocks,
        and before any later device work; mutates only those device
        blocks."""
        ...

    def copy_seconds(self) -> tuple[float, float]:
        """Time spent copying so far, offloads then loads, in seconds, over
        the calls known finished (device time on a GPU)."""
        ...


class HostTierTooSmall(ValueError):
    """``host_kv_gib`` holds no block: a startup error."""


def num_host_blocks(gib: float, bytes_per_block: int) -> int:
    """Host blocks in ``gib`` GiB; HostTierTooSmall when ``gib`` > 0 holds none."""
    num_blocks = math.floor(gib * 2**30 / bytes_per_block)
    if gib > 0 and num_blocks < 1:
        raise HostTierTooSmall(
            f"host_kv_gib: {gib} GiB holds no KV block of {bytes_per_block} bytes"
        )
    return num_blocks


def move_blocks(
    store: BlockStore | None, offloads: np.ndarray, loads: np.ndarray, *written: np.ndarray
) -> None:
    """A step's host copies: every offload (``[n, 2]``: block, host block),
    then every load (``[m, 2]``: host block, block), so a load reads what
    the step's offloads left; ``written``: the other blocks the step writes
    into (its table updates' blocks, its copies' destinations), whose
    pending offloads its device work waits for. No store: the host columns
    are empty (validated)."""
    if store is None:
        return
    if len(offloads):
        store.offload(offloads[:, 0], offloads[:, 1])
    if len(loads):
        store.load(loads[:, 0], loads[:, 1])
    for blocks in written:
        if len(blocks):
            store.before_writes(blocks)


def _by_host_id(a: np.ndarray, b: np.ndarray, first: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The pairs ``(a[i], b[i])`` ordered by their host block id (``a``'s
    with ``first``, else ``b``'s), so that host blocks given in any order (a
    request's tail block is evicted, and offloaded, first) still move in one
    copy per run of consecutive ids."""
    host_ids = a if first else b
    if len(host_ids) < 2 or bool((np.diff(host_ids) > 0).all()):
        return a, b
    order = np.argsort(host_ids, kind="stable")
    return a[order], b[order]


def _runs(host_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Runs of consecutive host ids: (first index, first host id, length)."""
    breaks = np.flatnonzero(np.diff(host_ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(host_ids)]])
    return [(int(s), int(host_ids[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


class _InFlight(NamedTuple):
    """One offload's copy to host memory: done when ``event`` is."""

    event: torch.cuda.Event
    host_ids: np.ndarray


def _latest(calls: deque[_InFlight], host_ids: np.ndarray) -> torch.cuda.Event | None:
    """The event of the last call in ``calls`` that writes any of
    ``host_ids``; on one stream, it being done means every earlier call is."""
    for call in reversed(calls):
        if np.isin(call.host_ids, host_ids).any():
            event: torch.cuda.Event = call.event
            return event
    return None


class _Timed(NamedTuple):
    """One call's copy between two timing events: 0 an offload, 1 a load."""

    kind: int
    start: torch.cuda.Event
    end: torch.cuda.Event


def _prune(calls: deque[_InFlight]) -> None:
    while calls and calls[0].event.query():
        calls.popleft()


class HostKVPool:
    """``num_blocks`` host blocks over ``kv``'s layers, block-major.

    ``blocks`` is ``[num_blocks, elements_per_block]`` of the KV dtype; a
    row is one block id's bytes, layer after layer, K then V, each
    ``[block_size, num_kv_heads, head_size]`` of its group, so a block moves
    in one contiguous copy (and a run of consecutive host ids in one).

    On CUDA the rows are pinned, and the copies between device and host
    memory run on two streams of the pool's own, beside the compute
    stream's work. An offload gathers the device blocks into a staging
    buffer (one launch over every layer, the backend's ``gather_blocks``)
    on the compute stream itself, in its order: it reads the blocks after every earlier write and
    before every later one, so nothing later waits for it. The offload
    stream then copies the staging rows to host memory without blocking the
    host. A load copies host rows into a staging buffer on the load stream
    without waiting for the compute stream (staging is fresh memory), after
    the offloads still writing those host rows; the compute stream waits
    for that copy and scatters the rows into the layers (``scatter_blocks``)
    as its own work. So both copies between host and device, the slow
    part, overlap the forwards already enqueued, and device blocks are read
    and written only in the compute stream's order. An offload's host rows
    are never read by a load still copying (the offload's copy waits for
    the compute stream, which waited for every earlier load's copy). Each
    copy records an event; finished offloads are dropped as later calls
    look. The host never waits. On the CPU the same code runs synchronously
    on plain memory. A call's staging holds its n blocks (``n *
    bytes_per_block`` device bytes) until its copy is done.
    ``copy_seconds`` sums the copies' times (timing events around each
    copy between host and device; wall time on the CPU).
    """

    def __init__(self, kv: KVMemory, num_blocks: int, backend: KernelBackend | None = None) -> None:
        """``backend``: its ``gather_blocks`` / ``scatter_blocks`` move a
        call's blocks of every layer in one launch when all layers' caches
        have one shape (else, or without one, an ``index_select`` /
        ``index_copy_`` per layer and K/V)."""
        caches = [c for pair in zip(kv.key_caches, kv.value_caches, strict=True) for c in pair]
        dtypes = {cache.dtype for cache in caches}
        assert len(dtypes) == 1 and all(c.is_contiguous() for c in caches)
        self.device = caches[0].device
        self.dtype = caches[0].dtype
        uniform = len({cache.shape for cache in caches}) == 1
        self._caches = caches
        self._backend = backend if uniform else None
        # Each layer's K, then V, as [num_device_blocks, elements of one
        # block], and its columns in a host row.
        self._parts: list[tuple[torch.Tensor, slice]] = []
        start = 0
        for cache in caches:
            layer = cache.view(cache.shape[0], -1)
            self._parts.append((layer, slice(start, start + layer.shape[1])))
            start += layer.shape[1]
        self.elements_per_block = start
        cuda = self.device.type == "cuda"
        self.blocks = torch.empty(
            (num_blocks, self.elements_per_block), dtype=self.dtype, pin_memory=cuda
        )
        self._offload_stream = torch.cuda.Stream(self.device) if cuda else None
        self._load_stream = torch.cuda.Stream(self.device) if cuda else None
        self._offloads: deque[_InFlight] = deque()  # offload calls not known done
        self._timed: list[_Timed] = []  # calls whose copy time is not summed yet
        self._seconds = [0.0, 0.0]  # offloads, loads
        self._timing = threading.Lock()  # calls append, a step's completion sums

    def copy_seconds(self) -> tuple[float, float]:
        """See ``BlockStore.copy_seconds``."""
        with self._timing:
            pending = []
            for call in self._timed:
                if call.end.query():
                    self._seconds[call.kind] += call.start.elapsed_time(call.end) * 1e-3
                else:
                    pending.append(call)
            self._timed = pending
            return self._seconds[0], self._seconds[1]

    @contextlib.contextmanager
    def _timed_on(
        self, stream: torch.cuda.Stream | None, kind: int
    ) -> Iterator[torch.cuda.Event | None]:
        """Times the body's copies on ``stream`` (a timing event before and
        the one yielded, recorded after); on the CPU, its wall time."""
        if stream is None:
            began = time.perf_counter()
            yield None
            with self._timing:
                self._seconds[kind] += time.perf_counter() - began
            return
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        with torch.cuda.stream(stream):
            yield end
        end.record(stream)
        with self._timing:
            self._timed.append(_Timed(kind, start, end))

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def num_bytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def offload(self, block_ids: np.ndarray, host_ids: np.ndarray) -> None:
        """See ``BlockStore.offload``."""
        if not len(block_ids):
            return
        block_ids, host_ids = _by_host_id(block_ids, host_ids)
        # The gather runs on the compute stream, in its order: it reads the
        # blocks after every earlier write and before every later one, so
        # nothing that follows waits for the copy to host memory.
        staging = self._gather(to_device(block_ids, self.device))
        stream = self._offload_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            staging.record_stream(stream)  # the copy below reads it there
        with self._timed_on(stream, 0) as copied:
            for i, host_id, n in _runs(host_ids):
                self.blocks[host_id : host_id + n].copy_(staging[i : i + n], non_blocking=True)
        if copied is not None:
            self._offloads.append(_InFlight(copied, host_ids.copy()))

    def before_writes(self, block_ids: np.ndarray) -> None:
        """See ``BlockStore.before_writes``: nothing to wait for here (an
        offload has read its device blocks on the compute stream)."""

    def load(self, host_ids: np.ndarray, block_ids: np.ndarray) -> None:
        """See ``BlockStore.load``."""
        if not len(block_ids):
            return
        host_ids, block_ids = _by_host_id(host_ids, block_ids, first=True)
        index = to_device(block_ids, self.device)
        stream = self._load_stream
        if stream is None:
            with self._timed_on(None, 1):
                self._scatter(index, self._rows(host_ids))
            return
        if self._offloads:
            _prune(self._offloads)
            event = _latest(self._offloads, host_ids)
            if event is not None:  # an offload still writes some of these host rows
                stream.wait_event(event)
        with self._timed_on(stream, 1) as copied:
            staging = self._rows(host_ids)
        assert copied is not None
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(copied)
        staging.record_stream(compute)  # the scatter below reads it there
        self._scatter(index, staging)

    def _rows(self, host_ids: np.ndarray) -> torch.Tensor:
        """``[n, elements_per_block]`` on the device: host rows ``host_ids``
        (ascending), copied without blocking the host."""
        staging = torch.empty(
            (len(host_ids), self.elements_per_block), dtype=self.dtype, device=self.device
        )
        for i, host_id, n in _runs(host_ids):
            staging[i : i + n].copy_(self.blocks[host_id : host_id + n], non_blocking=True)
        return staging

    def _gather(self, index: torch.Tensor) -> torch.Tensor:
        """``[n, elements_per_block]``: device blocks ``index``, as host rows."""
        staging = torch.empty(
            (len(index), self.elements_per_block), dtype=self.dtype, device=self.device
        )
        if self._backend is not None:
            self._backend.gather_blocks(self._caches, index, staging)
            return staging
        for layer, columns in self._parts:
            torch.index_select(layer, 0, index, out=staging[:, columns])
        return staging

    def _scatter(self, index: torch.Tensor, staging: torch.Tensor) -> None:
        """Writes row i of ``staging`` into device block ``index[i]``."""
        if self._backend is not None:
            self._backend.scatter_blocks(self._caches, index, staging)
            return
        for layer, columns in self._parts:
            layer.index_copy_(0, index, staging[:, columns])
