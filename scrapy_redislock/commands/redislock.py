"""``scrapy redislock status|set-limit|release|reset|dashboard``: the command line of
:mod:`scrapy_redislock.cli.main`, reading the project's settings.

Settings read (through :func:`scrapy_redislock.crawl.settings.read_settings`): REDISLOCK_URL (and
scrapy-redis's REDIS_URL / REDIS_HOST / REDIS_PORT / REDIS_PARAMS fallbacks), REDISLOCK_PARAMS,
REDISLOCK_KEY_PREFIX, REDISLOCK_TTL, REDISLOCK_STAGES; ``--url`` / ``--prefix`` after the
sub-command win. Scrapy's own options (``-s NAME=VALUE``) go before the sub-command.
"""

from __future__ import annotations

import argparse
from typing import Any, ClassVar

from scrapy.commands import ScrapyCommand
from scrapy.exceptions import UsageError

from scrapy_redislock.cli import main as cli


class Command(ScrapyCommand):
    requires_project = False
    requires_crawler_process = False
    default_settings: ClassVar[dict[str, Any]] = {"LOG_ENABLED": False}

    def syntax(self) -> str:
        return "[-s NAME=VALUE] {status,set-limit,release,reset,dashboard} [options]"

    def short_desc(self) -> str:
        return "Show and steer the stage locks of a running crawl (status, set-limit, release, reset, dashboard)"

    def long_desc(self) -> str:
        return "Show and steer the stage locks (scrapy_redislock) of a running crawl: status, set-limit STAGE N, release STAGE HOLDER, reset STAGE, dashboard (a live web page and /metrics). Connects as the project's settings say (REDISLOCK_URL ...); see `scrapy redislock COMMAND -h`."  # noqa: E501

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        super().add_options(parser)
        cli.add_subcommands(parser, top_level=False, prog="scrapy redislock")

    def run(self, args: list[str], opts: argparse.Namespace) -> None:
        if args:
            raise UsageError(
                f"unrecognized arguments: {' '.join(args)} (Scrapy's options such as -s go before the sub-command)",
                print_help=False,
            )
        self.exitcode = cli.run(opts, settings=self.settings, prog="scrapy redislock")
