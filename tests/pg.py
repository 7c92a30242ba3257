"""A real PostgreSQL server for the tests: ONE per pytest process (each xdist worker starts its
own, on its own port and folder), and a fresh database per test (`pg_url`).

The server is the machine's PostgreSQL binaries (/usr/lib/postgresql/<version>/bin, Debian's
`postgresql` package; scripts/setup.sh installs it), run from a temp folder: initdb and the
server refuse root, so as root they run as the `postgres` user (runuser), which owns the folder.
It listens on 127.0.0.1 on a free port with trust authentication, fsync on, and is stopped with
`pg_ctl stop -m immediate`. Without the binaries the PostgreSQL tests are skipped with the
reason, except under CI (`tests.skips.in_ci`), where they fail (CI must run them).
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ABSENT = "PostgreSQL server binaries absent (apt-get install postgresql)"
_databases = itertools.count()


def pg_bin() -> Path | None:
    """The newest installed PostgreSQL server's bin folder, or None. FORGERL_PG_BIN names
    another folder (one holding initdb and pg_ctl)."""
    if folder := os.environ.get("FORGERL_PG_BIN"):
        return Path(folder) if (Path(folder) / "initdb").exists() else None
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


def server_bin() -> Path:
    """`pg_bin()` for a test: skipped with the reason when absent, failed under CI."""
    from tests.skips import in_ci  # lazy: conftest imports this module before its plugin

    bin_dir = pg_bin()
    if bin_dir is None:
        if in_ci():
            pytest.fail(f"{ABSENT}; CI=true must run the PostgreSQL tests")
        pytest.skip(ABSENT)
    return bin_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], as_postgres: bool) -> None:
    if as_postgres:
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGERL")}  # not a test's
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="/", env=env)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stdout}{done.stderr}")


class Server:
    """A throwaway server from `bin_dir` in its own temp folder (initdb here); `with` starts it
    and, at the end, stops it if running and deletes the folder. `stop` and `start` again keep
    its port (a test that stops the server mid-run). `url`: "postgresql://postgres@127.0.0.1:PORT"
    (add "/postgres" or another database's name)."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin, self.root, self.port, self.running = bin_dir, os.geteuid() == 0, 0, False
        self.folder = Path(tempfile.mkdtemp(prefix="forgerl-pg-"))
        if self.root:
            shutil.chown(self.folder, "postgres", "postgres")
        self.data, self.log = self.folder / "data", self.folder / "server.log"
        _run([str(bin_dir / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
              "-N", "-E", "UTF8", "--locale=C"], self.root)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start on its port, the first time a free one: another worker may take that port
        before the server binds, so a first start tries up to 5."""
        tries = 1 if self.port else 5
        for attempt in range(tries):
            port = self.port or _free_port()
            options = (f"-p {port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=on"
                       " -c max_connections=200")
            try:
                _run([str(self.bin / "pg_ctl"), "start", "-w", "-t", "60", "-D", str(self.data),
                      "-l", str(self.log), "-o", options], self.root)
                self.port, self.running = port, True
                return
            except RuntimeError:
                if attempt == tries - 1:
                    raise RuntimeError("PostgreSQL did not start: "
                                       f"{self.log.read_text()[-2000:]}") from None

    def stop(self) -> None:
        """`pg_ctl stop -m immediate`, as a crash or a failover stops it."""
        _run([str(self.bin / "pg_ctl"), "stop", "-m", "immediate", "-D", str(self.data)],
             self.root)
        self.running = False

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.running:
                self.stop()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """The pytest process's server (`Server`); skipped or failed when absent."""
    with Server(server_bin()) as server:
        yield server.url


@pytest.fixture
def pg_url(pg_server: str) -> Iterator[str]:
    """A fresh, empty database on the session's server; its URL. Dropped after the test."""
    import psycopg  # lazy: only the PostgreSQL tests need it

    name = f"t{os.getpid()}_{next(_databases)}"
    with psycopg.connect(f"{pg_server}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield f"{pg_server}/{name}"
    with psycopg.connect(f"{pg_server}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
