"""The documentation site in docs/ builds with Sphinx, warnings as errors; its settings table is
generated from scrapy_redislock/crawl/defaults.py (every setting, its default, its comment) into
docs/settings.md; the ACL lines it shows are what scrapy_redislock.cli.acl prints; and every file
and test it cites exists."""

from __future__ import annotations

import contextlib
import dataclasses
import html
import importlib
import io
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from scrapy_redislock.cli import acl
from scrapy_redislock.crawl import defaults
from scrapy_redislock.lock.permit import LockKeys
from scrapy_redislock.workers.queue import QueueKeys

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [
    "quickstart",
    "request-caps",
    "worker-caps",
    "lock",
    "operating",
    "deploy",
    "security",
    "failures",
    "high-availability",
    "figures",
    "architecture",
]


@contextlib.contextmanager
def _ext() -> Iterator[None]:
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        yield
    finally:
        sys.path.remove(str(DOCS / "_ext"))


with _ext():
    # docs/_ext/settings_reference.py
    settings_reference = importlib.import_module("settings_reference")


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
    for topic in (
        "set-limit",
        "The dashboard",
        "Prometheus metrics",
        "redislock_grants_total",
        "--allow-control",
    ):
        assert topic in html.unescape(operating), topic
    assert (built / "_images" / "dashboard.png").is_file()


# -- the settings table ----------------------------------------------------------------------------


def test_the_settings_reference_lists_every_setting_of_defaults_py(built: Path) -> None:
    documented = settings_reference.documented_settings()
    assert [name for name, _, _ in documented] == list(defaults.SETTINGS)
    undocumented = [name for name, _, description in documented if not description]
    assert not undocumented, f"give these settings a doc in defaults.TABLE: {undocumented}"
    page = html.unescape((built / "settings.html").read_text())
    assert "<table" in page
    for name, default, description in documented:
        assert name in page and repr(default) in page and description.split(";")[0] in page, name


def test_settings_md_holds_the_current_table_as_markdown() -> None:
    """docs/settings.md shows the table itself (GitHub, an editor), not only the Sphinx site: its
    rows are defaults.SETTINGS' names and defaults, in order, and the whole table is what the
    generator makes now."""
    page = (DOCS / "settings.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(REDISLOCK_\w+)` \| `([^`]*)` \| .+ \|$", page, re.MULTILINE)
    assert [name for name, _ in rows] == list(defaults.SETTINGS), (
        "run python docs/_ext/settings_reference.py"
    )
    for name, default in rows:
        assert default == repr(defaults.SETTINGS[name]), (
            f"{name}: run python docs/_ext/settings_reference.py"
        )
    assert settings_reference.with_current_table(page) == page, (
        "docs/settings.md's settings table is stale: run python docs/_ext/settings_reference.py"
    )


# -- the ACL lines ---------------------------------------------------------------------------------


def test_the_acl_lines_in_the_docs_are_what_the_acl_command_prints() -> None:
    """Every ``$ python -m scrapy_redislock.cli.acl ARGS`` in the docs is followed by the line the
    command prints now (its rules are :func:`scrapy_redislock.cli.acl.acl_rules`'s), e.g. the
    crawler's ``+info`` and ``+lrange``."""
    found = 0
    for path in _cited_in():
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            if not line.startswith("$ python -m scrapy_redislock.cli.acl"):
                continue
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert acl.main(shlex.split(line)[4:]) == 0
            where = f"{path.relative_to(ROOT)}:{number + 2}"
            assert lines[number + 1] == out.getvalue().rstrip("\n"), (
                f"{where}: paste what `{line[2:]}` prints"
            )
            found += 1
    assert found >= 2  # the crawler's and the watcher's, in docs/security.md
    security = (DOCS / "security.md").read_text(encoding="utf-8")
    assert " ".join(acl.acl_rules("crawler", keys=["shop:start_urls"])) in security


# -- every file and test the docs cite -------------------------------------------------------------

ROOTS = (
    "scrapy_redislock",
    "tests",
    "testing",
    "bench",
    "example_project",
    "docs",
    ".ci",
    "deploy",
)
NOT_AFTER = r"(?<![\w./~:=@-])"  # not inside a URL, another path, a Redis key or a stat name
ROOTED = re.compile(
    NOT_AFTER + r"((?:" + "|".join(re.escape(r) for r in ROOTS) + r")/[\w./*-]*)(?:::(\w+))?"
)
IN_PACKAGE = re.compile(NOT_AFTER + r"((?:[a-z_]+/)+(?:[\w*-]+\.(?:py|lua|html)\b)?)")
BARE_TEST_FILE = re.compile(NOT_AFTER + r"(test_\w+\.py)\b")
BARE_SCRIPT = re.compile(NOT_AFTER + r"(\w+\.lua)\b")
TEST_NAME = re.compile(r"(?<![\w./:-])(test_\w+)(?!\w|\.py|\.\.\.|…)")
TEST_PREFIX = re.compile(r"(?<![\w./:-])(test_\w+)(?:\.\.\.|…)")
TEST_SUFFIX = re.compile(r"(?:\.\.\.|…)(_\w+)")
DEFINED = re.compile(r"^\s*(?:async\s+)?def\s+(test_\w+)", re.MULTILINE)


