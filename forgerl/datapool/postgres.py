"""`PostgresPool`: the `DataPool` in a PostgreSQL database (`[datapool] url`), for several
processes (gateway processes, the controller, the online service) writing one pool at once.

The logic and SQL are `SQLPool`'s (sql.py), run through psycopg 3 with SQLite's column types
mapped to PostgreSQL's (INTEGER → BIGINT, REAL → DOUBLE PRECISION, BLOB → BYTEA): the same
packed blobs, so logprobs round-trip bit-exactly, and the same errors. Where SQLite serializes
every writer with its one write lock, PostgreSQL runs them at once (READ COMMITTED), so a write
locks what it reads: a completion or event locks its trajectory's row (`SELECT ... FOR UPDATE`,
so turn indices stay dense under concurrent writers), a group commit locks all its trajectories
in id order first (no deadlock between two group commits), a trained mark or group finish
locks the task's row (exactly once), and the writers that read a table-wide fact (a new
trajectory's seq and id, a new task, the schema) take one transaction-level advisory lock.

Durability: a COMMIT returns once the server has flushed its WAL (synchronous_commit=on, the
server's default; the test server runs with fsync on).
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from typing import Any

import psycopg

from forgerl.datapool.base import PoolLost, redacted
from forgerl.datapool.sql import _SCHEMA, SQLPool

_ADVISORY_KEY = 0x466F726765  # "Forge": the pool's writers that read table-wide facts

_PG_TYPES = {"INTEGER": "BIGINT", "REAL": "DOUBLE PRECISION", "BLOB": "BYTEA"}
_PG_SCHEMA = re.sub(r"\b(INTEGER|REAL|BLOB)\b", lambda m: _PG_TYPES[m[1]], _SCHEMA).replace(
    "CREATE TABLE IF NOT EXISTS events (",
    "CREATE TABLE IF NOT EXISTS events (\n    rowid BIGINT GENERATED ALWAYS AS IDENTITY,")
"""SQLite's schema in PostgreSQL types; events get the insertion order SQLite's rowid gives."""


@functools.lru_cache(maxsize=256)
def _pg(sql: str) -> str:
    """`?` placeholders → psycopg's `%s` (the pool's SQL has no other `?` or `%`)."""
    return sql.replace("?", "%s")


class _Connection:
    """A psycopg connection (autocommit: the pool issues BEGIN/COMMIT) with sqlite3's call
    shape: `execute(sql, args)` → a cursor, `executemany`, `?` placeholders."""

    def __init__(self, conn: psycopg.Connection, url: str) -> None:
        self.conn, self.url = conn, url

    def execute(self, sql: str, args: Any = ()) -> psycopg.Cursor:
        _int64(args)
        with self._lost():
            return self.conn.execute(_pg(sql), args)

    def executemany(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        for row in rows:
            _int64(row)
        with self._lost(), self.conn.cursor() as cur:
            cur.executemany(_pg(sql), rows)

    @contextlib.contextmanager
    def _lost(self) -> Iterator[None]:
        """A lost connection (the server stopped or is unreachable) → `PoolLost`, one line."""
        try:
            yield
        except psycopg.OperationalError as e:
            if not (self.conn.closed or self.conn.broken):
                raise
            raise user_error(PoolLost, "lost the connection to", self.url, e,
                             "; re-run to resume once the server is back") from None

    def close(self) -> None:
        self.conn.close()


class PostgresPool(SQLPool):
    """Durable data pool in a PostgreSQL database; see the module docstring.

    Thread-safe like `SQLitePool`: one connection guarded by the pool's RLock, each public method
    one transaction. Several processes may open the same database.

    Args:
        url: a libpq connection URL, e.g. "postgresql://user@host:5432/db". The tables are
            created if missing. Raises `psycopg.OperationalError` when the server cannot be
            reached or refuses the connection.
    """

    _INTEGRITY = (psycopg.IntegrityError, psycopg.DataError)
    _LOCK = " FOR UPDATE"

    def __init__(self, url: str, connect_timeout_s: float = 10.0) -> None:
        super().__init__()
        self.url = url
        self._name = f"PostgresPool({redacted(url)})"
        self._conn = _Connection(psycopg.connect(
            url, autocommit=True, connect_timeout=max(1, round(connect_timeout_s))), url)
        self._create_schema(_PG_SCHEMA)

    def _columns(self, db: Any, table: str) -> set[str]:
        return {r[0] for r in db.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name=?"
            " AND table_schema=current_schema()", (table,))}

    def _serialize(self, db: Any) -> None:
        db.execute("SELECT pg_advisory_xact_lock(?)", (_ADVISORY_KEY,))

    def _lock_trajectories(self, db: Any, ids: list[str]) -> None:
        ids = [i for i in ids if "\x00" not in i]  # never stored; `_turns` says unknown
        db.execute("SELECT 1 FROM trajectories WHERE id = ANY(?) ORDER BY id FOR UPDATE", (ids,))


def user_error(kind: type[Exception], what: str, url: str, e: Exception,
               then: str = "") -> Exception:
    """`kind` with one line: "datapool.url: <what> <url, no password>: <e's text><then>"."""
    reason = " ".join(str(e).split()) or type(e).__name__
    return kind(f"datapool.url: {what} {redacted(url)}: {reason}{then}")


def _int64(args: Any) -> None:
    """OverflowError, as sqlite3 raises, for an int no 64-bit column holds (psycopg would send
    it as NUMERIC: "bigint out of range" on a write, a silent miss on a lookup)."""
    for a in args:
        if type(a) is int and not -2**63 <= a < 2**63:
            raise OverflowError(f"Python int too large for a 64-bit column: {a}")
