"""What a new user meets first: a wrong ``--model`` is refused in one line
before anything loads, and every command's --help states its defaults."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from pagedkv.common.cli import ENTRY_POINT_GROUP, build_parser, main

MISSING = "/no/such/dir"


@pytest.fixture
def empty_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, for this process and the ones it starts."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def _cache_model(cache: Path, repo_id: str, files: dict[str, str]) -> None:
    """Lays out ``repo_id`` at revision main as huggingface_hub caches it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)


def _one_line_error(err: str) -> str:
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("command", ["serve", "executor"])
def test_a_missing_model_directory_is_one_line_and_exit_2(
    command: str, empty_hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--model", MISSING]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert line == f"pagedkv {command}: --model {MISSING}: no such directory"


@pytest.mark.parametrize("command", ["serve", "executor"])
def test_a_directory_without_config_json_is_not_a_model(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "weights.bin").write_text("")
    assert main([command, "--model", str(tmp_path)]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert line == f"pagedkv {command}: --model {tmp_path}: not a model directory: no config.json"


def test_a_file_is_not_a_model_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text("{}")
    model = tmp_path / "config.json"
    assert main(["serve", "--model", str(model)]) == 2
    assert _one_line_error(capsys.readouterr().err).endswith(": not a directory")


def test_an_uncached_hub_id_says_it_is_not_in_the_local_cache(
    empty_hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--model", "some-org/some-model"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert line == (
        f"pagedkv serve: --model some-org/some-model: not a directory and not in the Hugging "
        f"Face cache at {empty_hub_cache} (models are not downloaded at run time; set "
        "HF_HUB_CACHE or HF_HOME)"
    )


def test_a_cached_hub_id_passes_and_one_cached_without_config_does_not(
    empty_hub_cache: Path,
) -> None:
    from pagedkv.common.cli import ModelArgumentError, check_model_argument

    _cache_model(empty_hub_cache, "org/cached", {"config.json": "{}"})
    _cache_model(empty_hub_cache, "org/no-config", {"tokenizer.json": "{}"})
    check_model_argument("org/cached")
    with pytest.raises(ModelArgumentError, match=r"no config\.json"):
        check_model_argument("org/no-config")


def test_python_m_pagedkv_executor_refuses_a_missing_model_in_one_line(
    empty_hub_cache: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pagedkv.executor", "--model", MISSING],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    line = _one_line_error(done.stderr)
    assert line == f"pagedkv executor: --model {MISSING}: no such directory"


# --- every command's --help states its defaults -----------------------------------


def _commands() -> list[tuple[str, ...]]:
    """Every command path registered under the ``pagedkv.commands`` entry points."""
    return sorted(tuple(ep.name.split(".")) for ep in entry_points(group=ENTRY_POINT_GROUP))


def _parser_of(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        (subparsers,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = subparsers.choices[name]
    return parser


def _option_entries(help_text: str) -> dict[str, str]:
    """Each option's entry in a --help text (first option string -> its lines joined)."""
    entries: dict[str, str] = {}
    current: str | None = None
    for line in help_text.splitlines():
        match = re.match(r"  (-[\w-]+)", line)
        if match:
            current = match.group(1)
            entries[current] = line.strip()
        elif current is not None and line.startswith("   "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def _has_a_default_worth_showing(action: argparse.Action) -> bool:
    default = action.default
    if not action.option_strings or action.help == argparse.SUPPRESS:
        return False
    return default not in (None, argparse.SUPPRESS) and not isinstance(default, bool | list)


def test_the_commands_are_found() -> None:
    paths = _commands()
    for expected in [("serve",), ("scheduler",), ("executor",), ("generate",), ("stats",)]:
        assert expected in paths
    assert ("bench", "blocks") in paths and ("make-tiny-model",) in paths


@pytest.mark.parametrize("path", [(), *_commands()], ids=lambda p: " ".join(p) or "pagedkv")
def test_every_command_help_states_the_defaults_of_its_options(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*path, "--help"])
    assert exited.value.code == 0
    entries = _option_entries(capsys.readouterr().out)
    parser = _parser_of(path)
    checked = [a for a in parser._actions if _has_a_default_worth_showing(a)]
    for action in checked:
        entry = entries[action.option_strings[0]]
        assert "default" in entry, entry


def test_python_m_pagedkv_executor_help_states_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pagedkv.executor.__main__ import main as executor_main

    with pytest.raises(SystemExit):
        executor_main(["--help"])
    entries = _option_entries(capsys.readouterr().out)
    assert "(default: 16)" in entries["--block-size"]
    assert "(default: 127.0.0.1)" in entries["--host"]
    assert "(default: INFO)" in entries["--log-level"]


# --- make setup -------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_setup_says_what_it_does_and_lets_pip_show_its_progress(tmp_path: Path) -> None:
    # Run as its own make, also under `make test` (no inherited make flags,
    # no "Entering/Leaving directory" lines).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    venv = f"VENV={tmp_path / 'venv'}"
    dry_run = subprocess.run(
        ["make", "--no-print-directory", "--dry-run", "--always-make", "setup", venv],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    lines = dry_run.stdout.splitlines()
    (pip,) = (i for i, line in enumerate(lines) if "pip install" in line)
    assert any(line.startswith('echo "setup: installing') for line in lines[:pip])
    assert "--quiet" not in lines[pip].split() and "-q" not in lines[pip].split()
    assert lines[-1].startswith('echo "setup: done')
