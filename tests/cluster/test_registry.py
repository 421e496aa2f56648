"""The executor registry against a real Redis: registration with a TTL kept
alive by heartbeats, unregistration of only its own incarnation, and
re-registration after Redis restarts empty; the registration never raises
while Redis is down."""

from __future__ import annotations

import dataclasses

import pytest

from pagedkv.cluster.connection import connect, connect_sync
from pagedkv.cluster.keys import Keys
from pagedkv.cluster.registry import ExecutorRecord, ExecutorRegistration, list_executors
from tests.cluster.conftest import run, wait_until
from tests.redis_server import RedisServer

RECORD = ExecutorRecord(
    address="127.0.0.1:7001",
    incarnation_id="inc-1",
    model_id="tiny-llama",
    block_size=16,
    num_blocks=64,
    bytes_per_block=4096,
    max_num_rows=8,
    max_model_len=128,
    registered_at_ms=1_700_000_000_000,
)
KEYS = Keys()


def listed(url: str) -> list[ExecutorRecord]:
    return run(list_executors(connect(url)))


def test_record_round_trips_and_rejects_mistyped_fields() -> None:
    assert ExecutorRecord.from_json(RECORD.to_json()) == RECORD
    bad = RECORD.to_json().replace('"num_blocks":64', '"num_blocks":"64"')
    with pytest.raises(ValueError, match="num_blocks"):
        ExecutorRecord.from_json(bad)
    with pytest.raises(ValueError, match="not an executor record"):
        ExecutorRecord.from_json('{"address": "x"}')


def test_registration_heartbeats_keep_a_short_ttl_record_alive(redis_url: str) -> None:
    registration = ExecutorRegistration(connect_sync(redis_url), RECORD, ttl_ms=1500)
    registration.start()
    try:
        wait_until(lambda: registration.num_beats >= 7)  # two TTLs of beats
        assert listed(redis_url) == [RECORD]
        ttl = registration.client.pttl(KEYS.executor(RECORD.address))
        assert 0 < ttl <= 1500
    finally:
        assert registration.close()
    assert listed(redis_url) == []
    assert registration.client.smembers(KEYS.executors()) == set()


def test_a_record_without_heartbeats_expires_and_leaves_the_set(redis_url: str) -> None:
    client = connect_sync(redis_url)
    client.set(KEYS.executor(RECORD.address), RECORD.to_json(), px=50)
    client.sadd(KEYS.executors(), RECORD.address)
    wait_until(lambda: client.exists(KEYS.executor(RECORD.address)) == 0)
    assert listed(redis_url) == []
    assert client.smembers(KEYS.executors()) == set()


def test_close_unregisters_only_its_own_incarnation(redis_url: str) -> None:
    old = ExecutorRegistration(connect_sync(redis_url), RECORD, ttl_ms=60_000)
    old.start()
    wait_until(lambda: old.healthy)
    newer = dataclasses.replace(RECORD, incarnation_id="inc-2")
    new = ExecutorRegistration(connect_sync(redis_url), newer, ttl_ms=60_000)
    new.start()
    wait_until(lambda: new.healthy)
    assert not old.close()  # the address is the newer incarnation's now
    assert listed(redis_url) == [newer]
    assert new.close()
    assert listed(redis_url) == []


def test_an_older_incarnation_heartbeat_does_not_overwrite_a_newer_one(redis_url: str) -> None:
    old = ExecutorRegistration(connect_sync(redis_url), RECORD, ttl_ms=300)
    old.start()
    wait_until(lambda: old.healthy)
    newer = dataclasses.replace(RECORD, incarnation_id="inc-2")
    client = connect_sync(redis_url)
    client.set(KEYS.executor(RECORD.address), newer.to_json(), px=60_000)
    beats = old.num_beats
    wait_until(lambda: old.num_beats >= beats + 3)
    assert listed(redis_url) == [newer]
    assert not old.close()


def test_registration_survives_a_redis_kill_and_restart(
    redis_url: str, redis_server: RedisServer
) -> None:
    registration = ExecutorRegistration(connect_sync(redis_url), RECORD, ttl_ms=600)
    registration.start()
    try:
        wait_until(lambda: registration.healthy)
        redis_server.kill()
        wait_until(lambda: not registration.healthy)  # beats fail quietly
        redis_server.start()  # empty
        wait_until(lambda: listed(redis_url) == [RECORD])
        assert registration.healthy
    finally:
        registration.close()


def test_registration_starts_and_closes_while_redis_is_down(
    redis_url: str, redis_server: RedisServer
) -> None:
    redis_server.kill()
    registration = ExecutorRegistration(connect_sync(redis_url), RECORD, ttl_ms=3000)
    registration.start()  # warns once and keeps trying
    assert registration.num_beats == 0
    redis_server.start()
    wait_until(lambda: registration.healthy)
    assert listed(redis_url) == [RECORD]
    redis_server.kill()
    assert not registration.close()  # never raises
    redis_server.start()
