"""Run tests/crawlspider.py as a real `scrapy runspider` process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SPIDER = ROOT / "tests" / "crawlspider.py"

BASE_SETTINGS: dict[str, Any] = {
    "DOWNLOADER_MIDDLEWARES": {"scrapy_redislock.StageLockMiddleware": 950},
    "SCHEDULER": "scrapy_redislock.StageScheduler",
    "LOG_LEVEL": "INFO",
    "TELNETCONSOLE_ENABLED": False,
    "ROBOTSTXT_OBEY": False,
    "REDISLOCK_TTL": 3,
    "CONCURRENT_REQUESTS_PER_DOMAIN": 1000,
    "RETRY_ENABLED": False,
}


def crawl_command(base: str, plan: str, settings: dict[str, Any], stats_file: Path | None = None) -> list[str]:
    merged = {**BASE_SETTINGS, **settings}
    command = [sys.executable, "-m", "scrapy", "runspider", str(SPIDER), "-a", f"base={base}", "-a", f"plan={plan}"]
    for key, value in merged.items():
        if value is None:
            continue
        command += ["-s", f"{key}={json.dumps(value) if isinstance(value, dict | list) else value}"]
    if stats_file is not None:
        command += ["-s", f"STATS_DUMP_FILE={stats_file}"]
    return command


def start_crawl(base: str, plan: str, settings: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        crawl_command(base, plan, settings), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def run_crawl(base: str, plan: str, settings: dict[str, Any], timeout: float = 120) -> tuple[int, str]:
    process = start_crawl(base, plan, settings)
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output
