"""pytest plugin of the compatibility pass: puts this project's components in place under a peer's own tests.

Loaded with ``-p compat.plugin`` by ``compat/run.py`` (the project root first on PYTHONPATH), in every run, the
baseline included: there it only records results. Configured by environment variables (run.py sets them):

``COMPAT_FRONT``
    ``none`` (baseline: nothing patched), ``stage`` (StageScheduler + StageLockMiddleware) or ``worker``
    (StageWorkerScheduler, and StageWorkerMixin under scrapy-redis's spiders).
``COMPAT_CAP``
    The cap of the one stage every request is in (``REDISLOCK_STAGES`` / ``REDISLOCK_WORKER_STAGES = {"all": CAP}``).
``COMPAT_REDIS_URL``
    The redis-server run.py started for this run.
``COMPAT_INNER``
    With the stage front: REDISLOCK_SCHEDULER_INNER when a test sets no SCHEDULER (Scrapy's scheduler by default;
    scrapy-redis's for scrapy-redis's tests).
``COMPAT_SUBSTITUTE``
    ``1`` (default): a test module's global ``Scheduler`` that is Scrapy's or scrapy-redis's class is replaced, for
    the test, by a stand-in whose ``from_crawler`` builds ours (StageScheduler wrapping that class, or
    StageWorkerScheduler); called without a crawler (``Scheduler(dupefilter)``) it is the real class.
``COMPAT_SPIDER_MIXIN``
    ``1`` (default with the worker front): ``scrapy_redis.spiders.RedisSpider`` / ``RedisCrawlSpider`` become
    ``StageWorkerMixin`` subclasses before the tests import them.
``COMPAT_NOSE_SHIM``
    ``1``: call nose-style ``setup()`` / ``teardown()`` methods of plain test classes, as pytest < 8 did
    (scrapy-redis 0.9.1's tests rely on it; its requirements pin pytest < 7). Applied to baseline and patched runs.
``COMPAT_RESULTS``
    A file to write one JSON line per event (test start, test outcome, warning, session end).

What it patches (front ``stage``/``worker`` only):

- ``scrapy.settings.default_settings``: SCHEDULER (ours), DOWNLOADER_MIDDLEWARES_BASE (+ StageLockMiddleware at
  950, stage front), REDISLOCK_STAGES or REDISLOCK_WORKER_STAGES ``{"all": CAP}``, REDISLOCK_DEFAULT_STAGE
  ``"all"``, REDISLOCK_URL, and REDISLOCK_KEY_PREFIX (a new one before each test, so no lock outlives its test);
  every ``Settings()`` made afterwards starts from them.
- ``scrapy.crawler.Crawler.__init__``: after Scrapy's own (which applies the spider's settings), a SCHEDULER the
  test set itself (priority above ``default``) moves to REDISLOCK_SCHEDULER_INNER and SCHEDULER becomes ours, at
  the same priority (stage front). With the worker front only scrapy-redis's scheduler is replaced.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import re
import time
import unittest
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

STAGE_SCHEDULER = "scrapy_redislock.StageScheduler"
WORKER_SCHEDULER = "scrapy_redislock.StageWorkerScheduler"
MIDDLEWARE = "scrapy_redislock.StageLockMiddleware"
STAGE = "all"

FRONT = os.environ.get("COMPAT_FRONT", "none")
CAP = int(os.environ.get("COMPAT_CAP", "1"))
REDIS_URL = os.environ.get("COMPAT_REDIS_URL", "redis://127.0.0.1:6379/0")
INNER = os.environ.get("COMPAT_INNER") or None
SUBSTITUTE = os.environ.get("COMPAT_SUBSTITUTE", "1") == "1"
SPIDER_MIXIN = os.environ.get("COMPAT_SPIDER_MIXIN", "1" if FRONT == "worker" else "0") == "1"
NOSE_SHIM = os.environ.get("COMPAT_NOSE_SHIM", "0") == "1"
RESULTS = os.environ.get("COMPAT_RESULTS")

_current: str | None = None  # nodeid of the test running now
_touched: dict[str, Counter[str]] = {}  # nodeid -> what of ours it met (see _touch)
_outcomes: dict[str, dict[str, Any]] = {}
_tests_run = 0


def _touch(what: str) -> None:
    """Count, for the running test, one meeting with our components: ``direct`` (a Scheduler the
    test built directly became ours), ``passthrough`` (built without a crawler: stayed Scrapy's),
    ``inner`` (a SCHEDULER the test set became REDISLOCK_SCHEDULER_INNER), ``StageScheduler`` /
    ``StageWorkerScheduler`` (one was built), ``mixin`` (the test module uses scrapy-redis's
    spiders, which carry StageWorkerMixin)."""
    if _current is not None:
        _touched.setdefault(_current, Counter())[what] += 1


def _emit(event: dict[str, Any]) -> None:
    if not RESULTS:
        return
    with open(RESULTS, "a", encoding="utf-8") as out:
        out.write(json.dumps(event, default=str) + "\n")


# -- putting the components in place ---------------------------------------------------------------


def _ours() -> tuple[type, ...]:
    from scrapy_redislock.requests.scheduler import StageScheduler
    from scrapy_redislock.workers.scheduler import StageWorkerScheduler

    return (StageScheduler, StageWorkerScheduler)


def _is_ours(value: Any) -> bool:
    """Whether ``value`` is (the path of) one of our schedulers or a subclass. Not ``issubclass``:
    Scrapy's BaseScheduler metaclass makes any class with the scheduler methods a "subclass" of
    StageWorkerScheduler."""
    cls = _resolve(value)
    ours = _ours()
    return isinstance(cls, type) and any(base in ours for base in cls.__mro__)


def _resolve(value: Any) -> Any:
    from scrapy.utils.misc import load_object

    try:
        return load_object(value) if isinstance(value, str) else value
    except (ImportError, ValueError, NameError, AttributeError):
        return None


def _is_scrapy_redis_scheduler(value: Any) -> bool:
    try:
        from scrapy_redis.scheduler import Scheduler as RedisScheduler
    except ImportError:
        return False
    cls = _resolve(value)
    return isinstance(cls, type) and RedisScheduler in cls.__mro__


def _patch_default_settings() -> None:
    import scrapy.settings.default_settings as defaults

    defaults.REDISLOCK_URL = REDIS_URL  # type: ignore[attr-defined]
    defaults.REDISLOCK_DEFAULT_STAGE = STAGE  # type: ignore[attr-defined]
    defaults.REDISLOCK_KEY_PREFIX = "compat"  # type: ignore[attr-defined]
    if FRONT == "stage":
        defaults.SCHEDULER = STAGE_SCHEDULER
        defaults.REDISLOCK_STAGES = {STAGE: CAP}  # type: ignore[attr-defined]
        defaults.DOWNLOADER_MIDDLEWARES_BASE = {
            **defaults.DOWNLOADER_MIDDLEWARES_BASE,
            MIDDLEWARE: 950,
        }
        if INNER:
            defaults.REDISLOCK_SCHEDULER_INNER = INNER  # type: ignore[attr-defined]
    else:
        defaults.SCHEDULER = WORKER_SCHEDULER
        defaults.REDISLOCK_WORKER_STAGES = {STAGE: CAP}  # type: ignore[attr-defined]


def _set_key_prefix(prefix: str) -> None:
    import scrapy.settings.default_settings as defaults

    defaults.REDISLOCK_KEY_PREFIX = prefix  # type: ignore[attr-defined]


def _move_scheduler(settings: Any) -> None:
    """A SCHEDULER the test set itself: inner scheduler of ours (stage front), or replaced (worker
    front, only scrapy-redis's)."""
    from scrapy.settings import SETTINGS_PRIORITIES

    priority = settings.getpriority("SCHEDULER")
    if priority is None or priority <= SETTINGS_PRIORITIES["default"] or settings.frozen:
        return
    value = settings.get("SCHEDULER")
    if _is_ours(value):
        return
    if FRONT == "stage":
        settings.set("REDISLOCK_SCHEDULER_INNER", value, priority=priority)
        settings.set("SCHEDULER", STAGE_SCHEDULER, priority=priority)
        _touch("inner")
    elif _is_scrapy_redis_scheduler(value):
        settings.set("SCHEDULER", WORKER_SCHEDULER, priority=priority)
        _touch("inner")


def _wrap_crawler_init() -> None:
    from scrapy.crawler import Crawler

    original = Crawler.__init__

    @functools.wraps(original)
    def __init__(self: Crawler, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _move_scheduler(self.settings)

    Crawler.__init__ = __init__  # type: ignore[method-assign]


def _count_builds() -> None:
    for cls in _ours():
        original = cls.__init__

        def __init__(
            self: Any, *args: Any, __original: Callable[..., None] = original, **kwargs: Any
        ) -> None:
            _touch(type(self).__name__)
            __original(self, *args, **kwargs)

        cls.__init__ = functools.wraps(original)(__init__)  # type: ignore[method-assign]


@contextlib.contextmanager
def _crawler_settings(crawler: Any, **values: Any) -> Iterator[None]:
    """The crawler's settings plus ``values`` (cmdline priority) while ours is built; the test's
    crawler keeps its own settings object afterwards."""
    original = crawler.settings
    patched = original.copy()
    patched.frozen = False
    for name, value in values.items():
        patched.set(name, value, priority="cmdline")
    if original.frozen:
        patched.freeze()
    crawler.settings = patched
    try:
        yield
    finally:
        crawler.settings = original


def _build_ours(real: type, crawler: Any) -> Any:
    from scrapy.utils.misc import build_from_crawler

    stage_cls, worker_cls = _ours()
    if FRONT == "stage":
        with _crawler_settings(crawler, REDISLOCK_SCHEDULER_INNER=real):
            return build_from_crawler(stage_cls, crawler)
    with _crawler_settings(crawler):
        return build_from_crawler(worker_cls, crawler)


def _substitute(real: type) -> type:
    """A stand-in for ``real`` in a test module: ``from_crawler`` builds ours; a direct call is
    ``real``'s."""

    class Substitute:
        @classmethod
        def from_crawler(cls, crawler: Any, *args: Any, **kwargs: Any) -> Any:
            _touch("direct")
            return _build_ours(real, crawler)

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            _touch("passthrough")
            return real(*args, **kwargs)

    Substitute.__name__ = real.__name__
    Substitute.__qualname__ = f"{real.__qualname__}[compat]"
    return Substitute


def _replaced_classes() -> list[type]:
    """The scheduler classes a test module may build directly that ours stands in for."""
    replaced: list[type] = []
    if FRONT == "stage" or os.environ.get("COMPAT_SUITE") == "scrapy":
        from scrapy.core.scheduler import Scheduler

        replaced.append(Scheduler)
    with contextlib.suppress(ImportError):
        from scrapy_redis.scheduler import Scheduler as RedisScheduler

        replaced.append(RedisScheduler)
    return replaced


def _mix_spiders() -> None:
    """scrapy-redis's RedisSpider and RedisCrawlSpider carry StageWorkerMixin (before the tests
    import them)."""
    import scrapy_redis.spiders as spiders

    from scrapy_redislock.workers.mixin import StageWorkerMixin

    for name in ("RedisSpider", "RedisCrawlSpider"):
        original = getattr(spiders, name)
        mixed = type(name, (StageWorkerMixin, original), {"__module__": original.__module__})
        mixed.__compat_mixin__ = True  # type: ignore[attr-defined]
        setattr(spiders, name, mixed)


def _module_files() -> dict[str, str | None]:
    """Where the code under test was imported from (run.py checks that scrapy_redislock is the tree
    it meant)."""
    import importlib.util

    files: dict[str, str | None] = {}
    for name in ("scrapy_redislock", "scrapy", "scrapy_redis"):
        spec = importlib.util.find_spec(name)
        files[name] = spec.origin if spec is not None else None
    return files


# -- pytest hooks ----------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    if FRONT not in ("none", "stage", "worker"):
        raise pytest.UsageError(f"COMPAT_FRONT must be none, stage or worker, got {FRONT!r}")
    _emit({"event": "config", "front": FRONT, "cap": CAP, "modules": _module_files()})
    if FRONT == "none":
        return
    _patch_default_settings()
    _wrap_crawler_init()
    _count_builds()
    if SPIDER_MIXIN:
        _mix_spiders()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    global _current, _tests_run
    _current = item.nodeid
    _tests_run += 1
    if FRONT != "none":
        _set_key_prefix(f"compat:{os.getpid()}:{_tests_run}")
    _emit({"event": "start", "nodeid": item.nodeid, "time": time.time()})
    try:
        return (yield)
    finally:
        record = _outcomes.pop(item.nodeid, None)
        if record is not None:
            record["touched"] = dict(_touched.pop(item.nodeid, Counter()))
            _emit({"event": "result", "nodeid": item.nodeid, **record})
        _current = None


@pytest.fixture(autouse=True)
def _compat_substitute(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace, for this test, the module's direct references to the scheduler classes ours stands
    in for."""
    if FRONT == "none":
        return
    module = getattr(request, "module", None)
    if module is None:
        return
    if any(
        isinstance(value, type) and getattr(value, "__compat_mixin__", False)
        for value in vars(module).values()
    ):
        _touch("mixin")
    if not SUBSTITUTE:
        return
    replaced = _replaced_classes()
    for name, value in list(vars(module).items()):
        if any(value is cls for cls in replaced):
            monkeypatch.setattr(module, name, _substitute(value))


@pytest.fixture(autouse=True)
def _compat_collect_garbage() -> Iterator[None]:
    """A full collection at the end of each test (its teardown; in every configuration, the baseline
    too), so that an object a test left unclosed warns (ResourceWarning, unraisable exception in
    ``__del__``) in that test, not in whichever later test the collector happens to run in."""
    yield
    gc.collect()


@pytest.fixture(autouse=True)
def _compat_nose_shim(request: pytest.FixtureRequest) -> Iterator[None]:
    """pytest < 8 called a plain test class's ``setup()`` / ``teardown()`` around each test (nose
    style)."""
    instance = getattr(request, "instance", None)
    if not NOSE_SHIM or instance is None or isinstance(instance, unittest.TestCase):
        yield
        return
    setup = getattr(type(instance), "setup", None)
    teardown = getattr(type(instance), "teardown", None)
    if callable(setup):
        setup(instance)
    yield
    if callable(teardown):
        teardown(instance)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    record = _outcomes.setdefault(
        report.nodeid, {"outcome": "passed", "message": "", "duration": 0.0}
    )
    record["duration"] += report.duration
    message = _message(report)
    if report.when == "call":
        if report.passed:
            record["outcome"] = "xpassed" if hasattr(report, "wasxfail") else "passed"
        elif report.skipped:
            record["outcome"] = "xfailed" if hasattr(report, "wasxfail") else "skipped"
            record["message"] = message
        else:
            record["outcome"] = "failed"
            record["message"] = message
    elif report.failed:  # setup or teardown
        if record["outcome"] in ("passed", "skipped", "xfailed"):
            record["outcome"] = "error"
        record["message"] = (
            record["message"] + " | " if record["message"] else ""
        ) + f"{report.when}: {message}"
    elif report.skipped and report.when == "setup":
        record["outcome"] = "skipped"
        record["message"] = message


def _message(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        return str(longrepr[2])[:400]
    messages: list[str] = []
    for _, crash, _ in getattr(longrepr, "chain", ()):  # chained exceptions: the cause first
        if crash is not None and crash.message and crash.message.strip() not in messages:
            messages.append(crash.message.strip())
    crash = getattr(longrepr, "reprcrash", None)
    if not messages and crash is not None and crash.message:
        messages.append(crash.message.strip())
    if not messages:
        text = str(longrepr).strip().splitlines()
        messages.append(text[-1] if text else "")
    if any("unraisable exception" in message for message in messages):
        messages.append(_unraisable_summary(str(longrepr)))
    return " -> ".join(" ".join(message.split()) for message in messages)[:600]


def _unraisable_summary(text: str) -> str:
    """What an unraisable-exception failure was about: its warnings, addresses and descriptors left
    out, counted."""
    found: Counter[str] = Counter()
    for match in re.finditer(r"(\w*Warning|\w*Error): (.+)", text):
        if match.group(1) == "PytestUnraisableExceptionWarning":
            continue
        line = re.sub(r" at 0x[0-9a-f]+|fd=\d+|port=\d+|bufsize=\d+", "", match.group(2)).strip()
        found[f"{match.group(1)}: {line[:120]}"] += 1
    return "; ".join(f"{n} x {line}" for line, n in found.most_common(3)) or "(no warning text)"


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _emit(
            {
                "event": "collect_error",
                "nodeid": report.nodeid,
                "message": str(report.longrepr)[-1500:],
            }
        )


def pytest_warning_recorded(
    warning_message: warnings.WarningMessage,
    when: str,
    nodeid: str,
    location: tuple[str, int, str] | None,
) -> None:
    category = warning_message.category.__name__
    if category not in ("ResourceWarning", "PytestUnraisableExceptionWarning", "RuntimeWarning"):
        return
    _emit(
        {
            "event": "warning",
            "nodeid": nodeid,
            "category": category,
            "message": str(warning_message.message)[:300],
        }
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _emit({"event": "finish", "exitstatus": int(exitstatus)})
