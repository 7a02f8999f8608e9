"""Sphinx configuration of the scrapy-redislock documentation (built by ``sphinx-build -W docs
docs/_build``)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))

from scrapy_redislock import __version__  # noqa: E402

project = "scrapy-redislock"
author = "the scrapy-redislock authors"
copyright = "the scrapy-redislock authors"
version = release = __version__

extensions = ["myst_parser", "settings_reference"]
source_suffix = {".md": "markdown"}
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
exclude_patterns = ["_build", "README.md"]
html_theme = "alabaster"
smartquotes = False  # setting names and code-like text stay as typed
html_title = f"scrapy-redislock {release}"
html_static_path: list[str] = []
suppress_warnings: list[str] = []
