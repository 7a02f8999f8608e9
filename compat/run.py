"""Compatibility pass (issue 27): Scrapy's and scrapy-redis's own tests, run against this project's
schedulers.

Downloads the peers' sdists at the installed versions into ``.compat-cache/`` (gitignored), copies
their tests to a work directory there, and runs each suite once unpatched (the baseline) and once
per configuration with our components put in place by ``compat/plugin.py``:

- ``scrapy``: Scrapy's tests/test_scheduler.py, test_scheduler_base.py, test_dupefilters.py,
  test_engine_loop.py; configurations ``stage-64`` and ``stage-1`` (StageScheduler over the
  scheduler the test asked for, StageLockMiddleware in every crawl, every request in one stage
  capped at 64, which never binds, or 1);
- ``scrapy-redis``: its whole tests/ directory; ``stage-64``/``stage-1`` (StageScheduler over
  scrapy-redis's scheduler) and ``worker-64``/``worker-1`` (StageWorkerScheduler in place of
  scrapy-redis's scheduler, and StageWorkerMixin under its spiders).

It prints a table per suite and the tests whose outcome differs from the baseline. Exit status 1
when a test that passes in the baseline fails (or errors, or does not run) in a configuration and
compat/known_differences.toml does not list it for that configuration; 2 when the harness itself
could not run. Run it with the project's venv:

    .venv/bin/python compat/run.py                          # everything (about 2 minutes)
    .venv/bin/python compat/run.py --suite scrapy --cap 1 -k TestRequestSendOrder
    .venv/bin/python compat/run.py --suite scrapy-redis --front worker -v -- -x

See compat/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import fnmatch
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".compat-cache"
REQUIREMENTS = ROOT / "compat" / "requirements.txt"
KNOWN = ROOT / "compat" / "known_differences.toml"
CAPS = (64, 1)  # 64: never binds (the tests have fewer requests in flight); 1: binds
GOOD = ("passed", "xfailed")
BAD = ("failed", "error", "killed", "not run")
# pytest runs per configuration at most (each after a test was killed by the time limit)
RESTARTS = 8
KEEP_RESULTS = 10  # result directories kept in .compat-cache/results/ (one per pass)
# This pass's logs and outcomes: a directory of its own, so that passes running at the same time do
# not mix.
RESULTS = CACHE / "results" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


@dataclass(frozen=True)
class Suite:
    name: str
    dist: str  # the distribution whose sdist holds the tests
    copy: tuple[str, ...]  # what of the sdist goes to the work directory
    config_file: str  # its pytest configuration, in the work directory
    targets: tuple[str, ...]
    fronts: tuple[str, ...]  # the configurations run by default
    # REDISLOCK_SCHEDULER_INNER when a test sets no SCHEDULER (stage front)
    inner: str | None = None
    nose_shim: bool = False
    pytest_args: tuple[str, ...] = ()


SUITES = {
    "scrapy": Suite(
        name="scrapy",
        dist="scrapy",
        copy=("tests", "conftest.py", "pyproject.toml"),
        config_file="pyproject.toml",
        targets=(
            "tests/test_scheduler.py",
            "tests/test_scheduler_base.py",
            "tests/test_dupefilters.py",
            "tests/test_engine_loop.py",
        ),
        fronts=("stage",),
    ),
    "scrapy-redis": Suite(
        name="scrapy-redis",
        dist="scrapy-redis",
        copy=("tests", "pytest.ini"),
        config_file="pytest.ini",
        targets=("tests",),
        fronts=("stage", "worker"),
        inner="scrapy_redis.scheduler.Scheduler",
        nose_shim=True,  # its tests use nose-style setup(); its requirements pin pytest < 7
        # The reactor Scrapy's own suite uses; ResourceWarnings shown (Python hides them by
        # default).
        pytest_args=("--reactor=asyncio", "-W", "always::ResourceWarning"),
    ),
}


@dataclass
class Run:
    """One pytest configuration of a suite, and what it gave."""

    suite: str
    config: str
    tests: dict[str, dict[str, Any]] = field(default_factory=dict)
    warnings: dict[str, Counter[str]] = field(default_factory=dict)
    collect_errors: list[dict[str, Any]] = field(default_factory=list)
    modules: dict[str, str | None] = field(default_factory=dict)
    seconds: float = 0.0
    restarts: int = 0
    cached: str | None = None
    log: Path | None = None

    def counts(self) -> Counter[str]:
        return Counter(record["outcome"] for record in self.tests.values())


class HarnessError(Exception):
    """The pass could not run (download, install, redis-server, pytest crash): exit status 2."""


# -- preparing -------------------------------------------------------------------------------------


@contextlib.contextmanager
def cache_lock() -> Iterator[None]:
    """Held while the cache is prepared (downloads, extraction, work copies, pip), for passes
    started together."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prune_results() -> None:
    """Keep the newest KEEP_RESULTS result directories."""
    kept = sorted((p for p in (CACHE / "results").iterdir() if p.is_dir()), key=lambda p: p.name)
    for old in kept[:-KEEP_RESULTS]:
        shutil.rmtree(old, ignore_errors=True)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def install_requirements(python: str) -> None:
    """compat/requirements.txt into this venv, once per content of the file (a stamp in the
    venv)."""
    digest = hashlib.sha1(REQUIREMENTS.read_bytes()).hexdigest()[:12]
    stamp = Path(sys.prefix) / f".compat-installed-{digest}"
    if stamp.exists():
        return
    log(f"installing {REQUIREMENTS.relative_to(ROOT)} into {sys.prefix}")
    cmd = [
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "-r",
        str(REQUIREMENTS),
    ]
    if subprocess.run(cmd).returncode != 0:
        raise HarnessError(f"pip install -r {REQUIREMENTS} failed")
    stamp.touch()


