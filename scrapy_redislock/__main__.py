"""``python -m scrapy_redislock``: the operator's command line (see
:mod:`scrapy_redislock.cli.main`)."""

from __future__ import annotations

import os
import sys

from scrapy_redislock.cli.main import main


def entry() -> None:
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. `status --watch | head`: the reader left; no traceback for that
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    entry()
