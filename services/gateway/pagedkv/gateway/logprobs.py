"""Log-probabilities in OpenAI's two shapes, with each token's text and bytes.

``TokenStrings`` gives a token id's bytes and text from the model's
``tokenizer.json`` (the ``tokenizers`` library, no ``transformers``): a
byte-level token (GPT-2 style) maps its characters back to bytes, a
SentencePiece byte token ``<0xE2>`` is that byte, ``▁`` is a space, and an
added token (``<|eot_id|>``) is its content. A token that is part of a
multi-byte character has text U+FFFD; its ``bytes`` (chat) are exact.

Completions (``logprobs: k``): ``{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}`` with the k most likely tokens and the chosen
one in each ``top_logprobs`` entry. Chat (``logprobs: true, top_logprobs:
k``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``.
Values are the model's raw distribution (before temperature, top_k, top_p).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from pagedkv.client.types import TokenLogprob

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPIECE_SPACE = "\u2581"
_COMPLETION_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _uses_byte_level(tokenizer: Tokenizer) -> bool:
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in parts)


class TokenStrings:
    """A token id's bytes and text, computed once per id and kept."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_level = _byte_level_chars() if _uses_byte_level(tokenizer) else None
        self._added = {
            token_id: token.content
            for token_id, token in tokenizer.get_added_tokens_decoder().items()
        }
        self._cache: dict[int, tuple[str, bytes]] = {}

    @classmethod
    def from_model_dir(cls, path: Path) -> TokenStrings | None:
        """From ``path/tokenizer.json``; None without one (no logprob text)."""
        file = path / "tokenizer.json"
        return cls(Tokenizer.from_file(str(file))) if file.is_file() else None

    def num_tokens(self, text: str) -> int:
        """Tokens of ``text`` as the scheduler encodes a text prompt (no
        special tokens added)."""
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def get(self, token_id: int) -> tuple[str, bytes]:
        """The text and bytes of ``token_id``."""
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._compute(token_id)
        return found

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        if token_id in self._added:
            text = self._added[token_id]
            return text, text.encode()
        token = self._tokenizer.id_to_token(token_id)
        if token is None:
            return "", b""
        match = _BYTE_TOKEN.match(token)
        if match is not None:
            data = bytes([int(match.group(1), 16)])
        elif self._byte_level is not None and all(c in self._byte_level for c in token):
            data = bytes(self._byte_level[c] for c in token)
        else:
            data = token.replace(_SPIECE_SPACE, " ").encode()
        return data.decode("utf-8", errors="replace"), data


class CompletionLogprobs:
    """One completion choice's ``logprobs`` object, built as tokens arrive
    (``text_offset`` counts the characters of the tokens before)."""

    __slots__ = ("_offset", "_strings")

    def __init__(self, strings: TokenStrings) -> None:
        self._strings = strings
        self._offset = 0

    def add(self, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        """The object for these tokens (a stream event's, or a part to ``merge``)."""
        tokens, chosen, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, logprobs, strict=False):
            text = self._strings.get(token_id)[0]
            top: dict[str, float] = {}
            for top_id, top_logprob in zip(entry.top_token_ids, entry.top_logprobs, strict=False):
                top.setdefault(self._strings.get(top_id)[0], top_logprob)  # the likelier first
            top.setdefault(text, entry.logprob)
            tokens.append(text)
            chosen.append(entry.logprob)
            tops.append(top)
            offsets.append(self._offset)
            self._offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": chosen,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def merge_completion(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The parts of one choice as one object (a response that is not streamed)."""
    merged: dict[str, Any] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for part in parts:
        for key, values in part.items():
            merged[key].extend(values)
    return merged


def chat_logprobs(
    strings: TokenStrings, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...]
) -> list[dict[str, Any]]:
    """The ``logprobs.content`` entries of these tokens."""
    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        text, data = strings.get(token_id)
        top = []
        for top_id, top_logprob in zip(entry.top_token_ids, entry.top_logprobs, strict=False):
            top_text, top_data = strings.get(top_id)
            top.append({"token": top_text, "logprob": top_logprob, "bytes": list(top_data)})
        content.append(
            {"token": text, "logprob": entry.logprob, "bytes": list(data), "top_logprobs": top}
        )
    return content
