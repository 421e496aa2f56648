"""The `pagedkv` command.

Each part contributes its subcommands through the ``pagedkv.commands`` entry
point group, so the CLI offers exactly what is installed (a scheduler image has
no executor commands). An entry point's name is the command path with dots
(``bench.blocks`` is ``pagedkv bench blocks``); its value is a function
``register(subparsers, name)`` that adds a parser called ``name`` to the given
argparse subparsers, with its arguments and help, and sets ``handler`` (a
function of the parsed namespace returning an exit code) with
``parser.set_defaults``. Register functions must import nothing heavy:
the command's own module is imported only when it runs. Every option's
default is stated in --help (``show_defaults``), so help texts need not
repeat it.

A command that runs only where some other part is installed (``pagedkv
serve`` starts executors) says so with ``@requires("pagedkv.executor")`` on
its register function; ``available_commands`` leaves out such commands, and
those whose register function does not import, so a scheduler image lists
only what it can run.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from pagedkv.common.logging import configure_logging
from pagedkv.common.model_source import ModelNotFound, resolve_model

ENTRY_POINT_GROUP = "pagedkv.commands"

DEFAULT_SCHEDULER_PORT = 50051
"""Where ``pagedkv serve`` and ``pagedkv scheduler`` listen unless ``--port``
says otherwise, and so the port of a client target that names none."""

Handler = Callable[[argparse.Namespace], int]
Register = Callable[[Any, str], None]

_REQUIRED_MODULES = "required_modules"
"""The attribute ``requires`` sets on a register function."""


def requires(*modules: str) -> Callable[[Register], Register]:
    """Marks a register function whose command runs only where every one of
    ``modules`` (a part of pagedkv, a library) is installed; elsewhere the
    command is not offered (see ``available_commands``)."""

    def mark(register: Register) -> Register:
        setattr(register, _REQUIRED_MODULES, modules)
        return register

    return mark


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it (its
    parent packages are imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_commands(points: Iterable[EntryPoint]) -> list[tuple[tuple[str, ...], Register]]:
    """The commands of ``points`` (entry points of ``ENTRY_POINT_GROUP``) that
    can run here, as (command path, register function), by name: those
    whose register function imports and whose ``requires`` modules are all
    installed. What is left out is logged at DEBUG."""
    found = []
    for point in sorted(points, key=lambda p: p.name):
        try:
            register = point.load()
        except ImportError as exc:
            logging.getLogger(__name__).debug("command %s left out: %s", point.name, exc)
            continue
        missing = [m for m in getattr(register, _REQUIRED_MODULES, ()) if not installed(m)]
        if missing:
            logging.getLogger(__name__).debug(
                "command %s left out: %s not installed", point.name, ", ".join(missing)
            )
            continue
        found.append((tuple(point.name.split(".")), register))
    return found


def target_with_port(target: str) -> str:
    """A Scheduler target as gRPC takes it: ``HOST`` and ``[IPV6]`` get
    ``DEFAULT_SCHEDULER_PORT`` (gRPC alone would take 443); ``HOST:PORT``
    and URIs with a scheme (``dns:///host:port``, ``unix:/path``) are kept."""
    if ":" not in target or (target.startswith("[") and target.endswith("]")):
        return f"{target}:{DEFAULT_SCHEDULER_PORT}"
    return target


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--log-format``, for ``configure_logging``."""
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument(
        "--log-format",
        default="console",
        choices=("console", "json"),
        help="json: one JSON object per line, for log collectors",
    )


def add_server_tls_arguments(parser: argparse.ArgumentParser, *, clients: str) -> None:
    """``--tls-cert``, ``--tls-key`` and ``--tls-ca`` of a server (read by
    ``pagedkv.common.security.server_tls_from_args``); ``clients`` says who
    ``--tls-ca`` lets in."""
    group = parser.add_argument_group("TLS (see docs/security.md)")
    group.add_argument(
        "--tls-cert",
        metavar="PATH",
        help="PEM certificate to serve TLS with; without it, plaintext",
    )
    group.add_argument(
        "--tls-key", metavar="PATH", help="PEM private key of --tls-cert (default: none)"
    )
    group.add_argument(
        "--tls-ca",
        metavar="PATH",
        help=f"PEM CA: only {clients} with a certificate it signed get through (mutual TLS); "
        "without it, any client",
    )
    group.add_argument(
        "--health-port",
        type=int,
        metavar="PORT",
        help="also serve grpc.health.v1 alone, in plaintext, on this port of --host (for "
        "Kubernetes' gRPC probes, which speak no TLS; default: none, health on the main port "
        "only)",
    )


def add_client_tls_arguments(parser: argparse.ArgumentParser, prefix: str, peers: str) -> None:
    """``--{prefix}tls-ca``, ``-cert``, ``-key`` and ``-server-name`` of a
    client of ``peers`` (read by ``pagedkv.common.security.client_tls_from_args``)."""
    group = parser.add_argument_group(f"TLS towards {peers} (see docs/security.md)")
    group.add_argument(
        f"--{prefix}tls-ca",
        metavar="PATH",
        help=f"PEM CA that signed the {peers}' certificates; turns TLS on towards them "
        "(default: none, plaintext)",
    )
    group.add_argument(
        f"--{prefix}tls-cert",
        metavar="PATH",
        help=f"PEM client certificate presented to the {peers} (mutual TLS; default: none)",
    )
    group.add_argument(
        f"--{prefix}tls-key", metavar="PATH", help=f"PEM key of --{prefix}tls-cert (default: none)"
    )
    group.add_argument(
        f"--{prefix}tls-server-name",
        metavar="NAME",
        help=f"the name the {peers}' certificates are checked against, for addresses no "
        "certificate can name, such as pod IPs (default: the host dialled)",
    )


def add_auth_token_argument(parser: argparse.ArgumentParser) -> None:
    """``--auth-token-file`` of a server of the client-facing API."""
    parser.add_argument(
        "--auth-token-file",
        metavar="PATH",
        help="accepted bearer tokens, one per line (# comments); every call but health needs "
        "authorization: Bearer <one of them>; re-read when the file changes (default: none, "
        "no token needed)",
    )


def add_redis_secret_arguments(parser: argparse.ArgumentParser) -> None:
    """``--redis-password-file`` and ``--redis-tls-ca`` (read by
    ``pagedkv.cluster.connection.redis_url_with``)."""
    parser.add_argument(
        "--redis-password-file",
        metavar="PATH",
        help="file holding the Redis password (its first line); overrides the URL's "
        "(default: the URL's, if any)",
    )
    parser.add_argument(
        "--redis-tls-ca",
        metavar="PATH",
        help="PEM CA that signed Redis' certificate, for a rediss:// --redis-url (default: "
        "the URL's ssl_ca_certs, else the system's CAs)",
    )


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Makes --help state the default of every option of ``parser`` and of
    its subcommands, at any depth: "(default: X)" is added to the help of
    each option whose default is a value (not None, a flag's False or an
    empty list) unless its help already speaks of a default. Mutates the
    parsers' actions; call it once the parser is complete."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                show_defaults(subparser)
            continue
        default, help_text = action.default, action.help or ""
        if (
            not action.option_strings
            or help_text == argparse.SUPPRESS
            or default in (None, argparse.SUPPRESS)
            or isinstance(default, bool | list)
            or "default" in help_text
        ):
            continue
        action.help = f"{help_text} (default: %(default)s)".lstrip()


class ModelArgumentError(ValueError):
    """A ``--model`` argument that names no loadable model; the message is one
    line saying what is wrong."""


def check_model_argument(model: str) -> None:
    """Checks that ``model`` names a model the executors can load offline.

    A model is a directory holding ``config.json``, or a Hugging Face hub id
    (``name`` or ``org/name``) whose snapshot in the local hub cache holds
    one (see ``pagedkv.common.model_source``): models are never downloaded
    at run time. Reads the file system only. Raises ``ModelArgumentError``.
    """
    try:
        path = resolve_model(model)
    except ModelNotFound as exc:
        raise ModelArgumentError(str(exc)) from None
    if not (path / "config.json").is_file():
        raise ModelArgumentError("not a model directory: no config.json")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand that can run here
    (``available_commands``)."""
    parser = argparse.ArgumentParser(prog="pagedkv", description="pagedkv: paged-KV LLM serving.")
    add_logging_arguments(parser)
    groups: dict[tuple[str, ...], Any] = {
        (): parser.add_subparsers(dest="command", metavar="COMMAND")
    }
    for path, register in available_commands(entry_points(group=ENTRY_POINT_GROUP)):
        for depth in range(1, len(path)):
            prefix = path[:depth]
            if prefix not in groups:
                sub = groups[prefix[:-1]].add_parser(prefix[-1], help=f"{prefix[-1]} commands")
                groups[prefix] = sub.add_subparsers(dest="_".join(prefix), metavar="COMMAND")
        register(groups[path[:-1]], path[-1])
    if ("bench",) not in groups:  # the benchmarks are a part of their own
        bench = groups[()].add_parser("bench", help="benchmarks (pagedkv-bench is not installed)")
        bench.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        bench.set_defaults(handler=_bench_not_installed)
    show_defaults(parser)
    return parser


def _bench_not_installed(args: argparse.Namespace) -> int:
    print(
        "pagedkv bench: pagedkv-bench is not installed (the images carry no benchmarks; "
        "in a checkout, `make setup` installs it, or pip install ./bench)",
        file=sys.stderr,
    )
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pagedkv` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    configure_logging(args.log_format, args.log_level)
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
