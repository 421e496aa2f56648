"""``pagedkv serve``: the options it hands each child executor, and what a running one
shows and binds."""

from __future__ import annotations

import argparse
import re
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pagedkv.common.bearer_tokens import bearer_metadata
from pagedkv.common.cli import build_parser, main
from pagedkv.scheduler.child_commands import executor_commands, router_commands, scheduler_commands
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.cluster.cluster_stack import wait_until
from tests.processes import ServedProcess
from tests.test_first_contact import _option_entries


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
        assert "--no-progress" in command  # serve reports start-up itself


def test_by_default_executors_run_the_torch_kernels_on_the_cpu_with_console_logs() -> None:
    (command,) = _commands("serve")
    assert _option(command, "--device") == "cpu"
    assert _option(command, "--kernel-backend") == "torch"
    assert _option(command, "--log-format") == "console"
    assert "--enforce-eager" not in command and "--num-blocks" not in command


# --- a running `pagedkv serve` ------------------------------------------------


@pytest.fixture(scope="module")
def served() -> Iterator[ServedProcess]:
    """``pagedkv serve`` with two executors on a tiny model, metrics on a free port."""
    command = [sys.executable, "-m", "pagedkv.common.cli", "serve", "--executors", "2"]
    command += ["--num-blocks", "16", "--host", "127.0.0.1", "--port", "0"]
    command += ["--metrics-port", "0"]
    with ServedProcess(command) as process:
        yield process


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of this machine's TCP sockets listening on ``port``
    (from /proc/net/tcp and tcp6: IPv4 as dotted quads, IPv6 as hex)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            next(rows)
            for row in rows:
                local, state = row.split()[1], row.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    if len(address) == 8:
                        address = socket.inet_ntoa(struct.pack("<I", int(address, 16)))
                    found.add(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's socket table")
def test_metrics_listen_on_the_host_given_not_on_every_interface(served: ServedProcess) -> None:
    match = re.search(r"metrics on :(\d+)", served.ready_line)
    assert match is not None, served.ready_line
    assert _listening_addresses(int(match.group(1))) == {"127.0.0.1"}


def test_start_up_is_one_labelled_ready_line_per_executor_without_progress_bars(
    served: ServedProcess,
) -> None:
    stderr = served.stderr()
    lines = [line for line in stderr.splitlines() if re.search(r"\] executor ready\b", line)]
    fields = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines]
    assert sorted(f["executor"] for f in fields) == ["1/2", "2/2"]
    ready = [(f["address"], f["executor"]) for f in fields]
    stats = scheduler_pb2_grpc.SchedulerStub(served.channel).GetStats(
        scheduler_pb2.GetStatsRequest()
    )
    assert {address for address, _ in ready} == {ex.address for ex in stats.executors}
    assert "Loading weights" not in stderr  # transformers' bars are off too
    assert "\r" not in stderr  # and the executors' own start-up bars


def test_an_executor_that_exits_early_is_one_line_not_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedkv.scheduler import serve, serve_arguments

    def commands(args: argparse.Namespace, model: str) -> list[list[str]]:
        return [[sys.executable, "-c", "import sys; sys.exit(3)"]]

    monkeypatch.setattr(serve, "executor_commands", commands)
    model = Path(__file__).parent  # any directory will do once the check passes
    monkeypatch.setattr(serve_arguments, "check_model_argument", lambda model: None)
    assert main(["serve", "--model", str(model)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        "pagedkv serve: executor 1/1 exited with status 3 before it was ready (its log is above)"
    )


# --- options `pagedkv serve` takes and hands on ------------------------------------


def test_model_is_also_positional_and_reaches_the_executors(tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "/models/m", "--max-model-len", "512"])
    assert args.model_path == "/models/m"
    (command,) = executor_commands(args, "/models/m")
    assert _option(command, "--max-model-len") == "512"
    args = build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.5"])
    (command,) = executor_commands(args, "/models/m")
    assert _option(command, "--gpu-memory-utilization") == "0.5"
    assert "--max-model-len" not in command  # the executors' own default
    assert "--host-kv-gib" not in command  # no host tier unless asked
    args = build_parser().parse_args(["serve", "--host-kv-gib", "0.25"])
    (command,) = executor_commands(args, "/models/m")
    assert _option(command, "--host-kv-gib") == "0.25"
    assert "--kv-cache-rotation" not in command  # the executors' own default
    args = build_parser().parse_args(["serve", "--kv-cache-rotation", "none"])
    (command,) = executor_commands(args, "/models/m")
    assert _option(command, "--kv-cache-rotation") == "none"


