"""``/v1/chat/completions``: rendering the messages, and the responses.

The messages are rendered with the model's chat template
(``pagedkv.gateway.chat_template``) and the text sent as the prompt; a model
without a template refuses chat with a 400. Responses are built as in
``pagedkv.gateway.completions``: a choice's first stream event carries
``delta.role`` ("assistant") with its first text, later ones the text alone.
"""

from __future__ import annotations

from typing import Any

from pagedkv.gateway.chat_template import ChatTemplate, ChatTemplateError
from pagedkv.gateway.errors import ApiError
from pagedkv.gateway.logprobs import TokenStrings, chat_logprobs
from pagedkv.gateway.protocol import ChatCompletionRequest
from pagedkv.gateway.streaming import FINISH_JSON, Update, Usage, dumps, json_text


def render(template: ChatTemplate | None, request: ChatCompletionRequest) -> str:
    """The prompt text of ``request``'s messages; ApiError 400 (param
    "messages") without a template or when the template refuses them."""
    if template is None:
        raise ApiError(
            400,
            "messages: this model has no chat template (use /v1/completions)",
            param="messages",
            code="no_chat_template",
        )
    messages = [message.as_template_input() for message in request.messages]
    variables = dict(request.chat_template_kwargs or {})
    add_generation_prompt = bool(
        variables.pop("add_generation_prompt", request.add_generation_prompt)
    )
    try:
        return template.render(messages, add_generation_prompt=add_generation_prompt, **variables)
    except ChatTemplateError as exc:
        param = exc.param or "messages"
        raise ApiError(400, f"{param}: {exc}", param=param, code="invalid_value") from exc


class ChatFormat:
    """The response of one chat request (as ``CompletionFormat``)."""

    object_name = "chat.completion"

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
            f'data: {{"id":{dumps(request_id)},"object":"chat.completion.chunk",'
            f'"created":{created},"model":{dumps(model)},"choices":'
        ).encode()
        self._strings = strings if logprobs else None
        self._started = [False] * num_choices
        self._texts: list[list[str]] = [[] for _ in range(num_choices)]
        self._logprobs: list[list[dict[str, Any]]] = [[] for _ in range(num_choices)]
        self._finish: list[str | None] = [None] * num_choices

    def _choice_logprobs(self, update: Update) -> list[dict[str, Any]] | None:
        if self._strings is None:
            return None
        return chat_logprobs(self._strings, update.token_ids, update.logprobs)

    def _delta(self, update: Update) -> bytes:
        if self._started[update.choice]:
            return b'{"content":%s}' % json_text(update.text)
        self._started[update.choice] = True
        return b'{"role":"assistant","content":%s}' % json_text(update.text)

    def event(self, updates: list[Update], extra: bytes = b"") -> bytes | None:
        """The SSE event of one chunk's updates; None when it says nothing.
        Built from bytes directly: one JSON string per choice is encoded.
        ``extra``: more members of the event's object (``,"usage":{...}``)."""
        parts = []
        for u in updates:
            if not (u.text or u.finish_reason or u.logprobs):
                continue
            content = self._choice_logprobs(u)
            parts.append(
                b'{"index":%d,"delta":%s,"logprobs":%s,"finish_reason":%s}'
                % (
                    u.choice,
                    self._delta(u),
                    b"null" if content is None else b'{"content":%s}' % dumps(content).encode(),
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
            content = self._choice_logprobs(u)
            if content is not None:
                self._logprobs[u.choice].extend(content)

    def response(self, usage: Usage) -> dict[str, Any]:
        """The whole response object."""
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": "".join(texts)},
                "logprobs": None if self._strings is None else {"content": self._logprobs[i]},
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
