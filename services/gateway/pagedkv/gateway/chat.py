"""``/v1/chat/completions``: rendering the messages, and the responses.

The messages are rendered with the model's chat template
(``pagedkv.gateway.chat_template``) and the text sent as the prompt; a model
without a template refuses chat with a 400. Responses are built as in
``pagedkv.gateway.completions`` (``responses.ChoicesFormat``): a choice's first stream event carries
``delta.role`` ("assistant") with its first text, later ones the text alone.
"""

from __future__ import annotations

from typing import Any

from pagedkv.gateway.chat_template import ChatTemplate, ChatTemplateError
from pagedkv.gateway.errors import ApiError
from pagedkv.gateway.logprobs import TokenStrings, chat_logprobs
from pagedkv.gateway.protocol import ChatCompletionRequest
from pagedkv.gateway.responses import ChoicesFormat
from pagedkv.gateway.streaming import Update, dumps, json_text


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


class ChatFormat(ChoicesFormat):
    """The response of one chat request (as ``CompletionFormat``)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

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
        self._strings = strings if logprobs else None
        self._started = [False] * num_choices
        self._logprobs: list[list[dict[str, Any]]] = [[] for _ in range(num_choices)]

    def _choice_logprobs(self, update: Update) -> list[dict[str, Any]] | None:
        if self._strings is None:
            return None
        return chat_logprobs(self._strings, update.token_ids, update.logprobs)

    def _delta(self, update: Update) -> bytes:
        if self._started[update.choice]:
            return b'{"content":%s}' % json_text(update.text)
        self._started[update.choice] = True
        return b'{"role":"assistant","content":%s}' % json_text(update.text)

    def _event_choice(self, update: Update, finish: bytes) -> bytes:
        content = self._choice_logprobs(update)
        return b'{"index":%d,"delta":%s,"logprobs":%s,"finish_reason":%s}' % (
            update.choice,
            self._delta(update),
            b"null" if content is None else b'{"content":%s}' % dumps(content).encode(),
            finish,
        )

    def _collect_logprobs(self, update: Update) -> None:
        content = self._choice_logprobs(update)
        if content is not None:
            self._logprobs[update.choice].extend(content)

    def _choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": None if self._strings is None else {"content": self._logprobs[index]},
            "finish_reason": finish_reason,
        }
