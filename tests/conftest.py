"""Shared fixtures: a real redis-server per test session (or REDISLOCK_TEST_URL).

Set REDISLOCK_TEST_URL=redis://host:port/db to run against an external server;
the tests flush that database.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis

from scrapy_redislock.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    external = os.environ.get("REDISLOCK_TEST_URL")
    if external:
        yield external
        return
    with RedisServer() as server:
        yield server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()
