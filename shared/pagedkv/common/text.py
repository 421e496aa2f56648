"""Text in and out: a model's ``tokenizer.json``, and output text streamed as deltas.

``TextTokenizer`` wraps a Hugging Face ``tokenizers.Tokenizer`` (the Rust
library, no ``transformers``): prompts given as text are encoded with it, and
finished outputs decoded. ``IncrementalDetokenizer`` turns one output
sequence's tokens, as they are sampled, into text deltas.

Shared code: the scheduler encodes text prompts and streams output text with
it, and the router encodes text prompts with the same tokenizer to hash their
blocks. Nothing here depends on either service.

Streaming needs care because a token is not a character: byte-level
tokenizers (GPT-2 style, and SentencePiece byte fallback) can split one
multi-byte UTF-8 character over several tokens, and decoding a prefix that
ends inside a character gives U+FFFD (the replacement character) where the
character will be. The detokenizer holds such text back until the following
tokens complete it, and decodes only a short window of the newest tokens per
step rather than the whole output.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from pagedkv.common.model_source import model_dir_or_none

REPLACEMENT_CHAR = "\ufffd"
"""What a decoder writes for bytes that are not (yet) valid UTF-8."""

TOKENIZER_FILE = "tokenizer.json"

_CONTEXT_TOKENS = 5
"""Emitted tokens kept before the unemitted ones as decode context, so that
decoders whose output depends on the previous token (leading spaces, word
pieces) give the same text in the window as in the whole sequence."""

_MAX_HELD_TOKENS = 4
"""Held-back tokens above which invalid bytes are let out before the end.

