"""docs/security.md's "Certificates with openssl", as written: its shell steps
run with the real ``openssl`` in an empty directory; a scheduler (over a CPU
executor) serves mutual TLS and tokens with the files they made, started
with the page's command line; the page's ``pagedkv stats`` line and its SDK
example connect with them, and a client without the client certificate is
refused."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.client import Client, ResumePolicy, TlsConfig, UnavailableError
from tests.docs_blocks import DOCS, code_blocks, run_sh
from tests.executor.driver import ExecutorProcess
from tests.service.stack import Process

PAGE = DOCS / "security.md"
SECTION = "Certificates with openssl"
TOKEN = "docs-token-0123456789abcdef"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def command_lines(block: str) -> list[list[str]]:
    """The command lines of a shell block, backslash continuations joined."""
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory the page's openssl steps ran in, with a token file."""
    directory = tmp_path_factory.mktemp("openssl")
    steps = code_blocks(PAGE, "sh", section=SECTION)
    assert len(steps) == 4  # CA, server, client, check
    for step in steps:
        run_sh(step, directory)
    (directory / "tokens").write_text(f"{TOKEN}\n")
    (directory / "token").write_text(f"{TOKEN}\n")
    return directory


def test_the_steps_make_a_ca_and_certificates_it_signed(made: Path) -> None:
    for name in ("ca.pem", "ca-key.pem", "server.pem", "server-key.pem"):
        assert (made / name).stat().st_size > 0
    assert (made / "client-key.pem").stat().st_mode & 0o077 == 0
    names = subprocess.run(
        ["openssl", "x509", "-in", "server.pem", "-noout", "-ext", "subjectAltName"],
        cwd=made,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "DNS:localhost" in names and "IP Address:127.0.0.1" in names


def test_a_scheduler_serves_what_the_steps_made_to_the_documented_clients(
    made: Path, model_dir: Path
) -> None:
    (usage,) = code_blocks(PAGE, "", section=SECTION)
    serve_line, stats_line = command_lines(usage)
    assert serve_line[:2] == ["pagedkv", "scheduler"]
    assert stats_line[:2] == ["pagedkv", "stats"]
    (example,) = code_blocks(PAGE, "python")
    with ExecutorProcess(model_dir, num_blocks=64) as executor:
        args = [executor.target if a == "HOST:PORT" else a for a in serve_line[1:]]
        args = [str(made / a) if (made / a).is_file() else a for a in args]
        with Process([*args, "--port", "0"]) as scheduler:
            port = scheduler.target.rsplit(":", 1)[1]
            # The page's stats command line, as written but for the port.
            stats = shlex.join(stats_line).replace("localhost:50051", f"localhost:{port}")
            shown = run_sh(stats, made).stdout
            assert executor.target in shown
            # The page's SDK example, dialling localhost (a name the certificate has).
            code = example.replace("router.example:50051", f"localhost:{port}")
            result = subprocess.run(
                [sys.executable, "-c", code], cwd=made, capture_output=True, text=True, timeout=120
            )
            assert result.returncode == 0, result.stderr
            # Mutual TLS is on: the CA alone is not enough.
            policy = ResumePolicy(max_attempts=0)
            without = TlsConfig(ca=made / "ca.pem")
            with (
                Client(f"localhost:{port}", tls=without, token=TOKEN, resume=policy) as client,
                pytest.raises(UnavailableError),
            ):
                client.stats(timeout=30)
