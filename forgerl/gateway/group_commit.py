"""Group commit: the model calls that finish together are made durable in one transaction.

Data flow: `record.record` (record.py) hands each answered call (its completions and their
process events) to `GroupCommit.record` and awaits it; the call is answered only once its rows
are committed (synchronous=FULL: one fsync). Calls that arrive while a commit is running wait
for the next one, which takes them all (`SQLitePool.record_calls`: one transaction, a savepoint
per call), so under load one fsync serves many calls, and the fsync runs in a worker thread
instead of blocking the event loop. A lone call still commits at once (no added wait).

`on_commit` runs on the event loop right after the call's rows are durable, even when the
awaiting request was cancelled meanwhile (a client disconnect): the session's turn tree is then
updated with what the pool holds, never one without the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from forgerl.datapool.base import DataPool
from forgerl.types import Completion


@dataclass
class _Pending:
    trajectory_id: str
    completions: list[Completion]
    events: list[list[str]]
    on_commit: Callable[[list[int]], None]
    future: asyncio.Future[list[int]]


@dataclass
class GroupCommit:
    """Batches concurrent `record` calls into one `pool.record_calls` transaction.

    commits / calls: transactions run and calls recorded (calls / commits = the batching).
    """

    pool: DataPool
    in_thread: bool = True
    """Run each commit in a worker thread: the loop serves other requests during the fsync and
    sees a client that leaves meanwhile (its turns are marked undelivered, `record.record`).
    False: on the event loop (no thread hop)."""
    commits: int = 0
    calls: int = 0
    _pending: list[_Pending] = field(default_factory=list)
    _flusher: asyncio.Task[None] | None = None

    async def record(self, trajectory_id: str, completions: list[Completion],
                     events: list[list[str]], on_commit: Callable[[list[int]], None],
                     ) -> list[int]:
        """Durably add `completions` (and per completion the kinds of its process events) to
        the running trajectory; returns their turn indices. `on_commit(turns)` runs once they
        are committed. Raises the pool's KeyError / ValueError (unknown or ended trajectory;
        nothing of this call recorded)."""
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(trajectory_id, completions, events, on_commit, future))
        if self._flusher is None:
            self._flusher = asyncio.ensure_future(self._flush())
        return await asyncio.shield(future)

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    calls = [(p.trajectory_id, p.completions, p.events) for p in batch]
                    results = (await asyncio.to_thread(self.pool.record_calls, calls)
                               if self.in_thread else self.pool.record_calls(calls))
                except Exception as e:  # the pool itself failed (closed, disk error)
                    results = [e] * len(batch)
                self.commits, self.calls = self.commits + 1, self.calls + len(batch)
                for p, result in zip(batch, results, strict=True):
                    try:
                        if isinstance(result, Exception):
                            raise result
                        p.on_commit(result)
                    except Exception as e:
                        p.future.set_exception(e)
                    else:
                        p.future.set_result(result)
        finally:
            self._flusher = None
