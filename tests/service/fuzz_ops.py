"""The operations of the Scheduler API fuzz suite (``test_fuzz.py``) and the
hypothesis strategies that draw them.

A ``Burst`` is a list of operations started together against one live
stack: ``Generate`` calls, ``Abort`` calls and ``GetStats`` snapshots. Each
operation may wait for an earlier ``Generate`` to stream its first chunk (or
end) and then for a short delay, so that "while it runs" orderings are
drawn on purpose rather than left to timing. Request ids are mostly one
base id per burst with separators (``a``, ``a/1``, ``a/beam1``, ...), ids
used before, or the ids the scheduler could give an earlier Generate's
sequences, so that live duplicates and clashes are frequent; the rest are
any unicode and ids around the 256-byte limit.

The tiny model's vocabulary is the 256 bytes plus <bos> 256, <eos> 257 and
<pad> 258; its tokenizer maps byte ``b`` to token ``b``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from hypothesis import strategies as st

from pagedkv.v1 import common_pb2, scheduler_pb2

BLOCK_SIZE = 16  # the executors' default --block-size
# Blocks per executor (--num-blocks; one is the null block). A burst's
# generations do not all fit, so running ones are preempted; each one alone
# fits with its tokens allocated ahead (async stepping), so none may wait forever.
NUM_BLOCKS = 12
NUM_USABLE_BLOCKS = NUM_BLOCKS - 1
NUM_AHEAD_TOKENS = 4
EOS_TOKEN_ID = 257
MAX_REQUEST_ID_BYTES = 256
DELAYS_S = (0.0, 0.0, 0.0, 0.0, 0.02, 0.1, 0.3)
OWN_DEADLINES_S = (0.05, 0.3, 1.0, 3.0)
# Prompts are prefixes of a few texts, so that prompts share cached blocks
# (placement then puts them on the same executor).
TEXTS = (
    b"The quick brown fox jumps over the lazy dog; the dog sleeps on. " * 12,
    b"Paged attention keeps the KV cache in fixed-size blocks of tokens. " * 12,
    bytes(range(32, 127)) * 8,
)
STOP_CANDIDATES = (*b" eo.;", 0, EOS_TOKEN_ID)
HUGE_PROMPT_LENGTHS = (520, 700)  # more blocks than a pool holds: RESOURCE_EXHAUSTED


def _id_repr(request_id: str) -> str:
    """A long id as Python that makes it: ``'日' * 85 + 'x'``."""
    head = request_id[:1]
    count = len(request_id) - len(request_id.lstrip(head))
    if count < 16:
        return repr(request_id)
    rest = request_id[count:]
    return f"{head!r} * {count}" + (f" + {rest!r}" if rest else "")


def _repr_fields(obj: object) -> str:
    """``Name(field=value, ...)`` with the fields that differ from their
    defaults; runnable Python."""
    parts = []
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if f.name == "request_id":
            parts.append(f"request_id={_id_repr(value)}")
        elif f.default is not value and f.default != value:
            parts.append(f"{f.name}={value!r}")
    return f"{type(obj).__name__}({', '.join(parts)})"


@dataclass(frozen=True, repr=False)
class Generate:
    """One Generate call. ``text``/``length``: the prompt is the first
    ``length`` bytes of ``TEXTS[text]``. ``deadline_s``: the call's own
    deadline (None: only the suite's generous bound). ``cancel_after``: the
    client cancels the call after that many chunks (0: right after starting)."""

    request_id: str
    text: int = 0
    length: int = 8
    max_tokens: int = 8
    n: int = 1
    beam_width: int = 0
    temperature: float = 0.0
    seed: int | None = None
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    priority: int = 0
    cache_salt: str = ""
    deadline_s: float | None = None
    cancel_after: int | None = None
    after: int | None = None
    delay_s: float = 0.0

    def __repr__(self) -> str:
        return _repr_fields(self)

    @property
    def prompt(self) -> list[int]:
        return list(TEXTS[self.text][: self.length])

    @property
    def id_too_long(self) -> bool:
        return len(self.request_id.encode()) > MAX_REQUEST_ID_BYTES

    @property
    def prompt_too_big(self) -> bool:
        """RESOURCE_EXHAUSTED: the prompt (plus one token) and one block per
        sequence need more blocks than an executor has."""
        needed = math.ceil((self.length + 1) / BLOCK_SIZE) + self.n
        return needed > NUM_USABLE_BLOCKS

    def request(self) -> scheduler_pb2.GenerateRequest:
        sampling = common_pb2.SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            n=self.n,
            beam_width=self.beam_width,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
        )
        if self.seed is not None:
            sampling.seed = self.seed
        if self.logprobs is not None:
            sampling.logprobs = self.logprobs
        return scheduler_pb2.GenerateRequest(
            request_id=self.request_id,
            token_ids=scheduler_pb2.TokenIds(ids=self.prompt),
            sampling=sampling,
            priority=self.priority,
            cache_salt=self.cache_salt,
        )


@dataclass(frozen=True, repr=False)
class Abort:
    """One Abort call."""

    request_id: str
    after: int | None = None
    delay_s: float = 0.0

    def __repr__(self) -> str:
        return _repr_fields(self)


@dataclass(frozen=True, repr=False)
class Stats:
    """One GetStats call in the middle of the burst."""

    after: int | None = None
    delay_s: float = 0.0

    def __repr__(self) -> str:
        return _repr_fields(self)


Operation = Generate | Abort | Stats


@dataclass(frozen=True)
class Burst:
    """Operations started together; ``after`` names an earlier operation's
    index (always a ``Generate``)."""

    operations: tuple[Operation, ...] = field(default=())

    def __repr__(self) -> str:
        lines = [f"    {op!r},  # {i}" for i, op in enumerate(self.operations)]
        return "Burst(operations=(\n" + "\n".join(lines) + "\n))"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """How hypothesis prints a falsifying burst: one operation a line."""
        printer.text(repr(self))


def sized_id(num_bytes: int, char: str) -> str:
    """An id of exactly ``num_bytes`` bytes of UTF-8: ``char`` repeated, padded with "x"."""
    width = len(char.encode())
    return char * (num_bytes // width) + "x" * (num_bytes % width)


# Suffixes the scheduler's own sequence ids use ("<id>/<i>", "<id>/beam<k>"), and others.
SUFFIXES = ("", "", "/0", "/1", "/1", "/2", "/3", "/beam1", "/beam2", "/", ":1", "/1/0", "\x00")
BASES = ("a", "", "é", "日本", "🙂")

# Anything: unicode, control characters, ids around the 256-byte limit in
# one- to four-byte characters.
any_request_ids = st.text(max_size=6) | st.builds(
    sized_id, st.sampled_from((255, 256, 257, 300)), st.sampled_from("aé日🙂")
)


def max_tokens_that_fit(length: int, num_sequences: int) -> int:
    """The most tokens each of ``num_sequences`` sequences of a ``length``
    prompt may generate so that the generation alone fits in a pool: they
    share the prompt's blocks but the one its last token is in (each
    recomputes that token into a copy of it), and the rest are their own."""
    shared = (length - 1) // BLOCK_SIZE
    own = (NUM_USABLE_BLOCKS - shared) // num_sequences
    return (shared + own) * BLOCK_SIZE - length - NUM_AHEAD_TOKENS


@st.composite
def generates(draw: st.DrawFn, request_id: str, after: int | None, text: int) -> Generate:
    """A Generate; its prompt mostly a prefix of ``TEXTS[text]``, the burst's
    text, so that it shares cached blocks (and an executor) with others."""
    beam = draw(st.integers(0, 5)) == 5
    n = 1 if beam else draw(st.integers(1, 4))
    beam_width = draw(st.integers(2, 3)) if beam else 0
    huge = draw(st.integers(0, 24)) == 24
    text = draw(st.sampled_from((text, text, text, *range(len(TEXTS)))))
    length = draw(st.sampled_from(HUGE_PROMPT_LENGTHS)) if huge else draw(st.integers(1, 48))
    room = max_tokens_that_fit(length, max(n, beam_width))
    temperature = draw(st.sampled_from((0.0, 0.0, 0.8, 1.0)))
    return Generate(
        request_id=request_id,
        text=text,
        length=length,
        max_tokens=draw(st.integers(1, max(1, min(48, room)))),
        n=n,
        beam_width=beam_width,
        temperature=temperature,
        seed=draw(st.none() | st.integers(0, 2**64 - 1)) if temperature else None,
        top_k=draw(st.sampled_from((0, 0, 5))),
        stop_token_ids=tuple(draw(st.lists(st.sampled_from(STOP_CANDIDATES), max_size=3))),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.none() | st.integers(0, 4)),
        priority=draw(st.integers(-2, 2)),
        cache_salt=draw(st.sampled_from(("", "", "", "tenant"))),
        deadline_s=draw(st.sampled_from((None,) * 6 + OWN_DEADLINES_S)),
        cancel_after=draw(st.sampled_from((None,) * 8 + (0, 1, 2, 4))),
        after=after,
        delay_s=draw(st.sampled_from(DELAYS_S)),
    )


def sequence_id(parent: Generate, index: int) -> str:
    """An id the scheduler could give one of ``parent``'s sequences."""
    if parent.beam_width:
        return f"{parent.request_id}/beam{index % 2 + 1}"
    return f"{parent.request_id}/{index % max(parent.n, 2)}"


