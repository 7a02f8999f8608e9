"""Pure unit tests of the sans-IO core (no Redis): validation, keys, and the command protocol driven
by hand."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.exceptions
from redis.crc import key_slot

from scrapy_redislock import (
    AsyncCountingLock,
    CountingLock,
    InvalidArgument,
    LockConnectionError,
    LockError,
    LockLost,
)
from scrapy_redislock._redis import text
from scrapy_redislock.lock.core import SCRIPT_NAMES, LockCore
from scrapy_redislock.lock.permit import LockKeys, Permit, fence_of
from scrapy_redislock.lock.protocol import (
    Call,
    ReadGrant,
    RunScript,
    WaitReplicas,
    adrive,
    drive,
    translate_error,
)

# -- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "named", "shown"),
    [
        ({"name": ""}, "name", "''"),
        ({"name": "a{b}"}, "name", "'a{b}'"),
        ({"name": "a}b"}, "name", "'a}b'"),
        ({"name": 3}, "name", "3"),
        ({"name": None}, "name", "None"),
        ({"limit": -1}, "limit", "-1"),
        ({"limit": "three"}, "limit", "'three'"),
        ({"limit": True}, "limit", "True"),
        ({"limit": 1.5}, "limit", "1.5"),
        ({"ttl": 0}, "ttl", "got 0"),
        ({"ttl": -2}, "ttl", "-2"),
        ({"ttl": 0.0001}, "ttl", "0.0001"),
        ({"ttl": math.nan}, "ttl", "nan"),
        ({"ttl": math.inf}, "ttl", "inf"),
        ({"ttl": "30"}, "ttl", "'30'"),
        ({"ttl": True}, "ttl", "True"),
        ({"key_prefix": ""}, "key_prefix", "''"),
        ({"key_prefix": "{x}"}, "key_prefix", "'{x}'"),
        ({"reentrant": True, "limit": 3}, "reentrant", "limit=3"),
        ({"reentrant": True, "limit": None}, "reentrant", "limit=None"),
    ],
)
def test_bad_arguments_name_the_argument_and_the_value(
    kwargs: dict[str, Any], named: str, shown: str
) -> None:
    args: dict[str, Any] = {"name": "detail", "limit": 3, "ttl": 30.0} | kwargs
    with pytest.raises(InvalidArgument) as info:
        LockCore.create(args.pop("name"), args.pop("limit"), args.pop("ttl"), **args)
    message = str(info.value)
    assert message.startswith(named) or f" {named}" in message or f"{named}=" in message, message
    assert shown in message, message
    assert isinstance(info.value, LockError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("front", [CountingLock, AsyncCountingLock])
def test_the_fronts_validate_before_touching_redis(front: type) -> None:
    client = redis.Redis(port=1) if front is CountingLock else redis.asyncio.Redis(port=1)
    for kwargs, named in [
        ({"limit": -1}, "limit"),
        ({"limit": "three"}, "limit"),
        ({"ttl": 0}, "ttl"),
    ]:
        with pytest.raises(InvalidArgument, match=named):
            front(client, "detail", **kwargs)
    with pytest.raises(
        InvalidArgument, match="name must be a non-empty string without braces, got ''"
    ):
        front(client, "")


def test_client_type_is_checked() -> None:
    with pytest.raises(InvalidArgument, match=r"client must be a redis\.client\.Redis .*got str"):
        CountingLock("redis://localhost", "detail", limit=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"client must be .*got Redis"):
        CountingLock(redis.asyncio.Redis(), "detail", limit=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"client must be a redis\.asyncio.*got Redis"):
        AsyncCountingLock(redis.Redis(), "detail", limit=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"client must be .*got NoneType"):
        AsyncCountingLock(None, "detail", limit=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [-1, -0.001, math.nan, "5", True])
def test_bad_timeout_is_named_before_any_command(timeout: object) -> None:
    core = LockCore.create("detail", 1, 10.0)
    with pytest.raises(
        InvalidArgument, match=f"timeout must be None or a number >= 0, got {timeout!r}"
    ):
        next(core.acquire(timeout))  # type: ignore[arg-type]


def test_bad_limit_and_permit_are_named_before_any_command() -> None:
    core = LockCore.create("detail", 1, 10.0)
    with pytest.raises(InvalidArgument, match="limit must be an integer from 0 to 1000, got 'x'"):
        next(core.set_limit("x"))
    with pytest.raises(InvalidArgument, match="permit must be a Permit, got '0-1'"):
        next(core.release("0-1"))  # type: ignore[arg-type]


# -- keys, fences, scripts -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "name"), [("redislock", "detail"), ("crawl:a", "list-pages"), ("p", "x.y")]
)
def test_keys_share_one_hash_tag(prefix: str, name: str) -> None:
    keys = LockKeys.of(prefix, name)
    all_keys = (keys.slots, keys.meta, keys.owners, keys.ttls)
    assert len(set(all_keys)) == 4
    assert {k[k.index("{") : k.index("}") + 1] for k in all_keys} == {f"{{{name}}}"}
    assert all(k.startswith(f"{prefix}:") for k in all_keys)
    assert len({key_slot(k.encode()) for k in all_keys}) == 1  # one Redis Cluster slot
    other = LockKeys.of(prefix, name + "2")
    assert not set(all_keys) & {other.slots, other.meta, other.owners, other.ttls}


def test_fence_is_the_entry_sequence() -> None:
    assert fence_of("0-1") == 1
    assert fence_of("0-123456789") == 123456789
    assert fence_of("1700000000000-5") == 5


def test_text_decodes_nested_replies() -> None:
    assert text([b"a", [b"0-1", 2], None, "s"]) == ["a", ["0-1", 2], None, "s"]


@pytest.mark.parametrize(
    "part", ["scrapy_redislock.lock", "scrapy_redislock.crawl", "scrapy_redislock.workers"]
)
def test_every_script_opens_with_a_keys_argv_returns_header(part: str) -> None:
    folder = resources.files(part) / "scripts"
    names = sorted(
        f.name[:-4] for f in folder.iterdir() if f.name.endswith(".lua") and f.name != "_lib.lua"
    )
    assert names
    if part.endswith("lock"):
        assert set(SCRIPT_NAMES) == set(names)
    for name in names:
        head = (folder / f"{name}.lua").read_text(encoding="utf-8").split("\nlocal ", 1)[0]
        assert head.startswith(f"-- {name}:"), name
        assert "KEYS[1]" in head and "Returns" in head, name
        assert "ARGV[1]" in head or "-- ARGV none" in head, name


# -- the generator protocol, driven by hand --------------------------------------------------------


def finish(op: Any, reply: Any) -> Any:
    """Send the last reply; return the operation's result."""
    with pytest.raises(StopIteration) as done:
        op.send(reply)
    return done.value.value


