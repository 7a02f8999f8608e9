"""The test harness's redis-server: a port taken by another process between picking it and the
server binding it (pytest-xdist workers and test HTTP servers pick ports at the same time) costs a
new port, not an error, unless the port was given or already handed out."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import redis

from testing.redis_server import RedisServer, free_port


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_port_taken_before_the_server_binds_it_is_swapped_for_a_free_one(taken_port: int) -> None:
    server = RedisServer()
    server._port = taken_port  # what another process took between free_port() and the bind
    with server:
        assert server.port != taken_port
        assert redis.Redis(port=server.port).ping()


def test_a_given_port_that_is_taken_is_a_clear_error(taken_port: int) -> None:
    server = RedisServer(port=taken_port)
    with pytest.raises(RuntimeError, match=f"(?s)port {taken_port} is taken: .*already in use"):
        server.start()
    server.stop()


def test_a_port_already_read_is_kept_and_its_loss_is_a_clear_error(taken_port: int) -> None:
    server = RedisServer()
    server._port = taken_port
    url = server.url  # crawls pointed at it before it starts
    with pytest.raises(RuntimeError, match=f"port {taken_port} is taken"):
        server.start()
    assert url.endswith(f":{taken_port}/0")
    server.stop()
