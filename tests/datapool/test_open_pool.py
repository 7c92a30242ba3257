"""`open_pool` and `[datapool] url`: the backend follows the location; a bad URL or an
unreachable server is a one-line error naming `datapool.url` (no password, no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from forgerl.config import ConfigError, load_config
from forgerl.controller.rundir import save_config
from forgerl.datapool import open_pool
from forgerl.datapool.postgres import PostgresPool
from forgerl.datapool.sqlite import SQLitePool
from tests.test_crash_consistency import FORGERL, write_config

UNREACHABLE = "postgresql://forge:s3cret@127.0.0.1:1/pool"  # port 1: nothing listens


def test_the_location_picks_the_backend(tmp_path, pg_url):
    sqlite, pg = open_pool(tmp_path / "p.sqlite"), open_pool(pg_url)
    assert type(sqlite) is SQLitePool and type(pg) is PostgresPool
    for pool in (sqlite, pg):
        pool.set_meta("cursor", {"head": 3})
        assert pool.get_meta("cursor") == {"head": 3}
        pool.close()
    with pytest.raises(ValueError, match=r"^PostgresPool\(postgresql://postgres@.*\) is closed"):
        pg.get_meta("cursor")
    config = load_config(None, [f"--datapool.url={pg_url}", f"--run_dir={tmp_path}"])
    assert config.datapool.location(tmp_path) == pg_url
    assert load_config(None, []).datapool.location(tmp_path) == tmp_path / "pool.sqlite"


def test_an_unreachable_server_is_a_config_error_without_the_password():
    with pytest.raises(ConfigError) as info:
        open_pool(UNREACHABLE)
    message = str(info.value)
    assert message.startswith("datapool.url: cannot open postgresql://forge:***@127.0.0.1:1/pool: ")
    assert "s3cret" not in message and "\n" not in message


def test_a_url_that_is_not_postgresql_names_the_field():
    with pytest.raises(ConfigError, match=r"datapool\.url: .*postgresql:// URL"):
        load_config(None, ["--datapool.url=mysql://x/y"])


def test_forgerl_train_says_it_in_one_line(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f"run_dir = {str(tmp_path / 'run')!r}\nmax_steps = 1\n"
                      "[model]\npath = 'tiny'\n[agent]\ncommand = ['true']\n")
    done = subprocess.run([sys.executable, "-m", "forgerl", "train", str(config),
                           "--datapool.url", UNREACHABLE], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("forgerl: error: datapool.url: cannot open "
                                  "postgresql://forge:***@127.0.0.1:1/pool: ")
    assert len(done.stderr.splitlines()) == 1 and "s3cret" not in done.stderr


@pytest.mark.parametrize("ci", ["", "true"])
def test_absent_server_binaries_skip_with_the_reason_or_fail_under_ci(ci):
    """Without PostgreSQL's binaries a PostgreSQL test is skipped, saying what to install;
    under CI=true it fails instead (CI must run it)."""
    env = {**os.environ, "FORGERL_PG_BIN": "/nonexistent", "CI": ci,
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # no third-party plugins: a quick start
    test = "tests/datapool/test_open_pool.py::test_the_location_picks_the_backend"
    done = subprocess.run([sys.executable, "-m", "pytest", "-rsE", "-p", "no:cacheprovider",
                           "--noconftest", "-p", "tests.pg", test],  # tests.pg: the fixtures
                          capture_output=True, text=True, timeout=120, env=env,
                          cwd=Path(__file__).resolve().parents[2])
    reason = "PostgreSQL server binaries absent (apt-get install postgresql)"
    if ci:
        assert done.returncode == 1 and "1 error" in done.stdout
        assert f"{reason}; CI=true must run the PostgreSQL tests" in done.stdout
    else:
        assert done.returncode == 0 and "1 skipped" in done.stdout
        assert f"SKIPPED [1] {test.split('::')[0]}" in done.stdout and reason in done.stdout


def test_a_password_given_as_a_parameter_is_redacted_too():
    url = "postgresql:///pool?host=127.0.0.1&port=1&user=forge&password=s3cret&sslmode=disable"
    with pytest.raises(ConfigError) as info:
        open_pool(url)
    assert "s3cret" not in str(info.value)
    assert "cannot open postgresql:///pool?host=127.0.0.1&port=1&user=forge&password=***&" \
           "sslmode=disable: " in str(info.value)


def test_the_run_folder_keeps_no_password(tmp_path, caplog):
    """RUN_DIR/config.json (and the resume's "changed settings" log) name the pool without
    its password; a rotated password is no changed setting."""
    for password in ("s3cret", "n3w"):
        save_config(tmp_path, load_config(None, [
            f"--datapool.url=postgresql://forge:{password}@db:5432/run?password={password}"]))
    saved = (tmp_path / "config.json").read_text()
    assert "s3cret" not in saved and "n3w" not in saved and "s3cret" not in caplog.text
    assert '"url": "postgresql://forge:***@db:5432/run?password=***"' in saved


@pytest.mark.slow
def test_a_second_run_on_the_same_database_is_refused(tmp_path, pg_url):
    """One database per run: a second run folder pointed at a used database would retrain the
    first run's groups and overwrite its trained marks (it did: no check); now one line."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    first = write_config(tmp_path / "a", max_steps=1, pool_url=pg_url)
    done = subprocess.run([*FORGERL, "train", str(first)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    run_id = (tmp_path / "a" / "run" / "run_id").read_text()
    second = write_config(tmp_path / "b", max_steps=1, pool_url=pg_url)
    refused = subprocess.run([*FORGERL, "train", str(second)], capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert refused.stderr.startswith("forgerl: error: datapool.url: the database holds the pool "
                                     f"of another run (run_id {run_id}, "), refused.stderr
    assert not list((tmp_path / "b" / "run").glob("checkpoints/*"))
    again = subprocess.run([*FORGERL, "train", str(first), "--max_steps", "2"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr  # the owner still resumes