def sdist_tests(suite: Suite, python: str) -> tuple[str, Path]:
    """(installed version, work directory holding a copy of the sdist's tests) for a suite."""
    version = importlib.metadata.version(suite.dist)
    sdists = CACHE / "sdist"
    sdists.mkdir(parents=True, exist_ok=True)
    wanted = f"{suite.dist}-{version}.tar.gz".lower().replace("-", "_")
    found = [p for p in sdists.glob("*.tar.gz") if p.name.lower().replace("-", "_") == wanted]
    if not found:
        log(f"downloading the {suite.dist}=={version} sdist")
        cmd = [
            python,
            "-m",
            "pip",
            "download",
            "-q",
            "--disable-pip-version-check",
            "--no-binary",
            ":all:",
        ]
        cmd += ["--no-deps", "-d", str(sdists), f"{suite.dist}=={version}"]
        if subprocess.run(cmd).returncode != 0:
            raise HarnessError(f"pip download of the {suite.dist}=={version} sdist failed")
        found = [p for p in sdists.glob("*.tar.gz") if p.name.lower().replace("-", "_") == wanted]
        if not found:
            raise HarnessError(f"pip download gave no sdist of {suite.dist} {version} in {sdists}")
    archive = found[0]
    source = CACHE / "src"
    with tarfile.open(archive) as tar:
        top = tar.getnames()[0].split("/")[0]
        if not (source / top).exists():
            # Python >= 3.11.4: no path outside the target, no devices
            if hasattr(tarfile, "data_filter"):
                tar.extractall(source, filter="data")
            else:
                tar.extractall(source)
    extracted = source / top
    if not (extracted / "tests").is_dir():
        raise HarnessError(
            f"the {archive.name} sdist has no tests/ directory: nothing to run for {suite.name}"
        )
    work = CACHE / "work" / f"{suite.name}-{version}"
    if not (work / ".complete").exists():
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        for name in suite.copy:
            src = extracted / name
            if src.is_dir():
                shutil.copytree(src, work / name)
            elif src.exists():
                shutil.copy2(src, work / name)
        (work / ".complete").write_text(f"copied from {extracted}\n")
    return version, work


def code_tree(rev: str | None) -> Path:
    """The directory whose scrapy_redislock is under test: the work tree, or ``git archive <rev>``
    of it."""
    if rev is None:
        return ROOT
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if sha.returncode != 0:
        raise HarnessError(f"--rev {rev!r} is not a commit: {sha.stderr.strip()}")
    tree = CACHE / "rev" / sha.stdout.strip()[:12]
    if not (tree / "scrapy_redislock").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            [
                "git",
                "-C",
                str(ROOT),
                "archive",
                "--format=tar",
                sha.stdout.strip(),
                "scrapy_redislock",
            ],
            capture_output=True,
            check=False,
        )
        if archive.returncode != 0:
            raise HarnessError(
                f"git archive {rev} failed: {archive.stderr.decode(errors='replace').strip()}"
            )
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


# -- running ---------------------------------------------------------------------------------------


