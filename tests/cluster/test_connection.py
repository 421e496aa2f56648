"""Redis URLs: errors that name --redis-url, passwords never shown, and a dead
Redis that fails fast."""

from __future__ import annotations

import pytest
import redis

from pagedkv.cluster.connection import (
    RedisUrlError,
    check_redis_url,
    connect,
    connect_sync,
    redacted,
)
from tests.cluster.conftest import run
from tests.redis_server import free_port


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:6379/0", "redis://h", "rediss://u:p@h:1/2", "unix:///tmp/r.sock"],
)
def test_good_urls_pass(url: str) -> None:
    assert check_redis_url(url) == url


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://h:1/0", "scheme"),
        ("127.0.0.1:6379", "scheme"),
        ("redis://:6379/0", "no host"),
        ("redis://h:99999/0", "out of range"),
        ("redis://h:1/zero", "database"),
        ("unix://", "socket path"),
    ],
)
def test_bad_urls_name_the_flag(url: str, message: str) -> None:
    with pytest.raises(RedisUrlError, match=message) as error:
        check_redis_url(url)
    assert str(error.value).startswith("--redis-url ")


def test_passwords_are_redacted_in_urls_and_errors() -> None:
    assert redacted("redis://user:s3cret@h:1/0") == "redis://user:***@h:1/0"
    assert redacted("redis://:s3cret@h:1/0") == "redis://:***@h:1/0"
    assert redacted("redis://h:1/0") == "redis://h:1/0"
    with pytest.raises(RedisUrlError) as error:
        check_redis_url("redis://u:s3cret@h:1/x")
    assert "s3cret" not in str(error.value)


def test_a_dead_redis_fails_with_a_connection_error() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(redis.ConnectionError):
        connect_sync(url).ping()
    with pytest.raises(redis.ConnectionError):
        run(connect(url).ping())
