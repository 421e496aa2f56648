"""The simulated router: the real prefix index and policy, fed with the control plane's lags.

What a real router knows, and when:

- Cache events: a scheduler buffers its executors' pool events and flushes
  them every ``flush_interval_s`` (the Redis prefix mirror); the router's
  follower applies each flush ``index_lag_s`` later. ``buffer`` takes a
  step's events, ``flush`` ships the buffers, ``apply_due`` applies what
  has arrived.
- Load: each scheduler reports its executors' running + waiting sequences
  and free blocks every report interval (``report``); between reports the
  router adds what it placed on each executor since the last one.

``place`` builds a ``Candidate`` for every executor with a live owner, looks
the prompt's block hashes up in the index and in the prompts placed in the
last ``PENDING_TTL_MS`` (as the router does) and takes the policy's first
choice; the three policies run this same code.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from pagedkv.router.index import PrefixIndex, prompt_block_hashes
from pagedkv.router.pending import PendingPrompts, merged
from pagedkv.router.scoring import Candidate, Choice, RoutingPolicy
from pagedkv.scheduler.cache_events import CacheEvent, CacheEventKind


class ReportedLoad(NamedTuple):
    num_queued: int
    kv_usage: float


class SimRouter:
    """Places requests on executors; only its methods change its index and loads."""

    def __init__(
        self,
        policy: RoutingPolicy,
        *,
        incarnation_ids: Sequence[str],
        model_id: str,
        block_size: int,
        index_lag_s: float,
    ) -> None:
        self.policy = policy
        self.index = PrefixIndex()
        self.pending = PendingPrompts()
        self.model_id = model_id
        self.block_size = block_size
        self.index_lag_s = index_lag_s
        self._incarnations = list(incarnation_ids)
        n = len(self._incarnations)
        self._loads = [ReportedLoad(0, 0.0)] * n
        self._placed_since_report = [0] * n
        self._owners: list[str | None] = [None] * n
        self._candidates: dict[int, Candidate] = {}  # by executor, rebuilt when stale
        self._buffers: list[list[CacheEvent]] = [[] for _ in range(n)]
        self._in_flight: deque[tuple[float, int, list[CacheEvent]]] = deque()

    # -- cache events ------------------------------------------------------------------

    def buffer(self, executor: int, events: list[CacheEvent]) -> None:
        """A step's cache events, waiting for its scheduler's next flush."""
        if events:
            self._buffers[executor].extend(events)

    def drop_buffer(self, executor: int) -> None:
        """Its scheduler died: the events it had not flushed are lost."""
        self._buffers[executor] = []

    def flush(self, now: float) -> None:
        """Every scheduler flushes its buffers; the router sees them ``index_lag_s`` later."""
        for executor, events in enumerate(self._buffers):
            if events:
                self._in_flight.append((now + self.index_lag_s, executor, events))
                self._buffers[executor] = []
        self.apply_due(now)

    def apply_due(self, now: float) -> None:
        """Applies the flushes that have reached the router by ``now``, in order."""
        in_flight = self._in_flight
        while in_flight and in_flight[0][0] <= now:
            _, executor, events = in_flight.popleft()
            holder = self._incarnations[executor]
            for event in events:
                if event.group_id:
                    continue
                if event.kind is CacheEventKind.STORED:
                    self.index.add(holder, (event.block_hash,))
                else:
                    self.index.remove(holder, (event.block_hash,))

    def resync(self, executor: int, hashes: Sequence[bytes]) -> None:
        """A new owner mirrors the executor's cache from its index (adoption)."""
        self._buffers[executor] = []
        self._in_flight = deque(f for f in self._in_flight if f[1] != executor)
        self.index.replace(self._incarnations[executor], hashes)

    # -- load and owners ---------------------------------------------------------------

    def set_owner(self, executor: int, owner_id: str | None) -> None:
        self._owners[executor] = owner_id
        self._candidates.pop(executor, None)

    def report(self, executor: int, num_queued: int, kv_usage: float) -> None:
        """Its owner's load report; placements made before it are in it."""
        self._loads[executor] = ReportedLoad(num_queued, kv_usage)
        self._placed_since_report[executor] = 0
        self._candidates.pop(executor, None)

    def _candidate(self, executor: int, owner_id: str) -> Candidate:
        candidate = self._candidates.get(executor)
        if candidate is None:
            load = self._loads[executor]
            candidate = Candidate(
                address=f"executor-{executor:03d}",
                incarnation_id=self._incarnations[executor],
                owner_id=owner_id,
                num_queued=load.num_queued + self._placed_since_report[executor],
                kv_usage=load.kv_usage,
            )
            self._candidates[executor] = candidate
        return candidate

    # -- placement ---------------------------------------------------------------------

    def place(self, token_ids: Sequence[int], now: float) -> tuple[int, Choice]:
        """The executor the policy ranks first for a prompt at ``now``
        (seconds), and its choice."""
        candidates = [
            self._candidate(executor, owner)
            for executor, owner in enumerate(self._owners)
            if owner is not None
        ]
        if not candidates:
            raise RuntimeError("no executor has an owner")
        hashes = prompt_block_hashes(token_ids, self.model_id, self.block_size)
        now_ms = int(now * 1000)
        cached = merged(self.index.match(hashes), self.pending.match(hashes, now_ms))
        choices = self.policy.rank(candidates, cached, len(hashes))
        best = choices[0]
        self.pending.add(best.candidate.incarnation_id, hashes, now_ms)
        executor = int(best.candidate.address.rsplit("-", 1)[1])
        self._placed_since_report[executor] += 1
        self._candidates.pop(executor, None)
        return executor, best
