"""The host tier: KV blocks in host memory, below the device's pool.

A step's ``offload_block_ids`` / ``offload_host_block_ids`` copy device
blocks to host blocks, and its ``load_host_block_ids`` / ``load_block_ids``
copy host blocks back into device blocks, before anything else of the step
(executor.proto). A block here is what copy-on-write copies for a block id:
K and V of every layer of every KV cache group (kv_memory.py).

``HostKVPool`` is such a tier in host memory, behind the executor's
``BlockStore`` interface (block_store.py, with ``move_blocks``). Which host
block holds what is the scheduler's to know: a store keeps no bookkeeping,
and a host block never offloaded holds undefined bytes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from pagedkv.executor.kv_memory import KVMemory
from pagedkv.executor.rows import to_device
from pagedkv.kernels.backend import KernelBackend


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


LOAD_CHUNKS = 8
"""At most this many groups of consecutive layers (chunks) a host row is
split into: a load copies them in turn, and a forward's attention of a layer
waits only for its chunk's copy, so the copy of the later layers overlaps
the forward of the earlier ones (an eager forward at each layer's attention,
a mixed-step graph between its segments: mixed_graphs.py). Each run of
consecutive host ids takes one copy per chunk. On the H200, an eager 8B
host hit with eight chunks finished its 9.7 ms of copies in the first 10 ms
of a 38 ms forward (host-tier-executor-8b-p8-h200), against one chunk's
copy that the whole forward of a graph waited for
(host-tier-executor-8b-p1-h200)."""


class _Chunk(NamedTuple):
    """Consecutive layers of a host row: their caches (each layer's K, then
    V), each cache as ``[num_device_blocks, elements of one block]`` with its
    columns in the chunk's rows, and the chunk's rows in host memory."""

    first_layer: int
    caches: list[torch.Tensor]
    parts: list[tuple[torch.Tensor, slice]]
    host: torch.Tensor  # [num_blocks, elements]: one contiguous run of the pool's memory
    uniform: bool  # every cache of one shape: the backend's one-launch moves apply


class _Pending(NamedTuple):
    """A load not enqueued yet: its host ids (ascending), its blocks, and
    the offload still writing some of those host rows, if any."""

    host_ids: np.ndarray
    block_ids: np.ndarray
    after: torch.cuda.Event | None


class _Landing(NamedTuple):
    """One chunk of a load on its way: scattered into ``block_ids``' blocks
    once the compute stream has waited for ``copied``."""

    chunk: _Chunk
    block_ids: torch.Tensor
    staging: torch.Tensor
    copied: torch.cuda.Event | None


def _chunks(
    kv: KVMemory, num_blocks: int, count: int, pinned: bool
) -> tuple[torch.Tensor, list[_Chunk]]:
    """The pool's memory and its ``count`` (at most) chunks of layers."""
    num_layers = len(kv.key_storage)
    per_chunk = -(-num_layers // max(1, min(count, num_layers)))
    layers = [
        range(first, min(first + per_chunk, num_layers))
        for first in range(0, num_layers, per_chunk)
    ]
    groups = [
        [c for layer in r for c in (kv.key_storage[layer], kv.value_storage[layer])] for r in layers
    ]
    sizes = [sum(cache[0].numel() for cache in caches) for caches in groups]
    memory = torch.empty(num_blocks * sum(sizes), dtype=kv.key_storage[0].dtype, pin_memory=pinned)
    chunks, offset = [], 0
    for r, caches, size in zip(layers, groups, sizes, strict=True):
        parts, column = [], 0
        for cache in caches:
            flat = cache.view(cache.shape[0], -1)
            parts.append((flat, slice(column, column + flat.shape[1])))
            column += flat.shape[1]
        host = memory[offset : offset + num_blocks * size].view(num_blocks, size)
        offset += num_blocks * size
        uniform = len({cache.shape for cache in caches}) == 1
        chunks.append(_Chunk(r.start, caches, parts, host, uniform))
    return memory, chunks


class HostKVPool:
    """``num_blocks`` host blocks over ``kv``'s layers, chunk-major.

    The layers are split into at most ``chunks`` (``LOAD_CHUNKS``) chunks of
    consecutive layers. Host block ``h`` is row ``h`` of every chunk's
    ``[num_blocks, elements]`` region of ``blocks``: its layers' K, then V,
    each ``[block_size, num_kv_heads, head_size]`` of its group (an int8
    block's scales after its values, kv_memory.py). So a chunk
    of a run of consecutive host ids moves in one contiguous copy.

    On CUDA the memory is pinned, and the copies between device and host
    memory run on two streams of the pool's own, beside the compute
    stream's work. An offload gathers the device blocks into a staging
    buffer per chunk (one launch over its layers, the backend's
    ``gather_blocks``) on the compute stream itself, in its order: it reads
    the blocks after every earlier write and before every later one, so
    nothing later waits for it. The offload stream then copies the staging
    rows to host memory without blocking the host. A load (enqueued when
    the compute stream first asks for a chunk, after the step's inputs have
    gone to the device) copies host rows
    into staging, chunk after chunk, on the load stream without waiting for
    the compute stream (staging is fresh memory), after the offloads still
    writing those host rows; an event follows each chunk's copy. The chunk
    lands when the compute stream needs it: ``before_layer`` of its first
    layer (a forward's attention) or ``finish_loads`` makes the compute
    stream wait for that chunk's copy and scatter it into the layers
    (``scatter_blocks``) as its own work. So the copies between host and
    device, the slow part, overlap the forwards already enqueued and the
    layers of the step's own forward before the chunk's, and device blocks
    are read and written only in the compute stream's order. An offload's
    host rows are never read by a load still copying (the offload's copy
    waits for the compute stream, which waited for every earlier load's
    copy by the end of its step). Each copy records an event; finished
    offloads are dropped as later calls look. The host never waits. On the
    CPU the same code runs on plain memory, each copy at once. A call's
    staging holds its n blocks (``n * bytes_per_block`` device bytes) until
    its copy is done. ``copy_seconds`` sums the copies' times (timing
    events around each call's copies between host and device; wall time on
    the CPU).
    """

    def __init__(
        self,
        kv: KVMemory,
        num_blocks: int,
        backend: KernelBackend | None = None,
        chunks: int = LOAD_CHUNKS,
    ) -> None:
        """``backend``: its ``gather_blocks`` / ``scatter_blocks`` move a
        chunk's blocks of its layers in one launch when their caches have
        one shape (else, or without one, an ``index_select`` /
        ``index_copy_`` per layer and K/V)."""
        caches = [*kv.key_storage, *kv.value_storage]  # an int8 block's scales with it
        dtypes = {cache.dtype for cache in caches}
        assert len(dtypes) == 1 and all(c.is_contiguous() for c in caches)
        self.device = caches[0].device
        self.dtype = caches[0].dtype
        self._backend = backend
        cuda = self.device.type == "cuda"
        self.blocks, self._chunks = _chunks(kv, num_blocks, chunks, pinned=cuda)
        self._num_blocks = num_blocks
        self._offload_stream = torch.cuda.Stream(self.device) if cuda else None
        self._load_stream = torch.cuda.Stream(self.device) if cuda else None
        self._offloads: deque[_InFlight] = deque()  # offload calls not known done
        self._pending: deque[_Pending] = deque()  # loads whose copies are not enqueued yet
        self._landing: deque[_Landing] = deque()  # loaded chunks not scattered yet
        self._timed: list[_Timed] = []  # calls whose copy time is not summed yet
        self._seconds = [0.0, 0.0]  # offloads, loads
        self._timing = threading.Lock()  # calls append, a step's completion sums

    @property
    def elements_per_block(self) -> int:
        return sum(int(chunk.host.shape[1]) for chunk in self._chunks)

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    def chunk_starts(self) -> tuple[int, ...]:
        """See ``BlockStore.chunk_starts``."""
        return tuple(chunk.first_layer for chunk in self._chunks)

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
        return self._num_blocks

    @property
    def num_bytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def offload(self, block_ids: np.ndarray, host_ids: np.ndarray) -> None:
        """See ``BlockStore.offload``."""
        if not len(block_ids):
            return
        block_ids, host_ids = _by_host_id(block_ids, host_ids)
        # The gathers run on the compute stream, in its order: they read the
        # blocks after every earlier write and before every later one, so
        # nothing that follows waits for the copy to host memory.
        index = to_device(block_ids, self.device)
        staged = [self._gather(chunk, index) for chunk in self._chunks]
        stream = self._offload_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            for staging in staged:
                staging.record_stream(stream)  # the copies below read it there
        runs = _runs(host_ids)
        with self._timed_on(stream, 0) as copied:
            for chunk, staging in zip(self._chunks, staged, strict=True):
                for i, host_id, n in runs:
                    chunk.host[host_id : host_id + n].copy_(staging[i : i + n], non_blocking=True)
        if copied is not None:
            self._offloads.append(_InFlight(copied, host_ids.copy()))

    def before_writes(self, block_ids: np.ndarray) -> None:
        """See ``BlockStore.before_writes``: nothing to wait for here (an
        offload has read its device blocks on the compute stream)."""

    def load(self, host_ids: np.ndarray, block_ids: np.ndarray) -> None:
        """See ``BlockStore.load``. The copies are enqueued when the compute
        stream first needs a chunk (``before_layer`` or ``finish_loads``):
        by then the step's own small copies to the device (its inputs) are
        enqueued, and they do not queue behind the load's on the device's
        copy engine (on the H200 a graph's inputs waited for a whole 510 MiB
        load that way, and its forward with them)."""
        if not len(block_ids):
            return
        host_ids, block_ids = _by_host_id(host_ids, block_ids, first=True)
        after = None
        if self._load_stream is not None and self._offloads:
            _prune(self._offloads)
            after = _latest(self._offloads, host_ids)  # an offload still writing these rows
        self._pending.append(_Pending(host_ids, block_ids, after))

    def _issue(self) -> None:
        """Enqueues the pending loads' copies, chunk after chunk."""
        stream = self._load_stream
        while self._pending:
            host_ids, block_ids, after = self._pending.popleft()
            index = to_device(block_ids, self.device)
            runs = _runs(host_ids)
            if stream is not None and after is not None:
                stream.wait_event(after)
            with self._timed_on(stream, 1):
                for chunk in self._chunks:
                    staging = torch.empty(
                        (len(host_ids), chunk.host.shape[1]), dtype=self.dtype, device=self.device
                    )
                    for i, host_id, n in runs:
                        staging[i : i + n].copy_(
                            chunk.host[host_id : host_id + n], non_blocking=True
                        )
                    copied = None
                    if stream is not None:
                        copied = torch.cuda.Event()
                        copied.record(stream)
                    self._landing.append(_Landing(chunk, index, staging, copied))

    def before_layer(self, layer: int) -> None:
        """See ``BlockStore.before_layer``."""
        self._issue()
        if not self._landing:
            return
        later: deque[_Landing] = deque()
        for landing in self._landing:  # in the order they were loaded
            if landing.chunk.first_layer <= layer:
                self._land(landing)
            else:
                later.append(landing)
        self._landing = later

    def finish_loads(self) -> None:
        """See ``BlockStore.finish_loads``."""
        self._issue()
        while self._landing:
            self._land(self._landing.popleft())

    def _land(self, landing: _Landing) -> None:
        """The compute stream waits for the chunk's copy and scatters it."""
        chunk, index, staging, copied = landing
        if copied is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(copied)
            staging.record_stream(compute)  # the scatter below reads it there
        if chunk.uniform and self._backend is not None:
            self._backend.scatter_blocks(chunk.caches, index, staging)
            return
        for layer, columns in chunk.parts:
            layer.index_copy_(0, index, staging[:, columns])

    def _gather(self, chunk: _Chunk, index: torch.Tensor) -> torch.Tensor:
        """``[n, elements]``: device blocks ``index``, as ``chunk``'s host rows."""
        staging = torch.empty(
            (len(index), chunk.host.shape[1]), dtype=self.dtype, device=self.device
        )
        if chunk.uniform and self._backend is not None:
            self._backend.gather_blocks(chunk.caches, index, staging)
            return staging
        for layer, columns in chunk.parts:
            torch.index_select(layer, 0, index, out=staging[:, columns])
        return staging