def resp2(grant: str) -> list[Any]:
    return [[b"redislock:{detail}:slots", [(grant.encode(), {b"s": b"1"})]]]


def resp3(grant: str) -> dict[bytes, Any]:
    return {b"redislock:{detail}:slots": [[(grant.encode(), {b"s": b"1"})]]}


class Ticks:
    """A hand-moved clock."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def granted(core: LockCore, grant: str = "0-3") -> Permit:
    """A permit obtained through a non-blocking acquire (the take script) on a set-up core."""
    core.registration.done(core.clock())
    op = core.acquire(None, blocking=False)
    command = next(op)
    assert command.name == "take" and command.keys == (core.keys.slots, core.keys.meta)
    return finish(op, grant.encode())


def wait_of(core: LockCore, n: int) -> str:
    """The consumer name of this core's n-th wait."""
    return f"{core.owner}#{n}"


def read_grant(core: LockCore, consumer: str, block_ms: int) -> ReadGrant:
    """The blocking read of one wait, with what its guard needs (the lock's meta key; not
    durable)."""
    return ReadGrant(core.keys.slots, consumer, block_ms, core.keys.meta, False)


def confirm(core: LockCore, grant: str) -> RunScript:
    """The owner's word on a grant its blocked wait was handed (``hold_again``)."""
    return RunScript("hold_again", (core.keys.slots,), (core.owner, grant))


def confirmed(core: LockCore, op: Any, reply: Any, grant: str) -> Any:
    """Send a read's reply carrying ``grant``; the wait confirms it; return the operation's
    result."""
    assert op.send(reply) == confirm(core, grant)
    return finish(op, 1)


