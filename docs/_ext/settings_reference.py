"""The settings table of ``docs/settings.md``, made from the table in
``scrapy_redislock/crawl/defaults.py`` (each setting's name, default and description), the one that
``read_settings`` reads, so the reference cannot drift from the code.

The table is a plain Markdown table written *into* ``docs/settings.md`` between two HTML comments,
so that it shows wherever the Markdown is read (GitHub, an editor) and not only in the Sphinx site.
After a change to defaults.py::

    python docs/_ext/settings_reference.py            # rewrite the table in docs/settings.md
    python docs/_ext/settings_reference.py --check    # exit 1 if the table is stale (tests/test_docs.py checks it)

As a Sphinx extension it puts the current table into the page at build time as well, so the site is
never stale.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import scrapy_redislock.crawl.defaults as defaults  # noqa: E402

PAGE = HERE.parent / "settings.md"
BEGIN = (
    "<!-- settings table: generated from scrapy_redislock/crawl/defaults.py by "
    "`python docs/_ext/settings_reference.py`; do not edit by hand -->"
)
END = "<!-- end of the generated settings table -->"
BLOCK = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)


def documented_settings() -> list[tuple[str, Any, str]]:
    """(name, default, description) of every setting, in the order of defaults.TABLE."""
    return [(setting.name, setting.default, setting.doc) for setting in defaults.TABLE]


def _text(value: str) -> str:
    """Plain text for a Markdown table cell: nothing in it is taken for markup (emphasis, HTML, a
    cell border)."""
    value = re.sub(r"([\\`*|<\[\]])", r"\\\1", value)
    # _ inside a word is no emphasis anyway
    return re.sub(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", r"\\_", value)


def markdown_table() -> str:
    """The table, one row per setting: `name` | `repr(default)` | description."""
    lines = ["| setting | default | meaning |", "|---|---|---|"]
    for name, default, description in documented_settings():
        lines.append(f"| `{name}` | `{default!r}` | {_text(description)} |")
    return "\n".join(lines)


def generated_block() -> str:
    return f"{BEGIN}\n\n{markdown_table()}\n\n{END}"


def with_current_table(page: str) -> str:
    """The page with its generated block replaced by the current one (ValueError if it has no such
    block)."""
    if len(BLOCK.findall(page)) != 1:
        raise ValueError(f"docs/settings.md must hold exactly one block from {BEGIN!r} to {END!r}")
    return BLOCK.sub(lambda _: generated_block(), page)


def _source_read(app: Any, docname: str, source: list[str]) -> None:
    if docname == "settings":
        app.env.note_dependency(defaults.__file__)  # rebuild the page when defaults.py changes
        source[0] = with_current_table(source[0])


def setup(app: Any) -> dict[str, Any]:
    app.connect("source-read", _source_read)
    return {"version": "2", "parallel_read_safe": True, "parallel_write_safe": True}


def main(argv: list[str]) -> int:
    page = PAGE.read_text(encoding="utf-8")
    current = with_current_table(page)
    if "--check" in argv:
        if current != page:
            print(
                f"{PAGE} has a stale settings table: run python docs/_ext/settings_reference.py",
                file=sys.stderr,
            )
            return 1
        return 0
    if current != page:
        PAGE.write_text(current, encoding="utf-8")
        print(f"{PAGE}: settings table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
