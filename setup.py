"""The metadata is in setup.cfg; this only rewrites the README for a package index, and keeps
bytecode out of the sdist.

The README links to files of the repository (``docs/quickstart.md``, ``docs/dashboard.png``): on a
package index those relative links lead nowhere, so the long description gets them as absolute
URLs into the release's tag of the repository (images as raw files). The README itself keeps
relative links, which the repository's browser and tests/test_docs.py check.
"""

from __future__ import annotations

import re
from pathlib import Path

from setuptools import setup
from setuptools.command.sdist import sdist

HOME = "https://github.com/scrapy-redislock/scrapy-redislock"
# a link target that is not a URL, not an anchor and not a mail address: a repository path
RELATIVE = re.compile(r"(!?)\[([^\]]*)\]\((?![a-z][a-z0-9+.-]*:|#)([^)\s]+)\)")
VERSION = re.compile(r'^__version__ = "([^"]+)"', re.M)


def long_description(root: Path) -> str:
    version = VERSION.search((root / "scrapy_redislock" / "__init__.py").read_text())
    assert version is not None, "scrapy_redislock/__init__.py sets no __version__"
    tag = f"v{version.group(1)}"

    def absolute(match: re.Match[str]) -> str:
        image, text, target = match.groups()
        kind = "raw" if image else "blob"
        return f"{image}[{text}]({HOME}/{kind}/{tag}/{target})"

    return RELATIVE.sub(absolute, (root / "README.md").read_text(encoding="utf-8"))


class Sdist(sdist):
    """MANIFEST.in grafts whole folders: a checkout's bytecode is left out here (MANIFEST.in's
    global-exclude would warn on a clean tree, where nothing matches)."""

    def make_distribution(self) -> None:
        self.filelist.exclude_pattern(r"(^|/)__pycache__/|\.py[cod]$", is_regex=True)
        super().make_distribution()


setup(
    long_description=long_description(Path(__file__).parent),
    cmdclass={"sdist": Sdist},
)
