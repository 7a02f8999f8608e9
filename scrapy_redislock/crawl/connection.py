"""Redis URLs, in one place: parse and check them, mask their secrets, build clients for a server,
Sentinel or Cluster.

Both fronts (through :mod:`scrapy_redislock.crawl.settings`), the CLI and the dashboard connect with
:func:`parse_url`; no other module parses a Redis URL. URL forms::

    redis://[user:password@]host:6379/0          one server (also rediss:// for TLS, unix:///path.sock?db=0)
    redis+sentinel://[user:password@]host1:26379,host2:26379/service_name[/db]
    rediss+sentinel://...                        TLS to the sentinels and to the master
    redis+cluster://[user:password@]host1:7000,host2:7001   (also rediss+cluster://)

The user and password in front of the hosts are the master's (or the cluster nodes'). The sentinels'
own credentials are query options, kept apart: ``?sentinel_username=...&sentinel_password=...``.
Every other query option (``socket_timeout``, ``ssl_ca_certs``, ``ssl_cert_reqs``, ...) is
redis-py's and applies to the data connections. A sentinel or cluster host without a port gets 26379
or 6379. A Sentinel client asks the sentinels for the master whenever it opens a connection, so
after a failover the next connection goes to the new master; a Cluster client follows MOVED replies.
Reads no settings and imports no Scrapy.

scrapy-redis's own connections (its scheduler's queue and dupefilter, RedisSpider's start URLs) take
the same URLs with ``REDIS_PARAMS = {"redis_cls": "scrapy_redislock.RedisClient"}``
(:class:`RedisClient`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from redis.connection import parse_url as redis_parse_url

from scrapy_redislock.errors import ConfigError
from scrapy_redislock.lock.quorum import master_options

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}
SERVER_SCHEMES = ("redis", "rediss", "unix")
# Query options that are the sentinels' own, not the master's.
SENTINEL_OPTIONS = {"sentinel_username": "username", "sentinel_password": "password"}
# Query options whose value is a secret, masked like the password.
SECRET_OPTIONS = ("password", "sentinel_password")
DEFAULT_PORTS = {"sentinel": 26379, "cluster": 6379}
# A sentinel answers at once; one that does not (paused, cut off) is skipped after this long for the
# next one.
SENTINEL_SOCKET_TIMEOUT = 5.0
EXAMPLE = "redis://host:6379/0, redis+sentinel://host1:26379,host2:26379/service_name or redis+cluster://host1:7000,host2:7001"


def mask_url(url: str) -> str:
    """The URL with its passwords (the master's, and the sentinels' query option) replaced by
    ***."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    if "@" in netloc:
        userinfo, _, hosts = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{hosts}" if colon else netloc
    for option in SECRET_OPTIONS:
        tail = re.sub(rf"(?<=[?&]){option}=[^&#]*", f"{option}=***", tail)
    return f"{scheme}://{netloc}{slash}{tail}"


