"""REDISLOCK_SCHEDULER_INNER takes what Scrapy's SCHEDULER takes: a class object (even one not
importable by its qualified name) or an import path, checked against the interface Scrapy's engine
checks (BaseScheduler); anything else is a ConfigError naming the setting and the value."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from scrapy.core.engine import ExecutionEngine
from scrapy.core.scheduler import BaseScheduler, Scheduler
from scrapy.settings import Settings

from scrapy_redislock import ConfigError
from scrapy_redislock.crawl.inner import inner_name, load_inner_scheduler
from scrapy_redislock.crawl.settings import read_settings
from scrapy_redislock.requests.scheduler import StageScheduler
from testing.inprocess import front


def local_classes() -> dict[str, type]:
    """Classes defined in a function: their qualified names (``local_classes.<locals>.Duck``) cannot
    be imported."""

    class Duck:  # the three methods and nothing else, not derived from BaseScheduler: Scrapy takes it
        def has_pending_requests(self) -> bool:
            return False

        def enqueue_request(self, request: Any) -> bool:
            return True

        def next_request(self) -> None:
            return None

    class NoNext:  # lacks next_request
        def has_pending_requests(self) -> bool:
            return False

        def enqueue_request(self, request: Any) -> bool:
            return True

    class NotCallable(Duck):
        next_request = None  # type: ignore[assignment]

    class Sub(Scheduler):
        pass

    return {"Duck": Duck, "NoNext": NoNext, "NotCallable": NotCallable, "Sub": Sub}


LOCAL = local_classes()


def scrapy_accepts(value: Any) -> bool:
    """What Scrapy's engine does with the same value as SCHEDULER (scrapy/core/engine.py)."""
    try:
        ExecutionEngine._get_scheduler_class(None, Settings({"SCHEDULER": value}))  # type: ignore[arg-type]
    except (TypeError, ValueError, ImportError, NameError, AttributeError):
        return False
    return True


CANDIDATES = [
    "scrapy.core.scheduler.Scheduler",
    "scrapy_redis.scheduler.Scheduler",
    Scheduler,
    BaseScheduler,
    LOCAL["Duck"],
    LOCAL["Sub"],
    LOCAL["NoNext"],
    LOCAL["NotCallable"],
    "scrapy.core.scheduler.NoSuchScheduler",
    "no_such_module.Scheduler",
    "Scheduler",  # not a full path
    "scrapy.http.Request",  # a class, not a scheduler
    "scrapy.core.scheduler",  # a module
    dict,
]


@pytest.mark.parametrize("value", CANDIDATES, ids=[inner_name(v) for v in CANDIDATES])
def test_accepted_exactly_when_scrapy_accepts_it_as_scheduler(value: Any) -> None:
    """Scrapy's own check decides; ours only adds a ConfigError that names the setting, the value
    and what lacks."""
    if scrapy_accepts(value):
        loaded = load_inner_scheduler(value)
        assert isinstance(loaded, type) and issubclass(loaded, BaseScheduler)
        return
    with pytest.raises(ConfigError) as raised:
        load_inner_scheduler(value)
    assert "REDISLOCK_SCHEDULER_INNER" in str(raised.value) and inner_name(value) in str(
        raised.value
    )


def test_a_class_object_is_kept_as_given_even_when_its_name_cannot_be_imported() -> None:
    duck = LOCAL["Duck"]
    assert "<locals>" in duck.__qualname__
    checked = read_settings(Settings({"REDISLOCK_SCHEDULER_INNER": duck}))
    assert checked.scheduler_inner is duck
    assert load_inner_scheduler(checked.scheduler_inner) is duck


def test_an_import_path_is_loaded_as_scrapy_loads_it() -> None:
    checked = read_settings(
        Settings({"REDISLOCK_SCHEDULER_INNER": "scrapy.core.scheduler.Scheduler"})
    )
    assert checked.scheduler_inner == "scrapy.core.scheduler.Scheduler"
    assert load_inner_scheduler(checked.scheduler_inner) is Scheduler
    # the default
    assert read_settings(Settings({})).scheduler_inner == "scrapy.core.scheduler.Scheduler"


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (LOCAL["NoNext"], "lacks next_request"),
        (LOCAL["NotCallable"], "lacks next_request"),
        (42, "must be a scheduler class or its import path"),
        (LOCAL["Duck"](), "must be a scheduler class or its import path"),
        ("Scheduler", "must be a scheduler class or its import path"),
        ("scrapy.core.scheduler.", "must be a scheduler class or its import path"),
    ],
    ids=[
        "class-without-next_request",
        "next_request-not-callable",
        "int",
        "instance",
        "not-a-path",
        "trailing-dot",
    ],
)
def test_read_settings_refuses_what_is_no_scheduler_class_without_importing_anything(
    value: Any, says: str
) -> None:
    with pytest.raises(ConfigError, match="REDISLOCK_SCHEDULER_INNER") as raised:
        read_settings(Settings({"REDISLOCK_SCHEDULER_INNER": value}))
    assert says in str(raised.value)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("no_such_module.Scheduler", "cannot be loaded: 'no_such_module.Scheduler'"),
        ("scrapy.core.scheduler.Nope", "cannot be loaded: 'scrapy.core.scheduler.Nope'"),
        (
            "scrapy.http.Request",
            "'scrapy.http.Request' is not a scheduler class (it lacks has_pending_requests",
        ),
        (
            "scrapy.core.scheduler.logger",
            "must name a scheduler class, got 'scrapy.core.scheduler.logger'",
        ),
    ],
)
def test_a_path_that_does_not_load_a_scheduler_class_is_named(value: str, says: str) -> None:
    read_settings(Settings({"REDISLOCK_SCHEDULER_INNER": value}))  # only its form is checked here
    with pytest.raises(ConfigError, match="REDISLOCK_SCHEDULER_INNER") as raised:
        load_inner_scheduler(value)
    assert says in str(raised.value)


def test_the_wrapping_scheduler_is_refused_as_its_own_inner_scheduler() -> None:
    class Mine(StageScheduler):
        pass

    for value in (StageScheduler, "scrapy_redislock.StageScheduler", Mine):
        with pytest.raises(
            ConfigError, match=r"REDISLOCK_SCHEDULER_INNER .* is StageScheduler itself"
        ):
            load_inner_scheduler(value, outer=StageScheduler)


@pytest.mark.integration
def test_stage_scheduler_wraps_a_class_given_as_an_object(
    redis_url: str, redis_client: Any
) -> None:
    """A subclass of Scrapy's scheduler defined in a test (its qualified name holds ``<locals>``) is
    built and wrapped, as SCHEDULER would take it."""

    class Counting(Scheduler):
        pass

    async def run() -> None:
        async with front(redis_url, {"detail": 1}, REDISLOCK_SCHEDULER_INNER=Counting) as f:
            assert f.scheduler is not None and type(f.scheduler.inner) is Counting

    asyncio.run(run())
