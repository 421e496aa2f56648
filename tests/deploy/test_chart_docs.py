"""docs/deploy.md's "Rendering and linting without helm", as written: its
shell blocks run in an empty directory that holds the chart where the page
says (``helm/pagedkv``, as from the repository root), with this
environment's ``python`` and ``kubernetes-validate``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.chart import CHART
from tests.docs_blocks import DOCS, code_blocks, run_sh, tool_path

PAGE = DOCS / "deploy.md"
SECTION = "Rendering and linting without helm"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "helm").mkdir()
    (tmp_path / "helm" / "pagedkv").symlink_to(CHART, target_is_directory=True)
    return tmp_path


def steps() -> tuple[str, str, str]:
    values, render, validate = code_blocks(PAGE, "sh", section=SECTION)
    return values, render, validate


def test_the_documented_commands_render_lint_and_validate_the_chart(workdir: Path) -> None:
    values, render, validate = steps()
    run_sh(values, workdir)
    rendered = run_sh(render, workdir).stdout
    assert "Clients call the Scheduler API at llm-pagedkv-router.llm.svc:50051" in rendered
    kinds = {
        doc["kind"]
        for path in (workdir / "rendered").glob("*.yaml")
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    }
    assert {"Deployment", "StatefulSet", "Service", "NetworkPolicy"} <= kinds
    validated = run_sh(validate, workdir).stdout
    assert "statefulset/llm-pagedkv-executor against version 1.30" in validated


def test_the_documented_render_fails_on_values_the_chart_refuses(workdir: Path) -> None:
    _, render, _ = steps()
    (workdir / "values.yaml").write_text("model:\n  name: ''\n")
    result = subprocess.run(
        ["sh", "-e", "-c", render],
        cwd=workdir,
        env={"PATH": tool_path()},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "model.name is required" in result.stdout + result.stderr
    assert not (workdir / "rendered").exists()


def test_the_documented_validation_refuses_an_unknown_field(workdir: Path) -> None:
    *_, validate = steps()
    (workdir / "rendered").mkdir()
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"clusterIp": "None", "ports": [{"port": 1}]},
    }
    (workdir / "rendered" / "service.yaml").write_text(yaml.safe_dump(service))
    result = subprocess.run(
        ["sh", "-e", "-c", validate],
        cwd=workdir,
        env={"PATH": tool_path()},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0, result.stdout
