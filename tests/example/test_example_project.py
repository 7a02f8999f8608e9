"""The example project: the fake shop site, the live view, and the one demo command end to end."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from example_project.run import Screen, arguments, bar
from testing.site import ShopSite

ROOT = Path(__file__).resolve().parents[2]


def get(url: str, agent: str = "test") -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"User-Agent": agent})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""


def test_the_shop_links_list_to_details_to_comments() -> None:
    with ShopSite(lists=2, details=3, comments=2, delay=0) as site:
        status, body = get(f"{site.url}/list/1")
        assert status == 200 and body.count('class="detail"') == 3 and 'href="/detail/1-2"' in body
        status, body = get(f"{site.url}/detail/1-2")
        assert (
            status == 200
            and body.count('class="comments"') == 2
            and 'href="/comments/1-2/1"' in body
        )
        assert get(f"{site.url}/comments/1-2/1")[0] == 200
        assert get(f"{site.url}/list/2")[0] == 404  # only 2 list pages
        assert get(f"{site.url}/nothing")[0] == 404
        status, body = get(site.start_url)
        assert status == 200 and body.count('class="list"') == 2 and 'href="/list/1"' in body
        assert site.totals == {"list": 2, "detail": 6, "comments": 12}
        assert len(site.expected_paths()) == 20 and "/comments/0-0/0" in site.expected_paths()
        # A page counts as done once its handler has finished, a moment after the client has the
        # whole response.
        deadline = time.monotonic() + 5
        while site.done("index") < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert site.hits["/list/1"] == 1 and site.done("list") == 2 and site.done("index") == 1
        assert site.first_request is not None and site.last_served is not None
        site.reset_counts()
        assert not site.hits and site.first_request is None


def test_the_shop_sees_how_many_workers_have_a_stage_in_flight() -> None:
    """Three clients, two of them the same worker (User-Agent), hit detail pages at the same
    time."""
    with ShopSite(delay=0.3) as site:
        agents = ["worker-1", "worker-1", "worker-2"]
        threads = [
            threading.Thread(target=get, args=(f"{site.url}/detail/0-{n}", a))
            for n, a in enumerate(agents)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert site.max_in_flight["detail"] == 3
        assert site.max_workers["detail"] == 2
        assert site.in_flight["detail"] == 0 and not site.workers_in_flight["detail"]


def test_progress_bar_and_arguments() -> None:
    assert bar(0, 10, 10) == ".........."
    assert bar(5, 10, 10) == "#####....."
    assert bar(12, 10, 10) == "##########"
    assert bar(0, 0, 4) == "####"
    with pytest.raises(SystemExit):
        arguments(["--workers", "0"])
    assert arguments([]).workers == 5


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_live_view_redraws_in_place_on_a_terminal_and_prints_lines_on_a_pipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    screen = Screen(enabled=True)
    screen.show(["title", "  list ..."], force=True)
    screen.show(["title", "  list ###"], force=True)
    out = terminal.getvalue()
    # second frame: two lines up, each line cleared
    assert out.count("\x1b[2K") == 4 and "\x1b[2F" in out
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stdout", pipe)
    screen = Screen(enabled=True)
    screen.show(["title", "  list ..."], force=True)
    screen.show(["title", "  list ###"])  # too soon after the first: a pipe gets a frame every 2 s
    assert pipe.getvalue() == "title\n  list ...\n"
    quiet = io.StringIO()
    monkeypatch.setattr(sys, "stdout", quiet)
    Screen(enabled=False).show(["x"], force=True)
    assert quiet.getvalue() == ""


@pytest.mark.integration
@pytest.mark.crawl
def test_the_demo_command_starts_everything_and_reports(tmp_path: Path) -> None:
    """`python -m example_project.run` on a small shop: its own Redis, the site, 3 workers, both
    runs, the report."""
    command = [
        sys.executable,
        "-m",
        "example_project.run",
        *("--workers", "3", "--lists", "3", "--details", "8", "--comments", "2", "--delay", "0.02"),
        *("--idle-close", "1", "--output", str(tmp_path)),
    ]
    env = {k: v for k, v in os.environ.items() if k != "REDISLOCK_URL"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    # the view, as lines on a pipe
    assert "with stage slots:" in out and "without (scrapy-redis):" in out
    assert "\x1b[" not in out
    assert "first comment" in out and "sooner with stage slots" in out
    assert out.count("[ok]") == 5 and "FAILED" not in out
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figures = json.loads((tmp_path / "summary.json").read_text())
    slots, baseline = figures["phases"]
    assert slots["items"] == baseline["items"] == {"list": 3, "detail": 24, "comments": 48}
    assert slots["duplicates"] == baseline["duplicates"] == 0
    assert slots["max_workers_site"]["list"] <= 1 and slots["max_workers_site"]["detail"] <= 3
    assert slots["first_item"]["comments"] > 0 and baseline["first_item"]["comments"] > 0
    assert (
        len(list(tmp_path.glob("shop-*.jsonl"))) == 3
        and len(list(tmp_path.glob("shop_baseline-*.log"))) == 3
    )
