"""The PostgreSQL server of a run's pool stops mid-run (`pg_ctl stop -m immediate`, as a crash
or a failover does): `forgerl train` ends with one line naming `datapool.url` (no traceback from
the gateway's in-flight requests, no password), and once the server is back the same command
resumes to the run an uninterrupted one gives: every task trained once, at the logged step."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.pg import ABSENT, _free_port, _run, pg_bin
from tests.test_crash_consistency import FORGERL, check_run_state, records, write_config

pytestmark = pytest.mark.slow


class Server:
    """A PostgreSQL server this test may stop and start again (the shared one must stay up)."""

    def __init__(self, bin_dir: Path, folder: Path) -> None:
        self.bin, self.data, self.port = bin_dir, folder / "data", _free_port()
        self.options = f"-p {self.port} -k {folder} -c listen_addresses=127.0.0.1"
        self.log = folder / "server.log"
        _run([str(bin_dir / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
              "-N", "-E", "UTF8", "--locale=C"], as_postgres=True)

    def start(self) -> None:
        _run([str(self.bin / "pg_ctl"), "start", "-w", "-D", str(self.data), "-l", str(self.log),
              "-o", self.options], as_postgres=True)

    def stop(self) -> None:
        _run([str(self.bin / "pg_ctl"), "stop", "-m", "immediate", "-D", str(self.data)],
             as_postgres=True)


@pytest.fixture
def server() -> Iterator[Server]:
    bin_dir = pg_bin()
    if bin_dir is None:
        pytest.skip(ABSENT)
    folder = Path(tempfile.mkdtemp(prefix="forgerl-pg-"))
    shutil.chown(folder, "postgres", "postgres")
    server = Server(bin_dir, folder)
    server.start()
    yield server
    subprocess.run([str(bin_dir / "pg_ctl"), "stop", "-m", "immediate", "-D", str(server.data)],
                   capture_output=True)  # already stopped if the test failed there
    shutil.rmtree(folder, ignore_errors=True)


def test_a_server_stopped_mid_run_is_one_line_and_the_run_resumes(tmp_path, server):
    base = f"postgresql://postgres:hunter2@127.0.0.1:{server.port}"
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute("CREATE DATABASE run")
    config = write_config(tmp_path, max_steps=2, checkpoint_every=1, pool_url=f"{base}/run")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*FORGERL, "train", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while len(records(run_dir)) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)  # step 1 trained: rollouts of step 2 are in flight
    server.stop()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "Traceback" not in err and "hunter2" not in err, err
    assert err.splitlines()[-1].startswith(
        "forgerl: PoolLost: datapool.url: lost the connection to "
        f"postgresql://postgres:***@127.0.0.1:{server.port}/run: "), err
    server.start()
    resumed = subprocess.run([*FORGERL, "train", str(config)], capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    check_run_state(run_dir, max_steps=2, pool_url=f"{base}/run")
