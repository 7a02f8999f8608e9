"""Pure tests of the shared helpers: the one back-off; a connection closed under a command by
another task is an outage, not a bug (the helper that tells them apart, and the driver that retries
it as a connection error)."""

from __future__ import annotations

import redis.exceptions

from scrapy_redislock._redis import Backoff, as_connection_error
from scrapy_redislock.lock.core import LockCore
from scrapy_redislock.lock.protocol import drive


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
