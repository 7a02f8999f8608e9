"""A user-space TCP proxy that puts a network between a client and a server on one machine: a delay
per direction, and a blackhole on demand. No root, no kernel netem.

    with LatencyProxy(redis_port, delay=0.0025) as proxy:     # +5 ms per round trip
        url = f"redis://127.0.0.1:{proxy.port}"
        ...
        proxy.blackhole()     # nothing goes through any more, either way; connections stay open
        proxy.heal()          # what was held goes on, in order (as TCP delivers after a partition)
        proxy.blackhole("down")   # only the replies held back: commands still reach Redis and run

Each chunk read from one side is written to the other ``delay`` seconds after it arrived (``up``:
client to server, ``down``: server to client; both by default), in order. While a direction is
blackholed (both by default), nothing is written that way; while ``up`` is, a new client's
connection is accepted but not carried on to the server until healed. The peers see a silent
network, not a closed connection (as a switch failing, a VM paused, a link saturated). One asyncio
loop in a daemon thread serves every connection; give each process its own proxy to cut one process
off while the others carry on.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from types import TracebackType

CHUNK = 65536


class LatencyProxy:
    """``LatencyProxy(target_port, delay=..., up=..., down=...)``: listens on ``port`` (127.0.0.1)
    and forwards to ``target_host:target_port``."""

    def __init__(
        self,
        target_port: int,
        delay: float = 0.0,
        *,
        up: float | None = None,
        down: float | None = None,
        target_host: str = "127.0.0.1",
    ) -> None:
        if delay < 0 or (up is not None and up < 0) or (down is not None and down < 0):
            raise ValueError(f"LatencyProxy: delays must be >= 0 s, got {delay=} {up=} {down=}")
        self.target = (target_host, target_port)
        self.up = delay if up is None else up  # s, client -> server
        self.down = delay if down is None else down  # s, server -> client
        self.connections = 0  # accepted so far
        self.accepted: list[float] = []  # when each was accepted, on time.monotonic
        self.forwarded = {"up": 0, "down": 0}  # bytes written on
        self._loop = asyncio.new_event_loop()
        self._open: dict[str, asyncio.Event] = {}  # direction -> set while it forwards
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.port: int = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)

    def __enter__(self) -> LatencyProxy:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def url(self) -> str:
        """A redis:// URL through this proxy."""
        return f"redis://127.0.0.1:{self.port}"

    @property
    def blackholed(self) -> bool:
        """Whether a direction is blackholed now."""
        return any(not event.is_set() for event in self._open.values())

    def set_delay(self, delay: float) -> None:
        """The delay of both directions from now on, s (chunks already read keep theirs)."""
        if delay < 0:
            raise ValueError(f"LatencyProxy.set_delay: delay must be >= 0 s, got {delay}")
        self.up = self.down = delay

    def blackhole(self, *directions: str) -> None:
        """Stop forwarding ``directions`` ("up", "down"; both when none is named); connections stay
        open (until :meth:`heal`)."""
        unknown = set(directions) - {"up", "down"}
        if unknown:
            raise ValueError(
                f"LatencyProxy.blackhole: directions are 'up' and 'down', got {unknown}"
            )

        def close() -> None:
            for direction in directions or ("up", "down"):
                self._opened(direction).clear()

        self._call(close)

    def heal(self) -> None:
        """Forward again, both ways: what was held goes on, in order."""

        def reopen() -> None:
            for direction in ("up", "down"):
                self._opened(direction).set()

        self._call(reopen)

    def close(self) -> None:
        """Close the listener and every connection; stop the thread."""
        if self._loop.is_closed():
            return
        with contextlib.suppress(RuntimeError, TimeoutError):
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    # -- on the proxy's loop -------------------------------------------------------------------------

    def _call(self, action: Callable[[], None]) -> None:
        if self._loop.is_closed():
            return  # closed: nothing goes through any more, whatever was asked

        async def run() -> None:
            action()

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def _opened(self, direction: str) -> asyncio.Event:
        if direction not in self._open:
            self._open[direction] = asyncio.Event()
            self._open[direction].set()
        return self._open[direction]

    async def _listen(self) -> int:
        self._opened("up"), self._opened("down")
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _serve(
        self, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter
    ) -> None:
        self.connections += 1
        self.accepted.append(time.monotonic())
        self._writers.add(client)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        server: asyncio.StreamWriter | None = None
        try:
            await self._opened("up").wait()  # a partition: the connection goes no further
            try:
                server_reader, server = await asyncio.open_connection(*self.target)
            except OSError:
                return
            self._writers.add(server)
            await asyncio.gather(
                self._pump(client_reader, server, "up"),
                self._pump(server_reader, client, "down"),
                return_exceptions=True,
            )
        except asyncio.CancelledError:
            # closed with the connection open: end quietly (Python 3.11's start_server callback
            # reads a cancelled task's exception and reports it as unraisable)
            return
        finally:
            self._tasks.discard(task)
            for writer in (client, server):
                if writer is not None:
                    self._writers.discard(writer)
                    writer.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str
    ) -> None:
        """Read as it comes; write each chunk on when its delay is over and the network is open."""
        line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await line.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._opened(direction).wait()
                if not data:
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    return
                writer.write(data)
                self.forwarded[direction] += len(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(CHUNK)
                delay = self.up if direction == "up" else self.down
                line.put_nowait((time.monotonic() + delay, data))
                if not data:
                    break
            await sender
        finally:
            sender.cancel()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
