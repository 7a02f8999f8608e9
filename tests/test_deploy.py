"""deploy/: the docker compose file names only what the project has, and the Prometheus rules pass
their unit tests.

There is no Docker here, so the compose file is read, not run: every service's command is parsed by
the parser of the program it runs (the command line's for the dashboard, ``python -m testing.site``'s
for the shop), every ``-s`` setting is one the package, Scrapy or scrapy-redis reads and the whole
set passes :func:`scrapy_redislock.crawl.settings.read_settings`, every spider, module and file
exists, and every port meets the one the other side uses. The alert and scaling rules use only the
series the dashboard's ``/metrics`` exports, and ``promtool test rules deploy/prometheus/tests.yml``
passes (skipped when promtool is not on PATH: Debian's ``prometheus`` package has it). No Redis.
"""

from __future__ import annotations

import configparser
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import scrapy
import scrapy.settings.default_settings as scrapy_defaults
import scrapy_redis
import yaml
from scrapy.settings import Settings
from scrapy.spiderloader import SpiderLoader
from scrapy_redis import defaults as scrapy_redis_defaults

from scrapy_redislock.cli import dashboard
from scrapy_redislock.cli import main as cli
from scrapy_redislock.crawl import defaults
from scrapy_redislock.crawl.settings import read_settings, read_worker_settings
from scrapy_redislock.requests.addon import Addon
from testing import site

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
PROMETHEUS = DEPLOY / "prometheus"
APP = "/app"  # where deploy/Dockerfile copies the repository
FRONTS = ("worker-front", "request-front")
# what the command line reads from the environment (scrapy_redislock/cli/main.py's docstring)
CLI_ENVIRONMENT = ("REDISLOCK_URL", "REDIS_URL", "REDISLOCK_KEY_PREFIX")
REDIS_PORT = 6379  # redis-server's default, and the command line's default URL's
INTERPOLATED = re.compile(r"\$\{(\w+):-([^}]*)\}")


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return load(COMPOSE)["services"]


def interpolate(value: Any) -> str:
    """``${NAME:-default}`` as compose reads it with NAME unset."""
    return INTERPOLATED.sub(lambda m: m.group(2), str(value))


def in_repository(path: str, working_dir: str = APP) -> Path:
    """A path inside the container, as the file of the repository it is."""
    full = path if path.startswith("/") else f"{working_dir}/{path}"
    assert full == APP or full.startswith(APP + "/"), f"{path} is not under {APP}"
    return ROOT / full.removeprefix(APP).lstrip("/")


def published(service: dict[str, Any]) -> dict[int, str]:
    """Container port -> host address of the service's published ports."""
    ports = {}
    for entry in service.get("ports", []):
        address, host_port, container_port = str(entry).split(":")
        assert host_port == container_port, entry
        ports[int(container_port)] = address
    return ports


def options(command: list[str]) -> dict[str, str]:
    """``--flag value`` pairs of a command (flags without a value map to "")."""
    found: dict[str, str] = {}
    for n, word in enumerate(command):
        if word.startswith("--"):
            following = command[n + 1] if n + 1 < len(command) else "--"
            found[word] = "" if following.startswith("--") else following
    return found


def scrapy_settings(command: list[str]) -> dict[str, str]:
    """The ``-s NAME=VALUE`` of a ``scrapy crawl`` command."""
    pairs = [command[n + 1] for n, word in enumerate(command) if word == "-s"]
    return dict(pair.split("=", 1) for pair in pairs)


def uses_project_image(service: dict[str, Any]) -> bool:
    return "build" in service


# -- the services ------------------------------------------------------------------------------------


def test_the_services_are_redis_the_shop_both_fronts_the_dashboard_and_prometheus(
    services: dict[str, dict[str, Any]],
) -> None:
    assert set(services) == {
        "redis",
        "shop",
        "seed",
        *FRONTS,
        "dashboard",
        "prometheus",
    }
    for front in FRONTS:
        replicas = int(interpolate(services[front]["deploy"]["replicas"]))
        assert replicas >= 2, f"{front}: N workers, not {replicas}"
    for name, service in services.items():
        for port, address in published(service).items():
            assert address == "127.0.0.1", f"{name} publishes {port} beyond the host's loopback"


def test_redis_keeps_the_worker_queues_across_restarts(
    services: dict[str, dict[str, Any]],
) -> None:
    """docs/worker-caps.md: AOF, appendfsync always to lose no acknowledged write;
    docs/failures.md: noeviction, else the crawl refuses to start."""
    redis = services["redis"]
    command = redis["command"]
    assert command[0] == "redis-server"
    flags = options(command)
    assert flags["--appendonly"] == "yes"
    assert flags["--appendfsync"] == "always"
    assert flags["--maxmemory-policy"] == "noeviction"
    assert "--port" not in flags  # REDIS_PORT, as every URL below says
    assert any(volume.endswith(":/data") for volume in redis["volumes"])  # the image's dir
    assert published(redis) == {REDIS_PORT: "127.0.0.1"}


