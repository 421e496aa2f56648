"""docs/sdk.md's examples, as written: every ``python`` block of the page runs
as a program of its own against ``pagedkv serve`` (one CPU executor on the
tiny llama), with ``localhost:50051`` replaced by the server's address and
``localhost:50052`` by a port nothing listens on. The examples assert what
they show."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.executor.tiny_model import make_tiny_model
from tests.docs_blocks import DOCS, code_blocks
from tests.redis_server import free_port
from tests.service.stack import Process, serve

PAGE = DOCS / "sdk.md"
EXAMPLES = code_blocks(PAGE, "python")

PRINTED = {
    "NotConnectedError": (
        "INVALID_ARGUMENT: sampling.top_p",
        "INVALID_ARGUMENT: sampling.max_tokens",
        "ValueError: max_tokens: must be",
        "UNAVAILABLE: no server at 127.0.0.1:",
    ),
}
"""What an example that uses the key must print: each line its comments show
(an example that merely caught nothing would pass otherwise)."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    model = tmp_path_factory.mktemp("sdk-docs") / "llama"
    make_tiny_model(model, "llama", seed=7)
    with serve(model, executors=1, num_blocks=128) as process:
        yield process


def test_the_page_has_an_example_per_part() -> None:
    assert len(EXAMPLES) >= 6
    assert any("AsyncClient" in code for code in EXAMPLES)
    assert any("localhost:50052" in code for code in EXAMPLES)


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_the_example_runs_against_a_real_stack(stack: Process, index: int, tmp_path: Path) -> None:
    code = EXAMPLES[index]
    assert "localhost:50051" in code or "localhost:50052" in code
    code = code.replace("localhost:50051", stack.target)
    code = code.replace("localhost:50052", f"127.0.0.1:{free_port()}")
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, f"example {index}:\n{code}\n{result.stdout}\n{result.stderr}"
    for key, lines in PRINTED.items():
        if key in code:
            for line in lines:
                assert line in result.stdout, f"example {index} did not print {line!r}"
