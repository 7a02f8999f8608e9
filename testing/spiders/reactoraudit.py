"""A Scrapy extension for the tests: counts blocking redis-py commands sent from the reactor thread.

Enabled with ``EXTENSIONS = {"testing.spiders.reactoraudit.ReactorThreadAudit": 0}`` and
``REACTOR_AUDIT_FILE``; at spider close it writes ``{"blocking_calls": N, "commands": [...]}``
there. It wraps the *sync* client's command and pipeline methods (redis.asyncio's are separate
classes and untouched), so N counts exactly what would stall every download of the process while
Redis answers.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import redis.client
from scrapy import signals


class ReactorThreadAudit:
    def __init__(self, crawler: Any) -> None:
        self.path = Path(crawler.settings["REACTOR_AUDIT_FILE"])
        self.commands: list[str] = []
        audit = self
        reactor_thread = threading.current_thread()

        def wrap(cls: type, name: str) -> None:
            original = getattr(cls, name)

            def audited(self: Any, *args: Any, **kwargs: Any) -> Any:
                if threading.current_thread() is reactor_thread:
                    audit.commands.append(str(args[0]) if args else name)
                return original(self, *args, **kwargs)

            setattr(cls, name, audited)

        wrap(redis.client.Redis, "execute_command")
        wrap(redis.client.Pipeline, "execute")
        crawler.signals.connect(self.spider_closed, signal=signals.spider_closed)

    @classmethod
    def from_crawler(cls, crawler: Any) -> ReactorThreadAudit:
        return cls(crawler)

    def spider_closed(self, spider: Any) -> None:
        self.path.write_text(
            json.dumps({"blocking_calls": len(self.commands), "commands": self.commands[:20]})
        )