def _cited_in() -> list[Path]:
    return [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]


def _outputs(root: Path) -> list[str]:
    """Folders .gitignore names by path (docs/_build/, example_project/output/, ...): what commands
    write."""
    ignore = root / ".gitignore"
    lines = ignore.read_text(encoding="utf-8").splitlines() if ignore.is_file() else []
    return [line.strip().strip("/") + "/" for line in lines if "/" in line.strip().strip("/")]


def _exists(root: Path, cited: str) -> bool:
    if any(ch in cited for ch in "*?["):
        return any(root.glob(cited))
    return (root / cited).is_dir() if cited.endswith("/") else (root / cited).exists()


def broken_citations(texts: dict[str, str], root: Path = ROOT) -> list[str]:
    """Every file path or test name in ``texts`` ({where: Markdown}) that does not exist in the
    repository ``root``.

    The rule:

    - a *repository path* is a word starting with ``scrapy_redislock/``, ``tests/``, ``testing/``,
      ``bench/``, ``example_project/``, ``docs/``, ``.ci/`` or ``deploy/`` (not inside a URL, a longer path, a
      Redis key or a stat name). It must exist: a file, a folder when it ends with ``/``, at least
      one file when it is a glob (``*.lua``). Paths under a folder .gitignore names by path
      (``docs/_build/``, ``example_project/output/``) are what commands write, and are not checked;
    - a *package path* is a path relative to the package, starting with a folder of it
      (``lock/core.py``, ``cli/``, ``scripts/*.lua``) and ending in ``/`` or a ``.py``, ``.lua`` or
      ``.html`` file: it must exist under some folder of ``scrapy_redislock/`` (``cli/status.py`` is
      ``scrapy_redislock/cli/status.py``, ``scripts/queue_*.lua`` is in
      ``scrapy_redislock/workers/scripts/``);
    - a bare test file ``test_x.py`` must be exactly one file under ``tests/`` (else give its
      folder); a bare Lua script ``x.lua`` must be a file somewhere in ``scrapy_redislock/``;
    - ``path.py::test_name`` must be a test defined (``def test_name`` or ``async def test_name``)
      in that file;
    - any other word ``test_name`` must be a test defined in some file under ``tests/``. Written
      ``test_start...`` it is any test whose name starts so, and ``..._end`` (right after a test
      named in full, for a sibling) any test whose name ends so; ``…`` counts as ``...``.
    """
    outputs = _outputs(root)
    package = root / "scrapy_redislock"
    package_dirs = {
        p.name for p in package.rglob("*") if p.is_dir() and not p.name.startswith("__")
    }
    test_files = sorted((root / "tests").rglob("test_*.py"))
    defined = {
        p: set(DEFINED.findall(p.read_text(encoding="utf-8")))
        for p in (root / "tests").rglob("*.py")
    }
    every_test = set().union(*defined.values())
    broken: list[str] = []
    for where, text in texts.items():
        for number, line in enumerate(text.splitlines(), 1):
            at = f"{where}:{number}"
            for match in ROOTED.finditer(line):
                cited, test = match.group(1).rstrip("."), match.group(2)
                if any(cited.startswith(output) or cited + "/" == output for output in outputs):
                    continue
                if not _exists(root, cited):
                    broken.append(f"{at}: no file {cited}")
                elif test and test not in defined.get(root / cited, set()):
                    broken.append(f"{at}: no test {test} in {cited}")
            for match in IN_PACKAGE.finditer(line):
                cited = match.group(1)
                first = cited.split("/")[0]
                if (
                    first in ROOTS
                    or first not in package_dirs
                    or not (cited.endswith("/") or "." in cited)
                ):
                    continue
                if not any(
                    _exists(folder, cited)
                    for folder in [package, *package.rglob("*")]
                    if folder.is_dir()
                ):
                    broken.append(f"{at}: no {cited} in scrapy_redislock/")
            for match in BARE_TEST_FILE.finditer(line):
                found = [p for p in test_files if p.name == match.group(1)]
                if len(found) != 1:
                    what = (
                        "no such file"
                        if not found
                        else "ambiguous: " + ", ".join(str(p.relative_to(root)) for p in found)
                    )
                    broken.append(f"{at}: test file {match.group(1)} under tests/: {what}")
            for match in BARE_SCRIPT.finditer(line):
                if not any(package.rglob(match.group(1))):
                    broken.append(f"{at}: no script {match.group(1)} in scrapy_redislock/")
            for match in TEST_NAME.finditer(line):
                if match.group(1) not in every_test:
                    broken.append(f"{at}: no test {match.group(1)} under tests/")
            for match in TEST_PREFIX.finditer(line):
                if not any(name.startswith(match.group(1)) for name in every_test):
                    broken.append(f"{at}: no test named {match.group(1)}... under tests/")
            for match in TEST_SUFFIX.finditer(line):
                if not any(name.endswith(match.group(1)) for name in every_test):
                    broken.append(f"{at}: no test named ...{match.group(1)} under tests/")
    return broken


