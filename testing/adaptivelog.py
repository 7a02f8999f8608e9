"""The history an adaptive lock's controller keeps in Redis (``adapt_log``, one record per window it
moved, newest first), as the adaptive benchmark and tests read it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from scrapy_redislock._redis import text
from scrapy_redislock.lock.permit import LockKeys
from scrapy_redislock.lock.protocol import Call, Operation


@dataclass(frozen=True)
class LogRecord:
    """One window of the history (``adapt_log``, newest first)."""

    at_ms: int
    limit: int
    latency_ms: float | None
    noload_ms: float
    overload_rate: float
    error_rate: float
    in_flight: float | None


def history(keys: LockKeys, count: int = 600) -> Operation[list[LogRecord]]:
    """The last ``count`` history records of a lock's controller, newest first."""
    raw = yield Call(("LRANGE", keys.adapt_log, 0, max(0, count - 1)))
    records = []
    for entry in text(raw):
        at, limit, latency, noload, overload, errors, in_flight = json.loads(entry)
        records.append(LogRecord(int(at), int(limit), _optional(latency), float(noload),
                                 float(overload), float(errors), _optional(in_flight)))  # fmt: skip
    return records


def _optional(value: Any) -> float | None:
    return None if value is None or value == "" else float(value)