def maintain_reply(
    lost: tuple[str, ...] = (), adopted: tuple[str, ...] = (), lease_ms: int = 10000
) -> list[Any]:
    return [[g.encode() for g in lost], 2, lease_ms, 0, [g.encode() for g in adopted]]


@pytest.mark.parametrize("shape", [resp2, resp3])
def test_acquire_sets_up_then_blocks_for_what_is_left_of_the_timeout(
    shape: Callable[[str], Any],
) -> None:
    clock = Ticks()
    core = LockCore.create("detail", 2, 10.0, clock=clock)
    op = core.acquire(timeout=5.0)
    command = next(op)
    assert isinstance(command, RunScript) and command.name == "setup"
    assert command.keys == (
        core.keys.slots,
        core.keys.meta,
        core.keys.owners,
        core.keys.ttls,
        core.keys.seen,
    )
    assert command.args[:3] == (2, 10000, core.owner) and command.args[4] == "0"
    command = op.send([1, 2, 10000])
    assert command == read_grant(core, wait_of(core, 1), 5000)
    clock.now += 0.5
    command = op.send(None)  # the server-side block ended without a grant: the same wait goes on
    assert command == read_grant(core, wait_of(core, 1), 4500)
    clock.now += 0.2
    assert op.send(shape("0-7")) == confirm(core, "0-7")  # handed to a blocked wait: confirmed
    clock.now += 0.1
    permit = finish(op, 1)
    assert (permit.fence, permit.grant, permit.owner, permit.acquired_at) == (
        7,
        "0-7",
        core.owner,
        100.7,
    )
    # the lease begins again with the confirmation (which moved it to the owner's consumer)
    assert permit.leased_at == 100.7 and permit.valid_until == 110.7
    assert permit.token == f"{core.owner}/0-7" and permit.consumer == core.owner
    assert (
        core.held == {"0-7": permit} and core.waits_in_flight == 0 and not core.consumers.abandoned
    )
    # set up once: the next acquire goes straight to the read, on the freed consumer
    assert next(core.acquire(None)) == read_grant(core, wait_of(core, 1), 0)


def test_a_grant_reclaimed_before_its_confirmation_is_not_used_and_the_wait_goes_on() -> None:
    """A blocked wait's reply that came after Redis took the grant back (the owner was silent for
    a renewal interval): hold_again says 0, and the same wait blocks again."""
    core = LockCore.create("detail", 2, 10.0)
    core.registration.done(core.clock())
    op = core.acquire(None)
    assert next(op) == read_grant(core, wait_of(core, 1), 0)
    assert op.send(resp2("0-7")) == confirm(core, "0-7")
    assert op.send(0) == read_grant(core, wait_of(core, 1), 0)
    permit = confirmed(core, op, resp2("0-9"), "0-9")
    assert permit.grant == "0-9" and core.held == {"0-9": permit}


def test_registration_is_refreshed_after_a_quiet_spell() -> None:
    """An owner forgotten by the garbage collector (3 leases unseen) registers again before it
    waits."""
    clock = Ticks()
    core = LockCore.create("detail", 2, 10.0, clock=clock)
    core.registration.done(clock.now)
    clock.now += 10.0
    assert isinstance(next(core.acquire(None)), ReadGrant)
    clock.now += 0.1
    assert next(core.acquire(None)).name == "setup"


def test_acquire_times_out_after_one_last_look() -> None:
    clock = Ticks()
    core = LockCore.create("detail", 1, 10.0, clock=clock)
    core.registration.done(clock.now)
    op = core.acquire(timeout=0.25)
    assert next(op).block_ms == 250
    clock.now += 0.25
    # deadline passed: one look without blocking, by a script that checks for a restart
    command = op.send(None)
    assert command.name == "take" and command.args[0] == wait_of(core, 1)
    with pytest.raises(LockError, match=r"lock 'detail': no slot within 0.25 s") as info:
        op.send(None)
    assert type(info.value).__name__ == "AcquireTimeout" and isinstance(info.value, TimeoutError)
    assert core.held == {} and core.waits_in_flight == 0
    # nothing was delivered to it: the next wait reuses it
    assert core.consumers.idle == [wait_of(core, 1)]
    assert next(core.acquire(None)).consumer == wait_of(core, 1)


