"""Tests of the shared helpers: the one back-off; a connection closed under a command by another
task is an outage, not a bug (the helper that tells them apart, and the driver that retries it as a
connection error), pure; and how a project script is run after a NOSCRIPT, on a real
redis-server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot

from scrapy_redislock._redis import (
    Backoff,
    ProjectScript,
    ScriptBatch,
    ScriptMode,
    as_connection_error,
    hash_tag,
)
from scrapy_redislock.lock.core import LockCore
from scrapy_redislock.lock.protocol import drive
from testing.monitor import Monitor, commands
from testing.waiting import wait_until


def raised_in(filename: str, error: str) -> BaseException:
    """The exception a line of code compiled as ``filename`` raises (its innermost frame is
    there)."""
    code = compile(f"raise {error}", filename, "exec")
    try:
        exec(code, {})
    except BaseException as exc:
        return exc
    raise AssertionError("nothing raised")


def test_an_attribute_error_inside_a_connection_is_a_connection_error() -> None:
    exc = raised_in(
        "/venv/lib/python3.11/site-packages/redis/asyncio/connection.py",
        "AttributeError(\"'NoneType' object has no attribute 'writelines'\")",
    )
    error = as_connection_error(exc)
    assert isinstance(error, redis.exceptions.ConnectionError)
    assert "writelines" in str(error) and error.__cause__ is exc
    transport = raised_in(
        "/usr/lib/python3.11/asyncio/selector_events.py", "TypeError(\"'NoneType' object\")"
    )
    assert isinstance(as_connection_error(transport), redis.exceptions.ConnectionError)


def test_the_same_errors_anywhere_else_are_left_alone() -> None:
    assert (
        as_connection_error(raised_in("/work/scrapy_redislock/lock/core.py", "TypeError()")) is None
    )
    assert as_connection_error(raised_in("/x/redis/asyncio/connection.py", "KeyError()")) is None
    assert as_connection_error(ValueError()) is None


def test_the_driver_hands_the_operation_a_connection_error() -> None:
    """A command whose connection broke that way reaches the operation as a ConnectionError (which
    the lock wraps in LockConnectionError and the crawl retries); any other AttributeError is
    raised as it is."""
    core = LockCore.create("detail", 2, 30.0)
    broken = raised_in("/x/redis/asyncio/connection.py", "AttributeError('writelines')")

    def closed_under(command: object) -> object:
        raise broken

    try:
        drive(core.get_limit(), closed_under, "detail")
    except redis.exceptions.ConnectionError as exc:
        assert "closed under the command" in str(exc)
    else:
        raise AssertionError("no error")

    def our_bug(command: object) -> object:
        raise AttributeError("ours")

    try:
        drive(core.get_limit(), our_bug, "detail")
    except AttributeError as exc:
        assert str(exc) == "ours"
    else:
        raise AssertionError("no error")


def test_the_back_off_doubles_with_jitter_up_to_its_most_and_resets() -> None:
    """Each delay lies between half and all of first * 2**failures (at most ``most``): workers an
    outage stopped together spread their retries."""
    backoff = Backoff(first=0.1, most=1.0)
    delays = [backoff.next() for _ in range(8)]
    for failures, delay in enumerate(delays):
        ceiling = min(1.0, 0.1 * 2**failures)
        assert ceiling / 2 <= delay <= ceiling
    assert len({round(Backoff(0.1, 1.0).next(), 9) for _ in range(20)}) > 1  # not in lockstep
    backoff.reset()
    assert backoff.next() <= 0.1


# -- the project's scripts on a real redis-server ---------------------------------------------------


@pytest.mark.integration
def test_the_default_user_loads_a_missing_script_without_trying_the_functions(
    redis_client: redis.Redis,
) -> None:
    """After a NOSCRIPT, Redis's default user loads the script and runs it again (one load, as
    redis-py's Script): no FCALL of functions it never needed on the way."""
    redis_client.script_flush()
    source = "return ARGV[1]"
    port = redis_client.connection_pool.connection_kwargs["port"]
    monitor = Monitor(port)
    with redis.Redis(port=port, protocol=2) as client:
        assert ProjectScript(client, source, ScriptMode())(keys=["k"], args=["x"]) == b"x"
    raw = monitor.stop(redis_client)
    sent = [(source, args[0].decode().lower()) for _, source, args in commands(raw)]
    ours = next(source for source, name in sent if name == "evalsha")
    assert [name for source, name in sent if source == ours] == ["evalsha", "script", "evalsha"]