def start_redis() -> Any:
    sys.path.insert(0, str(ROOT))
    try:
        from testing.redis_server import RedisServer
    finally:
        sys.path.pop(0)
    try:
        return RedisServer().start()
    except RuntimeError as exc:
        raise HarnessError(f"cannot start a redis-server: {exc}") from None


def read_events(path: Path, run: Run) -> tuple[bool, list[str]]:
    """Fold one results file into ``run``; (the session finished, node ids started but given no
    outcome)."""
    finished = False
    started: list[str] = []
    if not path.exists():
        return False, []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        kind = event.get("event")
        if kind == "start":
            started.append(event["nodeid"])
        elif kind == "result":
            run.tests[event["nodeid"]] = event
        elif kind == "warning":
            run.warnings.setdefault(event["nodeid"], Counter())[event["category"]] += 1
        elif kind == "collect_error":
            run.collect_errors.append(event)
        elif kind == "config":
            run.modules = event.get("modules", {})
        elif kind == "finish":
            finished = True
    return finished, [nodeid for nodeid in started if nodeid not in run.tests]


def run_config(
    suite: Suite,
    config: str,
    work: Path,
    code: Path,
    args: argparse.Namespace,
    python: str,
    verbose: bool,
) -> Run:
    """One configuration: pytest (again after a test killed by the time limit, without the tests
    already run)."""
    front, _, cap = config.partition("-")
    run = Run(suite.name, config)
    results_dir = RESULTS
    run.log = results_dir / f"{suite.name}-{config}.log"
    env = dict(os.environ)
    env.pop("PYTEST_ADDOPTS", None)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(code), str(ROOT)]))
    env["COMPAT_SUITE"] = suite.name
    env["COMPAT_FRONT"] = "none" if config == "baseline" else front
    env["COMPAT_CAP"] = cap or "0"
    env["COMPAT_SUBSTITUTE"] = "0" if args.no_substitute else "1"
    env["COMPAT_NOSE_SHIM"] = "1" if suite.nose_shim else "0"
    if suite.inner:
        env["COMPAT_INNER"] = suite.inner
    redis = start_redis()
    started_at = time.monotonic()
    deselect: list[str] = []
    try:
        env["COMPAT_REDIS_URL"] = redis.url
        env["REDIS_HOST"], env["REDIS_PORT"] = "127.0.0.1", str(redis.port)  # scrapy-redis's tests
        env["REDIS_URL"] = redis.url
        while True:
            events = results_dir / f"{suite.name}-{config}.{run.restarts}.jsonl"
            env["COMPAT_RESULTS"] = str(events)
            cmd = [
                python,
                "-m",
                "pytest",
                "-p",
                "compat.plugin",
                "-p",
                "no:cacheprovider",
                "-p",
                "no:xdist",
            ]
            cmd += ["-c", suite.config_file, "--rootdir", ".", "-q", "-rN"]
            cmd += [f"--timeout={args.timeout}", "--timeout-method=thread", *suite.pytest_args]
            if args.k:
                cmd += ["-k", args.k]
            cmd += [f"--deselect={nodeid}" for nodeid in deselect]
            cmd += [*args.pytest_args, *suite.targets]
            with open(run.log, "a", encoding="utf-8") as out:
                out.write(f"$ {' '.join(cmd)}\n")
                out.flush()
                try:
                    done = subprocess.run(
                        cmd,
                        cwd=work,
                        env=env,
                        stdout=None if verbose else out,
                        stderr=subprocess.STDOUT,
                        timeout=args.run_timeout,
                        check=False,
                    )
                    returncode: int | None = done.returncode
                except subprocess.TimeoutExpired:
                    returncode = None
            finished, unfinished = read_events(events, run)
            if finished:
                break
            # the test running when pytest-timeout (or a crash) ended the process
            for nodeid in unfinished:
                why = (
                    "over the time limit"
                    if returncode is not None
                    else "the whole run went over --run-timeout"
                )
                run.tests[nodeid] = {
                    "outcome": "killed",
                    "message": f"killed: {why}",
                    "touched": {},
                }
            if returncode is None or not unfinished or run.restarts + 1 >= RESTARTS:
                if not run.tests and returncode not in (0, 1, 5):
                    raise HarnessError(
                        f"pytest exited with {returncode} for {suite.name} {config}: see {run.log}"
                    )
                break
            run.restarts += 1
            deselect = sorted(run.tests)
    finally:
        redis.stop()
    run.seconds = time.monotonic() - started_at
    origin = run.modules.get("scrapy_redislock")
    if (
        config != "baseline"
        and origin
        and not Path(origin).resolve().is_relative_to(code.resolve())
    ):
        raise HarnessError(
            f"scrapy_redislock was imported from {origin}, not from {code} (PYTHONPATH is ignored?)"
        )
    return run


