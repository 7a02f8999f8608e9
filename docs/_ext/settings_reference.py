"""Sphinx directive ``settings-reference``: the table of every REDISLOCK_* setting, made from
``scrapy_redislock/defaults.py`` itself (each assignment, its default, and the comment above it), so the reference
cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

import scrapy_redislock.crawl.defaults as defaults

ASSIGNMENT = re.compile(r"^(REDISLOCK_[A-Z0-9_]+)\s*(?::[^=]+)?=")


def documented_settings() -> list[tuple[str, Any, str]]:
    """(name, default, description) in the order of defaults.py; the comment right above a setting describes it."""
    source = Path(defaults.__file__).read_text(encoding="utf-8").splitlines()
    found: list[tuple[str, Any, str]] = []
    comment: list[str] = []
    for line in source:
        if line.startswith("#"):
            comment.append(line.lstrip("#").strip())
            continue
        match = ASSIGNMENT.match(line)
        if match:
            found.append((match.group(1), defaults.SETTINGS[match.group(1)], " ".join(comment)))
        comment = []  # a comment describes the one line below it
    missing = set(defaults.SETTINGS) - {name for name, _, _ in found}
    if missing:
        raise ValueError(f"settings in defaults.SETTINGS but not assigned on a line of their own: {sorted(missing)}")
    return found


def _row(*cells: nodes.Node) -> nodes.row:
    row = nodes.row()
    for content in cells:
        entry = nodes.entry()
        entry += content
        row += entry
    return row


class SettingsReference(SphinxDirective):
    has_content = False

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(defaults.__file__)
        table = nodes.table(classes=["settings-reference"])
        group = nodes.tgroup(cols=3)
        table += group
        for width in (30, 25, 45):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        head += _row(*(nodes.paragraph(text=title) for title in ("setting", "default", "meaning")))
        group += head
        body = nodes.tbody()
        for name, default, description in documented_settings():
            target = nodes.target("", "", ids=[name.lower().replace("_", "-")], names=[name.lower()])
            title = nodes.paragraph()
            title += [target, nodes.literal(text=name)]
            body += _row(
                title,
                nodes.paragraph("", "", nodes.literal(text=repr(default))),
                nodes.paragraph(text=description or "(undocumented in defaults.py)"),
            )
        group += body
        return [table]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("settings-reference", SettingsReference)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
