"""guidellm, one of the field's load generators (a dev dependency from the
package index), runs a short concurrent profile against ``pagedkv serve
--http-port`` on a tiny llama (one CPU executor), and its JSON report
parses with every request successful, each with the prompt and output
lengths asked for (the server's usage as guidellm read it from the
stream), and nothing left held by the scheduler afterwards.

The profile is slow: guidellm's start (its imports, a client process, the synthetic
prompts) takes 20 to 40 s on two busy cores before the first request.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.executor.tiny_model import make_tiny_model
from tests.gateway.loadgen import Load, parse_args, read_report, run_guidellm, served_model
from tests.gateway.stack import ServeWithGateway, nothing_held, wait_until

LOAD = Load(streams=8, num_requests=32, prompt_tokens=64, output_tokens=16)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("loadgen") / "llama"
    make_tiny_model(path, "llama", seed=3)
    return path


def test_the_recipes_options_reach_the_server_and_the_report() -> None:
    # --device is the serving benchmark's, never taken as short for --device-name.
    argv = ["--streams", "64", "--output", "x.json", "--device-name", "h200"]
    args, bench = parse_args([*argv, "--preset", "llama-1.1b", "--device", "cuda"])
    assert (args.device_name, args.streams, args.waves, args.max_seconds) == ("h200", "64", 2, 90)
    assert (bench.device, bench.preset) == ("cuda", "llama-1.1b")


@pytest.mark.slow
def test_guidellm_profile_succeeds_for_every_request(model: Path, tmp_path: Path) -> None:
    report = tmp_path / "guidellm.json"
    with ServeWithGateway(model, num_blocks=256) as serve:
        name = served_model(serve.url)
        run = run_guidellm(serve.url, name, model, [LOAD], report, worker_processes=1)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
        wait_until(lambda: nothing_held(serve.target), 30, "the scheduler holds nothing")

    (benchmark,) = read_report(json.loads(report.read_text()))
    assert benchmark.streams == LOAD.streams
    counts = (benchmark.num_successful, benchmark.num_errored, benchmark.num_incomplete)
    assert counts == (LOAD.num_requests, 0, 0), benchmark.errors[:3]
    assert benchmark.prompt_tokens == [LOAD.prompt_tokens] * LOAD.num_requests
    assert benchmark.output_tokens == [LOAD.output_tokens] * LOAD.num_requests
    assert benchmark.ttft_ms["p50"] > 0 and benchmark.itl_ms["p50"] > 0