def baseline_key(suite: Suite, args: argparse.Namespace) -> str:
    versions = {
        name: importlib.metadata.version(name)
        for name in ("scrapy", "scrapy-redis", "pytest", "twisted")
    }
    what = [
        versions,
        sys.version,
        suite,
        args.k,
        args.pytest_args,
        args.timeout,
        REQUIREMENTS.read_text(),
    ]
    return hashlib.sha1(json.dumps(what, default=str).encode()).hexdigest()[:12]


def run_baseline(
    suite: Suite, work: Path, code: Path, args: argparse.Namespace, python: str, verbose: bool
) -> Run:
    """The unpatched run, reused from the cache when nothing it depends on changed (not our code: it
    is unused)."""
    cached = CACHE / "baselines" / f"{suite.name}-{baseline_key(suite, args)}.json"
    if cached.exists() and not args.fresh_baseline:
        data = json.loads(cached.read_text())
        run = Run(
            suite.name,
            "baseline",
            tests=data["tests"],
            seconds=data["seconds"],
            cached=data["when"],
        )
        run.warnings = {k: Counter(v) for k, v in data["warnings"].items()}
        run.collect_errors = data["collect_errors"]
        return run
    run = run_config(suite, "baseline", work, code, args, python, verbose)
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(
        json.dumps(
            {
                "tests": run.tests,
                "warnings": run.warnings,
                "collect_errors": run.collect_errors,
                "seconds": run.seconds,
                "when": time.strftime("%Y-%m-%d %H:%M"),
            }
        )
    )
    partial.replace(cached)  # atomic: another pass running at the same time reads all of it or none
    return run


# -- comparing -------------------------------------------------------------------------------------


@dataclass
class Known:
    suite: str
    config: str
    test: str
    reason: str

    def matches(self, suite: str, config: str, nodeid: str) -> bool:
        return (
            fnmatch.fnmatchcase(suite, self.suite)
            and fnmatch.fnmatchcase(config, self.config)
            and (nodeid == self.test or fnmatch.fnmatchcase(nodeid, self.test))
        )


def load_known(path: Path) -> list[Known]:
    if not path.exists():
        return []
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise HarnessError(f"{path}: {exc}") from None
    known = []
    for index, entry in enumerate(data.get("difference", [])):
        missing = [
            key
            for key in ("suite", "config", "test", "reason")
            if not str(entry.get(key, "")).strip()
        ]
        if missing:
            raise HarnessError(f"{path}: [[difference]] #{index + 1} lacks {', '.join(missing)}")
        known.append(Known(entry["suite"], entry["config"], entry["test"], entry["reason"].strip()))
    return known


@dataclass
class Difference:
    config: str
    nodeid: str
    baseline: str
    patched: str
    message: str
    known: Known | None = None

    @property
    def regression(self) -> bool:
        return self.baseline in GOOD and self.patched in BAD


def differences(baseline: Run, run: Run, known: list[Known]) -> list[Difference]:
    found = []
    for nodeid in sorted(set(baseline.tests) | set(run.tests)):
        before = baseline.tests.get(nodeid, {}).get("outcome", "not run")
        record = run.tests.get(
            nodeid, {"outcome": "not run", "message": "not collected or deselected"}
        )
        if before == record["outcome"]:
            continue
        entry = next((k for k in known if k.matches(run.suite, run.config, nodeid)), None)
        found.append(
            Difference(
                run.config, nodeid, before, record["outcome"], record.get("message", ""), entry
            )
        )
    return found


def new_warnings(baseline: Run, run: Run) -> dict[str, Counter[str]]:
    """Per test, the ResourceWarnings and unraisable-exception warnings seen patched beyond the
    baseline's."""
    extra = {}
    for nodeid, counts in run.warnings.items():
        more = counts - baseline.warnings.get(nodeid, Counter())
        if more:
            extra[nodeid] = more
    return extra


def touched_summary(run: Run) -> str:
    kinds: Counter[str] = Counter()
    untouched = 0
    for record in run.tests.values():
        touched = record.get("touched") or {}
        if not touched:
            untouched += 1
        kinds.update(touched.keys())
    parts = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))
    return f"tests that met our components: {len(run.tests) - untouched} ({parts or 'none'}); untouched: {untouched}"


