"""Redis clients for the cluster code: validated URLs, fast failure, no
password in any log line.

Both clients have ~1 s socket and connect timeouts and one immediate retry (a
pooled connection that Redis closed when it restarted is replaced once, then
the error reaches the caller), so a dead Redis fails a call within about two
seconds instead of hanging a heartbeat. Replies are ``bytes`` (the KV event
streams are binary); callers decode.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.backoff
import redis.retry

from pagedkv.common.logging import get_logger

log = get_logger("pagedkv.cluster")

R = TypeVar("R")

SOCKET_TIMEOUT_S = 1.0
SCHEMES = ("redis", "rediss", "unix")


class RedisUrlError(ValueError):
    """A ``--redis-url`` that cannot name a Redis server."""


def check_redis_url(url: str) -> str:
    """``url`` if it names a Redis server (``redis://HOST:PORT/DB``, ``rediss://``
    for TLS, ``unix:///path``); else RedisUrlError naming ``--redis-url``
    (and never showing the password)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise RedisUrlError(f"--redis-url {redacted(url)}: {exc}") from None
    if parts.scheme not in SCHEMES:
        raise RedisUrlError(
            f"--redis-url {redacted(url)}: the scheme must be one of "
            f"{', '.join(s + '://' for s in SCHEMES)} (e.g. redis://127.0.0.1:6379/0)"
        )
    if parts.scheme == "unix":
        if not parts.path:
            raise RedisUrlError(f"--redis-url {redacted(url)}: unix:// needs a socket path")
        return url
    if not parts.hostname:
        raise RedisUrlError(f"--redis-url {redacted(url)}: no host (e.g. redis://HOST:PORT/DB)")
    if port == 0:
        raise RedisUrlError(f"--redis-url {redacted(url)}: port 0 is no server port")
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise RedisUrlError(f"--redis-url {redacted(url)}: the database {db!r} is not a number")
    return url


def redacted(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``, for logs and errors."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparseable url>"
    if password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def redis_url_with(url: str, *, password_file: str | None = None, tls_ca: str | None = None) -> str:
    """``url`` (checked) with the password of ``password_file`` (its first
    line; it replaces the URL's) and, for a ``rediss://`` URL, ``tls_ca``
    as the CA that verifies Redis' certificate (redis-py's ``ssl_ca_certs``
    query). The result carries the password: log it only ``redacted``.
    RedisUrlError naming the flag; never shows the password."""
    check_redis_url(url)
    parts = urlsplit(url)
    if tls_ca is not None:
        if parts.scheme != "rediss":
            raise RedisUrlError(
                f"--redis-tls-ca needs a rediss:// --redis-url (got {parts.scheme}://)"
            )
        if not Path(tls_ca).is_file():
            raise RedisUrlError(f"--redis-tls-ca {tls_ca}: no such file")
        query = [(k, v) for k, v in parse_qsl(parts.query) if k != "ssl_ca_certs"]
        parts = parts._replace(query=urlencode([*query, ("ssl_ca_certs", tls_ca)]))
    if password_file is not None:
        if parts.scheme == "unix":
            raise RedisUrlError("--redis-password-file: not for a unix:// --redis-url")
        try:
            lines = Path(password_file).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise RedisUrlError(f"--redis-password-file {password_file}: no such file") from None
        except (OSError, UnicodeDecodeError):
            raise RedisUrlError(f"--redis-password-file {password_file}: cannot read it") from None
        password = lines[0].strip() if lines else ""
        if not password:
            raise RedisUrlError(f"--redis-password-file {password_file}: its first line is empty")
        userinfo, _, host = parts.netloc.rpartition("@")
        user = userinfo.partition(":")[0]  # as written in the URL (quoted)
        parts = parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}")
    return urlunsplit(parts)


def connect(url: str) -> redis.asyncio.Redis:
    """An asyncio client for ``url`` (checked first). Connects lazily: a dead
    Redis shows up as ``redis.exceptions.ConnectionError`` on the first call."""
    return redis.asyncio.Redis.from_url(
        check_redis_url(url),
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=SOCKET_TIMEOUT_S,
        retry=redis.asyncio.retry.Retry(redis.backoff.NoBackoff(), 1),
    )


def connect_sync(url: str) -> redis.Redis:
    """A synchronous (thread-safe, pooled) client for ``url``; see ``connect``."""
    return redis.Redis.from_url(
        check_redis_url(url),
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=SOCKET_TIMEOUT_S,
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), 1),
    )


def text(value: bytes | str) -> str:
    """A reply as ``str`` (the clients return bytes; typed as either)."""
    return value.decode() if isinstance(value, bytes) else value


async def live_records(
    client: redis.asyncio.Redis,
    set_key: str,
    record_key: Callable[[str], str],
    parse: Callable[[bytes | str], R],
    what: str,
) -> list[R]:
    """The records of the members of ``set_key`` (each at ``record_key(member)``,
    with a TTL), by member. Members whose record expired are removed from
    the set (a live one adds itself back at its next heartbeat); unreadable
    records (``parse`` raises ValueError) are logged and left out."""
    members = sorted(text(m) for m in await client.smembers(set_key))
    if not members:
        return []
    values = await client.mget([record_key(m) for m in members])
    records: list[R] = []
    dead: list[str] = []
    for member, value in zip(members, values, strict=True):
        if value is None:
            dead.append(member)
            continue
        try:
            records.append(parse(value))
        except ValueError as exc:
            log.warning(f"unreadable {what} record", member=member, error=str(exc))
    if dead:
        await client.srem(set_key, *dead)
    return records
