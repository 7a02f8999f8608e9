"""A TCP proxy in front of a redis-server that can hold back Redis's replies (a slow network, a
reply delayed in a paused server), while the commands still reach Redis and run there."""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType


class ReplyProxy:
    """``with ReplyProxy(port) as proxy``: connect to ``proxy.port``; while ``proxy.holding`` is
    set, what Redis sends is kept back (in order) until it is cleared."""

    def __init__(self, redis_port: int) -> None:
        self.redis_port = redis_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.holding = threading.Event()
        self.released = threading.Condition()
        self.sockets: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> ReplyProxy:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def hold(self) -> None:
        self.holding.set()

    def let_go(self) -> None:
        with self.released:
            self.holding.clear()
            self.released.notify_all()

    def close(self) -> None:
        self.closed = True
        self.let_go()
        for sock in [self.listener, *self.sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.redis_port))
            self.sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, target: socket.socket, replies: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if replies:
                    with self.released:
                        self.released.wait_for(lambda: not self.holding.is_set())
                target.sendall(data)
        with contextlib.suppress(OSError):
            target.shutdown(socket.SHUT_WR)