def test_every_file_and_test_the_docs_cite_exists() -> None:
    texts = {str(path.relative_to(ROOT)): path.read_text(encoding="utf-8") for path in _cited_in()}
    broken = broken_citations(texts)
    assert not broken, "the docs cite what does not exist:\n" + "\n".join(broken)


def test_the_citation_check_finds_what_is_missing() -> None:
    """The check above is only as good as its patterns: each kind of citation, right and wrong."""
    good = (
        "`tests/lock/test_faults.py`, `tests/lock/`, `scrapy_redislock/lock/scripts/*.lua`, "
        "`.ci/run`, `docs/_build/x`"
        " `tests/lock/test_sync.py::test_commands_per_grant`, `test_commands_per_grant`, "
        "`lock/core.py`, `cli/`,"
        " `scripts/queue_*.lua`, `queue_beat.lua`, `test_acl.py`, "
        "(`test_a_master_restarted_empty_does_not_rejoin"
        "_while_the_holder_renews`, `..._rejoins_only_after_the_holders_validity`), "
        "`test_a_master_restarted...`,"
        " https://example.com/tests/nothing.py, redislock/workers/nothing, pages/s, commands/s, "
        "REDISLOCK_TEST_URL"
    )
    assert broken_citations({"good": good}) == []
    bad = {
        "tests/lock/test_nothing.py": "no file tests/lock/test_nothing.py",
        "scrapy_redislock/scripts/*.lua": "no file scrapy_redislock/scripts/*.lua",
        "docs/nothing.md": "no file docs/nothing.md",
        "tests/lock/test_sync.py::test_nothing_at_all": "no test test_nothing_at_all in "
        "tests/lock/test_sync.py",
        "test_faults_lock.py": "test file test_faults_lock.py under tests/: no such file",
        "test_keys.py": "test file test_keys.py under tests/: ambiguous",
        "lock/nothing.py": "no lock/nothing.py in scrapy_redislock/",
        "nothing.lua": "no script nothing.lua in scrapy_redislock/",
        "(`test_there_is_no_such_test`)": "no test test_there_is_no_such_test under tests/",
        "`..._rejoins_never`": "no test named ..._rejoins_never under tests/",
        "`test_nothing_starts_so...`": "no test named test_nothing_starts_so... under tests/",
    }
    for text, says in bad.items():
        found = broken_citations({"doc": f"see `{text}` here"})
        assert len(found) == 1 and found[0].startswith(f"doc:1: {says}"), (text, found)


def test_the_architecture_names_every_module_script_and_key() -> None:
    """docs/architecture.md is the map: every module of the package, every Lua script and every
    key the key classes make is named there (the other tests check that what it names exists)."""
    doc = (DOCS / "architecture.md").read_text()
    package = ROOT / "scrapy_redislock"
    modules = [
        path.relative_to(package)
        for path in sorted(package.rglob("*.py"))
        if path.name != "__init__.py"
    ]
    missing = [str(m) for m in modules if f"`{m.name}`" not in doc and str(m) not in doc]
    scripts = [
        f"{path.parent.parent.name}/scripts/{path.name}"
        for path in sorted(package.glob("*/scripts/*.lua"))
        if path.name != "_lib.lua"
    ]
    missing += [script for script in scripts if f"`{script}`" not in doc]
    missing += [
        f"LockKeys.{field.name}"
        for field in dataclasses.fields(LockKeys)
        if f"}}:{field.name}`" not in doc
    ]
    keys = QueueKeys("B")
    made = [
        getattr(keys, name)
        for name, value in vars(QueueKeys).items()
        if isinstance(value, property)
    ]
    made += [keys.queue("<stage>"), keys.scored("<stage>"), keys.signal("<stage>")]
    made += [keys.inflight("<worker>")]
    missing += [key for key in made if f"{{<spider>}}{key[1:]}`" not in doc]
    assert not missing, f"docs/architecture.md does not name: {missing}"