@st.composite
def bursts(draw: st.DrawFn, max_operations: int) -> Burst:
    """A burst: mostly Generates. A request id is one of the burst's family
    (a base id with a suffix), one used before, one of an earlier Generate's
    sequence ids (started once that Generate streams), or anything."""
    operations: list[Operation] = []
    used_ids: list[str] = []
    base = draw(st.sampled_from(BASES) | st.text(min_size=1, max_size=3))
    family = st.sampled_from(SUFFIXES).map(lambda suffix: base + suffix)
    text = draw(st.integers(0, len(TEXTS) - 1))
    for _ in range(draw(st.integers(1, max_operations))):
        earlier = [i for i, op in enumerate(operations) if isinstance(op, Generate)]
        waits = earlier and draw(st.integers(0, 3)) == 3
        after = draw(st.sampled_from(earlier)) if waits else None
        kind = draw(st.sampled_from(("generate",) * 6 + ("abort", "abort", "stats")))
        if kind == "stats":
            operations.append(Stats(after, draw(st.sampled_from(DELAYS_S))))
            continue
        choice = draw(st.integers(0, 7))
        if choice == 7:
            request_id = draw(any_request_ids)
        elif choice >= 5 and earlier:
            index = draw(st.sampled_from(earlier))
            parent = operations[index]
            assert isinstance(parent, Generate)
            request_id = sequence_id(parent, draw(st.integers(0, 3)))
            # While the parent streams; a beam search streams only at its end.
            after = None if parent.beam_width else index
        elif choice >= 3 and used_ids:
            request_id = draw(st.sampled_from(used_ids))
        else:
            request_id = draw(family)
        used_ids.append(request_id)
        if kind == "generate":
            operations.append(draw(generates(request_id, after, text)))
        else:
            operations.append(Abort(request_id, after, draw(st.sampled_from(DELAYS_S))))
    return Burst(tuple(operations))
