"""Beam search: which (beam, token) pairs survive a round.

A round starts when every live beam of a generation has its candidates: the
executor's top ``num_candidates`` raw log-probabilities at the beam's next
position. Every (beam, token) pair scores the beam's cumulative logprob plus
the token's; pairs are ranked by score (ties: the earlier beam, then the
lower token id). Walking the ranking, a pair whose token ends the sequence
(a stop token, or EOS unless ignore_eos) is a finished hypothesis if its
rank is below the width; any other pair becomes a live beam until there are
``width`` of them. ``BeamSearch.select`` is pure; ``ExecutorScheduler`` forks
and prunes the sequences it names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

Beam = TypeVar("Beam")


@dataclass(frozen=True, slots=True)
class Candidate(Generic[Beam]):
    """A surviving (beam, token) pair and its score."""

    score: float
    beam: Beam
    token: int


class Finished(NamedTuple):
    """A finished hypothesis: its score, generated tokens and finish reason."""

    score: float
    token_ids: tuple[int, ...]
    reason: int


@dataclass
class BeamSearch:
    """The beam-search state of one generation."""

    width: int
    num_candidates: int
    finished: list[Finished] = field(default_factory=list)
    num_forks: int = 0

    def select(
        self,
        beams: Sequence[Beam],
        cumulative: Callable[[Beam], float],
        candidates: Callable[[Beam], Sequence[tuple[float, int]]],
        finish_reason: Callable[[int], int | None],
        output: Callable[[Beam], Sequence[int]],
    ) -> list[Candidate[Beam]]:
        """The surviving (beam, token) pairs, best first; records finished
        hypotheses. ``candidates(beam)`` gives (logprob, token id) pairs."""
        ranked = sorted(
            (
                (cumulative(beam) + logprob, order, token, beam)
                for order, beam in enumerate(beams)
                for logprob, token in candidates(beam)
            ),
            key=lambda item: (-item[0], item[1], item[2]),
        )
        live: list[Candidate[Beam]] = []
        for rank, (score, _, token, beam) in enumerate(ranked):
            if len(live) == self.width:
                break
            reason = finish_reason(token)
            if reason is None:
                live.append(Candidate(score, beam, token))
            elif rank < self.width:
                self.finished.append(Finished(score, (*output(beam), token), reason))
        return live

    def add_finished(self, score: float, token_ids: Sequence[int], reason: int) -> None:
        self.finished.append(Finished(score, tuple(token_ids), reason))

    @property
    def done(self) -> bool:
        return len(self.finished) >= self.width

    def best(self) -> list[Finished]:
        """The final beams, best first."""
        return sorted(self.finished, key=lambda f: -f.score)[: self.width]
