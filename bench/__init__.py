"""The benchmarks (see bench/README.md). Each takes ``--smoke``: one short run of every part (seconds,
not minutes) that prints its tables; tests/test_bench_smoke.py runs them all so that a refactor that
breaks one fails the suite. Their figures are not the benchmark's.

``RESULTS``: where they write (``bench/results``, git-ignored); the environment variable
REDISLOCK_BENCH_RESULTS moves it (the smoke test writes to a temporary folder). Each writes its table
and its rows with :func:`write_results`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

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


def write_results(name: str, text: str, data: Any, out: Path | None = None) -> Path:
    """``<name>.md`` (the table, as printed) and ``<name>.json`` (the rows) in ``out`` (default
    RESULTS), made if missing; the table's path."""
    folder = RESULTS if out is None else out
    folder.mkdir(parents=True, exist_ok=True)
    table = folder / f"{name}.md"
    table.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    (folder / f"{name}.json").write_text(
        json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8"
    )
    return table
