"""``/v1/completions`` responses: the whole object, or its stream's events.

One event per gRPC chunk (the scheduler already coalesces a stream's
tokens), several tokens' text in it when the chunk had several; events are
built as bytes (``responses.ChoicesFormat``).
"""

from __future__ import annotations

from typing import Any

from pagedkv.gateway.logprobs import CompletionLogprobs, TokenStrings, merge_completion
from pagedkv.gateway.responses import ChoicesFormat
from pagedkv.gateway.streaming import Update, dumps, json_text


class CompletionFormat(ChoicesFormat):
    """The response of one completion request with ``num_choices`` choices.

    ``logprobs``: the request asked for them (then ``strings`` is needed).
    """

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        num_choices: int,
        strings: TokenStrings | None,
        logprobs: bool,
    ) -> None:
        super().__init__(request_id, created, model, num_choices)
        self._logprobs = (
            [CompletionLogprobs(strings) for _ in range(num_choices)]
            if logprobs and strings is not None
            else None
        )
        self._logprob_parts: list[list[dict[str, Any]]] = [[] for _ in range(num_choices)]

    def _choice_logprobs(self, update: Update) -> dict[str, Any] | None:
        if self._logprobs is None:
            return None
        return self._logprobs[update.choice].add(update.token_ids, update.logprobs)

    def _event_choice(self, update: Update, finish: bytes) -> bytes:
        logprobs = self._choice_logprobs(update)
        return b'{"index":%d,"text":%s,"logprobs":%s,"finish_reason":%s}' % (
            update.choice,
            json_text(update.text),
            b"null" if logprobs is None else dumps(logprobs).encode(),
            finish,
        )

    def _collect_logprobs(self, update: Update) -> None:
        part = self._choice_logprobs(update)
        if part is not None:
            self._logprob_parts[update.choice].append(part)

    def _choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        logprobs = self._logprob_parts[index]
        return {
            "index": index,
            "text": text,
            "logprobs": merge_completion(logprobs) if self._logprobs is not None else None,
            "finish_reason": finish_reason,
        }
