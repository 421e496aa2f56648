"""``pagedkv serve`` hands its executor options to each child executor's command line."""

from __future__ import annotations

from pagedkv.common.cli import build_parser
from pagedkv.scheduler.serve import executor_commands


def _commands(*argv: str) -> list[list[str]]:
    args = build_parser().parse_args(list(argv))
    return executor_commands(args, "/models/m")


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_each_executor_gets_its_own_gpu_and_the_shared_options() -> None:
    commands = _commands(
        "--log-format", "json", "--log-level", "DEBUG",
        "serve", "--device", "cuda", "--executors", "2", "--enforce-eager",
        "--num-blocks", "64", "--max-num-seqs", "8",
    )  # fmt: skip
    assert [_option(c, "--device") for c in commands] == ["cuda:0", "cuda:1"]
    for command in commands:
        assert command[1:3] == ["-m", "pagedkv.executor"]
        assert _option(command, "--model") == "/models/m"
        assert _option(command, "--kernel-backend") == "triton"
        assert _option(command, "--log-format") == "json"
        assert _option(command, "--log-level") == "DEBUG"
        assert _option(command, "--num-blocks") == "64"
        assert _option(command, "--max-num-rows") == "8"
        assert "--enforce-eager" in command


def test_by_default_executors_run_the_torch_kernels_on_the_cpu_with_console_logs() -> None:
    (command,) = _commands("serve")
    assert _option(command, "--device") == "cpu"
    assert _option(command, "--kernel-backend") == "torch"
    assert _option(command, "--log-format") == "console"
    assert "--enforce-eager" not in command and "--num-blocks" not in command
