"""The benchmarks (see bench/README.md). Each takes ``--smoke``: one short run of every part (seconds,
not minutes) that prints its tables; tests/test_bench_smoke.py runs them all so that a refactor that
breaks one fails the suite. Their figures are not the benchmark's.

``RESULTS``: where they write (``bench/results``, git-ignored); the environment variable
REDISLOCK_BENCH_RESULTS moves it (the smoke test writes to a temporary folder).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

RESULTS = Path(
    os.environ.get("REDISLOCK_BENCH_RESULTS") or Path(__file__).resolve().parent / "results"
)


def add_smoke(parser: argparse.ArgumentParser) -> None:
    """The ``--smoke`` flag every benchmark takes (see the module docstring)."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a short run of every part (seconds, not minutes) that prints its tables; its figures "
        "are not the benchmark's",
    )