def test_acquire_timeout_zero_tries_once_and_try_acquire_never_blocks() -> None:
    core = LockCore.create("detail", 1, 10.0, clock=Ticks())
    core.registration.done(core.clock())
    op = core.acquire(timeout=0)
    assert next(op).name == "take"
    with pytest.raises(LockError, match="no slot"):
        op.send(None)
    op = core.acquire(None, blocking=False)
    command = next(op)
    # reaps at most once a renewal
    assert command.name == "take" and command.args == (wait_of(core, 1), 1000, "0")
    assert finish(op, None) is None and core.consumers.idle == [wait_of(core, 1)]


def test_max_block_caps_each_wait() -> None:
    clock = Ticks()
    core = LockCore.create("detail", 1, 10.0, clock=clock, max_block=4.0)
    core.registration.done(clock.now)
    # never "forever" on a client with a read timeout
    assert next(core.acquire(None)).block_ms == 4000
    op = core.acquire(timeout=10)
    assert next(op).block_ms == 4000
    clock.now += 8
    assert op.send(None).block_ms == 2000


def test_limit_none_on_a_missing_lock_is_a_clear_error() -> None:
    core = LockCore.create("ghost", None, 10.0)
    op = core.acquire(None)
    command = next(op)
    assert command.name == "setup" and command.args[0] == ""
    with pytest.raises(
        LockError, match="lock 'ghost' does not exist in Redis and no limit was given"
    ):
        op.throw(redis.exceptions.ResponseError("NOLOCK lock has no limit in Redis yet"))


def test_limit_none_learns_the_limit_from_redis() -> None:
    core = LockCore.create("detail", None, 10.0)
    op = core.setup()
    next(op)
    assert finish(op, [0, 4, 20000]) == (False, 4)
    # the lease in force: the longest ttl of the live owners
    assert core.limit == 4 and core.ttl == 20.0


def test_a_lock_that_vanished_while_waiting_is_recreated_in_recovery_mode() -> None:
    core = LockCore.create("detail", 2, 10.0)
    op = core.acquire(None)
    next(op)
    op.send([1, 2, 10000])
    command = op.throw(
        redis.exceptions.ResponseError("NOGROUP No such key 'x' or consumer group 'holders'")
    )
    assert command.name == "setup" and command.args[4] == "1"  # recover: slots start in limbo
    assert op.send([1, 2, 10000]) == read_grant(core, wait_of(core, 1), 0)
    assert confirmed(core, op, resp2("0-1"), "0-1").fence == 1


def test_other_response_errors_propagate() -> None:
    core = LockCore.create("detail", 2, 10.0)
    core.registration.done(core.clock())
    op = core.acquire(None)
    next(op)
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        op.throw(redis.exceptions.ResponseError("WRONGTYPE Operation against a key"))
    assert (
        core.waits_in_flight == 0 and not core.consumers.abandoned
    )  # an error reply: nothing was delivered


def test_an_interrupted_wait_is_abandoned_by_its_consumer_and_freed_by_the_next_maintains() -> None:
    """A wait that never saw its reply may have been handed a slot: its consumer's grants are freed,
    by name."""
    core = LockCore.create("detail", 2, 10.0)
    core.registration.done(core.clock())
    kept = granted(core, "0-2")
    op = core.acquire(None)
    assert next(op).consumer == wait_of(core, 2)
    assert core.waits_in_flight == 1
    op.close()  # cancelled (asyncio) or interrupted while blocked
    assert core.waits_in_flight == 0 and core.consumers.abandoned == {wait_of(core, 2): 2}
    # the second pass frees a grant Redis delivered late (it saw the disconnect late)
    for _ in range(2):
        op = core.maintain()
        command = next(op)
        # the consumer to free, then the grants to renew
        assert command.args[5:] == ("1", 1, wait_of(core, 2), "0-2")
        assert finish(op, maintain_reply()) == []
    assert not core.consumers.abandoned and next(core.maintain()).args[5:] == ("1", 0, "0-2")
    # emptied by the renewal
    assert kept.consumer == core.owner and core.consumers.idle == [wait_of(core, 1)]
    assert next(core.acquire(None)).consumer == wait_of(core, 1)
    assert next(core.acquire(None)).consumer == wait_of(core, 3)


