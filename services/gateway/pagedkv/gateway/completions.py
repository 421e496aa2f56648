"""``/v1/completions`` responses: the whole object, or its stream's events.

Events are built as bytes around a head that is serialized once per request
(id, object, created, model), so a stream event costs the JSON encoding of
its texts (and logprobs, when asked for); one event per gRPC chunk
(the scheduler already coalesces a stream's tokens), several tokens' text in
it when the chunk had several.
"""

from __future__ import annotations

from typing import Any

from pagedkv.gateway.logprobs import CompletionLogprobs, TokenStrings, merge_completion
from pagedkv.gateway.streaming import FINISH_JSON, Update, Usage, dumps, json_text


class CompletionFormat:
    """The response of one completion request with ``num_choices`` choices.

    ``logprobs``: the request asked for them (then ``strings`` is needed).
    For a response that is not streamed, ``collect`` every update, then
    ``response``; for a stream, ``event`` per chunk and ``usage_event``.
    """

    object_name = "text_completion"

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        num_choices: int,
        strings: TokenStrings | None,
        logprobs: bool,
    ) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self._head = (
            f'data: {{"id":{dumps(request_id)},"object":"{self.object_name}",'
            f'"created":{created},"model":{dumps(model)},"choices":'
        ).encode()
        self._logprobs = (
            [CompletionLogprobs(strings) for _ in range(num_choices)]
            if logprobs and strings is not None
            else None
        )
        self._texts: list[list[str]] = [[] for _ in range(num_choices)]
        self._logprob_parts: list[list[dict[str, Any]]] = [[] for _ in range(num_choices)]
        self._finish: list[str | None] = [None] * num_choices

    def _choice_logprobs(self, update: Update) -> dict[str, Any] | None:
        if self._logprobs is None:
            return None
        return self._logprobs[update.choice].add(update.token_ids, update.logprobs)

    def event(self, updates: list[Update], extra: bytes = b"") -> bytes | None:
        """The SSE event of one chunk's updates; None when it says nothing.
        Built from bytes directly: one JSON string per choice is encoded.
        ``extra``: more members of the event's object (``,"usage":{...}``)."""
        parts = []
        for u in updates:
            if not (u.text or u.finish_reason or u.logprobs):
                continue
            logprobs = self._choice_logprobs(u)
            parts.append(
                b'{"index":%d,"text":%s,"logprobs":%s,"finish_reason":%s}'
                % (
                    u.choice,
                    json_text(u.text),
                    b"null" if logprobs is None else dumps(logprobs).encode(),
                    FINISH_JSON[u.finish_reason],
                )
            )
        if not parts:
            return None
        return self._head + b"[" + b",".join(parts) + b"]" + extra + b"}\n\n"

    def usage_event(self, usage: Usage) -> bytes:
        return self._head + b'[],"usage":' + dumps(usage.as_dict()).encode() + b"}\n\n"

    def collect(self, updates: list[Update]) -> None:
        """Adds ``updates`` to the response that is not streamed."""
        for u in updates:
            self._texts[u.choice].append(u.text)
            if u.finish_reason is not None:
                self._finish[u.choice] = u.finish_reason
            part = self._choice_logprobs(u)
            if part is not None:
                self._logprob_parts[u.choice].append(part)

    def response(self, usage: Usage) -> dict[str, Any]:
        """The whole response object."""
        choices = [
            {
                "index": i,
                "text": "".join(texts),
                "logprobs": (
                    merge_completion(self._logprob_parts[i]) if self._logprobs is not None else None
                ),
                "finish_reason": self._finish[i],
            }
            for i, texts in enumerate(self._texts)
        ]
        return {
            "id": self.request_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage.as_dict(),
        }
