"""Pure unit tests of the sans-IO core: validation, keys, and the command protocol (no Redis)."""

from __future__ import annotations

import math
from importlib import resources

import pytest
import redis

from scrapy_redislock import CountingLock, InvalidArgument, LockError
from scrapy_redislock.core import SCRIPT_NAMES, LockCore, LockKeys, ReadGrant, RunScript, fence_of


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"name": ""}, "name"),
        ({"name": "a{b}"}, "name"),
        ({"name": 3}, "name"),
        ({"limit": -1}, "limit"),
        ({"limit": "three"}, "limit"),
        ({"limit": True}, "limit"),
        ({"limit": 1.5}, "limit"),
        ({"ttl": 0}, "ttl"),
        ({"ttl": -2}, "ttl"),
        ({"ttl": math.nan}, "ttl"),
        ({"ttl": "30"}, "ttl"),
        ({"key_prefix": ""}, "key_prefix"),
        ({"reentrant": True, "limit": 3}, "reentrant"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], named: str) -> None:
    args: dict[str, object] = {"name": "detail", "limit": 3, "ttl": 30.0} | kwargs
    with pytest.raises(InvalidArgument) as info:
        LockCore.create(args.pop("name"), args.pop("limit"), args.pop("ttl"), **args)  # type: ignore[arg-type]
    assert named in str(info.value)
    assert isinstance(info.value, LockError) and isinstance(info.value, ValueError)


def test_client_type_is_checked() -> None:
    with pytest.raises(InvalidArgument, match="client must be a redis"):
        CountingLock("redis://localhost", "detail", limit=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="client"):
        CountingLock(redis.asyncio.Redis(), "detail", limit=1)  # type: ignore[arg-type]


def test_keys_share_one_hash_tag() -> None:
    keys = LockKeys.of("redislock", "detail")
    tags = {k[k.index("{") : k.index("}") + 1] for k in (keys.slots, keys.meta, keys.owners, keys.holds)}
    assert tags == {"{detail}"}


def test_fence_is_the_entry_sequence() -> None:
    assert fence_of("0-1") == 1
    assert fence_of("0-123456789") == 123456789


def test_every_script_opens_with_a_keys_argv_returns_header() -> None:
    folder = resources.files("scrapy_redislock") / "scripts"
    for name in SCRIPT_NAMES:
        head = (folder / f"{name}.lua").read_text(encoding="utf-8").split("\nlocal ", 1)[0]
        assert head.startswith(f"-- {name}:"), name
        assert "KEYS[1]" in head and "ARGV[1]" in head and "Returns" in head, name


def test_acquire_protocol_by_hand() -> None:
    """Drive the generator with canned replies: setup, one empty blocking read, then a grant."""
    ticks = iter([0.0, 0.0, 0.5, 0.5, 0.5])
    core = LockCore.create("detail", 2, 10.0, clock=lambda: next(ticks))
    op = core.acquire(timeout=5.0)
    command = next(op)
    assert isinstance(command, RunScript) and command.name == "setup"
    assert command.keys == (core.keys.slots, core.keys.meta, core.keys.owners)
    command = op.send([1, 2, 10000])
    assert isinstance(command, ReadGrant) and command.block_ms == 5000
    command = op.send(None)  # the server-side block ended without a grant
    assert isinstance(command, ReadGrant) and command.block_ms == 4500
    with pytest.raises(StopIteration) as done:
        op.send({b"redislock:{detail}:slots": [[(b"0-7", {b"s": b"1"})]]})
    permit = done.value.value
    assert permit.fence == 7 and permit.grant == "0-7" and core.held == {"0-7": permit}


def test_release_protocol_by_hand() -> None:
    core = LockCore.create("detail", 1, 10.0)
    core.set_up = True
    permit_op = core.acquire(None, blocking=False)
    next(permit_op)
    with pytest.raises(StopIteration) as done:
        permit_op.send([[b"k", [(b"0-3", {})]]])
    permit = done.value.value
    op = core.release(permit)
    command = next(op)
    assert isinstance(command, RunScript) and command.name == "release"
    assert command.args == (core.owner, "0-3", "0")
    with pytest.raises(StopIteration) as released:
        op.send(0)
    assert released.value.value is False and permit.lost and core.held == {}
