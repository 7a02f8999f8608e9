"""The release: ``python -m build`` makes an sdist and a wheel with no warning; the sdist is the
whole source release (every file of the repository: docs, changelog, the tests and what they run),
the wheel only the package and its data; the metadata has the floors, the project URLs and a long
description whose links work on a package index (setup.py makes them absolute).

The build runs without isolation (``--no-isolation``: the test extra installs setuptools, wheel and
build), in a copy of the tree, so that it writes nothing into the checkout."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import scrapy_redislock

ROOT = Path(__file__).resolve().parent.parent
# what a checkout holds beside its files: environments, caches, outputs (.gitignore's)
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", ".tox", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".pytest_cache",
    ".hypothesis", ".ruff_cache", ".mypy_cache", ".compat-cache", "_build", "results", "output",
)  # fmt: skip
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HOME = "https://github.com/scrapy-redislock/scrapy-redislock"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(the folder with the sdist and the wheel, what the build printed)."""
    work = tmp_path_factory.mktemp("package")
    source = work / "src"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    # PYTHONDONTWRITEBYTECODE makes setuptools warn "byte-compiling is disabled": the environment's,
    # not the project's
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(work / "dist"), str(source)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return work / "dist", output


def test_the_build_prints_no_warning(built: tuple[Path, str]) -> None:
    _, output = built
    warnings = [line for line in output.splitlines() if re.search(r"warn|!!", line, re.I)]
    assert not warnings, "\n".join(warnings)


def _sdist_members(dist: Path) -> set[str]:
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    top = f"scrapy_redislock-{scrapy_redislock.__version__}/"
    assert all(name.startswith(top) or name + "/" == top for name in names)
    return {name[len(top) :] for name in names if name.startswith(top)}


def test_the_sdist_is_the_whole_source_release(built: tuple[Path, str]) -> None:
    members = _sdist_members(built[0])
    for needed in ("LICENSE", "README.md", "CHANGELOG.md", "docs/index.md", "docs/conf.py",
                   "tests/conftest.py", "testing/redis_server.py", "tox.ini", "PKG-INFO"):  # fmt: skip
        assert needed in members, needed
    assert not [m for m in members if "__pycache__" in m or m.startswith("docs/_build")]
    if (ROOT / ".git").exists() and shutil.which("git"):
        tracked = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
        missing = [path for path in tracked if path not in members]
        assert not missing, f"in the repository, not in the sdist (MANIFEST.in): {missing}"


def test_the_wheel_holds_the_package_and_its_data_only(built: tuple[Path, str]) -> None:
    (wheel,) = built[0].glob("*.whl")
    assert wheel.name == f"scrapy_redislock-{scrapy_redislock.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = Parser().parsestr(
            archive.read(
                f"scrapy_redislock-{scrapy_redislock.__version__}.dist-info/METADATA"
            ).decode()
        )
    tops = {name.split("/")[0] for name in names}
    assert tops == {
        "scrapy_redislock",
        f"scrapy_redislock-{scrapy_redislock.__version__}.dist-info",
    }
    package = ROOT / "scrapy_redislock"
    data = [p.relative_to(ROOT).as_posix() for p in package.rglob("*.lua")]
    data += ["scrapy_redislock/py.typed", "scrapy_redislock/cli/dashboard.html"]
    assert not [d for d in data if d not in names]
    assert any(name.endswith("LICENSE") for name in names)
    # the metadata: the floors of setup.cfg, the URLs, links that work on a package index
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    floors = config["options"]["install_requires"].split()
    assert sorted(metadata.get_all("Requires-Dist")[: len(floors)]) == sorted(floors)
    urls = metadata.get_all("Project-URL")
    assert urls and all(url.split(", ", 1)[1].startswith(HOME) for url in urls)
    description = metadata.get_payload()
    assert "# scrapy-redislock" in description
    relative = [t for t in LINK.findall(description) if not t.startswith(("https://", "#"))]
    assert not relative, relative
    assert f"{HOME}/blob/v{scrapy_redislock.__version__}/docs/quickstart.md" in description


def test_tox_and_ci_pin_the_floors_setup_cfg_declares() -> None:
    """tox's floors factor pins what setup.cfg declares (.ci/run's floors pass reads setup.cfg)."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    declared = {
        name: version
        for name, version in (
            line.split(">=") for line in config["options"]["install_requires"].split()
        )
    }
    tox = configparser.ConfigParser()
    tox.read(ROOT / "tox.ini")
    pinned = dict(
        line.split(":", 1)[1].strip().split("==")
        for line in tox["testenv"]["deps"].splitlines()
        if line.startswith("floors:")
    )
    assert {name: version.removesuffix(".0") for name, version in pinned.items()} == {
        name: version.removesuffix(".0") for name, version in declared.items()
    }
    assert "python_requires = >=3.11" in (ROOT / "setup.cfg").read_text()
    assert "py311-" in tox["tox"]["envlist"]


def test_the_lock_imports_no_scrapy_and_no_twisted() -> None:
    """``from scrapy_redislock import CountingLock`` (the lock alone, for code that is no crawl)
    loads neither Scrapy nor Twisted: the Scrapy glue is imported on first use (a move of
    ``DONT_META`` into a module that imports Scrapy once broke it, with no test to say so)."""
    probe = (
        "import sys; from scrapy_redislock import AsyncCountingLock, CountingLock; "
        "print(sorted(m for m in ('scrapy', 'twisted') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
