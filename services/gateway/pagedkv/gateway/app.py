"""The gateway's ASGI app (FastAPI): its routes, bearer tokens and errors.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST
/v1/chat/completions`` (with ``--auth-token-file``, these need
``Authorization: Bearer <token>``, compared in constant time), ``GET
/health`` (200 while a target serves, else 503; how many serve, never
their addresses) and ``GET /metrics`` (Prometheus), both open. Every
error is an ``ApiError`` in OpenAI's shape, unknown routes included.
Bodies are parsed by the request models of ``protocol`` (not by FastAPI's
own validation, which answers 422).

``GatewayState`` holds what lives as long as the app: one ``AsyncClient``
over every target (one channel each, streams resumed as the SDK does), the
targets' health, the chat template, the tokenizer's token strings and the
metrics. It is made in the app's lifespan, inside the serving event loop.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from pagedkv.client import AsyncClient
from pagedkv.common.bearer_tokens import TokenFile, presented_token
from pagedkv.common.logging import get_logger
from pagedkv.common.security import TlsConfig
from pagedkv.gateway.chat import ChatFormat, render
from pagedkv.gateway.chat_template import ChatTemplate
from pagedkv.gateway.completions import CompletionFormat
from pagedkv.gateway.errors import ApiError, from_validation, unsupported
from pagedkv.gateway.fastpath import GatewayApp
from pagedkv.gateway.health import TargetHealth
from pagedkv.gateway.logprobs import TokenStrings
from pagedkv.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from pagedkv.gateway.protocol import ChatCompletionRequest, CompletionRequest, check_supported
from pagedkv.gateway.responses import Exchange
from pagedkv.gateway.sampling import chat_generate_request, completion_requests
from pagedkv.gateway.streaming import Generation

log = get_logger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    """What a gateway serves and how it reaches its targets.

    ``model_dir``: the model's directory (its tokenizer and chat template);
    ``served_model_names``: the names requests may give as ``model``, all
    listed by ``/v1/models``; ``auth_tokens``: the bearer tokens
    callers must present (None: none needed); ``tls`` and ``target_token``:
    the gateway's own credentials towards the targets. ``template`` and
    ``strings`` are read from ``model_dir`` by ``from_model_dir``."""

    targets: tuple[str, ...]
    model_dir: Path
    served_model_names: tuple[str, ...]
    auth_tokens: TokenFile | None = None
    tls: TlsConfig | None = None
    target_token: TokenFile | None = None
    template: ChatTemplate | None = None
    strings: TokenStrings | None = None

    @classmethod
    def from_model_dir(cls, model_dir: Path, **fields: Any) -> GatewayConfig:
        """The config with the chat template and token strings of
        ``model_dir``; ChatTemplateError (a ValueError) for a template that
        does not compile."""
        return cls(
            model_dir=model_dir,
            template=ChatTemplate.from_model_dir(model_dir),
            strings=TokenStrings.from_model_dir(model_dir),
            **fields,
        )


class GatewayState:
    """The app's long-lived parts (see the module docstring). Owns the
    client's and the health checks' channels (``close``)."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.config = config
        self.metrics = metrics
        token = None if config.target_token is None else config.target_token.first()
        self.client = AsyncClient(config.targets, tls=config.tls, token=token)
        self.health = TargetHealth(config.targets, config.tls)
        self.template = config.template
        self.strings = config.strings
        self.created = int(time.time())

    async def close(self) -> None:
        await self.client.close()
        await self.health.close()


def _authorize(state: GatewayState, request: Request) -> None:
    tokens = state.config.auth_tokens
    if tokens is None:
        return
    token = presented_token(request.headers.items())
    if token is None or not tokens.accepts(token):
        why = "no bearer token" if token is None else "the bearer token is not accepted"
        raise ApiError(401, f"{why} (send Authorization: Bearer <token>)", code="invalid_api_key")


def _check_model(state: GatewayState, model: str) -> None:
    if model not in state.config.served_model_names:
        served = ", ".join(state.config.served_model_names)
        raise ApiError(
            404,
            f"model: the model `{model}` does not exist (served: {served})",
            param="model",
            code="model_not_found",
        )