class CountingConnection(redis.asyncio.Connection):
    """A real connection that counts its writes of scripts: one batch, one write."""

    writes = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        packed = command if isinstance(command, bytes | str) else b"".join(command)
        if b"EVALSHA" in (packed.encode() if isinstance(packed, str) else packed):
            type(self).writes += 1
        await super().send_packed_command(command, check_health)


def counting_client(port: int) -> redis.asyncio.Redis:
    """An asyncio client whose connections count their writes of scripts."""
    pool = redis.asyncio.ConnectionPool(port=port, protocol=2, connection_class=CountingConnection)
    return redis.asyncio.Redis.from_pool(pool)


def busy(microseconds: int, then: str) -> str:
    """A script that keeps Redis busy this long (on its clock), then runs ``then``."""
    return (
        "local t0 = redis.call('TIME') local t = t0 "
        f"while (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) < {microseconds} do "
        f"t = redis.call('TIME') end {then}"
    )


@pytest.mark.integration
def test_scripts_asked_in_one_loop_turn_go_out_together_each_with_its_own_reply(
    redis_client: redis.Redis,
) -> None:
    """The EVALSHAs asked of an asyncio runner in one turn of the event loop (ScriptBatch): the
    first goes at once, the others are written together at the next turn: one write, one
    connection, in the order asked, no MULTI; each caller gets its own reply or error (a script
    that fails fails only its caller), and a caller cancelled before the batch is written sends
    nothing."""
    port = redis_client.connection_pool.connection_kwargs["port"]
    echo, refuse = "return ARGV[1]", "return redis.error_reply('NOPE ' .. ARGV[1])"

    async def main() -> list[object]:
        client = counting_client(port)
        try:
            mode, batch = ScriptMode(), ScriptBatch(client)
            good = ProjectScript(client, echo, mode, batch)
            bad = ProjectScript(client, refuse, mode, batch)
            assert await good(keys=["k"], args=["loaded"]) == b"loaded"  # both scripts loaded
            with pytest.raises(redis.exceptions.ResponseError):
                await bad(keys=["k"], args=["loaded"])
            monitor = Monitor(port)
            writes = CountingConnection.writes
            first = asyncio.ensure_future(good(keys=["k"], args=["first"]))
            gone = asyncio.ensure_future(good(keys=["k"], args=["gone"]))
            calls = [asyncio.ensure_future(good(keys=["k"], args=[str(i)])) for i in range(4)]
            calls.append(asyncio.ensure_future(bad(keys=["k"], args=["x"])))
            await asyncio.sleep(0)  # every call has asked; the batch is written at the next turn
            gone.cancel()
            results = await asyncio.gather(first, gone, *calls, return_exceptions=True)
            assert CountingConnection.writes - writes == 2  # the first, then the batch
            raw = monitor.stop(redis_client)
            sent = [(source, args) for _, source, args in commands(raw)]
            assert not any(args[0].lower() == b"multi" for _, args in sent)
            scripts = [(source, args[-1]) for source, args in sent if args[0].lower() == b"evalsha"]
            assert sorted(arg for _, arg in scripts) == [b"0", b"1", b"2", b"3", b"first", b"x"]
            batched = [(source, arg) for source, arg in scripts if arg != b"first"]
            assert [arg for _, arg in batched] == [b"0", b"1", b"2", b"3", b"x"]
            assert len({source for source, _ in batched}) == 1
            return results
        finally:
            await client.aclose()

    results = asyncio.run(main())
    assert results[0] == b"first"
    assert isinstance(results[1], asyncio.CancelledError)
    assert results[2:6] == [b"0", b"1", b"2", b"3"]
    assert isinstance(results[6], redis.exceptions.ResponseError) and "NOPE x" in str(results[6])


@pytest.mark.integration
def test_a_batch_after_script_flush_loads_its_script_and_answers_every_caller(
    redis_client: redis.Redis,
) -> None:
    """NOSCRIPT comes back to each caller of a batch on its own; each loads the script and runs
    it again, and gets its own reply."""
    port = redis_client.connection_pool.connection_kwargs["port"]

    async def main() -> list[object]:
        client = redis.asyncio.Redis(port=port, protocol=2)
        try:
            script = ProjectScript(client, "return ARGV[1]", ScriptMode(), ScriptBatch(client))
            assert await script(keys=["k"], args=["first"]) == b"first"
            await client.script_flush()
            calls = [script(keys=["k"], args=[str(i)]) for i in range(4)]
            return list(await asyncio.gather(*calls))
        finally:
            await client.aclose()

    assert asyncio.run(main()) == [b"0", b"1", b"2", b"3"]


