"""`open_pool` and `[datapool] url`: the backend follows the location; a bad URL or an
unreachable server is a one-line error naming `datapool.url` (no password, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from forgerl.config import ConfigError, load_config
from forgerl.datapool import open_pool
from forgerl.datapool.postgres import PostgresPool
from forgerl.datapool.sqlite import SQLitePool

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