def test_renew_lists_only_its_permit_and_frees_nothing_else() -> None:
    """Finding 1: renew(permit) after a cancelled wait must not free the caller's other permits."""
    core = LockCore.create("detail", 3, 10.0)
    p1, p2 = granted(core, "0-1"), granted(core, "0-2")
    op = core.acquire(None)
    next(op)
    op.close()
    op = core.renew(p1)
    command = next(op)
    # p2 is not listed, and nothing says "free the rest" (nor "all re-adopted": see maintain.lua)
    assert command.args[5:] == ("0", 1, wait_of(core, 3), "0-1")
    assert finish(op, maintain_reply()) is None
    assert not p1.lost and not p2.lost and set(core.held) == {"0-1", "0-2"}


def test_a_grant_waiting_for_replicas_is_abandoned_by_its_consumer_when_cancelled() -> None:
    core = LockCore.create("detail", 2, 10.0, replicas=1)
    core.registration.done(core.clock())
    op = core.acquire(None)
    next(op)
    assert op.send(resp2("0-4")) == confirm(core, "0-4")
    assert isinstance(op.send(1), WaitReplicas)
    # confirmed (under the owner's consumer) but not held yet: abandoning its id frees exactly it
    assert core.held == {}
    op.close()
    assert core.consumers.abandoned == {"0-4": 2}


def test_reentrant_acquire_and_release_protocol() -> None:
    core = LockCore.create("mutex", 1, 10.0, reentrant=True)
    core.registration.done(core.clock())
    op = core.acquire(None, holder="thread-1")
    next(op)
    permit = confirmed(core, op, resp2("0-4"), "0-4")
    op = core.acquire(None, holder="thread-1")
    command = next(op)
    assert command == RunScript("hold_again", (core.keys.slots,), (core.owner, "0-4"))
    assert finish(op, 1) is permit and permit.holds == 2  # the count is the process's
    # moved by hold_again
    assert permit.consumer == core.owner and core.consumers.idle == [wait_of(core, 1)]
    assert next(core.acquire(None, holder="thread-2")).block_ms == 0  # another holder waits
    op = core.release(permit)
    assert finish(op, None) is True and permit.holds == 1 and not permit.released  # no Redis
    assert core.held == {"0-4": permit}
    op = core.release(permit)
    assert next(op).args == (core.owner, "0-4")
    assert finish(op, 1) is True and permit.released and core.held == {} and core.by_holder == {}


def test_reentrant_acquire_of_a_lost_grant_waits_for_a_new_one() -> None:
    core = LockCore.create("mutex", 1, 10.0, reentrant=True)
    old = granted(core, "0-4")
    core.by_holder["t"] = old
    op = core.acquire(None, holder="t")
    assert next(op).name == "hold_again"
    assert op.send(0) == read_grant(
        core, wait_of(core, 1), 0
    )  # gone: wait like anybody else, on the freed consumer
    new = confirmed(core, op, resp2("0-9"), "0-9")
    assert new is not old and core.by_holder == {"t": new} and core.held == {"0-9": new}


@pytest.mark.parametrize(("reply", "result", "lost"), [(1, True, False), (0, False, True)])
def test_release_replies(reply: int, result: bool, lost: bool) -> None:
    core = LockCore.create("detail", 1, 10.0)
    permit = granted(core)
    op = core.release(permit)
    command = next(op)
    assert command == RunScript("release", (core.keys.slots, core.keys.meta), (core.owner, "0-3"))
    assert finish(op, reply) is result
    assert permit.lost is lost and permit.released and core.held == {}
    # its one grant is gone: the name is free for the next wait
    assert core.consumers.idle == [wait_of(core, 1)]