def test_the_image_is_the_repository_with_the_dashboard_extra(
    services: dict[str, dict[str, Any]],
) -> None:
    dockerfile = DEPLOY / "Dockerfile"
    for name, service in services.items():
        if uses_project_image(service):
            build = service["build"]
            assert (DEPLOY / build["context"]).resolve() == ROOT, name
            assert (ROOT / build["dockerfile"]).resolve() == dockerfile, name
    text = dockerfile.read_text(encoding="utf-8")
    assert f"WORKDIR {APP}" in text and f"COPY . {APP}" in text
    extras = re.search(r'pip install [^\n]*"\.\[(\w+)\]"', text)
    assert extras, "the Dockerfile installs the repository with an extra"
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    assert extras.group(1) in setup["options.extras_require"]
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text(encoding="utf-8").split()
    assert ".venv" in ignored and ".git" in ignored


# -- the commands ------------------------------------------------------------------------------------


def test_every_python_module_a_service_runs_exists(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        if not uses_project_image(service):
            continue
        command = service["command"]
        working_dir = service.get("working_dir", APP)
        assert in_repository(working_dir).is_dir(), f"{name}: no {working_dir}"
        if command[0] == "python":
            assert command[1] == "-m", name
            module = ROOT / command[2].replace(".", "/")
            assert module.with_suffix(".py").is_file() or (module / "__main__.py").is_file(), (
                f"{name}: no module {command[2]} in the repository"
            )
        else:
            assert command[:2] == ["scrapy", "crawl"], f"{name}: {command}"
            assert (in_repository(working_dir) / "scrapy.cfg").is_file(), name


def test_the_dashboard_command_parses_with_the_command_line(
    services: dict[str, dict[str, Any]],
) -> None:
    service = services["dashboard"]
    command = service["command"]
    assert command[:3] == ["python", "-m", "scrapy_redislock"]
    opts = cli.build_parser().parse_args(command[3:])
    assert opts.command == "dashboard"
    assert opts.host == "0.0.0.0"  # inside the container; published on the host's loopback only
    assert opts.allow_control  # the token is in its log
    assert published(service) == {opts.port: "127.0.0.1"}
    environment = service["environment"]
    assert set(environment) <= set(CLI_ENVIRONMENT)
    for name in environment:
        assert name in (cli.__doc__ or ""), f"{name}: the command line does not say it reads it"
    url = urlsplit(environment["REDISLOCK_URL"])
    assert (url.scheme, url.hostname, url.port) == ("redis", "redis", REDIS_PORT)


def test_the_shop_command_parses_with_the_sites_own_parser(
    services: dict[str, dict[str, Any]],
) -> None:
    command = services["shop"]["command"]
    assert command[:3] == ["python", "-m", "testing.site"]
    args = site.arguments().parse_args(command[3:])
    assert args.host == "0.0.0.0"
    assert published(services["shop"]) == {args.port: "127.0.0.1"}


def spiders() -> dict[str, type[scrapy.Spider]]:
    """The example project's spiders by name, found as ``scrapy crawl`` finds them (its
    SPIDER_MODULES)."""
    from example_project.example_project import settings as project

    modules = [f"example_project.{module}" for module in project.SPIDER_MODULES]
    loader = SpiderLoader.from_settings(Settings({"SPIDER_MODULES": modules}))
    return {name: loader.load(name) for name in loader.list()}


def crawl_settings(command: list[str]) -> tuple[type[scrapy.Spider], Settings]:
    """The spider a ``scrapy crawl`` command runs and the settings it runs with: the project's, the
    spider's, the command line's, then the add-ons'."""
    from example_project.example_project import settings as project

    spider = spiders()[command[2]]
    settings = Settings()
    settings.setmodule(project, priority="project")
    spider.update_settings(settings)
    settings.setdict(scrapy_settings(command), priority="cmdline")
    for path in settings.getdict("ADDONS"):
        assert path == "scrapy_redislock.Addon", f"an add-on the project does not have: {path}"
        Addon().update_settings(settings)
    return spider, settings


def read_by_scrapy_redis(name: str) -> bool:
    """Whether scrapy-redis's source reads the setting (it has no table of them)."""
    package = Path(scrapy_redis.__file__).parent
    return any(f'"{name}"' in path.read_text() for path in package.glob("*.py"))


def test_the_fronts_run_example_spiders_with_settings_that_exist(
    services: dict[str, dict[str, Any]],
) -> None:
    names = spiders()
    for front in FRONTS:
        command = services[front]["command"]
        assert command[2] in names, f"{front}: no spider {command[2]!r} ({sorted(names)})"
        for name in scrapy_settings(command):
            if name.startswith("REDISLOCK_"):
                assert name in defaults.SETTINGS, f"{front}: no setting {name}"
            else:
                assert hasattr(scrapy_defaults, name) or read_by_scrapy_redis(name), (
                    f"{front}: neither Scrapy nor scrapy-redis reads {name}"
                )
        spider, settings = crawl_settings(command)
        checked = read_settings(settings)  # a bad value raises ConfigError, naming it
        url = urlsplit(settings["REDIS_URL"])
        assert (url.scheme, url.hostname, url.port) == ("redis", "redis", REDIS_PORT), front
        if front == "worker-front":
            assert getattr(spider, "worker_stages", None), "the worker front's spider has stages"
            # workers wait for work instead of closing when idle (compose would restart them)
            assert read_worker_settings(settings, checked).idle_close is None
        else:
            assert checked.stages == {"list": 1, "detail": 3, "comments": None}
            # the add-on wraps scrapy-redis's scheduler: one queue shared by every process
            assert settings["SCHEDULER"] == "scrapy_redislock.StageScheduler"
            assert settings["REDISLOCK_SCHEDULER_INNER"] == "scrapy_redis.scheduler.Scheduler"
            assert settings.getint("MAX_IDLE_TIME_BEFORE_CLOSE") == 0


def test_the_seed_feeds_each_fronts_spider_the_shops_start_page(
    services: dict[str, dict[str, Any]],
) -> None:
    shop = site.arguments().parse_args(services["shop"]["command"][3:])
    entrypoint = services["seed"]["entrypoint"]
    assert entrypoint[:2] == ["sh", "-c"]
    pushed = {}
    for part in entrypoint[2].split("&&"):
        words = shlex.split(part)
        assert words[:3] == ["redis-cli", "-h", "redis"] and words[3] == "lpush", part
        pushed[words[4]] = json.loads(words[5])["url"]
    expected = {
        scrapy_redis_defaults.START_URLS_KEY % {"name": services[front]["command"][2]}
        for front in FRONTS
    }
    assert set(pushed) == expected
    for url in pushed.values():
        parts = urlsplit(url)
        assert (parts.hostname, parts.port) == ("shop", shop.port)
        page = object.__new__(site.ShopSite)  # its pages, without a server
        page.lists, page.details, page.comments = shop.lists, shop.details, shop.comments
        assert site.ShopSite.content(page, parts.path), f"the shop has no page {parts.path}"


# -- Prometheus --------------------------------------------------------------------------------------


def test_prometheus_scrapes_the_dashboard_and_loads_the_rules(
    services: dict[str, dict[str, Any]],
) -> None:
    service = services["prometheus"]
    assert "./prometheus:/etc/prometheus:ro" in service["volumes"]
    assert service["command"] == ["--config.file=/etc/prometheus/prometheus.yml"]
    config = load(PROMETHEUS / "prometheus.yml")
    for rules in config["rule_files"]:
        assert (PROMETHEUS / rules).is_file(), rules
    assert set(config["rule_files"]) == {"alerts.yml", "scaling.yml"}
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "redislock"  # RedislockExporterDown watches up{job="redislock"}
    opts = cli.build_parser().parse_args(services["dashboard"]["command"][3:])
    assert job["static_configs"] == [{"targets": [f"dashboard:{opts.port}"]}]
    # the Host Prometheus sends is one the dashboard answers (else 421)
    hosts = dashboard.allowed_hosts(opts.host, opts.allowed_host)
    assert hosts is None or "dashboard" in hosts
    tests = load(PROMETHEUS / "tests.yml")
    assert set(tests["rule_files"]) == set(config["rule_files"])


def exported_series() -> set[str]:
    """The names of the series /metrics can have (a counter's with _total), from the dashboard's own
    collector."""

    class NoRedis:
        def read(self) -> tuple[list[Any], list[Any]]:
            return [], []

    names = set()
    for family in dashboard.RedisCollector(NoRedis()).collect():  # type: ignore[arg-type]
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def test_the_rules_use_only_series_the_dashboard_exports_and_documents() -> None:
    exported = exported_series()
    assert {"redislock_up", "redislock_grants_total", "redislock_queue_length"} <= exported
    documented = (ROOT / "docs" / "operating.md").read_text(encoding="utf-8")
    recorded: set[str] = set()
    alerts: set[str] = set()
    for path in ("alerts.yml", "scaling.yml"):
        for group in load(PROMETHEUS / path)["groups"]:
            for rule in group["rules"]:
                expr = rule["expr"]
                for name in re.findall(r"\b(redislock_\w+)", expr):
                    assert name in exported, f"{path}: {name} is not a series of /metrics"
                    assert f"`{name}`" in documented, f"{name} is not in docs/operating.md"
                for name in re.findall(r"\b(redislock:[\w:]+)", expr):
                    assert name in recorded, f"{path}: {name} is not recorded before it is used"
                if "record" in rule:
                    recorded.add(rule["record"])
                else:
                    alerts.add(rule["alert"])
                    assert rule["labels"]["severity"] in ("critical", "warning", "info")
                    assert rule["annotations"].keys() == {"summary", "description"}
    tested = {
        case["alertname"]
        for test in load(PROMETHEUS / "tests.yml")["tests"]
        for case in test.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    assert alerts == tested, f"alerts without a test that fires them: {sorted(alerts - tested)}"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not on PATH")
def test_promtool_checks_the_config_and_passes_the_rules_unit_tests() -> None:
    for args in (
        ["check", "config", "prometheus.yml"],  # and the rule files it names
        ["test", "rules", "tests.yml"],
    ):
        done = subprocess.run(
            ["promtool", *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"
        assert "SUCCESS" in done.stdout + done.stderr
