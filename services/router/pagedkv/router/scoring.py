"""Routing policies: which executor a request should run on.

A policy ranks the candidate executors (those with a live lease holder that
admits requests) for one request, best first; the router tries them in that
order. Three policies, swappable by type (``POLICIES``):

- ``KVAwarePolicy`` (``kv``, the default) keeps every executor under a
  load bound, and among those under it scores each by the share of the
  prompt's full blocks its prefix cache holds, minus its load relative to
  the cluster's mean, minus its KV usage::

      mean  = (sum(queued) + 1) / num_executors      # with this request
      bound = ceil(max(load_bound * mean, mean + load_slack))
      score = w_prefix * (cached_blocks + w_host * host_blocks) / prompt_blocks
            - w_load * queued / (mean_queued + 1)
            - w_kv * kv_usage

  ``host_blocks`` are the prompt blocks past the GPU's leading run that the
  executor's host tier holds (its own leading run of the prompt, less the
  GPU's; docs/memory.md): a host hit is loaded over
  PCIe rather than computed, so it counts ``w_host`` of a GPU hit (default
  0.89: on the H200, 8B shape, a 4,096-token prompt's first token took 95.3
  ms recomputed, 18.2 ms from a GPU hit and 26.7 ms from a host hit, and
  (95.3 - 26.7) / (95.3 - 18.2) = 0.89; host-tier-executor-8b-2-h200).

  ``queued`` is the executor's running plus waiting sequences (the last load
  report, plus what this router placed there since). An executor that would
  pass the bound with this request (``queued + 1 > bound``) is ranked after
  every executor under it, however much of the prompt it caches: this is
  what spreads a hot prefix (bounded loads, as in consistent hashing with
  bounded loads). The bound is relative to the mean, so it holds for 4
  executors or 64, idle or busy; with the default 1.5 the hottest executor
  runs at most about 1.5 times the mean. The slack (default 4 sequences)
  is for small loads: there, one more sequence in a batch costs an
  executor next to nothing, while 1.5 times a mean of 2 would already
  send a prefix's second request elsewhere and compute it again. Under the
  bound the cache wins:
  with ``w_prefix = 1`` and ``w_load = 0.5`` an executor holding the whole
  prompt beats an idle one until it runs about twice the mean above it,
  which is past the bound, so the load term only orders executors that
  hold equal shares (usually none). A prefix computed once is worth more
  than a slightly shorter queue: on a GPU a prompt block's prefill costs
  far more than the marginal decode work of one more sequence in a batch.
- ``RoundRobinPolicy`` (``round-robin``) and ``LeastLoadedPolicy``
  (``least-loaded``, fewest queued then lowest KV usage) ignore the cache:
  they are the baselines of the routing benchmarks.

Ties go round robin (a counter rotates the order of equal candidates), so
identical requests on an idle cluster do not all land on the first address.
Pure and synchronous: the cluster simulation drives the same code.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class Candidate:
    """An executor a request can be sent to, with the load inputs of its score."""

    address: str
    incarnation_id: str
    owner_id: str  # the scheduler member holding its lease
    num_queued: float  # running + waiting sequences (report + own placements since)
    kv_usage: float  # fraction of usable blocks in use, 0.0 to 1.0


@dataclass(frozen=True, slots=True)
class RoutingWeights:
    """The ``kv`` policy's weights (see the module docstring)."""

    prefix: float = 1.0
    load: float = 0.5
    kv_usage: float = 0.5
    load_bound: float = 1.5  # times the mean queued, after this request
    load_slack: float = 4.0  # sequences above that mean, for small loads
    host: float = 0.89  # a host-tier hit, as a share of a GPU hit's worth

    def __post_init__(self) -> None:
        if not 0.0 <= self.host <= 1.0:
            raise ValueError(f"weight host: {self.host} must be in [0, 1]")
        for name in ("prefix", "load", "kv_usage"):
            value = getattr(self, name)
            if not value >= 0.0:
                raise ValueError(f"weight {name}: {value} must be >= 0")
        if not self.load_bound >= 1.0:
            raise ValueError(f"load bound: {self.load_bound} must be >= 1")
        if not self.load_slack >= 0.0:
            raise ValueError(f"load slack: {self.load_slack} must be >= 0")


