"""Stop strings: one output sequence's text, checked for ``sampling.stop``.

A stop string is matched on the detokenized text, so it may span tokens and
the bytes of a multi-byte character (the detokenizer only ever lets whole
characters out). Text is released as soon as it cannot become part of a
stop string: the matcher holds back the longest tail of the text that is a
prefix of some stop string, and lets the rest go.

Which stop string wins: the one that ends first in the text, and at the same
end the longer one (it starts earlier). That is the stop string completed
first as the text grows, so the result does not depend on how the text is
split into tokens: with stops ``"ab"`` and ``"abc"``, text ``"xabc"`` stops
at ``"ab"``; with ``"abc"`` and ``"bc"``, it stops at ``"abc"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pagedkv.common.text import IncrementalDetokenizer

MAX_STOP_STRINGS = 16
"""Stop strings one request may give."""

MAX_STOP_STRING_CHARS = 256
"""Characters of one stop string at most: the matcher holds back at most
this many less one, and searches that far back per delta."""


class Released(NamedTuple):
    """What a push lets out: text that can no longer be part of a stop
    string, and the stop string that ended the sequence (None: it goes on).
    With a stop string, ``text`` ends before it (or after it, when the
    matcher includes it) and nothing comes after."""

    text: str
    stop: str | None = None


class StopMatcher:
    """Runs a sequence's detokenizer eagerly and watches its text for stop strings.

    Owns the detokenizer it is given: nothing else may push to it. After a
    match the matcher is spent (``stopped``): later pushes release nothing.
    """

    __slots__ = ("_detokenizer", "_firsts", "_held", "_include", "_longest", "_stops", "stopped")

    def __init__(
        self, detokenizer: IncrementalDetokenizer, stops: Sequence[str], include: bool = False
    ) -> None:
        """``stops``: non-empty strings (validated by the caller);
        ``include``: a matched stop string is part of the released text."""
        assert stops and all(stops), "stop strings are non-empty"
        self._detokenizer = detokenizer
        self._stops = tuple(dict.fromkeys(stops))
        self._firsts = frozenset(stop[0] for stop in self._stops)
        self._longest = max(len(stop) for stop in self._stops)
        self._include = include
        self._held = ""
        self.stopped: str | None = None
        """The stop string that matched, once one has."""

    @property
    def held(self) -> str:
        """Text made but not released: a prefix of some stop string."""
        return self._held

    def push(self, token_ids: Sequence[int], match: bool = True) -> Released:
        """Takes the next output tokens; returns the text they release and
        the stop string they complete, if any (see the module's rule).
        ``match`` False: the sequence may not stop yet (``min_tokens``), so
        no stop string is looked for; one completed now is never matched
        later (only stop strings that end in new text are)."""
        if self.stopped is not None:
            return Released("")
        delta = self._detokenizer.push(token_ids)
        if not delta:
            return Released("")
        before = len(self._held)
        held = self._held + delta
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops if match else ():
            # A new match ends in the delta: it starts at most len(stop) - 1 back.
            start = held.find(stop, max(before - len(stop) + 1, 0))
            if start >= 0:
                end = start + len(stop)
                if best is None or (end, start) < best[:2]:
                    best = (end, start, stop)
        if best is not None:
            end, start, stop = best
            self.stopped = stop
            self._held = ""
            return Released(held[: end if self._include else start], stop)
        cut = self._hold_from(held)
        self._held = held[cut:]
        return Released(held[:cut])

    def skip(self, token_ids: Sequence[int]) -> None:
        """Takes output tokens whose released text the caller already has (a
        resumed stream's), one at a time as the broken stream took them,
        dropping that text and looking for no stop string: the text held
        back stays held, as the broken stream held it."""
        for token in token_ids:
            held = self._held + self._detokenizer.push((token,))
            self._held = held[self._hold_from(held) :]

    def flush(self) -> str:
        """Releases everything held (with the detokenizer's own held-back
        bytes); for a sequence that ends otherwise than by a stop string."""
        if self.stopped is not None:
            return ""
        text = self._held + self._detokenizer.flush()
        self._held = ""
        return text

    def _hold_from(self, text: str) -> int:
        """Where the longest tail of ``text`` that is a prefix of some stop
        string starts (``len(text)``: none is)."""
        firsts = self._firsts
        for i in range(max(len(text) - self._longest + 1, 0), len(text)):
            if text[i] in firsts:
                tail = text[i:]
                if any(stop.startswith(tail) for stop in self._stops):
                    return i
        return len(text)
