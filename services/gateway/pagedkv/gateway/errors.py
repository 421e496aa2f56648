"""The gateway's one error policy: every failure becomes an ``ApiError``,
answered in OpenAI's error shape.

``{"error": {"message", "type", "param", "code"}}`` with the HTTP status
OpenAI's clients expect: 400 for a request the gateway or the scheduler
refuses (``param`` names the OpenAI parameter), 401 for a missing or wrong
bearer token, 404 for an unknown model, 429 and 503 (with ``Retry-After``)
when the targets are overloaded or unavailable, 504 for a passed deadline,
502 when the targets refuse the gateway's own credentials, 500 otherwise.
A stream that fails after its first event ends with one ``data:`` event
carrying the same object (``sse_error``).
"""

from __future__ import annotations

import json
import re
from typing import Any

import grpc
import pydantic
from starlette.responses import Response

from pagedkv.client.errors import PagedkvError

RETRY_AFTER_S = 1
"""``Retry-After`` of a 429 or 503: the seconds after which a retry may find
room (or a scheduler) again."""

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """A request the gateway answers with ``status`` and OpenAI's error object.

    ``param`` names the request parameter at fault (None when none is);
    ``code`` is a short machine-readable reason (e.g. "model_not_found").
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        """The JSON object of the answer."""
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        headers = {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}
        return Response(
            json.dumps(self.body()),
            status_code=self.status,
            media_type="application/json",
            headers=headers,
        )

    def sse(self) -> bytes:
        """The server-sent event that ends a stream failing after it started."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def invalid(param: str, message: str) -> ApiError:
    """A 400 naming ``param``."""
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def unsupported(param: str, why: str = "not supported") -> ApiError:
    """A 400 for a parameter the gateway does not support (yet)."""
    return ApiError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


def _param_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic location as a parameter path: ``messages[0].content``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not path:
            path = part
        elif part.startswith(("function-", "list[", "str", "int", "bool", "float", "dict[")):
            continue  # which member of a union pydantic tried: not a parameter
        else:
            path += f".{part}"
    return path


def from_validation(exc: pydantic.ValidationError) -> ApiError:
    """The 400 of a request body that does not validate: the first error,
    its location as ``param`` (an unknown field: that field)."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first['msg']}", code="invalid_json")
    if first["type"] == "model_type" and not first["loc"]:
        return ApiError(400, "the body must be a JSON object", code="invalid_json")
    param = _param_path(tuple(first["loc"]))
    if first["type"] == "extra_forbidden":
        return unsupported(param, "unknown or unsupported parameter")
    if first["type"] == "missing":
        return ApiError(400, f"{param}: required", param=param, code="missing_required_parameter")
    # A union of types gives one error per member: say what was expected once.
    kinds = {e["type"] for e in errors if _param_path(tuple(e["loc"])) == param}
    message = first["msg"] if len(kinds) == 1 else "has the wrong type"
    return invalid(param, message)


_SCHEDULER_PARAMS = {
    "sampling.max_tokens": "max_tokens",
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.seed": "seed",
    "sampling.n": "n",
    "sampling.stop_token_ids": "stop_token_ids",
    "sampling.logprobs": "logprobs",
    "sampling.stop": "stop",
    "sampling.min_tokens": "min_tokens",
    "prompt": "prompt",
}
_FIELD = re.compile(r"^([a-z_.]+)(?:\[\d+\])?(?:\.[a-z_.\[\]\d]+)?:")


_CHAT_PARAMS = {"prompt": "messages", "logprobs": "top_logprobs"}
"""Where chat names a parameter otherwise (the prompt is its messages)."""


def scheduler_param(details: str, prompt_param: str = "prompt") -> str | None:
    """The OpenAI parameter an INVALID_ARGUMENT's details name (the
    scheduler starts them with the field: "sampling.top_p: ...");
    ``prompt_param``: what the prompt is called ("messages" for chat, whose
    logprobs count is ``top_logprobs`` too)."""
    match = _FIELD.match(details)
    if match is None:
        return None
    field = match.group(1)
    for prefix, param in _SCHEDULER_PARAMS.items():
        if field == prefix or field.startswith(prefix + "."):
            return _CHAT_PARAMS.get(param, param) if prompt_param == "messages" else param
    return None


def from_pagedkv(exc: PagedkvError, prompt_param: str = "prompt") -> ApiError:
    """The answer for a call to the targets that failed (see the module docstring)."""
    code, details = exc.code, exc.details
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        param = scheduler_param(details, prompt_param)
        return ApiError(400, details, param=param, code="invalid_value")
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ApiError(429, details, code="resource_exhausted", retry_after=RETRY_AFTER_S)
    if code is grpc.StatusCode.UNAVAILABLE:
        return ApiError(503, details, code="service_unavailable", retry_after=RETRY_AFTER_S)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, details, code="timeout")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        # The gateway's own credentials towards its targets, not the caller's.
        message = f"the gateway's credentials were refused by its targets ({code.name})"
        return ApiError(502, message, code="upstream_credentials")
    return ApiError(500, f"{code.name}: {details}", code="internal_error")
