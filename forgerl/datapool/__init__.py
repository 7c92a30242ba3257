"""The data pool: `open_pool` picks the backend from `[datapool]` (sql.py has the shared logic)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from forgerl.config import ConfigError
from forgerl.datapool.sqlite import SQLitePool

if TYPE_CHECKING:
    from forgerl.datapool.postgres import PostgresPool


def open_pool(url_or_path: str | Path) -> SQLitePool | PostgresPool:
    """A `PostgresPool` for a "postgresql://" or "postgres://" URL, else a `SQLitePool` at the
    path. Raises ConfigError naming `datapool.url` when the server cannot be reached or refuses
    the connection (one line: no password, no traceback)."""
    text = str(url_or_path)
    if not text.startswith(("postgresql://", "postgres://")):
        return SQLitePool(url_or_path)
    # lazy: psycopg only for a PostgreSQL pool
    import psycopg

    from forgerl.datapool.postgres import PostgresPool, user_error  # lazy: with psycopg
    try:
        return PostgresPool(text)
    except psycopg.Error as e:
        raise user_error(ConfigError, "cannot open", text, e) from None