Valid UTF-8 never holds more than 3 byte tokens (a character has at most 4
bytes); only invalid bytes followed by more invalid or incomplete bytes hold
more, and then ``push`` looks for a clean cut (see ``_clean_cut``)."""


class TextTokenizer:
    """Encodes prompts and decodes outputs with one model's tokenizer.

    Encoding adds no special tokens (the caller adds a BOS if the model wants
    one); decoding skips special tokens. Stateless and safe to share between
    requests; the wrapped ``tokenizers.Tokenizer`` is owned by this object.
    """

    __slots__ = ("_tokenizer", "longest_token_chars")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.longest_token_chars = max((len(token) for token in vocab), default=1)
        """Characters of the longest string in the vocabulary (added tokens
        included): no token covers more characters of a text than this
        (byte-level strings have one character per byte, at least one per
        character they cover; SentencePiece's byte tokens are longer than
        the byte they stand for)."""

    @classmethod
    def from_model_dir(cls, path: str | Path) -> TextTokenizer | None:
        """Load ``<path>/tokenizer.json``; None when the model dir has none.

        ``path`` may also be a Hugging Face id in the local cache (see
        ``pagedkv.common.model_source``); None when it is not there.
        A model served without a tokenizer takes prompts as token ids only.
        A file that exists but does not parse raises ``tokenizers``' exception.
        """
        directory = model_dir_or_none(str(path))
        file = None if directory is None else directory / TOKENIZER_FILE
        if file is None or not file.is_file():
            return None
        return cls(Tokenizer.from_file(str(file)))

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without added special tokens.

        Text that spells an added token (``"<eos>"``) encodes to that token.
        Runs without the GIL (``encode_batch`` releases it; ``encode`` does
        not), so a worker thread can encode while the event loop runs.
        """
        (encoding,) = self._tokenizer.encode_batch([text], add_special_tokens=False)
        return list(encoding.ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens skipped; invalid UTF-8 becomes U+FFFD."""
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))


class IncrementalDetokenizer:
    """Text deltas of one output sequence, as its tokens arrive.

    Contract: the concatenation of every ``push`` delta and the final
    ``flush`` equals ``tokenizer.decode(all pushed tokens)`` (with
    ``prompt_ids``: the decode of their tail and the outputs, less the decode
    of that tail, if the tail ends on a whole character), for tokenizers
    whose decode of a token window extends the decode of its prefix
    (byte-level BPE and SentencePiece decoders do). A delta never ends in an
    unfinished character: when new tokens extend the text and it ends in
    U+FFFD, they are held until later tokens complete the character; if the
    bytes were invalid to begin with, the U+FFFD comes out once more tokens
    make that certain (see ``_MAX_HELD_TOKENS``), or at ``flush``.

    State, in token positions of ``_ids`` (which keeps only the window):
    ``_read`` is how far text has been emitted, ``_prefix`` where the decode
    window starts (up to ``_CONTEXT_TOKENS`` before ``_read``), and
    ``_prefix_text`` is the decode of ``_ids[_prefix:_read]``. A push decodes
    ``_ids[_prefix:]`` once, and once more to re-anchor after emitting.
    """

    __slots__ = ("_ids", "_num_tokens", "_prefix", "_prefix_text", "_read", "_tokenizer")

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: Sequence[int] = ()) -> None:
        """Start a sequence; ``prompt_ids`` (optional) give its last tokens as context.

        With a prompt, the first output token decodes as it does after the
        prompt (SentencePiece drops the leading space of a sequence's first
        word; after the prompt it keeps it).
        """
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = tokenizer.decode(self._ids) if self._ids else ""
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Output tokens pushed so far."""
        return self._num_tokens

    def push(self, token_ids: Sequence[int]) -> str:
        """Take the next output tokens; return the text they complete (maybe "").

        Mutates the window: after a non-empty delta, the emitted tokens are
        all but the last ``_CONTEXT_TOKENS`` dropped.
        """
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        self._num_tokens += len(token_ids)
        text = self._tokenizer.decode(self._ids[self._prefix :])
        grew = len(text) > len(self._prefix_text)
        if not (grew and text.endswith(REPLACEMENT_CHAR)):
            return self._emit_to(len(self._ids), text)
        if len(self._ids) - self._read > _MAX_HELD_TOKENS:
            cut = self._clean_cut(text)
            if cut is not None:
                return self._emit_to(*cut)
        return ""

    def skip(self, token_ids: Sequence[int]) -> None:
        """Take output tokens whose text the caller already has (a resumed
        stream's ``resumed_token_ids``), dropping their text.

        Pushes them one at a time, as the scheduler pushes sampled tokens, so
        the state is the one the broken stream's detokenizer had after them:
        text it held back (an unfinished character) is held here too, and the
        next delta starts exactly where the caller's text ends.
        """
        for token in token_ids:
            self.push((token,))

    def flush(self) -> str:
        """Return all held-back text, U+FFFD included; call at the sequence's end.

        The detokenizer stays usable, but a character split over the flush
        comes out as U+FFFD on both sides of it.
        """
        if self._read == len(self._ids):
            return ""
        return self._emit_to(len(self._ids), self._tokenizer.decode(self._ids[self._prefix :]))

    def _emit_to(self, end: int, text: str) -> str:
        """Emit ``text`` (the decode of ``_ids[_prefix:end]``) past ``_prefix_text``.

        Moves ``_read`` to ``end`` and the window start to ``_CONTEXT_TOKENS``
        before it, dropping older tokens, and re-decodes ``_prefix_text``.
        """
        delta = text[len(self._prefix_text) :]
        start = max(end - _CONTEXT_TOKENS, 0)
        del self._ids[:start]
        self._prefix = 0
        self._read = end - start
        self._prefix_text = self._tokenizer.decode(self._ids[: self._read])
        return delta

    def _clean_cut(self, text: str) -> tuple[int, str] | None:
        """The latest cut ``(end, decode of _ids[_prefix:end])`` whose text is final.

        A cut ``end`` past ``_read`` is clean when its text grows past
        ``_prefix_text``, the tokens after it decode to some text (not only
        special tokens), and the window decodes to the text before the cut
        followed by the text after it: then no character (nor a run of bytes
        the decoder turns into one U+FFFD) straddles the cut, so the text
        before it cannot change. None when no such cut exists.
        """
        for end in range(len(self._ids) - 1, self._read, -1):
            head = self._tokenizer.decode(self._ids[self._prefix : end])
            if len(head) <= len(self._prefix_text):
                return None
            tail = self._tokenizer.decode(self._ids[end:])
            if tail and head + tail == text:
                return end, head
        return None
