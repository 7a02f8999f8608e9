"""Docstrings that cannot go stale: every cross-reference role in the package's source
(``:class:``, ``:func:``, ``:meth:``, ``:mod:``, ``:data:``, ``:attr:``, ``:exc:``) names something that
exists, as Sphinx would resolve it from that module (its own names, its classes' attributes, or a
full ``scrapy_redislock.`` path)."""

from __future__ import annotations

import importlib
import inspect
import re
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "scrapy_redislock"
# a role's target, bare or after a title (:meth:`title <target>`)
ROLE = re.compile(
    r":(mod|class|func|meth|data|attr|exc|obj):`(?:[^`<]*<)?~?([A-Za-z_][\w.]*)(?:\(\))?>?`"
)
MISSING = object()


def instance_attributes(cls: type) -> set[str]:
    """What ``__init__`` and the other methods set on ``self`` (Sphinx's autodoc reads these too)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return set()
    return set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=", source))


def member(obj: Any, name: str) -> Any:
    found = getattr(obj, name, MISSING)
    if (
        found is MISSING
        and isinstance(obj, type)
        and (name in getattr(obj, "__annotations__", {}) or name in instance_attributes(obj))
    ):
        return name  # an attribute: nothing further to look into
    return found


def resolves(target: str, module: ModuleType) -> bool:
    parts = target.split(".")
    if parts[0] == "scrapy_redislock":
        for cut in range(len(parts), 0, -1):
            try:
                obj: Any = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for name in parts[cut:]:
                obj = member(obj, name)
                if obj is MISSING:
                    return False
            return True
        return False
    obj = module
    for name in parts:
        obj = member(obj, name)
        if obj is MISSING:
            break
    else:
        return True
    if len(parts) > 1:
        return False
    own = [
        v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__
    ]
    return any(member(cls, target) is not MISSING for cls in own)


def unresolved(path: Path) -> list[str]:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    module = importlib.import_module(name)
    text = path.read_text(encoding="utf-8")
    return [
        f"{path.relative_to(ROOT)}:{text[: match.start()].count(chr(10)) + 1}: {match.group(0)}"
        for match in ROLE.finditer(text)
        if not resolves(match.group(2), module)
    ]


def test_every_cross_reference_in_the_package_names_something_that_exists() -> None:
    bad = [line for path in sorted(PACKAGE.rglob("*.py")) for line in unresolved(path)]
    assert not bad, "stale cross-references:\n" + "\n".join(bad)


def test_the_check_finds_a_stale_reference() -> None:
    module = importlib.import_module("scrapy_redislock.workers.inflight")
    assert resolves("InFlight.buffer", module)  # an attribute set in __init__
    assert resolves("scrapy_redislock.workers.outbox.Outbox.know", module)
    assert not resolves("InFlight.gone", module)
    assert not resolves("scrapy_redislock.workers.scheduler.StageWorkerScheduler._fill", module)
    assert not resolves("OutageLog", module)  # not imported there
    titled = ROLE.search(":meth:`RequestSlots.ask <scrapy_redislock.requests.lines.SlotLines.ask>`")
    assert titled is not None and titled.group(2) == "scrapy_redislock.requests.lines.SlotLines.ask"
