"""The latency harness (testing/netproxy.py) against a real redis-server: bytes pass unchanged and in
order, each direction waits its delay, and a blackhole holds everything (new connections included),
or only the replies, with the connections left open until healed."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import pytest
import redis

from testing.netproxy import LatencyProxy

pytestmark = pytest.mark.integration


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def clients(client: redis.Redis) -> int:
    return len(client.client_list())


def test_bytes_pass_in_order_and_each_direction_waits_its_delay(redis_url: str) -> None:
    with LatencyProxy(port_of(redis_url), up=0.03, down=0.05) as proxy:
        client = redis.Redis.from_url(proxy.url)
        try:
            client.ping()  # the connection made
            pipe = client.pipeline(transaction=False)
            for n in range(200):
                pipe.set(f"netproxy:{n}", "x" * n)
            pipe.execute()
            assert [client.get(f"netproxy:{n}") for n in (0, 7, 199)] == [b"", b"x" * 7, b"x" * 199]
            began = time.monotonic()
            client.ping()
            assert time.monotonic() - began >= 0.08  # up + down
            assert proxy.forwarded["up"] > 0 and proxy.forwarded["down"] > 0
        finally:
            client.delete(*(f"netproxy:{n}" for n in range(200)))
            client.close()


def test_a_blackhole_holds_everything_and_keeps_connections_open(
    redis_url: str, redis_client: redis.Redis
) -> None:
    with LatencyProxy(port_of(redis_url)) as proxy:
        held = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        try:
            held.sendall(b"PING\r\n")
            assert held.recv(64) == b"+PONG\r\n"
            before = clients(redis_client)
            proxy.blackhole()
            assert proxy.blackholed
            held.sendall(b"PING\r\n")
            late = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
            late.sendall(b"PING\r\n")
            for sock in (held, late):
                sock.settimeout(0.3)
                with pytest.raises(TimeoutError):
                    sock.recv(64)  # silence, not a closed connection
            assert clients(redis_client) == before  # the late one did not reach Redis
            proxy.heal()
            for sock in (held, late):
                sock.settimeout(5)
                assert sock.recv(64) == b"+PONG\r\n"  # what was held goes on
            assert clients(redis_client) == before + 1
            late.close()
        finally:
            held.close()


def test_a_blackhole_of_the_replies_lets_the_commands_run(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """``blackhole("down")``: a reply held back (a slow network, a paused Redis's reply) while the
    command still reaches Redis and runs there."""
    with LatencyProxy(port_of(redis_url)) as proxy:
        held = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        try:
            proxy.blackhole("down")
            held.sendall(b"SET netproxy:down yes\r\n")
            deadline = time.monotonic() + 5
            while redis_client.get("netproxy:down") != b"yes" and time.monotonic() < deadline:
                time.sleep(0.01)
            assert redis_client.get("netproxy:down") == b"yes"  # it ran
            held.settimeout(0.3)
            with pytest.raises(TimeoutError):
                held.recv(64)  # its reply did not come
            proxy.heal()
            held.settimeout(5)
            assert held.recv(64) == b"+OK\r\n"
        finally:
            held.close()
            redis_client.delete("netproxy:down")


def test_bad_delays_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="delays must be >= 0 s"):
        LatencyProxy(1, delay=-1)
