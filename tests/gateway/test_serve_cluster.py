"""``pagedkv serve --http-port`` in front of a cluster: a private Redis, two
schedulers and a router; the gateway targets the router, answers with
Hugging Face's greedy output, and stops with the stack."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import openai
import pytest

from pagedkv.executor.tiny_model import make_tiny_model
from tests.executor.test_generation import hf_greedy
from tests.gateway.stack import GATEWAY_READY, ServeWithGateway
from tests.gateway.test_openai_client import decode

pytestmark = [
    pytest.mark.slow,  # a cluster started and stopped
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server"),
]


def test_the_gateway_of_a_cluster_targets_its_router(tmp_path: Path) -> None:
    model = tmp_path / "llama"
    make_tiny_model(model, "llama", seed=7)
    extra = ("--redis", "--schedulers", "2", "--routers", "1", "--served-model-name", "tiny")
    with ServeWithGateway(model, num_blocks=128, extra=extra) as stack:
        lines = "".join(stack.lines)
        router = next(line for line in stack.lines if "router 1/1 ready on" in line)
        router_address = router.split("ready on ")[1].split()[0]
        gateway_line = next(line for line in stack.lines if GATEWAY_READY.search(line))
        assert gateway_line.rstrip().endswith(f"1 targets: {router_address})"), lines
        with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0) as client:
            completion = client.completions.create(
                model="tiny", prompt="Hello", max_tokens=10, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
        assert completion.choices[0].text == decode(model, hf_greedy(model, list(b"Hello"), 10))
        stack.process.send_signal(signal.SIGTERM)
        assert stack.process.wait(timeout=120) == 0
