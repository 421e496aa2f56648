"""The gateway's credentials towards its targets: ``pagedkv serve
--http-port`` on a stack closed with mutual TLS and bearer tokens gives its
gateway the stack's token and the client certificate, so HTTP callers with
a token get answers; a gateway without the token is refused by the
scheduler (502: its own credentials), one without TLS cannot connect (503)."""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx
import openai
import pytest

from pagedkv.executor.tiny_model import make_tiny_model
from tests.gateway.stack import Gateway, ServeWithGateway
from tests.security.conftest import Pki, pki

__all__ = ["pki"]  # the module fixture of the security tests

MODEL = "tiny"


def test_a_closed_stack_answers_callers_with_a_token(tmp_path: Path, pki: Pki) -> None:
    model = tmp_path / "llama"
    make_tiny_model(model, "llama", seed=7)
    token = f"tok-{secrets.token_hex(8)}"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{token}\n")
    closed = (
        "--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key),
        "--tls-ca", str(pki.ca), "--auth-token-file", str(tokens),
        "--scheduler-tls-ca", str(pki.ca), "--scheduler-tls-cert", str(pki.client.cert),
        "--scheduler-tls-key", str(pki.client.key), "--served-model-name", MODEL,
    )  # fmt: skip
    with ServeWithGateway(model, num_blocks=64, extra=closed) as stack:
        with openai.OpenAI(base_url=f"{stack.url}/v1", api_key=token, max_retries=0) as client:
            done = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert done.usage is not None and done.usage.prompt_tokens == 2
        with (
            openai.OpenAI(base_url=f"{stack.url}/v1", api_key="wrong", max_retries=0) as client,
            pytest.raises(openai.AuthenticationError),
        ):
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        tls = ("--tls-ca", str(pki.ca), "--tls-cert", str(pki.client.cert))
        tls += ("--tls-key", str(pki.client.key), "--served-model-name", MODEL)
        with Gateway(stack.target, model, tls) as no_token:
            refused = httpx.post(f"{no_token.url}/v1/completions", json=body, timeout=60)
            assert refused.status_code == 502, refused.text
            assert refused.json()["error"]["code"] == "upstream_credentials"
        plain = ("--token-file", str(tokens), "--served-model-name", MODEL)
        with Gateway(stack.target, model, plain) as no_tls:
            refused = httpx.post(f"{no_tls.url}/v1/completions", json=body, timeout=60)
            assert refused.status_code == 503, refused.text
            assert httpx.get(f"{no_tls.url}/health").status_code == 503