ROUTERS_UNDER_MUTUAL_TLS = [
    "--redis-url", "redis://127.0.0.1:6379/0", "--routers", "1",
    "--tls-cert", "/c", "--tls-key", "/k", "--tls-ca", "/ca", "--scheduler-tls-ca", "/ca",
]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--executors", "0"], "--executors 0: at least 1"),
        (["/a", "--model", "/b"], "MODEL /a and --model /b: give one"),
        (
            ["--num-blocks", "8", "--gpu-memory-utilization", "0.5"],
            "give --num-blocks or --gpu-memory-utilization, not both",
        ),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5: must be in (0, 1]"),
        (["--max-model-len", "0"], "--max-model-len 0: at least 1"),
        (["--host-kv-gib", "-1"], "--host-kv-gib -1.0: at least 0"),
        (["--tls-cert", "/no/cert"], "--tls-cert and --tls-key go together: give both or neither"),
        (
            ["--redis-password-file", "/p"],
            "--redis-password-file and --redis-tls-ca need --redis-url",
        ),
        (
            ROUTERS_UNDER_MUTUAL_TLS,
            "--routers with --tls-ca needs --scheduler-tls-cert and --scheduler-tls-key (the "
            "client certificate the routers present to the schedulers, which require one)",
        ),
    ],
)
def test_wrong_options_are_refused_up_front_naming_the_option(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"pagedkv serve: {error}"


def test_a_positional_model_is_checked_like_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "/no/such/model"]) == 2
    assert capsys.readouterr().err.startswith("pagedkv serve: --model /no/such/model: no such")


def test_child_schedulers_and_routers_get_the_security_options(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "serve", "--redis-url", "redis://127.0.0.1:6379/0", "--schedulers", "2",
            "--routers", "2", "--port", "6000", "--health-port", "7000",
            "--redis-password-file", "/s/pw", "--tls-cert", "/s/cert", "--tls-key", "/s/key",
            "--tls-ca", "/s/ca", "--auth-token-file", "/s/tokens",
            "--scheduler-tls-ca", "/s/ca", "--scheduler-tls-cert", "/s/client",
            "--scheduler-tls-key", "/s/client-key",
        ]
    )  # fmt: skip
    (scheduler,) = scheduler_commands(args, "/models/m", args.redis_url)
    routers = router_commands(args, "/models/m", args.redis_url)
    for command in [scheduler, *routers]:
        assert _option(command, "--redis-url") == "redis://127.0.0.1:6379/0"
        assert _option(command, "--redis-password-file") == "/s/pw"
        assert _option(command, "--tls-cert") == "/s/cert"
        assert _option(command, "--tls-key") == "/s/key"
        assert _option(command, "--tls-ca") == "/s/ca"
        assert _option(command, "--auth-token-file") == "/s/tokens"
    # routers first (7000, 7001), the scheduler here (7002), then the children
    assert [_option(c, "--health-port") for c in routers] == ["7000", "7001"]
    assert _option(scheduler, "--health-port") == "7003"
    for router in routers:
        assert _option(router, "--scheduler-tls-ca") == "/s/ca"
        assert _option(router, "--scheduler-tls-cert") == "/s/client"
        assert _option(router, "--scheduler-tls-key") == "/s/client-key"
        assert _option(router, "--scheduler-token-file") == "/s/tokens"
    for command in executor_commands(args, "/models/m"):
        assert _option(command, "--redis-password-file") == "/s/pw"
        assert "--tls-cert" not in command  # executors listen on 127.0.0.1, for the stack


def test_child_schedulers_get_the_host_tier_s_scheduler_options() -> None:
    args = build_parser().parse_args(
        [
            "serve", "--redis-url", "redis://127.0.0.1:6379/0", "--schedulers", "2",
            "--host-kv-gib", "4", "--host-loads", "never", "--host-offload", "eviction",
        ]
    )  # fmt: skip
    (scheduler,) = scheduler_commands(args, "/models/m", args.redis_url)
    assert _option(scheduler, "--host-loads") == "never"
    assert _option(scheduler, "--host-offload") == "eviction"


def test_help_states_what_options_without_a_value_default_to(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    entries = _option_entries(out)
    for option in ("--num-blocks", "--metrics-port", "--gpu-memory-utilization", "--max-model-len"):
        assert "default" in entries[option], entries[option]
    assert "[MODEL]" in out


def test_each_executor_is_reported_starting_before_it_is_ready(served: ServedProcess) -> None:
    lines = [line for line in served.stderr().splitlines() if "] executor starting" in line]
    fields = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines]
    assert sorted(f["executor"] for f in fields) == ["1/2", "2/2"]
    assert all(f["pid"].isdigit() for f in fields)


def test_serve_closes_its_scheduler_with_the_token_file_given(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("serve-token-1\n")
    command = [sys.executable, "-m", "pagedkv.common.cli", "serve", "--num-blocks", "16"]
    command += ["--port", "0", "--auth-token-file", str(tokens)]
    with ServedProcess(command) as process:
        stub = scheduler_pb2_grpc.SchedulerStub(process.channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stats = stub.GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=30, metadata=bearer_metadata("serve-token-1")
        )
        assert len(stats.executors) == 1


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads Linux's /proc")
def test_a_signal_while_executors_start_stops_them_and_says_so(tmp_path: Path) -> None:
    log = tmp_path / "stderr"
    command = [sys.executable, "-m", "pagedkv.common.cli", "serve", "--executors", "2"]
    with log.open("w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            wait_until(lambda: log.read_text().count("executor starting") == 2, timeout=120)
            pids = [int(p) for p in re.findall(r"executor starting .*pid=(\d+)", log.read_text())]
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=120) == 1
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert log.read_text().splitlines()[-1] == "pagedkv serve: stopped before it was ready"
    for pid in pids:
        wait_until(lambda pid=pid: not _running(pid), timeout=60)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
