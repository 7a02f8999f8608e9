"""What the parts of one lock operation (:mod:`.wait`, :mod:`.renewal`) need of their
:class:`~scrapy_redislock.lock.core.LockCore`: the parts import this, never the core, so imports
run one way."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from scrapy_redislock.lock.consumers import Consumers, Registration
    from scrapy_redislock.lock.permit import LockKeys, Permit
    from scrapy_redislock.lock.protocol import Operation, RunScript


class Core(Protocol):
    """One lock object's state and the operations its parts call back."""

    name: str
    owner: str
    keys: LockKeys
    identity: dict[str, Any]
    ttl: float
    durable: bool
    replicas: int
    reentrant: bool
    max_block: float | None
    held: dict[str, Permit]
    waits_in_flight: int
    reported_limit: int | None
    consumers: Consumers
    registration: Registration
    light_grants_made: int

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def ttl_ms(self) -> int: ...

    @property
    def renew_interval(self) -> float: ...

    @property
    def durable_flag(self) -> str: ...

    @property
    def stream_grants(self) -> set[str]: ...

    def ensure_setup(self) -> Operation[None]: ...

    def take_script(self, consumer: str) -> RunScript: ...

    def maintain(self, permits: list[Permit] | None = None) -> Operation[list[Permit]]: ...

    def wait_replicas(self) -> Operation[int]: ...

    def release(self, permit: Permit, confirm: bool = True) -> Operation[bool]: ...

    def let_go(self, permit: Permit) -> None: ...
