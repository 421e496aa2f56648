"""Every container's command line in the rendered chart parses with the real
`pagedkv` CLI (the parsers the installed parts register), without running
anything: no flag the CLI lacks, no value it refuses."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from typing import Any

import pytest

from pagedkv.common.cli import build_parser
from tests.deploy.chart import VALUE_SETS, manifests_of, workloads

ENV_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
EXAMPLE_ENV = {"POD_NAME": "demo-pagedkv-executor-3", "POD_IP": "10.1.2.3"}
"""Values for the fieldRef variables Kubernetes substitutes into args."""


def _expanded(args: list[str], defined: set[str]) -> list[str]:
    """``args`` with $(VAR) replaced as the kubelet does; a reference to a
    variable the container does not define would stay literal, so it fails."""

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        assert name in defined, f"$({name}) is not in the container's env"
        return EXAMPLE_ENV[name]

    return [ENV_REFERENCE.sub(substitute, arg) for arg in args]


def _parse(args: list[str]) -> argparse.Namespace:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"pagedkv {' '.join(args)}\n{stderr.getvalue()}")


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_container_command_line_parses_with_the_pagedkv_cli(name: str) -> None:
    for workload in workloads(manifests_of(name)):
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        assert "command" not in container  # the image's ENTRYPOINT is `pagedkv`
        defined = {e["name"] for e in container["env"]}
        parsed: Any = _parse(_expanded(container["args"], defined))
        assert parsed.command == component
        assert callable(parsed.handler)
        assert parsed.host == "0.0.0.0"
        assert parsed.log_format == "json"
        if component == "executor":
            assert parsed.advertise_address.startswith("demo-pagedkv-executor-3.")
        if component == "scheduler":
            assert parsed.advertise_address == "10.1.2.3:50051"
            assert parsed.executors == []  # executors come from Redis


def test_a_flag_the_cli_lacks_fails_the_parse() -> None:
    """So the test above means something."""
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments: --no-such-flag"):
        _parse(["scheduler", "--no-such-flag", "1"])
