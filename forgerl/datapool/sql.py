"""`SQLPool`: the data pool's logic, shared by its two backends (`SQLitePool`, `PostgresPool`).

Writers are the gateway (completions, from the event-loop thread) and the controller (tasks,
trajectory status, rewards, trained marks, scheduler state; possibly from worker threads); the
reader is the trainer. Every public method runs as one transaction under a lock on a single
connection, so threads never interleave inside a transaction. The SQL is written once, with `?`
placeholders, in the subset both SQLite and PostgreSQL accept; a backend gives the connection,
the BEGIN statement, its column listing, its integrity errors, and the row locks other
processes' writers need (`_LOCK`, `_serialize`, `_lock_trajectories`: no-ops for SQLite, whose
BEGIN IMMEDIATE already serializes every writer).

Storage: token ids are little-endian int32 blobs, weight versions int64 blobs and logprobs float64
blobs, so floats round-trip bit-exactly and a 4k-token turn costs 32 KiB, not ~80 KiB of JSON;
a MoE turn's routed experts are one uint8 blob (`Routes.to_blob`, NULL for a dense model).
Both backends refuse what only one can store (ValueError): a NUL character in an id, a kind, a
finish_reason, a policy or a meta key (PostgreSQL's text holds none; an error text gets it as
the four characters `\\x00`), and NaN in a float column (SQLite would store NULL).

Task lifecycle (`tasks.status`): "queued" (add_task) → "running" (first trajectory created) →
"finished" (`finish_group`: all G rollouts ended, or finalised by a timeout) → "trained"
(`mark_trained`). The methods beyond `DataPool` are listed in its docstring (base.py).
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
import uuid
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, Literal

from forgerl.types import (
    Completion,
    Event,
    Group,
    Routes,
    SamplingParams,
    Trajectory,
    TrajectoryStatus,
)

TaskStatus = Literal["queued", "running", "finished", "trained"]
_ENDED: tuple[str, ...] = ("finished", "failed", "aborted", "aborted_infra")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_index INTEGER PRIMARY KEY,
    payload TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'queued',
    trained_step INTEGER
);
CREATE TABLE IF NOT EXISTS trajectories (
    id TEXT PRIMARY KEY,
    task_index INTEGER NOT NULL,
    rollout_index INTEGER NOT NULL,
    status TEXT NOT NULL,
    reward REAL,
    turn_rewards TEXT,
    policy_rewards TEXT,
    error TEXT,
    started_at REAL NOT NULL,
    ended_at REAL NOT NULL DEFAULT 0.0,
    seq INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS trajectories_by_task ON trajectories (task_index, rollout_index, seq);
CREATE INDEX IF NOT EXISTS trajectories_by_seq ON trajectories (seq);  -- MAX(seq) in O(log n)
CREATE TABLE IF NOT EXISTS completions (
    trajectory_id TEXT NOT NULL,
    turn INTEGER NOT NULL,
    prompt_ids BLOB NOT NULL,
    completion_ids BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    weight_versions BLOB NOT NULL,
    weight_version INTEGER NOT NULL,
    finish_reason TEXT NOT NULL,
    sampling TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL NOT NULL,
    token_exact INTEGER NOT NULL,
    extends_previous INTEGER NOT NULL,
    trace INTEGER NOT NULL DEFAULT 0,
    train INTEGER NOT NULL DEFAULT 1,
    request TEXT NOT NULL DEFAULT '{}',
    routed_experts BLOB,
    policy TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (trajectory_id, turn)
);
CREATE TABLE IF NOT EXISTS events (
    trajectory_id TEXT NOT NULL,
    turn INTEGER NOT NULL,
    kind TEXT NOT NULL,
    value REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_trajectory ON events (trajectory_id, turn);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

_ADDED_COLUMNS = {
    "completions": {
        "trace": "INTEGER NOT NULL DEFAULT 0",
        "train": "INTEGER NOT NULL DEFAULT 1",
        "request": "TEXT NOT NULL DEFAULT '{}'",
        "routed_experts": "BLOB",  # `Routes.to_blob`; NULL for a dense model
        "policy": "TEXT NOT NULL DEFAULT ''",
    },
    "trajectories": {"policy_rewards": "TEXT"},
}
"""Columns, per table, newer than the first schema: a pool file written before them gets
them added (with their defaults) when it is opened, so an older run resumes."""

_TRAJECTORIES = ("SELECT id, task_index, rollout_index, status, reward, turn_rewards, error,"
                 " started_at, ended_at, policy_rewards FROM trajectories")
"""A trajectory's row as `SQLPool._trajectory` reads it (add the WHERE)."""
_INSERT_EVENT = "INSERT INTO events (trajectory_id, turn, kind, value) VALUES (?, ?, ?, ?)"
_SET_META = ("INSERT INTO meta (key, value) VALUES (?, ?)"
             " ON CONFLICT (key) DO UPDATE SET value=excluded.value")


