"""The Dockerfiles and their install script agree: each image's builder
copies every part its set installs, the build context lets those files in,
and the final stage runs `pagedkv` as a non-root user. (No container daemon
here: `make image-install-check` runs the install script itself, and
`make lint` runs hadolint.)"""

from __future__ import annotations

import fnmatch
import re

import pytest
import tomllib

from tests.deploy.chart import REPO

DEPLOY = REPO / "deploy"
IMAGES = {"scheduler": "Dockerfile.scheduler", "executor": "Dockerfile.executor"}
TORCH_SIDE = {"torch", "triton", "transformers", "pagedkv-kernels", "pagedkv-executor"}
"""Distributions the torch-free image must not pull in."""


def _stages(dockerfile: str) -> list[list[str]]:
    """The instructions of each stage (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / dockerfile).read_text())
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def _parts(set_name: str) -> list[str]:
    """The part folders deploy/install.sh installs for ``set_name``."""
    script = (DEPLOY / "install.sh").read_text()
    match = re.search(rf'^\s*{set_name}\) parts="([^"]+)"', script, re.MULTILINE)
    assert match, set_name
    return [p.removeprefix("./") for p in match.group(1).split()]


def _ignored(path: str) -> bool:
    """Whether .dockerignore keeps ``path`` out of the build context (its
    patterns in order, the last match deciding, as Docker reads them)."""
    ignored = False
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.removeprefix("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
            ignored = not negated
    return ignored


@pytest.mark.parametrize("set_name", sorted(IMAGES))
def test_the_builder_copies_every_part_it_installs(set_name: str) -> None:
    builder, _ = _stages(IMAGES[set_name])
    copied = {
        source.rstrip("/")
        for line in builder
        if line.startswith("COPY ")
        for source in line.split()[1:-1]
    }
    assert f"RUN sh deploy/install.sh {set_name} /opt/pagedkv" in builder
    for needed in ["constraints.txt", "deploy/install.sh", *_parts(set_name)]:
        assert any(needed == c or needed.startswith(c + "/") for c in copied), needed
        assert (REPO / needed).exists()
        assert not _ignored(needed), f".dockerignore leaves out {needed}"


def test_the_scheduler_set_leaves_out_the_torch_parts() -> None:
    assert not {"kernels", "services/executor"} & set(_parts("scheduler"))
    assert {"kernels", "services/executor"} <= set(_parts("executor"))


def test_both_sets_install_the_gateway() -> None:
    """`pagedkv gateway` runs from the torch-free image (the chart's gateway
    Deployment uses it) and from the executor image, which has every part."""
    for set_name in IMAGES:
        assert "services/gateway" in _parts(set_name)


@pytest.mark.parametrize("part", _parts("scheduler"))
def test_no_part_of_the_scheduler_set_depends_on_torch(part: str) -> None:
    """What keeps torch out of the image is each part's own dependency list
    (`make image-install-check` proves the installed result)."""
    project = tomllib.loads((REPO / part / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert not names & TORCH_SIDE, part


@pytest.mark.parametrize("dockerfile", sorted(IMAGES.values()))
def test_the_final_stage_runs_pagedkv_as_a_non_root_user(dockerfile: str) -> None:
    final = _stages(dockerfile)[-1]
    assert "COPY --from=builder /opt/pagedkv /opt/pagedkv" in final
    assert 'ENTRYPOINT ["pagedkv"]' in final
    users = [line.split()[1] for line in final if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert not any("pip install" in line for line in final)
    assert any(line.startswith("LABEL org.opencontainers.image.title=") for line in final)


def test_tests_and_local_state_stay_out_of_the_build_context() -> None:
    for path in ("tests", ".venv", ".git", "helm", "shared/pagedkv/__pycache__"):
        assert _ignored(path), path