class Choice(NamedTuple):
    """One ranked candidate: the prompt blocks it holds and its score (policies
    without a score rank by their own order; their score is minus the rank).
    ``over_bound``: the kv policy ranked it last for its load."""

    candidate: Candidate
    cached_blocks: int
    score: float
    over_bound: bool = False


class RoutingPolicy(ABC):
    """Ranks candidates for one request, best first."""

    name: str

    def __init__(self) -> None:
        self._turn = itertools.count()

    def _rotation(self, candidates: Sequence[Candidate]) -> dict[str, int]:
        """Each candidate's place in this call's round-robin order."""
        turn = next(self._turn)
        ordered = sorted(c.address for c in candidates)
        n = len(ordered) or 1
        return {address: (i - turn) % n for i, address in enumerate(ordered)}

    @abstractmethod
    def rank(
        self,
        candidates: Sequence[Candidate],
        cached_blocks: Mapping[str, int],
        num_prompt_blocks: int,
        host_blocks: Mapping[str, int] | None = None,
    ) -> list[Choice]:
        """``candidates`` best first. ``cached_blocks``: leading prompt blocks
        each incarnation holds (absent: none); ``num_prompt_blocks``: the
        prompt's full blocks; ``host_blocks``: the blocks after those that
        each incarnation's host tier holds (absent: none)."""


class KVAwarePolicy(RoutingPolicy):
    name = "kv"

    def __init__(self, weights: RoutingWeights | None = None) -> None:
        super().__init__()
        self.weights = weights or RoutingWeights()

    def rank(
        self,
        candidates: Sequence[Candidate],
        cached_blocks: Mapping[str, int],
        num_prompt_blocks: int,
        host_blocks: Mapping[str, int] | None = None,
    ) -> list[Choice]:
        if not candidates:
            return []
        on_host = host_blocks or {}
        w = self.weights
        total = sum(c.num_queued for c in candidates)
        mean = total / len(candidates)
        after = (total + 1.0) / len(candidates)
        bound = math.ceil(max(w.load_bound * after, after + w.load_slack) - 1e-9)
        rotation = self._rotation(candidates)
        choices = []
        for c in candidates:
            cached = cached_blocks.get(c.incarnation_id, 0)
            worth = cached + w.host * on_host.get(c.incarnation_id, 0)
            hit = worth / num_prompt_blocks if num_prompt_blocks else 0.0
            score = w.prefix * hit - w.load * c.num_queued / (mean + 1.0) - w.kv_usage * c.kv_usage
            choices.append(Choice(c, cached, score, c.num_queued + 1.0 > bound))
        choices.sort(key=lambda ch: (ch.over_bound, -ch.score, rotation[ch.candidate.address]))
        return choices


class _CacheBlindPolicy(RoutingPolicy):
    """Ranks by its own key alone; a choice's score is minus its rank."""

    @abstractmethod
    def _key(self, candidate: Candidate, turn: int) -> tuple[float, ...]:
        """``turn``: the candidate's place in this call's round-robin order."""

    def rank(
        self,
        candidates: Sequence[Candidate],
        cached_blocks: Mapping[str, int],
        num_prompt_blocks: int,
        host_blocks: Mapping[str, int] | None = None,
    ) -> list[Choice]:
        rotation = self._rotation(candidates)
        ordered = sorted(candidates, key=lambda c: self._key(c, rotation[c.address]))
        return [
            Choice(c, cached_blocks.get(c.incarnation_id, 0), -float(i))
            for i, c in enumerate(ordered)
        ]


class RoundRobinPolicy(_CacheBlindPolicy):
    name = "round-robin"

    def _key(self, candidate: Candidate, turn: int) -> tuple[float, ...]:
        return (turn,)


class LeastLoadedPolicy(_CacheBlindPolicy):
    name = "least-loaded"

    def _key(self, candidate: Candidate, turn: int) -> tuple[float, ...]:
        return (candidate.num_queued, candidate.kv_usage, turn)


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (KVAwarePolicy, RoundRobinPolicy, LeastLoadedPolicy)
}


def make_policy(name: str, weights: RoutingWeights | None = None) -> RoutingPolicy:
    """The policy called ``name`` (ValueError naming the choices otherwise)."""
    if name == KVAwarePolicy.name:
        return KVAwarePolicy(weights)
    policy = POLICIES.get(name)
    if policy is None:
        raise ValueError(f"policy: {name!r} is not one of {', '.join(POLICIES)}")
    return policy()
