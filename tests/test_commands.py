"""The ``pagedkv`` command offers only what can run where it is installed: a
command whose register function does not import, or that ``requires`` a part
that is not installed, is left out; a scheduler-only install (the torch-free
set of the scheduler image) lists the scheduler side's commands and no
other."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib.metadata import EntryPoint
from typing import Any

import pytest

from pagedkv.common.cli import ENTRY_POINT_GROUP, available_commands, main, requires
from tests.test_first_contact import _commands, _option_entries, _parser_of

MISSING_PART = "pagedkv.no_such_part"


def register_plain(subparsers: Any, name: str) -> None:
    subparsers.add_parser(name)


@requires(MISSING_PART)
def register_needing_a_missing_part(subparsers: Any, name: str) -> None:
    subparsers.add_parser(name)


@requires("pagedkv.scheduler", "grpc")
def register_needing_installed_parts(subparsers: Any, name: str) -> None:
    subparsers.add_parser(name)


def _point(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


def test_commands_that_cannot_run_here_are_left_out() -> None:
    points = [
        _point("plain", f"{__name__}:register_plain"),
        _point("bench.needs-missing", f"{__name__}:register_needing_a_missing_part"),
        _point("bench.needs-installed", f"{__name__}:register_needing_installed_parts"),
        _point("broken", f"{MISSING_PART}.cli:register"),
    ]
    found = available_commands(points)
    assert found == [
        (("bench", "needs-installed"), register_needing_installed_parts),
        (("plain",), register_plain),
    ]


HIDE_THE_EXECUTOR_SIDE = """
import importlib.abc, sys

class Absent(importlib.abc.MetaPathFinder):
    # as in the scheduler image: no executor, no kernels, no torch
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton", "transformers") or name.startswith(
            ("pagedkv.executor", "pagedkv.kernels")
        ):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Absent())
from pagedkv.common.cli import main
sys.exit(main(sys.argv[1:]))
"""

SCHEDULER_SIDE_COMMANDS = ["bench", "demo", "gateway", "generate", "router", "scheduler", "stats"]
SCHEDULER_SIDE_BENCHMARKS = ["blocks", "cluster-sim", "host-tier"]


def _listed(help_text: str) -> list[str]:
    """The command names of a --help text's COMMAND list."""
    lines = help_text.split("positional arguments:")[1].split("options:")[0].splitlines()
    return [match.group(1) for line in lines if (match := re.match(r"    (\S+)", line))]


def _pagedkv_without_the_executor_side(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", HIDE_THE_EXECUTOR_SIDE, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


def test_a_scheduler_only_install_lists_only_the_commands_it_can_run() -> None:
    top = _pagedkv_without_the_executor_side("--help").stdout
    assert _listed(top) == SCHEDULER_SIDE_COMMANDS
    bench = _pagedkv_without_the_executor_side("bench", "--help").stdout
    assert _listed(bench) == SCHEDULER_SIDE_BENCHMARKS
    for command in [*SCHEDULER_SIDE_COMMANDS, *(f"bench {b}" for b in SCHEDULER_SIDE_BENCHMARKS)]:
        _pagedkv_without_the_executor_side(*command.split(), "--help")


def test_the_demo_without_a_target_says_the_executors_are_not_installed() -> None:
    command = [sys.executable, "-c", HIDE_THE_EXECUTOR_SIDE, "demo"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "pagedkv demo: without --target it starts pagedkv serve, whose executors are not "
        "installed here (pagedkv-executor); give --target HOST[:PORT]"
    ]


def test_the_full_install_lists_every_command() -> None:
    from pagedkv.common.cli import build_parser

    parser = build_parser()
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {"serve", "executor", "make-tiny-model", "scheduler", "router"} <= set(commands.choices)


# --- every option's --help says what happens without it -----------------------------


def _takes_a_value_and_may_be_left_out(action: argparse.Action, parser: Any) -> bool:
    if not action.option_strings or action.help == argparse.SUPPRESS or action.nargs == 0:
        return False
    required_groups = [g for g in parser._mutually_exclusive_groups if g.required]
    return not action.required and not any(action in g._group_actions for g in required_groups)


@pytest.mark.parametrize("path", [(), *_commands()], ids=lambda p: " ".join(p) or "pagedkv")
def test_every_option_that_can_be_left_out_says_its_default(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    """Also options without a value to show (None): their help says what
    leaving them out means ("default: ..." or "without it ...")."""
    with pytest.raises(SystemExit):
        main([*path, "--help"])
    entries = _option_entries(capsys.readouterr().out)
    parser = _parser_of(path)
    silent = [
        entries[action.option_strings[0]]
        for action in parser._actions
        if _takes_a_value_and_may_be_left_out(action, parser)
        and not re.search(r"default|without it", entries[action.option_strings[0]])
    ]
    assert silent == []