@pytest.mark.integration
def test_a_timeout_in_a_batch_fails_its_callers_and_runs_no_script_twice(
    redis_client: redis.Redis,
) -> None:
    """A batch whose second script outlasts the socket timeout, on a client that retries: every
    caller not answered gets the timeout, and no script of the batch runs twice (a pipeline's retry
    would run every one again). The runner goes on with a new connection."""
    port = redis_client.connection_pool.connection_kwargs["port"]
    count = "return redis.call('INCR', KEYS[1])"
    slow = busy(600000, "return redis.call('INCR', KEYS[1])")

    async def main() -> list[object]:
        client = redis.asyncio.Redis(
            port=port, protocol=2, socket_timeout=0.3, retry=Retry(NoBackoff(), 2)
        )
        try:
            mode, batch = ScriptMode(), ScriptBatch(client)
            counter, sleeper = (ProjectScript(client, s, mode, batch) for s in (count, slow))
            await client.script_load(count)
            await client.script_load(slow)
            # the turn's first goes alone, at once; a, b, c are the batch
            calls = [counter(keys=["lead"]), counter(keys=["a"]), sleeper(keys=["b"])]
            calls.append(counter(keys=["c"]))
            results = list(await asyncio.gather(*calls, return_exceptions=True))[1:]
            await asyncio.to_thread(
                wait_until, lambda: redis_client.get("b") is not None, 5.0, "the slow script's end"
            )
            results.append(await counter(keys=["d"]))  # a new connection
            return results
        finally:
            await client.aclose()

    results = asyncio.run(main())
    # the first reply is written with the others, after the slow script, unless Redis read the
    # first command alone
    assert results[0] == 1 or isinstance(results[0], redis.exceptions.TimeoutError), results
    assert all(isinstance(r, redis.exceptions.TimeoutError) for r in results[1:3]), results
    assert results[3] == 1
    assert [redis_client.get(key) for key in "ab"] == [b"1", b"1"]
    assert redis_client.get("c") in (None, b"1")  # Redis may drop it with the closed connection


@pytest.mark.integration
def test_a_batch_whose_callers_all_leave_drops_its_connection_and_the_runner_goes_on(
    redis_client: redis.Redis,
) -> None:
    """Callers cancelled after their batch was written (a timeout, a spider closing): the reply is
    nobody's, so the connection is dropped as redis-py drops one command's, the pool gets it back,
    and the next batch is answered."""
    port = redis_client.connection_pool.connection_kwargs["port"]
    slow = busy(300000, "return ARGV[1]")

    async def main() -> list[object]:
        client = counting_client(port)
        try:
            mode, batch = ScriptMode(), ScriptBatch(client)
            script = ProjectScript(client, slow, mode, batch)
            echo = ProjectScript(client, "return ARGV[1]", mode, batch)
            await client.script_load(slow)
            await echo(keys=["k"], args=["loaded"])
            writes = CountingConnection.writes
            # the turn's first (an echo) goes alone, at once; the two slow ones are the batch
            lead = asyncio.ensure_future(echo(keys=["k"], args=["lead"]))
            calls = [asyncio.ensure_future(script(keys=["k"], args=[str(i)])) for i in range(2)]
            while CountingConnection.writes < writes + 2:  # the first, then the batch, written
                await asyncio.sleep(0.005)
            for call in calls:
                call.cancel()
            gone = await asyncio.gather(*calls, return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError) for r in gone), gone
            assert await lead == b"lead"
            again = [script(keys=["k"], args=["x"]), script(keys=["k"], args=["y"])]
            return list(await asyncio.gather(*again))
        finally:
            await client.aclose()

    assert asyncio.run(main()) == [b"x", b"y"]


@pytest.mark.parametrize(
    "key",
    [
        "shop:requests",  # no tag: the whole key
        "{shop}:requests",  # its tag
        "x{}y{z}",  # an empty first tag: the whole key, braces and all
        "a{b",  # a brace never closed: the whole key
        "shop}:requests",  # a '}' would end our tag early: a number in the key's slot
        "a{}b",
    ],
)
def test_a_hash_tag_puts_our_key_in_the_slot_of_the_users_key(key: str) -> None:
    """A key of ours tagged with hash_tag(key) is in key's Redis Cluster slot, whatever braces the
    user's key has: a script's keys must be in one slot. A whole key with a '}' was used as the tag
    as it was, and ``{shop}:requests}`` hashes ``shop``: CROSSSLOT on Cluster."""
    ours = f"redislock:shared:{{{hash_tag(key)}}}:popped:p1:{key}"
    assert key_slot(ours.encode()) == key_slot(key.encode())
