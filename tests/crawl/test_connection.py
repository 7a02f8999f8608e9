"""The crawl's redis.asyncio clients against a real redis-server: what a new connection costs
before its first command (the way to a crawl's first request goes through two of them)."""

from __future__ import annotations

import asyncio

import pytest
import redis

from scrapy_redislock.crawl.connection import parse_url
from scrapy_redislock.crawl.settings import DEFAULT_CLIENT_PARAMS
from testing.monitor import Monitor, commands

pytestmark = pytest.mark.integration


def sent_by_the_client(admin_url: str, work: str) -> list[str]:
    """The commands (names) a new client with the crawl's default parameters sends for ``work``
    ("get": one GET; "stale": one GET, then one more once its health check is due)."""
    monitor = Monitor(redis.Redis.from_url(admin_url).connection_pool.connection_kwargs["port"])

    async def run() -> None:
        client = parse_url(admin_url, "REDISLOCK_URL").async_client(**DEFAULT_CLIENT_PARAMS)
        try:
            await client.get("redislock-test:fresh")
            if work == "stale":
                connection = client.connection_pool._available_connections[0]
                connection.next_health_check = 0  # as if it had been idle for the interval
                await client.get("redislock-test:fresh")
        finally:
            await client.aclose()

    asyncio.run(run())
    with redis.Redis.from_url(admin_url) as admin:
        raw = monitor.stop(admin)
    sent = [(source, args[0].decode().lower()) for _, source, args in commands(raw)]
    ours = next(source for source, name in sent if name == "get")
    return [name for source, name in sent if source == ours]


def test_a_new_connection_sends_its_first_command_without_a_health_check(admin_url: str) -> None:
    """No PING and no HELLO in front of the first command (two round trips redis-py 8 would
    spend): the connection was just opened, and the crawl speaks RESP2."""
    assert sent_by_the_client(admin_url, "get") == ["get"]


def test_a_connection_idle_for_the_interval_is_still_checked(admin_url: str) -> None:
    assert sent_by_the_client(admin_url, "stale") == ["get", "ping", "get"]
