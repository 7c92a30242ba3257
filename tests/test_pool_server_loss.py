"""The PostgreSQL server of a run's pool stops mid-run (`pg_ctl stop -m immediate`, as a crash
or a failover does): `forgerl train` ends with one line naming `datapool.url` (no traceback from
the gateway's in-flight requests, no password), and once the server is back the same command
resumes to the run an uninterrupted one gives: every task trained once, at the logged step."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import psycopg
import pytest

from tests.pg import Server, server_bin
from tests.test_crash_consistency import FORGERL, check_run_state, records, write_config

pytestmark = pytest.mark.slow


@pytest.fixture
def server() -> Iterator[Server]:
    """A server of this test's own, which it may stop and start again (the shared one must
    stay up)."""
    with Server(server_bin()) as server:
        yield server


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
