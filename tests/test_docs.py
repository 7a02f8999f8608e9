"""The documentation site in docs/ builds with Sphinx, warnings as errors, and its settings reference is generated
from scrapy_redislock/crawl/defaults.py (every setting, its default, its comment)."""

from __future__ import annotations

import html
import subprocess
import sys
from pathlib import Path

import pytest

from scrapy_redislock.crawl import defaults

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [
    "quickstart",
    "request-caps",
    "worker-caps",
    "lock",
    "operating",
    "security",
    "failures",
    "high-availability",
    "figures",
    "architecture",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs")
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "-d", str(out / ".doctrees"),
         str(DOCS), str(out / "html")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr
    return out / "html"


def test_the_site_builds_with_warnings_as_errors_and_has_every_page(built: Path) -> None:
    index = (built / "index.html").read_text()
    for page in [*PAGES, "settings"]:
        assert (built / f"{page}.html").is_file(), page
        assert f'href="{page}.html"' in index, f"{page} is not in the table of contents"
    operating = (built / "operating.html").read_text()
    for topic in ("set-limit", "The dashboard", "Prometheus metrics", "redislock_grants_total", "--allow-control"):
        assert topic in html.unescape(operating), topic
    assert (built / "_images" / "dashboard.png").is_file()


def test_the_settings_reference_lists_every_setting_of_defaults_py(built: Path) -> None:
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        from settings_reference import documented_settings
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    documented = documented_settings()
    assert [name for name, _, _ in documented] == list(defaults.SETTINGS)
    undocumented = [name for name, _, description in documented if not description]
    assert not undocumented, f"give these settings a comment line in defaults.py: {undocumented}"
    page = html.unescape((built / "settings.html").read_text())
    for name, default, description in documented:
        assert name in page and repr(default) in page and description.split(";")[0] in page, name