def test_maintain_protocol_lost_adopted_and_lease() -> None:
    core = LockCore.create("detail", 3, 10.0)
    a, b, c = granted(core, "0-1"), granted(core, "0-2"), granted(core, "0-3")
    op = core.maintain()
    command = next(op)
    assert command.name == "maintain"
    k = core.keys
    assert command.keys == (k.slots, k.meta, k.owners, k.ttls, k.seen)
    assert command.args[0] == core.owner and command.args[2:7] == (10000, 1000, "0", "1", 0)
    assert set(command.args[7:]) == {"0-1", "0-2", "0-3"}
    lost = finish(op, maintain_reply(lost=("0-2",), adopted=("0-3", "0-8"), lease_ms=20000))
    assert lost == [b] and b.lost and not a.lost and not c.lost
    assert (c.grant, c.fence) == ("0-8", 8)  # re-adopted after a data loss
    assert set(core.held) == {"0-1", "0-8"}
    # leases last 20 s; this object renews on its own ttl
    assert core.ttl == 20.0 and core.renew_interval == 1.0
    assert a.consumer == c.consumer == core.owner  # renewed grants sit under the owner's own name


def test_readoption_map_is_applied_as_a_whole() -> None:
    """Finding 3: old and new ids that collide (a, b swapped) never drop or overwrite a permit."""
    core = LockCore.create("detail", 2, 10.0)
    a, b = granted(core, "0-1"), granted(core, "0-2")
    op = core.maintain()
    next(op)
    assert finish(op, maintain_reply(adopted=("0-1", "0-2", "0-2", "0-1"))) == []
    assert core.held == {"0-2": a, "0-1": b} and (a.fence, b.fence) == (2, 1)


def test_a_permit_released_while_the_renewal_ran_gives_its_adopted_slot_back() -> None:
    """Finding 5: a release that reached Redis first makes the renewal adopt a limbo slot for
    nobody."""
    core = LockCore.create("detail", 2, 10.0)
    permit = granted(core, "0-5")
    op = core.maintain()
    next(op)
    core.let_go(permit)
    permit.released = True  # the release ran meanwhile
    command = op.send(maintain_reply(adopted=("0-5", "0-9")))
    assert command == RunScript("release", (core.keys.slots, core.keys.meta), (core.owner, "0-9"))
    assert finish(op, 1) == [] and core.held == {} and permit.grant == "0-5"


def test_maintain_does_not_report_a_permit_released_meanwhile() -> None:
    core = LockCore.create("detail", 2, 10.0)
    permit = granted(core)
    op = core.maintain()
    next(op)
    permit.released = True  # another thread released it while the script ran
    assert finish(op, maintain_reply(lost=("0-3",))) == []
    assert not permit.lost


def test_maintain_recreates_a_vanished_lock_then_runs_again() -> None:
    core = LockCore.create("detail", 2, 10.0)
    granted(core, "0-5")
    core.registration.ever = True
    op = core.maintain()
    next(op)
    command = op.throw(redis.exceptions.ResponseError("NOLOCK lock is gone from Redis"))
    # it holds a grant: not a survivor yet; the renewal of all it holds that follows reports it
    assert command.name == "setup" and command.args[4] == "1" and command.args[6] == "0"
    command = op.send([1, 2, 10000])
    assert command.name == "maintain" and command.args[5:] == ("1", 0, "0-5")
    assert finish(op, maintain_reply(adopted=("0-5", "0-1"))) == []
    assert set(core.held) == {"0-1"}


def test_maintain_of_a_lock_never_set_up_creates_it_without_limbo() -> None:
    """Finding 10: a maintain before any setup must not reserve every slot for a lease."""
    core = LockCore.create("detail", 2, 10.0)
    op = core.maintain()
    next(op)
    command = op.throw(redis.exceptions.ResponseError("NOLOCK lock is gone from Redis"))
    assert command.name == "setup" and command.args[4] == "0"


def test_renew_raises_lock_lost() -> None:
    core = LockCore.create("detail", 1, 10.0)
    permit = granted(core)
    op = core.renew(permit)
    assert next(op).args[5:] == ("1", 0, "0-3")
    with pytest.raises(LockLost, match=f"lock 'detail': lease of permit {permit.token} is gone"):
        op.send(maintain_reply(lost=("0-3",)))
    op = core.renew(granted(core, "0-4"))
    next(op)
    assert finish(op, maintain_reply()) is None


