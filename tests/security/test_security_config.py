"""The shared security pieces without servers: token files (parsing,
rotation, constant-time acceptance), PEM checks whose errors name the flag
and never the contents, and the command lines' refusals (exit 2, one line
naming the flag)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from pagedkv.common.bearer_tokens import TokenFile, parse_tokens, presented_token
from pagedkv.common.cli import main
from pagedkv.common.security import SecurityError, TlsConfig, read_pem
from tests.security.certs import CertificateAuthority


def test_token_files_skip_blank_lines_and_comments() -> None:
    content = "# rotation: new first\n\n  tok-new  \n# old\ntok-old\n"
    assert parse_tokens(content, "--auth-token-file f") == (b"tok-new", b"tok-old")


def test_a_bad_token_line_is_named_by_number_not_shown() -> None:
    with pytest.raises(SecurityError) as error:
        parse_tokens("good\nsecret with spaces\n", "--auth-token-file f")
    assert "line 2" in str(error.value) and "secret" not in str(error.value)
    with pytest.raises(SecurityError, match="no token in it"):
        parse_tokens("# only a comment\n\n", "--auth-token-file f")


def test_a_token_file_is_re_read_when_it_changes_and_kept_when_it_breaks(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("first\n")
    tokens = TokenFile(path)
    assert tokens.accepts(b"first") and not tokens.accepts(b"second")
    path.write_text("second\nthird\n")
    assert tokens.accepts(b"second") and tokens.accepts(b"third")
    assert not tokens.accepts(b"first") and not tokens.accepts(b"")
    path.unlink()  # a Secret being swapped: the last tokens stay
    assert tokens.tokens() == (b"second", b"third")
    assert tokens.first() == "second"


def test_a_missing_token_file_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match=r"^--auth-token-file .*absent: no such file$"):
        TokenFile(tmp_path / "absent")


def test_only_a_bearer_authorization_presents_a_token() -> None:
    assert presented_token((("authorization", "Bearer abc"),)) == b"abc"
    assert presented_token((("authorization", "bearer  abc "),)) == b"abc"
    assert presented_token((("authorization", "Basic abc"),)) is None
    assert presented_token((("x-other", "Bearer abc"),)) is None
    assert presented_token(None) is None


def test_pem_errors_name_the_flag_and_never_the_contents(tmp_path: Path) -> None:
    key = tmp_path / "key.pem"
    key.write_text("-----BEGIN PRIVATE KEY-----\nc2VjcmV0IGtleQ==\n-----END PRIVATE KEY-----\n")
    with pytest.raises(SecurityError) as error:
        read_pem(key, "cert", "--tls-cert")
    assert str(error.value) == f"--tls-cert {key}: not a PEM certificate"
    with pytest.raises(SecurityError, match=r"--tls-ca .*absent: no such file"):
        read_pem(tmp_path / "absent", "ca", "--tls-ca")
    with pytest.raises(SecurityError, match="not a PEM private key"):
        read_pem(b"garbage", "key", "tls.key")
    with pytest.raises(SecurityError, match="cert and key go together"):
        TlsConfig(ca=key, cert=key)


@pytest.fixture(scope="module")
def pems(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    ca = CertificateAuthority(tmp_path_factory.mktemp("pems"))
    server = ca.issue("server", server=True)
    return {"ca": str(ca.pem), "cert": str(server.cert), "key": str(server.key)}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text("{}")
    return str(path)


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["scheduler", "--executor", "h:1", "--tls-cert", "{cert}"], "go together"),
        (["scheduler", "--executor", "h:1", "--tls-ca", "{ca}"], "--tls-ca needs --tls-cert"),
        (
            ["scheduler", "--executor", "h:1", "--executor-tls-cert", "{cert}"],
            "--executor-tls-cert and --executor-tls-key need --executor-tls-ca",
        ),
        (
            ["scheduler", "--executor", "h:1", "--auth-token-file", "{ca}.absent"],
            "--auth-token-file .*: no such file",
        ),
        (
            ["scheduler", "--executor", "h:1", "--tls-cert", "{key}", "--tls-key", "{key}"],
            "--tls-cert .*: not a PEM certificate",
        ),
        (["router", "--redis-url", "redis://h:1/0", "--scheduler-tls-key", "{key}"], "need"),
        (
            ["router", "--redis-url", "redis://h:1/0", "--scheduler-tls-server-name", "s.ns.svc"],
            "--scheduler-tls-server-name needs --scheduler-tls-ca",
        ),
        (
            ["router", "--redis-url", "redis://h:1/0", "--scheduler-token-file", "{ca}.absent"],
            "--scheduler-token-file .*: no such file",
        ),
        (
            ["executor", "--model", "{model}", "--tls-cert", "{cert}", "--tls-key", "{key}"],
            "--tls-cert needs --tls-ca here",
        ),
        (["executor", "--model", "{model}", "--redis-tls-ca", "{ca}"], "need --redis-url"),
        (
            [
                "generate",
                "--target",
                "h",
                "--max-tokens",
                "1",
                "--prompt",
                "x",
                "--tls-cert",
                "{cert}",
                "--tls-key",
                "{key}",
            ],
            "--tls-cert and --tls-key need --tls-ca",
        ),
        (["stats", "--target", "h", "--token-file", "{ca}.absent"], "--token-file .*: no such"),
    ],
)
def test_command_lines_refuse_incomplete_security_options(
    command: list[str],
    message: str,
    pems: dict[str, str],
    model: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [part.format(model=model, **pems) for part in command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert re.search(message, err), err


def test_the_token_comes_from_the_environment_unless_a_file_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedkv.client.credentials import client_security

    args = argparse.Namespace(tls_ca=None, tls_cert=None, tls_key=None, token_file=None)
    monkeypatch.setenv("PAGEDKV_TOKEN", "from-env")
    assert client_security(args) == {"tls": None, "token": "from-env"}
    path = tmp_path / "token"
    path.write_text("# mine\nfrom-file\n")
    args.token_file = str(path)
    assert client_security(args)["token"] == "from-file"
