"""Text prompts encoded off the event loop, and refused before any encoding
when they cannot fit the model.

Shared code, like ``pagedkv.common.text``: the scheduler and the router both
take text prompts and encode them this way.

Encoding costs time in proportion to the text (about a second a megabyte on
one core, more for a pre-tokenizer's long words); on the event loop it would
stall every stream, health check and lease renewal of the process.
``PromptEncoder`` runs it on a few worker threads: the Rust tokenizer
releases the GIL while it encodes (``TextTokenizer.encode``), so the loop
keeps running. A process pool would also work but would copy the text and
the ids across processes; threads measured as responsive.

The bound: no token covers more than ``longest_token_chars`` characters
(the longest string in the tokenizer's vocabulary), so a text longer than
``max_model_len * longest_token_chars`` characters has more than
``max_model_len`` tokens and is refused (INVALID_ARGUMENT on ``prompt.text``)
before it is encoded. This is exact for tokenizers whose normalizer and
pre-tokenizer keep every character (byte-level BPE, SentencePiece); one that
drops characters (whitespace splitting, control characters) may have fit
such a text, and the bound is then the service's limit.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pagedkv.common.errors import InvalidArgument
from pagedkv.common.text import TextTokenizer

MAX_ENCODE_WORKERS = 2
"""Threads that encode prompts; more prompts wait their turn in the pool's
queue (on the loop, each is only a pending future)."""


def max_prompt_chars(tokenizer: TextTokenizer, max_model_len: int) -> int:
    """The longest text (in characters) that could encode to ``max_model_len``
    tokens or fewer."""
    return max_model_len * tokenizer.longest_token_chars


def check_prompt_text(text: str, tokenizer: TextTokenizer, max_model_len: int) -> None:
    """Raises InvalidArgument naming ``prompt.text`` when ``text`` is longer
    than ``max_prompt_chars`` (it cannot fit ``max_model_len``); reads only
    the text's length."""
    limit = max_prompt_chars(tokenizer, max_model_len)
    if len(text) > limit:
        raise InvalidArgument(
            f"prompt.text: {len(text)} characters cannot fit max_model_len {max_model_len} "
            f"(at most {limit} characters: {tokenizer.longest_token_chars} a token at most)"
        )


class PromptEncoder:
    """Encodes text prompts on ``max_workers`` threads of its own.

    Owns the pool; ``close`` shuts it down (encodings in progress finish,
    queued ones are cancelled). Safe to share between requests.
    """

    def __init__(self, max_workers: int = MAX_ENCODE_WORKERS) -> None:
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="pagedkv-encode")

    async def encode(self, text: str, tokenizer: TextTokenizer, max_model_len: int) -> list[int]:
        """The token ids of ``text``, encoded on a worker thread; a text
        longer than the bound is refused first (``check_prompt_text``)."""
        check_prompt_text(text, tokenizer, max_model_len)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, tokenizer.encode, text)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