def report(
    suite: Suite, version: str, runs: list[Run], known: list[Known]
) -> tuple[int, list[Difference]]:
    """Print the suite's table and differences; (unlisted regressions, all differences)."""
    baseline = runs[0]
    print(f"\n== {suite.name}: {suite.dist} {version} sdist, {' '.join(suite.targets)} ==")
    header = f"{'config':<12}{'passed':>8}{'failed':>8}{'errors':>8}{'skipped':>9}{'other':>7}{'differ':>8}{'new':>5}"
    print(header + f"{'time':>9}")
    all_diffs: list[Difference] = []
    unlisted = 0
    for run in runs:
        counts = run.counts()
        other = sum(
            n
            for k, n in counts.items()
            if k not in ("passed", "failed", "error", "killed", "skipped")
        )
        if run is baseline:
            diffs: list[Difference] = []
            differ = new = "-"
        else:
            diffs = differences(baseline, run, known)
            regressions = [d for d in diffs if d.regression and d.known is None]
            unlisted += len(regressions)
            all_diffs += diffs
            differ, new = str(len(diffs)), str(len(regressions))
        if run is baseline and not run.tests:
            print(f"{run.config:<12}{'(not run: --no-baseline)':>40}")
            continue
        when = f"cached {run.cached}" if run.cached else f"{run.seconds:.1f} s"
        print(
            f"{run.config:<12}{counts['passed']:>8}{counts['failed']:>8}{counts['error'] + counts['killed']:>8}"
            f"{counts['skipped']:>9}{other:>7}{differ:>8}{new:>5}  {when}"
            + (f" ({run.restarts} restarts)" if run.restarts else "")
        )
    bad = {nodeid: r for nodeid, r in baseline.tests.items() if r["outcome"] in BAD}
    if bad:
        print(
            f"baseline failures ({len(bad)}, not compared: they fail unpatched in this "
            "environment):"
        )
        for nodeid, record in sorted(bad.items()):
            print(f"  {record['outcome']:<8}{nodeid}\n          {record.get('message', '')[:200]}")
    for run in runs:
        for error in run.collect_errors:
            print(
                f"collection error in {run.config}: {error['nodeid']}\n    "
                f"{error['message'][-600:]}"
            )
    for run in runs[1:]:
        print(f"{run.config}: {touched_summary(run)}")
    if all_diffs:
        print(
            "differences from the baseline (NEW: passes in the baseline, fails here, not in "
            "known_differences):"
        )
        explained: set[int] = set()
        touched = {
            (run.config, nodeid): record.get("touched")
            for run in runs
            for nodeid, record in run.tests.items()
        }
        for diff in all_diffs:
            tag = (
                "NEW"
                if diff.regression and diff.known is None
                else ("known" if diff.known else "info")
            )
            print(f"  {tag:<6}{diff.config:<10}{diff.baseline}->{diff.patched:<9}{diff.nodeid}")
            if diff.message:
                print(f"          {diff.message[:400]}")
            if "unraisable" in diff.message and not touched.get((diff.config, diff.nodeid)):
                print(
                    "          (this test met none of our components: what it reports was left by "
                    "an earlier test)"
                )
            if diff.known and id(diff.known) not in explained:
                explained.add(id(diff.known))
                print(f"          known: {' '.join(diff.known.reason.split())}")
            elif diff.known:
                print("          known: as above")
    for run in runs[1:]:
        extra = new_warnings(baseline, run)
        if extra:
            print(
                f"{run.config}: warnings beyond the baseline's in {len(extra)} tests "
                "(ResourceWarning etc.):"
            )
            for nodeid, counts in sorted(extra.items()):
                print(f"  {nodeid or '(outside a test)'}: {dict(counts)}")
    return unlisted, all_diffs


def stale_known(
    known: list[Known], runs: dict[str, list[Run]], diffs: list[tuple[str, Difference]]
) -> list[Known]:
    """Entries that matched no difference although their test ran in their configuration (fixed
    since?)."""
    used = {id(diff.known) for _, diff in diffs if diff.known is not None}
    stale = []
    for entry in known:
        if id(entry) in used:
            continue
        if any(
            entry.matches(name, run.config, nodeid)
            for name, suite_runs in runs.items()
            for run in suite_runs[1:]
            for nodeid in run.tests
        ):
            stale.append(entry)
    return stale