def _pack(values: list[int] | list[float], typecode: str) -> bytes:
    """Little-endian blob of `values` ('i' int32, 'q' int64, 'd' float64)."""
    arr = array(typecode, values)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def _unpack(blob: bytes, typecode: str) -> list[Any]:
    arr = array(typecode)
    arr.frombytes(blob)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist()


def _text(value: str, what: str) -> str:
    """`value` unless it holds a NUL character, which PostgreSQL's text cannot store: then a
    ValueError on both backends (the same behaviour whatever the backend)."""
    if "\x00" in value:
        raise ValueError(f"{what} contains a NUL character: {value!r}")
    return value


def _real(value: float | None, what: str) -> float | None:
    """`value` unless NaN, which SQLite stores as NULL: then a ValueError on both backends."""
    if value is not None and math.isnan(value):
        raise ValueError(f"{what} is NaN")
    return value


def _sampling_json(params: SamplingParams) -> str:
    return json.dumps(asdict(params))


def _sampling_from_json(text: str) -> SamplingParams:
    raw = json.loads(text)
    raw["stop_token_ids"] = tuple(raw["stop_token_ids"])
    return SamplingParams(**raw)


class SQLPool:
    """The `DataPool` (plus the scheduler's and resume's helpers) over one DB-API connection.

    A backend subclass opens `self._conn` (an object with `execute(sql, args)` → a cursor and
    `executemany`, `?` placeholders), names itself in `self._name`, then calls `_create_schema`.
    """

    _BEGIN = "BEGIN"
    """The statement that opens a write transaction."""
    _LOCK = ""
    """Appended to the SELECT of a task row a write depends on (" FOR UPDATE")."""
    _INTEGRITY: tuple[type[Exception], ...] = ()
    """The backend's errors for a value its column cannot hold (kept out by record_calls)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._conn: Any = None
        self._name = type(self).__name__

    def _create_schema(self, schema: str) -> None:
        with self._tx() as db:
            self._serialize(db)
            for statement in schema.split(";"):
                if statement.strip():
                    db.execute(statement)
            for table, columns in _ADDED_COLUMNS.items():
                have = self._columns(db, table)
                for name, decl in columns.items():
                    if name not in have:
                        db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")

    # ---- backend hooks ------------------------------------------------------------------------

    def _columns(self, db: Any, table: str) -> set[str]:
        """The names of `table`'s columns."""
        raise NotImplementedError

    def _serialize(self, db: Any) -> None:
        """Inside a transaction: wait for every other process's `_serialize` to commit (a
        writer that reads a table-wide fact, e.g. MAX(seq) or whether an id is taken)."""

    def _lock_trajectories(self, db: Any, ids: list[str]) -> None:
        """Inside a transaction: lock these trajectories' rows in one fixed order (no deadlock
        between two processes' group commits)."""

    # ---- plumbing -----------------------------------------------------------------------------

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        """One write transaction: `_BEGIN` ... COMMIT (ROLLBACK on any exception)."""
        with self._lock:
            if self._conn is None:
                raise ValueError(f"{self._name} is closed")
            self._conn.execute(self._BEGIN)
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            if self._conn is None:
                raise ValueError(f"{self._name} is closed")
            return self._conn.execute(sql, args).fetchall()

    # ---- DataPool -----------------------------------------------------------------------------

    def add_task(self, task_index: int, payload: dict[str, Any]) -> None:
        """`DataPool.add_task`."""
        text = json.dumps(payload, sort_keys=True)
        with self._tx() as db:
            self._serialize(db)
            row = db.execute("SELECT payload FROM tasks WHERE task_index=?", (task_index,))
            old = row.fetchone()
            if old is None:
                db.execute("INSERT INTO tasks (task_index, payload) VALUES (?, ?)",
                           (task_index, text))
            elif old[0] != text:
                raise ValueError(f"task {task_index} already exists with another payload")

    def get_task(self, task_index: int) -> dict[str, Any]:
        """The payload given to add_task. Raises KeyError if unknown."""
        rows = self._read("SELECT payload FROM tasks WHERE task_index=?", (task_index,))
        if not rows:
            raise KeyError(f"unknown task {task_index}")
        return json.loads(rows[0][0])

    def create_trajectory(
        self, task_index: int, rollout_index: int, trajectory_id: str | None = None
    ) -> str:
        """`DataPool.create_trajectory`; a queued task becomes "running" (ad-hoc and eval
        sessions use negative indices, with no task)."""
        trajectory_id = _text(trajectory_id or uuid.uuid4().hex, "trajectory id")
        with self._tx() as db:
            self._serialize(db)
            if db.execute("SELECT 1 FROM trajectories WHERE id=?", (trajectory_id,)).fetchone():
                raise ValueError(f"trajectory {trajectory_id!r} already exists")
            seq = db.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM trajectories").fetchone()[0]
            db.execute(
                "INSERT INTO trajectories (id, task_index, rollout_index, status, started_at, seq)"
                " VALUES (?, ?, ?, 'running', ?, ?)",
                (trajectory_id, task_index, rollout_index, time.time(), seq),
            )
            db.execute("UPDATE tasks SET status='running' WHERE task_index=? AND status='queued'",
                       (task_index,))
        return trajectory_id

    def add_completion(self, trajectory_id: str, completion: Completion) -> int:
        """Append one completion to a running trajectory; returns its turn index (0-based).

        Raises KeyError for an unknown trajectory, ValueError if it is no longer running or the
        completion's ids, logprobs and weight versions differ in length (`Completion.check`).
        """
        with self._tx() as db:
            self._lock_trajectories(db, [trajectory_id])
            return self._insert_completion(db, trajectory_id, completion)

    def record_calls(
        self, calls: list[tuple[str, list[Completion], list[list[str]]]]
    ) -> list[list[int] | Exception]:
        """Record several model calls in ONE transaction (one fsync: group commit).

        Each call is (trajectory_id, its completions, per completion the kinds of the process
        events to add on its turn, value 1.0). A call's completions land together or not at all
        (a savepoint each); a call that fails (KeyError unknown / ValueError not running, or
        OverflowError / TypeError / IntegrityError for a value its column cannot hold, e.g. a
        token id of 2**31 or a finish_reason None) gets its exception in the result and leaves
        the others recorded. Returns, per call, the turn indices of its completions or the
        exception.
        """
        results: list[list[int] | Exception] = []
        with self._tx() as db:
            self._lock_trajectories(db, sorted({tid for tid, _, _ in calls}))
            for tid, completions, events in calls:
                db.execute("SAVEPOINT call")
                try:
                    turns = [self._insert_completion(db, tid, c) for c in completions]
                    rows = [(tid, turn, k, 1.0)
                            for turn, kinds in zip(turns, events, strict=True) for k in kinds]
                    if rows:  # a round trip less per call on a server
                        db.executemany(_INSERT_EVENT, rows)
                except (KeyError, ValueError, OverflowError, TypeError,
                        *self._INTEGRITY) as e:
                    db.execute("ROLLBACK TO call")
                    results.append(e)
                else:
                    results.append(turns)
                db.execute("RELEASE call")
        return results

    def _insert_completion(self, db: Any, trajectory_id: str,
                           c: Completion) -> int:
        c.check()  # ValueError: ids and logprobs of unequal lengths (CASES.md C01)
        turn = self._turns(db, trajectory_id)
        for what, text in (("finish_reason", c.finish_reason), ("policy", c.policy)):
            _text(text, what) if isinstance(text, str) else None  # non-str: the column refuses
        _real(c.started_at, "started_at"), _real(c.ended_at, "ended_at")
        db.execute(
            "INSERT INTO completions (trajectory_id, turn, prompt_ids, completion_ids, logprobs,"
            " weight_versions, weight_version, finish_reason, sampling, started_at, ended_at,"
            " token_exact, extends_previous, trace, train, request, routed_experts, policy)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (trajectory_id, turn, _pack(c.prompt_ids, "i"), _pack(c.completion_ids, "i"),
             _pack(c.logprobs, "d"), _pack(c.weight_versions, "q"), c.weight_version,
             c.finish_reason, _sampling_json(c.sampling), c.started_at, c.ended_at,
             int(c.token_exact), int(c.extends_previous), c.trace, int(c.train),
             json.dumps(c.request),
             None if c.routed_experts is None else c.routed_experts.to_blob(), c.policy),
        )
        return turn

    def add_event(self, trajectory_id: str, kind: str, value: float = 1.0,
                  turn: int | None = None) -> int:
        """Record a process event on a running trajectory; returns the turn it is on.

        turn: 0-based completion index; None = the latest recorded turn. Raises KeyError for
        an unknown trajectory, ValueError when it is no longer running, has no such turn (or
        no turn yet), or `value` is not finite.
        """
        if not math.isfinite(value):
            raise ValueError(f"event value must be finite, got {value}")
        _text(kind, "event kind")
        with self._tx() as db:
            self._lock_trajectories(db, [trajectory_id])
            turns = self._turns(db, trajectory_id)
            turn = turns - 1 if turn is None else turn
            if not 0 <= turn < turns:
                raise ValueError(f"trajectory {trajectory_id} has {turns} turns, no turn {turn}")
            db.execute(_INSERT_EVENT,
                       (trajectory_id, turn, kind, float(value)))
        return turn

    def finish_trajectory(
        self,
        trajectory_id: str,
        status: TrajectoryStatus,
        reward: float | None = None,
        error: str | None = None,
        turn_rewards: list[float] | None = None,
        policy_rewards: dict[str, float] | None = None,
    ) -> None:
        """`DataPool.finish_trajectory` (base.py: the contract and its errors)."""
        if status not in _ENDED:
            raise ValueError(f"final status must be one of {_ENDED}, got {status!r}")
        _real(reward, "reward")
        error = None if error is None else error.replace("\x00", "\\x00")  # text holds no NUL
        with self._tx() as db:
            self._lock_trajectories(db, [trajectory_id])
            self._turns(db, trajectory_id)  # KeyError / ValueError unless running
            db.execute(
                "UPDATE trajectories SET status=?, reward=?, error=?, turn_rewards=?, ended_at=?,"
                " policy_rewards=? WHERE id=?",
                (status, reward, error, None if turn_rewards is None else json.dumps(turn_rewards),
                 time.time(), None if policy_rewards is None else json.dumps(policy_rewards),
                 trajectory_id),
            )

    def get_trajectory(self, trajectory_id: str) -> Trajectory:
        """The trajectory with all its completions in turn order. Raises KeyError."""
        with self._lock:
            rows = [] if "\x00" in trajectory_id else self._read(
                _TRAJECTORIES + " WHERE id=?", (trajectory_id,))
            if not rows:
                raise KeyError(f"unknown trajectory {trajectory_id!r}")
            return self._trajectory(rows[0])

    def get_group(self, task_index: int) -> Group:
        """All trajectories of one task, ordered by rollout_index (then creation order).

        After `reset_in_flight`, aborted attempts stay in the group next to their re-runs (same
        rollout_index); the trainer trains only status "finished".
        """
        with self._lock:
            rows = self._read(_TRAJECTORIES + " WHERE task_index=? ORDER BY rollout_index, seq",
                              (task_index,))
            return Group(task_index, [self._trajectory(r) for r in rows])

    def mark_trained(self, task_indices: list[int], step: int) -> None:
        """`DataPool.mark_trained` (exactly-once, CASES.md C12)."""
        with self._tx() as db:
            self._mark_trained(db, task_indices, step)

    def set_meta(self, key: str, value: Any) -> None:
        """Store a JSON-serialisable value (e.g. the scheduler state) durably."""
        _text(key, "meta key")
        with self._tx() as db:
            db.execute(_SET_META, (key, json.dumps(value)))

    def claim(self, key: str, value: Any) -> Any:
        """`set_meta(key, value)` unless `key` is already set, atomically; returns the value
        stored (`value`, or the one a first claimer stored)."""
        with self._tx() as db:
            db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING",
                       (_text(key, "meta key"), json.dumps(value)))
            [(text,)] = db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchall()
        return json.loads(text)

    def get_meta(self, key: str, default: Any = None) -> Any:
        """Read a value stored with set_meta (`default` if absent)."""
        rows = [] if "\x00" in key else self._read("SELECT value FROM meta WHERE key=?", (key,))
        return json.loads(rows[0][0]) if rows else default

    def close(self) -> None:
        """Close the connection; idempotent. Later calls raise ValueError."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # ---- scheduler and resume helpers ---------------------------------------------------------

    def finish_group(self, task_index: int) -> list[str]:
        """Mark the task's group finished; abort its still-running trajectories (timeout).

        Returns the ids of the trajectories it aborted. Raises KeyError for an unknown task and
        ValueError for a trained one.
        """
        with self._tx() as db:
            status = self._task_status(db, task_index)
            if status == "trained":
                raise ValueError(f"task {task_index} is already trained")
            aborted = self._abort_running(db, task_index, "group finalised (timeout)")
            db.execute("UPDATE tasks SET status='finished' WHERE task_index=?", (task_index,))
        return aborted

    def task_indices(self, status: TaskStatus | None = None) -> list[int]:
        """Task indices in ascending order, optionally only those with `status`."""
        if status is None:
            rows = self._read("SELECT task_index FROM tasks ORDER BY task_index")
        else:
            rows = self._read("SELECT task_index FROM tasks WHERE status=? ORDER BY task_index",
                              (status,))
        return [r[0] for r in rows]

    def finished_group_task_indices(self) -> list[int]:
        """Tasks whose group is finished but not yet trained (ascending): train these on resume."""
        return self.task_indices("finished")

    def missing_rollouts(self, task_index: int, group_size: int) -> list[int]:
        """Rollout indices in 0..group_size-1 with no finished or failed trajectory yet (an
        aborted or aborted_infra attempt is run again by a redispatch pass or a resume)."""
        rows = self._read(
            "SELECT DISTINCT rollout_index FROM trajectories WHERE task_index=?"
            " AND status IN ('finished', 'failed')", (task_index,))
        done = {r[0] for r in rows}
        return [g for g in range(group_size) if g not in done]

    def reset_in_flight(self) -> list[int]:
        """Abort every running trajectory and send "running" tasks back to "queued" (resume;
        finished rollouts are kept, `missing_rollouts` re-runs the rest).

        Returns the reset task indices, ascending.
        """
        with self._tx() as db:
            tasks = [r[0] for r in db.execute(
                "SELECT task_index FROM tasks WHERE status='running' ORDER BY task_index")]
            db.execute("UPDATE trajectories SET status='aborted', error='aborted on resume',"
                       " ended_at=? WHERE status='running'", (time.time(),))
            db.execute("UPDATE tasks SET status='queued' WHERE status='running'")
        return tasks

    def commit_trained(self, task_indices: list[int], step: int, meta: dict[str, Any]) -> None:
        """`mark_trained` plus `set_meta` for every item of `meta`, in one transaction.

        Use it to save the scheduler state with the trained marks, so a crash can never leave
        one without the other. Errors as `mark_trained`.
        """
        with self._tx() as db:
            self._mark_trained(db, task_indices, step)
            for key, value in meta.items():
                db.execute(_SET_META, (_text(key, "meta key"), json.dumps(value)))

    def untrain(self, task_indices: list[int]) -> None:
        """Send trained tasks back to "finished" (trained_step cleared); others are unchanged.

        For a resume from a checkpoint older than the pool: groups consumed after that
        checkpoint never reached the restored weights, so they are trained again (not lost,
        not twice).
        """
        with self._tx() as db:
            db.executemany("UPDATE tasks SET status='finished', trained_step=NULL"
                           " WHERE task_index=? AND status='trained'",
                           [(i,) for i in task_indices])

    def discard(self, trajectory_ids: list[str], error: str) -> None:
        """Mark ended (finished or failed) trajectories "aborted" with `error`, so that
        `missing_rollouts` runs them again, and send their finished, untrained tasks back to
        "queued". For rollouts sampled from weights that a crash lost (newer than the restored
        checkpoint). Unknown or running ids are ignored."""
        with self._tx() as db:
            for tid in (t for t in trajectory_ids if "\x00" not in t):  # never stored
                row = db.execute("SELECT task_index FROM trajectories WHERE id=? AND status IN"
                                 " ('finished', 'failed')", (tid,)).fetchone()
                if row is None:
                    continue
                db.execute("UPDATE trajectories SET status='aborted', error=? WHERE id=?",
                           (error, tid))
                db.execute("UPDATE tasks SET status='queued' WHERE task_index=?"
                           " AND status='finished'", (row[0],))

    def stats(self) -> dict[str, int]:
        """Counts: `tasks_<status>`, `trajectories_<status>` (every status, 0 if none), and
        `completions`, `completion_tokens`."""
        with self._lock:
            out = {f"tasks_{s}": 0 for s in ("queued", "running", "finished", "trained")}
            out |= {f"trajectories_{s}": 0 for s in ("running", *_ENDED)}
            for status, n in self._read("SELECT status, COUNT(*) FROM tasks GROUP BY status"):
                out[f"tasks_{status}"] = n
            for status, n in self._read(
                    "SELECT status, COUNT(*) FROM trajectories GROUP BY status"):
                out[f"trajectories_{status}"] = n
            n, nbytes = self._read(
                "SELECT COUNT(*), CAST(COALESCE(SUM(LENGTH(completion_ids)), 0) AS BIGINT)"
                " FROM completions")[0]
            out["completions"] = n
            out["completion_tokens"] = nbytes // 4
            return out

    # ---- internals ----------------------------------------------------------------------------

    @staticmethod
    def _turns(db: Any, trajectory_id: str) -> int:
        """How many turns the running trajectory has. Its row must be locked first
        (`_lock_trajectories`): this statement's snapshot then holds every committed turn."""
        if "\x00" in trajectory_id:  # never stored (`_text`); PostgreSQL cannot even compare it
            raise KeyError(f"unknown trajectory {trajectory_id!r}")
        row = db.execute("SELECT status, (SELECT COUNT(*) FROM completions WHERE trajectory_id=?)"
                         " FROM trajectories WHERE id=?", (trajectory_id, trajectory_id)).fetchone()
        if row is None:
            raise KeyError(f"unknown trajectory {trajectory_id!r}")
        if row[0] != "running":
            raise ValueError(f"trajectory {trajectory_id!r} is {row[0]}, not running")
        return row[1]

    def _task_status(self, db: Any, task_index: int) -> str:
        row = db.execute("SELECT status FROM tasks WHERE task_index=?" + self._LOCK,
                         (task_index,)).fetchone()
        if row is None:
            raise KeyError(f"unknown task {task_index}")
        return row[0]

    @staticmethod
    def _abort_running(db: Any, task_index: int, error: str) -> list[str]:
        ids = [r[0] for r in db.execute(
            "SELECT id FROM trajectories WHERE task_index=? AND status='running' ORDER BY seq",
            (task_index,))]
        db.execute("UPDATE trajectories SET status='aborted', error=?, ended_at=?"
                   " WHERE task_index=? AND status='running'", (error, time.time(), task_index))
        return ids

    def _mark_trained(self, db: Any, task_indices: list[int], step: int) -> None:
        if len(set(task_indices)) != len(task_indices):
            raise ValueError(f"duplicate task indices in {task_indices}")
        for i in task_indices:
            if self._task_status(db, i) == "trained":
                raise ValueError(f"task {i} was already trained")
        db.executemany("UPDATE tasks SET status='trained', trained_step=? WHERE task_index=?",
                       [(step, i) for i in task_indices])

    def _trajectory(self, row: tuple[Any, ...]) -> Trajectory:
        tid, task_index, rollout_index, status, reward, turn_rewards, error, start, end, pr = row
        rows = self._read(
            "SELECT prompt_ids, completion_ids, logprobs, weight_versions, weight_version,"
            " finish_reason, sampling, started_at, ended_at, token_exact, extends_previous,"
            " trace, train, request, routed_experts, policy FROM completions WHERE trajectory_id=?"
            " ORDER BY turn", (tid,))
        completions = [
            Completion(
                prompt_ids=_unpack(r[0], "i"), completion_ids=_unpack(r[1], "i"),
                logprobs=_unpack(r[2], "d"), weight_versions=_unpack(r[3], "q"),
                weight_version=r[4], finish_reason=r[5], sampling=_sampling_from_json(r[6]),
                started_at=r[7], ended_at=r[8], token_exact=bool(r[9]),
                extends_previous=bool(r[10]), trace=r[11], train=bool(r[12]),
                request=json.loads(r[13]),
                routed_experts=None if r[14] is None else Routes.from_blob(r[14]), policy=r[15],
            )
            for r in rows
        ]
        events = [Event(*r) for r in self._read(
            "SELECT turn, kind, value FROM events WHERE trajectory_id=? ORDER BY rowid", (tid,))]
        return Trajectory(
            id=tid, task_index=task_index, rollout_index=rollout_index, completions=completions,
            reward=reward, turn_rewards=None if turn_rewards is None else json.loads(turn_rewards),
            status=status, error=error, started_at=start, ended_at=end, events=events,
            policy_rewards=None if pr is None else json.loads(pr),
        )
