"""Redis secrets: the password comes from --redis-password-file (never the
command line), and rediss:// URLs verify Redis' certificate with
--redis-tls-ca. Each against a private redis-server."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pagedkv.cluster.connection import RedisUrlError, connect_sync, redacted, redis_url_with
from tests.redis_server import RedisServer, free_port
from tests.router.router_stack import RouterProcess
from tests.security.conftest import Pki

PASSWORD = "s3cret p@ss/word"  # quoted into the URL


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "redis-password"
    path.write_text(f"{PASSWORD}\n")
    return path


def test_the_password_file_opens_a_redis_that_requires_it(password_file: Path) -> None:
    with RedisServer(password=PASSWORD) as server:
        with pytest.raises(redis.AuthenticationError):
            connect_sync(server.url).ping()
        url = redis_url_with(server.url, password_file=str(password_file))
        assert connect_sync(url).ping()
        assert PASSWORD not in redacted(url) and "***" in redacted(url)
        # It overrides a password in the URL.
        wrong = server.url.replace("redis://", "redis://:wrong@")
        assert connect_sync(redis_url_with(wrong, password_file=str(password_file))).ping()


def test_redis_secret_flags_are_checked(tmp_path: Path, password_file: Path) -> None:
    with pytest.raises(RedisUrlError, match=r"--redis-password-file .*: no such file"):
        redis_url_with("redis://h:1/0", password_file=str(tmp_path / "absent"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(RedisUrlError, match="first line is empty"):
        redis_url_with("redis://h:1/0", password_file=str(tmp_path / "empty"))
    with pytest.raises(RedisUrlError, match="--redis-tls-ca needs a rediss://"):
        redis_url_with("redis://h:1/0", tls_ca=str(password_file))
    with pytest.raises(RedisUrlError, match=r"--redis-tls-ca .*: no such file"):
        redis_url_with("rediss://h:1/0", tls_ca=str(tmp_path / "absent"))


@pytest.fixture
def tls_redis(pki: Pki, tmp_path: Path) -> Iterator[str]:
    """A redis-server serving only TLS (with a password); its rediss:// URL
    (without the password). Skipped where redis-server has no TLS."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    command = [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1"]
    command += ["--tls-cert-file", str(pki.server.cert), "--tls-key-file", str(pki.server.key)]
    command += ["--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", "no"]
    command += ["--requirepass", PASSWORD, "--save", "", "--appendonly", "no"]
    command += ["--dir", str(tmp_path)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            if process.poll() is not None:
                output = process.stdout.read().decode() if process.stdout else ""
                pytest.skip(f"redis-server does not serve TLS here: {output[-300:]}")
            try:
                client = redis.Redis(
                    port=port, password=PASSWORD, ssl=True, ssl_ca_certs=str(pki.ca)
                )
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server with TLS did not start"
                time.sleep(0.05)
        yield f"rediss://127.0.0.1:{port}/0"
    finally:
        process.kill()
        process.wait()


def test_rediss_verifies_redis_with_the_given_ca(
    tls_redis: str, pki: Pki, password_file: Path
) -> None:
    url = redis_url_with(tls_redis, password_file=str(password_file), tls_ca=str(pki.ca))
    assert connect_sync(url).ping()
    with pytest.raises(redis.ConnectionError):  # another CA: Redis' certificate is refused
        bad = redis_url_with(tls_redis, password_file=str(password_file), tls_ca=str(pki.other_ca))
        connect_sync(bad).ping()


def test_a_router_reads_the_cluster_over_rediss(
    tls_redis: str, pki: Pki, password_file: Path
) -> None:
    router = RouterProcess(
        tls_redis, "--redis-password-file", str(password_file), "--redis-tls-ca", str(pki.ca)
    )
    with router:
        deadline = time.monotonic() + 30
        while router.metric("pagedkv_router_degraded") != 0.0:
            assert time.monotonic() < deadline, router.stderr()
            time.sleep(0.1)
        assert PASSWORD not in router.stderr()