# -- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="compat/run.py",
        description="Run Scrapy's and scrapy-redis's own tests against this project's schedulers "
        "(issue 27).",
        epilog="Arguments after -- go to pytest (e.g. -- -x --lf is not supported: no cache; -- -x "
        "works).",
    )
    parser.add_argument(
        "--suite", action="append", choices=sorted(SUITES), help="default: all suites"
    )
    parser.add_argument(
        "--front", action="append", choices=("stage", "worker"), help="default: per suite"
    )
    parser.add_argument("--cap", action="append", type=int, help="default: 64 and 1")
    parser.add_argument("-k", help="pytest -k expression, for the baseline and every configuration")
    parser.add_argument(
        "--fresh-baseline", action="store_true", help="run the baseline even if cached"
    )
    parser.add_argument(
        "--no-baseline", action="store_true", help="no baseline: only show outcomes"
    )
    parser.add_argument(
        "--no-substitute", action="store_true", help="leave directly built Scheduler classes alone"
    )
    parser.add_argument(
        "--rev",
        help="test scrapy_redislock as of this git revision (git archive), not the work tree",
    )
    parser.add_argument("--timeout", type=float, default=30, help="seconds per test (default 30)")
    parser.add_argument(
        "--run-timeout", type=float, default=600, help="seconds per pytest run (default 600)"
    )
    parser.add_argument(
        "--no-install", action="store_true", help="do not pip install compat/requirements.txt"
    )
    parser.add_argument(
        "--known", type=Path, default=KNOWN, help="the allow-list (default %(default)s)"
    )
    parser.add_argument(
        "--json", type=Path, help="also write the outcomes and differences to this file"
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show pytest's output (else in logs)"
    )
    parser.add_argument("pytest_args", nargs="*", help=argparse.SUPPRESS)
    if "--" in argv:
        cut = argv.index("--")
        args = parser.parse_args(argv[:cut])
        args.pytest_args = argv[cut + 1 :]
    else:
        args = parser.parse_args(argv)
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    python = sys.executable
    started = time.monotonic()
    try:
        known = load_known(args.known)
        RESULTS.mkdir(parents=True)
        prune_results()
        with cache_lock():
            if not args.no_install:
                install_requirements(python)
            code = code_tree(args.rev)
        all_runs: dict[str, list[Run]] = {}
        all_diffs: list[tuple[str, Difference]] = []
        unlisted = 0
        for name in args.suite or list(SUITES):
            suite = SUITES[name]
            with cache_lock():
                version, work = sdist_tests(suite, python)
            fronts = args.front or list(suite.fronts)
            configs = [f"{front}-{cap}" for front in fronts for cap in (args.cap or CAPS)]
            runs = []
            if not args.no_baseline:
                log(f"{name}: baseline")
                runs.append(run_baseline(suite, work, code, args, python, args.verbose))
            else:
                runs.append(Run(name, "baseline"))
            for config in configs:
                log(f"{name}: {config}")
                runs.append(run_config(suite, config, work, code, args, python, args.verbose))
            all_runs[name] = runs
            count, diffs = report(suite, version, runs, known)
            unlisted += count
            all_diffs += [(name, diff) for diff in diffs]
    except HarnessError as exc:
        log(f"compat: {exc}")
        return 2
    for entry in stale_known(known, all_runs, all_diffs):
        print(f"\nnote: known difference not seen: {entry.suite} {entry.config} {entry.test}")
    print(f"\ncode under test: {code}{f' (git {args.rev})' if args.rev else ''}; logs in {RESULTS}")
    print(f"total {time.monotonic() - started:.0f} s; {unlisted} unlisted regression(s)")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "runs": {
                        name: {
                            run.config: {"tests": run.tests, "seconds": run.seconds} for run in runs
                        }
                        for name, runs in all_runs.items()
                    },
                    "differences": [
                        {
                            "suite": name,
                            **{k: v for k, v in vars(d).items() if k != "known"},
                            "known": d.known.reason if d.known else None,
                        }
                        for name, d in all_diffs
                    ],
                },
                indent=1,
                default=str,
            )
        )
    return 1 if unlisted else 0


if __name__ == "__main__":
    try:
        status = main(sys.argv[1:])
    except KeyboardInterrupt:
        status = 130
    except Exception:  # a bug of the harness: not "a test differs" (1)
        import traceback

        traceback.print_exc()
        status = 2
    sys.exit(status)
