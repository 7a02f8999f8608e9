"""Every benchmark runs in its short form (``--smoke``: seconds, not minutes) and prints its tables,
so that a refactor that breaks one fails the suite. Whether it runs, not how fast: no figure is
checked. Select these alone with ``-m bench``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.bench, pytest.mark.integration, pytest.mark.crawl]

# bench -> a line of the table it prints (its header or a row's label)
TABLES = {
    "adaptive": "| processes | control | pages/s |",
    "cache_hits": "cached crawl, StageScheduler, every slot held by another process",
    "contention": "| design |",
    "dashboard": "Redis commands per read:",
    "dropin": "## StageScheduler as a drop-in",
    "keys": "| processes | domains | pages | cap | how |",
    "middleware": "mean detail requests in flight, StageScheduler:",
    "partition": "| healthy processes' detail pages/s before the cut |",
    "path": "| the request | modules entered |",
    "quorum": "| design |",
    "reactorlag": "| round | delay each way |",
    "requestformat": "bare GET: json/pickle size",
    "restarts": "per grant",
    "scale": "## Idle: Redis commands per second with nothing to crawl",
    "startup": "| round trip added |",
    "stages": "| run | first list | first detail | first comment | total | pages |",
}


def test_every_benchmark_is_here() -> None:
    """A new benchmark gets a smoke run too (modules that are parts of others excepted)."""
    parts = {"__init__", "ceiling", "handoff_probe", "peers"}
    found = {path.stem for path in (ROOT / "bench").glob("*.py")} - parts
    assert found == set(TABLES)


@pytest.mark.parametrize("bench", sorted(TABLES))
def test_the_benchmark_runs_in_its_short_form(bench: str, tmp_path: Path) -> None:
    env = {**os.environ, "REDISLOCK_BENCH_RESULTS": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{bench}", "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert TABLES[bench] in done.stdout, output[-4000:]
