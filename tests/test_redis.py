"""Tests of the shared helpers: the one back-off; a connection closed under a command by another
task is an outage, not a bug (the helper that tells them apart, and the driver that retries it as a
connection error), pure; and how a project script is run after a NOSCRIPT, on a real
redis-server."""

from __future__ import annotations

import pytest
import redis
import redis.exceptions

from scrapy_redislock._redis import Backoff, ProjectScript, ScriptMode, as_connection_error
from scrapy_redislock.lock.core import LockCore
from scrapy_redislock.lock.protocol import drive
from testing.monitor import Monitor, commands


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
