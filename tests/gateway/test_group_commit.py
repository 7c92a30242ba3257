"""Group commit of the gateway's pool writes (`forgerl/gateway/group_commit.py`).

Calls that finish together share one transaction (one fsync) and each is answered only once
its rows are durable; one call on an ended trajectory is refused without losing the others;
a request cancelled while its commit runs still gets its turn into the session tree.
"""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from forgerl.datapool.sqlite import SQLitePool
from forgerl.gateway.group_commit import GroupCommit
from forgerl.types import Completion, Event


def _completion(k: int) -> Completion:
    return Completion([1, 2, k], [k, 9], [-0.1, -0.2], [0, 0], 0, "stop")


def test_record_calls_is_one_transaction_with_a_savepoint_per_call(tmp_path):
    pool = SQLitePool(tmp_path / "pool.sqlite")
    a, b, c = (pool.create_trajectory(0, i) for i in range(3))
    pool.finish_trajectory(b, "failed", error="gone")
    out = pool.record_calls([(a, [_completion(1), _completion(2)], [["invalid_tool_call"], []]),
                             (b, [_completion(3)], [[]]),
                             (c, [_completion(4)], [["undeclared_tool", "invalid_tool_call"]])])
    assert out[0] == [0, 1] and out[2] == [0]
    assert isinstance(out[1], ValueError) and "not running" in str(out[1])
    assert [x.completion_ids for x in pool.get_trajectory(a).completions] == [[1, 9], [2, 9]]
    assert pool.get_trajectory(b).completions == []
    assert pool.get_trajectory(a).events == [Event(0, "invalid_tool_call")]
    assert pool.get_trajectory(c).events == [Event(0, "undeclared_tool"),
                                             Event(0, "invalid_tool_call")]
    pool.close()


def test_a_value_no_column_holds_fails_its_call_alone(tmp_path):
    """A token id over int32 (OverflowError) or a finish_reason None (NOT NULL) in a call of
    the batch: that call gets the error and nothing of it is recorded; the others are."""
    pool = SQLitePool(tmp_path / "pool.sqlite")
    a, b, c = (pool.create_trajectory(0, i) for i in range(3))
    bad = Completion([1, 2], [2**31, 9], [-0.1, -0.2], [0, 0], 0, "stop")
    null = Completion([1, 2], [3, 9], [-0.1, -0.2], [0, 0], 0, None)  # NOT NULL column
    out = pool.record_calls([(a, [_completion(1)], [[]]), (b, [_completion(2), bad], [[], []]),
                             (c, [_completion(3)], [[]]), (c, [null], [[]])])
    assert out[0] == [0] and out[2] == [0] and isinstance(out[1], OverflowError)
    assert isinstance(out[3], sqlite3.IntegrityError)
    assert [len(pool.get_trajectory(t).completions) for t in (a, b, c)] == [1, 0, 1]
    pool.close()


def test_concurrent_calls_share_a_commit_and_a_refused_one_loses_nothing(tmp_path):
    pool = SQLitePool(tmp_path / "pool.sqlite")
    tids = [pool.create_trajectory(0, i) for i in range(20)]
    pool.finish_trajectory(tids[7], "failed", error="expired")
    committed: list[str] = []

    async def run() -> list[list[int] | BaseException]:
        commits = GroupCommit(pool)
        out = await asyncio.gather(*[
            commits.record(t, [_completion(i)], [[]], lambda turns, t=t: committed.append(t))
            for i, t in enumerate(tids)], return_exceptions=True)
        assert (commits.commits, commits.calls) == (1, 20)  # all twenty in one transaction
        return out

    out = asyncio.run(run())
    assert isinstance(out[7], ValueError)
    assert [o for i, o in enumerate(out) if i != 7] == [[0]] * 19
    assert sorted(committed) == sorted(t for i, t in enumerate(tids) if i != 7)
    assert all(len(pool.get_trajectory(t).completions) == (i != 7) for i, t in enumerate(tids))
    pool.close()


def test_a_cancelled_request_still_records_its_turn(tmp_path):
    pool = SQLitePool(tmp_path / "pool.sqlite")
    tid = pool.create_trajectory(0, 0)
    committed: list[list[int]] = []

    async def run() -> None:
        commits = GroupCommit(pool)
        task = asyncio.ensure_future(commits.record(tid, [_completion(5)], [[]],
                                                    committed.append))
        await asyncio.sleep(0)  # the flusher has taken the call
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while commits._flusher is not None:
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert committed == [[0]]  # the session tree learns of the row the pool holds
    assert len(pool.get_trajectory(tid).completions) == 1
    pool.close()
