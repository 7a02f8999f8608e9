"""The dashboard in a real headless Chromium (Debian's chromium and chromium-driver, which .ci/run
installs), against a live crawl of the example project: 3 ``scrapy crawl shop`` workers over the
shop site.

Set REDISLOCK_DASHBOARD_SCREENSHOT=docs/dashboard.png to keep the screenshot for the documentation.
"""

from __future__ import annotations

import base64
import functools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from example_project.run import HERE, SLOTS, arguments, seed, worker_command
from scrapy_redislock.lock.permit import LockKeys
from testing.dashboardproc import DashboardProcess
from testing.site import ShopSite
from testing.waiting import wait_until
from tests.cli.test_main import call

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
TTL = 3.0  # the workers' REDISLOCK_TTL: a killed worker is dead after this much silence
T = TypeVar("T")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.crawl,
    pytest.mark.skipif(
        not (CHROMIUM and CHROMEDRIVER),
        reason="no headless browser: Debian's chromium and chromium-driver are not installed "
        "(.ci/run installs them: "
        "apt-get install chromium chromium-driver)",
    ),
]


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1280,1000")
    options.binary_location = str(CHROMIUM)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def crawl(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The example project's shop crawl with stage slots, running: 3 workers, slow pages, no idle
    close."""
    args = arguments(["--workers", "3", "--ttl", str(TTL), "--idle-close", "600", "--delay", "0.3"])
    with ShopSite(lists=6, details=40, comments=2, delay=args.delay) as site:
        seed(redis_client, SLOTS, site)
        workers = [
            subprocess.Popen(
                worker_command(SLOTS, n, redis_url, args, tmp_path / f"shop-{n}.jsonl"),
                cwd=HERE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for n in range(3)
        ]
        try:
            yield workers
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                worker.wait()


# The page re-renders its elements every second: one gone stale while it was read is "not yet".
wait_on_page = functools.partial(wait_until, step=0.05, ignore=(StaleElementReferenceException,))


def fresh(read: Callable[..., T]) -> Callable[..., T]:
    """Read the page again if it re-rendered the elements while they were read (it refreshes every
    second)."""

    def again(*args: Any) -> T:
        for _ in range(20):
            try:
                return read(*args)
            except StaleElementReferenceException:
                time.sleep(0.05)
        return read(*args)

    return again


def stage_cell(driver: webdriver.Chrome, stage: str, field: str) -> str | None:
    """One script in the page: a re-render cannot come between finding the cell and reading it."""
    text: str | None = driver.execute_script(
        "const cell = document.querySelector(arguments[0]); return cell ? cell.innerText : null;",
        f'#stages tr[data-stage="{stage}"] td[data-field="{field}"]',
    )
    return None if text is None else text.strip()


def worker_states(driver: webdriver.Chrome) -> dict[str, str]:
    """Every worker row's state, read in one script in the page (the rows are re-rendered every
    refresh: read one by one under load, some row was always stale)."""
    states: dict[str, str] = driver.execute_script(
        "const rows = document.querySelectorAll(arguments[0]); const states = {};"
        " rows.forEach(row => { states[row.dataset.worker] = row.dataset.state; }); return states;",
        'table[data-workers="shop"] tr[data-worker]',
    )
    return states


@fresh
def message(driver: webdriver.Chrome) -> str:
    return driver.find_element(By.ID, "message").text


@fresh
def set_limit_on_the_page(driver: webdriver.Chrome, stage: str, limit: int) -> None:
    Select(driver.find_element(By.ID, "stage-select")).select_by_value(stage)
    field = driver.find_element(By.ID, "limit")
    field.clear()
    field.send_keys(str(limit))
    driver.find_element(By.ID, "set-limit").click()


def severe_errors(driver: webdriver.Chrome) -> list[dict[str, Any]]:
    """Errors in the browser's console, less the refusal the test asked for (Chromium logs every
    403)."""
    refused = "/api/set-limit - Failed to load resource: the server responded with a status of 403"
    return [
        e
        for e in driver.get_log("browser")
        if e["level"] == "SEVERE" and refused not in e["message"]
    ]


def test_the_dashboard_follows_a_live_crawl(
    redis_url: str, redis_client: redis.Redis, crawl: list[subprocess.Popen[bytes]], browser: webdriver.Chrome,
    tmp_path: Path,
) -> None:  # fmt: skip
    meta = lambda stage: LockKeys.of("redislock", stage).meta  # noqa: E731
    with DashboardProcess(
        redis_url, "--allow-control", "--interval", "0.5", "--history", "30"
    ) as dashboard:
        # The page shows the stages of the running crawl, and its workers, all alive.
        browser.get(dashboard.url + "/")
        wait_on_page(
            lambda: stage_cell(browser, "workers:detail", "limit") == "3",
            60,
            "the detail stage on the page",
        )
        assert stage_cell(browser, "workers:list", "limit") == "1"
        pids = {str(worker.pid) for worker in crawl}
        wait_on_page(
            lambda: (
                {w.split(":")[-2] for w, s in worker_states(browser).items() if s == "alive"}
                == pids
            ),
            60,
            "the 3 workers alive on the page",
        )
        wait_on_page(
            lambda: int(stage_cell(browser, "workers:detail", "held") or 0) >= 1,
            60,
            "a detail slot held",
        )

        # Control is refused without the token: the page says so, and Redis keeps its limit.
        set_limit_on_the_page(browser, "workers:detail", 1)
        wait_on_page(lambda: message(browser).startswith("refused:"), 10, "the refusal on the page")
        assert "token" in message(browser)
        assert redis_client.hget(meta("workers:detail"), "limit") == b"3"

        # With the token (the link the dashboard printed), the page steers.
        browser.get(f"{dashboard.url}/#token={dashboard.token}")
        wait_on_page(
            lambda: stage_cell(browser, "workers:detail", "limit") == "3", 30, "the page again"
        )
        assert "#token" not in browser.current_url  # taken off the address bar at once
        set_limit_on_the_page(browser, "workers:detail", 2)
        wait_on_page(
            lambda: "limit 3 -> 2" in message(browser), 10, "the page's set-limit to succeed"
        )
        assert redis_client.hget(meta("workers:detail"), "limit") == b"2"

        # A set-limit from the command line shows on the page within 2 s.
        code, _, err = call("set-limit", "workers:detail", "3", "--url", redis_url)
        assert code == 0, err
        changed = time.monotonic()
        wait_on_page(
            lambda: stage_cell(browser, "workers:detail", "limit") == "3",
            10,
            "the CLI's limit on the page",
        )
        shown_after = time.monotonic() - changed
        assert shown_after <= 2.0, f"the page showed the new limit after {shown_after:.2f} s"

        # A worker killed with SIGKILL shows as dead once it has been silent for the TTL (it beats
        # every TTL/3).
        victim = crawl[0]
        victim_id = next(w for w in worker_states(browser) if w.split(":")[-2] == str(victim.pid))
        killed = time.monotonic()  # before: the lower bound below must not gain the signal's time
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        assert worker_states(browser)[victim_id] == "alive"
        wait_on_page(
            lambda: worker_states(browser).get(victim_id) == "dead",
            TTL + 15,
            "the killed worker dead",
        )
        dead_after = time.monotonic() - killed
        assert dead_after >= TTL * 2 / 3 - 0.1, (
            f"shown dead {dead_after:.2f} s after the kill, before its TTL"
        )
        others = {w: s for w, s in worker_states(browser).items() if w != victim_id}
        assert list(others.values()) == ["alive", "alive"], others

        # The charts have drawn lines, and the page raised no error.
        assert browser.find_elements(By.CSS_SELECTOR, "#chart-grants polyline")
        assert browser.find_elements(By.CSS_SELECTOR, "#chart-queues polyline")
        assert severe_errors(browser) == []
        shot = tmp_path / "dashboard.png"
        page = browser.execute_cdp_cmd(
            "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}
        )
        shot.write_bytes(base64.b64decode(page["data"]))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        keep = os.environ.get("REDISLOCK_DASHBOARD_SCREENSHOT")
        if keep:
            shutil.copyfile(shot, keep)
        print(
            f"[dashboard] CLI set-limit shown after {shown_after:.2f} s; killed worker dead after "
            f"{dead_after:.2f} s"
        )