def test_set_limit_get_limit_and_release_all() -> None:
    core = LockCore.create("detail", 1, 10.0)
    op = core.set_limit(4)
    assert next(op) == RunScript(
        "set_limit", (core.keys.slots, core.keys.meta, core.keys.adapt), (4, 10000, "0", "0", "0")
    )
    assert finish(op, -1) is None and core.limit == 4
    op = core.set_limit(2)
    next(op)
    assert finish(op, 4) == 4
    op = core.get_limit()
    assert next(op) == Call(("HGET", core.keys.meta, "limit"))
    assert finish(op, b"2") == 2
    op = core.get_limit()
    next(op)
    assert finish(op, None) is None
    permits = [granted(core, "0-1"), granted(core, "0-2")]
    op = core.release_all()
    assert next(op).args == (core.owner,)
    assert finish(op, 2) == 2
    assert all(p.lost for p in permits) and core.held == {} and not core.registration.current


# -- drive / adrive --------------------------------------------------------------------------------


class Executor:
    """Canned replies per command type; an exception instance is raised instead of returned."""

    def __init__(self, replies: Iterator[Any]) -> None:
        self.replies = replies
        self.seen: list[Any] = []

    def __call__(self, command: Any) -> Any:
        self.seen.append(command)
        reply = next(self.replies)
        if isinstance(reply, BaseException):
            raise reply
        return reply


def test_drive_runs_an_operation() -> None:
    core = LockCore.create("detail", 1, 10.0)
    execute = Executor(iter([[1, 1, 10000], resp3("0-1"), 1]))
    permit = drive(core.acquire(None), execute, core.name)
    assert permit.fence == 1 and [type(c) for c in execute.seen] == [
        RunScript,
        ReadGrant,
        RunScript,
    ]


@pytest.mark.parametrize(
    "error", [redis.exceptions.ConnectionError("refused"), redis.exceptions.TimeoutError("t/o")]
)
def test_drive_names_the_lock_in_connection_errors(error: Exception) -> None:
    core = LockCore.create("detail", 1, 10.0)
    with pytest.raises(
        LockConnectionError, match=rf"redis lock 'detail': {type(error).__name__}: "
    ) as info:
        drive(core.acquire(None), Executor(iter([error])), core.name)
    assert info.value.__cause__ is error and isinstance(
        info.value, redis.exceptions.ConnectionError
    )
    assert not core.registration.current and core.held == {}


def test_translate_error_leaves_other_errors_alone() -> None:
    error = redis.exceptions.ResponseError("ERR")
    assert translate_error("x", error) is error
    already = LockConnectionError("x")
    assert translate_error("x", already) is already


def test_drive_interrupted_mid_wait_abandons_the_wait_at_once() -> None:
    """KeyboardInterrupt while blocked: the operation's cleanup runs before drive returns, not at
    GC."""
    core = LockCore.create("detail", 1, 10.0)
    execute = Executor(iter([[1, 1, 10000], KeyboardInterrupt()]))
    with pytest.raises(KeyboardInterrupt):
        drive(core.acquire(None), execute, core.name)
    assert core.waits_in_flight == 0 and core.consumers.abandoned == {f"{core.owner}#1": 2}


def test_adrive_cancelled_mid_wait_abandons_the_wait_at_once() -> None:
    core = LockCore.create("detail", 1, 10.0)
    entered = asyncio.Event()

    async def execute(command: Any) -> Any:
        if isinstance(command, RunScript):
            return [1, 1, 10000]
        entered.set()
        await asyncio.sleep(3600)

    async def scenario() -> None:
        task = asyncio.create_task(adrive(core.acquire(None), execute, core.name))
        await entered.wait()
        assert core.waits_in_flight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the task (and its traceback) are still referenced here: cleanup must not wait for GC
        assert core.waits_in_flight == 0 and core.consumers.abandoned == {f"{core.owner}#1": 2}

    asyncio.run(scenario())


def test_adrive_translates_connection_errors() -> None:
    core = LockCore.create("detail", 1, 10.0)

    async def execute(command: Any) -> Any:
        raise redis.exceptions.ConnectionError("refused")

    with pytest.raises(LockConnectionError, match="'detail'"):
        asyncio.run(adrive(core.get_limit(), execute, core.name))