@dataclass(frozen=True)
class RedisURL:
    """A checked Redis URL: what kind of deployment, where, and how to connect to it."""

    url: str
    setting: str  # where the URL came from, for messages
    kind: str = "server"  # "server", "sentinel" or "cluster"
    hosts: tuple[tuple[str, int], ...] = ()  # sentinels or cluster seed nodes
    service: str | None = None  # the Sentinel service (master) name
    # data connections: user, password, db, ssl, query
    options: Mapping[str, Any] = field(default_factory=dict)
    sentinel_options: Mapping[str, Any] = field(default_factory=dict)  # the sentinels' connections

    @property
    def tls(self) -> bool:
        return self.url.startswith("rediss")

    def secrets(self) -> set[str]:
        """Every secret in the URL (raw and percent-decoded), for scrubbing messages."""
        found = {self.options.get("password"), self.sentinel_options.get("password")}
        raw = re.search(r"://([^/@]*)@", self.url)
        if raw and ":" in raw.group(1):
            found.add(raw.group(1).partition(":")[2])
        return {str(secret) for secret in found if secret} | {unquote(str(s)) for s in found if s}

    def scrub(self, message: str) -> str:
        """The message with the URL's secrets (should a library ever echo one) replaced by ***."""
        for secret in sorted(self.secrets(), key=len, reverse=True):
            message = message.replace(secret, "***")
        return message

    # -- clients -----------------------------------------------------------------------------------

    def client(
        self, cluster_class: type[redis.RedisCluster] = redis.RedisCluster, **params: Any
    ) -> redis.Redis | redis.RedisCluster:
        """A blocking client (CLI, tests); ``params`` are redis client arguments
        (REDISLOCK_PARAMS)."""
        if self.kind == "server":
            return redis.Redis.from_url(self.url, **params)
        if self.kind == "cluster":
            nodes = [redis.cluster.ClusterNode(host, port) for host, port in self.hosts]
            return cluster_class(startup_nodes=nodes, **self._data_kwargs(params))
        sentinel = redis.sentinel.Sentinel(
            self.hosts, sentinel_kwargs=self._sentinel_kwargs(params)
        )
        assert self.service is not None
        client = sentinel.master_for(
            self.service, redis_class=SentinelMaster, **self._data_kwargs(params)
        )
        return _owning(client, sentinel)

    def async_client(self, **params: Any) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
        """A redis.asyncio client for the reactor thread (asyncio reactor); a server's or a
        Sentinel master's skips the health check on a connection it has just opened."""
        if self.kind == "server":
            return _healthy_when_fresh(redis.asyncio.Redis.from_url(self.url, **params))
        if self.kind == "cluster":
            nodes = [redis.asyncio.cluster.ClusterNode(host, port) for host, port in self.hosts]
            return redis.asyncio.RedisCluster(startup_nodes=nodes, **self._data_kwargs(params))
        sentinel = redis.asyncio.sentinel.Sentinel(
            self.hosts, sentinel_kwargs=self._sentinel_kwargs(params)
        )
        assert self.service is not None
        client = sentinel.master_for(
            self.service, redis_class=AsyncSentinelMaster, **self._data_kwargs(params)
        )
        return _owning(_healthy_when_fresh(client), sentinel)

    def _data_kwargs(self, params: Mapping[str, Any]) -> dict[str, Any]:
        kwargs = {**params, **self.options}
        if self.kind == "cluster":
            kwargs.pop("db", None)  # parse_url refuses a cluster URL with another db
            # the cluster clients check their nodes themselves
            kwargs.pop("health_check_interval", None)
        return kwargs

    def _sentinel_kwargs(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The sentinels' connections: their own credentials, the socket options, TLS like the
        master's."""
        merged = {**params, **self.options}
        kwargs = {k: v for k, v in merged.items() if k.startswith(("socket_", "ssl"))}
        kwargs.setdefault("socket_timeout", SENTINEL_SOCKET_TIMEOUT)
        kwargs.update(self.sentinel_options)
        return kwargs


class _FreshIsHealthy:
    """Mixed in front of a pool's redis.asyncio connection class: a connection just opened is
    healthy, so its first health-check PING is due one ``health_check_interval`` later. redis-py
    checks a new connection's health before its first command, a round trip on a crawl's way to its
    first request (and its waiting connection's)."""

    health_check_interval: float
    next_health_check: float

    async def _connect(self) -> None:
        await super()._connect()  # type: ignore[misc]
        self.next_health_check = asyncio.get_running_loop().time() + self.health_check_interval


_FRESH_CLASSES: dict[type, type] = {}


def _healthy_when_fresh(client: Any) -> Any:
    """``client`` with its pool's connection class behind :class:`_FreshIsHealthy` (the class the
    URL chose: TCP, TLS, a Unix socket or a Sentinel's)."""
    pool = client.connection_pool
    base = pool.connection_class
    if base not in _FRESH_CLASSES:
        _FRESH_CLASSES[base] = type(f"FreshIsHealthy{base.__name__}", (_FreshIsHealthy, base), {})
    pool.connection_class = _FRESH_CLASSES[base]
    return client


def _owning(client: Any, sentinel: Any) -> Any:
    """``client`` (a Sentinel master's) closing its pool and the sentinels' connections when it is
    closed: made by ``master_for``, it leaves its pool open on close before redis-py 6, and nothing
    ever closes the sentinels'."""
    client.auto_close_connection_pool = True
    client.sentinels = sentinel
    return client


class SentinelMaster(redis.Redis):
    """The blocking client of a Sentinel master: ``close()`` also closes the sentinels' connections
    (its own Sentinel's; a client made on another pool of the same Sentinel, as
    :func:`~scrapy_redislock.lock.base.waiting_client` makes, closes only its own pool)."""

    sentinels: Any = None

    def close(self) -> None:
        try:
            super().close()
        finally:
            sentinels, self.sentinels = self.sentinels, None
            for each in getattr(sentinels, "sentinels", ()):
                each.close()


class AsyncSentinelMaster(redis.asyncio.Redis):
    """The redis.asyncio client of a Sentinel master: ``aclose()`` also closes the sentinels'
    connections."""

    sentinels: Any = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            sentinels, self.sentinels = self.sentinels, None
            for each in getattr(sentinels, "sentinels", ()):
                await each.aclose()


class ScrapyRedisCluster(redis.RedisCluster):
    """A cluster client for scrapy-redis, whose priority queue pops with ``pipeline()`` then
    ``multi()`` on its one key: its pipelines are transactions unless told otherwise (redis-py's
    cluster pipelines refuse ``multi()``)."""

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        return super().pipeline(
            transaction=True if transaction is None else transaction, shard_hint=shard_hint
        )


class RedisClient:
    """A ``redis_cls`` for scrapy-redis (``REDIS_PARAMS = {"redis_cls":
    "scrapy_redislock.RedisClient"}``): its ``from_url`` takes every URL form above, so scrapy-redis
    follows a Sentinel failover or a Cluster like we do."""

    # A factory: scrapy-redis calls redis_cls(**kwargs) for a client; mypy wants __new__ to make a
    # RedisClient.
    def __new__(cls, **kwargs: Any) -> redis.Redis:  # type: ignore[misc]
        return redis.Redis(**kwargs)  # scrapy-redis with REDIS_HOST/REDIS_PORT and no URL

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> redis.Redis | redis.RedisCluster:
        return parse_url(url, "REDIS_URL").client(cluster_class=ScrapyRedisCluster, **kwargs)


def async_clients(
    url: str, setting: str, params: Mapping[str, Any], masters: Sequence[str] = ()
) -> list[redis.asyncio.Redis | redis.asyncio.RedisCluster]:
    """A crawl's redis.asyncio clients for the reactor thread: the one Redis of ``url``, or one per
    master of a quorum (no retries, 1 s socket timeouts unless ``params`` says otherwise: a dead
    master must not eat the validity time)."""
    if not masters:
        return [parse_url(url, setting).async_client(**params)]
    merged = {**master_options(asyncio=True), **params}
    return [parse_url(master, setting).async_client(**merged) for master in masters]


def parse_url(url: Any, setting: str) -> RedisURL:
    """A checked :class:`RedisURL`; ConfigError naming ``setting`` and the URL (password masked)
    when it is bad."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{setting} must be a redis URL such as {EXAMPLE}, got {url!r}")

    def bad(why: str) -> ConfigError:
        return ConfigError(f"{setting} is not a valid redis URL ({why}): {mask_url(url)!r}")

    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in SERVER_SCHEMES:
        try:
            redis_parse_url(url)
        except (ValueError, TypeError) as exc:
            raise bad(str(exc)) from None
        return RedisURL(url, setting)
    kind = _kind_of(scheme, bad)
    rest, _, query = url.split("://", 1)[1].partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    hosts = tuple(_host(part, DEFAULT_PORTS[kind], bad) for part in hostlist.split(","))
    service, db = _service_and_db(path, kind, bad)
    sentinel_options, data_query = _split_query(query, kind, bad)
    options = _data_options(scheme, f"{userinfo}{at}", db, data_query, bad)
    return RedisURL(url, setting, kind, hosts, service, options, sentinel_options)


def _kind_of(scheme: str, bad: Callable[[str], ConfigError]) -> str:
    """ "sentinel" or "cluster" for a URL that is not one server's."""
    if scheme in SENTINEL_SCHEMES:
        return "sentinel"
    if scheme in CLUSTER_SCHEMES:
        return "cluster"
    raise bad(
        f"the scheme must be one of redis, rediss, unix, redis+sentinel, rediss+sentinel, redis+cluster, rediss+cluster, got {scheme or 'none'!r}"  # noqa: E501
    )


def _split_query(
    query: str, kind: str, bad: Callable[[str], ConfigError]
) -> tuple[dict[str, str], str]:
    """The Sentinel options of a URL's query (for the sentinels' own connections), and the rest."""
    pairs = parse_qsl(query, keep_blank_values=True)
    sentinel_options = {SENTINEL_OPTIONS[k]: v for k, v in pairs if k in SENTINEL_OPTIONS}
    if sentinel_options and kind != "sentinel":
        raise bad(
            f"{', '.join(sorted(k for k, _ in pairs if k in SENTINEL_OPTIONS))} only applies to Sentinel URLs"
        )
    return sentinel_options, urlencode([(k, v) for k, v in pairs if k not in SENTINEL_OPTIONS])


def _service_and_db(
    path: str, kind: str, bad: Callable[[str], ConfigError]
) -> tuple[str | None, int]:
    """The Sentinel service name (None for a cluster) and the database number of a URL's path."""
    names = [unquote(part) for part in path.split("/") if part]
    service: str | None = None
    if kind == "sentinel":
        if not names:
            raise bad("it names no service: add /service_name after the sentinels")
        service, names = names[0], names[1:]
    return service, _db_of(names, "service name" if service else "hosts", kind, bad)


def _db_of(names: list[str], after: str, kind: str, bad: Callable[[str], ConfigError]) -> int:
    if len(names) > 1 or (names and not names[0].isdigit()):
        raise bad(f"the path after the {after} must be a database number, got {'/'.join(names)!r}")
    db = int(names[0]) if names else 0
    if kind == "cluster" and db:
        raise bad("Redis Cluster has only database 0")
    return db


def _data_options(
    scheme: str, credentials: str, db: int, query: str, bad: Callable[[str], ConfigError]
) -> dict[str, Any]:
    """Client options of the data connections, by redis-py's own parser (one host standing for all):
    the types of the query options, quoting, TLS."""
    single = f"{'rediss' if scheme.startswith('rediss') else 'redis'}://{credentials}localhost/{db}"
    try:
        options = redis_parse_url(f"{single}?{query}" if query else single)
    except (ValueError, TypeError) as exc:
        raise bad(str(exc)) from None
    options.pop("host", None)
    options.pop("port", None)
    if options.pop("connection_class", None) is not None:
        options["ssl"] = True
    return options


def _host(part: str, default_port: int, bad: Any) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6]:port``."""
    match = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?", part)
    if not part or match is None:
        raise bad(f"bad host {part!r}: hosts are host:port, separated by commas")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4) or default_port)
    if not 0 < port < 65536:
        raise bad(f"bad port in {part!r}")
    return host, port