def _num_prompt_tokens(state: GatewayState, prompts: list[str | Sequence[int]]) -> int:
    """The prompts' tokens, as the scheduler will count them."""
    num = 0
    for prompt in prompts:
        if not isinstance(prompt, str):
            num += len(prompt)
        elif state.strings is not None:
            num += state.strings.num_tokens(prompt)
    return num


def create_app(config: GatewayConfig, metrics: GatewayMetrics | None = None) -> GatewayApp:
    """The gateway app for ``config``; its state is made when it starts.
    The generation routes are ``GatewayApp``'s own; FastAPI serves the rest."""
    metrics = metrics if metrics is not None else GatewayMetrics()
    holder: dict[str, GatewayState] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        holder["state"] = GatewayState(config, metrics)
        try:
            yield
        finally:
            await holder.pop("state").close()

    app = FastAPI(
        title="pagedkv gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )

    def answered(endpoint: str, response: Response) -> Response:
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        return answered("other", error.response())

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("request failed", path=request.url.path, error=repr(exc))
        error = ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error")
        return answered("other", error.response())

    @app.get("/health")
    async def health() -> Response:
        health = holder["state"].health
        serving = await health.serving()
        body = {"num_serving": len(serving), "num_targets": len(health.targets)}
        return answered("health", JSONResponse(body, status_code=200 if serving else 503))

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        state = holder["state"]
        try:
            _authorize(state, request)
        except ApiError as exc:
            return answered("models", exc.response())
        data = [
            {"id": name, "object": "model", "created": state.created, "owned_by": "pagedkv"}
            for name in state.config.served_model_names
        ]
        return answered("models", JSONResponse({"object": "list", "data": data}))

    async def generate(request: Request, endpoint: str) -> Response:
        return await _generate(holder["state"], request, endpoint)

    return GatewayApp(app, generate, metrics)


async def _generate(state: GatewayState, request: Request, endpoint: str) -> Response:
    """Answers a completion or chat request (see ``responses``)."""
    started = time.perf_counter()
    try:
        _authorize(state, request)
        body = await request.body()
        try:
            parsed: CompletionRequest | ChatCompletionRequest
            if endpoint == "chat":
                parsed = ChatCompletionRequest.model_validate_json(body)
            else:
                parsed = CompletionRequest.model_validate_json(body)
        except pydantic.ValidationError as exc:
            raise from_validation(exc) from None
        check_supported(parsed)
        _check_model(state, parsed.model)
        logprobs = parsed.logprobs is True or type(parsed.logprobs) is int
        if logprobs and state.strings is None:
            raise unsupported("logprobs", "this model has no tokenizer.json to name the tokens")
        created = int(time.time())
        fmt: CompletionFormat | ChatFormat
        if isinstance(parsed, ChatCompletionRequest):
            request_id = f"chatcmpl-{uuid.uuid4().hex}"
            prompt = render(state.template, parsed)
            requests = [chat_generate_request(parsed, prompt, request_id)]
            generation = Generation(state.client, requests, parsed.n, "messages")
            fmt = ChatFormat(
                request_id, created, parsed.model, parsed.n, state.strings, parsed.logprobs
            )
        else:
            request_id = f"cmpl-{uuid.uuid4().hex}"
            requests = completion_requests(parsed, request_id)
            generation = Generation(state.client, requests, parsed.n)
            fmt = CompletionFormat(
                request_id,
                created,
                parsed.model,
                generation.num_choices,
                state.strings,
                parsed.logprobs is not None,
            )
        exchange = Exchange(endpoint, generation, fmt, state.metrics, started)
        if not parsed.stream:
            return await exchange.whole(request)
        prompt_tokens = None
        if parsed.continuous_usage():
            prompt_tokens = _num_prompt_tokens(state, [r.text or r.token_ids.ids for r in requests])
        return await exchange.stream(request, parsed.include_usage(), prompt_tokens)
    except ApiError as exc:
        if exc.status >= 500:
            log.warning("request failed", endpoint=endpoint, status=exc.status, error=exc.message)
        return exc.response()
