"""`SQLitePool`: the default, durable `DataPool` backend (one SQLite file in WAL mode).

The pool's logic is `SQLPool` (sql.py); this file opens the connection. Other processes may
open the same file: BEGIN IMMEDIATE takes SQLite's single write lock up front (waiting up to
`busy_timeout_s`), so writers of every process are serialized and row locks are not needed.

Durability: `journal_mode=WAL` with `synchronous=FULL`. Under WAL, NORMAL already survives a
SIGKILL of the process (the WAL is in the OS page cache), but a power loss or kernel crash can roll
back the last commits; FULL fsyncs the WAL on every commit, so "committed before the call returns"
(the `DataPool` contract) also holds across power loss. Rollouts cost seconds of engine time each,
an fsync costs about a millisecond, so FULL is cheap here.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from forgerl.datapool.sql import _SCHEMA, SQLPool


class SQLitePool(SQLPool):
    """Durable data pool in one SQLite file (WAL, synchronous=FULL); see the module docstring.

    Thread-safe: one connection (`check_same_thread=False`) guarded by the pool's RLock.

    Args:
        path: the database file; created (with its parent folder) if missing.
        busy_timeout_s: how long a write waits for another process's lock before
            `sqlite3.OperationalError` ("database is locked").
    """

    _BEGIN = "BEGIN IMMEDIATE"
    _INTEGRITY = (sqlite3.IntegrityError,)

    def __init__(self, path: str | Path, busy_timeout_s: float = 30.0) -> None:
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._name = f"SQLitePool({self.path})"
        # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                     timeout=busy_timeout_s)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._create_schema(_SCHEMA)

    def _columns(self, db: Any, table: str) -> set[str]:
        return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
